#include "models/make_model.h"

#include <set>
#include <string>

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "loader/config.h"
#include "loader/loader.h"
#include "models/families.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tokenizer/tokenizer.h"

namespace accel::models {
namespace {

using ::accel::test::IsOk;
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
