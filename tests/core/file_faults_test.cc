// The weights-file fault record and the SIGBUS handler, on a real file
// truncated under a real mapping: the read past the new end completes (a
// zero page), the fault names the file and stays recorded; a SIGBUS outside
// any registered mapping still kills, as it would without the handler. Each
// case runs in its own process (ctest), so the process-wide record starts
// empty.
#include "core/file_faults.h"

#include <csignal>
#include <cstdio>
#include <fcntl.h>
#include <filesystem>
#include <optional>
#include <string>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/temp_dir.h"

namespace accel {
namespace {

using ::accel::test::TempDir;
using ::testing::HasSubstr;

// A file of `pages` pages of 0x5a, mapped read-only; the mapping's address.
const char* MapFile(const std::string& path, size_t pages, size_t* size) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  *size = pages * page;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  EXPECT_GE(fd, 0);
  const std::string bytes(*size, '\x5a');
  EXPECT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  void* addr = ::mmap(nullptr, *size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  EXPECT_NE(addr, MAP_FAILED);
  return static_cast<const char*>(addr);
}

char ReadByte(const char* p) { return *static_cast<const volatile char*>(p); }

// The process died of it: SIGBUS's default action, or (under ASan, whose
// handler was there before ours) ASan's report and then its exit, or its
// abort under abort_on_error=1 (as CI runs it).
bool DiedOfIt(int status) {
  return (WIFSIGNALED(status) && (WTERMSIG(status) == SIGBUS || WTERMSIG(status) == SIGABRT)) ||
         (WIFEXITED(status) && WEXITSTATUS(status) != 0);
}

TEST(FileFaults, ATruncatedMappingReadsZerosAndTheFaultNamesTheFile) {
  InstallMappedFileFaultHandler();
  ResetModelFileFaultForTesting();
  TempDir dir;
  const std::string path = dir.File("model.safetensors");
  size_t size = 0;
  const char* data = MapFile(path, 4, &size);
  MappedFileRegistration registration(data, size, path);
  EXPECT_EQ(ReadByte(data + size - 1), '\x5a');
  EXPECT_EQ(ModelFileFault(), std::nullopt);

  ASSERT_EQ(::truncate(path.c_str(), 100), 0);  // `cp` over the file starts so
  EXPECT_EQ(ReadByte(data + 50), '\x5a');       // still inside the file
  EXPECT_EQ(ReadByte(data + size - 1), '\0');   // past its end: SIGBUS, mended
  EXPECT_EQ(MappedFileFaultCount(), 1);
  ASSERT_NE(ModelFileFault(), std::nullopt);
  EXPECT_THAT(*ModelFileFault(), HasSubstr(path));
  EXPECT_THAT(*ModelFileFault(), HasSubstr("truncated or rewritten"));
  // The mended page stays: no second fault.
  EXPECT_EQ(ReadByte(data + size - 2), '\0');
  EXPECT_EQ(MappedFileFaultCount(), 1);
  ::munmap(const_cast<char*>(data), size);
}

TEST(FileFaults, TheFirstFaultIsKept) {
  ResetModelFileFaultForTesting();
  RecordModelFileFault("reading /m/model-00002.safetensors: No such file");
  RecordModelFileFault("a later one");
  EXPECT_EQ(ModelFileFault(), "reading /m/model-00002.safetensors: No such file");
}

TEST(FileFaultsDeathTest, ASigbusOutsideTheRegisteredMappingsStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  TempDir dir;
  const std::string path = dir.File("other.bin");
  EXPECT_EXIT(
      {
        InstallMappedFileFaultHandler();
        size_t size = 0;
        const char* data = MapFile(path, 2, &size);
        if (::truncate(path.c_str(), 0) != 0) std::_Exit(1);
        // The child made a folder of its own (the test runs again in it) and
        // dies without destructors: removed here, the mapping stays valid.
        std::error_code ec;
        std::filesystem::remove_all(dir.path(), ec);
        (void)ReadByte(data + size - 1);
        std::_Exit(0);
      },
      DiedOfIt, "");
}

TEST(FileFaults, ARegistrationEndsWithItsOwner) {
  InstallMappedFileFaultHandler();
  ResetModelFileFaultForTesting();
  TempDir dir;
  const std::string path = dir.File("gone.safetensors");
  size_t size = 0;
  const char* data = MapFile(path, 2, &size);
  { MappedFileRegistration registration(data, size, path); }
  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  EXPECT_EXIT(
      {
        (void)ReadByte(data + size - 1);
        std::_Exit(0);
      },
      DiedOfIt, "");
  EXPECT_EQ(ModelFileFault(), std::nullopt);
}

// Waits up to `ms` milliseconds for a fault to be recorded.
std::optional<std::string> AwaitFault(int ms) {
  for (int waited = 0; waited < ms && !ModelFileFault(); waited += 10) ::usleep(10000);
  return ModelFileFault();
}

// A held file's name given to a new file (a rename over it) and that file
// written is not a fault: the process still holds the old one. The held file
// rewritten in place (cp over it) is, naming it.
TEST(FileFaults, TheWatcherTellsAChangeInPlaceFromAReplacement) {
  ResetModelFileFaultForTesting();
  StartWeightsFileWatcher();
  TempDir dir;
  const std::string replaced = dir.Write("a.safetensors", std::string(4096, 'a'));
  const int a = ::open(replaced.c_str(), O_RDONLY);
  ASSERT_GE(a, 0);
  WeightsFileWatch watch_a(a, replaced);
  dir.Write("new.safetensors", std::string(4096, 'b'));
  ASSERT_EQ(std::rename(dir.File("new.safetensors").c_str(), replaced.c_str()), 0);
  dir.Write("a.safetensors", std::string(4096, 'c'));  // the replacement, rewritten
  EXPECT_EQ(AwaitFault(500), std::nullopt);

  const std::string rewritten = dir.Write("b.safetensors", std::string(4096, 'a'));
  const int b = ::open(rewritten.c_str(), O_RDONLY);
  ASSERT_GE(b, 0);
  WeightsFileWatch watch_b(b, rewritten);
  dir.Write("b.safetensors", std::string(4096, 'z'));  // truncated and written: the same inode
  const std::optional<std::string> fault = AwaitFault(10000);
  ASSERT_NE(fault, std::nullopt);
  EXPECT_THAT(*fault, HasSubstr(rewritten));
  EXPECT_THAT(*fault, HasSubstr("modified in place"));
  ::close(a);
  ::close(b);
}

}  // namespace
}  // namespace accel
