// Decode of a Mixtral-shaped model (8 experts, top-2, over 1 GB) whose
// experts do not fit the memory budget, in one run:
//   (a) everything in RAM (the page cache warm): the compute bound;
//   (b) experts on disk, fetched whole-layer: Accelerate's plan for the
//       budget (MixtralDecoderLayer never split) and its block-at-a-time
//       loading, which reads every expert of a disk layer each step (with
//       accel's reader one layer ahead, and the same direct reads as (c));
//   (c) experts on disk, fetched one by one as the router picks them, through
//       the expert cache (--offload_experts); (c') the same without the
//       guessed read-ahead of the next layer's experts.
// The experts really come from disk: the checkpoint's pages are dropped from
// the page cache before each run (posix_fadvise DONTNEED) and offloaded
// weights are read with O_DIRECT, so no run is served by the page cache and
// the cpu budget (below the experts' total) is the memory that holds weights.
// The disk is shared and its rate moves a lot, so the runs alternate (a),
// (b), (c), (c') three times and each row is the median run, and the read
// bound (O_DIRECT reads of one expert's size, over the bytes a token read) is
// measured between them. For (c) also the experts routed per token, how many
// came from the cache, the guesses read and used, and what the routed experts
// alone weigh (what per-expert loading without a cache, as Accelerate's
// per-module hooks do, would read).
//
// With --gpu_budget (a CUDA build), the GPU is the execution device: (a) is
// the whole model in GPU memory, and (b), (c) hold that budget on GPU 0 with
// the rest planned into the cpu budget and disk as above.
//
//   build/bin/accel-bench-moe [--layers 8] [--hidden 1024] [--tokens 16]
//       [--budget 700MB] [--gpu_budget 300MB] [--rounds 3] [--dir /tmp/accel-bench-moe]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <functional>
#include <string>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "bench/bench_util.h"
#include "core/bytes.h"
#include "models/load_model.h"
#include "models/make_model.h"

namespace {

using accel::bench::DropPageCache;
using accel::bench::Median;
using accel::bench::SafetensorsFiles;
using accel::bench::Seconds;

// O_DIRECT reads of `chunk` bytes at spread-out offsets of the files, as
// the engine reads an expert with direct reads: bytes per second from the
// device, the page cache bypassed.
double DirectReadRate(const std::vector<std::string>& files, uint64_t chunk, int reads) {
  constexpr uint64_t kAlign = 4096;
  chunk = (chunk + kAlign - 1) / kAlign * kAlign;
  void* raw = nullptr;
  if (::posix_memalign(&raw, kAlign, chunk) != 0) return 0;
  uint64_t total = 0;
  const double seconds = Seconds([&] {
    for (int r = 0; r < reads; ++r) {
      const std::string& f = files[static_cast<size_t>(r) % files.size()];
      const uint64_t size = std::filesystem::file_size(f);
      if (size < chunk) continue;
      // Offsets spread over the file, in a scrambled order.
      const uint64_t slots = (size - chunk) / kAlign;
      const uint64_t at = (static_cast<uint64_t>(r) * 2654435761u % (slots + 1)) * kAlign;
      const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      if (fd < 0) continue;
      const ssize_t got = ::pread(fd, raw, chunk, static_cast<off_t>(at));
      if (got > 0) total += static_cast<uint64_t>(got);
      ::close(fd);
    }
  });
  std::free(raw);
  return static_cast<double>(total) / seconds;
}

// Reads the files twice from the page cache (warming it for (a)); the rate
// of the second pass.
double CachedReadRate(const std::vector<std::string>& files) {
  std::vector<char> buffer(16 << 20);
  double rate = 0;
  for (int pass = 0; pass < 2; ++pass) {
    int64_t total = 0;
    const double seconds = Seconds([&] {
      for (const std::string& f : files) {
        const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t got;
        while ((got = ::read(fd, buffer.data(), buffer.size())) > 0) total += got;
        ::close(fd);
      }
    });
    rate = static_cast<double>(total) / seconds;
  }
  return rate;
}

struct Row {
  std::string name;
  double tokens_per_second = 0;
  double read_per_token = 0;         // bytes from disk
  double expert_uses_per_token = 0;  // routed experts that were offloaded
  double hits_per_token = 0;
  double prefetch_hits_per_token = 0;
  double reads_per_token = 0;   // experts read
  double misses_per_token = 0;  // of which read in line, not cached
  double guess_reads_per_token = 0, guess_hits_per_token = 0;
};

int64_t ExpertBytes(const accel::models::LoadedModel& m) {
  const accel::loader::ModelConfig& c = m.config;
  const int64_t element = m.dtype == at::kFloat ? 4 : 2;
  return 3 * c.hidden_size * c.intermediate_size * element;
}

// Decodes `tokens` steps for `batch` sequences after a short prompt each;
// times the decode steps only.
Row Decode(const std::string& name, const std::string& dir,
           const accel::models::ModelLoadOptions& options, int batch, int tokens,
           const std::vector<std::string>& shards, bool cold) {
  Row row;
  row.name = name;
  if (cold) DropPageCache(shards);
  auto loaded = accel::models::LoadModel(dir, options);
  if (!loaded.ok()) {
    std::fprintf(stderr, "accel-bench-moe: %s: %s\n", name.c_str(),
                 std::string(loaded.status().message()).c_str());
    std::exit(1);
  }
  c10::InferenceMode inference;
  std::vector<accel::models::KvCache> caches(static_cast<size_t>(batch));
  std::vector<accel::models::SequenceChunk> chunks;
  std::vector<int64_t> ids;
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < 8; ++t) ids.push_back((b * 131 + t * 17 + 5) % 30000);
    chunks.push_back({&caches[static_cast<size_t>(b)], 8});
  }
  auto step = [&](const std::vector<int64_t>& input) {
    auto logits =
        loaded->model->Forward(at::tensor(input, at::kLong), chunks,
                               accel::models::Logits::kLastOfEach, loaded->dispatched.get());
    if (!logits.ok()) {
      std::fprintf(stderr, "accel-bench-moe: %s\n", std::string(logits.status().message()).c_str());
      std::exit(1);
    }
    const at::Tensor next = logits->argmax(-1).to(at::kCPU).contiguous();
    return std::vector<int64_t>(next.data_ptr<int64_t>(), next.data_ptr<int64_t>() + batch);
  };
  std::vector<int64_t> next = step(ids);
  for (auto& c : chunks) c.tokens = 1;
  const accel::dispatch::OffloadStats before = loaded->dispatched->stats();
  const double seconds = Seconds([&] {
    for (int t = 0; t < tokens; ++t) next = step(next);
  });
  const accel::dispatch::OffloadStats after = loaded->dispatched->stats();
  const double generated = static_cast<double>(tokens) * batch;
  row.tokens_per_second = generated / seconds;
  row.read_per_token = static_cast<double>(after.bytes_read - before.bytes_read) / generated;
  const double hits = static_cast<double>(after.expert_cache_hits - before.expert_cache_hits);
  const double reads = static_cast<double>(after.expert_fetches - before.expert_fetches);
  const double prefetch_hits =
      static_cast<double>(after.expert_prefetch_hits - before.expert_prefetch_hits);
  row.hits_per_token = hits / generated;
  row.prefetch_hits_per_token = prefetch_hits / generated;
  row.reads_per_token = reads / generated;
  row.misses_per_token =
      static_cast<double>(after.expert_misses - before.expert_misses) / generated;
  row.expert_uses_per_token = row.hits_per_token + row.misses_per_token;
  row.guess_reads_per_token =
      static_cast<double>(after.expert_guess_reads - before.expert_guess_reads) / generated;
  row.guess_hits_per_token =
      static_cast<double>(after.expert_guess_hits - before.expert_guess_hits) / generated;
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t layers = 8, hidden = 1024;
  int tokens = 16;
  std::string budget = "700MB";
  std::string dir = "/tmp/accel-bench-moe";
  std::string gpu_budget;
  int rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--layers") layers = std::atoll(argv[i + 1]);
    if (flag == "--hidden") hidden = std::atoll(argv[i + 1]);
    if (flag == "--tokens") tokens = std::atoi(argv[i + 1]);
    if (flag == "--budget") budget = argv[i + 1];
    if (flag == "--dir") dir = argv[i + 1];
    if (flag == "--gpu_budget") gpu_budget = argv[i + 1];
    if (flag == "--rounds") rounds = std::max(1, std::atoi(argv[i + 1]));
  }
  const int kRounds = rounds;
  accel::models::MakeModelOptions make;
  make.family = "mixtral";
  make.vocab_size = 32000;
  make.hidden_size = hidden;
  make.intermediate_size = hidden * 7 / 2;  // Mixtral's 14336 / 4096
  make.num_heads = hidden / 128;
  make.num_kv_heads = std::max<int64_t>(1, hidden / 512);
  make.num_layers = layers;
  make.num_experts = 8;
  make.num_experts_per_tok = 2;
  make.max_position_embeddings = 4096;
  make.dtype = at::kBFloat16;
  make.max_shard_size = 2'000'000'000;
  if (!std::filesystem::exists(dir + "/config.json")) {
    std::printf("making %s ...\n", dir.c_str());
    auto made = accel::models::MakeModel(dir, make);
    if (!made.ok()) {
      std::fprintf(stderr, "accel-bench-moe: %s\n", std::string(made.status().message()).c_str());
      return 1;
    }
  }
  const std::vector<std::string> shards = SafetensorsFiles(dir);
  int64_t file_bytes = 0;
  for (const auto& s : shards) file_bytes += static_cast<int64_t>(std::filesystem::file_size(s));

  accel::models::ModelLoadOptions ram;
  ram.device_map = "cpu";
  ram.progress = accel::Progress::Style::kSilent;
  accel::models::ModelLoadOptions whole = ram;
  whole.device_map = "auto";
  whole.max_memory = absl::StrCat("cpu=", budget, ",disk=1TB");
  whole.direct_reads = true;
  whole.offload_experts = "false";  // Accelerate's plan: whole blocks
  if (!gpu_budget.empty()) {
    ram.device_map = "0";
    whole.max_memory = absl::StrCat("0=", gpu_budget, ",", whole.max_memory);
    whole.execution_device = "cuda:0";
    std::printf("execution device cuda:0: (a) all in GPU memory, (b) and (c) with 0=%s\n",
                gpu_budget.c_str());
  }
  accel::models::ModelLoadOptions experts = whole;
  experts.offload_experts = "true";
  accel::models::ModelLoadOptions no_ahead = experts;
  no_ahead.prefetch = false;

  int64_t expert_bytes = 0;
  {
    auto probe = accel::models::LoadModel(dir, experts);
    if (!probe.ok()) {
      std::fprintf(stderr, "accel-bench-moe: %s\n", std::string(probe.status().message()).c_str());
      return 1;
    }
    expert_bytes = ExpertBytes(*probe);
    int64_t on_disk = 0;
    for (const auto& [name, p] : probe->device_map.entries()) {
      if (p.is_disk()) ++on_disk;
    }
    std::printf(
        "model: %s (MixtralForCausalLM, %lld layers, hidden %lld, 8 experts of %s, top-2, "
        "bfloat16), budget cpu=%s; with --offload_experts the expert cache is %s\n",
        accel::FormatBytes(file_bytes).c_str(), static_cast<long long>(layers),
        static_cast<long long>(hidden), accel::FormatBytes(expert_bytes).c_str(), budget.c_str(),
        accel::FormatBytes(probe->expert_cache_bytes).c_str());
  }
  const double warm_rate = CachedReadRate(shards);
  std::printf("the checkpoint from the page cache: %.2f GB/s\n", warm_rate / 1e9);
  std::printf(
      "rows: medians of %d alternating runs; the read bound is the rate of O_DIRECT reads of one "
      "expert's size at spread-out offsets (measured between the runs) over the bytes a token "
      "read\n\n",
      kRounds);

  for (int batch : {1, 8}) {
    std::printf("batch %d, %d decode steps:\n", batch, tokens);
    std::printf("  %-44s %9s %12s %12s %9s\n", "", "tokens/s", "read/token", "read bound",
                "of bound");
    const char* names[] = {"(a) all in RAM", "(b) experts on disk, whole layers",
                           "(c) experts on disk, one by one + cache",
                           "(c') the same, no guessed read-ahead"};
    const accel::models::ModelLoadOptions* modes[] = {&ram, &whole, &experts, &no_ahead};
    std::vector<std::vector<Row>> runs(4);
    std::vector<double> rates;
    for (int round = 0; round < kRounds; ++round) {
      rates.push_back(DirectReadRate(shards, static_cast<uint64_t>(expert_bytes), 12));
      for (int m = 0; m < 4; ++m) {
        if (m == 0) CachedReadRate(shards);  // (a): the page cache warm
        runs[m].push_back(Decode(names[m], dir, *modes[m], batch, tokens, shards, m > 0));
      }
    }
    rates.push_back(DirectReadRate(shards, static_cast<uint64_t>(expert_bytes), 12));
    const double rate = Median(rates);
    std::vector<Row> rows;
    for (int m = 0; m < 4; ++m) {
      std::vector<Row> sorted = runs[m];
      std::sort(sorted.begin(), sorted.end(), [](const Row& x, const Row& y) {
        return x.tokens_per_second < y.tokens_per_second;
      });
      rows.push_back(sorted[sorted.size() / 2]);
    }
    for (const Row& r : rows) {
      const double bound = r.read_per_token > 0 ? rate / r.read_per_token : 0;
      std::printf("  %-44s %9.2f %12s %12s %8.0f%%\n", r.name.c_str(), r.tokens_per_second,
                  accel::FormatBytes(static_cast<int64_t>(r.read_per_token)).c_str(),
                  bound > 0 ? absl::StrFormat("%.2f t/s", bound).c_str() : "-",
                  bound > 0 ? 100 * r.tokens_per_second / bound : 0.0);
    }
    std::printf("  O_DIRECT reads of %s: %.2f GB/s (median; from %.2f to %.2f)\n",
                accel::FormatBytes(expert_bytes).c_str(), rate / 1e9,
                *std::min_element(rates.begin(), rates.end()) / 1e9,
                *std::max_element(rates.begin(), rates.end()) / 1e9);
    for (size_t i = 2; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::printf(
          "  %s per token: %.2f offloaded experts routed to (%.2f cache hits, %.2f of them read "
          "ahead; %.2f read in line); %.2f experts read in all, %.2f of them guesses (%.2f used); "
          "the routed ones weigh %s\n",
          r.name.substr(0, 4).c_str(), r.expert_uses_per_token, r.hits_per_token,
          r.prefetch_hits_per_token, r.misses_per_token, r.reads_per_token, r.guess_reads_per_token,
          r.guess_hits_per_token,
          accel::FormatBytes(
              static_cast<int64_t>(r.expert_uses_per_token * static_cast<double>(expert_bytes)))
              .c_str());
    }
    std::printf("  (c) against (b): %.2fx the tokens/s, %.2fx fewer bytes read a token\n\n",
                rows[2].tokens_per_second / rows[1].tokens_per_second,
                rows[1].read_per_token / std::max(rows[2].read_per_token, 1.0));
  }
  return 0;
}
