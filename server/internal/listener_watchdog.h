// server/internal/listener_watchdog.h: liveness that notices a port that
// stopped accepting. Torch-free, gRPC-free.
//
// A process whose listening socket is dead (gRPC 1.51's after one EMFILE)
// still answers on its open connections, so nothing inside it notices. The
// watchdog connects to each of accel-serve's ports as a client would, every
// `interval`, and asks for the protocol's first answer: an HTTP response
// (the OpenAI and metrics ports), an HTTP/2 SETTINGS frame (plaintext gRPC),
// a finished TLS handshake (a TLS port). A port that fails `failures` probes
// in a row is dead; the server then reports itself not live (health
// "accel.live" / "" NOT_SERVING, accel_listener_up 0), so an orchestrator
// restarts it, and says which port on stderr. A probe that cannot even open
// its socket (the process is out of descriptors) proves nothing and counts
// neither way. A port that answers again is live again.
#ifndef ACCEL_SERVER_INTERNAL_LISTENER_WATCHDOG_H_
#define ACCEL_SERVER_INTERNAL_LISTENER_WATCHDOG_H_

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace accel::server::internal {

enum class ProbeResult { kAlive, kDead, kUnknown };

// What a probe of `port` on `host` (an IPv4 address) expects, within
// `timeout` of the connect.
enum class ProbeKind {
  kHttp,  // any "HTTP/1.x" status line to GET /health
  kGrpc,  // a SETTINGS frame after the HTTP/2 preface
  kTls,   // a completed TLS handshake (ALPN: `alpn`)
};
ProbeResult ProbeListener(const std::string& host, int port, ProbeKind kind, absl::Duration timeout,
                          const std::string& alpn = "");

class ListenerWatchdog {
 public:
  struct Listener {
    std::string name;  // "grpc", "http", "metrics"
    std::function<ProbeResult()> probe;
  };
  // Called when a listener turns dead (alive = false) or alive again, on the
  // watchdog's thread.
  using OnChange = std::function<void(const std::string& name, bool alive)>;

  ListenerWatchdog(std::vector<Listener> listeners, absl::Duration interval, int failures,
                   OnChange on_change);
  // Stop().
  ~ListenerWatchdog();
  ListenerWatchdog(const ListenerWatchdog&) = delete;
  ListenerWatchdog& operator=(const ListenerWatchdog&) = delete;

  // Probes every `interval` on a thread of its own until Stop.
  void Start();
  void Stop();
  // One round now, on the caller's thread (tests; Start's loop).
  void ProbeOnce();
  // True while no listener is dead.
  bool all_alive() const;

 private:
  struct State {
    Listener listener;
    int failed = 0;  // in a row
    bool alive = true;
  };
  const absl::Duration interval_;
  const int failures_;
  const OnChange on_change_;
  mutable absl::Mutex mu_;
  std::vector<State> states_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_LISTENER_WATCHDOG_H_
