// accel-bench-decode-gpu: decode and time to first token on a CUDA device,
// against the device's own copy rate measured in the same run.
//
// The model is a checkpoint accel-make-model wrote (scripts/gpu_check.sh
// makes an 8B-shaped Llama: Llama-3-8B's hidden 4096, MLP 14336, 32 layers,
// 32 heads over 8 kv heads, vocabulary 128256, bfloat16, random weights),
// loaded whole onto GPU 0 with LoadModel, as stored and again quantized on
// loading (--quantize none,nf4). For each: the engine core's decode steps at
// each --batches size (greedy, 16-token prompts, the prefill step excluded;
// the paged KV cache and its CUDA decode kernels), and the time to first
// token of a --prompt-token prompt (one request; the prefill and the first
// token's sampling, prefix caching off, median of --rounds).
//
// Decode at batch 1 reads every weight once per token (all but the
// embedding, of which one row is read), so weight bytes x tokens/s is the
// memory bandwidth it uses; the baseline is a 1 GiB device-to-device copy,
// whose traffic (read + write) is what the device's memory sustains: "of
// copy traffic" is the share of it decode reaches. At batch b a step reads
// the weights once for b tokens.
//
//   build/bin/accel-bench-decode-gpu --model DIR [--quantize none,nf4]
//       [--batches 1,8,32,128] [--tokens 64] [--prompt 2048] [--rounds 3] [--json FILE]
//       [--graph_batches 1,8]   (decode with CUDA graphs against eager, and their tokens)
//       [--compare_unfused 1]   (the graphs rows again without models/cuda/fused_ops.h's kernels)
//       [--compare_decode_gemv 1]   (the graphs rows again with cuBLAS and separate norms in
//                                    place of models/cuda/decode_gemv.h's kernel)
//       [--gemv_shapes 4096x4096,6144x4096 --gemv_rows 1,4,8]   (bfloat16 N x K products at
//                                    those rows, the decode GEMV against cuBLAS, each call's
//                                    kernels timed by Kineto, before the model loads)
//       [--general_batches 8,32]   (eager steps through the general forward)
//       [--mixed_batches 32,128] [--mixed_prompt 48]   (each step the batch's decodes and a
//                                new request's prompt, as a served load's steps: the general
//                                forward, against decode-only steps in the same run)
//       [--profile_mixed 128]   (the kernels of such a step, eager)
//       [--compare_host_routing 1,4]   (a mixture's decode with its few rows routed on the
//                                device against the host reading the routing, same run)
//       [--count_syncs 32,128]   (how often the host waits for the device a step: static
//                                decode steps, general decode-only steps and mixed steps,
//                                with the call stacks of the waits; a CUDA build's engine)
//       [--profile_batches 1]   (the kernels a decode step runs, eager and from graphs, with
//                                libtorch's Kineto profiler: libtorch 2.x)
//       [--temperature 1]   (sampled decode, each request seeded: the rows drawn on the
//                            device by Sampler::NextRows; default 0, greedy)
//       [--device cpu]   (the same measurements on the cpu: a check of the harness)
// Without a CUDA device (and without --device cpu) it says so and exits with
// status 1.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/module.h>
#include <torch/version.h>
// libtorch's Kineto profiler (CUPTI) for --profile_batches: its C++ entry
// points as 2.x declares them.
#if TORCH_VERSION_MAJOR >= 2 && __has_include(<torch/csrc/autograd/profiler_kineto.h>)
#define ACCEL_BENCH_KINETO 1
#include <map>
#include <set>

#include <torch/csrc/autograd/profiler_kineto.h>
#endif

#include "core/bytes.h"
#include "core/malloc_tuning.h"
#include "engine/decode_graphs.h"
#include "engine/engine_core.h"
#include "engine/internal/cuda_sync_counter.h"
#include "engine/model_runner.h"
#include "engine/request.h"
#include "models/load_model.h"
#include "models/nn.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(const std::function<void()>& fn) {
  const auto start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<std::string> Split(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    if (comma > start) out.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

[[noreturn]] void Usage(const std::string& error) {
  std::fprintf(stderr,
               "accel-bench-decode-gpu: %s\nusage: accel-bench-decode-gpu --model DIR "
               "[--quantize none,nf4] [--batches 1,8,32,128] [--tokens N] [--prompt N] "
               "[--rounds N] [--json FILE] [--graph_batches 1,8] [--compare_unfused 0|1] "
               "[--compare_decode_gemv 0|1] [--gemv_shapes NxK,...] [--gemv_rows 1,4,8] "
               "[--general_batches 32] [--mixed_batches 32] [--mixed_prompt 48] "
               "[--profile_batches 1] [--profile_mixed 32] [--count_syncs 32] "
               "[--compare_host_routing 1,4]\n",
               error.c_str());
  std::exit(2);
}

// Bytes copied per second by a device-to-device copy of 1 GiB (median of
// rounds of 10 copies; the final .item() waits for the stream).
double DeviceCopyRate(const at::Device& device, int rounds) {
  const int64_t bytes = int64_t{1} << 30;
  const at::TensorOptions options = at::TensorOptions().dtype(at::kByte).device(device);
  at::Tensor src = at::ones({bytes}, options), dst = at::empty({bytes}, options);
  dst.copy_(src);
  (void)dst[0].item<uint8_t>();
  std::vector<double> rates;
  for (int r = 0; r < rounds; ++r) {
    const double s = Seconds([&] {
      for (int i = 0; i < 10; ++i) dst.copy_(src);
      (void)dst[0].item<uint8_t>();
    });
    rates.push_back(10.0 * static_cast<double>(bytes) / s);
  }
  return Median(rates);
}

// --temperature: 0 (greedy) unless asked; above 0 each request is seeded by
// its salt, so a rerun draws the same tokens.
double g_temperature = 0;

// The loaded model's vocabulary (main sets it), which the prompts' ids stay inside.
int64_t g_vocab = 32000;

accel::engine::GenerationRequest Request(int64_t prompt_tokens, int64_t new_tokens, int64_t salt) {
  accel::engine::GenerationRequest r;
  // Ids 1..31999 (a smaller vocabulary: 1..vocab - 1): the same prompts for
  // every model of 32000 tokens or more (Mixtral's).
  const int64_t span = std::max<int64_t>(std::min<int64_t>(g_vocab, 32000) - 1, 1);
  for (int64_t t = 0; t < prompt_tokens; ++t) {
    r.prompt_ids.push_back(1 + (salt * 7919 + t * 104729) % span);
  }
  r.sampling.temperature = g_temperature;
  if (g_temperature > 0) r.sampling.seed = static_cast<uint64_t>(salt);
  r.max_new_tokens = new_tokens;  // no stop tokens: exactly this many
  return r;
}

// Adds `request` to `core`, or says why not and aborts (a benchmark has no
// way on without it).
void AddOrDie(accel::engine::EngineCore& core, const accel::engine::GenerationRequest& request) {
  const absl::StatusOr<uint64_t> added = core.Add(request);
  if (added.ok()) return;
  std::fprintf(stderr, "accel-bench-decode-gpu: a request was refused: %s\n",
               added.status().ToString().c_str());
  std::abort();
}

// An engine core whose KV cache holds `sequences` of `tokens_each`, without
// prefix caching (each measurement computes its whole prompt). With
// `graphs`, decode steps are padded to batch buckets and (on a CUDA device)
// replayed from CUDA graphs, as accel-serve --enforce_eager=false runs them.
std::unique_ptr<accel::engine::EngineCore> CoreFor(accel::models::LoadedModel& m, int64_t sequences,
                                                   int64_t tokens_each, bool graphs = false,
                                                   bool general = false) {
  accel::engine::ModelRunnerOptions r;
  // `general`: eager decode steps through the general forward (each
  // sequence's key and value written by its own copies, the tables
  // uploaded in every layer) instead of the unpadded static step.
  if (general) {
    r.unpadded_static_decode = accel::engine::ModelRunnerOptions::UnpaddedStaticDecode::kOff;
  }
  r.block_size = 16;
  r.num_blocks = sequences * ((tokens_each + 15) / 16 + 1) + 16;
  if (graphs) {
    // A mixture's decode up to the rows it routes on the device (as
    // LlmEngine sizes its buckets); none where it routes on the host.
    const int64_t captured = m.model->MaxCapturedDecodeRows();
    if (captured != 0) {
      r.decode_buckets = accel::engine::DecodeBatchBuckets(
          sequences, captured > 0 ? captured : accel::engine::kMaxDecodeBucket);
      r.capture_decode_graphs = m.dispatched->main_device().is_cuda();
    }
  }
  auto runner = accel::engine::ModelRunner::Create(m.model, m.dispatched.get(), r);
  if (!runner.ok()) {
    std::fprintf(stderr, "%s\n", runner.status().ToString().c_str());
    std::abort();
  }
  accel::engine::EngineCoreOptions c;
  c.prefix_caching = false;
  return std::make_unique<accel::engine::EngineCore>(*std::move(runner), nullptr, c);
}

// How DecodeRate runs its steps, beyond the batch, tokens and salt.
struct DecodeRun {
  bool graphs = false;  // padded to buckets, replayed from CUDA graphs
  // Every token in the order the steps gave them, if set.
  std::vector<int64_t>* produced_ids = nullptr;
  // Decode steps after the prefill left out of the time too (with graphs,
  // the first captures the bucket's graph).
  int untimed_steps = 0;
  bool general = false;  // eager steps through the general forward (CoreFor)
  // Called with true before the timed steps and false after them.
  std::function<void(bool)> around_timed;
  // > 0: before each timed step but the last a new request of this many
  // prompt tokens arrives and leaves with its first token, so every step
  // mixes the batch's decodes with a prompt, as a served load's steps do
  // (the rate then counts batch + 1 tokens a step).
  int64_t arriving = 0;
};

// Decode tokens/s over `batch` sequences (the prefill step excluded).
double DecodeRate(accel::models::LoadedModel& m, int64_t batch, int64_t tokens, int64_t salt,
                  const DecodeRun& run = {}) {
  const int untimed_steps = run.untimed_steps;
  const int64_t arriving = run.arriving;
  std::vector<int64_t>* produced_ids = run.produced_ids;
  std::unique_ptr<accel::engine::EngineCore> core =
      arriving > 0 ? CoreFor(m, batch + tokens, std::max<int64_t>(16 + tokens, arriving + 1),
                             run.graphs, run.general)
                   : CoreFor(m, batch, 16 + tokens, run.graphs, run.general);
  accel::engine::EngineCore& generator = *core;
  for (int64_t i = 0; i < batch; ++i) {
    AddOrDie(generator, Request(16, tokens, salt + i));
  }
  if (!generator.Step().ok()) std::abort();  // prefill
  for (int i = 0; i < untimed_steps; ++i) {
    auto events = generator.Step();
    if (!events.ok()) {
      std::fprintf(stderr, "%s\n", events.status().ToString().c_str());
      std::abort();
    }
    if (produced_ids != nullptr) {
      for (const accel::engine::TokenEvent& e : *events) produced_ids->push_back(e.token_id);
    }
  }
  int64_t produced = 0;
  if (run.around_timed) run.around_timed(true);
  const double seconds = Seconds([&] {
    for (int64_t step = 0; generator.num_requests() > 0; ++step) {
      // The batch's last decode step (tokens - 1 in all, untimed ones and
      // the prefill's first token counted) runs without an arrival.
      if (arriving > 0 && step + untimed_steps + 2 < tokens) {
        AddOrDie(generator, Request(arriving, 1, salt + 500000 + step));
      }
      auto events = generator.Step();
      if (!events.ok()) {
        std::fprintf(stderr, "%s\n", events.status().ToString().c_str());
        std::abort();
      }
      produced += static_cast<int64_t>(events->size());
      if (produced_ids != nullptr) {
        for (const accel::engine::TokenEvent& e : *events) produced_ids->push_back(e.token_id);
      }
    }
  });
  if (run.around_timed) run.around_timed(false);
  return static_cast<double>(produced) / seconds;
}

// The CUDA kernels (and copies) a run of decode steps launched, from
// libtorch's Kineto profiler: per name, launches and device time a step,
// the `top` longest printed; the device's busy time a step against the
// step's wall time. JSON of it, or "" without the profiler (libtorch 1.x).
std::string ProfileDecode(accel::models::LoadedModel& m, int64_t batch, int64_t tokens, bool graphs,
                          int top, int64_t arriving = 0) {
#ifdef ACCEL_BENCH_KINETO
  namespace impl = torch::profiler::impl;
  namespace profiler = torch::autograd::profiler;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  const std::set<impl::ActivityType> activities = {impl::ActivityType::CUDA};
  std::unique_ptr<profiler::ProfilerResult> result;
  const auto around = [&](bool start) {
    if (start) {
      profiler::prepareProfiler(config, activities);
      profiler::enableProfiler(config, activities);
    } else {
      result = profiler::disableProfiler();
    }
  };
  const double rate = DecodeRate(m, batch, tokens, 7000, [&] {
    DecodeRun run;
    run.graphs = graphs;
    run.untimed_steps = 1;
    run.around_timed = around;
    run.arriving = arriving;
    return run;
  }());
  if (!result) return "";
  // The prefill gives the first token and the first decode step is untimed:
  // tokens - 2 steps profiled.
  const double steps = static_cast<double>(tokens - 2);
  struct Total {
    int64_t count = 0;
    double ns = 0;
  };
  std::map<std::string, Total> by_name;
  double busy_ns = 0;
  int64_t launches = 0;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA) continue;
    Total& t = by_name[e.name()];
    t.count += 1;
    t.ns += static_cast<double>(e.durationNs());
    busy_ns += static_cast<double>(e.durationNs());
    launches += 1;
  }
  std::vector<std::pair<std::string, Total>> sorted(by_name.begin(), by_name.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
  const double step_ms = 1e3 * static_cast<double>(batch + (arriving > 0 ? 1 : 0)) / rate;
  std::printf(
      "  profile, batch %ld%s, %s: %.1f kernels a step, device busy %.2f ms of a %.2f ms step\n",
      static_cast<long>(batch),
      arriving > 0 ? (" + a " + std::to_string(arriving) + "-token prompt").c_str() : "",
      graphs ? "CUDA graphs" : "eager", static_cast<double>(launches) / steps,
      busy_ns / steps / 1e6, step_ms);
  std::string json = "{\"batch\": " + std::to_string(batch) +
                     ", \"arriving_prompt\": " + std::to_string(arriving) +
                     ", \"graphs\": " + (graphs ? "true" : "false") +
                     ", \"kernels_per_step\": " + std::to_string(launches / steps) +
                     ", \"busy_ms_per_step\": " + std::to_string(busy_ns / steps / 1e6) +
                     ", \"step_ms\": " + std::to_string(step_ms) + ", \"top\": [";
  for (int i = 0; i < top && i < static_cast<int>(sorted.size()); ++i) {
    const auto& [name, t] = sorted[static_cast<size_t>(i)];
    std::string shown = name.size() > 100 ? name.substr(0, 100) + "..." : name;
    std::printf("    %7.1f a step %8.1f us a step %7.2f us each  %s\n",
                static_cast<double>(t.count) / steps, t.ns / steps / 1e3,
                t.ns / static_cast<double>(t.count) / 1e3, shown.c_str());
    for (char& c : shown) {
      if (c == '"' || c == '\\') c = '\'';
    }
    json += std::string(i == 0 ? "" : ", ") + "{\"name\": \"" + shown +
            "\", \"per_step\": " + std::to_string(static_cast<double>(t.count) / steps) +
            ", \"us_per_step\": " + std::to_string(t.ns / steps / 1e3) + "}";
  }
  std::fflush(stdout);
  return json + "]}";
#else
  (void)m;
  (void)batch;
  (void)tokens;
  (void)graphs;
  (void)top;
  (void)arriving;
  std::printf("  profile: this libtorch (1.x) has no Kineto entry points this binary uses\n");
  return "";
#endif
}

// One shape of --gemv_shapes at `rows` rows: the decode GEMV
// (models/cuda/decode_gemv.h, through nn::DenseLinear) and cuBLAS (the same
// call with it off), each call's kernels' device time from Kineto (cuBLAS's
// split-K GEMV and its reduce together), and the weight's bytes over that
// time as a share of the copy traffic. JSON of it; "" where Kineto is not
// in this libtorch.
std::string GemvShape(const at::Device& device, int64_t n, int64_t k, int64_t rows,
                      double copy_traffic) {
#ifdef ACCEL_BENCH_KINETO
  namespace impl = torch::profiler::impl;
  namespace profiler = torch::autograd::profiler;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  const std::set<impl::ActivityType> activities = {impl::ActivityType::CUDA};
  const at::TensorOptions options = at::TensorOptions().dtype(at::kBFloat16).device(device);
  const at::Tensor weight = at::randn({n, k}, options) * 0.02;
  const at::Tensor x = at::randn({1, rows, k}, options);
  constexpr int kCalls = 50;
  // Device microseconds a call (the decode GEMV at every row count it has,
  // whatever its default).
  accel::nn::SetCudaDecodeGemvRows(8);
  const auto time = [&](bool ours) {
    accel::nn::SetCudaDecodeGemv(ours);
    for (int i = 0; i < 3; ++i) (void)accel::nn::DenseLinear(x, weight, at::Tensor());
    (void)x[0][0][0].item<float>();
    profiler::prepareProfiler(config, activities);
    profiler::enableProfiler(config, activities);
    for (int i = 0; i < kCalls; ++i) (void)accel::nn::DenseLinear(x, weight, at::Tensor());
    (void)x[0][0][0].item<float>();
    const std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
    accel::nn::SetCudaDecodeGemv(true);
    double ns = 0;
    int64_t kernels = 0;
    for (const auto& e : result->events()) {
      if (e.deviceType() != c10::DeviceType::CUDA || e.name().find("emcpy") != std::string::npos) {
        continue;
      }
      ns += static_cast<double>(e.durationNs());
      ++kernels;
    }
    return std::make_pair(ns / kCalls / 1e3, static_cast<double>(kernels) / kCalls);
  };
  const auto [ours_us, ours_kernels] = time(true);
  const auto [cublas_us, cublas_kernels] = time(false);
  accel::nn::SetCudaDecodeGemvRows(4);
  const double bytes = static_cast<double>(n) * static_cast<double>(k) * 2.0;
  std::printf(
      "  %6ldx%-6ld rows %ld: decode GEMV %7.2f us (%.1f kernels, %.2f of copy traffic), cuBLAS "
      "%7.2f us (%.1f kernels, %.2f)\n",
      static_cast<long>(n), static_cast<long>(k), static_cast<long>(rows), ours_us, ours_kernels,
      bytes / (ours_us * 1e-6) / copy_traffic, cublas_us, cublas_kernels,
      bytes / (cublas_us * 1e-6) / copy_traffic);
  std::fflush(stdout);
  return "{\"n\": " + std::to_string(n) + ", \"k\": " + std::to_string(k) +
         ", \"rows\": " + std::to_string(rows) +
         ", \"decode_gemv_us\": " + std::to_string(ours_us) +
         ", \"cublas_us\": " + std::to_string(cublas_us) +
         ", \"decode_gemv_of_copy\": " + std::to_string(bytes / (ours_us * 1e-6) / copy_traffic) +
         ", \"cublas_of_copy\": " + std::to_string(bytes / (cublas_us * 1e-6) / copy_traffic) + "}";
#else
  (void)device;
  (void)n;
  (void)k;
  (void)rows;
  (void)copy_traffic;
  std::printf("  GEMV shapes: this libtorch (1.x) has no Kineto entry points this binary uses\n");
  return "";
#endif
}

// The host's waits for the device a step (engine/internal/cuda_sync_counter.h)
// at `batch`: static decode steps, general decode-only steps, and general
// steps with an `arriving`-token prompt each step; the call stacks of the
// waits printed where a step waits more than once. JSON of it.
std::string CountSyncs(accel::models::LoadedModel& m, int64_t batch, int64_t tokens,
                       int64_t arriving) {
  using accel::engine::internal::CudaSyncCounter;
  if (!CudaSyncCounter::Available()) {
    std::printf("  host waits: not counted (an engine built without ACCEL_WITH_ENGINE_CUDA)\n");
    return "";
  }
  std::string json;
  const char* kinds[] = {"static decode steps", "general decode-only steps",
                         "general steps with a prompt arriving"};
  for (int kind = 0; kind < 3; ++kind) {
    std::unique_ptr<CudaSyncCounter> counter;
    int64_t waits = 0;
    std::vector<std::pair<std::string, int64_t>> sites;
    const auto around = [&](bool start) {
      if (start) {
        counter = std::make_unique<CudaSyncCounter>();
        return;
      }
      waits = counter->count();
      sites = counter->Sites();
      counter.reset();
    };
    DecodeRun run;
    run.general = kind == 1;
    run.around_timed = around;
    run.arriving = kind == 2 ? arriving : 0;
    (void)DecodeRate(m, batch, tokens, 9000, run);
    // The prefill gave the first token: tokens - 1 timed steps.
    const double per_step = static_cast<double>(waits) / static_cast<double>(tokens - 1);
    std::printf("  host waits for the device, batch %ld, %s: %.2f a step (%ld in %ld steps)\n",
                static_cast<long>(batch), kinds[kind], per_step, static_cast<long>(waits),
                static_cast<long>(tokens - 1));
    if (per_step > 1.5) {
      for (size_t i = 0; i < sites.size() && i < 3; ++i) {
        std::printf("    %ld of the first waits from:\n%s\n", static_cast<long>(sites[i].second),
                    sites[i].first.c_str());
      }
    }
    std::fflush(stdout);
    json += std::string(json.empty() ? "" : ", ") + "{\"batch\": " + std::to_string(batch) +
            ", \"steps\": \"" + kinds[kind] +
            "\", \"waits_per_step\": " + std::to_string(per_step) + "}";
  }
  return json;
}

// Seconds from a request's arrival to its first token (one step).
double TimeToFirstToken(accel::models::LoadedModel& m, int64_t prompt, int64_t salt) {
  std::unique_ptr<accel::engine::EngineCore> core = CoreFor(m, 1, prompt + 1);
  accel::engine::EngineCore& generator = *core;
  return Seconds([&] {
    AddOrDie(generator, Request(prompt, 1, salt));
    auto events = generator.Step();
    if (!events.ok() || events->empty()) {
      std::fprintf(stderr, "accel-bench-decode-gpu: the prefill step gave no token\n");
      std::abort();
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, json_path;
  std::vector<std::string> quantize = {"none", "nf4"};
  std::vector<int64_t> batches = {1, 8, 32, 128};
  std::vector<int64_t> graph_batches;    // decode with CUDA graphs against eager, same run
  std::vector<int64_t> general_batches;  // eager through the general forward, same run
  std::vector<int64_t> profile_batches;  // the kernels of a step, eager and from graphs
  std::vector<int64_t> mixed_batches;    // decodes with a prompt arriving every step
  std::vector<int64_t> profile_mixed;    // the kernels of such a step, eager
  std::vector<int64_t> count_syncs;      // the host's waits for the device a step
  std::vector<int64_t> host_routing;     // MoE decode with the routing read on the host too
  std::vector<std::pair<int64_t, int64_t>> gemv_shapes;  // N x K, the decode GEMV against cuBLAS
  std::vector<int64_t> gemv_rows = {1, 4, 8};
  int64_t mixed_prompt = 48;
  int64_t tokens = 64, prompt = 2048;
  int rounds = 3;
  bool cpu = false;
  bool compare_unfused = false;      // graphs rows again without the fused kernels
  bool compare_decode_gemv = false;  // graphs rows again with cuBLAS's products
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Usage("missing value after " + flag);
    const std::string value = argv[i + 1];
    if (flag == "--model") {
      model_dir = value;
    } else if (flag == "--json") {
      json_path = value;
    } else if (flag == "--quantize") {
      quantize = Split(value);
    } else if (flag == "--batches") {
      batches.clear();
      for (const std::string& b : Split(value)) batches.push_back(std::atoll(b.c_str()));
    } else if (flag == "--tokens") {
      tokens = std::atoll(value.c_str());
    } else if (flag == "--prompt") {
      prompt = std::atoll(value.c_str());
    } else if (flag == "--device") {
      if (value != "cpu" && value != "0") Usage("--device is 0 or cpu, got " + value);
      cpu = value == "cpu";
    } else if (flag == "--graph_batches") {
      graph_batches.clear();
      for (const std::string& b : Split(value)) graph_batches.push_back(std::atoll(b.c_str()));
    } else if (flag == "--profile_batches") {
      for (const std::string& b : Split(value)) profile_batches.push_back(std::atoll(b.c_str()));
    } else if (flag == "--mixed_batches") {
      for (const std::string& b : Split(value)) mixed_batches.push_back(std::atoll(b.c_str()));
    } else if (flag == "--profile_mixed") {
      for (const std::string& b : Split(value)) profile_mixed.push_back(std::atoll(b.c_str()));
    } else if (flag == "--count_syncs") {
      for (const std::string& b : Split(value)) count_syncs.push_back(std::atoll(b.c_str()));
    } else if (flag == "--compare_host_routing") {
      for (const std::string& b : Split(value)) host_routing.push_back(std::atoll(b.c_str()));
    } else if (flag == "--mixed_prompt") {
      mixed_prompt = std::atoll(value.c_str());
    } else if (flag == "--general_batches") {
      for (const std::string& b : Split(value)) general_batches.push_back(std::atoll(b.c_str()));
    } else if (flag == "--gemv_shapes") {
      for (const std::string& s : Split(value)) {
        const size_t x = s.find('x');
        const int64_t n = x == std::string::npos ? 0 : std::atoll(s.substr(0, x).c_str());
        const int64_t k = x == std::string::npos ? 0 : std::atoll(s.substr(x + 1).c_str());
        if (n < 1 || k < 1) Usage("--gemv_shapes takes NxK,NxK..., got " + s);
        gemv_shapes.emplace_back(n, k);
      }
    } else if (flag == "--gemv_rows") {
      gemv_rows.clear();
      for (const std::string& b : Split(value)) gemv_rows.push_back(std::atoll(b.c_str()));
    } else if (flag == "--compare_decode_gemv") {
      if (value != "0" && value != "1" && value != "true" && value != "false") {
        Usage("--compare_decode_gemv is 0, 1, true or false, got " + value);
      }
      compare_decode_gemv = value == "1" || value == "true";
    } else if (flag == "--compare_unfused") {
      if (value != "0" && value != "1" && value != "true" && value != "false") {
        Usage("--compare_unfused is 0, 1, true or false, got " + value);
      }
      compare_unfused = value == "1" || value == "true";
    } else if (flag == "--rounds") {
      rounds = std::max(1, std::atoi(value.c_str()));
    } else if (flag == "--temperature") {
      g_temperature = std::atof(value.c_str());
      if (!(g_temperature >= 0)) Usage("--temperature must be >= 0, got " + value);
    } else {
      Usage("unknown flag " + flag);
    }
  }
  if (model_dir.empty()) Usage("--model is required");
  for (int64_t b : batches) {
    if (b < 1) Usage("--batches must be positive");
  }
  for (int64_t b : general_batches) {
    if (b < 1) Usage("--general_batches must be positive");
  }
  for (int64_t b : profile_batches) {
    if (b < 1) Usage("--profile_batches must be positive");
  }
  for (int64_t b : mixed_batches) {
    if (b < 1) Usage("--mixed_batches must be positive");
  }
  for (int64_t b : profile_mixed) {
    if (b < 1) Usage("--profile_mixed must be positive");
  }
  for (int64_t b : count_syncs) {
    if (b < 1) Usage("--count_syncs must be positive");
  }
  for (int64_t b : host_routing) {
    if (b < 1) Usage("--compare_host_routing must be positive");
  }
  if (mixed_prompt < 1) Usage("--mixed_prompt must be positive");
  if (tokens < 3 || prompt < 1) Usage("--tokens must be at least 3 and --prompt positive");
  if (!cpu && !at::hasCUDA()) {
    std::fprintf(stderr,
                 "accel-bench-decode-gpu: no CUDA device (or a libtorch without CUDA); this "
                 "benchmark needs a GPU\n");
    return 1;
  }
  // As accel-serve and the tools run (core/tool_main.cc): freed buffers kept
  // for reuse, not faulted in again at every step.
  accel::KeepFreedMemoryForReuse();
  c10::InferenceMode inference;
  const at::Device device = cpu ? at::Device(at::kCPU) : at::Device(at::kCUDA, 0);
  const double copy_rate = DeviceCopyRate(device, rounds);
  std::printf("%s copy of 1 GiB: %.1f GB/s copied, %.1f GB/s of traffic\n",
              cpu ? "cpu" : "device-to-device", copy_rate / 1e9, 2 * copy_rate / 1e9);
  std::fflush(stdout);
  std::string json = "{\"copy_gbs\": " + std::to_string(copy_rate / 1e9) +
                     ", \"copy_traffic_gbs\": " + std::to_string(2 * copy_rate / 1e9) +
                     ", \"tokens\": " + std::to_string(tokens) +
                     ", \"prompt\": " + std::to_string(prompt) + ", ";
  auto write_json = [&](const std::string& tail) {
    if (json_path.empty()) return;
    std::FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) return;
    std::fputs((json + tail).c_str(), f);
    std::fclose(f);
  };
  if (!gemv_shapes.empty()) {
    std::printf("\nbfloat16 products at decode's rows, device time a call:\n");
    std::string shapes;
    for (const auto& [n, k] : gemv_shapes) {
      for (int64_t rows : gemv_rows) {
        if (rows < 1) Usage("--gemv_rows must be positive");
        const std::string one = GemvShape(device, n, k, rows, 2 * copy_rate);
        if (!one.empty()) shapes += std::string(shapes.empty() ? "" : ", ") + one;
      }
    }
    json += "\"gemv_shapes\": [" + shapes + "], ";
  }
  json += "\"models\": [";
  write_json("]}\n");
  bool first_model = true;
  for (const std::string& q : quantize) {
    accel::models::ModelLoadOptions options;
    options.device_map = cpu ? "cpu" : "0";
    options.quantize = q;
    options.progress = accel::Progress::Style::kSilent;
    absl::StatusOr<accel::models::LoadedModel> loaded;
    const double load_s = Seconds([&] { loaded = accel::models::LoadModel(model_dir, options); });
    if (!loaded.ok()) {
      std::fprintf(stderr, "accel-bench-decode-gpu: %s\n", loaded.status().ToString().c_str());
      return 1;
    }
    accel::models::LoadedModel& m = *loaded;
    g_vocab = m.config.vocab_size;
    // Every tensor is read once per step except the embedding, of which one
    // row per token is, and a mixture-of-experts block's experts, of which
    // a batch-1 token reads its top-k (the figure at batch 1; larger batches
    // read more experts, so their "of copy" is a lower bound); quantized
    // layers as stored.
    const double expert_share = m.config.moe.num_experts > 0
                                    ? static_cast<double>(m.config.moe.num_experts_per_tok) /
                                          static_cast<double>(m.config.moe.num_experts)
                                    : 1.0;
    double per_step = 0;
    const auto count = [&](const std::string& name, const at::Tensor& t) {
      if (name == "model.embed_tokens.weight") return;
      const double bytes = static_cast<double>(t.nbytes());
      per_step += name.find(".experts.") != std::string::npos ? bytes * expert_share : bytes;
    };
    for (const auto& t : m.model->named_parameters()) count(t.key(), t.value());
    for (const auto& t : m.model->named_buffers()) count(t.key(), t.value());
    std::printf("\n%s: %d layers, %s read a step, loaded onto %s in %.1f s\n",
                q == "none" ? "as stored" : ("quantized " + q).c_str(),
                static_cast<int>(m.config.num_hidden_layers),
                accel::FormatBytes(static_cast<int64_t>(per_step)).c_str(),
                cpu ? "the cpu" : "GPU 0", load_s);
    std::fflush(stdout);
    (void)DecodeRate(m, 1, 4, 999);  // warm-up: kernels' first launches, the allocator
    std::string rows;
    for (int64_t batch : batches) {
      std::vector<double> rates;
      for (int r = 0; r < rounds; ++r) rates.push_back(DecodeRate(m, batch, tokens, 1000 * r));
      const double rate = Median(rates);
      const double steps = rate / static_cast<double>(batch);
      const double used = per_step * steps;
      std::printf(
          "  batch %3ld: %8.1f tokens/s (%.2f ms a step), weights at %.0f GB/s = %.2f of copy "
          "traffic\n",
          static_cast<long>(batch), rate, 1e3 / steps, used / 1e9, used / (2 * copy_rate));
      std::fflush(stdout);
      rows += std::string(rows.empty() ? "" : ", ") + "{\"batch\": " + std::to_string(batch) +
              ", \"tokens_per_s\": " + std::to_string(rate) +
              ", \"step_ms\": " + std::to_string(1e3 / steps) +
              ", \"weight_gbs\": " + std::to_string(used / 1e9) +
              ", \"of_copy_traffic\": " + std::to_string(used / (2 * copy_rate)) + "}";
    }
    // A mixture's decode with its few rows routed on the device (the
    // default) against the host reading the routing a layer (nn::
    // SetCudaExpertRouting(false)), in the same run, and whether the greedy
    // tokens are the same (each slot's product is its expert's one-row
    // product either way).
    for (int64_t batch : host_routing) {
      std::vector<double> on_device, on_host;
      bool same = true;
      for (int r = 0; r < rounds; ++r) {
        std::vector<int64_t> device_ids, host_ids;
        DecodeRun run;
        run.produced_ids = &device_ids;
        on_device.push_back(DecodeRate(m, batch, tokens, 3000 + 1000 * r, run));
        accel::nn::SetCudaExpertRouting(false);
        run.produced_ids = &host_ids;
        on_host.push_back(DecodeRate(m, batch, tokens, 3000 + 1000 * r, run));
        accel::nn::SetCudaExpertRouting(true);
        same &= device_ids == host_ids;
      }
      std::printf(
          "  batch %3ld, experts routed on the device: %8.1f tokens/s against %8.1f routed on "
          "the host (%.2fx); greedy tokens %s\n",
          static_cast<long>(batch), Median(on_device), Median(on_host),
          Median(on_device) / Median(on_host), same ? "the same" : "DIFFERENT");
      std::fflush(stdout);
      rows += std::string(rows.empty() ? "" : ", ") + "{\"batch\": " + std::to_string(batch) +
              ", \"device_routed_tokens_per_s\": " + std::to_string(Median(on_device)) +
              ", \"host_routed_tokens_per_s\": " + std::to_string(Median(on_host)) +
              ", \"same_tokens\": " + (same ? "true" : "false") + "}";
    }
    // The same eager steps through the general forward: what the unpadded
    // static step saves.
    for (int64_t batch : general_batches) {
      DecodeRun general;
      general.general = true;
      const double rate = DecodeRate(m, batch, tokens, 1000, general);
      std::printf("  batch %3ld, general forward: %8.1f tokens/s (%.2f ms a step)\n",
                  static_cast<long>(batch), rate, 1e3 * static_cast<double>(batch) / rate);
      std::fflush(stdout);
      rows += std::string(rows.empty() ? "" : ", ") + "{\"batch\": " + std::to_string(batch) +
              ", \"general_forward\": true, \"tokens_per_s\": " + std::to_string(rate) + "}";
    }
    // Steps as a served load has them: the batch's decodes and a prompt
    // arriving every step (each step through the general forward), against
    // the decode-only steps of the same batch in the same run.
    for (int64_t batch : mixed_batches) {
      const double alone = DecodeRate(m, batch, tokens, 1000);
      const double mixed = DecodeRate(m, batch, tokens, 1000, [&] {
        DecodeRun run;
        run.arriving = mixed_prompt;
        return run;
      }());
      const double alone_ms = 1e3 * static_cast<double>(batch) / alone;
      const double mixed_ms = 1e3 * static_cast<double>(batch + 1) / mixed;
      std::printf(
          "  batch %3ld + a %ld-token prompt a step: %.2f ms a step (decodes alone %.2f ms: "
          "%.2fx)\n",
          static_cast<long>(batch), static_cast<long>(mixed_prompt), mixed_ms, alone_ms,
          mixed_ms / alone_ms);
      std::fflush(stdout);
      rows += std::string(rows.empty() ? "" : ", ") + "{\"batch\": " + std::to_string(batch) +
              ", \"arriving_prompt\": " + std::to_string(mixed_prompt) +
              ", \"step_ms\": " + std::to_string(mixed_ms) +
              ", \"decode_only_step_ms\": " + std::to_string(alone_ms) + "}";
    }
    // CUDA graphs (issue 37, item 2): decode at each --graph_batches size
    // eagerly and replayed from graphs, in the same run, and whether the
    // greedy tokens are the same.
    std::string graph_rows;
    for (int64_t batch : graph_batches) {
      std::vector<double> eager, graphed;
      bool same = true;
      for (int r = 0; r < rounds; ++r) {
        std::vector<int64_t> eager_ids, graph_ids;
        // The first decode step untimed in both (it captures, with graphs).
        DecodeRun run;
        run.untimed_steps = 1;
        run.produced_ids = &eager_ids;
        eager.push_back(DecodeRate(m, batch, tokens, 2000 + 1000 * r, run));
        run.graphs = true;
        run.produced_ids = &graph_ids;
        graphed.push_back(DecodeRate(m, batch, tokens, 2000 + 1000 * r, run));
        same &= eager_ids == graph_ids;
      }
      // On the cpu (a check of the harness) the padded step runs without capture.
      std::printf(
          "  batch %3ld, %s: %8.1f tokens/s against %8.1f eager (%.2fx); greedy tokens %s\n",
          static_cast<long>(batch), cpu ? "padded, no graphs" : "CUDA graphs", Median(graphed),
          Median(eager), Median(graphed) / Median(eager), same ? "the same" : "DIFFERENT");
      std::fflush(stdout);
      // The same steps without the fused RMSNorm / rotary / SiLU kernels
      // (models/cuda/fused_ops.h): what they save a step.
      // The graphs rows again with one of nn's CUDA switches off (each round
      // as above).
      const auto graphs_without = [&](void (*set)(bool)) {
        std::vector<double> rates;
        set(false);
        for (int r = 0; r < rounds; ++r) {
          DecodeRun run;
          run.graphs = true;
          run.untimed_steps = 1;
          rates.push_back(DecodeRate(m, batch, tokens, 2000 + 1000 * r, run));
        }
        set(true);
        return Median(rates);
      };
      // Without the fused RMSNorm / rotary / SiLU kernels
      // (models/cuda/fused_ops.h): what they save a step.
      std::string unfused_json;
      if (compare_unfused) {
        const double unfused = graphs_without(accel::nn::SetFusedCudaOps);
        std::printf(
            "  batch %3ld, CUDA graphs without the fused kernels: %8.1f tokens/s (%.2f ms "
            "a step; with them %.2f ms)\n",
            static_cast<long>(batch), unfused, 1e3 * static_cast<double>(batch) / unfused,
            1e3 * static_cast<double>(batch) / Median(graphed));
        std::fflush(stdout);
        unfused_json = ", \"graphs_unfused_tokens_per_s\": " + std::to_string(unfused);
      }
      // With cuBLAS's products and the norms as kernels of their own
      // (models/cuda/decode_gemv.h off): what the decode GEMV and the norm
      // inside it save a step, or cost.
      if (compare_decode_gemv) {
        const double cublas = graphs_without(accel::nn::SetCudaDecodeGemv);
        std::printf(
            "  batch %3ld, CUDA graphs with cuBLAS's products and separate norms: %8.1f "
            "tokens/s (%.2f ms a step; with the decode GEMV %.2f ms)\n",
            static_cast<long>(batch), cublas, 1e3 * static_cast<double>(batch) / cublas,
            1e3 * static_cast<double>(batch) / Median(graphed));
        std::fflush(stdout);
        unfused_json += ", \"graphs_cublas_tokens_per_s\": " + std::to_string(cublas);
      }
      graph_rows += std::string(graph_rows.empty() ? "" : ", ") +
                    "{\"batch\": " + std::to_string(batch) +
                    ", \"graphs_tokens_per_s\": " + std::to_string(Median(graphed)) +
                    ", \"eager_tokens_per_s\": " + std::to_string(Median(eager)) +
                    ", \"same_tokens\": " + (same ? "true" : "false") + unfused_json + "}";
    }
    std::string profiles;
    for (int64_t batch : profile_batches) {
      for (const bool graphs : {false, true}) {
        const std::string one = ProfileDecode(m, batch, tokens, graphs && !cpu, 25);
        if (!one.empty()) profiles += std::string(profiles.empty() ? "" : ", ") + one;
      }
    }
    for (int64_t batch : profile_mixed) {
      const std::string one = ProfileDecode(m, batch, tokens, false, 25, mixed_prompt);
      if (!one.empty()) profiles += std::string(profiles.empty() ? "" : ", ") + one;
    }
    std::string syncs;
    for (int64_t batch : count_syncs) {
      const std::string one = CountSyncs(m, batch, tokens, mixed_prompt);
      if (!one.empty()) syncs += std::string(syncs.empty() ? "" : ", ") + one;
    }
    std::vector<double> ttft;
    // One untimed first: a prompt this long meets new kernel shapes (cuBLAS's
    // and attention's first calls), which the first measured one paid before.
    (void)TimeToFirstToken(m, prompt, 4999);
    for (int r = 0; r < rounds; ++r) ttft.push_back(TimeToFirstToken(m, prompt, 5000 + r));
    std::printf("  time to first token, %ld-token prompt: %.1f ms (median of %d)\n",
                static_cast<long>(prompt), 1e3 * Median(ttft), rounds);
    std::fflush(stdout);
    json += std::string(first_model ? "" : ",") + "\n  {\"quantize\": \"" + q +
            "\", \"layers\": " + std::to_string(m.config.num_hidden_layers) +
            ", \"bytes_per_step\": " + std::to_string(per_step) +
            ", \"load_s\": " + std::to_string(load_s) + ", \"decode\": [" + rows +
            "], \"graphs\": [" + graph_rows + "], \"profiles\": [" + profiles +
            "], \"host_waits\": [" + syncs + "], \"ttft_s\": " + std::to_string(Median(ttft)) + "}";
    first_model = false;
    write_json("\n]}\n");
  }
  return 0;
}
