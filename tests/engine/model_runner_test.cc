// The model runner under the engine core on real (small, random) models:
// generation against a plain loop written here (the whole sequence through
// the model at every step, no cache, argmax), plus: packed and joined-late
// sequences generate what they generate alone, seeds reproduce, stop tokens,
// stop strings (also across tokens and while streaming), limits, log-probs,
// cancellation, preemption under a small KV cache, prefix caching, chunked
// prefill, LongRoPE, and the logits-processor hook.
#include "engine/model_runner.h"

#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/decode_graphs.h"
#include "engine/engine_core.h"
#include "engine/internal/cuda_sync_counter.h"
#include "engine/kv_cache_manager.h"
#include "engine/logits_processor.h"
#include "engine/output_processor.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "models/load_model.h"
#include "models/make_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::engine {
namespace {

using models::LoadedModel;
using models::LoadModel;
using models::Logits;
using models::MakeModel;
using models::MakeModelOptions;
using models::ModelLoadOptions;

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::ElementsAreArray;
using ::testing::FloatNear;
using ::testing::HasSubstr;
using ::testing::Pointwise;

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

// The engine core's and the runner's options the tests vary.
struct GeneratorOptions {
  int64_t kv_cache_blocks = 0;
  int64_t block_size = 16;
  bool prefix_caching = true;
  int64_t max_num_batched_tokens = 0;
};

class GeneratorTest : public ::testing::Test {
 protected:
  void SetUp() override { Load("llama", 0); }

  void Load(const std::string& family, int64_t max_positions, int64_t longrope_factor = 0,
            std::optional<int64_t> sliding_window = std::nullopt) {
    MakeModelOptions o;
    o.family = family;
    o.sliding_window = sliding_window;
    o.longrope_factor = longrope_factor;
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

  EngineCore MakeGenerator(bool text = true, GeneratorOptions options = {},
                           ModelRunnerOptions runner_options = {}) {
    TextStreamFactory streams;
    if (text) streams = [] { return std::make_unique<LetterStream>(); };
    runner_options.num_blocks = options.kv_cache_blocks;
    runner_options.block_size = options.block_size;
    auto runner = ModelRunner::Create(loaded_->model, loaded_->dispatched.get(), runner_options);
    EXPECT_THAT(runner, IsOk());
    EngineCoreOptions core;
    core.prefix_caching = options.prefix_caching;
    core.max_num_batched_tokens = options.max_num_batched_tokens;
    return EngineCore(*std::move(runner), streams, core);
  }

  // Each request run alone in a generator with room to spare.
  std::vector<GenerationResult> Alone(const std::vector<GenerationRequest>& requests) {
    std::vector<GenerationResult> alone;
    for (const GenerationRequest& r : requests) {
      EngineCore generator = MakeGenerator();
      auto result = Generate(generator, {r});
      EXPECT_THAT(result, IsOk());
      if (result.ok()) alone.push_back((*result)[0]);
    }
    return alone;
  }

  std::vector<int64_t> Prompt(int64_t first, int64_t n) {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < n; ++i) ids.push_back((first + i * 37) % 300);
    return ids;
  }

  // The reference: no cache, no packing, the whole sequence every step;
  // `pick` chooses each token from the last position's logits.
  template <typename Pick>
  std::vector<int64_t> ByHand(std::vector<int64_t> ids, int64_t count, Pick pick) {
    c10::InferenceMode inference;
    std::vector<int64_t> out;
    for (int64_t i = 0; i < count; ++i) {
      auto logits = loaded_->model->Forward(at::tensor(ids, at::kLong),
                                            {{nullptr, static_cast<int64_t>(ids.size())}},
                                            Logits::kAll, loaded_->dispatched.get());
      EXPECT_THAT(logits, IsOk());
      const int64_t next = pick((*logits)[static_cast<int64_t>(ids.size()) - 1], ids);
      ids.push_back(next);
      out.push_back(next);
    }
    return out;
  }

  std::vector<int64_t> GreedyByHand(std::vector<int64_t> ids, int64_t count,
                                    std::vector<float>* logprobs = nullptr) {
    return ByHand(std::move(ids), count, [&](const at::Tensor& last, const std::vector<int64_t>&) {
      const int64_t next = last.argmax().item<int64_t>();
      if (logprobs) logprobs->push_back(at::log_softmax(last, -1)[next].item<float>());
      return next;
    });
  }

  // What Sampler::Next draws, a token at a time.
  std::vector<int64_t> SampledByHand(std::vector<int64_t> ids, int64_t count,
                                     const SamplingParams& params) {
    absl::StatusOr<Sampler> sampler = Sampler::Create(params);
    EXPECT_THAT(sampler, IsOk());
    return ByHand(std::move(ids), count,
                  [&](const at::Tensor& last, const std::vector<int64_t>& seen) {
                    return sampler->Next(last, seen);
                  });
  }

  // Seven greedy requests with logprobs, of different lengths, every other
  // one behind the same 9-token prefix (prefix hits).
  std::vector<GenerationRequest> SharedPrefixRequests() {
    std::vector<GenerationRequest> requests;
    const std::vector<int64_t> system = Prompt(5, 9);
    for (int i = 0; i < 7; ++i) {
      std::vector<int64_t> prompt = i % 2 == 0 ? system : std::vector<int64_t>{};
      for (int64_t id : Prompt(i * 13 + 2, 3 + 2 * i)) prompt.push_back(id);
      GenerationRequest r = Greedy(prompt, 8 + 4 * i);
      r.logprobs = true;
      requests.push_back(std::move(r));
    }
    return requests;
  }

  // A small model of `family` made and loaded whole onto GPU 0 (the device
  // tests).
  // "mixtral-nf4": a bfloat16 Mixtral of 8 experts quantized to NF4 on
  // loading, its widths multiples of 256 (what the 4-bit experts kernel
  // takes, so its decode rows route on the device).
  absl::StatusOr<LoadedModel> OnGpu(const std::string& family, int64_t layers,
                                    std::optional<int64_t> sliding_window = std::nullopt) {
    const bool nf4 = family == "mixtral-nf4";
    MakeModelOptions o;
    o.family = nf4 ? "mixtral" : family;
    o.hidden_size = nf4 ? 256 : 64;
    o.num_heads = 4;
    o.num_kv_heads = 2;
    o.num_layers = layers;
    o.vocab_size = 300;
    o.max_position_embeddings = 256;
    o.sliding_window = sliding_window;
    if (nf4) {
      o.intermediate_size = 512;
      o.num_experts = 8;
      o.num_experts_per_tok = 2;
      o.dtype = at::kBFloat16;
    }
    const std::string dir = dir_.path() + "/cuda-" + family + "-" + std::to_string(layers);
    if (auto made = MakeModel(dir, o); !made.ok()) return made.status();
    ModelLoadOptions load;
    load.device_map = "0";
    load.progress = Progress::Style::kSilent;
    if (nf4) load.quantize = "nf4";
    return LoadModel(dir, load);
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
  EngineCore generator = MakeGenerator();
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
  EXPECT_EQ(generator.num_requests(), 0u);
  EXPECT_EQ(generator.stats().kv_blocks_used, 0);
}

// Prompt logprobs (echo with logprobs, lm-eval-harness's loglikelihood):
// each prompt token's log-probability under the tokens before it, from the
// prefill's logits, equals the model's full forward pass's log_softmax, also
// when the prompt is read in chunks beside another request and was cached
// before (such a request computes every position itself).
TEST_F(GeneratorTest, PromptLogprobsAreTheFullForwardsLogSoftmax) {
  const std::vector<int64_t> prompt = Prompt(3, 40);
  at::Tensor reference;
  {
    c10::InferenceMode inference;
    auto logits = loaded_->model->Forward(at::tensor(prompt, at::kLong), {{nullptr, 40}},
                                          Logits::kAll, loaded_->dispatched.get());
    ASSERT_THAT(logits, IsOk());
    reference = at::log_softmax(logits->to(at::kFloat), -1);
  }
  GeneratorOptions options;
  options.max_num_batched_tokens = 16;
  EngineCore generator = MakeGenerator(true, options);
  // The same prompt first, so its blocks are in the prefix cache.
  ASSERT_THAT(Generate(generator, {Greedy(prompt, 2)}), IsOk());
  GenerationRequest request = Greedy(prompt, 3);
  request.logprobs = true;
  request.top_logprobs = 2;
  request.prompt_logprobs = true;
  auto results = Generate(generator, {request, Greedy(Prompt(7, 30), 4)});
  ASSERT_THAT(results, IsOk());
  const std::vector<PromptLogprob>& got = (*results)[0].prompt_logprobs;
  ASSERT_EQ(got.size(), 40u);
  EXPECT_EQ(got[0].token_id, prompt[0]);
  EXPECT_FALSE(got[0].logprob.has_value());
  EXPECT_TRUE(got[0].top_logprobs.empty());
  for (size_t i = 1; i < 40; ++i) {
    const at::Tensor row = reference[static_cast<int64_t>(i) - 1];
    EXPECT_EQ(got[i].token_id, prompt[i]) << i;
    ASSERT_TRUE(got[i].logprob.has_value()) << i;
    EXPECT_NEAR(*got[i].logprob, row[prompt[i]].item<float>(), 1e-4) << i;
    ASSERT_EQ(got[i].top_logprobs.size(), 2u) << i;
    EXPECT_EQ(got[i].top_logprobs[0].token_id, row.argmax().item<int64_t>()) << i;
    EXPECT_NEAR(got[i].top_logprobs[0].logprob, row.max().item<float>(), 1e-4) << i;
  }
  // The generated tokens are those of decoding without it.
  EXPECT_EQ((*results)[0].token_ids, GreedyByHand(prompt, 3));
  EXPECT_TRUE((*results)[1].prompt_logprobs.empty());
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
  // Two more sampled rows drawn in the same call (Sampler::NextRows), with
  // their own filters and seeds, and one with a repetition penalty, which
  // the host samples.
  GenerationRequest nucleus = Greedy({21, 22}, 7);
  nucleus.sampling.temperature = 0.8;
  nucleus.sampling.top_p = 0.9;
  nucleus.sampling.min_p = 0.02;
  nucleus.sampling.seed = 11;
  requests.push_back(nucleus);
  GenerationRequest plain = Greedy({31, 32, 33, 34}, 7);
  plain.sampling.temperature = 1.0;
  plain.sampling.seed = 12;
  requests.push_back(plain);
  GenerationRequest penalised = Greedy({41}, 7);
  penalised.sampling.temperature = 1.0;
  penalised.sampling.repetition_penalty = 1.3;
  penalised.sampling.seed = 13;
  requests.push_back(penalised);
  std::vector<GenerationResult> alone;
  for (const GenerationRequest& r : requests) {
    EngineCore generator = MakeGenerator();
    auto result = Generate(generator, {r});
    ASSERT_THAT(result, IsOk());
    alone.push_back((*result)[0]);
  }
  EngineCore generator = MakeGenerator();
  auto together = Generate(generator, requests);
  ASSERT_THAT(together, IsOk());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_THAT((*together)[i].token_ids, ElementsAreArray(alone[i].token_ids)) << i;
    EXPECT_EQ((*together)[i].text, alone[i].text) << i;
  }
  // And they are the sampler's own draws, row by row.
  for (size_t i = 3; i < requests.size(); ++i) {
    EXPECT_THAT(alone[i].token_ids,
                ElementsAreArray(SampledByHand(requests[i].prompt_ids, requests[i].max_new_tokens,
                                               requests[i].sampling)))
        << i;
  }
}

TEST_F(GeneratorTest, ARequestJoiningMidwayGeneratesWhatItGeneratesAlone) {
  const std::vector<int64_t> first = GreedyByHand({3, 1, 4}, 6);
  const std::vector<int64_t> second = GreedyByHand({2, 7, 1, 8, 2, 8}, 3);
  EngineCore generator = MakeGenerator();
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t a, generator.Add(Greedy({3, 1, 4}, 6)));
  std::vector<int64_t> got_a, got_b;
  for (int step = 0; step < 2; ++step) {
    auto events = generator.Step();
    ASSERT_THAT(events, IsOk());
    for (const TokenEvent& e : *events) got_a.push_back(e.token_id);
  }
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t b, generator.Add(Greedy({2, 7, 1, 8, 2, 8}, 3)));
  while (generator.num_requests() > 0) {
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
    EngineCore generator = MakeGenerator();
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
  EngineCore generator = MakeGenerator();
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
  EngineCore generator = MakeGenerator();
  ASSERT_THAT(generator.Add(r), IsOk());
  std::string streamed;
  std::optional<FinishReason> finish;
  int64_t tokens = 0;
  while (generator.num_requests() > 0) {
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
  EngineCore generator = MakeGenerator();
  auto result = Generate(generator, {r});
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ((*result)[0].text, all.substr(0, all.find(all.substr(3, 2))));
  EXPECT_EQ((*result)[0].finish_reason, FinishReason::kStop);
  EXPECT_EQ((*result)[0].token_ids.size(), 5u);
}

TEST_F(GeneratorTest, TheModelsPositionLimitEndsGeneration) {
  Load("gpt2", 8);
  EngineCore generator = MakeGenerator();
  EXPECT_EQ(generator.position_limit(), 8);
  auto result = Generate(generator, {Greedy({1, 2, 3, 4, 5}, 100)});
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ((*result)[0].token_ids.size(), 3u);
  EXPECT_EQ((*result)[0].finish_reason, FinishReason::kLength);
}

TEST_F(GeneratorTest, CancelFreesTheCacheAtOnce) {
  EngineCore generator = MakeGenerator();
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t a, generator.Add(Greedy({1, 2, 3}, 50)));
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t b, generator.Add(Greedy({4, 5}, 50)));
  ASSERT_THAT(generator.Step(), IsOk());
  const int64_t both = generator.stats().kv_blocks_used;
  EXPECT_GT(both, 0);
  EXPECT_TRUE(generator.Cancel(a));
  EXPECT_FALSE(generator.Cancel(a));
  EXPECT_LT(generator.stats().kv_blocks_used, both);
  auto events = generator.Step();
  ASSERT_THAT(events, IsOk());
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].sequence, b);
  EXPECT_TRUE(generator.Cancel(b));
  EXPECT_EQ(generator.num_requests(), 0u);
  EXPECT_EQ(generator.stats().kv_blocks_used, 0);
  auto none = generator.Step();
  ASSERT_THAT(none, IsOk());
  EXPECT_TRUE(none->empty());
}

// Paged KV memory: requests that need far more blocks than there are all
// finish, preempted and recomputed, with the tokens they make alone.
TEST_F(GeneratorTest, ManyRequestsUnderASmallKvBudgetGenerateWhatTheyGenerateAlone) {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 8; ++i) requests.push_back(Greedy(Prompt(i * 11 + 1, 6 + i), 20));
  const std::vector<GenerationResult> alone = Alone(requests);
  GeneratorOptions options;
  options.block_size = 4;
  options.kv_cache_blocks = 24;  // 96 tokens for 8 requests of up to 33
  EngineCore generator = MakeGenerator(true, options);
  auto together = Generate(generator, requests);
  ASSERT_THAT(together, IsOk());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_THAT((*together)[i].token_ids, ElementsAreArray(alone[i].token_ids)) << i;
    EXPECT_EQ((*together)[i].text, alone[i].text) << i;
  }
  const EngineStats stats = generator.stats();
  EXPECT_GT(stats.preemptions, 0);
  EXPECT_EQ(stats.kv_blocks_used, 0);
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.waiting, 0);
}

TEST_F(GeneratorTest, ARequestThatCouldNeverFitIsRefusedAtOnce) {
  GeneratorOptions options;
  options.block_size = 4;
  options.kv_cache_blocks = 4;  // 16 tokens
  EngineCore generator = MakeGenerator(true, options);
  EXPECT_THAT(generator.Add(Greedy(Prompt(1, 10), 10)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("16 tokens")));
  EXPECT_THAT(generator.Add(Greedy(Prompt(1, 10), 6)), IsOk());
}

TEST_F(GeneratorTest, APrefixFoundInTheCacheGivesTheSameTokensAsNoReuse) {
  const std::vector<int64_t> system = Prompt(3, 21);
  std::vector<int64_t> first = system, second = system;
  first.push_back(5);
  second.insert(second.end(), {9, 10, 11});
  GeneratorOptions off;
  off.block_size = 4;
  off.prefix_caching = false;
  EngineCore plain = MakeGenerator(true, off);
  auto expected = Generate(plain, {Greedy(second, 10)});
  ASSERT_THAT(expected, IsOk());
  EXPECT_EQ(plain.stats().prefix_hit_tokens, 0);

  GeneratorOptions on = off;
  on.prefix_caching = true;
  EngineCore cached = MakeGenerator(true, on);
  ASSERT_THAT(Generate(cached, {Greedy(first, 3)}), IsOk());
  auto reused = Generate(cached, {Greedy(second, 10)});
  ASSERT_THAT(reused, IsOk());
  EXPECT_THAT((*reused)[0].token_ids, ElementsAreArray((*expected)[0].token_ids));
  // The 21 shared tokens hold 5 full blocks of 4.
  EXPECT_EQ(cached.stats().prefix_hit_tokens, 20);
  EXPECT_EQ(cached.stats().kv_blocks_used, 0);
  // Two at once, sharing the blocks while both run.
  auto both = Generate(cached, {Greedy(second, 10), Greedy(first, 3)});
  ASSERT_THAT(both, IsOk());
  EXPECT_THAT((*both)[0].token_ids, ElementsAreArray((*expected)[0].token_ids));
}

// Decode steps padded to batch-size buckets (what a CUDA graph per bucket
// replays; here called directly) give exactly the tokens and log-probs of
// unpadded steps: a dense model, a mixture of experts (padded rows are
// routed too) and Gemma 2 (soft-caps, windows shorter than the sequences),
// seven requests of different lengths (so the batch shrinks through every
// bucket up to 8 and most steps need padding), over many steps, and again
// under a KV cache too small for them (preemption, recomputation) with a
// shared prompt prefix (prefix hits) and chunked prefill (mixed steps run
// unpadded between padded ones).
TEST_F(GeneratorTest, DecodeStepsPaddedToBucketsGiveWhatUnpaddedStepsGive) {
  for (const std::string family : {"llama", "mixtral", "gemma2"}) {
    SCOPED_TRACE(family);
    Load(family, 256, 0, family == "gemma2" ? std::optional<int64_t>(8) : std::nullopt);
    const std::vector<GenerationRequest> requests = SharedPrefixRequests();
    GeneratorOptions roomy;
    roomy.block_size = 4;
    GeneratorOptions tight = roomy;
    tight.kv_cache_blocks = 22;  // 88 tokens for 7 requests of up to 57
    tight.max_num_batched_tokens = 10;
    for (const GeneratorOptions& options : {roomy, tight}) {
      const bool squeezed = options.kv_cache_blocks > 0;
      SCOPED_TRACE(squeezed ? "tight" : "roomy");
      EngineCore eager = MakeGenerator(true, options);
      auto want = Generate(eager, requests);
      ASSERT_THAT(want, IsOk());
      ModelRunnerOptions padded_options;
      padded_options.decode_buckets = DecodeBatchBuckets(8);
      padded_options.num_blocks = options.kv_cache_blocks;
      padded_options.block_size = options.block_size;
      auto runner = ModelRunner::Create(loaded_->model, loaded_->dispatched.get(), padded_options);
      ASSERT_THAT(runner, IsOk());
      const ModelRunner* padded_runner = runner->get();
      EngineCoreOptions core;
      core.max_num_batched_tokens = options.max_num_batched_tokens;
      EngineCore padded(
          *std::move(runner), [] { return std::make_unique<LetterStream>(); }, core);
      auto got = Generate(padded, requests);
      ASSERT_THAT(got, IsOk());
      for (size_t i = 0; i < requests.size(); ++i) {
        EXPECT_THAT((*got)[i].token_ids, ElementsAreArray((*want)[i].token_ids)) << i;
        if (family != "gemma2") {
          // Bit for bit: a padded row changes no real row's arithmetic.
          EXPECT_THAT((*got)[i].logprobs, ElementsAreArray((*want)[i].logprobs)) << i;
        } else {
          // libtorch's vectorized gelu (tanh) computes a tensor's last
          // numel % vector-width elements in a scalar loop that rounds
          // differently, so with an intermediate size that is not a
          // multiple of the vector width the last row's last activations
          // change in the last bit with the row count (checked alone on
          // at::gelu). The tokens above are still exact.
          EXPECT_THAT((*got)[i].logprobs, Pointwise(FloatNear(1e-5f), (*want)[i].logprobs)) << i;
        }
        EXPECT_EQ((*got)[i].text, (*want)[i].text) << i;
      }
      // The padded path ran, with padding, and every block came back.
      EXPECT_GT(padded_runner->padded_decode_steps(), 20);
      EXPECT_GT(padded_runner->padded_decode_rows(), 10);
      const EngineStats stats = padded.stats();
      EXPECT_EQ(stats.kv_blocks_used, 0);
      if (squeezed) {
        EXPECT_GT(stats.preemptions, 0);
        EXPECT_GT(stats.prefix_hit_tokens, 0);
      }
    }
  }
}

// Steps of one-token decodes run as the model's static decode step at their
// own size (ModelRunnerOptions::unpadded_static_decode; on by default on a
// CUDA device, forced here on the cpu) give the general forward's tokens and
// log-probs bit for bit: dense, mixture-of-experts and sliding-window
// models, with preemption and prefix hits, and chunked prompts between.
TEST_F(GeneratorTest, UnpaddedStaticDecodeStepsGiveWhatTheGeneralForwardGives) {
  using Unpadded = ModelRunnerOptions::UnpaddedStaticDecode;
  for (const std::string family : {"llama", "mixtral", "gemma2"}) {
    SCOPED_TRACE(family);
    Load(family, 256, 0, family == "gemma2" ? std::optional<int64_t>(8) : std::nullopt);
    const std::vector<GenerationRequest> requests = SharedPrefixRequests();
    GeneratorOptions tight;
    tight.block_size = 4;
    tight.kv_cache_blocks = 22;  // 88 tokens for 7 requests of up to 57
    tight.max_num_batched_tokens = 10;
    std::vector<GenerationResult> results[2];
    int64_t static_steps[2] = {0, 0};
    for (int forced = 0; forced < 2; ++forced) {
      ModelRunnerOptions r;
      r.num_blocks = tight.kv_cache_blocks;
      r.block_size = tight.block_size;
      // kAuto: the cpu is not a CUDA device, so the general forward runs.
      r.unpadded_static_decode = forced == 1 ? Unpadded::kAlways : Unpadded::kAuto;
      auto runner = ModelRunner::Create(loaded_->model, loaded_->dispatched.get(), r);
      ASSERT_THAT(runner, IsOk());
      const ModelRunner* made = runner->get();
      EngineCoreOptions core;
      core.max_num_batched_tokens = tight.max_num_batched_tokens;
      EngineCore engine(
          *std::move(runner), [] { return std::make_unique<LetterStream>(); }, core);
      auto got = Generate(engine, requests);
      ASSERT_THAT(got, IsOk());
      results[forced] = *std::move(got);
      static_steps[forced] = made->unpadded_static_decode_steps();
      EXPECT_GT(engine.stats().preemptions, 0);
      EXPECT_GT(engine.stats().prefix_hit_tokens, 0);
      EXPECT_EQ(engine.stats().kv_blocks_used, 0);
    }
    EXPECT_EQ(static_steps[0], 0);
    EXPECT_GT(static_steps[1], 20);
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_THAT(results[1][i].token_ids, ElementsAreArray(results[0][i].token_ids)) << i;
      EXPECT_THAT(results[1][i].logprobs, ElementsAreArray(results[0][i].logprobs)) << i;
      EXPECT_EQ(results[1][i].text, results[0][i].text) << i;
    }
  }
}

// Steps in flight (ModelRunnerOptions::steps_in_flight, as a pipeline-
// parallel leader runs them; here one process, whose CausalLM::Submit runs
// the forward at once): the engine core splits the requests into two
// alternating batches through Submit / Collect, and every request gets the
// tokens of one step at a time, with preemption and prefix hits. A step
// abandoned after Submit puts its caches back, so it can run again.
TEST_F(GeneratorTest, StepsInFlightGiveTheTokensOfOneStepAtATime) {
  Load("llama", 256);
  const std::vector<GenerationRequest> requests = SharedPrefixRequests();
  GeneratorOptions tight;
  tight.block_size = 4;
  tight.kv_cache_blocks = 22;  // 88 tokens for 7 requests of up to 57
  tight.max_num_batched_tokens = 10;
  EngineCore one = MakeGenerator(true, tight);
  auto want = Generate(one, requests);
  ASSERT_THAT(want, IsOk());
  ModelRunnerOptions in_flight;
  in_flight.steps_in_flight = 2;
  EngineCore two = MakeGenerator(true, tight, in_flight);
  auto got = Generate(two, requests);
  ASSERT_THAT(got, IsOk());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_THAT((*got)[i].token_ids, ElementsAreArray((*want)[i].token_ids)) << i;
    // Other batches (about half the requests each): the same tokens, the
    // logprobs within rounding.
    EXPECT_THAT((*got)[i].logprobs, Pointwise(FloatNear(1e-4f), (*want)[i].logprobs)) << i;
    EXPECT_EQ((*got)[i].text, (*want)[i].text) << i;
  }
  const EngineStats stats = two.stats();
  EXPECT_GT(stats.overlapped_steps, 10);
  EXPECT_GT(stats.preemptions, 0);
  EXPECT_GT(stats.prefix_hit_tokens, 0);
  EXPECT_EQ(stats.kv_blocks_used, 0);
  EXPECT_EQ(one.stats().overlapped_steps, 0);

  auto runner = ModelRunner::Create(loaded_->model, loaded_->dispatched.get(), in_flight);
  ASSERT_THAT(runner, IsOk());
  KvCacheManager kv((*runner)->num_blocks(), (*runner)->block_size(), false);
  Scheduler scheduler({}, &kv);
  ASSERT_THAT((*runner)->AddRequest(1, requests[0]), IsOk());
  scheduler.Add(1, requests[0]);
  const SchedulerOutput out = scheduler.Schedule();
  ASSERT_THAT((*runner)->Submit(out), IsOk());
  (*runner)->AbandonSubmitted();
  auto again = (*runner)->Execute(out);
  ASSERT_THAT(again, IsOk());
  ASSERT_EQ(again->sampled.size(), 1u);
  EXPECT_EQ(again->sampled[0].token_ids[0], (*want)[0].token_ids[0]);
}

// On a CUDA device (scripts/gpu_check.sh): the same steps replayed from a
// CUDA graph per bucket give the tokens of eager steps on the device, for a
// dense model, Gemma 2 and a Mixtral of NF4 experts (its buckets up to the
// rows it routes on the device: 1, 2 and 4), with padding, preemption and
// prefix hits.
TEST_F(GeneratorTest, DecodeStepsReplayedFromCudaGraphsGiveWhatEagerStepsGive) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: the device script runs this";
  for (const std::string family : {"llama", "gemma2", "mixtral-nf4"}) {
    SCOPED_TRACE(family);
    auto loaded = OnGpu(family, 2, family == "gemma2" ? std::optional<int64_t>(8) : std::nullopt);
    ASSERT_THAT(loaded, IsOk());
    const std::vector<GenerationRequest> requests = SharedPrefixRequests();
    // 0: the general forward; 1: eager decode steps as unpadded static
    // steps (the default on a CUDA device); 2: padded and replayed from graphs.
    std::vector<GenerationResult> results[3];
    for (int graphs = 0; graphs < 3; ++graphs) {
      ModelRunnerOptions r;
      r.block_size = 4;
      r.num_blocks = 22;  // preemption, as on the cpu above
      if (graphs == 0) r.unpadded_static_decode = ModelRunnerOptions::UnpaddedStaticDecode::kOff;
      const int64_t captured = loaded->model->MaxCapturedDecodeRows();
      if (family == "mixtral-nf4") {
        ASSERT_EQ(captured, 4);
      } else {
        ASSERT_EQ(captured, -1);
      }
      if (graphs == 2) {
        r.decode_buckets = DecodeBatchBuckets(8, captured > 0 ? captured : kMaxDecodeBucket);
        r.capture_decode_graphs = true;
      }
      auto runner = ModelRunner::Create(loaded->model, loaded->dispatched.get(), r);
      ASSERT_THAT(runner, IsOk());
      const ModelRunner* made = runner->get();
      EngineCoreOptions core;
      core.max_num_batched_tokens = 10;
      EngineCore engine(*std::move(runner), nullptr, core);
      auto got = Generate(engine, requests);
      ASSERT_THAT(got, IsOk());
      results[graphs] = *std::move(got);
      EXPECT_GT(engine.stats().preemptions, 0);
      if (graphs == 1) {
        EXPECT_GT(made->unpadded_static_decode_steps(), 20);
      }
      if (graphs == 2) {
        // Still padded: no fallback to eager (the mixture's steps of more
        // than 4 decodes run eagerly).
        EXPECT_GT(made->padded_decode_steps(), family == "mixtral-nf4" ? 5 : 20);
      }
    }
    for (int variant = 1; variant < 3; ++variant) {
      SCOPED_TRACE(variant == 1 ? "unpadded static" : "graphs");
      for (size_t i = 0; i < requests.size(); ++i) {
        EXPECT_THAT(results[variant][i].token_ids, ElementsAreArray(results[0][i].token_ids)) << i;
        // Padded batches may take other GEMM kernels: equal to float32 rounding.
        EXPECT_THAT(results[variant][i].logprobs,
                    Pointwise(FloatNear(1e-4f), results[0][i].logprobs))
            << i;
      }
    }
  }
}

// On a CUDA device (scripts/gpu_check.sh): a step waits for the device only
// to read what it sampled, however many layers, prompt chunks and experts it
// runs: the keys' block indices of a prompt's later chunk, the experts' rows
// and the rows that get logits go to the device without a wait
// (core/device_copy.h); a wait inside the layers would make the host and
// the device take turns. A mixture-of-experts layer reads its routing on the
// host: one wait a layer more. Chunked prompts, prefix hits and preemption,
// through the general forward and the default static decode steps.
TEST_F(GeneratorTest, StepsOnACudaDeviceWaitOnlyForWhatTheySampled) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: the device script runs this";
  ASSERT_TRUE(internal::CudaSyncCounter::Available())
      << "a CUDA libtorch, but the engine was built without ACCEL_WITH_ENGINE_CUDA";
  {
    internal::CudaSyncCounter calibration;
    (void)at::ones({1}, at::TensorOptions().device(at::kCUDA)).sum().item<float>();
    ASSERT_GE(calibration.count(), 1) << "the counter does not see libtorch's waits";
  }
  constexpr int64_t kLayers = 4;
  for (const std::string family : {"llama", "mixtral"}) {
    SCOPED_TRACE(family);
    auto loaded = OnGpu(family, kLayers);
    ASSERT_THAT(loaded, IsOk());
    const int64_t allowed = 3 + (family == "mixtral" ? kLayers : 0);
    for (const auto mode : {ModelRunnerOptions::UnpaddedStaticDecode::kOff,
                            ModelRunnerOptions::UnpaddedStaticDecode::kAuto}) {
      SCOPED_TRACE(mode == ModelRunnerOptions::UnpaddedStaticDecode::kOff ? "general"
                                                                          : "static decodes");
      ModelRunnerOptions r;
      r.block_size = 4;
      r.num_blocks = 22;
      r.unpadded_static_decode = mode;
      auto runner = ModelRunner::Create(loaded->model, loaded->dispatched.get(), r);
      ASSERT_THAT(runner, IsOk());
      EngineCoreOptions core;
      core.max_num_batched_tokens = 10;  // prompts in chunks, a later chunk beside decodes
      EngineCore engine(*std::move(runner), nullptr, core);
      for (const GenerationRequest& request : SharedPrefixRequests()) {
        ASSERT_THAT(engine.Add(request), IsOk());
      }
      int64_t steps = 0, most = 0;
      std::vector<std::pair<std::string, int64_t>> worst;
      while (engine.num_requests() > 0) {
        internal::CudaSyncCounter syncs;
        ASSERT_THAT(engine.Step(), IsOk());
        ++steps;
        if (syncs.count() > most) {
          most = syncs.count();
          worst = syncs.Sites();
        }
      }
      EXPECT_GT(steps, 20);
      std::string sites;
      for (const auto& [stack, n] : worst) sites += std::to_string(n) + " x\n" + stack + "\n";
      EXPECT_LE(most, allowed) << "the step that waited most, where:\n" << sites;
      EXPECT_GT(engine.stats().preemptions, 0);
    }
  }
}

// On a CUDA device: a Mixtral of NF4 experts decoding one sequence routes
// its rows on the device, so after the prompt (whose slots the host groups
// by expert: a wait a layer) a step waits only for what it sampled,
// however many sparse layers it runs.
TEST_F(GeneratorTest, AMixtureOfNf4ExpertsDecodesWithoutWaitingForItsRouting) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: the device script runs this";
  ASSERT_TRUE(internal::CudaSyncCounter::Available());
  constexpr int64_t kLayers = 4;
  auto loaded = OnGpu("mixtral-nf4", kLayers);
  ASSERT_THAT(loaded, IsOk());
  ModelRunnerOptions r;
  r.block_size = 4;
  auto runner = ModelRunner::Create(loaded->model, loaded->dispatched.get(), r);
  ASSERT_THAT(runner, IsOk());
  EngineCore engine(*std::move(runner), nullptr, EngineCoreOptions{});
  ASSERT_THAT(engine.Add(Greedy(Prompt(3, 9), 12)), IsOk());
  std::vector<int64_t> waits;
  while (engine.num_requests() > 0) {
    internal::CudaSyncCounter syncs;
    ASSERT_THAT(engine.Step(), IsOk());
    waits.push_back(syncs.count());
  }
  ASSERT_GE(waits.size(), 10u);
  EXPECT_LE(waits[0], 3 + kLayers);  // the prompt
  for (size_t i = 1; i < waits.size(); ++i) EXPECT_LE(waits[i], 3) << "step " << i;
}

// Padding applies to decode-only steps up to the largest bucket: a batch
// above it, steps that read prompts, and models without a static decode
// step run unpadded.
TEST_F(GeneratorTest, OnlyDecodeStepsWithinTheLargestBucketArePadded) {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 3; ++i) requests.push_back(Greedy(Prompt(i * 7 + 1, 5), 6));
  ModelRunnerOptions options;
  options.decode_buckets = {1, 2};  // three sequences decoding: above the largest
  options.block_size = 4;
  auto runner = ModelRunner::Create(loaded_->model, loaded_->dispatched.get(), options);
  ASSERT_THAT(runner, IsOk());
  const ModelRunner* r = runner->get();
  EngineCore core(*std::move(runner), nullptr, EngineCoreOptions{});
  ASSERT_THAT(Generate(core, requests), IsOk());
  EXPECT_EQ(r->padded_decode_steps(), 0);
  // One request under bucket 2: its prompt step is not padded, each of its
  // 5 decode steps gets one padded row.
  options.decode_buckets = {2};
  runner = ModelRunner::Create(loaded_->model, loaded_->dispatched.get(), options);
  ASSERT_THAT(runner, IsOk());
  r = runner->get();
  EngineCore one(*std::move(runner), nullptr, EngineCoreOptions{});
  ASSERT_THAT(Generate(one, {requests[0]}), IsOk());
  EXPECT_EQ(r->padded_decode_steps(), 5);
  EXPECT_EQ(r->padded_decode_rows(), 5);
  // A model without a static decode step (GPT-2's learned positions are
  // not on that path) runs unpadded, with the same tokens.
  Load("gpt2", 0);
  const std::vector<GenerationResult> alone = Alone({requests[0]});
  runner = ModelRunner::Create(loaded_->model, loaded_->dispatched.get(), options);
  ASSERT_THAT(runner, IsOk());
  r = runner->get();
  EngineCore unpadded(*std::move(runner), nullptr, EngineCoreOptions{});
  auto got = Generate(unpadded, {requests[0]});
  ASSERT_THAT(got, IsOk());
  EXPECT_THAT((*got)[0].token_ids, ElementsAreArray(alone[0].token_ids));
  EXPECT_EQ(r->padded_decode_steps(), 0);
}

// Chunked prefill: a long prompt is read a few tokens a step while a
// decoding sequence gets a token every step, and both generate what they
// generate alone.
TEST_F(GeneratorTest, ALongPromptIsReadInChunksWhileOthersKeepDecoding) {
  const GenerationRequest decoder = Greedy(Prompt(2, 3), 30);
  const GenerationRequest reader = Greedy(Prompt(7, 40), 5);
  const std::vector<GenerationResult> alone = Alone({decoder, reader});
  GeneratorOptions options;
  options.max_num_batched_tokens = 5;
  EngineCore generator = MakeGenerator(true, options);
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t a, generator.Add(decoder));
  std::vector<int64_t> got_a, got_b;
  auto first = generator.Step();  // a's prompt and first token
  ASSERT_THAT(first, IsOk());
  ASSERT_EQ(first->size(), 1u);
  got_a.push_back((*first)[0].token_id);
  ASSERT_THAT(generator.Add(reader), IsOk());
  int steps_without_b = 0;
  while (generator.num_requests() > 0) {
    auto events = generator.Step();
    ASSERT_THAT(events, IsOk());
    EXPECT_LE(generator.stats().last_step_tokens, 5);
    bool a_went = false, b_went = false;
    for (const TokenEvent& e : *events) {
      (e.sequence == a ? got_a : got_b).push_back(e.token_id);
      (e.sequence == a ? a_went : b_went) = true;
    }
    if (static_cast<int64_t>(got_a.size()) < decoder.max_new_tokens) {
      EXPECT_TRUE(a_went) << "the decoding sequence waited for a prompt";
    }
    if (got_b.empty() && !b_went) ++steps_without_b;
  }
  EXPECT_GE(steps_without_b, 40 / 4 - 1);  // the prompt took many steps
  EXPECT_THAT(got_a, ElementsAreArray(alone[0].token_ids));
  EXPECT_THAT(got_b, ElementsAreArray(alone[1].token_ids));
}

// A short prompt arriving while a long one is read in chunks does not wait
// for the whole long prompt: it starts within a few steps, and both
// generate what they generate alone.
TEST_F(GeneratorTest, AShortPromptBehindALongOneStartsWithinAFewSteps) {
  const GenerationRequest long_prompt = Greedy(Prompt(3, 60), 3);
  const GenerationRequest short_prompt = Greedy(Prompt(8, 6), 3);
  const std::vector<GenerationResult> alone = Alone({long_prompt, short_prompt});
  GeneratorOptions options;
  options.max_num_batched_tokens = 6;
  EngineCore generator = MakeGenerator(true, options);
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t a, generator.Add(long_prompt));
  ASSERT_THAT(generator.Step(), IsOk());  // the first 6 of 60
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t b, generator.Add(short_prompt));
  std::vector<int64_t> got_a, got_b;
  int steps = 0, first_b = -1;
  while (generator.num_requests() > 0) {
    auto events = generator.Step();
    ASSERT_THAT(events, IsOk());
    ++steps;
    for (const TokenEvent& e : *events) {
      if (e.sequence == b && first_b < 0) first_b = steps;
      (e.sequence == a ? got_a : got_b).push_back(e.token_id);
    }
  }
  // Half the budget (3 tokens) a step: 6 tokens in 2 steps, not after ~9.
  EXPECT_GT(first_b, 0);
  EXPECT_LE(first_b, 3);
  EXPECT_THAT(got_a, ElementsAreArray(alone[0].token_ids));
  EXPECT_THAT(got_b, ElementsAreArray(alone[1].token_ids));
}

// LongRoPE (Phi-3): crossing the original context recomputes the sequence
// with the long factors, also when its prompt is read in chunks into paged
// blocks and when it is preempted; the tokens equal a loop without a cache.
// Blocks are never shared: a position's keys depend on the sequence's length.
TEST_F(GeneratorTest, ALongRopeModelCrossesItsOriginalContextInChunksAndNeverSharesBlocks) {
  Load("phi3", 64, /*longrope_factor=*/4);  // original context 16
  const std::vector<int64_t> prompt = Prompt(5, 12);
  const std::vector<int64_t> expected = GreedyByHand(prompt, 20);  // to 32 positions
  GeneratorOptions options;
  options.block_size = 4;
  options.kv_cache_blocks = 12;  // 48 tokens for two requests of 32: one is preempted
  options.max_num_batched_tokens = 5;
  EngineCore generator = MakeGenerator(true, options);
  auto results = Generate(generator, {Greedy(prompt, 20), Greedy(prompt, 20)});
  ASSERT_THAT(results, IsOk());
  EXPECT_THAT((*results)[0].token_ids, ElementsAreArray(expected));
  EXPECT_THAT((*results)[1].token_ids, ElementsAreArray(expected));
  EXPECT_EQ(generator.stats().prefix_hit_tokens, 0);
  EXPECT_GT(generator.stats().preemptions, 0);
  EXPECT_EQ(generator.stats().kv_blocks_used, 0);
}

TEST_F(GeneratorTest, CancellingDuringPrefillChunksFreesTheBlocks) {
  GeneratorOptions options;
  options.max_num_batched_tokens = 4;
  options.block_size = 4;
  EngineCore generator = MakeGenerator(true, options);
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t id, generator.Add(Greedy(Prompt(1, 40), 4)));
  for (int i = 0; i < 3; ++i) {
    auto events = generator.Step();
    ASSERT_THAT(events, IsOk());
    EXPECT_TRUE(events->empty());  // still reading the prompt
  }
  EXPECT_EQ(generator.stats().kv_blocks_used, 3);
  EXPECT_TRUE(generator.Cancel(id));
  EXPECT_EQ(generator.stats().kv_blocks_used, 0);
  EXPECT_EQ(generator.stats().running, 0);
}

// Random arrivals, cancellations and steps under a small budget with
// chunking and prefix caching: every request that is not cancelled
// finishes, and when all are gone every block is free again.
TEST_F(GeneratorTest, ARandomizedRunLeavesEveryBlockFree) {
  std::mt19937 rng(11);
  GeneratorOptions options;
  options.block_size = 4;
  options.kv_cache_blocks = 20;
  options.max_num_batched_tokens = 9;
  EngineCore generator = MakeGenerator(true, options);
  std::set<uint64_t> live;
  int finished = 0;
  for (int round = 0; round < 150; ++round) {
    const int action = static_cast<int>(rng() % 6);
    if (action <= 1) {
      const int64_t length = 2 + static_cast<int64_t>(rng() % 30);
      // Half share a system prompt.
      std::vector<int64_t> prompt = rng() % 2 == 0 ? Prompt(1, 12) : std::vector<int64_t>();
      for (int64_t id : Prompt(static_cast<int64_t>(rng() % 300), length)) prompt.push_back(id);
      auto id = generator.Add(Greedy(prompt, 1 + static_cast<int64_t>(rng() % 20)));
      if (id.ok()) live.insert(*id);
    } else if (action == 2 && !live.empty()) {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      EXPECT_TRUE(generator.Cancel(*it));
      live.erase(it);
    } else {
      auto events = generator.Step();
      ASSERT_THAT(events, IsOk());
      for (const TokenEvent& e : *events) {
        if (e.finish) {
          live.erase(e.sequence);
          ++finished;
        }
      }
    }
    const EngineStats stats = generator.stats();
    ASSERT_LE(stats.kv_blocks_used, 20);
    ASSERT_EQ(stats.running + stats.waiting, static_cast<int64_t>(live.size()));
  }
  while (generator.num_requests() > 0) {
    auto events = generator.Step();
    ASSERT_THAT(events, IsOk());
    for (const TokenEvent& e : *events) finished += e.finish ? 1 : 0;
  }
  EXPECT_GT(finished, 10);
  EXPECT_EQ(generator.stats().kv_blocks_used, 0);
}

}  // namespace
}  // namespace accel::engine
