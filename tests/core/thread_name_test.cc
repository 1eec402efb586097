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

// The name a new thread has once it has named itself `name`.
std::string NameSeenAfterNaming(const char* name) {
  std::string seen;
  std::thread([&] {
    NameThisThread(name);
    seen = ThreadComm();
  }).join();
  return seen;
}

TEST(NameThisThreadTest, TheKernelShowsTheName) {
  EXPECT_EQ(NameSeenAfterNaming("accel-reader"), "accel-reader");
}

TEST(NameThisThreadTest, ALongNameIsCutTo15CharactersNotRefused) {
  EXPECT_EQ(NameSeenAfterNaming("accel-a-name-longer-than-fifteen"), "accel-a-name-lo");
}

TEST(NameThisThreadTest, OnlyTheCallingThreadIsNamed) {
  const std::string before = ThreadComm();
  std::thread([] { NameThisThread("accel-other"); }).join();
  EXPECT_EQ(ThreadComm(), before);
}

}  // namespace
}  // namespace accel
