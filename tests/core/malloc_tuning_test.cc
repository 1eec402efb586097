// core/malloc_tuning.h against glibc itself: once set, a 4 MiB block (above
// glibc's default mmap threshold) comes from the heap and stays there, free,
// after it is freed, where by default it would be mapped and unmapped.
#include "core/malloc_tuning.h"

#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace accel {
namespace {

TEST(MallocTuningTest, FreedBlocksStayInTheHeap) {
  if (!KeepFreedMemoryForReuse()) GTEST_SKIP() << "not glibc's malloc, or GLIBC_TUNABLES set it";
#if defined(__GLIBC__)
  constexpr size_t kBlock = size_t{4} << 20;
  static_assert(kBlock < kHeapBlockMaxBytes);
  const struct mallinfo2 before = mallinfo2();
  void* volatile block = std::malloc(kBlock);
  const struct mallinfo2 held = mallinfo2();
  ASSERT_NE(block, nullptr);  // NOLINT(clang-analyzer-unix.Malloc): null, nothing to free
  EXPECT_EQ(held.hblkhd, before.hblkhd) << "the block was mapped on its own";
  EXPECT_GE(held.uordblks, before.uordblks + kBlock);
  std::free(block);
  const struct mallinfo2 after = mallinfo2();
  EXPECT_GE(after.fordblks, kBlock) << "the freed block went back to the kernel";
  EXPECT_GE(after.arena, held.arena) << "the heap was trimmed";
#endif
}

// A user's own malloc tunables win: nothing is changed then.
TEST(MallocTuningTest, GlibcTunablesStand) {
  const char* old = std::getenv("GLIBC_TUNABLES");
  const std::string saved = old != nullptr ? old : "";
  ASSERT_EQ(setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0", 1), 0);
  EXPECT_FALSE(KeepFreedMemoryForReuse());
  if (old != nullptr) {
    setenv("GLIBC_TUNABLES", saved.c_str(), 1);
  } else {
    unsetenv("GLIBC_TUNABLES");
  }
}

}  // namespace
}  // namespace accel
