#include "models/families.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "loader/config.h"
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

// ---- real configs ---------------------------------------------------------------

namespace accel::models {
namespace {

// The config.json of each checkpoint, as published (fields a family ignores
// left in: they must not change anything).
constexpr char kMixtral8x7bInstruct[] = R"({
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
  "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000})";

constexpr char kQwen3_30bA3b[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
  "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
  "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";

constexpr char kQwen15MoeA27b[] = R"({
  "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
  "model_type": "qwen2_moe", "num_attention_heads": 16, "num_hidden_layers": 24,
  "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 32768, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.40.0.dev0", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
  "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
  "norm_topk_prob": false, "output_router_logits": false, "router_aux_loss_coef": 0.001})";

constexpr char kGemma2_2b[] = R"({
  "architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
  "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
  "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
  "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
  "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
  "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
  "sliding_window": 4096, "torch_dtype": "bfloat16", "transformers_version": "4.42.4",
  "use_cache": true, "vocab_size": 256000})";

constexpr char kGemma3_1b[] = R"({
  "architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid",
  "eos_token_id": [1, 106], "final_logit_softcapping": null, "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
  "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
  "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
  "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000,
  "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
  "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144})";

// Phi-3-mini-128k-instruct, its 48-number factor lists cut to the length check's needs.
std::string Phi3Mini128k() {
  std::string short_factor, long_factor;
  for (int i = 0; i < 48; ++i) {
    absl::StrAppend(&short_factor, i ? ", " : "", 1.0 + 0.01 * i);
    absl::StrAppend(&long_factor, i ? ", " : "", 1.0 + 0.5 * i);
  }
  return absl::StrCat(R"({
  "architectures": ["Phi3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
  "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "model_type": "phi3", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
  "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
  "rope_scaling": {"long_factor": [)",
                      long_factor, R"(], "short_factor": [)", short_factor,
                      R"(], "type": "longrope"},
  "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": true,
  "vocab_size": 32064})");
}

int64_t Parameters(const dispatch::ModuleTree& tree) {
  int64_t n = 0;
  for (const auto& p : tree.NamedParameters()) n += p.decl->numel();
  return n;
}

// The parameter counts these checkpoints are published with (transformers'
// num_parameters(), a tied head once): every tensor of every family is there,
// with its shape, and nothing else is.
TEST(RealConfigsTest, ModuleTreesHaveThePublishedParameterCounts) {
  const struct {
    std::string json;
    int64_t parameters;
    const char* block;
  } cases[] = {
      {kMixtral8x7bInstruct, 46'702'792'704, "MixtralDecoderLayer"},
      {kQwen3_30bA3b, 30'532'122'624, "Qwen3MoeDecoderLayer"},
      {kQwen15MoeA27b, 14'315'784'192, "Qwen2MoeDecoderLayer"},
      {kGemma2_2b, 2'614'341'888, "Gemma2DecoderLayer"},
      {kGemma3_1b, 999'885'952, "Gemma3DecoderLayer"},
      {Phi3Mini128k(), 3'821'079'552, "Phi3DecoderLayer"},
  };
  for (const auto& c : cases) {
    ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config,
                               loader::ParseModelConfig(c.json, "config.json"));
    SCOPED_TRACE(config.architectures[0]);
    ACCEL_ASSERT_OK_AND_ASSIGN(dispatch::ModuleTree tree,
                               ModuleTreeFor(config, c10::ScalarType::BFloat16));
    EXPECT_EQ(Parameters(tree), c.parameters);
    ACCEL_ASSERT_OK_AND_ASSIGN(Family family, FamilyOf(config));
    EXPECT_STREQ(family.block_class, c.block);
  }
}

TEST(RealConfigsTest, EachIsResolvedAsTransformersRunsIt) {
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(auto c, loader::ParseModelConfig(kMixtral8x7bInstruct, "c"));
    ACCEL_ASSERT_OK_AND_ASSIGN(ResolvedConfig r, ResolveConfig(c));
    EXPECT_EQ(r.num_experts, 8);
    EXPECT_EQ(r.top_k, 2);
    EXPECT_TRUE(r.norm_topk);
    EXPECT_EQ(r.expert_intermediate, 14336);
    EXPECT_EQ(std::count(r.sparse.begin(), r.sparse.end(), true), 32);
    EXPECT_FALSE(r.windows[0].has_value());  // sliding_window: null
    EXPECT_EQ(ExpertLists(r)[31], "model.layers.31.block_sparse_moe.experts");
  }
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(auto c, loader::ParseModelConfig(kQwen3_30bA3b, "c"));
    ACCEL_ASSERT_OK_AND_ASSIGN(ResolvedConfig r, ResolveConfig(c));
    EXPECT_EQ(r.top_k, 8);
    EXPECT_TRUE(r.norm_topk);
    EXPECT_EQ(r.expert_intermediate, 768);
    EXPECT_EQ(ExpertLists(r).size(), 48u);
    EXPECT_EQ(ExpertLists(r)[0], "model.layers.0.mlp.experts");
  }
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(auto c, loader::ParseModelConfig(kQwen15MoeA27b, "c"));
    ACCEL_ASSERT_OK_AND_ASSIGN(ResolvedConfig r, ResolveConfig(c));
    EXPECT_FALSE(r.norm_topk);
    EXPECT_EQ(r.shared_intermediate, 5632);
    // sliding_window is set but use_sliding_window is off: full attention.
    EXPECT_FALSE(r.windows[23].has_value());
  }
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(auto c, loader::ParseModelConfig(kGemma2_2b, "c"));
    ACCEL_ASSERT_OK_AND_ASSIGN(ResolvedConfig r, ResolveConfig(c));
    EXPECT_EQ(r.activation, "gelu_pytorch_tanh");
    EXPECT_EQ(r.windows[0], 4096);
    EXPECT_FALSE(r.windows[1].has_value());
    EXPECT_EQ(r.attn_softcap, 50.0);
    EXPECT_EQ(r.final_softcap, 30.0);
    EXPECT_TRUE(c.tie_word_embeddings);  // Gemma2Config's default
  }
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(auto c, loader::ParseModelConfig(kGemma3_1b, "c"));
    ACCEL_ASSERT_OK_AND_ASSIGN(ResolvedConfig r, ResolveConfig(c));
    for (int i = 0; i < 26; ++i) {
      EXPECT_EQ(r.windows[i].has_value(), (i + 1) % 6 != 0) << i;
      EXPECT_EQ(r.local_rope[i], (i + 1) % 6 != 0) << i;
    }
    EXPECT_FALSE(r.attn_softcap.has_value());
    EXPECT_FALSE(r.final_softcap.has_value());
  }
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(auto c, loader::ParseModelConfig(Phi3Mini128k(), "c"));
    ACCEL_ASSERT_OK_AND_ASSIGN(ResolvedConfig r, ResolveConfig(c));
    EXPECT_EQ(r.rotary_dim, 96);
    EXPECT_EQ(r.windows[0], 262144);
    EXPECT_EQ(c.rope_scaling->rope_type, "longrope");
    EXPECT_EQ(c.rope_scaling->lists.at("long_factor").size(), 48u);
  }
}

}  // namespace
}  // namespace accel::models
