#include "server/server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <iterator>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

#include "core/thread_name.h"
#include "server/generation_service.h"
#include "server/internal/connection_limits.h"
#include "server/internal/grpc_listener.h"
#include "server/internal/listener_watchdog.h"
#include "server/kserve_service.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/openai_http.h"
#include "server/server_metrics.h"
#include "server/serving.h"

namespace accel::server {
namespace {

constexpr int kMaxMessageBytes = 64 << 20;
// Health service names: live from the start, ready while the model serves.
const char* const kLiveServices[] = {"", "accel.live"};
const char* const kReadyServices[] = {"accel.ready", "accel.v1.Generation",
                                      "inference.GRPCInferenceService"};

// OpenSSL's reasons for the last failure, oldest first; clears them.
std::string OpenSslErrors() {
  std::string reasons;
  while (unsigned long code = ERR_get_error()) {
    char buffer[256];
    ERR_error_string_n(code, buffer, sizeof(buffer));
    absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", buffer);
  }
  return reasons.empty() ? "no PEM block found" : reasons;
}

// Refuses a key file that asks for a password rather than prompting on the
// terminal, as OpenSSL otherwise would.
int NoPassword(char*, int, int, void*) { return 0; }

// The PEM text of --tls_cert and --tls_key, read once for both ports; both
// empty without TLS.
struct TlsPem {
  std::string cert;
  std::string key;
};

// gRPC reports any credential it cannot use only as a port it cannot open
// (BuildAndStart fails), so the PEM files are checked here first, with
// OpenSSL, which gRPC itself uses on Debian: the certificate chain parses,
// the key parses (unencrypted), and the key is the first certificate's.
absl::StatusOr<TlsPem> ReadTlsFiles(const std::string& cert_path, const std::string& key_path) {
  if (cert_path.empty() != key_path.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together: give both or neither");
  }
  if (cert_path.empty()) return TlsPem{};
  absl::StatusOr<std::string> cert_pem = ReadFlagFile(cert_path, "tls_cert");
  if (!cert_pem.ok()) return cert_pem.status();
  absl::StatusOr<std::string> key_pem = ReadFlagFile(key_path, "tls_key");
  if (!key_pem.ok()) return key_pem.status();

  ERR_clear_error();
  BIO* cert_bio = BIO_new_mem_buf(cert_pem->data(), static_cast<int>(cert_pem->size()));
  X509* cert = PEM_read_bio_X509(cert_bio, nullptr, NoPassword, nullptr);
  BIO_free(cert_bio);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_cert: ", cert_path, " holds no valid PEM certificate (", OpenSslErrors(), ")"));
  }
  BIO* key_bio = BIO_new_mem_buf(key_pem->data(), static_cast<int>(key_pem->size()));
  EVP_PKEY* key = PEM_read_bio_PrivateKey(key_bio, nullptr, NoPassword, nullptr);
  BIO_free(key_bio);
  if (key == nullptr) {
    X509_free(cert);
    return absl::InvalidArgumentError(absl::StrCat("--tls_key: ", key_path,
                                                   " holds no valid unencrypted PEM private key (",
                                                   OpenSslErrors(), ")"));
  }
  const bool match = X509_check_private_key(cert, key) == 1;
  EVP_PKEY_free(key);
  X509_free(cert);
  if (!match) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key: ", key_path, " is not the private key of the certificate in ", cert_path));
  }
  return TlsPem{*std::move(cert_pem), *std::move(key_pem)};
}

std::shared_ptr<grpc::ServerCredentials> GrpcCredentials(const TlsPem& pem) {
  if (pem.cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({pem.key, pem.cert});
  return grpc::SslServerCredentials(ssl);
}

// Linking gRPC's reflection library registers its plugin for every server
// (a static initializer); reflection=false takes it out again.
class NoReflection : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
                                    return plugin->name() == "proto_server_reflection";
                                  }),
                   plugins->end());
  }
};

int Milliseconds(absl::Duration d) {
  return static_cast<int>(
      std::min<int64_t>(absl::ToInt64Milliseconds(d), std::numeric_limits<int>::max()));
}

}  // namespace

struct Server::Impl {
  explicit Impl(const ServerOptions& o)
      : options(o),
        metrics(&registry),
        stat_logger(&metrics),
        state(o.auth_token, &metrics),
        generation(&state, o.tool_call_parser),
        kserve(&state, o.version) {}

  ~Impl() {
    // The watchdog first (it probes the ports), then gRPC and HTTP (their
    // handlers reach the engine), then the engine (its scheduler calls the
    // sinks), then the metrics endpoint (it reads both).
    watchdog.reset();
    if (grpc_listener != nullptr) grpc_listener->Stop();
    grpc_server.reset();
    grpc_listener.reset();
    http.reset();
    if (loader.joinable()) loader.join();
    {
      absl::MutexLock lock(&collect_mu);
      collecting = nullptr;
    }
    engine.reset();
    metrics_http.reset();
  }

  // The liveness watchdog (internal/listener_watchdog.h) over the ports
  // that serve requests. Our own gRPC accept loop reports through its
  // heartbeat (a full port is not a dead one: its clients wait in the
  // backlog); gRPC's own listener (TLS) and the HTTP port are probed as a
  // client would. The metrics port is left to Prometheus (a failed scrape
  // is its `up` 0): civetweb's accept loop does not die, and a probe stuck
  // behind idle sockets there must not restart a server that serves.
  void StartWatchdog(const std::string& tls) {
    if (options.liveness_probe_interval <= absl::ZeroDuration()) return;
    const bool secure = !tls.empty();
    const std::string host = options.host;
    constexpr absl::Duration kProbeTimeout = absl::Seconds(2);
    std::vector<internal::ListenerWatchdog::Listener> listeners;
    if (grpc_listener != nullptr) {
      internal::GrpcListener* listener = grpc_listener.get();
      listeners.push_back({"grpc", [listener] {
                             return absl::Now() - listener->last_heartbeat() < absl::Seconds(5)
                                        ? internal::ProbeResult::kAlive
                                        : internal::ProbeResult::kDead;
                           }});
    } else {
      const int grpc_port = ports.grpc;
      listeners.push_back({"grpc", [host, grpc_port] {
                             return internal::ProbeListener(
                                 host, grpc_port, internal::ProbeKind::kTls, kProbeTimeout, "h2");
                           }});
    }
    if (ports.http > 0) {
      const int http_port = ports.http;
      listeners.push_back({"http", [host, http_port, secure] {
                             return internal::ProbeListener(
                                 host, http_port,
                                 secure ? internal::ProbeKind::kTls : internal::ProbeKind::kHttp,
                                 kProbeTimeout, "http/1.1");
                           }});
    }
    for (const auto& listener : listeners) metrics.listener_up.WithLabels({listener.name}).Set(1);
    watchdog = std::make_unique<internal::ListenerWatchdog>(
        std::move(listeners), options.liveness_probe_interval, /*failures=*/3,
        [this](const std::string& name, bool alive) {
          metrics.listener_up.WithLabels({name}).Set(alive ? 1 : 0);
          std::fprintf(stderr, "accel-serve: the %s port %s; health accel.live %s\n", name.c_str(),
                       alive ? "answers again" : "stopped answering (three probes in a row)",
                       watchdog->all_alive() ? "SERVING" : "NOT_SERVING");
          std::fflush(stderr);
          SetHealth(kLiveServices, std::size(kLiveServices), watchdog->all_alive());
        });
    watchdog->Start();
  }

  void SetHealth(const char* const* names, size_t count, bool serving) {
    grpc::HealthCheckServiceInterface* health = grpc_server->GetHealthCheckService();
    for (size_t i = 0; i < count; ++i) health->SetServingStatus(names[i], serving);
  }

  // Refreshes the offload counters from the engine's snapshot at scrape time.
  void Collect() {
    absl::MutexLock lock(&collect_mu);  // scrapes may run at once; each delta is added once
    if (collecting == nullptr) return;
    const dispatch::OffloadStats stats = collecting->offload_stats();
    const auto catch_up = [](Counter& counter, int64_t total) {
      counter.Increment(static_cast<double>(total) - counter.value());
    };
    catch_up(metrics.offload_fetches, stats.fetches);
    catch_up(metrics.offload_prefetch_hits, stats.prefetch_hits);
    catch_up(metrics.offload_disk_read_bytes, stats.bytes_read);
    catch_up(metrics.offload_disk_mapped_bytes, stats.bytes_mapped);
    catch_up(metrics.offload_disk_dropped_bytes, stats.bytes_dropped);
    catch_up(metrics.offload_device_copy_bytes, stats.bytes_to_device);
    catch_up(metrics.offload_expert_fetches, stats.expert_fetches);
    catch_up(metrics.offload_expert_cache_hits, stats.expert_cache_hits);
    catch_up(metrics.offload_expert_prefetch_hits, stats.expert_prefetch_hits);
    const double tokens = metrics.prompt_tokens.value() + metrics.generation_tokens.value();
    metrics.offload_read_bytes_per_token.Set(
        tokens > 0 ? static_cast<double>(stats.bytes_read + stats.bytes_mapped) / tokens : 0.0);
  }

  void Load() {
    absl::StatusOr<std::unique_ptr<engine::LlmEngine>> loaded =
        engine::LlmEngine::Load(options.engine, &stat_logger);
    absl::MutexLock lock(&mu);
    load_done = true;
    if (!loaded.ok()) {
      load_status = loaded.status();
      return;
    }
    engine = *std::move(loaded);
    metrics.model_load_seconds.Set(engine->info().load_seconds);
    for (const auto& [device, bytes] : engine->info().bytes_per_device) {
      metrics.weight_bytes.WithLabels({device}).Set(static_cast<double>(bytes));
    }
    // A drain that started during the load already stopped serving.
    if (drain_started) {
      load_status = absl::UnavailableError("the server was drained while the model loaded");
      return;
    }
    {
      absl::MutexLock collect_lock(&collect_mu);
      collecting = engine.get();
    }
    state.SetReady(engine.get());
    metrics.ready.Set(1);
    SetHealth(kReadyServices, std::size(kReadyServices), true);
    ready = true;
  }

  // gRPC C++ answers a call that arrives once Server::Shutdown has begun
  // with CANCELLED (core zombifies it before any handler runs; grpc/grpc
  // issue 41785, fix proposed in PR 41786), which clients do not retry, and
  // a call already on its way when the GOAWAY leaves arrives then. While
  // gRPC still runs, our handlers answer UNAVAILABLE (retryable) instead;
  // so the drain keeps answering until clients went quiet (no call for
  // kQuiet, at most kMaxLinger) and only then shuts gRPC down.
  void Linger(absl::Time drain_start) {
    constexpr absl::Duration kQuiet = absl::Milliseconds(250);
    constexpr absl::Duration kMaxLinger = absl::Seconds(2);
    const absl::Time end = absl::Now() + kMaxLinger;
    while (true) {
      const absl::Time now = absl::Now();
      const absl::Time quiet_since = std::max(drain_start, state.last_call());
      if (now - quiet_since >= kQuiet || now >= end) return;
      absl::SleepFor(std::min(kQuiet - (now - quiet_since), end - now));
    }
  }

  int Drain(absl::Duration grace) {
    bool was_ready;
    {
      absl::MutexLock lock(&mu);
      if (drain_started) {
        mu.Await(absl::Condition(&drained));
        return 0;
      }
      drain_started = true;
      was_ready = ready;
    }
    const absl::Time drain_start = absl::Now();
    // Ports close on purpose from here on.
    if (watchdog != nullptr) watchdog->Stop();
    state.SetDraining();
    metrics.ready.Set(0);
    metrics.draining.Set(1);
    SetHealth(kReadyServices, std::size(kReadyServices), false);
    int ended = 0;
    if (was_ready) {
      engine::EngineLoop& loop = engine->loop();
      loop.StopAdmission();
      if (!loop.WaitIdle(grace)) {
        const engine::EngineLoop::Snapshot left = loop.snapshot();
        ended = left.running + left.waiting;
        loop.CancelAll();
        loop.WaitIdle(absl::Seconds(10));
      }
    }
    // In-flight HTTP answers have ended with their requests; new ones got
    // 503 meanwhile. Stop accepting and let the last answers go out.
    if (http != nullptr) http->Stop(absl::Seconds(5));
    Linger(drain_start);
    // No new connection is handed to gRPC once it shuts down.
    if (grpc_listener != nullptr) grpc_listener->Stop();
    // Lets the last responses go out, then cancels whatever RPC is left.
    grpc_server->Shutdown(std::chrono::system_clock::now() +
                          std::chrono::seconds(was_ready ? 5 : 0));
    grpc_server->Wait();
    absl::MutexLock lock(&mu);
    drained = true;
    return ended;
  }

  const ServerOptions options;
  MetricsRegistry registry;
  ServerMetrics metrics;
  MetricsStatLogger stat_logger;
  ServingState state;
  GenerationService generation;
  KServeService kserve;
  std::unique_ptr<MetricsHttpServer> metrics_http;
  std::unique_ptr<OpenAiHttpServer> http;
  std::unique_ptr<internal::GrpcListener> grpc_listener;  // null: gRPC's own listener
  std::unique_ptr<grpc::Server> grpc_server;
  std::unique_ptr<internal::ListenerWatchdog> watchdog;
  Ports ports;
  Limits limits;

  absl::Mutex collect_mu;
  engine::LlmEngine* collecting ABSL_GUARDED_BY(collect_mu) = nullptr;

  absl::Mutex mu;
  bool load_done ABSL_GUARDED_BY(mu) = false;
  absl::Status load_status ABSL_GUARDED_BY(mu);
  // Set once by the loader; only read after `ready` (or after the join).
  std::unique_ptr<engine::LlmEngine> engine;
  bool ready ABSL_GUARDED_BY(mu) = false;
  bool drain_started ABSL_GUARDED_BY(mu) = false;
  bool drained ABSL_GUARDED_BY(mu) = false;
  std::thread loader;  // last: started after everything above exists
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() {
  impl_->Drain(absl::ZeroDuration());
  impl_.reset();
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  if (options.max_connection_age < absl::ZeroDuration() ||
      options.max_connection_age_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--max_connection_age and --max_connection_age_grace must not be negative");
  }
  if (options.http_port < 0 || options.http_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http_port=", options.http_port, ": give a port in 1..65535, or 0 for off"));
  }
  absl::StatusOr<TlsPem> tls = ReadTlsFiles(options.tls_cert_file, options.tls_key_file);
  if (!tls.ok()) return tls.status();

  // Errors name files by their folder's last component only.
  AddPrivatePath(options.engine.model_dir);
  if (!options.engine.load.offload_folder.empty()) {
    AddPrivatePath(options.engine.load.offload_folder);
  }
  if (!options.engine.speculative.model.empty()) {
    AddPrivatePath(options.engine.speculative.model);  // the draft model's folder
  }
  auto impl = std::make_unique<Impl>(options);
  Impl& s = *impl;
  const internal::ConnectionLimits limits = internal::ConnectionLimitsFor(
      internal::OpenFileLimit(), options.grpc_max_connections, options.http_max_connections);
  s.limits.open_files = limits.open_files;
  s.limits.http_connections = limits.http;
  s.limits.metrics_threads = limits.metrics_threads;
  s.metrics.build_info.WithLabels({options.version}).Set(1);
  s.registry.AddCollectHook([&s] { s.Collect(); });
  if (options.metrics_port >= 0) {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http = MetricsHttpServer::Start(
        options.host, options.metrics_port, &s.registry, limits.metrics_threads);
    if (!http.ok()) {
      return absl::Status(http.status().code(),
                          absl::StrCat("--metrics_port: ", http.status().message()));
    }
    s.metrics_http = *std::move(http);
    s.ports.metrics = s.metrics_http->port();
  }

  if (options.http_port > 0) {
    OpenAiHttpOptions http;
    http.host = options.host;
    http.port = options.http_port;
    http.request_timeout = options.http_request_timeout;
    http.max_connections = limits.http;
    http.tls_cert_pem = tls->cert;  // HTTPS with gRPC's certificate, or plain HTTP
    http.tls_key_pem = tls->key;
    http.tool_call_parser = options.tool_call_parser;
    http.cors = options.cors;
    // /metrics on the API port too, as vLLM serves it.
    http.metrics_text = [&s] { return s.registry.Render(); };
    absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> started =
        OpenAiHttpServer::Start(http, &s.state);
    if (!started.ok()) {
      return absl::Status(started.status().code(),
                          absl::StrCat("--http_port: ", started.status().message()));
    }
    s.http = *std::move(started);
    s.ports.http = s.http->port();
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (!options.reflection) builder.SetOption(std::make_unique<NoReflection>());
  // Plaintext gRPC on an IPv4 host: our accept loop, capped
  // (internal/grpc_listener.h); else gRPC's own listener.
  if (tls->cert.empty()) {
    absl::StatusOr<std::unique_ptr<internal::GrpcListener>> listener =
        internal::GrpcListener::Bind(options.host, options.port, limits.grpc);
    if (listener.ok()) {
      s.grpc_listener = *std::move(listener);
      s.ports.grpc = s.grpc_listener->port();
      s.limits.grpc_connections = limits.grpc;
    } else if (absl::IsUnavailable(listener.status())) {
      return absl::UnavailableError(absl::StrCat("--port: ", listener.status().message()));
    }
  }
  if (s.grpc_listener == nullptr) {
    builder.AddListeningPort(absl::StrCat(options.host, ":", options.port), GrpcCredentials(*tls),
                             &s.ports.grpc);
  }
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  if (options.max_connection_age > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               Milliseconds(options.max_connection_age));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                               Milliseconds(options.max_connection_age_grace));
  }
  builder.RegisterService(&s.generation);
  builder.RegisterService(&s.kserve);
  s.grpc_server = builder.BuildAndStart();
  if (s.grpc_server != nullptr && s.grpc_listener != nullptr) {
    s.grpc_listener->Serve(s.grpc_server.get());
  }
  if (s.grpc_server == nullptr || s.ports.grpc == 0) {
    s.grpc_server.reset();
    return absl::UnavailableError(absl::StrCat("--port: cannot listen on ", options.host, ":",
                                               options.port, " (in use, or a bad --host?)"));
  }
  s.SetHealth(kLiveServices, std::size(kLiveServices), true);
  s.SetHealth(kReadyServices, std::size(kReadyServices), false);
  s.StartWatchdog(tls->cert.empty() ? "" : "tls");
  s.loader = std::thread([&s] {
    NameThisThread("accel-load");
    s.Load();
  });
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::Ports Server::ports() const { return impl_->ports; }

Server::Limits Server::limits() const { return impl_->limits; }

const engine::ModelInfo& Server::model_info() const { return impl_->engine->info(); }

absl::Status Server::WaitReady(absl::Duration timeout) {
  Impl& s = *impl_;
  absl::MutexLock lock(&s.mu);
  if (!s.mu.AwaitWithTimeout(absl::Condition(&s.load_done), timeout)) {
    return absl::DeadlineExceededError("the model is still loading");
  }
  return s.load_status;
}

int Server::Drain() { return impl_->Drain(impl_->options.shutdown_timeout); }

void Server::Wait() {
  absl::MutexLock lock(&impl_->mu);
  impl_->mu.Await(absl::Condition(&impl_->drained));
}

}  // namespace accel::server
