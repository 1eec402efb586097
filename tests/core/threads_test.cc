#include "core/threads.h"

#include <optional>
#include <sched.h>
#include <stdlib.h>
#include <string>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

namespace accel {
namespace {

// Sets OMP_NUM_THREADS (or unsets it, for nullopt) for the scope.
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(std::optional<std::string> value) {
    if (const char* old = std::getenv("OMP_NUM_THREADS")) old_ = old;
    if (value) {
      setenv("OMP_NUM_THREADS", value->c_str(), 1);
    } else {
      unsetenv("OMP_NUM_THREADS");
    }
  }
  ~ScopedOmpThreads() {
    if (old_) {
      setenv("OMP_NUM_THREADS", old_->c_str(), 1);
    } else {
      unsetenv("OMP_NUM_THREADS");
    }
  }

 private:
  std::optional<std::string> old_;
};

int AffinityCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  return CPU_COUNT(&set);
}

TEST(IntraOpThreadsTest, RequestedWins) {
  ScopedOmpThreads env("5");
  EXPECT_EQ(IntraOpThreads(3), 3);
}

TEST(IntraOpThreadsTest, OmpNumThreadsWhenNothingRequested) {
  ScopedOmpThreads env("5");
  EXPECT_EQ(IntraOpThreads(0), 5);
}

TEST(IntraOpThreadsTest, OneThreadPerCpuOfTheAffinityMask) {
  ScopedOmpThreads env(std::nullopt);
  EXPECT_EQ(IntraOpThreads(0), AffinityCpus());
  EXPECT_GE(IntraOpThreads(-1), 1);
}

TEST(IntraOpThreadsTest, MalformedOmpNumThreadsIsIgnored) {
  for (const char* bad : {"", "abc", "0", "-2", "3x"}) {
    ScopedOmpThreads env{std::string(bad)};
    EXPECT_EQ(IntraOpThreads(0), AffinityCpus()) << "OMP_NUM_THREADS=" << bad;
  }
}

TEST(IntraOpThreadsTest, SetAppliesToLibtorch) {
  ScopedOmpThreads env(std::nullopt);
  EXPECT_EQ(SetIntraOpThreads(0), AffinityCpus());
  EXPECT_EQ(at::get_num_threads(), AffinityCpus());
  EXPECT_EQ(SetIntraOpThreads(1), 1);
  EXPECT_EQ(at::get_num_threads(), 1);
}

}  // namespace
}  // namespace accel
