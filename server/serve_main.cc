// accel-serve: serves one HuggingFace-format model over gRPC
// (accel.v1.Generation, KServe v2, grpc.health.v1, reflection) with
// Prometheus metrics on HTTP. docs/API.md describes the services.
//
// Lifecycle: the gRPC port opens first (health: live), the model loads, then
// ready. SIGTERM or SIGINT starts a drain: ready turns NOT_SERVING, new
// requests get UNAVAILABLE, running ones finish within --shutdown_timeout
// (past it they end with finish_reason cancelled), and the process exits 0.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <memory>
#include <optional>
#include <pthread.h>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"

#include "core/file_faults.h"
#include "core/threads.h"
#include "core/tool_main.h"
#include "dist/env.h"
#include "dist/launch.h"
#include "engine/engine_args.h"
#include "engine/parallel_run.h"
#include "models/tensor_parallel.h"
#include "server/internal/connection_limits.h"
#include "server/internal/parallel_worker.h"
#include "server/server.h"
#include "server/serving.h"

namespace {
constexpr char kVersion[] = "0.1.0";
}  // namespace

ABSL_FLAG(std::string, host, "0.0.0.0", "Address the gRPC and metrics ports listen on.");
ABSL_FLAG(int, port, 50051, "gRPC port; 0 picks a free one (printed on stdout).");
ABSL_FLAG(int, metrics_port, 8002,
          "Prometheus /metrics HTTP port; 0 picks a free one; -1 turns metrics off.");
ABSL_FLAG(int, http_port, 0,
          "The OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) "
          "on this port; 0: off. HTTPS with --tls_cert/--tls_key (the gRPC port's certificate), "
          "else plain HTTP.");
ABSL_FLAG(absl::Duration, http_request_timeout, absl::Seconds(10),
          "An HTTP request's head and body must arrive within this of its first byte; a slower "
          "client is answered 408 and closed. Under TLS the handshake must also end within this of "
          "the connection.");
ABSL_FLAG(absl::Duration, shutdown_timeout, absl::Seconds(30),
          "On SIGTERM/SIGINT, how long running requests may take to finish before they are "
          "ended (finish_reason cancelled).");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve gRPC (and --http_port) over TLS (with --tls_key).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert.");
ABSL_FLAG(std::string, auth_token_file, "",
          "A file holding a token; requests must then carry \"authorization: Bearer <token>\" "
          "(health checks excepted).");
ABSL_FLAG(bool, grpc_reflection, true, "Register gRPC server reflection (grpcurl, grpc_cli).");
ABSL_FLAG(absl::Duration, max_connection_age, absl::Minutes(5),
          "Close a client connection this old (GOAWAY, then --max_connection_age_grace for its "
          "calls to finish), so clients reconnect and spread over the replicas behind a "
          "Kubernetes ClusterIP Service as they come and go; 0: connections live forever.");
ABSL_FLAG(absl::Duration, max_connection_age_grace, absl::InfiniteDuration(),
          "After --max_connection_age, how long calls on the old connection may run before it "
          "is closed; inf (the default): to their end, so no generation is cut (the client "
          "sends new calls on a new connection at once either way).");
ABSL_FLAG(int, grpc_max_connections, 0,
          "Most connections open at once on the gRPC port (plaintext; more wait in the kernel's "
          "backlog); 0: half of what the file-descriptor limit leaves after a reserve.");
ABSL_FLAG(int, http_max_connections, 0,
          "Most connections open at once on --http_port (past it the connection that waited "
          "longest for its request is closed, or the newcomer gets 503); 0: from the "
          "file-descriptor limit, at most 512.");
ABSL_FLAG(std::vector<std::string>, allowed_origins, {},
          "CORS on the HTTP port: the origins (scheme://host[:port], comma-separated, or *) whose "
          "browser pages may call the API; their requests get Access-Control-Allow-Origin and "
          "their OPTIONS preflights are answered. Empty (the default): no CORS headers at all.");
ABSL_FLAG(std::vector<std::string>, allowed_methods, {"*"},
          "CORS: the methods a preflight allows (comma-separated, or *), as vLLM's "
          "--allowed-methods.");
ABSL_FLAG(std::vector<std::string>, allowed_headers, {"*"},
          "CORS: the request headers a preflight allows (comma-separated, or *), as vLLM's "
          "--allowed-headers.");
ABSL_FLAG(std::string, tool_call_parser, "auto",
          "How tool calls are parsed out of a model's text on the OpenAI API (message.tool_calls) "
          "and forced (tool_choice required / a named function): hermes (Hermes, Qwen 2.5, Qwen "
          "3), llama3_json (Llama 3.1 / 3.2), mistral, none, or auto (from the vocabulary's "
          "<tool_call> / [TOOL_CALLS] / <|python_tag|> token).");
ABSL_FLAG(absl::Duration, liveness_probe_interval, absl::Seconds(10),
          "How often every port is probed as a client would; three failures in a row turn "
          "health accel.live NOT_SERVING. 0: no probes.");
namespace {

// The exit status after a weights file fault: a restart is what mends it.
constexpr int kExitWeightsFault = 3;
// After a tensor-parallel group broke (a rank died or stopped answering).
constexpr int kExitParallelFault = accel::server::internal::kExitParallelFault;

void Log(const std::string& message) {
  std::fprintf(stderr, "accel-serve: %s\n", message.c_str());
  std::fflush(stderr);
}

absl::Status NonNegative(const char* flag, int64_t value) {
  if (value >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be 0 or more, got ", value));
}

absl::StatusOr<accel::server::ServerOptions> ReadOptions() {
  accel::server::ServerOptions o;
  // Every engine and load option, checked before a port opens.
  absl::StatusOr<accel::engine::EngineOptions> engine =
      accel::engine::EngineArgs::FromFlags().Resolve();
  if (!engine.ok()) return engine.status();
  o.engine = *std::move(engine);
  o.host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  o.http_port = absl::GetFlag(FLAGS_http_port);
  o.http_request_timeout = absl::GetFlag(FLAGS_http_request_timeout);
  o.shutdown_timeout = absl::GetFlag(FLAGS_shutdown_timeout);
  o.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  o.reflection = absl::GetFlag(FLAGS_grpc_reflection);
  o.max_connection_age = absl::GetFlag(FLAGS_max_connection_age);
  o.max_connection_age_grace = absl::GetFlag(FLAGS_max_connection_age_grace);
  o.grpc_max_connections = absl::GetFlag(FLAGS_grpc_max_connections);
  o.http_max_connections = absl::GetFlag(FLAGS_http_max_connections);
  o.tool_call_parser = absl::GetFlag(FLAGS_tool_call_parser);
  o.cors.allowed_origins = absl::GetFlag(FLAGS_allowed_origins);
  o.cors.allowed_methods = absl::GetFlag(FLAGS_allowed_methods);
  o.cors.allowed_headers = absl::GetFlag(FLAGS_allowed_headers);
  o.liveness_probe_interval = absl::GetFlag(FLAGS_liveness_probe_interval);
  o.version = kVersion;

  for (absl::Status s : {NonNegative("grpc_max_connections", o.grpc_max_connections),
                         NonNegative("http_max_connections", o.http_max_connections)}) {
    if (!s.ok()) return s;
  }
  if (o.port < 0 || o.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--port must be in [0, 65535], got ", o.port));
  }
  if (o.metrics_port < -1 || o.metrics_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_port must be -1 (off) or in [0, 65535], got ", o.metrics_port));
  }
  if (o.liveness_probe_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--liveness_probe_interval must not be negative");
  }
  if (o.shutdown_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--shutdown_timeout must not be negative");
  }
  if (o.max_connection_age < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max_connection_age must not be negative");
  }
  if (o.max_connection_age_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max_connection_age_grace must not be negative");
  }
  const std::string token_file = absl::GetFlag(FLAGS_auth_token_file);
  if (!token_file.empty()) {
    absl::StatusOr<std::string> token = accel::server::ReadFlagFile(token_file, "auth_token_file");
    if (!token.ok()) return token.status();
    std::string trimmed(absl::StripAsciiWhitespace(*token));
    if (trimmed.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_token_file: ", token_file, " holds no token"));
    }
    o.auth_token = std::move(trimmed);
  }
  return o;
}

int Run(int argc, char** argv) {
  // The command line as given, for the ranks this process starts.
  const std::vector<std::string> command_line(argv, argv + argc);
  // libtorch's oneDNN caches keep a primitive per matrix shape (1024 each by
  // default); a server sees a new row count with every batch size and prompt
  // length, and its memory grew by megabytes a minute under load in
  // bfloat16 (docs/BENCHMARKS.md). A small cap keeps it flat at the same
  // speed. Read on first use, so set before anything touches libtorch; a
  // value in the environment wins.
  setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32", /*overwrite=*/0);
  setenv("LRU_CACHE_CAPACITY", "32", /*overwrite=*/0);
  // Before any thread starts, so every thread inherits the mask and the
  // signals queue for sigtimedwait below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A weights file truncated under its mapping: a SIGBUS mended and
  // recorded, not a silent death (core/file_faults.h).
  accel::InstallMappedFileFaultHandler();
  // And one rewritten in place, which faults nothing: told by inotify.
  accel::StartWeightsFileWatcher();

  absl::SetProgramUsageMessage(
      "Serves a HuggingFace-format model over gRPC.\n"
      "  accel-serve [--model DIR] [--device_map auto] [--port 50051] [--metrics_port 8002]\n"
      "Without --model it serves the embedded default model. docs/API.md has the services.");
  accel::engine::EngineArgs::RegisterFlags();
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    Log(absl::StrCat("unexpected argument \"", rest[1], "\" (flags are --name=value)"));
    return 1;
  }
  absl::StatusOr<accel::server::ServerOptions> options = ReadOptions();
  if (!options.ok()) {
    Log(std::string(options.status().message()));
    return 1;
  }
  // Tensor parallel: which rank this is, the ranks it starts, the group.
  const accel::dist::ParallelFlags& parallel = options->engine.parallel;
  absl::StatusOr<accel::dist::RankLayout> layout =
      accel::dist::ResolveRankLayout(parallel, accel::dist::ProcessEnv());
  if (!layout.ok()) {
    Log(std::string(layout.status().message()));
    return 1;
  }
  accel::engine::ParallelRun parallel_run;
  if (layout->world_size > 1) {
    // Refused by name before a process starts: what cannot split.
    if (absl::Status split = accel::engine::CheckParallelSplit(options->engine); !split.ok()) {
      Log(std::string(split.message()));
      return 1;
    }
    if (absl::Status started = accel::engine::StartLocalRanks(*layout, command_line, parallel_run);
        !started.ok()) {
      Log(std::string(started.message()));
      return 1;
    }
    if (absl::Status joined =
            accel::engine::JoinParallelGroups(*layout, options->engine, parallel_run);
        !joined.ok()) {
      Log(std::string(joined.message()));
      return kExitParallelFault;
    }
    if (!layout->leader()) {
      // Health only, its slice, the leader's steps; SIGTERM ends it at once.
      pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);
      const int port = options->port == 0 ? 0 : options->port + layout->local_rank;
      accel::SetIntraOpThreads(options->engine.threads);  // as the leader's engine does
      accel::models::ModelLoadOptions load = options->engine.load;
      load.progress = accel::Progress::Style::kSilent;
      return accel::server::internal::ServeWorkerRank(options->engine.model_dir, load,
                                                      options->host, port, *parallel_run.group);
    }
    Log(absl::StrCat(
        "parallel: rank 0 of ", layout->world_size, " (tensor ", parallel.tensor_parallel_size,
        " x pipeline ", parallel.pipeline_parallel_size, ")",
        parallel_run.workers
            ? absl::StrCat(", started ", parallel_run.workers->pids().size(), " ranks here")
            : std::string()));
  }
  // Every connection is a descriptor; the soft limit (often 1024) is far
  // below what the hard one allows, and running out stalls every port.
  Log(accel::server::internal::RaiseOpenFileLimit());
  absl::StatusOr<std::unique_ptr<accel::server::Server>> server =
      accel::server::Server::Start(*options);
  if (!server.ok()) {
    Log(std::string(server.status().message()));
    return 1;
  }
  const accel::server::Server::Ports ports = (*server)->ports();
  // One line on stdout that scripts and tests read for the ports.
  // " http=H:P" is added only when the OpenAI HTTP API is on.
  const std::string http =
      ports.http > 0 ? absl::StrCat(" http=", options->host, ":", ports.http) : "";
  std::printf("accel-serve: listening grpc=%s:%d metrics=%s:%d%s\n", options->host.c_str(),
              ports.grpc, options->host.c_str(), ports.metrics, http.c_str());
  std::fflush(stdout);
  const accel::server::Server::Limits limits = (*server)->limits();
  Log(absl::StrCat("connections at once: grpc ",
                   limits.grpc_connections > 0 ? std::to_string(limits.grpc_connections)
                                               : std::string("uncapped (gRPC's listener)"),
                   ", http ", limits.http_connections, ", metrics ", limits.metrics_threads,
                   " (from ", limits.open_files, " open files)"));
  Log(absl::StrCat("loading ", options->engine.model_dir));

  const timespec tick = {0, 100'000'000};
  bool logged_ready = false;
  std::optional<std::string> fault;
  bool parallel_fault = false;
  while (true) {
    siginfo_t info;
    const int signal = sigtimedwait(&signals, &info, &tick);
    if (signal == SIGTERM || signal == SIGINT) {
      Log(absl::StrCat(signal == SIGTERM ? "SIGTERM" : "SIGINT", ": draining"));
      break;
    }
    // A weights file that changed or failed under us (core/file_faults.h):
    // every step fails from now on, so stop being ready and exit non-zero
    // once drained, for a restart that loads the files as they are now.
    if (logged_ready && (fault = accel::ModelFileFault())) {
      Log(absl::StrCat("weights file fault: ", *fault,
                       "; not ready, draining, then exiting with status ", kExitWeightsFault,
                       " for a restart"));
      break;
    }
    // A rank of the group that died or stopped (seen here, or by a
    // collective that failed): not ready, the requests in flight end with
    // UNAVAILABLE (their steps fail), drained, then exit non-zero so that
    // the group is restarted whole.
    if (parallel_run.group != nullptr) {
      std::optional<std::string> broken = accel::models::TensorParallelFault();
      if (!broken && parallel_run.workers) broken = parallel_run.workers->Failure();
      if (broken) {
        Log(absl::StrCat("tensor parallel group broken: ", *broken,
                         "; not ready, draining, then exiting with status ", kExitParallelFault));
        parallel_fault = true;
        if (!logged_ready) {
          std::fflush(nullptr);
          std::_Exit(kExitParallelFault);
        }
        break;
      }
    }
    if (logged_ready) continue;
    const absl::Status loaded = (*server)->WaitReady(absl::ZeroDuration());
    if (absl::IsDeadlineExceeded(loaded)) continue;
    if (!loaded.ok()) {
      Log(absl::StrCat("cannot load the model: ", loaded.message()));
      return 1;
    }
    logged_ready = true;
    const accel::engine::ModelInfo& model = (*server)->model_info();
    Log(absl::StrFormat("ready: %s (%s, %d parameters, %s) loaded in %.2f s", model.name,
                        model.architecture, model.parameters, model.dtype, model.load_seconds));
  }

  // Asked of the server, not of the loop above: it turns ready (and says so
  // on the health service) the moment the load ends, between two ticks.
  const absl::Status loaded = (*server)->WaitReady(absl::ZeroDuration());
  if (absl::IsDeadlineExceeded(loaded)) {
    // A load cannot be interrupted; nothing was served, so nothing is lost.
    Log("the model was still loading; exiting");
    std::fflush(nullptr);
    std::_Exit(0);
  }
  if (!loaded.ok()) {
    Log(absl::StrCat("cannot load the model: ", loaded.message()));
    return 1;
  }
  const int ended = (*server)->Drain();
  if (ended > 0) {
    Log(absl::StrCat("--shutdown_timeout passed with ", ended,
                     " requests left; they were ended (finish_reason cancelled)"));
  }
  server->reset();
  Log("drained; exiting");
  if (parallel_fault) {
    // The group's threads may be stuck on the rank that went silent.
    std::fflush(nullptr);
    std::_Exit(kExitParallelFault);
  }
  return fault ? kExitWeightsFault : 0;
}

}  // namespace

int main(int argc, char** argv) { return accel::ToolMain("accel-serve", argc, argv, Run); }
