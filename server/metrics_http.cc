#include "server/metrics_http.h"

#include <CivetServer.h>
#include <algorithm>
#include <cerrno>
#include <civetweb.h>
#include <cstdio>
#include <dlfcn.h>
#include <exception>
#include <pthread.h>
#include <string>
#include <vector>

#include <arpa/inet.h>
#include <prometheus/exposer.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

// Debian's civetweb is built with USE_STACK_SIZE=102400: every thread it
// starts asks for a 100 KiB stack. glibc refuses such a stack (EINVAL) once
// the process's static TLS no longer fits in it, and OpenBLAS alone, which
// libtorch reaches through libblas.so.3, brings 60 KiB of it; civetweb then
// fails with "Cannot create threads: error 0". This definition, linked into
// every binary that can start the metrics server, takes precedence over
// libc's for civetweb too, and raises stacks under 1 MiB to 1 MiB (address
// space only: pages are touched as they are used).
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using Setter = int (*)(pthread_attr_t*, size_t);
  static const auto libc_setter =
      reinterpret_cast<Setter>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  constexpr size_t kFloor = size_t{1} << 20;
  if (libc_setter == nullptr) return ENOSYS;
  return libc_setter(attr, size < kFloor ? kFloor : size);
}

namespace accel::server {
namespace {

// civetweb reports why it cannot start ("cannot bind to 127.0.0.1:8002: Address already in use")
// only through its log callback, on the thread that starts it; Start collects those lines here.
thread_local std::string* start_log = nullptr;

int LogMessage(const mg_connection*, const char* message) {
  if (start_log != nullptr) {
    absl::StrAppend(start_log, start_log->empty() ? "" : "; ", message);
    return 1;
  }
  std::fprintf(stderr, "accel metrics http: %s\n", message);
  return 1;  // handled: civetweb writes it nowhere else
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, const MetricsRegistry* registry, int threads) {
  const std::string address = absl::StrCat(host, ":", port);
  // civetweb's own parser takes "999.1.1.1" as some other address and listens there anyway
  // (tried with 1.15), so the host is checked here.
  in_addr ipv4 = {};
  if (inet_pton(AF_INET, host.c_str(), &ipv4) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics HTTP address ", address,
                                                   ": the host must be an IPv4 address such as "
                                                   "127.0.0.1 or 0.0.0.0"));
  }
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics HTTP address ", address, ": the port must be in 0..65535"));
  }

  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  // civetweb 1.15 gives each accepted connection a worker thread of its own until the connection
  // closes, and a connection that sends nothing holds its thread until the request timeout. With
  // the old 2 threads and 10 s, four idle sockets stopped every scrape (issue 19). So:
  // - num_threads 128 (fewer under a low descriptor limit: Server::Start passes a share of it,
  //   internal/connection_limits.h): a scrape finds a free thread beside 100+ idle or slowloris
  //   connections. An idle worker costs little: 1 MiB of stack address space (pages touched only as
  //   used, see pthread_attr_setstacksize above) and a 16 KiB request buffer.
  // - request_timeout_ms 3000: a scrape's request is one small packet, sent at once; 3 s bounds
  //   how long any client that never finishes its request head (idle, or trickling bytes: the
  //   timeout counts from the first read, not between bytes) holds a thread. Past 128 such
  //   connections a scrape queues behind them, and waits at most about one timeout per 128.
  // - enable_keep_alive no (civetweb's default, stated): every response closes its connection,
  //   so a scraper does not hold a thread idle between scrapes.
  // - connection_queue and listen_backlog stay at civetweb's defaults: the queue is first in,
  //   first out, so a longer one would not let a scrape overtake the idle connections ahead of
  //   it; threads and the timeout do. linger_timeout_ms stays unset: a zero linger would reset
  //   connections and could cut a response the scraper has not read yet.
  std::vector<std::string> options = {
      "listening_ports",    address,
      "num_threads",        std::to_string(std::clamp(threads, 1, 128)),
      "request_timeout_ms", "3000",
      "enable_keep_alive",  "no"};
  CivetCallbacks callbacks;
  callbacks.log_message = &LogMessage;
  std::string log;
  start_log = &log;
  try {
    server->exposer_ = std::make_unique<prometheus::Exposer>(std::move(options), &callbacks);
  } catch (const std::exception& e) {
    start_log = nullptr;
    return absl::UnavailableError(absl::StrCat("metrics HTTP server cannot listen on ", address,
                                               ": ", log.empty() ? e.what() : log));
  }
  start_log = nullptr;
  const std::vector<int> ports = server->exposer_->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    return absl::InternalError(
        absl::StrCat("metrics HTTP server on ", address, ": civetweb reports no listening port"));
  }
  server->port_ = ports[0];
  // "$": civetweb matches a handler's URI as a prefix otherwise (/metricsx).
  server->exposer_->RegisterCollectable(registry->collectable(), "/metrics$");
  return server;
}

MetricsHttpServer::~MetricsHttpServer() = default;

}  // namespace accel::server
