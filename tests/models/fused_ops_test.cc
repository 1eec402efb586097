// The fused decoder-step kernels (models/cuda/fused_ops.h): their code run on
// the host (RMSNorm's CTA emulated thread by thread, tests/testing/
// cta_emulator.h; the element kernels element by element), against the eager
// formulas they replace (nn::RMSNorm, nn::ApplyRotary, Activation * up on the
// cpu, where the kernels never run), in float32, bfloat16 and float16, over
// strided inputs as the decoder passes them. On a device (skipped elsewhere):
// the wrappers (models/internal/fused_ops.h) against the same formulas run
// eagerly on the device.
#include "models/internal/fused_ops.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/TensorIndexing.h>
#include <ATen/TensorOperators.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "models/cuda/fused_ops.h"
#include "models/cuda/internal/fused_ops.h"
#include "models/nn.h"
#include "tests/models/fused_ops_emulation.h"

namespace accel::models {
namespace {

using DType = testing::KernelDType;
constexpr const auto& kDTypes = testing::kKernelDTypes;
using testing::EmulateRmsNorm;

// One rounding of the storage dtype, relative (the kernels' float32 sums run
// in another order than libtorch's, and rsqrt / exp may differ in a last
// float32 bit, which can move a 16-bit result by one step).
double Ulp(at::ScalarType type) {
  return type == at::kBFloat16 ? 1.0 / 128 : type == at::kHalf ? 1.0 / 1024 : 4e-6;
}

// Every element of `got` within `ulps` roundings of `want` (relative to the
// larger magnitude, with a floor for values near zero).
void ExpectClose(const at::Tensor& got, const at::Tensor& want, double ulps,
                 const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const at::Tensor g = got.to(at::kDouble).cpu(), w = want.to(at::kDouble).cpu();
  const at::Tensor bound =
      ulps * Ulp(got.scalar_type()) * at::maximum(g.abs(), w.abs()).clamp_min(1e-3);
  const at::Tensor excess = (g - w).abs() - bound;
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max |diff| " << (g - w).abs().max().item<double>();
  // In 16 bits most elements equal to the bit: a kernel that computed
  // something else within the tolerance would not. (In float32 a row's
  // RMSNorm factor one bit off moves every element of the row.)
  if (got.scalar_type() != at::kFloat) {
    const double equal = g.eq(w).to(at::kDouble).mean().item<double>();
    EXPECT_GE(equal, 0.9) << what;
  }
}

template <typename Tag, typename Params, typename Fn>
void ForEach(const Params& p, int64_t n, Fn fn) {
  for (int64_t i = 0; i < n; ++i) fn(Tag{}, p, i);
}

template <typename Params, typename Fn>
void ForEachAs(cuda::KvDType dtype, const Params& p, int64_t n, Fn fn) {
  switch (dtype) {
    case cuda::KvDType::kFloat32:
      return ForEach<cuda::internal::Float32>(p, n, fn);
    case cuda::KvDType::kBFloat16:
      return ForEach<cuda::internal::BFloat16>(p, n, fn);
    case cuda::KvDType::kFloat16:
      return ForEach<cuda::internal::Float16>(p, n, fn);
  }
}

TEST(FusedOpsEmulationTest, RmsNormEqualsTheEagerFormula) {
  c10::InferenceMode inference;
  for (const DType& dtype : kDTypes) {
    for (int64_t dim : {7, 64, 300, 4096}) {
      for (bool unit_offset : {false, true}) {
        const std::string what = std::string(dtype.name) + " dim " + std::to_string(dim) +
                                 (unit_offset ? " unit offset" : "");
        at::manual_seed(static_cast<uint64_t>(dim));
        // Rows of a [2, 3, dim] activation, values around the size a
        // residual stream has.
        const at::Tensor x = (at::randn({2, 3, dim}) * 3.0).to(dtype.type);
        nn::RMSNorm norm("RMSNorm", dim, 1e-6, dtype.type, unit_offset);
        norm.weight.copy_(at::randn({dim}) * 0.5 + (unit_offset ? 0.0 : 1.0));
        const at::Tensor want = norm.forward(x);  // the cpu: the eager formula
        at::Tensor got = at::empty_like(x);
        cuda::RmsNormParams p;
        p.x = x.data_ptr();
        p.weight = norm.weight.data_ptr();
        p.out = got.data_ptr();
        p.rows = 6;
        p.dim = static_cast<int32_t>(dim);
        p.x_row_stride = p.out_row_stride = dim;
        p.eps = 1e-6f;
        p.unit_offset = unit_offset;
        ASSERT_EQ(cuda::CheckRmsNormParams(p), nullptr);
        ASSERT_EQ(EmulateRmsNorm(p, dtype.kernel), "") << what;
        ExpectClose(got, want, 1.0, what);
      }
    }
  }
}

// With a residual (the decoder's add before its post-attention norm): the
// sum the kernel stores is the eager add's, bit for bit, and the norm of it
// the eager norm's, over the 16-byte path and the per-element one.
TEST(FusedOpsEmulationTest, AddRmsNormEqualsTheEagerAddThenNorm) {
  c10::InferenceMode inference;
  for (const DType& dtype : kDTypes) {
    for (int64_t dim : {7, 64, 300, 4096}) {
      const std::string what = std::string(dtype.name) + " dim " + std::to_string(dim);
      at::manual_seed(static_cast<uint64_t>(dim) + 1);
      const at::Tensor x = (at::randn({2, 3, dim}) * 3.0).to(dtype.type);
      const at::Tensor residual = (at::randn({2, 3, dim}) * 2.0).to(dtype.type);
      nn::RMSNorm norm("RMSNorm", dim, 1e-6, dtype.type);
      norm.weight.copy_(at::randn({dim}) * 0.5 + 1.0);
      const at::Tensor sum_want = x + residual;  // the cpu: the eager formulas
      const at::Tensor want = norm.forward(sum_want);
      at::Tensor got = at::empty_like(x), sum_got = at::full_like(x, 7.0);
      cuda::RmsNormParams p;
      p.x = x.data_ptr();
      p.residual = residual.data_ptr();
      p.weight = norm.weight.data_ptr();
      p.out = got.data_ptr();
      p.sum = sum_got.data_ptr();
      p.rows = 6;
      p.dim = static_cast<int32_t>(dim);
      p.x_row_stride = p.out_row_stride = p.residual_row_stride = p.sum_row_stride = dim;
      p.eps = 1e-6f;
      ASSERT_EQ(cuda::CheckRmsNormParams(p), nullptr);
      ASSERT_EQ(EmulateRmsNorm(p, dtype.kernel), "") << what;
      EXPECT_TRUE(at::equal(sum_got, sum_want)) << what;
      ExpectClose(got, want, 1.0, what);
      // And bit for bit the kernel's own norm of the eager sum.
      at::Tensor alone = at::empty_like(x);
      cuda::RmsNormParams q = p;
      q.x = sum_want.data_ptr();
      q.out = alone.data_ptr();
      q.residual = nullptr;
      q.sum = nullptr;
      ASSERT_EQ(EmulateRmsNorm(q, dtype.kernel), "") << what;
      EXPECT_TRUE(at::equal(got, alone)) << what;
      // Through the module on the cpu: the eager add and norm.
      const auto [sum_eager, normed_eager] = norm.AddForward(x, residual);
      EXPECT_TRUE(at::equal(sum_eager, sum_want)) << what;
      EXPECT_TRUE(at::equal(normed_eager, want)) << what;
    }
  }
  cuda::RmsNormParams bad;
  int64_t word = 0;
  bad.x = bad.weight = bad.residual = &word;
  bad.out = &word;
  bad.rows = 1;
  bad.dim = 1;
  bad.x_row_stride = bad.out_row_stride = bad.residual_row_stride = 1;
  EXPECT_STREQ(cuda::CheckRmsNormParams(bad),
               "a residual without a sum, or residual or sum rows overlap");
}

TEST(FusedOpsEmulationTest, RotaryEqualsTheEagerFormulaOverTheDecodersStrides) {
  c10::InferenceMode inference;
  for (const DType& dtype : kDTypes) {
    for (int64_t cos_batch : {1, 2}) {
      const std::string what = std::string(dtype.name) + " cos batch " + std::to_string(cos_batch);
      at::manual_seed(5);
      const int64_t batch = 2, tokens = 3, heads = 4, dim = 64;
      // As the decoder: q [batch, tokens, heads, dim] viewed as [batch, heads, tokens, dim].
      const at::Tensor q = at::randn({batch, tokens, heads, dim}).to(dtype.type);
      const at::Tensor x = q.transpose(1, 2);
      const at::Tensor angles = at::randn({cos_batch, tokens, dim}) * 3.0;
      const at::Tensor cos = at::cos(angles).to(dtype.type), sin = at::sin(angles).to(dtype.type);
      // The eager formula, as nn::ApplyRotary writes it.
      const at::Tensor rotated =
          at::cat({-x.narrow(-1, dim / 2, dim / 2), x.narrow(-1, 0, dim / 2)}, -1);
      const at::Tensor want = x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
      at::Tensor got = at::empty({batch, heads, tokens, dim}, x.options());
      cuda::RotaryParams p;
      p.x = x.data_ptr();
      p.cos = cos.data_ptr();
      p.sin = sin.data_ptr();
      p.out = got.data_ptr();
      p.batch = static_cast<int32_t>(batch);
      p.heads = static_cast<int32_t>(heads);
      p.tokens = static_cast<int32_t>(tokens);
      p.dim = static_cast<int32_t>(dim);
      p.x_batch_stride = x.stride(0);
      p.x_head_stride = x.stride(1);
      p.x_token_stride = x.stride(2);
      p.cos_batch_stride = p.sin_batch_stride = cos_batch == 1 ? 0 : cos.stride(0);
      p.cos_token_stride = p.sin_token_stride = cos.stride(1);
      ASSERT_EQ(cuda::CheckRotaryParams(p), nullptr);
      ForEachAs(dtype.kernel, p, batch * heads * tokens * dim / 2,
                [](auto tag, const cuda::RotaryParams& params, int64_t i) {
                  cuda::internal::RotaryPair<decltype(tag)>(params, i);
                });
      // Products and the sum rounded as libtorch rounds them: equal to the bit.
      EXPECT_TRUE(at::equal(got, want.contiguous())) << what;
    }
  }
}

// The static decode step's rotary + KV write (RotaryStoreParams): q from a
// packed q/k/v row rotated into q_out, k rotated and v copied into each row's
// slot of the blocks, equal to the bit to the eager rotary and an indexed
// write; every other slot untouched.
TEST(FusedOpsEmulationTest, RotaryStoreEqualsTheRotaryThenTheSlotWrites) {
  c10::InferenceMode inference;
  for (const DType& dtype : kDTypes) {
    const std::string what = dtype.name;
    at::manual_seed(6);
    const int64_t rows = 3, heads = 4, kv_heads = 2, dim = 64, block_size = 4, blocks = 6;
    // One token a row: q, k and v narrowed from a packed projection.
    const at::Tensor qkv = at::randn({1, rows, (heads + 2 * kv_heads) * dim}).to(dtype.type);
    const at::Tensor q = qkv.narrow(-1, 0, heads * dim).view({1, rows, heads, dim});
    const at::Tensor k = qkv.narrow(-1, heads * dim, kv_heads * dim).view({1, rows, kv_heads, dim});
    const at::Tensor v =
        qkv.narrow(-1, (heads + kv_heads) * dim, kv_heads * dim).view({1, rows, kv_heads, dim});
    const at::Tensor angles = at::randn({1, rows, dim}) * 3.0;
    const at::Tensor cos = at::cos(angles).to(dtype.type), sin = at::sin(angles).to(dtype.type);
    const auto eager_rotary = [&](const at::Tensor& x) {  // x [1, heads, rows, dim]
      const at::Tensor rotated =
          at::cat({-x.narrow(-1, dim / 2, dim / 2), x.narrow(-1, 0, dim / 2)}, -1);
      return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
    };
    const std::vector<int64_t> slot_blocks = {5, 0, 3}, slot_offsets = {1, 3, 0};
    const at::Tensor key_before = at::randn({blocks, kv_heads, block_size, dim}).to(dtype.type);
    const at::Tensor value_before = at::randn({blocks, kv_heads, block_size, dim}).to(dtype.type);
    at::Tensor key_blocks = key_before.clone(), value_blocks = value_before.clone();
    at::Tensor q_out = at::empty({rows, heads, dim}, q.options());
    const at::Tensor blocks_of_rows = at::tensor(slot_blocks, at::kLong);
    const at::Tensor offsets_of_rows = at::tensor(slot_offsets, at::kLong);
    // The wrapper's parameters (FusedRotaryStore passes the same).
    const cuda::RotaryStoreParams p = internal::RotaryStoreParamsFor(
        q, k, v, cos, sin, blocks_of_rows, offsets_of_rows, q_out, key_blocks, value_blocks);
    ASSERT_EQ(cuda::CheckRotaryStoreParams(p), nullptr);
    ForEachAs(dtype.kernel, p, cuda::RotaryStoreItems(p),
              [](auto tag, const cuda::RotaryStoreParams& params, int64_t i) {
                cuda::internal::RotaryStoreItem<decltype(tag)>(params, i);
              });
    // q_out [rows, heads, dim]: the eager rotary of q [1, heads, rows, dim].
    EXPECT_TRUE(at::equal(q_out, eager_rotary(q.transpose(1, 2))[0].transpose(0, 1))) << what;
    const at::Tensor k_rotated = eager_rotary(k.transpose(1, 2))[0];  // [kv_heads, rows, dim]
    at::Tensor want_keys = key_before.clone(), want_values = value_before.clone();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = slot_blocks[static_cast<size_t>(r)];
      const int64_t o = slot_offsets[static_cast<size_t>(r)];
      want_keys[b].select(1, o).copy_(k_rotated.select(1, r));
      want_values[b].select(1, o).copy_(v[0][r]);
    }
    EXPECT_TRUE(at::equal(key_blocks, want_keys)) << what;
    EXPECT_TRUE(at::equal(value_blocks, want_values)) << what;
  }
}

TEST(FusedOpsEmulationTest, SiluMulEqualsTheEagerFormulaOnAFusedGateUp) {
  c10::InferenceMode inference;
  for (const DType& dtype : kDTypes) {
    at::manual_seed(9);
    const int64_t rows = 5, inter = 96;
    // Phi-3's gate_up_proj output, narrowed into gate and up (rows 2 * inter apart).
    const at::Tensor both = (at::randn({1, rows, 2 * inter}) * 4.0).to(dtype.type);
    const at::Tensor gate = both.narrow(-1, 0, inter), up = both.narrow(-1, inter, inter);
    // SiLU in float32 rounded once, as libtorch's CUDA kernel computes it
    // (its cpu kernel for bfloat16 rounds inside the formula: 1 + exp(-g)
    // is 1 in bfloat16 once g > 5.5), then the product.
    const at::Tensor want = at::silu(gate.to(at::kFloat)).to(dtype.type) * up;
    at::Tensor got = at::empty(gate.sizes(), gate.options());
    cuda::SiluMulParams p;
    p.gate = gate.data_ptr();
    p.up = up.data_ptr();
    p.out = got.data_ptr();
    p.rows = rows;
    p.dim = static_cast<int32_t>(inter);
    p.gate_row_stride = p.up_row_stride = 2 * inter;
    ASSERT_EQ(cuda::CheckSiluMulParams(p), nullptr);
    ForEachAs(dtype.kernel, p, rows * inter,
              [](auto tag, const cuda::SiluMulParams& params, int64_t i) {
                cuda::internal::SiluMulAt<decltype(tag)>(params, i);
              });
    ExpectClose(got, want, 1.0, dtype.name);
  }
}

TEST(FusedOpsEmulationTest, ParametersTheKernelsCannotTakeAreNamed) {
  cuda::RmsNormParams norm;
  EXPECT_NE(cuda::CheckRmsNormParams(norm), nullptr);
  cuda::RotaryParams rotary;
  int32_t dummy = 0;
  rotary.x = rotary.cos = rotary.sin = &dummy;
  rotary.out = &dummy;
  rotary.batch = rotary.heads = rotary.tokens = 1;
  rotary.dim = 7;  // odd: no halves
  EXPECT_NE(cuda::CheckRotaryParams(rotary), nullptr);
  rotary.dim = 8;
  EXPECT_EQ(cuda::CheckRotaryParams(rotary), nullptr);
  cuda::SiluMulParams silu;
  silu.gate = silu.up = &dummy;
  silu.out = &dummy;
  silu.rows = 2;
  silu.dim = 8;
  silu.gate_row_stride = 4;  // rows would overlap
  silu.up_row_stride = 8;
  EXPECT_NE(cuda::CheckSiluMulParams(silu), nullptr);
}

// On the cpu the wrappers decline, and the eager formulas run.
TEST(FusedOpsTest, TheWrappersDeclineCpuTensors) {
  c10::InferenceMode inference;
  const at::Tensor x = at::randn({2, 8}), w = at::ones({8});
  EXPECT_FALSE(internal::FusedRmsNorm(x, w, 1e-6, false).has_value());
  EXPECT_FALSE(internal::FusedAddRmsNorm(x, x, w, 1e-6, false).has_value());
  const at::Tensor q = at::randn({1, 2, 3, 8}), cs = at::randn({1, 3, 8});
  EXPECT_FALSE(internal::FusedRotary(q, cs, cs).has_value());
  EXPECT_FALSE(internal::FusedSiluMul(x, x).has_value());
}

// On a device: each wrapper against the eager formulas on the same device.
TEST(FusedOpsTest, OnCudaTheKernelsEqualTheEagerFormulas) {
  if (!internal::FusedCudaOpsBuilt() || !at::hasCUDA()) {
    GTEST_SKIP() << "no fused CUDA kernels in this build, or no CUDA device";
  }
  c10::InferenceMode inference;
  const at::Device gpu(at::kCUDA, 0);
  for (const DType& dtype : kDTypes) {
    at::manual_seed(3);
    nn::RMSNorm norm("RMSNorm", 4096, 1e-5, dtype.type);
    norm.weight.copy_(at::randn({4096}) * 0.5 + 1.0);
    norm.weight = norm.weight.to(gpu);
    const at::Tensor x = (at::randn({1, 5, 4096}) * 3.0).to(dtype.type).to(gpu);
    const at::Tensor q = at::randn({1, 5, 32, 128}).to(dtype.type).to(gpu).transpose(1, 2);
    const at::Tensor angles = at::randn({1, 5, 128}) * 3.0;
    const at::Tensor cos = at::cos(angles).to(dtype.type).to(gpu);
    const at::Tensor sin = at::sin(angles).to(dtype.type).to(gpu);
    const at::Tensor both = (at::randn({1, 5, 2048}) * 4.0).to(dtype.type).to(gpu);
    const at::Tensor gate = both.narrow(-1, 0, 1024), up = both.narrow(-1, 1024, 1024);

    internal::SetFusedCudaOps(false);
    const at::Tensor norm_want = norm.forward(x);
    const at::Tensor rotary_want = nn::ApplyRotary(q, cos, sin);
    const at::Tensor silu_want = nn::ActivationTimes("silu", gate, up);
    internal::SetFusedCudaOps(true);
    const std::optional<at::Tensor> norm_got = internal::FusedRmsNorm(x, norm.weight, 1e-5, false);
    const std::optional<at::Tensor> rotary_got = internal::FusedRotary(q, cos, sin);
    const std::optional<at::Tensor> silu_got = internal::FusedSiluMul(gate, up);
    ASSERT_TRUE(norm_got && rotary_got && silu_got) << dtype.name;
    ExpectClose(*norm_got, norm_want, 1.0, std::string("RMSNorm ") + dtype.name);
    ExpectClose(*rotary_got, rotary_want, 0.0, std::string("rotary ") + dtype.name);
    ExpectClose(*silu_got, silu_want, 1.0, std::string("SiLU * up ") + dtype.name);
    // Through the modules, as the decoder calls them.
    ExpectClose(norm.forward(x), norm_want, 1.0, std::string("nn::RMSNorm ") + dtype.name);
    // The residual add and the norm in one launch: the eager add's bits, and
    // the fused norm's of that sum.
    const at::Tensor residual = (at::randn({1, 5, 4096}) * 2.0).to(dtype.type).to(gpu);
    const std::optional<std::pair<at::Tensor, at::Tensor>> added =
        internal::FusedAddRmsNorm(x, residual, norm.weight, 1e-5, false);
    ASSERT_TRUE(added) << dtype.name;
    EXPECT_TRUE(at::equal(added->first, x + residual)) << dtype.name;
    EXPECT_TRUE(
        at::equal(added->second, *internal::FusedRmsNorm(x + residual, norm.weight, 1e-5, false)))
        << dtype.name;

    // The static decode step's rotary + KV write: q [1, rows = 5, 32, 128]
    // and k, v [1, 5, 8, 128] from one packed projection, the rows' slots in
    // blocks of 16.
    constexpr int64_t kDim = 128;
    const at::Tensor qkv = at::randn({1, 5, (32 + 16) * kDim}).to(dtype.type).to(gpu);
    const at::Tensor pq = qkv.narrow(-1, 0, 32 * kDim).view({1, 5, 32, kDim});
    const at::Tensor pk = qkv.narrow(-1, 32 * kDim, 8 * kDim).view({1, 5, 8, kDim});
    const at::Tensor pv = qkv.narrow(-1, 40 * kDim, 8 * kDim).view({1, 5, 8, kDim});
    const at::Tensor slot_blocks = at::tensor(std::vector<int64_t>{3, 0, 7, 3, 1}).to(gpu);
    const at::Tensor slot_offsets = at::tensor(std::vector<int64_t>{0, 15, 2, 1, 9}).to(gpu);
    const at::Tensor key_before = at::randn({8, 8, 16, 128}).to(dtype.type).to(gpu);
    at::Tensor key_blocks = key_before.clone(), value_blocks = key_before.clone();
    const std::optional<at::Tensor> q_rotated = internal::FusedRotaryStore(
        pq, pk, pv, cos, sin, slot_blocks, slot_offsets, key_blocks, value_blocks);
    ASSERT_TRUE(q_rotated) << dtype.name;
    internal::SetFusedCudaOps(false);
    const at::Tensor q_want = nn::ApplyRotary(pq.transpose(1, 2), cos, sin)[0].transpose(0, 1);
    const at::Tensor k_want = nn::ApplyRotary(pk.transpose(1, 2), cos, sin)[0].transpose(0, 1);
    internal::SetFusedCudaOps(true);
    ExpectClose(*q_rotated, q_want, 0.0, std::string("rotary store q ") + dtype.name);
    at::Tensor keys_want = key_before.clone(), values_want = key_before.clone();
    keys_want.index_put_({slot_blocks, at::indexing::Slice(), slot_offsets}, k_want);
    values_want.index_put_({slot_blocks, at::indexing::Slice(), slot_offsets}, pv[0]);
    EXPECT_TRUE(at::equal(key_blocks, keys_want)) << dtype.name;
    EXPECT_TRUE(at::equal(value_blocks, values_want)) << dtype.name;
  }
}

}  // namespace
}  // namespace accel::models
