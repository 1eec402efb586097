#include "server/internal/connection_limits.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accel::server::internal {
namespace {

using ::testing::HasSubstr;

// The shares of internal/connection_limits.h, worked by hand.
TEST(ConnectionLimitsTest, SharesOfTheDescriptorLimit) {
  // 256 open files (the outside test): reserve 64, budget 192.
  ConnectionLimits small = ConnectionLimitsFor(256);
  EXPECT_EQ(small.open_files, 256);
  EXPECT_EQ(small.grpc, 96);
  EXPECT_EQ(small.http, 72);
  EXPECT_EQ(small.metrics_threads, 12);
  // Every port at its cap, with civetweb's queue of 20, leaves the reserve.
  EXPECT_LE(small.grpc + small.http + small.metrics_threads + 20, 256 - 64 + 20);
  // 1024 (a common default): reserve 128, budget 896.
  ConnectionLimits common = ConnectionLimitsFor(1024);
  EXPECT_EQ(common.grpc, 448);
  EXPECT_EQ(common.http, 336);
  EXPECT_EQ(common.metrics_threads, 56);
  // A container's 1048576: HTTP and metrics at their own caps.
  ConnectionLimits large = ConnectionLimitsFor(1 << 20);
  EXPECT_EQ(large.grpc, ((1 << 20) - (1 << 17)) / 2);
  EXPECT_EQ(large.http, 512);
  EXPECT_EQ(large.metrics_threads, 128);
  // Caps asked for are kept.
  ConnectionLimits asked = ConnectionLimitsFor(256, 10, 20);
  EXPECT_EQ(asked.grpc, 10);
  EXPECT_EQ(asked.http, 20);
  // A tiny limit still leaves every port something.
  ConnectionLimits tiny = ConnectionLimitsFor(16);
  EXPECT_GE(tiny.grpc, 1);
  EXPECT_GE(tiny.http, 1);
  EXPECT_GE(tiny.metrics_threads, 2);
}

// In a child, so the test process keeps its own limit.
TEST(ConnectionLimitsTest, RaiseOpenFileLimitTakesTheHardLimit) {
  const pid_t pid = fork();
  if (pid == 0) {
    rlimit limit = {200, 300};
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(2);
    const std::string said = RaiseOpenFileLimit();
    if (said != "open files: 200 -> 300 (the hard limit)") _exit(3);
    if (OpenFileLimit() != 300) _exit(4);
    if (RaiseOpenFileLimit() != "open files: 300 (the hard limit)") _exit(5);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace accel::server::internal
