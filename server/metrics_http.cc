#include "server/metrics_http.h"

#include <cerrno>
#include <civetweb.h>
#include <cstdio>
#include <cstring>
#include <dlfcn.h>
#include <mutex>
#include <pthread.h>
#include <string>

#include <arpa/inet.h>

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

constexpr char kMetricsContentType[] = "text/plain; version=0.0.4; charset=utf-8";
constexpr char kPlainText[] = "text/plain; charset=utf-8";

// civetweb asks for mg_init_library once before any mg_start and does not make it thread-safe.
// It is never undone: another server may start later in the process.
void InitCivetwebOnce() {
  static std::once_flag once;
  std::call_once(once, [] { mg_init_library(0); });
}

// Returns `status`, which civetweb records in its access log.
int Respond(mg_connection* conn, int status, const char* content_type, absl::string_view body,
            const char* allow = nullptr) {
  std::string length = std::to_string(body.size());
  mg_response_header_start(conn, status);
  mg_response_header_add(conn, "Content-Type", content_type, -1);
  mg_response_header_add(conn, "Content-Length", length.c_str(), -1);
  if (allow != nullptr) mg_response_header_add(conn, "Allow", allow, -1);
  mg_response_header_send(conn);
  mg_write(conn, body.data(), body.size());
  return status;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, const MetricsRegistry* registry) {
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
  InitCivetwebOnce();

  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(registry));
  // civetweb 1.15 gives each accepted connection a worker thread of its own until the connection
  // closes, and a connection that sends nothing holds its thread until the request timeout. With
  // the old 2 threads and 10 s, four idle sockets stopped every scrape (issue 19). So:
  // - num_threads 128: a scrape finds a free thread beside 100+ idle or slowloris connections.
  //   An idle worker costs little: 1 MiB of stack address space (pages touched only as used, see
  //   pthread_attr_setstacksize above) and a 16 KiB request buffer.
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
  const char* options[] = {"listening_ports",
                           address.c_str(),
                           "num_threads",
                           "128",
                           "request_timeout_ms",
                           "3000",
                           "enable_keep_alive",
                           "no",
                           nullptr};
  mg_callbacks callbacks = {};
  callbacks.log_message = &MetricsHttpServer::LogMessage;
  mg_init_data init = {&callbacks, server.get(), options};
  unsigned error_code = 0;
  char error_text[256] = "";
  mg_error_data error = {&error_code, error_text, sizeof error_text};
  server->context_ = mg_start2(&init, &error);
  {
    absl::MutexLock lock(&server->log_mu_);
    if (server->context_ == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("metrics HTTP server cannot listen on ", address, ": ",
                       server->start_log_.empty() ? error_text : server->start_log_));
    }
    server->started_ = true;
  }

  // civetweb 1.15 reads back the bound address after bind(), so port 0 reports the real port.
  mg_server_port bound[1] = {};
  if (mg_get_server_ports(server->context_, 1, bound) != 1 || bound[0].port <= 0) {
    return absl::InternalError(
        absl::StrCat("metrics HTTP server on ", address, ": civetweb reports no listening port"));
  }
  server->port_ = bound[0].port;
  // "/**" takes every path, so that routing, and every status but civetweb's own errors, is ours.
  mg_set_request_handler(server->context_, "/**", &MetricsHttpServer::HandleRequest, server.get());
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ != nullptr) mg_stop(context_);
}

int MetricsHttpServer::HandleRequest(mg_connection* conn, void* self) {
  const mg_request_info* request = mg_get_request_info(conn);
  if (request->local_uri == nullptr || std::strcmp(request->local_uri, "/metrics") != 0) {
    return Respond(conn, 404, kPlainText, "Not Found: the metrics are at /metrics\n");
  }
  if (std::strcmp(request->request_method, "GET") != 0) {
    return Respond(conn, 405, kPlainText, "Method Not Allowed: use GET\n", /*allow=*/"GET");
  }
  std::string body = static_cast<const MetricsHttpServer*>(self)->registry_->Render();
  return Respond(conn, 200, kMetricsContentType, body);
}

int MetricsHttpServer::LogMessage(const mg_connection* conn, const char* message) {
  auto* self = static_cast<MetricsHttpServer*>(mg_get_user_data(mg_get_context(conn)));
  if (self != nullptr) {
    absl::MutexLock lock(&self->log_mu_);
    if (!self->started_) {
      absl::StrAppend(&self->start_log_, self->start_log_.empty() ? "" : "; ", message);
      return 1;
    }
  }
  std::fprintf(stderr, "accel metrics http: %s\n", message);
  return 1;  // handled: civetweb writes it nowhere else
}

}  // namespace accel::server
