// Server load: concurrent streaming clients (accel.v1.Generation/GenerateStream)
// against accel-serve, each phase next to a baseline measured in the same run.
//
// Client phases: one client (one request at a time, the baseline), then one
// phase of T seconds per count in --clients. Per phase: completed requests,
// generated tokens/s (all tokens over the phase's wall time) and its multiple
// of the 1-client figure, client-side time to first token and inter-token
// latency p50/p99, the server's prefix-cache hit rate and preemptions over the
// phase (its /metrics), errors (non-OK statuses, finish_reason cancelled,
// usage that disagrees with what was sent or streamed; any makes the exit
// status 1), and the server's RSS after the phase.
//
// Prompts are token ids (input_ids), so their lengths are exact: each request
// has --prompt_tokens random ids of its own, after a --system_prompt_tokens
// system prompt shared by every request. With a system prompt, the client
// phases run twice: on a server with prefix caching (the default) and on one
// with --enable_prefix_caching=false.
//
// --long_prompt_tokens N: --decoders clients decode alone, then beside one
// client sending N-token prompts, on a server with chunked prefill
// (--max_num_batched_tokens) and on one reading whole prompts (0); it prints
// the decoders' ITL p99 with the neighbour over without it.
//
// Each server gets a warm-up phase first; RSS growth is counted from after it.
// docs/BENCHMARKS.md.
//
//   build/bin/accel-bench-serve [--clients 1,4,16] [--seconds 10] [--max_new_tokens 64]
//       [--model DIR | --model_size small|500mb-f32|500mb-bf16]
//       [--server_args "--max_batch_size=32"] [--prompt_tokens 48]
//       [--system_prompt_tokens 1000] [--long_prompt_tokens 4096 --decoders 4]
//       [--address HOST:PORT]   (an already running server: no RSS, no metrics)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "accel/v1/generation.grpc.pb.h"
#include "tests/server/server_process.h"

ABSL_FLAG(std::string, model, "", "Model folder to serve; empty: make one (--model_size).");
ABSL_FLAG(std::string, model_size, "small",
          "Without --model, the random-weight llama to make with accel-make-model in a "
          "temporary folder: small (4 layers, hidden 256, vocabulary 512, context 1024, "
          "float32: 12 MiB); 500mb-f32 (6 layers, hidden 1024, 16 heads, 4 key/value heads, "
          "vocabulary 32000, context 8192, float32: 527 MB) or 500mb-bf16 (the same with 18 "
          "layers in bfloat16: 528 MB), so that reading the weights dominates a step.");
ABSL_FLAG(std::vector<std::string>, clients, {"16"},
          "Client counts, one load phase each (e.g. 1,4,16,64), after the 1-client baseline.");
ABSL_FLAG(double, seconds, 10, "Length of each phase (a request started in it runs to its end).");
ABSL_FLAG(int64_t, max_new_tokens, 64, "Tokens each request generates (ignore_eos is set).");
ABSL_FLAG(int64_t, prompt_tokens, 48,
          "Each request's own prompt: this many random token ids, new for every request.");
ABSL_FLAG(int64_t, system_prompt_tokens, 0,
          "> 0: every prompt starts with the same system prompt of this many token ids, and the "
          "client phases run again on a server with --enable_prefix_caching=false.");
ABSL_FLAG(int64_t, long_prompt_tokens, 0,
          "> 0: the long-prompt mix: --decoders clients alone, then beside one client sending "
          "prompts of this many tokens, with chunked prefill on and off.");
ABSL_FLAG(int, decoders, 4, "Decoding clients in the long-prompt mix (no system prompt).");
ABSL_FLAG(int64_t, long_max_new_tokens, 4, "max_new_tokens of the long-prompt client.");
ABSL_FLAG(int64_t, max_num_batched_tokens, 64,
          "accel-serve's --max_num_batched_tokens for the mix with chunked prefill (the other "
          "server gets 0: whole prompts).");
ABSL_FLAG(std::string, server_args, "",
          "Extra accel-serve flags for every server, separated by spaces (e.g. "
          "\"--max_batch_size=64\").");
ABSL_FLAG(std::string, address, "",
          "HOST:PORT of an already running accel-serve; empty: start servers (RSS and metrics "
          "are then reported).");
ABSL_FLAG(std::string, protocol, "grpc",
          "grpc | http | both: the clients use accel.v1 GenerateStream, the OpenAI-compatible "
          "HTTP API (POST /v1/completions with stream: true, server-sent events; the server is "
          "started with --http_port), or both, one after the other on the same server.");
ABSL_FLAG(int, load_rounds, 1,
          "How many times each load phase runs back to back (more than 1 shows whether RSS "
          "keeps growing).");

namespace {

using accel::testing::ServerProcess;
using accel::v1::GenerateRequest;
using accel::v1::GenerateResponse;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Random prompt ids are drawn from [kFirstId, vocab_size - 3]: clear of the
// special ids at either end of a vocabulary (accel-make-model puts bos and eos
// at the top, Llama's tokenizers at 0-2). Set once from GetModelInfo.
constexpr int64_t kFirstId = 3;
int64_t g_last_id = 258;
// Seeds the random ids of each request: no two requests share them.
std::atomic<uint64_t> g_next_request{1};

void AppendRandomIds(int64_t n, google::protobuf::RepeatedField<int64_t>* ids) {
  std::mt19937_64 rng(g_next_request.fetch_add(1));
  std::uniform_int_distribution<int64_t> id(kFirstId, g_last_id);
  for (int64_t i = 0; i < n; ++i) ids->Add(id(rng));
}

struct PhaseResult {
  int64_t requests = 0;
  int64_t tokens = 0;
  double wall_seconds = 0;  // from the phase's start to the group's last client's end
  std::vector<double> ttft_ms;
  std::vector<double> itl_ms;
  int64_t errors = 0;
  int64_t prompt_tokens = 0;                // usage.prompt_tokens of a completed request
  std::vector<std::string> error_messages;  // the first few

  double tokens_per_second() const { return static_cast<double>(tokens) / wall_seconds; }
};

// Clients that send the same kind of request: `fixed` ids (the system
// prompt), then `fresh` random ids new to each request.
struct Group {
  int clients = 1;
  std::vector<int64_t> fixed;
  int64_t fresh = 0;
  int64_t max_new_tokens = 1;
  PhaseResult result;
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

// One client of `group`: GenerateStream requests back to back until `end`; a
// request started before `end` runs to its finish.
// Adds one client's figures to the phase's (shared by the clients).
void AddClientResult(PhaseResult& mine, Clock::time_point begin, PhaseResult* out,
                     absl::Mutex* mu) {
  const double wall = std::chrono::duration<double>(Clock::now() - begin).count();
  absl::MutexLock lock(mu);
  out->wall_seconds = std::max(out->wall_seconds, wall);
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

void RunClient(accel::v1::Generation::Stub* stub, const Group* group, Clock::time_point begin,
               Clock::time_point end, absl::Duration call_timeout, PhaseResult* out,
               absl::Mutex* mu) {
  PhaseResult mine;
  while (Clock::now() < end) {
    GenerateRequest request;
    request.set_max_new_tokens(group->max_new_tokens);
    request.set_ignore_eos(true);  // every request generates max_new_tokens
    auto* ids = request.mutable_input_ids()->mutable_ids();
    ids->Reserve(static_cast<int>(group->fixed.size() + group->fresh));
    ids->Add(group->fixed.begin(), group->fixed.end());
    AppendRandomIds(group->fresh, ids);
    const int64_t sent = ids->size();

    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(call_timeout));
    const Clock::time_point start = Clock::now();
    std::unique_ptr<grpc::ClientReader<GenerateResponse>> reader =
        stub->GenerateStream(&context, request);
    GenerateResponse chunk;
    std::optional<Clock::time_point> last;
    int64_t tokens = 0;
    int64_t generated = -1;  // usage of the last chunk
    int64_t prompt = -1;
    accel::v1::FinishReason finish = accel::v1::FINISH_REASON_UNSPECIFIED;
    while (reader->Read(&chunk)) {
      const Clock::time_point now = Clock::now();
      const int n = chunk.token_ids_size();
      if (chunk.finish_reason() != accel::v1::FINISH_REASON_UNSPECIFIED) {
        finish = chunk.finish_reason();
        prompt = chunk.usage().prompt_tokens();
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
    } else if (status.ok() && (generated != tokens || generated != group->max_new_tokens)) {
      status = grpc::Status(grpc::StatusCode::DATA_LOSS,
                            absl::StrCat("streamed ", tokens, " tokens, usage says ", generated,
                                         ", max_new_tokens ", group->max_new_tokens));
    } else if (status.ok() && prompt != sent) {
      status = grpc::Status(grpc::StatusCode::DATA_LOSS,
                            absl::StrCat("sent ", sent, " prompt ids, usage says ", prompt));
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
    mine.prompt_tokens = prompt;
  }
  AddClientResult(mine, begin, out, mu);
}

// The protocol the clients of the phases now running use, and the server's
// HTTP port (--protocol http/both).
std::string g_protocol = "grpc";
int g_http_port = 0;

// RunClient over the OpenAI-compatible HTTP API: POST /v1/completions with
// the same ids as a token-id prompt, stream: true, on a connection of its
// own per request. TTFT: the first event with text; the tokens: the usage
// event's completion_tokens; the ITL: the time from the first to the last
// event over the tokens after the first.
void RunHttpClient(const Group* group, Clock::time_point begin, Clock::time_point end,
                   PhaseResult* out, absl::Mutex* mu) {
  PhaseResult mine;
  while (Clock::now() < end) {
    google::protobuf::RepeatedField<int64_t> ids;
    ids.Add(group->fixed.begin(), group->fixed.end());
    AppendRandomIds(group->fresh, &ids);
    const int64_t sent = ids.size();
    const std::string body = absl::StrCat(
        "{\"prompt\": [", absl::StrJoin(ids, ","), "], \"max_tokens\": ", group->max_new_tokens,
        ", \"ignore_eos\": true, \"temperature\": 0, \"stream\": true, ",
        "\"stream_options\": {\"include_usage\": true}}");
    const Clock::time_point start = Clock::now();
    std::string error;
    int64_t generated = -1, prompt = -1;
    std::optional<Clock::time_point> first, last;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(g_http_port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      error = "cannot connect to the HTTP port";
    } else {
      const std::string request = absl::StrCat(
          "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
          "Content-Type: application/json\r\nContent-Length: ",
          body.size(), "\r\n\r\n", body);
      if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
          static_cast<ssize_t>(request.size())) {
        error = "send failed";
      }
      std::string buffer;
      size_t scanned = 0;
      bool done = false;
      char chunk[16384];
      while (error.empty() && !done) {
        const ssize_t n = recv(fd, chunk, sizeof(chunk), 0);
        if (n <= 0) break;
        const Clock::time_point now = Clock::now();
        buffer.append(chunk, static_cast<size_t>(n));
        size_t at;
        while ((at = buffer.find("data: ", scanned)) != std::string::npos) {
          const size_t stop = buffer.find("\n\n", at);
          if (stop == std::string::npos) break;
          const std::string event = buffer.substr(at + 6, stop - at - 6);
          scanned = stop + 2;
          if (event == "[DONE]") {
            done = true;
            break;
          }
          if (event.find("\"error\"") != std::string::npos) {
            error = event;
            break;
          }
          if (event.find("\"text\":\"\"") == std::string::npos &&
              event.find("\"text\"") != std::string::npos) {
            if (!first) first = now;
            last = now;
          }
          const size_t usage = event.find("\"completion_tokens\":");
          if (usage != std::string::npos) {
            generated = std::atoll(event.c_str() + usage + 20);
            const size_t p = event.find("\"prompt_tokens\":");
            if (p != std::string::npos) prompt = std::atoll(event.c_str() + p + 16);
          }
        }
      }
      if (error.empty() && !done) error = "the stream ended before [DONE]";
      if (error.empty() && buffer.rfind("HTTP/1.1 200", 0) != 0) {
        error = buffer.substr(0, 200);
      }
    }
    close(fd);
    if (error.empty() && generated != group->max_new_tokens) {
      error = absl::StrCat("usage says ", generated, " tokens, max_tokens ", group->max_new_tokens);
    } else if (error.empty() && prompt != sent) {
      error = absl::StrCat("sent ", sent, " prompt ids, usage says ", prompt);
    }
    if (!error.empty()) {
      ++mine.errors;
      if (mine.error_messages.size() < 3) mine.error_messages.push_back("http: " + error);
      continue;
    }
    if (first) {
      mine.ttft_ms.push_back(Ms(*first - start));
      if (generated > 1) {
        const double gap = Ms(*last - *first) / static_cast<double>(generated - 1);
        for (int64_t i = 1; i < generated; ++i) mine.itl_ms.push_back(gap);
      }
    }
    ++mine.requests;
    mine.tokens += generated;
    mine.prompt_tokens = prompt;
  }
  AddClientResult(mine, begin, out, mu);
}

// Runs every group's clients at once for `seconds`; each group's figures go
// to its own result.
void RunGroups(accel::v1::Generation::Stub* stub, const std::vector<Group*>& groups,
               double seconds) {
  absl::Mutex mu;
  const absl::Duration call_timeout = absl::Seconds(std::max(3600.0, 10 * seconds));
  const Clock::time_point start = Clock::now();
  const Clock::time_point end =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  std::vector<std::thread> threads;
  for (Group* g : groups) {
    g->result = PhaseResult();
    for (int i = 0; i < g->clients; ++i) {
      if (g_protocol == "http") {
        threads.emplace_back(RunHttpClient, g, start, end, &g->result, &mu);
      } else {
        threads.emplace_back(RunClient, stub, g, start, end, call_timeout, &g->result, &mu);
      }
    }
  }
  for (std::thread& t : threads) t.join();
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

// The server's counters the table reports, from its /metrics.
struct Counters {
  double prefix_queries = 0;
  double prefix_hits = 0;
  double preemptions = 0;
  // The engine's steps (accel_step_duration_seconds, accel_iteration_tokens):
  // what a phase's time went to on the server's side of the stream.
  double steps = 0;
  double step_seconds = 0;
  double step_tokens = 0;
};

// One server the phases run against: started here with `flags`, or the one
// at --address (no RSS, no metrics).
class Target {
 public:
  std::string flags;  // what this server adds to --server_args, for the table
  std::unique_ptr<ServerProcess> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<accel::v1::Generation::Stub> stub;
  std::optional<double> rss_after_warmup;

  std::optional<double> Rss() const {
    return server ? RssMib(server->pid()) : std::optional<double>();
  }
  std::optional<Counters> Read() const {
    if (!server) return std::nullopt;
    absl::StatusOr<std::string> text = server->Metrics();
    if (!text.ok()) return std::nullopt;
    Counters c;
    using accel::testing::MetricValue;
    c.prefix_queries = MetricValue(*text, "accel_prefix_cache_queries_total").value_or(0);
    c.prefix_hits = MetricValue(*text, "accel_prefix_cache_hits_total").value_or(0);
    c.preemptions = MetricValue(*text, "accel_num_preemptions_total").value_or(0);
    c.steps = MetricValue(*text, "accel_step_duration_seconds_count").value_or(0);
    c.step_seconds = MetricValue(*text, "accel_step_duration_seconds_sum").value_or(0);
    c.step_tokens = MetricValue(*text, "accel_iteration_tokens_sum").value_or(0);
    return c;
  }
};

// Starts accel-serve on `model_dir` with --server_args then `flags`, or
// connects to --address; nullptr after printing why not.
std::unique_ptr<Target> Connect(const std::string& model_dir, const std::string& flags) {
  auto target = std::make_unique<Target>();
  target->flags = flags.empty() ? "(defaults)" : flags;
  const std::string address = absl::GetFlag(FLAGS_address);
  if (address.empty()) {
    std::vector<std::string> args =
        absl::StrSplit(absl::GetFlag(FLAGS_server_args), ' ', absl::SkipWhitespace());
    for (absl::string_view f : absl::StrSplit(flags, ' ', absl::SkipWhitespace()))
      args.emplace_back(f);
    if (absl::GetFlag(FLAGS_protocol) != "grpc") {
      // A free port for the HTTP API: the kernel's pick, released.
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr = {};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      socklen_t length = sizeof(addr);
      bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
      close(fd);
      args.push_back(absl::StrCat("--http_port=", ntohs(addr.sin_port)));
    }
    auto started = ServerProcess::Start(model_dir, args, absl::Seconds(300));
    if (!started.ok()) {
      std::fprintf(stderr, "accel-bench-serve: %s\n", started.status().ToString().c_str());
      return nullptr;
    }
    target->server = *std::move(started);
    g_http_port = target->server->http_port();
    target->channel = target->server->Channel();
    std::fprintf(stderr, "accel-bench-serve: accel-serve pid %d on %s, %s\n",
                 static_cast<int>(target->server->pid()), target->server->address().c_str(),
                 args.empty() ? "default flags" : absl::StrJoin(args, " ").c_str());
  } else {
    target->channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  }
  if (!target->channel->WaitForConnected(std::chrono::system_clock::now() +
                                         std::chrono::seconds(10))) {
    std::fprintf(stderr, "accel-bench-serve: cannot connect to the server\n");
    return nullptr;
  }
  target->stub = accel::v1::Generation::NewStub(target->channel);
  return target;
}

// SIGTERM, then false (after printing its stderr) unless it exits 0.
bool Stop(Target& target) {
  if (!target.server) return true;
  target.server->Signal(SIGTERM);
  const std::optional<int> code = target.server->Wait(absl::Seconds(60));
  if (code == 0) return true;
  std::fprintf(stderr, "accel-bench-serve: accel-serve did not exit 0 on SIGTERM\n%s",
               target.server->Stderr().c_str());
  return false;
}

// One table row per phase, printed as it completes.
class Report {
 public:
  Report() {
    std::printf(
        "\n| server flags | phase | clients | requests | prompt | tok/s | x base | TTFT p50 / p99 "
        "ms | ITL p50 / p99 ms | prefix hits | preempted | errors | RSS MiB (vs warm-up) "
        "| steps: count, mean ms, tokens "
        "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        "\n");
    std::fflush(stdout);
  }

  // Runs `groups` on `target` for `seconds` and prints a row per group:
  // `names[i]` for groups[i]; `bases[i]`, when set, is the tok/s the
  // "x base" column divides by.
  void Phase(Target& target, const std::vector<std::string>& names,
             const std::vector<Group*>& groups, const std::vector<std::optional<double>>& bases,
             double seconds) {
    const std::optional<Counters> before = target.Read();
    RunGroups(target.stub.get(), groups, seconds);
    const std::optional<Counters> after = target.Read();
    const std::optional<double> rss = target.Rss();
    std::string hits = "-", preempted = "-", steps = "-";
    if (before && after) {
      // The engine's steps in the phase: how many, their mean time and
      // tokens (count x mean against the phase's seconds: the rest the
      // engine waited for requests or spent between steps).
      const double count = after->steps - before->steps;
      if (count > 0) {
        steps =
            absl::StrCat(static_cast<int64_t>(count), ", ",
                         Fmt(1e3 * (after->step_seconds - before->step_seconds) / count, "%.2f"),
                         ", ", Fmt((after->step_tokens - before->step_tokens) / count));
      }
      const double queries = after->prefix_queries - before->prefix_queries;
      if (queries > 0) {
        hits =
            absl::StrCat(Fmt(100.0 * (after->prefix_hits - before->prefix_hits) / queries), " %");
      }
      preempted = absl::StrCat(static_cast<int64_t>(after->preemptions - before->preemptions));
    }
    std::string rss_text = "-";
    if (rss) {
      rss_text = Fmt(*rss);
      if (target.rss_after_warmup) {
        absl::StrAppend(&rss_text, " (", Fmt(*rss - *target.rss_after_warmup, "%+.1f"), ")");
      }
    }
    for (size_t i = 0; i < groups.size(); ++i) {
      const PhaseResult& p = groups[i]->result;
      errors_ += p.errors;
      for (const std::string& m : p.error_messages) {
        messages_.push_back(absl::StrCat(target.flags, ", ", names[i], ": ", m));
      }
      const std::string times =
          bases[i] && *bases[i] > 0 ? Fmt(p.tokens_per_second() / *bases[i], "%.2fx") : "-";
      std::printf(
          "| %s | %s | %d | %lld | %lld | %s | %s | %s / %s | %s / %s | %s | %s | %lld | "
          "%s | %s |\n",
          target.flags.c_str(), names[i].c_str(), groups[i]->clients,
          static_cast<long long>(p.requests), static_cast<long long>(p.prompt_tokens),
          Fmt(p.tokens_per_second()).c_str(), times.c_str(), Fmt(Percentile(p.ttft_ms, 50)).c_str(),
          Fmt(Percentile(p.ttft_ms, 99)).c_str(), Fmt(Percentile(p.itl_ms, 50), "%.2f").c_str(),
          Fmt(Percentile(p.itl_ms, 99), "%.2f").c_str(), hits.c_str(), preempted.c_str(),
          static_cast<long long>(p.errors), rss_text.c_str(), steps.c_str());
    }
    std::fflush(stdout);
  }

  // A warm-up phase: the row, and the RSS that later rows are compared with.
  void WarmUp(Target& target, Group* group) {
    Phase(target, {"warm-up"}, {group}, {std::nullopt},
          std::min(absl::GetFlag(FLAGS_seconds), 3.0));
    target.rss_after_warmup = target.Rss();
  }

  int64_t errors() const { return errors_; }
  const std::vector<std::string>& messages() const { return messages_; }

 private:
  int64_t errors_ = 0;
  std::vector<std::string> messages_;
};

// The client phases on one server: the 1-client baseline, then each count.
// Returns the tok/s of each count (the baseline first).
std::vector<double> ClientPhases(Report& report, Target& target, const std::vector<int>& counts,
                                 const std::vector<int64_t>& system_prompt) {
  Group group;
  group.fixed = system_prompt;
  group.fresh = absl::GetFlag(FLAGS_prompt_tokens);
  group.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  group.clients = *std::max_element(counts.begin(), counts.end());
  report.WarmUp(target, &group);
  group.clients = 1;
  report.Phase(target, {g_protocol + " baseline (1 client)"}, {&group}, {std::nullopt}, seconds);
  const double base = group.result.tokens_per_second();
  std::vector<double> rates = {base};
  for (int clients : counts) {
    if (clients == 1) continue;
    group.clients = clients;
    for (int round = 0; round < absl::GetFlag(FLAGS_load_rounds); ++round) {
      std::string name = absl::StrCat(g_protocol, " load (", clients, " clients)");
      if (absl::GetFlag(FLAGS_load_rounds) > 1) absl::StrAppend(&name, " #", round + 1);
      report.Phase(target, {name}, {&group}, {base}, seconds);
    }
    rates.push_back(group.result.tokens_per_second());
  }
  return rates;
}

// The decoders' ITL p99 alone and beside the long-prompt client, on one server.
struct MixResult {
  double alone_p99 = std::nan("");
  double mixed_p99 = std::nan("");
};

MixResult MixPhases(Report& report, Target& target) {
  Group decoders;
  decoders.clients = absl::GetFlag(FLAGS_decoders);
  decoders.fresh = absl::GetFlag(FLAGS_prompt_tokens);
  decoders.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  Group long_client;
  long_client.fresh = absl::GetFlag(FLAGS_long_prompt_tokens);
  long_client.max_new_tokens = absl::GetFlag(FLAGS_long_max_new_tokens);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  report.WarmUp(target, &decoders);
  report.Phase(target, {"decoders alone"}, {&decoders}, {std::nullopt}, seconds);
  MixResult mix;
  mix.alone_p99 = Percentile(decoders.result.itl_ms, 99);
  const double base = decoders.result.tokens_per_second();
  report.Phase(target, {"decoders beside the long prompts", "long-prompt client"},
               {&decoders, &long_client}, {base, std::nullopt}, seconds);
  mix.mixed_p99 = Percentile(decoders.result.itl_ms, 99);
  return mix;
}

// The accel-make-model flags of --model_size, or empty for an unknown size.
std::string MakeModelFlags(const std::string& size) {
  if (size == "small") {
    return "--family llama --num_layers 4 --hidden_size 256 --num_heads 4 --num_kv_heads 2"
           " --max_position_embeddings 1024 --seed 1";
  }
  const std::string large =
      "--family llama --hidden_size 1024 --num_heads 16 --num_kv_heads 4 --vocab_size 32000"
      " --max_position_embeddings 8192 --seed 1";
  if (size == "500mb-f32") return large + " --num_layers 6 --dtype float32";
  if (size == "500mb-bf16") return large + " --num_layers 18 --dtype bfloat16";
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Concurrent streaming clients against accel-serve, next to one request at a time.\n"
      "  accel-bench-serve [--clients 1,4,16] [--seconds 10] [--model DIR | --model_size "
      "500mb-f32]\n"
      "      [--system_prompt_tokens 1000] [--long_prompt_tokens 4096] [--address HOST:PORT]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "accel-bench-serve: unexpected argument \"%s\"\n", rest[1]);
    return 2;
  }
  std::vector<int> counts;
  for (const std::string& c : absl::GetFlag(FLAGS_clients)) {
    int n = 0;
    if (!absl::SimpleAtoi(c, &n) || n < 1) {
      std::fprintf(stderr, "accel-bench-serve: --clients: \"%s\" is not a positive count\n",
                   c.c_str());
      return 2;
    }
    counts.push_back(n);
  }
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const int64_t max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  const int64_t prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  const int64_t system_tokens = absl::GetFlag(FLAGS_system_prompt_tokens);
  const int64_t long_tokens = absl::GetFlag(FLAGS_long_prompt_tokens);
  if (counts.empty() || seconds <= 0 || max_new_tokens < 1 || prompt_tokens < 1 ||
      absl::GetFlag(FLAGS_load_rounds) < 1 || absl::GetFlag(FLAGS_decoders) < 1 ||
      absl::GetFlag(FLAGS_long_max_new_tokens) < 1 || system_tokens < 0 || long_tokens < 0 ||
      absl::GetFlag(FLAGS_max_num_batched_tokens) < 1) {
    std::fprintf(stderr,
                 "accel-bench-serve: --clients, --seconds, --max_new_tokens, --prompt_tokens, "
                 "--load_rounds, --decoders, --long_max_new_tokens and --max_num_batched_tokens "
                 "must be positive; --system_prompt_tokens and --long_prompt_tokens at least 0\n");
    return 2;
  }
  if (!absl::GetFlag(FLAGS_address).empty() && (system_tokens > 0 || long_tokens > 0)) {
    std::fprintf(stderr,
                 "accel-bench-serve: --system_prompt_tokens and --long_prompt_tokens compare "
                 "servers this tool starts with different flags: not with --address\n");
    return 2;
  }
  const std::string make_flags = MakeModelFlags(absl::GetFlag(FLAGS_model_size));
  if (make_flags.empty()) {
    std::fprintf(stderr,
                 "accel-bench-serve: --model_size: expected small, 500mb-f32 or 500mb-bf16\n");
    return 2;
  }
  // server_process.h finds accel-serve and accel-make-model in $ACCEL_BIN_DIR:
  // default to the folder this binary is in.
  {
    const std::string protocol = absl::GetFlag(FLAGS_protocol);
    if (protocol != "grpc" && protocol != "http" && protocol != "both") {
      std::fprintf(stderr, "accel-bench-serve: --protocol must be grpc, http or both, not \"%s\"\n",
                   protocol.c_str());
      return 2;
    }
  }
  if (std::getenv("ACCEL_BIN_DIR") == nullptr) {
    const std::string self = SelfDir();
    if (!self.empty()) setenv("ACCEL_BIN_DIR", self.c_str(), 1);
  }

  std::string model_dir = absl::GetFlag(FLAGS_model);
  std::string made_root;
  if (absl::GetFlag(FLAGS_address).empty() && model_dir.empty()) {
    char pattern[] = "/tmp/accel-bench-serve-XXXXXX";
    if (mkdtemp(pattern) == nullptr) {
      std::perror("mkdtemp");
      return 1;
    }
    made_root = pattern;
    model_dir = made_root + "/model";
    const std::string command = absl::StrCat(accel::testing::BinDir(), "/accel-make-model ",
                                             model_dir, " ", make_flags, " > /dev/null");
    if (accel::testing::RunCommand(command) != 0) {
      std::fprintf(stderr, "accel-bench-serve: failed: %s\n", command.c_str());
      return 1;
    }
  }
  // Removes the made model however main returns.
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ignored;
      if (!dir.empty()) std::filesystem::remove_all(dir, ignored);
    }
  } cleanup{made_root};

  // The servers one after another, each stopped before the next starts.
  std::unique_ptr<Target> target = Connect(model_dir, "");
  if (target == nullptr) return 1;
  accel::v1::ModelInfo info;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    const grpc::Status status =
        target->stub->GetModelInfo(&context, accel::v1::GetModelInfoRequest(), &info);
    if (!status.ok()) {
      std::fprintf(stderr, "accel-bench-serve: GetModelInfo: %s\n", status.error_message().c_str());
      return 1;
    }
  }
  g_last_id = info.vocab_size() - 3;
  const int64_t longest = std::max(system_tokens + prompt_tokens, long_tokens);
  if (g_last_id < kFirstId || longest > info.max_input_tokens() ||
      std::max(system_tokens + prompt_tokens + max_new_tokens,
               long_tokens + absl::GetFlag(FLAGS_long_max_new_tokens)) > info.max_total_tokens()) {
    std::fprintf(stderr,
                 "accel-bench-serve: prompts of up to %lld tokens (plus max_new_tokens) do not "
                 "fit the server's limits: max_input_tokens %lld, max_total_tokens %lld\n",
                 static_cast<long long>(longest), static_cast<long long>(info.max_input_tokens()),
                 static_cast<long long>(info.max_total_tokens()));
    return 2;
  }
  std::printf("model: %s, %s, %lld parameters, %s, vocabulary %lld, context %lld (%s)\n",
              info.architecture().c_str(), model_dir.empty() ? "at --address" : model_dir.c_str(),
              static_cast<long long>(info.parameters()), info.dtype().c_str(),
              static_cast<long long>(info.vocab_size()), static_cast<long long>(info.max_context()),
              made_root.empty() ? "given" : absl::GetFlag(FLAGS_model_size).c_str());
  std::printf(
      "clients %s, %.1f s per phase, prompts: %lld-token system prompt + %lld own tokens, "
      "max_new_tokens %lld (ignore_eos, greedy); server_args \"%s\"; %u cores here\n",
      absl::StrJoin(counts, ",").c_str(), seconds, static_cast<long long>(system_tokens),
      static_cast<long long>(prompt_tokens), static_cast<long long>(max_new_tokens),
      absl::GetFlag(FLAGS_server_args).c_str(), std::max(1u, std::thread::hardware_concurrency()));
  if (long_tokens > 0) {
    std::printf(
        "long-prompt mix: %d decoders beside 1 client sending %lld-token prompts "
        "(max_new_tokens %lld)\n",
        absl::GetFlag(FLAGS_decoders), static_cast<long long>(long_tokens),
        static_cast<long long>(absl::GetFlag(FLAGS_long_max_new_tokens)));
  }

  // The system prompt: fixed random ids, the same for every request.
  google::protobuf::RepeatedField<int64_t> system_ids;
  AppendRandomIds(system_tokens, &system_ids);
  const std::vector<int64_t> system_prompt(system_ids.begin(), system_ids.end());

  Report report;
  bool stopped_cleanly = true;
  const std::string protocol = absl::GetFlag(FLAGS_protocol);
  // --protocol both: HTTP first, on the same server, then gRPC (whose
  // figures the rest of the report uses).
  std::vector<double> http_rates;
  if (protocol == "http" || protocol == "both") {
    g_protocol = "http";
    http_rates = ClientPhases(report, *target, counts, system_prompt);
    g_protocol = "grpc";
  }
  if (protocol == "http") g_protocol = "http";
  const std::vector<double> cached =
      protocol == "http" ? http_rates : ClientPhases(report, *target, counts, system_prompt);
  stopped_cleanly &= Stop(*target);
  std::vector<double> uncached;
  if (system_tokens > 0) {
    target = Connect(model_dir, "--enable_prefix_caching=false");
    if (target == nullptr) return 1;
    uncached = ClientPhases(report, *target, counts, system_prompt);
    stopped_cleanly &= Stop(*target);
  }
  std::optional<MixResult> chunked, whole;
  const std::string chunked_flag =
      absl::StrCat("--max_num_batched_tokens=", absl::GetFlag(FLAGS_max_num_batched_tokens));
  if (long_tokens > 0) {
    target = Connect(model_dir, chunked_flag);
    if (target == nullptr) return 1;
    chunked = MixPhases(report, *target);
    stopped_cleanly &= Stop(*target);
    target = Connect(model_dir, "--max_num_batched_tokens=0");
    if (target == nullptr) return 1;
    whole = MixPhases(report, *target);
    stopped_cleanly &= Stop(*target);
  }

  // The figures the questions ask for, each over its in-run baseline.
  std::vector<int> loads = {1};
  for (int c : counts) {
    if (c != 1) loads.push_back(c);
  }
  auto multiples = [&](const std::vector<double>& rates) {
    std::string out;
    for (size_t i = 1; i < rates.size(); ++i) {
      absl::StrAppend(&out, i > 1 ? ", " : "", loads[i], " clients ",
                      Fmt(rates[i] / rates[0], "%.2fx"));
    }
    return out.empty() ? std::string("(no load phase)") : out;
  };
  std::printf("\ntok/s over 1 client (%s tok/s): %s\n", Fmt(cached[0]).c_str(),
              multiples(cached).c_str());
  if (protocol == "both") {
    std::printf("HTTP (SSE) over gRPC, tok/s:");
    for (size_t i = 0; i < cached.size() && i < http_rates.size(); ++i) {
      std::printf("%s %d client%s %s", i > 0 ? "," : "", loads[i], loads[i] > 1 ? "s" : "",
                  Fmt(http_rates[i] / cached[i], "%.2fx").c_str());
    }
    std::printf("\n");
  }
  if (!uncached.empty()) {
    std::printf("tok/s over 1 client with prefix caching off (%s tok/s): %s\n",
                Fmt(uncached[0]).c_str(), multiples(uncached).c_str());
    std::printf("prefix caching on over off, tok/s:");
    for (size_t i = 0; i < cached.size(); ++i) {
      std::printf("%s %d client%s %s", i > 0 ? "," : "", loads[i], loads[i] > 1 ? "s" : "",
                  Fmt(cached[i] / uncached[i], "%.2fx").c_str());
    }
    std::printf("\n");
  }
  if (chunked && whole) {
    auto ratio = [](const MixResult& m) {
      return absl::StrCat(Fmt(m.mixed_p99, "%.2f"), " / ", Fmt(m.alone_p99, "%.2f"),
                          " ms = ", Fmt(m.mixed_p99 / m.alone_p99, "%.2fx"));
    };
    std::printf(
        "decoders' ITL p99 beside the long prompts / alone: %s %s; "
        "--max_num_batched_tokens=0 %s\n",
        chunked_flag.c_str(), ratio(*chunked).c_str(), ratio(*whole).c_str());
  }
  for (const std::string& m : report.messages()) {
    std::fprintf(stderr, "accel-bench-serve: %s\n", m.c_str());
  }
  int exit_code = stopped_cleanly ? 0 : 1;
  if (report.errors() > 0) {
    std::fprintf(stderr, "accel-bench-serve: %lld errors (must be 0)\n",
                 static_cast<long long>(report.errors()));
    exit_code = 1;
  }
  return exit_code;
}
