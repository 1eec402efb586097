// Where an accel-serve process stands in a tensor-parallel group (flags or a
// launcher's variables), and the workers it starts: real child processes,
// killed, stopped and exiting.
#include "dist/launch.h"

#include <chrono>
#include <csignal>
#include <map>
#include <string>
#include <thread>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::dist {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Optional;

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(ResolveRankLayout, OneMachineStartsTheOtherRanks) {
  ParallelFlags flags;
  flags.tensor_parallel_size = 4;
  absl::StatusOr<RankLayout> layout = ResolveRankLayout(flags, Env({}));
  ASSERT_THAT(layout, IsOk());
  EXPECT_TRUE(layout->leader());
  EXPECT_EQ(layout->world_size, 4);
  EXPECT_EQ(layout->master_addr, "127.0.0.1");
  ASSERT_EQ(layout->to_start.size(), 3u);
  EXPECT_EQ(layout->to_start[2].at("RANK"), "3");
  EXPECT_EQ(layout->to_start[2].at("LOCAL_RANK"), "3");
  EXPECT_EQ(layout->to_start[2].at("WORLD_SIZE"), "4");
  EXPECT_EQ(layout->to_start[0].at("MASTER_PORT"), "29500");
  // One process: nothing to start.
  EXPECT_TRUE(ResolveRankLayout(ParallelFlags(), Env({}))->to_start.empty());
}

TEST(ResolveRankLayout, TorchrunFlagsAcrossNodes) {
  ParallelFlags flags;
  flags.tensor_parallel_size = 4;
  flags.nnodes = 2;
  flags.node_rank = 1;
  flags.master_addr = "10.0.0.1";
  flags.master_port = 1234;
  absl::StatusOr<RankLayout> layout = ResolveRankLayout(flags, Env({}));
  ASSERT_THAT(layout, IsOk());
  EXPECT_EQ(layout->rank, 2);  // node 1's first rank
  EXPECT_FALSE(layout->leader());
  ASSERT_EQ(layout->to_start.size(), 1u);
  EXPECT_EQ(layout->to_start[0].at("RANK"), "3");
  EXPECT_EQ(layout->to_start[0].at("LOCAL_RANK"), "1");
  EXPECT_EQ(layout->to_start[0].at("LOCAL_WORLD_SIZE"), "2");
  EXPECT_EQ(layout->to_start[0].at("MASTER_ADDR"), "10.0.0.1");
  EXPECT_EQ(layout->to_start[0].at("MASTER_PORT"), "1234");
}

TEST(ResolveRankLayout, ALauncherSetsTheRank) {
  ParallelFlags flags;
  flags.tensor_parallel_size = 2;
  absl::StatusOr<RankLayout> layout = ResolveRankLayout(flags, Env({{"RANK", "1"},
                                                                    {"WORLD_SIZE", "2"},
                                                                    {"MASTER_ADDR", "leader.svc"},
                                                                    {"MASTER_PORT", "3000"}}));
  ASSERT_THAT(layout, IsOk());
  EXPECT_EQ(layout->rank, 1);
  EXPECT_EQ(layout->local_rank, 1);
  EXPECT_EQ(layout->master_addr, "leader.svc");
  EXPECT_EQ(layout->master_port, 3000);
  EXPECT_TRUE(layout->to_start.empty());
}

TEST(ResolveRankLayout, BadFlagsAreRefusedByName) {
  const auto refused = [](ParallelFlags flags, std::map<std::string, std::string> env = {}) {
    return ResolveRankLayout(flags, Env(env)).status();
  };
  ParallelFlags f;
  f.tensor_parallel_size = 0;
  EXPECT_THAT(refused(f),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tensor_parallel_size")));
  f = ParallelFlags();
  f.pipeline_parallel_size = 0;
  EXPECT_THAT(refused(f),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--pipeline_parallel_size")));
  // Tensor x pipeline: N x M ranks.
  f = ParallelFlags();
  f.tensor_parallel_size = 2;
  f.pipeline_parallel_size = 2;
  absl::StatusOr<RankLayout> both = ResolveRankLayout(f, Env({}));
  ASSERT_THAT(both, IsOk());
  EXPECT_EQ(both->world_size, 4);
  EXPECT_EQ(both->to_start.size(), 3u);
  f = ParallelFlags();
  f.tensor_parallel_size = 3;
  f.nnodes = 2;
  f.master_addr = "x";
  EXPECT_THAT(refused(f), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--nnodes 2")));
  f.tensor_parallel_size = 4;
  f.node_rank = 2;
  EXPECT_THAT(refused(f), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--node_rank")));
  f.node_rank = 1;
  f.master_addr.clear();
  EXPECT_THAT(refused(f), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--master_addr")));
  f = ParallelFlags();
  f.master_port = 70000;
  EXPECT_THAT(refused(f), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--master_port")));
  f = ParallelFlags();
  f.tensor_parallel_size = 2;
  EXPECT_THAT(refused(f, {{"WORLD_SIZE", "4"}, {"RANK", "0"}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("WORLD_SIZE=4")));
  EXPECT_THAT(refused(f, {{"WORLD_SIZE", "2"}, {"RANK", "2"}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("RANK=2")));
  EXPECT_THAT(refused(f, {{"WORLD_SIZE", "two"}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("WORLD_SIZE=\"two\"")));
}

std::optional<std::string> WaitForFailure(LocalWorkers& workers) {
  for (int i = 0; i < 500; ++i) {
    if (std::optional<std::string> failure = workers.Failure()) return failure;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return std::nullopt;
}

TEST(LocalWorkers, AKilledStoppedOrExitingWorkerIsReportedByRank) {
  // sleep itself (no shell between), so that no grandchild outlives the test.
  const std::vector<std::string> sleep = {"sleep", "30"};
  const std::vector<std::map<std::string, std::string>> ranks = {{{"RANK", "1"}}, {{"RANK", "2"}}};
  {
    absl::StatusOr<std::unique_ptr<LocalWorkers>> workers =
        LocalWorkers::Start("/bin/sleep", sleep, ranks);
    ASSERT_THAT(workers, IsOk());
    EXPECT_EQ((*workers)->Failure(), std::nullopt);
    ::kill((*workers)->pids()[1], SIGKILL);
    EXPECT_THAT(WaitForFailure(**workers),
                Optional(AllOf(HasSubstr("worker rank 2"), HasSubstr("killed by signal 9"))));
  }
  {
    absl::StatusOr<std::unique_ptr<LocalWorkers>> workers =
        LocalWorkers::Start("/bin/sleep", sleep, ranks);
    ASSERT_THAT(workers, IsOk());
    ::kill((*workers)->pids()[0], SIGSTOP);
    EXPECT_THAT(WaitForFailure(**workers),
                Optional(AllOf(HasSubstr("worker rank 1"), HasSubstr("stopped"))));
    // The destructor ends the stopped worker too (SIGCONT, SIGTERM).
  }
  absl::StatusOr<std::unique_ptr<LocalWorkers>> exiting =
      LocalWorkers::Start("/bin/sh", {"sh", "-c", "exit 4"}, {{{"RANK", "5"}}});
  ASSERT_THAT(exiting, IsOk());
  EXPECT_THAT(WaitForFailure(**exiting),
              Optional(AllOf(HasSubstr("worker rank 5"), HasSubstr("exited with status 4"))));
  // Each worker sees its variables.
  absl::StatusOr<std::unique_ptr<LocalWorkers>> checking = LocalWorkers::Start(
      "/bin/sh", {"sh", "-c", "test \"$RANK\" = 7 && exit 9"}, {{{"RANK", "7"}}});
  ASSERT_THAT(checking, IsOk());
  EXPECT_THAT(WaitForFailure(**checking), Optional(HasSubstr("exited with status 9")));
}

}  // namespace
}  // namespace accel::dist
