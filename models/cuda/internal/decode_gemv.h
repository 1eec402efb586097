// models/cuda/internal/decode_gemv.h: the work of one decode GEMV CTA
// (models/cuda/decode_gemv.h), written once for the device kernel
// (models/cuda/decode_gemv.cu) and for the host emulation that tests it
// (tests/models/fused_ops_test.cc), as internal/fused_ops.h is.
//
// With a norm, a CTA first writes the norm of x's rows to shared memory
// (RmsNormRow, a row at a time); without, x is read where it is (every warp
// reads it, from the cache). Each of its warps takes rows of W
// (columns of the output): warp w of CTA c the rows c * warps + w, then
// every warps * ctas after it. A lane reads 16-byte chunks of the row
// (lane, lane + 32, ...; kDecodeGemvAhead of them issued before the first is
// used), multiplies them with the same chunks of each row of x and adds
// them into one float32 sum a row of x; the lanes' sums meet by a butterfly.
#ifndef ACCEL_MODELS_CUDA_INTERNAL_DECODE_GEMV_H_
#define ACCEL_MODELS_CUDA_INTERNAL_DECODE_GEMV_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>

#include "models/cuda/decode_gemv.h"
#include "models/cuda/internal/fused_ops.h"

namespace accel::models::cuda::internal {

static_assert(kDecodeGemvNormChunks == kRmsNormChunks, "decode_gemv.h's bound is the norm's");
// The norm's float32 sums run in the order of its CTA's threads: with as
// many threads as the RMSNorm kernel's, x' equals that kernel's output.
static_assert(kDecodeGemvThreads == kRmsNormThreads, "the norm kernel's thread count");

// 16-byte chunks of W a lane has in flight.
inline constexpr int32_t kDecodeGemvAhead = 8;
inline constexpr int32_t kDecodeGemvWarps = kDecodeGemvThreads / 32;

ACCEL_MODELS_HD float Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// 16 bytes of storage as they lie in memory (a lane holds its chunks of W
// so until it uses them: half the registers of floats in 16 bits).
template <typename Tag>
struct alignas(16) RawChunk {
  typename Tag::Storage values[16 / sizeof(typename Tag::Storage)];
};

// 16 bytes of W, read once (a streaming load on the device).
template <typename Tag>
ACCEL_MODELS_HD void LoadWeightChunk(const typename Tag::Storage* src, RawChunk<Tag>& out) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(out.values) = __ldcs(reinterpret_cast<const uint4*>(src));
#else
  std::memcpy(out.values, src, 16);
#endif
}

// 16 bytes of x' in shared memory.
template <typename Tag>
ACCEL_MODELS_HD void LoadXChunk(const typename Tag::Storage* src,
                                float (&out)[16 / sizeof(typename Tag::Storage)]) {
  constexpr int kVec = 16 / sizeof(typename Tag::Storage);
  RawChunk<Tag> chunk;
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(chunk.values) = *reinterpret_cast<const uint4*>(src);
#else
  std::memcpy(chunk.values, src, 16);
#endif
  for (int e = 0; e < kVec; ++e) out[e] = ToFloat(Tag{}, chunk.values[e]);
}

// The CTA's prologue with a norm: RMSNorm(x (+ residual)) into `staged`
// ([rows][k] of the storage dtype, 16-byte aligned), a row at a time by
// RmsNormRow; `reduce` holds kDecodeGemvWarps floats. CTA 0 writes the sum
// x + residual; the others keep it in registers only. Ends with a barrier.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, typename Exec>
ACCEL_MODELS_HD void StageNormedX(const DecodeGemvParams& p, int64_t cta,
                                  typename Tag::Storage* staged, float* reduce, Exec& exec) {
  RmsNormParams norm = p.norm;
  norm.x = p.x;
  norm.out = staged;
  norm.rows = p.rows;
  norm.dim = p.k;
  norm.x_row_stride = p.x_row_stride;
  norm.out_row_stride = p.k;
  if (cta != 0) norm.sum = nullptr;
  for (int32_t r = 0; r < p.rows; ++r) {
    RmsNormRow<Tag>(norm, r, kDecodeGemvThreads, reduce, exec);
    // The next row's reduction reuses `reduce`; the warps read x after.
    exec.Sync();
  }
}

// The CTA's prologue with silu_mul: SiLU(gate) * up of x's rows into
// `staged` ([rows][k]), 16-byte chunks a thread. Ends with a barrier.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, typename Exec>
ACCEL_MODELS_HD void StageSiluMulX(const DecodeGemvParams& p, typename Tag::Storage* staged,
                                   Exec& exec) {
  using Storage = typename Tag::Storage;
  constexpr int32_t kVec = 16 / sizeof(Storage);
  const int32_t chunks = p.k / kVec;
  for (int32_t i = exec.tid(); i < p.rows * chunks; i += kDecodeGemvThreads) {
    const int32_t r = i / chunks;
    const int64_t c = static_cast<int64_t>(i % chunks) * kVec;
    const Storage* gate = static_cast<const Storage*>(p.x) + r * p.x_row_stride;
    float g[kVec], u[kVec], out[kVec];
    LoadChunk<Tag>(gate + c, g);
    LoadChunk<Tag>(gate + p.k + c, u);
    for (int32_t e = 0; e < kVec; ++e) out[e] = SiluTimes<Tag>(g[e], u[e]);
    StoreChunk<Tag>(staged + static_cast<int64_t>(r) * p.k + c, out);
  }
  exec.Sync();
}

// Asks the L2 cache for row `col` of W (a no-op on the host), so that the
// norm's prologue and the first row's reads overlap.
template <typename Tag>
ACCEL_MODELS_HD void PrefetchWeightRow(const DecodeGemvParams& p, int64_t col, int32_t lane) {
#if defined(__CUDA_ARCH__)
  const char* row =
      static_cast<const char*>(p.weight) +
      col * static_cast<int64_t>(p.k) * static_cast<int64_t>(sizeof(typename Tag::Storage));
  const int64_t bytes =
      static_cast<int64_t>(p.k) * static_cast<int64_t>(sizeof(typename Tag::Storage));
  for (int64_t at = static_cast<int64_t>(lane) * 128; at < bytes; at += 32 * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(row + at));
  }
#else
  (void)p;
  (void)col;
  (void)lane;
#endif
}

// Output column `col` (row `col` of W) for every row of x, by one warp
// (`lane` its lane): x's rows `x_stride` elements apart at `x`.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, int32_t kRows, bool kXShared, typename Exec>
ACCEL_MODELS_HD void DecodeGemvColumn(const DecodeGemvParams& p, int64_t col, int32_t lane,
                                      const typename Tag::Storage* x, int64_t x_stride,
                                      Exec& exec) {
  using Storage = typename Tag::Storage;
  constexpr int32_t kVec = 16 / sizeof(Storage);
  const int32_t chunks = p.k / kVec;
  const Storage* w = static_cast<const Storage*>(p.weight) + col * p.k;
  float acc[kRows];
  for (int32_t r = 0; r < kRows; ++r) acc[r] = 0.0f;
  for (int32_t first = lane; first < chunks; first += 32 * kDecodeGemvAhead) {
    RawChunk<Tag> raw[kDecodeGemvAhead];
    for (int32_t u = 0; u < kDecodeGemvAhead; ++u) {
      const int32_t c = first + 32 * u;
      if (c < chunks) LoadWeightChunk<Tag>(w + static_cast<int64_t>(c) * kVec, raw[u]);
    }
    for (int32_t u = 0; u < kDecodeGemvAhead; ++u) {
      const int32_t c = first + 32 * u;
      if (c >= chunks) break;
      float wf[kVec];
      for (int32_t e = 0; e < kVec; ++e) wf[e] = ToFloat(Tag{}, raw[u].values[e]);
      for (int32_t r = 0; r < kRows; ++r) {
        if (r >= p.rows) break;
        float xf[kVec];
        // (Global x through the read-only cache: every warp reads it.)
        if (kXShared) {
          LoadXChunk<Tag>(x + r * x_stride + static_cast<int64_t>(c) * kVec, xf);
        } else {
          LoadChunk<Tag>(x + r * x_stride + static_cast<int64_t>(c) * kVec, xf);
        }
        for (int32_t e = 0; e < kVec; ++e) acc[r] = Fma(wf[e], xf[e], acc[r]);
      }
    }
  }
  // Every lane reaches the exchanges (kRows is the same for the warp).
  for (int32_t r = 0; r < kRows; ++r) {
    for (int32_t mask = 16; mask >= 1; mask /= 2)
      acc[r] = AddRn(acc[r], exec.XorLanes(acc[r], mask));
  }
  if (lane != 0) return;
  const float bias =
      p.bias != nullptr ? ToFloat(Tag{}, static_cast<const Storage*>(p.bias)[col]) : 0.0f;
  for (int32_t r = 0; r < kRows; ++r) {
    if (r >= p.rows) break;
    static_cast<Storage*>(p.out)[r * p.out_row_stride + col] =
        FromFloat(Tag{}, AddRn(acc[r], bias));
  }
}

// What a CTA does before its columns (a kernel each on the device: the
// plain one needs fewer registers than the norm's, so more CTAs fit an SM).
enum class DecodeGemvPrologue { kNone, kNorm, kSiluMul };

ACCEL_MODELS_HD DecodeGemvPrologue PrologueOf(const DecodeGemvParams& p) {
  return p.norm.weight != nullptr ? DecodeGemvPrologue::kNorm
         : p.silu_mul             ? DecodeGemvPrologue::kSiluMul
                                  : DecodeGemvPrologue::kNone;
}

// CTA `cta` of `ctas` (kPrologue: PrologueOf(p)). With a prologue, x' into
// `staged` (rows * k storage elements; `reduce` kDecodeGemvWarps floats),
// then the columns from there; without, the columns from x in global memory
// at once, nothing to wait for.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, int32_t kRows, DecodeGemvPrologue kPrologue, typename Exec>
ACCEL_MODELS_HD void DecodeGemvCta(const DecodeGemvParams& p, int64_t cta, int64_t ctas,
                                   typename Tag::Storage* staged, float* reduce, Exec& exec) {
  const int32_t warp = exec.tid() / 32, lane = exec.tid() % 32;
  const int64_t first = cta * kDecodeGemvWarps + warp, step = ctas * kDecodeGemvWarps;
  if (kPrologue == DecodeGemvPrologue::kNone) {
    const auto* x = static_cast<const typename Tag::Storage*>(p.x);
    for (int64_t col = first; col < p.n; col += step) {
      DecodeGemvColumn<Tag, kRows, false>(p, col, lane, x, p.x_row_stride, exec);
    }
    return;
  }
  if (first < p.n) PrefetchWeightRow<Tag>(p, first, lane);
  if (kPrologue == DecodeGemvPrologue::kNorm) {
    StageNormedX<Tag>(p, cta, staged, reduce, exec);
  } else {
    StageSiluMulX<Tag>(p, staged, exec);
  }
  for (int64_t col = first; col < p.n; col += step) {
    DecodeGemvColumn<Tag, kRows, true>(p, col, lane, staged, p.k, exec);
  }
}

}  // namespace accel::models::cuda::internal

#endif  // ACCEL_MODELS_CUDA_INTERNAL_DECODE_GEMV_H_
