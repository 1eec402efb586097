// SdpaAttention (models/internal/sdpa.h): where it applies (a CUDA device,
// libtorch 2.5+, no soft-cap) against a plain reference in double written
// here: causal prefill, a chunk continuing a cache (past > 0), a sliding
// window, grouped heads, a rule that divides. Everywhere else it declines,
// so AttendPacked keeps its own path (and the cpu's numbers).
#include "models/internal/sdpa.h"

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

namespace accel::models::internal {
namespace {

// [heads, n, dv] in double on the cpu.
at::Tensor Reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t past,
                     std::optional<int64_t> window, const ScoreRule& rule) {
  const at::Tensor qd = q.to(at::kDouble).cpu(), kd = k.to(at::kDouble).cpu();
  const at::Tensor vd = v.to(at::kDouble).cpu();
  const int64_t heads = q.size(0), n = q.size(1), d = q.size(2), kv_heads = k.size(0);
  const int64_t dv = v.size(2), total = past + n, group = heads / kv_heads;
  at::Tensor out = at::zeros({heads, n, dv}, at::kDouble);
  auto qa = qd.accessor<double, 3>();
  auto ka = kd.accessor<double, 3>();
  auto va = vd.accessor<double, 3>();
  auto oa = out.accessor<double, 3>();
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t g = h / group;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = past + i;
      std::vector<double> scores(static_cast<size_t>(total), -INFINITY);
      double top = -INFINITY;
      for (int64_t j = 0; j <= p; ++j) {
        if (window && p - j >= *window) continue;
        double dot = 0;
        for (int64_t e = 0; e < d; ++e) dot += qa[h][i][e] * ka[g][j][e];
        dot = rule.divide ? dot / rule.scale : dot * rule.scale;
        scores[static_cast<size_t>(j)] = dot;
        top = std::max(top, dot);
      }
      double sum = 0;
      for (double& s : scores) sum += (s = std::exp(s - top));
      for (int64_t e = 0; e < dv; ++e) {
        double acc = 0;
        for (int64_t j = 0; j < total; ++j) acc += scores[static_cast<size_t>(j)] * va[g][j][e];
        oa[h][i][e] = acc / sum;
      }
    }
  }
  return out;
}

TEST(SdpaTest, DeclinesOffCudaAndWithASoftcap) {
  c10::InferenceMode inference;
  const at::Tensor q = at::randn({4, 3, 16}), k = at::randn({2, 3, 16});
  ScoreRule rule;
  EXPECT_FALSE(SdpaAttention(q, k, k, 0, std::nullopt, rule).has_value());
  if (!SdpaBuilt() || !at::hasCUDA()) GTEST_SKIP() << "no scaled_dot_product_attention or device";
  const at::Device gpu(at::kCUDA, 0);
  rule.softcap = 30.0;
  EXPECT_FALSE(SdpaAttention(q.to(gpu), k.to(gpu), k.to(gpu), 0, std::nullopt, rule).has_value());
}

struct Case {
  const char* name;
  at::ScalarType dtype;
  int64_t heads, kv_heads, d, n, past;
  std::optional<int64_t> window;
  bool divide;
};

TEST(SdpaTest, MatchesTheReferenceOnADevice) {
  if (!SdpaBuilt() || !at::hasCUDA()) GTEST_SKIP() << "no scaled_dot_product_attention or device";
  c10::InferenceMode inference;
  const at::Device gpu(at::kCUDA, 0);
  const Case cases[] = {
      {"CausalPrefillGqa", at::kBFloat16, 32, 8, 128, 300, 0, std::nullopt, false},
      {"ContinuingAChunk", at::kHalf, 8, 2, 64, 50, 70, std::nullopt, false},
      {"WindowedPrefill", at::kBFloat16, 8, 8, 64, 200, 0, int64_t{64}, false},
      {"WindowedContinuation", at::kFloat, 4, 1, 64, 20, 100, int64_t{32}, true},
      {"OneTokenOverAContiguousCache", at::kBFloat16, 8, 2, 128, 1, 500, std::nullopt, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    at::manual_seed(3);
    const at::Tensor q = at::randn({c.heads, c.n, c.d}).to(c.dtype).to(gpu);
    const at::Tensor k = at::randn({c.kv_heads, c.past + c.n, c.d}).to(c.dtype).to(gpu);
    const at::Tensor v = at::randn({c.kv_heads, c.past + c.n, c.d}).to(c.dtype).to(gpu);
    ScoreRule rule;
    if (c.divide) {
      rule.scale = std::sqrt(static_cast<double>(c.d));
      rule.divide = true;
    } else {
      rule.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    }
    const std::optional<at::Tensor> got = SdpaAttention(q, k, v, c.past, c.window, rule);
    ASSERT_TRUE(got.has_value());
    ASSERT_EQ(got->sizes(), (std::vector<int64_t>{c.heads, c.n, c.d}));
    EXPECT_EQ(got->scalar_type(), c.dtype);
    const at::Tensor want = Reference(q, k, v, c.past, c.window, rule);
    const double tolerance = c.dtype == at::kFloat ? 1e-4 : c.dtype == at::kHalf ? 4e-3 : 3e-2;
    EXPECT_LE((got->cpu().to(at::kDouble) - want).abs().max().item<double>(), tolerance);
  }
}

}  // namespace
}  // namespace accel::models::internal
