#include "core/thread_name.h"

#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace accel {
namespace {

// The calling thread's name as the kernel shows it to top -H and perf.
std::string ThreadComm() {
  std::ifstream in("/proc/thread-self/comm");
  std::string name;
  std::getline(in, name);
  return name;
}

TEST(NameThisThreadTest, TheKernelShowsTheName) {
  std::string seen;
  std::thread([&] {
    NameThisThread("accel-reader");
    seen = ThreadComm();
  }).join();
  EXPECT_EQ(seen, "accel-reader");
}

TEST(NameThisThreadTest, ALongNameIsCutTo15CharactersNotRefused) {
  std::string seen;
  std::thread([&] {
    NameThisThread("accel-a-name-longer-than-fifteen");
    seen = ThreadComm();
  }).join();
  EXPECT_EQ(seen, "accel-a-name-lo");
}

TEST(NameThisThreadTest, OnlyTheCallingThreadIsNamed) {
  const std::string before = ThreadComm();
  std::thread([] { NameThisThread("accel-other"); }).join();
  EXPECT_EQ(ThreadComm(), before);
}

}  // namespace
}  // namespace accel
