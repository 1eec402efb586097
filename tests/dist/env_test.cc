// Who a process is in a distributed run, from each launcher's variables.
#include "dist/env.h"

#include <map>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::dist {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(DetectProcessEnvironment, NoLauncherIsOneProcess) {
  auto env = DetectProcessEnvironment(Env({}));
  ASSERT_THAT(env, IsOk());
  EXPECT_EQ(env->rank, 0);
  EXPECT_EQ(env->world_size, 1);
  EXPECT_EQ(env->launcher, "none");
  EXPECT_EQ(env->master_addr, "127.0.0.1");
  EXPECT_EQ(env->master_port, 29500);
}

TEST(DetectProcessEnvironment, Torchrun) {
  auto env = DetectProcessEnvironment(Env({{"RANK", "3"},
                                           {"WORLD_SIZE", "4"},
                                           {"LOCAL_RANK", "1"},
                                           {"LOCAL_WORLD_SIZE", "2"},
                                           {"MASTER_ADDR", "10.0.0.7"},
                                           {"MASTER_PORT", "1234"},
                                           {"GLOO_SOCKET_IFNAME", "eth1"},
                                           {"ACCELERATE_USE_CPU", "True"}}));
  ASSERT_THAT(env, IsOk());
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 2);
  EXPECT_EQ(env->master_addr, "10.0.0.7");
  EXPECT_EQ(env->master_port, 1234);
  EXPECT_EQ(env->launcher, "torchrun");
  EXPECT_EQ(env->gloo_socket_ifname, "eth1");
  EXPECT_TRUE(env->use_cpu);
}

TEST(DetectProcessEnvironment, MpiAndSlurm) {
  auto ompi = DetectProcessEnvironment(Env({{"OMPI_COMM_WORLD_RANK", "2"},
                                            {"OMPI_COMM_WORLD_SIZE", "4"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                            {"MASTER_ADDR", "node0"}}));
  ASSERT_THAT(ompi, IsOk());
  EXPECT_EQ(ompi->rank, 2);
  EXPECT_EQ(ompi->local_rank, 0);
  EXPECT_EQ(ompi->launcher, "mpi");
  auto pmi = DetectProcessEnvironment(Env({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}}));
  ASSERT_THAT(pmi, IsOk());
  EXPECT_EQ(pmi->rank, 1);
  EXPECT_EQ(pmi->local_rank, 1);  // one node: local = global
  auto slurm = DetectProcessEnvironment(Env({{"SLURM_PROCID", "5"},
                                             {"SLURM_NTASKS", "8"},
                                             {"SLURM_LOCALID", "1"},
                                             {"SLURM_NTASKS_PER_NODE", "4"},
                                             {"MASTER_ADDR", "n1"}}));
  ASSERT_THAT(slurm, IsOk());
  EXPECT_EQ(slurm->rank, 5);
  EXPECT_EQ(slurm->world_size, 8);
  EXPECT_EQ(slurm->local_rank, 1);
  EXPECT_EQ(slurm->launcher, "slurm");
}

TEST(DetectProcessEnvironment, BadValuesNameTheVariable) {
  EXPECT_THAT(DetectProcessEnvironment(Env({{"RANK", "x"}, {"WORLD_SIZE", "2"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("RANK=\"x\"")));
  EXPECT_THAT(DetectProcessEnvironment(Env({{"RANK", "2"}, {"WORLD_SIZE", "2"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("RANK=2 is outside")));
  EXPECT_THAT(DetectProcessEnvironment(Env({{"WORLD_SIZE", "0"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("WORLD_SIZE")));
  EXPECT_THAT(DetectProcessEnvironment(
                  Env({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("MASTER_ADDR")));
  EXPECT_THAT(DetectProcessEnvironment(Env({{"MASTER_PORT", "99999"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("MASTER_PORT")));
  EXPECT_THAT(
      DetectProcessEnvironment(Env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "5"}})),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("LOCAL_RANK")));
}

// Every refused environment, as a table: the variables and what the message names.
TEST(DetectProcessEnvironment, EveryRefusalNamesTheVariable) {
  struct Case {
    std::map<std::string, std::string> vars;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{"WORLD_SIZE", "two"}}, "WORLD_SIZE=\"two\" is not an integer"},
      {{{"LOCAL_RANK", "1.5"}}, "LOCAL_RANK=\"1.5\" is not an integer"},
      {{{"LOCAL_WORLD_SIZE", ""}}, "LOCAL_WORLD_SIZE=\"\" is not an integer"},
      {{{"PMI_RANK", "-"}, {"PMI_SIZE", "2"}}, "PMI_RANK=\"-\""},
      {{{"OMPI_COMM_WORLD_SIZE", "4x"}}, "OMPI_COMM_WORLD_SIZE=\"4x\""},
      {{{"MV2_COMM_WORLD_LOCAL_RANK", "a"}}, "MV2_COMM_WORLD_LOCAL_RANK=\"a\""},
      {{{"SLURM_NTASKS_PER_NODE", "2(x3)"}}, "SLURM_NTASKS_PER_NODE=\"2(x3)\""},
      {{{"WORLD_SIZE", "-3"}}, "WORLD_SIZE=-3: must be at least 1"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK=-1 is outside [0, 2)"},
      {{{"RANK", "1"}}, "RANK=1 is outside [0, 1) (WORLD_SIZE)"},
      {{{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}},
       "SLURM_PROCID=4 is outside [0, 4) (SLURM_NTASKS)"},
      {{{"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}}, "LOCAL_WORLD_SIZE=3 is outside [1, 2]"},
      {{{"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "0"}}, "LOCAL_WORLD_SIZE=0 is outside [1, 2]"},
      {{{"OMPI_COMM_WORLD_SIZE", "4"},
        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
        {"MASTER_ADDR", "n"}},
       "OMPI_COMM_WORLD_LOCAL_RANK=2 is outside [0, 2)"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_NTASKS_PER_NODE", "4"}},
       "needs MASTER_ADDR"},
      {{{"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}}, "needs MASTER_ADDR"},
      {{{"MASTER_PORT", "http"}}, "MASTER_PORT=\"http\" is not a port"},
      {{{"MASTER_PORT", "0"}}, "MASTER_PORT=\"0\" is not a port"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(DetectProcessEnvironment(Env(c.vars)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.message;
  }
}

// torchrun's variables win over MPI's and SLURM's; a single node needs no MASTER_ADDR.
TEST(DetectProcessEnvironment, PrecedenceAndDefaults) {
  auto env = DetectProcessEnvironment(Env({{"RANK", "1"},
                                           {"WORLD_SIZE", "2"},
                                           {"PMI_RANK", "0"},
                                           {"PMI_SIZE", "8"},
                                           {"SLURM_PROCID", "7"},
                                           {"SLURM_NTASKS", "9"},
                                           {"ACCEL_USE_CPU", "1"}}));
  ASSERT_THAT(env, IsOk());
  EXPECT_EQ(env->rank, 1);
  EXPECT_EQ(env->world_size, 2);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 2);
  EXPECT_EQ(env->master_addr, "127.0.0.1");
  EXPECT_EQ(env->launcher, "torchrun");
  EXPECT_TRUE(env->use_cpu);
  auto mpi = DetectProcessEnvironment(Env({{"MV2_COMM_WORLD_RANK", "3"},
                                           {"MV2_COMM_WORLD_SIZE", "4"},
                                           {"MPI_LOCALRANKID", "1"},
                                           {"MPI_LOCALNRANKS", "2"},
                                           {"MASTER_ADDR", "head"},
                                           {"ACCELERATE_USE_CPU", "false"}}));
  ASSERT_THAT(mpi, IsOk());
  EXPECT_EQ(mpi->rank, 3);
  EXPECT_EQ(mpi->local_rank, 1);
  EXPECT_EQ(mpi->local_world_size, 2);
  EXPECT_EQ(mpi->launcher, "mpi");
  EXPECT_EQ(mpi->master_addr, "head");
  EXPECT_FALSE(mpi->use_cpu);
  // Without a local rank, it is the rank modulo the local world size.
  auto slurm = DetectProcessEnvironment(Env({{"SLURM_PROCID", "5"},
                                             {"SLURM_NTASKS", "6"},
                                             {"SLURM_NTASKS_PER_NODE", "3"},
                                             {"MASTER_ADDR", "n0"}}));
  ASSERT_THAT(slurm, IsOk());
  EXPECT_EQ(slurm->local_rank, 2);
  EXPECT_EQ(slurm->launcher, "slurm");
}

}  // namespace
}  // namespace accel::dist
