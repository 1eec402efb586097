// Tensor and pipeline parallel against one process, in one run (issue 36
// item 7): a generated ~1 GiB bfloat16 Llama-family model loaded whole in
// this process (the baseline), then split over 2 ranks by tensor parallel
// (TP 2) and into 2 pipeline stages (PP 2) (this binary started again as
// each rank, gloo over 127.0.0.1). Printed for each: the resident bytes of
// every process after loading (VmRSS), greedy decode tokens/s at batch 1,
// and for the ranks the time in collectives per step. On a 2-core machine
// the cores are the limit (2 ranks share them), so the point is the memory
// per rank and the cost of the collectives, not a speed-up.
//
// Then pipeline micro-batches (--batch B sequences a step, B > 0): PP 2
// with micro-batching off (ACCEL_BENCH_MICRO 1, accel-serve's
// --pipeline_micro_batches 1) and on (2, one per stage; and 4),
// beside one process with one and with two threads at the same batch:
// tokens/s of a prefill step of --prompt tokens per sequence and of the
// decode steps after it. Last, PP 2 with two steps in flight across steps
// (ACCEL_BENCH_IN_FLIGHT 2, accel-serve's --pipeline_batches_in_flight 2):
// the sequences in two groups of B / 2, each step whole.
//
//   build/bin/accel-bench-tensor-parallel [--tokens 32] [--dir /tmp/x] [--bytes 1073741824]
//       [--batch 8] [--prompt 64] [--only_batch 1]
//
// Each process prints one line: "rank R [of N] rss_loaded=BYTES rss=BYTES
// [tok_s=T collective_s_per_step=S]" (PP: the time in step messages and
// in send / recv between the stages), rss after the decode (every weight read
// once, mapped pages included); the baseline is "rank 0 of 1". Under it,
// where those bytes are (/proc/self/smaps): per kind of mapping (shared
// libraries, libtorch, the heap, anonymous memory, the checkpoint) its RSS
// and the part only this process maps, in MB, and the proportional set size;
// ACCEL_BENCH_SMAPS=PREFIX copies the whole smaps to PREFIX.<pid> (and with
// ACCEL_BENCH_PAUSE=S waits S seconds, for a look at /proc/<pid>/pagemap:
// which pages of which tensor are resident). First of
// all, "libtorch only": this binary with libtorch loaded and nothing else,
// the floor every process holds whatever the model.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "bench/bench_util.h"
#include "core/bytes.h"
#include "dist/env.h"
#include "dist/process_group.h"
#include "models/load_model.h"
#include "models/make_model.h"
#include "models/tensor_parallel.h"
#include "tests/testing/multiprocess.h"
#include "tests/testing/process_memory.h"

namespace {

using namespace accel;  // NOLINT: a benchmark's main file

// A line of /proc/self/status in bytes ("VmRSS:", "RssAnon:", "RssFile:").
int64_t StatusBytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == field) {
      int64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
    std::getline(status, key);
  }
  return -1;
}
int64_t ResidentBytes() { return StatusBytes("VmRSS:"); }

// "rss=B anon=B file=B": resident bytes, and those of memory and of files.
std::string Resident() {
  return absl::StrCat("rss=", ResidentBytes(), " anon=", StatusBytes("RssAnon:"),
                      " file=", StatusBytes("RssFile:"));
}

// Where the resident bytes are, from /proc/self/smaps: per kind of mapping
// its resident bytes and the part only this process maps (private), in MB:
// "kind=RSS/PRIVATE ...", then the totals and the proportional set size.
std::string ResidentByMapping() {
  if (const char* copy = std::getenv("ACCEL_BENCH_SMAPS")) {
    // For a closer look: /proc/self/smaps as it is now, to COPY.<pid>.
    std::ifstream smaps("/proc/self/smaps");
    std::ofstream(absl::StrCat(copy, ".", ::getpid())) << smaps.rdbuf();
    if (const char* pause = std::getenv("ACCEL_BENCH_PAUSE")) ::sleep(std::atoi(pause));
  }
  const std::string binary = std::filesystem::read_symlink("/proc/self/exe").string();
  std::map<std::string, std::pair<int64_t, int64_t>> kinds;
  int64_t rss = 0, priv = 0, pss = 0;
  for (const test::Mapping& m : test::ReadMappings()) {
    std::string kind = "other";
    const std::string name = std::filesystem::path(m.path).filename().string();
    if (m.path.empty()) {
      kind = "anonymous";
    } else if (m.path == "[heap]") {
      kind = "heap";
    } else if (m.path == "[stack]") {
      kind = "stack";
    } else if (m.path == binary) {
      kind = "binary";
    } else if (absl::EndsWith(name, ".safetensors")) {
      kind = "checkpoint";
    } else if (absl::StartsWith(name, "libtorch") || absl::StartsWith(name, "libc10")) {
      kind = "libtorch";
    } else if (absl::StrContains(name, ".so")) {
      kind = "libraries";
    }
    kinds[kind].first += m.rss;
    kinds[kind].second += m.private_bytes;
    rss += m.rss;
    priv += m.private_bytes;
    pss += m.pss;
  }
  const auto mb = [](int64_t b) { return absl::StrFormat("%.1f", b / 1e6); };
  std::string out;
  for (const auto& [kind, bytes] : kinds) {
    absl::StrAppend(&out, kind, "=", mb(bytes.first), "/", mb(bytes.second), " ");
  }
  absl::StrAppend(&out, "total=", mb(rss), "/", mb(priv), " pss=", mb(pss));
  return out;
}

// Greedy decode of one sequence at batch 1: tokens/s over `tokens` steps
// after its prompt.
double DecodeTokensPerSecond(models::CausalLM& model, dispatch::DispatchedModel* dispatched,
                             int tokens) {
  c10::InferenceMode inference;
  models::KvBlockStore store(64, 16, static_cast<size_t>(model.config().num_hidden_layers));
  models::KvCache cache;
  cache.store = &store;
  for (int b = 0; b < 64; ++b) cache.block_table.push_back(b);
  std::vector<int64_t> ids = {1, 2, 3, 4, 5, 6, 7, 8};
  int64_t next = 0;
  auto step = [&](const std::vector<int64_t>& in) {
    absl::StatusOr<at::Tensor> logits =
        model.Forward(at::tensor(in, at::kLong), {{&cache, static_cast<int64_t>(in.size())}},
                      models::Logits::kLastOfEach, dispatched);
    if (!logits.ok()) {
      std::fprintf(stderr, "step failed: %s\n", std::string(logits.status().message()).c_str());
      std::exit(1);
    }
    next = logits->argmax(-1)[0].item<int64_t>();
  };
  step(ids);
  const double seconds = bench::Seconds([&] {
    for (int i = 0; i < tokens; ++i) step({next});
  });
  return tokens / seconds;
}

// `batch` sequences together (the pipeline's micro-batches are cut from
// them): tokens/s of kPrefillSteps chunked-prefill steps of `prompt`
// tokens each, and of `tokens` decode steps after them (batch x tokens
// generated); the seconds this rank waited in collectives (step messages,
// send / recv) in each phase.
constexpr int kPrefillSteps = 4;
struct BatchRate {
  double prefill_tok_s = 0, decode_tok_s = 0;
  double prefill_wait_s = 0, decode_wait_s = 0, prefill_s = 0, decode_s = 0;
};
// With `in_flight` M > 1 (PP: vLLM's virtual engines, as accel-serve's
// --pipeline_batches_in_flight runs them), the sequences are M groups of
// batch / M, each stepped by CausalLM::Submit with up to M steps in flight:
// a group's next step is submitted once its previous step's logits are
// back, while the other groups' steps run in the later stages.
BatchRate BatchTokensPerSecond(models::CausalLM& model, dispatch::DispatchedModel* dispatched,
                               int batch, int prompt, int tokens, int in_flight) {
  c10::InferenceMode inference;
  const int64_t block = 16, per_sequence = (kPrefillSteps * prompt + tokens + block) / block + 1;
  models::KvBlockStore store(batch * per_sequence, block,
                             static_cast<size_t>(model.config().num_hidden_layers));
  std::vector<models::KvCache> caches(static_cast<size_t>(batch));
  for (int s = 0; s < batch; ++s) {
    caches[static_cast<size_t>(s)].store = &store;
    for (int64_t b = 0; b < per_sequence; ++b) {
      caches[static_cast<size_t>(s)].block_table.push_back(s * per_sequence + b);
    }
  }
  std::vector<int64_t> next(static_cast<size_t>(batch));
  const int groups = std::max(1, std::min(in_flight, batch));
  // Group g's sequences, [first, end).
  const auto group_range = [&](int g) {
    return std::pair<int, int>(g * batch / groups, (g + 1) * batch / groups);
  };
  const auto submit = [&](int g, int each) {
    const auto [first, end] = group_range(g);
    std::vector<int64_t> ids;
    std::vector<models::SequenceChunk> chunks;
    for (int s = first; s < end; ++s) {
      for (int t = 0; t < each; ++t) {
        ids.push_back(each == 1 ? next[static_cast<size_t>(s)] : 1 + (s * 131 + t * 7) % 1000);
      }
      chunks.push_back({&caches[static_cast<size_t>(s)], each});
    }
    absl::StatusOr<std::unique_ptr<models::PendingLogits>> pending =
        model.Submit(at::tensor(ids, at::kLong), chunks, models::Logits::kLastOfEach, dispatched);
    if (!pending.ok()) {
      std::fprintf(stderr, "step failed: %s\n", std::string(pending.status().message()).c_str());
      std::exit(1);
    }
    return *std::move(pending);
  };
  const auto collect = [&](int g, models::PendingLogits& pending) {
    absl::StatusOr<at::Tensor> logits = pending.Wait();
    if (!logits.ok()) {
      std::fprintf(stderr, "step failed: %s\n", std::string(logits.status().message()).c_str());
      std::exit(1);
    }
    const at::Tensor best = logits->argmax(-1);
    const auto [first, end] = group_range(g);
    for (int s = first; s < end; ++s)
      next[static_cast<size_t>(s)] = best[s - first].item<int64_t>();
  };
  // `steps` steps of every group, up to `groups` in flight.
  const auto run_in_flight = [&](int steps, int each) {
    std::deque<std::pair<int, std::unique_ptr<models::PendingLogits>>> queue;
    std::vector<int> left(static_cast<size_t>(groups), steps);
    for (int g = 0; g < groups; ++g) {
      queue.emplace_back(g, submit(g, each));
      --left[static_cast<size_t>(g)];
    }
    while (!queue.empty()) {
      auto [g, pending] = std::move(queue.front());
      queue.pop_front();
      collect(g, *pending);
      if (left[static_cast<size_t>(g)]-- > 0) queue.emplace_back(g, submit(g, each));
    }
  };
  auto step = [&](int each) {
    std::vector<int64_t> ids;
    std::vector<models::SequenceChunk> chunks;
    for (int s = 0; s < batch; ++s) {
      for (int t = 0; t < each; ++t) {
        ids.push_back(each == 1 ? next[static_cast<size_t>(s)] : 1 + (s * 131 + t * 7) % 1000);
      }
      chunks.push_back({&caches[static_cast<size_t>(s)], each});
    }
    absl::StatusOr<at::Tensor> logits =
        model.Forward(at::tensor(ids, at::kLong), chunks, models::Logits::kLastOfEach, dispatched);
    if (!logits.ok()) {
      std::fprintf(stderr, "step failed: %s\n", std::string(logits.status().message()).c_str());
      std::exit(1);
    }
    const at::Tensor best = logits->argmax(-1);
    for (int s = 0; s < batch; ++s) next[static_cast<size_t>(s)] = best[s].item<int64_t>();
  };
  BatchRate rate;
  double waited = models::TensorParallelCollectiveSeconds();
  rate.prefill_s = bench::Seconds([&] {
    if (groups > 1) return run_in_flight(kPrefillSteps, prompt);
    for (int i = 0; i < kPrefillSteps; ++i) step(prompt);
  });
  rate.prefill_wait_s = models::TensorParallelCollectiveSeconds() - waited;
  rate.prefill_tok_s = batch * prompt * kPrefillSteps / rate.prefill_s;
  waited = models::TensorParallelCollectiveSeconds();
  rate.decode_s = bench::Seconds([&] {
    if (groups > 1) return run_in_flight(tokens, 1);
    for (int i = 0; i < tokens; ++i) step(1);
  });
  rate.decode_wait_s = models::TensorParallelCollectiveSeconds() - waited;
  rate.decode_tok_s = batch * tokens / rate.decode_s;
  return rate;
}

models::ModelLoadOptions CpuLoad() {
  models::ModelLoadOptions options;
  options.device_map = "cpu";
  options.progress = Progress::Style::kSilent;
  return options;
}

// One rank of the split run; prints "rank R rss=B tok_s=T collective_s_per_step=C".
int RunRank(const std::string& dir, int tokens) {
  absl::StatusOr<dist::ProcessEnvironment> env = dist::DetectProcessEnvironment(dist::ProcessEnv());
  if (!env.ok()) return 1;
  dist::ProcessGroupOptions group_options;
  group_options.timeout = absl::Seconds(300);
  absl::StatusOr<std::unique_ptr<dist::ProcessGroup>> group =
      dist::ProcessGroup::Connect(*env, group_options);
  if (!group.ok()) return 1;
  models::ModelLoadOptions load = CpuLoad();
  // ACCEL_BENCH_TP ranks per stage; the rest are pipeline stages.
  const char* tp = std::getenv("ACCEL_BENCH_TP");
  std::unique_ptr<dist::ProcessGroup> stage_group;
  absl::StatusOr<models::TensorParallel> place = models::JoinParallelGroups(
      **group, tp != nullptr ? std::atoi(tp) : (*group)->size(), &stage_group);
  if (!place.ok()) return 1;
  load.tensor_parallel = *place;
  if (const char* micro = std::getenv("ACCEL_BENCH_MICRO")) {
    load.tensor_parallel.pipeline_micro_batches = std::atoi(micro);
  }
  absl::StatusOr<models::LoadedModel> loaded = models::LoadModel(dir, load);
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s\n", std::string(loaded.status().message()).c_str());
    return 1;
  }
  const int64_t rss = ResidentBytes();
  if ((*group)->rank() != 0) {
    const double waited = models::TensorParallelCollectiveSeconds();
    double ran_s = 0;
    absl::Status ran;
    ran_s = bench::Seconds([&] {
      ran = models::RunTensorParallelWorker(*loaded->model, loaded->dispatched.get(), **group);
    });
    // Waiting: for the leader's next step message (the leader sampling, or
    // a step's earlier stages) and for a stage's inputs.
    std::printf(
        "rank %d rss_loaded=%lld %s waiting=%.0f%% of %.1f s\n  rank %d MB rss/private: %s\n",
        (*group)->rank(), static_cast<long long>(rss), Resident().c_str(),
        100 * (models::TensorParallelCollectiveSeconds() - waited) / ran_s, ran_s, (*group)->rank(),
        ResidentByMapping().c_str());
    return ran.ok() ? 0 : 1;
  }
  if (const char* batch = std::getenv("ACCEL_BENCH_BATCH")) {
    // Several sequences a step: the pipeline's micro-batches at work.
    const int64_t micro_before = models::PipelineMicroBatchesRun();
    const char* in_flight = std::getenv("ACCEL_BENCH_IN_FLIGHT");
    const BatchRate rate =
        BatchTokensPerSecond(*loaded->model, loaded->dispatched.get(), std::atoi(batch),
                             std::atoi(std::getenv("ACCEL_BENCH_PROMPT")), tokens,
                             in_flight != nullptr ? std::atoi(in_flight) : 1);
    std::printf(
        "batch %s: rank 0 of %d (tp %d x pp %d, micro-batches %s, steps in flight %s, %s threads) "
        "prefill_tok_s=%.2f (waiting %.0f%%) decode_tok_s=%.2f (waiting %.0f%%) "
        "micro_batches_per_step=%.2f\n",
        batch, (*group)->size(), place->size, place->pipeline_size,
        std::getenv("ACCEL_BENCH_MICRO") != nullptr ? std::getenv("ACCEL_BENCH_MICRO") : "-",
        in_flight != nullptr ? in_flight : "1", std::getenv("OMP_NUM_THREADS"), rate.prefill_tok_s,
        100 * rate.prefill_wait_s / rate.prefill_s, rate.decode_tok_s,
        100 * rate.decode_wait_s / rate.decode_s,
        static_cast<double>(models::PipelineMicroBatchesRun() - micro_before) /
            (tokens + kPrefillSteps));
    std::fflush(stdout);
    return 0;
  }
  const double before = models::TensorParallelCollectiveSeconds();
  const double tok_s = DecodeTokensPerSecond(*loaded->model, loaded->dispatched.get(), tokens);
  const double collective = models::TensorParallelCollectiveSeconds() - before;
  // After decoding every weight has been read: mapped ones count now too.
  std::printf(
      "rank 0 of %d (tp %d x pp %d, %s threads) rss_loaded=%lld %s tok_s=%.3f "
      "collective_s_per_step=%.6f\n  rank 0 MB rss/private: %s\n",
      (*group)->size(), place->size, place->pipeline_size, std::getenv("OMP_NUM_THREADS"),
      static_cast<long long>(rss), Resident().c_str(), tok_s, collective / (tokens + 1),
      ResidentByMapping().c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int tokens = 32;
  int64_t bytes = int64_t{1} << 30;
  std::string dir = "/tmp/accel-bench-tensor-parallel";
  int batch = 8, prompt = 64;
  bool only_batch = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--tokens") tokens = std::atoi(value.c_str());
    if (flag == "--dir") dir = value;
    if (flag == "--bytes") bytes = std::atoll(value.c_str());
    if (flag == "--batch") batch = std::atoi(value.c_str());
    if (flag == "--prompt") prompt = std::atoi(value.c_str());
    if (flag == "--only_batch") only_batch = value == "1" || value == "true";
  }
  if (std::getenv("ACCEL_BENCH_BARE") != nullptr) {
    // The floor every process holds whatever the model: this binary with
    // libtorch loaded and one small bfloat16 product run (its kernels and
    // thread pool started), nothing else.
    const at::Tensor a = at::ones({64, 64}, at::kBFloat16);
    const double sum = at::matmul(a, a).sum().item<double>();
    std::printf("libtorch only (%s threads, %.0f) rss=%lld\n  MB rss/private: %s\n",
                std::getenv("OMP_NUM_THREADS"), sum, static_cast<long long>(ResidentBytes()),
                ResidentByMapping().c_str());
    return 0;
  }
  if (std::getenv("ACCEL_BENCH_RANK_OF") != nullptr) {
    return RunRank(std::getenv("ACCEL_BENCH_DIR"), std::atoi(std::getenv("ACCEL_BENCH_TOKENS")));
  }

  if (!std::filesystem::exists(dir + "/config.json")) {
    models::MakeModelOptions o;
    o.family = "llama";
    o.hidden_size = 1024;
    o.num_heads = 16;
    o.num_kv_heads = 8;
    o.intermediate_size = 2816;
    o.vocab_size = 32000;
    o.dtype = at::kBFloat16;
    o.target_bytes = bytes;
    o.seed = 1;
    absl::StatusOr<models::MadeModel> made = models::MakeModel(dir, o);
    if (!made.ok()) {
      std::fprintf(stderr, "%s\n", std::string(made.status().message()).c_str());
      return 1;
    }
  }
  std::printf("model: %s (bfloat16, %d decode tokens at batch 1)\n", dir.c_str(), tokens);
  // The baseline, in a process of its own so that its resident bytes are its own.
  std::map<std::string, std::string> env = {{"ACCEL_BENCH_RANK_OF", "1"},
                                            {"ACCEL_BENCH_DIR", dir},
                                            {"ACCEL_BENCH_TOKENS", std::to_string(tokens)}};
  bool ok = true;
  if (!only_batch) {
    // One process with one thread and with the machine's two; each rank one thread.
    env["OMP_NUM_THREADS"] = "1";
    std::map<std::string, std::string> bare = env;
    bare["ACCEL_BENCH_BARE"] = "1";
    ok &= test::RunRanks(1, "", bare, 1200)[0] == 0;
    std::vector<int> one = test::RunRanks(1, "", env, 1200);
    env["OMP_NUM_THREADS"] = "2";
    std::vector<int> one_two = test::RunRanks(1, "", env, 1200);
    env["OMP_NUM_THREADS"] = "1";
    env["ACCEL_BENCH_TP"] = "2";
    std::vector<int> two = test::RunRanks(2, "", env, 1200);
    env["ACCEL_BENCH_TP"] = "1";  // two pipeline stages
    std::vector<int> stages = test::RunRanks(2, "", env, 1200);
    std::printf("exit codes: one process %d %d, TP 2 %d %d, PP 2 %d %d\n", one[0], one_two[0],
                two[0], two[1], stages[0], stages[1]);
    ok = one[0] == 0 && one_two[0] == 0 && two[0] == 0 && two[1] == 0 && stages[0] == 0 &&
         stages[1] == 0;
  }
  if (batch > 0) {
    // PP 2 with `batch` sequences a step, micro-batching off
    // (--pipeline_micro_batches 1), on (2: one per stage) and
    // with 4, beside one process (one thread, and the machine's two) at the
    // same batch.
    std::printf("batch: %d sequences, a %d-token prefill each, then %d decode steps\n", batch,
                prompt, tokens);
    env["ACCEL_BENCH_BATCH"] = std::to_string(batch);
    env["ACCEL_BENCH_PROMPT"] = std::to_string(prompt);
    env.erase("ACCEL_BENCH_TP");
    for (const char* threads : {"1", "2"}) {
      env["OMP_NUM_THREADS"] = threads;
      ok &= test::RunRanks(1, "", env, 1200)[0] == 0;
    }
    env["OMP_NUM_THREADS"] = "1";
    env["ACCEL_BENCH_TP"] = "1";
    for (const char* micro : {"1", "2", "4"}) {
      env["ACCEL_BENCH_MICRO"] = micro;
      for (int code : test::RunRanks(2, "", env, 1200)) ok &= code == 0;
    }
    // Steps in flight across steps (--pipeline_batches_in_flight 2): two
    // groups of batch / 2, each step whole (micro-batches 1).
    env["ACCEL_BENCH_MICRO"] = "1";
    env["ACCEL_BENCH_IN_FLIGHT"] = "2";
    for (int code : test::RunRanks(2, "", env, 1200)) ok &= code == 0;
  }
  return ok ? 0 : 1;
}
