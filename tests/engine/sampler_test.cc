// The sampler against hand-worked cases of transformers' logits processors,
// and its draws against the distribution they come from; extreme temperatures
// and penalties against their limits on the demo model's logits.
#include "engine/sampler.h"

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/engine_core.h"
#include "engine/model_runner.h"
#include "models/causal_lm.h"
#include "models/load_model.h"
#include "tests/testing/status_matchers.h"
#include "tokenizer/tokenizer.h"

namespace accel::engine {
namespace {

using models::LoadedModel;
using models::LoadModel;
using models::Logits;
using models::ModelLoadOptions;
using models::SequenceChunk;

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::tokenizer::Tokenizer;
using ::testing::HasSubstr;

// Sampling proper: the default temperature (0) is greedy.
SamplingParams Sampled() {
  SamplingParams p;
  p.temperature = 1.0;
  return p;
}

Sampler Make(const SamplingParams& p) {
  auto s = Sampler::Create(p);
  EXPECT_TRUE(s.ok()) << s.status();
  return *std::move(s);
}

// Which tokens survive the filters.
std::vector<int64_t> Kept(const Sampler& s, const at::Tensor& logits) {
  at::Tensor x = s.Process(logits, {});
  std::vector<int64_t> kept;
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (std::isfinite(x[i].item<float>())) kept.push_back(i);
  }
  return kept;
}

at::Tensor LogProbs(const std::vector<double>& p) {
  return at::log(at::tensor(p, at::kDouble)).to(at::kFloat);
}

TEST(SamplerTest, GreedyIsTheArgmaxAfterTheRepetitionPenalty) {
  SamplingParams p;
  p.temperature = 0;
  at::Tensor logits = at::tensor({1.0f, 3.0f, 2.0f, -1.0f});
  EXPECT_EQ(Make(p).Next(logits, {}), 1);
  p.repetition_penalty = 2.0;
  Sampler penalised = Make(p);
  EXPECT_EQ(penalised.Next(logits, {1}), 2);  // 3 / 2 = 1.5 < 2
  at::Tensor x = penalised.Process(logits, {1, 3, 1});
  EXPECT_FLOAT_EQ(x[1].item<float>(), 1.5f);   // positive: divided
  EXPECT_FLOAT_EQ(x[3].item<float>(), -2.0f);  // negative: multiplied
  EXPECT_FLOAT_EQ(x[0].item<float>(), 1.0f);   // unseen: unchanged
}

TEST(SamplerTest, TemperatureDividesTheLogits) {
  SamplingParams p;
  p.temperature = 0.5;
  at::Tensor x = Make(p).Process(at::tensor({1.0f, -2.0f}), {});
  EXPECT_FLOAT_EQ(x[0].item<float>(), 2.0f);
  EXPECT_FLOAT_EQ(x[1].item<float>(), -4.0f);
}

TEST(SamplerTest, TopKKeepsTiesAtTheBoundary) {
  SamplingParams p = Sampled();
  p.top_k = 2;
  at::Tensor logits = at::tensor({1.0f, 5.0f, 5.0f, 3.0f});
  EXPECT_EQ(Kept(Make(p), logits), (std::vector<int64_t>{1, 2}));
  p.top_k = 3;
  EXPECT_EQ(Kept(Make(p), logits), (std::vector<int64_t>{1, 2, 3}));
}

TEST(SamplerTest, TopPKeepsTheSmallestSetReachingP) {
  SamplingParams p = Sampled();
  p.top_p = 0.79;  // 0.5 + 0.3 reaches it (away from the 0.8 boundary)
  EXPECT_EQ(Kept(Make(p), LogProbs({0.5, 0.3, 0.15, 0.05})), (std::vector<int64_t>{0, 1}));
  p.top_p = 0.81;  // needs the 0.15 too
  EXPECT_EQ(Kept(Make(p), LogProbs({0.5, 0.3, 0.15, 0.05})), (std::vector<int64_t>{0, 1, 2}));
  p.top_p = 0.01;  // the most likely token always stays
  EXPECT_EQ(Kept(Make(p), LogProbs({0.2, 0.7, 0.1})), (std::vector<int64_t>{1}));
}

TEST(SamplerTest, MinPDropsTokensFarBelowTheBest) {
  SamplingParams p = Sampled();
  p.min_p = 0.2;  // below 0.2 x 0.5 = 0.1 goes
  EXPECT_EQ(Kept(Make(p), LogProbs({0.5, 0.3, 0.15, 0.05})), (std::vector<int64_t>{0, 1, 2}));
}

TEST(SamplerTest, DrawsFollowTheFilteredDistribution) {
  SamplingParams p = Sampled();
  p.seed = 1234;
  p.top_k = 2;  // {0.5, 0.3} renormalised: 0.625, 0.375
  Sampler s = Make(p);
  at::Tensor logits = LogProbs({0.5, 0.3, 0.2});
  std::vector<int> counts(3, 0);
  constexpr int kDraws = 20000;
  for (int i = 0; i < kDraws; ++i) counts[s.Next(logits, {})]++;
  EXPECT_EQ(counts[2], 0);
  EXPECT_NEAR(counts[0] / static_cast<double>(kDraws), 0.625, 0.015);
  EXPECT_NEAR(counts[1] / static_cast<double>(kDraws), 0.375, 0.015);
}

TEST(SamplerTest, TheSameSeedGivesTheSameTokens) {
  SamplingParams p = Sampled();
  p.seed = 7;
  Sampler a = Make(p), b = Make(p);
  p.seed = 8;
  Sampler c = Make(p);
  at::Tensor logits = at::zeros({50});
  std::vector<int64_t> ta, tb, tc;
  for (int i = 0; i < 32; ++i) {
    ta.push_back(a.Next(logits, {}));
    tb.push_back(b.Next(logits, {}));
    tc.push_back(c.Next(logits, {}));
  }
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ta, tc);
}

// NextRows against Next, row by row with twin generators: the same tokens,
// bit for bit, for rows of mixed parameters in one call (each filter alone,
// all of them, none, a temperature that overflows the logits), over logits
// rounded to bfloat16 so that ties straddle the top-k and top-p boundaries,
// for many draws (each advancing the generators as Next does).
TEST(SamplerTest, NextRowsIsNextForEveryRow) {
  std::vector<SamplingParams> params;
  for (int variant = 0; variant < 8; ++variant) {
    SamplingParams p = Sampled();
    p.seed = 100 + variant;
    switch (variant) {
      case 1:
        p.temperature = 0.7;
        break;
      case 2:
        p.top_k = 40;
        break;
      case 3:
        p.top_p = 0.9;
        break;
      case 4:
        p.min_p = 0.05;
        break;
      case 5:
        p.top_k = 50;
        p.top_p = 0.8;
        p.min_p = 0.02;
        p.temperature = 1.3;
        break;
      case 6:
        p.temperature = 1e-300;
        break;  // divides the logits past the double range
      case 7:
        p.top_p = 0.5;
        p.top_k = 3;
        break;
      default:
        break;
    }
    params.push_back(p);
  }
  std::vector<Sampler> one_by_one, together;
  for (const SamplingParams& p : params) {
    one_by_one.push_back(Make(p));
    together.push_back(Make(p));
  }
  std::vector<Sampler*> rows;
  for (Sampler& s : together) {
    EXPECT_TRUE(s.batch_samplable());
    rows.push_back(&s);
  }
  at::manual_seed(3);
  int differing_rows = 0;
  for (int step = 0; step < 40; ++step) {
    // 2000 tokens, logits on a bfloat16 grid: many exact ties.
    const at::Tensor logits = (at::randn({static_cast<int64_t>(params.size()), 2000}) * 3)
                                  .to(at::kBFloat16)
                                  .to(at::kFloat);
    std::vector<int64_t> want;
    for (size_t r = 0; r < params.size(); ++r) {
      want.push_back(one_by_one[r].Next(logits[static_cast<int64_t>(r)], {}));
    }
    const std::vector<int64_t> got = Sampler::NextRows(logits, rows);
    ASSERT_EQ(got, want) << "step " << step;
    for (size_t r = 1; r < want.size(); ++r) differing_rows += want[r] != want[0];
  }
  // The rows' parameters and generators are their own, not the first row's.
  EXPECT_GT(differing_rows, 100);
  // Greedy rows, or ones with a repetition penalty, are not batch_samplable.
  EXPECT_FALSE(Make(SamplingParams()).batch_samplable());
  SamplingParams penalised = Sampled();
  penalised.repetition_penalty = 1.2;
  EXPECT_FALSE(Make(penalised).batch_samplable());
}

// A vocabulary of 1.5 M: NextRows takes its rows two at a time (its
// temporaries bounded), and the rows of every part are still Next()'s.
TEST(SamplerTest, NextRowsOverALargeVocabularyGoesInPartsAndIsNextForEveryRow) {
  std::vector<SamplingParams> params(3, Sampled());
  params[0].seed = 1;
  params[1].seed = 2;
  params[1].top_p = 0.9;
  params[2].seed = 3;
  params[2].top_k = 1000;
  params[2].temperature = 0.5;
  std::vector<Sampler> one_by_one, together;
  for (const SamplingParams& p : params) {
    one_by_one.push_back(Make(p));
    together.push_back(Make(p));
  }
  std::vector<Sampler*> rows;
  rows.reserve(together.size());
  for (Sampler& s : together) rows.push_back(&s);
  at::manual_seed(4);
  const at::Tensor logits = at::randn({3, 1500000}) * 4;
  std::vector<int64_t> want;
  for (int64_t r = 0; r < 3; ++r)
    want.push_back(one_by_one[static_cast<size_t>(r)].Next(logits[r], {}));
  EXPECT_EQ(Sampler::NextRows(logits, rows), want);
}

TEST(SamplerTest, BadParametersNameThemselves) {
  auto bad = [](auto set, const char* name) {
    SamplingParams p;
    set(p);
    EXPECT_THAT(Sampler::Create(p), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(name)));
  };
  bad([](SamplingParams& p) { p.temperature = -1; }, "temperature");
  bad([](SamplingParams& p) { p.temperature = NAN; }, "temperature");
  bad([](SamplingParams& p) { p.top_k = -3; }, "top_k");
  bad([](SamplingParams& p) { p.top_p = 0; }, "top_p");
  bad([](SamplingParams& p) { p.top_p = 1.5; }, "top_p");
  bad([](SamplingParams& p) { p.min_p = 2; }, "min_p");
  bad([](SamplingParams& p) { p.repetition_penalty = 0; }, "repetition_penalty");
}

// Real logits: the shipped demo model (models/demo) read a prompt; one row per position.
class ExtremeParametersTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ModelLoadOptions options;
    options.device_map = "cpu";
    options.dtype = "float32";
    auto loaded = LoadModel(ACCEL_DEMO_MODEL_DIR, options);
    ASSERT_THAT(loaded, IsOk());
    auto tokenizer = Tokenizer::FromFile(std::string(ACCEL_DEMO_MODEL_DIR) + "/tokenizer.json");
    ASSERT_THAT(tokenizer, IsOk());
    auto ids = tokenizer->Encode("The meaning of life is a question that", false);
    ASSERT_THAT(ids, IsOk());
    ASSERT_GE(ids->size(), 6u);
    at::NoGradGuard no_grad;
    std::vector<SequenceChunk> chunks = {{nullptr, static_cast<int64_t>(ids->size())}};
    auto logits = loaded->model->Forward(at::tensor(*ids, at::kLong), chunks, Logits::kAll,
                                         loaded->dispatched.get());
    ASSERT_THAT(logits, IsOk());
    loaded_ = new LoadedModel(*std::move(loaded));
    prompt_ = new std::vector<int64_t>(*ids);
    logits_ = new at::Tensor(logits->to(at::kFloat));
  }
  static void TearDownTestSuite() {
    delete logits_;
    delete prompt_;
    delete loaded_;
  }

  static LoadedModel* loaded_;
  static std::vector<int64_t>* prompt_;
  static at::Tensor* logits_;  // [prompt length, vocab], float32
};

LoadedModel* ExtremeParametersTest::loaded_ = nullptr;
std::vector<int64_t>* ExtremeParametersTest::prompt_ = nullptr;
at::Tensor* ExtremeParametersTest::logits_ = nullptr;

// Regression (issue 19): in float32 a temperature below about 1e-38 made every logit inf or
// NaN and the draw fell through to the last token. A tiny temperature's limit is greedy.
TEST_F(ExtremeParametersTest, TinyTemperaturesGiveTheGreedyToken) {
  ASSERT_NE(logits_, nullptr);
  const double denorm_min = std::numeric_limits<double>::denorm_min();
  for (double temperature : {1e-30, 1e-38, 1e-39, 1e-45, 1e-300, denorm_min}) {
    for (int64_t row = 0; row < logits_->size(0); ++row) {
      const at::Tensor logits = (*logits_)[row];
      const int64_t greedy = logits.argmax().item<int64_t>();
      SamplingParams p;
      p.temperature = temperature;
      p.seed = static_cast<uint64_t>(row);
      EXPECT_EQ(Make(p).Next(logits, {}), greedy)
          << "temperature " << temperature << " row " << row;
      // With the filters too (top-p and min-p take a softmax of the scaled logits).
      p.top_k = 40;
      p.top_p = 0.9;
      p.min_p = 0.05;
      Sampler filtered = Make(p);
      EXPECT_EQ(filtered.Next(logits, {}), greedy)
          << "filtered, temperature " << temperature << " row " << row;
      at::Tensor processed = filtered.Process(logits, {});
      EXPECT_FALSE(processed.isnan().any().item<bool>()) << "temperature " << temperature;
      EXPECT_EQ(processed.isfinite().sum().item<int64_t>(), 1) << "temperature " << temperature;
    }
  }
}

// The same through the engine core, as a client meets it: 16 tokens at temperature 1e-39 are
// the greedy ones (before the fix every step gave the same last token of the vocabulary).
TEST_F(ExtremeParametersTest, GenerationAtATinyTemperatureIsGreedy) {
  ASSERT_NE(loaded_, nullptr);
  auto generate = [&](double temperature) {
    auto runner = ModelRunner::Create(loaded_->model, loaded_->dispatched.get());
    EXPECT_THAT(runner, IsOk());
    EngineCore generator(*std::move(runner), nullptr);
    GenerationRequest request;
    request.prompt_ids = *prompt_;
    request.max_new_tokens = 16;
    request.sampling.temperature = temperature;
    request.sampling.seed = 3;
    std::vector<int64_t> tokens;
    auto id = generator.Add(request);
    EXPECT_THAT(id, IsOk());
    while (generator.num_requests() > 0) {
      auto events = generator.Step();
      EXPECT_THAT(events, IsOk());
      if (!events.ok()) break;
      for (const TokenEvent& e : *events) tokens.push_back(e.token_id);
    }
    return tokens;
  };
  std::vector<int64_t> greedy = generate(0);
  ASSERT_EQ(greedy.size(), 16u);
  EXPECT_EQ(generate(1e-39), greedy);
  EXPECT_EQ(generate(1e-300), greedy);
}

// A penalty of 1e-30 multiplies a seen positive logit by 1e30: the largest seen positive one
// wins, greedy or drawn at temperature 1 (the others are 1e30 times their gap behind).
TEST_F(ExtremeParametersTest, TinyRepetitionPenaltyPicksTheBestSeenToken) {
  ASSERT_NE(logits_, nullptr);
  int checked = 0;
  for (int64_t row = 0; row < logits_->size(0); ++row) {
    const at::Tensor logits = (*logits_)[row];
    int64_t best = -1;
    for (int64_t id : *prompt_) {
      const float v = logits[id].item<float>();
      if (v > 0 && (best < 0 || v > logits[best].item<float>())) best = id;
    }
    if (best < 0) continue;  // no seen token with a positive logit at this position
    ++checked;
    for (double temperature : {0.0, 1.0}) {
      SamplingParams p;
      p.temperature = temperature;
      p.repetition_penalty = kMinRepetitionPenalty;
      p.seed = static_cast<uint64_t>(row);
      EXPECT_EQ(Make(p).Next(logits, *prompt_), best)
          << "row " << row << " temperature " << temperature;
    }
  }
  EXPECT_GT(checked, 0);
}

// A penalty of 1e30 puts every seen token at (about) 0 or far below: where an unseen token has
// a positive logit, the greedy token is the best unseen one.
TEST_F(ExtremeParametersTest, HugeRepetitionPenaltyAvoidsEverySeenToken) {
  ASSERT_NE(logits_, nullptr);
  at::Tensor seen = at::zeros({logits_->size(1)}, at::kBool);
  for (int64_t id : *prompt_) seen[id] = true;
  int checked = 0;
  for (int64_t row = 0; row < logits_->size(0); ++row) {
    const at::Tensor logits = (*logits_)[row];
    const at::Tensor unseen_only =
        logits.masked_fill(seen, -std::numeric_limits<float>::infinity());
    if (!(unseen_only.max().item<float>() > 0)) continue;
    ++checked;
    const int64_t best_unseen = unseen_only.argmax().item<int64_t>();
    for (double temperature : {0.0, 1e-3}) {
      SamplingParams p;
      p.temperature = temperature;
      p.repetition_penalty = kMaxRepetitionPenalty;
      EXPECT_EQ(Make(p).Next(logits, *prompt_), best_unseen)
          << "row " << row << " temperature " << temperature;
    }
    // At temperature 1 no seen token is ever more likely than e^-max of the unseen ones.
    SamplingParams p = Sampled();
    p.repetition_penalty = kMaxRepetitionPenalty;
    at::Tensor probs = Make(p).Process(logits, *prompt_).softmax(0);
    EXPECT_LE(probs.masked_select(seen).max().item<double>(),
              std::exp(-unseen_only.max().item<double>()) + 1e-12)
        << "row " << row;
  }
  EXPECT_GT(checked, 0);
}

// Past [1e-30, 1e30] the penalty overflows (1e-300 drew the last token at every step in
// float32): refused, naming the parameter and the range; the bounds themselves are accepted.
TEST(SamplerTest, RepetitionPenaltyOutsideItsRangeIsRefused) {
  for (double penalty : {1e-300, 1e-31, 1e31, 1e300}) {
    SamplingParams p;
    p.repetition_penalty = penalty;
    EXPECT_THAT(Sampler::Create(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                             ::testing::AllOf(HasSubstr("repetition_penalty"),
                                                              HasSubstr("[1e-30, 1e30]"))))
        << penalty;
  }
  for (double penalty : {kMinRepetitionPenalty, kMaxRepetitionPenalty}) {
    SamplingParams p;
    p.repetition_penalty = penalty;
    EXPECT_THAT(Sampler::Create(p), IsOk()) << penalty;
  }
}

}  // namespace
}  // namespace accel::engine
