// The input processor: the one place a request is completed and checked.
// Defaults (max_new_tokens within the limits, the model's stop tokens, the
// deadline), prompt text and conversations through the shipped demo model's
// tokenizer and chat template, and every bad request refused naming the
// field.
#include "engine/input_processor.h"

#include <memory>
#include <string>
#include <utility>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"

#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::engine {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

InputProcessorOptions Options() {
  InputProcessorOptions o;
  o.served_model_name = "tiny";
  o.limits.vocab_size = 300;
  o.limits.max_input_tokens = 20;
  o.limits.max_total_tokens = 24;
  o.default_max_new_tokens = 16;
  o.eos_token_ids = {299};
  return o;
}

GenerationRequest Ids(std::vector<int64_t> ids, int64_t max_new_tokens = 0) {
  GenerationRequest r;
  r.prompt_ids = std::move(ids);
  r.max_new_tokens = max_new_tokens;
  return r;
}

class InputProcessorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto loaded = InputProcessor::Load(dir_.path());  // no tokenizer.json
    ASSERT_THAT(loaded, IsOk());
    inputs_ = *std::move(loaded);
    inputs_->Configure(Options());
  }
  TempDir dir_;
  std::unique_ptr<InputProcessor> inputs_;
};

TEST_F(InputProcessorTest, DefaultsStopTokensAndDeadlines) {
  GenerationRequest r = Ids({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  ASSERT_THAT(inputs_->Process(r), IsOk());
  // 16 by default, but only 14 fit in 24 after the prompt.
  EXPECT_EQ(r.max_new_tokens, 14);
  EXPECT_THAT(r.stop_token_ids, ElementsAre(299));
  // To the end of the context (OpenAI's chat without max_tokens): all 22 left.
  GenerationRequest to_context = Ids({1, 2});
  to_context.max_new_tokens_to_context = true;
  ASSERT_THAT(inputs_->Process(to_context), IsOk());
  EXPECT_EQ(to_context.max_new_tokens, 22);
  EXPECT_EQ(r.deadline, absl::InfiniteFuture());

  GenerationRequest own = Ids({1}, 3);
  own.ignore_eos = true;
  own.deadline = absl::Now() + absl::Hours(1);
  ASSERT_THAT(inputs_->Process(own), IsOk());
  EXPECT_EQ(own.max_new_tokens, 3);
  EXPECT_TRUE(own.stop_token_ids.empty());
  EXPECT_EQ(own.deadline_reason, "the client's deadline");

  InputProcessorOptions timed = Options();
  timed.request_timeout = absl::Seconds(30);
  inputs_->Configure(timed);
  GenerationRequest t = Ids({1}, 3);
  ASSERT_THAT(inputs_->Process(t), IsOk());
  EXPECT_LT(t.deadline, absl::Now() + absl::Seconds(31));
  EXPECT_EQ(t.deadline_reason, "--request_timeout=30s");
}

TEST_F(InputProcessorTest, BadRequestsAreClearErrors) {
  auto bad = [&](GenerationRequest r, const std::string& message) {
    EXPECT_THAT(inputs_->Process(r),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message)))
        << message;
  };
  bad(Ids({}), "neither a prompt nor input_ids");
  bad(Ids({1, 300}), "input_ids[1]: token id 300");
  bad(Ids({-5}), "token id -5");
  bad(Ids({1}, -1), "max_new_tokens");
  bad(Ids(std::vector<int64_t>(21, 1)), "over the limit of 20 (--max_input_tokens)");
  bad(Ids({1, 2, 3, 4, 5}, 20), "is over the limit of 24 tokens (--max_total_tokens)");
  GenerationRequest hot = Ids({1}, 4);
  hot.sampling.temperature = -1;
  bad(hot, "temperature");
  GenerationRequest top = Ids({1}, 4);
  top.sampling.top_p = 0;
  bad(top, "top_p");
  GenerationRequest logprobs = Ids({1}, 4);
  logprobs.top_logprobs = 3;
  bad(logprobs, "top_logprobs needs logprobs");
  GenerationRequest empty_stop = Ids({1}, 4);
  empty_stop.stop_strings = {"x", ""};
  bad(empty_stop, "stop[1] is empty");
  GenerationRequest stop = Ids({1}, 4);
  stop.stop_strings = {"x"};
  bad(stop, "need a tokenizer");
  GenerationRequest text;
  text.prompt = "hello";
  bad(text, "no tokenizer.json");
  GenerationRequest chat;
  chat.chat = ChatInput{R"([{"role": "user", "content": "hi"}])", "", true};
  bad(chat, "no chat template");
  GenerationRequest other = Ids({1}, 4);
  other.model = "big\n";
  EXPECT_THAT(inputs_->Process(other),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model \"big\\n\" is not served")));
}

// The shipped demo model: a tokenizer and a chat template.
TEST(InputProcessorDemoTest, PromptTextAndConversationsAreTokenized) {
  auto loaded = InputProcessor::Load(ACCEL_DEMO_MODEL_DIR);
  ASSERT_THAT(loaded, IsOk());
  InputProcessor& inputs = **loaded;
  InputProcessorOptions options = Options();
  options.limits.vocab_size = 2048;
  options.limits.max_input_tokens = 200;
  options.limits.max_total_tokens = 256;
  options.eos_token_ids = {2047};
  inputs.Configure(options);
  ASSERT_NE(inputs.tokenizer(), nullptr);
  EXPECT_TRUE(inputs.has_chat_template());
  EXPECT_EQ(inputs.TokenText(2047), "<|end_of_text|>");

  GenerationRequest text;
  text.prompt = "Once upon a time";
  text.stop_strings = {"."};
  ASSERT_THAT(inputs.Process(text), IsOk());
  auto expected = inputs.tokenizer()->Encode("Once upon a time", /*add_special_tokens=*/true);
  ASSERT_THAT(expected, IsOk());
  EXPECT_EQ(text.prompt_ids, *expected);

  GenerationRequest chat;
  chat.chat = ChatInput{R"([{"role": "user", "content": "hi"}])", "", true};
  ASSERT_THAT(inputs.Process(chat), IsOk());
  auto rendered = inputs.tokenizer()->Encode(
      "<|begin_of_text|><|user|>\nhi<|end_of_text|>\n<|assistant|>\n", false);
  ASSERT_THAT(rendered, IsOk());
  EXPECT_EQ(chat.prompt_ids, *rendered);
  // The template's turn end (eos here) and the model's eos.
  EXPECT_THAT(chat.stop_token_ids, ElementsAre(2047, 2047));

  GenerationRequest empty;
  empty.prompt = "";
  EXPECT_THAT(inputs.Process(empty),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prompt is empty")));
}

}  // namespace
}  // namespace accel::engine
