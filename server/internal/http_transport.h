// server/internal/http_transport.h: the HTTP/1.1 (and HTTPS) server under
// accel-serve's OpenAI-compatible API (server/openai_http.h), on Boost.Beast
// and Boost.Asio (TLS: Asio's OpenSSL streams). Torch-free and engine-free;
// no Boost in this header.
//
// Why a library, and this one: it replaced ~1,200 lines of our own sockets
// and TLS code, and a handler must learn that its client left while it
// waits for tokens, which civetweb (the metrics port) cannot tell it and
// cpp-httplib cannot tell a non-streaming handler. Here a connection costs
// no thread: every connection is a chain of asynchronous operations on a
// small pool of I/O threads, and while a request is being answered a read
// stays posted on its socket, so a close (a FIN, a reset, a TLS
// close_notify) reaches the handler at once (HttpExchange::OnClientGone).
//
//   HttpServerOptions options;  options.port = 8000;
//   auto server = HttpServer::Start(options, [](std::shared_ptr<HttpExchange> exchange) {
//     exchange->Respond(200, "application/json", "{}");
//   }, error_body);
//
// Limits, from the request's first byte: a head of at most
// max_header_bytes (431) parsed by ParseHttpRequestHead (Beast's parser and
// our rules: http_request_head.h), a body of at most max_body_bytes (413,
// refused from Content-Length before it is read; `Expect: 100-continue` is
// answered), head and body within request_timeout (408, then close: a
// client trickling bytes holds its connection that long at most); a
// connection waits idle at most idle_timeout for its next request (and
// request_timeout for its first, TLS handshake included); a write that makes
// no progress for write_timeout ends the connection.
//
// Connections: at most max_connections at once. A new connection past the
// cap first takes the place of the connection that has waited longest
// without a complete request (idle or trickling), which is closed; only when
// every connection is being answered is the new one answered 503 with
// Retry-After (plain HTTP; under TLS it is closed). Every answer that ends a
// connection (errors, 503) is followed by a lingering close (our side shut,
// the client's bytes read and dropped for up to two seconds), so the answer
// reaches the client rather than being destroyed by a TCP reset. When
// accept() fails for want of file descriptors, accepting pauses and resumes
// (it never spins), so the port accepts again once descriptors are free.
//
// TLS: with tls_cert_pem / tls_key_pem the port speaks HTTPS only (TLS 1.2
// or later, ALPN http/1.1). A plain HTTP request to it is answered 400 in
// plain text; other bytes are dropped.
#ifndef ACCEL_SERVER_INTERNAL_HTTP_TRANSPORT_H_
#define ACCEL_SERVER_INTERNAL_HTTP_TRANSPORT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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
  int io_threads = 2;
  // PEM text (not paths): the certificate chain, leaf first, and its
  // unencrypted private key. Both empty: plain HTTP. Start checks them
  // (InvalidArgument naming the reason).
  std::string tls_cert_pem;
  std::string tls_key_pem;
};

struct HttpRequest {
  std::string method;
  std::string path;                                          // without the query
  std::string query;                                         // after '?', or empty
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;
  // The first header of that (lower-case) name, or null.
  const std::string* Header(absl::string_view name) const;
};

class Connection;  // http_transport.cc
struct ExchangeShared;

// One request and its answer. Thread-safe: a handler may answer from any
// thread, now or later (from the engine's sink). Writes are queued and sent
// in order; each returns false once the client is gone (its connection
// closed or failed, or a write timed out), after which nothing more is sent.
// The exchange ends with Respond or EndStream.
class HttpExchange {
 public:
  ~HttpExchange();
  HttpExchange(const HttpExchange&) = delete;
  HttpExchange& operator=(const HttpExchange&) = delete;

  const HttpRequest& request() const { return request_; }

  // Headers ("Name: value") every answer of this exchange carries besides
  // its own (CORS). Call before answering, on the handler's turn.
  void AddResponseHeaders(std::vector<std::string> headers) {
    for (std::string& header : headers) common_headers_.push_back(std::move(header));
  }

  // A whole response with Content-Length. `headers`: extra "Name: value".
  bool Respond(int status, absl::string_view content_type, absl::string_view body,
               const std::vector<std::string>& headers = {});
  // A streamed response (Transfer-Encoding: chunked): StartStream, then
  // WriteChunk as often as needed, then EndStream.
  bool StartStream(int status, absl::string_view content_type,
                   const std::vector<std::string>& headers = {});
  bool WriteChunk(absl::string_view data);
  bool EndStream();
  // True once the client is gone (closed its connection, or a write
  // failed); while the answer is being made, also as soon as its FIN or
  // reset reached the socket (a cheap, non-blocking look, for a handler busy
  // on the connection's own sequence: parsing a large body).
  bool PeerClosed() const;
  // `on_gone` runs once if the client goes before the exchange ended (at
  // once, on this thread, if it has already gone); never after the exchange
  // ended. It runs on a transport thread and must not block.
  void OnClientGone(std::function<void()> on_gone);
  // Runs `task` on the connection's own sequence (after the writes queued
  // before it), never concurrently with another task of this exchange;
  // dropped once this exchange's answer has ended (Respond or EndStream
  // reached the connection) or the connection closed. For work that must
  // leave the caller's thread at once (the engine's scheduler calls the
  // sinks).
  void Post(std::function<void()> task);
  // True once the server stops (HttpServer::Stop).
  bool stopping() const;

 private:
  friend class Connection;
  HttpExchange(HttpRequest request, std::shared_ptr<ExchangeShared> shared)
      : request_(std::move(request)), shared_(std::move(shared)) {}

  const HttpRequest request_;
  const std::shared_ptr<ExchangeShared> shared_;
  std::vector<std::string> common_headers_;
};

class HttpServer {
 public:
  // Called on a transport thread for each request, with the exchange to
  // answer. It may answer at once or later; it must not block for long.
  using Handler = std::function<void(std::shared_ptr<HttpExchange>)>;
  // The body of an error the server answers itself (400 bad request, 408,
  // 411, 413, 431, 503 too many connections), given status and message.
  using ErrorBody = std::function<std::string(int status, absl::string_view message)>;

  // Listens and starts accepting. InvalidArgument for a bad host or port or
  // TLS PEM text, Unavailable when it cannot listen.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                           Handler handler, ErrorBody error_body);
  // Stop(), then ends every connection and joins the I/O threads.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  // Stops accepting and closes connections that wait for a request; answers
  // in progress go on (they see HttpExchange::stopping() and close after).
  // Does not wait.
  void Stop();
  // Waits up to `timeout` for every connection to end; true when all did.
  bool WaitConnections(absl::Duration timeout);
  // Connections open now; connections closed to make room for newer ones,
  // and connections answered 503 (or closed) past max_connections, since
  // the start. For the metrics and the tests.
  struct Counts {
    int64_t open = 0;
    int64_t evicted = 0;
    int64_t refused = 0;
    int64_t accept_failures = 0;  // accept() failed (file descriptors ran out)
  };
  Counts counts() const;

  struct Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_HTTP_TRANSPORT_H_
