// Who a process is in a distributed run, from each launcher's variables.
#include "train/env.h"

#include <map>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::train {
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

TEST(Names, PrecisionAndDistributedType) {
  EXPECT_THAT(ParsePrecision("BF16"), IsOk());
  EXPECT_EQ(*ParsePrecision("fp16"), PrecisionType::kFp16);
  EXPECT_THAT(ParsePrecision("fp8"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fp8")));
  EXPECT_THAT(ParsePrecision("half"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"half\"")));
  for (PrecisionType p : {PrecisionType::kNo, PrecisionType::kFp16, PrecisionType::kBf16}) {
    EXPECT_EQ(*ParsePrecision(PrecisionName(p)), p);
  }
  for (DistributedType t :
       {DistributedType::kNo, DistributedType::kMultiCpu, DistributedType::kMultiGpu}) {
    EXPECT_EQ(*ParseDistributedType(DistributedTypeName(t)), t);
  }
  EXPECT_THAT(ParseDistributedType("DEEPSPEED"), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace accel::train
