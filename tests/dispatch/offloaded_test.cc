// dispatch/internal/offloaded.h's file mapping: disk weights used in place.
#include "dispatch/internal/offloaded.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/string_view.h"

#include "core/file_faults.h"
#include "core/status.h"
#include "tests/testing/process_memory.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::dispatch::internal {
namespace {

using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

// `count` float32 values 0, 1, 2, ... as raw bytes.
std::string WriteFloats(const TempDir& dir, int64_t count) {
  std::vector<float> values(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) values[static_cast<size_t>(i)] = static_cast<float>(i);
  return dir.Write("weights.bin", absl::string_view(reinterpret_cast<const char*>(values.data()),
                                                    values.size() * sizeof(float)));
}

TEST(FileMappingTest, AMissingFileIsAnErrorNamingIt) {
  TempDir dir;
  EXPECT_THAT(OpenFile::Open(dir.path() + "/absent.bin", /*direct=*/false),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("absent.bin")));
}

TEST(FileMappingTest, AViewIsTheFilesBytesAndSurvivesDropAndPopulate) {
  TempDir dir;
  constexpr int64_t kCount = 3 * 1024 + 17;
  const std::string path = WriteFloats(dir, kCount);
  ACCEL_ASSERT_OK_AND_ASSIGN(std::shared_ptr<const OpenFile> file, OpenFile::Open(path, false));
  ACCEL_ASSERT_OK_AND_ASSIGN(std::shared_ptr<FileMapping> mapping, FileMapping::Open(*file));
  EXPECT_EQ(mapping->size(), static_cast<uint64_t>(kCount * 4));
  // At a huge page's boundary, so the page cache's huge folios of the file
  // can be mapped whole (core/map_file.h).
  EXPECT_EQ(reinterpret_cast<uintptr_t>(mapping->data()) % (uint64_t{2} << 20), 0u);
  Source source;
  source.path = path;
  source.offset = uint64_t{400} * 4;
  source.nbytes = uint64_t{2000} * 4;
  source.dtype = at::kFloat;
  source.shape = {40, 50};
  source.mapping = mapping;
  at::Tensor view = MappedView(source);
  ASSERT_TRUE(view.defined());
  EXPECT_EQ(view.data_ptr(), mapping->data() + source.offset);  // no copy
  const at::Tensor expected = at::arange(400, 2400, at::kFloat).reshape({40, 50});
  EXPECT_TRUE(at::equal(view, expected));
  // Dropped pages come back from the file on the next touch; edges past the
  // file's end are clipped, not an error.
  mapping->Drop(0, mapping->size());
  EXPECT_TRUE(at::equal(view, expected));
  mapping->Populate(source.offset, source.nbytes);
  mapping->Populate(mapping->size() - 4, 1 << 20);
  mapping->Drop(mapping->size() + 10, 100);
  EXPECT_TRUE(at::equal(view, expected));
  // The view keeps the mapping alive past its last other owner.
  mapping.reset();
  source.mapping.reset();
  EXPECT_TRUE(at::equal(view, expected));
}

TEST(FileMappingTest, UnalignedOrOutOfRangeBytesHaveNoView) {
  TempDir dir;
  const std::string path = WriteFloats(dir, 64);
  ACCEL_ASSERT_OK_AND_ASSIGN(std::shared_ptr<const OpenFile> file, OpenFile::Open(path, false));
  ACCEL_ASSERT_OK_AND_ASSIGN(std::shared_ptr<FileMapping> mapping, FileMapping::Open(*file));
  Source source;
  source.path = path;
  source.dtype = at::kFloat;
  source.shape = {4};
  source.nbytes = 16;
  source.mapping = mapping;
  source.offset = 2;  // not a multiple of 4: such a tensor is read into a buffer instead
  EXPECT_FALSE(MappedView(source).defined());
  source.offset = 64 * 4 - 8;  // past the end
  EXPECT_FALSE(MappedView(source).defined());
  source.offset = 8;
  EXPECT_TRUE(MappedView(source).defined());
  source.mapping.reset();  // a source without a mapping
  EXPECT_FALSE(MappedView(source).defined());
}

// A mapping of a file of `count` floats 0, 1, 2, ..., written back to disk
// and dropped from the page cache, so that what reads it reads the disk;
// null where the page cache keeps the file all the same (a memory file
// system), or on a failure, which it records.
std::shared_ptr<FileMapping> EvictedMapping(const TempDir& dir, int64_t count) {
  const std::string path = WriteFloats(dir, count);
  const int fd = ::open(path.c_str(), O_RDONLY);
  EXPECT_GE(fd, 0) << path;
  if (fd < 0) return nullptr;
  EXPECT_EQ(::fsync(fd), 0) << path;  // written back, so the page cache can let it go
  ::close(fd);
  absl::StatusOr<std::shared_ptr<const OpenFile>> file = OpenFile::Open(path, false);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return nullptr;
  absl::StatusOr<std::shared_ptr<FileMapping>> mapping = FileMapping::Open(**file);
  EXPECT_TRUE(mapping.ok()) << mapping.status();
  if (!mapping.ok()) return nullptr;
  const uint64_t size = (*mapping)->size();
  (*mapping)->Evict(0, size);
  if ((*mapping)->Missing(0, size) != size) return nullptr;
  return *std::move(mapping);
}

// The thread's storage reads across a Populate() are the bytes the page
// cache lacked (what Missing() says before), and nothing once it holds them:
// how the expert cache counts a read without a page-cache lookup per page.
TEST(FileMappingTest, ThreadStorageReadBytesCountsWhatAPopulateReadFromDisk) {
  TempDir dir;
  constexpr int64_t kCount = int64_t{1} << 20;  // 4 MiB, whole pages
  std::shared_ptr<FileMapping> mapping = EvictedMapping(dir, kCount);
  if (HasFailure()) return;
  if (mapping == nullptr) GTEST_SKIP() << "the page cache keeps the file: no disk to count";
  const uint64_t size = mapping->size();
  if (!std::filesystem::exists("/proc/self/io")) {
    GTEST_SKIP() << "this kernel keeps no per-task I/O accounting";
  }
  const uint64_t before = ThreadStorageReadBytes();
  mapping->WillNeed(0, size);
  mapping->Populate(0, size);
  const uint64_t read = ThreadStorageReadBytes() - before;
  EXPECT_EQ(mapping->Missing(0, size), 0u);
  EXPECT_GE(read, size);
  EXPECT_LE(read, size + (uint64_t{2} << 20));  // at most a huge folio past the end
  const uint64_t again = ThreadStorageReadBytes();
  mapping->WillNeed(0, size);
  mapping->Populate(0, size);
  EXPECT_EQ(ThreadStorageReadBytes() - again, 0u);
  const at::Tensor view = at::from_blob(const_cast<char*>(mapping->data()), {kCount}, at::kFloat);
  EXPECT_TRUE(at::equal(view, at::arange(0, kCount, at::kFloat)));
}

// A small range advised is read into the page cache ahead of its
// Populate(); a range of kWillNeedLimit or more is not (the kernel would read
// one readahead window of it in small folios), and its Populate() reads it.
TEST(FileMappingTest, WillNeedReadsSmallRangesAndLeavesLargeOnesToPopulate) {
  TempDir dir;
  const int64_t count = static_cast<int64_t>(FileMapping::kWillNeedLimit / 4) + (int64_t{1} << 20);
  std::shared_ptr<FileMapping> mapping = EvictedMapping(dir, count);
  if (HasFailure()) return;
  if (mapping == nullptr) GTEST_SKIP() << "the page cache keeps the file: no disk to read";
  const uint64_t size = mapping->size();
  const uint64_t small = uint64_t{1} << 20;
  const uint64_t large_at = uint64_t{2} << 20;
  const uint64_t large = FileMapping::kWillNeedLimit;
  ASSERT_LE(large_at + large, size);
  mapping->WillNeed(0, small);
  mapping->WillNeed(large_at, large);
  // The small range's reads complete on their own; give them up to 5 s.
  for (int i = 0; i < 500 && mapping->Missing(0, small) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(mapping->Missing(0, small), 0u);
  EXPECT_EQ(mapping->Missing(large_at, large), large);
  mapping->Populate(large_at, large);
  EXPECT_EQ(mapping->Missing(large_at, large), 0u);
}

// Large read buffers sit at 2 MiB boundaries and are advised MADV_HUGEPAGE,
// so the kernel can back each 2 MiB with one page (what the products then
// read without a fault a small page); they are reused, and unmapped when the
// last holder goes.
TEST(BufferPoolTest, LargeBuffersAreHugePageAlignedAdvisedReusedAndUnmapped) {
  constexpr uint64_t kHuge = uint64_t{2} << 20;
  const uint64_t bytes = 5 * kHuge + 12345;  // not a whole number of huge pages
  const void* data = nullptr;
  {
    BufferPool pool;
    at::Tensor buffer = pool.Take(bytes, /*pinned=*/false);
    ASSERT_EQ(buffer.nbytes(), bytes);
    ASSERT_EQ(buffer.scalar_type(), at::kByte);
    data = buffer.data_ptr();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % kHuge, 0u);
    const test::Mapping mapping = test::MappingHolding(data);
    ASSERT_NE(mapping.end, 0u) << "no mapping holds the buffer";
    EXPECT_THAT(mapping.vm_flags, HasSubstr(" hg"));
    EXPECT_GE(mapping.end - reinterpret_cast<uintptr_t>(data), bytes);
    // Writable to its last byte, and what is written is read back.
    buffer.fill_(7);
    buffer[static_cast<int64_t>(bytes) - 1].fill_(9);
    EXPECT_EQ(buffer.sum().item<int64_t>(), 7 * static_cast<int64_t>(bytes) + 2);
    // Given back and taken again: the same memory, not a new mapping.
    pool.Give(std::move(buffer));
    at::Tensor again = pool.Take(bytes - 100, /*pinned=*/false);
    EXPECT_EQ(again.data_ptr(), data);
    // A value still viewing a buffer keeps it out of the pool.
    at::Tensor view = again.narrow(0, 0, 16);
    pool.Give(again);
    EXPECT_NE(pool.Take(bytes, /*pinned=*/false).data_ptr(), data);
  }
  // The pool and every tensor gone: the memory is unmapped.
  EXPECT_EQ(test::MappingHolding(data).end, 0u);
  // Small buffers come from the allocator as before.
  BufferPool pool;
  at::Tensor small = pool.Take(kHugePageBufferBytes / 2, /*pinned=*/false);
  EXPECT_EQ(small.nbytes(), kHugePageBufferBytes / 2);
}

// A file is read through the descriptor opened at load, never its path
// again: replaced (renamed over) or deleted, the bytes read are the ones it
// had; truncated under us, a read is DataLoss naming the tensor and the file,
// and is recorded as a weights file fault (core/file_faults.h).
TEST(OpenFileTest, ReadsGoThroughTheHeldFileNotThePath) {
  ResetModelFileFaultForTesting();
  TempDir dir;
  const std::string path = WriteFloats(dir, 1024);
  ACCEL_ASSERT_OK_AND_ASSIGN(std::shared_ptr<const OpenFile> file, OpenFile::Open(path, true));
  Source source;
  source.path = path;
  source.offset = uint64_t{100} * 4;
  source.nbytes = uint64_t{200} * 4;
  source.dtype = at::kFloat;
  source.shape = {200};
  source.file = file;
  const at::Tensor expected = at::arange(100, 300, at::kFloat);
  const auto read = [&](bool direct) -> absl::StatusOr<at::Tensor> {
    ACCEL_ASSIGN_OR_RETURN(ReadTensors got, ReadCoalesced({&source}, {"w"}, direct, [](uint64_t n) {
                             return at::empty({static_cast<int64_t>(n)}, at::kByte);
                           }));
    return got.values[0].clone();
  };
  for (bool direct : {false, true}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor first, read(direct));
    EXPECT_TRUE(at::equal(first, expected));
  }
  // Replaced by a rename (how a model is updated safely), then deleted.
  dir.Write("other.bin", std::string(4096, '\x7f'));
  ASSERT_EQ(std::rename(dir.File("other.bin").c_str(), path.c_str()), 0);
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor replaced, read(false));
  EXPECT_TRUE(at::equal(replaced, expected));
  std::filesystem::remove(path);
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor deleted, read(true));
  EXPECT_TRUE(at::equal(deleted, expected));
  EXPECT_EQ(ModelFileFault(), std::nullopt);
  // Truncated in place: the held file itself is cut short.
  const int writer = ::open(("/proc/self/fd/" + std::to_string(file->fd())).c_str(), O_WRONLY);
  ASSERT_GE(writer, 0);
  ASSERT_EQ(::ftruncate(writer, 300), 0);
  ::close(writer);
  EXPECT_THAT(read(false), StatusIs(absl::StatusCode::kDataLoss,
                                    AllOf(HasSubstr("tensor 'w'"), HasSubstr(path))));
  ASSERT_NE(ModelFileFault(), std::nullopt);
  EXPECT_THAT(*ModelFileFault(), HasSubstr(path));
  ResetModelFileFaultForTesting();
}

}  // namespace
}  // namespace accel::dispatch::internal
