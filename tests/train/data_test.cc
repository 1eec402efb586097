// Sharding, samplers and loaders against Accelerate's own test vectors
// (../shared/reference/accelerate-training.md §1), and the loader's
// end-of-data state that accumulation and gather_for_metrics rely on.
#include "train/data.h"

#include <mutex>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "tests/testing/multiprocess.h"
#include "tests/testing/status_matchers.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;
using Batches = std::vector<IndexBatch>;

Batches Range(int64_t n, int64_t bs, bool drop_last) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  return MakeBatches(order, bs, drop_last);
}

std::vector<Batches> Shards(int64_t n, int64_t bs, int p, bool split, bool even, bool drop) {
  std::vector<Batches> out;
  for (int r = 0; r < p; ++r) {
    auto shard = ShardBatches(Range(n, bs, drop), bs, drop, {p, r, split, even});
    EXPECT_THAT(shard, IsOk());
    out.push_back(shard.ok() ? *shard : Batches{});
    if (!split) {
      EXPECT_EQ(
          ShardedLength(static_cast<int64_t>(Range(n, bs, drop).size()), drop, {p, r, split, even}),
          static_cast<int64_t>(out.back().size()))
          << "n=" << n << " bs=" << bs << " rank " << r;
    }
  }
  return out;
}

struct ShardCase {
  int64_t n, bs;
  bool drop;
  Batches p0, p1;
};

// Table A: split=False, even=True.
TEST(BatchSamplerShard, NoSplitsEven) {
  const std::vector<ShardCase> cases = {
      {24,
       3,
       false,
       {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}},
       {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}}},
      {24,
       3,
       true,
       {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}},
       {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}}},
      {21,
       3,
       false,
       {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}},
       {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {0, 1, 2}}},
      {21, 3, true, {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}},
      {22,
       3,
       false,
       {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}},
       {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 0, 1}}},
      {22, 3, true, {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}},
      {20,
       3,
       false,
       {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 0}},
       {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {1, 2, 3}}},
      {20, 3, true, {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}},
      {2, 3, false, {{0, 1, 0}}, {{1, 0, 1}}},
      {2, 3, true, {}, {}},
  };
  for (const auto& c : cases) {
    auto s = Shards(c.n, c.bs, 2, false, true, c.drop);
    EXPECT_EQ(s[0], c.p0) << "n=" << c.n << " drop=" << c.drop;
    EXPECT_EQ(s[1], c.p1) << "n=" << c.n << " drop=" << c.drop;
  }
}

// Table B: split=True, even=True.
TEST(BatchSamplerShard, SplitsEven) {
  const std::vector<ShardCase> cases = {
      {24,
       4,
       false,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {22, 23}}},
      {24,
       4,
       true,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {22, 23}}},
      {22,
       4,
       false,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {0, 1}}},
      {22,
       4,
       true,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}},
      {21,
       4,
       false,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 0}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {1, 2}}},
      {21,
       4,
       true,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}},
      {2, 4, false, {{0, 1}}, {{0, 1}}},
      {2, 4, true, {}, {}},
  };
  for (const auto& c : cases) {
    auto s = Shards(c.n, c.bs, 2, true, true, c.drop);
    EXPECT_EQ(s[0], c.p0) << "n=" << c.n << " drop=" << c.drop;
    EXPECT_EQ(s[1], c.p1) << "n=" << c.n << " drop=" << c.drop;
  }
}

// Table C: split=False, even=False.
TEST(BatchSamplerShard, NoSplitsNoEven) {
  const std::vector<ShardCase> cases = {
      {24,
       3,
       false,
       {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}},
       {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}}},
      {24,
       3,
       true,
       {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}},
       {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}}},
      {21,
       3,
       false,
       {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}},
       {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}},
      {21, 3, true, {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}},
      {22,
       3,
       false,
       {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}},
       {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21}}},
      {22, 3, true, {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}},
      {20,
       3,
       false,
       {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19}},
       {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}},
      {20, 3, true, {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}},
      {2, 3, false, {{0, 1}}, {}},
      {2, 3, true, {}, {}},
  };
  for (const auto& c : cases) {
    auto s = Shards(c.n, c.bs, 2, false, false, c.drop);
    EXPECT_EQ(s[0], c.p0) << "n=" << c.n << " drop=" << c.drop;
    EXPECT_EQ(s[1], c.p1) << "n=" << c.n << " drop=" << c.drop;
  }
}

// Table D: split=True, even=False.
TEST(BatchSamplerShard, SplitsNoEven) {
  const std::vector<ShardCase> cases = {
      {24,
       4,
       false,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {22, 23}}},
      {24,
       4,
       true,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {22, 23}}},
      {22,
       4,
       false,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}},
      {22,
       4,
       true,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}},
      {21,
       4,
       false,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}},
      {21,
       4,
       true,
       {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}},
       {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}},
      {2, 4, false, {{0, 1}}, {}},
      {2, 4, true, {}, {}},
  };
  for (const auto& c : cases) {
    auto s = Shards(c.n, c.bs, 2, true, false, c.drop);
    EXPECT_EQ(s[0], c.p0) << "n=" << c.n << " drop=" << c.drop;
    EXPECT_EQ(s[1], c.p1) << "n=" << c.n << " drop=" << c.drop;
  }
  // Accelerate's quirk: split mode reports the sampler's length even when uneven.
  EXPECT_EQ(ShardedLength(6, false, {2, 1, true, false}), 6);
}

// Table E: dynamic batch sizes (no batch_size).
TEST(BatchSamplerShard, DynamicBatches) {
  const Batches five = {{0, 1, 2}, {3, 4}, {5, 6, 7, 8}, {9, 10, 11}, {12, 13}};
  const Batches four = {{0, 1, 2}, {3, 4}, {5, 6, 7, 8}, {9, 10, 11}};
  auto shard = [](const Batches& b, int p, int r, bool even, bool drop = false) {
    auto s = ShardBatches(b, std::nullopt, drop, {p, r, false, even});
    EXPECT_THAT(s, IsOk());
    return *s;
  };
  EXPECT_EQ(shard(five, 2, 0, false), Batches({{0, 1, 2}, {5, 6, 7, 8}, {12, 13}}));
  EXPECT_EQ(shard(five, 2, 1, false), Batches({{3, 4}, {9, 10, 11}}));
  EXPECT_EQ(ShardedLength(5, false, {2, 0, false, false}), 3);
  EXPECT_EQ(ShardedLength(5, false, {2, 1, false, false}), 2);
  EXPECT_EQ(shard(four, 2, 0, true), Batches({{0, 1, 2}, {5, 6, 7, 8}}));
  EXPECT_EQ(shard(four, 2, 1, true), Batches({{3, 4}, {9, 10, 11}}));
  EXPECT_EQ(shard(five, 2, 0, true), Batches({{0, 1, 2}, {5, 6, 7, 8}, {12, 13}}));
  EXPECT_EQ(shard(five, 2, 1, true), Batches({{3, 4}, {9, 10, 11}, {0, 1, 2}}));
  EXPECT_EQ(shard({{0, 1, 2}}, 2, 0, true), Batches({{0, 1, 2}}));
  EXPECT_EQ(shard({{0, 1, 2}}, 2, 1, true), Batches({{0, 1, 2}}));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(shard({{0, 1, 2}}, 3, r, true), Batches({{0, 1, 2}}));
  EXPECT_EQ(shard(five, 2, 0, true, true), Batches({{0, 1, 2}, {5, 6, 7, 8}}));
  EXPECT_EQ(shard(five, 2, 1, true, true), Batches({{3, 4}, {9, 10, 11}}));
  const Batches six = {{0}, {1, 2}, {3, 4, 5}, {6}, {7, 8}, {9, 10, 11}};
  EXPECT_EQ(shard(six, 3, 0, true), Batches({{0}, {6}}));
  EXPECT_EQ(shard(six, 3, 1, true), Batches({{1, 2}, {7, 8}}));
  EXPECT_EQ(shard(six, 3, 2, true), Batches({{3, 4, 5}, {9, 10, 11}}));
  Batches seven = six;
  seven.push_back({12, 13});
  EXPECT_EQ(shard(seven, 3, 0, true), Batches({{0}, {6}, {12, 13}}));
  EXPECT_EQ(shard(seven, 3, 1, true), Batches({{1, 2}, {7, 8}, {0}}));
  EXPECT_EQ(shard(seven, 3, 2, true), Batches({{3, 4, 5}, {9, 10, 11}, {1, 2}}));
}

// Table F [derived]: P = 3 and 4.
TEST(BatchSamplerShard, ThreeAndFourProcesses) {
  auto s = Shards(10, 2, 3, false, true, false);
  EXPECT_EQ(s, std::vector<Batches>({{{0, 1}, {6, 7}}, {{2, 3}, {8, 9}}, {{4, 5}, {0, 1}}}));
  s = Shards(10, 2, 3, false, false, false);
  EXPECT_EQ(s, std::vector<Batches>({{{0, 1}, {6, 7}}, {{2, 3}, {8, 9}}, {{4, 5}}}));
  s = Shards(10, 2, 3, false, true, true);
  EXPECT_EQ(s, std::vector<Batches>({{{0, 1}}, {{2, 3}}, {{4, 5}}}));
  s = Shards(11, 3, 3, false, true, false);
  EXPECT_EQ(s, std::vector<Batches>(
                   {{{0, 1, 2}, {9, 10, 0}}, {{3, 4, 5}, {1, 2, 3}}, {{6, 7, 8}, {4, 5, 6}}}));
  s = Shards(11, 3, 3, false, false, false);
  EXPECT_EQ(s, std::vector<Batches>({{{0, 1, 2}, {9, 10}}, {{3, 4, 5}}, {{6, 7, 8}}}));
  s = Shards(12, 6, 3, true, true, false);
  EXPECT_EQ(s, std::vector<Batches>({{{0, 1}, {6, 7}}, {{2, 3}, {8, 9}}, {{4, 5}, {10, 11}}}));
  s = Shards(13, 6, 3, true, true, false);
  EXPECT_EQ(s,
            std::vector<Batches>(
                {{{0, 1}, {6, 7}, {12, 0}}, {{2, 3}, {8, 9}, {1, 2}}, {{4, 5}, {10, 11}, {3, 4}}}));
  s = Shards(13, 6, 3, true, false, false);
  EXPECT_EQ(s,
            std::vector<Batches>({{{0, 1}, {6, 7}, {12}}, {{2, 3}, {8, 9}}, {{4, 5}, {10, 11}}}));
  // The quirk: every rank reports 3 though ranks 1 and 2 yield 2.
  for (int r = 0; r < 3; ++r) EXPECT_EQ(ShardedLength(3, false, {3, r, true, false}), 3);
  s = Shards(13, 6, 3, true, true, true);
  EXPECT_EQ(s, std::vector<Batches>({{{0, 1}, {6, 7}}, {{2, 3}, {8, 9}}, {{4, 5}, {10, 11}}}));
  s = Shards(5, 4, 4, false, true, false);
  EXPECT_EQ(s,
            std::vector<Batches>({{{0, 1, 2, 3}}, {{4, 0, 1, 2}}, {{3, 4, 0, 1}}, {{2, 3, 4, 0}}}));
  s = Shards(1, 1, 3, false, true, false);
  EXPECT_EQ(s, std::vector<Batches>({{{0}}, {{0}}, {{0}}}));
}

TEST(BatchSamplerShard, ErrorsAsAccelerateRaises) {
  EXPECT_THAT(ShardBatches({{0, 1, 2, 3}, {4, 5, 6, 7}}, std::nullopt, false, {2, 0, true, true}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("split_batches")));
  EXPECT_THAT(ShardBatches(Range(20, 3, false), 3, false, {2, 0, true, true}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("round multiple")));
  EXPECT_THAT(ShardBatches(Range(4, 2, false), 2, false, {2, 2, false, true}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("process_index")));
  EXPECT_THAT(ShardBatches(Range(4, 2, false), 2, false, {0, 0, false, true}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_processes")));
}

TEST(IterableDatasetShard, DerivedVectors) {
  struct Case {
    int64_t n, bs;
    int p;
    bool split, drop;
    std::vector<std::vector<int64_t>> ranks;
  };
  const std::vector<Case> cases = {
      {10, 4, 2, false, false, {{0, 1, 2, 3, 8, 9, 0, 1}, {4, 5, 6, 7, 2, 3, 4, 5}}},
      {10, 4, 2, false, true, {{0, 1, 2, 3}, {4, 5, 6, 7}}},
      {10, 4, 2, true, false, {{0, 1, 4, 5, 8, 9}, {2, 3, 6, 7, 0, 1}}},
      {10, 4, 2, true, true, {{0, 1, 4, 5}, {2, 3, 6, 7}}},
      {3, 4, 2, false, false, {{0, 1, 2, 0}, {1, 2, 0, 1}}},
      {3, 4, 2, true, false, {{0, 1}, {2, 0}}},
      {7, 2, 3, false, false, {{0, 1, 6, 0}, {2, 3, 1, 2}, {4, 5, 3, 4}}},
      {7, 3, 3, true, false, {{0, 3, 6}, {1, 4, 0}, {2, 5, 1}}},
  };
  for (const auto& c : cases) {
    for (int r = 0; r < c.p; ++r) {
      auto got = ShardIterable(c.n, c.bs, c.drop, {c.p, r, c.split, true});
      ASSERT_THAT(got, IsOk());
      EXPECT_EQ(*got, c.ranks[static_cast<size_t>(r)]) << "n=" << c.n << " rank " << r;
    }
  }
  // __len__: ceil (floor with drop_last) of n / (bs * P) real batches, times bs.
  EXPECT_EQ(IterableShardLength(10, 4, false, {2, 0, false, true}), 8);
  EXPECT_EQ(IterableShardLength(10, 4, true, {2, 1, false, true}), 4);
  EXPECT_EQ(IterableShardLength(10, 4, false, {2, 0, true, true}), 8);  // quirk: yields 6
  EXPECT_EQ(IterableShardLength(10, 4, true, {2, 0, true, true}), 4);
  EXPECT_EQ(IterableShardLength(7, 2, false, {3, 2, false, true}), 4);
  EXPECT_THAT(ShardIterable(10, 3, false, {2, 0, true, true}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("round multiple")));
}

TEST(SeedableSampler, MatchesTorchRandperm) {
  // torch.randperm(n, generator=torch.Generator().manual_seed(seed)) in torch 1.13.
  EXPECT_EQ(RandomPermutation(10, 42), std::vector<int64_t>({2, 6, 1, 8, 4, 5, 0, 9, 3, 7}));
  EXPECT_EQ(RandomPermutation(10, 43), std::vector<int64_t>({8, 4, 9, 0, 5, 1, 6, 7, 2, 3}));
  EXPECT_EQ(RandomPermutation(10, 0), std::vector<int64_t>({4, 1, 7, 5, 3, 9, 0, 8, 6, 2}));
  auto hundred = RandomPermutation(100, 42);
  EXPECT_EQ(std::vector<int64_t>(hundred.begin(), hundred.begin() + 10),
            std::vector<int64_t>({42, 96, 62, 98, 46, 95, 60, 24, 78, 16}));
}

TEST(SkipBatchSampler, SkipsTheFirstBatches) {
  EXPECT_EQ(SkipBatches(Range(16, 4, false), 2), Batches({{8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_TRUE(SkipBatches(Range(16, 4, false), 9).empty());
}

// A group of `size` ranks seen from rank `rank`, for loaders without
// dispatch_batches: only the rank and the size are used.
class FakeGroup : public ProcessGroup {
 public:
  FakeGroup(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& backend() const override { return name_; }
  absl::Status AllReduce(std::vector<at::Tensor>&, ReduceOp) override { return Fake(); }
  absl::StatusOr<std::unique_ptr<PendingWork>> AllReduceAsync(std::vector<at::Tensor>&,
                                                              ReduceOp) override {
    return Fake();
  }
  absl::StatusOr<at::Tensor> AllGather(const at::Tensor&) override { return Fake(); }
  absl::StatusOr<std::unique_ptr<PendingWork>> AllGatherIntoAsync(const at::Tensor&,
                                                                  at::Tensor) override {
    return Fake();
  }
  absl::StatusOr<std::unique_ptr<PendingWork>> ReduceScatterAsync(at::Tensor, at::Tensor) override {
    return Fake();
  }
  absl::Status Broadcast(at::Tensor&, int) override { return Fake(); }
  absl::Status Barrier() override { return Fake(); }
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(absl::string_view) override {
    return Fake();
  }
  absl::StatusOr<std::string> BroadcastBytes(absl::string_view, int) override { return Fake(); }
  absl::StatusOr<std::unique_ptr<PendingWork>> SendAsync(const at::Tensor&, int) override {
    return Fake();
  }
  absl::StatusOr<std::unique_ptr<PendingWork>> RecvAsync(const at::Tensor&, int) override {
    return Fake();
  }
  absl::StatusOr<std::unique_ptr<dist::ProcessGroup>> NewGroup(const std::vector<int>&) override {
    return Fake();
  }

 private:
  static absl::Status Fake() { return absl::UnimplementedError("FakeGroup has no collectives"); }
  int rank_, size_;
  std::string name_ = "fake";
};

DataLoaderOptions Options(int64_t batch_size) {
  DataLoaderOptions o;
  o.batch_size = batch_size;
  return o;
}

std::shared_ptr<TensorDataset> Numbers(int64_t n) {
  auto ds = TensorDataset::Create({{"x", at::arange(n, at::kLong)}});
  EXPECT_THAT(ds, IsOk());
  return *ds;
}

// Every batch of one pass, as index lists (the "x" column is the index).
std::vector<std::vector<int64_t>> Pass(DataLoader& loader, std::vector<bool>* ends = nullptr) {
  std::vector<std::vector<int64_t>> out;
  EXPECT_THAT(loader.Start(), IsOk());
  while (true) {
    auto b = loader.Next();
    EXPECT_THAT(b, IsOk());
    if (!b.ok() || !*b) break;
    at::Tensor x = (**b).at("x");
    out.emplace_back(x.data_ptr<int64_t>(), x.data_ptr<int64_t>() + x.numel());
    if (ends != nullptr) ends->push_back(loader.progress().end_of_dataloader);
  }
  return out;
}

TEST(DataLoaderShard, SeedablePipelineMatchesAccelerate) {
  // [derived] data_seed 42, batch 2, P=2, drop_last False, even True.
  struct Case {
    int64_t n;
    int64_t epoch;
    Batches p0, p1;
  };
  const std::vector<Case> cases = {
      {10, 0, {{2, 6}, {4, 5}, {3, 7}}, {{1, 8}, {0, 9}, {2, 6}}},
      {10, 1, {{8, 4}, {5, 1}, {2, 3}}, {{9, 0}, {6, 7}, {8, 4}}},
      {7, 0, {{1, 6}, {4, 0}}, {{3, 5}, {2, 1}}},
      {7, 1, {{3, 1}, {5, 0}}, {{2, 4}, {6, 3}}},
  };
  for (const auto& c : cases) {
    DataLoaderOptions o;
    o.batch_size = 2;
    o.shuffle = true;
    auto base = DataLoader::Create(Numbers(c.n), o);
    ASSERT_THAT(base, IsOk());
    for (int r = 0; r < 2; ++r) {
      FakeGroup group(r, 2);
      PrepareOptions prepare;
      prepare.data_seed = 42;
      auto loader = DataLoader::Prepare(**base, group, nullptr, prepare);
      ASSERT_THAT(loader, IsOk());
      (*loader)->set_epoch(c.epoch);
      EXPECT_EQ(Pass(**loader), r == 0 ? c.p0 : c.p1) << "n=" << c.n << " epoch " << c.epoch;
      EXPECT_EQ((*loader)->epoch(), c.epoch + 1);  // a full pass moves to the next epoch
    }
  }
}

TEST(DataLoaderShard, EndOfDataloaderOnTheLastBatchOfEveryPass) {
  // Upstream: DataLoaderShard(range(16), batch_size=4): end_of_dataloader exactly at idx 3.
  DataLoaderOptions o;
  o.batch_size = 4;
  auto loader = DataLoader::Create(Numbers(16), o);
  ASSERT_THAT(loader, IsOk());
  ActiveLoaders active;
  auto prepared = DataLoader::Prepare(**loader, *ProcessGroup::Single(), &active, {});
  ASSERT_THAT(prepared, IsOk());
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<bool> ends;
    EXPECT_EQ(Pass(**prepared, &ends).size(), 4u);
    EXPECT_EQ(ends, std::vector<bool>({false, false, false, true}));
    EXPECT_EQ(active.active(), nullptr);  // the pass ended: the loader left the stack
  }
  // While iterating, the loader is the active one; a nested loader takes over and gives back.
  ASSERT_THAT((*prepared)->Start(), IsOk());
  EXPECT_EQ(active.active(), &(*prepared)->progress());
  {
    auto inner = DataLoader::Prepare(**loader, *ProcessGroup::Single(), &active, {});
    ASSERT_THAT((*inner)->Start(), IsOk());
    EXPECT_EQ(active.active(), &(*inner)->progress());
  }  // destroyed mid-pass
  EXPECT_EQ(active.active(), &(*prepared)->progress());
}

TEST(DataLoaderShard, AnAbandonedPassKeepsItsEpoch) {
  // Breaking out of a pass does not finish it: the epoch (and so the
  // shuffle) stays, and the loader leaves the stack when restarted or destroyed.
  DataLoaderOptions o = Options(2);
  o.shuffle = true;
  o.seed = 3;
  auto loader = DataLoader::Create(Numbers(6), o);
  ASSERT_THAT(loader, IsOk());
  ActiveLoaders active;
  auto prepared = DataLoader::Prepare(**loader, *ProcessGroup::Single(), &active, {});
  ASSERT_THAT(prepared, IsOk());
  ASSERT_THAT((*prepared)->Start(), IsOk());
  auto first = (*prepared)->Next();
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ((*prepared)->epoch(), 0);
  auto whole = Pass(**prepared);  // Start again: one registration, the same epoch
  ASSERT_EQ(whole.size(), 3u);
  EXPECT_TRUE(at::equal((**first).at("x"), at::tensor(whole[0], at::kLong)));
  std::vector<int64_t> flat;
  for (const auto& b : whole) flat.insert(flat.end(), b.begin(), b.end());
  EXPECT_EQ(flat, RandomPermutation(6, 3));
  EXPECT_EQ((*prepared)->epoch(), 1);
  EXPECT_EQ(active.active(), nullptr);
  // The next epoch is seed + 1.
  flat.clear();
  for (const auto& b : Pass(**prepared)) flat.insert(flat.end(), b.begin(), b.end());
  EXPECT_EQ(flat, RandomPermutation(6, 4));
}

TEST(DataLoaderShard, SkipFirstBatchesKeepsTheEpoch) {
  DataLoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.seed = 5;
  auto loader = DataLoader::Create(Numbers(16), o);
  ASSERT_THAT(loader, IsOk());
  (*loader)->set_epoch(1);
  auto full = Pass(**loader);
  (*loader)->set_epoch(1);
  auto skipping = (*loader)->SkipFirstBatches(2);
  EXPECT_EQ(skipping->epoch(), 1);
  EXPECT_EQ(skipping->size(), 2);  // SkipBatchSampler.__len__
  // A pass abandoned midway skips again when restarted.
  ASSERT_THAT(skipping->Start(), IsOk());
  EXPECT_THAT(skipping->Next(), IsOk());
  EXPECT_EQ(Pass(*skipping), std::vector<std::vector<int64_t>>(full.begin() + 2, full.end()));
  EXPECT_EQ(skipping->epoch(), 2);
  // Only the first complete pass skips.
  EXPECT_EQ(skipping->size(), 4);
  EXPECT_EQ(Pass(*skipping).size(), 4u);
  // Unshuffled: upstream's skip_first_batches(DataLoader(range(16), bs=4), 2).
  DataLoaderOptions plain;
  plain.batch_size = 4;
  auto ordered = DataLoader::Create(Numbers(16), plain);
  EXPECT_EQ(Pass(*(*ordered)->SkipFirstBatches(2)),
            std::vector<std::vector<int64_t>>({{8, 9, 10, 11}, {12, 13, 14, 15}}));
}

// save_state / load_state: the position is the epoch and the batches handed
// out; a restored position makes the passes of its epoch skip what was used.
TEST(DataLoaderShard, PositionIsSavedAndRestored) {
  DataLoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.seed = 5;
  auto base = DataLoader::Create(Numbers(16), o);
  ASSERT_THAT(base, IsOk());
  auto prepare = [&] {
    auto loader = DataLoader::Prepare(**base, *ProcessGroup::Single(), nullptr, {});
    EXPECT_THAT(loader, IsOk());
    return *std::move(loader);
  };
  auto saved = prepare();
  saved->set_epoch(1);
  const auto epoch1 = Pass(*saved);
  const auto epoch2 = Pass(*saved);
  saved->set_epoch(1);
  EXPECT_EQ(saved->position().epoch, 1);
  EXPECT_EQ(saved->position().batches_yielded, 0);
  ASSERT_THAT(saved->Start(), IsOk());
  ASSERT_THAT(saved->Next(), IsOk());
  ASSERT_THAT(saved->Next(), IsOk());
  const LoaderPosition at = saved->position();
  EXPECT_EQ(at.epoch, 1);
  EXPECT_EQ(at.batches_yielded, 2);

  // A fresh loader (a new process) restored there continues the epoch, then
  // runs whole epochs again.
  auto resumed = prepare();
  resumed->cursor()->Restore(at);
  EXPECT_EQ(resumed->epoch(), 1);
  EXPECT_EQ(resumed->size(), 2);
  // A pass abandoned midway skips again when restarted.
  ASSERT_THAT(resumed->Start(), IsOk());
  EXPECT_EQ(resumed->position().batches_yielded, 2);
  ASSERT_THAT(resumed->Next(), IsOk());
  EXPECT_EQ(resumed->position().batches_yielded, 3);
  EXPECT_EQ(Pass(*resumed), std::vector<std::vector<int64_t>>(epoch1.begin() + 2, epoch1.end()));
  EXPECT_EQ(resumed->position().epoch, 2);
  EXPECT_EQ(resumed->position().batches_yielded, 0);
  EXPECT_EQ(resumed->size(), 4);
  EXPECT_EQ(Pass(*resumed), epoch2);

  // The position belongs to its epoch: another epoch is not skipped.
  auto moved = prepare();
  moved->cursor()->Restore(at);
  moved->set_epoch(2);
  EXPECT_EQ(Pass(*moved), epoch2);
  moved->set_epoch(1);
  EXPECT_EQ(Pass(*moved), epoch1);

  // Resuming by hand (set_epoch + SkipFirstBatches) still works after a
  // restore: the explicit count wins, and the loader it came from moves on
  // with it to the next epoch, unskipped.
  auto by_hand = prepare();
  by_hand->cursor()->Restore(at);
  auto skipping = by_hand->SkipFirstBatches(3);
  EXPECT_EQ(Pass(*skipping), std::vector<std::vector<int64_t>>(epoch1.begin() + 3, epoch1.end()));
  EXPECT_EQ(by_hand->epoch(), 2);
  EXPECT_EQ(Pass(*by_hand), epoch2);
}

// use_seedable_sampler false: Accelerate's RandomSampler path as torch 1.13
// draws it.

// torch.empty((), dtype=torch.int64).random_(generator=g).item().
int64_t Draw(at::Generator* g = nullptr) {
  at::Tensor t = at::empty({}, at::kLong);
  if (g != nullptr) {
    t.random_(*g);
  } else {
    t.random_();
  }
  return t.item<int64_t>();
}

std::vector<int64_t> Flat(const std::vector<std::vector<int64_t>>& batches) {
  std::vector<int64_t> out;
  for (const auto& b : batches) out.insert(out.end(), b.begin(), b.end());
  return out;
}

at::Tensor GlobalRngState() {
  at::Generator g = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void SetGlobalRngState(const at::Tensor& state) {
  at::Generator g = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

TEST(RandomSamplerPath, OneProcessSeedsAFreshGeneratorEveryPass) {
  DataLoaderOptions o;
  o.batch_size = 3;
  o.shuffle = true;  // no seed: RandomSampler(generator=None)
  auto base = DataLoader::Create(Numbers(10), o);
  ASSERT_THAT(base, IsOk());
  PrepareOptions prepare;
  prepare.use_seedable_sampler = false;
  auto loader = DataLoader::Prepare(**base, *ProcessGroup::Single(), nullptr, prepare);
  ASSERT_THAT(loader, IsOk());
  EXPECT_THAT((*loader)->EpochBatches(), StatusIs(absl::StatusCode::kFailedPrecondition));
  at::manual_seed(21);
  const auto e0 = Flat(Pass(**loader));
  const auto e1 = Flat(Pass(**loader));
  // Each pass: the DataLoader's base seed, then the sampler's seed, both from
  // the global RNG; the order is randperm from a generator seeded with the second.
  at::manual_seed(21);
  Draw();
  const std::vector<int64_t> want0 = RandomPermutation(10, static_cast<uint64_t>(Draw()));
  Draw();
  const std::vector<int64_t> want1 = RandomPermutation(10, static_cast<uint64_t>(Draw()));
  EXPECT_EQ(e0, want0);
  EXPECT_EQ(e1, want1);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, RandomPermutation(10, 21));  // not the seedable sampler's
  // set_seed reproduces it; another seed does not.
  at::manual_seed(21);
  EXPECT_EQ(Flat(Pass(**loader)), e0);
  at::manual_seed(42);
  EXPECT_NE(Flat(Pass(**loader)), e0);
}

TEST(RandomSamplerPath, AGivenSeedIsTheSamplersOwnGenerator) {
  DataLoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.seed = 7;  // DataLoader(generator=torch.Generator().manual_seed(7))
  auto base = DataLoader::Create(Numbers(10), o);
  PrepareOptions prepare;
  prepare.use_seedable_sampler = false;
  auto loader = DataLoader::Prepare(**base, *ProcessGroup::Single(), nullptr, prepare);
  ASSERT_THAT(loader, IsOk());
  at::manual_seed(5);
  const at::Tensor global = GlobalRngState();
  const auto e0 = Flat(Pass(**loader));
  const auto e1 = Flat(Pass(**loader));
  // The base seed and both randperms (the second when the sampler is
  // exhausted) come from that generator; the global RNG is untouched.
  EXPECT_TRUE(at::equal(GlobalRngState(), global));
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(7);
  Draw(&g);
  auto perm = [&] {
    at::Tensor p = at::randperm(10, g, at::TensorOptions().dtype(at::kLong));
    return std::vector<int64_t>(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + 10);
  };
  const std::vector<int64_t> first = perm();
  perm();
  Draw(&g);
  const std::vector<int64_t> second = perm();
  EXPECT_EQ(e0, first);
  EXPECT_EQ(e1, second);
}

TEST(RandomSamplerPath, APassInProgressResumesWithItsOrder) {
  DataLoaderOptions o;
  o.batch_size = 2;
  o.shuffle = true;
  auto base = DataLoader::Create(Numbers(9), o);
  PrepareOptions prepare;
  prepare.use_seedable_sampler = false;
  auto prepare_loader = [&] {
    auto loader = DataLoader::Prepare(**base, *ProcessGroup::Single(), nullptr, prepare);
    EXPECT_THAT(loader, IsOk());
    return *std::move(loader);
  };
  at::manual_seed(3);
  auto straight = prepare_loader();
  Pass(*straight);
  ASSERT_THAT(straight->Start(), IsOk());
  ASSERT_THAT(straight->Next(), IsOk());
  ASSERT_THAT(straight->Next(), IsOk());
  const LoaderPosition at = straight->position();  // save_state
  const at::Tensor global = GlobalRngState();
  EXPECT_TRUE(at.pass_started);
  ASSERT_TRUE(at.generator_state.defined());
  std::vector<std::vector<int64_t>> tail;
  while (true) {
    auto b = straight->Next();
    ASSERT_THAT(b, IsOk());
    if (!*b) break;
    at::Tensor x = (**b).at("x");
    tail.emplace_back(x.data_ptr<int64_t>(), x.data_ptr<int64_t>() + x.numel());
  }
  EXPECT_EQ(tail.size(), 3u);
  const auto next_epoch = Pass(*straight);

  // A new process: other global RNG state until load_state restores it.
  at::manual_seed(999);
  auto resumed = prepare_loader();
  resumed->cursor()->Restore(at);
  SetGlobalRngState(global);
  EXPECT_EQ(Pass(*resumed), tail);
  EXPECT_EQ(Pass(*resumed), next_epoch);
}

TEST(DataLoaderShard, RemainderForGatherForMetrics) {
  // n=99, bs=16, P=2 (§1.6): gather concatenates the ranks' last batches in
  // rank order; the first `remainder` = 99 % 32 = 3 rows are [96, 97, 98].
  DataLoaderOptions o;
  o.batch_size = 16;
  auto base = DataLoader::Create(Numbers(99), o);
  ASSERT_THAT(base, IsOk());
  std::vector<int64_t> gathered_last;
  for (int r = 0; r < 2; ++r) {
    FakeGroup group(r, 2);
    ActiveLoaders active;
    auto loader = DataLoader::Prepare(**base, group, &active, {});
    ASSERT_THAT(loader, IsOk());
    EXPECT_EQ((*loader)->total_batch_size(), 32);
    EXPECT_EQ((*loader)->dataset_size(), 99);
    EXPECT_EQ((*loader)->size(), 4);  // 7 batches over 2 ranks, evened
    auto batches = (*loader)->EpochBatches();
    ASSERT_THAT(batches, IsOk());
    ASSERT_EQ(batches->size(), 4u);
    gathered_last.insert(gathered_last.end(), batches->back().begin(), batches->back().end());
    // What the loader yields is what EpochBatches says, and the progress on
    // the last batch is what gather_for_metrics reads.
    std::vector<bool> ends;
    EXPECT_EQ(Pass(**loader, &ends), *batches);
    EXPECT_EQ(ends, std::vector<bool>({false, false, false, true}));
    EXPECT_EQ((*loader)->progress().remainder, 3);
    EXPECT_TRUE((*loader)->progress().end_of_dataloader);
  }
  ASSERT_EQ(gathered_last.size(), 32u);
  EXPECT_EQ(std::vector<int64_t>(gathered_last.begin(), gathered_last.begin() + 3),
            std::vector<int64_t>({96, 97, 98}));

  // Single process: remainder = 99 % 16; drop_last: -1.
  ActiveLoaders active;
  auto single = DataLoader::Prepare(**base, *ProcessGroup::Single(), &active, {});
  ASSERT_THAT((*single)->Start(), IsOk());
  EXPECT_EQ((*single)->progress().remainder, 99 % 16);
  EXPECT_EQ((*single)->total_batch_size(), 16);
  DataLoaderOptions drop = o;
  drop.drop_last = true;
  auto dropped = DataLoader::Create(Numbers(99), drop);
  ASSERT_THAT((*dropped)->Start(), IsOk());
  EXPECT_EQ((*dropped)->progress().remainder, -1);
  // Split batches: total_batch_size is the batch size.
  PrepareOptions split;
  split.shard.split_batches = true;
  FakeGroup rank1(1, 2);
  auto split_loader = DataLoader::Prepare(**base, rank1, nullptr, split);
  ASSERT_THAT(split_loader, IsOk());
  EXPECT_EQ((*split_loader)->total_batch_size(), 16);
  EXPECT_EQ((*split_loader)->size(), 7);
  ASSERT_THAT((*split_loader)->Start(), IsOk());
  EXPECT_EQ((*split_loader)->progress().remainder, 99 % 16);
}

TEST(DataLoaderShard, PreparedLoaderShardsTheEpochsOrder) {
  // Prepare is BatchSamplerShard over the base loader's batches, for every
  // combination of split / even / drop_last.
  for (bool split : {false, true}) {
    for (bool even : {false, true}) {
      for (bool drop : {false, true}) {
        DataLoaderOptions o;
        o.batch_size = 4;
        o.drop_last = drop;
        auto base = DataLoader::Create(Numbers(22), o);
        ASSERT_THAT(base, IsOk());
        for (int r = 0; r < 2; ++r) {
          FakeGroup group(r, 2);
          PrepareOptions prepare;
          prepare.shard.split_batches = split;
          prepare.shard.even_batches = even;
          auto loader = DataLoader::Prepare(**base, group, nullptr, prepare);
          ASSERT_THAT(loader, IsOk());
          auto want = ShardBatches(Range(22, 4, drop), 4, drop, {2, r, split, even});
          ASSERT_THAT(want, IsOk());
          EXPECT_EQ(Pass(**loader), *want) << split << even << drop << " rank " << r;
          // skip_first_batches counts this rank's batches.
          EXPECT_EQ(Pass(*(*loader)->SkipFirstBatches(1)), SkipBatches(*want, 1));
          EXPECT_EQ((*loader)->size(), ShardedLength(drop ? 5 : 6, drop, {2, r, split, even}));
        }
      }
    }
  }
}

TEST(SeedableSampler, Reproducibility) {
  auto epochs = [](std::optional<uint64_t> seed, std::optional<uint64_t> data_seed, int p) {
    std::vector<std::vector<std::vector<int64_t>>> out;
    DataLoaderOptions o;
    o.batch_size = 2;
    o.shuffle = true;
    o.seed = seed;
    auto base = DataLoader::Create(Numbers(10), o);
    EXPECT_THAT(base, IsOk());
    for (int r = 0; r < p; ++r) {
      FakeGroup group(r, p);
      PrepareOptions prepare;
      prepare.data_seed = data_seed;
      auto loader = DataLoader::Prepare(**base, group, nullptr, prepare);
      EXPECT_THAT(loader, IsOk());
      (*loader)->set_epoch(0);
      for (int e = 0; e < 3; ++e) out.push_back(Pass(**loader));
      EXPECT_EQ((*loader)->epoch(), 3);
    }
    return out;
  };
  for (int p : {1, 2}) {
    // set_seed(21) twice: the same order; set_seed(42): another.
    EXPECT_EQ(epochs(21, std::nullopt, p), epochs(21, std::nullopt, p));
    EXPECT_NE(epochs(21, std::nullopt, p), epochs(42, std::nullopt, p));
    // data_seed wins over the seed; 42 and 43 differ.
    EXPECT_EQ(epochs(7, 42, p), epochs(8, 42, p));
    EXPECT_NE(epochs(7, 42, p), epochs(7, 43, p));
  }
  // The seed is initial_seed + epoch: epoch 1 of seed 42 is epoch 0 of seed 43.
  auto one = epochs(42, std::nullopt, 1);
  auto other = epochs(43, std::nullopt, 1);
  EXPECT_EQ(one[1], other[0]);
  std::vector<int64_t> flat;
  for (const auto& b : one[0]) flat.insert(flat.end(), b.begin(), b.end());
  EXPECT_EQ(flat, RandomPermutation(10, 42));
  // Unset seeds shuffle with 0.
  auto zero = epochs(std::nullopt, std::nullopt, 1);
  flat.clear();
  for (const auto& b : zero[0]) flat.insert(flat.end(), b.begin(), b.end());
  EXPECT_EQ(flat, std::vector<int64_t>({4, 1, 7, 5, 3, 9, 0, 8, 6, 2}));
}

// A dataset whose row `bad` cannot be read.
class BrokenDataset : public Dataset {
 public:
  explicit BrokenDataset(int64_t bad) : bad_(bad) {}
  int64_t size() const override { return 8; }
  absl::StatusOr<Example> Get(int64_t index) const override {
    if (index == bad_) return absl::DataLossError(absl::StrCat("row ", index, " is corrupt"));
    return Example{{"x", at::scalar_tensor(index, at::kLong)}};
  }

 private:
  int64_t bad_;
};

TEST(DataLoader, DatasetErrorsReachTheCaller) {
  DataLoaderOptions o;
  o.batch_size = 2;
  auto at_start = DataLoader::Create(std::make_shared<BrokenDataset>(1), o);
  EXPECT_THAT((*at_start)->Start(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("row 1")));
  auto later = DataLoader::Create(std::make_shared<BrokenDataset>(5), o);
  ASSERT_THAT((*later)->Start(), IsOk());
  // One batch ahead: the second Next reads batch 2, which holds row 5.
  EXPECT_THAT((*later)->Next(), IsOk());
  EXPECT_THAT((*later)->Next(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("row 5")));
}

TEST(DataLoader, UnpreparedLoader) {
  DataLoaderOptions o;
  o.batch_size = 3;
  auto loader = DataLoader::Create(Numbers(7), o);
  ASSERT_THAT(loader, IsOk());
  EXPECT_EQ((*loader)->size(), 3);
  EXPECT_EQ((*loader)->total_batch_size(), 3);
  EXPECT_EQ((*loader)->dataset_size(), 7);
  std::vector<bool> ends;
  EXPECT_EQ(Pass(**loader, &ends), std::vector<std::vector<int64_t>>({{0, 1, 2}, {3, 4, 5}, {6}}));
  EXPECT_EQ(ends, std::vector<bool>({false, false, true}));
  EXPECT_EQ((*loader)->epoch(), 1);
  EXPECT_EQ((*loader)->progress().remainder, 1);
  // Collate stacks each column along a new dimension 0.
  auto ds = TensorDataset::Create(
      {{"x", at::arange(12, at::kFloat).reshape({4, 3})}, {"y", at::arange(4, at::kLong)}});
  ASSERT_THAT(ds, IsOk());
  auto pairs = DataLoader::Create(*ds, Options(2));
  ASSERT_THAT((*pairs)->Start(), IsOk());
  auto first = (*pairs)->Next();
  ASSERT_THAT(first, IsOk());
  EXPECT_TRUE(at::equal((**first).at("x"), at::arange(6, at::kFloat).reshape({2, 3})));
  EXPECT_TRUE(at::equal((**first).at("y"), at::arange(2, at::kLong)));
  // An empty dataset: a pass with no batch.
  auto none = DataLoader::Create(Numbers(0), o);
  ASSERT_THAT(none, IsOk());
  EXPECT_TRUE(Pass(**none).empty());
  EXPECT_EQ((*none)->size(), 0);
}

TEST(DataLoader, BadInputNamesTheProblem) {
  EXPECT_THAT(TensorDataset::Create({{"a", at::zeros({3})}, {"b", at::zeros({4})}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"b\" has 4 rows")));
  EXPECT_THAT(TensorDataset::Create({{"s", at::zeros({})}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"s\"")));
  EXPECT_THAT(TensorDataset::Create({}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Numbers(3)->Get(3), StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("index 3")));
  EXPECT_THAT(Collate({{{"a", at::zeros({2})}}, {{"a", at::zeros({3})}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"a\" of example 1")));
  EXPECT_THAT(Collate({{{"a", at::zeros({2})}}, {{"b", at::zeros({2})}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no \"a\"")));
  EXPECT_THAT(Collate({}), StatusIs(absl::StatusCode::kInvalidArgument));
  DataLoaderOptions zero;
  zero.batch_size = 0;
  EXPECT_THAT(DataLoader::Create(Numbers(3), zero),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("batch_size")));
  DataLoaderOptions o;
  auto loader = DataLoader::Create(Numbers(3), o);
  EXPECT_THAT((*loader)->Next(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// dispatch_batches over two real ranks: rank 0 reads, broadcasts the global
// batch, and each rank keeps its slice (Accelerate's DataLoaderDispatcher, §1.5).
TEST(DataLoaderDispatcherWorker, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of DataLoaderDispatcher.TwoRanks";
  auto env = DetectProcessEnvironment(ProcessEnv());
  ASSERT_THAT(env, IsOk());
  auto group = ProcessGroup::Connect(*env, {});
  ASSERT_THAT(group, IsOk());
  const int rank = (*group)->rank();
  ASSERT_EQ((*group)->size(), 2);
  struct Case {
    std::string name;
    int64_t n, bs;
    bool drop, split, shuffle;
    int64_t size, remainder;
    Batches p0, p1;
  };
  const std::vector<Case> cases = {
      // Global batches [0..3] [4..7] [8]: the last gets the first P rows of
      // the first batch ([8, 0, 1]) and a slice of 1 each.
      {"n9", 9, 2, false, false, false, 3, 1, {{0, 1}, {4, 5}, {8}}, {{2, 3}, {6, 7}, {0}}},
      // [8, 9, 10] + [0, 1], slices of 2.
      {"n11",
       11,
       2,
       false,
       false,
       false,
       3,
       3,
       {{0, 1}, {4, 5}, {8, 9}},
       {{2, 3}, {6, 7}, {10, 0}}},
      // Divisible: no padding.
      {"n12",
       12,
       2,
       false,
       false,
       false,
       3,
       4,
       {{0, 1}, {4, 5}, {8, 9}},
       {{2, 3}, {6, 7}, {10, 11}}},
      // drop_last: 5 base batches, the incomplete group [8, 9] is dropped.
      {"drop", 10, 2, true, false, false, 2, 4, {{0, 1}, {4, 5}}, {{2, 3}, {6, 7}}},
      // split: one base batch per global batch, halves; the short last one [8, 9] too.
      {"split", 10, 4, false, true, false, 3, 2, {{0, 1}, {4, 5}, {8}}, {{2, 3}, {6, 7}, {9}}},
      // split, a last batch of one row: [8] + [0, 1], a row each (unpadded,
      // row 8 went to no rank).
      {"split_n9", 9, 4, false, true, false, 3, 1, {{0, 1}, {4, 5}, {8}}, {{2, 3}, {6, 7}, {0}}},
      // split, [8, 9, 10] + [0, 1]: two rows each (unpadded, row 10 was lost).
      {"split_n11",
       11,
       4,
       false,
       true,
       false,
       3,
       3,
       {{0, 1}, {4, 5}, {8, 9}},
       {{2, 3}, {6, 7}, {10, 0}}},
      // Not split, batch 4: global batches [0..7] and [8]; [8] + [0, 1].
      {"n9_bs4", 9, 4, false, false, false, 2, 1, {{0, 1, 2, 3}, {8}}, {{4, 5, 6, 7}, {0}}},
      // Seeded shuffle (seed 42): rank 0 reads 2 6 1 8 | 4 5 0 9 | 3 7.
      {"shuffle", 10, 2, false, false, true, 3, 2, {{2, 6}, {4, 5}, {3}}, {{1, 8}, {0, 9}, {7}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    DataLoaderOptions o;
    o.batch_size = c.bs;
    o.drop_last = c.drop;
    o.shuffle = c.shuffle;
    o.seed = 42;
    auto base = DataLoader::Create(Numbers(c.n), o);
    ASSERT_THAT(base, IsOk());
    ActiveLoaders active;
    PrepareOptions prepare;
    prepare.dispatch_batches = true;
    prepare.shard.split_batches = c.split;
    auto loader = DataLoader::Prepare(**base, **group, &active, prepare);
    ASSERT_THAT(loader, IsOk());
    EXPECT_EQ((*loader)->size(), c.size);
    for (int pass = 0; pass < 2 && !c.shuffle; ++pass) {
      std::vector<bool> ends;
      EXPECT_EQ(Pass(**loader, &ends), rank == 0 ? c.p0 : c.p1);
      std::vector<bool> want_ends(static_cast<size_t>(c.size), false);
      want_ends.back() = true;
      EXPECT_EQ(ends, want_ends);  // end_of_dataloader exactly on the last batch, every pass
      EXPECT_EQ((*loader)->progress().remainder, c.remainder);
      EXPECT_EQ(active.active(), nullptr);
    }
    if (c.shuffle) {
      EXPECT_EQ(Pass(**loader), rank == 0 ? c.p0 : c.p1);
    }
  }
  // skip_first_batches skips global batches; the padding of the last batch
  // then comes from the first batch this pass yields ([4, 5]).
  {
    auto base = DataLoader::Create(Numbers(9), Options(2));
    PrepareOptions prepare;
    prepare.dispatch_batches = true;
    auto loader = DataLoader::Prepare(**base, **group, nullptr, prepare);
    ASSERT_THAT(loader, IsOk());
    auto skipping = (*loader)->SkipFirstBatches(1);
    std::vector<bool> ends;
    EXPECT_EQ(Pass(*skipping, &ends), rank == 0 ? Batches({{4, 5}, {8}}) : Batches({{6, 7}, {4}}));
    EXPECT_EQ(ends, std::vector<bool>({false, true}));
    EXPECT_EQ(skipping->progress().remainder, 1);
  }
  // A row rank 0 cannot read fails the pass on both ranks (no rank waits for
  // a broadcast that never comes).
  auto broken = DataLoader::Create(std::make_shared<BrokenDataset>(5), Options(2));
  PrepareOptions prepare;
  prepare.dispatch_batches = true;
  auto loader = DataLoader::Prepare(**broken, **group, nullptr, prepare);
  ASSERT_THAT(loader, IsOk());
  ASSERT_THAT((*loader)->Start(), IsOk());
  EXPECT_THAT((*loader)->Next(),
              StatusIs(rank == 0 ? absl::StatusCode::kDataLoss : absl::StatusCode::kAborted,
                       HasSubstr("row 5 is corrupt")));
}

TEST(DataLoaderDispatcher, TwoRanks) {
  EXPECT_THAT(test::RunRanks(2, "DataLoaderDispatcherWorker.Run", {}, /*timeout_s=*/60),
              testing::Each(0));
}

// ---- Iterable datasets ----

// A stream of `n` examples {"x": i + 1000 * epoch}; `bad` makes element
// `bad` fail, `bad_reset` makes Reset fail.
class Stream : public IterableDataset {
 public:
  explicit Stream(int64_t n, bool sized = true) : n_(n), sized_(sized) {}
  absl::Status Reset(int64_t epoch) override {
    resets.push_back(epoch);
    if (bad_reset) return absl::UnavailableError("the stream's server is down");
    epoch_ = epoch;
    position_ = 0;
    return absl::OkStatus();
  }
  absl::StatusOr<std::optional<Example>> Next() override {
    if (position_ >= n_) return std::optional<Example>();
    if (position_ == bad) {
      return absl::DataLossError(absl::StrCat("element ", position_, " is corrupt"));
    }
    const int64_t value = position_++ + 1000 * epoch_;
    ++reads;
    return std::optional<Example>(Example{{"x", at::scalar_tensor(value, at::kLong)}});
  }
  std::optional<int64_t> size() const override {
    return sized_ ? std::optional<int64_t>(n_) : std::nullopt;
  }

  int64_t bad = -1;
  bool bad_reset = false;
  std::vector<int64_t> resets;
  int64_t reads = 0;

 private:
  int64_t n_;
  bool sized_;
  int64_t epoch_ = 0;
  int64_t position_ = 0;
};

TEST(IterableLoader, OneProcessBatchesTheStream) {
  DataLoaderOptions o = Options(3);
  auto stream = std::make_shared<Stream>(7);
  auto loader = DataLoader::Create(stream, o);
  ASSERT_THAT(loader, IsOk());
  EXPECT_TRUE((*loader)->is_iterable());
  EXPECT_EQ((*loader)->size(), 3);
  EXPECT_EQ((*loader)->dataset_size(), 7);
  std::vector<bool> ends;
  EXPECT_EQ(Pass(**loader, &ends), Batches({{0, 1, 2}, {3, 4, 5}, {6}}));
  EXPECT_EQ(ends, std::vector<bool>({false, false, true}));
  EXPECT_EQ((*loader)->epoch(), 1);
  // The next pass is epoch 1: Reset(1) restarts the stream.
  EXPECT_EQ(Pass(**loader), Batches({{1000, 1001, 1002}, {1003, 1004, 1005}, {1006}}));
  EXPECT_EQ(stream->resets, std::vector<int64_t>({0, 1}));
  // drop_last drops the short batch; an unsized stream has no size.
  o.drop_last = true;
  auto unsized = DataLoader::Create(std::make_shared<Stream>(7, /*sized=*/false), o);
  ASSERT_THAT(unsized, IsOk());
  EXPECT_EQ((*unsized)->size(), -1);
  EXPECT_EQ((*unsized)->dataset_size(), -1);
  ends.clear();
  EXPECT_EQ(Pass(**unsized, &ends), Batches({{0, 1, 2}, {3, 4, 5}}));
  EXPECT_EQ(ends, std::vector<bool>({false, true}));
  // Prepared for one process: the same batches (no padding), and an empty stream is an empty pass.
  FakeGroup one(0, 1);
  auto single = DataLoader::Prepare(**DataLoader::Create(std::make_shared<Stream>(7), Options(3)),
                                    one, nullptr, {});
  ASSERT_THAT(single, IsOk());
  EXPECT_EQ(Pass(**single), Batches({{0, 1, 2}, {3, 4, 5}, {6}}));
  auto empty = DataLoader::Create(std::make_shared<Stream>(0), Options(3));
  ASSERT_THAT(empty, IsOk());
  EXPECT_TRUE(Pass(**empty).empty());
  EXPECT_TRUE((*empty)->progress().end_of_dataloader);
}

TEST(IterableLoader, ShardsLikeIterableDatasetShard) {
  // Accelerate's vectors (ShardIterable above): every rank reads the stream
  // and keeps its slice of each group of bs * P (bs when split) as a batch;
  // the short final group is completed from the first one.
  struct Case {
    int64_t n, bs;
    int p;
    bool split, drop;
    int64_t remainder;  // the real examples of the final group
  };
  const std::vector<Case> cases = {
      {10, 4, 2, false, false, 2}, {10, 4, 2, false, true, -1}, {10, 4, 2, true, false, 2},
      {10, 4, 2, true, true, -1},  {3, 4, 2, false, false, 3},  {3, 4, 2, true, false, 3},
      {7, 2, 3, false, false, 1},  {7, 3, 3, true, false, 1},   {16, 4, 2, false, false, 0},
      {0, 2, 2, false, false, 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(
        absl::StrCat("n=", c.n, " bs=", c.bs, " P=", c.p, " split=", c.split, " drop=", c.drop));
    const int64_t per = c.split ? c.bs / c.p : c.bs;
    const int64_t group = c.split ? c.bs : c.bs * c.p;
    const int64_t want_batches = c.drop ? c.n / group : (c.n + group - 1) / group;
    std::vector<int64_t> gathered_last;
    for (int r = 0; r < c.p; ++r) {
      FakeGroup fake(r, c.p);
      ActiveLoaders active;
      DataLoaderOptions o = Options(c.bs);
      o.drop_last = c.drop;
      auto base = DataLoader::Create(std::make_shared<Stream>(c.n), o);
      ASSERT_THAT(base, IsOk());
      PrepareOptions prepare;
      prepare.shard.split_batches = c.split;
      auto loader = DataLoader::Prepare(**base, fake, &active, prepare);
      ASSERT_THAT(loader, IsOk());
      EXPECT_EQ((*loader)->size(), want_batches);
      std::vector<bool> ends;
      const Batches batches = Pass(**loader, &ends);
      auto want = ShardIterable(c.n, c.bs, c.drop, {c.p, r, c.split, true});
      ASSERT_THAT(want, IsOk());
      EXPECT_EQ(Flat(batches), *want) << "rank " << r;
      // Every rank the same number of full batches; the end seen on the last.
      ASSERT_EQ(static_cast<int64_t>(batches.size()), want_batches) << "rank " << r;
      for (const auto& b : batches) EXPECT_EQ(static_cast<int64_t>(b.size()), per);
      if (want_batches > 0) {
        std::vector<bool> want_ends(static_cast<size_t>(want_batches), false);
        want_ends.back() = true;
        EXPECT_EQ(ends, want_ends);
        gathered_last.insert(gathered_last.end(), batches.back().begin(), batches.back().end());
      }
      EXPECT_EQ((*loader)->progress().remainder, c.remainder);
      EXPECT_EQ(active.active(), nullptr);
    }
    // gather_for_metrics keeps the first `remainder` rows of the gathered
    // last batch: exactly the stream's tail, with no duplicate.
    if (c.remainder > 0) {
      const std::vector<int64_t> kept(gathered_last.begin(), gathered_last.begin() + c.remainder);
      std::vector<int64_t> tail;
      for (int64_t i = c.n - c.remainder; i < c.n; ++i) tail.push_back(i);
      EXPECT_EQ(kept, tail);
    }
  }
}

TEST(IterableLoader, SkipAndResumeReplayTheStream) {
  // P=2, bs=2: rank 0's batches are [0,1] [4,5] [8,9] [12,13] [16,17].
  FakeGroup rank0(0, 2);
  auto stream = std::make_shared<Stream>(20);
  auto base = DataLoader::Create(stream, Options(2));
  ASSERT_THAT(base, IsOk());
  auto loader = DataLoader::Prepare(**base, rank0, nullptr, {});
  ASSERT_THAT(loader, IsOk());
  auto skipping = (*loader)->SkipFirstBatches(2);
  EXPECT_EQ(skipping->size(), 3);
  EXPECT_EQ(Pass(*skipping), Batches({{8, 9}, {12, 13}, {16, 17}}));
  EXPECT_EQ((*loader)->epoch(), 1);  // the skipping loader moved the shared cursor
  // Epoch 1, two batches in, then "the process dies": its position says so.
  ASSERT_THAT((*loader)->Start(), IsOk());
  ASSERT_THAT((*loader)->Next(), IsOk());
  ASSERT_THAT((*loader)->Next(), IsOk());
  const LoaderPosition saved = (*loader)->position();
  EXPECT_EQ(saved.epoch, 1);
  EXPECT_EQ(saved.batches_yielded, 2);
  // A new run restores it: the stream is replayed from Reset(1) and the
  // first two batches are dropped.
  auto stream2 = std::make_shared<Stream>(20);
  auto resumed = DataLoader::Prepare(**DataLoader::Create(stream2, Options(2)), rank0, nullptr, {});
  ASSERT_THAT(resumed, IsOk());
  (*resumed)->cursor()->Restore(saved);
  EXPECT_EQ((*resumed)->size(), 3);
  EXPECT_EQ(Pass(**resumed), Batches({{1008, 1009}, {1012, 1013}, {1016, 1017}}));
  EXPECT_EQ(stream2->resets, std::vector<int64_t>({1}));
  EXPECT_EQ((*resumed)->epoch(), 2);
  EXPECT_EQ(Pass(**resumed).size(), 5u);  // the next epoch is whole again
  // Skipping past the end leaves an empty pass.
  auto past = (*loader)->SkipFirstBatches(9);
  EXPECT_TRUE(Pass(*past).empty());
}

TEST(IterableLoader, BadInputAndStreamErrorsNameTheProblem) {
  DataLoaderOptions o = Options(2);
  o.shuffle = true;
  EXPECT_THAT(DataLoader::Create(std::make_shared<Stream>(4), o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shuffle")));
  EXPECT_THAT(DataLoader::Create(std::shared_ptr<IterableDataset>(), Options(2)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no dataset")));
  DataLoaderOptions zero;
  zero.batch_size = 0;
  EXPECT_THAT(DataLoader::Create(std::make_shared<Stream>(4), zero),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("batch_size")));
  auto loader = DataLoader::Create(std::make_shared<Stream>(4), Options(2));
  ASSERT_THAT(loader, IsOk());
  EXPECT_THAT((*loader)->EpochBatches(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("IterableDataset")));
  FakeGroup rank0(0, 2);
  PrepareOptions split;
  split.shard.split_batches = true;
  EXPECT_THAT(DataLoader::Prepare(**DataLoader::Create(std::make_shared<Stream>(4), Options(3)),
                                  rank0, nullptr, split),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("round multiple")));
  // The stream's own errors reach the caller: Reset's at Start, Next's one batch ahead.
  auto broken_reset = std::make_shared<Stream>(4);
  broken_reset->bad_reset = true;
  EXPECT_THAT((*DataLoader::Create(broken_reset, Options(2)))->Start(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("IterableDataset::Reset")));
  auto broken = std::make_shared<Stream>(8);
  broken->bad = 5;
  auto reading = DataLoader::Prepare(**DataLoader::Create(broken, Options(2)), rank0, nullptr, {});
  ASSERT_THAT(reading, IsOk());
  ASSERT_THAT((*reading)->Start(), IsOk());  // group [0..3]
  EXPECT_THAT((*reading)->Next(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("element 5 is corrupt")));
}

TEST(DataLoaderPlacement, BatchesGoToThePreparedDeviceOrStay) {
  // The meta device stands for a GPU: a move there is observable on any libtorch.
  FakeGroup one(0, 1);
  for (bool iterable : {false, true}) {
    SCOPED_TRACE(iterable ? "iterable" : "map-style");
    auto make = [&] {
      return iterable ? DataLoader::Create(std::make_shared<Stream>(4), Options(2))
                      : DataLoader::Create(Numbers(4), Options(2));
    };
    PrepareOptions placed;
    placed.device = c10::Device(c10::kMeta);
    auto on_meta = DataLoader::Prepare(**make(), one, nullptr, placed);
    ASSERT_THAT(on_meta, IsOk());
    ASSERT_THAT((*on_meta)->Start(), IsOk());
    auto batch = (*on_meta)->Next();
    ASSERT_THAT(batch, IsOk());
    EXPECT_TRUE((**batch).at("x").is_meta());
    PrepareOptions unplaced;
    unplaced.device = std::nullopt;
    auto on_cpu = DataLoader::Prepare(**make(), one, nullptr, unplaced);
    ASSERT_THAT(on_cpu, IsOk());
    EXPECT_EQ(Pass(**on_cpu), Batches({{0, 1}, {2, 3}}));
  }
}

// dispatch_batches over a stream, on two real ranks: rank 0 alone reads (one
// group ahead, to know the last), and the batches are those of the
// map-style dispatcher over the same examples (DataLoaderDispatcherWorker).
TEST(IterableDispatcherWorker, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of IterableDispatcher.TwoRanks";
  auto env = DetectProcessEnvironment(ProcessEnv());
  ASSERT_THAT(env, IsOk());
  auto group = ProcessGroup::Connect(*env, {});
  ASSERT_THAT(group, IsOk());
  const int rank = (*group)->rank();
  ASSERT_EQ((*group)->size(), 2);
  struct Case {
    std::string name;
    int64_t n, bs;
    bool drop, split;
    int64_t size, remainder;
    Batches p0, p1;
  };
  const std::vector<Case> cases = {
      {"n9", 9, 2, false, false, 3, 1, {{0, 1}, {4, 5}, {8}}, {{2, 3}, {6, 7}, {0}}},
      {"n11", 11, 2, false, false, 3, 3, {{0, 1}, {4, 5}, {8, 9}}, {{2, 3}, {6, 7}, {10, 0}}},
      {"n12", 12, 2, false, false, 3, 4, {{0, 1}, {4, 5}, {8, 9}}, {{2, 3}, {6, 7}, {10, 11}}},
      {"drop", 10, 2, true, false, 2, 4, {{0, 1}, {4, 5}}, {{2, 3}, {6, 7}}},
      {"split", 10, 4, false, true, 3, 2, {{0, 1}, {4, 5}, {8}}, {{2, 3}, {6, 7}, {9}}},
      {"split_n9", 9, 4, false, true, 3, 1, {{0, 1}, {4, 5}, {8}}, {{2, 3}, {6, 7}, {0}}},
      {"n9_bs4", 9, 4, false, false, 2, 1, {{0, 1, 2, 3}, {8}}, {{4, 5, 6, 7}, {0}}},
      {"one_group", 4, 2, false, false, 1, 4, {{0, 1}}, {{2, 3}}},
      {"empty", 0, 2, false, false, 0, -1, {}, {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    DataLoaderOptions o = Options(c.bs);
    o.drop_last = c.drop;
    auto stream = std::make_shared<Stream>(c.n);
    auto base = DataLoader::Create(stream, o);
    ASSERT_THAT(base, IsOk());
    ActiveLoaders active;
    PrepareOptions prepare;
    prepare.dispatch_batches = true;
    prepare.shard.split_batches = c.split;
    auto loader = DataLoader::Prepare(**base, **group, &active, prepare);
    ASSERT_THAT(loader, IsOk());
    EXPECT_EQ((*loader)->size(), c.size);
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<bool> ends;
      const int64_t offset = 1000 * pass;  // the stream's epoch shows in its values
      Batches want = rank == 0 ? c.p0 : c.p1;
      for (auto& b : want) {
        for (auto& v : b) v += offset;
      }
      EXPECT_EQ(Pass(**loader, &ends), want);
      if (c.size > 0) {
        std::vector<bool> want_ends(static_cast<size_t>(c.size), false);
        want_ends.back() = true;
        EXPECT_EQ(ends, want_ends);
      }
      EXPECT_EQ((*loader)->progress().remainder, c.remainder);
      EXPECT_TRUE((*loader)->progress().end_of_dataloader);
      EXPECT_EQ(active.active(), nullptr);
    }
    // Only rank 0 reads the stream.
    EXPECT_EQ(stream->reads, rank == 0 ? 2 * c.n : 0);
  }
  // Skipping (resume) drops batches after dispatching them, as Accelerate's
  // skip_batches does for a dispatcher: the padding still comes from the
  // pass's first group ([0, 1]).
  {
    auto base = DataLoader::Create(std::make_shared<Stream>(9), Options(2));
    PrepareOptions prepare;
    prepare.dispatch_batches = true;
    auto loader = DataLoader::Prepare(**base, **group, nullptr, prepare);
    ASSERT_THAT(loader, IsOk());
    auto skipping = (*loader)->SkipFirstBatches(1);
    std::vector<bool> ends;
    EXPECT_EQ(Pass(*skipping, &ends), rank == 0 ? Batches({{4, 5}, {8}}) : Batches({{6, 7}, {0}}));
    EXPECT_EQ(ends, std::vector<bool>({false, true}));
    EXPECT_EQ(skipping->progress().remainder, 1);
  }
  // Rank 0's failures reach both ranks (no rank waits for a header that
  // never comes): Reset's at the first fetch, Next's mid-stream.
  {
    auto stream = std::make_shared<Stream>(6);
    stream->bad_reset = true;
    PrepareOptions prepare;
    prepare.dispatch_batches = true;
    auto loader =
        DataLoader::Prepare(**DataLoader::Create(stream, Options(2)), **group, nullptr, prepare);
    ASSERT_THAT(loader, IsOk());
    EXPECT_THAT((*loader)->Start(),
                StatusIs(rank == 0 ? absl::StatusCode::kUnavailable : absl::StatusCode::kAborted,
                         HasSubstr("server is down")));
  }
  {
    auto stream = std::make_shared<Stream>(20);
    stream->bad = 9;  // in the third group: read ahead while the first is handed out
    PrepareOptions prepare;
    prepare.dispatch_batches = true;
    auto loader =
        DataLoader::Prepare(**DataLoader::Create(stream, Options(2)), **group, nullptr, prepare);
    ASSERT_THAT(loader, IsOk());
    ASSERT_THAT((*loader)->Start(), IsOk());
    EXPECT_THAT((*loader)->Next(),
                StatusIs(rank == 0 ? absl::StatusCode::kDataLoss : absl::StatusCode::kAborted,
                         HasSubstr("element 9 is corrupt")));
  }
  ASSERT_THAT((*group)->Barrier(), IsOk());
}

TEST(IterableDispatcher, TwoRanks) {
  EXPECT_THAT(test::RunRanks(2, "IterableDispatcherWorker.Run", {}, /*timeout_s=*/60),
              testing::Each(0));
}

}  // namespace
}  // namespace accel::train
