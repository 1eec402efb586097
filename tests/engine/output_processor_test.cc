// The output processor alone: text per token from the request's stream,
// stop strings cut the text before them and are never streamed (held back
// while they could still be one), a stop string completed mid-step drops
// the step's later tokens, the decoder's final flush can complete a stop
// string, and log-probabilities travel with their tokens.
#include "engine/output_processor.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accel::engine {
namespace {

using ::testing::ElementsAre;

// Token k reads as 'a' + k % 26, but only once the next token arrives (as a
// real incremental decoder holds back a partial character).
class LetterStream : public TextStream {
 public:
  std::string Next(int64_t id) override {
    std::string out = held_;
    held_ = std::string(1, static_cast<char>('a' + id % 26));
    return out;
  }
  std::string Flush() override { return std::exchange(held_, std::string()); }

 private:
  std::string held_;
};

OutputProcessor Letters() {
  return OutputProcessor([] { return std::make_unique<LetterStream>(); });
}

RequestUpdate Update(uint64_t id, std::vector<int64_t> tokens,
                     std::optional<FinishReason> finish = std::nullopt) {
  RequestUpdate u;
  u.id = id;
  u.token_ids = std::move(tokens);
  u.logprobs.assign(u.token_ids.size(), std::nullopt);
  u.top_logprobs.resize(u.token_ids.size());
  u.finish = finish;
  return u;
}

std::string Text(const std::vector<TokenEvent>& events) {
  std::string out;
  for (const TokenEvent& e : events) out += e.text;
  return out;
}

TEST(OutputProcessorTest, EachTokensTextComesWhenTheDecoderGivesIt) {
  OutputProcessor p = Letters();
  GenerationRequest r;
  p.Add(1, r);
  std::vector<TokenEvent> events = p.Process({Update(1, {0, 1, 2})});
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].text, "");  // held by the decoder until the next token
  EXPECT_EQ(Text(events), "ab");
  events = p.Process({Update(1, {3}, FinishReason::kLength)});
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].text, "cd");  // the finish flushes the decoder
  EXPECT_EQ(events[0].finish, FinishReason::kLength);
  // Finished requests are gone.
  EXPECT_TRUE(p.Process({Update(1, {4})}).empty());
}

TEST(OutputProcessorTest, AStopStringIsNeverStreamedAndDropsTheRestOfTheStep) {
  OutputProcessor p = Letters();
  GenerationRequest r;
  r.stop_strings = {"xyz", "cde"};
  p.Add(1, r);
  // "abc": "c" could start "cde", so only "ab" goes out.
  std::vector<TokenEvent> events = p.Process({Update(1, {0, 1, 2, 3})});
  EXPECT_EQ(Text(events), "ab");
  // "cd" held; "e" completes "cde" with token 5 (the letter of 4 arrives
  // then): the request stops at token 5, and 6, 7 are dropped.
  events = p.Process({Update(1, {4, 5, 6, 7})});
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(Text(events), "");
  EXPECT_EQ(events.back().token_id, 5);
  EXPECT_EQ(events.back().finish, FinishReason::kStop);
}

TEST(OutputProcessorTest, IncludeStopStrInOutputKeepsTheStopString) {
  OutputProcessor p = Letters();
  GenerationRequest r;
  r.stop_strings = {"cd"};
  r.include_stop_str_in_output = true;
  p.Add(1, r);
  std::vector<TokenEvent> events = p.Process({Update(1, {0, 1, 2, 3, 4, 5})});
  EXPECT_EQ(Text(events), "abcd");
  EXPECT_EQ(events.back().token_id, 4);
  EXPECT_EQ(events.back().finish, FinishReason::kStop);
}

// vLLM's min_tokens: stop strings are matched once more than min_tokens
// tokens were generated; one completed earlier stays in the text.
TEST(OutputProcessorTest, StopStringsAreNotMatchedBeforeMinTokens) {
  OutputProcessor p = Letters();
  GenerationRequest r;
  r.stop_strings = {"b", "e"};
  r.min_tokens = 3;
  p.Add(1, r);
  // Token 2 makes "b" readable (the letter of 1): 2 tokens, not matched.
  std::vector<TokenEvent> events = p.Process({Update(1, {0, 1, 2})});
  EXPECT_EQ(Text(events), "ab");
  EXPECT_FALSE(events.back().finish.has_value());
  events = p.Process({Update(1, {3, 4, 5, 6})});
  EXPECT_EQ(Text(events), "cd");  // "e" (read with token 5) is a stop: matched now
  EXPECT_EQ(events.back().token_id, 5);
  EXPECT_EQ(events.back().finish, FinishReason::kStop);
}

TEST(OutputProcessorTest, TheFinalFlushCanCompleteAStopString) {
  OutputProcessor p = Letters();
  GenerationRequest r;
  r.stop_strings = {"bc"};
  p.Add(1, r);
  std::vector<TokenEvent> events = p.Process({Update(1, {0, 1, 2}, FinishReason::kEos)});
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(Text(events), "a");
  EXPECT_EQ(events.back().finish, FinishReason::kStop);
}

TEST(OutputProcessorTest, LogprobsAndRequestsStayApart) {
  OutputProcessor p(nullptr);  // no text
  EXPECT_FALSE(p.has_text_streams());
  GenerationRequest r;
  p.Add(1, r);
  p.Add(2, r);
  RequestUpdate a = Update(1, {5, 6});
  a.logprobs = {-0.5f, -1.5f};
  a.top_logprobs[1] = {{6, -1.5f}, {9, -2.0f}};
  std::vector<TokenEvent> events = p.Process({a, Update(2, {8}, FinishReason::kEos)});
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].sequence, 1u);
  EXPECT_EQ(events[0].logprob, -0.5f);
  EXPECT_EQ(events[1].logprob, -1.5f);
  ASSERT_EQ(events[1].top_logprobs.size(), 2u);
  EXPECT_EQ(events[1].top_logprobs[1].token_id, 9);
  EXPECT_EQ(events[2].sequence, 2u);
  EXPECT_EQ(events[2].finish, FinishReason::kEos);
  EXPECT_EQ(events[2].text, "");
  p.Remove(1);
  EXPECT_TRUE(p.Process({Update(1, {1})}).empty());
}

}  // namespace
}  // namespace accel::engine
