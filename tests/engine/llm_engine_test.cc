// LlmEngine, the facade accel-serve and accel-generate use: a request goes
// through the input processor once and the loop on its thread; prompt
// lookup and a draft model come from the speculative config and give the
// tokens of plain decoding; the KV cache holds the draft model's keys too;
// what cannot be served is refused when the engine loads, naming the field.
#include "engine/llm_engine.h"

#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

#include "models/make_model.h"
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
}

}  // namespace
}  // namespace accel::engine
