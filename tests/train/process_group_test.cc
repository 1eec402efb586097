// The gloo process group and Accelerate's collectives, in real processes
// (test_ops.py's expectations: each rank's tensor is arange(P) + 1 + P * rank).
#include "train/process_group.h"

#include <string>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/multiprocess.h"
#include "tests/testing/status_matchers.h"
#include "train/collectives.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::Each;
using ::testing::HasSubstr;

std::unique_ptr<ProcessGroup> Connect(absl::Duration timeout = absl::Seconds(60)) {
  auto env = DetectProcessEnvironment(ProcessEnv());
  EXPECT_THAT(env, IsOk());
  ProcessGroupOptions options;
  options.timeout = timeout;
  auto group = ProcessGroup::Connect(*env, options);
  EXPECT_THAT(group, IsOk());
  return group.ok() ? *std::move(group) : nullptr;
}

TEST(CollectivesWorker, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of Collectives.*";
  auto group = Connect();
  ASSERT_NE(group, nullptr);
  const int p = group->size(), r = group->rank();
  const at::Tensor mine = at::arange(p, at::kFloat) + 1 + p * r;

  auto gathered = Gather(*group, mine);
  ASSERT_THAT(gathered, IsOk());
  EXPECT_TRUE(at::equal(*gathered, at::arange(1, p * p + 1, at::kFloat)));
  auto scalar = group->AllGather(at::tensor(static_cast<float>(r)));
  ASSERT_THAT(scalar, IsOk());
  EXPECT_TRUE(at::equal(*scalar, at::arange(p, at::kFloat)));

  auto broadcast = BroadcastFrom(*group, mine, 0);
  ASSERT_THAT(broadcast, IsOk());
  EXPECT_TRUE(at::equal(*broadcast, at::arange(1, p + 1, at::kFloat)));

  // Sum over ranks of arange(P) + 1 + P*r; mean = sum / P; max = the last rank's.
  at::Tensor sum = at::zeros({p});
  for (int k = 0; k < p; ++k) sum += at::arange(p, at::kFloat) + 1 + p * k;
  auto reduced = Reduce(*group, mine, Reduction::kSum);
  ASSERT_THAT(reduced, IsOk());
  EXPECT_TRUE(at::equal(*reduced, sum));
  if (p == 2) {
    EXPECT_TRUE(at::equal(*reduced, at::tensor({4.0f, 6.0f})));
  }
  auto mean = Reduce(*group, mine, Reduction::kMean);
  ASSERT_THAT(mean, IsOk());
  EXPECT_TRUE(at::allclose(*mean, sum / p));
  auto max = Reduce(*group, mine, Reduction::kMax);
  ASSERT_THAT(max, IsOk());
  EXPECT_TRUE(at::equal(*max, at::arange(p, at::kFloat) + 1 + p * (p - 1)));
  EXPECT_THAT(Reduce(*group, at::ones({2}, at::kLong), Reduction::kMean),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mean")));

  // pad_across_processes: rank 0 has P+1 elements, the others P.
  at::Tensor ragged = at::arange(r == 0 ? p + 1 : p, at::kFloat);
  auto padded = PadAcrossProcesses(*group, ragged);
  ASSERT_THAT(padded, IsOk());
  EXPECT_EQ(padded->size(0), p + 1);
  if (r != 0) {
    EXPECT_TRUE(at::equal(*padded, at::cat({at::arange(p, at::kFloat), at::zeros({1})})));
  }
  PadOptions first;
  first.pad_first = true;
  first.pad_index = -1;
  auto padded_first = PadAcrossProcesses(*group, ragged, first);
  ASSERT_THAT(padded_first, IsOk());
  if (r != 0) {
    EXPECT_EQ((*padded_first)[0].item<float>(), -1);
  }
  // Gathering unequal shapes is an error, not garbage.
  EXPECT_THAT(Gather(*group, ragged),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pad_across_processes")));

  // gather_object: byte strings of different lengths.
  auto objects = GatherObject(*group, std::string(static_cast<size_t>(r + 1), 'a' + r));
  ASSERT_THAT(objects, IsOk());
  ASSERT_EQ(objects->size(), static_cast<size_t>(p));
  for (int k = 0; k < p; ++k) {
    EXPECT_EQ((*objects)[k], std::string(static_cast<size_t>(k + 1), 'a' + k));
  }
  auto from_last = group->BroadcastBytes(r == p - 1 ? "last words" : "", p - 1);
  ASSERT_THAT(from_last, IsOk());
  EXPECT_EQ(*from_last, "last words");

  // Maps of tensors, and async all-reduce of mixed dtypes.
  TensorMap batch = {{"ids", at::full({2}, r, at::kLong)}, {"x", at::full({1, 3}, 1.0f + r)}};
  auto gathered_map = Gather(*group, batch);
  ASSERT_THAT(gathered_map, IsOk());
  EXPECT_EQ(gathered_map->at("ids").size(0), 2 * p);
  EXPECT_EQ(gathered_map->at("x").sizes(), at::IntArrayRef({p, 3}));
  std::vector<at::Tensor> mixed = {at::ones({3}, at::kDouble), at::full({2}, r, at::kInt)};
  auto work = group->AllReduceAsync(mixed, ReduceOp::kSum);
  ASSERT_THAT(work, IsOk());
  ASSERT_THAT((*work)->Wait(), IsOk());
  EXPECT_TRUE(at::equal(mixed[0], at::full({3}, p, at::kDouble)));
  EXPECT_TRUE(at::equal(mixed[1], at::full({2}, p * (p - 1) / 2, at::kInt)));
  std::vector<at::Tensor> mins = {at::tensor({static_cast<float>(r)})};
  ASSERT_THAT(group->AllReduce(mins, ReduceOp::kMin), IsOk());
  EXPECT_EQ(mins[0].item<float>(), 0);
  EXPECT_THAT(group->Broadcast(mins[0], p), StatusIs(absl::StatusCode::kInvalidArgument));
  // A non-contiguous tensor is reduced through a copy and written back.
  std::vector<at::Tensor> strided = {(at::arange(6, at::kFloat) * (r + 1)).view({2, 3}).t()};
  ASSERT_THAT(group->AllReduce(strided, ReduceOp::kSum), IsOk());
  EXPECT_TRUE(
      at::equal(strided[0], (at::arange(6, at::kFloat) * (p * (p + 1) / 2)).view({2, 3}).t()));

  // bfloat16 and bool, which gloo in libtorch 1.13 cannot move by itself.
  std::vector<at::Tensor> bf16 = {at::full({3}, 1.5 + r, at::kBFloat16),
                                  at::full({2}, -r, at::kBFloat16)};
  ASSERT_THAT(group->AllReduce(bf16, ReduceOp::kSum), IsOk());
  EXPECT_EQ(bf16[0].scalar_type(), at::kBFloat16);
  // 1.5 P + P (P - 1) / 2: 4 for P = 2, 7.5 for P = 3, exact in bfloat16.
  EXPECT_TRUE(at::equal(bf16[0], at::full({3}, 1.5 * p + p * (p - 1) / 2.0, at::kBFloat16)));
  EXPECT_TRUE(at::equal(bf16[1], at::full({2}, -p * (p - 1) / 2.0, at::kBFloat16)));
  std::vector<at::Tensor> bf16_max = {at::full({2}, 0.25 * r, at::kBFloat16)};
  auto bf16_work = group->AllReduceAsync(bf16_max, ReduceOp::kMax);
  ASSERT_THAT(bf16_work, IsOk());
  ASSERT_THAT((*bf16_work)->Wait(), IsOk());
  EXPECT_TRUE(at::equal(bf16_max[0], at::full({2}, 0.25 * (p - 1), at::kBFloat16)));
  at::Tensor bf16_root = at::full({2}, r == 0 ? 3.25 : 0.0, at::kBFloat16);
  ASSERT_THAT(group->Broadcast(bf16_root, 0), IsOk());
  EXPECT_TRUE(at::equal(bf16_root, at::full({2}, 3.25, at::kBFloat16)));
  auto bf16_all = group->AllGather(at::full({1}, r + 0.5, at::kBFloat16));
  ASSERT_THAT(bf16_all, IsOk());
  EXPECT_TRUE(at::equal(*bf16_all, (at::arange(p, at::kFloat) + 0.5).to(at::kBFloat16)));
  at::Tensor flags = at::full({2}, r == 0, at::kBool);
  ASSERT_THAT(group->Broadcast(flags, 0), IsOk());
  EXPECT_TRUE(flags.all().item<bool>());
  auto parity = group->AllGather(at::full({1}, r % 2 == 0, at::kBool));
  ASSERT_THAT(parity, IsOk());
  EXPECT_TRUE(at::equal(*parity, at::arange(p, at::kLong).remainder(2).eq(0)));
  ASSERT_THAT(group->Barrier(), IsOk());
}

// The nested forms and the refusals, which every rank must reach together.
TEST(CollectiveEdgesWorker, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of Collectives.Edges";
  auto group = Connect(absl::Seconds(30));
  ASSERT_NE(group, nullptr);
  const int p = group->size(), r = group->rank();
  // A batch: 2-d ids padded along dim 1 (and -1), a 1-d tensor that has no
  // dim 1 and stays as it is (Accelerate's rule), a 0-d one.
  TensorMap batch = {{"ids", at::full({2, r + 1}, r + 1, at::kLong)},
                     {"lengths", at::full({r + 1}, 5, at::kLong)},
                     {"loss", at::tensor(0.5f * r)}};
  PadOptions along1;
  along1.dim = 1;
  along1.pad_index = -7;
  auto padded = PadAcrossProcesses(*group, batch, along1);
  ASSERT_THAT(padded, IsOk());
  at::Tensor want_ids = at::full({2, p}, -7, at::kLong);
  want_ids.narrow(1, 0, r + 1).fill_(r + 1);
  EXPECT_TRUE(at::equal(padded->at("ids"), want_ids));
  EXPECT_TRUE(at::equal(padded->at("lengths"), batch.at("lengths")));
  EXPECT_TRUE(at::equal(padded->at("loss"), batch.at("loss")));
  PadOptions last_first;
  last_first.dim = -1;
  last_first.pad_first = true;
  auto padded_first = PadAcrossProcesses(*group, batch.at("ids"), last_first);
  ASSERT_THAT(padded_first, IsOk());
  at::Tensor want_first = at::zeros({2, p}, at::kLong);
  want_first.narrow(1, p - (r + 1), r + 1).fill_(r + 1);
  EXPECT_TRUE(at::equal(*padded_first, want_first));
  // Gathered after padding: rank order along dim 0; a 0-d entry counts as [1].
  padded->erase("lengths");
  auto gathered = Gather(*group, *padded);
  ASSERT_THAT(gathered, IsOk());
  EXPECT_EQ(gathered->at("ids").sizes(), at::IntArrayRef({2 * p, p}));
  EXPECT_TRUE(at::equal(gathered->at("ids").narrow(0, 2 * r, 2), want_ids));
  EXPECT_TRUE(at::equal(gathered->at("loss"), at::arange(p, at::kFloat) * 0.5));
  // Without padding, the ragged entry is refused on every rank, naming the key.
  TensorMap ragged = {{"ids", batch.at("ids")}};
  EXPECT_THAT(Gather(*group, ragged),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"ids\""), HasSubstr("differ in shape"))));
  // A different number of dims or dtype is refused too, not exchanged as garbage.
  EXPECT_THAT(Gather(*group, r == 0 ? at::zeros({2, 2}) : at::zeros({4})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("-d tensor")));
  EXPECT_THAT(
      Gather(*group, TensorList{at::ones({1}), r == 0 ? at::ones({1}) : at::ones({1}, at::kInt)}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("element 1"), HasSubstr("Float"), HasSubstr("Int"))));
  // Reduce and broadcast over a map.
  TensorMap values = {{"a", at::full({2}, 1.0 + r)}, {"b", at::full({1}, 2.0 * r, at::kDouble)}};
  auto means = Reduce(*group, values, Reduction::kMean);
  ASSERT_THAT(means, IsOk());
  EXPECT_TRUE(at::allclose(means->at("a"), at::full({2}, (p + 1) / 2.0)));
  EXPECT_TRUE(at::allclose(means->at("b"), at::full({1}, p - 1.0, at::kDouble)));
  EXPECT_TRUE(at::equal(values.at("a"), at::full({2}, 1.0 + r)));  // the input stays
  auto from_last = BroadcastFrom(*group, values, p - 1);
  ASSERT_THAT(from_last, IsOk());
  EXPECT_TRUE(at::equal(from_last->at("a"), at::full({2}, 1.0 * p)));
  auto int_sum = Reduce(*group, at::full({3}, r + 1, at::kInt), Reduction::kSum);
  ASSERT_THAT(int_sum, IsOk());
  EXPECT_TRUE(at::equal(*int_sum, at::full({3}, p * (p + 1) / 2, at::kInt)));
  // gather_object with empty and binary strings.
  std::string mine = r == 0 ? std::string() : std::string("\0x\xff", 3);
  auto objects = GatherObject(*group, mine);
  ASSERT_THAT(objects, IsOk());
  EXPECT_EQ((*objects)[0], "");
  EXPECT_EQ((*objects)[p - 1], std::string("\0x\xff", 3));
  ASSERT_THAT(group->Barrier(), IsOk());
}

TEST(Collectives, Edges) { EXPECT_THAT(test::RunRanks(2, "CollectiveEdgesWorker.Run"), Each(0)); }

TEST(Collectives, UndefinedTensorsAreRefused) {
  auto single = ProcessGroup::Single();
  EXPECT_THAT(Gather(*single, at::Tensor()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gather: undefined")));
  EXPECT_THAT(PadAcrossProcesses(*single, at::Tensor()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pad_across_processes")));
  EXPECT_THAT(Reduce(*single, at::Tensor(), Reduction::kSum),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reduce: undefined")));
  EXPECT_THAT(BroadcastFrom(*single, TensorMap{{"x", at::Tensor()}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"x\"")));
  auto objects = GatherObject(*single, "only");
  ASSERT_THAT(objects, IsOk());
  EXPECT_EQ(*objects, std::vector<std::string>({"only"}));
}

// Sharded training's two collectives: all-gather into one flat buffer and
// reduce-scatter of one (float32 and bfloat16, which gloo moves as words).
TEST(ShardCollectivesWorker, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "runs as a rank of ShardCollectives.*";
  auto group = Connect();
  ASSERT_NE(group, nullptr);
  const int64_t r = group->rank();
  const int64_t p = group->size();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    // Rank r's shard: 3 values r * 10 + {0, 1, 2}.
    at::Tensor shard = (at::arange(3, at::kFloat) + r * 10).to(dtype);
    at::Tensor whole = at::full({3 * p}, -1.0, dtype);
    auto work = group->AllGatherIntoAsync(shard, whole);
    ASSERT_THAT(work, IsOk());
    ASSERT_THAT((*work)->Wait(), IsOk());
    for (int64_t k = 0; k < p; ++k) {
      EXPECT_TRUE(
          at::equal(whole.narrow(0, k * 3, 3), (at::arange(3, at::kFloat) + k * 10).to(dtype)))
          << "chunk " << k;
    }
    // Every rank contributes (rank + 1) * [0 .. 3p); chunk r of the sum is
    // (1 + ... + p) * [3r .. 3r + 3).
    at::Tensor input = (at::arange(3 * p, at::kFloat) * (r + 1)).to(dtype);
    at::Tensor out = at::empty({3}, dtype);
    ASSERT_THAT(group->ReduceScatter(input, out), IsOk());
    const double ranks_sum = static_cast<double>(p * (p + 1)) / 2.0;
    EXPECT_TRUE(at::equal(out, (at::arange(3, at::kFloat) + 3 * r).mul(ranks_sum).to(dtype)))
        << out;
  }
  // Shapes that do not divide are refused, naming the operation.
  EXPECT_THAT(group->AllGatherIntoAsync(at::zeros({3}), at::zeros({3 * p + 1})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("all_gather_into")));
  EXPECT_THAT(group->ReduceScatter(at::zeros({3 * p}), at::zeros({2})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reduce_scatter")));
}

TEST(ShardCollectives, TwoAndThreeRanks) {
  EXPECT_THAT(test::RunRanks(2, "ShardCollectivesWorker.Run"), Each(0));
  EXPECT_THAT(test::RunRanks(3, "ShardCollectivesWorker.Run"), Each(0));
}

TEST(Collectives, TwoRanks) { EXPECT_THAT(test::RunRanks(2, "CollectivesWorker.Run"), Each(0)); }
TEST(Collectives, ThreeRanks) { EXPECT_THAT(test::RunRanks(3, "CollectivesWorker.Run"), Each(0)); }

// A rank that leaves early: the others' next collective fails within the
// timeout, as an error Status, instead of hanging.
TEST(PeerGoneWorker, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of ProcessGroup.PeerGone";
  auto group = Connect(absl::Seconds(3));
  ASSERT_NE(group, nullptr);
  ASSERT_THAT(group->Barrier(), IsOk());
  if (group->rank() == 1) _exit(0);
  std::vector<at::Tensor> t = {at::ones({4})};
  absl::Status status = group->AllReduce(t, ReduceOp::kSum);
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(std::string(status.message()), HasSubstr("all_reduce"));
}

TEST(ProcessGroup, PeerGoneIsAnErrorNotAHang) {
  EXPECT_THAT(test::RunRanks(2, "PeerGoneWorker.Run", {}, /*timeout_s=*/60), Each(0));
}

TEST(ProcessGroup, SingleIsTheIdentity) {
  auto single = ProcessGroup::Single();
  EXPECT_EQ(single->size(), 1);
  at::Tensor t = at::arange(3, at::kFloat);
  auto gathered = Gather(*single, t);
  ASSERT_THAT(gathered, IsOk());
  EXPECT_TRUE(at::equal(*gathered, t));
  auto mean = Reduce(*single, t, Reduction::kMean);
  EXPECT_TRUE(at::equal(*mean, t));
  EXPECT_THAT(single->Broadcast(t, 1), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ProcessGroup, BadBackendAndRank) {
  ProcessEnvironment env;
  ProcessGroupOptions nccl;
  nccl.backend = "nccl";
  EXPECT_THAT(ProcessGroup::Connect(env, nccl),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("nccl")));
  ProcessGroupOptions mpi;
  mpi.backend = "mpi";
  EXPECT_THAT(ProcessGroup::Connect(env, mpi),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"mpi\"")));
  ProcessGroupOptions no_time;
  no_time.timeout = absl::ZeroDuration();
  EXPECT_THAT(ProcessGroup::Connect(env, no_time),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
  env.rank = 3;
  env.world_size = 2;
  EXPECT_THAT(ProcessGroup::Connect(env, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 3 of world size 2")));
}

// "auto" means NCCL only where libtorch has it; this one is CPU-only, so gloo.
TEST(ProcessGroup, AutoFallsBackToGlooWithoutNccl) {
  ProcessEnvironment env;
  env.master_port = test::FreePort();
  ProcessGroupOptions options;
  options.use_cuda = true;
  options.timeout = absl::Seconds(20);
  auto group = ProcessGroup::Connect(env, options);
  ASSERT_THAT(group, IsOk());
  EXPECT_EQ((*group)->backend(), "gloo");
  std::vector<at::Tensor> t = {at::arange(3, at::kFloat)};
  ASSERT_THAT((*group)->AllReduce(t, ReduceOp::kMax), IsOk());
  EXPECT_TRUE(at::equal(t[0], at::arange(3, at::kFloat)));
}

// Accelerate's InitProcessGroupKwargs.__post_init__ (and torch's defaults):
// 600 s for nccl, 1800 s otherwise, when no timeout is given.
TEST(ProcessGroup, DefaultTimeoutFollowsAccelerate) {
  EXPECT_EQ(DefaultProcessGroupTimeout("nccl"), absl::Seconds(600));
  EXPECT_EQ(DefaultProcessGroupTimeout("gloo"), absl::Seconds(1800));
  EXPECT_FALSE(ProcessGroupOptions{}.timeout.has_value());
}

TEST(SplitBetweenProcesses, ContiguousSharesAndPadding) {
  const std::vector<int> items = {1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(SplitBetweenProcesses(items, 0, 3), std::vector<int>({1, 2, 3}));
  EXPECT_EQ(SplitBetweenProcesses(items, 1, 3), std::vector<int>({4, 5}));
  EXPECT_EQ(SplitBetweenProcesses(items, 2, 3), std::vector<int>({6, 7}));
  EXPECT_EQ(SplitBetweenProcesses(items, 2, 3, true), std::vector<int>({6, 7, 7}));
  EXPECT_EQ(SplitBetweenProcesses(std::vector<int>{1}, 1, 2), std::vector<int>({}));
}

}  // namespace
}  // namespace accel::train
