#include "server/internal/openai_tokenize.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace accel::server::internal {
namespace {

using ::testing::StartsWith;
using json = nlohmann::json;

std::string TokenizeError(const json& body) {
  absl::StatusOr<TokenizeRequest> parsed = ParseTokenizeRequest(body.dump());
  EXPECT_FALSE(parsed.ok()) << body.dump();
  return parsed.ok() ? "" : std::string(parsed.status().message());
}

std::string DetokenizeError(const json& body) {
  absl::StatusOr<DetokenizeRequest> parsed = ParseDetokenizeRequest(body.dump(), 100);
  EXPECT_FALSE(parsed.ok()) << body.dump();
  if (parsed.ok()) return "";
  EXPECT_TRUE(absl::IsInvalidArgument(parsed.status()));
  return std::string(parsed.status().message());
}

TEST(OpenAiTokenizeTest, PromptOrMessagesWithVllmsDefaults) {
  absl::StatusOr<TokenizeRequest> prompt =
      ParseTokenizeRequest(R"({"model": "m", "prompt": "hello"})");
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_EQ(prompt->input.model, "m");
  EXPECT_EQ(prompt->input.prompt, "hello");
  EXPECT_TRUE(prompt->add_special_tokens);
  EXPECT_FALSE(prompt->input.chat.has_value());

  absl::StatusOr<TokenizeRequest> chat = ParseTokenizeRequest(
      R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})");
  ASSERT_TRUE(chat.ok()) << chat.status();
  ASSERT_TRUE(chat->input.chat.has_value());
  EXPECT_EQ(json::parse(chat->input.chat->messages_json),
            json::parse(R"([{"role": "user", "content": "hi"}])"));
  EXPECT_TRUE(chat->input.chat->add_generation_prompt);
  EXPECT_FALSE(chat->add_special_tokens);

  absl::StatusOr<TokenizeRequest> explicit_flags = ParseTokenizeRequest(
      R"({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false,
          "add_special_tokens": true})");
  ASSERT_TRUE(explicit_flags.ok());
  EXPECT_FALSE(explicit_flags->input.chat->add_generation_prompt);
  EXPECT_TRUE(explicit_flags->add_special_tokens);
}

TEST(OpenAiTokenizeTest, BadTokenizeRequestsNameTheField) {
  EXPECT_THAT(TokenizeError(json::object()), StartsWith("prompt: "));
  EXPECT_THAT(TokenizeError({{"prompt", "a"}, {"messages", json::array({{{"role", "user"}}})}}),
              StartsWith("prompt: "));
  EXPECT_THAT(TokenizeError({{"prompt", 3}}), StartsWith("prompt: "));
  EXPECT_THAT(TokenizeError({{"prompt", "a"}, {"add_special_tokens", "yes"}}),
              StartsWith("add_special_tokens: "));
  EXPECT_THAT(TokenizeError({{"prompt", "a"}, {"model", 1}}), StartsWith("model: "));
  EXPECT_THAT(TokenizeError({{"messages", json::array({{{"content", "x"}}})}}),
              StartsWith("messages[0].role: "));
  EXPECT_FALSE(ParseTokenizeRequest("[1]").ok());
  EXPECT_FALSE(ParseTokenizeRequest("{").ok());
}

TEST(OpenAiTokenizeTest, Detokenize) {
  absl::StatusOr<DetokenizeRequest> parsed =
      ParseDetokenizeRequest(R"({"model": "m", "tokens": [0, 5, 99]})", 100);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->model, "m");
  EXPECT_EQ(parsed->tokens, (std::vector<int64_t>{0, 5, 99}));
  EXPECT_EQ(json::parse(DetokenizeResponse("hi \"x\"")), (json{{"prompt", "hi \"x\""}}));
  EXPECT_EQ(json::parse(TokenizeResponse({1, 2}, 2048)),
            json::parse(R"({"count": 2, "max_model_len": 2048, "tokens": [1, 2],
                            "token_strs": null})"));

  EXPECT_THAT(DetokenizeError(json::object()), StartsWith("tokens: "));
  EXPECT_THAT(DetokenizeError({{"tokens", "1 2"}}), StartsWith("tokens: "));
  EXPECT_EQ(DetokenizeError({{"tokens", {1, 100}}}),
            "tokens[1]: token id 100 is outside the vocabulary [0, 100)");
  EXPECT_THAT(DetokenizeError({{"tokens", {-1}}}), StartsWith("tokens[0]: token id -1"));
  EXPECT_THAT(DetokenizeError({{"tokens", {1.5}}}), StartsWith("tokens[0]: "));
  EXPECT_THAT(DetokenizeError({{"tokens", {18446744073709551615ull}}}), StartsWith("tokens[0]: "));
}

}  // namespace
}  // namespace accel::server::internal
