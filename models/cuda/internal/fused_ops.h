// models/cuda/internal/fused_ops.h: the work of one RMSNorm row (a CTA) and
// of one rotary pair or SiLU-times-up element (a thread), written once for
// the device kernels (models/cuda/fused_ops.cu) and for the host emulation
// that tests them (tests/models/cuda_fused_ops_test.cc), as
// internal/paged_decode.h is. Products and sums that eager libtorch rounds
// separately are kept apart here (MulRn / AddRn: no fused multiply-add on
// the device, where nvcc would otherwise contract them).
#ifndef ACCEL_MODELS_CUDA_INTERNAL_FUSED_OPS_H_
#define ACCEL_MODELS_CUDA_INTERNAL_FUSED_OPS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>

#include "models/cuda/fused_ops.h"
#include "models/cuda/internal/paged_decode.h"

namespace accel::models::cuda::internal {

ACCEL_MODELS_HD float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

ACCEL_MODELS_HD float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

ACCEL_MODELS_HD float Rsqrt(float v) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(v);
#else
  return 1.0f / std::sqrt(v);
#endif
}

ACCEL_MODELS_HD float Exp(float v) {
#if defined(__CUDA_ARCH__)
  return expf(v);
#else
  return std::exp(v);
#endif
}

// Rounds v to the storage dtype and back (what a libtorch op that returns a
// 16-bit tensor does to its float32 result).
template <typename Tag>
ACCEL_MODELS_HD float Round(float v) {
  return ToFloat(Tag{}, FromFloat(Tag{}, v));
}

// 16 bytes (16-byte aligned) of storage from floats, rounded once each.
template <typename Tag>
ACCEL_MODELS_HD void StoreChunk(typename Tag::Storage* dst,
                                const float (&in)[16 / sizeof(typename Tag::Storage)]) {
  using Storage = typename Tag::Storage;
  constexpr int kVec = 16 / sizeof(Storage);
#if defined(__CUDA_ARCH__)
  union {
    uint4 raw;
    Storage values[kVec];
  } chunk;
  for (int e = 0; e < kVec; ++e) chunk.values[e] = FromFloat(Tag{}, in[e]);
  *reinterpret_cast<uint4*>(dst) = chunk.raw;
#else
  Storage values[kVec];
  for (int e = 0; e < kVec; ++e) values[e] = FromFloat(Tag{}, in[e]);
  std::memcpy(dst, values, 16);
#endif
}

// 16-byte chunks a thread of an RMSNorm CTA holds in registers: rows of up
// to kRmsNormChunks * threads chunks (8192 bfloat16 values at 256 threads)
// are read once, into registers; longer or unaligned rows element by element.
inline constexpr int32_t kRmsNormChunks = 4;

// One output element: h = x * r (float32), then the weight as the eager
// formula applies it.
template <typename Tag>
ACCEL_MODELS_HD float RmsNormValue(float x, float r, float weight, bool unit_offset) {
  const float h = MulRn(x, r);
  return unit_offset ? MulRn(h, AddRn(1.0f, weight)) : MulRn(weight, Round<Tag>(h));
}

// One row of RMSNorm by a CTA of `threads` threads (a multiple of 32, at
// most 1024); `shared` holds threads / 32 floats. Every thread reaches the
// same exchanges and the one barrier. Where the row's pointers and strides
// allow 16-byte accesses, a thread reads its chunks once into registers
// (thread t: chunks t, t + threads, ...), sums their squares, and writes
// its chunks of the output from them: the row's bytes pass once each way,
// in 16-byte accesses.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, typename Exec>
ACCEL_MODELS_HD void RmsNormRow(const RmsNormParams& p, int64_t row, int32_t threads, float* shared,
                                Exec& exec) {
  using Storage = typename Tag::Storage;
  constexpr int32_t kVec = 16 / sizeof(Storage);
  const Storage* x = static_cast<const Storage*>(p.x) + row * p.x_row_stride;
  const Storage* w = static_cast<const Storage*>(p.weight);
  Storage* out = static_cast<Storage*>(p.out) + row * p.out_row_stride;
  // With a residual the row is x + residual, rounded, also stored to `sum`.
  const bool add = p.residual != nullptr;
  const Storage* res =
      add ? static_cast<const Storage*>(p.residual) + row * p.residual_row_stride : nullptr;
  Storage* summed =
      add && p.sum != nullptr ? static_cast<Storage*>(p.sum) + row * p.sum_row_stride : nullptr;
  const int32_t tid = exec.tid();
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const int32_t chunks = p.dim / kVec;
  // The same for every CTA of the launch (row strides keep the alignment).
  const bool vectorized =
      p.dim % kVec == 0 && chunks <= kRmsNormChunks * threads && aligned(p.x) && aligned(p.out) &&
      aligned(p.weight) && p.x_row_stride % kVec == 0 && p.out_row_stride % kVec == 0 &&
      (!add || (aligned(p.residual) && aligned(p.sum) && p.residual_row_stride % kVec == 0 &&
                p.sum_row_stride % kVec == 0));
  // Callers that pass a residual without a sum (the decode GEMV's norm) take
  // only the register path, which keeps the sum in `held`.
  if (add && summed == nullptr && !vectorized) return;
  float held[kRmsNormChunks][kVec];
  // The weight's chunks too, loaded with x's: the norm then waits for
  // memory once, not again after its reduction (a CTA's latency is the
  // kernel's time at decode).
  float weight[kRmsNormChunks][kVec];
  float sum = 0.0f;
  if (vectorized) {
    for (int32_t i = 0; i < kRmsNormChunks; ++i) {
      const int32_t c = tid + i * threads;
      if (c >= chunks) break;
      LoadChunk<Tag>(x + static_cast<int64_t>(c) * kVec, held[i]);
      LoadChunk<Tag>(w + static_cast<int64_t>(c) * kVec, weight[i]);
      if (add) {
        float other[kVec];
        LoadChunk<Tag>(res + static_cast<int64_t>(c) * kVec, other);
        for (int32_t e = 0; e < kVec; ++e) held[i][e] = Round<Tag>(AddRn(held[i][e], other[e]));
        // (A null `sum` on this path: the caller keeps the sum elsewhere.)
        if (summed != nullptr) StoreChunk<Tag>(summed + static_cast<int64_t>(c) * kVec, held[i]);
      }
      for (int32_t e = 0; e < kVec; ++e) sum = AddRn(sum, MulRn(held[i][e], held[i][e]));
    }
  } else {
    for (int32_t c = tid; c < p.dim; c += threads) {
      float h = ToFloat(Tag{}, x[c]);
      if (add) {
        h = Round<Tag>(AddRn(h, ToFloat(Tag{}, res[c])));
        summed[c] = FromFloat(Tag{}, h);
      }
      sum = AddRn(sum, MulRn(h, h));
    }
  }
  for (int32_t mask = 16; mask >= 1; mask /= 2) sum = AddRn(sum, exec.XorLanes(sum, mask));
  if (tid % 32 == 0) shared[tid / 32] = sum;
  exec.Sync();
  // Every thread adds the warps' sums in the same order: one value for all.
  float total = 0.0f;
  for (int32_t warp = 0; warp < threads / 32; ++warp) total = AddRn(total, shared[warp]);
  // The mean as libtorch's CUDA reduction takes it: the sum times 1 / dim.
  const float r = Rsqrt(AddRn(MulRn(total, 1.0f / static_cast<float>(p.dim)), p.eps));
  if (vectorized) {
    for (int32_t i = 0; i < kRmsNormChunks; ++i) {
      const int32_t c = tid + i * threads;
      if (c >= chunks) break;
      float result[kVec];
      for (int32_t e = 0; e < kVec; ++e) {
        result[e] = RmsNormValue<Tag>(held[i][e], r, weight[i][e], p.unit_offset);
      }
      StoreChunk<Tag>(out + static_cast<int64_t>(c) * kVec, result);
    }
    return;
  }
  // (A thread reads back only the sums it wrote itself.)
  const Storage* normed = add ? summed : x;
  for (int32_t c = tid; c < p.dim; c += threads) {
    out[c] = FromFloat(Tag{}, RmsNormValue<Tag>(ToFloat(Tag{}, normed[c]), r, ToFloat(Tag{}, w[c]),
                                                p.unit_offset));
  }
}

// Elements i and i + half of a row of 2 * half rotated: x, cos and sin rows
// to `out`'s row.
template <typename Tag>
ACCEL_MODELS_HD void RotateInto(const typename Tag::Storage* x, const typename Tag::Storage* c,
                                const typename Tag::Storage* s, int32_t i, int32_t half,
                                typename Tag::Storage* out) {
  const float x1 = ToFloat(Tag{}, x[i]), x2 = ToFloat(Tag{}, x[i + half]);
  // out[i] = x1 * cos[i] + (-x2) * sin[i]; out[i + half] = x2 * cos[i + half] + x1 * sin[i + half]
  out[i] = FromFloat(Tag{}, AddRn(Round<Tag>(MulRn(x1, ToFloat(Tag{}, c[i]))),
                                  Round<Tag>(MulRn(-x2, ToFloat(Tag{}, s[i])))));
  out[i + half] = FromFloat(Tag{}, AddRn(Round<Tag>(MulRn(x2, ToFloat(Tag{}, c[i + half]))),
                                         Round<Tag>(MulRn(x1, ToFloat(Tag{}, s[i + half])))));
}

// Rotary pair `index` of RotaryParams' batch * heads * tokens * dim / 2:
// elements i and i + dim / 2 of one (batch, head, token) row.
template <typename Tag>
ACCEL_MODELS_HD void RotaryPair(const RotaryParams& p, int64_t index) {
  using Storage = typename Tag::Storage;
  const int32_t half = p.dim / 2;
  const int32_t i = static_cast<int32_t>(index % half);
  int64_t rest = index / half;
  const int32_t t = static_cast<int32_t>(rest % p.tokens);
  rest /= p.tokens;
  const int32_t h = static_cast<int32_t>(rest % p.heads);
  const int32_t b = static_cast<int32_t>(rest / p.heads);
  const Storage* x = static_cast<const Storage*>(p.x) + b * p.x_batch_stride + h * p.x_head_stride +
                     t * p.x_token_stride;
  const Storage* c =
      static_cast<const Storage*>(p.cos) + b * p.cos_batch_stride + t * p.cos_token_stride;
  const Storage* s =
      static_cast<const Storage*>(p.sin) + b * p.sin_batch_stride + t * p.sin_token_stride;
  Storage* out = static_cast<Storage*>(p.out) +
                 ((static_cast<int64_t>(b) * p.heads + h) * p.tokens + t) * p.dim;
  RotateInto<Tag>(x, c, s, i, half, out);
}

// Work item `index` of a RotaryStoreParams launch (RotaryStoreItems): a
// rotary pair of q (to q_out) or of k (to its slot in the key blocks), or an
// element of v (to its slot in the value blocks).
template <typename Tag>
ACCEL_MODELS_HD void RotaryStoreItem(const RotaryStoreParams& p, int64_t index) {
  using Storage = typename Tag::Storage;
  const int32_t half = p.dim / 2;
  const int64_t q_items = static_cast<int64_t>(p.rows) * p.heads * half;
  const int64_t k_items = static_cast<int64_t>(p.rows) * p.kv_heads * half;
  if (index < q_items + k_items) {
    const bool is_q = index < q_items;
    const int64_t local = is_q ? index : index - q_items;
    const int32_t heads = is_q ? p.heads : p.kv_heads;
    const int32_t i = static_cast<int32_t>(local % half);
    const int32_t h = static_cast<int32_t>((local / half) % heads);
    const int32_t r = static_cast<int32_t>(local / half / heads);
    const Storage* c = static_cast<const Storage*>(p.cos) + r * p.cos_row_stride;
    const Storage* s = static_cast<const Storage*>(p.sin) + r * p.sin_row_stride;
    if (is_q) {
      const Storage* x =
          static_cast<const Storage*>(p.q) + r * p.q_row_stride + h * p.q_head_stride;
      Storage* out =
          static_cast<Storage*>(p.q_out) + (static_cast<int64_t>(r) * p.heads + h) * p.dim;
      RotateInto<Tag>(x, c, s, i, half, out);
    } else {
      const Storage* x =
          static_cast<const Storage*>(p.k) + r * p.k_row_stride + h * p.k_head_stride;
      Storage* out =
          static_cast<Storage*>(p.key_blocks) +
          ((p.slot_blocks[r] * p.kv_heads + h) * p.block_size + p.slot_offsets[r]) * p.dim;
      RotateInto<Tag>(x, c, s, i, half, out);
    }
    return;
  }
  const int64_t local = index - q_items - k_items;
  const int32_t e = static_cast<int32_t>(local % p.value_dim);
  const int32_t h = static_cast<int32_t>((local / p.value_dim) % p.kv_heads);
  const int32_t r = static_cast<int32_t>(local / p.value_dim / p.kv_heads);
  const Storage* x = static_cast<const Storage*>(p.v) + r * p.v_row_stride + h * p.v_head_stride;
  static_cast<Storage*>(p.value_blocks)
      [((p.slot_blocks[r] * p.kv_heads + h) * p.block_size + p.slot_offsets[r]) * p.value_dim + e] =
          x[e];
}

// SiLU(g) * u as SiluMulParams computes it, before the output's rounding.
template <typename Tag>
ACCEL_MODELS_HD float SiluTimes(float g, float u) {
  const float silu = g / AddRn(1.0f, Exp(-g));
  return MulRn(Round<Tag>(silu), u);
}

// Element `index` of SiluMulParams' rows * dim.
template <typename Tag>
ACCEL_MODELS_HD void SiluMulAt(const SiluMulParams& p, int64_t index) {
  using Storage = typename Tag::Storage;
  const int64_t row = index / p.dim;
  const int32_t c = static_cast<int32_t>(index % p.dim);
  const float g = ToFloat(Tag{}, static_cast<const Storage*>(p.gate)[row * p.gate_row_stride + c]);
  const float u = ToFloat(Tag{}, static_cast<const Storage*>(p.up)[row * p.up_row_stride + c]);
  static_cast<Storage*>(p.out)[index] = FromFloat(Tag{}, SiluTimes<Tag>(g, u));
}

}  // namespace accel::models::cuda::internal

#endif  // ACCEL_MODELS_CUDA_INTERNAL_FUSED_OPS_H_
