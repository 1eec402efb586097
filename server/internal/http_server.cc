#include "server/internal/http_server.h"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>
#include <variant>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "server/internal/http_parse.h"

namespace accel::server::internal {
namespace {

// How often a blocked read looks at the stop flag.
constexpr absl::Duration kPollSlice = absl::Milliseconds(200);

const char* Reason(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 411:
      return "Length Required";
    case 413:
      return "Payload Too Large";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 499:
      return "Client Closed Request";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return "Unknown";
  }
}

std::string Head(int status, absl::string_view content_type, const std::string& framing, bool close,
                 const std::vector<std::string>& headers) {
  std::string head = absl::StrCat("HTTP/1.1 ", status, " ", Reason(status), "\r\n");
  if (!content_type.empty()) absl::StrAppend(&head, "Content-Type: ", content_type, "\r\n");
  absl::StrAppend(&head, framing, "\r\n");
  if (close) absl::StrAppend(&head, "Connection: close\r\n");
  for (const std::string& header : headers) absl::StrAppend(&head, header, "\r\n");
  absl::StrAppend(&head, "\r\n");
  return head;
}

enum class ReadResult { kData, kClosed, kTimeout, kStopping };

// Waits until `fd` has one of `events` (true), or `deadline` passes, or
// `stopping` (when not null) turns true, or the socket fails (false;
// `result` says which).

bool WaitFor(int fd, short events, absl::Time deadline, const std::atomic<bool>* stopping,
             ReadResult* result) {
  while (true) {
    if (stopping != nullptr && stopping->load()) {
      *result = ReadResult::kStopping;
      return false;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      *result = ReadResult::kTimeout;
      return false;
    }
    pollfd p = {fd, events, 0};
    const int waited = poll(&p, 1,
                            static_cast<int>(absl::ToInt64Milliseconds(std::min(left, kPollSlice) +
                                                                       absl::Milliseconds(1))));
    if (waited < 0 && errno != EINTR) {
      *result = ReadResult::kClosed;
      return false;
    }
    if (waited > 0) return true;
  }
}

// The whole of `data` on a blocking socket (SO_SNDTIMEO bounds each send).
bool SendAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;  // EAGAIN here is SO_SNDTIMEO passing: a client that stopped reading
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// A client that closed its socket (FIN, reset, error), seen by poll alone;
// `readable` says whether bytes wait.
bool SocketClosed(int fd, bool* readable) {
  *readable = false;
  pollfd p = {fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) return true;
  *readable = (p.revents & POLLIN) != 0;
  return false;
}

int NoPassword(char*, int, int, void*) { return 0; }

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

struct SslCtxFree {
  void operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }
};
struct SslFree {
  void operator()(SSL* ssl) const { SSL_free(ssl); }
};
struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct EvpPkeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslCtxFree>;
using SslPtr = std::unique_ptr<SSL, SslFree>;
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using EvpPkeyPtr = std::unique_ptr<EVP_PKEY, EvpPkeyFree>;

// ALPN: this server speaks HTTP/1.1 only; a client offering only h2 gets
// no ALPN answer (and may then speak HTTP/1.1 or give up).
int SelectHttp11(SSL*, const unsigned char** out, unsigned char* out_length,
                 const unsigned char* in, unsigned int in_length, void*) {
  static const unsigned char kHttp11[] = {8, 'h', 't', 't', 'p', '/', '1', '.', '1'};
  unsigned char* selected = nullptr;
  if (SSL_select_next_proto(&selected, out_length, kHttp11, sizeof(kHttp11), in, in_length) !=
      OPENSSL_NPN_NEGOTIATED) {
    return SSL_TLSEXT_ERR_NOACK;
  }
  *out = selected;
  return SSL_TLSEXT_ERR_OK;
}

}  // namespace

// How a connection's bytes move: the parsing in HttpServer::ServeRequests
// and HttpExchange see only this.
class Transport {
 public:
  enum class Opened { kOk, kFailed, kPlainHttpOnTls };
  explicit Transport(int fd) : fd_(fd) {}
  virtual ~Transport() = default;
  int fd() const { return fd_; }
  // TLS: the handshake, by `deadline` (a server stopping gives up). Plain:
  // nothing to do.
  virtual Opened Open(absl::Time /*deadline*/, const std::atomic<bool>& /*stopping*/) {
    return Opened::kOk;
  }
  // Appends what the peer sent to `buffer`, waiting until `deadline`;
  // kStopping only when stop_when_idle.
  virtual ReadResult Read(std::string& buffer, absl::Time deadline,
                          const std::atomic<bool>& stopping, bool stop_when_idle) = 0;
  // The whole of `data`; false once the client is gone or stopped reading
  // for the write timeout.
  virtual bool Write(absl::string_view data) = 0;
  // A cheap, non-blocking check whether the client closed the connection.
  virtual bool PeerClosed() = 0;
  // Before the socket is closed (TLS: close_notify).
  virtual void Shutdown() {}

 protected:
  const int fd_;
};

namespace {

// Plain HTTP: a blocking socket (SO_SNDTIMEO bounds writes), poll before recv.
class PlainTransport final : public Transport {
 public:
  using Transport::Transport;

  ReadResult Read(std::string& buffer, absl::Time deadline, const std::atomic<bool>& stopping,
                  bool stop_when_idle) override {
    while (true) {
      ReadResult result;
      if (!WaitFor(fd_, POLLIN, deadline, stop_when_idle ? &stopping : nullptr, &result)) {
        return result;
      }
      char chunk[16384];
      const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
      if (n == 0) return ReadResult::kClosed;
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        return ReadResult::kClosed;
      }
      buffer.append(chunk, static_cast<size_t>(n));
      return ReadResult::kData;
    }
  }

  bool Write(absl::string_view data) override { return SendAll(fd_, data); }

  bool PeerClosed() override {
    bool readable;
    if (SocketClosed(fd_, &readable)) return true;
    if (readable) {
      char byte;
      const ssize_t n = recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n == 0) return true;
      if (n < 0 && errno != EAGAIN && errno != EINTR) return true;
    }
    return false;
  }
};

// TLS over a non-blocking socket: every SSL_* call that wants the socket
// waits for it with poll, so each has a deadline (a client that stops
// mid-record cannot block a read, nor one that stops reading a write).
class TlsTransport final : public Transport {
 public:
  TlsTransport(int fd, SslPtr ssl, absl::Duration write_timeout)
      : Transport(fd), ssl_(std::move(ssl)), write_timeout_(write_timeout) {
    fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) | O_NONBLOCK);
    SSL_set_fd(ssl_.get(), fd_);
  }

  Opened Open(absl::Time deadline, const std::atomic<bool>& stopping) override {
    while (true) {
      ERR_clear_error();
      const int r = SSL_accept(ssl_.get());
      if (r == 1) return Opened::kOk;
      const int error = SSL_get_error(ssl_.get(), r);
      ReadResult ignored;
      if (error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) {
        if (!WaitFor(fd_, error == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline, &stopping,
                     &ignored)) {
          broken_ = true;  // a handshake half done: no close_notify
          return Opened::kFailed;
        }
        continue;
      }
      broken_ = true;
      const unsigned long code = ERR_peek_error();
      ERR_clear_error();
      if (error == SSL_ERROR_SSL && ERR_GET_LIB(code) == ERR_LIB_SSL &&
          ERR_GET_REASON(code) == SSL_R_HTTP_REQUEST) {
        return Opened::kPlainHttpOnTls;
      }
      return Opened::kFailed;
    }
  }

  ReadResult Read(std::string& buffer, absl::Time deadline, const std::atomic<bool>& stopping,
                  bool stop_when_idle) override {
    while (true) {
      if (stop_when_idle && stopping.load()) return ReadResult::kStopping;
      char chunk[16384];
      ERR_clear_error();
      const int n = SSL_read(ssl_.get(), chunk, sizeof(chunk));
      if (n > 0) {
        buffer.append(chunk, static_cast<size_t>(n));
        return ReadResult::kData;
      }
      const int error = SSL_get_error(ssl_.get(), n);
      if (error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) {
        ReadResult result;
        if (!WaitFor(fd_, error == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline,
                     stop_when_idle ? &stopping : nullptr, &result)) {
          return result;
        }
        continue;
      }
      if (error != SSL_ERROR_ZERO_RETURN) broken_ = true;  // ZERO_RETURN: close_notify
      ERR_clear_error();
      return ReadResult::kClosed;
    }
  }

  bool Write(absl::string_view data) override {
    if (broken_) return false;
    // As SO_SNDTIMEO on the plain socket: a limit on each wait, not the whole.
    absl::Time deadline = absl::Now() + write_timeout_;
    while (!data.empty()) {
      ERR_clear_error();
      const int n = SSL_write(ssl_.get(), data.data(),
                              static_cast<int>(std::min<size_t>(data.size(), 1 << 30)));
      if (n > 0) {
        data.remove_prefix(static_cast<size_t>(n));
        deadline = absl::Now() + write_timeout_;
        continue;
      }
      const int error = SSL_get_error(ssl_.get(), n);
      ReadResult ignored;
      if ((error == SSL_ERROR_WANT_WRITE || error == SSL_ERROR_WANT_READ) &&
          WaitFor(fd_, error == SSL_ERROR_WANT_WRITE ? POLLOUT : POLLIN, deadline, nullptr,
                  &ignored)) {
        continue;
      }
      broken_ = true;
      ERR_clear_error();
      return false;
    }
    return true;
  }

  // Decrypted bytes OpenSSL holds (SSL_has_pending) are a request the client
  // pipelined, not a close; otherwise poll sees a FIN or a reset, and bytes
  // on the socket may be a close_notify alert, which SSL_peek reports as
  // SSL_ERROR_ZERO_RETURN (it consumes records but keeps application data).
  bool PeerClosed() override {
    if (broken_) return true;
    bool readable;
    if (SocketClosed(fd_, &readable)) return true;
    if (!readable && SSL_has_pending(ssl_.get()) == 0) return false;
    char byte;
    ERR_clear_error();
    const int n = SSL_peek(ssl_.get(), &byte, 1);
    if (n > 0) return false;
    const int error = SSL_get_error(ssl_.get(), n);
    if (error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) return false;
    if (error != SSL_ERROR_ZERO_RETURN) broken_ = true;
    ERR_clear_error();
    return true;
  }

  // One close_notify, not waiting for the client's (the socket closes next).
  void Shutdown() override {
    if (broken_) return;
    ERR_clear_error();
    SSL_shutdown(ssl_.get());
    ERR_clear_error();
  }

 private:
  const SslPtr ssl_;
  const absl::Duration write_timeout_;
  // A fatal TLS error happened (or the handshake did not finish): no
  // SSL_shutdown, as OpenSSL requires, and no more writes.
  bool broken_ = false;
};

}  // namespace

// The SSL_CTX, built once by HttpServer::Start and shared by the
// connections' threads (OpenSSL locks what it shares).
class TlsContext {
 public:
  static absl::StatusOr<std::unique_ptr<TlsContext>> Create(const std::string& cert_pem,
                                                            const std::string& key_pem) {
    ERR_clear_error();
    SslCtxPtr ctx(SSL_CTX_new(TLS_server_method()));
    if (ctx == nullptr) {
      return absl::InternalError(absl::StrCat("HTTP TLS: SSL_CTX_new: ", OpenSslErrors()));
    }
    SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
    SSL_CTX_set_options(ctx.get(), SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
    SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE |
                                    SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER | SSL_MODE_RELEASE_BUFFERS);
    SSL_CTX_set_alpn_select_cb(ctx.get(), SelectHttp11, nullptr);
    // The chain: the leaf, then any intermediates.
    BioPtr cert_bio(BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())));
    X509Ptr leaf(PEM_read_bio_X509(cert_bio.get(), nullptr, NoPassword, nullptr));
    if (leaf == nullptr || SSL_CTX_use_certificate(ctx.get(), leaf.get()) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("HTTP TLS: no usable PEM certificate (", OpenSslErrors(), ")"));
    }
    while (X509Ptr extra{PEM_read_bio_X509(cert_bio.get(), nullptr, NoPassword, nullptr)}) {
      if (SSL_CTX_add0_chain_cert(ctx.get(), extra.get()) != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("HTTP TLS: a chain certificate is unusable (", OpenSslErrors(), ")"));
      }
      extra.release();  // owned by ctx now
    }
    ERR_clear_error();  // the read past the last certificate
    BioPtr key_bio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())));
    EvpPkeyPtr key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, NoPassword, nullptr));
    if (key == nullptr || SSL_CTX_use_PrivateKey(ctx.get(), key.get()) != 1 ||
        SSL_CTX_check_private_key(ctx.get()) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "HTTP TLS: no usable private key for the certificate (", OpenSslErrors(), ")"));
    }
    return std::unique_ptr<TlsContext>(new TlsContext(std::move(ctx)));
  }

  // A connection's TLS state, or null when OpenSSL cannot make one.
  std::unique_ptr<Transport> NewTransport(int fd, absl::Duration write_timeout) const {
    SslPtr ssl(SSL_new(ctx_.get()));
    if (ssl == nullptr) {
      ERR_clear_error();
      return nullptr;
    }
    return std::make_unique<TlsTransport>(fd, std::move(ssl), write_timeout);
  }

 private:
  explicit TlsContext(SslCtxPtr ctx) : ctx_(std::move(ctx)) {}
  const SslCtxPtr ctx_;
};

const std::string* HttpRequest::Header(absl::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return &value;
  }
  return nullptr;
}

bool HttpExchange::Send(absl::string_view data) {
  if (failed_) return false;
  if (!io_->Write(data)) failed_ = true;
  return !failed_;
}

bool HttpExchange::Respond(int status, absl::string_view content_type, absl::string_view body,
                           const std::vector<std::string>& headers) {
  if (responded_) return false;
  responded_ = true;
  std::string message = Head(status, content_type, absl::StrCat("Content-Length: ", body.size()),
                             close_after_, headers);
  // One send for small answers: one packet, no delayed-ACK stall.
  if (body.size() < 65536) {
    message.append(body.data(), body.size());
    return Send(message);
  }
  return Send(message) && Send(body);
}

bool HttpExchange::StartStream(int status, absl::string_view content_type,
                               const std::vector<std::string>& headers) {
  if (responded_) return false;
  responded_ = true;
  streaming_ = true;
  return Send(Head(status, content_type, "Transfer-Encoding: chunked", close_after_, headers));
}

bool HttpExchange::WriteChunk(absl::string_view data) {
  if (!streaming_) return false;
  if (data.empty()) return !failed_;  // an empty chunk would end the body
  std::string chunk = absl::StrCat(absl::Hex(data.size()), "\r\n");
  chunk.append(data.data(), data.size());
  chunk.append("\r\n");
  return Send(chunk);
}

bool HttpExchange::EndStream() {
  if (!streaming_) return false;
  streaming_ = false;
  return Send("0\r\n\r\n");
}

bool HttpExchange::PeerClosed() {
  if (failed_) return true;
  if (io_->PeerClosed()) failed_ = true;
  return failed_;
}

bool HttpExchange::stopping() const { return stopping_->load(); }

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                              Handler handler,
                                                              ErrorBody error_body) {
  const std::string address = absl::StrCat(options.host, ":", options.port);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, options.host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HTTP address ", address, ": the host must be an IPv4 address such as 0.0.0.0"));
  }
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP address ", address, ": the port must be in 0..65535"));
  }
  addr.sin_port = htons(static_cast<uint16_t>(options.port));
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("HTTP TLS: give both a certificate and a key, or neither");
  }
  std::unique_ptr<HttpServer> server(
      new HttpServer(options, std::move(handler), std::move(error_body)));
  if (!options.tls_cert_pem.empty()) {
    absl::StatusOr<std::unique_ptr<TlsContext>> tls =
        TlsContext::Create(options.tls_cert_pem, options.tls_key_pem);
    if (!tls.ok()) return tls.status();
    server->tls_ = *std::move(tls);
  }
  server->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (server->listen_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("HTTP: socket(): ", std::strerror(errno)));
  }
  const int one = 1;
  setsockopt(server->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(server->listen_fd_, 512) != 0) {
    return absl::UnavailableError(
        absl::StrCat("HTTP server cannot listen on ", address, ": ", std::strerror(errno)));
  }
  socklen_t length = sizeof(addr);
  getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &length);
  server->port_ = ntohs(addr.sin_port);
  if (pipe2(server->wake_pipe_, O_CLOEXEC) != 0) {
    return absl::UnavailableError(absl::StrCat("HTTP: pipe(): ", std::strerror(errno)));
  }
  HttpServer* self = server.get();
  server->acceptor_ = std::thread([self] { self->AcceptLoop(); });
  return server;
}

HttpServer::HttpServer(HttpServerOptions options, Handler handler, ErrorBody error_body)
    : options_(std::move(options)),
      handler_(std::move(handler)),
      error_body_(std::move(error_body)) {}

HttpServer::~HttpServer() {
  Stop();
  if (acceptor_.joinable()) acceptor_.join();
  std::list<Connection> connections;
  {
    absl::MutexLock lock(&mu_);
    connections.swap(connections_);
  }
  for (Connection& connection : connections) connection.thread.join();
  if (listen_fd_ >= 0) close(listen_fd_);
  for (int fd : wake_pipe_) {
    if (fd >= 0) close(fd);
  }
}

void HttpServer::Stop() {
  if (stopping_.exchange(true)) return;
  if (wake_pipe_[1] >= 0) {
    const char byte = 0;
    [[maybe_unused]] ssize_t ignored = write(wake_pipe_[1], &byte, 1);
  }
}

bool HttpServer::WaitConnections(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return open_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&none), timeout);
}

void HttpServer::ReapLocked() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (it->done.load()) {
      it->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

std::string HttpServer::ErrorResponse(int status, absl::string_view message) const {
  const std::string body = error_body_(status, message);
  std::string response =
      Head(status, "application/json", absl::StrCat("Content-Length: ", body.size()), true, {});
  response += body;
  return response;
}

bool HttpServer::SendError(Transport& io, int status, absl::string_view message) {
  return io.Write(ErrorResponse(status, message));
}

void HttpServer::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
    if (poll(p, 2, 1000) <= 0) {
      absl::MutexLock lock(&mu_);
      ReapLocked();
      continue;
    }
    if (stopping_.load()) break;
    if (!(p[0].revents & POLLIN)) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    const absl::Duration write_timeout = options_.write_timeout;
    timeval tv = absl::ToTimeval(write_timeout);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    absl::MutexLock lock(&mu_);
    ReapLocked();
    if (open_ >= options_.max_connections) {
      // Under TLS an answer would need a handshake here, on the acceptor's
      // thread: the connection is only closed.
      if (tls_ == nullptr) {
        timeval short_tv = {1, 0};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &short_tv, sizeof(short_tv));
        SendAll(fd, ErrorResponse(503, absl::StrCat("this server has ", open_,
                                                    " connections open, its limit; retry")));
      }
      close(fd);
      continue;
    }
    ++open_;
    connections_.emplace_back();
    Connection* connection = &connections_.back();
    const absl::Time accepted = absl::Now();
    connection->thread = std::thread([this, fd, connection, accepted] {
      Serve(fd, accepted);
      close(fd);
      absl::MutexLock inner(&mu_);
      --open_;
      connection->done.store(true);
    });
  }
}

void HttpServer::Serve(int fd, absl::Time accepted) {
  // OpenSSL writes to the socket with send() without MSG_NOSIGNAL: a client
  // gone must not kill the process. A SIGPIPE blocked on this thread stays
  // pending on it and goes with it.
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  std::unique_ptr<Transport> io;
  if (tls_ == nullptr) {
    io = std::make_unique<PlainTransport>(fd);
  } else {
    io = tls_->NewTransport(fd, options_.write_timeout);
    if (io == nullptr) return;
  }
  switch (io->Open(accepted + options_.request_timeout, stopping_)) {
    case Transport::Opened::kOk:
      ServeRequests(*io, accepted);
      io->Shutdown();
      return;
    case Transport::Opened::kPlainHttpOnTls: {
      // Said in plain text, as the client speaks; its request is read (a
      // little) before the close so the answer is not lost to a reset.
      const std::string answer = ErrorResponse(
          400, "this port speaks HTTPS (TLS): send the request to https://, not http://");
      send(fd, answer.data(), answer.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      shutdown(fd, SHUT_WR);
      std::string ignored;
      const absl::Time until = absl::Now() + absl::Milliseconds(500);
      ReadResult result;
      while (ignored.size() < (64 << 10) && WaitFor(fd, POLLIN, until, nullptr, &result)) {
        char chunk[4096];
        const ssize_t n = recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
        if (n <= 0 && !(n < 0 && (errno == EAGAIN || errno == EINTR))) break;
        if (n > 0) ignored.append(chunk, static_cast<size_t>(n));
      }
      return;
    }
    case Transport::Opened::kFailed:
      return;
  }
}

void HttpServer::ServeRequests(Transport& io, absl::Time accepted) {
  std::string buffer;
  bool first = true;
  while (true) {
    // Wait for the next request to begin: the first within request_timeout
    // of the connection (its TLS handshake included), later ones within
    // idle_timeout of the last answer.
    const absl::Time idle_deadline =
        first ? accepted + options_.request_timeout : absl::Now() + options_.idle_timeout;
    absl::Time deadline = absl::InfiniteFuture();
    if (buffer.empty()) {
      const ReadResult r = io.Read(buffer, idle_deadline, stopping_, true);
      if (r != ReadResult::kData) {
        if (r == ReadResult::kTimeout && first) {
          SendError(io, 408, "the request did not arrive in time");
        }
        return;
      }
    }
    first = false;
    deadline = absl::Now() + options_.request_timeout;
    // The head.
    size_t head_end;
    while ((head_end = buffer.find("\r\n\r\n")) == std::string::npos) {
      if (buffer.size() > options_.max_header_bytes) {
        SendError(io, 431,
                  absl::StrCat("the request head is over ", options_.max_header_bytes, " bytes"));
        return;
      }
      const ReadResult r = io.Read(buffer, deadline, stopping_, false);
      if (r == ReadResult::kTimeout) {
        SendError(io, 408, "the request head did not arrive in time");
        return;
      }
      if (r != ReadResult::kData) return;
    }
    if (head_end > options_.max_header_bytes) {
      SendError(io, 431,
                absl::StrCat("the request head is over ", options_.max_header_bytes, " bytes"));
      return;
    }
    HttpParseResult parsed = ParseHttpRequestHead(absl::string_view(buffer).substr(0, head_end),
                                                  options_.max_body_bytes);
    if (const HttpParseError* error = std::get_if<HttpParseError>(&parsed)) {
      SendError(io, error->status, error->message);
      return;
    }
    HttpRequestHead& head = std::get<HttpRequestHead>(parsed);
    HttpRequest request;
    request.method = std::move(head.method);
    request.path = std::move(head.path);
    request.query = std::move(head.query);
    request.headers = std::move(head.headers);
    const size_t length = static_cast<size_t>(head.content_length);
    const bool close_after = !head.keep_alive;
    buffer.erase(0, head_end + 4);
    if (head.expect_continue && buffer.size() < length) {
      if (!io.Write("HTTP/1.1 100 Continue\r\n\r\n")) return;
    }
    while (buffer.size() < length) {
      const ReadResult r = io.Read(buffer, deadline, stopping_, false);
      if (r == ReadResult::kTimeout) {
        SendError(io, 408, "the request body did not arrive in time");
        return;
      }
      if (r != ReadResult::kData) return;
    }
    request.body = buffer.substr(0, length);
    buffer.erase(0, length);

    HttpExchange exchange(&io, request, &stopping_);
    exchange.close_after_ = close_after || stopping_.load();
    handler_(exchange);
    if (!exchange.responded_) {
      exchange.Respond(500, "application/json", error_body_(500, "the handler did not answer"));
    }
    if (exchange.failed_ || exchange.streaming_ || exchange.close_after_) return;
  }
}

}  // namespace accel::server::internal
