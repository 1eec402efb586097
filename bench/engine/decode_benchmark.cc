// Decode speed on the cpu: tokens/s at batch 1 and the throughput of a batch
// of 8, for a generated ~1 GB float32 model and a ~500 MB bfloat16 one (also
// quantized on loading: LLM.int8, NF4, NF4 with double quant), next
// to the memory-bandwidth bound measured in the same run: decode at batch 1
// reads every weight once per token, so tokens/s cannot beat (read
// bandwidth) / (weight bytes per token).
//
//   build/bin/accel-bench-decode [--tokens 32] [--batch 8] [--rounds 3] [--dir /tmp/x]
//       [--malloc reuse|default]   (default: glibc's malloc as it comes, not
//                                   core/malloc_tuning.h's settings)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/module.h>

#include "core/bytes.h"
#include "core/dtype.h"
#include "core/malloc_tuning.h"
#include "core/threads.h"
#include "engine/engine_core.h"
#include "engine/model_runner.h"
#include "models/load_model.h"
#include "models/make_model.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(const std::function<void()>& fn) {
  const auto start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Best(int repeats, const std::function<void()>& fn) {
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) best = std::min(best, Seconds(fn));
  return best;
}

struct Bandwidth {
  double copy;  // bytes copied per second (memcpy, one thread)
  double read;  // bytes read per second (every word summed, on `threads` threads)
};

// Sums every 8-byte word, split over threads as the GEMV kernels split
// their columns: the plain read that decode at batch 1 is bound by.
uint64_t ReadAll(const uint64_t* words, int64_t count, int threads) {
  std::vector<uint64_t> sums(static_cast<size_t>(threads), 0);
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  const int64_t per = count / threads;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const uint64_t* p = words + t * per;
      const int64_t n = t == threads - 1 ? count - t * per : per;
      uint64_t a = 0, b = 0, c = 0, d = 0;
      for (int64_t i = 0; i + 4 <= n; i += 4) {
        a += p[i];
        b += p[i + 1];
        c += p[i + 2];
        d += p[i + 3];
      }
      sums[static_cast<size_t>(t)] = a + b + c + d;
    });
  }
  for (std::thread& t : pool) t.join();
  uint64_t total = 0;
  for (uint64_t v : sums) total += v;
  return total;
}

Bandwidth MeasureBandwidth(int64_t bytes, int threads) {
  std::vector<uint64_t> a(static_cast<size_t>(bytes / 8), 1), b(a.size());
  Bandwidth out{};
  out.copy = static_cast<double>(bytes) / Best(3, [&] { std::memcpy(b.data(), a.data(), bytes); });
  volatile uint64_t sink = 0;
  out.read =
      static_cast<double>(bytes) / Best(3, [&] { sink = ReadAll(a.data(), bytes / 8, threads); });
  (void)sink;
  return out;
}

struct Result {
  double batch1_tokens_per_s;
  double batch_tokens_per_s;
};

// Decode steps only: the first step (prefill) is excluded.
double DecodeRate(accel::models::LoadedModel& m, int batch, int64_t tokens) {
  auto runner = accel::engine::ModelRunner::Create(m.model, m.dispatched.get());
  if (!runner.ok()) std::abort();
  accel::engine::EngineCore generator(*std::move(runner), nullptr);
  for (int i = 0; i < batch; ++i) {
    accel::engine::GenerationRequest r;
    for (int t = 0; t < 8; ++t) r.prompt_ids.push_back(1 + (i * 8 + t) % 1000);
    r.sampling.temperature = 0;
    r.max_new_tokens = tokens;  // no stop tokens: exactly this many
    if (!generator.Add(r).ok()) std::abort();
  }
  if (!generator.Step().ok()) std::abort();  // prefill
  int64_t produced = 0;
  const double seconds = Seconds([&] {
    while (generator.num_requests() > 0) {
      auto events = generator.Step();
      if (!events.ok()) {
        std::fprintf(stderr, "%s\n", events.status().ToString().c_str());
        std::abort();
      }
      produced += static_cast<int64_t>(events->size());
    }
  });
  return static_cast<double>(produced) / seconds;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 32;
  int batch = 8;
  int rounds = 3;
  bool tune_malloc = true;  // --malloc default: glibc's own settings, for comparison
  std::string root;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: accel-bench-decode [--tokens N] [--batch B] [--rounds R] [--dir DIR] "
                   "[--malloc reuse|default]\n");
      return 2;
    }
    if (flag == "--tokens")
      tokens = std::atoll(argv[i + 1]);
    else if (flag == "--batch")
      batch = std::atoi(argv[i + 1]);
    else if (flag == "--dir")
      root = argv[i + 1];
    else if (flag == "--malloc" &&
             (std::string(argv[i + 1]) == "reuse" || std::string(argv[i + 1]) == "default"))
      tune_malloc = std::string(argv[i + 1]) == "reuse";
    else if (flag == "--rounds")
      rounds = std::max(1, std::atoi(argv[i + 1]));
    else {
      std::fprintf(stderr,
                   "usage: accel-bench-decode [--tokens N] [--batch B] [--rounds R] [--dir DIR] "
                   "[--malloc reuse|default]\n");
      return 2;
    }
  }
  const bool own_root = root.empty();
  if (own_root) {
    root = (std::filesystem::temp_directory_path() / "accel-bench-decode").string();
  }
  std::filesystem::create_directories(root);

  // As the tools run (core/tool_main.cc): freed tensor memory kept for reuse.
  const bool malloc_tuned = tune_malloc && accel::KeepFreedMemoryForReuse();
  const int threads = accel::SetIntraOpThreads(0);
  const Bandwidth bw = MeasureBandwidth(int64_t{1} << 30, threads);
  std::printf(
      "memory bandwidth (1 GiB, best of 3): memcpy %.1f GB/s, read (sum every word, %d threads) "
      "%.1f GB/s; malloc %s\n",
      bw.copy / 1e9, threads, bw.read / 1e9,
      malloc_tuned ? "keeps freed memory for reuse" : "glibc's settings");

  struct Case {
    const char* name;
    c10::ScalarType dtype;
    int64_t bytes;
    const char* quantize;
    bool double_quant;
  };
  const c10::ScalarType f32 = c10::ScalarType::Float, bf16 = c10::ScalarType::BFloat16;
  const std::vector<Case> cases = {Case{"float32", f32, int64_t{1} << 30, "none", false},
                                   Case{"bfloat16", bf16, 500'000'000, "none", false},
                                   Case{"bfloat16 -> int8", bf16, 500'000'000, "int8", false},
                                   Case{"bfloat16 -> nf4", bf16, 500'000'000, "nf4", false},
                                   Case{"bfloat16 -> nf4+dq", bf16, 500'000'000, "nf4", true}};
  struct Loaded {
    accel::models::LoadedModel model;
    double held = 0, per_token = 0;
    std::vector<double> one, many;  // tokens/s per round
  };
  std::vector<Loaded> models;
  for (const Case& c : cases) {
    accel::models::MakeModelOptions o;
    o.family = "llama";
    o.vocab_size = 32000;
    o.hidden_size = 1024;
    // A multiple of 256, as Llama's multiple_of makes its MLPs (11008 = 43 x
    // 256): 4-bit rows of a multiple of 64 take the AVX2 nibble kernels. The
    // generator's default (2736, 8/3 x hidden rounded to 8) would leave the
    // down projection to the float-permute ones.
    o.intermediate_size = 2816;
    o.num_heads = 16;
    o.num_kv_heads = 4;
    o.dtype = c.dtype;
    o.target_bytes = c.bytes;
    const std::string dir = root + "/" + std::string(accel::DTypeName(c.dtype));
    if (!std::filesystem::exists(dir + "/config.json")) {
      auto made = accel::models::MakeModel(dir, o);
      if (!made.ok()) {
        std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
        return 1;
      }
    }
    accel::models::ModelLoadOptions options;
    options.device_map = "cpu";
    options.quantize = c.quantize;
    options.double_quant = c.double_quant;
    options.progress = accel::Progress::Style::kSilent;
    auto loaded = accel::models::LoadModel(dir, options);
    if (!loaded.ok()) {
      std::fprintf(stderr, "%s\n", loaded.status().ToString().c_str());
      return 1;
    }
    Loaded l;
    l.model = *std::move(loaded);
    // Every tensor is read once per step except the embedding, of which
    // one row per token is; quantized layers as stored.
    for (const auto& t : l.model.model->named_parameters()) {
      l.held += static_cast<double>(t.value().nbytes());
      if (t.key() != "model.embed_tokens.weight")
        l.per_token += static_cast<double>(t.value().nbytes());
    }
    for (const auto& t : l.model.model->named_buffers()) {
      l.held += static_cast<double>(t.value().nbytes());
      l.per_token += static_cast<double>(t.value().nbytes());
    }
    models.push_back(std::move(l));
  }
  // Rounds alternate the models, so a noisy spell (other processes on a
  // shared machine) lands on all of them; the median is reported.
  for (int round = 0; round < rounds; ++round) {
    for (Loaded& l : models) {
      l.one.push_back(DecodeRate(l.model, 1, tokens));
      l.many.push_back(DecodeRate(l.model, batch, tokens));
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  // The ratio to bfloat16 is the median of each round's ratio: bfloat16 ran
  // right before or after in the same round, so a slow spell of the machine
  // that spans a round cancels out.
  auto median_ratio = [&](const std::vector<double>& v, const std::vector<double>& base) {
    std::vector<double> ratios;
    for (size_t r = 0; r < v.size(); ++r) ratios.push_back(v[r] / base[r]);
    return median(ratios);
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Loaded& l = models[i];
    const double one = median(l.one), many = median(l.many);
    const double one_ratio = median_ratio(l.one, models[1].one);
    const double many_ratio = median_ratio(l.many, models[1].many);
    const double bound_read = bw.read / l.per_token, bound_copy = bw.copy / l.per_token;
    std::printf(
        "%s model, %d layers, %s held (%s read per token), median of %d rounds (x bfloat16: "
        "the median of the rounds' ratios):\n"
        "  batch 1: %.2f tokens/s (%.2f-%.2f) = %.2fx bfloat16, %.0f%% of the read-bandwidth "
        "bound %.2f tokens/s (memcpy bound %.2f); %.1f GB/s of weights\n"
        "  batch %d: %.2f tokens/s in all (%.2f-%.2f) = %.2fx bfloat16, %.2fx batch 1\n",
        cases[i].name, static_cast<int>(l.model.config.num_hidden_layers),
        accel::FormatBytes(static_cast<int64_t>(l.held)).c_str(),
        accel::FormatBytes(static_cast<int64_t>(l.per_token)).c_str(), rounds, one,
        *std::min_element(l.one.begin(), l.one.end()),
        *std::max_element(l.one.begin(), l.one.end()), one_ratio, 100 * one / bound_read,
        bound_read, bound_copy, one * l.per_token / 1e9, batch, many,
        *std::min_element(l.many.begin(), l.many.end()),
        *std::max_element(l.many.begin(), l.many.end()), many_ratio, many / one);
    std::fflush(stdout);
  }
  if (own_root) std::filesystem::remove_all(root);
  return 0;
}
