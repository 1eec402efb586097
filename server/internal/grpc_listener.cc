#include "server/internal/grpc_listener.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "core/thread_name.h"

namespace accel::server::internal {
namespace {

// How long the loop waits between looks at a full house, and after a failed
// accept (at first; doubling up to the most).
constexpr int kFullPollMs = 100;
constexpr absl::Duration kFailurePause = absl::Milliseconds(50);
constexpr absl::Duration kMaxFailurePause = absl::Seconds(1);
// A heartbeat at least this often, even with nothing to accept.
constexpr int kIdlePollMs = 1000;

std::pair<uint64_t, uint64_t> SocketIdentity(int fd) {
  struct stat st = {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return {0, 0};
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcListener>> GrpcListener::Bind(const std::string& host, int port,
                                                                 int max_connections) {
  const std::string address = absl::StrCat(host, ":", port);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("gRPC address ", address, ": the host must be an IPv4 address"));
  }
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("gRPC address ", address, ": the port must be in 0..65535"));
  }
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("gRPC: socket(): ", strerror(errno)));
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 4096) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, ": ", strerror(err), " (in use?)"));
  }
  socklen_t length = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
  std::unique_ptr<GrpcListener> listener(
      new GrpcListener(fd, ntohs(addr.sin_port), std::max(1, max_connections)));
  if (pipe2(listener->wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::UnavailableError(absl::StrCat("gRPC: pipe(): ", strerror(errno)));
  }
  return listener;
}

GrpcListener::GrpcListener(int fd, int port, int max_connections)
    : listen_fd_(fd), port_(port), max_connections_(max_connections) {
  heartbeat_ns_.store(absl::GetCurrentTimeNanos());
}

GrpcListener::~GrpcListener() {
  Stop();
  for (int fd : wake_) {
    if (fd >= 0) close(fd);
  }
}

void GrpcListener::Serve(grpc::Server* server) {
  thread_ = std::thread([this, server] {
    NameThisThread("accel-grpc");
    Loop(server);
  });
}

void GrpcListener::Stop() {
  if (stopping_.exchange(true)) return;
  const char byte = 0;
  [[maybe_unused]] ssize_t ignored = write(wake_[1], &byte, 1);
  // Once the loop is done no connection is handed over any more (a caller
  // shuts gRPC down next); then the port closes and newcomers are refused.
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
}

int64_t GrpcListener::open_connections() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(handed_.size());
}

absl::Time GrpcListener::last_heartbeat() const {
  return absl::FromUnixNanos(heartbeat_ns_.load());
}

void GrpcListener::Sweep() {
  for (auto it = handed_.begin(); it != handed_.end();) {
    if (SocketIdentity(it->first) != it->second) {
      it = handed_.erase(it);
    } else {
      ++it;
    }
  }
}

void GrpcListener::Loop(grpc::Server* server) {
  absl::Duration pause = kFailurePause;
  while (!stopping_.load()) {
    heartbeat_ns_.store(absl::GetCurrentTimeNanos());
    bool full;
    {
      absl::MutexLock lock(&mu_);
      if (static_cast<int>(handed_.size()) >= max_connections_) Sweep();
      full = static_cast<int>(handed_.size()) >= max_connections_;
    }
    // Full: only the wake pipe, so that waiting clients (readable listener)
    // do not spin the loop; they wait in the backlog.
    pollfd p[2] = {{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    const int ready = poll(p, full ? 1 : 2, full ? kFullPollMs : kIdlePollMs);
    if (stopping_.load()) break;
    if (ready <= 0 || full || !(p[1].revents & POLLIN)) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) {
        continue;
      }
      // Out of descriptors (EMFILE, ENFILE) or memory: the connection stays
      // in the backlog; pause (never spin), then try again.
      accept_failures_.fetch_add(1);
      poll(p, 1, static_cast<int>(absl::ToInt64Milliseconds(pause)));
      pause = std::min(pause * 2, kMaxFailurePause);
      continue;
    }
    pause = kFailurePause;
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    {
      absl::MutexLock lock(&mu_);
      handed_[fd] = SocketIdentity(fd);  // a descriptor reused: its old connection ended
    }
    grpc::AddInsecureChannelFromFd(server, fd);
  }
}

}  // namespace accel::server::internal
