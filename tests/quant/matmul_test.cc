// quant/matmul.h against straightforward references written here (double or
// int64 sums), at every kernel level this CPU runs (scalar and AVX2):
// 4-bit dequantization bit for bit; the fused 4-bit GEMV (up to 16 rows) and
// the dequantize-and-multiply path (more rows) within the float32 summation
// bound; the int8 product exactly (where float32 would not be); LLM.int8's
// outlier decomposition; and every validation error.
#include "quant/matmul.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "quant/bnb.h"
#include "quant/internal/arguments.h"
#include "quant/internal/kernels_cpu.h"
#include "quant/internal/nibble_avx2.h"
#include "tests/testing/status_matchers.h"

namespace accel::quant {
namespace {

using internal::CpuIsa;
using test::IsOk;
using test::StatusIs;
using ::testing::HasSubstr;

// NF4 and FP4 (bit-pattern order) from ../shared/reference/bitsandbytes.md §1.1.
const std::array<float, 16>& kNf4 = CodeTable(QuantType4bit::kNf4);  // checked by hex in bnb_test
constexpr std::array<float, 16> kFp4 = {0.0f / 12,  0.0625f / 12,  8.0f / 12,  12.0f / 12,
                                        4.0f / 12,  6.0f / 12,     2.0f / 12,  3.0f / 12,
                                        -0.0f / 12, -0.0625f / 12, -8.0f / 12, -12.0f / 12,
                                        -4.0f / 12, -6.0f / 12,    -2.0f / 12, -3.0f / 12};

std::vector<CpuIsa> Isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    if (internal::CpuIsaSupported(isa)) isas.push_back(isa);
  }
  return isas;
}

// Runs the public functions at one kernel level while it lives.
class IsaScope {
 public:
  explicit IsaScope(CpuIsa isa) { internal::SetIsaOverrideForTesting(isa); }
  ~IsaScope() { internal::SetIsaOverrideForTesting(std::nullopt); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
};

// Gemv4bit's arguments for x [m, in] and y [m, out] (contiguous rows) and a
// weight of out x in (blocksize 64; bfloat16 rounding: set others after).
internal::Gemv4bitArgs GemvArgs(int64_t m, int64_t in, int64_t out, const float* x,
                                const uint8_t* packed, const float* absmax, const float* code,
                                float* y) {
  internal::Gemv4bitArgs args;
  args.m = m;
  args.in = in;
  args.out = out;
  args.x = x;
  args.x_stride = in;
  args.w.packed = packed;
  args.w.absmax = absmax;
  args.w.code = code;
  args.w.numel = out * in;
  args.round = internal::DenseType::kBFloat16;
  args.y = y;
  args.y_stride = out;
  return args;
}

// A plain blockwise 4-bit quantizer over the flat row-major weight: absmax
// per block, nearest code of x / absmax, high nibble first.
Weight4bit Quantize(const at::Tensor& w, int64_t blocksize, const std::array<float, 16>& table) {
  const at::Tensor flat = w.to(at::kFloat).contiguous().flatten();
  const float* v = flat.data_ptr<float>();
  const int64_t n = flat.numel();
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  Weight4bit q;
  q.blocksize = blocksize;
  q.out_features = w.size(0);
  q.in_features = w.size(1);
  q.absmax = at::zeros({blocks}, at::kFloat);
  q.packed = at::zeros({(n + 1) / 2, 1}, at::kByte);
  q.code = at::from_blob(const_cast<float*>(table.data()), {16}, at::kFloat).clone();
  float* absmax = q.absmax.data_ptr<float>();
  uint8_t* packed = q.packed.data_ptr<uint8_t>();
  for (int64_t j = 0; j < n; ++j) {
    absmax[j / blocksize] = std::max(absmax[j / blocksize], std::fabs(v[j]));
  }
  for (int64_t j = 0; j < n; ++j) {
    const float a = absmax[j / blocksize];
    const float s = a > 0 ? v[j] / a : 0.0f;
    int best = 0;
    for (int c = 1; c < 16; ++c) {
      if (std::fabs(s - table[c]) < std::fabs(s - table[best])) best = c;
    }
    packed[j / 2] |= static_cast<uint8_t>((j % 2 == 0) ? best << 4 : best);
  }
  return q;
}

// The spec's formula, one element at a time: float32(code) * absmax, then
// rounded by torch's own conversion.
at::Tensor ReferenceDequantize(const Weight4bit& q, at::ScalarType dtype) {
  const int64_t n = q.out_features * q.in_features;
  at::Tensor out = at::empty({n}, at::kFloat);
  const uint8_t* packed = q.packed.data_ptr<uint8_t>();
  const float* absmax = q.absmax.data_ptr<float>();
  const float* code = q.code.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) {
    const int c = j % 2 == 0 ? packed[j / 2] >> 4 : packed[j / 2] & 0xF;
    out.data_ptr<float>()[j] = code[c] * absmax[j / q.blocksize];
  }
  return out.to(dtype).view({q.out_features, q.in_features});
}

// Bit-for-bit equality (NaN-free inputs).
void ExpectSameBits(const at::Tensor& a, const at::Tensor& b) {
  ASSERT_EQ(a.scalar_type(), b.scalar_type());
  ASSERT_EQ(a.sizes(), b.sizes());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const int64_t bytes = ac.numel() * static_cast<int64_t>(ac.element_size());
  if (std::memcmp(ac.data_ptr(), bc.data_ptr(), static_cast<size_t>(bytes)) == 0) return;
  const at::Tensor diff = (ac.to(at::kDouble) - bc.to(at::kDouble)).abs();
  ADD_FAILURE() << "differ at " << diff.flatten().argmax().item<int64_t>() << " by "
                << diff.max().item<double>();
}

// Uniform in [-scale, scale], float32.
at::Tensor Random(at::IntArrayRef shape, double scale = 1.0) {
  return ((at::rand(shape, at::kDouble) * 2 - 1) * scale).to(at::kFloat);
}

// Unit roundoff of a dtype's rounding: 2^-p.
double Unit(at::ScalarType t) {
  return t == at::kBFloat16 ? std::ldexp(1.0, -8) : t == at::kHalf ? std::ldexp(1.0, -11) : 0.0;
}

// y against exact (double) with float32 sums over `terms` terms of magnitude
// `magnitude`, then the roundings to each of `roundings` (in order).
void ExpectWithin(const at::Tensor& y, const at::Tensor& exact, const at::Tensor& magnitude,
                  int64_t terms, const std::vector<at::ScalarType>& roundings) {
  const double u = std::ldexp(1.0, -24);
  const double gamma =
      static_cast<double>(terms + 1) * u / (1 - static_cast<double>(terms + 1) * u);
  at::Tensor bound = gamma * magnitude;
  for (at::ScalarType t : roundings) {
    if (t == at::kFloat) continue;
    bound = bound + Unit(t) * (exact.abs() + bound) + std::ldexp(1.0, -126);
  }
  ASSERT_EQ(y.sizes(), exact.sizes());
  const at::Tensor error = (y.to(at::kDouble) - exact).abs();
  EXPECT_LE((error - bound).max().item<double>(), 0.0)
      << "worst error " << error.max().item<double>() << " bound there "
      << bound.flatten()[(error - bound).argmax()].item<double>();
}

// ---- 4-bit dequantization ---------------------------------------------------

struct Shape4bit {
  int64_t out, in, blocksize;
};

TEST(Dequantize4bitTest, BitExactAtEveryLevel) {
  at::manual_seed(1);
  // Rows a multiple of the block; blocks crossing rows (96 % 64); an odd
  // number of elements; blocks larger than the weight; blocksizes that are not
  // a multiple of 8 (not bnb's, but the kernel takes any).
  const std::vector<Shape4bit> shapes = {{64, 128, 64}, {5, 96, 64}, {7, 33, 32},    {3, 5, 4096},
                                         {9, 31, 6},    {4, 17, 1},  {300, 2600, 64}};
  for (const Shape4bit& s : shapes) {
    for (const auto* table : {&kNf4, &kFp4}) {
      const Weight4bit q = Quantize(Random({s.out, s.in}, 3.0), s.blocksize, *table);
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        const at::Tensor expected = ReferenceDequantize(q, dtype);
        for (CpuIsa isa : Isas()) {
          SCOPED_TRACE(testing::Message() << s.out << "x" << s.in << " blocksize " << s.blocksize
                                          << " " << dtype << " " << internal::CpuIsaName(isa));
          IsaScope scope(isa);
          ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor got, Dequantize4bitDense(q, dtype));
          ExpectSameBits(got, expected);
        }
      }
    }
  }
}

// A range of the flat weight (what Linear4bitForward dequantizes a slab of
// rows at a time above 16 rows) is the same bits as that part of the whole:
// ranges starting on any multiple of 16, ending anywhere, with an odd row
// length (rows starting mid-byte) and blocks crossing rows.
TEST(Dequantize4bitTest, RangesAreTheirPartOfTheWhole) {
  at::manual_seed(9);
  const Weight4bit q = Quantize(Random({7, 1001}, 3.0), 64, kNf4);
  internal::Packed4bit p;
  p.packed = q.packed.data_ptr<uint8_t>();
  p.absmax = q.absmax.data_ptr<float>();
  p.code = q.code.data_ptr<float>();
  p.blocksize = q.blocksize;
  p.numel = int64_t{7} * 1001;
  for (CpuIsa isa : Isas()) {
    SCOPED_TRACE(internal::CpuIsaName(isa));
    std::vector<uint16_t> whole(static_cast<size_t>(p.numel));
    internal::Dequantize4bit(isa, p, internal::DenseType::kBFloat16, whole.data());
    for (const auto& [first, last] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 7007}, {16, 17}, {1008, 3003}, {4000, 7007}, {6992, 9000}}) {
      std::vector<uint16_t> part(static_cast<size_t>(std::min<int64_t>(last, p.numel) - first));
      internal::Dequantize4bitRange(isa, p, internal::DenseType::kBFloat16, first, last,
                                    part.data());
      EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + first))
          << "[" << first << ", " << last << ")";
    }
  }
}

// Scales chosen so that code * absmax lands on rounding ties, float16
// subnormals and float16 overflow, with every code in every position.
TEST(Dequantize4bitTest, RoundingTiesSubnormalsAndOverflow) {
  auto bits = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof(f));
    return f;
  };
  const std::vector<float> scales = {
      bits(0x3F808000u),                 // bfloat16 tie, even: down
      bits(0x3F818000u),                 // bfloat16 tie, odd: up
      1.0f + std::ldexp(1.0f, -11),      // float16 tie, even: down
      1.0f + 3 * std::ldexp(1.0f, -11),  // float16 tie, odd: up
      1e-6f,                             // float16 subnormals
      7e4f,                              // beyond float16's 65504: inf for +-1
      0.0f,                              // an all-zero block
      3.4e38f,                           // bfloat16 overflow
  };
  Weight4bit q;
  q.blocksize = 32;
  q.out_features = static_cast<int64_t>(scales.size());
  q.in_features = 32;
  q.absmax = at::from_blob(const_cast<float*>(scales.data()), {q.out_features}, at::kFloat).clone();
  q.packed = at::empty({q.out_features * 16}, at::kByte);
  for (int64_t i = 0; i < q.packed.numel(); ++i) {
    q.packed.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(i * 37 + 11);
  }
  q.code = at::from_blob(const_cast<float*>(kNf4.data()), {16}, at::kFloat).clone();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (CpuIsa isa : Isas()) {
      SCOPED_TRACE(testing::Message() << dtype << " " << internal::CpuIsaName(isa));
      IsaScope scope(isa);
      ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor got, Dequantize4bitDense(q, dtype));
      ExpectSameBits(got, ReferenceDequantize(q, dtype));
    }
  }
}

// ---- Linear4bitForward --------------------------------------------------------

// bnb's Linear4bit on the reference weights, in double: x and bias rounded to
// the compute dtype, the weight dequantized to it.
void ExpectLinear4bit(const at::Tensor& y, const at::Tensor& x, const Weight4bit& q,
                      const at::Tensor& bias, at::ScalarType compute) {
  const at::Tensor w = ReferenceDequantize(q, compute).to(at::kDouble);
  const at::Tensor xd = x.to(compute).to(at::kDouble);
  const at::Tensor bd = bias.defined() ? bias.to(compute).to(at::kDouble) : at::Tensor();
  const at::Tensor exact = at::linear(xd, w, bd);
  const at::Tensor magnitude = at::linear(xd.abs(), w.abs(), bd.defined() ? bd.abs() : bd);
  ASSERT_EQ(y.scalar_type(), x.scalar_type());
  ExpectWithin(y, exact, magnitude, q.in_features, {compute, x.scalar_type()});
}

struct DTypes {
  at::ScalarType x, compute;
};

TEST(Linear4bitForwardTest, MatchesReferenceForFewAndManyRows) {
  at::manual_seed(2);
  const std::vector<Shape4bit> shapes = {{48, 128, 64}, {37, 96, 64}, {7, 33, 32}, {300, 2600, 64}};
  const std::vector<DTypes> dtypes = {{at::kFloat, at::kFloat},
                                      {at::kFloat, at::kBFloat16},
                                      {at::kBFloat16, at::kBFloat16},
                                      {at::kBFloat16, at::kFloat},
                                      {at::kHalf, at::kHalf}};
  for (const Shape4bit& s : shapes) {
    const Weight4bit q = Quantize(Random({s.out, s.in}, 0.1), s.blocksize, kNf4);
    for (int64_t rows : {1, 2, 5, 16, 17, 40}) {
      if (s.out == 300 && rows > 5 && rows != 17) continue;  // the large shape: a few cases
      for (bool with_bias : {false, true}) {
        for (const DTypes& d : dtypes) {
          const at::Tensor x = Random({rows, s.in}).to(d.x);
          const at::Tensor bias = with_bias ? Random({s.out}).to(d.x) : at::Tensor();
          for (CpuIsa isa : Isas()) {
            SCOPED_TRACE(testing::Message()
                         << rows << " rows, " << s.out << "x" << s.in << " blocksize "
                         << s.blocksize << (with_bias ? " with bias" : "") << ", x " << d.x
                         << ", compute " << d.compute << ", " << internal::CpuIsaName(isa));
            IsaScope scope(isa);
            ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y, Linear4bitForward(x, q, bias, d.compute));
            ExpectLinear4bit(y, x, q, bias, d.compute);
          }
        }
      }
    }
  }
}

TEST(Linear4bitForwardTest, ThreeDimensionalInputAndFp4) {
  at::manual_seed(3);
  const Weight4bit q = Quantize(Random({20, 96}), 64, kFp4);
  const at::Tensor bias = Random({20});
  for (std::vector<int64_t> shape : {std::vector<int64_t>{2, 3, 96}, {3, 7, 96}, {0, 4, 96}}) {
    const at::Tensor x = Random(shape).to(at::kBFloat16);
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y, Linear4bitForward(x, q, bias, at::kBFloat16));
    EXPECT_EQ(y.sizes(), (std::vector<int64_t>{shape[0], shape[1], 20}));
    if (x.numel() > 0) {
      ExpectLinear4bit(y.reshape({-1, 20}), x.reshape({-1, 96}), q, bias, at::kBFloat16);
    }
  }
}

// The kernel itself at every level on the same inputs: each within the bound
// of the exact result, and within 1e-5 of the scalar level; the rounding of W
// to bfloat16 happens inside the kernel (x is passed already rounded). Rows
// 1-4 take the register path (AVX-512: any number, in passes of up to 8),
// more the buffered one; 2601 columns (odd, so every other weight row starts
// mid-byte, and blocks cross rows) are several chunks of the buffered path
// and several column tiles of the register path from 4 rows on.
TEST(Gemv4bitKernelTest, LevelsAgree) {
  at::manual_seed(4);
  constexpr int64_t kIn = 2601;
  const Weight4bit q = Quantize(Random({65, kIn}), 64, kNf4);
  const at::Tensor w = ReferenceDequantize(q, at::kBFloat16).to(at::kDouble);
  for (int64_t m : {1, 3, 4, 9}) {
    const at::Tensor x = Random({m, kIn}).to(at::kBFloat16).to(at::kFloat).contiguous();
    const at::Tensor bias = Random({65});
    std::vector<at::Tensor> ys;
    for (CpuIsa isa : Isas()) {
      SCOPED_TRACE(testing::Message() << m << " rows, " << internal::CpuIsaName(isa));
      at::Tensor y = at::full({m, 65}, std::nan(""), at::kFloat);
      internal::Gemv4bitArgs args =
          GemvArgs(m, kIn, 65, x.data_ptr<float>(), q.packed.data_ptr<uint8_t>(),
                   q.absmax.data_ptr<float>(), q.code.data_ptr<float>(), y.data_ptr<float>());
      args.w.blocksize = q.blocksize;
      args.bias = bias.data_ptr<float>();
      internal::Gemv4bit(isa, args);
      ExpectWithin(y, at::linear(x.to(at::kDouble), w, bias.to(at::kDouble)),
                   at::linear(x.to(at::kDouble).abs(), w.abs(), bias.to(at::kDouble).abs()), kIn,
                   {});
      if (!ys.empty()) {
        EXPECT_LE((ys[0] - y).abs().max().item<double>(), 1e-5 * ys[0].abs().max().item<double>());
      }
      ys.push_back(y);
    }
  }
}

// The nibble kernels (AVX2, rows and blocks of a multiple of 64 elements,
// bfloat16 / float16 rounding; 1-2 rows in registers, 3-16 rows through the
// decoded buffer): the shapes they take, checked like every other path, with
// blocks longer than a row's span of 16 groups and shorter than a row;
// float32 compute goes elsewhere on the same weights. 16448 = 257 groups of
// 64: two chunks of absmax, the second a single group (whose tables the
// loop, which builds each group's a group ahead, must not read past).
TEST(Linear4bitForwardTest, NibbleKernelShapes) {
  at::manual_seed(5);
  const std::vector<Shape4bit> shapes = {{96, 512, 64}, {40, 1024, 128}, {33, 2048, 2048},
                                         {17, 192, 64}, {5, 4096, 256},  {3, 16448, 64},
                                         {2, 16512, 64}};
  const std::vector<DTypes> dtypes = {{at::kBFloat16, at::kBFloat16},
                                      {at::kFloat, at::kBFloat16},
                                      {at::kHalf, at::kHalf},
                                      {at::kFloat, at::kHalf},
                                      {at::kFloat, at::kFloat}};
  for (const Shape4bit& s : shapes) {
    const Weight4bit q = Quantize(Random({s.out, s.in}, 0.1), s.blocksize, kNf4);
    internal::Gemv4bitArgs args;
    args.in = s.in;
    args.w.code = q.code.data_ptr<float>();
    args.w.blocksize = s.blocksize;
    args.round = internal::DenseType::kBFloat16;
    EXPECT_EQ(internal::NibbleGemvApplies(args), internal::CpuIsaSupported(CpuIsa::kAvx2));
    for (int64_t rows : {1, 2, 3, 4, 5, 8, 16}) {
      for (const DTypes& d : dtypes) {
        const at::Tensor x = Random({rows, s.in}).to(d.x);
        const at::Tensor bias = Random({s.out}).to(d.x);
        for (CpuIsa isa : Isas()) {
          SCOPED_TRACE(testing::Message()
                       << rows << " rows, " << s.out << "x" << s.in << " blocksize " << s.blocksize
                       << ", x " << d.x << ", compute " << d.compute << ", "
                       << internal::CpuIsaName(isa));
          IsaScope scope(isa);
          ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y, Linear4bitForward(x, q, bias, d.compute));
          ExpectLinear4bit(y, x, q, bias, d.compute);
        }
      }
    }
  }
}

TEST(Gemv4bitKernelTest, NibbleKernelsTakeOnlyTheirLayout) {
  float code[16];
  std::copy(kNf4.begin(), kNf4.end(), code);
  internal::Gemv4bitArgs a;
  a.in = 128;
  a.w.code = code;
  a.w.blocksize = 64;
  a.round = internal::DenseType::kBFloat16;
  const bool avx2 = internal::CpuIsaSupported(CpuIsa::kAvx2);
  EXPECT_EQ(internal::NibbleGemvApplies(a), avx2);
  a.round = internal::DenseType::kFloat16;
  EXPECT_EQ(internal::NibbleGemvApplies(a), avx2);
  a.round = internal::DenseType::kFloat32;  // four byte tables: not taken
  EXPECT_FALSE(internal::NibbleGemvApplies(a));
  a.round = internal::DenseType::kBFloat16;
  a.in = 96;  // a group would cross rows
  EXPECT_FALSE(internal::NibbleGemvApplies(a));
  a.in = 128;
  a.w.blocksize = 32;  // a group would cross blocks
  EXPECT_FALSE(internal::NibbleGemvApplies(a));
  a.w.blocksize = 64;
  code[3] = std::nanf("");  // a damaged code table
  EXPECT_FALSE(internal::NibbleGemvApplies(a));
  code[3] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(internal::NibbleGemvApplies(a));
}

// A damaged checkpoint's NaN or inf absmax: the nibble kernel rounds that
// block's values as c10 does (its integer rounding holds for finite values
// only) and gives NaN / inf exactly where the scalar level does, the same
// sums elsewhere.
TEST(Gemv4bitKernelTest, NibbleKernelNonFiniteAbsmax) {
  at::manual_seed(6);
  constexpr int64_t kOut = 6, kIn = 256;
  Weight4bit q = Quantize(Random({kOut, kIn}), 64, kNf4);
  float* absmax = q.absmax.data_ptr<float>();
  absmax[1] = std::nanf("");                           // row 0
  absmax[6] = std::numeric_limits<float>::infinity();  // row 1: code 0 gives NaN, others inf
  for (int64_t m : {1, 2}) {
    const at::Tensor x = Random({m, kIn}).to(at::kBFloat16).to(at::kFloat).contiguous();
    std::vector<at::Tensor> ys;
    for (CpuIsa isa : Isas()) {
      SCOPED_TRACE(testing::Message() << m << " rows, " << internal::CpuIsaName(isa));
      at::Tensor y = at::zeros({m, kOut}, at::kFloat);
      internal::Gemv4bitArgs args =
          GemvArgs(m, kIn, kOut, x.data_ptr<float>(), q.packed.data_ptr<uint8_t>(), absmax,
                   q.code.data_ptr<float>(), y.data_ptr<float>());
      args.w.blocksize = 64;
      internal::Gemv4bit(isa, args);
      if (!ys.empty()) {
        const at::Tensor ref = ys[0];
        EXPECT_TRUE(at::equal(at::isnan(y), at::isnan(ref))) << y << ref;
        EXPECT_TRUE(at::equal(at::isinf(y), at::isinf(ref)));
        const at::Tensor finite = at::isfinite(ref);
        EXPECT_TRUE(finite.any().item<bool>());
        EXPECT_LE((y.masked_select(finite) - ref.masked_select(finite)).abs().max().item<double>(),
                  1e-5 * ref.masked_select(finite).abs().max().item<double>());
      } else {
        EXPECT_TRUE(at::isnan(y.select(1, 0)).all().item<bool>());
        EXPECT_TRUE(at::isfinite(y.select(1, 2)).all().item<bool>());
      }
      ys.push_back(y);
    }
  }
}

// The nibble kernels' tables bit for bit: x one-hot at column k makes
// y[n] = W[n, k] exactly (one product by 1, the rest +0: NaN in a row that
// holds an inf), so each block's
// rounded values, ties, bfloat16 overflow and float16 subnormals included,
// must equal the reference dequantization's.
TEST(Gemv4bitKernelTest, NibbleTablesRoundExactly) {
  auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  };
  const std::vector<float> scales = {1.0f,
                                     bits(0x3F808000u),
                                     bits(0x3F818000u),
                                     1.0f + std::ldexp(1.0f, -11),
                                     1e-6f,
                                     7e4f,
                                     0.0f,
                                     3.4e38f,
                                     0.0123f};
  Weight4bit q;
  q.blocksize = 64;
  q.out_features = static_cast<int64_t>(scales.size());
  q.in_features = 64;
  q.absmax = at::from_blob(const_cast<float*>(scales.data()), {q.out_features}, at::kFloat).clone();
  q.packed = at::empty({q.out_features * 32}, at::kByte);
  for (int64_t i = 0; i < q.packed.numel(); ++i) {
    q.packed.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(i * 37 + 11);
  }
  q.code = at::from_blob(const_cast<float*>(kNf4.data()), {16}, at::kFloat).clone();
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const at::Tensor w = ReferenceDequantize(q, dtype).to(at::kFloat);
    for (CpuIsa isa : Isas()) {
      SCOPED_TRACE(testing::Message() << dtype << " " << internal::CpuIsaName(isa));
      for (int64_t k = 0; k < 64; ++k) {
        at::Tensor x = at::zeros({1, 64}, at::kFloat);
        x[0][k] = 1.0f;
        at::Tensor y = at::zeros({1, q.out_features}, at::kFloat);
        internal::Gemv4bitArgs args =
            GemvArgs(1, 64, q.out_features, x.data_ptr<float>(), q.packed.data_ptr<uint8_t>(),
                     q.absmax.data_ptr<float>(), q.code.data_ptr<float>(), y.data_ptr<float>());
        args.w.blocksize = 64;
        args.round =
            dtype == at::kBFloat16 ? internal::DenseType::kBFloat16 : internal::DenseType::kFloat16;
        internal::Gemv4bit(isa, args);
        // In double: inf x 0 (a huge block's other columns) is NaN there too.
        const at::Tensor want = at::linear(x.to(at::kDouble), w.to(at::kDouble));
        for (int64_t n = 0; n < q.out_features; ++n) {
          const float got = y[0][n].item<float>();
          const double expected = want[0][n].item<double>();
          if (std::isnan(expected)) {
            EXPECT_TRUE(std::isnan(got)) << "row " << n << " column " << k;
          } else {
            EXPECT_EQ(static_cast<double>(got), expected) << "row " << n << " column " << k;
          }
        }
      }
    }
  }
}

// What the AVX-512 BF16 level gives up against the others (kernels_cpu.h):
// vdpbf16ps reads a subnormal weight or x as 0. A block whose absmax makes
// its values subnormal in bfloat16 (1e-39 x NF4's codes) and a subnormal x
// give their exact products at every other level and 0 there; in the same
// call a normal block and x still give theirs exactly (x one-hot).
TEST(Gemv4bitKernelTest, Bf16LevelReadsSubnormalsAsZero) {
  if (!internal::CpuIsaSupported(CpuIsa::kAvx512Bf16)) GTEST_SKIP() << "no AVX512-BF16 here";
  const float tiny = 1e-39f;  // subnormal in float32 and bfloat16
  ASSERT_EQ(std::fpclassify(c10::BFloat16(tiny * kNf4[15]).operator float()), FP_SUBNORMAL);
  Weight4bit q;
  q.blocksize = 64;
  q.out_features = 2;
  q.in_features = 64;
  const std::vector<float> absmax = {tiny, 0.5f};  // row 0 subnormal, row 1 normal
  q.absmax = at::from_blob(const_cast<float*>(absmax.data()), {2}, at::kFloat).clone();
  q.packed = at::full({64}, 0xFF, at::kByte);  // code 15 (1.0) everywhere
  q.code = at::from_blob(const_cast<float*>(kNf4.data()), {16}, at::kFloat).clone();
  for (float x_value : {1.0f, tiny}) {
    for (CpuIsa isa : Isas()) {
      SCOPED_TRACE(testing::Message() << "x " << x_value << ", " << internal::CpuIsaName(isa));
      std::vector<float> x(64, 0.0f);
      x[5] = static_cast<float>(c10::BFloat16(x_value));
      std::vector<float> y(2, -1.0f);
      internal::Gemv4bitArgs args =
          GemvArgs(1, 64, 2, x.data(), q.packed.data_ptr<uint8_t>(), q.absmax.data_ptr<float>(),
                   q.code.data_ptr<float>(), y.data());
      internal::Gemv4bit(isa, args);
      const bool flushes = isa == CpuIsa::kAvx512Bf16;
      const float w0 = static_cast<float>(c10::BFloat16(tiny)), w1 = 0.5f;
      EXPECT_EQ(y[0], flushes ? 0.0f : w0 * x[5]);
      EXPECT_EQ(y[1], flushes && x_value == tiny ? 0.0f : w1 * x[5]);
    }
  }
}

// The AVX-512 BF16 kernel on bnb's layout takes a row's blocks in pairs, one
// table for both (the first block's values, then the second's), its last
// block alone when a row has an odd number: each block of a pair keeps its
// own absmax whether both take the fast table, one of them the exact
// rounding (a tiny absmax, whose values are subnormal) or a NaN. Five
// blocks a row of code 15 (1.0) and x of ones, so each row's sum is 64 x
// its blocks' absmax, exact; the tiny blocks add less than half an ulp of
// the rest at every level (the BF16 level reads them as 0).
TEST(Gemv4bitKernelTest, BlockPairsKeepEachBlocksAbsmax) {
  const float tiny = 1e-39f, nan = std::nanf("");
  const std::vector<float> absmax = {0.5f, tiny,  0.25f,  0.125f, tiny,    // row 0
                                     0.5f, 0.25f, 0.125f, 2.0f,   4.0f,    // row 1: all fast
                                     0.5f, nan,   1.0f,   1.0f,   1.0f,    // row 2
                                     tiny, 0.5f,  1.0f,   1.0f,   0.25f};  // row 3
  const std::vector<float> expected = {64 * 0.875f, 64 * 6.875f, nan, 64 * 2.75f};
  const int64_t out = 4, in = 320;
  const std::vector<uint8_t> packed(static_cast<size_t>(out * in / 2), 0xFF);
  for (int64_t m : {1, 3}) {
    const std::vector<float> x(static_cast<size_t>(m * in), 1.0f);
    for (CpuIsa isa : Isas()) {
      SCOPED_TRACE(testing::Message() << m << " rows, " << internal::CpuIsaName(isa));
      std::vector<float> y(static_cast<size_t>(m * out), -1.0f);
      internal::Gemv4bitArgs args =
          GemvArgs(m, in, out, x.data(), packed.data(), absmax.data(), kNf4.data(), y.data());
      internal::Gemv4bit(isa, args);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t n = 0; n < out; ++n) {
          const float got = y[static_cast<size_t>(i * out + n)];
          const float want = expected[static_cast<size_t>(n)];
          if (std::isnan(want)) {
            EXPECT_TRUE(std::isnan(got)) << "row " << n;
          } else {
            EXPECT_EQ(got, want) << "row " << n;
          }
        }
      }
    }
  }
}

// A double-quant weight as the layers hold it: the absmax as stored (uint8
// codes) with the nested state.
Weight4bit AsStored(const Quantized4bit& q, const Shape4bit& s) {
  Weight4bit w;
  w.packed = q.packed;
  w.absmax = q.absmax;
  w.code = q.quant_map;
  w.blocksize = s.blocksize;
  w.out_features = s.out;
  w.in_features = s.in;
  w.nested_absmax = q.nested_absmax;
  w.nested_code = q.nested_quant_map;
  w.nested_offset = q.state.nested_offset;
  return w;
}

// At the AVX-512 BF16 level a row's product does not depend on the rows
// beside it: up to 4 rows of x (decode at batch 4, weight rows walked whole,
// each row's sums in the same order whatever the count), each row's float32
// sums have the bits they have alone, with float32 absmax and double quant
// as stored, on rows of an even and an odd number of blocks. The float32
// levels (AVX2, AVX-512) tile the columns by the number of rows, so theirs
// do depend on it.
TEST(Gemv4bitKernelTest, ARowsSumsDoNotDependOnTheBatch) {
  const CpuIsa isa = CpuIsa::kAvx512Bf16;
  if (!internal::CpuIsaSupported(isa)) GTEST_SKIP() << "no AVX512-BF16 here";
  at::manual_seed(12);
  for (const Shape4bit& s : std::vector<Shape4bit>{{37, 4096, 64}, {21, 4160, 64}}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(
        Quantized4bit q, Quantize4bit(Random({s.out, s.in}, 0.1), QuantType4bit::kNf4, s.blocksize,
                                      /*double_quant=*/true));
    ACCEL_ASSERT_OK_AND_ASSIGN(const at::Tensor expanded, BlockAbsmax(q));
    const at::Tensor x = Random({4, s.in}).to(at::kBFloat16).to(at::kFloat).contiguous();
    for (bool nested : {false, true}) {
      SCOPED_TRACE(testing::Message() << s.out << "x" << s.in << (nested ? ", nested" : ""));
      // y [rows, out] for rows of x from `first`.
      const auto product = [&](int64_t first, int64_t rows) {
        at::Tensor y = at::full({rows, s.out}, std::nan(""), at::kFloat);
        internal::Gemv4bitArgs args = GemvArgs(
            rows, s.in, s.out, x.data_ptr<float>() + first * s.in, q.packed.data_ptr<uint8_t>(),
            expanded.data_ptr<float>(), q.quant_map.data_ptr<float>(), y.data_ptr<float>());
        if (nested) {
          args.w.absmax = nullptr;
          args.w.absmax_codes = q.absmax.data_ptr<uint8_t>();
          args.w.nested_absmax = q.nested_absmax.data_ptr<float>();
          args.w.nested_code = q.nested_quant_map.data_ptr<float>();
          args.w.nested_offset = q.state.nested_offset;
        }
        internal::Gemv4bit(isa, args);
        return y;
      };
      for (int64_t rows : {2, 3, 4}) {
        const at::Tensor batch = product(0, rows);
        for (int64_t i = 0; i < rows; ++i) ExpectSameBits(batch.narrow(0, i, 1), product(i, 1));
      }
    }
  }
}

// The weight rows are handed to the threads in pieces as they ask
// (ParallelRows): one thread, two and three give the same bits, on the
// register paths (1 to 4 rows) and the buffered one (6 rows), with rows
// enough for many pieces (out = 2080: 65 tiles of 32, a short last piece).
TEST(Gemv4bitKernelTest, TheBitsDoNotDependOnTheThreads) {
  at::manual_seed(13);
  const int64_t out = 2080, in = 1024;
  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit q,
                             Quantize4bit(Random({out, in}, 0.1), QuantType4bit::kNf4, 64, false));
  const at::Tensor x = Random({6, in}).to(at::kBFloat16).to(at::kFloat).contiguous();
  const int threads_before = at::get_num_threads();
  for (CpuIsa isa : Isas()) {
    for (int64_t rows : {1, 2, 4, 6}) {
      SCOPED_TRACE(testing::Message() << "isa " << static_cast<int>(isa) << ", rows " << rows);
      const auto product = [&](int threads) {
        at::set_num_threads(threads);
        at::Tensor y = at::full({rows, out}, std::nan(""), at::kFloat);
        internal::Gemv4bit(isa, GemvArgs(rows, in, out, x.data_ptr<float>(),
                                         q.packed.data_ptr<uint8_t>(), q.absmax.data_ptr<float>(),
                                         q.quant_map.data_ptr<float>(), y.data_ptr<float>()));
        return y;
      };
      const at::Tensor one = product(1);
      EXPECT_FALSE(at::isnan(one).any().item<bool>());
      ExpectSameBits(product(2), one);
      ExpectSameBits(product(3), one);
    }
  }
  at::set_num_threads(threads_before);
}

// Double quant read as stored (uint8 absmax codes, nested absmax and map,
// offset): the kernels dequantize each block's absmax on the way and give
// the very bits of the same weight with the absmax expanded to float32
// (quant::BlockAbsmax, bnb's two float32 steps), at every level, on the
// register, buffered and dequantize-then-multiply paths, and on shapes with
// and without the nibble layout (2600 columns: blocks cross rows; 2816: 44
// blocks a row, so the AVX-512 BF16 kernel's runs of 16 blocks straddle the
// nested groups of 256).
TEST(Linear4bitForwardTest, DoubleQuantReadAsStoredMatchesExpanded) {
  at::manual_seed(7);
  for (const Shape4bit& s :
       std::vector<Shape4bit>{{300, 1024, 64}, {70, 2600, 64}, {9, 512, 128}, {40, 2816, 64}}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(
        Quantized4bit q, Quantize4bit(Random({s.out, s.in}, 0.1), QuantType4bit::kNf4, s.blocksize,
                                      /*double_quant=*/true));
    ASSERT_EQ(q.absmax.scalar_type(), at::kByte);
    const Weight4bit nested = AsStored(q, s);
    ASSERT_NE(nested.nested_offset, 0.0f);
    Weight4bit expanded = nested;
    ACCEL_ASSERT_OK_AND_ASSIGN(expanded.absmax, BlockAbsmax(q));
    for (CpuIsa isa : Isas()) {
      IsaScope scope(isa);
      for (at::ScalarType compute : {at::kBFloat16, at::kHalf, at::kFloat}) {
        SCOPED_TRACE(testing::Message() << s.out << "x" << s.in << ", compute " << compute << ", "
                                        << internal::CpuIsaName(isa));
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor a, Dequantize4bitDense(nested, compute));
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor b, Dequantize4bitDense(expanded, compute));
        ExpectSameBits(a, b);
        for (int64_t rows : {1, 2, 3, 8, 17}) {
          const at::Tensor x = Random({rows, s.in}).to(at::kBFloat16);
          ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor ya, Linear4bitForward(x, nested, {}, compute));
          ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor yb, Linear4bitForward(x, expanded, {}, compute));
          ExpectSameBits(ya, yb);
        }
      }
    }
  }
}

// Double quant's absmax is two float32 steps (bnb's dequantize_blockwise,
// then += offset), never one fused multiply-add: nested code 2/3 (as float32,
// (2 + 2^-24) / 3) times nested absmax 3 is 2 + 2^-24 exactly, which
// float32 rounds to 2; adding the offset -1.498046875 gives 0.501953125, a tie
// between two bfloat16 values (0.5 and 0.50390625) that rounds to the even
// one, 0.5. Fused, the sum is 0.501953125 + 2^-24 and rounds up. Every weight
// here is code 15 (1.0) times that absmax, and x picks one column, so each
// output is the weight itself: 0.5 in bfloat16, 0.501953125 in float32, at
// every level and row count (register, buffered and slab paths).
TEST(Linear4bitForwardTest, DoubleQuantAbsmaxRoundsTwiceOnEveryPath) {
  constexpr int64_t kOut = 20, kIn = 256, kBlocks = kOut * kIn / 64;
  Weight4bit w;
  w.packed = at::full({kOut * kIn / 2}, 0xFF, at::kByte);
  w.absmax = at::full({kBlocks}, 5, at::kByte);
  w.code = at::tensor(std::vector<float>(kNf4.begin(), kNf4.end()));
  w.blocksize = 64;
  w.out_features = kOut;
  w.in_features = kIn;
  w.nested_absmax = at::full({1}, 3.0f);
  w.nested_code = at::zeros({256});
  w.nested_code[5] = 2.0f / 3.0f;
  w.nested_offset = -1.498046875f;
  ASSERT_EQ(2.0f / 3.0f * 3.0f, 2.0f);  // the product's own rounding
  for (CpuIsa isa : Isas()) {
    IsaScope scope(isa);
    for (int64_t rows : {1, 2, 3, 17}) {
      at::Tensor x = at::zeros({rows, kIn});
      x.select(1, 3).fill_(1.0f);
      for (const auto& [compute, expected] : std::vector<std::pair<at::ScalarType, float>>{
               {at::kBFloat16, 0.5f}, {at::kFloat, 0.501953125f}}) {
        SCOPED_TRACE(testing::Message()
                     << rows << " rows, compute " << compute << ", " << internal::CpuIsaName(isa));
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y, Linear4bitForward(x.to(compute), w, {}, compute));
        EXPECT_TRUE(y.to(at::kFloat).eq(expected).all().item<bool>())
            << y.to(at::kFloat).min().item<float>() << " .. "
            << y.to(at::kFloat).max().item<float>();
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor dense, Dequantize4bitDense(w, compute));
        EXPECT_TRUE(dense.to(at::kFloat).eq(expected).all().item<bool>());
      }
    }
  }
}

// The bfloat16 kernel on bnb's layout at decode's shapes: up to 4 rows of x
// a weight row is walked whole (up to 65536 columns, then in tiles), from 5
// rows on in tiles of 24 KiB of x (whole block pairs), and a double-quant
// block's absmax comes from its nested group's table. Rows of 14336 columns
// (Mixtral's w2), 65664 (past one whole-row tile) and 4160 (65 blocks: a
// row's last block alone, odd rows starting mid-pair, a pair across two
// nested groups in row 3, a last column tile of an odd block count),
// single- and double-quant, against bnb's product in double and against
// each other.
TEST(Linear4bitForwardTest, WideRowsWholeAndInColumnTiles) {
  at::manual_seed(8);
  for (const Shape4bit& s :
       std::vector<Shape4bit>{{37, 14336, 64}, {3, 65664, 64}, {9, 4160, 64}}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(
        Quantized4bit q, Quantize4bit(Random({s.out, s.in}, 0.1), QuantType4bit::kNf4, s.blocksize,
                                      /*double_quant=*/true));
    const Weight4bit nested = AsStored(q, s);
    Weight4bit expanded = nested;
    ACCEL_ASSERT_OK_AND_ASSIGN(expanded.absmax, BlockAbsmax(q));
    for (int64_t rows : {1, 2, 4, 5, 8}) {
      const at::Tensor x = Random({rows, s.in}).to(at::kBFloat16);
      for (CpuIsa isa : Isas()) {
        SCOPED_TRACE(testing::Message() << rows << " rows, " << s.out << "x" << s.in << ", "
                                        << internal::CpuIsaName(isa));
        IsaScope scope(isa);
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor ya, Linear4bitForward(x, nested, {}, at::kBFloat16));
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor yb,
                                   Linear4bitForward(x, expanded, {}, at::kBFloat16));
        ExpectSameBits(ya, yb);
        ExpectLinear4bit(ya, x, expanded, {}, at::kBFloat16);
      }
    }
  }
}

// Above 16 rows the weight is dequantized a slab of rows at a time (8 MiB):
// rows of 65664 columns make slabs of 48 rows where bfloat16 is multiplied
// by libtorch in bfloat16 (oneDNN, the AVX-512 levels) and 16 where the
// slab is float32 (float32 and float16 compute; bfloat16 below the AVX-512
// level or without oneDNN's bfloat16 product), so 100 weight rows take 3 or
// 7 slabs, the last one short. The bias is large against the bound of 65664
// terms, so a slab given another slab's bias is out of it.
TEST(Linear4bitForwardTest, ManyRowsInSlabs) {
  at::manual_seed(10);
  const Weight4bit q = Quantize(Random({100, 65664}, 0.1), 64, kNf4);
  const at::Tensor bias = Random({100}, 1000.0);
  const at::Tensor x = Random({17, 65664});
  for (CpuIsa isa : Isas()) {
    IsaScope scope(isa);
    for (at::ScalarType compute : {at::kBFloat16, at::kFloat, at::kHalf}) {
      SCOPED_TRACE(testing::Message()
                   << "compute " << compute << ", " << internal::CpuIsaName(isa));
      ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y, Linear4bitForward(x, q, bias, compute));
      ExpectLinear4bit(y, x, q, bias, compute);
    }
  }
}

// Every weight bfloat16(code * absmax) with absmax 1 is a multiple of 2^-11
// at most 1, so with x in {-1, 0, 1} every float32 partial sum of 128 terms
// is exact in any order and the product comes out as the exact sum rounded
// once to bfloat16, on every path (fused rows, slabs in bfloat16 or in
// float32): a path that multiplied the weights unrounded (float32
// code * absmax) or rounded the sums twice differs.
TEST(Linear4bitForwardTest, BFloat16ProductsUseTheRoundedWeightsOnEveryPath) {
  at::manual_seed(11);
  at::Tensor w = Random({48, 128});
  w.select(1, 0).fill_(1.0);
  w.select(1, 64).fill_(-1.0);  // each block's absmax is 1
  const Weight4bit q = Quantize(w, 64, kNf4);
  const at::Tensor w16 = ReferenceDequantize(q, at::kBFloat16).to(at::kDouble);
  for (int64_t rows : {1, 5, 16, 17, 40}) {
    const at::Tensor x = at::randint(-1, 2, {rows, 128}, at::kLong).to(at::kBFloat16);
    const at::Tensor expected = at::linear(x.to(at::kDouble), w16).to(at::kBFloat16);
    for (CpuIsa isa : Isas()) {
      SCOPED_TRACE(testing::Message() << rows << " rows, " << internal::CpuIsaName(isa));
      IsaScope scope(isa);
      ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y,
                                 Linear4bitForward(x, q, at::Tensor(), at::kBFloat16));
      EXPECT_TRUE(at::equal(y, expected))
          << "largest difference " << (y.to(at::kDouble) - expected.to(at::kDouble)).abs().max();
    }
  }
}

// ---- int8 ---------------------------------------------------------------------

at::Tensor RandomInt8(at::IntArrayRef shape) {
  return at::randint(-128, 128, shape, at::kLong).to(at::kChar);
}

at::Tensor Int64Product(const at::Tensor& a, const at::Tensor& b) {
  return at::mm(a.to(at::kLong), b.to(at::kLong).t());
}

TEST(Int8MatmulTest, ExactInt32AtEveryLevel) {
  at::manual_seed(5);
  const std::vector<std::array<int64_t, 3>> shapes = {
      {1, 7, 5},      {3, 33, 10}, {5, 100, 17},  {16, 257, 9}, {40, 64, 13},
      {2, 4096, 300}, {1, 0, 3},   {11, 64, 30},  {12, 64, 30}, {33, 101, 29},
      {64, 1027, 50}, {70, 5, 3},  {130, 66, 49}, {17, 2, 1}};
  // From 12 rows the AVX-512 level keeps rows in lanes (kInt8LanesMinRows):
  // row groups of 16 with 1-15 rows missing, 1-4 groups at a time and more
  // than 4 (130 rows), K not a multiple of 4, columns past a multiple of 24
  // / 12 / 8 / 6.
  for (const auto& [m, k, n] : shapes) {
    const at::Tensor a = RandomInt8({m, k}), b = RandomInt8({n, k});
    for (CpuIsa isa : Isas()) {
      SCOPED_TRACE(testing::Message()
                   << m << "x" << k << " . " << n << "x" << k << " " << internal::CpuIsaName(isa));
      IsaScope scope(isa);
      ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor c, Int8MatmulInt32(a, b));
      ASSERT_EQ(c.scalar_type(), at::kInt);
      EXPECT_TRUE(at::equal(c.to(at::kLong), Int64Product(a, b)));
    }
  }
}

// Sums of 8192 products of +-127 are above 2^24, where float32 (bnb's
// fallback) loses bits; the int32 kernel must not.
TEST(Int8MatmulTest, WorstCaseK8192IsExact) {
  const int64_t k = 8192;
  // 20 rows: the AVX-512 level's rows-in-lanes kernel too.
  at::Tensor a = at::full({20, k}, 127, at::kChar);
  a[7].fill_(-128);
  a[1].fill_(-127);
  a[1][5] = 126;
  at::Tensor b = at::full({3, k}, 127, at::kChar);
  b[1][100] = 126;
  b[2].fill_(-127);
  b[2][k - 1] = -126;
  const at::Tensor exact = Int64Product(a, b);
  // The test can fail: float32 gets these wrong.
  const at::Tensor as_float = at::mm(a.to(at::kFloat), b.to(at::kFloat).t()).to(at::kLong);
  ASSERT_FALSE(at::equal(as_float, exact));
  for (CpuIsa isa : Isas()) {
    SCOPED_TRACE(internal::CpuIsaName(isa));
    IsaScope scope(isa);
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor c, Int8MatmulInt32(a, b));
    EXPECT_TRUE(at::equal(c.to(at::kLong), exact)) << c << exact;
  }
}

float RoundTo(float v, at::ScalarType t) {
  if (t == at::kBFloat16) return static_cast<float>(c10::BFloat16(v));
  if (t == at::kHalf) return static_cast<float>(c10::Half(v));
  return v;
}

// LLM.int8 per ../shared/reference/bitsandbytes.md §3.2 / §3.3, one element at
// a time. Returns y (x's dtype) and, for the comparison's bound, the part of
// each output from outlier columns (magnitude) in `outlier_magnitude`.
struct Int8Reference {
  at::Tensor y;                  // x's dtype, [rows, out]
  at::Tensor outlier_magnitude;  // double, sum |x * subB| over outlier columns
  int64_t outlier_cols = 0;
};

Int8Reference ReferenceInt8(const at::Tensor& x, const at::Tensor& cb, const at::Tensor& scb,
                            const at::Tensor& bias, double threshold) {
  const int64_t out = cb.size(0), in = cb.size(1);
  const at::Tensor x2 = x.reshape({-1, in}).to(at::kFloat).contiguous();
  const int64_t rows = x2.size(0);
  const at::Tensor a = x.reshape({-1, in}).to(at::kHalf).to(at::kFloat).contiguous();
  auto A = [&](int64_t m, int64_t k) { return a.data_ptr<float>()[m * in + k]; };
  auto X = [&](int64_t m, int64_t k) { return x2.data_ptr<float>()[m * in + k]; };
  const float t = static_cast<float>(threshold);
  auto is_outlier = [&](int64_t m, int64_t k) { return t > 0 && std::fabs(A(m, k)) >= t; };
  std::vector<bool> outlier_col(static_cast<size_t>(in), false);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k < in; ++k) {
      if (is_outlier(m, k)) outlier_col[static_cast<size_t>(k)] = true;
    }
  }
  Int8Reference ref;
  for (bool c : outlier_col) ref.outlier_cols += c ? 1 : 0;
  const int8_t* cbp = cb.data_ptr<int8_t>();
  const float* scbp = scb.data_ptr<float>();
  at::Tensor y = at::empty({rows, out}, at::kDouble);
  ref.outlier_magnitude = at::zeros({rows, out}, at::kDouble);
  for (int64_t m = 0; m < rows; ++m) {
    float sca = 0;
    for (int64_t k = 0; k < in; ++k) {
      if (!is_outlier(m, k)) sca = std::max(sca, std::fabs(A(m, k)));
    }
    std::vector<int64_t> ca(static_cast<size_t>(in), 0);
    for (int64_t k = 0; k < in; ++k) {
      const bool zero =
          sca == 0 || is_outlier(m, k) || (rows > 1 && outlier_col[static_cast<size_t>(k)]);
      if (!zero)
        ca[static_cast<size_t>(k)] = static_cast<int64_t>(std::nearbyint(A(m, k) * (127.0f / sca)));
    }
    for (int64_t n = 0; n < out; ++n) {
      int64_t c = 0;
      for (int64_t k = 0; k < in; ++k) c += ca[static_cast<size_t>(k)] * cbp[n * in + k];
      float v = static_cast<float>(c) * (sca * scbp[n]) * (1.0f / 16129.0f);
      if (bias.defined()) v += bias.to(at::kFloat)[n].item<float>();
      double extra = 0, magnitude = 0;
      for (int64_t k = 0; k < in; ++k) {
        if (!outlier_col[static_cast<size_t>(k)]) continue;
        const float sub_b = RoundTo(static_cast<float>(cbp[n * in + k]) * scbp[n] *
                                        static_cast<float>(7.874015718698502e-3),
                                    x.scalar_type());
        extra += static_cast<double>(X(m, k)) * sub_b;
        magnitude += std::fabs(static_cast<double>(X(m, k)) * sub_b);
      }
      y[m][n] = static_cast<double>(v) + extra;
      ref.outlier_magnitude[m][n] = magnitude;
    }
  }
  ref.y = y;
  return ref;
}

// Without outlier columns every step is the same float32 operation as the
// reference's: bit for bit. With them, the outlier dot is a float32 sum.
void ExpectInt8(const at::Tensor& y, const at::Tensor& x, const at::Tensor& cb,
                const at::Tensor& scb, const at::Tensor& bias, double threshold) {
  const Int8Reference ref = ReferenceInt8(x, cb, scb, bias, threshold);
  ASSERT_EQ(y.scalar_type(), x.scalar_type());
  const at::Tensor y2 = y.reshape({-1, cb.size(0)});
  if (ref.outlier_cols == 0) {
    ExpectSameBits(y2, ref.y.to(at::kFloat).to(x.scalar_type()));
  } else {
    ExpectWithin(y2, ref.y, ref.outlier_magnitude + ref.y.abs(), ref.outlier_cols + 1,
                 {x.scalar_type()});
  }
}

// Rows quantized the way Int8Params does, so SCB and CB are consistent.
std::pair<at::Tensor, at::Tensor> QuantizeRows(const at::Tensor& w) {
  const at::Tensor w32 = w.to(at::kHalf).to(at::kFloat);
  const at::Tensor scb = std::get<0>(w32.abs().max(1)).contiguous();
  const at::Tensor cb = at::round(w32 * (127.0 / scb.unsqueeze(1))).to(at::kChar).contiguous();
  return {cb, scb};
}

// The activation quantization by its definition (reference §3.2), one value
// at a time in float32, against every level's bytes; with NaN, inf, values
// exactly at the threshold, a row of zeros and ties to even.
TEST(QuantizeInt8RowsTest, EveryLevelGivesTheDefinitionsBytes) {
  std::mt19937 gen(9);
  std::uniform_real_distribution<float> dist(-5.0f, 5.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::array<int64_t, 2>> shapes = {{1, 37}, {3, 16}, {5, 70}, {2, 1}, {4, 33}};
  for (const auto& [m, k] : shapes) {
    for (float threshold : {0.0f, 6.0f}) {
      std::vector<float> a(static_cast<size_t>(m * k));
      for (float& v : a) v = dist(gen);
      a[0] = nan;
      a[static_cast<size_t>(k - 1)] = -6.0f;  // an outlier with threshold 6 (>=)
      if (m > 1 && k > 2) {
        // absmax 127 / 32: scale 32, so 2.5 / 32 and -3.5 / 32 are ties.
        float* r1 = a.data() + k;
        for (int64_t t = 0; t < k; ++t) r1[t] = 0.0f;
        r1[0] = 3.96875f;
        r1[1] = 2.5f / 32;
        r1[2] = -3.5f / 32;
      }
      if (m > 2) std::fill(a.begin() + 2 * k, a.begin() + 3 * k, 0.0f);
      if (m > 3) a[static_cast<size_t>(3 * k + k - 2)] = inf;
      // The definition.
      auto outlier = [&](float v) { return threshold > 0 && std::fabs(v) >= threshold; };
      std::vector<uint8_t> want_col(static_cast<size_t>(k), 0);
      for (int64_t i = 0; i < m * k; ++i) {
        if (outlier(a[static_cast<size_t>(i)])) want_col[static_cast<size_t>(i % k)] = 1;
      }
      std::vector<float> want_sca(static_cast<size_t>(m), 0.0f);
      std::vector<int8_t> want(static_cast<size_t>(m * k), 0);
      for (int64_t i = 0; i < m; ++i) {
        float sca = 0.0f;
        for (int64_t t = 0; t < k; ++t) {
          const float v = a[static_cast<size_t>(i * k + t)];
          if (!std::isnan(v) && !outlier(v)) sca = std::max(sca, std::fabs(v));
        }
        want_sca[static_cast<size_t>(i)] = sca;
        for (int64_t t = 0; t < k; ++t) {
          const float v = a[static_cast<size_t>(i * k + t)];
          if (sca == 0 || outlier(v) || (m > 1 && want_col[static_cast<size_t>(t)])) continue;
          const float r = std::nearbyint(v * (127.0f / sca));
          if (r >= -128 && r <= 127) want[static_cast<size_t>(i * k + t)] = static_cast<int8_t>(r);
        }
      }
      if (m > 1 && k > 2) {
        EXPECT_EQ(want[static_cast<size_t>(k + 1)], 2);
        EXPECT_EQ(want[static_cast<size_t>(k + 2)], -4);
      }
      for (CpuIsa isa : Isas()) {
        SCOPED_TRACE(testing::Message() << m << "x" << k << " threshold " << threshold << " "
                                        << internal::CpuIsaName(isa));
        std::vector<uint8_t> col(static_cast<size_t>(k), 7);
        std::vector<float> sca(static_cast<size_t>(m), -1.0f);
        std::vector<int8_t> codes(static_cast<size_t>(m * k), 99);
        internal::QuantizeInt8Rows(isa, a.data(), m, k, threshold, col.data(), sca.data(),
                                   codes.data());
        EXPECT_EQ(col, want_col);
        EXPECT_EQ(sca, want_sca);
        EXPECT_EQ(codes, want);
      }
    }
  }
}

TEST(Int8LinearForwardTest, NoDecompositionIsBitExact) {
  at::manual_seed(6);
  for (int64_t in : {64, 100, 4096}) {
    auto [cb, scb] = QuantizeRows(Random({33, in}, 0.05));
    for (int64_t rows : {1, 3, 17}) {
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        for (bool with_bias : {false, true}) {
          at::Tensor x = Random({rows, in}, 4.0);
          x[0][3] = 9.5;  // large, but threshold 0 takes no outliers
          x = x.to(dtype);
          const at::Tensor bias = with_bias ? Random({33}).to(dtype) : at::Tensor();
          for (CpuIsa isa : Isas()) {
            SCOPED_TRACE(testing::Message()
                         << rows << "x" << in << " " << dtype << (with_bias ? " with bias " : " ")
                         << internal::CpuIsaName(isa));
            IsaScope scope(isa);
            for (double threshold : {0.0, 100.0}) {  // 100: nothing reaches it
              ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y,
                                         Int8LinearForward(x, cb, scb, bias, threshold));
              ExpectInt8(y, x, cb, scb, bias, threshold);
            }
          }
        }
      }
    }
  }
}

TEST(Int8LinearForwardTest, OutlierColumnsOneRowAndManyRows) {
  at::manual_seed(7);
  const int64_t in = 96, out = 21;
  auto [cb, scb] = QuantizeRows(Random({out, in}, 0.05));
  for (int64_t rows : {1, 4, 20}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      at::Tensor x = Random({rows, in}, 3.0);
      x[0][5] = 8.5;           // outlier column 5
      x[rows - 1][17] = -6.0;  // exactly the threshold: an outlier (>=)
      x[0][40] = 5.99;         // below it
      x = x.to(dtype);
      const at::Tensor bias = Random({out}).to(dtype);
      at::Tensor first_level;
      for (CpuIsa isa : Isas()) {
        SCOPED_TRACE(testing::Message()
                     << rows << " rows " << dtype << " " << internal::CpuIsaName(isa));
        IsaScope scope(isa);
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y, Int8LinearForward(x, cb, scb, bias, 6.0));
        ExpectInt8(y, x, cb, scb, bias, 6.0);
        // Every level sums the outlier dot in the same order: the same bits.
        if (!first_level.defined()) first_level = y;
        EXPECT_TRUE(at::equal(y, first_level));
        // The decomposition matters: without it the answer is different.
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor plain, Int8LinearForward(x, cb, scb, bias, 0.0));
        EXPECT_FALSE(at::equal(plain, y));
      }
    }
  }
}

// With more than one row, the other rows' values in an outlier column leave
// the int8 product too (they go through the outlier product instead); with
// one row only the outlier itself does. A row whose values are all outliers
// or all zero has SCA 0 and contributes no int8 codes.
TEST(Int8LinearForwardTest, ZeroRowsAndRowsOfOutliers) {
  at::manual_seed(8);
  const int64_t in = 40, out = 9;
  auto [cb, scb] = QuantizeRows(Random({out, in}, 0.05));
  at::Tensor x = Random({3, 2, in}, 2.0);
  x[0][0].zero_();
  x[1][1].fill_(7.0);
  const at::Tensor bias = Random({out});
  for (CpuIsa isa : Isas()) {
    SCOPED_TRACE(internal::CpuIsaName(isa));
    IsaScope scope(isa);
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y, Int8LinearForward(x, cb, scb, bias, 6.0));
    EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 2, out}));
    ExpectInt8(y, x, cb, scb, bias, 6.0);
    // Row 0: all zero, so bias alone (every column is an outlier column, and
    // x is 0 there).
    EXPECT_TRUE(at::allclose(y[0][0], bias, 0, 0)) << y[0][0] << bias;
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor y0, Int8LinearForward(x, cb, scb, bias, 0.0));
    ExpectInt8(y0, x, cb, scb, bias, 0.0);
  }
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor empty,
                             Int8LinearForward(at::zeros({0, in}), cb, scb, bias, 6.0));
  EXPECT_EQ(empty.sizes(), (std::vector<int64_t>{0, out}));
}

// ---- validation ---------------------------------------------------------------

class ValidationTest : public ::testing::Test {
 protected:
  void SetUp() override { q_ = Quantize(Random({4, 64}), 64, kNf4); }
  Weight4bit q_;
};

TEST_F(ValidationTest, Linear4bitArguments) {
  const at::Tensor x = Random({2, 64}).to(at::kFloat);
  auto bad = [&](const Weight4bit& w, const at::Tensor& xx, const at::Tensor& bias,
                 at::ScalarType compute) { return Linear4bitForward(xx, w, bias, compute); };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(bad(q_, x.to(at::kDouble), {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("x must be float32")));
  EXPECT_THAT(bad(q_, Random({2, 63}).to(at::kFloat), {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("in_features")));
  EXPECT_THAT(bad(q_, at::empty({2, 64}, at::TensorOptions().device(at::kMeta)), {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("x must be a dense cpu tensor")));
  EXPECT_THAT(bad(q_, x, {}, at::kDouble), StatusIs(kInvalid, HasSubstr("compute_dtype")));
  EXPECT_THAT(bad(q_, x, at::zeros({5}), at::kFloat),
              StatusIs(kInvalid, HasSubstr("bias must be [4]")));
  EXPECT_THAT(bad(q_, x, at::zeros({4}, at::kInt), at::kFloat),
              StatusIs(kInvalid, HasSubstr("bias")));
  EXPECT_THAT(bad(q_, at::Tensor(), {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("x is undefined")));

  Weight4bit w = q_;
  w.packed = q_.packed.to(at::kChar);
  EXPECT_THAT(bad(w, x, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("weight.packed must be uint8")));
  w = q_;
  w.packed = q_.packed.narrow(0, 0, 127);
  EXPECT_THAT(bad(w, x, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("weight.packed holds 127 bytes")));
  w = q_;
  w.packed = at::empty({128}, at::TensorOptions().dtype(at::kByte).device(at::kMeta));
  EXPECT_THAT(bad(w, x, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("weight.packed must be a dense cpu")));
  w = q_;
  w.absmax = at::ones({5});
  EXPECT_THAT(bad(w, x, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("weight.absmax holds 5 values")));
  w = q_;
  w.absmax = q_.absmax.to(at::kHalf);
  EXPECT_THAT(bad(w, x, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("weight.absmax must be float32")));
  // uint8 absmax: double quant, whose nested tensors must be there and fit.
  w = q_;
  w.absmax = at::zeros(q_.absmax.sizes(), at::kByte);
  EXPECT_THAT(bad(w, x, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("weight.nested_absmax is undefined")));
  w.nested_absmax = at::ones({2});
  w.nested_code = at::ones({256});
  EXPECT_THAT(bad(w, x, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("weight.nested_absmax holds 2 values, not ceil(")));
  w.nested_absmax = at::ones({1});
  w.nested_code = at::ones({255});
  EXPECT_THAT(bad(w, x, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("weight.nested_code must hold 256 values")));
  w.nested_code = at::ones({256}, at::kDouble);
  EXPECT_THAT(bad(w, x, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("weight.nested_code must be float32")));
  w.nested_code = at::ones({256});
  EXPECT_TRUE(bad(w, x, {}, at::kFloat).ok());
  w = q_;
  w.code = q_.code.narrow(0, 0, 15);
  EXPECT_THAT(bad(w, x, {}, at::kFloat), StatusIs(kInvalid, HasSubstr("weight.code must hold 16")));
  w = q_;
  w.code = q_.code.to(at::kDouble);
  EXPECT_THAT(bad(w, x, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("weight.code must be float32")));
  w = q_;
  w.blocksize = 0;
  EXPECT_THAT(bad(w, x, {}, at::kFloat), StatusIs(kInvalid, HasSubstr("weight.blocksize")));
  w = q_;
  w.in_features = 0;
  EXPECT_THAT(bad(w, x, {}, at::kFloat), StatusIs(kInvalid, HasSubstr("weight.out_features")));
  w = q_;
  w.blocksize = 32;  // absmax would need 8 values
  EXPECT_THAT(bad(w, x, {}, at::kFloat), StatusIs(kInvalid, HasSubstr("ceil(256 / 32) = 8")));

  EXPECT_THAT(Dequantize4bitDense(q_, at::kInt), StatusIs(kInvalid, HasSubstr("dtype must be")));
  w = q_;
  w.absmax = at::ones({2});
  EXPECT_THAT(Dequantize4bitDense(w, at::kFloat), StatusIs(kInvalid, HasSubstr("weight.absmax")));
}

TEST_F(ValidationTest, Int8Arguments) {
  auto [cb, scb] = QuantizeRows(Random({4, 64}));
  const at::Tensor x = Random({2, 64}).to(at::kFloat);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(Int8LinearForward(x, cb.to(at::kFloat), scb, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("cb must be int8")));
  EXPECT_THAT(Int8LinearForward(x, cb.flatten(), scb, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("cb must be [out, in]")));
  EXPECT_THAT(Int8LinearForward(x, cb, scb.narrow(0, 0, 3), {}, 6.0),
              StatusIs(kInvalid, HasSubstr("scb must be [4]")));
  EXPECT_THAT(Int8LinearForward(x, cb, scb.to(at::kHalf), {}, 6.0),
              StatusIs(kInvalid, HasSubstr("scb must be float32")));
  EXPECT_THAT(Int8LinearForward(Random({2, 65}).to(at::kFloat), cb, scb, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("in_features")));
  EXPECT_THAT(Int8LinearForward(x.to(at::kChar), cb, scb, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("x must be float32")));
  EXPECT_THAT(Int8LinearForward(x, cb, scb, at::zeros({3}), 6.0),
              StatusIs(kInvalid, HasSubstr("bias must be [4]")));
  EXPECT_THAT(Int8LinearForward(x, cb, scb, {}, -1.0), StatusIs(kInvalid, HasSubstr("threshold")));
  EXPECT_THAT(Int8LinearForward(x, cb, scb, {}, std::nan("")),
              StatusIs(kInvalid, HasSubstr("threshold")));
  EXPECT_THAT(Int8LinearForward(x, cb, scb, {}, std::numeric_limits<double>::infinity()),
              StatusIs(kInvalid, HasSubstr("threshold must be a finite number")));
  EXPECT_THAT(Int8LinearForward(Random({2, 0}).to(at::kFloat), cb.narrow(1, 0, 0), scb, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("cb must have at least one column")));
  EXPECT_THAT(Int8LinearForward(at::empty({2, 64}, at::TensorOptions().device(at::kMeta)), cb, scb,
                                {}, 6.0),
              StatusIs(kInvalid, HasSubstr("x must be a dense cpu tensor")));
  EXPECT_THAT(Int8LinearForward(
                  x, at::empty({4, 64}, at::TensorOptions().dtype(at::kChar).device(at::kMeta)),
                  scb, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("cb must be a dense cpu tensor")));

  EXPECT_THAT(Int8MatmulInt32(cb.to(at::kFloat), cb),
              StatusIs(kInvalid, HasSubstr("a must be int8")));
  EXPECT_THAT(Int8MatmulInt32(cb, cb.to(at::kShort)),
              StatusIs(kInvalid, HasSubstr("b must be int8")));
  EXPECT_THAT(Int8MatmulInt32(cb, cb.narrow(1, 0, 63)), StatusIs(kInvalid, HasSubstr("same K")));
  EXPECT_THAT(Int8MatmulInt32(cb.flatten(), cb), StatusIs(kInvalid, HasSubstr("2-D")));
}

// The checks both forward paths share name the device they want: the cpu
// path's wording, and x's device for the CUDA path (the other branch, run
// here with the meta device standing in for a CUDA one).
TEST(ArgumentChecksTest, OnDeviceNamesTheDeviceWanted) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const at::Tensor on_cpu = at::zeros({2});
  const at::Tensor on_meta = at::empty({2}, at::TensorOptions().device(at::kMeta));
  EXPECT_THAT(internal::CheckOnDevice(on_cpu, "bias", at::Device(at::kCPU)), IsOk());
  EXPECT_THAT(internal::CheckOnDevice(on_meta, "bias", at::Device(at::kMeta)), IsOk());
  EXPECT_THAT(internal::CheckOnDevice(on_meta, "bias", at::Device(at::kCPU)),
              StatusIs(kInvalid, HasSubstr("bias must be a dense cpu tensor, got one on meta")));
  EXPECT_THAT(
      internal::CheckOnDevice(on_cpu, "cb", at::Device(at::kMeta)),
      StatusIs(kInvalid, HasSubstr("cb must be a dense tensor on meta (x's device), got one "
                                   "on cpu")));
  EXPECT_THAT(internal::CheckOnDevice(at::Tensor(), "scb", at::Device(at::kCPU)),
              StatusIs(kInvalid, HasSubstr("scb is undefined")));
  EXPECT_THAT(
      internal::CheckComputeDType(at::kInt, "dtype"),
      StatusIs(kInvalid, HasSubstr("dtype must be float32, bfloat16 or float16, got int32")));
}

}  // namespace
}  // namespace accel::quant
