// GemvTransposed (models/internal/gemv_transposed.cc): y = x @ w (+ bias) for
// a weight stored [k, n], checked bit for bit against the plain loop its
// contract names (each column's products added in order of j by std::fma,
// then the bias), and within float32's summation bound of a double sum.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "models/internal/gemv.h"
#include "tests/models/gemv_params.h"

namespace accel::models::internal {
namespace {

// A weight [k, n] with rows `stride` >= n apart, NaN in the padding (a kernel
// that reads past n, or past k, makes a NaN), and its values as float32.
struct Weight {
  GemvWeight type = GemvWeight::kFloat32;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  std::vector<float> value;
  const void* data() const {
    return type == GemvWeight::kFloat32 ? static_cast<const void*>(f32.data())
                                        : static_cast<const void*>(u16.data());
  }
};

Weight MakeWeight(GemvWeight type, int64_t k, int64_t n, int64_t stride, std::mt19937& rng) {
  Weight w;
  w.type = type;
  const size_t size = static_cast<size_t>((k + 1) * stride);  // a NaN row past k too
  w.value.assign(size, std::numeric_limits<float>::quiet_NaN());
  if (type == GemvWeight::kFloat32) {
    w.f32.assign(size, std::numeric_limits<float>::quiet_NaN());
  } else {
    w.u16.assign(size, type == GemvWeight::kFloat16 ? 0x7e00 : 0x7fc0);
  }
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_int_distribution<int> bits(0, 0xffff);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t c = 0; c < n; ++c) {
      const size_t at = static_cast<size_t>(j * stride + c);
      if (type == GemvWeight::kFloat32) {
        w.f32[at] = w.value[at] = uniform(rng);
      } else if (type == GemvWeight::kFloat16) {
        // Magnitudes below 2, subnormals included.
        const auto b = static_cast<uint16_t>(bits(rng) & 0xbfff);
        w.u16[at] = b;
        w.value[at] = HalfToFloat(b);
      } else {
        const int exponent = std::uniform_int_distribution<int>(112, 127)(rng);
        w.u16[at] =
            static_cast<uint16_t>((bits(rng) & 0x8000) | (exponent << 7) | (bits(rng) & 0x7f));
        w.value[at] = BFloat16ToFloat(w.u16[at]);
      }
    }
  }
  return w;
}

struct Case {
  int64_t m, k, n;
  bool bias;
};

std::string Describe(const Case& c) {
  return "m=" + std::to_string(c.m) + " k=" + std::to_string(c.k) + " n=" + std::to_string(c.n) +
         (c.bias ? " bias" : "");
}

float Sentinel() {
  const uint32_t bits = 0x7fc0dead;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

bool IsSentinel(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits == 0x7fc0dead;
}

// Runs the ranges, then checks every y element: in a range, the plain loop's
// bits and the double sum's bound; outside, untouched.
void CheckOne(GemvIsa isa, GemvWeight type, const Case& c,
              const std::vector<std::pair<int64_t, int64_t>>& ranges, std::mt19937& rng) {
  SCOPED_TRACE(Describe(c));
  const int64_t x_stride = c.k + 3, w_stride = c.n + 5, y_stride = c.n + 2;
  std::vector<float> x(static_cast<size_t>(std::max<int64_t>(1, c.m) * x_stride),
                       std::numeric_limits<float>::quiet_NaN());
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.k; ++j) x[i * x_stride + j] = uniform(rng);
  }
  const Weight w = MakeWeight(type, c.k, c.n, w_stride, rng);
  std::vector<float> bias(static_cast<size_t>(c.n));
  for (float& b : bias) b = uniform(rng);
  std::vector<float> y(static_cast<size_t>(std::max<int64_t>(1, c.m) * y_stride), Sentinel());
  GemvArgs args;
  args.m = c.m;
  args.k = c.k;
  args.x = x.data();
  args.x_stride = x_stride;
  args.w = w.data();
  args.w_type = type;
  args.w_stride = w_stride;
  args.bias = c.bias ? bias.data() : nullptr;
  args.y = y.data();
  args.y_stride = y_stride;
  for (const auto& [begin, end] : ranges) GemvTransposedWithIsa(isa, args, begin, end);

  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t col = 0; col < y_stride; ++col) {
      const float got = y[i * y_stride + col];
      bool owned = false;
      for (const auto& [begin, end] : ranges) owned = owned || (col >= begin && col < end);
      if (!owned || col >= c.n) {
        EXPECT_TRUE(IsSentinel(got)) << "row " << i << " column " << col << " was written";
        continue;
      }
      float sum = 0.0f;
      double exact = 0.0, magnitude = 0.0;
      for (int64_t j = 0; j < c.k; ++j) {
        const float xv = x[i * x_stride + j], wv = w.value[j * w_stride + col];
        sum = std::fma(xv, wv, sum);
        exact += static_cast<double>(xv) * wv;
        magnitude += std::fabs(static_cast<double>(xv) * wv);
      }
      if (c.bias) {
        sum += bias[col];
        exact += bias[col];
        magnitude += std::fabs(bias[col]);
      }
      uint32_t got_bits, want_bits;
      std::memcpy(&got_bits, &got, sizeof(got));
      std::memcpy(&want_bits, &sum, sizeof(sum));
      ASSERT_EQ(got_bits, want_bits)
          << "row " << i << " column " << col << ": " << got << " against " << sum;
      const double u = std::ldexp(1.0, -24), steps = static_cast<double>(c.k + 1);
      EXPECT_LE(std::fabs(got - exact), steps * u / (1 - steps * u) * magnitude + 1e-30);
    }
  }
}

class GemvTransposedTest : public ::testing::TestWithParam<GemvParam> {
 protected:
  void SetUp() override {
    if (!GemvIsaSupported(isa())) GTEST_SKIP() << "this CPU cannot run " << GemvIsaName(isa());
  }
  GemvIsa isa() const { return std::get<0>(GetParam()); }
  GemvWeight type() const { return std::get<1>(GetParam()); }
};

// k of 1-257 covers every step of weight rows (8, 4 and 2 a step for 1, 2
// and 3-4 rows of x) with and without a remainder; n of 7, 37 and 1030 a
// column tail past the last eight, and 1030 a second tile of columns; m of 5
// and 9 a second and third pass of rows.
TEST_P(GemvTransposedTest, EqualsTheOrderedFmaLoopBitForBit) {
  std::mt19937 rng(31);
  for (int64_t m : {1, 2, 3, 4, 5, 9}) {
    for (int64_t k : {1, 3, 8, 9, 17, 64, 257}) {
      for (int64_t n : {1, 7, 8, 37}) {
        for (bool bias : {false, true}) CheckOne(isa(), type(), {m, k, n, bias}, {{0, n}}, rng);
      }
    }
    CheckOne(isa(), type(), {m, 33, 1030, true}, {{0, 1030}}, rng);
  }
}

TEST_P(GemvTransposedTest, ColumnRangesSplitTheWorkAndTouchNothingElse) {
  std::mt19937 rng(32);
  for (int64_t m : {1, 4, 6}) {
    // As threads split 100 columns at odd boundaries, and a part alone.
    CheckOne(isa(), type(), {m, 40, 100, true}, {{0, 13}, {13, 14}, {14, 61}, {61, 100}}, rng);
    CheckOne(isa(), type(), {m, 40, 100, false}, {{29, 71}}, rng);
  }
}

TEST_P(GemvTransposedTest, NothingToDoWritesNothing) {
  std::mt19937 rng(33);
  CheckOne(isa(), type(), {3, 16, 9, true}, {{4, 4}}, rng);  // no columns
  CheckOne(isa(), type(), {0, 16, 9, true}, {{0, 9}}, rng);  // no rows
  CheckOne(isa(), type(), {2, 0, 9, true}, {{0, 9}}, rng);   // y = bias
}

INSTANTIATE_TEST_SUITE_P(AllLevels, GemvTransposedTest, AllGemvLevelsAndWeights(), GemvParamName);

}  // namespace
}  // namespace accel::models::internal
