#include "models/make_model.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "core/dtype.h"
#include "core/progress.h"
#include "loader/config.h"
#include "loader/loader.h"
#include "models/families.h"
#include "models/load_model.h"
#include "models/quantize.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tokenizer/tokenizer.h"

namespace accel::models {
namespace {

using ::accel::test::IsOk;
using ::accel::test::ReadAll;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::accel::tokenizer::Tokenizer;
using ::testing::HasSubstr;

TEST(MakeModelTest, WritesAFolderThatLoadsBack) {
  TempDir dir;
  MakeModelOptions options;
  options.num_kv_heads = 2;
  ACCEL_ASSERT_OK_AND_ASSIGN(MadeModel made, MakeModel(dir.path(), options));

  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config,
                             loader::ReadModelConfig(dir.File("config.json")));
  EXPECT_EQ(config.architectures[0], "LlamaForCausalLM");
  EXPECT_EQ(config.kv_heads(), 2);
  EXPECT_EQ(config.num_hidden_layers, 2);
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::GenerationConfig gen,
                             loader::ReadGenerationConfig(dir.File("generation_config.json")));
  EXPECT_EQ(gen.eos_token_ids, config.eos_token_ids);

  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
  ACCEL_ASSERT_OK_AND_ASSIGN(auto specs, CheckpointTensors(config, c10::ScalarType::Float));
  ASSERT_EQ(ckpt.tensors().size(), specs.size());
  for (const auto& spec : specs) {
    const loader::Checkpoint::Entry* entry = ckpt.Find(spec.name);
    ASSERT_NE(entry, nullptr) << spec.name;
    EXPECT_EQ(entry->info.shape, spec.shape);
  }
  EXPECT_EQ(made.bytes, ckpt.total_bytes());

  // N(0, 0.02) matrices, 1 + N(0, 0.02) norms.
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor w, ckpt.Tensor("model.embed_tokens.weight"));
  EXPECT_NEAR(w.std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(w.mean().item<double>(), 0.0, 0.002);
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor norm, ckpt.Tensor("model.norm.weight"));
  EXPECT_NEAR(norm.mean().item<double>(), 1.0, 0.01);
}

TEST(MakeModelTest, SameSeedSameBytesOtherSeedOtherBytes) {
  TempDir a, b, c;
  MakeModelOptions options;
  options.dtype = c10::ScalarType::BFloat16;
  ASSERT_THAT(MakeModel(a.path(), options), IsOk());
  ASSERT_THAT(MakeModel(b.path(), options), IsOk());
  options.seed = 1;
  ASSERT_THAT(MakeModel(c.path(), options), IsOk());
  EXPECT_EQ(test::ReadAll(a.File("model.safetensors")), test::ReadAll(b.File("model.safetensors")));
  EXPECT_NE(test::ReadAll(a.File("model.safetensors")), test::ReadAll(c.File("model.safetensors")));
  EXPECT_EQ(test::ReadAll(a.File("tokenizer.json")), test::ReadAll(b.File("tokenizer.json")));
}

TEST(MakeModelTest, TensorsDoNotDependOnSharding) {
  TempDir one, many;
  MakeModelOptions options;
  ASSERT_THAT(MakeModel(one.path(), options), IsOk());
  options.max_shard_size = 100000;
  ACCEL_ASSERT_OK_AND_ASSIGN(MadeModel made, MakeModel(many.path(), options));
  EXPECT_GT(made.files, 3);
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint a, loader::Checkpoint::Open(one.path()));
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint b, loader::Checkpoint::Open(many.path()));
  for (const auto& entry : a.tensors()) {
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor x, a.Tensor(entry.info.name));
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y, b.Tensor(entry.info.name));
    EXPECT_TRUE(at::equal(x, y)) << entry.info.name;
  }
}

TEST(MakeModelTest, SizeFlagPicksLayersToMatch) {
  MakeModelOptions options;
  options.hidden_size = 128;
  options.target_bytes = 8 << 20;
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config, MakeModelConfig(options));
  ACCEL_ASSERT_OK_AND_ASSIGN(auto specs, CheckpointTensors(config, c10::ScalarType::Float));
  int64_t bytes = 0;
  for (const auto& s : specs) {
    int64_t n = 4;
    for (int64_t d : s.shape) n *= d;
    bytes += n;
  }
  // Within half a layer of the target: a layer is 4*(4*128*128 + 3*128*344 + 2*128) bytes.
  const int64_t layer = 4 * (4 * 128 * 128 + 3 * 128 * 344 + 2 * 128);
  EXPECT_LE(std::abs(bytes - (8 << 20)), layer / 2 + 1);
}

TEST(MakeModelTest, TokenizerJsonIsAByteLevelBpeThatFitsTheVocabulary) {
  TempDir dir;
  MakeModelOptions options;
  options.family = "gpt2";
  options.vocab_size = 300;
  ASSERT_THAT(MakeModel(dir.path(), options), IsOk());
  nlohmann::json tok = nlohmann::json::parse(test::ReadAll(dir.File("tokenizer.json")));
  EXPECT_EQ(tok["model"]["type"], "BPE");
  EXPECT_EQ(tok["pre_tokenizer"]["type"], "ByteLevel");
  const auto& vocab = tok["model"]["vocab"];
  std::set<int64_t> ids;
  for (const auto& [token, id] : vocab.items()) {
    EXPECT_LT(id.get<int64_t>(), 300);
    ids.insert(id.get<int64_t>());
  }
  // The special tokens are in the vocabulary at their ids, which HF requires
  // to keep those ids (it gives an added token outside it the next free id).
  EXPECT_EQ(vocab["<|startoftext|>"], 298);
  EXPECT_EQ(vocab["<|endoftext|>"], 299);
  EXPECT_EQ(ids.size(), vocab.size());  // no id used twice
  EXPECT_EQ(vocab["!"], 0);             // GPT-2's byte order: printable bytes first
  EXPECT_EQ(vocab["Ġ"], 220);           // the space byte
  for (const auto& merge : tok["model"]["merges"]) {
    std::string m = merge.get<std::string>();
    auto space = m.find(' ');
    ASSERT_NE(space, std::string::npos);
    EXPECT_TRUE(vocab.contains(m.substr(0, space))) << m;
    EXPECT_TRUE(vocab.contains(m.substr(0, space) + m.substr(space + 1))) << m;
  }
  EXPECT_EQ(tok["added_tokens"][1]["content"], "<|endoftext|>");
  EXPECT_EQ(tok["added_tokens"][1]["id"], 299);
}

TEST(MakeModelTest, TokenizerJsonLoadsWithTheConfigsSpecialTokens) {
  TempDir dir;
  MakeModelOptions options;
  options.vocab_size = 1000;
  ASSERT_THAT(MakeModel(dir.path(), options), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config,
                             loader::ReadModelConfig(dir.File("config.json")));
  ACCEL_ASSERT_OK_AND_ASSIGN(Tokenizer tok, Tokenizer::FromFile(dir.File("tokenizer.json")));
  EXPECT_EQ(tok.vocab_size(), config.vocab_size);
  EXPECT_EQ(tok.TokenToId("<|begin_of_text|>"), config.bos_token_id);
  EXPECT_EQ(tok.TokenToId("<|end_of_text|>"), config.eos_token_ids[0]);
  EXPECT_TRUE(tok.IsSpecial(*config.bos_token_id));
  const std::string text = "The server reads the weights once.\n\tDone: 42 \xC3\xA9t\xC3\xA9s!";
  ACCEL_ASSERT_OK_AND_ASSIGN(std::vector<int64_t> ids, tok.Encode(text, true));
  EXPECT_LT(ids.size(), text.size());
  ACCEL_ASSERT_OK_AND_ASSIGN(std::string decoded, tok.Decode(ids, false));
  EXPECT_EQ(decoded, text);
}

TEST(MakeModelTest, BadOptionsNameTheFlag) {
  TempDir dir;
  MakeModelOptions options;
  options.family = "falcon";
  EXPECT_THAT(MakeModel(dir.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--family")));
  options = {};
  options.num_heads = 5;
  EXPECT_THAT(MakeModel(dir.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--num_heads")));
  options = {};
  options.num_kv_heads = 3;
  EXPECT_THAT(MakeModel(dir.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--num_kv_heads")));
  options = {};
  options.vocab_size = 100;
  EXPECT_THAT(MakeModel(dir.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--vocab_size")));
  options = {};
  options.dtype = c10::ScalarType::Int;
  EXPECT_THAT(MakeModel(dir.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--dtype")));
}

}  // namespace
}  // namespace accel::models

namespace accel::models {
namespace {

using ::accel::test::IsOk;
using ::accel::test::ReadAll;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::HasSubstr;

std::vector<std::string> FileNames(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// accel-make-model --quantize against accel-quantize of the float model made
// with the same options: every file, byte for byte (shards, index, config).
TEST(MakeModelQuantizeTest, WritesWhatAccelQuantizeWritesFromTheSameWeights) {
  struct Case {
    const char* family;
    const char* method;
    bool double_quant;
    const char* dtype;
    int64_t max_shard_size;
  };
  for (const Case& c : {Case{"mixtral", "nf4", false, "bfloat16", 5'000'000'000},
                        Case{"mixtral", "fp4", true, "float32", 300'000},
                        Case{"llama", "int8", false, "float16", 150'000},
                        Case{"gpt2", "nf4", true, "bfloat16", 50'000},
                        Case{"qwen2_moe", "nf4", false, "float32", 5'000'000'000}}) {
    SCOPED_TRACE(absl::StrCat(c.family, " ", c.method, c.double_quant ? " +dq " : " ", c.dtype));
    MakeModelOptions options;
    options.family = c.family;
    options.hidden_size = 64;
    options.num_layers = 2;
    options.attention_bias = std::string(c.family) == "llama";
    options.dtype = *ParseDType(c.dtype);
    options.max_shard_size = c.max_shard_size;
    TempDir dense, by_quantize, by_maker;
    ASSERT_THAT(MakeModel(dense.path(), options), IsOk());
    ModelLoadOptions load;
    load.device_map = "cpu";
    load.quantize = c.method;
    load.double_quant = c.double_quant;
    load.progress = Progress::Style::kSilent;
    ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel loaded, LoadModel(dense.path(), load));
    ASSERT_THAT(SaveQuantizedModel(loaded, by_quantize.path(), c.max_shard_size), IsOk());

    options.quantize = c.method;
    options.double_quant = c.double_quant;
    ACCEL_ASSERT_OK_AND_ASSIGN(MadeModel made, MakeModel(by_maker.path(), options));
    const std::vector<std::string> names = FileNames(by_quantize.path());
    ASSERT_EQ(FileNames(by_maker.path()), names);
    EXPECT_EQ(made.files > 1, c.max_shard_size < 1'000'000);
    for (const std::string& name : names) {
      EXPECT_TRUE(ReadAll(by_maker.File(name)) == ReadAll(by_quantize.File(name))) << name;
    }
    // And it loads as a pre-quantized model.
    ModelLoadOptions as_stored;
    as_stored.device_map = "cpu";
    as_stored.progress = Progress::Style::kSilent;
    ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel back, LoadModel(by_maker.path(), as_stored));
    EXPECT_TRUE(back.prequantized);
    EXPECT_EQ(back.quantization.size(), loaded.quantization.size());
  }
}

// A layer's tensors sit together in the checkpoint's order, as transformers
// saves them: the weight, its quant state, the blob, then the next layer.
TEST(MakeModelQuantizeTest, ALayersTensorsAreTogetherInStateDictOrder) {
  MakeModelOptions options;
  options.family = "llama";
  options.attention_bias = true;
  options.quantize = "nf4";
  options.double_quant = true;
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), options), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config,
                             loader::ReadModelConfig(dir.File("config.json")));
  ACCEL_ASSERT_OK_AND_ASSIGN(dispatch::ModuleTree tree, ModuleTreeFor(config, at::kFloat));
  QuantizeOptions asked;
  asked.method = "nf4";
  asked.double_quant = true;
  ACCEL_ASSERT_OK_AND_ASSIGN(quant::BnbQuantizationConfig bnb, BnbConfigFor(asked));
  ACCEL_ASSERT_OK_AND_ASSIGN(QuantPlan plan, PlanQuantization(tree, bnb));
  ACCEL_ASSERT_OK_AND_ASSIGN(
      std::vector<loader::TensorSpec> specs,
      QuantizedCheckpointSpecs(tree, plan,
                               [](const std::string&) -> absl::StatusOr<int64_t> { return 1; }));
  std::vector<std::string> names;
  for (const auto& s : specs) names.push_back(s.name);
  const std::string q = "model.layers.0.self_attn.q_proj";
  auto at = std::find(names.begin(), names.end(), q + ".weight");
  ASSERT_NE(at, names.end());
  EXPECT_EQ(std::vector<std::string>(at, at + 7),
            (std::vector<std::string>{q + ".weight", q + ".bias", q + ".weight.absmax",
                                      q + ".weight.quant_map", q + ".weight.nested_absmax",
                                      q + ".weight.nested_quant_map",
                                      q + ".weight.quant_state.bitsandbytes__nf4"}));
  EXPECT_EQ(names.front(), "model.embed_tokens.weight");
  EXPECT_EQ(names.back(), "lm_head.weight");  // kept as it is
}

TEST(MakeModelQuantizeTest, ARealConfigIsMadeAsItSays) {
  // A Mixtral-shaped config.json as the hub has it, scaled down.
  const std::string text = R"({
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "vocab_size": 300, "max_position_embeddings": 128,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "sliding_window": null,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    "router_aux_loss_coef": 0.02,
    "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true}})";
  TempDir src, dir;
  const std::string path = src.Write("config.json", text);
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config, loader::ReadModelConfig(path));
  MakeModelOptions options;
  options.config = config;
  options.dtype = at::kBFloat16;
  options.quantize = "nf4";
  ACCEL_ASSERT_OK_AND_ASSIGN(MadeModel made, MakeModel(dir.path(), options));
  EXPECT_EQ(made.config.moe.num_experts, 4);
  const nlohmann::json written = nlohmann::json::parse(ReadAll(dir.File("config.json")));
  EXPECT_EQ(written["num_local_experts"], 4);
  EXPECT_EQ(written["router_aux_loss_coef"], 0.02);
  EXPECT_EQ(written["rope_theta"], 1000000.0);
  EXPECT_EQ(written["bos_token_id"], 298);  // the made tokenizer's
  EXPECT_EQ(written["eos_token_id"], 299);
  EXPECT_EQ(written["quantization_config"]["bnb_4bit_quant_type"], "nf4");
  EXPECT_EQ(written["torch_dtype"], "bfloat16");
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
  EXPECT_NE(ckpt.Find("model.layers.1.block_sparse_moe.experts.3.w2.weight.absmax"), nullptr);
  EXPECT_EQ(ckpt.Find("model.layers.1.block_sparse_moe.gate.weight")->info.dtype, "BF16");

  options.quantize = "int4";
  EXPECT_THAT(MakeModel(dir.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("quantize")));
  options.quantize = "none";
  options.double_quant = true;
  EXPECT_THAT(MakeModel(dir.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("double_quant")));
}

}  // namespace
}  // namespace accel::models
