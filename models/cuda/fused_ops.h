// models/cuda/fused_ops.h: the small per-layer operations of a decoder step
// as one kernel each, where eager libtorch launches several: RMSNorm (8
// kernels eagerly: cast, pow, mean, add, rsqrt, mul, cast, mul), the rotary
// embedding (5: neg, cat, mul, mul, add) and SiLU(gate) * up (2). At batch 1
// on a GPU each kernel is a few microseconds whatever its size, and a layer
// launches about 45 of them, so a decode step of an 8B model spent about 5 ms
// of its 8.8 ms (CUDA graphs, H200, docs/BENCHMARKS.md) outside the weights'
// reading; these take 13 launches a layer out.
//
// Each computes what the eager formulas in models/nn.cc compute, rounding to
// the storage dtype where they round (so a bfloat16 result equals the eager
// one but for the float32 sum of squares' order and rsqrt's last bit):
//   RmsNorm:  h = float(x); r = rsqrt(sum(h*h) / dim + eps);
//             out = w * dtype(h * r)           (w and out in dtype), or with
//             unit_offset (Gemma) out = dtype(h * r * (1 + float(w)))
//   Rotary:   out = dtype(dtype(x * cos) + dtype(rotate_half(x) * sin)),
//             rotate_half(x) = cat(-x[half:], x[:half])
//   SiluMul:  out = dtype(dtype(silu(gate)) * up), silu(g) = g / (1 + exp(-g))
// Raw pointers and a stream, no libtorch (as attention_kernels.h); the
// at::Tensor wrappers are models/internal/fused_ops.h. The work of a row or an
// element is in models/cuda/internal/fused_ops.h, shared with the host
// emulation that tests it on a machine without a GPU.
#ifndef ACCEL_MODELS_CUDA_FUSED_OPS_H_
#define ACCEL_MODELS_CUDA_FUSED_OPS_H_

#include <cstdint>

#include "models/cuda/paged_decode_params.h"

namespace accel::models::cuda {

// Threads of an RMSNorm CTA (one CTA a row).
inline constexpr int32_t kRmsNormThreads = 256;

// x and out: `rows` rows of `dim` elements, each row's elements contiguous,
// rows `x_row_stride` / `out_row_stride` elements apart; weight: `dim`.
struct RmsNormParams {
  const void* x = nullptr;
  const void* weight = nullptr;
  void* out = nullptr;
  int64_t rows = 0;
  int32_t dim = 0;
  int64_t x_row_stride = 0;
  int64_t out_row_stride = 0;
  float eps = 0.0f;
  bool unit_offset = false;
};

// x: [batch, heads, tokens, dim] at the given strides (elements; the last
// dimension contiguous); cos and sin: [batch, tokens, dim] at theirs (shared
// by every head); out: contiguous [batch, heads, tokens, dim]. dim is even.
struct RotaryParams {
  const void* x = nullptr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  void* out = nullptr;
  int32_t batch = 0, heads = 0, tokens = 0, dim = 0;
  int64_t x_batch_stride = 0, x_head_stride = 0, x_token_stride = 0;
  int64_t cos_batch_stride = 0, cos_token_stride = 0;
  int64_t sin_batch_stride = 0, sin_token_stride = 0;
};

// gate and up: `rows` rows of `dim` contiguous elements, rows
// `gate_row_stride` / `up_row_stride` apart; out: contiguous [rows, dim].
struct SiluMulParams {
  const void* gate = nullptr;
  const void* up = nullptr;
  void* out = nullptr;
  int64_t rows = 0;
  int32_t dim = 0;
  int64_t gate_row_stride = 0;
  int64_t up_row_stride = 0;
};

// Why the kernels cannot take these parameters, or null when they can.
inline const char* CheckRmsNormParams(const RmsNormParams& p) {
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) return "a null pointer";
  if (p.rows < 1 || p.rows > 2147483647 || p.dim < 1) return "rows or dim out of range";
  if (p.x_row_stride < p.dim || p.out_row_stride < p.dim) return "rows overlap";
  return nullptr;
}
inline const char* CheckRotaryParams(const RotaryParams& p) {
  if (p.x == nullptr || p.cos == nullptr || p.sin == nullptr || p.out == nullptr) {
    return "a null pointer";
  }
  if (p.batch < 1 || p.heads < 1 || p.tokens < 1 || p.dim < 2 || p.dim % 2 != 0) {
    return "shape out of range (dim must be even)";
  }
  return nullptr;
}
inline const char* CheckSiluMulParams(const SiluMulParams& p) {
  if (p.gate == nullptr || p.up == nullptr || p.out == nullptr) return "a null pointer";
  if (p.rows < 1 || p.dim < 1) return "rows or dim out of range";
  if (p.gate_row_stride < p.dim || p.up_row_stride < p.dim) return "rows overlap";
  return nullptr;
}

}  // namespace accel::models::cuda

#endif  // ACCEL_MODELS_CUDA_FUSED_OPS_H_
