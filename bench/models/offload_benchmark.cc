// What disk offload costs per forward, with and without prefetch, next to a
// raw read of the offloaded bytes and the forward with every weight in RAM,
// all measured in one run with a cold page cache (posix_fadvise DONTNEED on
// the checkpoint before each forward). Also the load time against a raw read.
// With a CUDA device (a CUDA libtorch), the same with the GPU as the main
// device: cpu and disk entries come over the copy stream, next to a plain
// pinned host-to-device copy of the same bytes; and half the layers on the
// host (interleaved) as a share of its bound, the slower of a pinned copy of
// those layers and the forward with every layer resident (issue 37: >= 85%).
//
// Then decode rows (bench/models/offload_decode.cc): a model of over 1 GB decoding
// with 0%, 50% and 100% of its layers on disk, warm and cold.
//
//   build/bin/accel-bench-offload [--layers 8] [--hidden 4096] [--repeats 5]
//       [--decode_only] [--decode_layers 18] [--decode_hidden 1024]
//       [--decode_tokens 16] [--decode_dir /tmp/accel-bench-offload-decode]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "absl/strings/str_cat.h"

#include "bench/bench_util.h"
#include "bench/models/offload_decode.h"
#include "dispatch/dispatch.h"
#include "dispatch/empty_weights.h"
#include "loader/loader.h"

namespace {

using accel::bench::DropPageCache;
using accel::bench::Median;
using accel::bench::SafetensorsFiles;
using accel::bench::Seconds;
using accel::dispatch::DispatchedModel;

struct Stack : torch::nn::Module {
  Stack(int layers, int64_t hidden) {
    for (int i = 0; i < layers; ++i) {
      blocks.emplace_back(
          register_module("l" + std::to_string(i),
                          torch::nn::Linear(torch::nn::LinearOptions(hidden, hidden).bias(false))));
    }
  }
  at::Tensor forward(at::Tensor x, DispatchedModel* d) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      std::optional<DispatchedModel::Scope> scope;
      if (d != nullptr) scope.emplace(*d->Enter("l" + std::to_string(i)));
      x = at::tanh(blocks[i]->forward(x));
    }
    return x;
  }
  std::vector<torch::nn::Linear> blocks;
};

uint64_t RawRead(const std::vector<std::string>& files, std::vector<char>& buffer) {
  uint64_t total = 0;
  for (const std::string& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY);
    ssize_t n;
    while ((n = ::read(fd, buffer.data(), buffer.size())) > 0) total += static_cast<uint64_t>(n);
    ::close(fd);
  }
  return total;
}

// `where` for every layer; `first`, when given, for l0 (a GPU there makes
// the GPU the main device); `odd`, when given, for l1, l3, ... (half the
// layers elsewhere, interleaved, so each offloaded layer's copy can overlap
// the compute of the resident layer before it).
std::unique_ptr<DispatchedModel> Dispatch(const std::shared_ptr<Stack>& model,
                                          const std::string& dir, const char* where, bool prefetch,
                                          const char* first = nullptr, const char* odd = nullptr) {
  accel::dispatch::DeviceMap map;
  map.Set("", *accel::Placement::Parse(where));
  if (odd != nullptr) {
    for (size_t i = 1; i < model->blocks.size(); i += 2) {
      map.Set("l" + std::to_string(i), *accel::Placement::Parse(odd));
    }
  }
  if (first != nullptr) map.Set("l0", *accel::Placement::Parse(first));
  accel::dispatch::LoadOptions options;
  options.prefetch = prefetch;
  options.progress = accel::Progress::Style::kSilent;
  auto loaded = DispatchedModel::Load(model, dir, map, options);
  if (!loaded.ok()) {
    std::fprintf(stderr, "load failed: %s\n", std::string(loaded.status().message()).c_str());
    std::exit(1);
  }
  return *std::move(loaded);
}

std::shared_ptr<Stack> EmptyStack(int layers, int64_t hidden) {
  auto m = std::make_shared<Stack>(layers, hidden);
  (void)accel::dispatch::EmptyModule(*m);
  return m;
}

// The GPU as the main device: l0 on GPU 0, the other layers resident there,
// in RAM, or on disk. Forward times include waiting for the GPU.
void GpuRows(const std::string& dir, const std::vector<std::string>& files, int layers,
             int64_t hidden, int repeats) {
  const at::Device gpu(at::kCUDA, 0);
  at::Tensor x = at::randn({1, hidden}).to(gpu);
  const auto forward = [&](const std::shared_ptr<Stack>& m, DispatchedModel* d) {
    (void)m->forward(x, d).cpu();  // waits for the GPU
  };
  struct Row {
    const char* label;
    const char* where;  // the layers after l0; "disk" rows run with a cold cache
    bool prefetch;
    bool half;  // only l2, l4, ... at `where`, the odd layers resident on the GPU
    std::shared_ptr<Stack> model;
    std::unique_ptr<DispatchedModel> dispatched;
    std::vector<double> seconds;
  };
  std::vector<Row> rows;
  rows.push_back({"GPU, weights resident", "0", false, false, nullptr, nullptr, {}});
  rows.push_back({"GPU, cpu offload", "cpu", false, false, nullptr, nullptr, {}});
  rows.push_back({"GPU, cpu offload + prefetch", "cpu", true, false, nullptr, nullptr, {}});
  rows.push_back({"GPU, half on cpu + prefetch", "cpu", true, true, nullptr, nullptr, {}});
  rows.push_back({"GPU, disk offload (cold cache)", "disk", false, false, nullptr, nullptr, {}});
  rows.push_back({"GPU, disk + prefetch (cold cache)", "disk", true, false, nullptr, nullptr, {}});
  for (Row& r : rows) {
    r.model = EmptyStack(layers, hidden);
    r.dispatched = Dispatch(r.model, dir, r.where, r.prefetch, "0", r.half ? "0" : nullptr);
    forward(r.model, r.dispatched.get());  // learns the order, warms the kernels
  }
  // The baseline: the offloaded bytes copied host-to-device from pinned memory.
  const int64_t offloaded = static_cast<int64_t>(layers - 1) * hidden * hidden;
  at::Tensor pinned = at::randn({offloaded}).pin_memory();
  at::Tensor on_gpu = at::empty({offloaded}, at::TensorOptions().device(gpu));
  // And the half row's: its host layers (l2, l4, ...) alone.
  const int64_t half_layers = (layers - 1) / 2;
  const int64_t half_offloaded = half_layers * hidden * hidden;
  std::vector<double> copy, half_copy;
  for (int r = 0; r < repeats; ++r) {
    copy.push_back(Seconds([&] {
      on_gpu.copy_(pinned);
      (void)on_gpu[0].item<float>();
    }));
    half_copy.push_back(Seconds([&] {
      on_gpu.narrow(0, 0, half_offloaded).copy_(pinned.narrow(0, 0, half_offloaded));
      (void)on_gpu[0].item<float>();
    }));
    for (Row& row : rows) {
      if (std::strcmp(row.where, "disk") == 0) DropPageCache(files);
      row.seconds.push_back(Seconds([&] { forward(row.model, row.dispatched.get()); }));
    }
  }
  const double gb = static_cast<double>(offloaded) * 4 / 1e9;
  std::printf(
      "\nGPU main device (%s): l0 on the GPU, %d layers (%.2f GB) offloaded; median of %d\n",
      gpu.str().c_str(), layers - 1, gb, repeats);
  std::printf("%-34s %9s %9s\n", "per forward", "seconds", "x copy");
  std::printf("%-34s %9.4f %9.2f   (%.1f GB/s)\n", "pinned host-to-device copy", Median(copy), 1.0,
              gb / Median(copy));
  for (const Row& row : rows) {
    std::printf("%-34s %9.4f %9.2f\n", row.label, Median(row.seconds),
                Median(row.seconds) / Median(copy));
  }
  // Issue 37's goal: half the layers on the host at >= 85% of the bound,
  // the slower of copying them (pinned, this run) and the step with every
  // layer resident.
  for (const Row& row : rows) {
    if (!row.half) continue;
    const double bound = std::max(Median(half_copy), Median(rows[0].seconds));
    std::printf(
        "%s: %lld of %d layers on the host (%.2f GB); bound %.4f s (pinned copy of them %.4f s, "
        "all resident %.4f s); %.0f%% of the bound\n",
        row.label, static_cast<long long>(half_layers), layers,
        static_cast<double>(half_offloaded) * 4 / 1e9, bound, Median(half_copy),
        Median(rows[0].seconds), 100 * bound / Median(row.seconds));
  }
  for (const Row& row : rows) {
    if (!row.prefetch) continue;
    auto stats = row.dispatched->stats();
    std::printf("%s: %lld prefetch hits of %lld fetches, %.2f GB over the copy stream\n", row.label,
                static_cast<long long>(stats.prefetch_hits), static_cast<long long>(stats.fetches),
                static_cast<double>(stats.bytes_to_device) / 1e9);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 8, repeats = 5;
  int64_t hidden = 4096;
  bool decode_only = false;
  accel::bench::DecodeRowsOptions decode;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--decode_only")) decode_only = true;
    if (i + 1 >= argc) continue;
    if (!std::strcmp(argv[i], "--layers")) layers = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--hidden")) hidden = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--repeats")) repeats = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--decode_layers")) decode.layers = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--decode_hidden")) decode.hidden = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--decode_tokens")) decode.tokens = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--decode_dir")) decode.dir = argv[i + 1];
  }
  if (decode_only) return accel::bench::DecodeRows(decode);
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp ? tmp : "/tmp") + "/accel-bench-offload-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) return 1;

  // A checkpoint of `layers` float32 [hidden, hidden] weights.
  std::vector<accel::loader::TensorSpec> specs;
  specs.reserve(static_cast<size_t>(layers));
  for (int i = 0; i < layers; ++i)
    specs.push_back({"l" + std::to_string(i) + ".weight", at::kFloat, {hidden, hidden}});
  auto produce = [](const accel::loader::TensorSpec& s) -> absl::StatusOr<at::Tensor> {
    return at::randn(s.shape) * 0.02;
  };
  accel::loader::CheckpointWriteOptions write;
  write.max_shard_size = 1'000'000'000;
  if (!accel::loader::WriteCheckpoint(dir, specs, produce, write).ok()) return 1;
  const std::vector<std::string> files = SafetensorsFiles(dir);
  std::vector<char> buffer(64 << 20);

  c10::InferenceMode inference;
  at::Tensor x = at::randn({1, hidden});
  auto resident_model = EmptyStack(layers, hidden);
  auto disk_model = EmptyStack(layers, hidden);
  auto prefetch_model = EmptyStack(layers, hidden);

  std::vector<double> load_raw, load_cpu;
  for (int r = 0; r < 3; ++r) {
    DropPageCache(files);
    load_raw.push_back(Seconds([&] { RawRead(files, buffer); }));
    DropPageCache(files);
    auto m = EmptyStack(layers, hidden);
    load_cpu.push_back(Seconds([&] {
      auto d = Dispatch(m, dir, "cpu", false);
      for (auto& b : m->blocks) (void)b->weight.sum();  // touch every weight: ready in RAM
    }));
  }

  auto resident = Dispatch(resident_model, dir, "cpu", false);
  auto disk = Dispatch(disk_model, dir, "disk", false);
  auto prefetch = Dispatch(prefetch_model, dir, "disk", true);
  // One pass each so the prefetch order is learned and the kernels are warm.
  resident_model->forward(x, resident.get());
  disk_model->forward(x, disk.get());
  prefetch_model->forward(x, prefetch.get());

  std::vector<double> raw, in_ram, no_prefetch, with_prefetch;
  for (int r = 0; r < repeats; ++r) {
    DropPageCache(files);
    raw.push_back(Seconds([&] { RawRead(files, buffer); }));
    in_ram.push_back(Seconds([&] { resident_model->forward(x, resident.get()); }));
    DropPageCache(files);
    no_prefetch.push_back(Seconds([&] { disk_model->forward(x, disk.get()); }));
    DropPageCache(files);
    with_prefetch.push_back(Seconds([&] { prefetch_model->forward(x, prefetch.get()); }));
  }
  const double gb = static_cast<double>(layers) * static_cast<double>(hidden) *
                    static_cast<double>(hidden) * 4 / 1e9;
  std::printf(
      "%d layers of float32 [%lld, %lld]: %.2f GB offloaded; %d cores, %d torch threads; median of "
      "%d\n",
      layers, static_cast<long long>(hidden), static_cast<long long>(hidden), gb,
      static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)), at::get_num_threads(), repeats);
  std::printf(
      "load (cold cache)     raw read %.3f s   Load(cpu)+touch %.3f s  (x%.2f of the raw read)\n",
      Median(load_raw), Median(load_cpu), Median(load_cpu) / Median(load_raw));
  std::printf("%-34s %9s %9s\n", "per forward (cold cache)", "seconds", "x raw");
  std::printf("%-34s %9.3f %9.2f\n", "raw read of the offloaded bytes", Median(raw), 1.0);
  std::printf("%-34s %9.3f %9.2f\n", "forward, weights in RAM", Median(in_ram),
              Median(in_ram) / Median(raw));
  std::printf("%-34s %9.3f %9.2f\n", "forward, disk offload", Median(no_prefetch),
              Median(no_prefetch) / Median(raw));
  std::printf("%-34s %9.3f %9.2f\n", "forward, disk offload + prefetch", Median(with_prefetch),
              Median(with_prefetch) / Median(raw));
  std::printf(
      "offload cost per forward: %.3f s without prefetch, %.3f s with (read alone: %.3f s)\n",
      Median(no_prefetch) - Median(in_ram), Median(with_prefetch) - Median(in_ram), Median(raw));
  auto stats = prefetch->stats();
  std::printf("prefetch hits: %lld of %lld fetches\n", static_cast<long long>(stats.prefetch_hits),
              static_cast<long long>(stats.fetches));
  if (at::hasCUDA()) {
    GpuRows(dir, files, layers, hidden, repeats);
  } else {
    std::printf("GPU rows: skipped, no CUDA device (at::hasCUDA() is false)\n");
  }
  std::filesystem::remove_all(dir);
  return accel::bench::DecodeRows(decode);
}
