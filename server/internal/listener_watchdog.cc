#include "server/internal/listener_watchdog.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <memory>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <utility>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include "absl/strings/match.h"
#include "absl/time/clock.h"

#include "core/thread_name.h"

namespace accel::server::internal {
namespace {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  const int fd_;
};

// Waits for `events` on `fd` until `deadline`; false when it passes.
bool WaitFor(int fd, short events, absl::Time deadline) {
  while (true) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) return false;
    pollfd p = {fd, events, 0};
    const int ready = poll(&p, 1, static_cast<int>(left));
    if (ready > 0) return true;
    if (ready < 0 && errno != EINTR) return false;
  }
}

bool SendAll(int fd, const std::string& data, absl::Time deadline) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR) && WaitFor(fd, POLLOUT, deadline)) continue;
    return false;
  }
  return true;
}

// At least `want` bytes (fewer if the peer closes), until `deadline`.
std::string ReadSome(int fd, size_t want, absl::Time deadline) {
  std::string got;
  char buffer[256];
  while (got.size() < want && WaitFor(fd, POLLIN, deadline)) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n > 0) {
      got.append(buffer, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      break;
    }
  }
  return got;
}

ProbeResult TlsHandshake(int fd, const std::string& alpn, absl::Time deadline) {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()),
                                                        &SSL_CTX_free);
  if (ctx == nullptr) return ProbeResult::kUnknown;
  // Only whether the port answers; its certificate is not the question.
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_NONE, nullptr);
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), &SSL_free);
  if (ssl == nullptr) return ProbeResult::kUnknown;
  if (!alpn.empty()) {
    std::string wire(1, static_cast<char>(alpn.size()));
    wire += alpn;
    SSL_set_alpn_protos(ssl.get(), reinterpret_cast<const unsigned char*>(wire.data()),
                        static_cast<unsigned>(wire.size()));
  }
  SSL_set_fd(ssl.get(), fd);
  while (true) {
    ERR_clear_error();
    const int r = SSL_connect(ssl.get());
    if (r == 1) break;
    const int error = SSL_get_error(ssl.get(), r);
    if ((error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) &&
        WaitFor(fd, error == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline)) {
      continue;
    }
    ERR_clear_error();
    return ProbeResult::kDead;
  }
  ERR_clear_error();
  return ProbeResult::kAlive;
}

}  // namespace

ProbeResult ProbeListener(const std::string& host, int port, ProbeKind kind, absl::Duration timeout,
                          const std::string& alpn) {
  const absl::Time deadline = absl::Now() + timeout;
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  // A wildcard listener is reached on the loopback.
  const std::string target = host == "0.0.0.0" ? "127.0.0.1" : host;
  if (inet_pton(AF_INET, target.c_str(), &addr.sin_addr) != 1) return ProbeResult::kUnknown;
  const Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  // No descriptor for the probe: the process is out of them; that says
  // nothing about the listener.
  if (fd.get() < 0) return ProbeResult::kUnknown;
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) return ProbeResult::kDead;
    if (!WaitFor(fd.get(), POLLOUT, deadline)) return ProbeResult::kDead;
    int error = 0;
    socklen_t length = sizeof(error);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) return ProbeResult::kDead;
  }
  switch (kind) {
    case ProbeKind::kHttp: {
      if (!SendAll(fd.get(), "GET /health HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n",
                   deadline)) {
        return ProbeResult::kDead;
      }
      return absl::StartsWith(ReadSome(fd.get(), 9, deadline), "HTTP/1.") ? ProbeResult::kAlive
                                                                          : ProbeResult::kDead;
    }
    case ProbeKind::kGrpc: {
      // The client preface and an empty SETTINGS frame; the server's first
      // frame is its SETTINGS (type 4).
      std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
      preface += std::string("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9);
      if (!SendAll(fd.get(), preface, deadline)) return ProbeResult::kDead;
      const std::string frame = ReadSome(fd.get(), 9, deadline);
      return frame.size() >= 9 && frame[3] == '\x04' ? ProbeResult::kAlive : ProbeResult::kDead;
    }
    case ProbeKind::kTls:
      return TlsHandshake(fd.get(), alpn, deadline);
  }
  return ProbeResult::kUnknown;
}

ListenerWatchdog::ListenerWatchdog(std::vector<Listener> listeners, absl::Duration interval,
                                   int failures, OnChange on_change)
    : interval_(interval),
      failures_(failures < 1 ? 1 : failures),
      on_change_(std::move(on_change)) {
  absl::MutexLock lock(&mu_);
  for (Listener& listener : listeners) states_.push_back(State{std::move(listener)});
}

ListenerWatchdog::~ListenerWatchdog() { Stop(); }

void ListenerWatchdog::Start() {
  thread_ = std::thread([this] {
    NameThisThread("accel-watchdog");
    while (!stop_.WaitForNotificationWithTimeout(interval_)) ProbeOnce();
  });
}

void ListenerWatchdog::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

void ListenerWatchdog::ProbeOnce() {
  std::vector<std::function<ProbeResult()>> probes;
  {
    absl::MutexLock lock(&mu_);
    for (const State& state : states_) probes.push_back(state.listener.probe);
  }
  std::vector<ProbeResult> results;
  for (const auto& probe : probes) results.push_back(probe());
  std::vector<std::pair<std::string, bool>> changes;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < states_.size(); ++i) {
      State& state = states_[i];
      if (results[i] == ProbeResult::kUnknown) continue;
      if (results[i] == ProbeResult::kAlive) {
        state.failed = 0;
        if (!state.alive) {
          state.alive = true;
          changes.emplace_back(state.listener.name, true);
        }
        continue;
      }
      if (++state.failed >= failures_ && state.alive) {
        state.alive = false;
        changes.emplace_back(state.listener.name, false);
      }
    }
  }
  for (const auto& [name, alive] : changes) on_change_(name, alive);
}

bool ListenerWatchdog::all_alive() const {
  absl::MutexLock lock(&mu_);
  for (const State& state : states_) {
    if (!state.alive) return false;
  }
  return true;
}

}  // namespace accel::server::internal
