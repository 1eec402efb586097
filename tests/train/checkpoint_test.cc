// save_model sharding (huggingface_hub's split, Accelerate's upstream
// ModelForTest case), the state files, and checkpoint naming.
#include "train/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <string>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

// Accelerate's ModelForTest: Linear(3, 4), BatchNorm1d(4), Linear(4, 5).
StateDict ModelForTest() {
  at::manual_seed(0);
  torch::nn::Linear l1(3, 4), l2(4, 5);
  torch::nn::BatchNorm1d bn(4);
  return {{"linear1.weight", l1->weight},
          {"linear1.bias", l1->bias},
          {"batchnorm.weight", bn->weight},
          {"batchnorm.bias", bn->bias},
          {"batchnorm.running_mean", bn->running_mean},
          {"batchnorm.running_var", bn->running_var},
          {"batchnorm.num_batches_tracked", bn->num_batches_tracked},
          {"linear2.weight", l2->weight},
          {"linear2.bias", l2->bias}};
}

TEST(ParseShardSize, DecimalBinaryAndBytes) {
  EXPECT_EQ(*ParseShardSize("10GB"), 10'000'000'000);
  EXPECT_EQ(*ParseShardSize("500MB"), 500'000'000);
  EXPECT_EQ(*ParseShardSize("100KB"), 100'000);
  EXPECT_EQ(*ParseShardSize("2GiB"), int64_t{2} << 30);
  EXPECT_EQ(*ParseShardSize("100"), 100);
  EXPECT_EQ(*ParseShardSize("1.5mb"), 1'500'000);
  EXPECT_THAT(ParseShardSize("ten"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"ten\"")));
  EXPECT_THAT(ParseShardSize("-5GB"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(SaveModel, UpstreamThreeShards) {
  test::TempDir dir;
  StateDict state = ModelForTest();
  SaveModelOptions o;
  o.max_shard_size = 100;
  ASSERT_THAT(SaveModel(state, dir.path(), o), IsOk());
  // [derived] 96 + 40 + 100 bytes, total 236.
  nlohmann::json index =
      nlohmann::json::parse(test::ReadAll(dir.File("model.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"], 236);
  const std::string s1 = "model-00001-of-00003.safetensors",
                    s2 = "model-00002-of-00003.safetensors",
                    s3 = "model-00003-of-00003.safetensors";
  auto& map = index["weight_map"];
  for (const char* n : {"linear1.weight", "linear1.bias", "batchnorm.weight", "batchnorm.bias"}) {
    EXPECT_EQ(map[n], s1) << n;
  }
  for (const char* n :
       {"batchnorm.running_mean", "batchnorm.running_var", "batchnorm.num_batches_tracked"}) {
    EXPECT_EQ(map[n], s2) << n;
  }
  EXPECT_EQ(map["linear2.weight"], s3);
  EXPECT_EQ(map["linear2.bias"], s3);
  // huggingface_hub's format: indent 2, sorted keys, trailing newline.
  const std::string text = test::ReadAll(dir.File("model.safetensors.index.json"));
  EXPECT_EQ(text.back(), '\n');
  EXPECT_THAT(text, HasSubstr("{\n  \"metadata\""));
  auto back = LoadModelWeights(dir.path());
  ASSERT_THAT(back, IsOk());
  ASSERT_EQ(back->size(), state.size());
  std::map<std::string, at::Tensor> by_name(back->begin(), back->end());
  for (const auto& [name, t] : state) EXPECT_TRUE(at::equal(by_name.at(name), t)) << name;

  // A bigger limit: one file, and the stale shards and index are gone.
  ASSERT_THAT(SaveModel(state, dir.path(), {}), IsOk());
  EXPECT_TRUE(std::filesystem::exists(dir.File("model.safetensors")));
  EXPECT_FALSE(std::filesystem::exists(dir.File(s1)));
  EXPECT_FALSE(std::filesystem::exists(dir.File("model.safetensors.index.json")));
}

TEST(SaveModel, TiedTensorsAreKeptOnce) {
  test::TempDir dir;
  at::Tensor shared = at::arange(6, at::kFloat).view({2, 3});
  ASSERT_THAT(
      SaveModel({{"embed.weight", shared}, {"lm_head.weight", shared}, {"bias", at::zeros({2})}},
                dir.path()),
      IsOk());
  auto back = LoadModelWeights(dir.path());
  ASSERT_THAT(back, IsOk());
  std::vector<std::string> names;
  for (const auto& [n, t] : *back) names.push_back(n);
  EXPECT_THAT(names, ::testing::UnorderedElementsAre("embed.weight", "bias"));
}

TEST(SaveModel, OtherStemsAndErrors) {
  test::TempDir dir;
  SaveModelOptions o;
  o.weights_name = "model_1";
  ASSERT_THAT(SaveModel({{"w", at::ones({2})}}, dir.path(), o), IsOk());
  EXPECT_TRUE(std::filesystem::exists(dir.File("model_1.safetensors")));
  EXPECT_THAT(LoadModelWeights(dir.path(), "model_1"), IsOk());
  EXPECT_THAT(LoadModelWeights(dir.path(), "model_2"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model_2")));
  // A file where the folder should be: the error names it, nothing is left half-written.
  const std::string blocker = dir.Write("blocker", "x");
  EXPECT_FALSE(SaveModel({{"w", at::ones({2})}}, blocker + "/sub").ok());
}

TEST(StateFiles, OptimizerRoundTripTakesTheSameNextStep) {
  test::TempDir dir;
  auto train = [](torch::optim::Adam& adam, at::Tensor& w, int steps) {
    for (int i = 0; i < steps; ++i) {
      adam.zero_grad();
      (w * w).sum().backward();
      adam.step();
    }
  };
  at::Tensor w1 = at::arange(4, at::kFloat).set_requires_grad(true);
  torch::optim::Adam a1({w1}, torch::optim::AdamOptions(0.1));
  train(a1, w1, 3);
  ASSERT_THAT(SaveOptimizer(a1, dir.File("optimizer.bin")), IsOk());
  at::Tensor w2 = w1.detach().clone().set_requires_grad(true);
  torch::optim::Adam a2({w2}, torch::optim::AdamOptions(0.1));
  ASSERT_THAT(LoadOptimizer(a2, dir.File("optimizer.bin")), IsOk());
  train(a1, w1, 2);
  train(a2, w2, 2);
  EXPECT_TRUE(at::equal(w1, w2));
  EXPECT_THAT(LoadOptimizer(a2, dir.File("missing.bin")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.bin")));
  dir.Write("corrupt.bin", "not an archive");
  EXPECT_THAT(LoadOptimizer(a2, dir.File("corrupt.bin")),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("corrupt.bin")));
}

TEST(StateFiles, PicklesRoundTrip) {
  test::TempDir dir;
  SchedulerState sched{7, 8, {0.1, 0.2}, {0.05, 0.1}};
  ASSERT_THAT(SaveSchedulerState(sched, dir.File("scheduler.bin")), IsOk());
  auto s = LoadSchedulerState(dir.File("scheduler.bin"));
  ASSERT_THAT(s, IsOk());
  EXPECT_EQ(s->last_epoch, 7);
  EXPECT_EQ(s->step_count, 8);
  EXPECT_EQ(s->base_lrs, sched.base_lrs);
  EXPECT_EQ(s->last_lrs, sched.last_lrs);

  GradScalerState scaler{1024, 2, 0.5, 100, 3};
  ASSERT_THAT(SaveScalerState(scaler, dir.File("scaler.pt")), IsOk());
  auto sc = LoadScalerState(dir.File("scaler.pt"));
  ASSERT_THAT(sc, IsOk());
  EXPECT_EQ(sc->scale, 1024);
  EXPECT_EQ(sc->growth_interval, 100);
  EXPECT_EQ(sc->growth_tracker, 3);

  ASSERT_THAT(SaveCustomState({{"a", at::arange(3)}}, dir.File("custom_checkpoint_0.pkl")), IsOk());
  auto custom = LoadCustomState(dir.File("custom_checkpoint_0.pkl"));
  ASSERT_THAT(custom, IsOk());
  EXPECT_TRUE(at::equal(custom->at("a"), at::arange(3)));

  // A pickle of the wrong shape names the file and the key.
  EXPECT_THAT(LoadSchedulerState(dir.File("scaler.pt")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("last_epoch")));
  dir.Write("truncated.pkl", test::ReadAll(dir.File("scaler.pt")).substr(0, 40));
  EXPECT_THAT(LoadScalerState(dir.File("truncated.pkl")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated.pkl")));
  EXPECT_THAT(LoadScalerState(dir.File("nope.pt")), StatusIs(absl::StatusCode::kNotFound));
}

TEST(StateFiles, RandomStatesRepeatTheSequence) {
  test::TempDir dir;
  at::manual_seed(123);
  (void)at::rand({5});
  ASSERT_THAT(SaveRandomStates(CaptureRandomStates(4), dir.File("random_states_0.pkl")), IsOk());
  at::Tensor first = at::rand({8});
  (void)at::rand({100});
  auto states = LoadRandomStates(dir.File("random_states_0.pkl"));
  ASSERT_THAT(states, IsOk());
  EXPECT_EQ(states->step, 4);
  ASSERT_THAT(RestoreRandomStates(*states), IsOk());
  EXPECT_TRUE(at::equal(at::rand({8}), first));
}

TEST(CheckpointNaming, TotalLimitPrunesNumerically) {
  test::TempDir dir;
  for (int64_t i = 0; i <= 10; ++i) {
    auto next = NextCheckpointDir(dir.path(), i, 2, true);
    ASSERT_THAT(next, IsOk());
    EXPECT_THAT(*next, ::testing::EndsWith("checkpoint_" + std::to_string(i)));
    std::filesystem::create_directories(*next);
  }
  EXPECT_FALSE(std::filesystem::exists(dir.File("checkpoints/checkpoint_0")));
  EXPECT_FALSE(std::filesystem::exists(dir.File("checkpoints/checkpoint_8")));
  EXPECT_TRUE(std::filesystem::exists(dir.File("checkpoints/checkpoint_9")));
  EXPECT_TRUE(std::filesystem::exists(dir.File("checkpoints/checkpoint_10")));
  // checkpoint_10 is later than checkpoint_9 (not lexicographic).
  auto latest = LatestCheckpointDir(dir.path());
  ASSERT_THAT(latest, IsOk());
  EXPECT_THAT(*latest, ::testing::EndsWith("checkpoint_10"));
  EXPECT_THAT(NextCheckpointDir(dir.path(), 10, std::nullopt, true),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already exists")));
  test::TempDir empty;
  EXPECT_THAT(LatestCheckpointDir(empty.path()), StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace accel::train
