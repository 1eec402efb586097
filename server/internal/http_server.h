// server/internal/http_server.h: the small HTTP/1.1 server under accel-serve's
// OpenAI-compatible API (server/openai_http.h). Torch-free, engine-free.
//
// Why our own rather than civetweb (which serves /metrics): a generation
// handler waits for tokens and must notice a client that closed its
// connection meanwhile, to cancel the request; civetweb 1.15 offers no way to
// reach a connection's socket or to ask whether the peer closed, and Debian
// builds it without TLS. Here each connection has a thread (at most
// max_connections; past it a connection is answered 503 at once, or closed
// at once under TLS), the socket is ours (PeerClosed polls it), and every
// read has a deadline.
//
// TLS: with tls_cert_pem / tls_key_pem set the port speaks HTTPS only (TLS
// 1.2 or later, OpenSSL; one SSL_CTX built by Start). The handshake must end
// within request_timeout of the connection (a client that never sends its
// ClientHello is closed then, as is one that trickles it); a plain HTTP
// request to the port is answered 400 in plain text and closed. A connection's
// bytes go through a Transport (http_server.cc: a plain socket, or TLS over
// it), so the parsing and the limits below are the same either way.
//
//   HttpServerOptions options;  options.port = 8000;
//   auto server = HttpServer::Start(options, [](HttpExchange& exchange) {
//     exchange.Respond(200, "application/json", "{}");
//   }, error_body);
//
// Limits: a request head of at most max_header_bytes, a body of at most
// max_body_bytes (413, refused before it is read when Content-Length says
// so; `Expect: 100-continue` is answered), head and body within
// request_timeout of the request's first byte (408, then close: a client
// trickling bytes holds a thread for at most that long), keep-alive
// connections idle at most idle_timeout. Request bodies need Content-Length
// (chunked request bodies: 411). The head is parsed by ParseHttpRequestHead
// (http_parse.h: its rules against request smuggling and header injection,
// and at most kMaxHttpHeaders header lines, 431).
#ifndef ACCEL_SERVER_INTERNAL_HTTP_SERVER_H_
#define ACCEL_SERVER_INTERNAL_HTTP_SERVER_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace accel::server::internal {

struct HttpServerOptions {
  std::string host = "0.0.0.0";  // an IPv4 address
  int port = 0;                  // 0: a free one
  size_t max_header_bytes = 64 << 10;
  size_t max_body_bytes = 4 << 20;
  absl::Duration request_timeout = absl::Seconds(10);
  absl::Duration idle_timeout = absl::Seconds(30);
  absl::Duration write_timeout = absl::Seconds(30);  // a client that stops reading
  int max_connections = 512;
  // PEM text (not paths): the certificate chain, leaf first, and its
  // unencrypted private key. Both empty: plain HTTP. Start checks them
  // (InvalidArgument naming the reason).
  std::string tls_cert_pem;
  std::string tls_key_pem;
};

// A connection's byte stream (http_server.cc): a plain socket, or TLS.
class Transport;
class TlsContext;

struct HttpRequest {
  std::string method;
  std::string path;                                          // without the query
  std::string query;                                         // after '?', or empty
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;
  // The first header of that (lower-case) name, or null.
  const std::string* Header(absl::string_view name) const;
};

// One request's answer, on the connection's thread. Every write returns
// false once the client is gone (or the write timed out).
class HttpExchange {
 public:
  const HttpRequest& request() const { return request_; }

  // A whole response with Content-Length. `headers`: extra "Name: value".
  bool Respond(int status, absl::string_view content_type, absl::string_view body,
               const std::vector<std::string>& headers = {});
  // A streamed response (Transfer-Encoding: chunked): StartStream, then
  // WriteChunk as often as needed, then EndStream.
  bool StartStream(int status, absl::string_view content_type,
                   const std::vector<std::string>& headers = {});
  bool WriteChunk(absl::string_view data);
  bool EndStream();
  // True when the client closed its connection (or it failed): a cheap,
  // non-blocking check, to call while waiting for something to send.
  bool PeerClosed();
  // True once the server stops (HttpServer::Stop): a handler that waits
  // should end soon.
  bool stopping() const;

 private:
  friend class HttpServer;
  HttpExchange(Transport* io, const HttpRequest& request, const std::atomic<bool>* stopping)
      : io_(io), request_(request), stopping_(stopping) {}
  bool Send(absl::string_view data);

  Transport* io_;
  const HttpRequest& request_;
  const std::atomic<bool>* stopping_;
  bool responded_ = false;
  bool streaming_ = false;
  bool failed_ = false;
  bool close_after_ = false;  // the client asked for Connection: close
};

class HttpServer {
 public:
  using Handler = std::function<void(HttpExchange&)>;
  // The body of an error the server answers itself (400 bad request, 408,
  // 411, 413, 431, 503 too many connections), given status and message.
  using ErrorBody = std::function<std::string(int status, absl::string_view message)>;

  // Listens and starts accepting. InvalidArgument for a bad host or port or
  // TLS PEM text, Unavailable when it cannot listen.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                           Handler handler, ErrorBody error_body);
  // Stop(), then waits for every connection's thread.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  // Stops accepting and closes idle connections; handlers running go on
  // (they see HttpExchange::stopping()). Does not wait.
  void Stop();
  // Waits up to `timeout` for every connection to end; true when all did.
  bool WaitConnections(absl::Duration timeout);

 private:
  struct Connection {
    std::thread thread;
    std::atomic<bool> done{false};
  };
  HttpServer(HttpServerOptions options, Handler handler, ErrorBody error_body);
  void AcceptLoop();
  // One connection, from its accept at `accepted` to its last answer.
  void Serve(int fd, absl::Time accepted);
  void ServeRequests(Transport& io, absl::Time accepted);
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool SendError(Transport& io, int status, absl::string_view message);
  std::string ErrorResponse(int status, absl::string_view message) const;

  const HttpServerOptions options_;
  const Handler handler_;
  const ErrorBody error_body_;
  std::unique_ptr<TlsContext> tls_;  // null: plain HTTP
  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  int port_ = 0;
  std::atomic<bool> stopping_{false};

  absl::Mutex mu_;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
  int open_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread acceptor_;
};

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_HTTP_SERVER_H_
