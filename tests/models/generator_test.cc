// Generation against a plain loop written here (the whole sequence through
// the model at every step, no cache, argmax), plus: packed and joined-late
// sequences generate what they generate alone, seeds reproduce, stop tokens,
// stop strings (also across tokens and while streaming), limits, log-probs,
// cancellation, and every bad request.
#include "models/generator.h"

#include <memory>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "models/load_model.h"
#include "models/make_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::models {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// Token k reads as one letter, 'a' + k % 26, but only once the next token
// arrives (as a real incremental decoder holds back a partial character).
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

std::string Letters(const std::vector<int64_t>& ids) {
  std::string out;
  for (int64_t id : ids) out += static_cast<char>('a' + id % 26);
  return out;
}

class GeneratorTest : public ::testing::Test {
 protected:
  void SetUp() override { Load("llama", 0); }

  void Load(const std::string& family, int64_t max_positions) {
    MakeModelOptions o;
    o.family = family;
    o.hidden_size = 32;
    o.num_heads = 4;
    o.num_kv_heads = 2;
    o.num_layers = 2;
    o.vocab_size = 300;
    if (max_positions > 0) o.max_position_embeddings = max_positions;
    ASSERT_THAT(MakeModel(dir_.path(), o), IsOk());
    ModelLoadOptions options;
    options.device_map = "cpu";
    options.progress = Progress::Style::kSilent;
    auto loaded = LoadModel(dir_.path(), options);
    ASSERT_THAT(loaded, IsOk());
    loaded_ = std::make_unique<LoadedModel>(*std::move(loaded));
  }

  Generator MakeGenerator(bool text = true) {
    TextStreamFactory streams;
    if (text) streams = [] { return std::make_unique<LetterStream>(); };
    return Generator(loaded_->model, loaded_->dispatched.get(), streams);
  }

  // The reference: no cache, no packing, the whole sequence every step.
  std::vector<int64_t> GreedyByHand(std::vector<int64_t> ids, int64_t count,
                                    std::vector<float>* logprobs = nullptr) {
    c10::InferenceMode inference;
    std::vector<int64_t> out;
    for (int64_t i = 0; i < count; ++i) {
      auto logits = loaded_->model->Forward(at::tensor(ids, at::kLong),
                                            {{nullptr, static_cast<int64_t>(ids.size())}},
                                            Logits::kAll, loaded_->dispatched.get());
      EXPECT_THAT(logits, IsOk());
      at::Tensor last = (*logits)[static_cast<int64_t>(ids.size()) - 1];
      const int64_t next = last.argmax().item<int64_t>();
      if (logprobs) logprobs->push_back(at::log_softmax(last, -1)[next].item<float>());
      ids.push_back(next);
      out.push_back(next);
    }
    return out;
  }

  GenerationRequest Greedy(std::vector<int64_t> prompt, int64_t max_new_tokens) {
    GenerationRequest r;
    r.prompt_ids = std::move(prompt);
    r.sampling.temperature = 0;
    r.max_new_tokens = max_new_tokens;
    return r;
  }

  TempDir dir_;
  std::unique_ptr<LoadedModel> loaded_;
};

TEST_F(GeneratorTest, GreedyEqualsTheLoopWithoutACache) {
  Generator generator = MakeGenerator();
  GenerationRequest request = Greedy({5, 17, 299, 42}, 12);
  request.logprobs = true;
  auto results = Generate(generator, {request});
  ASSERT_THAT(results, IsOk());
  std::vector<float> logprobs;
  const std::vector<int64_t> expected = GreedyByHand({5, 17, 299, 42}, 12, &logprobs);
  EXPECT_THAT((*results)[0].token_ids, ElementsAreArray(expected));
  EXPECT_EQ((*results)[0].finish_reason, FinishReason::kLength);
  EXPECT_EQ((*results)[0].text, Letters(expected));
  ASSERT_EQ((*results)[0].logprobs.size(), 12u);
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_NEAR((*results)[0].logprobs[i], logprobs[i], 1e-5) << i;
    EXPECT_LT((*results)[0].logprobs[i], 0.0f);
  }
  EXPECT_EQ(generator.running(), 0u);
  EXPECT_EQ(generator.kv_cache_bytes(), 0);
}

TEST_F(GeneratorTest, ABatchGeneratesWhatEachRequestGeneratesAlone) {
  std::vector<GenerationRequest> requests = {Greedy({1, 2, 3, 4, 5, 6, 7}, 9), Greedy({250}, 4),
                                             Greedy({9, 8, 7}, 6)};
  // Sampled too: a seed makes the draws the same whatever else is running.
  GenerationRequest sampled = Greedy({11, 12, 13}, 8);
  sampled.sampling.temperature = 1.5;
  sampled.sampling.top_k = 50;
  sampled.sampling.seed = 7;
  requests.push_back(sampled);
  std::vector<GenerationResult> alone;
  for (const GenerationRequest& r : requests) {
    Generator generator = MakeGenerator();
    auto result = Generate(generator, {r});
    ASSERT_THAT(result, IsOk());
    alone.push_back((*result)[0]);
  }
  Generator generator = MakeGenerator();
  auto together = Generate(generator, requests);
  ASSERT_THAT(together, IsOk());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_THAT((*together)[i].token_ids, ElementsAreArray(alone[i].token_ids)) << i;
    EXPECT_EQ((*together)[i].text, alone[i].text) << i;
  }
}

TEST_F(GeneratorTest, ARequestJoiningMidwayGeneratesWhatItGeneratesAlone) {
  const std::vector<int64_t> first = GreedyByHand({3, 1, 4}, 6);
  const std::vector<int64_t> second = GreedyByHand({2, 7, 1, 8, 2, 8}, 3);
  Generator generator = MakeGenerator();
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t a, generator.Add(Greedy({3, 1, 4}, 6)));
  std::vector<int64_t> got_a, got_b;
  for (int step = 0; step < 2; ++step) {
    auto events = generator.Step();
    ASSERT_THAT(events, IsOk());
    for (const TokenEvent& e : *events) got_a.push_back(e.token_id);
  }
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t b, generator.Add(Greedy({2, 7, 1, 8, 2, 8}, 3)));
  while (generator.running() > 0) {
    auto events = generator.Step();
    ASSERT_THAT(events, IsOk());
    for (const TokenEvent& e : *events) (e.sequence == a ? got_a : got_b).push_back(e.token_id);
    EXPECT_TRUE(std::all_of(events->begin(), events->end(), [&](const TokenEvent& e) {
      return e.sequence == a || e.sequence == b;
    }));
  }
  EXPECT_THAT(got_a, ElementsAreArray(first));
  EXPECT_THAT(got_b, ElementsAreArray(second));
}

TEST_F(GeneratorTest, TheSameSeedGivesTheSameTokens) {
  auto run = [&](uint64_t seed) {
    GenerationRequest r = Greedy({1, 2, 3}, 16);
    r.sampling.temperature = 2.0;  // near-uniform over 300 tokens
    r.sampling.seed = seed;
    Generator generator = MakeGenerator();
    auto result = Generate(generator, {r});
    EXPECT_THAT(result, IsOk());
    return (*result)[0].token_ids;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST_F(GeneratorTest, AStopTokenEndsTheSequence) {
  const std::vector<int64_t> greedy = GreedyByHand({10, 20}, 8);
  const int64_t stop = greedy[4];
  const size_t first = std::find(greedy.begin(), greedy.end(), stop) - greedy.begin();
  GenerationRequest r = Greedy({10, 20}, 8);
  r.stop_token_ids = {299, stop};
  Generator generator = MakeGenerator();
  auto result = Generate(generator, {r});
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ((*result)[0].finish_reason, FinishReason::kEos);
  EXPECT_THAT((*result)[0].token_ids,
              ElementsAreArray(std::vector<int64_t>(greedy.begin(), greedy.begin() + first + 1)));
  EXPECT_EQ(FinishReasonName(FinishReason::kEos), "eos");
}

TEST_F(GeneratorTest, AStopStringCutsTheTextAndIsNeverStreamed) {
  const std::vector<int64_t> greedy = GreedyByHand({4, 5, 6}, 10);
  const std::string all = Letters(greedy);
  // Spans tokens 3..5; the text must end where its first occurrence starts.
  const std::string stop = all.substr(3, 3);
  const size_t cut = all.find(stop);
  GenerationRequest r = Greedy({4, 5, 6}, 10);
  r.stop_strings = {"never-there", stop};
  Generator generator = MakeGenerator();
  ASSERT_THAT(generator.Add(r), IsOk());
  std::string streamed;
  std::optional<FinishReason> finish;
  int64_t tokens = 0;
  while (generator.running() > 0) {
    auto events = generator.Step();
    ASSERT_THAT(events, IsOk());
    for (const TokenEvent& e : *events) {
      streamed += e.text;
      ++tokens;
      // Never more than the text before the stop string, at any moment.
      EXPECT_LE(streamed.size(), cut);
      if (e.finish) finish = e.finish;
    }
  }
  EXPECT_EQ(finish, FinishReason::kStop);
  EXPECT_EQ(streamed, all.substr(0, cut));
  // The letter of token t appears when token t + 1 arrives: the stop string
  // completes one token after its last letter's token.
  EXPECT_EQ(tokens, static_cast<int64_t>(cut + stop.size() + 1));
}

TEST_F(GeneratorTest, AStopStringCompletedByTheFinalFlushStillStops) {
  const std::vector<int64_t> greedy = GreedyByHand({7, 7}, 5);
  const std::string all = Letters(greedy);
  GenerationRequest r = Greedy({7, 7}, 5);
  r.stop_strings = {all.substr(3, 2)};  // its last letter comes only with Flush()
  Generator generator = MakeGenerator();
  auto result = Generate(generator, {r});
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ((*result)[0].text, all.substr(0, all.find(all.substr(3, 2))));
  EXPECT_EQ((*result)[0].finish_reason, FinishReason::kStop);
  EXPECT_EQ((*result)[0].token_ids.size(), 5u);
}

TEST_F(GeneratorTest, TheModelsPositionLimitEndsGeneration) {
  Load("gpt2", 8);
  Generator generator = MakeGenerator();
  EXPECT_EQ(generator.position_limit(), 8);
  auto result = Generate(generator, {Greedy({1, 2, 3, 4, 5}, 100)});
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ((*result)[0].token_ids.size(), 3u);
  EXPECT_EQ((*result)[0].finish_reason, FinishReason::kLength);
  EXPECT_THAT(generator.Add(Greedy({1, 2, 3, 4, 5, 6, 7, 8}, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 8 positions")));
}

TEST_F(GeneratorTest, CancelFreesTheCacheAtOnce) {
  Generator generator = MakeGenerator();
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t a, generator.Add(Greedy({1, 2, 3}, 50)));
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t b, generator.Add(Greedy({4, 5}, 50)));
  ASSERT_THAT(generator.Step(), IsOk());
  const int64_t both = generator.kv_cache_bytes();
  EXPECT_GT(both, 0);
  EXPECT_TRUE(generator.Cancel(a));
  EXPECT_FALSE(generator.Cancel(a));
  EXPECT_LT(generator.kv_cache_bytes(), both);
  auto events = generator.Step();
  ASSERT_THAT(events, IsOk());
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].sequence, b);
  EXPECT_TRUE(generator.Cancel(b));
  EXPECT_EQ(generator.running(), 0u);
  EXPECT_EQ(generator.kv_cache_bytes(), 0);
  auto none = generator.Step();
  ASSERT_THAT(none, IsOk());
  EXPECT_TRUE(none->empty());
}

TEST_F(GeneratorTest, BadRequestsAreClearErrors) {
  Generator generator = MakeGenerator();
  auto bad = [&](GenerationRequest r, const std::string& message) {
    EXPECT_THAT(generator.Add(std::move(r)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message)));
  };
  bad(Greedy({}, 4), "prompt is empty");
  bad(Greedy({1, 300}, 4), "input_ids[1]: token id 300");
  bad(Greedy({-5}, 4), "token id -5");
  bad(Greedy({1}, -1), "max_new_tokens");
  GenerationRequest hot = Greedy({1}, 4);
  hot.sampling.temperature = -1;
  bad(hot, "temperature");
  GenerationRequest empty_stop = Greedy({1}, 4);
  empty_stop.stop_strings = {"x", ""};
  bad(empty_stop, "stop[1] is empty");
  Generator no_text = MakeGenerator(/*text=*/false);
  GenerationRequest stop = Greedy({1}, 4);
  stop.stop_strings = {"x"};
  EXPECT_THAT(no_text.Add(stop),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("need a tokenizer")));
  EXPECT_EQ(generator.running(), 0u);
  // One bad request fails Generate() as a whole and leaves nothing running.
  auto results = Generate(generator, {Greedy({1}, 2), Greedy({}, 2)});
  EXPECT_THAT(results, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("request 1")));
  EXPECT_EQ(generator.running(), 0u);
}

}  // namespace
}  // namespace accel::models
