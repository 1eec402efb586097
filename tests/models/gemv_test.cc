// The GEMV kernels at every level this CPU runs (scalar, AVX2, AVX-512)
// against a straightforward double-precision loop, within the float32
// accumulation error bound.
#include "models/internal/gemv.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tests/models/gemv_params.h"

namespace accel::models::internal {
namespace {

// Reference decoders, written from the formats' definitions.
double DecodeHalf(uint16_t bits) {
  const int sign = bits >> 15, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -24);
  } else if (exponent == 0x1f) {
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN()
                         : std::numeric_limits<double>::infinity();
  } else {
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return sign ? -magnitude : magnitude;
}

double DecodeBFloat16(uint16_t bits) {
  const int sign = bits >> 15, exponent = (bits >> 7) & 0xff, mantissa = bits & 0x7f;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -133);
  } else if (exponent == 0xff) {
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN()
                         : std::numeric_limits<double>::infinity();
  } else {
    magnitude = std::ldexp(128 + mantissa, exponent - 134);
  }
  return sign ? -magnitude : magnitude;
}

TEST(GemvConvertTest, HalfToFloatIsExactForEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const double want = DecodeHalf(static_cast<uint16_t>(b));
    const float got = HalfToFloat(static_cast<uint16_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << b;
    }
  }
}

TEST(GemvConvertTest, BFloat16ToFloatIsExactForEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const double want = DecodeBFloat16(static_cast<uint16_t>(b));
    const float got = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << b;
    }
  }
}

TEST(GemvIsaTest, ScalarIsAlwaysSupportedAndTheBestIsSupported) {
  EXPECT_TRUE(GemvIsaSupported(GemvIsa::kScalar));
  EXPECT_TRUE(GemvIsaSupported(BestGemvIsa()));
  EXPECT_EQ(GemvIsaName(GemvIsa::kScalar), "scalar");
  EXPECT_EQ(GemvIsaName(GemvIsa::kAvx2), "avx2");
  EXPECT_EQ(GemvIsaName(GemvIsa::kAvx512), "avx512");
#if !defined(__x86_64__)
  EXPECT_EQ(BestGemvIsa(), GemvIsa::kScalar);
#endif
}

// A weight matrix [n, k] with row stride `stride`; the padding between k and
// the stride holds NaN, so a kernel that reads past k fails the test.
struct Weights {
  GemvWeight type;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  std::vector<double> value;  // the exact values, [n, stride]
  const void* data() const {
    return type == GemvWeight::kFloat32 ? static_cast<const void*>(f32.data())
                                        : static_cast<const void*>(u16.data());
  }
};

Weights MakeWeights(GemvWeight type, int64_t n, int64_t k, int64_t stride, std::mt19937& rng) {
  Weights w;
  w.type = type;
  const size_t size = static_cast<size_t>(n * stride);
  w.value.assign(size, 0.0);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_int_distribution<int> bit(0, 1);
  if (type == GemvWeight::kFloat32) {
    w.f32.assign(size, std::numeric_limits<float>::quiet_NaN());
  } else {
    w.u16.assign(size, type == GemvWeight::kFloat16 ? 0x7e00 : 0x7fc0);  // NaN
  }
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      const size_t at = static_cast<size_t>(r * stride + j);
      if (type == GemvWeight::kFloat32) {
        w.f32[at] = uniform(rng);
        w.value[at] = w.f32[at];
      } else if (type == GemvWeight::kFloat16) {
        // Magnitudes below 2, subnormals included (exponent field 0).
        const int exponent = std::uniform_int_distribution<int>(0, 15)(rng);
        const int mantissa = std::uniform_int_distribution<int>(0, 1023)(rng);
        w.u16[at] = static_cast<uint16_t>((bit(rng) << 15) | (exponent << 10) | mantissa);
        w.value[at] = DecodeHalf(w.u16[at]);
      } else {
        const int exponent = std::uniform_int_distribution<int>(112, 127)(rng);
        const int mantissa = std::uniform_int_distribution<int>(0, 127)(rng);
        w.u16[at] = static_cast<uint16_t>((bit(rng) << 15) | (exponent << 7) | mantissa);
        w.value[at] = DecodeBFloat16(w.u16[at]);
      }
    }
  }
  return w;
}

// gamma(j) = j u / (1 - j u), u = 2^-24: a float32 sum of j rounded terms is
// within gamma(j) * sum |term| of the exact sum, in any order.
double Gamma(int64_t j) {
  const double u = std::ldexp(1.0, -24);
  return static_cast<double>(j) * u / (1 - static_cast<double>(j) * u);
}

bool IsSentinel(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits == 0x7fc0dead;
}

float Sentinel() {
  const uint32_t bits = 0x7fc0dead;  // a NaN with a payload nothing computes
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

struct Shape {
  int64_t m, k, n;
  bool bias, strided;
};

std::string Describe(const Shape& s) {
  return "m=" + std::to_string(s.m) + " k=" + std::to_string(s.k) + " n=" + std::to_string(s.n) +
         (s.bias ? " bias" : "") + (s.strided ? " strided" : "");
}

// Runs the kernel on `ranges` (column ranges, in order) and checks every
// computed element against the reference and every other one untouched.
void CheckOne(GemvIsa isa, GemvWeight type, const Shape& s,
              const std::vector<std::pair<int64_t, int64_t>>& ranges, std::mt19937& rng) {
  SCOPED_TRACE(Describe(s));
  const int64_t pad = s.strided ? 5 : 0;
  const int64_t xs = s.k + pad, ws = s.k + pad, ys = s.n + pad;
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(s.m * xs), std::numeric_limits<float>::quiet_NaN());
  for (int64_t i = 0; i < s.m; ++i) {
    for (int64_t j = 0; j < s.k; ++j) x[static_cast<size_t>(i * xs + j)] = uniform(rng);
  }
  const Weights w = MakeWeights(type, s.n, s.k, ws, rng);
  std::vector<float> bias;
  if (s.bias) {
    for (int64_t c = 0; c < s.n; ++c) bias.push_back(uniform(rng));
  }
  std::vector<float> y(static_cast<size_t>(s.m * ys), Sentinel());

  GemvArgs args;
  args.m = s.m;
  args.k = s.k;
  args.x = x.data();
  args.x_stride = xs;
  args.w = w.data();
  args.w_type = type;
  args.w_stride = ws;
  args.bias = s.bias ? bias.data() : nullptr;
  args.y = y.data();
  args.y_stride = ys;
  std::vector<bool> computed(static_cast<size_t>(s.n), false);
  for (const auto& [begin, end] : ranges) {
    GemvWithIsa(isa, args, begin, end);
    for (int64_t c = begin; c < end; ++c) computed[static_cast<size_t>(c)] = true;
  }

  int failures = 0;
  for (int64_t i = 0; i < s.m; ++i) {
    for (int64_t c = 0; c < ys; ++c) {
      const float got = y[static_cast<size_t>(i * ys + c)];
      if (c >= s.n || !computed[static_cast<size_t>(c)]) {
        EXPECT_TRUE(IsSentinel(got)) << "wrote y[" << i << ", " << c << "]";
        continue;
      }
      double exact = 0, magnitude = 0;
      for (int64_t j = 0; j < s.k; ++j) {
        const double term = static_cast<double>(x[static_cast<size_t>(i * xs + j)]) *
                            w.value[static_cast<size_t>(c * ws + j)];
        exact += term;
        magnitude += std::fabs(term);
      }
      if (s.bias) {
        exact += bias[static_cast<size_t>(c)];
        magnitude += std::fabs(bias[static_cast<size_t>(c)]);
      }
      const double bound = Gamma(s.k + 1) * magnitude;
      if (!(std::fabs(got - exact) <= bound) && ++failures <= 5) {
        ADD_FAILURE() << "y[" << i << ", " << c << "] = " << got << ", want " << exact << " within "
                      << bound;
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

class GemvTest : public ::testing::TestWithParam<GemvParam> {
 protected:
  void SetUp() override {
    if (!GemvIsaSupported(isa())) {
      GTEST_SKIP() << "this CPU cannot run " << GemvIsaName(isa());
    }
  }
  GemvIsa isa() const { return std::get<0>(GetParam()); }
  GemvWeight type() const { return std::get<1>(GetParam()); }
};

TEST_P(GemvTest, MatchesTheDoubleReferenceOverShapes) {
  std::mt19937 rng(1234);
  // n = 37 leaves a column tail for every register blocking; m = 5, 11, 17
  // give uneven row blocks (17: three of them).
  for (int64_t m : {1, 2, 3, 5, 8, 11, 16, 17}) {
    for (int64_t k : {1, 7, 16, 17, 64, 1000, 4096 + 3}) {
      for (int64_t n : {1, 7, 37}) {
        for (bool bias : {false, true}) {
          for (bool strided : {false, true}) {
            if (k > 1000 && m > 3 && m != 8 && m != 16) continue;  // keep the test quick
            CheckOne(isa(), type(), {m, k, n, bias, strided}, {{0, n}}, rng);
          }
        }
      }
    }
  }
}

TEST_P(GemvTest, ColumnRangesSplitTheWorkAndTouchNothingElse) {
  std::mt19937 rng(99);
  for (int64_t m : {1, 3, 8, 16}) {
    for (int64_t k : {17, 1000}) {
      // As threads would split 100 columns, at odd boundaries.
      CheckOne(isa(), type(), {m, k, 100, true, true}, {{0, 13}, {13, 14}, {14, 61}, {61, 100}},
               rng);
      // A part only: the rest of y stays as it was.
      CheckOne(isa(), type(), {m, k, 100, false, true}, {{29, 71}}, rng);
    }
  }
}

TEST_P(GemvTest, EmptyRangesAndZeroKWriteOnlyWhatTheyOwn) {
  std::mt19937 rng(7);
  CheckOne(isa(), type(), {4, 64, 9, true, false}, {{3, 3}}, rng);  // no columns
  CheckOne(isa(), type(), {0, 64, 9, true, false}, {{0, 9}}, rng);  // no rows
  CheckOne(isa(), type(), {3, 0, 9, true, true}, {{0, 9}}, rng);    // y = bias
  CheckOne(isa(), type(), {3, 0, 9, false, false}, {{0, 9}}, rng);  // y = 0
}

TEST_P(GemvTest, LargeValuesKeepFloat32Range) {
  // Products beyond bfloat16's and float16's precision but inside float32's
  // range: an accumulator narrower than float32 would overflow or lose them.
  std::vector<float> x(64, 3.0e4f);
  const uint16_t w_bits = type() == GemvWeight::kFloat16 ? 0x7800 /* 32768 */
                                                         : 0x4700 /* 32768 */;
  std::vector<uint16_t> w16(64 * 2, w_bits);
  std::vector<float> w32(64 * 2, 32768.0f);
  std::vector<float> y(2, 0.0f);
  GemvArgs args;
  args.m = 1;
  args.k = 64;
  args.x = x.data();
  args.x_stride = 64;
  args.w = type() == GemvWeight::kFloat32 ? static_cast<const void*>(w32.data())
                                          : static_cast<const void*>(w16.data());
  args.w_type = type();
  args.w_stride = 64;
  args.y = y.data();
  args.y_stride = 2;
  GemvWithIsa(isa(), args, 0, 2);
  EXPECT_FLOAT_EQ(y[0], 64 * 3.0e4f * 32768.0f);
  EXPECT_FLOAT_EQ(y[1], 64 * 3.0e4f * 32768.0f);
}

INSTANTIATE_TEST_SUITE_P(AllLevels, GemvTest, AllGemvLevelsAndWeights(), GemvParamName);

}  // namespace
}  // namespace accel::models::internal
