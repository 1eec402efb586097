// The decode GEMV kernel (models/cuda/decode_gemv.h): its code run on the
// host, every CTA of a grid emulated thread by thread
// (tests/testing/cta_emulator.h), against a float64 sum of the same products
// (within float32's bound, and to the bit where every sum is exact), more
// columns than warps, row strides, and the norm in its prologue (x' in
// shared memory) against the RMSNorm kernel followed by the GEMV. On a device (skipped elsewhere):
// the wrappers (models/internal/fused_ops.h) against libtorch's product and the separate norm.
#include "models/cuda/decode_gemv.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "models/cuda/internal/decode_gemv.h"
#include "models/internal/fused_ops.h"
#include "models/nn.h"
#include "tests/models/fused_ops_emulation.h"
#include "tests/testing/cta_emulator.h"

namespace accel::models {
namespace {

using accel::testing::CtaEmulator;

using DType = testing::KernelDType;
constexpr const auto& kDTypes = testing::kKernelDTypes;
using testing::EmulateRmsNorm;

using cuda::internal::DecodeGemvPrologue;

template <typename Tag, int32_t kRows, DecodeGemvPrologue kPrologue>
std::string EmulateGrid(const cuda::DecodeGemvParams& p, int64_t ctas) {
  CtaEmulator cta(cuda::kDecodeGemvThreads);
  struct alignas(16) Chunk {
    char bytes[16];
  };
  std::vector<Chunk> staged(static_cast<size_t>(cuda::kDecodeGemvSharedBytes / 16));
  std::vector<float> reduce(cuda::internal::kDecodeGemvWarps);
  for (int64_t c = 0; c < ctas; ++c) {
    const std::string error = cta.Run([&](CtaEmulator::Exec& exec) {
      cuda::internal::DecodeGemvCta<Tag, kRows, kPrologue>(
          p, c, ctas, reinterpret_cast<typename Tag::Storage*>(staged.data()), reduce.data(), exec);
    });
    if (!error.empty()) return "cta " + std::to_string(c) + ": " + error;
  }
  return "";
}

template <typename Tag, DecodeGemvPrologue kPrologue>
std::string EmulateRows(const cuda::DecodeGemvParams& p, int64_t ctas) {
  if (p.rows <= 1) return EmulateGrid<Tag, 1, kPrologue>(p, ctas);
  if (p.rows <= 2) return EmulateGrid<Tag, 2, kPrologue>(p, ctas);
  if (p.rows <= 4) return EmulateGrid<Tag, 4, kPrologue>(p, ctas);
  return EmulateGrid<Tag, 8, kPrologue>(p, ctas);
}

template <typename Tag>
std::string EmulateAs(const cuda::DecodeGemvParams& p, int64_t ctas) {
  switch (cuda::internal::PrologueOf(p)) {
    case DecodeGemvPrologue::kNone:
      return EmulateRows<Tag, DecodeGemvPrologue::kNone>(p, ctas);
    case DecodeGemvPrologue::kNorm:
      return EmulateRows<Tag, DecodeGemvPrologue::kNorm>(p, ctas);
    case DecodeGemvPrologue::kSiluMul:
      return EmulateRows<Tag, DecodeGemvPrologue::kSiluMul>(p, ctas);
  }
  return "prologue";
}

std::string Emulate(const cuda::DecodeGemvParams& p, cuda::KvDType dtype, int64_t ctas) {
  if (const char* refused = cuda::CheckDecodeGemvParams(p, dtype)) return refused;
  switch (dtype) {
    case cuda::KvDType::kFloat32:
      return EmulateAs<cuda::internal::Float32>(p, ctas);
    case cuda::KvDType::kBFloat16:
      return EmulateAs<cuda::internal::BFloat16>(p, ctas);
    case cuda::KvDType::kFloat16:
      return EmulateAs<cuda::internal::Float16>(p, ctas);
  }
  return "dtype";
}

cuda::DecodeGemvParams ParamsFor(const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& bias, const at::Tensor& out) {
  cuda::DecodeGemvParams p;
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.rows = static_cast<int32_t>(x.size(0));
  p.n = weight.size(0);
  p.k = static_cast<int32_t>(weight.size(1));
  p.x_row_stride = x.stride(0);
  p.out_row_stride = out.stride(0);
  return p;
}

// |got - want| within float32's bound for a k-term sum of products (each
// product and addition one rounding, relative to the sum of |products|) plus
// one rounding of the storage dtype.
void ExpectWithinBound(const at::Tensor& got, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& bias, const std::string& what) {
  const at::Tensor xd = x.to(at::kDouble), wd = weight.to(at::kDouble);
  at::Tensor want = at::matmul(xd, wd.t());
  if (bias.defined()) want = want + bias.to(at::kDouble);
  const at::Tensor magnitude = at::matmul(xd.abs(), wd.abs().t());
  const double unit = got.scalar_type() == at::kBFloat16 ? 1.0 / 256
                      : got.scalar_type() == at::kHalf   ? 1.0 / 2048
                                                         : 0.0;
  const at::Tensor bound = static_cast<double>(x.size(1) + 2) * std::ldexp(1.0, -24) * magnitude +
                           unit * want.abs() + 1e-30;
  const at::Tensor excess = (got.to(at::kDouble) - want).abs() - bound;
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max |diff| " << (got.to(at::kDouble) - want).abs().max().item<double>();
}

// Each element of `got` within one rounding of the storage dtype of `want`
// (relative to the larger magnitude, with a floor near zero).
void ExpectWithinARounding(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const double unit = got.scalar_type() == at::kBFloat16 ? 1.0 / 128
                      : got.scalar_type() == at::kHalf   ? 1.0 / 1024
                                                         : 4e-6;
  const at::Tensor excess = (g - w).abs() - unit * at::maximum(g.abs(), w.abs()).clamp_min(1e-3);
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max |diff| " << (g - w).abs().max().item<double>();
}

TEST(DecodeGemvEmulationTest, EachOutputIsTheSumOfItsProductsWithinFloat32sBound) {
  c10::InferenceMode inference;
  struct Shape {
    int32_t rows;
    int64_t n, k;
    int64_t ctas;  // fewer than n / 8: warps take several columns
  };
  // (Without a norm x is read from global memory; with one, from the CTA's
  // shared memory: TheNormInside... below.)
  const Shape shapes[] = {{1, 37, 64, 5},  {3, 70, 512, 2}, {8, 24, 4096, 3}, {3, 17, 4096, 1},
                          {4, 9, 4096, 2}, {5, 40, 136, 5}, {2, 8, 4104, 1}};
  for (const DType& dtype : kDTypes) {
    for (const Shape& s : shapes) {
      for (bool with_bias : {false, true}) {
        const std::string what = std::string(dtype.name) + " rows " + std::to_string(s.rows) +
                                 " n " + std::to_string(s.n) + " k " + std::to_string(s.k) +
                                 (with_bias ? " bias" : "");
        at::manual_seed(static_cast<uint64_t>(s.n * 31 + s.k));
        const at::Tensor x = (at::randn({s.rows, s.k}) * 2.0).to(dtype.type);
        const at::Tensor weight = (at::randn({s.n, s.k}) * 0.5).to(dtype.type);
        const at::Tensor bias = with_bias ? at::randn({s.n}).to(dtype.type) : at::Tensor();
        at::Tensor out = at::full({s.rows, s.n}, 1e4).to(dtype.type);
        const cuda::DecodeGemvParams p = ParamsFor(x, weight, bias, out);
        ASSERT_EQ(Emulate(p, dtype.kernel, s.ctas), "") << what;
        ExpectWithinBound(out, x, weight, bias, what);
      }
    }
  }
}

// Small integers: every product and partial sum exact in float32 and every
// result exact in 16 bits, so any order of the sums gives the exact result.
// A kernel reading a wrong chunk of x or of W, or dropping a lane's sum,
// fails this to the bit.
TEST(DecodeGemvEmulationTest, ExactSumsAreExact) {
  c10::InferenceMode inference;
  for (const DType& dtype : kDTypes) {
    for (int32_t rows : {1, 2, 4, 6, 8}) {
      for (int64_t k : {8, 256, 2056}) {
        const std::string what =
            std::string(dtype.name) + " rows " + std::to_string(rows) + " k " + std::to_string(k);
        at::manual_seed(static_cast<uint64_t>(int64_t{rows} * 100 + k));
        const int64_t n = 19;
        const at::Tensor x = at::randint(-1, 2, {rows, k}).to(dtype.type);
        const at::Tensor weight = at::randint(-1, 2, {n, k}).to(dtype.type);
        const at::Tensor bias = at::randint(-4, 5, {n}).to(dtype.type);
        at::Tensor out = at::zeros({rows, n}, at::TensorOptions(dtype.type));
        ASSERT_EQ(Emulate(ParamsFor(x, weight, bias, out), dtype.kernel, 2), "") << what;
        const at::Tensor want =
            (at::matmul(x.to(at::kDouble), weight.to(at::kDouble).t()) + bias.to(at::kDouble))
                .to(dtype.type);
        // (|sums| <= k + 4 <= 2060: exact in float32; rounded once to 16 bits.)
        EXPECT_TRUE(at::equal(out, want)) << what;
      }
    }
  }
}

// x's rows spaced apart (a view of a wider tensor) and out's too.
TEST(DecodeGemvEmulationTest, RowStridesAreFollowed) {
  c10::InferenceMode inference;
  const at::Tensor wide = at::randint(-1, 2, {3, 96}).to(at::kBFloat16);
  const at::Tensor x = wide.narrow(1, 0, 64);  // rows 96 apart
  const at::Tensor weight = at::randint(-1, 2, {10, 64}).to(at::kBFloat16);
  at::Tensor out_wide = at::full({3, 16}, 5.0).to(at::kBFloat16);
  const at::Tensor out = out_wide.narrow(1, 0, 10);
  cuda::DecodeGemvParams p = ParamsFor(x, weight, at::Tensor(), out);
  ASSERT_EQ(p.x_row_stride, 96);
  ASSERT_EQ(p.out_row_stride, 16);
  ASSERT_EQ(Emulate(p, cuda::KvDType::kBFloat16, 1), "");
  EXPECT_TRUE(
      at::equal(out, at::matmul(x.to(at::kFloat), weight.to(at::kFloat).t()).to(at::kBFloat16)));
  // The columns past n are untouched.
  EXPECT_TRUE(at::equal(out_wide.narrow(1, 10, 6), at::full({3, 6}, 5.0).to(at::kBFloat16)));
}

// The norm in the GEMV's prologue is the RMSNorm kernel's, bit for bit: the
// fused launch's y equals the GEMV of the norm kernel's output, and its sum
// the eager x + residual (written by one CTA; every CTA normalises).
TEST(DecodeGemvEmulationTest, TheNormInsideEqualsTheNormKernelThenTheGemv) {
  c10::InferenceMode inference;
  for (const DType& dtype : kDTypes) {
    for (int32_t rows : {1, 3}) {
      for (bool add : {false, true}) {
        for (bool unit_offset : {false, true}) {
          const int64_t k = 1024, n = 29;
          const std::string what = std::string(dtype.name) + " rows " + std::to_string(rows) +
                                   (add ? " residual" : "") + (unit_offset ? " unit offset" : "");
          at::manual_seed(static_cast<uint64_t>(rows) * 7 + (add ? 3 : 0) + (unit_offset ? 1 : 0));
          const at::Tensor x = (at::randn({rows, k}) * 3.0).to(dtype.type);
          const at::Tensor residual =
              add ? (at::randn({rows, k}) * 2.0).to(dtype.type) : at::Tensor();
          const at::Tensor norm_weight = (at::randn({k}) * 0.5 + 1.0).to(dtype.type);
          const at::Tensor weight = (at::randn({n, k}) * 0.3).to(dtype.type);
          const at::Tensor bias = at::randn({n}).to(dtype.type);
          // The norm kernel, then the GEMV on its output.
          at::Tensor normed = at::empty({rows, k}, x.options());
          at::Tensor sum_want = add ? at::empty_like(x) : at::Tensor();
          cuda::RmsNormParams norm;
          norm.x = x.data_ptr();
          norm.weight = norm_weight.data_ptr();
          norm.out = normed.data_ptr();
          norm.rows = rows;
          norm.dim = static_cast<int32_t>(k);
          norm.x_row_stride = norm.out_row_stride = k;
          norm.eps = 1e-5f;
          norm.unit_offset = unit_offset;
          if (add) {
            norm.residual = residual.data_ptr();
            norm.sum = sum_want.data_ptr();
            norm.residual_row_stride = norm.sum_row_stride = k;
          }
          ASSERT_EQ(EmulateRmsNorm(norm, dtype.kernel), "") << what;
          at::Tensor want = at::empty({rows, n}, x.options());
          ASSERT_EQ(Emulate(ParamsFor(normed, weight, bias, want), dtype.kernel, 2), "") << what;
          // The fused launch, over three CTAs.
          at::Tensor got = at::full({rows, n}, 9.0).to(dtype.type);
          at::Tensor sum_got = add ? at::full_like(x, 9.0) : at::Tensor();
          // (The norm's parameters as given to the norm kernel, its sum to
          // another tensor: the GEMV sets the rest.)
          cuda::DecodeGemvParams p = ParamsFor(x, weight, bias, got);
          p.norm = norm;
          p.norm.out = nullptr;
          if (add) p.norm.sum = sum_got.data_ptr();
          ASSERT_EQ(Emulate(p, dtype.kernel, 3), "") << what;
          EXPECT_TRUE(at::equal(got, want)) << what;
          if (add) {
            EXPECT_TRUE(at::equal(sum_got, sum_want)) << what;
            EXPECT_TRUE(at::equal(sum_got, x + residual)) << what;
          }
          // And x' the eager norm (nn::RMSNorm on the cpu) within a rounding
          // (its float32 sum of squares runs in another order).
          nn::RMSNorm module("RMSNorm", k, 1e-5, dtype.type, unit_offset);
          module.weight.copy_(norm_weight);
          ExpectWithinARounding(normed, module.forward(add ? x + residual : x),
                                what + " against the eager norm");
        }
      }
    }
  }
}

// SiLU(gate) * up inside the down projection: y equals the SiluMul kernel's
// output (its own code, element by element) then the GEMV, bit for bit.
TEST(DecodeGemvEmulationTest, TheSiluMulInsideEqualsTheSiluMulKernelThenTheGemv) {
  c10::InferenceMode inference;
  for (const DType& dtype : kDTypes) {
    for (int32_t rows : {1, 3}) {
      const int64_t k = 704, n = 21;
      const std::string what = std::string(dtype.name) + " rows " + std::to_string(rows);
      at::manual_seed(static_cast<uint64_t>(rows) + 40);
      const at::Tensor gate_up = (at::randn({rows, 2 * k}) * 3.0).to(dtype.type);
      const at::Tensor weight = (at::randn({n, k}) * 0.3).to(dtype.type);
      const at::Tensor bias = at::randn({n}).to(dtype.type);
      // The SiluMul kernel's code, element by element, then the GEMV.
      at::Tensor activated = at::empty({rows, k}, gate_up.options());
      cuda::SiluMulParams silu;
      silu.gate = gate_up.data_ptr();
      silu.up = static_cast<char*>(gate_up.data_ptr()) + k * gate_up.element_size();
      silu.out = activated.data_ptr();
      silu.rows = rows;
      silu.dim = static_cast<int32_t>(k);
      silu.gate_row_stride = silu.up_row_stride = 2 * k;
      ASSERT_EQ(cuda::CheckSiluMulParams(silu), nullptr);
      for (int64_t i = 0; i < rows * k; ++i) {
        switch (dtype.kernel) {
          case cuda::KvDType::kFloat32:
            cuda::internal::SiluMulAt<cuda::internal::Float32>(silu, i);
            break;
          case cuda::KvDType::kBFloat16:
            cuda::internal::SiluMulAt<cuda::internal::BFloat16>(silu, i);
            break;
          case cuda::KvDType::kFloat16:
            cuda::internal::SiluMulAt<cuda::internal::Float16>(silu, i);
            break;
        }
      }
      at::Tensor want = at::empty({rows, n}, gate_up.options());
      ASSERT_EQ(Emulate(ParamsFor(activated, weight, bias, want), dtype.kernel, 2), "") << what;
      at::Tensor got = at::full({rows, n}, 9.0).to(dtype.type);
      cuda::DecodeGemvParams p = ParamsFor(gate_up, weight, bias, got);
      p.silu_mul = true;
      ASSERT_EQ(p.x_row_stride, 2 * k);
      ASSERT_EQ(Emulate(p, dtype.kernel, 3), "") << what;
      EXPECT_TRUE(at::equal(got, want)) << what;
      // And x' SiLU(gate) * up in float32, rounded once, then the product
      // (libtorch's CUDA formula; its cpu kernel for 16 bits rounds inside
      // SiLU), within a rounding (exp's last float32 bit).
      const at::Tensor gate = gate_up.narrow(1, 0, k), up = gate_up.narrow(1, k, k);
      ExpectWithinARounding(activated, at::silu(gate.to(at::kFloat)).to(dtype.type) * up,
                            what + " against the formula");
    }
  }
}

TEST(DecodeGemvEmulationTest, ParametersTheKernelCannotTakeAreNamed) {
  alignas(16) uint16_t buffer[64] = {};
  cuda::DecodeGemvParams p;
  p.x = p.weight = buffer;
  p.out = buffer;
  p.rows = 1;
  p.n = 4;
  p.k = 16;
  p.x_row_stride = 16;
  p.out_row_stride = 4;
  const cuda::KvDType bf16 = cuda::KvDType::kBFloat16;
  EXPECT_EQ(cuda::CheckDecodeGemvParams(p, bf16), nullptr);
  cuda::DecodeGemvParams q = p;
  q.rows = cuda::kDecodeGemvMaxRows + 1;
  EXPECT_STREQ(cuda::CheckDecodeGemvParams(q, bf16), "rows outside 1..kDecodeGemvMaxRows");
  q = p;
  q.k = 12;  // not whole 16-byte chunks of 16-bit values
  q.x_row_stride = 12;
  EXPECT_STREQ(cuda::CheckDecodeGemvParams(q, bf16), "k not whole 16-byte chunks (or n, k < 1)");
  q = p;
  q.weight = buffer + 1;
  EXPECT_STREQ(cuda::CheckDecodeGemvParams(q, bf16), "a pointer not 16-byte aligned");
  q = p;
  q.norm.residual = buffer;
  q.norm.sum = buffer;
  EXPECT_STREQ(cuda::CheckDecodeGemvParams(q, bf16), "a residual without a norm");
  q = p;
  q.norm.weight = buffer;
  EXPECT_EQ(cuda::CheckDecodeGemvParams(q, bf16), nullptr);
  q.norm.residual = buffer;
  EXPECT_STREQ(cuda::CheckDecodeGemvParams(q, bf16), "residual and sum: both or neither");
  q = p;
  q.norm.weight = buffer;
  q.rows = 8;
  q.k = 4096;  // 64 KiB of x: not staged, so no norm
  q.x_row_stride = 4096;
  EXPECT_STREQ(cuda::CheckDecodeGemvParams(q, bf16), "x does not fit shared memory for the norm");
  q.rows = 1;
  q.k = 16384;  // staged, but more chunks than the norm holds in registers
  q.x_row_stride = 16384;
  EXPECT_STREQ(cuda::CheckDecodeGemvParams(q, bf16), "k too large for the norm");
  q = p;
  q.silu_mul = true;  // x's rows must hold gate and up: 2k wide
  EXPECT_STREQ(cuda::CheckDecodeGemvParams(q, bf16), "silu_mul: x rows narrower than 2k");
  q.x_row_stride = 32;
  EXPECT_EQ(cuda::CheckDecodeGemvParams(q, bf16), nullptr);
  q.norm.weight = buffer;
  EXPECT_STREQ(cuda::CheckDecodeGemvParams(q, bf16), "silu_mul with a norm");
}

// The grid: every warp the same number of rows of W, in one wave.
TEST(DecodeGemvEmulationTest, TheGridGivesEveryWarpTheSameRowsInOneWave) {
  struct Case {
    int64_t n, resident, ctas;
  };
  // 8 rows of W a CTA at a time; an H200's 132 SMs at 4 or 2 CTAs each.
  const Case cases[] = {{4096, 528, 512},    // o_proj: one row a warp
                        {6144, 528, 384},    // q | k | v: two rows a warp, not 1.45 waves
                        {6144, 264, 256},    // (the norm's kernel: 2 an SM) three rows a warp
                        {28672, 528, 512},   // gate | up: seven rows a warp
                        {128256, 528, 518},  // lm_head: 31 rows a warp (the last CTAs' fewer)
                        {5, 528, 1},        {17, 1, 1}, {17, 0, 1}};
  for (const Case& c : cases) {
    const int64_t ctas = cuda::DecodeGemvCtas(c.n, c.resident);
    EXPECT_EQ(ctas, c.ctas) << c.n << " rows over " << c.resident;
    EXPECT_LE(ctas, std::max<int64_t>(c.resident, 1));
    // The warps' rows differ by at most one, and only where n is not whole rounds.
    const int64_t groups = (c.n + 7) / 8, rounds = (groups + ctas - 1) / ctas;
    EXPECT_GT(ctas * rounds, groups - ctas) << c.n;
  }
}

TEST(DecodeGemvTest, TheWrappersDeclineCpuTensors) {
  c10::InferenceMode inference;
  const at::Tensor x = at::randn({1, 16}), w = at::randn({4, 16}), g = at::ones({16});
  EXPECT_FALSE(internal::FusedDecodeLinear(x, w, at::Tensor()).has_value());
  EXPECT_FALSE(internal::FusedNormLinear(x, x, g, 1e-6, false, w, at::Tensor()).has_value());
  EXPECT_FALSE(internal::FusedSiluMulLinear(at::randn({1, 32}), w, at::Tensor()).has_value());
  EXPECT_FALSE(internal::DecodeGemvMayTake(x));
  nn::RMSNorm norm("RMSNorm", 16, 1e-6, at::kFloat);
  EXPECT_FALSE(norm.NormThenLinear(x, at::Tensor(), w, at::Tensor()).has_value());
}

// On a device: the GEMV against libtorch's product (within float32's bound:
// cuBLAS adds in another order), the fused norm bit for bit the norm kernel
// then the GEMV, and nn::Linear / the switch routing through them.
TEST(DecodeGemvTest, OnCudaTheKernelMatchesLibtorchAndTheNormKernel) {
  if (!internal::FusedCudaOpsBuilt() || !at::hasCUDA()) {
    GTEST_SKIP() << "no fused CUDA kernels in this build, or no CUDA device";
  }
  c10::InferenceMode inference;
  const at::Device gpu(at::kCUDA, 0);
  internal::SetCudaDecodeGemv(true);  // (whatever ACCEL_CUDA_DECODE_GEMV says)
  internal::SetCudaDecodeGemvRows(8);
  for (const DType& dtype : kDTypes) {
    for (int64_t rows : {1, 4, 8}) {
      const std::string what = std::string(dtype.name) + " rows " + std::to_string(rows);
      at::manual_seed(static_cast<uint64_t>(rows));
      const at::Tensor x = (at::randn({1, rows, 4096}) * 2.0).to(dtype.type).to(gpu);
      const at::Tensor weight = (at::randn({6144, 4096}) * 0.02).to(dtype.type).to(gpu);
      const at::Tensor bias = at::randn({6144}).to(dtype.type).to(gpu);
      const std::optional<at::Tensor> got = internal::FusedDecodeLinear(x, weight, bias);
      ASSERT_TRUE(got) << what;
      ASSERT_EQ(got->sizes(), (std::vector<int64_t>{1, rows, 6144})) << what;
      ExpectWithinBound(got->cpu()[0], x.cpu()[0], weight.cpu(), bias.cpu(), what);
      // nn::DenseLinear routes a decode step's rows through it.
      EXPECT_TRUE(at::equal(nn::DenseLinear(x, weight, bias), *got)) << what;
      internal::SetCudaDecodeGemv(false);
      EXPECT_FALSE(internal::FusedDecodeLinear(x, weight, bias).has_value()) << what;
      internal::SetCudaDecodeGemv(true);
      EXPECT_TRUE(internal::DecodeGemvMayTake(x)) << what;
      internal::SetCudaDecodeGemvRows(rows - 1);
      EXPECT_FALSE(internal::DecodeGemvMayTake(x)) << what;
      EXPECT_FALSE(internal::FusedDecodeLinear(x, weight, bias).has_value()) << what;
      internal::SetCudaDecodeGemvRows(8);

      // SiLU(gate) * up inside: FusedSiluMul's output then the GEMV, to the bit.
      const at::Tensor gate_up =
          (at::randn({1, rows, int64_t{2} * 4096}) * 2.0).to(dtype.type).to(gpu);
      const std::optional<at::Tensor> activated =
          internal::FusedSiluMul(gate_up.narrow(-1, 0, 4096), gate_up.narrow(-1, 4096, 4096));
      ASSERT_TRUE(activated) << what;
      const std::optional<at::Tensor> silu_got =
          internal::FusedSiluMulLinear(gate_up, weight, bias);
      if (rows * 4096 * static_cast<int64_t>(weight.element_size()) <=
          cuda::kDecodeGemvSharedBytes) {
        ASSERT_TRUE(silu_got) << what;
        EXPECT_TRUE(at::equal(*silu_got, *internal::FusedDecodeLinear(*activated, weight, bias)))
            << what;
      } else {
        EXPECT_FALSE(silu_got.has_value()) << what;
      }
      // Autograd recording a tensor: the kernels decline (no backward).
      {
        c10::InferenceMode off(false);
        const at::Tensor trained = at::randn({16, 4096}, weight.options()).set_requires_grad(true);
        const at::Tensor plain = at::randn({1, 1, 4096}, x.options());
        EXPECT_FALSE(internal::FusedDecodeLinear(plain, trained, at::Tensor()).has_value()) << what;
      }

      const at::Tensor residual = (at::randn({1, rows, 4096})).to(dtype.type).to(gpu);
      const at::Tensor norm_weight = (at::randn({4096}) * 0.5 + 1.0).to(dtype.type).to(gpu);
      const std::optional<std::pair<at::Tensor, at::Tensor>> fused =
          internal::FusedNormLinear(x, residual, norm_weight, 1e-5, false, weight, bias);
      if (rows * 4096 * static_cast<int64_t>(weight.element_size()) >
          cuda::kDecodeGemvSharedBytes) {
        EXPECT_FALSE(fused.has_value()) << what;  // x does not fit: the caller norms first
        continue;
      }
      ASSERT_TRUE(fused) << what;
      const std::optional<std::pair<at::Tensor, at::Tensor>> separate =
          internal::FusedAddRmsNorm(x, residual, norm_weight, 1e-5, false);
      ASSERT_TRUE(separate) << what;
      EXPECT_TRUE(at::equal(fused->first, separate->first)) << what;
      EXPECT_TRUE(
          at::equal(fused->second, *internal::FusedDecodeLinear(separate->second, weight, bias)))
          << what;
    }
  }
}

}  // namespace
}  // namespace accel::models
