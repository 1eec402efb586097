#include "loader/config.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::loader {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The shape of Llama 3.1 8B's config.json.
constexpr char kLlama3[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

constexpr char kGpt2[] = R"({
  "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
  "bos_token_id": 50256, "eos_token_id": 50256, "layer_norm_epsilon": 1e-05,
  "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_inner": null,
  "n_layer": 12, "n_positions": 1024, "vocab_size": 50257
})";

TEST(ModelConfigTest, ReadsALlama3Config) {
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfig(kLlama3, "config.json"));
  EXPECT_THAT(c.architectures, ElementsAre("LlamaForCausalLM"));
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.num_hidden_layers, 32);
  EXPECT_EQ(c.kv_heads(), 8);
  EXPECT_EQ(c.head_size(), 128);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->rope_type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope_scaling->numbers.at("factor"), 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->numbers.at("original_max_position_embeddings"), 8192);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_THAT(c.eos_token_ids, ElementsAre(128001, 128008, 128009));
  EXPECT_EQ(c.vocab_size, 128256);
  // Unknown fields are kept verbatim.
  EXPECT_EQ(c.extra.at("transformers_version"), "\"4.43.0.dev0\"");
  EXPECT_EQ(c.extra.at("mlp_bias"), "false");
  EXPECT_EQ(c.extra.at("initializer_range"), "0.02");
  EXPECT_THAT(c.Validate(), IsOk());
}

TEST(ModelConfigTest, RoundTripsThroughToJson) {
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfig(kLlama3, "config.json"));
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig again, ParseModelConfig(c.ToJson(), "again"));
  EXPECT_EQ(again.ToJson(), c.ToJson());
  EXPECT_EQ(again.extra, c.extra);
  EXPECT_EQ(again.rope_scaling->numbers, c.rope_scaling->numbers);
  EXPECT_THAT(again.eos_token_ids, ElementsAre(128001, 128008, 128009));
}

// Each config round-trips: ToJson, read back, ToJson again gives the same text.
std::string RoundTrip(const std::string& json) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(json, "config.json");
  EXPECT_THAT(c, IsOk());
  if (!c.ok()) return "";
  absl::StatusOr<ModelConfig> again = ParseModelConfig(c->ToJson(), "again");
  EXPECT_THAT(again, IsOk());
  EXPECT_EQ(again->ToJson(), c->ToJson());
  return c->ToJson();
}

TEST(ModelConfigTest, ReadsMixtureOfExpertsFieldsUnderEachFamilysNames) {
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig mixtral,
                             ParseModelConfig(R"({"model_type": "mixtral", "num_local_experts": 8,
                           "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02})",
                                              "config.json"));
  EXPECT_EQ(mixtral.moe.num_experts, 8);
  EXPECT_EQ(mixtral.moe.num_experts_per_tok, 2);
  EXPECT_EQ(mixtral.extra.count("num_local_experts"), 0u);
  EXPECT_EQ(mixtral.extra.at("router_aux_loss_coef"), "0.02");
  EXPECT_THAT(mixtral.ToJson(), HasSubstr("\"num_local_experts\": 8"));
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ModelConfig qwen,
      ParseModelConfig(R"({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
                           "moe_intermediate_size": 768, "norm_topk_prob": true,
                           "decoder_sparse_step": 1, "mlp_only_layers": [0, 3],
                           "shared_expert_intermediate_size": 5632})",
                       "config.json"));
  EXPECT_EQ(qwen.moe.num_experts, 128);
  EXPECT_EQ(qwen.moe.moe_intermediate_size, 768);
  EXPECT_EQ(qwen.moe.norm_topk_prob, true);
  EXPECT_EQ(qwen.moe.decoder_sparse_step, 1);
  EXPECT_THAT(qwen.moe.mlp_only_layers, ElementsAre(0, 3));
  EXPECT_EQ(qwen.moe.shared_expert_intermediate_size, 5632);
  EXPECT_THAT(RoundTrip(qwen.ToJson()), HasSubstr("\"num_experts\": 128"));
  EXPECT_THAT(ParseModelConfig(R"({"model_type": "qwen3_moe", "mlp_only_layers": [1, "x"]})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mlp_only_layers")));
}

// Gemma's defaults are Gemma2Config's / Gemma3TextConfig's, and a null turns
// a soft-cap (or the window) off rather than bringing the default back.
TEST(ModelConfigTest, GemmaDefaultsAndNullsSurviveARoundTrip) {
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig g2,
                             ParseModelConfig(R"({"model_type": "gemma2"})", "config.json"));
  EXPECT_TRUE(g2.tie_word_embeddings);
  EXPECT_EQ(g2.head_dim, 256);
  EXPECT_EQ(g2.sliding_window, 4096);
  EXPECT_EQ(g2.attn_logit_softcapping, 50.0);
  EXPECT_EQ(g2.final_logit_softcapping, 30.0);
  EXPECT_EQ(g2.query_pre_attn_scalar, 256.0);
  EXPECT_EQ(g2.hidden_activation, "gelu_pytorch_tanh");
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ModelConfig off, ParseModelConfig(R"({"model_type": "gemma2", "attn_logit_softcapping": null,
                           "final_logit_softcapping": null, "sliding_window": null,
                           "head_dim": 0})",
                                        "config.json"));
  EXPECT_FALSE(off.attn_logit_softcapping.has_value());
  EXPECT_FALSE(off.final_logit_softcapping.has_value());
  EXPECT_FALSE(off.sliding_window.has_value());
  const std::string json = RoundTrip(off.ToJson());
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig again, ParseModelConfig(json, "again"));
  EXPECT_FALSE(again.attn_logit_softcapping.has_value());
  EXPECT_FALSE(again.sliding_window.has_value());
  EXPECT_EQ(again.head_dim, 0);
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig g3, ParseModelConfig(R"({"model_type": "gemma3_text",
                                                  "layer_types": ["sliding_attention",
                                                                  "full_attention"]})",
                                                              "config.json"));
  EXPECT_EQ(g3.rope_theta, 1e6);
  EXPECT_EQ(g3.rope_local_base_freq, 1e4);
  EXPECT_EQ(g3.sliding_window_pattern, 6);
  EXPECT_FALSE(g3.attn_logit_softcapping.has_value());
  EXPECT_THAT(g3.layer_types, ElementsAre("sliding_attention", "full_attention"));
  RoundTrip(g3.ToJson());
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig qwen3,
                             ParseModelConfig(R"({"model_type": "qwen3"})", "config.json"));
  EXPECT_EQ(qwen3.head_dim, 128);  // Qwen3Config's default, not hidden / heads
}

TEST(ModelConfigTest, LongRopeFactorListsAreRead) {
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ModelConfig c,
      ParseModelConfig(R"({"model_type": "phi3", "original_max_position_embeddings": 4096,
                           "partial_rotary_factor": 0.75,
                           "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5],
                                            "long_factor": [2.0, 8.25]}})",
                       "config.json"));
  EXPECT_EQ(c.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.partial_rotary_factor, 0.75);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->rope_type, "longrope");
  EXPECT_THAT(c.rope_scaling->lists.at("long_factor"), ElementsAre(2.0, 8.25));
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig again, ParseModelConfig(RoundTrip(c.ToJson()), "again"));
  EXPECT_THAT(again.rope_scaling->lists.at("short_factor"), ElementsAre(1.0, 1.5));
  EXPECT_THAT(ParseModelConfig(R"({"rope_scaling": {"type": "longrope", "long_factor": []}})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rope_scaling.long_factor")));
  EXPECT_THAT(ParseModelConfig(R"({"partial_rotary_factor": "half"})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("partial_rotary_factor")));
}

TEST(ModelConfigTest, ReadsGpt2NamesIntoTheCommonFields) {
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfig(kGpt2, "config.json"));
  EXPECT_EQ(c.hidden_size, 768);
  EXPECT_EQ(c.num_hidden_layers, 12);
  EXPECT_EQ(c.num_attention_heads, 12);
  EXPECT_EQ(c.kv_heads(), 12);
  EXPECT_EQ(c.max_position_embeddings, 1024);
  EXPECT_EQ(c.intermediate_size, 4 * 768);  // n_inner: null
  EXPECT_TRUE(c.tie_word_embeddings);       // GPT-2's default
  EXPECT_EQ(c.hidden_act, "gelu_new");
  EXPECT_THAT(c.eos_token_ids, ElementsAre(50256));
  EXPECT_EQ(c.extra.at("n_ctx"), "1024");
  EXPECT_THAT(c.Validate(), IsOk());
  std::string json = c.ToJson();
  EXPECT_THAT(json, AllOf(HasSubstr("\"n_embd\": 768"), HasSubstr("\"n_layer\": 12")));
  EXPECT_THAT(json, ::testing::Not(HasSubstr("hidden_size")));
}

TEST(ModelConfigTest, WrongTypesNameTheField) {
  EXPECT_THAT(ParseModelConfig(R"({"hidden_size": "big"})", "m/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("m/config.json"), HasSubstr("'hidden_size'"),
                             HasSubstr("\"big\""))));
  EXPECT_THAT(ParseModelConfig(R"({"num_hidden_layers": -2})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'num_hidden_layers'")));
  EXPECT_THAT(ParseModelConfig(R"({"eos_token_id": [1, "x"]})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'eos_token_id'")));
  EXPECT_THAT(ParseModelConfig(R"({"architectures": "LlamaForCausalLM"})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'architectures'")));
  EXPECT_THAT(ParseModelConfig(R"({"rope_scaling": {"factor": "8"}})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'rope_scaling.factor'")));
  EXPECT_THAT(ParseModelConfig(R"({"tie_word_embeddings": 1})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'tie_word_embeddings'")));
}

TEST(ModelConfigTest, AbsurdSizesAndDeepNestingAreInvalid) {
  // Found by tests/fuzz/config_fuzz: 4 x n_embd overflowed, and deeply nested
  // unknown fields made ToJson() quadratic.
  EXPECT_THAT(ParseModelConfig(R"({"model_type": "gpt2", "n_embd": 9223372036854775807})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'n_embd'")));
  // 4 x n_embd (n_inner null) must fit the same bound as the sizes themselves.
  EXPECT_THAT(ParseModelConfig(R"({"model_type": "gpt2", "n_embd": 30596929})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("when n_inner is null")));
  EXPECT_THAT(ParseModelConfig(R"({"vocab_size": 1099511627776})", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'vocab_size'")));
  std::string deep = R"({"x": )" + std::string(100, '[') + std::string(100, ']') + "}";
  EXPECT_THAT(ParseModelConfig(deep, "c"), StatusIs(absl::StatusCode::kInvalidArgument,
                                                    HasSubstr("nests deeper than 32 levels")));
  EXPECT_THAT(ParseGenerationConfig(deep, "g"), StatusIs(absl::StatusCode::kInvalidArgument,
                                                         HasSubstr("nests deeper than 32 levels")));
}

TEST(ModelConfigTest, NotJsonOrNotAnObjectIsInvalid) {
  EXPECT_THAT(
      ParseModelConfig("{", "c.json"),
      StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("c.json"), HasSubstr("JSON"))));
  EXPECT_THAT(ParseModelConfig("[1]", "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a JSON object")));
  EXPECT_THAT(ParseModelConfig("", "c.json"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ModelConfigTest, ValidateNamesMissingOrIndivisibleSizes) {
  ACCEL_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfig(kLlama3, "config.json"));
  ModelConfig no_hidden = c;
  no_hidden.hidden_size = 0;
  EXPECT_THAT(no_hidden.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden_size")));
  ModelConfig odd_heads = c;
  odd_heads.num_attention_heads = 30;
  EXPECT_THAT(odd_heads.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("divisible")));
  ModelConfig odd_kv = c;
  odd_kv.num_key_value_heads = 5;
  EXPECT_THAT(odd_kv.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_key_value_heads 5")));
}

TEST(GenerationConfigTest, ReadsAndRoundTrips) {
  constexpr char kText[] = R"({"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": true,
    "temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_length": 4096,
    "transformers_version": "4.40.0"})";
  ACCEL_ASSERT_OK_AND_ASSIGN(GenerationConfig g,
                             ParseGenerationConfig(kText, "generation_config.json"));
  EXPECT_EQ(g.bos_token_id, 1);
  EXPECT_THAT(g.eos_token_ids, ElementsAre(2, 3));
  EXPECT_EQ(g.do_sample, true);
  EXPECT_DOUBLE_EQ(*g.temperature, 0.6);
  EXPECT_EQ(g.top_k, 50);
  EXPECT_FALSE(g.min_p.has_value());
  EXPECT_EQ(g.extra.at("transformers_version"), "\"4.40.0\"");
  ACCEL_ASSERT_OK_AND_ASSIGN(GenerationConfig again, ParseGenerationConfig(g.ToJson(), "again"));
  EXPECT_EQ(again.ToJson(), g.ToJson());
  EXPECT_THAT(ParseGenerationConfig(R"({"temperature": "hot"})", "g.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("g.json"), HasSubstr("'temperature'"))));
}

TEST(ConfigFilesTest, MissingFileIsNotFound) {
  test::TempDir dir;
  EXPECT_THAT(ReadModelConfig(dir.File("config.json")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("config.json")));
  dir.Write("config.json", kGpt2);
  EXPECT_THAT(ReadModelConfig(dir.File("config.json")), IsOk());
}

}  // namespace
}  // namespace accel::loader
