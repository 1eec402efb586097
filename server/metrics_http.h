// server/metrics_http.h: the HTTP endpoint Prometheus scrapes, GET /metrics: prometheus-cpp's pull
// Exposer (on civetweb, its own threads: a thread per open connection, up to 128; a client that
// does not finish its request within 3 s is dropped), apart from gRPC's and the OpenAI port's.
// Besides the registry's metrics it serves the Exposer's own (exposer_scrapes_total,
// exposer_transferred_bytes_total, exposer_request_latencies).
//
//   ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<MetricsHttpServer> http,
//                          MetricsHttpServer::Start("0.0.0.0", 9090, &registry));
//   ...                 // serving until `http` is destroyed
#ifndef ACCEL_SERVER_METRICS_HTTP_H_
#define ACCEL_SERVER_METRICS_HTTP_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "server/metrics.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace accel::server {

// Thread-safe: requests are served on civetweb's threads; the object itself is only started,
// asked its port and destroyed.
class MetricsHttpServer {
 public:
  // Listens on host:port, an IPv4 address ("127.0.0.1", "0.0.0.0"); port 0 picks a free port.
  // Serves GET /metrics (Content-Type: text/plain; version=0.0.4) from registry->collectable()
  // (its collect hooks run per scrape; gzip when the client accepts it), civetweb's 405 for any
  // other method there, and 404 for any other path.
  // InvalidArgument for a host that is not an IPv4 address or a port outside 0..65535;
  // Unavailable when civetweb cannot listen (the port is in use, the address is not this
  // machine's). The message names host:port and civetweb's reason. `registry` is not owned and
  // must outlive the server.
  // `threads`: civetweb's worker threads, each serving one connection at a time (at most 128).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host, int port,
                                                                  const MetricsRegistry* registry,
                                                                  int threads = 128);

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;
  // Stops listening and joins civetweb's threads (a request in flight finishes first). Takes up to
  // 2 s: civetweb's accept loop notices the stop only when its poll, fixed at 2 s, returns.
  ~MetricsHttpServer();

  // The port really bound (the free one chosen when Start was given 0).
  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;

  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_METRICS_HTTP_H_
