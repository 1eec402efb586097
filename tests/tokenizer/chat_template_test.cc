// Unit tests of tokenizer/chat_template.h: where a folder's template comes
// from, what the template sees, and every way a folder or a request can be
// wrong. (The renderer itself is checked against @huggingface/jinja in
// tests/jinja/.)
#include "tokenizer/chat_template.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tokenizer/bpe_trainer.h"
#include "tokenizer/tokenizer.h"

namespace accel::tokenizer {
namespace {

using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

constexpr char kHello[] = R"([{"role": "user", "content": "Hello"}])";

std::string Config(const Json& fields) { return fields.dump(); }

TEST(ChatTemplateTest, ReadsTheTemplateAndSpecialTokensOfTokenizerConfig) {
  TempDir dir;
  dir.Write("tokenizer_config.json",
            Config({{"bos_token", "<s>"},
                    {"eos_token", {{"__type", "AddedToken"}, {"content", "</s>"}}},
                    {"chat_template",
                     "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                     "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]"
                     "{% endif %}"}}));
  ACCEL_ASSERT_OK_AND_ASSIGN(ChatTemplate chat, ChatTemplate::FromModelDir(dir.path()));
  EXPECT_THAT(chat.Render(kHello, "", true),
              test::IsOkAndHolds(std::string("<s>[user]Hello</s>[assistant]")));
  EXPECT_THAT(chat.Render(kHello, "", false),
              test::IsOkAndHolds(std::string("<s>[user]Hello</s>")));
  EXPECT_THAT(chat.end_of_turn_tokens(), ElementsAre("</s>"));
  EXPECT_EQ(chat.source_name(), dir.File("tokenizer_config.json") + ": chat_template");
}

TEST(ChatTemplateTest, AChatTemplateJinjaFileOverridesTokenizerConfig) {
  TempDir dir;
  dir.Write("tokenizer_config.json",
            Config({{"eos_token", "<|im_end|>"}, {"chat_template", "from the config"}}));
  dir.Write("chat_template.jinja",
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}");
  ACCEL_ASSERT_OK_AND_ASSIGN(ChatTemplate chat, ChatTemplate::FromModelDir(dir.path()));
  EXPECT_THAT(chat.Render(kHello, "", false),
              test::IsOkAndHolds(std::string("<|im_start|>user\nHello<|im_end|>\n")));
  EXPECT_THAT(chat.end_of_turn_tokens(), ElementsAre("<|im_end|>"));
  EXPECT_EQ(chat.source_name(), dir.File("chat_template.jinja"));
}

TEST(ChatTemplateTest, NamedTemplatesUseToolUseWhenTheRequestHasTools) {
  TempDir dir;
  dir.Write(
      "tokenizer_config.json",
      Config({{"chat_template",
               Json::array(
                   {{{"name", "default"}, {"template", "plain"}},
                    {{"name", "tool_use"},
                     {"template", "tools:{{ tools | length }} {{ tools[0].function.name }}"}}})}}));
  ACCEL_ASSERT_OK_AND_ASSIGN(ChatTemplate chat, ChatTemplate::FromModelDir(dir.path()));
  EXPECT_THAT(chat.Render(kHello, "", true), test::IsOkAndHolds(std::string("plain")));
  EXPECT_THAT(chat.Render(kHello, "[]", true), test::IsOkAndHolds(std::string("plain")));
  EXPECT_THAT(
      chat.Render(kHello, R"([{"type": "function", "function": {"name": "get_time"}}])", true),
      test::IsOkAndHolds(std::string("tools:1 get_time")));
}

TEST(ChatTemplateTest, TheTemplateSeesToolsAsNoneAndMessagesWithAllTheirFields) {
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ChatTemplate chat,
      ChatTemplate::FromSource(
          "{{ tools is none }}|{{ messages[0].tool_calls[0].function.arguments.city }}"
          "|{{ messages[0].content is none }}|{{ documents is none }}",
          {}, "test"));
  EXPECT_THAT(chat.Render(R"([{"role": "assistant", "content": null, "tool_calls": [
                  {"type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}]}])",
                          "", true),
              test::IsOkAndHolds(std::string("true|Oslo|true|true")));
}

TEST(ChatTemplateTest, ThePlainTemplateOfMadeModelsRendersEveryTurn) {
  TempDir dir;
  dir.Write("tokenizer_config.json", TokenizerConfigJson("<|begin_of_text|>", "<|end_of_text|>"));
  ACCEL_ASSERT_OK_AND_ASSIGN(ChatTemplate chat, ChatTemplate::FromModelDir(dir.path()));
  EXPECT_THAT(
      chat.Render(R"([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello."},
                              {"role": "user", "content": "More?"}])",
                  "", true),
      test::IsOkAndHolds(std::string(
          "<|begin_of_text|><|system|>\nBe brief.<|end_of_text|>\n<|user|>\nHi<|end_of_text|>\n"
          "<|assistant|>\nHello.<|end_of_text|>\n<|user|>\nMore?<|end_of_text|>\n"
          "<|assistant|>\n")));
  EXPECT_THAT(chat.end_of_turn_tokens(), ElementsAre("<|end_of_text|>"));
}

TEST(ChatTemplateTest, KnownTurnEndsTheTemplateWritesEndGeneration) {
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ChatTemplate chat,
      ChatTemplate::FromSource(
          "{% for m in messages %}<|start_header_id|>{{ m.role }}"
          "<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}",
          {{"eos_token", "<|end_of_text|>"}, {"bos_token", "<|begin_of_text|>"}}, "llama3"));
  EXPECT_THAT(chat.end_of_turn_tokens(), ElementsAre("<|end_of_text|>", "<|eot_id|>"));
}

TEST(ChatTemplateTest, EndOfTurnIdsAreTheTurnEndsTheTokenizerHas) {
  ACCEL_ASSERT_OK_AND_ASSIGN(
      Tokenizer tokenizer,
      Tokenizer::FromJson(
          ByteLevelTokenizerJson(TrainMerges(SampleEnglishText(), 200),
                                 {{"<|begin_of_text|>", 456}, {"<|end_of_text|>", 457}}),
          "test"));
  // <|eot_id|> is written by the template but is not in this vocabulary.
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ChatTemplate chat,
      ChatTemplate::FromSource("{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}",
                               {{"eos_token", "<|end_of_text|>"}}, "test"));
  EXPECT_THAT(chat.EndOfTurnIds(tokenizer), ElementsAre(457));
}

TEST(ChatTemplateTest, AFolderWithoutATemplateIsNotFoundNamingTheFolder) {
  TempDir dir;
  EXPECT_THAT(
      ChatTemplate::FromModelDir(dir.path()),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr(dir.path() + " has no chat template")));
  dir.Write("tokenizer_config.json", Config({{"eos_token", "</s>"}}));
  EXPECT_THAT(ChatTemplate::FromModelDir(dir.path()),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("no \"chat_template\" in " + dir.File("tokenizer_config.json"))));
  dir.Write("tokenizer_config.json", Config({{"chat_template", nullptr}}));
  EXPECT_THAT(ChatTemplate::FromModelDir(dir.path()), StatusIs(absl::StatusCode::kNotFound));
}

TEST(ChatTemplateTest, MalformedFilesAreNamed) {
  struct Case {
    std::string config;
    std::string message;
  };
  const Case cases[] = {
      {"{not json", "tokenizer_config.json: invalid JSON"},
      {"[1, 2]", "tokenizer_config.json: expected a JSON object"},
      {R"({"chat_template": 7})", "chat_template: expected a string or a list of named templates"},
      {R"({"chat_template": [{"name": "x"}]})",
       "chat_template[0]: expected an object with string \"name\" and \"template\""},
      {R"({"chat_template": [{"name": "a", "template": "1"}, {"name": "b", "template": "2"}]})",
       "several templates and none named 'default'"},
      {R"({"chat_template": [{"name": "default", "template": "1"}, {"name": "default", "template": "2"}]})",
       "a second template named 'default'"},
      {R"({"eos_token": 5, "chat_template": "x"})",
       "tokenizer_config.json: eos_token: expected a string or an object"},
      {R"({"additional_special_tokens": "x", "chat_template": "x"})",
       "additional_special_tokens: expected an array"},
      {R"({"chat_template": "line one\n{% if %}"})", "line 2"},
      {R"({"chat_template": "{{ x | no_such_filter }}"})", "no_such_filter"},
  };
  for (const Case& c : cases) {
    TempDir dir;
    dir.Write("tokenizer_config.json", c.config);
    EXPECT_THAT(ChatTemplate::FromModelDir(dir.path()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.config;
  }
  TempDir dir;
  dir.Write("chat_template.jinja", "{% for m in messages %}");
  EXPECT_THAT(ChatTemplate::FromModelDir(dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("chat_template.jinja")));
}

TEST(ChatTemplateTest, BadMessagesAndToolsAreInvalidArgumentsNamingTheField) {
  ACCEL_ASSERT_OK_AND_ASSIGN(ChatTemplate chat, ChatTemplate::FromSource("x", {}, "test"));
  const std::pair<std::string, std::string> cases[] = {
      {"{", "messages: invalid JSON"},
      {R"({"role": "user"})", "messages: expected an array"},
      {R"(["hi"])", "messages[0]: expected an object"},
      {R"([{"content": "hi"}])", "messages[0].role: expected a string"},
      {R"([{"role": 1}])", "messages[0].role: expected a string"},
      {std::string(100, '[') + std::string(100, ']'), "messages: nests deeper than 64"},
  };
  for (const auto& [messages, message] : cases) {
    EXPECT_THAT(chat.Render(messages, "", true),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message)))
        << messages;
  }
  EXPECT_THAT(chat.Render(kHello, "{\"a\": 1}", true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tools: expected an array")));
  EXPECT_THAT(chat.Render(kHello, "[", true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tools: invalid JSON")));
}

TEST(ChatTemplateTest, TheTemplatesOwnRefusalReachesTheCallerWithItsMessage) {
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ChatTemplate chat,
      ChatTemplate::FromSource(
          "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate "
          "user/assistant/user/assistant/...') }}"
          "{% endif %}{{ m.content }}{% endfor %}",
          {}, "mistral"));
  EXPECT_THAT(
      chat.Render(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])", "",
                  true),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Conversation roles must alternate")));
  EXPECT_THAT(
      chat.Render(R"([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])",
                  "", true),
      test::IsOkAndHolds(std::string("ab")));
}

}  // namespace
}  // namespace accel::tokenizer
