// server/server.h: one accel-serve server in a process: the gRPC port
// (accel.v1.Generation, KServe v2, grpc.health.v1, reflection), the
// Prometheus port, the OpenAI-compatible HTTP port (optional), and the
// engine, with their lifecycle. accel-serve is
// flag parsing around it; tests start one in-process.
//
//   ServerOptions options;
//   options.engine.model_dir = dir;
//   options.port = 0;  // any free port
//   ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<Server> server, Server::Start(options));
//   ... server->ports().grpc ...
//   ACCEL_RETURN_IF_ERROR(server->WaitReady(absl::Minutes(5)));
//   server->Drain();  // on SIGTERM: NOT_SERVING, finish in-flight work, stop
//
// Lifecycle: Start opens the ports (health: live) and loads the model on a
// thread; once loaded the server is ready (health: ready). Drain refuses new
// requests with UNAVAILABLE, lets accepted ones finish within
// shutdown_timeout, ends the rest (finish_reason cancelled), then stops gRPC.
//
// Torch-free header: server/ headers include no libtorch.
#ifndef ACCEL_SERVER_SERVER_H_
#define ACCEL_SERVER_SERVER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "engine/llm_engine.h"
#include "server/openai_http.h"

namespace accel::server {

struct ServerOptions {
  engine::EngineOptions engine;
  std::string host = "0.0.0.0";
  int port = 50051;         // 0: a free one (see ports())
  int metrics_port = 8002;  // 0: a free one; -1: no metrics endpoint
  // The OpenAI-compatible HTTP API (server/openai_http.h) on its own port;
  // 0: off. (No "free port" value: a test picks a free port itself.) With
  // tls_cert_file / tls_key_file it speaks HTTPS only, with the same
  // certificate and key as the gRPC port.
  int http_port = 0;
  // A request's head and body must arrive within this of its first byte
  // (a slow client is then answered 408 and closed).
  absl::Duration http_request_timeout = absl::Seconds(10);
  // How long Drain lets accepted requests run before ending them.
  absl::Duration shutdown_timeout = absl::Seconds(30);
  std::optional<std::string> auth_token;  // unset: no authentication
  // PEM files; both or neither. Checked by Start (each parses, and the key
  // is the certificate's), so a bad file is named rather than reported as a
  // port that cannot be opened.
  std::string tls_cert_file;
  std::string tls_key_file;
  bool reflection = true;
  // gRPC's GRPC_ARG_MAX_CONNECTION_AGE_MS and _GRACE_MS: a connection older
  // than the age is sent GOAWAY, and closed after the grace (infinite: when
  // its last call ends, so a long generation is never cut), so clients
  // behind a Kubernetes ClusterIP Service reconnect and spread over the
  // replicas there are now. Zero age: connections live forever.
  absl::Duration max_connection_age = absl::Minutes(5);
  absl::Duration max_connection_age_grace = absl::InfiniteDuration();
  // Connections open at once on the gRPC and HTTP ports; 0: a share of the
  // process's file-descriptor limit (internal/connection_limits.h), so that
  // no port can take the descriptors the others need. The gRPC cap holds
  // for plaintext gRPC on an IPv4 host (internal/grpc_listener.h).
  int grpc_max_connections = 0;
  int http_max_connections = 0;
  // The syntax of the tool calls models write, for the OpenAI API's
  // tool_calls and tool_choice: hermes, llama3_json, mistral, none, or auto
  // (from the model's vocabulary: <tool_call>, [TOOL_CALLS], <|python_tag|>).
  std::string tool_call_parser = "auto";
  // CORS on the HTTP port (--allowed_origins ...); empty origins: none.
  CorsOptions cors;
  // How often the liveness watchdog probes every port
  // (internal/listener_watchdog.h); a port that fails three probes in a row
  // turns health "accel.live" NOT_SERVING. Zero: no watchdog.
  absl::Duration liveness_probe_interval = absl::Seconds(10);
  std::string version = "0.1.0";  // ServerMetadata and accel_build_info
};

class Server {
 public:
  struct Ports {
    int grpc = 0;
    int metrics = -1;  // -1: no metrics endpoint
    int http = 0;      // 0: no OpenAI HTTP API
  };
  // What each port may hold, from the file-descriptor limit (see
  // ServerOptions::grpc_max_connections).
  struct Limits {
    int64_t open_files = 0;
    int grpc_connections = 0;  // 0: gRPC's own listener, uncapped (TLS)
    int http_connections = 0;
    int metrics_threads = 0;
  };

  // Opens both ports and starts loading the model on a thread; returns once
  // the ports listen. InvalidArgument for bad options or TLS files (naming
  // the file and the reason), Unavailable when a port cannot be opened.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  // Drains with no grace period (requests end at once) unless Drain ran,
  // and waits for the model to finish loading if it still is.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  Ports ports() const;
  Limits limits() const;
  // The served model; valid once WaitReady returned OK.
  const engine::ModelInfo& model_info() const;
  // OK once the model is loaded and the server ready; the load's error if
  // it failed; DeadlineExceeded if neither happened within `timeout`.
  absl::Status WaitReady(absl::Duration timeout);
  // Stops serving: health NOT_SERVING, new requests UNAVAILABLE, accepted
  // ones run for up to shutdown_timeout and are then ended; then the gRPC
  // server stops. Blocks until done; later calls return at once. If the
  // model is still loading, stops serving at once (the load cannot be
  // interrupted; the destructor waits for it). Returns how many requests
  // were still running or waiting when shutdown_timeout passed (and so were
  // ended, finish_reason cancelled).
  int Drain();
  // Blocks until Drain has finished (on another thread).
  void Wait();

 private:
  struct Impl;
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_SERVER_H_
