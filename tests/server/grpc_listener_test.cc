// accel-serve's own accept loop for plaintext gRPC
// (server/internal/grpc_listener.h): connections reach gRPC, at most the cap
// are open (more wait in the backlog), and after descriptors ran out the
// port accepts again (gRPC 1.51's own listener never did).
#include "server/internal/grpc_listener.h"

#include <dirent.h>
#include <memory>
#include <poll.h>
#include <string>
#include <sys/resource.h>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/server/raw_http.h"

namespace accel::server::internal {
namespace {

using ::accel::test::ConnectTo;
using ::accel::test::RawSocket;

class GrpcListenerTest : public ::testing::Test {
 protected:
  void Start(int max_connections) {
    auto bound = GrpcListener::Bind("127.0.0.1", 0, max_connections);
    ASSERT_TRUE(bound.ok()) << bound.status();
    listener_ = *std::move(bound);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;  // no port of its own
    // A callback service, as accel-serve's are: without one (and without a
    // port) gRPC has no completion queue it polls and refuses to start.
    builder.RegisterCallbackGenericService(&generic_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    listener_->Serve(server_.get());
  }
  void TearDown() override {
    if (listener_ != nullptr) listener_->Stop();
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
    listener_.reset();
    server_.reset();
  }

  // One health check on a fresh channel, within `timeout`.
  grpc::Status Check(absl::Duration timeout) {
    grpc::ChannelArguments args;
    args.SetInt("grpc.use_local_subchannel_pool", 1);  // a connection of its own
    auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", listener_->port()),
                                             grpc::InsecureChannelCredentials(), args);
    auto stub = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    return stub->Check(&context, request, &response);
  }

  grpc::CallbackGenericService generic_;
  std::unique_ptr<GrpcListener> listener_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(GrpcListenerTest, ConnectionsReachGrpc) {
  Start(8);
  EXPECT_TRUE(Check(absl::Seconds(10)).ok());
  EXPECT_TRUE(Check(absl::Seconds(10)).ok());
}

TEST_F(GrpcListenerTest, PastTheCapNewcomersWaitUntilAConnectionEnds) {
  Start(3);
  std::vector<RawSocket> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(ConnectTo(listener_->port()));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(listener_->open_connections(), 3);
  // A fourth waits in the backlog: its HTTP/2 preface gets no SETTINGS.
  // (Raw, not a gRPC channel: a channel's connection outlives its stub and
  // would take the next free place.)
  RawSocket fourth = ConnectTo(listener_->port());
  ASSERT_TRUE(fourth.ok());
  ASSERT_TRUE(accel::test::SendAll(
      fourth.fd(), std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0", 33)));
  pollfd p = {fourth.fd(), POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 1000), 0) << "answered past the cap";
  EXPECT_LE(listener_->open_connections(), 3);
  // It and one idle connection leave: gRPC closes its sides, the sweep sees
  // it, and the next client is served.
  fourth.Close();
  idle[0].Close();
  EXPECT_TRUE(Check(absl::Seconds(10)).ok());
}

int OpenDescriptors() {
  int count = 0;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (readdir(dir) != nullptr) ++count;
    closedir(dir);
  }
  return count - 3;
}

TEST_F(GrpcListenerTest, AcceptingResumesAfterDescriptorsRanOut) {
  Start(1000);
  ASSERT_TRUE(Check(absl::Seconds(10)).ok());
  rlimit saved = {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(OpenDescriptors() + 30);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<RawSocket> clients;
  for (int i = 0; i < 100; ++i) {
    RawSocket c = ConnectTo(listener_->port());
    if (!c.ok()) break;
    clients.push_back(std::move(c));
  }
  absl::SleepFor(absl::Milliseconds(500));
  const int64_t failures = listener_->accept_failures();
  clients.clear();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_GT(failures, 0);
  EXPECT_LT(failures, 100);  // paused between tries, never spinning
  EXPECT_TRUE(Check(absl::Seconds(10)).ok());
  EXPECT_GT(absl::Now() - listener_->last_heartbeat(), absl::ZeroDuration());
  EXPECT_LT(absl::Now() - listener_->last_heartbeat(), absl::Seconds(3));
}

}  // namespace
}  // namespace accel::server::internal
