// accel-bench-offload's decode rows: greedy decode of a Llama-shaped model of
// over 1 GB in float32 with 0%, 50% and 100% of its layers on disk, at batch
// 1 and 8, warm and cold page cache, next to all-in-RAM and to the raw read of
// the offloaded bytes, all in one run.
//
// The disk layers are what `max_memory cpu=...` plans (Accelerate's plan;
// 50%: layers 9-17, the norm and lm_head, as in the measurement), so
// the cpu budget leaves room for about one layer besides: mapped disk weights
// are dropped behind as they run, and each token maps them in again.
//   warm, mapped: disk weights used in place from the page cache (the default)
//   warm, read:   the same read into pooled buffers (map_disk off: the old path)
//   cold, direct: O_DIRECT reads, the page cache dropped and bypassed
// Bounds, measured in the same run: for warm rows, a pread of the offloaded
// bytes from the page cache, and mapping them in and dropping them again
// (MADV_POPULATE_READ + MADV_DONTNEED) as decode must each token; for cold
// rows, O_DIRECT sequential reads of the checkpoint in 32 MiB requests.
#include "bench/models/offload_decode.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <functional>
#include <string>
#include <sys/mman.h>
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

namespace accel::bench {
namespace {

// Reads every byte of the files once (into the page cache).
void Warm(const std::vector<std::string>& files) {
  std::vector<char> buffer(16 << 20);
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    while (::read(fd, buffer.data(), buffer.size()) > 0) {
    }
    ::close(fd);
  }
}

// Seconds to pread `bytes` of the files from the page cache (warm) into one
// reused buffer, as the read path does.
double CachedRead(const std::vector<std::string>& files, int64_t bytes) {
  std::vector<char> buffer(32 << 20);
  return Seconds([&] {
    int64_t left = bytes;
    for (const std::string& f : files) {
      const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
      ssize_t got;
      while (left > 0 &&
             (got = ::read(fd, buffer.data(),
                           std::min<int64_t>(left, static_cast<int64_t>(buffer.size())))) > 0) {
        left -= got;
      }
      ::close(fd);
    }
  });
}

// Seconds to map `bytes` of the files in from the page cache and drop them
// again, as warm mapped decode must for each token under the budget.
double MapAndDrop(const std::vector<std::string>& files, int64_t bytes) {
  double total = 0;
  for (const std::string& f : files) {
    if (bytes <= 0) break;
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    const auto size = static_cast<int64_t>(std::filesystem::file_size(f));
    const auto n = static_cast<size_t>(std::min(size, bytes));
    void* p = ::mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return -1;
    total += Seconds([&] {
#ifdef MADV_POPULATE_READ
      (void)::madvise(p, n, MADV_POPULATE_READ);
#endif
      (void)::madvise(p, n, MADV_DONTNEED);
    });
    ::munmap(p, n);
    bytes -= static_cast<int64_t>(n);
  }
  return total;
}

// Bytes per second of O_DIRECT sequential 32 MiB reads of the files.
double DirectReadRate(const std::vector<std::string>& files) {
  constexpr size_t kChunk = 32 << 20;
  void* raw = nullptr;
  if (::posix_memalign(&raw, 4096, kChunk) != 0) return 0;
  int64_t total = 0;
  const double seconds = Seconds([&] {
    for (const std::string& f : files) {
      const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      if (fd < 0) continue;
      ssize_t got;
      off_t at = 0;
      while ((got = ::pread(fd, raw, kChunk, at)) > 0) {
        total += got;
        at += got;
      }
      ::close(fd);
    }
  });
  std::free(raw);
  return static_cast<double>(total) / seconds;
}

struct Run {
  double tokens_per_second = 0;
  double brought_per_token = 0;  // read + mapped, bytes a generated token
  double dropped_per_token = 0;
  int disk_layers = 0;
};

Run Decode(const std::string& dir, const models::ModelLoadOptions& options, int batch, int tokens) {
  auto loaded = models::LoadModel(dir, options);
  if (!loaded.ok()) {
    std::fprintf(stderr, "accel-bench-offload: %s\n",
                 std::string(loaded.status().message()).c_str());
    std::exit(1);
  }
  Run run;
  for (int i = 0; i < loaded->config.num_hidden_layers; ++i) {
    const auto p = loaded->device_map.Lookup(absl::StrCat("model.layers.", i));
    if (p && p->is_disk()) ++run.disk_layers;
  }
  c10::InferenceMode inference;
  std::vector<models::KvCache> caches(static_cast<size_t>(batch));
  std::vector<models::SequenceChunk> chunks;
  std::vector<int64_t> ids;
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < 8; ++t) ids.push_back((b * 131 + t * 17 + 5) % 30000);
    chunks.push_back({&caches[static_cast<size_t>(b)], 8});
  }
  auto step = [&](const std::vector<int64_t>& input) {
    auto logits = loaded->model->Forward(at::tensor(input, at::kLong), chunks,
                                         models::Logits::kLastOfEach, loaded->dispatched.get());
    if (!logits.ok()) {
      std::fprintf(stderr, "accel-bench-offload: %s\n",
                   std::string(logits.status().message()).c_str());
      std::exit(1);
    }
    const at::Tensor next = logits->argmax(-1).to(at::kCPU).contiguous();
    return std::vector<int64_t>(next.data_ptr<int64_t>(), next.data_ptr<int64_t>() + batch);
  };
  std::vector<int64_t> next = step(ids);  // the prompt; the prefetch order is learned
  for (auto& c : chunks) c.tokens = 1;
  next = step(next);
  const dispatch::OffloadStats before = loaded->dispatched->stats();
  const double seconds = Seconds([&] {
    for (int t = 0; t < tokens; ++t) next = step(next);
  });
  const dispatch::OffloadStats after = loaded->dispatched->stats();
  const double generated = static_cast<double>(tokens) * batch;
  run.tokens_per_second = generated / seconds;
  run.brought_per_token = static_cast<double>(after.bytes_read - before.bytes_read +
                                              after.bytes_mapped - before.bytes_mapped) /
                          tokens;  // a step brings each weight once, whatever the batch
  run.dropped_per_token = static_cast<double>(after.bytes_dropped - before.bytes_dropped) / tokens;
  return run;
}

}  // namespace

int DecodeRows(const DecodeRowsOptions& o) {
  const std::string dir = o.dir;
  if (!std::filesystem::exists(dir + "/config.json")) {
    models::MakeModelOptions make;
    make.family = "llama";
    make.vocab_size = 32000;
    make.hidden_size = o.hidden;
    make.intermediate_size = o.hidden * 11 / 4;
    make.num_heads = o.hidden / 64;
    make.num_layers = o.layers;
    make.max_position_embeddings = 2048;
    make.dtype = at::kFloat;
    make.max_shard_size = 4'000'000'000;
    std::printf("making %s ...\n", dir.c_str());
    auto made = models::MakeModel(dir, make);
    if (!made.ok()) {
      std::fprintf(stderr, "accel-bench-offload: %s\n",
                   std::string(made.status().message()).c_str());
      return 1;
    }
  }
  const std::vector<std::string> shards = SafetensorsFiles(dir);
  int64_t file_bytes = 0;
  for (const auto& s : shards) file_bytes += static_cast<int64_t>(std::filesystem::file_size(s));
  // Budgets that plan about half, and all, of the layers onto disk: the
  // embedding, half the layers, and the planner's reserve for the largest
  // layer (lm_head, the embedding's size); the embedding and the reserve.
  const int64_t layer_bytes = 4 * (4 * o.hidden * o.hidden + 3 * o.hidden * (o.hidden * 11 / 4));
  const int64_t embed_bytes = int64_t{4} * 32000 * o.hidden;
  const std::string half = absl::StrCat(
      "cpu=", (2 * embed_bytes + int64_t{o.layers / 2} * layer_bytes + (int64_t{8} << 20)) >> 20,
      "MiB,disk=1TB");
  const std::string none =
      absl::StrCat("cpu=", (2 * embed_bytes + (int64_t{8} << 20)) >> 20, "MiB,disk=1TB");
  std::printf(
      "\ndecode: %s Llama (%d layers, hidden %lld, float32), greedy, %d steps after the prompt; "
      "%d cores; max_memory %s (50%%) and %s (100%%)\n",
      FormatBytes(file_bytes).c_str(), o.layers, static_cast<long long>(o.hidden), o.tokens,
      static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)), half.c_str(), none.c_str());

  models::ModelLoadOptions ram;
  ram.device_map = "cpu";
  ram.progress = Progress::Style::kSilent;
  struct Mode {
    const char* name;
    bool cold, map;
  };
  const Mode modes[] = {
      {"warm, mapped", false, true}, {"warm, read", false, false}, {"cold, direct", true, false}};
  for (int batch : {1, 8}) {
    std::printf("\nbatch %d %-24s %10s %9s %8s %12s %12s %11s %9s\n", batch, "", "tokens/s",
                "x RAM", "layers", "in/step", "dropped", "bound/step", "of bound");
    Warm(shards);
    const Run in_ram = Decode(dir, ram, batch, o.tokens);
    std::printf("  %-30s %10.2f %9.2f %8d\n", "0% on disk (all in RAM)", in_ram.tokens_per_second,
                1.0, 0);
    for (const auto& [label, budget] :
         {std::pair<const char*, std::string>{"50%", half}, {"100%", none}}) {
      for (const Mode& m : modes) {
        models::ModelLoadOptions options = ram;
        options.device_map = "auto";
        options.max_memory = budget;
        options.map_disk = m.map;
        options.direct_reads = m.cold;
        if (m.cold) {
          DropPageCache(shards);
        } else {
          Warm(shards);
        }
        const Run run = Decode(dir, options, batch, o.tokens);
        // The bound: the slower of the step's compute (all in RAM) and
        // bringing the offloaded bytes in alone, which the reader overlaps.
        const auto brought = static_cast<int64_t>(run.brought_per_token);
        double bring_seconds = 0;
        if (m.cold) {
          bring_seconds = static_cast<double>(brought) / DirectReadRate(shards);
        } else {
          Warm(shards);
          bring_seconds = m.map ? MapAndDrop(shards, static_cast<int64_t>(run.dropped_per_token))
                                : CachedRead(shards, brought);
        }
        const double bound_seconds = std::max(bring_seconds, batch / in_ram.tokens_per_second);
        const double step_seconds = batch / run.tokens_per_second;
        std::printf("  %-30s %10.2f %9.2f %8d %12s %12s %9.3f s %8.0f%%\n",
                    absl::StrCat(label, " on disk, ", m.name).c_str(), run.tokens_per_second,
                    run.tokens_per_second / in_ram.tokens_per_second, run.disk_layers,
                    FormatBytes(brought).c_str(),
                    FormatBytes(static_cast<int64_t>(run.dropped_per_token)).c_str(), bound_seconds,
                    100 * bound_seconds / step_seconds);
      }
    }
  }
  std::printf(
      "\nlayers: decoder layers on disk; in/step: weights brought in a step (read or mapped); "
      "dropped: of those, dropped again to keep the budget; bound/step: the slower of a step's "
      "compute (all in RAM) and "
      "bringing those bytes in alone (warm: a pread from the page cache, or mapping in and "
      "dropping the dropped bytes; cold: O_DIRECT 32 MiB reads), measured after each row; of "
      "bound: bound / measured step\n");
  return 0;
}

}  // namespace accel::bench
