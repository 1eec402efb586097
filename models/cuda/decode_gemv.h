// models/cuda/decode_gemv.h: a decode step's dense linear layer, y = x W^T
// (+ bias), for the few rows of x a decode step has, as one kernel, and the
// same with the RMSNorm before it done inside that kernel.
//
// Why (issue 37, docs/BENCHMARKS.md, the third device session): at batch 1
// on an H200 cuBLAS runs a 4096-wide projection as a split-K GEMV and a
// reduce (two launches), and a layer's two RMSNorms are launches of their
// own (4.3 us each, a CTA's latency, for 16 KB of work): 65 norms and 64
// reduces a step of the 8B model, each with a launch gap of about 1.6 us
// inside a CUDA graph. Here a warp reads rows of W in 16-byte chunks with
// several loads in flight (the int8 decode GEMV's shape, which read its
// weights at 0.77-0.89 of a device copy); with a norm, each CTA first
// writes the norm of x's rows to shared memory and reads x' from there, so
// the norm costs no launch.
//
// What it computes, in float32 whatever the storage dtype: each output is
// the sum over k of float(x'[r][k]) * float(W[n][k]) by fused multiply-adds
// (a lane's chunks in order, then the lanes' sums by a butterfly), plus
// float(bias[n]), rounded once to the storage dtype. x' is x, or with
// `norm.weight` the RMSNorm of x (+ residual) exactly as models/cuda/
// fused_ops.h's RmsNorm computes it (the same code, so x' equals that
// kernel's output to the bit), and with a residual the sum x + residual is
// written to `sum` as RmsNorm writes it; or, with `silu_mul`, x' is
// SiLU(gate) * up of x's rows [gate | up] (2k wide) as SiluMul computes it
// (the gated MLP's down projection takes its activation inside).
//
// Raw pointers and a stream, no libtorch (as fused_ops.h); the at::Tensor
// wrappers are in models/internal/fused_ops.h.
#ifndef ACCEL_MODELS_CUDA_DECODE_GEMV_H_
#define ACCEL_MODELS_CUDA_DECODE_GEMV_H_

#include <cstdint>

#include "models/cuda/fused_ops.h"

namespace accel::models::cuda {

// Rows of x one launch takes (a decode step's batch up to this).
inline constexpr int32_t kDecodeGemvMaxRows = 8;
// Threads of a CTA: eight warps, a warp per row of W at a time.
inline constexpr int32_t kDecodeGemvThreads = 256;
// Shared memory a CTA may hold the norm of x in (the default limit, no
// opt-in).
inline constexpr int64_t kDecodeGemvSharedBytes = 48 * 1024;
// The norm holds a row in registers: at most this many 16-byte chunks a
// thread (internal::kRmsNormChunks), so k <= 8192 in 16 bits.
inline constexpr int32_t kDecodeGemvNormChunks = 4;

// x: `rows` rows of `k` elements, `x_row_stride` apart; weight [n, k]
// contiguous; bias [n] or null; out: `rows` rows of n, `out_row_stride`
// apart. Every pointer 16-byte aligned, k a multiple of 16 bytes' elements.
// With norm.weight ([k]): x' = RMSNorm(x (+ residual)) with norm's eps,
// unit_offset, residual and sum (laid out as x, at their own strides; sum
// written with x + residual); norm's x, out, rows, dim and x / out strides
// are the GEMV's own (set by the kernel).
struct DecodeGemvParams {
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;
  void* out = nullptr;
  int32_t rows = 0;
  int64_t n = 0;
  int32_t k = 0;
  int64_t x_row_stride = 0;
  int64_t out_row_stride = 0;
  RmsNormParams norm;
  // x's rows are [gate | up], each k wide: x' = SiLU(gate) * up.
  bool silu_mul = false;
};

// Whether rows * k elements of this dtype fit the CTA's shared memory,
// where a norm or silu_mul writes x'.
ACCEL_MODELS_HD bool DecodeGemvStagesX(int32_t rows, int32_t k, KvDType dtype) {
  return static_cast<int64_t>(rows) * k * KvDTypeSize(dtype) <= kDecodeGemvSharedBytes;
}

// The grid for n rows of W when `resident` CTAs fit the device at once:
// every warp takes the same number of rows (rounds), in as few rounds as
// the resident CTAs allow, so no warp's extra row is the kernel's tail and
// the CTAs run in one wave. (A prologue, which each CTA repeats, is then
// paid at most once a resident CTA.)
ACCEL_MODELS_HD int64_t DecodeGemvCtas(int64_t n, int64_t resident) {
  const int64_t groups = (n + kDecodeGemvThreads / 32 - 1) / (kDecodeGemvThreads / 32);
  if (resident < 1) resident = 1;
  const int64_t rounds = (groups + resident - 1) / resident;
  return (groups + rounds - 1) / rounds;
}

// nullptr when the kernel takes `p`, else what it does not take.
ACCEL_MODELS_HD const char* CheckDecodeGemvParams(const DecodeGemvParams& p, KvDType dtype) {
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const int32_t vec = 16 / KvDTypeSize(dtype);
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) return "a null pointer";
  if (p.rows < 1 || p.rows > kDecodeGemvMaxRows) return "rows outside 1..kDecodeGemvMaxRows";
  if (p.n < 1 || p.k < 1 || p.k % vec != 0) return "k not whole 16-byte chunks (or n, k < 1)";
  if (!aligned(p.x) || !aligned(p.weight) || !aligned(p.out) ||
      (p.bias != nullptr && !aligned(p.bias))) {
    return "a pointer not 16-byte aligned";
  }
  if (p.x_row_stride < p.k || p.x_row_stride % vec != 0 || p.out_row_stride < p.n) {
    return "row strides";
  }
  if (p.silu_mul) {
    if (p.norm.weight != nullptr || p.norm.residual != nullptr || p.norm.sum != nullptr) {
      return "silu_mul with a norm";
    }
    if (!DecodeGemvStagesX(p.rows, p.k, dtype)) return "x' does not fit shared memory";
    return p.x_row_stride >= 2 * static_cast<int64_t>(p.k) ? nullptr
                                                           : "silu_mul: x rows narrower than 2k";
  }
  const RmsNormParams& norm = p.norm;
  if (norm.weight == nullptr) {
    return norm.residual == nullptr && norm.sum == nullptr ? nullptr : "a residual without a norm";
  }
  // The norm runs RmsNormRow's register path (each thread holds its chunks).
  if (!DecodeGemvStagesX(p.rows, p.k, dtype)) return "x does not fit shared memory for the norm";
  if (p.k / vec > kDecodeGemvNormChunks * kDecodeGemvThreads) return "k too large for the norm";
  if (!aligned(norm.weight)) return "norm.weight not 16-byte aligned";
  if ((norm.residual == nullptr) != (norm.sum == nullptr)) {
    return "residual and sum: both or neither";
  }
  if (norm.residual != nullptr &&
      (!aligned(norm.residual) || !aligned(norm.sum) || norm.residual_row_stride % vec != 0 ||
       norm.sum_row_stride % vec != 0 || norm.residual_row_stride < p.k ||
       norm.sum_row_stride < p.k)) {
    return "residual or sum layout";
  }
  return nullptr;
}

}  // namespace accel::models::cuda

#endif  // ACCEL_MODELS_CUDA_DECODE_GEMV_H_
