#include "models/families.h"

#include <algorithm>
#include <map>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::models {
namespace {

using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

loader::ModelConfig Config(const char* arch, const char* type) {
  loader::ModelConfig c;
  c.architectures = {arch};
  c.model_type = type;
  c.vocab_size = 100;
  c.hidden_size = 32;
  c.intermediate_size = 80;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  return c;
}

std::map<std::string, std::vector<int64_t>> Shapes(const loader::ModelConfig& c) {
  auto specs = CheckpointTensors(c, c10::ScalarType::BFloat16);
  EXPECT_TRUE(specs.ok()) << specs.status();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& s : *specs) {
    EXPECT_EQ(s.dtype, c10::ScalarType::BFloat16);
    shapes[s.name] = s.shape;
  }
  return shapes;
}

TEST(FamiliesTest, LlamaWithGroupedQueryAttention) {
  auto shapes = Shapes(Config("LlamaForCausalLM", "llama"));
  EXPECT_EQ(shapes.size(), 1 + 2 * 9 + 2u);
  EXPECT_EQ(shapes["model.embed_tokens.weight"], (std::vector<int64_t>{100, 32}));
  EXPECT_EQ(shapes["model.layers.1.self_attn.q_proj.weight"], (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(shapes["model.layers.1.self_attn.k_proj.weight"], (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(shapes["model.layers.1.self_attn.v_proj.weight"], (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(shapes["model.layers.0.mlp.down_proj.weight"], (std::vector<int64_t>{32, 80}));
  EXPECT_EQ(shapes["lm_head.weight"], (std::vector<int64_t>{100, 32}));
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_proj.bias"), 0u);
}

TEST(FamiliesTest, TiedEmbeddingsHaveNoHead) {
  loader::ModelConfig c = Config("LlamaForCausalLM", "llama");
  c.tie_word_embeddings = true;
  EXPECT_EQ(Shapes(c).count("lm_head.weight"), 0u);
}

TEST(FamiliesTest, LlamaAttentionBiasCoversOutputToo) {
  loader::ModelConfig c = Config("LlamaForCausalLM", "llama");
  c.attention_bias = true;
  auto shapes = Shapes(c);
  EXPECT_EQ(shapes["model.layers.0.self_attn.k_proj.bias"], (std::vector<int64_t>{16}));
  EXPECT_EQ(shapes["model.layers.0.self_attn.o_proj.bias"], (std::vector<int64_t>{32}));
}

TEST(FamiliesTest, Qwen2HasQkvBiasesOnly) {
  auto shapes = Shapes(Config("Qwen2ForCausalLM", "qwen2"));
  EXPECT_EQ(shapes["model.layers.0.self_attn.q_proj.bias"], (std::vector<int64_t>{32}));
  EXPECT_EQ(shapes["model.layers.0.self_attn.v_proj.bias"], (std::vector<int64_t>{16}));
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.o_proj.bias"), 0u);
}

TEST(FamiliesTest, Gpt2UsesConv1DLayoutAndLearnedPositions) {
  loader::ModelConfig c = Config("GPT2LMHeadModel", "gpt2");
  c.num_key_value_heads = 0;
  c.tie_word_embeddings = true;
  auto shapes = Shapes(c);
  EXPECT_EQ(shapes["transformer.wpe.weight"], (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(shapes["transformer.h.0.attn.c_attn.weight"], (std::vector<int64_t>{32, 96}));
  EXPECT_EQ(shapes["transformer.h.1.mlp.c_fc.weight"], (std::vector<int64_t>{32, 80}));
  EXPECT_EQ(shapes["transformer.h.1.mlp.c_proj.weight"], (std::vector<int64_t>{80, 32}));
  EXPECT_EQ(shapes.count("lm_head.weight"), 0u);
  EXPECT_EQ(shapes.size(), 2 + 2 * 12 + 2u);
}

TEST(FamiliesTest, FallsBackToModelTypeWithoutArchitectures) {
  loader::ModelConfig c = Config("", "mistral");
  c.architectures.clear();
  auto family = FamilyOf(c);
  ASSERT_TRUE(family.ok());
  EXPECT_STREQ(family->block_class, "MistralDecoderLayer");
}

TEST(FamiliesTest, UnknownArchitectureListsTheSupportedOnes) {
  EXPECT_THAT(CheckpointTensors(Config("FalconForCausalLM", "falcon"), c10::ScalarType::Float),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("FalconForCausalLM"), HasSubstr("LlamaForCausalLM"),
                             HasSubstr("GPT2LMHeadModel"))));
}

TEST(FamiliesTest, InvalidConfigIsRejectedBeforeLayout) {
  loader::ModelConfig c = Config("LlamaForCausalLM", "llama");
  c.num_key_value_heads = 3;
  EXPECT_THAT(CheckpointTensors(c, c10::ScalarType::Float),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_key_value_heads")));
}

}  // namespace
}  // namespace accel::models

namespace accel::models {
namespace {

TEST(ModuleTreeForTest, LlamaHasTransformersClassesAndATiedHead) {
  loader::ModelConfig c = Config("LlamaForCausalLM", "llama");
  c.tie_word_embeddings = true;
  auto tree = ModuleTreeFor(c, c10::ScalarType::BFloat16);
  ASSERT_TRUE(tree.ok()) << tree.status();
  EXPECT_EQ(tree->node(0).class_name, "LlamaForCausalLM");
  EXPECT_EQ(tree->node(*tree->FindModule("model.layers.1")).class_name, "LlamaDecoderLayer");
  EXPECT_EQ(tree->node(*tree->FindModule("model.layers.1.mlp")).class_name, "LlamaMLP");
  EXPECT_EQ(tree->node(*tree->FindModule("model.norm")).class_name, "LlamaRMSNorm");
  auto tied = tree->TiedParameters();
  ASSERT_EQ(tied.size(), 1u);
  EXPECT_EQ(tied[0], (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight"}));
  const auto buffers = tree->NamedBuffers();
  ASSERT_EQ(buffers.size(), 1u);
  EXPECT_EQ(buffers[0].name, "model.rotary_emb.inv_freq");
  EXPECT_FALSE(buffers[0].decl->persistent);
  EXPECT_EQ(buffers[0].decl->shape, (std::vector<int64_t>{4}));  // head_dim 8 / 2
}

TEST(ModuleTreeForTest, CheckpointIsTheStateDictWithoutTiedAliases) {
  loader::ModelConfig c = Config("Qwen2ForCausalLM", "qwen2");
  c.tie_word_embeddings = true;
  auto tree = ModuleTreeFor(c, c10::ScalarType::Float);
  auto specs = CheckpointTensors(c, c10::ScalarType::Float);
  ASSERT_TRUE(tree.ok() && specs.ok());
  std::vector<std::string> keys = tree->StateDictKeys();
  keys.erase(std::remove(keys.begin(), keys.end(), "lm_head.weight"), keys.end());
  std::vector<std::string> names;
  for (const auto& s : *specs) names.push_back(s.name);
  EXPECT_EQ(names, keys);
}

}  // namespace
}  // namespace accel::models
