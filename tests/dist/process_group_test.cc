// dist::ProcessGroup's point-to-point sends and sub-groups (what pipeline
// stages use), in real processes over gloo on 127.0.0.1. The collectives
// themselves are tested through the training library
// (tests/train/process_group_test.cc).
#include "dist/process_group.h"

#include <memory>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dist/env.h"
#include "tests/testing/multiprocess.h"
#include "tests/testing/status_matchers.h"

namespace accel::dist {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::Each;
using ::testing::HasSubstr;

// Three ranks: rank 0 sends to 1, 1 to 2 and 2 back to 0 (float and
// bfloat16, which gloo moves as raw bits); then a group of ranks {2, 0}
// (in that order: rank 2 is its rank 0) sums within itself while rank 1 is
// outside it.
TEST(PointToPointWorker, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of ProcessGroup.SendRecvAndNewGroup";
  absl::StatusOr<ProcessEnvironment> env = DetectProcessEnvironment(ProcessEnv());
  ASSERT_THAT(env, IsOk());
  ProcessGroupOptions options;
  options.timeout = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<ProcessGroup>> connected = ProcessGroup::Connect(*env, options);
  ASSERT_THAT(connected, IsOk());
  ProcessGroup& world = **connected;
  const int rank = world.rank(), next = (rank + 1) % 3, previous = (rank + 2) % 3;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor mine = (at::arange(6, at::kFloat) + 10 * rank).reshape({2, 3}).to(dtype);
    at::Tensor got = at::empty({2, 3}, dtype);
    if (rank == 0) {
      ASSERT_THAT(world.Send(mine, next), IsOk());
      ASSERT_THAT(world.Recv(got, previous), IsOk());
    } else {
      ASSERT_THAT(world.Recv(got, previous), IsOk());
      ASSERT_THAT(world.Send(mine, next), IsOk());
    }
    const at::Tensor want = (at::arange(6, at::kFloat) + 10 * previous).reshape({2, 3}).to(dtype);
    EXPECT_TRUE(at::equal(got, want)) << "rank " << rank;
  }
  {
    // Asynchronous: every rank posts its receives and sends at once (a ring
    // of blocking sends would wait for each other), three messages each;
    // they pair up in the order they were posted.
    std::vector<at::Tensor> inbox;
    std::vector<std::unique_ptr<PendingWork>> works;
    for (int m = 0; m < 3; ++m) {
      inbox.push_back(at::empty({4}));
      absl::StatusOr<std::unique_ptr<PendingWork>> recv = world.RecvAsync(inbox.back(), previous);
      ASSERT_THAT(recv, IsOk());
      works.push_back(*std::move(recv));
    }
    for (int m = 0; m < 3; ++m) {
      absl::StatusOr<std::unique_ptr<PendingWork>> send =
          world.SendAsync(at::full({4}, static_cast<double>(100 * rank + m)), next);
      ASSERT_THAT(send, IsOk());  // the work keeps the temporary alive
      works.push_back(*std::move(send));
    }
    for (auto& work : works) ASSERT_THAT(work->Wait(), IsOk());
    for (int m = 0; m < 3; ++m) {
      EXPECT_TRUE(at::equal(inbox[static_cast<size_t>(m)],
                            at::full({4}, static_cast<double>(100 * previous + m))))
          << "message " << m;
    }
  }
  at::Tensor buffer = at::empty({2});
  EXPECT_THAT(world.SendAsync(buffer, rank).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("destination rank")));
  EXPECT_THAT(world.Send(buffer, rank),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("destination rank")));
  EXPECT_THAT(world.Recv(buffer, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("source rank 3")));
  at::Tensor strided = at::empty({2, 2}).t();
  EXPECT_THAT(world.Recv(strided, previous),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("contiguous")));
  EXPECT_THAT(world.NewGroup({0, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listed twice")));
  EXPECT_THAT(world.NewGroup({0, 5}), StatusIs(absl::StatusCode::kInvalidArgument));

  absl::StatusOr<std::unique_ptr<ProcessGroup>> pair = world.NewGroup({2, 0});
  ASSERT_THAT(pair, IsOk());
  if (rank == 1) {
    EXPECT_EQ(*pair, nullptr);
  } else {
    ASSERT_NE(*pair, nullptr);
    EXPECT_EQ((*pair)->size(), 2);
    EXPECT_EQ((*pair)->rank(), rank == 2 ? 0 : 1);
    std::vector<at::Tensor> sum = {at::full({3}, static_cast<double>(rank + 1))};
    ASSERT_THAT((*pair)->AllReduce(sum, ReduceOp::kSum), IsOk());
    EXPECT_TRUE(at::equal(sum[0], at::full({3}, 4.0)));  // ranks 0 and 2: 1 + 3
    // Point to point inside the pair, by the pair's ranks.
    at::Tensor one = at::full({1}, 7.0);
    if ((*pair)->rank() == 0) {
      ASSERT_THAT((*pair)->Send(one, 1), IsOk());
    } else {
      at::Tensor in = at::empty({1});
      ASSERT_THAT((*pair)->Recv(in, 0), IsOk());
      EXPECT_EQ(in.item<float>(), 7.0f);
    }
  }
  // The world still works after the pair was made.
  ASSERT_THAT(world.Barrier(), IsOk());
}

TEST(ProcessGroup, SendRecvAndNewGroup) {
  EXPECT_THAT(test::RunRanks(3, "PointToPointWorker.Run", {}, /*timeout_s=*/60), Each(0));
}

TEST(ProcessGroup, SingleHasNoPeers) {
  std::unique_ptr<ProcessGroup> single = ProcessGroup::Single();
  at::Tensor t = at::ones({2});
  EXPECT_THAT(single->Send(t, 0), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(single->Recv(t, 0), StatusIs(absl::StatusCode::kInvalidArgument));
  absl::StatusOr<std::unique_ptr<ProcessGroup>> self = single->NewGroup({0});
  ASSERT_THAT(self, IsOk());
  EXPECT_EQ((*self)->size(), 1);
  EXPECT_THAT(single->NewGroup({0, 1}), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace accel::dist
