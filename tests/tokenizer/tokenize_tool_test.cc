// accel-tokenize as users run it: text and conversations in, the rendered
// text and its ids out, checked against the library's own answer; and the
// errors people will meet.
#include <cstdlib>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/command.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tokenizer/bpe_trainer.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace accel::tokenizer {
namespace {

using ::accel::test::TempDir;
using ::testing::HasSubstr;
using Json = nlohmann::json;

using Result = test::CommandResult;

// Runs build/bin/accel-tokenize; `stderr_too` adds stderr to the output.
Result RunTokenize(const std::string& args, bool stderr_too = true) {
  const char* bin = std::getenv("ACCEL_BIN_DIR");
  return test::CommandOutput(std::string(bin ? bin : "build/bin") + "/accel-tokenize " + args +
                             (stderr_too ? " 2>&1" : " 2>/dev/null"));
}

// A tokenizer folder as accel-make-model writes it.
void WriteTokenizer(const TempDir& dir, bool with_template) {
  dir.Write("tokenizer.json",
            ByteLevelTokenizerJson(TrainMerges(SampleEnglishText(), 200),
                                   {{"<|begin_of_text|>", 456}, {"<|end_of_text|>", 457}}));
  if (with_template) {
    dir.Write("tokenizer_config.json", TokenizerConfigJson("<|begin_of_text|>", "<|end_of_text|>"));
  }
}

TEST(TokenizeToolTest, ChatPrintsWhatTheModelReadsAndItsIds) {
  TempDir dir;
  WriteTokenizer(dir, true);
  const std::string messages =
      R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 🙂"}])";
  dir.Write("messages.json", messages);
  const Result r = RunTokenize("--model " + dir.path() + " --chat " + dir.File("messages.json") +
                                   " --add_generation_prompt --json",
                               /*stderr_too=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const Json out = Json::parse(r.out);

  ACCEL_ASSERT_OK_AND_ASSIGN(ChatTemplate chat, ChatTemplate::FromModelDir(dir.path()));
  ACCEL_ASSERT_OK_AND_ASSIGN(std::string text, chat.Render(messages, "", true));
  ACCEL_ASSERT_OK_AND_ASSIGN(Tokenizer tok, Tokenizer::FromFile(dir.File("tokenizer.json")));
  ACCEL_ASSERT_OK_AND_ASSIGN(std::vector<int64_t> ids, tok.Encode(text, false));
  EXPECT_EQ(out["text"].get<std::string>(), text);
  EXPECT_EQ(out["ids"].get<std::vector<int64_t>>(), ids);
  EXPECT_EQ(ids.front(), 456);  // written by the template, not added by the tokenizer
  EXPECT_THAT(text, HasSubstr("<|user|>\nHéllo 🙂<|end_of_text|>\n<|assistant|>\n"));

  // Without the generation prompt the text ends after the last turn.
  const Result plain =
      RunTokenize("--model " + dir.path() + " --chat " + dir.File("messages.json"));
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  EXPECT_THAT(plain.out, HasSubstr("Héllo 🙂<|end_of_text|>\n\nids ("));
  EXPECT_THAT(plain.out, ::testing::Not(HasSubstr("<|assistant|>")));
}

TEST(TokenizeToolTest, TextGetsTheTokenizersSpecialTokens) {
  TempDir dir;
  WriteTokenizer(dir, false);
  const Result r = RunTokenize("--model " + dir.path() + " --text 'Hello world' --json", false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  ACCEL_ASSERT_OK_AND_ASSIGN(Tokenizer tok, Tokenizer::FromFile(dir.File("tokenizer.json")));
  ACCEL_ASSERT_OK_AND_ASSIGN(std::vector<int64_t> ids, tok.Encode("Hello world", true));
  const Json out = Json::parse(r.out);
  EXPECT_EQ(out["text"], "Hello world");
  EXPECT_EQ(out["ids"].get<std::vector<int64_t>>(), ids);
}

TEST(TokenizeToolTest, ToolsReachTheTemplate) {
  TempDir dir;
  WriteTokenizer(dir, false);
  dir.Write(
      "tokenizer_config.json",
      Json({{"chat_template",
             "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"}})
          .dump());
  dir.Write("m.json", R"([{"role": "user", "content": "go"}])");
  dir.Write("t.json", R"([{"type": "function", "function": {"name": "search"}}])");
  const Result r = RunTokenize("--model " + dir.path() + " --chat " + dir.File("m.json") +
                                   " --tools " + dir.File("t.json") + " --json",
                               false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(Json::parse(r.out)["text"], "search;go");
}

TEST(TokenizeToolTest, MistakesAreNamed) {
  TempDir dir;
  WriteTokenizer(dir, false);
  dir.Write("m.json", R"([{"role": "user", "content": "go"}])");
  dir.Write("bad.json", R"({"role": "user"})");
  const std::string model = "--model " + dir.path();
  const std::pair<std::string, std::string> cases[] = {
      {"--text hi", "--model is required"},
      {model, "give one of --text and --chat"},
      {model + " --text hi --chat " + dir.File("m.json"), "give one of --text and --chat"},
      {model + " --text hi --tools " + dir.File("m.json"), "--tools needs --chat"},
      {model + " --chat " + dir.File("m.json"), dir.path() + " has no chat template"},
      {"--model " + dir.path() + "/nope --text hi", "nope/tokenizer.json"},
  };
  for (const auto& [args, message] : cases) {
    const Result r = RunTokenize(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_THAT(r.out, HasSubstr(message)) << args;
  }
  dir.Write("tokenizer_config.json", TokenizerConfigJson("<|begin_of_text|>", "<|end_of_text|>"));
  const Result missing = RunTokenize(model + " --chat " + dir.File("none.json"));
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_THAT(missing.out, HasSubstr("none.json"));
  const Result bad = RunTokenize(model + " --chat " + dir.File("bad.json"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.out,
              HasSubstr("--chat " + dir.File("bad.json") + ": messages: expected an array"));
}

}  // namespace
}  // namespace accel::tokenizer
