// Speculative decoding end to end on real (small, random) models. Greedy:
// with prompt lookup or a draft model the tokens are exactly those of
// decoding without speculation, for every family, one request alone and
// eight together, across preemption (a KV cache far too small), prefix
// hits, chunked prefill, stop strings, log-probabilities and cancellation.
// Sampled: the joint distribution of the first tokens with speculation is
// that without it (a two-sample chi-square test over many seeded requests,
// with a logits processor that keeps four tokens, so drafts are often
// right and often wrong).
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/engine_core.h"
#include "engine/logits_processor.h"
#include "engine/model_runner.h"
#include "engine/output_processor.h"
#include "models/load_model.h"
#include "models/make_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::engine {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr int64_t kVocab = 300;

// Token k reads as the letter 'a' + k % 26.
class LetterStream : public TextStream {
 public:
  std::string Next(int64_t id) override { return std::string(1, static_cast<char>('a' + id % 26)); }
  std::string Flush() override { return ""; }
};

struct Options {
  int64_t num_blocks = 0;
  int64_t block_size = 4;
  int64_t max_num_batched_tokens = 0;
  bool prefix_caching = true;
};

SpeculativeConfig Ngram(int64_t k, int64_t min_n = 1, int64_t max_n = 3) {
  SpeculativeConfig c;
  c.method = SpeculativeConfig::Method::kNgram;
  c.num_speculative_tokens = k;
  c.prompt_lookup_min = min_n;
  c.prompt_lookup_max = max_n;
  return c;
}

// Prompts that repeat themselves, so prompt lookup has matches from the
// start; `i` varies them.
std::vector<int64_t> Prompt(int64_t i, int64_t n) {
  std::vector<int64_t> ids;
  for (int64_t t = 0; t < n; ++t) ids.push_back((i * 31 + (t % 5) * 17 + t / 10) % kVocab);
  return ids;
}

GenerationRequest Greedy(std::vector<int64_t> prompt, int64_t max_new_tokens) {
  GenerationRequest r;
  r.prompt_ids = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  return r;
}

std::unique_ptr<models::LoadedModel> Make(const std::string& dir, const std::string& family,
                                          int64_t hidden, int64_t layers, uint64_t seed,
                                          int64_t max_positions = 256) {
  models::MakeModelOptions o;
  o.family = family;
  o.hidden_size = hidden;
  o.num_heads = 4;
  o.num_kv_heads = 2;
  o.num_layers = layers;
  o.vocab_size = kVocab;
  o.max_position_embeddings = max_positions;
  o.seed = seed;
  if (family == "gemma2" || family == "gemma3") o.sliding_window = 8;  // windows in play
  EXPECT_THAT(models::MakeModel(dir, o), IsOk());
  models::ModelLoadOptions options;
  options.device_map = "cpu";
  options.progress = Progress::Style::kSilent;
  auto loaded = models::LoadModel(dir, options);
  EXPECT_THAT(loaded, IsOk());
  if (!loaded.ok()) return nullptr;
  return std::make_unique<models::LoadedModel>(*std::move(loaded));
}

class SpecDecodeTest : public ::testing::Test {
 protected:
  EngineCore Core(models::LoadedModel& m, SpeculativeConfig spec, Options o = {},
                  models::LoadedModel* draft = nullptr,
                  LogitsProcessorFactory processors = nullptr) {
    ModelRunnerOptions r;
    r.num_blocks = o.num_blocks;
    r.block_size = o.block_size;
    r.speculative = spec;
    r.logits_processors = std::move(processors);
    if (draft != nullptr) {
      r.draft_model = draft->model;
      r.draft_dispatched = draft->dispatched.get();
    }
    auto runner = ModelRunner::Create(m.model, m.dispatched.get(), r);
    EXPECT_THAT(runner, IsOk());
    EngineCoreOptions c;
    c.max_num_batched_tokens = o.max_num_batched_tokens;
    c.prefix_caching = o.prefix_caching;
    return EngineCore(
        *std::move(runner), [] { return std::make_unique<LetterStream>(); }, c);
  }

  // Each request's greedy tokens without speculation, alone.
  std::vector<GenerationResult> Plain(models::LoadedModel& m,
                                      const std::vector<GenerationRequest>& requests) {
    std::vector<GenerationResult> out;
    for (const GenerationRequest& r : requests) {
      EngineCore core = Core(m, {});
      auto result = Generate(core, {r});
      EXPECT_THAT(result, IsOk());
      if (result.ok()) out.push_back((*result)[0]);
    }
    return out;
  }

  void ExpectSame(const std::vector<GenerationResult>& got,
                  const std::vector<GenerationResult>& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_THAT(got[i].token_ids, ElementsAreArray(want[i].token_ids)) << what << ", " << i;
      EXPECT_EQ(got[i].text, want[i].text) << what << ", " << i;
      EXPECT_EQ(got[i].finish_reason, want[i].finish_reason) << what << ", " << i;
    }
  }

  TempDir dir_;
};

// Every family, prompt lookup: one request alone, eight together, and the
// eight again sharing a system prompt under a KV cache too small for them
// (prefix hits, preemption and recomputation): the tokens of plain
// decoding, each request alone.
TEST_F(SpecDecodeTest, GreedyPromptLookupGivesTheTokensOfPlainDecodingForEveryFamily) {
  int64_t drafted = 0, accepted = 0;
  for (const std::string family : {"llama", "mistral", "qwen2", "gpt2", "mixtral", "qwen3",
                                   "qwen3_moe", "qwen2_moe", "gemma2", "gemma3", "phi3"}) {
    auto m = Make(dir_.path() + "/" + family, family, 32, 2, 1);
    ASSERT_NE(m, nullptr) << family;
    std::vector<GenerationRequest> requests, shared;
    for (int64_t i = 0; i < 8; ++i) {
      requests.push_back(Greedy(Prompt(i, 12 + i), 16 + i));
      std::vector<int64_t> prompt = Prompt(9, 13);
      for (int64_t id : Prompt(i, 2 + i)) prompt.push_back(id);
      shared.push_back(Greedy(prompt, 16));
    }
    const std::vector<GenerationResult> plain = Plain(*m, requests);
    const std::vector<GenerationResult> plain_shared = Plain(*m, shared);
    {
      EngineCore alone = Core(*m, Ngram(3));
      auto one = Generate(alone, {requests[0]});
      ASSERT_THAT(one, IsOk()) << family;
      ExpectSame(*one, {plain[0]}, family + " batch 1");
    }
    EngineCore batch = Core(*m, Ngram(3));
    auto eight = Generate(batch, requests);
    ASSERT_THAT(eight, IsOk()) << family;
    ExpectSame(*eight, plain, family + " batch 8");
    const EngineStats stats = batch.stats();
    drafted += stats.spec_num_draft_tokens;
    accepted += stats.spec_num_accepted_tokens;
    EXPECT_GT(stats.spec_num_draft_tokens, 0) << family;
    EXPECT_EQ(stats.kv_blocks_used, 0) << family;
    Options small;
    small.num_blocks = 20;  // 80 tokens for 8 requests of up to 38
    small.max_num_batched_tokens = 12;
    EngineCore tight = Core(*m, Ngram(3), small);
    auto squeezed = Generate(tight, shared);
    ASSERT_THAT(squeezed, IsOk()) << family;
    ExpectSame(*squeezed, plain_shared, family + " batch 8, preempted, prefix hits");
    EXPECT_GT(tight.stats().preemptions, 0) << family;
    EXPECT_GT(tight.stats().prefix_hit_tokens, 0) << family;
    EXPECT_EQ(tight.stats().kv_blocks_used, 0) << family;
  }
  // Random models repeat themselves: prompt lookup finds some of it.
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
}

// Eight requests under a third of the blocks they need (preempted and
// recomputed, drafts dropped for memory), sharing a system prompt (prefix
// hits), read in chunks of at most 10 tokens a step: the same tokens.
TEST_F(SpecDecodeTest, GreedyHoldsAcrossPreemptionPrefixHitsAndChunkedPrefill) {
  auto m = Make(dir_.path() + "/llama", "llama", 32, 2, 2);
  ASSERT_NE(m, nullptr);
  std::vector<GenerationRequest> requests;
  const std::vector<int64_t> system = Prompt(9, 13);
  for (int64_t i = 0; i < 8; ++i) {
    std::vector<int64_t> prompt = system;
    for (int64_t id : Prompt(i, 3 + i)) prompt.push_back(id);
    requests.push_back(Greedy(prompt, 20));
  }
  const std::vector<GenerationResult> plain = Plain(*m, requests);
  Options small;
  small.num_blocks = 30;  // 120 tokens for 8 requests of up to 43
  small.max_num_batched_tokens = 10;
  for (const SpeculativeConfig& spec : {Ngram(4), Ngram(2, 2, 2)}) {
    EngineCore core = Core(*m, spec, small);
    auto together = Generate(core, requests);
    ASSERT_THAT(together, IsOk());
    ExpectSame(*together, plain, "ngram k " + std::to_string(spec.num_speculative_tokens));
    const EngineStats stats = core.stats();
    EXPECT_GT(stats.preemptions, 0);
    EXPECT_GT(stats.prefix_hit_tokens, 0);
    EXPECT_GT(stats.spec_num_draft_tokens, 0);
    EXPECT_LE(stats.last_step_tokens, 10);
    EXPECT_EQ(stats.kv_blocks_used, 0);
  }
}

// A draft model of the same family and vocabulary (random, so it is often
// wrong): the same tokens alone, in a batch, and across preemption and
// prefix hits, where its keys and values live in the same block ids.
TEST_F(SpecDecodeTest, GreedyWithADraftModelGivesTheTokensOfPlainDecoding) {
  auto m = Make(dir_.path() + "/target", "llama", 64, 3, 3);
  ASSERT_NE(m, nullptr);
  auto draft = Make(dir_.path() + "/draft", "llama", 32, 1, 4);
  ASSERT_NE(draft, nullptr);
  SpeculativeConfig spec;
  spec.method = SpeculativeConfig::Method::kDraftModel;
  spec.num_speculative_tokens = 3;
  spec.model = "draft";
  std::vector<GenerationRequest> requests;
  for (int64_t i = 0; i < 8; ++i) {
    std::vector<int64_t> prompt = Prompt(7, 9);
    for (int64_t id : Prompt(i, 2 + i)) prompt.push_back(id);
    requests.push_back(Greedy(prompt, 14));
  }
  const std::vector<GenerationResult> plain = Plain(*m, requests);
  {
    EngineCore alone = Core(*m, spec, {}, draft.get());
    auto one = Generate(alone, {requests[3]});
    ASSERT_THAT(one, IsOk());
    ExpectSame(*one, {plain[3]}, "draft, batch 1");
    EXPECT_GT(alone.stats().spec_num_draft_tokens, 0);
  }
  Options small;
  small.num_blocks = 14;  // 56 tokens for 8 requests of up to 32
  small.max_num_batched_tokens = 12;
  EngineCore core = Core(*m, spec, small, draft.get());
  auto together = Generate(core, requests);
  ASSERT_THAT(together, IsOk());
  ExpectSame(*together, plain, "draft, batch 8");
  const EngineStats stats = core.stats();
  EXPECT_GT(stats.preemptions, 0);
  EXPECT_GT(stats.prefix_hit_tokens, 0);
  EXPECT_GT(stats.spec_num_draft_tokens, 0);
  EXPECT_EQ(stats.kv_blocks_used, 0);

  // The target as its own draft is right but where rounding differs (the
  // draft reads a step's tokens as a chunk, the target one by one): nearly
  // k + 1 tokens a step.
  EngineCore self = Core(*m, spec, {}, m.get());
  auto same = Generate(self, {requests[0]});
  ASSERT_THAT(same, IsOk());
  ExpectSame(*same, {plain[0]}, "self-draft");
  EXPECT_GE(self.stats().spec_num_accepted_tokens, self.stats().spec_num_draft_tokens * 8 / 10);
  EXPECT_LE(self.stats().steps, 7);
}

// Stop strings and stop tokens inside a step's accepted tokens, log-probs
// of every token, and cancellation with drafts pending.
TEST_F(SpecDecodeTest, StopsLogprobsAndCancellationKeepWorking) {
  auto m = Make(dir_.path() + "/llama", "llama", 32, 2, 5);
  ASSERT_NE(m, nullptr);
  const GenerationRequest base = Greedy(Prompt(3, 15), 24);
  GenerationRequest with_logprobs = base;
  with_logprobs.logprobs = true;
  const GenerationResult plain = Plain(*m, {with_logprobs})[0];
  ASSERT_EQ(plain.token_ids.size(), 24u);
  EngineCore core = Core(*m, Ngram(4));
  auto spec = Generate(core, {with_logprobs});
  ASSERT_THAT(spec, IsOk());
  ExpectSame(*spec, {plain}, "logprobs");
  ASSERT_EQ((*spec)[0].logprobs.size(), plain.logprobs.size());
  for (size_t i = 0; i < plain.logprobs.size(); ++i) {
    EXPECT_NEAR((*spec)[0].logprobs[i], plain.logprobs[i], 1e-4) << i;
  }

  // A stop string over tokens 10 and 11, and a stop token at 17: each ends
  // the request where plain decoding ends it.
  const std::string text = plain.text;
  GenerationRequest stop = base;
  stop.stop_strings = {text.substr(10, 2)};
  GenerationRequest eos = base;
  eos.stop_token_ids = {plain.token_ids[17]};
  const std::vector<GenerationResult> want = Plain(*m, {stop, eos});
  EngineCore stops = Core(*m, Ngram(4));
  auto got = Generate(stops, {stop, eos});
  ASSERT_THAT(got, IsOk());
  ExpectSame(*got, want, "stops");
  EXPECT_EQ((*got)[0].finish_reason, FinishReason::kStop);
  EXPECT_EQ((*got)[1].finish_reason, FinishReason::kEos);

  EngineCore cancel = Core(*m, Ngram(4));
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t id, cancel.Add(base));
  for (int i = 0; i < 3; ++i) ASSERT_THAT(cancel.Step(), IsOk());
  EXPECT_GT(cancel.stats().kv_blocks_used, 0);
  EXPECT_TRUE(cancel.Cancel(id));
  EXPECT_EQ(cancel.stats().kv_blocks_used, 0);
  auto none = cancel.Step();
  ASSERT_THAT(none, IsOk());
  EXPECT_TRUE(none->empty());
}

TEST_F(SpecDecodeTest, ConfigsTheModelsCannotServeAreRefused) {
  auto m = Make(dir_.path() + "/llama", "llama", 32, 2, 6);
  ASSERT_NE(m, nullptr);
  models::MakeModelOptions o;
  o.family = "phi3";
  o.longrope_factor = 4;
  o.vocab_size = kVocab;
  ASSERT_THAT(models::MakeModel(dir_.path() + "/longrope", o), IsOk());
  models::ModelLoadOptions load;
  load.device_map = "cpu";
  load.progress = Progress::Style::kSilent;
  auto longrope = models::LoadModel(dir_.path() + "/longrope", load);
  ASSERT_THAT(longrope, IsOk());
  ModelRunnerOptions r;
  r.speculative = Ngram(2);
  EXPECT_THAT(ModelRunner::Create(longrope->model, longrope->dispatched.get(), r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("LongRoPE")));
  SpeculativeConfig draft;
  draft.method = SpeculativeConfig::Method::kDraftModel;
  draft.num_speculative_tokens = 2;
  draft.model = "big-vocab";
  r.speculative = draft;
  EXPECT_THAT(ModelRunner::Create(m->model, m->dispatched.get(), r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not loaded")));
  models::MakeModelOptions big;
  big.vocab_size = 600;
  ASSERT_THAT(models::MakeModel(dir_.path() + "/big", big), IsOk());
  auto big_model = models::LoadModel(dir_.path() + "/big", load);
  ASSERT_THAT(big_model, IsOk());
  r.draft_model = big_model->model;
  r.draft_dispatched = big_model->dispatched.get();
  EXPECT_THAT(ModelRunner::Create(m->model, m->dispatched.get(), r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocabulary of 600")));
  r.draft_model = longrope->model;
  r.draft_dispatched = longrope->dispatched.get();
  EXPECT_THAT(ModelRunner::Create(m->model, m->dispatched.get(), r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("LongRoPE")));
}

// Only tokens 0..3 (the rest at -inf), at every position the target
// samples from: both runs below draw from the same distributions.
class FourTokens : public LogitsProcessor {
 public:
  void Apply(absl::Span<const int64_t>, at::Tensor& logits) override {
    logits.narrow(0, 4, logits.size(0) - 4).fill_(-std::numeric_limits<float>::infinity());
  }
};

// The 99.9th percentile of chi-square with `df` degrees of freedom
// (Wilson-Hilferty).
double ChiSquareBound(int64_t df) {
  const double k = static_cast<double>(df), z = 3.09;
  const double c = 1 - 2 / (9 * k) + z * std::sqrt(2 / (9 * k));
  return k * c * c * c;
}

// Sampled decoding keeps the target's distribution: the first three tokens
// of 2000 seeded requests with prompt lookup (whose drafts from a prompt of
// tokens 0..3 are often right and often wrong) against 2000 without.
TEST_F(SpecDecodeTest, SampledSpeculationKeepsTheTargetsDistribution) {
  auto m = Make(dir_.path() + "/llama", "llama", 32, 2, 7);
  ASSERT_NE(m, nullptr);
  const std::vector<int64_t> prompt = {0, 1, 2, 3, 0, 2, 1, 3, 3, 0, 1, 1, 2, 2, 0, 3, 2, 1, 0, 0};
  const auto run = [&](SpeculativeConfig spec, EngineStats* stats) {
    std::map<std::vector<int64_t>, int64_t> counts;
    const LogitsProcessorFactory four = [](const GenerationRequest&) {
      return std::make_unique<FourTokens>();
    };
    EngineCore core = Core(*m, spec, {}, nullptr, four);
    uint64_t seed = spec.enabled() ? 1'000'000 : 0;
    for (int batch = 0; batch < 20; ++batch) {
      std::vector<GenerationRequest> requests;
      for (int i = 0; i < 100; ++i) {
        GenerationRequest r = Greedy(prompt, 3);
        r.sampling.temperature = 1.0;
        r.sampling.seed = seed++;
        requests.push_back(r);
      }
      auto results = Generate(core, requests);
      EXPECT_THAT(results, IsOk());
      if (!results.ok()) break;
      for (const GenerationResult& r : *results) ++counts[r.token_ids];
    }
    *stats = core.stats();
    return counts;
  };
  EngineStats plain_stats, spec_stats;
  const auto plain = run({}, &plain_stats);
  const auto spec = run(Ngram(2, 1, 2), &spec_stats);
  EXPECT_EQ(plain_stats.spec_num_draft_tokens, 0);
  // Drafts were verified, and both accepted and rejected.
  EXPECT_GT(spec_stats.spec_num_accepted_tokens, 200);
  EXPECT_LT(spec_stats.spec_num_accepted_tokens, spec_stats.spec_num_draft_tokens);
  // Two samples of 2000 over the same categories: sum (a - b)^2 / (a + b).
  std::set<std::vector<int64_t>> keys;
  for (const auto& [k, n] : plain) keys.insert(k);
  for (const auto& [k, n] : spec) keys.insert(k);
  double chi = 0;
  for (const auto& key : keys) {
    ASSERT_EQ(key.size(), 3u);
    for (int64_t t : key) EXPECT_LT(t, 4);
    const double a = plain.count(key) ? static_cast<double>(plain.at(key)) : 0.0;
    const double b = spec.count(key) ? static_cast<double>(spec.at(key)) : 0.0;
    chi += (a - b) * (a - b) / (a + b);
  }
  EXPECT_LT(chi, ChiSquareBound(static_cast<int64_t>(keys.size()) - 1))
      << keys.size() << " categories";
}

}  // namespace
}  // namespace accel::engine
