// accel::nn layers against straightforward independent implementations.
#include "models/nn.h"

#include <cmath>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dispatch/empty_weights.h"
#include "dispatch/module_tree.h"
#include "tests/testing/status_matchers.h"

namespace accel::nn {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

// Fills a layer's (uninitialised) tensors with seeded values.
void Fill(at::Tensor& t, int seed) {
  at::manual_seed(seed);
  t.detach().copy_(at::randn(t.sizes()).to(t.scalar_type()));
}

TEST(LinearTest, MatchesANaiveLoop) {
  Linear linear(3, 2, /*bias=*/true, at::kFloat);
  Fill(linear.weight, 1);
  Fill(linear.bias, 2);
  at::Tensor x = at::randn({4, 3});
  at::Tensor y = linear.forward(x);
  auto w = linear.weight.accessor<float, 2>();
  auto b = linear.bias.accessor<float, 1>();
  auto xs = x.accessor<float, 2>();
  for (int r = 0; r < 4; ++r) {
    for (int o = 0; o < 2; ++o) {
      double sum = b[o];
      for (int i = 0; i < 3; ++i) sum += static_cast<double>(xs[r][i]) * w[o][i];
      EXPECT_NEAR(y[r][o].item<float>(), sum, 1e-5);
    }
  }
  EXPECT_EQ(linear.named_parameters().size(), 2u);
  Linear no_bias(3, 2, false, at::kFloat);
  EXPECT_EQ(no_bias.named_parameters().size(), 1u);
  EXPECT_FALSE(no_bias.bias.defined());
}

TEST(LinearTest, ASharedWeightIsTheSameTensor) {
  Embedding embed(10, 4, at::kFloat);
  Linear head(4, 10, false, at::kFloat, embed.weight);
  EXPECT_EQ(head.weight.unsafeGetTensorImpl(), embed.weight.unsafeGetTensorImpl());
}

TEST(Conv1DTest, IsXTimesWPlusB) {
  Conv1D conv(3, 5, at::kFloat);
  Fill(conv.weight, 3);
  Fill(conv.bias, 4);
  at::Tensor x = at::randn({2, 7, 3});
  at::Tensor y = conv.forward(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 7, 5}));
  for (int o = 0; o < 5; ++o) {
    double sum = conv.bias[o].item<double>();
    for (int i = 0; i < 3; ++i) sum += x[1][6][i].item<double>() * conv.weight[i][o].item<double>();
    EXPECT_NEAR(y[1][6][o].item<float>(), sum, 1e-5);
  }
}

TEST(EmbeddingTest, LooksUpRows) {
  Embedding embed(6, 3, at::kFloat);
  Fill(embed.weight, 5);
  at::Tensor rows = embed.forward(at::tensor({4, 0, 4}, at::kLong));
  EXPECT_TRUE(at::equal(rows[0], embed.weight[4]));
  EXPECT_TRUE(at::equal(rows[1], embed.weight[0]));
}

TEST(RMSNormTest, NormalisesInFloat32ThenScales) {
  RMSNorm norm("LlamaRMSNorm", 4, 1e-6, at::kFloat);
  Fill(norm.weight, 6);
  at::Tensor x = at::randn({3, 4});
  at::Tensor y = norm.forward(x);
  for (int r = 0; r < 3; ++r) {
    double ms = 0;
    for (int i = 0; i < 4; ++i) ms += x[r][i].item<double>() * x[r][i].item<double>() / 4;
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(y[r][i].item<float>(),
                  x[r][i].item<double>() / std::sqrt(ms + 1e-6) * norm.weight[i].item<double>(),
                  1e-5);
    }
  }
  // bf16 input: normalised in float32, cast to bf16, then times the weight.
  RMSNorm half("LlamaRMSNorm", 4, 1e-6, at::kBFloat16);
  half.weight.detach().copy_(norm.weight.to(at::kBFloat16));
  at::Tensor xb = x.to(at::kBFloat16);
  at::Tensor expected = half.weight * (xb.to(at::kFloat) *
                                       at::rsqrt(xb.to(at::kFloat).pow(2).mean({-1}, true) + 1e-6))
                                          .to(at::kBFloat16);
  EXPECT_TRUE(at::equal(half.forward(xb), expected));
  EXPECT_EQ(half.forward(xb).scalar_type(), at::kBFloat16);
}

TEST(LayerNormTest, MatchesMeanAndVariance) {
  LayerNorm norm(5, 1e-5, at::kFloat);
  Fill(norm.weight, 7);
  Fill(norm.bias, 8);
  at::Tensor x = at::randn({2, 5});
  at::Tensor y = norm.forward(x);
  for (int r = 0; r < 2; ++r) {
    double mean = 0, var = 0;
    for (int i = 0; i < 5; ++i) mean += x[r][i].item<double>() / 5;
    for (int i = 0; i < 5; ++i) var += std::pow(x[r][i].item<double>() - mean, 2) / 5;
    for (int i = 0; i < 5; ++i) {
      double want =
          (x[r][i].item<double>() - mean) / std::sqrt(var + 1e-5) * norm.weight[i].item<double>() +
          norm.bias[i].item<double>();
      EXPECT_NEAR(y[r][i].item<float>(), want, 1e-5);
    }
  }
}

TEST(RopeTest, DefaultAndLinearFrequencies) {
  at::Tensor f = RopeInverseFrequencies(8, 10000.0, std::nullopt);
  ASSERT_EQ(f.numel(), 4);
  for (int i = 0; i < 4; ++i)
    EXPECT_NEAR(f[i].item<double>(), std::pow(10000.0, -2.0 * i / 8), 1e-7);
  loader::RopeScaling linear{"linear", {{"factor", 4.0}}, {}};
  at::Tensor g = RopeInverseFrequencies(8, 10000.0, linear);
  for (int i = 0; i < 4; ++i)
    EXPECT_NEAR(g[i].item<double>(), std::pow(10000.0, -2.0 * i / 8) / 4, 1e-7);
}

// Llama 3.1's scaling, worked element by element the way transformers writes it.
TEST(RopeTest, Llama3ScalingMatchesAScalarImplementation) {
  loader::RopeScaling s{"llama3",
                        {{"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 8192.0}},
                        {}};
  at::Tensor f = RopeInverseFrequencies(128, 500000.0, s);
  ASSERT_EQ(f.numel(), 64);
  int scaled = 0, kept = 0, blended = 0;
  for (int i = 0; i < 64; ++i) {
    const double base = 1.0 / std::pow(500000.0, (2.0 * i) / 128);
    const double wavelen = 2 * M_PI / base;
    double want;
    if (wavelen < 8192.0 / 4.0) {
      want = base;
      ++kept;
    } else if (wavelen > 8192.0 / 1.0) {
      want = base / 8;
      ++scaled;
    } else {
      const double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
      want = (1 - smooth) * base / 8 + smooth * base;
      ++blended;
    }
    EXPECT_NEAR(f[i].item<double>() / want, 1.0, 1e-5) << i;
  }
  EXPECT_GT(scaled, 0);  // the three bands are all exercised
  EXPECT_GT(kept, 0);
  EXPECT_GT(blended, 0);
}

TEST(RopeTest, UnsupportedScalingIsInvalid) {
  EXPECT_THAT(RotaryEmbedding::Create("LlamaRotaryEmbedding", 8, 1e4,
                                      loader::RopeScaling{"yarn", {{"factor", 2}}, {}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'yarn'")));
  EXPECT_THAT(RotaryEmbedding::Create("LlamaRotaryEmbedding", 8, 1e4,
                                      loader::RopeScaling{"llama3", {{"factor", 2}}, {}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("low_freq_factor")));
  EXPECT_THAT(RotaryEmbedding::Create("LlamaRotaryEmbedding", 7, 1e4, std::nullopt),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("even")));
}

// Rotary embedding rotates each pair (x_i, x_{i + d/2}) by position x inv_freq_i.
TEST(RopeTest, RotatesPairsByPositionTimesFrequency) {
  auto rope = RotaryEmbedding::Create("LlamaRotaryEmbedding", 8, 100.0, std::nullopt);
  ASSERT_THAT(rope, IsOk());
  at::Tensor positions = at::tensor({0, 5}, at::kLong).view({1, 2});
  auto [cos, sin] = (*rope)->forward(positions, at::kFloat);
  at::Tensor x = at::randn({1, 3, 2, 8});  // [B, heads, T, head_dim]
  at::Tensor y = ApplyRotary(x, cos, sin);
  EXPECT_TRUE(at::allclose(y.select(2, 0), x.select(2, 0)));  // position 0: no rotation
  for (int h = 0; h < 3; ++h) {
    for (int i = 0; i < 4; ++i) {
      const double angle = 5 * std::pow(100.0, -2.0 * i / 8);
      const double a = x[0][h][1][i].item<double>(), b = x[0][h][1][i + 4].item<double>();
      EXPECT_NEAR(y[0][h][1][i].item<float>(), a * std::cos(angle) - b * std::sin(angle), 1e-5);
      EXPECT_NEAR(y[0][h][1][i + 4].item<float>(), b * std::cos(angle) + a * std::sin(angle), 1e-5);
    }
  }
}

TEST(LayersTest, BuildEmptyAndDescribeThemselves) {
  std::shared_ptr<RMSNorm> norm;
  std::shared_ptr<Linear> linear;
  {
    dispatch::EmptyWeightsGuard empty;
    norm = std::make_shared<RMSNorm>("Qwen2RMSNorm", 4096, 1e-6, at::kBFloat16);
    linear = std::make_shared<Linear>(4096, 4096, true, at::kBFloat16);
  }
  EXPECT_TRUE(norm->weight.is_meta());
  EXPECT_TRUE(linear->bias.is_meta());
  auto rope = RotaryEmbedding::Create("LlamaRotaryEmbedding", 64, 1e4, std::nullopt);
  ASSERT_THAT(rope, IsOk());
  auto tree = dispatch::ModuleTree::FromModule(**rope);
  ASSERT_THAT(tree, IsOk());
  EXPECT_EQ(tree->node(0).class_name, "LlamaRotaryEmbedding");
  ASSERT_EQ(tree->NamedBuffers().size(), 1u);
  EXPECT_FALSE(tree->NamedBuffers()[0].decl->persistent);  // inv_freq is computed, not loaded
  EXPECT_EQ(dispatch::ModuleTree::FromModule(*norm)->node(0).class_name, "Qwen2RMSNorm");
}

}  // namespace
}  // namespace accel::nn
