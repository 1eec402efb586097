// MapFileHugeAligned: the file's bytes at an address that agrees with their
// file offset modulo 2 MiB, advised MADV_HUGEPAGE, and nothing else left
// mapped.
#include "core/map_file.h"

#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <string>
#include <sys/mman.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/process_memory.h"
#include "tests/testing/temp_dir.h"

namespace accel {
namespace {

using ::accel::test::TempDir;
using ::testing::HasSubstr;

constexpr uint64_t kHuge = uint64_t{2} << 20;

// A file of 5 MiB and a part page: byte i is i * 7 mod 251.
std::string WriteFile(const TempDir& dir) {
  std::string bytes((5 << 20) + 123, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 % 251);
  return dir.Write("weights.bin", bytes);
}

bool HoldsFileBytes(const void* addr, uint64_t offset, size_t size) {
  const auto* p = static_cast<const unsigned char*>(addr);
  for (size_t i = 0; i < size; ++i) {
    if (p[i] != static_cast<unsigned char>((offset + i) * 7 % 251)) return false;
  }
  return true;
}

// The file of WriteFile, open for reading.
class MapFileHugeAlignedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path = WriteFile(dir);
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    size = std::filesystem::file_size(path);
  }
  void TearDown() override {
    if (fd >= 0) ::close(fd);
  }
  TempDir dir;
  std::string path;
  int fd = -1;
  size_t size = 0;
};

TEST_F(MapFileHugeAlignedTest, AddressAgreesWithTheOffsetModuloAHugePage) {
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  for (const uint64_t offset : {uint64_t{0}, page, 3 * page, kHuge + 5 * page}) {
    SCOPED_TRACE(offset);
    const size_t n = size - offset;
    for (const bool shared : {true, false}) {
      const int prot = shared ? PROT_READ : PROT_READ | PROT_WRITE;
      void* addr = MapFileHugeAligned(fd, offset, n, prot, shared ? MAP_SHARED : MAP_PRIVATE);
      ASSERT_NE(addr, MAP_FAILED) << std::strerror(errno);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(addr) % kHuge, offset % kHuge);
      EXPECT_TRUE(HoldsFileBytes(addr, offset, n));
      const test::Mapping m = test::MappingHolding(addr);
      EXPECT_EQ(m.begin, reinterpret_cast<uintptr_t>(addr));
      EXPECT_THAT(m.path, HasSubstr("weights.bin"));
      if (std::filesystem::exists("/sys/kernel/mm/transparent_hugepage/enabled")) {
        EXPECT_THAT(m.vm_flags, HasSubstr(" hg"));  // MADV_HUGEPAGE
      }
      if (!shared) {
        // Private and writable: copy-on-write, the file untouched.
        static_cast<char*>(addr)[10] = 1;
        EXPECT_EQ(static_cast<char*>(addr)[10], 1);
      }
      ::munmap(addr, n);
    }
  }
  char byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, 10), 1);
  EXPECT_EQ(byte, static_cast<char>(70));
}

TEST_F(MapFileHugeAlignedTest, GivesTheRestOfItsReservationBack) {
  // 200 mappings made and unmapped leave the address space as it was: a
  // reservation's 2 MiB margin left behind each time would add 400 MiB.
  const int64_t before = test::VirtualBytes();
  for (int i = 0; i < 200; ++i) {
    void* addr = MapFileHugeAligned(fd, 0, size, PROT_READ, MAP_SHARED);
    ASSERT_NE(addr, MAP_FAILED);
    ::munmap(addr, size);
  }
  EXPECT_LT(test::VirtualBytes() - before, int64_t{64} << 20);
}

TEST(MapAnonymousHugeAligned, IsWritableAtAHugePageBoundaryAdvisedAndNothingElseIsLeft) {
  const size_t size = 3 * kHuge + 4096 + 100;  // not a whole number of pages
  const int64_t before = test::VirtualBytes();
  for (int i = 0; i < 50; ++i) {
    void* addr = MapAnonymousHugeAligned(size);
    ASSERT_NE(addr, MAP_FAILED) << std::strerror(errno);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(addr) % kHuge, 0u);
    const test::Mapping m = test::MappingHolding(addr);
    EXPECT_EQ(m.begin, reinterpret_cast<uintptr_t>(addr));
    EXPECT_GE(m.end - m.begin, size);
    if (std::filesystem::exists("/sys/kernel/mm/transparent_hugepage/enabled")) {
      EXPECT_THAT(m.vm_flags, HasSubstr(" hg"));
    }
    auto* bytes = static_cast<unsigned char*>(addr);
    EXPECT_EQ(bytes[0], 0);  // anonymous memory comes zeroed
    bytes[0] = 1;
    bytes[size - 1] = 2;
    EXPECT_EQ(bytes[0] + bytes[size - 1], 3);
    ::munmap(addr, size);
  }
  // The reservations' margins went back: 50 left behind would be 100 MiB.
  EXPECT_LT(test::VirtualBytes() - before, int64_t{32} << 20);
}

TEST(MapFileHugeAligned, ABadDescriptorFailsWithItsErrno) {
  errno = 0;
  EXPECT_EQ(MapFileHugeAligned(-1, 0, 4096, PROT_READ, MAP_SHARED), MAP_FAILED);
  EXPECT_EQ(errno, EBADF);
}

}  // namespace
}  // namespace accel
