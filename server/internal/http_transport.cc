#include "server/internal/http_transport.h"

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <optional>
#include <poll.h>
#include <sstream>
#include <thread>
#include <variant>

#include <boost/asio/buffer.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/buffers_to_string.hpp>
#include <boost/beast/http/chunk_encode.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/write.hpp>
#include <openssl/ssl.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

#include "core/thread_name.h"
#include "server/internal/http_request_head.h"

namespace accel::server::internal {
namespace {

namespace net = boost::asio;
namespace ssl = boost::asio::ssl;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;
// A connection's socket is made on a strand of its own (make_strand at the
// accept); its executor, type-erased, is that strand.
using Strand = net::any_io_executor;

// Bytes a client may pipeline behind a request being answered; past them we
// stop reading (and so stop noticing a close) until the answer is out.
constexpr size_t kMaxPipelined = 1 << 20;
// A lingering close: how long, and how many bytes, the client's leftovers are
// read and dropped after our side is shut.
constexpr absl::Duration kLinger = absl::Seconds(2);
constexpr size_t kMaxLingerBytes = 1 << 20;
// Connections in a lingering close at once, beyond max_connections: an
// eighth of it, 4 to 64; past them a refused connection is closed at once.
int MaxLingering(int max_connections) { return std::clamp(max_connections / 8, 4, 64); }
// How long accepting pauses after accept() fails (out of descriptors), at
// first and at most.
constexpr absl::Duration kAcceptPause = absl::Milliseconds(50);
constexpr absl::Duration kMaxAcceptPause = absl::Seconds(1);

boost::beast::string_view View(absl::string_view s) {
  return boost::beast::string_view(s.data(), s.size());
}

std::string ResponseHead(int status, absl::string_view content_type,
                         std::optional<size_t> content_length, bool close,
                         const std::vector<std::string>& extra) {
  http::response_header<> head;
  head.version(11);
  head.result(static_cast<unsigned>(status));
  if (status == 499) head.reason("Client Closed Request");
  if (!content_type.empty()) head.set(http::field::content_type, View(content_type));
  if (content_length) {
    head.set(http::field::content_length, std::to_string(*content_length));
  } else {
    head.set(http::field::transfer_encoding, "chunked");
  }
  if (close) head.set(http::field::connection, "close");
  for (const std::string& header : extra) {
    const size_t colon = header.find(':');
    if (colon == std::string::npos) continue;
    head.insert(View(absl::string_view(header).substr(0, colon)),
                View(absl::StripAsciiWhitespace(absl::string_view(header).substr(colon + 1))));
  }
  std::ostringstream out;
  out << head;
  return out.str();
}

std::string Chunk(absl::string_view data) {
  return boost::beast::buffers_to_string(
      http::make_chunk(net::const_buffer(data.data(), data.size())));
}

std::string LastChunk() { return boost::beast::buffers_to_string(http::make_chunk_last()); }

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

absl::StatusOr<std::unique_ptr<ssl::context>> TlsContext(const std::string& cert_pem,
                                                         const std::string& key_pem) {
  auto ctx = std::make_unique<ssl::context>(ssl::context::tls_server);
  ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                   ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 |
                   ssl::context::single_dh_use);
  SSL_CTX* native = ctx->native_handle();
  SSL_CTX_set_min_proto_version(native, TLS1_2_VERSION);
  SSL_CTX_set_options(native, SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
  SSL_CTX_set_mode(native, SSL_MODE_RELEASE_BUFFERS);
  SSL_CTX_set_alpn_select_cb(native, SelectHttp11, nullptr);
  // An encrypted key is refused rather than prompted for on the terminal.
  ctx->set_password_callback([](std::size_t, ssl::context::password_purpose) { return ""; });
  error_code ec;
  ctx->use_certificate_chain(net::buffer(cert_pem), ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP TLS: no usable PEM certificate (", ec.message(), ")"));
  }
  ctx->use_private_key(net::buffer(key_pem), ssl::context::pem, ec);
  if (ec || SSL_CTX_check_private_key(native) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP TLS: no usable private key for the certificate (",
                     ec ? ec.message() : "it does not match the certificate", ")"));
  }
  return ctx;
}

std::chrono::steady_clock::time_point SteadyAfter(absl::Duration d) {
  return std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(d);
}

}  // namespace

// What a server and every exchange handle share: whether the server (its
// io_context) still exists. Handles may outlive the server (an engine sink
// still holding one); once `alive` is false they post nothing.
struct ServerLife {
  absl::Mutex mu;
  bool alive ABSL_GUARDED_BY(mu) = true;
  std::atomic<bool> stopping{false};
};

// One piece of an answer, handed from any thread to the connection's strand.
struct Piece {
  enum Kind { kWhole, kStreamStart, kChunk, kStreamEnd } kind = kWhole;
  int status = 200;
  std::string content_type;
  std::vector<std::string> headers;
  std::string data;
};

struct ExchangeShared : std::enable_shared_from_this<ExchangeShared> {
  std::shared_ptr<ServerLife> life;
  std::weak_ptr<Connection> connection;
  // The connection's socket, for PeerClosed's look while the exchange is
  // answered (its strand may be busy with the handler itself).
  int fd = -1;
  std::atomic<bool> gone{false};
  std::atomic<bool> answered{false};  // Respond or StartStream called
  std::atomic<bool> ended{false};     // Respond or EndStream called
  absl::Mutex mu;
  std::function<void()> on_gone ABSL_GUARDED_BY(mu);
  bool gone_fired ABSL_GUARDED_BY(mu) = false;

  // Runs `task` on the connection's strand, if the connection still is.
  void Dispatch(std::function<void(Connection&)> task);
  // A piece of this exchange's answer, to its connection.
  void Send(Piece piece);
  // The client left before the answer ended: on_gone, once.
  void Gone() {
    gone.store(true);
    std::function<void()> fire;
    {
      absl::MutexLock lock(&mu);
      if (gone_fired || ended.load()) return;
      gone_fired = true;
      fire = std::move(on_gone);
    }
    if (fire) fire();
  }
};

struct HttpServer::Impl {
  Impl(HttpServerOptions o, Handler h, ErrorBody e)
      : options(std::move(o)),
        handler(std::move(h)),
        error_body(std::move(e)),
        ioc(std::max(1, options.io_threads)),
        acceptor(net::make_strand(ioc)),
        accept_timer(acceptor.get_executor()) {}

  std::string ErrorResponse(int status, absl::string_view message) const {
    const std::string body = error_body(status, message);
    std::vector<std::string> headers;
    if (status == 503) headers.emplace_back("Retry-After: 1");
    return ResponseHead(status, "application/json", body.size(), /*close=*/true, headers) + body;
  }

  void Accept();
  void OnAccept(const error_code& ec, tcp::socket socket);
  // Past max_connections: room for `serial`, by closing the connection that
  // waited longest without a complete request; false when none waits.
  bool MakeRoom() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // `refused`: answered 503 and closed at once, never counted against
  // max_connections.
  void Register(uint64_t serial, const std::shared_ptr<Connection>& connection, bool refused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void Unregister(uint64_t serial);
  // A connection in its lingering close no longer counts against
  // max_connections (it counts against MaxLingering).
  void Lingering(uint64_t serial);

  const HttpServerOptions options;
  const Handler handler;
  const ErrorBody error_body;
  std::unique_ptr<ssl::context> tls;  // null: plain HTTP; outlives the streams in `ioc`
  net::io_context ioc;
  tcp::acceptor acceptor;
  net::steady_timer accept_timer;
  absl::Duration accept_pause = kAcceptPause;
  std::shared_ptr<ServerLife> life = std::make_shared<ServerLife>();
  std::vector<std::thread> threads;
  int port = 0;

  struct Entry {
    std::weak_ptr<Connection> connection;
    bool counted = true;  // against max_connections
    bool lingering = false;
  };
  mutable absl::Mutex mu;
  std::map<uint64_t, Entry> connections ABSL_GUARDED_BY(mu);
  int64_t active ABSL_GUARDED_BY(mu) = 0;  // counted against max_connections
  int64_t lingering ABSL_GUARDED_BY(mu) = 0;
  uint64_t next_serial ABSL_GUARDED_BY(mu) = 0;
  int64_t evicted ABSL_GUARDED_BY(mu) = 0;
  int64_t refused ABSL_GUARDED_BY(mu) = 0;
  std::atomic<int64_t> accept_failures{0};
};

// One accepted connection: its socket (and TLS stream), what it has read,
// its answer's queue, its timers. Every member is touched on its strand only,
// but for the atomics the server reads to choose whom to evict.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  enum class State { kHandshake, kIdle, kHead, kBody, kHandling, kLinger, kClosed };

  Connection(HttpServer::Impl& server, tcp::socket socket, uint64_t serial)
      : server_(server),
        serial_(serial),
        socket_(std::move(socket)),
        strand_(socket_.get_executor()),
        deadline_(strand_),
        write_timer_(strand_) {
    waiting_since_ns_.store(absl::GetCurrentTimeNanos());
  }

  uint64_t serial() const { return serial_; }
  const Strand& strand() const { return strand_; }
  // For the server's choice of whom to evict (any thread).
  bool Waiting() const {
    const State s = public_state_.load();
    return s == State::kHandshake || s == State::kIdle || s == State::kHead || s == State::kBody;
  }
  int64_t waiting_since_ns() const { return waiting_since_ns_.load(); }

  // On the strand: the first steps.
  void Start() {
    error_code ignored;
    socket_.set_option(tcp::no_delay(true), ignored);
    SetDeadline(server_.options.request_timeout);
    if (server_.tls == nullptr) {
      SetState(State::kIdle);
      StartRead();
      return;
    }
    SetState(State::kHandshake);
    // The first byte says whether the client speaks TLS (a handshake record
    // is 0x16) or plain HTTP (a method's first letter).
    auto self = shared_from_this();
    socket_.async_wait(tcp::socket::wait_read, [self](const error_code& ec) {
      if (ec || self->state_ == State::kClosed) return self->Close();
      self->Sniff();
    });
  }

  // Refused past the cap (on the strand): 503, then a lingering close.
  void Refuse() {
    if (server_.tls != nullptr) return Close();  // an answer would need a handshake first
    SetState(State::kHead);
    Reject(503, absl::StrCat("this server has ", server_.options.max_connections,
                             " connections open, its limit; retry"));
  }

  // Closed to make room for a newer connection, if it still waits.
  void Evict() {
    switch (state_) {
      case State::kHandshake:
      case State::kIdle:
        Close();
        return;
      case State::kHead:
      case State::kBody:
        Reject(503,
               "the server is at its connection limit and this request was the slowest to "
               "arrive; retry");
        return;
      default:
        return;
    }
  }

  // Server::Stop: a connection waiting for a request closes; an answer in
  // progress goes on (and closes after).
  void CloseIfIdle() {
    if (state_ == State::kIdle || state_ == State::kHandshake) Close();
  }

  void Abort() { Close(); }

  // A piece of `exchange`'s answer (on the strand); dropped unless it is the
  // exchange being answered.
  void Answer(const ExchangeShared* exchange, Piece piece) {
    if (state_ != State::kHandling || exchange_ == nullptr || exchange_.get() != exchange) return;
    // Anything after the answer's end (a chunk queued after EndStream by a
    // careless caller) would corrupt the next response's framing.
    if (exchange_done_) return;
    // A stop since the request came: this answer is the connection's last.
    if (server_.life->stopping.load()) close_after_ = true;
    switch (piece.kind) {
      case Piece::kWhole:
        Queue(ResponseHead(piece.status, piece.content_type, piece.data.size(), close_after_,
                           piece.headers) +
              piece.data);
        exchange_done_ = true;
        break;
      case Piece::kStreamStart:
        Queue(ResponseHead(piece.status, piece.content_type, std::nullopt, close_after_,
                           piece.headers));
        break;
      case Piece::kChunk:
        if (!piece.data.empty()) Queue(Chunk(piece.data));  // an empty chunk would end the body
        break;
      case Piece::kStreamEnd:
        Queue(LastChunk());
        exchange_done_ = true;
        break;
    }
    MaybeFinishExchange();
  }

  // A task of `exchange`'s (HttpExchange::Post): run while that exchange is
  // the one being answered.
  void RunTask(const ExchangeShared* exchange, const std::function<void()>& task) {
    if (state_ != State::kHandling || exchange_.get() != exchange || exchange_done_) return;
    task();
  }

 private:
  void SetState(State s) {
    state_ = s;
    public_state_.store(s);
    if (s == State::kIdle || s == State::kHead || s == State::kHandshake) {
      waiting_since_ns_.store(absl::GetCurrentTimeNanos());
    }
  }

  // --- reading ------------------------------------------------------------

  void StartRead() {
    if (reading_ || state_ == State::kClosed) return;
    reading_ = true;
    auto self = shared_from_this();
    auto done = [self](const error_code& ec, size_t n) { self->OnRead(ec, n); };
    if (tls_) {
      tls_->async_read_some(net::buffer(chunk_), done);
    } else {
      socket_.async_read_some(net::buffer(chunk_), done);
    }
  }

  void OnRead(const error_code& ec, size_t n) {
    reading_ = false;
    if (state_ == State::kClosed) return;
    if (state_ == State::kLinger) {
      if (tls_ && !plain_on_tls_) return ShutdownTls();
      lingered_ += n;
      if (ec || lingered_ > kMaxLingerBytes) return Close();
      return StartRead();
    }
    if (ec) {
      // The client closed (or reset) its connection. While it is answered
      // that is news for the handler; either way the connection ends.
      return Close();
    }
    in_.append(chunk_.data(), n);
    Advance();
  }

  // Takes the next step with what has been read.
  void Advance() {
    while (true) {
      switch (state_) {
        case State::kIdle:
          if (in_.empty()) return StartRead();
          // A request's first byte: it has request_timeout from now (the
          // first request: from the accept, already set).
          if (served_ > 0) SetDeadline(server_.options.request_timeout);
          SetState(State::kHead);
          continue;
        case State::kHead: {
          const size_t end = in_.find("\r\n\r\n");
          if (end == std::string::npos) {
            if (in_.size() > server_.options.max_header_bytes) {
              return Reject(431, absl::StrCat("the request head is over ",
                                              server_.options.max_header_bytes, " bytes"));
            }
            return StartRead();
          }
          if (end > server_.options.max_header_bytes) {
            return Reject(431, absl::StrCat("the request head is over ",
                                            server_.options.max_header_bytes, " bytes"));
          }
          HttpParseResult parsed = ParseHttpRequestHead(absl::string_view(in_).substr(0, end),
                                                        server_.options.max_body_bytes);
          if (const HttpParseError* error = std::get_if<HttpParseError>(&parsed)) {
            return Reject(error->status, error->message);
          }
          HttpRequestHead& head = std::get<HttpRequestHead>(parsed);
          request_ = HttpRequest();
          request_.method = std::move(head.method);
          request_.path = std::move(head.path);
          request_.query = std::move(head.query);
          request_.headers = std::move(head.headers);
          body_length_ = static_cast<size_t>(head.content_length);
          close_after_ = !head.keep_alive;
          in_.erase(0, end + 4);
          SetState(State::kBody);
          if (head.expect_continue && in_.size() < body_length_) {
            Queue("HTTP/1.1 100 Continue\r\n\r\n");
          }
          continue;
        }
        case State::kBody:
          if (in_.size() < body_length_) return StartRead();
          request_.body = in_.substr(0, body_length_);
          in_.erase(0, body_length_);
          Dispatch();
          return;
        case State::kHandling:
          // Pipelined bytes wait; the read stays posted to notice a close.
          if (in_.size() < kMaxPipelined) StartRead();
          return;
        default:
          return;
      }
    }
  }

  void Dispatch() {
    CancelDeadline();
    SetState(State::kHandling);
    ++served_;
    exchange_done_ = false;
    if (server_.life->stopping.load()) close_after_ = true;
    auto shared = std::make_shared<ExchangeShared>();
    shared->life = server_.life;
    shared->connection = weak_from_this();
    shared->fd = socket_.native_handle();
    exchange_ = shared;
    std::shared_ptr<HttpExchange> exchange(new HttpExchange(std::move(request_), shared));
    // Keep a read posted while the answer is made, to see the client leave.
    StartRead();
    server_.handler(std::move(exchange));
  }

  // --- writing ------------------------------------------------------------

  void Queue(std::string bytes) {
    if (state_ == State::kClosed) return;
    out_.push_back(std::move(bytes));
    if (!writing_) WriteNext();
  }

  void WriteNext() {
    writing_ = true;
    write_timer_.expires_at(SteadyAfter(server_.options.write_timeout));
    auto self = shared_from_this();
    const uint64_t generation = ++write_generation_;
    write_timer_.async_wait([self, generation](const error_code& ec) {
      // A write that made no progress for write_timeout: the client stopped
      // reading. Closing the socket fails the write.
      if (!ec && generation == self->write_generation_ && self->writing_) self->Close();
    });
    auto done = [self](const error_code& ec, size_t) { self->OnWrite(ec); };
    if (tls_ && !plain_on_tls_) {
      net::async_write(*tls_, net::buffer(out_.front()), done);
    } else {
      net::async_write(socket_, net::buffer(out_.front()), done);
    }
  }

  void OnWrite(const error_code& ec) {
    writing_ = false;
    ++write_generation_;
    write_timer_.cancel();
    if (state_ == State::kClosed) return;
    if (ec) return Close();
    out_.pop_front();
    if (!out_.empty()) return WriteNext();
    if (close_when_written_) return LingeringClose();
    MaybeFinishExchange();
  }

  // Once the exchange's answer is complete and written: the next request, or
  // the close the request (or a stop) asked for.
  void MaybeFinishExchange() {
    if (state_ != State::kHandling || !exchange_done_ || writing_ || !out_.empty()) return;
    exchange_->ended.store(true);
    exchange_.reset();
    if (close_after_ || server_.life->stopping.load()) return LingeringClose();
    SetState(State::kIdle);
    SetDeadline(server_.options.idle_timeout);
    Advance();
  }

  // An answer the transport gives itself (400, 408, 411, 413, 431, 503),
  // then a lingering close.
  void Reject(int status, absl::string_view message) {
    if (state_ == State::kClosed || state_ == State::kLinger) return;
    SetState(State::kHandling);  // no longer waiting (not evictable)
    CancelDeadline();
    close_when_written_ = true;
    Queue(server_.ErrorResponse(status, message));
  }

  // Our side shut, the client's leftovers read and dropped (bounded), so
  // that what we wrote is not destroyed by the reset a close with unread
  // bytes would send.
  void LingeringClose() {
    if (state_ == State::kClosed || state_ == State::kLinger) return;
    if (exchange_ != nullptr) {
      exchange_->ended.store(true);
      exchange_.reset();
    }
    SetState(State::kLinger);
    server_.Lingering(serial_);
    SetDeadline(kLinger);
    if (tls_ && !plain_on_tls_) {
      // A read still posted ends first (OnRead then shuts TLS down): a TLS
      // stream takes one read and one write at a time, and a shutdown reads.
      if (reading_) {
        error_code ignored;
        socket_.cancel(ignored);
        return;
      }
      return ShutdownTls();
    }
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    StartRead();
  }

  // --- TLS ----------------------------------------------------------------

  // close_notify; the client's own (or the deadline) ends the connection.
  void ShutdownTls() {
    auto self = shared_from_this();
    tls_->async_shutdown([self](const error_code&) { self->Close(); });
  }

  void Sniff() {
    unsigned char first = 0;
    error_code ec;
    socket_.non_blocking(true, ec);
    const size_t n = socket_.receive(net::buffer(&first, 1), tcp::socket::message_peek, ec);
    if (ec == net::error::would_block) {
      auto self = shared_from_this();
      socket_.async_wait(tcp::socket::wait_read, [self](const error_code& e) {
        if (e || self->state_ == State::kClosed) return self->Close();
        self->Sniff();
      });
      return;
    }
    if (ec || n == 0) return Close();
    if (first == 0x16) return Handshake();
    if (absl::ascii_isupper(first)) {
      // Plain HTTP on the TLS port: said in plain text, as the client speaks.
      plain_on_tls_ = true;
      SetState(State::kHead);
      return Reject(400, "this port speaks HTTPS (TLS): send the request to https://, not http://");
    }
    Close();  // neither TLS nor HTTP
  }

  void Handshake() {
    tls_.emplace(socket_, *server_.tls);
    auto self = shared_from_this();
    tls_->async_handshake(ssl::stream_base::server, [self](const error_code& ec) {
      if (self->state_ == State::kClosed) return;
      if (ec) return self->Close();
      self->SetState(State::kIdle);
      self->Advance();
    });
  }

  // --- deadlines and the end ------------------------------------------------

  void SetDeadline(absl::Duration after) {
    deadline_.expires_at(SteadyAfter(after));
    const uint64_t generation = ++deadline_generation_;
    auto self = shared_from_this();
    deadline_.async_wait([self, generation](const error_code& ec) {
      if (ec || generation != self->deadline_generation_) return;
      self->OnDeadline();
    });
  }

  void CancelDeadline() {
    ++deadline_generation_;
    deadline_.cancel();
  }

  void OnDeadline() {
    switch (state_) {
      case State::kIdle:
        // The first request never came: said, as a client waiting for an
        // answer to a request it sent slowly would want. A keep-alive
        // connection idle past idle_timeout just closes.
        if (served_ == 0) return Reject(408, "the request did not arrive in time");
        return Close();
      case State::kHead:
        return Reject(408, "the request head did not arrive in time");
      case State::kBody:
        return Reject(408, "the request body did not arrive in time");
      default:
        return Close();  // a handshake, a lingering close
    }
  }

  void Close() {
    if (state_ == State::kClosed) return;
    SetState(State::kClosed);
    CancelDeadline();
    ++write_generation_;
    write_timer_.cancel();
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    if (exchange_ != nullptr) {
      std::shared_ptr<ExchangeShared> exchange = std::move(exchange_);
      exchange->Gone();
    }
    server_.Unregister(serial_);
  }

  HttpServer::Impl& server_;
  const uint64_t serial_;
  tcp::socket socket_;
  Strand strand_;
  std::optional<ssl::stream<tcp::socket&>> tls_;
  bool plain_on_tls_ = false;  // a plain HTTP client on the TLS port
  net::steady_timer deadline_;
  uint64_t deadline_generation_ = 0;
  net::steady_timer write_timer_;
  uint64_t write_generation_ = 0;
  State state_ = State::kHandshake;
  std::atomic<State> public_state_{State::kHandshake};
  std::atomic<int64_t> waiting_since_ns_{0};
  std::array<char, 16384> chunk_;
  bool reading_ = false;
  std::string in_;
  HttpRequest request_;
  size_t body_length_ = 0;
  bool close_after_ = false;
  int64_t served_ = 0;
  std::shared_ptr<ExchangeShared> exchange_;
  bool exchange_done_ = false;
  std::deque<std::string> out_;
  bool writing_ = false;
  bool close_when_written_ = false;
  size_t lingered_ = 0;
};

void ExchangeShared::Dispatch(std::function<void(Connection&)> task) {
  absl::MutexLock lock(&life->mu);
  if (!life->alive) return;
  std::shared_ptr<Connection> c = connection.lock();
  if (c == nullptr) return;
  net::post(c->strand(), [c, task = std::move(task)] { task(*c); });
}

void ExchangeShared::Send(Piece piece) {
  std::shared_ptr<ExchangeShared> self = shared_from_this();
  Dispatch([self, piece = std::move(piece)](Connection& c) mutable {
    c.Answer(self.get(), std::move(piece));
  });
}

// --- HttpExchange ---------------------------------------------------------

HttpExchange::~HttpExchange() = default;

bool HttpExchange::Respond(int status, absl::string_view content_type, absl::string_view body,
                           const std::vector<std::string>& headers) {
  if (shared_->answered.exchange(true) || shared_->gone.load()) return false;
  Piece piece;
  piece.kind = Piece::kWhole;
  piece.status = status;
  piece.content_type = std::string(content_type);
  piece.headers = common_headers_;
  piece.headers.insert(piece.headers.end(), headers.begin(), headers.end());
  piece.data = std::string(body);
  shared_->Send(std::move(piece));
  return !shared_->gone.load();
}

bool HttpExchange::StartStream(int status, absl::string_view content_type,
                               const std::vector<std::string>& headers) {
  if (shared_->answered.exchange(true) || shared_->gone.load()) return false;
  Piece piece;
  piece.kind = Piece::kStreamStart;
  piece.status = status;
  piece.content_type = std::string(content_type);
  piece.headers = common_headers_;
  piece.headers.insert(piece.headers.end(), headers.begin(), headers.end());
  shared_->Send(std::move(piece));
  return !shared_->gone.load();
}

bool HttpExchange::WriteChunk(absl::string_view data) {
  if (!shared_->answered.load() || shared_->ended.load() || shared_->gone.load()) return false;
  if (data.empty()) return true;
  Piece piece;
  piece.kind = Piece::kChunk;
  piece.data = std::string(data);
  shared_->Send(std::move(piece));
  return !shared_->gone.load();
}

bool HttpExchange::EndStream() {
  if (!shared_->answered.load() || shared_->gone.load()) return false;
  Piece piece;
  piece.kind = Piece::kStreamEnd;
  shared_->Send(std::move(piece));
  return !shared_->gone.load();
}

bool HttpExchange::PeerClosed() const {
  if (shared_->gone.load()) return true;
  if (shared_->ended.load()) return false;
  // The read kept posted on the connection reports a close on its strand,
  // which the handler itself may be holding (parsing a large body): look at
  // the socket directly. A FIN, a reset or an error is a client gone; bytes
  // waiting (a pipelined request) are not.
  pollfd p = {shared_->fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

void HttpExchange::OnClientGone(std::function<void()> on_gone) {
  {
    absl::MutexLock lock(&shared_->mu);
    if (!shared_->gone_fired) {
      shared_->on_gone = std::move(on_gone);
      return;
    }
  }
  if (!shared_->ended.load()) on_gone();
}

void HttpExchange::Post(std::function<void()> task) {
  std::shared_ptr<ExchangeShared> shared = shared_;
  shared_->Dispatch(
      [shared, task = std::move(task)](Connection& c) { c.RunTask(shared.get(), task); });
}

bool HttpExchange::stopping() const { return shared_->life->stopping.load(); }

const std::string* HttpRequest::Header(absl::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return &value;
  }
  return nullptr;
}

// --- HttpServer -----------------------------------------------------------

void HttpServer::Impl::Accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](const error_code& ec, tcp::socket socket) {
    OnAccept(ec, std::move(socket));
  });
}

void HttpServer::Impl::OnAccept(const error_code& ec, tcp::socket socket) {
  if (ec == net::error::operation_aborted || !acceptor.is_open() || life->stopping.load()) return;
  if (ec) {
    // Out of file descriptors (EMFILE, ENFILE), or out of memory: the
    // connection waits in the backlog. Pausing, rather than trying again at
    // once, keeps this thread from spinning; the port accepts again as soon
    // as descriptors are free.
    accept_failures.fetch_add(1);
    accept_timer.expires_at(SteadyAfter(accept_pause));
    accept_pause = std::min(accept_pause * 2, kMaxAcceptPause);
    accept_timer.async_wait([this](const error_code& e) {
      if (!e) Accept();
    });
    return;
  }
  accept_pause = kAcceptPause;
  std::shared_ptr<Connection> connection;
  bool refuse = false;
  {
    absl::MutexLock lock(&mu);
    const uint64_t serial = next_serial++;
    connection = std::make_shared<Connection>(*this, std::move(socket), serial);
    if (active >= options.max_connections && !MakeRoom()) {
      refuse = true;
      ++refused;
      // Closed at once (the socket's end) past the lingering closes' share.
      if (lingering >= MaxLingering(options.max_connections)) connection.reset();
    }
    if (connection != nullptr) Register(serial, connection, refuse);
  }
  if (connection != nullptr) {
    net::post(connection->strand(), [connection, refuse] {
      if (refuse) {
        connection->Refuse();
      } else {
        connection->Start();
      }
    });
  }
  Accept();
}

bool HttpServer::Impl::MakeRoom() {
  std::shared_ptr<Connection> oldest;
  Entry* oldest_entry = nullptr;
  for (auto& [serial, entry] : connections) {
    if (!entry.counted) continue;
    std::shared_ptr<Connection> c = entry.connection.lock();
    if (c == nullptr || !c->Waiting()) continue;
    if (oldest == nullptr || c->waiting_since_ns() < oldest->waiting_since_ns()) {
      oldest = std::move(c);
      oldest_entry = &entry;
    }
  }
  if (oldest == nullptr) return false;
  ++evicted;
  // Counted out now, so that the newcomer's place is certain.
  oldest_entry->counted = false;
  --active;
  net::post(oldest->strand(), [oldest] { oldest->Evict(); });
  return true;
}

void HttpServer::Impl::Register(uint64_t serial, const std::shared_ptr<Connection>& connection,
                                bool refused) {
  Entry entry;
  entry.connection = connection;
  entry.counted = !refused;
  entry.lingering = refused;
  connections.emplace(serial, std::move(entry));
  ++(refused ? lingering : active);
}

void HttpServer::Impl::Unregister(uint64_t serial) {
  absl::MutexLock lock(&mu);
  auto it = connections.find(serial);
  if (it == connections.end()) return;
  if (it->second.counted) --active;
  if (it->second.lingering) --lingering;
  connections.erase(it);
}

void HttpServer::Impl::Lingering(uint64_t serial) {
  absl::MutexLock lock(&mu);
  auto it = connections.find(serial);
  if (it == connections.end() || it->second.lingering) return;
  it->second.lingering = true;
  ++lingering;
  if (it->second.counted) {
    it->second.counted = false;
    --active;
  }
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                              Handler handler,
                                                              ErrorBody error_body) {
  const std::string address = absl::StrCat(options.host, ":", options.port);
  error_code ec;
  const net::ip::address_v4 host = net::ip::make_address_v4(options.host, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HTTP address ", address, ": the host must be an IPv4 address such as 0.0.0.0"));
  }
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP address ", address, ": the port must be in 0..65535"));
  }
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("HTTP TLS: give both a certificate and a key, or neither");
  }
  auto impl = std::make_unique<Impl>(options, std::move(handler), std::move(error_body));
  if (!options.tls_cert_pem.empty()) {
    absl::StatusOr<std::unique_ptr<ssl::context>> tls =
        TlsContext(options.tls_cert_pem, options.tls_key_pem);
    if (!tls.ok()) return tls.status();
    impl->tls = *std::move(tls);
  }
  const tcp::endpoint endpoint(host, static_cast<unsigned short>(options.port));
  tcp::acceptor& acceptor = impl->acceptor;
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("HTTP server cannot listen on ", address, ": ", ec.message()));
  }
  impl->port = acceptor.local_endpoint(ec).port();
  impl->Accept();
  // Start returns once every I/O thread runs: a thread that first ran later
  // could meet a process already out of descriptors (UBSan's checks of a new
  // thread open a pipe), and the server would be up in name only.
  const int io_threads = std::max(1, options.io_threads);
  absl::BlockingCounter running(io_threads);
  for (int i = 0; i < io_threads; ++i) {
    Impl* self = impl.get();
    impl->threads.emplace_back([self, &running] {
      NameThisThread("accel-http");
      running.DecrementCount();
      self->ioc.run();
    });
  }
  running.Wait();
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() {
  Stop();
  // Every connection ends (its handlers' exchanges see the client gone);
  // then the threads stop, and handles still held elsewhere post nothing.
  std::vector<std::shared_ptr<Connection>> all;
  {
    absl::MutexLock lock(&impl_->mu);
    for (const auto& [serial, entry] : impl_->connections) {
      if (std::shared_ptr<Connection> c = entry.connection.lock()) all.push_back(std::move(c));
    }
  }
  for (const std::shared_ptr<Connection>& c : all) {
    net::post(c->strand(), [c] { c->Abort(); });
  }
  all.clear();
  WaitConnections(absl::Seconds(2));
  {
    absl::MutexLock lock(&impl_->life->mu);
    impl_->life->alive = false;
  }
  impl_->ioc.stop();
  for (std::thread& thread : impl_->threads) thread.join();
}

int HttpServer::port() const { return impl_->port; }

void HttpServer::Stop() {
  if (impl_->life->stopping.exchange(true)) return;
  Impl* impl = impl_.get();
  net::post(impl->acceptor.get_executor(), [impl] {
    error_code ignored;
    impl->acceptor.close(ignored);
    impl->accept_timer.cancel();
  });
  absl::MutexLock lock(&impl->mu);
  for (const auto& [serial, entry] : impl->connections) {
    if (std::shared_ptr<Connection> c = entry.connection.lock()) {
      net::post(c->strand(), [c] { c->CloseIfIdle(); });
    }
  }
}

bool HttpServer::WaitConnections(absl::Duration timeout) {
  absl::MutexLock lock(&impl_->mu);
  auto none = [this]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl_->mu) { return impl_->connections.empty(); };
  return impl_->mu.AwaitWithTimeout(absl::Condition(&none), timeout);
}

HttpServer::Counts HttpServer::counts() const {
  absl::MutexLock lock(&impl_->mu);
  Counts counts;
  counts.open = static_cast<int64_t>(impl_->connections.size());
  counts.evicted = impl_->evicted;
  counts.refused = impl_->refused;
  counts.accept_failures = impl_->accept_failures.load();
  return counts;
}

}  // namespace accel::server::internal
