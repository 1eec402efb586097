// Draft verification against the rule's promise. Greedy: drafts are kept
// while they are the argmax, then the argmax. Sampled: whatever the drafts
// (certain ones from prompt lookup, or drawn from a draft model's q), the
// tokens have the target's distribution p, checked by a chi-square test on
// many draws (a fixed seed, so the result is the same on every run; the
// bound is the 99.9th percentile). The logits processor sees every
// position.
#include "engine/rejection_sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accel::engine {
namespace {

using ::testing::ElementsAre;

Sampler Make(double temperature, uint64_t seed) {
  SamplingParams p;
  p.temperature = temperature;
  p.seed = seed;
  return *Sampler::Create(p);
}

// Pearson's statistic of `counts` against probabilities `p` over n draws.
double ChiSquare(const std::vector<int64_t>& counts, const std::vector<double>& p, int64_t n) {
  double chi = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double expected = p[i] * static_cast<double>(n);
    if (expected == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    chi += (static_cast<double>(counts[i]) - expected) *
           (static_cast<double>(counts[i]) - expected) / expected;
  }
  return chi;
}

// The 99.9th percentile of chi-square with 5 degrees of freedom (6 tokens).
constexpr double kChiSquare5 = 20.52;

const std::vector<float> kLogits0 = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f, 0.0f};
const std::vector<float> kLogits1 = {0.0f, -0.5f, 2.5f, 1.0f, 0.2f, 1.2f};

std::vector<double> Softmax(const std::vector<float>& logits) {
  std::vector<double> p;
  double total = 0;
  for (float x : logits) total += std::exp(static_cast<double>(x));
  for (float x : logits) p.push_back(std::exp(static_cast<double>(x)) / total);
  return p;
}

at::Tensor Rows(const std::vector<std::vector<float>>& rows) {
  std::vector<at::Tensor> out;
  for (const auto& r : rows) out.push_back(at::tensor(r, at::kFloat));
  return at::stack(out);
}

TEST(RejectionSamplerTest, GreedyKeepsDraftsWhileTheyAreTheArgmax) {
  Sampler s = Make(0, 1);
  const at::Tensor logits = Rows({kLogits0, kLogits1, kLogits0});  // argmax 1, 2, 1
  Verification all = VerifyDrafts(s, logits, {3}, {1, 2}, at::Tensor(), nullptr);
  EXPECT_THAT(all.token_ids, ElementsAre(1, 2, 1));
  EXPECT_EQ(all.accepted, 2);
  Verification second = VerifyDrafts(s, logits, {3}, {1, 4}, at::Tensor(), nullptr);
  EXPECT_THAT(second.token_ids, ElementsAre(1, 2));
  EXPECT_EQ(second.accepted, 1);
  Verification none = VerifyDrafts(s, logits.narrow(0, 0, 1), {3}, {}, at::Tensor(), nullptr);
  EXPECT_THAT(none.token_ids, ElementsAre(1));
  EXPECT_EQ(none.accepted, 0);
}

// With no drafts it is the sampler's own draw, token for token.
TEST(RejectionSamplerTest, WithoutDraftsItIsTheSamplersDraw) {
  Sampler a = Make(1.0, 5), b = Make(1.0, 5);
  const at::Tensor logits = Rows({kLogits0});
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(VerifyDrafts(a, logits, {}, {}, at::Tensor(), nullptr).token_ids[0],
              b.Next(logits[0], {}));
  }
}

// Prompt lookup's drafts are certain: whichever token is drafted, the
// first token and the pair of the first two keep p's distribution.
TEST(RejectionSamplerTest, CertainDraftsLeaveTheTargetsDistribution) {
  const int64_t n = 40000;
  const std::vector<double> p0 = Softmax(kLogits0), p1 = Softmax(kLogits1);
  for (int64_t draft : {1, 3}) {
    Sampler s = Make(1.0, 11 + static_cast<uint64_t>(draft));
    const at::Tensor logits = Rows({kLogits0, kLogits1, kLogits0});
    std::vector<int64_t> first(6, 0), second(6, 0);
    int64_t second_n = 0, accepted = 0;
    for (int64_t i = 0; i < n; ++i) {
      Verification v = VerifyDrafts(s, logits, {}, {draft, 2}, at::Tensor(), nullptr);
      ++first[static_cast<size_t>(v.token_ids[0])];
      accepted += v.accepted;
      if (v.token_ids.size() > 1) {
        ++second[static_cast<size_t>(v.token_ids[1])];
        ++second_n;
      }
    }
    EXPECT_LT(ChiSquare(first, p0, n), kChiSquare5) << "draft " << draft;
    // Given the first token is the draft, the second has p1's distribution.
    EXPECT_LT(ChiSquare(second, p1, second_n), kChiSquare5) << "draft " << draft;
    EXPECT_NEAR(static_cast<double>(second_n) / n, p0[static_cast<size_t>(draft)], 0.01);
    EXPECT_GT(accepted, 0);
  }
}

// A draft model's drafts drawn from q: accepted with min(1, p / q), the
// residual max(0, p - q) otherwise; the first token has p's distribution.
TEST(RejectionSamplerTest, DraftModelDraftsLeaveTheTargetsDistribution) {
  const int64_t n = 40000;
  const std::vector<double> p0 = Softmax(kLogits0);
  const std::vector<float> draft_logits = {2.0f, 0.0f, 1.0f, 1.0f, -1.0f, 0.5f};
  const std::vector<double> q = Softmax(draft_logits);
  const at::Tensor q_rows = at::tensor(q, at::kDouble).unsqueeze(0);
  std::mt19937_64 draw(3);
  std::discrete_distribution<int64_t> from_q(q.begin(), q.end());
  Sampler s = Make(1.0, 17);
  const at::Tensor logits = Rows({kLogits0, kLogits1});
  std::vector<int64_t> first(6, 0);
  int64_t accepted = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = from_q(draw);
    Verification v = VerifyDrafts(s, logits, {}, {d}, q_rows, nullptr);
    ++first[static_cast<size_t>(v.token_ids[0])];
    accepted += v.accepted;
  }
  EXPECT_LT(ChiSquare(first, p0, n), kChiSquare5);
  // The acceptance rate is sum(min(p, q)).
  double overlap = 0;
  for (size_t i = 0; i < q.size(); ++i) overlap += std::min(p0[i], q[i]);
  EXPECT_NEAR(static_cast<double>(accepted) / n, overlap, 0.01);
}

// A processor that bans token 1 (the argmax) at every position: greedy
// rejects a draft of 1 and gives the next best.
class BanOne : public LogitsProcessor {
 public:
  void Apply(absl::Span<const int64_t> previous, at::Tensor& logits) override {
    seen.push_back(static_cast<int64_t>(previous.size()));
    logits[1] = -std::numeric_limits<float>::infinity();
  }
  std::vector<int64_t> seen;
};

TEST(RejectionSamplerTest, TheLogitsProcessorSeesEveryPositionWithTheDraftsBeforeIt) {
  Sampler s = Make(0, 1);
  BanOne ban;
  const at::Tensor logits = Rows({kLogits1, kLogits0, kLogits1});  // argmax 2, (1 banned) 4, 2
  Verification v = VerifyDrafts(s, logits, {7, 7}, {2, 4}, at::Tensor(), &ban);
  EXPECT_THAT(v.token_ids, ElementsAre(2, 4, 2));
  EXPECT_THAT(ban.seen, ElementsAre(2, 3, 4));
}

}  // namespace
}  // namespace accel::engine
