// server/metrics_http.h: the HTTP endpoint Prometheus scrapes, GET /metrics, served by civetweb
// on its own threads (a thread per open connection, up to 128; a client that does not finish its
// request within 3 s is dropped), apart from gRPC's.
//
//   ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<MetricsHttpServer> http,
//                          MetricsHttpServer::Start("0.0.0.0", 9090, &registry));
//   ...                 // serving until `http` is destroyed
#ifndef ACCEL_SERVER_METRICS_HTTP_H_
#define ACCEL_SERVER_METRICS_HTTP_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

#include "server/metrics.h"

struct mg_connection;
struct mg_context;

namespace accel::server {

// Thread-safe: requests are served on civetweb's threads; the object itself is only started,
// asked its port and destroyed.
class MetricsHttpServer {
 public:
  // Listens on host:port, an IPv4 address ("127.0.0.1", "0.0.0.0"); port 0 picks a free port.
  // Serves GET /metrics (Content-Type: text/plain; version=0.0.4; charset=utf-8) from
  // registry->Render(), 405 for any other method there, and 404 for any other path.
  // InvalidArgument for a host that is not an IPv4 address or a port outside 0..65535;
  // Unavailable when civetweb cannot listen (the port is in use, the address is not this
  // machine's). The message names host:port and civetweb's reason. `registry` is not owned and
  // must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host, int port,
                                                                  const MetricsRegistry* registry);

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;
  // Stops listening and joins civetweb's threads (a request in flight finishes first). Takes up to
  // 2 s: civetweb's accept loop notices the stop only when its poll, fixed at 2 s, returns.
  ~MetricsHttpServer();

  // The port really bound (the free one chosen when Start was given 0).
  int port() const { return port_; }

 private:
  explicit MetricsHttpServer(const MetricsRegistry* registry) : registry_(registry) {}

  static int HandleRequest(mg_connection* conn, void* self);
  static int LogMessage(const mg_connection* conn, const char* message);

  const MetricsRegistry* const registry_;  // not owned
  mg_context* context_ = nullptr;          // set once by Start, freed by the destructor
  int port_ = 0;
  // civetweb reports why it cannot start (e.g. "cannot bind to ...: Address already in use")
  // only through the log callback; Start collects those lines for its Status.
  absl::Mutex log_mu_;
  bool started_ ABSL_GUARDED_BY(log_mu_) = false;
  std::string start_log_ ABSL_GUARDED_BY(log_mu_);
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_METRICS_HTTP_H_
