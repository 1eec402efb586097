// --speculative_config as vLLM takes it: both methods with their defaults,
// vLLM's older {"model": "ngram"}, and every bad config refused naming the
// flag and the field.
#include "engine/speculative_config.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::engine {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(SpeculativeConfigTest, NgramWithItsBounds) {
  auto c = ParseSpeculativeConfig(
      R"({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
          "prompt_lookup_max": 3})");
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->method, SpeculativeConfig::Method::kNgram);
  EXPECT_EQ(c->num_speculative_tokens, 4);
  EXPECT_EQ(c->prompt_lookup_min, 2);
  EXPECT_EQ(c->prompt_lookup_max, 3);
  EXPECT_TRUE(c->enabled());
  // vLLM's defaults: both 5; one given sets the other.
  auto defaults = ParseSpeculativeConfig(R"({"method": "ngram", "num_speculative_tokens": 2})");
  ASSERT_THAT(defaults, IsOk());
  EXPECT_EQ(defaults->prompt_lookup_min, 5);
  EXPECT_EQ(defaults->prompt_lookup_max, 5);
  auto max_only = ParseSpeculativeConfig(
      R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})");
  ASSERT_THAT(max_only, IsOk());
  EXPECT_EQ(max_only->prompt_lookup_min, 3);
  auto old = ParseSpeculativeConfig(R"({"model": "ngram", "num_speculative_tokens": 3})");
  ASSERT_THAT(old, IsOk());
  EXPECT_EQ(old->method, SpeculativeConfig::Method::kNgram);
  EXPECT_TRUE(old->model.empty());
}

TEST(SpeculativeConfigTest, ADraftModel) {
  auto c = ParseSpeculativeConfig(
      R"({"model": "/models/small", "num_speculative_tokens": 5, "quantization": "nf4",
          "disable_by_batch_size": 8})");
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->method, SpeculativeConfig::Method::kDraftModel);
  EXPECT_EQ(c->model, "/models/small");
  EXPECT_EQ(c->quantization, "nf4");
  EXPECT_EQ(c->disable_by_batch_size, 8);
  EXPECT_EQ(SpeculativeMethodName(c->method), "draft_model");
  ASSERT_THAT(ParseSpeculativeConfig(
                  R"({"method": "draft_model", "model": "d", "num_speculative_tokens": 1})"),
              IsOk());
  auto off = ParseSpeculativeConfig("");
  ASSERT_THAT(off, IsOk());
  EXPECT_FALSE(off->enabled());
}

TEST(SpeculativeConfigTest, BadConfigsAreRefusedNamingTheField) {
  auto bad = [](const std::string& json, const std::string& field) {
    EXPECT_THAT(ParseSpeculativeConfig(json),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("--speculative_config"), HasSubstr(field))))
        << json;
  };
  bad("{", "invalid JSON");
  bad("[1]", "not an object");
  bad(R"({"num_speculative_tokens": 3})", "method");
  bad(R"({"method": "eagle", "num_speculative_tokens": 3})", "\"method\"");
  bad(R"({"method": 5, "num_speculative_tokens": 3})", "\"method\"");
  bad(R"({"method": "ngram"})", "\"num_speculative_tokens\" is needed");
  bad(R"({"method": "ngram", "num_speculative_tokens": 0})", "\"num_speculative_tokens\"");
  bad(R"({"method": "ngram", "num_speculative_tokens": 33})", "[1, 32]");
  bad(R"({"method": "ngram", "num_speculative_tokens": 2.5})", "integer");
  bad(R"({"method": "ngram", "num_speculative_tokens": "4"})", "\"num_speculative_tokens\"");
  bad(R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0})",
      "\"prompt_lookup_min\"");
  bad(R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 65})",
      "\"prompt_lookup_max\"");
  bad(R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2})",
      "\"prompt_lookup_min\"");
  bad(R"({"method": "ngram", "num_speculative_tokens": 2, "model": "x"})", "\"model\"");
  bad(R"({"method": "draft_model", "num_speculative_tokens": 2})", "\"model\"");
  bad(R"({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3})",
      "\"prompt_lookup_max\"");
  bad(R"({"model": "d", "num_speculative_tokens": 2, "quantization": "gptq"})", "\"quantization\"");
  bad(R"({"model": "", "num_speculative_tokens": 2})", "\"model\"");
  bad(R"({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1})",
      "\"draft_tensor_parallel_size\"");
  bad(R"({"model": "d", "num_speculative_tokens": 2, "disable_by_batch_size": -1})",
      "\"disable_by_batch_size\"");
  bad(std::string(100, '[') + std::string(100, ']'), "nests deeper than 4");
  bad(R"({"method": "ngram", "method": "ngram", "num_speculative_tokens": 2})", "method");
}

}  // namespace
}  // namespace accel::engine
