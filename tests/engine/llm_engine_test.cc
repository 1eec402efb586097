// LlmEngine, the facade accel-serve and accel-generate use: a request goes
// through the input processor once and the loop on its thread; prompt
// lookup and a draft model come from the speculative config and give the
// tokens of plain decoding; the KV cache holds the draft model's keys too;
// what cannot be served is refused when the engine loads, naming the field.
#include "engine/llm_engine.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

#include "models/load_model.h"
#include "models/make_model.h"
#include "tests/testing/fake_cgroup.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::engine {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

class CollectingSink : public RequestSink {
 public:
  void OnTokens(TokenChunk chunk) override {
    absl::MutexLock lock(&mu_);
    tokens_.insert(tokens_.end(), chunk.token_ids.begin(), chunk.token_ids.end());
  }
  void OnDone(const absl::Status& status, const Completion& completion) override {
    {
      absl::MutexLock lock(&mu_);
      status_ = status;
      completion_ = completion;
    }
    done_.Notify();
  }
  std::vector<int64_t> Wait() {
    EXPECT_TRUE(done_.WaitForNotificationWithTimeout(absl::Seconds(60)));
    absl::MutexLock lock(&mu_);
    EXPECT_THAT(status_, IsOk());
    return tokens_;
  }

 private:
  absl::Mutex mu_;
  std::vector<int64_t> tokens_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  Completion completion_ ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
};

class LlmEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    models::MakeModelOptions o;
    o.hidden_size = 32;
    o.num_layers = 2;
    o.vocab_size = 300;
    o.max_position_embeddings = 512;
    ASSERT_THAT(models::MakeModel(dir_.path() + "/target", o), IsOk());
    o.num_layers = 1;
    o.seed = 9;
    ASSERT_THAT(models::MakeModel(dir_.path() + "/draft", o), IsOk());
  }

  EngineOptions Options(const std::string& speculative_json = "") {
    EngineOptions e;
    e.model_dir = dir_.path() + "/target";
    e.load.device_map = "cpu";
    e.kv_cache_memory = "1MiB";
    auto spec = ParseSpeculativeConfig(speculative_json);
    EXPECT_THAT(spec, IsOk());
    if (spec.ok()) e.speculative = *spec;
    return e;
  }

  std::vector<int64_t> Run(LlmEngine& engine, std::vector<int64_t> prompt, int64_t max_new) {
    GenerationRequest r;
    r.prompt_ids = std::move(prompt);
    r.max_new_tokens = max_new;
    r.ignore_eos = true;
    auto sink = std::make_shared<CollectingSink>();
    EXPECT_THAT(engine.Submit(r, sink), IsOk());
    return sink->Wait();
  }

  TempDir dir_;
};

TEST_F(LlmEngineTest, PromptLookupAndADraftModelGiveThePlainTokens) {
  // Every token of the vocabulary, then a question: prompt lookup always
  // finds the last token earlier (and drafts the ones after it).
  std::vector<int64_t> prompt;
  for (int64_t id = 0; id < 300; ++id) prompt.push_back(id);
  for (int64_t id : {5, 6, 7, 8, 5, 6}) prompt.push_back(id);
  auto plain = LlmEngine::Load(Options(), nullptr);
  ASSERT_THAT(plain, IsOk());
  EXPECT_EQ((*plain)->info().speculative_method, "none");
  const std::vector<int64_t> want = Run(**plain, prompt, 20);
  ASSERT_EQ(want.size(), 20u);

  auto ngram = LlmEngine::Load(
      Options(R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                 "prompt_lookup_max": 2})"),
      nullptr);
  ASSERT_THAT(ngram, IsOk());
  EXPECT_EQ((*ngram)->info().speculative_method, "ngram");
  EXPECT_EQ(Run(**ngram, prompt, 20), want);
  EXPECT_GT((*ngram)->loop().snapshot().engine.spec_num_draft_tokens, 0);

  auto draft = LlmEngine::Load(
      Options(R"({"model": ")" + dir_.path() + R"(/draft", "num_speculative_tokens": 2})"),
      nullptr);
  ASSERT_THAT(draft, IsOk());
  EXPECT_EQ((*draft)->info().speculative_method, "draft_model");
  EXPECT_EQ((*draft)->info().draft_model, dir_.path() + "/draft");
  // The draft's weights count on the cpu beside the target's.
  EXPECT_GT((*draft)->info().bytes_per_device.at("cpu"),
            (*plain)->info().bytes_per_device.at("cpu"));
  EXPECT_EQ(Run(**draft, prompt, 20), want);
  EXPECT_GT((*draft)->loop().snapshot().engine.spec_num_draft_tokens, 0);
}

// n choices' chunks by index, each choice's finish, and the one OnDone.
class ChoicesSink : public RequestSink {
 public:
  void OnTokens(TokenChunk chunk) override {
    absl::MutexLock lock(&mu_);
    std::vector<int64_t>& tokens = tokens_[chunk.index];
    tokens.insert(tokens.end(), chunk.token_ids.begin(), chunk.token_ids.end());
    if (chunk.finish) {
      EXPECT_FALSE(finish_.count(chunk.index)) << "choice " << chunk.index << " ended twice";
      finish_[chunk.index] = *chunk.finish;
      generated_[chunk.index] = chunk.generated_tokens;
    }
  }
  void OnDone(const absl::Status& status, const Completion& completion) override {
    {
      absl::MutexLock lock(&mu_);
      EXPECT_FALSE(done_.HasBeenNotified()) << "OnDone twice";
      status_ = status;
      completion_ = completion;
    }
    done_.Notify();
  }
  // Each choice's tokens, and the completion.
  std::map<int64_t, std::vector<int64_t>> Wait(Completion* completion = nullptr) {
    EXPECT_TRUE(done_.WaitForNotificationWithTimeout(absl::Seconds(60)));
    absl::MutexLock lock(&mu_);
    EXPECT_THAT(status_, IsOk());
    for (const auto& [index, tokens] : tokens_) {
      EXPECT_TRUE(finish_.count(index)) << "choice " << index << " has no finish";
      EXPECT_EQ(generated_[index], static_cast<int64_t>(tokens.size()));
    }
    if (completion != nullptr) *completion = completion_;
    return tokens_;
  }

 private:
  absl::Mutex mu_;
  std::map<int64_t, std::vector<int64_t>> tokens_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, Finish> finish_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, int64_t> generated_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  Completion completion_ ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
};

// n > 1: choice i of a seeded request is the single request seeded seed + i;
// the prompt is computed once (the other choices join on its cached
// blocks); usage counts every choice's tokens; greedy choices are equal.
TEST_F(LlmEngineTest, NChoicesShareThePromptAndEachIsItsOwnSeededStream) {
  auto engine = LlmEngine::Load(Options(), nullptr);
  ASSERT_THAT(engine, IsOk());
  std::vector<int64_t> prompt;
  for (int64_t id = 0; id < 40; ++id) prompt.push_back((id * 7) % 300);
  GenerationRequest r;
  r.prompt_ids = prompt;
  r.max_new_tokens = 6;
  r.ignore_eos = true;
  r.sampling.temperature = 1.0;
  r.sampling.seed = 1234;
  // Each choice alone, on another engine (so this one's cache is cold).
  auto other = LlmEngine::Load(Options(), nullptr);
  ASSERT_THAT(other, IsOk());
  std::vector<std::vector<int64_t>> alone;
  for (uint64_t seed : {1234u, 1235u, 1236u}) {
    GenerationRequest one = r;
    one.sampling.seed = seed;
    auto sink = std::make_shared<CollectingSink>();
    ASSERT_THAT((*other)->Submit(one, sink), IsOk());
    alone.push_back(sink->Wait());
  }
  EXPECT_NE(alone[0], alone[1]);  // the seeds differ, so do the choices
  const EngineStats before = (*engine)->loop().snapshot().engine;
  r.n = 3;
  auto sink = std::make_shared<ChoicesSink>();
  ASSERT_THAT((*engine)->Submit(r, sink), IsOk());
  Completion completion;
  std::map<int64_t, std::vector<int64_t>> choices = sink->Wait(&completion);
  ASSERT_EQ(choices.size(), 3u);
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(choices[i], alone[i]) << "choice " << i;
  EXPECT_EQ(completion.generated_tokens, 18);
  EXPECT_EQ(completion.prompt_tokens, 40);
  const EngineStats after = (*engine)->loop().snapshot().engine;
  // 40 tokens once, then 8 (past the two full 16-token blocks) for each other.
  EXPECT_EQ(after.prompt_tokens - before.prompt_tokens, 40 + 8 + 8);
  EXPECT_EQ(after.prefix_hit_tokens - before.prefix_hit_tokens, 64);

  // Greedy: every choice is the greedy text.
  r.sampling.temperature = 0;
  r.sampling.seed.reset();
  r.n = 2;
  sink = std::make_shared<ChoicesSink>();
  ASSERT_THAT((*engine)->Submit(r, sink), IsOk());
  choices = sink->Wait();
  ASSERT_EQ(choices.size(), 2u);
  EXPECT_EQ(choices[0], choices[1]);
  EXPECT_EQ(choices[0].size(), 6u);
}

// A list of prompts (OpenAI's): prompt p's choice j is index p * n + j, each
// what the prompt gives alone; usage counts every prompt once and every
// choice's tokens; a bad prompt is refused naming which.
TEST_F(LlmEngineTest, ABatchOfPromptsIsOneAnswerInOpenAisOrder) {
  auto engine = LlmEngine::Load(Options(), nullptr);
  ASSERT_THAT(engine, IsOk());
  const std::vector<int64_t> a = {4, 8, 15}, b = {16, 23, 42, 7};
  const std::vector<int64_t> alone_a = Run(**engine, a, 5), alone_b = Run(**engine, b, 5);
  std::vector<GenerationRequest> batch(2);
  batch[0].prompt_ids = a;
  batch[1].prompt_ids = b;
  for (GenerationRequest& r : batch) {
    r.max_new_tokens = 5;
    r.ignore_eos = true;
    r.n = 2;
  }
  auto sink = std::make_shared<ChoicesSink>();
  ASSERT_THAT((*engine)->SubmitBatch(batch, sink), IsOk());
  Completion completion;
  std::map<int64_t, std::vector<int64_t>> choices = sink->Wait(&completion);
  ASSERT_EQ(choices.size(), 4u);
  EXPECT_EQ(choices[0], alone_a);
  EXPECT_EQ(choices[1], alone_a);
  EXPECT_EQ(choices[2], alone_b);
  EXPECT_EQ(choices[3], alone_b);
  EXPECT_EQ(completion.prompt_tokens, 7);
  EXPECT_EQ(completion.generated_tokens, 20);
  batch[1].prompt_ids = {1, 300};
  EXPECT_THAT((*engine)->SubmitBatch(batch, std::make_shared<ChoicesSink>()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(prompt 1)")));
}

// min_tokens masks the stop tokens until that many were generated: the
// token greedy decoding gives first, made a stop token, ends a request
// at once, and with min_tokens 4 only after four others.
TEST_F(LlmEngineTest, MinTokensMasksStopTokensUntilReached) {
  auto engine = LlmEngine::Load(Options(), nullptr);
  ASSERT_THAT(engine, IsOk());
  const std::vector<int64_t> greedy = Run(**engine, {3, 1, 4, 1, 5}, 8);
  ASSERT_EQ(greedy.size(), 8u);
  GenerationRequest r;
  r.prompt_ids = {3, 1, 4, 1, 5};
  r.max_new_tokens = 8;
  r.ignore_eos = true;
  r.stop_token_ids = {greedy[0]};
  auto sink = std::make_shared<CollectingSink>();
  ASSERT_THAT((*engine)->Submit(r, sink), IsOk());
  EXPECT_EQ(sink->Wait(), std::vector<int64_t>{greedy[0]});
  r.min_tokens = 4;
  sink = std::make_shared<CollectingSink>();
  ASSERT_THAT((*engine)->Submit(r, sink), IsOk());
  const std::vector<int64_t> got = sink->Wait();
  ASSERT_GE(got.size(), 5u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NE(got[i], greedy[0]) << "token " << i;
  for (size_t i = 4; i + 1 < got.size(); ++i) EXPECT_NE(got[i], greedy[0]) << "token " << i;
}

// A model that fits maps its weights in place, and they become resident only
// as they are used: the KV cache's automatic size is what the load plan left
// beside them in the cpu budget, not half the memory free at the engine's
// start (which does not yet hold the weights).
TEST(LlmEngineKvTest, AutomaticKvOfAModelThatFitsStaysWithinTheLoadPlan) {
  TempDir dir;
  models::MakeModelOptions o;
  o.hidden_size = 64;
  o.num_layers = 2;
  o.max_position_embeddings = 32768;  // the engine would want a large KV cache
  ASSERT_THAT(models::MakeModel(dir.path(), o), IsOk());
  // A memory cgroup of 1 GiB with nothing used: half of what is free is
  // more than its budget leaves beside the weights and the runtime's reserve.
  test::FakeMemoryCgroup cgroup(int64_t{1} << 30);
  EngineOptions options;
  options.model_dir = dir.path();
  options.load.progress = Progress::Style::kSilent;
  auto plan = models::PlanLoad(dir.path(), options.load);
  ASSERT_THAT(plan, IsOk());
  ASSERT_TRUE(plan->memory.fits);
  ASSERT_GT(plan->memory.kv_cache_bytes, 0);
  auto engine = LlmEngine::Load(options, nullptr);
  ASSERT_THAT(engine, IsOk());
  const ModelInfo& info = (*engine)->info();
  EXPECT_GT(info.kv_blocks, 0);
  EXPECT_LE(info.kv_blocks * info.kv_block_bytes, plan->memory.kv_cache_bytes);
  // Within a block of it: the plan's room is what the KV cache gets.
  EXPECT_GT((info.kv_blocks + 1) * info.kv_block_bytes, plan->memory.kv_cache_bytes);
}

// --gpu_memory_utilization sizes the KV cache on a CUDA execution device
// only (engine/gpu_memory.h; the device script checks it there): on the cpu
// the blocks are --kv_cache_memory's whatever the fraction.
TEST_F(LlmEngineTest, OnTheCpuGpuMemoryUtilizationChangesNothing) {
  EngineOptions given = Options();  // 1 MiB
  given.gpu_memory_utilization = 0.05;
  auto engine = LlmEngine::Load(given, nullptr);
  ASSERT_THAT(engine, IsOk());
  const ModelInfo& info = (*engine)->info();
  ASSERT_GT(info.kv_block_bytes, 0);
  EXPECT_EQ(info.kv_blocks, (int64_t{1} << 20) / info.kv_block_bytes);
  EXPECT_THAT(info.kv_sizing, HasSubstr("--kv_cache_memory=1MiB -> "));
  std::vector<int64_t> blocks;
  for (double utilization : {0.05, 1.0}) {
    EngineOptions automatic = Options();
    automatic.kv_cache_memory = "auto";
    automatic.gpu_memory_utilization = utilization;
    auto loaded = LlmEngine::Load(automatic, nullptr);
    ASSERT_THAT(loaded, IsOk());
    blocks.push_back((*loaded)->info().kv_blocks);
    EXPECT_THAT((*loaded)->info().kv_sizing, HasSubstr("--kv_cache_memory=auto -> "));
  }
  EXPECT_GT(blocks[0], 0);
  EXPECT_EQ(blocks[0], blocks[1]);
}

TEST_F(LlmEngineTest, WhatCannotBeServedIsRefusedAtLoadAndBadRequestsAtSubmit) {
  EXPECT_THAT(LlmEngine::Load(Options(R"({"model": ")" + dir_.path() +
                                      R"(/none", "num_speculative_tokens": 2})"),
                              nullptr),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("--speculative_config"), HasSubstr("\"model\""))));
  EngineOptions small = Options();
  small.kv_cache_memory = "1KiB";
  EXPECT_THAT(LlmEngine::Load(small, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds no KV block")));
  auto engine = LlmEngine::Load(Options(), nullptr);
  ASSERT_THAT(engine, IsOk());
  EXPECT_EQ((*engine)->info().max_total_tokens, 512);
  GenerationRequest r;
  r.prompt_ids = std::vector<int64_t>(512, 1);
  EXPECT_THAT((*engine)->Submit(r, std::make_shared<CollectingSink>()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("over the limit of 511 (--max_input_tokens)")));
  r.prompt_ids = {1, 2};
  r.sampling.top_k = -1;
  EXPECT_THAT((*engine)->Submit(r, std::make_shared<CollectingSink>()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k")));
  r.sampling.top_k = 0;
  for (int64_t n : {0, -1, 129}) {
    r.n = n;
    EXPECT_THAT((*engine)->Submit(r, std::make_shared<CollectingSink>()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n: must be in [1, 128]")));
  }
  r.n = 2;
  r.max_new_tokens = 3;
  r.min_tokens = 4;
  EXPECT_THAT((*engine)->Submit(r, std::make_shared<CollectingSink>()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("min_tokens: 4 is more than max_new_tokens (3)")));
  r.min_tokens = -1;
  EXPECT_THAT((*engine)->Submit(r, std::make_shared<CollectingSink>()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("min_tokens")));
  r.min_tokens = 0;
  r.stop_token_ids = {300};
  EXPECT_THAT((*engine)->Submit(r, std::make_shared<CollectingSink>()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("stop_token_ids[0]: token id 300 is outside")));
}

}  // namespace
}  // namespace accel::engine
