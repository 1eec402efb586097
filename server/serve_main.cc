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
#include "core/tool_main.h"
#include "engine/speculative_config.h"
#include "models/default_model.h"
#include "server/internal/connection_limits.h"
#include "server/server.h"
#include "server/serving.h"

namespace {
constexpr char kVersion[] = "0.1.0";
}  // namespace

ABSL_FLAG(std::string, model, "",
          "A HuggingFace model folder (config.json, *.safetensors or pytorch_model.bin, "
          "tokenizer.json). Empty: the "
          "embedded default model (share/accel/default-model beside the binary's bin/, or "
          "$ACCEL_DEFAULT_MODEL).");
ABSL_FLAG(std::string, served_model_name, "",
          "The name clients use in requests; empty: the model folder's name.");
ABSL_FLAG(std::string, device_map, "auto",
          "auto | balanced | balanced_low_0 | sequential (planned within --max_memory), one "
          "device for everything (cpu, 0, cuda:1, disk), or a JSON map file as accel-device-map "
          "prints it.");
ABSL_FLAG(std::string, max_memory, "",
          "Memory per device for planning, e.g. 0=20GiB,cpu=64GiB,disk=1TB. Empty: free GPU "
          "memory and the RAM available to this container.");
ABSL_FLAG(std::string, offload_folder, "",
          "Where disk-placed weights that need a dtype conversion are written.");
ABSL_FLAG(std::string, dtype, "auto",
          "auto (config.json's torch_dtype) | float32 | bfloat16 | float16");
ABSL_FLAG(std::string, quantize, "none",
          "Quantize the linear layers on loading, in bitsandbytes' formats: none | int8 "
          "(LLM.int8, outlier threshold 6) | nf4 | fp4 (4-bit, blocksize 64). lm_head stays as it "
          "is. A model saved quantized (accel-quantize, transformers) loads as it is.");
ABSL_FLAG(bool, double_quant, false,
          "With nf4/fp4: quantize the absmaxes too (8 bits, groups of 256).");
ABSL_FLAG(bool, offload_experts, false,
          "Mixture-of-experts models: place experts one by one and bring offloaded ones in as the "
          "router picks them, through an expert cache (otherwise whole blocks, as Accelerate).");
ABSL_FLAG(std::string, expert_cache, "auto",
          "The expert cache's size, e.g. 2GiB (auto: the experts one token uses in every sparse "
          "layer, at most half the execution device's budget), inside max_memory.");
ABSL_FLAG(std::string, execution_device, "auto",
          "Where cpu- and disk-placed weights run: auto (the first GPU in the map, else the cpu), "
          "cpu, or a GPU (0, cuda:1), through which a model held in RAM or on disk streams.");
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
ABSL_FLAG(int, max_batch_size, 32, "Most sequences in one decode step.");
ABSL_FLAG(int64_t, max_num_batched_tokens, 512,
          "Most tokens in one forward step: one per decoding sequence first, then chunks of "
          "prompts being read (chunked prefill), so decoding keeps its pace beside a long "
          "prompt; 0: whole prompts.");
ABSL_FLAG(std::string, kv_cache_memory, "auto",
          "KV-cache memory, in blocks allocated up front: bytes (\"4GiB\"), a fraction of what "
          "the device holding most weights has free after them (\"0.5\"), or auto (max_batch_size "
          "sequences of max_total_tokens, within half of what is free).");
ABSL_FLAG(int64_t, kv_block_size, 16, "Tokens in one KV-cache block.");
ABSL_FLAG(bool, enable_prefix_caching, true,
          "Share the KV blocks of a common prompt prefix between requests.");
ABSL_FLAG(int, max_queue, 256,
          "Most requests waiting to join the batch (at least 1: every request passes through "
          "it); past it: RESOURCE_EXHAUSTED with a retry-after-ms hint.");
ABSL_FLAG(int64_t, max_input_tokens, 0, "Most prompt tokens; 0: the model's context - 1.");
ABSL_FLAG(int64_t, max_total_tokens, 0,
          "Most prompt + generated tokens per request; 0: the model's context.");
ABSL_FLAG(int64_t, default_max_new_tokens, 16, "max_new_tokens when a request leaves it 0.");
ABSL_FLAG(absl::Duration, request_timeout, absl::ZeroDuration(),
          "Longest a request may take, queue included (e.g. 60s); 0: no limit beyond the "
          "client's deadline.");
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
ABSL_FLAG(absl::Duration, liveness_probe_interval, absl::Seconds(10),
          "How often every port is probed as a client would; three failures in a row turn "
          "health accel.live NOT_SERVING. 0: no probes.");
ABSL_FLAG(std::string, speculative_config, "",
          "Speculative decoding, as vLLM's --speculative-config (JSON): "
          "{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, "
          "\"prompt_lookup_max\": 4} (prompt lookup) or {\"model\": DIR, "
          "\"num_speculative_tokens\": 4} (a draft model with this model's tokenizer). Empty: "
          "off.");
ABSL_FLAG(int, threads, 0,
          "libtorch intra-op threads; 0: OMP_NUM_THREADS, else one per CPU this process may use.");

namespace {

// The exit status after a weights file fault: a restart is what mends it.
constexpr int kExitWeightsFault = 3;

void Log(const std::string& message) {
  std::fprintf(stderr, "accel-serve: %s\n", message.c_str());
  std::fflush(stderr);
}

absl::StatusOr<accel::server::ServerOptions> ReadOptions() {
  accel::server::ServerOptions o;
  accel::engine::EngineOptions& e = o.engine;
  e.model_dir = absl::GetFlag(FLAGS_model);
  if (e.model_dir.empty()) e.model_dir = accel::models::DefaultModelDir();
  e.served_model_name = absl::GetFlag(FLAGS_served_model_name);
  e.device_map = absl::GetFlag(FLAGS_device_map);
  e.max_memory = absl::GetFlag(FLAGS_max_memory);
  e.offload_folder = absl::GetFlag(FLAGS_offload_folder);
  e.dtype = absl::GetFlag(FLAGS_dtype);
  e.quantize = absl::GetFlag(FLAGS_quantize);
  e.double_quant = absl::GetFlag(FLAGS_double_quant);
  e.offload_experts = absl::GetFlag(FLAGS_offload_experts);
  e.expert_cache = absl::GetFlag(FLAGS_expert_cache);
  e.execution_device = absl::GetFlag(FLAGS_execution_device);
  e.threads = absl::GetFlag(FLAGS_threads);
  e.loop.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  e.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  e.kv_cache_memory = absl::GetFlag(FLAGS_kv_cache_memory);
  e.kv_block_size = absl::GetFlag(FLAGS_kv_block_size);
  e.enable_prefix_caching = absl::GetFlag(FLAGS_enable_prefix_caching);
  e.loop.max_queue = absl::GetFlag(FLAGS_max_queue);
  e.max_input_tokens = absl::GetFlag(FLAGS_max_input_tokens);
  e.max_total_tokens = absl::GetFlag(FLAGS_max_total_tokens);
  e.default_max_new_tokens = absl::GetFlag(FLAGS_default_max_new_tokens);
  e.request_timeout = absl::GetFlag(FLAGS_request_timeout);
  absl::StatusOr<accel::engine::SpeculativeConfig> speculative =
      accel::engine::ParseSpeculativeConfig(absl::GetFlag(FLAGS_speculative_config));
  if (!speculative.ok()) return speculative.status();
  e.speculative = *std::move(speculative);
  if (e.speculative.method == accel::engine::SpeculativeConfig::Method::kDraftModel &&
      !std::filesystem::exists(e.speculative.model + "/config.json")) {
    return absl::NotFoundError(
        absl::StrCat("--speculative_config: \"model\": ", e.speculative.model,
                     "/config.json does not exist (the draft model's "
                     "folder)"));
  }
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
  o.liveness_probe_interval = absl::GetFlag(FLAGS_liveness_probe_interval);
  o.version = kVersion;

  auto positive = [](const char* flag, int64_t value) -> absl::Status {
    if (value >= 1) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be at least 1, got ", value));
  };
  auto non_negative = [](const char* flag, int64_t value) -> absl::Status {
    if (value >= 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be 0 or more, got ", value));
  };
  for (absl::Status s : {positive("max_batch_size", e.loop.max_batch_size),
                         positive("kv_block_size", e.kv_block_size),
                         non_negative("max_num_batched_tokens", e.max_num_batched_tokens),
                         positive("max_queue", e.loop.max_queue),
                         non_negative("max_input_tokens", e.max_input_tokens),
                         non_negative("max_total_tokens", e.max_total_tokens),
                         positive("default_max_new_tokens", e.default_max_new_tokens),
                         non_negative("threads", e.threads),
                         non_negative("grpc_max_connections", o.grpc_max_connections),
                         non_negative("http_max_connections", o.http_max_connections)}) {
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
  if (e.request_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--request_timeout must not be negative");
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
  if (!std::filesystem::exists(e.model_dir + "/config.json")) {
    return absl::NotFoundError(
        absl::StrCat("--model: ", e.model_dir,
                     "/config.json does not exist (a HuggingFace model folder has "
                     "config.json, *.safetensors and tokenizer.json)"));
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
  return fault ? kExitWeightsFault : 0;
}

}  // namespace

int main(int argc, char** argv) { return accel::ToolMain("accel-serve", argc, argv, Run); }
