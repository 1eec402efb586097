// dispatch/internal/host_memory.h: the memory cgroup's limit, v2 and v1,
// read from a made-up cgroup file system, and this process's own.
#include "dispatch/internal/host_memory.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dispatch/device_map.h"
#include "tests/testing/temp_dir.h"

namespace accel::dispatch::internal {
namespace {

using ::accel::test::TempDir;

constexpr int64_t kMiB = int64_t{1} << 20;

void Put(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
}

TEST(HostMemoryTest, V1ReadsTheProcesssOwnCgroupNotTheRoot) {
  TempDir root;
  // The root of the hierarchy has no limit; the process's cgroup has one.
  Put(root.path() + "/memory/memory.limit_in_bytes", "9223372036854771712\n");
  Put(root.path() + "/memory/memory.usage_in_bytes", "99999999999\n");
  const std::string own = root.path() + "/memory/jobs/run-1";
  Put(own + "/memory.limit_in_bytes", std::to_string(1024 * kMiB) + "\n");
  Put(own + "/memory.usage_in_bytes", std::to_string(600 * kMiB) + "\n");
  Put(own + "/memory.stat", "cache 1\nrss 2\nhierarchical_memory_limit " +
                                std::to_string(2048 * kMiB) + "\ntotal_inactive_file " +
                                std::to_string(100 * kMiB) + "\ntotal_active_file " +
                                std::to_string(50 * kMiB) + "\n");
  const auto got = ReadCgroupMemory(
      "12:pids:/jobs/run-1\n4:memory:/jobs/run-1\n1:name=systemd:/\n0::/\n", root.path());
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->path, own);
  EXPECT_EQ(got->limit, 1024 * kMiB);
  EXPECT_EQ(got->usage, 600 * kMiB);
  EXPECT_EQ(got->file, 150 * kMiB);
  // The page cache counts as room: 1024 - (600 - 150).
  EXPECT_EQ(got->available(), 574 * kMiB);
}

TEST(HostMemoryTest, V1TakesAnAncestorsSmallerLimit) {
  TempDir root;
  const std::string own = root.path() + "/memory/a/b";
  Put(own + "/memory.limit_in_bytes", "9223372036854771712\n");
  Put(own + "/memory.usage_in_bytes", std::to_string(10 * kMiB) + "\n");
  Put(own + "/memory.stat", "hierarchical_memory_limit " + std::to_string(300 * kMiB) + "\n");
  const auto got = ReadCgroupMemory("4:memory:/a/b\n", root.path());
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->limit, 300 * kMiB);
  EXPECT_EQ(got->available(), 290 * kMiB);
}

TEST(HostMemoryTest, V1WithoutALimitIsNone) {
  TempDir root;
  Put(root.path() + "/memory/x/memory.limit_in_bytes", "9223372036854771712\n");
  Put(root.path() + "/memory/x/memory.stat", "hierarchical_memory_limit 9223372036854771712\n");
  EXPECT_FALSE(ReadCgroupMemory("4:memory:/x\n", root.path()).has_value());
}

TEST(HostMemoryTest, V2ReadsMemoryMaxAndItsFileCache) {
  TempDir root;
  const std::string own = root.path() + "/system.slice/job.scope";
  Put(own + "/memory.max", std::to_string(512 * kMiB) + "\n");
  Put(own + "/memory.current", std::to_string(500 * kMiB) + "\n");
  Put(own + "/memory.stat", "anon 1\nfile 99\nactive_file " + std::to_string(20 * kMiB) +
                                "\ninactive_file " + std::to_string(30 * kMiB) + "\n");
  const auto got = ReadCgroupMemory("0::/system.slice/job.scope\n", root.path());
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->limit, 512 * kMiB);
  EXPECT_EQ(got->available(), 62 * kMiB);
  Put(own + "/memory.max", "max\n");
  EXPECT_FALSE(ReadCgroupMemory("0::/system.slice/job.scope\n", root.path()).has_value());
}

TEST(HostMemoryTest, InsideACgroupNamespaceTheMountIsTheOwnCgroup) {
  TempDir root;
  Put(root.path() + "/memory.max", std::to_string(256 * kMiB) + "\n");
  Put(root.path() + "/memory.current", "0\n");
  const auto got = ReadCgroupMemory("0::/\n", root.path());
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->limit, 256 * kMiB);
  EXPECT_EQ(got->available(), 256 * kMiB);
}

TEST(HostMemoryTest, NoCgroupLinesMeanNoLimit) {
  TempDir root;
  EXPECT_FALSE(ReadCgroupMemory("", root.path()).has_value());
  EXPECT_FALSE(ReadCgroupMemory("not a cgroup line\n", root.path()).has_value());
}

TEST(HostMemoryTest, TheMachinesMemAvailableIsRead) {
  TempDir dir;
  const std::string path = dir.Write("meminfo", "MemTotal: 100 kB\nMemAvailable:   2048 kB\n");
  EXPECT_EQ(MemAvailable(path), 2048 * 1024);
  EXPECT_FALSE(MemAvailable(dir.Write("empty", "MemTotal: 1 kB\n")).has_value());
  // This machine's own, whatever it is, is positive.
  ASSERT_TRUE(MemAvailable().has_value());
  EXPECT_GT(*MemAvailable(), 0);
}

// Whether a cgroup limit binds: one below the machine's memory does (the
// expert cache then drops the pages it evicts), none or one above does not.
// Read through $ACCEL_CGROUP_ROOT, laid out as a cgroup v2 mount whose own
// cgroup is its root (as inside a cgroup namespace), as the tools' tests do.
TEST(HostMemoryTest, ALimitBelowTheMachinesMemoryBinds) {
  TempDir root;
  Put(root.path() + "/memory.current", "0\n");
  Put(root.path() + "/memory.stat", "active_file 0\ninactive_file 0\n");
  ASSERT_EQ(::setenv("ACCEL_CGROUP_ROOT", root.path().c_str(), 1), 0);
  Put(root.path() + "/memory.max", std::to_string(256 * kMiB) + "\n");
  const bool small = HostMemoryLimitedByCgroup();
  Put(root.path() + "/memory.max", std::to_string(int64_t{1} << 50) + "\n");  // 1 PiB
  const bool large = HostMemoryLimitedByCgroup();
  Put(root.path() + "/memory.max", "max\n");
  const bool none = HostMemoryLimitedByCgroup();
  ::unsetenv("ACCEL_CGROUP_ROOT");
  EXPECT_TRUE(small);
  EXPECT_FALSE(large);
  EXPECT_FALSE(none);
}

}  // namespace
}  // namespace accel::dispatch::internal
