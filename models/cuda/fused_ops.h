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
// With `residual` (vLLM's fused_add_rms_norm): the row normalized is
// x + residual, added in float32 and rounded to the storage type as the
// eager add does, and that sum is written to `sum` too (the residual stream
// the next block adds to); residual and sum are laid out as x.
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
  const void* residual = nullptr;
  void* sum = nullptr;
  int64_t residual_row_stride = 0;
  int64_t sum_row_stride = 0;
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

// A static decode step's rotary embedding and KV write in one kernel (one
// token a row): q and k rotated as RotaryParams' formula does, q written to
// `q_out` (contiguous [rows, heads, dim]: what the paged decode kernels
// read), the rotated k and v written at each row's slot (slot_blocks[r],
// slot_offsets[r], on the device) of the layer's blocks [num_blocks,
// kv_heads, block_size, dim | value_dim]. q, k and v: [rows, heads |
// kv_heads, dim | value_dim] at the given element strides (the last
// dimension contiguous); cos and sin: a row of `dim` per row.
struct RotaryStoreParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_row_stride = 0, q_head_stride = 0;
  int64_t k_row_stride = 0, k_head_stride = 0;
  int64_t v_row_stride = 0, v_head_stride = 0;
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t cos_row_stride = 0, sin_row_stride = 0;
  const int64_t* slot_blocks = nullptr;
  const int64_t* slot_offsets = nullptr;
  void* q_out = nullptr;
  void* key_blocks = nullptr;
  void* value_blocks = nullptr;
  int32_t rows = 0, heads = 0, kv_heads = 0, dim = 0, value_dim = 0, block_size = 0;
};

// Work items of a RotaryStoreParams launch: q's rotary pairs, then k's, then
// v's elements.
ACCEL_MODELS_HD int64_t RotaryStoreItems(const RotaryStoreParams& p) {
  const int64_t half = p.dim / 2;
  return static_cast<int64_t>(p.rows) * ((static_cast<int64_t>(p.heads) + p.kv_heads) * half +
                                         static_cast<int64_t>(p.kv_heads) * p.value_dim);
}

// Why the kernels cannot take these parameters, or null when they can.
inline const char* CheckRmsNormParams(const RmsNormParams& p) {
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) return "a null pointer";
  if (p.rows < 1 || p.rows > 2147483647 || p.dim < 1) return "rows or dim out of range";
  if (p.x_row_stride < p.dim || p.out_row_stride < p.dim) return "rows overlap";
  if (p.residual != nullptr &&
      (p.sum == nullptr || p.residual_row_stride < p.dim || p.sum_row_stride < p.dim)) {
    return "a residual without a sum, or residual or sum rows overlap";
  }
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
inline const char* CheckRotaryStoreParams(const RotaryStoreParams& p) {
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.cos == nullptr || p.sin == nullptr ||
      p.slot_blocks == nullptr || p.slot_offsets == nullptr || p.q_out == nullptr ||
      p.key_blocks == nullptr || p.value_blocks == nullptr) {
    return "a null pointer";
  }
  if (p.rows < 1 || p.heads < 1 || p.kv_heads < 1 || p.dim < 2 || p.dim % 2 != 0 ||
      p.value_dim < 1 || p.block_size < 1) {
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
