// The sampler against hand-worked cases of transformers' logits processors,
// and its draws against the distribution they come from.
#include "models/sampling.h"

#include <cmath>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::models {
namespace {

using ::accel::test::StatusIs;
using ::testing::HasSubstr;

// Sampling proper: the default temperature (0) is greedy.
SamplingParams Sampled() {
  SamplingParams p;
  p.temperature = 1.0;
  return p;
}

Sampler Make(SamplingParams p) {
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

at::Tensor LogProbs(std::vector<double> p) {
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

}  // namespace
}  // namespace accel::models
