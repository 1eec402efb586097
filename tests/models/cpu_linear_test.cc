// FastLinear against at::linear computed in float64, within the float32
// accumulation bound (plus the final rounding to bfloat16 / float16), for
// decode-sized inputs and for prefill-sized ones cut into row chunks; the
// cases it must leave to libtorch; and nn::Linear taking it. FastConv1D the
// same way for GPT-2's [in, out] weights, and nn::Conv1D taking it.
#include "models/internal/cpu_linear.h"

#include <cmath>
#include <optional>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "core/cpu_features.h"
#include "core/torch_compat.h"
#include "models/nn.h"

namespace accel::models::internal {
namespace {

// Values exactly representable in `dtype` (uniform in [-1, 1], rounded).
at::Tensor Random(at::IntArrayRef shape, at::ScalarType dtype) {
  return (at::rand(shape, at::kDouble) * 2 - 1).to(dtype);
}

// Checks y (in x's dtype) against the exact product of the same inputs:
// |y - exact| <= gamma(in + 1) * (|x| |w|^T + |b|) for the float32 sums, plus
// half an ulp of the output type for its rounding.
void ExpectMatchesFloat64(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                          const at::Tensor& b) {
  const int64_t in = w.size(1);
  at::Tensor xd = x.to(at::kDouble), wd = w.to(at::kDouble);
  at::Tensor bd = b.defined() ? b.to(at::kDouble) : at::Tensor();
  at::Tensor exact = at::linear(xd, wd, bd);
  at::Tensor magnitude = at::linear(xd.abs(), wd.abs(), bd.defined() ? bd.abs() : at::Tensor());
  const double u = std::ldexp(1.0, -24);
  const double gamma = static_cast<double>(in + 1) * u / (1 - static_cast<double>(in + 1) * u);
  at::Tensor bound = gamma * magnitude;
  if (y.scalar_type() == at::kBFloat16) {
    bound = bound + std::ldexp(1.0, -8) * (exact.abs() + bound) + std::ldexp(1.0, -134);
  } else if (y.scalar_type() == at::kHalf) {
    bound = bound + std::ldexp(1.0, -11) * (exact.abs() + bound) + std::ldexp(1.0, -25);
  }
  ASSERT_EQ(y.sizes(), exact.sizes());
  ASSERT_EQ(y.scalar_type(), x.scalar_type());
  at::Tensor error = (y.to(at::kDouble) - exact).abs();
  at::Tensor excess = (error - bound).max();
  EXPECT_LE(excess.item<double>(), 0.0)
      << "worst error " << error.max().item<double>() << " bound there "
      << bound.flatten()[(error - bound).argmax()].item<double>();
}

bool TakesPrefillIn(at::ScalarType dtype) {
  return dtype != at::kBFloat16 || !CpuFeaturesOfThisMachine().onednn_bf16_matmul;
}

class CpuLinearTest : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  at::ScalarType dtype() const { return GetParam(); }
  // Whether FastLinear takes more than one chunk's rows in this dtype
  // (bfloat16 leaves them to libtorch's product where oneDNN runs it).
  bool TakesPrefill() const { return TakesPrefillIn(dtype()); }
};

TEST_P(CpuLinearTest, MatchesLinearInFloat64) {
  at::manual_seed(1);
  for (int64_t rows : {1, 2, 3, 8, 16}) {
    for (int64_t in : {1, 33, 256}) {
      for (int64_t out : {1, 17, 300}) {
        for (bool with_bias : {false, true}) {
          SCOPED_TRACE(testing::Message()
                       << rows << " x " << in << " -> " << out << (with_bias ? " with bias" : ""));
          at::Tensor x = Random({rows, in}, dtype());
          at::Tensor w = Random({out, in}, dtype());
          at::Tensor b = with_bias ? Random({out}, dtype()) : at::Tensor();
          std::optional<at::Tensor> y = FastLinear(x, w, b);
          ASSERT_TRUE(y.has_value());
          ExpectMatchesFloat64(*y, x, w, b);
        }
      }
    }
  }
}

TEST_P(CpuLinearTest, CutsManyRowsIntoChunks) {
  ASSERT_EQ(kFastLinearChunkRows, 16);
  at::manual_seed(7);
  // Chunks of 16 rows: 17 = 9 + 8, 31 = 16 + 15, 32 and 33 two and three
  // chunks, 100 seven.
  for (int64_t rows : {17, 31, 32, 33, 100}) {
    for (int64_t in : {33, 256}) {
      for (int64_t out : {17, 300}) {
        for (bool with_bias : {false, true}) {
          SCOPED_TRACE(testing::Message()
                       << rows << " x " << in << " -> " << out << (with_bias ? " with bias" : ""));
          at::Tensor x = Random({rows, in}, dtype());
          at::Tensor w = Random({out, in}, dtype());
          at::Tensor b = with_bias ? Random({out}, dtype()) : at::Tensor();
          std::optional<at::Tensor> y = FastLinear(x, w, b);
          ASSERT_EQ(y.has_value(), TakesPrefill());
          // What bfloat16 would get (accel-bench-gemv compares it with oneDNN).
          std::optional<at::Tensor> any = FastLinearAnyRows(x, w, b);
          ASSERT_TRUE(any.has_value());
          ExpectMatchesFloat64(*any, x, w, b);
          if (y) {
            EXPECT_TRUE(at::equal(*y, *any));
          }
        }
      }
    }
  }
}

TEST_P(CpuLinearTest, ChunksGiveEachRowWhatItGetsAlone) {
  // Each output element is summed in the same order however the rows are
  // blocked, so a row of a chunked product equals the one-row product
  // exactly: a wrong chunk offset cannot hide within the tolerance.
  // FastLinearAnyRows: the same path, which bfloat16 gets too.
  at::manual_seed(8);
  at::Tensor w = Random({70, 100}, dtype());
  at::Tensor b = Random({70}, dtype());
  for (int64_t rows : {32, 45}) {
    SCOPED_TRACE(testing::Message() << rows << " rows");
    at::Tensor x = Random({rows, 100}, dtype());
    std::optional<at::Tensor> y = FastLinearAnyRows(x, w, b);
    ASSERT_TRUE(y.has_value());
    for (int64_t i = 0; i < rows; ++i) {
      std::optional<at::Tensor> row = FastLinear(x[i], w, b);
      ASSERT_TRUE(row.has_value());
      EXPECT_TRUE(at::equal((*y)[i], *row)) << "row " << i;
    }
  }
}

TEST_P(CpuLinearTest, KeepsLeadingDimensions) {
  at::manual_seed(2);
  at::Tensor w = Random({40, 24}, dtype());
  at::Tensor b = Random({40}, dtype());
  at::Tensor x3 = Random({2, 4, 24}, dtype());  // [B, T, in]: 8 rows
  std::optional<at::Tensor> y3 = FastLinear(x3, w, b);
  ASSERT_TRUE(y3.has_value());
  EXPECT_EQ(y3->sizes(), (std::vector<int64_t>{2, 4, 40}));
  ExpectMatchesFloat64(*y3, x3, w, b);

  at::Tensor x1 = Random({24}, dtype());  // one vector
  std::optional<at::Tensor> y1 = FastLinear(x1, w, b);
  ASSERT_TRUE(y1.has_value());
  EXPECT_EQ(y1->sizes(), (std::vector<int64_t>{40}));
  ExpectMatchesFloat64(*y1, x1, w, b);

  at::Tensor prefill = Random({2, 50, 24}, dtype());  // [B, T, in]: 100 rows, 7 chunks
  std::optional<at::Tensor> y = FastLinear(prefill, w, b);
  ASSERT_EQ(y.has_value(), TakesPrefill());
  if (y) {
    EXPECT_EQ(y->sizes(), (std::vector<int64_t>{2, 50, 40}));
    ExpectMatchesFloat64(*y, prefill, w, b);
  }
}

TEST_P(CpuLinearTest, TakesNonContiguousInputs) {
  at::manual_seed(3);
  at::Tensor w = Random({50, 64}, dtype());
  at::Tensor b = Random({100}, dtype()).slice(0, 0, 100, 2);  // strided bias
  std::vector<at::Tensor> inputs = {
      Random({64, 4}, dtype()).t(),                // transposed: columns strided
      Random({4, 128}, dtype()).slice(1, 10, 74),  // rows strided, columns dense
      Random({1, 64}, dtype()).expand({6, 64}),    // one row seen 6 times (stride 0)
      Random({3, 8, 64}, dtype()).permute({1, 0, 2}).slice(0, 0, 4),  // [4, 3, in], permuted
      // More than one chunk of rows.
      Random({64, 40}, dtype()).t(),                    // 40 rows, columns strided
      Random({48, 128}, dtype()).slice(1, 10, 74),      // 48 rows (3 chunks), rows strided
      Random({1, 64}, dtype()).expand({33, 64}),        // stride 0, 33 rows
      Random({3, 20, 64}, dtype()).permute({1, 0, 2}),  // [20, 3, in]: 60 rows, permuted
  };
  for (const at::Tensor& x : inputs) {
    SCOPED_TRACE(testing::Message() << "x " << x.sizes() << " strides " << x.strides());
    ASSERT_FALSE(x.is_contiguous());
    std::optional<at::Tensor> y = FastLinear(x, w, b);
    if (x.numel() / 64 > kFastLinearChunkRows && !TakesPrefill()) {
      EXPECT_FALSE(y.has_value());
      continue;
    }
    ASSERT_TRUE(y.has_value());
    ExpectMatchesFloat64(*y, x, w, b);
  }
}

TEST_P(CpuLinearTest, TilesAndThreadsDoNotChangeAChunkedResult) {
  // 3001 x 512 weights are 6 MB in float32 (3 MB in 16 bits): several column
  // tiles per thread, each taken through the 3 chunks of 40 rows.
  // FastLinearAnyRows: the same path, which bfloat16 gets too.
  at::manual_seed(9);
  at::Tensor x = Random({40, 512}, dtype());
  at::Tensor w = Random({3001, 512}, dtype());
  at::Tensor b = Random({3001}, dtype());
  at::set_num_threads(1);
  std::optional<at::Tensor> one = FastLinearAnyRows(x, w, b);
  at::set_num_threads(2);
  std::optional<at::Tensor> two = FastLinearAnyRows(x, w, b);
  ASSERT_TRUE(one.has_value() && two.has_value());
  EXPECT_TRUE(at::equal(*one, *two));
  ExpectMatchesFloat64(*two, x, w, b);
  for (int64_t i : {0, 12, 13, 25, 26, 39}) {  // first and last rows of each chunk
    std::optional<at::Tensor> row = FastLinear(x[i], w, b);
    ASSERT_TRUE(row.has_value());
    EXPECT_TRUE(at::equal((*two)[i], *row)) << "row " << i;
  }
}

TEST(CpuLinearRoundingTest, RoundsTheFloat32ResultToNearestEven) {
  // Widening is exact and the arithmetic is the same, so the float32 product
  // of the widened tensors, rounded by torch's conversion, is the answer.
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::manual_seed(4);
    at::Tensor x = Random({5, 300}, dtype);
    at::Tensor w = Random({70, 300}, dtype);
    at::Tensor b = Random({70}, dtype);
    std::optional<at::Tensor> y = FastLinear(x, w, b);
    std::optional<at::Tensor> y32 =
        FastLinear(x.to(at::kFloat), w.to(at::kFloat), b.to(at::kFloat));
    ASSERT_TRUE(y.has_value() && y32.has_value());
    EXPECT_TRUE(at::equal(*y, y32->to(dtype)));
  }
}

TEST_P(CpuLinearTest, ThreadsSplitColumnsWithoutChangingTheResult) {
  at::manual_seed(5);
  at::Tensor x = Random({8, 512}, dtype());
  at::Tensor w = Random({3001, 512}, dtype());  // MBs of weights: several tasks
  at::Tensor b = Random({3001}, dtype());
  at::set_num_threads(1);
  std::optional<at::Tensor> one = FastLinear(x, w, b);
  at::set_num_threads(2);
  std::optional<at::Tensor> two = FastLinear(x, w, b);
  ASSERT_TRUE(one.has_value() && two.has_value());
  EXPECT_TRUE(at::equal(*one, *two));
  ExpectMatchesFloat64(*two, x, w, b);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CpuLinearTest,
                         ::testing::Values(at::kFloat, at::kBFloat16, at::kHalf),
                         [](const ::testing::TestParamInfo<at::ScalarType>& info) {
                           return std::string(c10::toString(info.param));
                         });

TEST(CpuLinearFallbackTest, LeavesEverythingElseToLibtorch) {
  at::Tensor w = at::randn({8, 16});
  at::Tensor b = at::randn({8});
  at::Tensor x = at::randn({2, 16});
  ASSERT_TRUE(FastLinear(x, w, b).has_value());
  EXPECT_TRUE(FastLinear(at::randn({17, 16}), w, b).has_value()) << "17 rows: two chunks";
  EXPECT_TRUE(
      FastLinear(at::randn({16, 16}).to(at::kBFloat16), w.to(at::kBFloat16), b.to(at::kBFloat16))
          .has_value())
      << "bfloat16, one chunk";
  EXPECT_EQ(
      FastLinear(at::randn({3, 6, 16}).to(at::kBFloat16), w.to(at::kBFloat16), b.to(at::kBFloat16))
          .has_value(),
      TakesPrefillIn(at::kBFloat16))
      << "bfloat16, 18 rows: oneDNN's where libtorch has it";
  EXPECT_FALSE(FastLinear(at::randn({0, 16}), w, b).has_value()) << "no rows";
  EXPECT_FALSE(FastLinear(at::randn({2, 15}), w, b).has_value()) << "in mismatch";
  EXPECT_FALSE(FastLinear(x, at::randn({16, 8}).t(), b).has_value()) << "weight not contiguous";
  EXPECT_FALSE(FastLinear(x, at::randn({2, 8, 16}), b).has_value()) << "weight 3-D";
  EXPECT_FALSE(FastLinear(x.to(at::kBFloat16), w, b).has_value()) << "x dtype differs";
  EXPECT_FALSE(FastLinear(x, w, b.to(at::kHalf)).has_value()) << "bias dtype differs";
  EXPECT_FALSE(FastLinear(x, w, at::randn({9})).has_value()) << "bias size";
  EXPECT_FALSE(FastLinear(x, w, at::randn({1, 8})).has_value()) << "bias 2-D";
  EXPECT_FALSE(FastLinear(x.to(at::kDouble), w.to(at::kDouble), b.to(at::kDouble)).has_value())
      << "float64";
  EXPECT_FALSE(FastLinear(x.to(at::kInt), w.to(at::kInt), b.to(at::kInt)).has_value()) << "int";
  EXPECT_FALSE(FastLinear(at::randn({2, 0}), at::randn({8, 0}), b).has_value()) << "in = 0";
  EXPECT_FALSE(FastLinear(x, at::randn({0, 16}), at::Tensor()).has_value()) << "out = 0";
  EXPECT_FALSE(FastLinear(x, at::empty({8, 16}, at::Device(at::kMeta)), b).has_value())
      << "meta weight";
  EXPECT_FALSE(FastLinear(at::Tensor(), w, b).has_value()) << "undefined x";
}

TEST(CpuLinearFallbackTest, LeavesAutogradToLibtorch) {
  at::Tensor w = at::randn({8, 16}).requires_grad_();
  at::Tensor x = at::randn({2, 16});
  ASSERT_TRUE(c10::GradMode::is_enabled());
  EXPECT_FALSE(FastLinear(x, w, at::Tensor()).has_value());
  EXPECT_FALSE(FastLinear(x.requires_grad_(), w.detach(), at::Tensor()).has_value());
  {
    at::NoGradGuard no_grad;
    EXPECT_TRUE(FastLinear(x, w, at::Tensor()).has_value());
  }
  {
    c10::InferenceMode inference;
    EXPECT_TRUE(FastLinear(x, w, at::Tensor()).has_value());
  }
}

TEST(CpuLinearLayerTest, LinearForwardUsesItOnTheCpu) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    nn::Linear linear(64, 48, /*bias=*/true, dtype);
    at::manual_seed(6);
    linear.weight.detach().copy_(Random({48, 64}, dtype));
    linear.bias.detach().copy_(Random({48}, dtype));
    c10::InferenceMode inference;
    at::Tensor decode = Random({1, 3, 64}, dtype);
    std::optional<at::Tensor> fast = FastLinear(decode, linear.weight, linear.bias);
    ASSERT_TRUE(fast.has_value());
    EXPECT_TRUE(at::equal(linear.forward(decode), *fast));
    // A prefill of 40 rows: three chunks, except in bfloat16 where libtorch
    // has oneDNN's product, which takes it and still agrees.
    at::Tensor prefill = Random({40, 64}, dtype);
    std::optional<at::Tensor> chunked = FastLinear(prefill, linear.weight, linear.bias);
    ASSERT_EQ(chunked.has_value(), TakesPrefillIn(dtype));
    if (chunked) {
      EXPECT_TRUE(at::equal(linear.forward(prefill), *chunked));
    }
    ExpectMatchesFloat64(linear.forward(prefill), prefill, linear.weight, linear.bias);
  }
}

// GPT-2's Conv1D weight is [in, out]: FastConv1D(x, w, b) = x @ w + b.
TEST(CpuConv1DTest, MatchesTheProductInFloat64AndKeepsShape) {
  at::manual_seed(8);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor w = Random({300, 77}, dtype), b = Random({77}, dtype);
    c10::InferenceMode inference;
    for (const at::Tensor& x :
         {Random({1, 300}, dtype), Random({2, 3, 300}, dtype), Random({16, 300}, dtype)}) {
      std::optional<at::Tensor> y = FastConv1D(x, w, b);
      ASSERT_TRUE(y.has_value());
      std::vector<int64_t> shape = x.sizes().vec();
      shape.back() = 77;
      ASSERT_EQ(y->sizes(), at::IntArrayRef(shape));
      const at::Tensor rows = x.reshape({-1, 300});
      ExpectMatchesFloat64(y->reshape({-1, 77}), rows, w.t(), b);
      std::optional<at::Tensor> no_bias = FastConv1D(rows, w, at::Tensor());
      ASSERT_TRUE(no_bias.has_value());
      ExpectMatchesFloat64(*no_bias, rows, w.t(), at::Tensor());
    }
  }
}

TEST(CpuConv1DTest, LeavesEverythingElseToLibtorch) {
  const at::Tensor w = at::randn({32, 24}), b = at::randn({24});
  c10::InferenceMode inference;
  EXPECT_TRUE(FastConv1D(at::randn({16, 32}), w, b).has_value());
  EXPECT_FALSE(FastConv1D(at::randn({17, 32}), w, b).has_value());  // a prefill's rows
  EXPECT_FALSE(FastConv1D(at::randn({2, 24}), w, b).has_value());   // x's columns
  EXPECT_FALSE(FastConv1D(at::randn({2, 32}), w, at::randn({32})).has_value());
  EXPECT_FALSE(FastConv1D(at::randn({2, 32}).to(at::kBFloat16), w, b).has_value());
  EXPECT_FALSE(FastConv1D(at::randn({2, 32}), at::randn({24, 32}).t(), b).has_value());
  EXPECT_FALSE(FastConv1D(at::randn({2, 32}), w.to(at::kDouble), b).has_value());
}

TEST(CpuConv1DTest, LeavesAutogradToLibtorch) {
  at::Tensor w = at::randn({16, 8}).requires_grad_();
  ASSERT_TRUE(c10::GradMode::is_enabled());
  EXPECT_FALSE(FastConv1D(at::randn({2, 16}), w, at::Tensor()).has_value());
  at::NoGradGuard no_grad;
  EXPECT_TRUE(FastConv1D(at::randn({2, 16}), w, at::Tensor()).has_value());
}

// nn::Conv1D takes it for decode where libtorch would multiply a float32
// copy of the weight (float16; bfloat16 without oneDNN's product), and
// agrees with the float32 product within the bound everywhere.
TEST(CpuConv1DTest, Conv1DForwardUsesItWhereLibtorchWouldCopyTheWeight) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    nn::Conv1D conv(64, 48, dtype);
    at::manual_seed(9);
    conv.weight.detach().copy_(Random({64, 48}, dtype));
    conv.bias.detach().copy_(Random({48}, dtype));
    c10::InferenceMode inference;
    const at::Tensor x = Random({1, 2, 64}, dtype);
    const at::Tensor y = conv.forward(x);
    const bool copies = (dtype == at::kHalf && !compat::kCpuHalfKernels) ||
                        (dtype == at::kBFloat16 && !CpuFeaturesOfThisMachine().onednn_bf16_matmul);
    if (copies) {
      std::optional<at::Tensor> fast = FastConv1D(x, conv.weight, conv.bias);
      ASSERT_TRUE(fast.has_value());
      EXPECT_TRUE(at::equal(y, *fast));
    }
    ExpectMatchesFloat64(y.reshape({-1, 48}), x.reshape({-1, 64}), conv.weight.t(), conv.bias);
  }
}

}  // namespace
}  // namespace accel::models::internal
