// LoadModel: every device-map spelling, dtypes, offload to disk (the same
// logits as all on the cpu), the stop tokens, and each bad option.
#include "models/load_model.h"

#include <algorithm>
#include <chrono>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "core/file_faults.h"
#include "loader/config.h"
#include "loader/loader.h"
#include "models/make_model.h"
#include "models/quantize.h"
#include "tests/testing/command.h"
#include "tests/testing/fake_cgroup.h"
#include "tests/testing/scoped_env.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::models {
namespace {

using ::accel::test::FakeMemoryCgroup;
using ::accel::test::FilesUnder;
using ::accel::test::IsOk;
using ::accel::test::ScopedEnv;
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
  // A bfloat16 disk placement of a float32 checkpoint is a conversion,
  // written once: by default into a folder of the user's cache, one per
  // model and conversion.
  TempDir cache;
  ScopedEnv cache_dir("ACCEL_CACHE_DIR", cache.path());
  options.device_map = "disk";
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel cached, LoadModel(dir_.path(), options));
  EXPECT_TRUE(at::equal(Logits(cached), Logits(m)));
  std::vector<std::string> written = FilesUnder(cache.path());
  EXPECT_EQ(std::count_if(written.begin(), written.end(),
                          [](const std::string& f) {
                            return absl::EndsWith(f, "/index.json") &&
                                   absl::StrContains(f, "/offload/");
                          }),
            1);
  EXPECT_GT(written.size(), 1u);
  // Or where asked; the cache is left alone.
  options.offload_folder = dir_.path() + "/offload";
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel offloaded, LoadModel(dir_.path(), options));
  EXPECT_TRUE(at::equal(Logits(offloaded), Logits(m)));
  EXPECT_EQ(FilesUnder(cache.path()), written);
  EXPECT_TRUE(std::filesystem::exists(dir_.path() + "/offload/index.json"));
}

TEST_F(LoadModelTest, AnOffloadFolderWithoutRoomIsRefusedBeforeWriting) {
  ModelLoadOptions options = Options("disk");
  options.dtype = "bfloat16";  // a conversion: it must be written
  // procfs has no free blocks, and nothing can be made there.
  options.offload_folder = "/proc/accel-offload-test";
  EXPECT_THAT(LoadModel(dir_.path(), options),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("/proc/accel-offload-test"), HasSubstr("free"))));
  EXPECT_FALSE(std::filesystem::exists(options.offload_folder));
}

// Issue 32: a pre-quantized checkpoint (packed codes, absmax, quant maps,
// the int8 weight and SCB) and the 16-bit tensors beside them are read from
// their shards in place, with layers on disk: nothing is written anywhere.
TEST_F(LoadModelTest, APreQuantizedModelWithLayersOnDiskWritesNothing) {
  for (const char* method : {"nf4", "int8"}) {
    SCOPED_TRACE(method);
    TempDir quantized, cache;
    ScopedEnv cache_dir("ACCEL_CACHE_DIR", cache.path());
    {
      ModelLoadOptions q = Options("cpu");
      q.quantize = method;
      q.double_quant = std::string(method) == "nf4";
      ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel loaded, LoadModel(dir_.path(), q));
      ASSERT_THAT(SaveQuantizedModel(loaded, quantized.path()), IsOk());
    }
    const std::vector<std::string> files = FilesUnder(quantized.path());
    ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel all_cpu, LoadModel(quantized.path(), Options("cpu")));
    for (const char* map : {"disk", "auto"}) {
      SCOPED_TRACE(map);
      ModelLoadOptions options = Options(map);
      if (std::string(map) == "auto") options.max_memory = "cpu=20KB,disk=1GB";
      ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel offloaded, LoadModel(quantized.path(), options));
      EXPECT_TRUE(offloaded.prequantized);
      EXPECT_GT(offloaded.memory.disk_weight_bytes, 0);
      EXPECT_TRUE(at::equal(Logits(offloaded), Logits(all_cpu)));
      // The disk layers came from the shards themselves.
      const dispatch::OffloadStats stats = offloaded.dispatched->stats();
      EXPECT_GT(stats.bytes_read + stats.bytes_mapped, 0);
    }
    EXPECT_EQ(FilesUnder(cache.path()), std::vector<std::string>{});  // nothing written
    EXPECT_EQ(FilesUnder(quantized.path()), files);                   // nor beside the model
  }
}

// The reader's window for a dense model's disk layers is three of the largest
// layers on disk, not three of the largest layer of all (Llama-3-70B's
// 1.96 GiB embedding took 5.87 GiB from its cpu budget). Here the embedding
// and lm_head are the largest layers and the budget leaves nothing in RAM.
TEST(LoadPlanTest, TheReadWindowIsThreeOfTheLargestLayersOnDisk) {
  TempDir model;
  MakeModelOptions o;
  o.hidden_size = 32;
  o.num_layers = 3;
  o.vocab_size = 4096;  // embedding and lm_head 512 KiB each, a layer about 50 KiB
  ASSERT_THAT(MakeModel(model.path(), o), IsOk());
  const int64_t embedding = int64_t{4096} * 32 * 4;
  // A cgroup of 64 MiB, as tools_test's fake root: the runtime and KV
  // reserves take more than its 85%, so the probed cpu budget starts at 0.
  FakeMemoryCgroup cgroup(64 << 20);
  ModelLoadOptions options;
  options.progress = Progress::Style::kSilent;
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadPlan plan, PlanLoad(model.path(), options));
  ASSERT_FALSE(plan.memory.fits);
  EXPECT_GT(plan.memory.disk_weight_bytes, 0);
  // The embedding, lm_head and one decoder layer, all on disk.
  EXPECT_GT(plan.memory.read_buffer_bytes, 2 * embedding);
  EXPECT_LT(plan.memory.read_buffer_bytes, 3 * embedding);
  // What the first reservation took beyond that went back to the budget.
  EXPECT_EQ(plan.memory.budget_bytes, 3 * embedding - plan.memory.read_buffer_bytes);
}

// A model that fits maps its weights in place; they become resident as they
// are used, so the KV cache is planned within what the cpu budget leaves
// beside them (tests/engine/llm_engine_test.cc checks that the engine keeps
// to it).
TEST(LoadPlanTest, AModelThatFitsPlansItsKvCacheBesideItsWeights) {
  TempDir model;
  MakeModelOptions o;
  o.hidden_size = 64;
  o.num_layers = 2;
  ASSERT_THAT(MakeModel(model.path(), o), IsOk());
  // A cgroup of 2 GiB: its 85% less the runtime's reserve is the budget.
  FakeMemoryCgroup cgroup(int64_t{2} << 30);
  ModelLoadOptions options;
  options.progress = Progress::Style::kSilent;
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadPlan plan, PlanLoad(model.path(), options));
  ASSERT_TRUE(plan.memory.fits);
  ASSERT_GT(plan.memory.budget_bytes, 256 << 20);
  EXPECT_EQ(plan.memory.kv_cache_bytes,
            plan.memory.budget_bytes - plan.memory.resident_weight_bytes);
  EXPECT_EQ(plan.memory.resident_bytes(), plan.memory.budget_bytes + plan.memory.runtime_bytes);
  // Under 85% of the cgroup: weights, KV and runtime together.
  EXPECT_LE(plan.memory.resident_bytes(), int64_t{2} << 30);
}

// Issue 32 item 5: what accel-estimate-memory predicts a process holds. The
// expert cache counts only when experts are fetched one by one: a model that
// fits maps its experts in place and never fills it (a Qwen3-30B-A3B that fit
// was predicted 972 MiB over its peak for it).
TEST(MemoryPlanTest, ResidentBytesAddWhatTheProcessHolds) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  MemoryPlan fits;
  fits.resident_weight_bytes = 1000 * kMiB;
  fits.expert_cache_bytes = 300 * kMiB;  // sized, but unused
  fits.runtime_bytes = 500 * kMiB;
  EXPECT_EQ(fits.resident_bytes(), 1500 * kMiB);  // no KV planned: -1
  MemoryPlan offloaded = fits;
  offloaded.fits = false;
  offloaded.offload_experts = true;
  offloaded.read_buffer_bytes = 20 * kMiB;
  offloaded.kv_cache_bytes = 256 * kMiB;
  EXPECT_EQ(offloaded.resident_bytes(), (1000 + 300 + 20 + 256 + 500) * kMiB);
}

TEST_F(LoadModelTest, StopTokensComeFromTheGenerationConfigFirst) {
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel m, LoadModel(dir_.path(), Options("cpu")));
  EXPECT_THAT(m.eos_token_ids(), ElementsAre(299));
  m.generation_config.eos_token_ids = {5, 6};
  EXPECT_THAT(m.eos_token_ids(), ElementsAre(5, 6));
}

// Regression (issue 19): a config.json whose num_hidden_layers leaves checkpoint tensors unused
// loaded silently. As transformers, the load goes on and a warning names them: the first few
// and how many.
TEST_F(LoadModelTest, CheckpointTensorsTheConfigLeavesUnusedAreWarnedAbout) {
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel m, LoadModel(dir_.path(), Options("cpu")));
    EXPECT_THAT(m.warnings, ::testing::IsEmpty());  // the model as made uses every tensor
  }
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config,
                             loader::ReadModelConfig(dir_.path() + "/config.json"));
  ASSERT_EQ(config.num_hidden_layers, 3);
  config.num_hidden_layers = 1;
  std::ofstream(dir_.path() + "/config.json") << config.ToJson();

  ::testing::internal::CaptureStderr();
  auto cut = LoadModel(dir_.path(), Options("cpu"));
  const std::string stderr_text = ::testing::internal::GetCapturedStderr();
  ASSERT_THAT(cut, IsOk());
  ASSERT_EQ(cut->warnings.size(), 1u);
  const std::string& warning = cut->warnings[0];
  // Layers 1 and 2 of a llama: 9 tensors each (4 attention projections, 3 MLP, 2 norms).
  EXPECT_THAT(warning, AllOf(HasSubstr("Some weights of the model checkpoint at " + dir_.path() +
                                       " were not used when initializing LlamaForCausalLM"),
                             HasSubstr("18 tensors"), HasSubstr("model.layers.1."),
                             HasSubstr("(13 more)"), HasSubstr("num_hidden_layers (1)")))
      << warning;
  EXPECT_THAT(warning, ::testing::Not(HasSubstr("model.layers.0.")));
  EXPECT_THAT(stderr_text, HasSubstr(warning));  // the operator sees it too
}

// GPT-2 checkpoints hold each layer's causal mask (h.N.attn.bias, h.N.attn.masked_bias), which
// transformers' model holds as buffers and never reports; accel computes its mask and does not
// report them either, but a stray tensor beside them is still named.
TEST(LoadModelGpt2Test, CausalMaskTensorsAreNotReportedAsUnused) {
  TempDir dir;
  MakeModelOptions o;
  o.family = "gpt2";
  o.hidden_size = 32;
  o.num_layers = 1;
  o.vocab_size = 300;
  ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
  const std::string file = dir.path() + "/model.safetensors";
  std::vector<loader::NamedTensor> tensors;
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(file));
    for (const loader::Checkpoint::Entry& entry : ckpt.tensors()) {
      ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor t, ckpt.Tensor(entry.info.name));
      tensors.emplace_back(entry.info.name, t.clone());
    }
  }
  tensors.emplace_back("h.0.attn.bias", at::ones({1, 1, 8, 8}));
  tensors.emplace_back("h.0.attn.masked_bias", at::scalar_tensor(-1e4));
  ASSERT_THAT(loader::WriteSafetensors(file, tensors, {{"format", "pt"}}), IsOk());
  ModelLoadOptions options;
  options.device_map = "cpu";
  options.progress = Progress::Style::kSilent;
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel m, LoadModel(dir.path(), options));
    EXPECT_THAT(m.warnings, ::testing::IsEmpty());
  }
  tensors.emplace_back("h.0.attn.stray", at::ones({2}));
  ASSERT_THAT(loader::WriteSafetensors(file, tensors, {{"format", "pt"}}), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel m, LoadModel(dir.path(), options));
  ASSERT_EQ(m.warnings.size(), 1u);
  EXPECT_THAT(m.warnings[0], AllOf(HasSubstr("1 tensor (h.0.attn.stray)"),
                                   ::testing::Not(HasSubstr("masked_bias"))));
}

// Regression (issue 19): an eos_token_id outside [0, vocab_size) loaded silently. transformers
// accepts it (it can never be generated); accel warns naming the file and the field, and drops
// it.
TEST_F(LoadModelTest, EosIdsOutsideTheVocabularyAreWarnedAboutAndDropped) {
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config,
                             loader::ReadModelConfig(dir_.path() + "/config.json"));
  config.eos_token_ids = {5000, 7};  // a negative id is refused by the config parser
  std::ofstream(dir_.path() + "/config.json") << config.ToJson();
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::GenerationConfig generation,
                             loader::ReadGenerationConfig(dir_.path() + "/generation_config.json"));
  generation.eos_token_ids = {299, 300, 100000};  // vocab_size is 300
  std::ofstream(dir_.path() + "/generation_config.json") << generation.ToJson();

  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel m, LoadModel(dir_.path(), Options("cpu")));
  EXPECT_THAT(m.config.eos_token_ids, ElementsAre(7));
  EXPECT_THAT(m.generation_config.eos_token_ids, ElementsAre(299));
  EXPECT_THAT(m.eos_token_ids(), ElementsAre(299));
  EXPECT_THAT(
      m.warnings,
      ElementsAre(
          AllOf(::testing::StartsWith("config.json: eos_token_id 5000 "), HasSubstr("[0, 300)")),
          AllOf(::testing::StartsWith("generation_config.json: eos_token_id 300, 100000 "),
                HasSubstr("[0, 300)"))));

  // When every id of generation_config.json goes, config.json's apply, as without the file's.
  generation.eos_token_ids = {300};
  std::ofstream(dir_.path() + "/generation_config.json") << generation.ToJson();
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel fallback, LoadModel(dir_.path(), Options("cpu")));
  EXPECT_THAT(fallback.eos_token_ids(), ElementsAre(7));
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

// Rewrites one key of `dir`/config.json.
void SetConfigKey(const std::string& dir, const std::string& key, nlohmann::json value) {
  nlohmann::json config = nlohmann::json::parse(test::ReadAll(dir + "/config.json"));
  config[key] = std::move(value);
  std::ofstream(dir + "/config.json") << config.dump(2);
}

// A config.json asking for far more layers (or experts) than the checkpoint
// holds is refused from the checkpoint's headers, before the model's
// skeleton (whose cost grows with the layers) is built: it once took 2.6 GB
// and a minute to find the tensors missing.
TEST_F(LoadModelTest, AConfigAskingForMoreLayersThanTheCheckpointIsRefusedFirst) {
  for (int64_t layers : {int64_t{4}, int64_t{100000}, int64_t{1} << 26}) {
    SetConfigKey(dir_.path(), "num_hidden_layers", layers);
    EXPECT_THAT(LoadModel(dir_.path(), Options("cpu")),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(absl::StrCat("num_hidden_layers is ", layers)),
                               HasSubstr("layers up to model.layers.2 only"))));
  }
  TempDir moe;
  MakeModelOptions o;
  o.family = "mixtral";
  o.hidden_size = 32;
  o.num_layers = 2;
  o.vocab_size = 300;
  o.num_experts = 4;
  o.num_experts_per_tok = 2;
  ASSERT_THAT(MakeModel(moe.path(), o), IsOk());
  SetConfigKey(moe.path(), "num_local_experts", 100000);
  EXPECT_THAT(LoadModel(moe.path(), Options("cpu")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("100000 experts"),
                             HasSubstr("model.layers.1.block_sparse_moe.experts.3 only"))));
}

// Files in a model folder that are not regular files (a FIFO here: opening
// one waits for a writer) are refused by name instead of hanging the load.
TEST_F(LoadModelTest, AFifoInTheModelFolderIsRefusedByName) {
  for (const char* name : {"config.json", "generation_config.json", "model.safetensors"}) {
    SCOPED_TRACE(name);
    TempDir copy;
    for (const auto& entry : std::filesystem::directory_iterator(dir_.path())) {
      std::filesystem::copy(entry.path(), copy.File(entry.path().filename().string()));
    }
    std::filesystem::remove(copy.File(name));
    ASSERT_EQ(::mkfifo(copy.File(name).c_str(), 0600), 0);
    // Were the load to wait on the FIFO, a writer would free it after 10 s
    // and the test would fail rather than hang.
    auto load =
        std::async(std::launch::async, [&] { return LoadModel(copy.path(), Options("cpu")); });
    if (load.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      ADD_FAILURE() << "the load waits on the FIFO";
      const int fd = ::open(copy.File(name).c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
    }
    EXPECT_THAT(load.get(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     AllOf(HasSubstr(copy.File(name)), HasSubstr("FIFO"))));
  }
}

// The tokenizer is checked against the model when a server starts: ids
// past config.json's vocab_size are refused naming tokenizer.json.
TEST_F(LoadModelTest, ATokenizerWithIdsPastTheVocabularyIsRefused) {
  const std::string path = dir_.path() + "/tokenizer.json";
  ACCEL_ASSERT_OK_AND_ASSIGN(tokenizer::Tokenizer tokenizer, tokenizer::Tokenizer::FromFile(path));
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config,
                             loader::ReadModelConfig(dir_.path() + "/config.json"));
  EXPECT_THAT(CheckTokenizer(tokenizer, config, path), IsOk());
  config.vocab_size = tokenizer.vocab_size() - 1;
  EXPECT_THAT(CheckTokenizer(tokenizer, config, path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("past config.json's vocab_size"))));
}

absl::StatusOr<at::Tensor> TryLogits(LoadedModel& m) {
  c10::InferenceMode inference;
  return m.model->Forward(at::tensor({1, 2, 3, 4}, at::kLong), {{nullptr, 4}}, Logits::kAll,
                          m.dispatched.get());
}

// Weights files replaced (renamed over) or deleted while serving change
// nothing: the model holds the files it loaded (their mappings, and the
// descriptors disk reads go through).
TEST_F(LoadModelTest, WeightsFilesReplacedOrDeletedWhileServingChangeNothing) {
  ResetModelFileFaultForTesting();
  ModelLoadOptions split = Options("auto");
  split.max_memory = "cpu=100KiB,disk=1GiB";
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel m, LoadModel(dir_.path(), split));
  ASSERT_THAT(m.device_map.ToJson(), HasSubstr("disk"));
  const at::Tensor before = Logits(m);
  // Another model's weights renamed over the file, then deleted altogether.
  TempDir other;
  MakeModelOptions o;
  o.hidden_size = 32;
  o.num_layers = 3;
  o.vocab_size = 300;
  o.seed = 99;
  ASSERT_THAT(MakeModel(other.path(), o), IsOk());
  std::filesystem::rename(other.File("model.safetensors"), dir_.File("model.safetensors"));
  EXPECT_TRUE(at::equal(Logits(m), before));
  std::filesystem::remove(dir_.File("model.safetensors"));
  EXPECT_TRUE(at::equal(Logits(m), before));
  EXPECT_EQ(ModelFileFault(), std::nullopt);
}

// A weights file truncated in place while serving (cp over it starts so):
// the read of a mapped page past its new end is a SIGBUS, mended and
// recorded (core/file_faults.h), and every step fails from then on naming
// the file, so no logits computed from the lost bytes are returned.
TEST_F(LoadModelTest, AWeightsFileTruncatedWhileServingFailsEveryStepNamingIt) {
  InstallMappedFileFaultHandler();
  ResetModelFileFaultForTesting();
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel m, LoadModel(dir_.path(), Options("cpu")));
  EXPECT_THAT(TryLogits(m), IsOk());
  const std::string file = dir_.File("model.safetensors");
  ASSERT_EQ(::truncate(file.c_str(), 64), 0);
  for (int step = 0; step < 2; ++step) {
    EXPECT_THAT(TryLogits(m), StatusIs(absl::StatusCode::kDataLoss,
                                       AllOf(HasSubstr(file), HasSubstr("every step fails"))));
  }
  EXPECT_GE(MappedFileFaultCount(), 1);
  m = LoadedModel();                // its mapping, zero page and all, goes
  ResetModelFileFaultForTesting();  // for the tests after this one in the same process
}

// pytorch_model.bin (torch.save's format, written by Python's pickler:
// tests/loader/torch_save.py) loads to the same logits as the same weights
// in safetensors, on the cpu and offloaded to disk, where a tensor stored as
// a strided view is copied into the offload folder (or refused by name
// without one).
TEST_F(LoadModelTest, APytorchModelBinLoadsToTheSameLogitsAsSafetensors) {
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel reference, LoadModel(dir_.path(), Options("cpu")));
  const at::Tensor expected = Logits(reference);
  TempDir bin;
  for (const char* file : {"config.json", "generation_config.json", "tokenizer.json"}) {
    std::filesystem::copy_file(dir_.path() + "/" + file, bin.File(file));
  }
  const std::string strided = "model.layers.1.mlp.down_proj.weight";
  const test::CommandResult made = test::CommandOutput(
      absl::StrCat("python3 ", ACCEL_TORCH_SAVE_PY, " ", dir_.path(), "/model.safetensors ",
                   bin.File("pytorch_model.bin"), " --ordered --transpose ", strided, " 2>&1"));
  ASSERT_EQ(made.exit_code, 0) << made.out;
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel from_bin, LoadModel(bin.path(), Options("cpu")));
  EXPECT_TRUE(at::equal(Logits(from_bin), expected));

  const std::string map = bin.File("map.json");
  std::ofstream(map) << R"({"model.embed_tokens": "cpu", "model.layers": "disk",
                           "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})";
  ModelLoadOptions tight = Options(map);
  {
    // Without an offload folder, the copy goes to the default one in the
    // user's cache (issue 32), which is made for it.
    TempDir cache;
    ScopedEnv cache_dir("ACCEL_CACHE_DIR", cache.path());
    ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel cached, LoadModel(bin.path(), tight));
    EXPECT_TRUE(at::equal(Logits(cached), expected));
    const std::vector<std::string> written = FilesUnder(cache.path());
    EXPECT_EQ(std::count_if(
                  written.begin(), written.end(),
                  [&](const std::string& f) { return absl::EndsWith(f, "/" + strided + ".dat"); }),
              1);
  }
  tight.offload_folder = bin.File("offload");
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel split, LoadModel(bin.path(), tight));
  EXPECT_THAT(split.device_map.ToJson(), HasSubstr("disk"));
  EXPECT_TRUE(at::equal(Logits(split), expected));
  EXPECT_TRUE(std::filesystem::exists(bin.File("offload/" + strided + ".dat")));
}

}  // namespace
}  // namespace accel::models
