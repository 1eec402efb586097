// LoadModel: every device-map spelling, dtypes, offload to disk (the same
// logits as all on the cpu), the stop tokens, and each bad option.
#include "models/load_model.h"

#include <fstream>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "loader/loader.h"
#include "models/make_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::models {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class LoadModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MakeModelOptions o;
    o.hidden_size = 32;
    o.num_layers = 3;
    o.vocab_size = 300;
    ASSERT_THAT(MakeModel(dir_.path(), o), IsOk());
  }

  ModelLoadOptions Options(const std::string& device_map) {
    ModelLoadOptions options;
    options.device_map = device_map;
    options.progress = Progress::Style::kSilent;
    return options;
  }

  static at::Tensor Logits(LoadedModel& m) {
    c10::InferenceMode inference;
    auto logits = m.model->Forward(at::tensor({1, 2, 3, 4}, at::kLong), {{nullptr, 4}},
                                   Logits::kAll, m.dispatched.get());
    EXPECT_THAT(logits, IsOk());
    return logits.ok() ? *logits : at::Tensor();
  }

  TempDir dir_;
};

TEST_F(LoadModelTest, AutoPlansWithinMaxMemoryAndOffloadsTheRestToDisk) {
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel all_cpu, LoadModel(dir_.path(), Options("cpu")));
  EXPECT_EQ(all_cpu.device_map.ToJson(), R"({"":"cpu"})");
  EXPECT_EQ(all_cpu.dtype, at::kFloat);
  // Room for about two layers on the cpu: the rest goes to disk, served from the
  // checkpoint's own file (float32 to float32 needs no offload folder).
  ModelLoadOptions tight = Options("auto");
  tight.max_memory = "cpu=200KB";
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel split, LoadModel(dir_.path(), tight));
  EXPECT_THAT(split.device_map.ToJson(), HasSubstr("disk"));
  EXPECT_THAT(split.device_map.ToJson(), HasSubstr("cpu"));
  EXPECT_TRUE(at::equal(Logits(split), Logits(all_cpu)));
  EXPECT_GT(split.dispatched->stats().fetches, 0);
}

TEST_F(LoadModelTest, ADeviceMapFileIsUsedAsItIs) {
  const std::string path = dir_.path() + "/map.json";
  std::ofstream(path) << R"({"model.embed_tokens": "cpu", "model.layers": "disk",
                            "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})";
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel m, LoadModel(dir_.path(), Options(path)));
  EXPECT_EQ(m.device_map.Lookup("model.layers.2.mlp")->ToString(), "disk");
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel all_cpu, LoadModel(dir_.path(), Options("cpu")));
  EXPECT_TRUE(at::equal(Logits(m), Logits(all_cpu)));
}

TEST_F(LoadModelTest, DTypeFollowsTheOptionOrTheConfig) {
  ModelLoadOptions options = Options("cpu");
  options.dtype = "bfloat16";
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel m, LoadModel(dir_.path(), options));
  EXPECT_EQ(m.dtype, at::kBFloat16);
  EXPECT_EQ(Logits(m).scalar_type(), at::kFloat);  // logits are always float32
  // A bfloat16 disk placement of a float32 checkpoint needs the offload folder.
  options.device_map = "disk";
  EXPECT_THAT(LoadModel(dir_.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("offload")));
  options.offload_folder = dir_.path() + "/offload";
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel offloaded, LoadModel(dir_.path(), options));
  EXPECT_TRUE(at::equal(Logits(offloaded), Logits(m)));
}

TEST_F(LoadModelTest, StopTokensComeFromTheGenerationConfigFirst) {
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel m, LoadModel(dir_.path(), Options("cpu")));
  EXPECT_THAT(m.eos_token_ids(), ElementsAre(299));
  m.generation_config.eos_token_ids = {5, 6};
  EXPECT_THAT(m.eos_token_ids(), ElementsAre(5, 6));
}

TEST_F(LoadModelTest, BadOptionsAreClearErrors) {
  EXPECT_THAT(LoadModel(dir_.path() + "/nowhere", Options("cpu")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("config.json")));
  EXPECT_THAT(LoadModel(dir_.path(), Options("fastest")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device_map 'fastest'")));
  ModelLoadOptions options = Options("cpu");
  options.dtype = "int8";
  EXPECT_THAT(LoadModel(dir_.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype 'int8'")));
  options = Options("auto");
  options.max_memory = "cpu=lots";
  EXPECT_THAT(LoadModel(dir_.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_memory")));
  options = Options("cpu");
  options.max_memory = "cpu=1GB";
  EXPECT_THAT(LoadModel(dir_.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot go with")));
  if (!at::hasCUDA()) {
    EXPECT_THAT(LoadModel(dir_.path(), Options("0")),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no CUDA")));
    options = Options("auto");
    options.max_memory = "0=1GB,cpu=1GB";
    EXPECT_THAT(LoadModel(dir_.path(), options),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no CUDA")));
  }
  const std::string bad_map = dir_.path() + "/bad.json";
  std::ofstream(bad_map) << R"({"model": "moon"})";
  EXPECT_THAT(LoadModel(dir_.path(), Options(bad_map)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad.json")));
  options = Options("cpu");
  options.execution_device = "disk";
  EXPECT_THAT(LoadModel(dir_.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("execution_device 'disk'")));
  options.execution_device = "gpu";
  EXPECT_THAT(LoadModel(dir_.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("execution_device 'gpu'")));
  if (!at::hasCUDA()) {
    // A model held in RAM streamed through a GPU this build cannot use.
    options.execution_device = "cuda:0";
    EXPECT_THAT(LoadModel(dir_.path(), options),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("execution device cuda:0"), HasSubstr("no CUDA"))));
  }
  options = Options("auto");
  options.max_memory = "cpu=1MB";
  options.expert_cache = "a lot";
  EXPECT_THAT(LoadModel(dir_.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert_cache")));
}

// The cpu as execution device is the default's own: the same logits.
TEST_F(LoadModelTest, TheCpuAsExecutionDeviceChangesNothing) {
  ModelLoadOptions options = Options("auto");
  options.max_memory = "cpu=100KiB,disk=1GiB";
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel by_default, LoadModel(dir_.path(), options));
  options.execution_device = "cpu";
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel on_cpu, LoadModel(dir_.path(), options));
  EXPECT_EQ(on_cpu.dispatched->main_device(), at::Device(at::kCPU));
  c10::InferenceMode inference;
  const at::Tensor ids = at::tensor(std::vector<int64_t>{1, 2, 3}, at::kLong);
  const SequenceChunk chunk{nullptr, 3};
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor a, by_default.model->Forward(ids, {chunk}, Logits::kAll,
                                                                     by_default.dispatched.get()));
  ACCEL_ASSERT_OK_AND_ASSIGN(
      at::Tensor b, on_cpu.model->Forward(ids, {chunk}, Logits::kAll, on_cpu.dispatched.get()));
  EXPECT_TRUE(at::equal(a, b));
}

}  // namespace
}  // namespace accel::models
