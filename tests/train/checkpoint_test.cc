// save_model sharding (huggingface_hub's split, Accelerate's upstream
// ModelForTest case), the state files, and checkpoint naming.
#include "train/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

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

// Any error whose message contains `text` (the code depends on the errno).
MATCHER_P(FailsMentioning, text, absl::StrCat("fails mentioning ", text)) {
  const absl::Status& s = ::accel::test::GetStatus(arg);
  *result_listener << "status " << s;
  return !s.ok() && absl::StrContains(s.message(), text);
}

// An independent reading of a safetensors header: tensor name -> byte count
// (data_offsets end - begin), and the __metadata__ object.
struct SafetensorsHeader {
  std::map<std::string, int64_t> bytes;
  std::map<std::string, std::string> metadata;
  int64_t total = 0;
};
SafetensorsHeader ReadHeader(const std::string& path) {
  const std::string file = test::ReadAll(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(file[static_cast<size_t>(i)]);
  nlohmann::json header = nlohmann::json::parse(file.substr(8, n));
  SafetensorsHeader out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      out.metadata = info.get<std::map<std::string, std::string>>();
      continue;
    }
    const int64_t b =
        info["data_offsets"][1].get<int64_t>() - info["data_offsets"][0].get<int64_t>();
    out.bytes[name] = b;
    out.total += b;
  }
  return out;
}

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
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
  EXPECT_EQ(*ParseShardSize(" 10 KB "), 10'000);  // huggingface_hub's whitespace rule
  EXPECT_EQ(*ParseShardSize("20mb"), 20'000'000);
  EXPECT_EQ(*ParseShardSize("1TB"), 1'000'000'000'000);
  EXPECT_EQ(*ParseShardSize("3KiB"), 3072);
  EXPECT_EQ(*ParseShardSize("100B"), 100);
  for (const char* bad : {"-5GB", "", "0", "5XB", "1ooKB", "infGB", "nanMB", "1e30TB", "GB"}) {
    EXPECT_THAT(ParseShardSize(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr(absl::StrCat("\"", bad, "\""))))
        << bad;
  }
}

// huggingface_hub's test_multiple_shards vector (sizes 6, 10, 30, 2, 2, limit
// 10): the oversized layer_3 is a shard of its own, appended while layer_2's
// shard is still being filled, so it comes second.
TEST(SaveModel, HuggingfaceHubSplitVector) {
  test::TempDir dir;
  StateDict state;
  int64_t i = 0;
  for (int64_t n : {6, 10, 30, 2, 2}) {
    ++i;
    state.emplace_back(absl::StrCat("layer_", i), at::full({n}, i, at::kByte));
  }
  SaveModelOptions o;
  o.max_shard_size = 10;
  ASSERT_THAT(SaveModel(state, dir.path(), o), IsOk());
  // json.dumps(index, indent=2, sort_keys=True) + "\n", byte for byte.
  EXPECT_EQ(test::ReadAll(dir.File("model.safetensors.index.json")),
            "{\n"
            "  \"metadata\": {\n"
            "    \"total_size\": 50\n"
            "  },\n"
            "  \"weight_map\": {\n"
            "    \"layer_1\": \"model-00001-of-00004.safetensors\",\n"
            "    \"layer_2\": \"model-00003-of-00004.safetensors\",\n"
            "    \"layer_3\": \"model-00002-of-00004.safetensors\",\n"
            "    \"layer_4\": \"model-00004-of-00004.safetensors\",\n"
            "    \"layer_5\": \"model-00004-of-00004.safetensors\"\n"
            "  }\n"
            "}\n");
  EXPECT_THAT(ReadHeader(dir.File("model-00004-of-00004.safetensors")).bytes,
              ::testing::ElementsAre(::testing::Pair("layer_4", 2), ::testing::Pair("layer_5", 2)));
  EXPECT_EQ(ReadHeader(dir.File("model-00002-of-00004.safetensors")).metadata,
            (std::map<std::string, std::string>{{"format", "pt"}}));
  auto back = LoadModelWeights(dir.path());
  ASSERT_THAT(back, IsOk());
  std::map<std::string, at::Tensor> by_name(back->begin(), back->end());
  ASSERT_EQ(by_name.size(), 5u);
  for (const auto& [name, t] : state) EXPECT_TRUE(at::equal(by_name.at(name), t)) << name;
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
  // The byte sizes of the table, read from each shard's own header.
  const SafetensorsHeader h1 = ReadHeader(dir.File(s1)), h2 = ReadHeader(dir.File(s2)),
                          h3 = ReadHeader(dir.File(s3));
  EXPECT_EQ(h1.total, 96);
  EXPECT_EQ(h1.bytes.at("linear1.weight"), 48);
  EXPECT_EQ(h2.total, 40);
  EXPECT_EQ(h2.bytes.at("batchnorm.num_batches_tracked"), 8);
  EXPECT_EQ(h3.total, 100);
  EXPECT_EQ(h3.bytes.at("linear2.weight"), 80);
  // huggingface_hub's format: indent 2, sorted keys, trailing newline.
  const std::string text = test::ReadAll(dir.File("model.safetensors.index.json"));
  EXPECT_EQ(text.back(), '\n');
  EXPECT_THAT(text, HasSubstr("{\n  \"metadata\""));
  auto back = LoadModelWeights(dir.path());
  ASSERT_THAT(back, IsOk());
  ASSERT_EQ(back->size(), state.size());
  std::map<std::string, at::Tensor> by_name(back->begin(), back->end());
  for (const auto& [name, t] : state) EXPECT_TRUE(at::equal(by_name.at(name), t)) << name;

  // A bigger limit: one file; the stale shards and index are gone, files that
  // are not this stem's shards stay.
  dir.Write("notes.txt", "keep");
  dir.Write("model_1-00001-of-00002.safetensors", "another stem");
  ASSERT_THAT(SaveModel(state, dir.path(), {}), IsOk());
  EXPECT_THAT(FilesIn(dir.path()),
              ::testing::ElementsAre("model.safetensors", "model_1-00001-of-00002.safetensors",
                                     "notes.txt"));
  // And back to two shards: the single file goes.
  o.max_shard_size = 150;
  ASSERT_THAT(SaveModel(state, dir.path(), o), IsOk());
  EXPECT_THAT(
      FilesIn(dir.path()),
      ::testing::ElementsAre("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                             "model.safetensors.index.json", "model_1-00001-of-00002.safetensors",
                             "notes.txt"));
  EXPECT_THAT(LoadModelWeights(dir.path()), IsOk());
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
  EXPECT_EQ(ReadHeader(dir.File("model.safetensors")).total, 6 * 4 + 2 * 4);
  std::map<std::string, at::Tensor> by_name(back->begin(), back->end());
  EXPECT_TRUE(at::equal(by_name.at("embed.weight"), shared));
}

// Different views of one storage are different tensors: each is written (as
// a copy), in the shard of the first, even past the limit.
TEST(SaveModel, ViewsOfOneStorageStayTogether) {
  test::TempDir dir;
  at::Tensor fused = at::arange(8, at::kFloat);
  SaveModelOptions o;
  o.max_shard_size = 16;
  ASSERT_THAT(SaveModel({{"q", fused.slice(0, 0, 4)},
                         {"other", at::ones({4})},
                         {"k", fused.slice(0, 4, 8)},
                         {"q_again", fused.slice(0, 0, 4)}},
                        dir.path(), o),
              IsOk());
  nlohmann::json index =
      nlohmann::json::parse(test::ReadAll(dir.File("model.safetensors.index.json")));
  EXPECT_EQ(index["weight_map"], nlohmann::json({{"q", "model-00001-of-00002.safetensors"},
                                                 {"k", "model-00001-of-00002.safetensors"},
                                                 {"other", "model-00002-of-00002.safetensors"}}));
  EXPECT_EQ(index["metadata"]["total_size"], 48);
  auto back = LoadModelWeights(dir.path());
  ASSERT_THAT(back, IsOk());
  std::map<std::string, at::Tensor> by_name(back->begin(), back->end());
  EXPECT_TRUE(at::equal(by_name.at("k"), at::arange(4, 8, at::kFloat)));
  EXPECT_TRUE(at::equal(by_name.at("q"), at::arange(4, at::kFloat)));
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
  // A file where the folder should be: the error names it.
  const std::string blocker = dir.Write("blocker", "x");
  EXPECT_THAT(SaveModel({{"w", at::ones({2})}}, blocker + "/sub"),
              FailsMentioning((blocker + "/sub")));
  EXPECT_THAT(SaveModel({{"w", at::ones({2})}}, dir.path(), {0, "model"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_shard_size")));
  EXPECT_THAT(SaveModel({{"w", at::Tensor()}}, dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"w\"")));
}

// A save that fails part-way (the second shard has a dtype safetensors cannot
// hold) leaves the earlier save untouched and no file of its own.
TEST(SaveModel, FailedSaveWritesNothing) {
  test::TempDir dir;
  StateDict good = {{"a", at::ones({4})}, {"b", at::zeros({4})}};
  ASSERT_THAT(SaveModel(good, dir.path()), IsOk());
  const std::string before = test::ReadAll(dir.File("model.safetensors"));
  SaveModelOptions o;
  o.max_shard_size = 16;
  EXPECT_THAT(SaveModel({{"a", at::full({4}, 7.0)}, {"c", at::ones({2}, at::kComplexFloat)}},
                        dir.path(), o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(dir.path())));
  EXPECT_THAT(FilesIn(dir.path()), ::testing::ElementsAre("model.safetensors"));
  EXPECT_EQ(test::ReadAll(dir.File("model.safetensors")), before);
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
  const std::string whole = test::ReadAll(dir.File("optimizer.bin"));
  dir.Write("truncated.bin", whole.substr(0, whole.size() / 2));
  EXPECT_THAT(LoadOptimizer(a2, dir.File("truncated.bin")),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("truncated.bin")));
  // Saving into a folder that is not there fails naming the file, leaving no temporary.
  EXPECT_THAT(SaveOptimizer(a1, dir.File("no/such/optimizer.bin")),
              FailsMentioning(("no/such/optimizer.bin")));
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
  // Restoring twice repeats it again, randn and randperm included.
  ASSERT_THAT(RestoreRandomStates(*states), IsOk());
  (void)at::rand({8});
  at::Tensor a = at::randn({5});  // an odd count: Box-Muller's cached second sample is state too
  at::Tensor p = at::randperm(20);
  ASSERT_THAT(RestoreRandomStates(*states), IsOk());
  EXPECT_TRUE(at::equal(at::rand({8}), first));
  EXPECT_TRUE(at::equal(at::randn({5}), a));
  EXPECT_TRUE(at::equal(at::randperm(20), p));

  RandomStates bad;
  bad.cpu_state = at::zeros({3}, at::kByte);
  EXPECT_THAT(RestoreRandomStates(bad), FailsMentioning(("CPU random state")));
  EXPECT_THAT(RestoreRandomStates(RandomStates{}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("CPU random state")));
  dir.Write("garbage.pkl", "\x80\x02garbage");
  EXPECT_THAT(LoadRandomStates(dir.File("garbage.pkl")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("garbage.pkl")));
  EXPECT_THAT(LoadRandomStates(dir.File("random_states_1.pkl")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("random_states_1.pkl")));
}

TEST(CheckpointNaming, TotalLimitPrunesNumerically) {
  test::TempDir dir;
  // Saves 0..10 with total_limit 2, each pruning after its folder exists.
  for (int64_t i = 0; i <= 10; ++i) {
    auto plan = PlanCheckpoint(dir.path(), i, 2);
    ASSERT_THAT(plan, IsOk());
    EXPECT_THAT(plan->dir, ::testing::EndsWith("checkpoint_" + std::to_string(i)));
    std::filesystem::create_directories(plan->dir);
    ASSERT_THAT(RemoveCheckpoints(plan->to_prune), IsOk());
  }
  EXPECT_FALSE(std::filesystem::exists(dir.File("checkpoints/checkpoint_0")));
  EXPECT_FALSE(std::filesystem::exists(dir.File("checkpoints/checkpoint_8")));
  EXPECT_TRUE(std::filesystem::exists(dir.File("checkpoints/checkpoint_9")));
  EXPECT_TRUE(std::filesystem::exists(dir.File("checkpoints/checkpoint_10")));
  // checkpoint_10 is later than checkpoint_9 (not lexicographic).
  auto latest = LatestCheckpointDir(dir.path());
  ASSERT_THAT(latest, IsOk());
  EXPECT_THAT(*latest, ::testing::EndsWith("checkpoint_10"));
  EXPECT_THAT(*latest, ::testing::StartsWith(dir.File("checkpoints/")));
  // One more: checkpoint_9 is the oldest (a lexicographic sort would drop _10).
  auto plan = PlanCheckpoint(dir.path(), 11, 2);
  ASSERT_THAT(plan, IsOk());
  EXPECT_THAT(plan->to_prune, ::testing::ElementsAre(dir.File("checkpoints/checkpoint_9")));
  // Planning removes nothing: pruning waits until the new one is in place.
  EXPECT_TRUE(std::filesystem::exists(dir.File("checkpoints/checkpoint_9")));
  EXPECT_THAT(PlanCheckpoint(dir.path(), 10, std::nullopt),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already exists")));
  test::TempDir empty;
  EXPECT_THAT(LatestCheckpointDir(empty.path()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(empty.File("checkpoints"))));
}

// A save in progress (checkpoint_N.tmp-PID) is not a checkpoint: never the
// latest, never counted or pruned; nor is anything else kept there.
TEST(CheckpointNaming, OnlyCheckpointFoldersCount) {
  test::TempDir dir;
  for (const char* name :
       {"checkpoints/checkpoint_1", "checkpoints/checkpoint_2", "checkpoints/checkpoint_3.tmp-4242",
        "checkpoints/notes_99", "checkpoints/checkpoint_7_old"}) {
    std::filesystem::create_directories(dir.File(name));
  }
  dir.Write("checkpoints/checkpoint_8", "a file, not a folder");
  auto latest = LatestCheckpointDir(dir.path());
  ASSERT_THAT(latest, IsOk());
  EXPECT_THAT(*latest, ::testing::EndsWith("checkpoints/checkpoint_2"));
  auto plan = PlanCheckpoint(dir.path(), 3, 1);
  ASSERT_THAT(plan, IsOk());
  EXPECT_THAT(plan->to_prune, ::testing::ElementsAre(dir.File("checkpoints/checkpoint_1"),
                                                     dir.File("checkpoints/checkpoint_2")));
}

TEST(CheckpointNaming, CommitMovesAWholeFolder) {
  test::TempDir dir;
  std::filesystem::create_directories(dir.File("c.tmp-1"));
  dir.Write("c.tmp-1/a.bin", "a");
  ASSERT_THAT(CommitCheckpointDir(dir.File("c.tmp-1"), dir.File("c")), IsOk());
  EXPECT_EQ(test::ReadAll(dir.File("c/a.bin")), "a");
  EXPECT_FALSE(std::filesystem::exists(dir.File("c.tmp-1")));
  // Already moved (another node's process was first): fine.
  EXPECT_THAT(CommitCheckpointDir(dir.File("c.tmp-1"), dir.File("c")), IsOk());
  // Into an existing folder: file by file, other files kept.
  dir.Write("c/mine.txt", "keep");
  std::filesystem::create_directories(dir.File("c.tmp-2"));
  dir.Write("c.tmp-2/a.bin", "new a");
  dir.Write("c.tmp-2/b.bin", "b");
  ASSERT_THAT(CommitCheckpointDir(dir.File("c.tmp-2"), dir.File("c")), IsOk());
  EXPECT_EQ(test::ReadAll(dir.File("c/a.bin")), "new a");
  EXPECT_EQ(test::ReadAll(dir.File("c/b.bin")), "b");
  EXPECT_EQ(test::ReadAll(dir.File("c/mine.txt")), "keep");
  EXPECT_FALSE(std::filesystem::exists(dir.File("c.tmp-2")));
  dir.Write("f", "a file");
  std::filesystem::create_directories(dir.File("f.tmp-3"));
  EXPECT_THAT(CommitCheckpointDir(dir.File("f.tmp-3"), dir.File("f")),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a folder")));
}

}  // namespace
}  // namespace accel::train
