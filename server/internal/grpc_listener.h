// server/internal/grpc_listener.h: accel-serve's own accept loop for the
// plaintext gRPC port, handing each connection to gRPC
// (grpc::AddInsecureChannelFromFd) with a cap on how many are open at once.
//
// Why not gRPC's listener: gRPC 1.51 (Debian's) stops accepting for good the
// first time accept() fails with EMFILE (its tcp_server_posix.cc drops the
// listening socket's read notification), so one episode of descriptor
// exhaustion (300 idle TCP connections under a 256-descriptor limit) left
// the port dead while the process looked alive; and it has no connection
// cap. Here at most max_connections connections are open: past that the
// loop stops accepting and newcomers wait in the kernel's backlog until one
// ends, so the port can never take the process's last descriptors; and if
// accept() fails anyway (the descriptors went elsewhere), the loop pauses and
// tries again, so the port accepts again once descriptors are free.
//
// How it knows a connection ended: gRPC owns the descriptor and closes it
// without telling anyone. Each handed-over descriptor is remembered with
// its socket's inode; a descriptor that no longer refers to that inode
// (closed, or reused by something else) has ended. The list is swept when
// the cap is reached, so the cost is paid only then.
//
// TLS (gRPC offers channels from descriptors only without credentials) and
// a host that is not an IPv4 address keep gRPC's own listener.
#ifndef ACCEL_SERVER_INTERNAL_GRPC_LISTENER_H_
#define ACCEL_SERVER_INTERNAL_GRPC_LISTENER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace accel::server::internal {

class GrpcListener {
 public:
  // Binds host:port (an IPv4 address; port 0: a free one) and listens; no
  // connection is accepted before Serve. InvalidArgument for a host that is
  // not an IPv4 address, Unavailable when it cannot listen.
  static absl::StatusOr<std::unique_ptr<GrpcListener>> Bind(const std::string& host, int port,
                                                            int max_connections);
  // Stop(), then joins the loop.
  ~GrpcListener();
  GrpcListener(const GrpcListener&) = delete;
  GrpcListener& operator=(const GrpcListener&) = delete;

  int port() const { return port_; }
  // Starts accepting for `server` (started, outliving this listener's loop).
  void Serve(grpc::Server* server);
  // Stops accepting and closes the listening socket; connections handed to
  // gRPC stay gRPC's. Idempotent.
  void Stop();

  // Connections handed to gRPC and still open (as of the last sweep); how
  // often accept() failed (descriptors ran out); a heartbeat of the loop
  // (the last time it went round), for the liveness watchdog.
  int64_t open_connections() const;
  int64_t accept_failures() const { return accept_failures_.load(); }
  absl::Time last_heartbeat() const;

 private:
  GrpcListener(int fd, int port, int max_connections);
  void Loop(grpc::Server* server);
  // Forgets the descriptors that no longer hold the socket handed over.
  void Sweep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int listen_fd_;
  const int port_;
  const int max_connections_;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> accept_failures_{0};
  std::atomic<int64_t> heartbeat_ns_{0};
  mutable absl::Mutex mu_;
  // Descriptor -> (device, inode) of the socket handed over on it.
  std::map<int, std::pair<uint64_t, uint64_t>> handed_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_GRPC_LISTENER_H_
