// The block pool: allocation until the pool is empty, reference
// counts, prefix matching by the hash chain (and only on equal tokens),
// least-recently-used eviction of cached blocks, and a randomized run of
// many sequences that must leave the pool whole.
#include "engine/kv_cache_manager.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

std::vector<int64_t> Range(int64_t first, int64_t n) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = first + i;
  return ids;
}

// Seals every full block of `ids` held in `table`, as the KV cache manager does.
void SealAll(BlockPool& m, const std::vector<int32_t>& table, const std::vector<int64_t>& ids) {
  uint64_t key = 0;
  const int64_t bs = m.block_size();
  for (size_t b = 0;
       (static_cast<int64_t>(b) + 1) * bs <= static_cast<int64_t>(ids.size()) && b < table.size();
       ++b) {
    absl::Span<const int64_t> span = absl::MakeConstSpan(ids).subspan(b * bs, bs);
    key = BlockPool::ChainKey(key, span);
    m.Seal(table[b], key, span);
  }
}

TEST(BlockPoolTest, AllocatesEveryBlockOnceThenRunsOut) {
  BlockPool m(4, 16, /*prefix_caching=*/false);
  EXPECT_EQ(m.BlocksFor(0), 0);
  EXPECT_EQ(m.BlocksFor(1), 1);
  EXPECT_EQ(m.BlocksFor(16), 1);
  EXPECT_EQ(m.BlocksFor(17), 2);
  std::set<int32_t> got;
  for (int i = 0; i < 4; ++i) {
    std::optional<int32_t> b = m.Allocate();
    ASSERT_TRUE(b.has_value());
    EXPECT_GE(*b, 0);
    EXPECT_LT(*b, 4);
    got.insert(*b);
  }
  EXPECT_EQ(got.size(), 4u);
  EXPECT_EQ(m.free_blocks(), 0);
  EXPECT_EQ(m.used_blocks(), 4);
  EXPECT_FALSE(m.Allocate().has_value());
  m.Release(2);
  EXPECT_EQ(m.free_blocks(), 1);
  EXPECT_EQ(m.Allocate(), std::optional<int32_t>(2));
}

TEST(BlockPoolTest, APrefixIsFoundOnlyForTheSameTokensFromTheStart) {
  BlockPool m(8, 4, /*prefix_caching=*/true);
  const std::vector<int64_t> prompt = Range(100, 10);  // two full blocks and 2 tokens
  std::vector<int32_t> table;
  for (int i = 0; i < 3; ++i) table.push_back(*m.Allocate());
  SealAll(m, table, prompt);
  EXPECT_EQ(m.cached_blocks(), 2);

  // The same first 8 tokens: both blocks, shared.
  std::vector<int64_t> other = Range(100, 8);
  other.push_back(7);
  BlockPool::Prefix hit = m.MatchPrefix(other, static_cast<int64_t>(other.size()) - 1);
  EXPECT_THAT(hit.blocks, ElementsAre(table[0], table[1]));
  EXPECT_EQ(hit.tokens, 8);
  EXPECT_EQ(m.ref_count(table[0]), 2);
  EXPECT_EQ(m.prefix_query_tokens(), 8);
  EXPECT_EQ(m.prefix_hit_tokens(), 8);

  // max_tokens cuts the match to whole blocks below it.
  BlockPool::Prefix cut = m.MatchPrefix(other, 7);
  EXPECT_EQ(cut.tokens, 4);
  m.Release(cut.blocks[0]);

  // The second block differs: only the first is shared.
  std::vector<int64_t> diverging = Range(100, 4);
  for (int64_t id : Range(900, 5)) diverging.push_back(id);
  BlockPool::Prefix half = m.MatchPrefix(diverging, 8);
  EXPECT_THAT(half.blocks, ElementsAre(table[0]));
  m.Release(half.blocks[0]);

  // The same second block after a different first one is another key.
  std::vector<int64_t> shifted = Range(0, 4);
  for (int64_t id : Range(104, 5)) shifted.push_back(id);
  EXPECT_THAT(m.MatchPrefix(shifted, 8).blocks, IsEmpty());

  for (int32_t b : hit.blocks) m.Release(b);
  for (int32_t b : table) m.Release(b);
  EXPECT_EQ(m.free_blocks(), 8);
  EXPECT_EQ(m.cached_blocks(), 2);  // released but still findable
  BlockPool::Prefix again = m.MatchPrefix(prompt, 9);
  EXPECT_EQ(again.tokens, 8);
  for (int32_t b : again.blocks) m.Release(b);
}

TEST(BlockPoolTest, WithoutPrefixCachingNothingIsShared) {
  BlockPool m(4, 2, /*prefix_caching=*/false);
  std::vector<int32_t> table = {*m.Allocate(), *m.Allocate()};
  SealAll(m, table, Range(1, 4));
  EXPECT_EQ(m.cached_blocks(), 0);
  EXPECT_THAT(m.MatchPrefix(Range(1, 4), 4).blocks, IsEmpty());
}

TEST(BlockPoolTest, CachedBlocksAreEvictedLeastRecentlyUsedFirst) {
  BlockPool m(3, 2, /*prefix_caching=*/true);
  // Three one-block prompts, cached and released in the order a, b, c.
  std::vector<std::vector<int64_t>> prompts = {{1, 2}, {3, 4}, {5, 6}};
  std::vector<int32_t> blocks;
  for (const auto& p : prompts) {
    blocks.push_back(*m.Allocate());
    SealAll(m, {blocks.back()}, p);
  }
  for (int32_t b : blocks) m.Release(b);
  // Touch a: b is now the least recently used.
  BlockPool::Prefix a = m.MatchPrefix(prompts[0], 2);
  ASSERT_EQ(a.tokens, 2);
  m.Release(a.blocks[0]);
  EXPECT_EQ(m.Allocate(), std::optional<int32_t>(blocks[1]));  // b evicted
  EXPECT_THAT(m.MatchPrefix(prompts[1], 2).blocks, IsEmpty());
  EXPECT_EQ(m.Allocate(), std::optional<int32_t>(blocks[2]));  // then c
  EXPECT_EQ(m.Allocate(), std::optional<int32_t>(blocks[0]));  // then a
  EXPECT_EQ(m.cached_blocks(), 0);
  EXPECT_FALSE(m.Allocate().has_value());
}

TEST(BlockPoolTest, AHeldCachedBlockIsNeverEvicted) {
  BlockPool m(2, 2, /*prefix_caching=*/true);
  const int32_t held = *m.Allocate();
  SealAll(m, {held}, {1, 2});
  const int32_t other = *m.Allocate();
  m.Release(other);
  EXPECT_EQ(m.Allocate(), std::optional<int32_t>(other));
  EXPECT_FALSE(m.Allocate().has_value());  // `held` stays
  EXPECT_EQ(m.MatchPrefix(std::vector<int64_t>{1, 2, 3}, 2).tokens, 2);
}

// Many sequences start (reusing prefixes), grow, are preempted or finish in
// a random order; at every point the counts agree, and at the end every
// block is free again.
TEST(BlockPoolTest, ARandomizedRunNeverLeaksABlock) {
  std::mt19937_64 rng(42);
  for (bool caching : {false, true}) {
    BlockPool m(64, 4, caching);
    struct Seq {
      std::vector<int64_t> ids;
      std::vector<int32_t> table;
      int64_t computed = 0;
    };
    std::map<int, Seq> live;
    int next = 0;
    // A few shared system prompts make prefix hits likely.
    const std::vector<std::vector<int64_t>> systems = {Range(0, 9), Range(50, 13), Range(7, 4)};
    for (int round = 0; round < 5000; ++round) {
      const int action = static_cast<int>(rng() % 4);
      if (action == 0 || live.empty()) {
        Seq s;
        s.ids = systems[rng() % systems.size()];
        const int64_t extra = static_cast<int64_t>(rng() % 10);
        for (int64_t i = 0; i < extra; ++i) s.ids.push_back(static_cast<int64_t>(rng() % 5));
        BlockPool::Prefix p = m.MatchPrefix(s.ids, static_cast<int64_t>(s.ids.size()) - 1);
        s.table = p.blocks;
        s.computed = p.tokens;
        ASSERT_LE(p.tokens, static_cast<int64_t>(s.ids.size()) - 1);
        const int64_t need =
            m.BlocksFor(static_cast<int64_t>(s.ids.size())) - static_cast<int64_t>(s.table.size());
        if (need > m.free_blocks()) {
          for (int32_t b : s.table) m.Release(b);
          continue;
        }
        for (int64_t i = 0; i < need; ++i) s.table.push_back(*m.Allocate());
        s.computed = static_cast<int64_t>(s.ids.size());
        SealAll(m, s.table, s.ids);
        live.emplace(next++, std::move(s));
      } else if (action == 1) {
        // Grow one sequence by a token.
        auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
        Seq& s = it->second;
        s.ids.push_back(static_cast<int64_t>(rng() % 5));
        if (m.BlocksFor(static_cast<int64_t>(s.ids.size())) >
            static_cast<int64_t>(s.table.size())) {
          std::optional<int32_t> b = m.Allocate();
          if (!b) {  // preempt it
            for (int32_t held : s.table) m.Release(held);
            live.erase(it);
            continue;
          }
          s.table.push_back(*b);
        }
        SealAll(m, s.table, s.ids);
      } else {
        auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
        for (int32_t b : it->second.table) m.Release(b);
        live.erase(it);
      }
      // Held blocks: each distinct block a sequence holds, once.
      std::map<int32_t, int> refs;
      for (const auto& [id, s] : live) {
        for (int32_t b : s.table) ++refs[b];
      }
      ASSERT_EQ(m.used_blocks(), static_cast<int64_t>(refs.size())) << "round " << round;
      for (const auto& [b, n] : refs) ASSERT_EQ(m.ref_count(b), n) << "block " << b;
    }
    for (auto& [id, s] : live) {
      for (int32_t b : s.table) m.Release(b);
    }
    EXPECT_EQ(m.free_blocks(), 64);
    EXPECT_EQ(m.used_blocks(), 0);
    if (caching) {
      EXPECT_GT(m.prefix_hit_tokens(), 0);
    }
  }
}

// The manager over a pool: a request joins on its cached prefix when its
// whole input fits, grows slot by slot, caches its full blocks, and frees
// them all at once.
TEST(KvCacheManagerTest, AdmitsOnACachedPrefixGrowsAndFrees) {
  KvCacheManager kv(6, 4, /*prefix_caching=*/true);
  const std::vector<int64_t> prompt = Range(10, 10);  // 2 full blocks and 2
  ASSERT_EQ(kv.Admit(1, prompt, /*first_tokens=*/100), std::optional<int64_t>(0));
  EXPECT_EQ(kv.block_table(1).size(), 3u);
  kv.CacheFullBlocks(1, prompt, 10);
  EXPECT_EQ(kv.pool().cached_blocks(), 2);
  // The same 8 tokens then others: the two blocks are shared, and only the
  // first chunk's block is allocated now (a chunk of 1 after the prefix).
  std::vector<int64_t> other = Range(10, 8);
  for (int64_t id : Range(500, 6)) other.push_back(id);
  ASSERT_EQ(kv.Admit(2, other, /*first_tokens=*/1), std::optional<int64_t>(8));
  EXPECT_EQ(kv.block_table(2).size(), 3u);
  EXPECT_EQ(kv.block_table(2)[0], kv.block_table(1)[0]);
  EXPECT_EQ(kv.used_blocks(), 4);
  EXPECT_TRUE(kv.AllocateSlots(2, 14));
  EXPECT_EQ(kv.block_table(2).size(), 4u);
  EXPECT_EQ(kv.free_blocks(), 1);
  EXPECT_FALSE(kv.AllocateSlots(2, 30));  // 8 blocks: nothing allocated
  EXPECT_EQ(kv.free_blocks(), 1);
  // A third request whose input needs more than is free waits (nullopt)
  // and holds nothing.
  EXPECT_EQ(kv.Admit(3, Range(900, 9), 9), std::nullopt);
  EXPECT_EQ(kv.free_blocks(), 1);
  kv.Free(1);
  kv.Free(2);
  EXPECT_EQ(kv.used_blocks(), 0);
  EXPECT_TRUE(kv.block_table(1).empty());
  kv.Free(7);  // unknown: nothing
}

TEST(KvCacheManagerTest, KvCacheBytesReadsBytesFractionsAndAuto) {
  using ::accel::test::StatusIs;
  EXPECT_EQ(*KvCacheBytes("4MiB", 1e9, 5), 4 << 20);
  EXPECT_EQ(*KvCacheBytes("0.25", 1000, 5), 250);
  EXPECT_EQ(*KvCacheBytes("auto", 1000, 300), 300);
  EXPECT_EQ(*KvCacheBytes("", 1000, 3000), 500);  // at most half of what is free
  EXPECT_THAT(KvCacheBytes("1.5", 1000, 5),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("(0, 1]")));
  EXPECT_THAT(
      KvCacheBytes("lots", 1000, 5),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("--kv_cache_memory=lots")));
}

}  // namespace
}  // namespace accel::engine
