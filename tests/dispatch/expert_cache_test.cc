// The expert cache on its own: what it reads, what it keeps, what it evicts,
// what the reader thread reads ahead, and that no value handed out is ever
// overwritten by a later read into a reused buffer.
#include "dispatch/internal/expert_cache.h"

#include <chrono>
#include <cstdio>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "loader/loader.h"
#include "tests/testing/process_memory.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::dispatch::internal {
namespace {

using ::accel::test::IsOk;
using ::accel::test::PageCachedBytes;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::HasSubstr;

constexpr int kUnits = 4;
constexpr int64_t kNumel = 256;  // floats per tensor; a unit is two tensors: 2 KiB
constexpr int64_t kUnitBytes = 2 * kNumel * 4;

// A raw file of kUnits x 2 tensors, tensor i holding the value i everywhere,
// and the table of offloaded tensors that points into it.
struct Fixture {
  TempDir dir;
  std::string path = dir.path() + "/experts.bin";
  std::vector<Offloaded> tensors;

  Fixture() {
    std::string bytes;
    for (int i = 0; i < 2 * kUnits; ++i) {
      at::Tensor t = at::full({kNumel}, static_cast<float>(i));
      bytes.append(static_cast<const char*>(t.data_ptr()), kNumel * 4);
      Source s;
      s.path = path;
      s.offset = static_cast<uint64_t>(i) * kNumel * 4;
      s.nbytes = kNumel * 4;
      s.dtype = at::kFloat;
      s.shape = {16, 16};
      tensors.push_back({absl::StrCat("experts.", i / 2, ".w", i % 2), s});
    }
    EXPECT_THAT(loader::WriteFileAtomically(path, bytes), IsOk());
    // Held open, as a load holds its files: reads go through the descriptor.
    absl::StatusOr<std::shared_ptr<const OpenFile>> file = OpenFile::Open(path, /*direct=*/true);
    EXPECT_THAT(file, IsOk());
    for (Offloaded& t : tensors) t.source.file = *file;
  }

  // Unit u in layer u % positions of the cycle.
  std::unique_ptr<ExpertCache> Cache(int64_t budget_units, int positions = 1, bool direct = false) {
    ExpertCache::Options options;
    options.budget_bytes = budget_units * kUnitBytes;
    options.positions = positions;
    options.direct = direct;
    auto cache = std::make_unique<ExpertCache>(tensors, options);
    for (int u = 0; u < kUnits; ++u) {
      EXPECT_EQ(cache->AddUnit({2 * u, 2 * u + 1}, u % positions), u);
    }
    return cache;
  }
};

OffloadStats Stats(const ExpertCache& cache) {
  OffloadStats s;
  cache.AddStats(s);
  return s;
}

// The values of unit u are u's two tensors, 2u and 2u + 1, shaped [16, 16].
void ExpectUnit(const std::vector<at::Tensor>& values, int u) {
  ASSERT_EQ(values.size(), 2u);
  for (int m = 0; m < 2; ++m) {
    EXPECT_EQ(values[m].sizes(), (std::vector<int64_t>{16, 16}));
    EXPECT_TRUE(at::equal(values[m], at::full({16, 16}, static_cast<float>(2 * u + m))))
        << "unit " << u << " member " << m;
  }
}

// Waits (bounded) until the reader has read `n` units in all.
bool WaitForFetches(const ExpertCache& cache, int64_t n) {
  for (int i = 0; i < 2000; ++i) {
    if (Stats(cache).expert_fetches >= n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

TEST(ExpertCacheTest, ReadsAUnitOnceThenServesItFromTheCache) {
  Fixture f;
  auto cache = f.Cache(2);
  ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({1}));
  ExpectUnit(values[0], 1);
  cache->Release({1});
  ACCEL_ASSERT_OK_AND_ASSIGN(values, cache->Acquire({1}));
  ExpectUnit(values[0], 1);
  cache->Release({1});
  const OffloadStats s = Stats(*cache);
  EXPECT_EQ(s.expert_fetches, 1);
  EXPECT_EQ(s.expert_cache_hits, 1);
  EXPECT_EQ(s.expert_prefetch_hits, 0);
  EXPECT_EQ(s.expert_bytes_read, kUnitBytes);
  EXPECT_EQ(s.bytes_read, kUnitBytes);
  EXPECT_EQ(cache->cached_bytes(), kUnitBytes);
}

// The names of this process's threads, as top -H and perf show them.
std::vector<std::string> ThreadNames() {
  std::vector<std::string> names;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "comm");
    std::string name;
    if (std::getline(in, name)) names.push_back(name);
  }
  return names;
}

TEST(ExpertCacheTest, ItsReaderThreadIsNamedSoAProfileTellsItFromTheCompute) {
  Fixture f;
  auto cache = f.Cache(2);
  bool named = false;
  for (int i = 0; i < 2000 && !named; ++i) {  // the thread names itself as it starts
    for (const std::string& name : ThreadNames()) named = named || name == "accel-expert-rd";
    if (!named) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(named) << testing::PrintToString(ThreadNames());
  cache.reset();
  for (const std::string& name : ThreadNames()) EXPECT_NE(name, "accel-expert-rd");
}

TEST(ExpertCacheTest, EvictsTheLeastRecentlyUsed) {
  Fixture f;
  auto cache = f.Cache(2);
  for (int u : {0, 1, 0, 2}) {  // 1 is now the oldest, and goes for 2
    ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({u}));
    cache->Release({u});
  }
  EXPECT_EQ(Stats(*cache).expert_fetches, 3);
  ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({0}));  // still cached
  cache->Release({0});
  EXPECT_EQ(Stats(*cache).expert_fetches, 3);
  ACCEL_ASSERT_OK_AND_ASSIGN(values, cache->Acquire({1}));  // evicted: read again
  ExpectUnit(values[0], 1);
  cache->Release({1});
  EXPECT_EQ(Stats(*cache).expert_fetches, 4);
  EXPECT_LE(cache->cached_bytes(), 2 * kUnitBytes);
}

// Layers run in a cycle: with layer 2 running, layer 0's unit is needed
// next and layer 1's (just run) last, so layer 1's goes, where
// least-recently-used would have evicted layer 0's.
TEST(ExpertCacheTest, EvictsTheUnitWhoseLayerComesRoundLast) {
  Fixture f;
  auto cache = f.Cache(2, /*positions=*/3);
  for (int u : {0, 1, 2}) {  // layers 0, 1, 2
    ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({u}));
    ExpectUnit(values[0], u);
    cache->Release({u});
  }
  EXPECT_TRUE(cache->Cached(0));
  EXPECT_FALSE(cache->Cached(1));
  EXPECT_TRUE(cache->Cached(2));
}

// The experts a step needs next are read by the reader in order while the
// step computes; each is then a hit that counts as read ahead.
TEST(ExpertCacheTest, NeededUnitsAreReadAheadInOrder) {
  Fixture f;
  auto cache = f.Cache(4);
  cache->Prefetch({1, 2, 3}, /*needed=*/true);
  for (int u : {1, 2, 3}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({u}));
    ExpectUnit(values[0], u);
    cache->Release({u});
  }
  const OffloadStats s = Stats(*cache);
  EXPECT_EQ(s.expert_fetches, 3);  // each read once, by one thread or the other
  EXPECT_EQ(s.expert_cache_hits + s.expert_misses, 3);
}

// Direct reads (O_DIRECT, widened to 4 KiB boundaries) give the same values.
TEST(ExpertCacheTest, DirectReadsGiveTheSameValues) {
  Fixture f;
  auto cache = f.Cache(1, 1, /*direct=*/true);
  for (int u : {3, 0, 2, 1}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({u}));
    ExpectUnit(values[0], u);
    cache->Release({u});
  }
  EXPECT_EQ(Stats(*cache).expert_fetches, 4);
}

TEST(ExpertCacheTest, PinnedUnitsStayPastTheBudgetUntilReleased) {
  Fixture f;
  auto cache = f.Cache(1);
  ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({0, 1, 3}));
  for (int k = 0; k < 3; ++k) ExpectUnit(values[k], k == 2 ? 3 : k);
  EXPECT_EQ(cache->cached_bytes(), 3 * kUnitBytes);  // a step never fails for want of room
  cache->Release({0, 1, 3});
  EXPECT_LE(cache->cached_bytes(), kUnitBytes);  // and the budget holds again after it
}

TEST(ExpertCacheTest, PrefetchedUnitsAreHitsThatCountAsReadAhead) {
  Fixture f;
  auto cache = f.Cache(2);
  cache->Prefetch({2, 3}, /*needed=*/false);
  ASSERT_TRUE(WaitForFetches(*cache, 2));
  ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({3, 2}));
  ExpectUnit(values[0], 3);
  ExpectUnit(values[1], 2);
  cache->Release({3, 2});
  OffloadStats s = Stats(*cache);
  EXPECT_EQ(s.expert_fetches, 2);
  EXPECT_EQ(s.expert_cache_hits, 2);
  EXPECT_EQ(s.expert_prefetch_hits, 2);
  // Used once, a unit is no longer "read ahead".
  ACCEL_ASSERT_OK_AND_ASSIGN(values, cache->Acquire({3}));
  cache->Release({3});
  EXPECT_EQ(Stats(*cache).expert_prefetch_hits, 2);
}

TEST(ExpertCacheTest, AGuessNeverEvictsWhatIsPinned) {
  Fixture f;
  auto cache = f.Cache(1);
  ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({0}));
  cache->Prefetch({1}, /*needed=*/false);  // no room: the only unit is pinned
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ExpectUnit(values[0], 0);
  EXPECT_EQ(Stats(*cache).expert_fetches, 1);
  EXPECT_EQ(cache->cached_bytes(), kUnitBytes);
  cache->Release({0});
}

TEST(ExpertCacheTest, AValueHeldPastItsEvictionIsNeverOverwritten) {
  Fixture f;
  auto cache = f.Cache(1);
  ACCEL_ASSERT_OK_AND_ASSIGN(auto held, cache->Acquire({0}));
  cache->Release({0});
  // Units 1, 2 and 3 evict one another, reading into freed buffers.
  for (int u : {1, 2, 3}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({u}));
    ExpectUnit(values[0], u);
    cache->Release({u});
  }
  ExpectUnit(held[0], 0);
}

TEST(ExpertCacheTest, AFailedReadNamesTheTensorAndLeavesNothingPinned) {
  Fixture f;
  // Unit 2's second tensor lives in a file that was cut short.
  const std::string short_file = f.dir.Write("short.bin", "four");
  ACCEL_ASSERT_OK_AND_ASSIGN(f.tensors[5].source.file, OpenFile::Open(short_file, false));
  f.tensors[5].source.path = short_file;
  auto cache = f.Cache(1);
  EXPECT_THAT(cache->Acquire({0, 2}),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("experts.2.w1")));
  // Unit 0 was read and is not left pinned: another unit can take its room.
  ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({1}));
  ExpectUnit(values[0], 1);
  cache->Release({1});
  EXPECT_LE(cache->cached_bytes(), kUnitBytes);
}

TEST(ExpertCacheTest, ATruncatedFileIsDataLoss) {
  Fixture f;
  ASSERT_EQ(::truncate(f.path.c_str(), 3 * kNumel * 4), 0);  // units 0 and half of 1 remain
  auto cache = f.Cache(2);
  ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache->Acquire({0}));
  ExpectUnit(values[0], 0);
  cache->Release({0});
  EXPECT_THAT(cache->Acquire({1}),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("experts.1.w1")));
}

// Mapped units (a cpu execution device, used in place) kept in the page
// cache after eviction stay there only while the machine's free memory is
// above the floor: below it, the cache drops the pages of the units it
// evicted longest ago before each read; above it, it leaves them. Units of
// 4 MiB at 2 MiB boundaries, so no page-cache folio is shared between two.
TEST(ExpertCacheTest, EvictedMappedUnitsLeaveThePageCacheOnlyBelowTheFreeMemoryFloor) {
  constexpr int64_t kBig = int64_t{1} << 19;  // floats a tensor: 2 MiB
  constexpr int64_t kBigUnitBytes = 2 * kBig * 4;
  TempDir dir;
  const std::string path = dir.path() + "/experts.bin";
  std::string bytes;
  for (int i = 0; i < 2 * kUnits; ++i) {
    at::Tensor t = at::full({kBig}, static_cast<float>(i));
    bytes.append(static_cast<const char*>(t.data_ptr()), kBig * 4);
  }
  ASSERT_THAT(loader::WriteFileAtomically(path, bytes), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(std::shared_ptr<const OpenFile> file,
                             OpenFile::Open(path, /*direct=*/false));
  ACCEL_ASSERT_OK_AND_ASSIGN(std::shared_ptr<FileMapping> mapping, FileMapping::Open(*file));
  std::vector<Offloaded> tensors;
  for (int i = 0; i < 2 * kUnits; ++i) {
    Source s;
    s.path = path;
    s.offset = static_cast<uint64_t>(i) * kBig * 4;
    s.nbytes = kBig * 4;
    s.dtype = at::kFloat;
    s.shape = {kBig};
    s.mapping = mapping;
    s.file = file;
    tensors.push_back({absl::StrCat("experts.", i / 2, ".w", i % 2), s});
  }
  const auto unit_cached = [&](int u) {
    return PageCachedBytes(mapping->data() + u * kBigUnitBytes, kBigUnitBytes);
  };
  for (const bool short_of_memory : {false, true}) {
    SCOPED_TRACE(short_of_memory ? "free memory below the floor" : "free memory above it");
    // From a page cache without the file (written pages made clean first).
    ::fsync(file->fd());
    ASSERT_EQ(::posix_fadvise(file->fd(), 0, 0, POSIX_FADV_DONTNEED), 0);
    ExpertCache::Options options;
    options.budget_bytes = kBigUnitBytes;  // one unit
    options.keep_memory_free = true;
    options.free_memory = [&] { return short_of_memory ? int64_t{0} : int64_t{1} << 50; };
    ExpertCache cache(tensors, options);
    for (int u = 0; u < kUnits; ++u) ASSERT_EQ(cache.AddUnit({2 * u, 2 * u + 1}, 0), u);
    for (int u = 0; u < 3; ++u) {
      ACCEL_ASSERT_OK_AND_ASSIGN(auto values, cache.Acquire({u}));
      EXPECT_TRUE(at::equal(values[0][1], at::full({kBig}, static_cast<float>(2 * u + 1))));
      cache.Release({u});
    }
    // Unit 0 was evicted by unit 1's read, unit 1 by unit 2's; unit 2 is cached.
    EXPECT_EQ(unit_cached(2), kBigUnitBytes);
    EXPECT_EQ(unit_cached(1), kBigUnitBytes);  // evicted last: not dropped yet
    EXPECT_EQ(unit_cached(0), short_of_memory ? 0 : kBigUnitBytes);
    EXPECT_EQ(Stats(cache).expert_units_uncached, short_of_memory ? 1 : 0);
    // A unit dropped from the page cache reads back the same values.
    ACCEL_ASSERT_OK_AND_ASSIGN(auto again, cache.Acquire({0}));
    EXPECT_TRUE(at::equal(again[0][0], at::full({kBig}, 0.0f)));
    cache.Release({0});
  }
}

}  // namespace
}  // namespace accel::dispatch::internal
