// The liveness watchdog: its probes against live, dead and silent ports,
// and when it declares a port dead or alive again.
#include "server/internal/listener_watchdog.h"

#include <memory>
#include <string>
#include <sys/socket.h>
#include <unistd.h>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

#include "server/internal/http_transport.h"

namespace accel::server::internal {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

// A socket that listens but whose owner never accepts: what a dead accept
// loop looks like from outside (connects still complete, in the backlog).
class SilentListener {
 public:
  SilentListener() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    listen(fd_, 16);
    socklen_t length = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &length);
    port_ = ntohs(addr.sin_port);
  }
  ~SilentListener() { close(fd_); }
  int port() const { return port_; }

 private:
  const int fd_;
  int port_ = 0;
};

TEST(ProbeListenerTest, AnswersSilenceAndRefusal) {
  auto http = HttpServer::Start(
      [] {
        HttpServerOptions options;
        options.host = "127.0.0.1";
        return options;
      }(),
      [](std::shared_ptr<HttpExchange> exchange) { exchange->Respond(404, "text/plain", "no"); },
      [](int, absl::string_view) { return std::string("{}"); });
  ASSERT_TRUE(http.ok()) << http.status();
  // Any HTTP answer, 404 included, is a live listener.
  EXPECT_EQ(ProbeListener("127.0.0.1", (*http)->port(), ProbeKind::kHttp, absl::Seconds(2)),
            ProbeResult::kAlive);
  // Not HTTP/2: no SETTINGS frame comes back.
  EXPECT_EQ(ProbeListener("127.0.0.1", (*http)->port(), ProbeKind::kGrpc, absl::Seconds(2)),
            ProbeResult::kDead);
  SilentListener silent;
  const absl::Time start = absl::Now();
  EXPECT_EQ(ProbeListener("127.0.0.1", silent.port(), ProbeKind::kHttp, absl::Milliseconds(300)),
            ProbeResult::kDead);
  EXPECT_EQ(ProbeListener("127.0.0.1", silent.port(), ProbeKind::kTls, absl::Milliseconds(300)),
            ProbeResult::kDead);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  const int closed = (*http)->port();
  http->reset();
  // Nobody listens there any more: refused.
  EXPECT_EQ(ProbeListener("127.0.0.1", closed, ProbeKind::kHttp, absl::Seconds(1)),
            ProbeResult::kDead);
}

TEST(ListenerWatchdogTest, ThreeFailuresInARowMakeAPortDeadAndOneAnswerAlive) {
  absl::Mutex mu;
  std::vector<ProbeResult> script = {
      ProbeResult::kDead, ProbeResult::kDead,  ProbeResult::kAlive,    // reset by an answer
      ProbeResult::kDead, ProbeResult::kDead,  ProbeResult::kUnknown,  // counts neither way
      ProbeResult::kDead,                                              // third in a row: dead
      ProbeResult::kDead, ProbeResult::kAlive,                         // alive again
  };
  size_t next = 0;
  std::vector<std::pair<std::string, bool>> changes;
  ListenerWatchdog watchdog({{"grpc",
                              [&] {
                                absl::MutexLock lock(&mu);
                                return script[next++];
                              }},
                             {"http", [] { return ProbeResult::kAlive; }}},
                            absl::Seconds(60), 3, [&](const std::string& name, bool alive) {
                              changes.emplace_back(name, alive);
                            });
  std::vector<bool> all_alive;
  for (size_t i = 0; i < script.size(); ++i) {
    watchdog.ProbeOnce();
    all_alive.push_back(watchdog.all_alive());
  }
  EXPECT_THAT(changes, ElementsAre(Pair("grpc", false), Pair("grpc", true)));
  EXPECT_THAT(all_alive, ElementsAre(true, true, true, true, true, true, false, false, true));
}

TEST(ListenerWatchdogTest, ProbesOnItsOwnThreadUntilStopped) {
  SilentListener silent;
  std::vector<std::pair<std::string, bool>> changes;
  absl::Mutex mu;
  ListenerWatchdog watchdog({{"metrics",
                              [&silent] {
                                return ProbeListener("127.0.0.1", silent.port(), ProbeKind::kHttp,
                                                     absl::Milliseconds(100));
                              }}},
                            absl::Milliseconds(50), 3, [&](const std::string& name, bool alive) {
                              absl::MutexLock lock(&mu);
                              changes.emplace_back(name, alive);
                            });
  watchdog.Start();
  {
    absl::MutexLock lock(&mu);
    auto noticed = [&changes]() { return !changes.empty(); };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&noticed), absl::Seconds(10)));
  }
  watchdog.Stop();
  absl::MutexLock lock(&mu);
  EXPECT_THAT(changes, ElementsAre(Pair("metrics", false)));
  EXPECT_FALSE(watchdog.all_alive());
}

}  // namespace
}  // namespace accel::server::internal
