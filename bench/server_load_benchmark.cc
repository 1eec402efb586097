// Server load: N concurrent streaming clients (accel.v1.Generation/GenerateStream)
// for T seconds against accel-serve, next to the same server answering one
// request at a time. Per phase: completed requests, generated tokens/s (all
// tokens over the phase's wall time), client-side time to first token and
// inter-token latency p50/p99, errors (non-OK statuses, finish_reason
// cancelled, or streamed tokens that disagree with usage; any makes the exit
// status 1), and the server's RSS after the phase. A warm-up phase runs
// first; the RSS after it is the reference for growth. docs/BENCHMARKS.md.
//
//   build/bin/accel-bench-serve [--clients 16] [--seconds 10] [--max_new_tokens 64]
//       [--model DIR] [--server_args "--max_batch_size=32"] [--load_rounds 1]
//       [--address HOST:PORT]   (an already running server: no RSS)
//
// Without --model it makes a random-weight llama (4 layers, hidden 256,
// context 1024) with accel-make-model in a temporary folder.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "accel/v1/generation.grpc.pb.h"
#include "tests/server/server_process.h"

ABSL_FLAG(std::string, model, "",
          "Model folder to serve; empty: make a random-weight llama (4 layers, hidden 256, "
          "context 1024) with accel-make-model in a temporary folder.");
ABSL_FLAG(int, clients, 16, "Concurrent streaming clients in the load phase.");
ABSL_FLAG(double, seconds, 10, "Length of the baseline phase and of each load phase.");
ABSL_FLAG(int64_t, max_new_tokens, 64, "Tokens each request generates (ignore_eos is set).");
ABSL_FLAG(std::string, prompt,
          "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
          "The prompt of every request.");
ABSL_FLAG(std::string, server_args, "",
          "Extra accel-serve flags, separated by spaces (e.g. \"--max_batch_size=8\").");
ABSL_FLAG(std::string, address, "",
          "HOST:PORT of an already running accel-serve; empty: start one (then RSS is reported).");
ABSL_FLAG(int, load_rounds, 1,
          "How many load phases to run back to back (more than 1 shows whether RSS keeps "
          "growing).");

namespace {

using accel::v1::GenerateRequest;
using accel::v1::GenerateResponse;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct PhaseResult {
  std::string name;
  int64_t requests = 0;
  int64_t tokens = 0;
  double wall_seconds = 0;
  std::vector<double> ttft_ms;
  std::vector<double> itl_ms;
  int64_t errors = 0;
  int64_t prompt_tokens = 0;                // usage.prompt_tokens of a completed request
  std::vector<std::string> error_messages;  // the first few
  std::optional<double> rss_mib;            // after the phase

  double tokens_per_second() const { return static_cast<double>(tokens) / wall_seconds; }
};

// Nearest-rank percentile over all samples.
double Percentile(std::vector<double> samples, double p) {
  if (samples.empty()) return std::nan("");
  std::sort(samples.begin(), samples.end());
  size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(samples.size())));
  rank = std::clamp<size_t>(rank, 1, samples.size());
  return samples[rank - 1];
}

// VmRSS of `pid` in MiB, or nullopt.
std::optional<double> RssMib(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) != 0) continue;
    std::vector<absl::string_view> parts =
        absl::StrSplit(line.substr(6), ' ', absl::SkipWhitespace());
    int64_t kib = 0;
    if (!parts.empty() && absl::SimpleAtoi(parts[0], &kib))
      return static_cast<double>(kib) / 1024.0;
  }
  return std::nullopt;
}

// One client: GenerateStream requests back to back until `end`; a request
// started before `end` runs to its finish.
void RunClient(accel::v1::Generation::Stub* stub, const GenerateRequest& request,
               Clock::time_point end, absl::Duration call_timeout, PhaseResult* out,
               absl::Mutex* mu) {
  PhaseResult mine;
  while (Clock::now() < end) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(call_timeout));
    const Clock::time_point start = Clock::now();
    std::unique_ptr<grpc::ClientReader<GenerateResponse>> reader =
        stub->GenerateStream(&context, request);
    GenerateResponse chunk;
    std::optional<Clock::time_point> last;
    int64_t tokens = 0;
    int64_t generated = -1;  // usage.generated_tokens of the last chunk
    accel::v1::FinishReason finish = accel::v1::FINISH_REASON_UNSPECIFIED;
    while (reader->Read(&chunk)) {
      const Clock::time_point now = Clock::now();
      const int n = chunk.token_ids_size();
      if (chunk.finish_reason() != accel::v1::FINISH_REASON_UNSPECIFIED) {
        finish = chunk.finish_reason();
        mine.prompt_tokens = chunk.usage().prompt_tokens();
        generated = chunk.usage().generated_tokens();
      }
      if (n == 0) continue;
      if (!last) {
        // Tokens after the first in this chunk have no gap to divide: none recorded.
        mine.ttft_ms.push_back(Ms(now - start));
      } else {
        const double gap = Ms(now - *last) / n;
        for (int i = 0; i < n; ++i) mine.itl_ms.push_back(gap);
      }
      last = now;
      tokens += n;
    }
    grpc::Status status = reader->Finish();
    if (status.ok() && finish == accel::v1::FINISH_REASON_CANCELLED) {
      status = grpc::Status(grpc::StatusCode::ABORTED, "finish_reason cancelled");
    } else if (status.ok() && generated != tokens) {
      status = grpc::Status(grpc::StatusCode::DATA_LOSS,
                            absl::StrCat("streamed ", tokens, " tokens, usage says ", generated));
    }
    if (!status.ok()) {
      ++mine.errors;
      if (mine.error_messages.size() < 3) {
        mine.error_messages.push_back(absl::StrCat("code ", static_cast<int>(status.error_code()),
                                                   ": ", status.error_message()));
      }
      continue;
    }
    ++mine.requests;
    mine.tokens += tokens;
  }
  absl::MutexLock lock(mu);
  out->requests += mine.requests;
  out->tokens += mine.tokens;
  out->errors += mine.errors;
  if (mine.prompt_tokens > 0) out->prompt_tokens = mine.prompt_tokens;
  out->ttft_ms.insert(out->ttft_ms.end(), mine.ttft_ms.begin(), mine.ttft_ms.end());
  out->itl_ms.insert(out->itl_ms.end(), mine.itl_ms.begin(), mine.itl_ms.end());
  for (std::string& m : mine.error_messages) {
    if (out->error_messages.size() < 5) out->error_messages.push_back(std::move(m));
  }
}

PhaseResult RunPhase(const std::string& name, accel::v1::Generation::Stub* stub,
                     const GenerateRequest& request, int clients, double seconds) {
  PhaseResult result;
  result.name = name;
  absl::Mutex mu;
  const absl::Duration call_timeout = absl::Seconds(std::max(120.0, 10 * seconds));
  const Clock::time_point start = Clock::now();
  const Clock::time_point end =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(clients));
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back(RunClient, stub, std::cref(request), end, call_timeout, &result, &mu);
  }
  for (std::thread& t : threads) t.join();
  result.wall_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

std::string SelfDir() {
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::string() : exe.parent_path().string();
}

std::string Fmt(double v, const char* format = "%.1f") {
  if (std::isnan(v)) return "-";
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), format, v);
  return buffer;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "N concurrent streaming clients against accel-serve, next to one request at a time.\n"
      "  accel-bench-serve [--clients 16] [--seconds 10] [--model DIR] [--address HOST:PORT]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "accel-bench-serve: unexpected argument \"%s\"\n", rest[1]);
    return 2;
  }
  const int clients = absl::GetFlag(FLAGS_clients);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const int64_t max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  const int load_rounds = absl::GetFlag(FLAGS_load_rounds);
  if (clients < 1 || seconds <= 0 || max_new_tokens < 1 || load_rounds < 1) {
    std::fprintf(stderr,
                 "accel-bench-serve: --clients, --seconds, --max_new_tokens and --load_rounds "
                 "must be positive\n");
    return 2;
  }
  // server_process.h finds accel-serve and accel-make-model in $ACCEL_BIN_DIR:
  // default to the folder this binary is in.
  if (std::getenv("ACCEL_BIN_DIR") == nullptr) {
    const std::string self = SelfDir();
    if (!self.empty()) setenv("ACCEL_BIN_DIR", self.c_str(), 1);
  }

  std::unique_ptr<accel::testing::ServerProcess> server;
  std::shared_ptr<grpc::Channel> channel;
  std::string model_dir = absl::GetFlag(FLAGS_model);
  std::string made_root;
  if (absl::GetFlag(FLAGS_address).empty()) {
    if (model_dir.empty()) {
      char pattern[] = "/tmp/accel-bench-serve-XXXXXX";
      if (mkdtemp(pattern) == nullptr) {
        std::perror("mkdtemp");
        return 1;
      }
      made_root = pattern;
      model_dir = made_root + "/model";
      const std::string command = absl::StrCat(
          accel::testing::BinDir(), "/accel-make-model ", model_dir,
          " --family llama --num_layers 4 --hidden_size 256 --num_heads 4 --num_kv_heads 2"
          " --max_position_embeddings 1024 --seed 1 > /dev/null");
      if (accel::testing::RunCommand(command) != 0) {
        std::fprintf(stderr, "accel-bench-serve: failed: %s\n", command.c_str());
        return 1;
      }
    }
    std::vector<std::string> args =
        absl::StrSplit(absl::GetFlag(FLAGS_server_args), ' ', absl::SkipWhitespace());
    auto started = accel::testing::ServerProcess::Start(model_dir, args, absl::Seconds(300));
    if (!started.ok()) {
      std::fprintf(stderr, "accel-bench-serve: %s\n", started.status().ToString().c_str());
      return 1;
    }
    server = *std::move(started);
    channel = server->Channel();
    std::printf("server: accel-serve pid %d on %s, model %s\n", static_cast<int>(server->pid()),
                server->address().c_str(), model_dir.c_str());
  } else {
    channel = grpc::CreateChannel(absl::GetFlag(FLAGS_address), grpc::InsecureChannelCredentials());
    std::printf("server: %s (not started here: no RSS)\n", absl::GetFlag(FLAGS_address).c_str());
  }
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    std::fprintf(stderr, "accel-bench-serve: cannot connect to the server\n");
    return 1;
  }
  auto stub = accel::v1::Generation::NewStub(channel);
  auto rss = [&]() -> std::optional<double> {
    return server ? RssMib(server->pid()) : std::nullopt;
  };

  GenerateRequest request;
  request.set_prompt(absl::GetFlag(FLAGS_prompt));
  request.set_max_new_tokens(max_new_tokens);
  request.set_ignore_eos(true);  // every request generates max_new_tokens
  std::printf(
      "clients %d, %.1f s per phase, max_new_tokens %lld (ignore_eos, greedy), %u cores here\n",
      clients, seconds, static_cast<long long>(max_new_tokens),
      std::max(1u, std::thread::hardware_concurrency()));
  std::fflush(stdout);

  std::vector<PhaseResult> phases;
  PhaseResult ready;
  ready.name = "(ready, before warm-up)";
  ready.rss_mib = rss();
  // Warm-up: the load pattern for a short while, so the batch sizes the load
  // phase reaches have been allocated once.
  PhaseResult warmup = RunPhase("warm-up", stub.get(), request, clients, std::min(seconds, 3.0));
  warmup.rss_mib = rss();
  phases.push_back(std::move(warmup));
  PhaseResult baseline = RunPhase("baseline (1 client)", stub.get(), request, 1, seconds);
  baseline.rss_mib = rss();
  phases.push_back(std::move(baseline));
  for (int round = 0; round < load_rounds; ++round) {
    std::string name = absl::StrCat("load (", clients, " clients)");
    if (load_rounds > 1) absl::StrAppend(&name, " #", round + 1);
    PhaseResult load = RunPhase(name, stub.get(), request, clients, seconds);
    load.rss_mib = rss();
    phases.push_back(std::move(load));
  }

  std::printf("prompt: %lld tokens\n", static_cast<long long>(phases[0].prompt_tokens));
  std::printf(
      "\n| phase | requests | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors | RSS MiB "
      "after |\n|---|---|---|---|---|---|---|\n");
  std::printf("| %s | | | | | | %s |\n", ready.name.c_str(),
              ready.rss_mib ? Fmt(*ready.rss_mib).c_str() : "-");
  int64_t errors = 0;
  for (const PhaseResult& p : phases) {
    errors += p.errors;
    std::printf("| %s | %lld | %s | %s / %s | %s / %s | %lld | %s |\n", p.name.c_str(),
                static_cast<long long>(p.requests), Fmt(p.tokens_per_second()).c_str(),
                Fmt(Percentile(p.ttft_ms, 50)).c_str(), Fmt(Percentile(p.ttft_ms, 99)).c_str(),
                Fmt(Percentile(p.itl_ms, 50), "%.2f").c_str(),
                Fmt(Percentile(p.itl_ms, 99), "%.2f").c_str(), static_cast<long long>(p.errors),
                p.rss_mib ? Fmt(*p.rss_mib).c_str() : "-");
  }
  const PhaseResult& base = phases[1];
  const double base_rate = base.tokens_per_second();
  for (size_t i = 2; i < phases.size(); ++i) {
    const PhaseResult& p = phases[i];
    std::printf(
        "\n%s: %sx the baseline's tokens/s", p.name.c_str(),
        Fmt(base_rate > 0 ? p.tokens_per_second() / base_rate : std::nan(""), "%.2f").c_str());
  }
  std::printf("\n");
  if (phases[0].rss_mib && phases.back().rss_mib) {
    const double reference = *phases[0].rss_mib;
    std::printf("RSS growth from after warm-up (%.1f MiB):", reference);
    for (size_t i = 1; i < phases.size(); ++i) {
      std::printf(" %s %+.1f MiB;", phases[i].name.c_str(), *phases[i].rss_mib - reference);
    }
    std::printf("\n");
  }
  for (const PhaseResult& p : phases) {
    for (const std::string& m : p.error_messages) {
      std::fprintf(stderr, "accel-bench-serve: %s: %s\n", p.name.c_str(), m.c_str());
    }
  }

  int exit_code = 0;
  if (errors > 0) {
    std::fprintf(stderr, "accel-bench-serve: %lld errors (must be 0)\n",
                 static_cast<long long>(errors));
    exit_code = 1;
  }
  if (server) {
    server->Signal(SIGTERM);
    const std::optional<int> code = server->Wait(absl::Seconds(60));
    if (code != 0) {
      std::fprintf(stderr, "accel-bench-serve: accel-serve did not exit 0 on SIGTERM\n%s",
                   server->Stderr().c_str());
      exit_code = 1;
    }
  }
  if (!made_root.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(made_root, ignored);
  }
  return exit_code;
}
