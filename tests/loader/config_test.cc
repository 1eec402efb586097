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
  EXPECT_THAT(ParseModelConfig(deep, "c"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nested")));
  EXPECT_THAT(ParseGenerationConfig(deep, "g"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nested")));
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
