#include "server/internal/http_server.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

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

enum class ReadResult { kData, kClosed, kTimeout, kStopping };

// Appends what the socket has to `buffer`, waiting until `deadline`.
ReadResult ReadMore(int fd, std::string& buffer, absl::Time deadline,
                    const std::atomic<bool>& stopping, bool stop_when_idle) {
  while (true) {
    if (stop_when_idle && stopping.load()) return ReadResult::kStopping;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return ReadResult::kTimeout;
    pollfd p = {fd, POLLIN, 0};
    const int waited = poll(&p, 1,
                            static_cast<int>(absl::ToInt64Milliseconds(std::min(left, kPollSlice) +
                                                                       absl::Milliseconds(1))));
    if (waited < 0 && errno != EINTR) return ReadResult::kClosed;
    if (waited <= 0) continue;
    char chunk[16384];
    const ssize_t n = recv(fd, chunk, sizeof(chunk), 0);
    if (n == 0) return ReadResult::kClosed;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return ReadResult::kClosed;
    }
    buffer.append(chunk, static_cast<size_t>(n));
    return ReadResult::kData;
  }
}

}  // namespace

const std::string* HttpRequest::Header(absl::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return &value;
  }
  return nullptr;
}

bool HttpExchange::Send(absl::string_view data) {
  if (failed_) return false;
  if (!SendAll(fd_, data)) failed_ = true;
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
  pollfd p = {fd_, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) return true;
  if (p.revents & POLLIN) {
    char byte;
    const ssize_t n = recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0 && errno != EAGAIN && errno != EINTR) return true;
  }
  return false;
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
  std::unique_ptr<HttpServer> server(
      new HttpServer(options, std::move(handler), std::move(error_body)));
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

bool HttpServer::SendError(int fd, int status, absl::string_view message) {
  const std::string body = error_body_(status, message);
  std::string response =
      Head(status, "application/json", absl::StrCat("Content-Length: ", body.size()), true, {});
  response += body;
  return SendAll(fd, response);
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
      timeval short_tv = {1, 0};
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &short_tv, sizeof(short_tv));
      SendError(fd, 503,
                absl::StrCat("this server has ", open_, " connections open, its limit; retry"));
      close(fd);
      continue;
    }
    ++open_;
    connections_.emplace_back();
    Connection* connection = &connections_.back();
    connection->thread = std::thread([this, fd, connection] {
      Serve(fd);
      close(fd);
      absl::MutexLock inner(&mu_);
      --open_;
      connection->done.store(true);
    });
  }
}

void HttpServer::Serve(int fd) {
  std::string buffer;
  bool first = true;
  while (true) {
    // Wait for the next request to begin: the first within request_timeout
    // of the connection, later ones within idle_timeout of the last answer.
    const absl::Time idle_deadline =
        absl::Now() + (first ? options_.request_timeout : options_.idle_timeout);
    absl::Time deadline = absl::InfiniteFuture();
    if (buffer.empty()) {
      const ReadResult r = ReadMore(fd, buffer, idle_deadline, stopping_, true);
      if (r != ReadResult::kData) {
        if (r == ReadResult::kTimeout && first) {
          SendError(fd, 408, "the request did not arrive in time");
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
        SendError(fd, 431,
                  absl::StrCat("the request head is over ", options_.max_header_bytes, " bytes"));
        return;
      }
      const ReadResult r = ReadMore(fd, buffer, deadline, stopping_, false);
      if (r == ReadResult::kTimeout) {
        SendError(fd, 408, "the request head did not arrive in time");
        return;
      }
      if (r != ReadResult::kData) return;
    }
    if (head_end > options_.max_header_bytes) {
      SendError(fd, 431,
                absl::StrCat("the request head is over ", options_.max_header_bytes, " bytes"));
      return;
    }
    HttpRequest request;
    const std::vector<absl::string_view> lines =
        absl::StrSplit(absl::string_view(buffer).substr(0, head_end), "\r\n");
    const std::vector<absl::string_view> start = absl::StrSplit(lines[0], ' ');
    if (start.size() != 3 || start[0].empty() || start[1].empty() || start[1][0] != '/' ||
        !absl::StartsWith(start[2], "HTTP/1.")) {
      SendError(fd, 400, "malformed HTTP request line");
      return;
    }
    request.method = std::string(start[0]);
    const size_t question = start[1].find('?');
    request.path = std::string(start[1].substr(0, question));
    if (question != absl::string_view::npos)
      request.query = std::string(start[1].substr(question + 1));
    const bool http10 = start[2] == "HTTP/1.0";
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      if (colon == absl::string_view::npos || colon == 0) {
        SendError(fd, 400, "malformed HTTP header line");
        return;
      }
      request.headers.emplace_back(
          absl::AsciiStrToLower(lines[i].substr(0, colon)),
          std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1))));
    }
    size_t length = 0;
    if (const std::string* encoding = request.Header("transfer-encoding")) {
      if (!absl::EqualsIgnoreCase(*encoding, "identity")) {
        SendError(fd, 411, "send the body with Content-Length (chunked bodies are not accepted)");
        return;
      }
    }
    if (const std::string* value = request.Header("content-length")) {
      uint64_t parsed = 0;
      if (!absl::SimpleAtoi(*value, &parsed)) {
        SendError(fd, 400, "Content-Length is not a number");
        return;
      }
      if (parsed > options_.max_body_bytes) {
        SendError(fd, 413,
                  absl::StrCat("the body is ", parsed, " bytes, over this server's limit of ",
                               options_.max_body_bytes, " bytes"));
        return;
      }
      length = static_cast<size_t>(parsed);
    }
    bool close_after = http10;
    if (const std::string* connection = request.Header("connection")) {
      if (absl::EqualsIgnoreCase(*connection, "close")) close_after = true;
      if (http10 && absl::EqualsIgnoreCase(*connection, "keep-alive")) close_after = false;
    }
    buffer.erase(0, head_end + 4);
    if (const std::string* expect = request.Header("expect")) {
      if (absl::EqualsIgnoreCase(*expect, "100-continue") && buffer.size() < length) {
        if (!SendAll(fd, "HTTP/1.1 100 Continue\r\n\r\n")) return;
      }
    }
    while (buffer.size() < length) {
      const ReadResult r = ReadMore(fd, buffer, deadline, stopping_, false);
      if (r == ReadResult::kTimeout) {
        SendError(fd, 408, "the request body did not arrive in time");
        return;
      }
      if (r != ReadResult::kData) return;
    }
    request.body = buffer.substr(0, length);
    buffer.erase(0, length);

    HttpExchange exchange(fd, request, &stopping_);
    exchange.close_after_ = close_after || stopping_.load();
    handler_(exchange);
    if (!exchange.responded_) {
      exchange.Respond(500, "application/json", error_body_(500, "the handler did not answer"));
    }
    if (exchange.failed_ || exchange.streaming_ || exchange.close_after_) return;
  }
}

}  // namespace accel::server::internal
