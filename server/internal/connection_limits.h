// server/internal/connection_limits.h: how many connections each of
// accel-serve's ports may hold, from the process's file-descriptor limit,
// so that no port can take the descriptors the others (and the model's
// files) need. Torch-free, gRPC-free.
//
// An outside test held 300 idle TCP connections against a 256-descriptor
// limit: gRPC's accept() failed with EMFILE, after which gRPC 1.51 never
// accepted again, and the HTTP and metrics ports stalled. Now accel-serve
// raises its soft limit to the hard one at start (RaiseOpenFileLimit), and
// each port has a share of what is left after a reserve:
//   reserve = max(64, limit / 8)          (files, pipes, gRPC's own, probes)
//   budget  = limit - reserve
//   gRPC    = budget / 2                  (GrpcListener's cap)
//   HTTP    = min(512, budget * 3 / 8)    (HttpServer's max_connections)
//   metrics = clamp(budget / 16, 2, 128)  (civetweb threads; its queue holds
//                                          20 more connections)
// A port given an explicit cap keeps it.
#ifndef ACCEL_SERVER_INTERNAL_CONNECTION_LIMITS_H_
#define ACCEL_SERVER_INTERNAL_CONNECTION_LIMITS_H_

#include <cstdint>
#include <string>

namespace accel::server::internal {

struct ConnectionLimits {
  int64_t open_files = 0;  // the soft RLIMIT_NOFILE they come from
  int grpc = 0;
  int http = 0;
  int metrics_threads = 0;
};

// `grpc` / `http`: caps asked for (flags); 0: from the limit.
ConnectionLimits ConnectionLimitsFor(int64_t open_files, int grpc = 0, int http = 0);

// The soft RLIMIT_NOFILE now.
int64_t OpenFileLimit();

// Raises the soft RLIMIT_NOFILE to the hard one (an infinite hard limit:
// to fs.nr_open). Returns a line for the log saying what it did ("open
// files: 1024 -> 524288"), or why it could not.
std::string RaiseOpenFileLimit();

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_CONNECTION_LIMITS_H_
