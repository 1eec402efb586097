// The OpenAI API's HTTP transport (server/internal/http_transport.h, on
// Boost.Beast and Asio) with real sockets: answers, streams, a client that
// leaves, the connection cap (idle and slow sockets give way, and the 503
// past it arrives whole), deadlines, bad heads, and descriptors running out.
#include "server/internal/http_transport.h"

#include <atomic>
#include <dirent.h>
#include <memory>
#include <string>
#include <sys/resource.h>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

#include "tests/server/raw_http.h"

namespace accel::server::internal {
namespace {

using ::accel::test::ConnectTo;
using ::accel::test::Exchange;
using ::accel::test::RawSocket;
using ::accel::test::ReadUntil;
using ::accel::test::Request;
using ::accel::test::SendAll;
using ::accel::test::StatusOf;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string ErrorBodyOf(int status, absl::string_view message) {
  return absl::StrCat("{\"status\": ", status, ", \"message\": \"", message, "\"}");
}

// A server whose handler answers "/echo" at once with the path and keeps
// every "/hold" exchange unanswered (held() has them).
class TransportTest : public ::testing::Test {
 protected:
  void StartServer(HttpServerOptions options = {}) {
    options.host = "127.0.0.1";
    auto started = HttpServer::Start(
        options,
        [this](std::shared_ptr<HttpExchange> exchange) {
          if (exchange->request().path == "/busy") {
            // A handler that keeps the connection's sequence busy (as a large
            // body's parse does) and looks whether its client is still there.
            const absl::Time until = absl::Now() + absl::Seconds(10);
            while (!exchange->PeerClosed() && absl::Now() < until) {
              absl::SleepFor(absl::Milliseconds(5));
            }
            if (exchange->PeerClosed()) busy_saw_close_.Notify();
            return;
          }
          if (exchange->request().path == "/hold") {
            absl::MutexLock lock(&mu_);
            held_.push_back(std::move(exchange));
            return;
          }
          exchange->Respond(
              200, "text/plain",
              absl::StrCat("path=", exchange->request().path, " body=", exchange->request().body));
        },
        ErrorBodyOf);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
  }

  std::vector<std::shared_ptr<HttpExchange>> held() {
    absl::MutexLock lock(&mu_);
    return held_;
  }
  // Waits until `n` exchanges are held.
  bool WaitHeld(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return held_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }

  void TearDown() override {
    server_.reset();
    absl::MutexLock lock(&mu_);
    held_.clear();
  }

  std::unique_ptr<HttpServer> server_;
  absl::Notification busy_saw_close_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<HttpExchange>> held_ ABSL_GUARDED_BY(mu_);
};

TEST_F(TransportTest, AnswersAndKeepsTheConnection) {
  StartServer();
  RawSocket s = ConnectTo(server_->port());
  ASSERT_TRUE(s.ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(SendAll(s.fd(), Request("POST", absl::StrCat("/echo/", i), "hi", false)));
    const std::string response = ReadUntil(s.fd(), absl::StrCat("body=hi"));
    EXPECT_THAT(response, StartsWith("HTTP/1.1 200 OK\r\n"));
    EXPECT_THAT(response, HasSubstr("Content-Length: 20\r\n"));
    EXPECT_THAT(response, EndsWith(absl::StrCat("path=/echo/", i, " body=hi")));
  }
  // Two requests in one write (pipelined): both answered, in order.
  ASSERT_TRUE(SendAll(s.fd(), Request("GET", "/echo/a", "", false) + Request("GET", "/echo/b")));
  const std::string both = ReadUntil(s.fd());
  EXPECT_LT(both.find("path=/echo/a"), both.find("path=/echo/b"));
  EXPECT_NE(both.find("path=/echo/b"), std::string::npos);
}

TEST_F(TransportTest, StreamedAnswerIsChunkedAndTheConnectionGoesOn) {
  StartServer();
  RawSocket s = ConnectTo(server_->port());
  ASSERT_TRUE(SendAll(s.fd(), Request("GET", "/hold", "", false)));
  ASSERT_TRUE(WaitHeld(1));
  std::shared_ptr<HttpExchange> exchange = held()[0];
  // From another thread, as the engine's sink does.
  std::thread writer([exchange] {
    EXPECT_TRUE(exchange->StartStream(200, "text/event-stream", {"Cache-Control: no-cache"}));
    EXPECT_TRUE(exchange->WriteChunk("data: 1\n\n"));
    EXPECT_TRUE(exchange->WriteChunk(""));  // nothing (an empty chunk would end the body)
    EXPECT_TRUE(exchange->WriteChunk("data: 2\n\n"));
    EXPECT_TRUE(exchange->EndStream());
  });
  writer.join();
  const std::string stream = ReadUntil(s.fd(), "0\r\n\r\n");
  EXPECT_THAT(stream, HasSubstr("Transfer-Encoding: chunked\r\n"));
  EXPECT_THAT(stream, HasSubstr("Cache-Control: no-cache\r\n"));
  EXPECT_THAT(stream, HasSubstr("9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"));
  // The exchange is over: nothing more goes out for it.
  EXPECT_FALSE(exchange->Respond(200, "text/plain", "late"));
  ASSERT_TRUE(SendAll(s.fd(), Request("GET", "/echo/next")));
  EXPECT_THAT(ReadUntil(s.fd()), HasSubstr("path=/echo/next"));
}

// What cancels a generation when its client leaves: the close reaches the
// handler at once, while it waits (nothing was written yet).
TEST_F(TransportTest, AClientThatLeavesIsNoticedAtOnce) {
  StartServer();
  for (bool shutdown_only : {false, true}) {
    const size_t index = held().size();  // before the request: it may be held at once
    RawSocket s = ConnectTo(server_->port());
    ASSERT_TRUE(SendAll(s.fd(), Request("POST", "/hold", "{}", false)));
    ASSERT_TRUE(WaitHeld(index + 1));
    std::shared_ptr<HttpExchange> exchange = held()[index];
    auto gone = std::make_shared<absl::Notification>();
    exchange->OnClientGone([gone] { gone->Notify(); });
    EXPECT_FALSE(exchange->PeerClosed());
    // A plain close, or a half close (FIN) with the socket still open.
    if (shutdown_only) {
      shutdown(s.fd(), SHUT_WR);
    } else {
      s.Close();
    }
    EXPECT_TRUE(gone->WaitForNotificationWithTimeout(absl::Seconds(5)));
    EXPECT_TRUE(exchange->PeerClosed());
    EXPECT_FALSE(exchange->Respond(200, "text/plain", "nobody reads this"));
    // Registered after the fact: runs at once.
    absl::Notification late;
    exchange->OnClientGone([&late] { late.Notify(); });
    EXPECT_TRUE(late.HasBeenNotified());
  }
}

// A handler busy on the connection's own sequence (the read that reports a
// close waits behind it) still sees its client leave: what stops the parse
// of a large body whose client has gone.
TEST_F(TransportTest, AHandlerBusyOnTheConnectionSeesItsClientLeave) {
  StartServer();
  RawSocket s = ConnectTo(server_->port());
  ASSERT_TRUE(SendAll(s.fd(), Request("POST", "/busy", std::string(100000, 'x'), false)));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(busy_saw_close_.HasBeenNotified());
  s.Close();
  EXPECT_TRUE(busy_saw_close_.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

// Posted tasks run on the connection's sequence, after what was queued
// before them; once the connection ended they are dropped.
TEST_F(TransportTest, PostedTasksRunInOrderAndStopWithTheConnection) {
  StartServer();
  RawSocket s = ConnectTo(server_->port());
  ASSERT_TRUE(SendAll(s.fd(), Request("GET", "/hold")));
  ASSERT_TRUE(WaitHeld(1));
  std::shared_ptr<HttpExchange> exchange = held()[0];
  auto order = std::make_shared<std::vector<int>>();
  auto done = std::make_shared<absl::Notification>();
  exchange->StartStream(200, "text/plain");
  for (int i = 0; i < 100; ++i) {
    exchange->Post([order, i, exchange] {
      order->push_back(i);
      exchange->WriteChunk(absl::StrCat(i, ","));
    });
  }
  exchange->Post([exchange, done] {
    exchange->EndStream();
    done->Notify();
  });
  ASSERT_TRUE(done->WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_EQ(order->size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ((*order)[i], i);
  const std::string body = ReadUntil(s.fd());
  EXPECT_THAT(body, HasSubstr("2\r\n0,\r\n2\r\n1,\r\n"));
  EXPECT_THAT(body, HasSubstr("3\r\n99,\r\n0\r\n\r\n"));
  // The connection is closed now (Connection: close was asked for).
  std::atomic<bool> ran{false};
  exchange->Post([&ran] { ran = true; });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(ran.load());
}

// 64 sockets that never send a byte and 64 that trickle a head, beside a cap
// of 32 connections: every real client is still answered, because a
// newcomer takes the place of the connection that waited longest for its
// request (the old server held a thread per socket up to its cap of 512 and
// refused everyone else).
TEST_F(TransportTest, IdleAndSlowSocketsGiveWayToNewClients) {
  HttpServerOptions options;
  options.max_connections = 32;
  options.request_timeout = absl::Seconds(30);
  StartServer(options);
  std::vector<RawSocket> idle;
  std::vector<RawSocket> slow;
  for (int i = 0; i < 64; ++i) {
    idle.push_back(ConnectTo(server_->port()));
    slow.push_back(ConnectTo(server_->port()));
    ASSERT_TRUE(idle.back().ok() && slow.back().ok());
  }
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    const std::string head = "GET /echo/slow HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    for (size_t i = 0; !stop.load(); ++i) {
      for (const RawSocket& s : slow) {
        send(s.fd(), &head[i % head.size()], 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  absl::SleepFor(absl::Milliseconds(300));
  for (int i = 0; i < 10; ++i) {
    const absl::Time start = absl::Now();
    const std::string response =
        Exchange(server_->port(), "GET", absl::StrCat("/echo/", i), "", "", absl::Seconds(10));
    EXPECT_EQ(StatusOf(response), 200) << response;
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  }
  stop = true;
  trickle.join();
  const HttpServer::Counts counts = server_->counts();
  EXPECT_GT(counts.evicted, 0);
  EXPECT_LE(counts.open, 32 + 64);  // the cap, and lingering closes beside it
}

// Every connection busy with a request being answered: a newcomer is told
// 503 with Retry-After, and the answer arrives whole, not destroyed by a
// reset (the old server wrote it and closed with the request unread, and
// most clients saw ECONNRESET).
TEST_F(TransportTest, PastTheCapTheAnswerIs503AndArrivesWhole) {
  HttpServerOptions options;
  options.max_connections = 2;
  StartServer(options);
  std::vector<RawSocket> busy;
  for (int i = 0; i < 2; ++i) {
    busy.push_back(ConnectTo(server_->port()));
    ASSERT_TRUE(SendAll(busy.back().fd(), Request("POST", "/hold", "{}", false)));
  }
  ASSERT_TRUE(WaitHeld(2));
  for (int i = 0; i < 20; ++i) {
    RawSocket s = ConnectTo(server_->port());
    ASSERT_TRUE(s.ok());
    // A request with a body, sent whole, as clients do.
    SendAll(s.fd(), Request("POST", "/echo", std::string(2000, 'x')));
    int error = 0;
    const std::string response = ReadUntil(s.fd(), "", absl::Seconds(10), &error);
    EXPECT_EQ(error, 0) << "attempt " << i << ": " << strerror(error);
    EXPECT_THAT(response, StartsWith("HTTP/1.1 503 Service Unavailable\r\n")) << i;
    EXPECT_THAT(response, HasSubstr("Retry-After: 1\r\n"));
    EXPECT_THAT(response, HasSubstr("Connection: close\r\n"));
    EXPECT_THAT(response, EndsWith("connections open, its limit; retry\"}"));
  }
  EXPECT_EQ(server_->counts().refused, 20);
  // The held ones are still served (two I/O threads: held() is in the order
  // the handlers ran, which need not be the order of the connections).
  for (const auto& exchange : held()) exchange->Respond(200, "text/plain", "finally");
  for (RawSocket& s : busy) {
    EXPECT_THAT(ReadUntil(s.fd(), "finally", absl::Seconds(5)), HasSubstr("finally"));
  }
}

TEST_F(TransportTest, TrickledHeadIsAnswered408AndClosed) {
  HttpServerOptions options;
  options.request_timeout = absl::Seconds(1);
  StartServer(options);
  RawSocket s = ConnectTo(server_->port());
  ASSERT_TRUE(SendAll(s.fd(), "GET /echo HTTP/1.1\r\nHo"));
  const absl::Time start = absl::Now();
  const std::string response = ReadUntil(s.fd(), "", absl::Seconds(10));
  EXPECT_THAT(response, StartsWith("HTTP/1.1 408 Request Timeout\r\n"));
  EXPECT_THAT(response, HasSubstr("the request head did not arrive in time"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // A connection that never sends anything is answered 408 too.
  RawSocket silent = ConnectTo(server_->port());
  EXPECT_THAT(ReadUntil(silent.fd(), "", absl::Seconds(10)),
              HasSubstr("the request did not arrive in time"));
}

TEST_F(TransportTest, BadHeadsGetTheirStatus) {
  HttpServerOptions options;
  options.max_body_bytes = 1000;
  options.max_header_bytes = 4096;
  StartServer(options);
  const int port = server_->port();
  EXPECT_EQ(StatusOf(Exchange(port, "POST", "/echo", "", "Transfer-Encoding: chunked\r\n")), 411);
  const std::string too_big = Exchange(port, "POST", "/echo", std::string(1001, 'x'));
  EXPECT_EQ(StatusOf(too_big), 413);
  EXPECT_THAT(too_big, HasSubstr("the body is 1001 bytes"));
  EXPECT_EQ(StatusOf(Exchange(port, "GET", "/echo", "",
                              absl::StrCat("X-Big: ", std::string(5000, 'a'), "\r\n"))),
            431);
  RawSocket s = ConnectTo(port);
  SendAll(s.fd(), "GET /echo HTTP/1.1\nHost: x\r\n\r\n");
  EXPECT_EQ(StatusOf(ReadUntil(s.fd())), 400);
  EXPECT_EQ(StatusOf(Exchange(port, "GET", "/echo")), 200);  // the server goes on
}

TEST_F(TransportTest, ExpectContinueIsAnswered) {
  StartServer();
  RawSocket s = ConnectTo(server_->port());
  ASSERT_TRUE(SendAll(s.fd(),
                      "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                      "Content-Length: 5\r\nConnection: close\r\n\r\n"));
  EXPECT_EQ(ReadUntil(s.fd(), "\r\n\r\n", absl::Seconds(5)), "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_TRUE(SendAll(s.fd(), "hello"));
  EXPECT_THAT(ReadUntil(s.fd()), EndsWith("path=/echo body=hello"));
}

TEST_F(TransportTest, StopClosesWaitingConnectionsAndLetsAnswersFinish) {
  StartServer();
  RawSocket idle = ConnectTo(server_->port());
  RawSocket busy = ConnectTo(server_->port());
  ASSERT_TRUE(SendAll(busy.fd(), Request("GET", "/hold", "", false)));
  ASSERT_TRUE(WaitHeld(1));
  server_->Stop();
  EXPECT_EQ(ReadUntil(idle.fd(), "", absl::Seconds(5)), "");  // closed, no answer
  EXPECT_TRUE(held()[0]->stopping());
  held()[0]->Respond(200, "text/plain", "last");
  const std::string last = ReadUntil(busy.fd(), "", absl::Seconds(5));
  EXPECT_THAT(last, HasSubstr("Connection: close\r\n"));
  EXPECT_THAT(last, EndsWith("last"));
  EXPECT_TRUE(server_->WaitConnections(absl::Seconds(5)));
  EXPECT_FALSE(ConnectTo(server_->port()).ok());
}

int OpenDescriptors() {
  int count = 0;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (readdir(dir) != nullptr) ++count;
    closedir(dir);
  }
  return count - 3;  // ".", "..", and the directory's own descriptor
}

// The outside test's episode: descriptors run out (here the test's own
// client sockets take them), accept() fails with EMFILE; once descriptors
// are free the port accepts again (gRPC 1.51's never did; the old HTTP
// server spun a core meanwhile).
TEST_F(TransportTest, AcceptingResumesAfterDescriptorsRanOut) {
#ifdef ACCEL_UBSAN_VPTR
  GTEST_SKIP() << "UBSan's vptr check needs a free descriptor (it probes memory through a pipe)";
#endif
  StartServer();
  rlimit saved = {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(OpenDescriptors() + 40);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<RawSocket> clients;
  for (int i = 0; i < 200; ++i) {
    RawSocket c = ConnectTo(server_->port());  // completes in the backlog even unaccepted
    if (!c.ok()) break;
    clients.push_back(std::move(c));
  }
  absl::SleepFor(absl::Milliseconds(500));
  const int64_t failures = server_->counts().accept_failures;
  clients.clear();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_GT(failures, 0) << "descriptors never ran out for the server";
  // Paused, not spinning: a few failures a second at most.
  EXPECT_LT(failures, 100);
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ(StatusOf(Exchange(server_->port(), "GET", "/echo/after", "", "", absl::Seconds(10))),
            200);
}

}  // namespace
}  // namespace accel::server::internal
