// accel-bench-train [--processes 1,2] [--steps 30] [--hidden 256] [--layers 4]
//     [--batch 8] [--seq 64] [--strategies ddp,FULL_SHARD,SHARD_GRAD_OP,NO_SHARD]
//
// With several processes each strategy runs in turn: data parallel ("ddp",
// the baseline of its process count) and the FSDP sharding strategies. Each
// reports its median step time and, per rank, the bytes of parameters,
// gradients and optimizer state at rest (after zero_grad) and at their peak
// in the step (FSDP: sampled at each gather and reduction; DDP: parameters,
// their gradients, the buckets and the optimizer state all at once), next to
// data parallel's.
//
// Data-parallel step time. Without WORLD_SIZE in its environment it is the
// driver: for each process count it runs itself under accel-launch
// (accel-launch from the same bin folder) with the cores shared out among the
// ranks (OMP_NUM_THREADS = cores / processes), and prints each run's figures
// next to the one-process baseline measured in the same invocation. As a
// rank it trains a Llama-family model on fixed random tokens, a per-process
// batch of --batch windows (so N processes see N times the samples per
// step), and reports from rank 0: median step time, samples/s, and the time
// the gradient all-reduce made backward wait (GradientSynchronizer).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <torch/optim/adamw.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

#include "core/status.h"
#include "models/causal_lm.h"
#include "models/load_model.h"
#include "models/make_model.h"
#include "train/accelerator.h"

namespace {

struct Flags {
  std::string processes = "1,2";
  int64_t steps = 30;
  int64_t hidden = 256;
  int64_t layers = 4;
  int64_t batch = 8;
  int64_t seq = 64;
  std::string strategies = "ddp,FULL_SHARD,SHARD_GRAD_OP,NO_SHARD";
  std::string strategy = "ddp";  // a rank's
};

Flags Parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    int64_t n = 0;
    if (k == "--processes") {
      f.processes = v;
    } else if (k == "--strategies") {
      f.strategies = v;
    } else if (k == "--strategy") {
      f.strategy = v;
    } else if (absl::SimpleAtoi(v, &n) && n > 0) {
      if (k == "--steps") f.steps = n;
      if (k == "--hidden") f.hidden = n;
      if (k == "--layers") f.layers = n;
      if (k == "--batch") f.batch = n;
      if (k == "--seq") f.seq = n;
    } else {
      std::cerr << "accel-bench-train: bad flag " << k << " " << v << "\n";
      std::exit(1);
    }
  }
  return f;
}

absl::Status Rank(const Flags& f) {
  using namespace accel;  // NOLINT(google-build-using-namespace): a benchmark's main
  train::AcceleratorOptions options;
  if (f.strategy != "ddp") {
    train::FullyShardedDataParallelPlugin plugin;
    ACCEL_ASSIGN_OR_RETURN(plugin.sharding_strategy, train::ParseShardingStrategy(f.strategy));
    options.fsdp_plugin = plugin;
  }
  ACCEL_ASSIGN_OR_RETURN(auto acc, train::Accelerator::Create(options));
  const std::string dir =
      absl::StrCat("/tmp/accel-bench-train-", f.hidden, "-", f.layers, "-", getppid());
  if (acc->is_main_process() && !std::filesystem::exists(dir + "/config.json")) {
    models::MakeModelOptions make;
    make.hidden_size = f.hidden;
    make.num_layers = f.layers;
    make.vocab_size = 1024;
    make.num_heads = 4;
    ACCEL_RETURN_IF_ERROR(models::MakeModel(dir, make).status());
  }
  ACCEL_RETURN_IF_ERROR(acc->WaitForEveryone());
  models::ModelLoadOptions load;
  load.device_map = "cpu";
  load.dtype = "float32";
  ACCEL_ASSIGN_OR_RETURN(models::LoadedModel loaded, models::LoadModel(dir, load));
  auto model = loaded.model;
  int64_t params = 0;
  std::vector<at::Tensor> unique;  // tied weights once
  for (at::Tensor& p : model->parameters()) {
    p.set_requires_grad(true);
    bool seen = false;
    for (const at::Tensor& u : unique) seen = seen || u.is_same(p);
    if (!seen) {
      unique.push_back(p);
      params += p.numel();
    }
  }
  auto adamw = std::make_shared<torch::optim::AdamW>(unique, torch::optim::AdamWOptions(1e-3));
  ACCEL_ASSIGN_OR_RETURN(train::PreparedModel * prepared, acc->PrepareModel(model));
  ACCEL_ASSIGN_OR_RETURN(train::PreparedOptimizer * opt, acc->PrepareOptimizer(adamw));
  at::manual_seed(acc->process_index());
  at::Tensor windows = at::randint(0, 1024, {f.batch, f.seq + 1}, at::kLong);
  at::Tensor inputs = windows.narrow(1, 0, f.seq).reshape({-1}).contiguous();
  at::Tensor targets = windows.narrow(1, 1, f.seq).reshape({-1});
  std::vector<models::SequenceChunk> chunks(static_cast<size_t>(f.batch), {nullptr, f.seq});

  std::vector<double> step_ms;
  double wait_before = 0;
  double wait_measured = 0;
  const int64_t warmup = 3;
  for (int64_t s = 0; s < f.steps + warmup; ++s) {
    if (s == warmup && prepared->synchronizer() != nullptr) {
      wait_before = prepared->synchronizer()->wait_seconds();
    }
    if (s == warmup && prepared->sharded() != nullptr) {
      wait_before = prepared->sharded()->communication_seconds();
      prepared->sharded()->ResetPeakBytes();
    }
    auto start = std::chrono::steady_clock::now();
    ACCEL_ASSIGN_OR_RETURN(at::Tensor logits,
                           model->Forward(inputs, chunks, models::Logits::kAll, nullptr));
    at::Tensor loss = at::cross_entropy_loss(logits, targets);
    ACCEL_RETURN_IF_ERROR(acc->Backward(loss));
    ACCEL_RETURN_IF_ERROR(opt->Step());
    opt->ZeroGrad();
    auto end = std::chrono::steady_clock::now();
    if (s >= warmup) {
      step_ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
    }
  }
  if (prepared->synchronizer() != nullptr) {
    wait_measured = prepared->synchronizer()->wait_seconds() - wait_before;
  }
  if (prepared->sharded() != nullptr) {
    wait_measured = prepared->sharded()->communication_seconds() - wait_before;
  }
  // Bytes of training state this rank holds: at rest, and at the step's peak.
  int64_t optimizer_bytes = 0;
  for (const auto& [key, state] : adamw->state()) {
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*state);
    optimizer_bytes += static_cast<int64_t>(adam.exp_avg().nbytes() + adam.exp_avg_sq().nbytes());
  }
  int64_t rest_bytes = optimizer_bytes;
  int64_t peak_bytes = optimizer_bytes;
  if (train::ShardedModel* sharded = prepared->sharded()) {
    rest_bytes += sharded->parameter_bytes() + sharded->gradient_bytes();
    peak_bytes += sharded->peak_bytes();
  } else {
    int64_t param_bytes = 0;
    for (const at::Tensor& p : unique) param_bytes += static_cast<int64_t>(p.nbytes());
    const int64_t buckets =
        prepared->synchronizer() != nullptr ? prepared->synchronizer()->bucket_bytes() : 0;
    rest_bytes += param_bytes + buckets;
    peak_bytes += 2 * param_bytes + buckets;  // the gradients live from backward to zero_grad
  }
  std::sort(step_ms.begin(), step_ms.end());
  const double median = step_ms[step_ms.size() / 2];
  double total_ms = 0;
  for (double ms : step_ms) total_ms += ms;
  const double wait_ms = wait_measured * 1e3 / static_cast<double>(step_ms.size());
  if (acc->is_main_process()) {
    std::printf(
        "RESULT processes=%d strategy=%s params=%lld step_ms=%.2f samples_per_s=%.1f "
        "comm_wait_ms=%.2f comm_share=%.3f state_mb=%.2f peak_state_mb=%.2f\n",
        acc->num_processes(), f.strategy.c_str(), static_cast<long long>(params), median,
        static_cast<double>(f.batch * acc->num_processes()) * 1e3 / median, wait_ms,
        wait_ms / (total_ms / static_cast<double>(step_ms.size())),
        static_cast<double>(rest_bytes) / (1 << 20), static_cast<double>(peak_bytes) / (1 << 20));
    std::fflush(stdout);
  }
  return acc->WaitForEveryone();
}

int Drive(const Flags& f, const char* self) {
  const std::string bin = std::filesystem::path(self).parent_path().string();
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::printf(
      "accel-bench-train: llama hidden %lld, %lld layers, batch %lld x %lld tokens per "
      "process, %lld steps, %u cores\n",
      static_cast<long long>(f.hidden), static_cast<long long>(f.layers),
      static_cast<long long>(f.batch), static_cast<long long>(f.seq),
      static_cast<long long>(f.steps), cores);
  double baseline = 0;
  for (absl::string_view p : absl::StrSplit(f.processes, ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(p, &n) || n < 1) {
      std::fprintf(stderr, "accel-bench-train: bad --processes entry '%s'\n",
                   std::string(p).c_str());
      return 1;
    }
    const unsigned threads = std::max(1u, cores / static_cast<unsigned>(n));
    // Data parallel first: the baseline of this process count.
    std::vector<std::string> strategies = {"ddp"};
    if (n > 1) {
      for (absl::string_view s : absl::StrSplit(f.strategies, ',', absl::SkipEmpty())) {
        if (s != "ddp") strategies.emplace_back(s);
      }
    }
    double ddp_ms = 0, ddp_state = 0, ddp_peak = 0;
    for (const std::string& strategy : strategies) {
      std::string cmd = absl::StrFormat(
          "OMP_NUM_THREADS=%u %s/accel-launch --num_processes %d --main_process_port 0 %s "
          "--steps %d --hidden %d --layers %d --batch %d --seq %d --strategy %s",
          threads, bin, n, self, f.steps, f.hidden, f.layers, f.batch, f.seq, strategy);
      FILE* pipe = ::popen(cmd.c_str(), "r");
      if (pipe == nullptr) return 1;
      char line[512];
      std::string result;
      while (std::fgets(line, sizeof(line), pipe) != nullptr) {
        if (std::string(line).rfind("RESULT", 0) == 0) result = line;
      }
      if (::pclose(pipe) != 0 || result.empty()) {
        std::fprintf(stderr, "accel-bench-train: the %d-process %s run failed\n", n,
                     strategy.c_str());
        return 1;
      }
      double samples = 0, ms = 0, state = 0, peak = 0;
      for (absl::string_view kv : absl::StrSplit(result, ' ')) {
        kv = absl::StripSuffix(kv, "\n");
        if (absl::ConsumePrefix(&kv, "samples_per_s=")) (void)absl::SimpleAtod(kv, &samples);
        if (absl::ConsumePrefix(&kv, "step_ms=")) (void)absl::SimpleAtod(kv, &ms);
        if (absl::ConsumePrefix(&kv, "state_mb=")) (void)absl::SimpleAtod(kv, &state);
        if (absl::ConsumePrefix(&kv, "peak_state_mb=")) (void)absl::SimpleAtod(kv, &peak);
      }
      if (n == 1 || baseline == 0) baseline = samples;
      std::printf("%s  %u thread(s) each; %.2fx the samples/s of %s\n",
                  std::string(absl::StripSuffix(result.substr(7), "\n")).c_str(), threads,
                  samples / baseline, n == 1 ? "itself (baseline)" : "1 process");
      if (strategy == "ddp") {
        ddp_ms = ms;
        ddp_state = state;
        ddp_peak = peak;
      } else if (ddp_ms > 0 && ddp_state > 0 && ddp_peak > 0) {
        std::printf(
            "  %s vs data parallel on %d processes: step time %.2fx, state at rest %.2fx, "
            "peak state %.2fx\n",
            strategy.c_str(), n, ms / ddp_ms, state / ddp_state, peak / ddp_peak);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags = Parse(argc, argv);
  if (std::getenv("WORLD_SIZE") == nullptr) return Drive(flags, argv[0]);
  absl::Status status = Rank(flags);
  if (!status.ok()) {
    std::cerr << "accel-bench-train: " << status << "\n";
    return 1;
  }
  return 0;
}
