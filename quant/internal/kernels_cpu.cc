#include "quant/internal/kernels_cpu.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

// Compiled with -fopenmp and without the shared PCH (accel_torch_parallel in
// quant/CMakeLists.txt): at::parallel_for is serial otherwise.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "core/cpu_features.h"
#include "quant/internal/nibble_avx2.h"
#include "quant/internal/x86_targets.h"

namespace accel::quant::internal {
namespace {

// Elements of a weight row decoded at a time by Gemv4bit: 4 KiB of float32,
// which stay in the L1 cache while every row of x is dotted with them.
constexpr int64_t kChunk = 1024;

// The register kernels of Gemv4bit take kRowTile weight rows at a time
// through every tile of columns, with a tile of x of at most kXTileBytes
// (kBf16XTileBytes for the bfloat16 kernels up to kBf16WholeRows rows).
constexpr int64_t kRowTile = 32;
constexpr int64_t kXTileBytes = int64_t{24} << 10;
// The bfloat16 kernels' tile of x up to kBf16WholeRows rows of x: no column
// tiles at decode's shapes. Their weights stream from memory, and a row
// walked in pieces (a tile of columns for kRowTile rows, then the next) read
// 1.2-1.5x slower than whole rows with x from L2 (Mixtral's w2, 4096 x 14336,
// one thread: 4.35 ms in tiles of 24 KiB, 3.68 ms whole; 4 rows of 4096 x
// 4096: 2.04 against 1.57 ms). From 6 rows on x's loads from L2 (12 of 64
// bytes a block) cost more than the pieces (6 rows of 4096 x 4096, two
// threads: 0.86 ms in tiles of 24 KiB, 1.15-1.18 whole), so they keep
// kXTileBytes.
constexpr int64_t kBf16XTileBytes = int64_t{128} << 10;
constexpr int64_t kBf16WholeRows = 4;
// How far ahead in its row the bfloat16 kernel asks for weights: the
// hardware prefetchers stop at each 4 KiB page, and a row of w2 (7 KiB)
// crosses two (measured, one thread: w2 at one row 3.68 -> 2.86 ms, 4096 x
// 4096 at 4 rows 1.57 -> 1.4 ms; 1024 and 4096 bytes ahead were slower).
constexpr int64_t kBf16PrefetchBytes = 2048;
// Where x's part of a call takes more than kBf16XInL1Bytes (w2's one row of
// 14336 columns is 28 KiB, the L1 cache 32 KiB), the weights are asked for
// into L2 only, kBf16FarPrefetchBytes ahead: prefetched into L1 they took
// x's lines, which every weight row reads again (one thread, w2 at one row:
// x cut to 4096 columns 1.90 ms, 7168 2.2-2.6, all 14336 2.8-2.9), and the
// line a pair loads from L2 costs less than x's four (w2 at one row, two
// threads: 1.56-1.67 -> 1.24-1.41 ms; docs/BENCHMARKS.md).
constexpr int64_t kBf16XInL1Bytes = int64_t{16} << 10;
constexpr int64_t kBf16FarPrefetchBytes = 4096;

// Rows of x up to which AVX2 takes the nibble kernels when they apply.
constexpr int64_t kNibbleMaxRows = 4;

// ---- Portable ---------------------------------------------------------------

template <DenseType T>
inline float RoundScalar(float v) {
  if constexpr (T == DenseType::kBFloat16) {
    return static_cast<float>(c10::BFloat16(v));  // nearest even; NaN -> 0x7FC0
  } else if constexpr (T == DenseType::kFloat16) {
    return static_cast<float>(c10::Half(v));
  } else {
    return v;
  }
}

inline float DecodeScalar(const Packed4bit& w, int64_t j) {
  const uint8_t byte = w.packed[j >> 1];
  const int index = (j & 1) == 0 ? byte >> 4 : byte & 0xF;
  return w.code[index] * BlockAbsmax(w, j / w.blocksize);
}

// Stores the rounded value v as element `i` of `out` (float32, or the bits of
// a bfloat16 / float16 when !kFloatOut).
template <DenseType T, bool kFloatOut>
inline void StoreScalar(void* out, int64_t i, float v) {
  if constexpr (kFloatOut || T == DenseType::kFloat32) {
    static_cast<float*>(out)[i] = RoundScalar<T>(v);
  } else if constexpr (T == DenseType::kBFloat16) {
    static_cast<uint16_t*>(out)[i] = c10::BFloat16(v).x;
  } else {
    static_cast<uint16_t*>(out)[i] = c10::Half(v).x;
  }
}

// Element i of values stored as From (float32, or bfloat16 / float16 bits).
template <DenseType From>
inline float LoadScalar(const void* in, int64_t i) {
  if constexpr (From == DenseType::kFloat32) {
    return static_cast<const float*>(in)[i];
  } else if constexpr (From == DenseType::kBFloat16) {
    return static_cast<float>(
        c10::BFloat16(static_cast<const uint16_t*>(in)[i], c10::BFloat16::from_bits()));
  } else {
    return static_cast<float>(
        c10::Half(static_cast<const uint16_t*>(in)[i], c10::Half::from_bits()));
  }
}

template <DenseType From, DenseType Round>
void LoadRoundedScalar(const void* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = RoundScalar<Round>(LoadScalar<From>(in, i));
}

template <DenseType Round, DenseType To>
void StoreRoundedScalar(const float* in, int64_t n, void* out) {
  for (int64_t i = 0; i < n; ++i) StoreScalar<To, false>(out, i, RoundScalar<Round>(in[i]));
}

// Flat elements [begin, end) into out[0, end - begin).
template <DenseType T, bool kFloatOut>
void DecodeRangeScalar(const Packed4bit& w, int64_t begin, int64_t end, void* out) {
  for (int64_t j = begin; j < end; ++j)
    StoreScalar<T, kFloatOut>(out, j - begin, DecodeScalar(w, j));
}

// sums[c][r] += sum_j w[c][j] * x[r * x_stride + j] for r < rows, c < cols.
void DotRowsScalar(const float* const* w, int64_t cols, int64_t len, const float* x,
                   int64_t x_stride, int64_t rows, float* const* sums) {
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * x_stride;
      float sum = 0.0f;
      for (int64_t j = 0; j < len; ++j) sum += w[c][j] * xr[j];
      sums[c][r] += sum;
    }
  }
}

// ---- AVX2 + FMA + F16C ------------------------------------------------------

#if defined(__x86_64__)

// Per-lane shifts that bring element e of 4 packed bytes (8 nibbles, high
// nibble first; element e at bit s_e = 8 * (e / 2) + (e even ? 4 : 0) of the
// little-endian word) into place: right by s_e for its low 3 bits (vpermps
// reads only those), left by 28 - s_e for its bit 3 (vblendvps reads only the
// sign bit).
struct Avx2Shifts {
  __m256i right, left;
};

ACCEL_TARGET_AVX2 ACCEL_INLINE Avx2Shifts MakeShifts() {
  return {_mm256_setr_epi32(4, 0, 12, 8, 20, 16, 28, 24),
          _mm256_setr_epi32(24, 28, 16, 20, 8, 12, 0, 4)};
}

// The values of flat elements 2 * (p - packed) .. + 7 from a 16-entry table
// held in two registers.
ACCEL_TARGET_AVX2 ACCEL_INLINE __m256 Lookup8(const uint8_t* p, __m256 lo, __m256 hi,
                                              const Avx2Shifts& s) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  const __m256i bytes = _mm256_set1_epi32(word);
  const __m256i index = _mm256_srlv_epi32(bytes, s.right);
  const __m256 select = _mm256_castsi256_ps(_mm256_sllv_epi32(bytes, s.left));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, index), _mm256_permutevar8x32_ps(hi, index),
                          select);
}

// v rounded to T (nearest even), as float32. bfloat16 as c10::BFloat16
// rounds (NaN -> 0x7FC0); float16 through the F16C conversion.
template <DenseType T>
ACCEL_TARGET_AVX2 ACCEL_INLINE __m256 Round8(__m256 v) {
  if constexpr (T == DenseType::kBFloat16) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                         _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                            _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
  } else if constexpr (T == DenseType::kFloat16) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return v;
  }
}

// A block's table: round(code[c] * absmax) for the 16 codes, the exact
// values the elements of the block take, so decoding is a lookup.
struct Avx2Table {
  __m256 lo, hi;
};

template <DenseType T>
ACCEL_TARGET_AVX2 ACCEL_INLINE Avx2Table BlockTable(const float* code, float absmax) {
  const __m256 scale = _mm256_set1_ps(absmax);
  return {Round8<T>(_mm256_mul_ps(_mm256_loadu_ps(code), scale)),
          Round8<T>(_mm256_mul_ps(_mm256_loadu_ps(code + 8), scale))};
}

// 8 values already rounded to T, stored as float32 or as T's 16 bits (exact).
template <DenseType T, bool kFloatOut>
ACCEL_TARGET_AVX2 ACCEL_INLINE void Store8(void* out, int64_t i, __m256 v) {
  if constexpr (kFloatOut || T == DenseType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(out) + i, v);
  } else if constexpr (T == DenseType::kBFloat16) {
    const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), packed);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// DecodeRangeScalar with 8 elements at a time: inside a block, from an even
// flat index (a byte boundary), as long as 8 remain; the rest one by one.
template <DenseType T, bool kFloatOut>
ACCEL_TARGET_AVX2 void DecodeRangeAvx2(const Packed4bit& w, int64_t begin, int64_t end, void* out) {
  const Avx2Shifts shifts = MakeShifts();
  // Block by block (a lambda would not inherit the target attribute).
  int64_t block = begin / w.blocksize;
  for (int64_t j = begin; j < end; ++block) {
    const int64_t e = std::min(end, (block + 1) * w.blocksize);
    if ((j & 1) != 0) {
      StoreScalar<T, kFloatOut>(out, j - begin, DecodeScalar(w, j));
      ++j;
    }
    if (j + 8 <= e) {
      const Avx2Table t = BlockTable<T>(w.code, BlockAbsmax(w, block));
      for (; j + 16 <= e; j += 16) {
        Store8<T, kFloatOut>(out, j - begin, Lookup8(w.packed + (j >> 1), t.lo, t.hi, shifts));
        Store8<T, kFloatOut>(out, j + 8 - begin,
                             Lookup8(w.packed + (j >> 1) + 4, t.lo, t.hi, shifts));
      }
      if (j + 8 <= e) {
        Store8<T, kFloatOut>(out, j - begin, Lookup8(w.packed + (j >> 1), t.lo, t.hi, shifts));
        j += 8;
      }
    }
    for (; j < e; ++j) StoreScalar<T, kFloatOut>(out, j - begin, DecodeScalar(w, j));
  }
}

ACCEL_TARGET_AVX2 ACCEL_INLINE float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// DotRowsScalar for R rows and C weight rows at once, with R x C
// accumulators: each loaded vector of x serves C products and each of w R.
template <int R, int C>
ACCEL_TARGET_AVX2 void DotRowsAvx2(const float* const* w, int64_t len, const float* x,
                                   int64_t x_stride, float* const* sums) {
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    __m256 wv[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w[c] + j);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * x_stride + j);
      // In a register: folded into each of the C FMAs as a memory operand,
      // the load repeats per FMA and the loads, not the FMAs, bound the loop.
      asm("" : "+x"(xv));
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      float sum = Sum8(acc[r][c]);
      for (int64_t t = j; t < len; ++t) sum += w[c][t] * x[r * x_stride + t];
      sums[c][r] += sum;
    }
  }
}

template <int C>
void DotRowsAvx2Blocks(const float* const* w, int64_t len, const float* x, int64_t x_stride,
                       int64_t rows, float* const* sums) {
  for (int64_t r = 0; r < rows; r += 4) {
    const float* xr = x + r * x_stride;
    float* s[C];
    for (int c = 0; c < C; ++c) s[c] = sums[c] + r;
    switch (std::min<int64_t>(4, rows - r)) {
      case 1:
        DotRowsAvx2<1, C>(w, len, xr, x_stride, s);
        break;
      case 2:
        DotRowsAvx2<2, C>(w, len, xr, x_stride, s);
        break;
      case 3:
        DotRowsAvx2<3, C>(w, len, xr, x_stride, s);
        break;
      default:
        DotRowsAvx2<4, C>(w, len, xr, x_stride, s);
        break;
    }
  }
}

void DotRowsAvx2Any(const float* const* w, int64_t cols, int64_t len, const float* x,
                    int64_t x_stride, int64_t rows, float* const* sums) {
  if (cols == 2) {
    DotRowsAvx2Blocks<2>(w, len, x, x_stride, rows, sums);
  } else {
    DotRowsAvx2Blocks<1>(w, len, x, x_stride, rows, sums);
  }
}

// Gemv4bit for R <= 4 rows of x, weight rows [n_begin, n_end) and columns
// [k0, k1) (a GemvRangeFn), with no buffer: each weight row is decoded into
// registers, 16 values at a time, and dotted with the R rows at once.
template <DenseType T, int R>
ACCEL_TARGET_AVX2 void GemvDirectAvx2(const Gemv4bitArgs& a, int64_t n_begin, int64_t n_end,
                                      int64_t k0, int64_t k1, float* sums, int64_t sums_stride) {
  const Avx2Shifts shifts = MakeShifts();
  const Packed4bit& w = a.w;
  const float* x = a.x;
  const int64_t xs = a.x_stride;
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m256 acc0[R], acc1[R];
    float tail[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc0[r] = acc1[r] = _mm256_setzero_ps();
      tail[r] = 0.0f;
    }
    const int64_t row = n * a.in, row_end = row + k1;
    int64_t block = (row + k0) / w.blocksize;
    for (int64_t j = row + k0; j < row_end; ++block) {
      const int64_t e = std::min(row_end, (block + 1) * w.blocksize);
      if ((j & 1) != 0) {
        const float v = RoundScalar<T>(DecodeScalar(w, j));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) tail[r] += v * x[r * xs + (j - row)];
        ++j;
      }
      if (j + 8 <= e) {
        const Avx2Table t = BlockTable<T>(w.code, BlockAbsmax(w, block));
        for (; j + 16 <= e; j += 16) {
          const __m256 w0 = Lookup8(w.packed + (j >> 1), t.lo, t.hi, shifts);
          const __m256 w1 = Lookup8(w.packed + (j >> 1) + 4, t.lo, t.hi, shifts);
          const float* xk = x + (j - row);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + r * xs), w0, acc0[r]);
            // Two chains per row where the registers allow it (R <= 2).
            if constexpr (R <= 2) {
              acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + r * xs + 8), w1, acc1[r]);
            } else {
              acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + r * xs + 8), w1, acc0[r]);
            }
          }
        }
        if (j + 8 <= e) {
          const __m256 w0 = Lookup8(w.packed + (j >> 1), t.lo, t.hi, shifts);
          const float* xk = x + (j - row);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + r * xs), w0, acc0[r]);
          }
          j += 8;
        }
      }
      for (; j < e; ++j) {
        const float v = RoundScalar<T>(DecodeScalar(w, j));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) tail[r] += v * x[r * xs + (j - row)];
      }
    }
    float* sn = sums + (n - n_begin) * sums_stride;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sn[r] += Sum8(_mm256_add_ps(acc0[r], acc1[r])) + tail[r];
  }
}

// LoadRounded / StoreRounded 8 values at a time; the rest one by one.
template <DenseType From>
ACCEL_TARGET_AVX2 ACCEL_INLINE __m256 Load8(const void* in, int64_t i) {
  if constexpr (From == DenseType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(in) + i);
  } else {
    const __m128i bits =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(in) + i));
    if constexpr (From == DenseType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    } else {
      return _mm256_cvtph_ps(bits);
    }
  }
}

template <DenseType From, DenseType Round>
ACCEL_TARGET_AVX2 void LoadRoundedAvx2(const void* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, Round8<Round>(Load8<From>(in, i)));
  for (; i < n; ++i) out[i] = RoundScalar<Round>(LoadScalar<From>(in, i));
}

template <DenseType Round, DenseType To>
ACCEL_TARGET_AVX2 void StoreRoundedAvx2(const float* in, int64_t n, void* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    Store8<To, false>(out, i, Round8<To>(Round8<Round>(_mm256_loadu_ps(in + i))));
  }
  for (; i < n; ++i) StoreScalar<To, false>(out, i, RoundScalar<Round>(in[i]));
}

// ---- AVX-512 (F, BW, VL, VBMI): the 4-bit kernels 16 values at a time ------
//
// A lookup is two instructions: vpmultishiftqb brings the 16 nibbles of 8
// packed bytes to the low bits of 16 lanes, and vpermps (which reads only
// those 4 bits) takes their values from the block's 16-entry table, held in
// one register. The dot products of the buffered path stay with the AVX2
// code.

// For qword q (lanes 2q and 2q + 1): byte 0 takes the bits from 8q + 4 on
// (the high nibble of packed byte q: element 2q), byte 4 from 8q (the low
// nibble: element 2q + 1).
constexpr int64_t NibbleControl(int q) { return (8 * q + 4) | (static_cast<int64_t>(8 * q) << 32); }

ACCEL_TARGET_AVX512 ACCEL_INLINE __m512i MakeNibbleControl() {
  return _mm512_set_epi64(NibbleControl(7), NibbleControl(6), NibbleControl(5), NibbleControl(4),
                          NibbleControl(3), NibbleControl(2), NibbleControl(1), NibbleControl(0));
}

// The values of flat elements 2 * (p - packed) .. + 15.
ACCEL_TARGET_AVX512 ACCEL_INLINE __m512 Lookup16(const uint8_t* p, __m512 table, __m512i control) {
  int64_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(control, _mm512_set1_epi64(word)),
                               table);
}

template <DenseType T>
ACCEL_TARGET_AVX512 ACCEL_INLINE __m512 Round16(__m512 v) {
  if constexpr (T == DenseType::kBFloat16) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                         _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(rounded), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  } else if constexpr (T == DenseType::kFloat16) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return v;
  }
}

template <DenseType T>
ACCEL_TARGET_AVX512 ACCEL_INLINE __m512 BlockTable16(const float* code, float absmax) {
  return Round16<T>(_mm512_mul_ps(_mm512_loadu_ps(code), _mm512_set1_ps(absmax)));
}

template <DenseType T, bool kFloatOut>
ACCEL_TARGET_AVX512 ACCEL_INLINE void Store16(void* out, int64_t i, __m512 v) {
  if constexpr (kFloatOut || T == DenseType::kFloat32) {
    _mm512_storeu_ps(static_cast<float*>(out) + i, v);
  } else if constexpr (T == DenseType::kBFloat16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <DenseType T, bool kFloatOut>
ACCEL_TARGET_AVX512 void DecodeRangeAvx512(const Packed4bit& w, int64_t begin, int64_t end,
                                           void* out) {
  const __m512i control = MakeNibbleControl();
  int64_t block = begin / w.blocksize;
  for (int64_t j = begin; j < end; ++block) {
    const int64_t e = std::min(end, (block + 1) * w.blocksize);
    if ((j & 1) != 0) {
      StoreScalar<T, kFloatOut>(out, j - begin, DecodeScalar(w, j));
      ++j;
    }
    if (j + 16 <= e) {
      const __m512 table = BlockTable16<T>(w.code, BlockAbsmax(w, block));
      for (; j + 16 <= e; j += 16) {
        Store16<T, kFloatOut>(out, j - begin, Lookup16(w.packed + (j >> 1), table, control));
      }
    }
    for (; j < e; ++j) StoreScalar<T, kFloatOut>(out, j - begin, DecodeScalar(w, j));
  }
}

// GemvDirectAvx2 16 values at a time.
template <DenseType T, int R>
ACCEL_TARGET_AVX512 void GemvDirectAvx512(const Gemv4bitArgs& a, int64_t n_begin, int64_t n_end,
                                          int64_t k0, int64_t k1, float* sums,
                                          int64_t sums_stride) {
  const __m512i control = MakeNibbleControl();
  const Packed4bit& w = a.w;
  const float* x = a.x;
  const int64_t xs = a.x_stride;
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m512 acc0[R], acc1[R];
    float tail[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc0[r] = acc1[r] = _mm512_setzero_ps();
      tail[r] = 0.0f;
    }
    const int64_t row = n * a.in, row_end = row + k1;
    int64_t block = (row + k0) / w.blocksize;
    for (int64_t j = row + k0; j < row_end; ++block) {
      const int64_t e = std::min(row_end, (block + 1) * w.blocksize);
      if ((j & 1) != 0) {
        const float v = RoundScalar<T>(DecodeScalar(w, j));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) tail[r] += v * x[r * xs + (j - row)];
        ++j;
      }
      if (j + 16 <= e) {
        const __m512 table = BlockTable16<T>(w.code, BlockAbsmax(w, block));
        for (; j + 32 <= e; j += 32) {
          const __m512 w0 = Lookup16(w.packed + (j >> 1), table, control);
          const __m512 w1 = Lookup16(w.packed + (j >> 1) + 8, table, control);
          const float* xk = x + (j - row);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xk + r * xs), w0, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xk + r * xs + 16), w1, acc1[r]);
          }
        }
        if (j + 16 <= e) {
          const __m512 w0 = Lookup16(w.packed + (j >> 1), table, control);
          const float* xk = x + (j - row);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xk + r * xs), w0, acc0[r]);
          }
          j += 16;
        }
      }
      for (; j < e; ++j) {
        const float v = RoundScalar<T>(DecodeScalar(w, j));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) tail[r] += v * x[r * xs + (j - row)];
      }
    }
    float* sn = sums + (n - n_begin) * sums_stride;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      sn[r] += _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r])) + tail[r];
    }
  }
}

template <DenseType T, int R>
GemvRangeFn DirectKernel(CpuIsa isa) {
  if (isa >= CpuIsa::kAvx512) return GemvDirectAvx512<T, R>;
  if constexpr (R <= 4) return GemvDirectAvx2<T, R>;
  return nullptr;
}

// The register kernel for m rows: up to 4 (AVX2) or 8 (AVX-512).
template <DenseType T, int R = 1>
GemvRangeFn PickDirectRows(CpuIsa isa, int64_t m) {
  if (m == R) return DirectKernel<T, R>(isa);
  if constexpr (R < 8) return PickDirectRows<T, R + 1>(isa, m);
  return nullptr;
}

GemvRangeFn PickDirect(CpuIsa isa, DenseType type, int64_t m) {
  switch (type) {
    case DenseType::kFloat32:
      return PickDirectRows<DenseType::kFloat32>(isa, m);
    case DenseType::kBFloat16:
      return PickDirectRows<DenseType::kBFloat16>(isa, m);
    case DenseType::kFloat16:
      break;
  }
  return PickDirectRows<DenseType::kFloat16>(isa, m);
}

// ---- AVX-512 BF16: Gemv4bit with bfloat16 rounding, 32 values at a time ---
//
// With bfloat16 rounding every weight and every x is a bfloat16, so their
// products are exact in float32 and vdpbf16ps (AVX512-BF16: two such
// products added into each float32 lane) does the work of two float32 FMAs
// on 32 values a register. The weights decode straight to bfloat16: vpermq
// spreads 16 packed bytes so that each 64-bit lane holds the 4 nibbles of its
// 4 words, vpmultishiftqb brings each nibble to the low bits of its word, and
// vpermw looks the 32 words up in the block's 16 bfloat16 values (held
// twice, as vpermw reads 5 index bits); on bnb's layout GemvBf16Blocks64
// decodes two blocks a step with shifts instead, x stored to match. x is
// converted to bfloat16 once per call.
// Like oneDNN's bfloat16 product, vdpbf16ps treats subnormal inputs as 0 and
// flushes subnormal results: the only difference from the float32 levels
// beyond the order of the additions (kernels_cpu.h).

// vpmultishiftqb's control for a qword whose 4 words take the 4 nibbles of
// its bytes 2 pair and 2 pair + 1, high nibble first: word e's low byte takes
// the bits from 8 (2 pair + e / 2) on, plus 4 for an even e. The high bytes
// are not read.
constexpr int64_t Bf16NibbleControl(int pair) {
  int64_t control = 0;
  for (int e = 0; e < 4; ++e) {
    const int64_t bit = 8 * (2 * pair + e / 2) + (e % 2 == 0 ? 4 : 0);
    control |= bit << (16 * e);
  }
  return control;
}

struct Bf16Decoder {
  __m512i spread;   // vpermq: qwords 0-3 <- packed qword 0, 4-7 <- qword 1
  __m512i control;  // vpmultishiftqb
};

ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE Bf16Decoder MakeBf16Decoder() {
  // Output qword q holds elements 4q .. 4q + 3 of the 32, packed bytes 2q and
  // 2q + 1, which vpermq put at bytes 2 (q % 4) of the qword.
  return {_mm512_set_epi64(1, 1, 1, 1, 0, 0, 0, 0),
          _mm512_set_epi64(Bf16NibbleControl(3), Bf16NibbleControl(2), Bf16NibbleControl(1),
                           Bf16NibbleControl(0), Bf16NibbleControl(3), Bf16NibbleControl(2),
                           Bf16NibbleControl(1), Bf16NibbleControl(0))};
}

// The bfloat16 values of the 32 elements whose nibbles are the 16 bytes of
// `packed`, from the block's table.
ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE __m512i Decode32(__m128i packed, __m512i table,
                                                       const Bf16Decoder& d) {
  const __m512i spread = _mm512_permutexvar_epi64(d.spread, _mm512_castsi128_si512(packed));
  return _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(d.control, spread), table);
}

ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE __m128i LoadBytes16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// vdpbf16ps's operand type from 32 bfloat16 bits (GCC 12 and clang 14 give
// no cast intrinsic; both types are 64-byte vectors of 16-bit integers).
ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE __m512bh AsBf16(__m512i v) {
  return (__m512bh)v;  // NOLINT(google-readability-casting)
}

// When a block's absmax passes, its 16 values code[c] * absmax are each 0 or
// a normal float32 (or an overflow to inf), which vcvtneps2bf16 rounds as
// c10::BFloat16 does; otherwise (tiny, NaN or infinite absmax) the integer
// rounding of Round16, which also gets subnormals and NaN right.
struct Bf16TableRule {
  __m512 code{};
  float min_fast = std::numeric_limits<float>::infinity();  // |absmax| from which fast holds
};

// Round16's integer rounding to bfloat16, out of line: only tiny, NaN or
// infinite absmax take it, and its constants would hold registers.
ACCEL_TARGET_AVX512_BF16 __attribute__((noinline)) __m256i Bf16HalfExact(__m512 values) {
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_castps_si512(Round16<DenseType::kBFloat16>(values)), 16));
}

// The table where the rule holds: one vcvtne2ps2bf16 rounds the 16 values
// and writes them twice.
ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE __m512i Bf16FastTable(const Bf16TableRule& rule,
                                                            float absmax) {
  const __m512 values = _mm512_mul_ps(rule.code, _mm512_set1_ps(absmax));
  return (__m512i)_mm512_cvtne2ps_pbh(values, values);  // NOLINT(google-readability-casting)
}

// Whether the rule holds for `absmax` (Bf16FastTable rounds its values).
ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE bool Bf16Fast(const Bf16TableRule& rule, float absmax) {
  const float magnitude = std::fabs(absmax);
  return magnitude >= rule.min_fast && magnitude <= FLT_MAX;
}

ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE __m512i Bf16Table(const Bf16TableRule& rule, float absmax) {
  if (__builtin_expect(static_cast<int64_t>(Bf16Fast(rule, absmax)), 1)) {
    return Bf16FastTable(rule, absmax);
  }
  return _mm512_broadcast_i64x4(Bf16HalfExact(_mm512_mul_ps(rule.code, _mm512_set1_ps(absmax))));
}

// The smallest |absmax| at which every nonzero code[c] * absmax is a normal
// float32: FLT_MIN / min |code[c]|, rounded up; inf (never fast) for a code
// table with a non-finite value.
ACCEL_TARGET_AVX512_BF16 Bf16TableRule MakeBf16TableRule(const float* code) {
  Bf16TableRule rule;
  rule.code = _mm512_loadu_ps(code);
  double min_code = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 16; ++c) {
    if (!std::isfinite(code[c])) return rule;
    if (code[c] != 0.0f) min_code = std::min(min_code, std::fabs(static_cast<double>(code[c])));
  }
  const double bound = static_cast<double>(FLT_MIN) / min_code;
  rule.min_fast = bound >= FLT_MAX ? std::numeric_limits<float>::infinity()
                                   : std::nextafter(static_cast<float>(bound), FLT_MAX);
  return rule;
}

// x rows (float32 values already bfloat16) as bfloat16: out[i * in + k].
ACCEL_TARGET_AVX512_BF16 void ToBf16Rows(const Gemv4bitArgs& a, uint16_t* out) {
  for (int64_t i = 0; i < a.m; ++i) {
    const float* x = a.x + i * a.x_stride;
    uint16_t* o = out + i * a.in;
    int64_t k = 0;
    for (; k + 32 <= a.in; k += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
      _mm512_storeu_si512(o + k, (__m512i)v);  // NOLINT(google-readability-casting)
    }
    for (; k < a.in; ++k) o[k] = c10::BFloat16(x[k]).x;
  }
}

// acc[r] += the products of `count` (<= 32) elements from the byte at
// `packed` but the first `lead` (0 or 1) and x row r from xk: weights and x
// loaded under masks, the elements outside them 0.
template <int R>
ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE void Bf16MaskedStep(__m512 (&acc)[R], const uint8_t* packed,
                                                          int64_t count, int64_t lead,
                                                          __m512i table, const Bf16Decoder& d,
                                                          const uint16_t* xk, int64_t xb_stride) {
  const auto bytes = static_cast<__mmask16>((uint32_t{1} << ((count + 1) / 2)) - 1);
  const auto words = static_cast<__mmask32>(
      (count == 32 ? ~uint32_t{0} : (uint32_t{1} << count) - 1) & ~((uint32_t{1} << lead) - 1));
  const __m512i wv =
      _mm512_maskz_mov_epi16(words, Decode32(_mm_maskz_loadu_epi8(bytes, packed), table, d));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_dpbf16_ps(acc[r], AsBf16(wv),
                              AsBf16(_mm512_maskz_loadu_epi16(words, xk + r * xb_stride)));
  }
}

// GemvDirectAvx512 for bfloat16 rounding, on x as bfloat16 (xb[r * xb_stride
// + k]). Each run of a row inside a block goes in steps of 32 elements from
// its byte boundary; the first and last steps load under masks, so any shape
// and blocksize take the same instructions.
template <int R>
ACCEL_TARGET_AVX512_BF16 void GemvBf16Avx512(const Gemv4bitArgs& a, const uint16_t* xb,
                                             int64_t xb_stride, int64_t n_begin, int64_t n_end,
                                             int64_t k0, int64_t k1, float* sums,
                                             int64_t sums_stride) {
  const Bf16Decoder d = MakeBf16Decoder();
  const Bf16TableRule rule = MakeBf16TableRule(a.w.code);
  const Packed4bit& w = a.w;
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m512 acc0[R], acc1[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    const int64_t row = n * a.in, row_end = row + k1;
    int64_t block = (row + k0) / w.blocksize;
    for (int64_t j = row + k0; j < row_end; ++block) {
      const int64_t e = std::min(row_end, (block + 1) * w.blocksize);
      const __m512i table = Bf16Table(rule, BlockAbsmax(w, block));
      // In steps of 32 elements from the byte boundary at or before j: a
      // masked step for a start mid-byte (the element before j masked off),
      // pairs of full steps, a masked step for the rest.
      int64_t s = j & ~int64_t{1};
      if (s != j) {
        Bf16MaskedStep<R>(acc0, w.packed + (s >> 1), std::min<int64_t>(32, e - s), 1, table, d,
                          xb + (s - row), xb_stride);
        s += 32;
      }
      for (; s + 64 <= e; s += 64) {
        const __m512i w0 = Decode32(LoadBytes16(w.packed + (s >> 1)), table, d);
        const __m512i w1 = Decode32(LoadBytes16(w.packed + (s >> 1) + 16), table, d);
        const uint16_t* xk = xb + (s - row);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc0[r] =
              _mm512_dpbf16_ps(acc0[r], AsBf16(w0), AsBf16(_mm512_loadu_si512(xk + r * xb_stride)));
          acc1[r] = _mm512_dpbf16_ps(acc1[r], AsBf16(w1),
                                     AsBf16(_mm512_loadu_si512(xk + r * xb_stride + 32)));
        }
      }
      for (; s < e; s += 32) {
        Bf16MaskedStep<R>(acc0, w.packed + (s >> 1), std::min<int64_t>(32, e - s), 0, table, d,
                          xb + (s - row), xb_stride);
      }
      j = e;
    }
    float* sn = sums + (n - n_begin) * sums_stride;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sn[r] += _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
  }
}

// GemvBf16Blocks64 decodes two blocks a step with four lookups and no
// shuffle but them: the pair's 64 packed bytes load as 32 words, word j
// holding the nibbles of elements 4j .. 4j + 3 (bnb's order: a byte's high
// nibble first) at bits 4, 0, 12 and 8; three shifts bring each to the low
// bits, vpternlogd masks it and sets bit 4 for the second block's words
// (16-31), and vpermw looks the words up in a table holding the first
// block's 16 bfloat16 values then the second's (one vcvtne2ps2bf16 for
// both). x is stored to match (ToBf16Groups). Decoding a block with
// vbroadcasti32x4 + vpmultishiftqb + vpermw for each 32 elements and a table
// of its own took 1.2x the time on Zen 4, whose two shuffle pipes bound it.
// The element of word j each lookup gives: 4j + kPairOrder[lookup].
constexpr int kPairOrder[4] = {1, 0, 3, 2};

// 32 float32 values from x + k as bfloat16 words.
ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE __m512i Bf16Words(const float* x, int64_t k) {
  // NOLINTNEXTLINE(google-readability-casting)
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
}

// Rows [i0, i0 + rows) of x (float32 values already bfloat16, a.in a
// multiple of 64) as bfloat16, in groups of 128 columns (one block pair) for
// GemvBf16Blocks64: out[(g * rows + r) * 128 + 32 q + j] = x[i0 + r, 128 g
// + 4 j + kPairOrder[q]]; a last group of 64 columns (a.in % 128 == 64) the
// same with 16 words a lookup: out[base + r * 64 + 16 q + j].
ACCEL_TARGET_AVX512_BF16 void ToBf16Groups(const Gemv4bitArgs& a, int64_t i0, int64_t rows,
                                           uint16_t* out) {
  // vpermt2w indices: word j < 16 of lookup q is element 4 j + kPairOrder[q]
  // of the 64 words of two registers.
  __m512i pick[4];
  for (int q = 0; q < 4; ++q) {
    alignas(64) uint16_t idx[32] = {};
    for (int j = 0; j < 16; ++j) idx[j] = static_cast<uint16_t>(4 * j + kPairOrder[q]);
    pick[q] = _mm512_load_si512(idx);
  }
  const int64_t pairs = a.in / 128;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = a.x + (i0 + r) * a.x_stride;
    for (int64_t g = 0; g < pairs; ++g) {
      const __m512i w0 = Bf16Words(x, 128 * g), w1 = Bf16Words(x, 128 * g + 32);
      const __m512i w2 = Bf16Words(x, 128 * g + 64), w3 = Bf16Words(x, 128 * g + 96);
      uint16_t* o = out + (g * rows + r) * 128;
      for (int q = 0; q < 4; ++q) {
        const __m512i low = _mm512_permutex2var_epi16(w0, pick[q], w1);
        const __m512i high = _mm512_permutex2var_epi16(w2, pick[q], w3);
        _mm512_storeu_si512(o + int64_t{32} * q,
                            _mm512_inserti64x4(low, _mm512_castsi512_si256(high), 1));
      }
    }
    if (a.in % 128 != 0) {
      const __m512i w0 = Bf16Words(x, 128 * pairs), w1 = Bf16Words(x, 128 * pairs + 32);
      uint16_t* o = out + pairs * 128 * rows + r * 64;
      for (int q = 0; q < 4; ++q) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + int64_t{16} * q),
                            _mm512_castsi512_si256(_mm512_permutex2var_epi16(w0, pick[q], w1)));
      }
    }
  }
}

// The bfloat16 values of two blocks, the first's in words 0-15 and the
// second's in 16-31 (Bf16Table's rule for each).
ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE __m512i Bf16PairTable(const Bf16TableRule& rule, float first,
                                                            float second, bool both_fast) {
  const __m512 a = _mm512_mul_ps(rule.code, _mm512_set1_ps(first));
  const __m512 b = _mm512_mul_ps(rule.code, _mm512_set1_ps(second));
  if (__builtin_expect(static_cast<int64_t>(both_fast), 1)) {
    return (__m512i)_mm512_cvtne2ps_pbh(b, a);  // NOLINT(google-readability-casting)
  }
  return _mm512_inserti64x4(Bf16Table(rule, first), _mm512_castsi512_si256(Bf16Table(rule, second)),
                            1);
}

// The pair decoder's constants.
struct Bf16PairDecoder {
  __m512i nibble;  // 0x000f in every word
  __m512i second;  // bit 4 of the second block's words: its half of the table
};

ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE Bf16PairDecoder MakeBf16PairDecoder() {
  return {_mm512_set1_epi16(0x0f),
          _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(0x10), 1)};
}

// acc0/acc1[r] += the products of the 128 weights of a block pair (64
// packed bytes at p, from `table`: Bf16PairTable) and x row r's 128 values,
// as ToBf16Groups leaves them.
template <int R>
ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE void Bf16PairStep(__m512 (&acc0)[R], __m512 (&acc1)[R],
                                                        const uint8_t* p, __m512i table,
                                                        const Bf16PairDecoder& d,
                                                        const uint16_t* x) {
  constexpr int kSelect = 0xEA;  // (a & b) | c
  const __m512i w = _mm512_loadu_si512(p);
  const __m512i q0 =
      _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(w, d.nibble, d.second, kSelect), table);
  const __m512i q1 = _mm512_permutexvar_epi16(
      _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), d.nibble, d.second, kSelect), table);
  const __m512i q2 = _mm512_permutexvar_epi16(
      _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), d.nibble, d.second, kSelect), table);
  const __m512i q3 =
      _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(w, 12), d.second), table);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const uint16_t* xr = x + int64_t{128} * r;
    acc0[r] = _mm512_dpbf16_ps(acc0[r], AsBf16(q0), AsBf16(_mm512_loadu_si512(xr)));
    acc1[r] = _mm512_dpbf16_ps(acc1[r], AsBf16(q2), AsBf16(_mm512_loadu_si512(xr + 64)));
    acc0[r] = _mm512_dpbf16_ps(acc0[r], AsBf16(q1), AsBf16(_mm512_loadu_si512(xr + 32)));
    acc1[r] = _mm512_dpbf16_ps(acc1[r], AsBf16(q3), AsBf16(_mm512_loadu_si512(xr + 96)));
  }
}

// 16 words at p, zero-extended to 512 bits.
ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE __m512i LoadWords16(const uint16_t* p) {
  return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The same for a lone block (a row's last when a.in % 128 == 64): 32 bytes
// as 16 words, looked up in 256-bit registers (vpermw reads 4 index bits
// there, so no mask), x as ToBf16Groups leaves a last group of 64.
template <int R>
ACCEL_TARGET_AVX512_BF16 ACCEL_INLINE void Bf16SingleStep(__m512 (&acc0)[R], __m512 (&acc1)[R],
                                                          const uint8_t* p, __m512i table,
                                                          const uint16_t* x) {
  const __m256i t = _mm512_castsi512_si256(table);
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i q[4] = {
      _mm512_zextsi256_si512(_mm256_permutexvar_epi16(w, t)),
      _mm512_zextsi256_si512(_mm256_permutexvar_epi16(_mm256_srli_epi16(w, 4), t)),
      _mm512_zextsi256_si512(_mm256_permutexvar_epi16(_mm256_srli_epi16(w, 8), t)),
      _mm512_zextsi256_si512(_mm256_permutexvar_epi16(_mm256_srli_epi16(w, 12), t))};
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const uint16_t* xr = x + int64_t{64} * r;
    acc0[r] = _mm512_dpbf16_ps(acc0[r], AsBf16(q[0]), AsBf16(LoadWords16(xr + 0)));
    acc1[r] = _mm512_dpbf16_ps(acc1[r], AsBf16(q[2]), AsBf16(LoadWords16(xr + 32)));
    acc0[r] = _mm512_dpbf16_ps(acc0[r], AsBf16(q[1]), AsBf16(LoadWords16(xr + 16)));
    acc1[r] = _mm512_dpbf16_ps(acc1[r], AsBf16(q[3]), AsBf16(LoadWords16(xr + 48)));
  }
}

// Double quant: block b's absmax is nested_code[its code] * nested_absmax
// [b / 256] + offset (BlockAbsmax: two roundings). A group of 256 blocks
// shares its nested absmax, so its 256 possible absmax are made once, 16 at
// a time, into `table` (and whether the fast table holds for all of them),
// and a block reads its own by its code.
// NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): see `table`.
struct NestedGroupTable {
  // Not zeroed: FillNestedGroup writes it before any read (group -1), and a
  // kilobyte's memset on every call of the plain-NF4 path would cost there.
  alignas(64) float table[256];
  int64_t group = -1;
  bool all_fast = false;
};

ACCEL_TARGET_AVX512_BF16 void FillNestedGroup(const Packed4bit& w, const Bf16TableRule& rule,
                                              int64_t group, NestedGroupTable& t) {
  const __m512 scale = _mm512_set1_ps(w.nested_absmax[group]);
  const __m512 offset = _mm512_set1_ps(w.nested_offset);
  __mmask16 fast = 0xffff;
  for (int c = 0; c < 256; c += 16) {
    __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(w.nested_code + c), scale);
    Unfused(scaled);  // two roundings, as bnb's two steps
    const __m512 absmax = _mm512_add_ps(scaled, offset);
    _mm512_store_ps(t.table + c, absmax);
    const __m512 magnitude = _mm512_abs_ps(absmax);
    fast &= _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(rule.min_fast), _CMP_GE_OQ) &
            _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ);
  }
  t.group = group;
  t.all_fast = fast == 0xffff;
}

// GemvBf16Avx512 for the common layout (bnb's blocksize 64, rows of a
// multiple of 64 elements): a block is 64 elements and never crosses a row;
// a row's blocks go in pairs from its start (Bf16PairStep), its last alone
// when a.in % 128 == 64 (Bf16SingleStep), and x comes as ToBf16Groups
// leaves it, so one pointer serves all R rows with no masks. k0 and k1 are
// multiples of 128 but for k1 = a.in. The blocks' absmax are checked 16 at
// a time for the fast table (Bf16TableRule), which then takes three
// instructions a pair (double quant: from the groups' tables, checked once
// a group).
template <int R>
ACCEL_TARGET_AVX512_BF16 void GemvBf16Blocks64(const Gemv4bitArgs& a, const uint16_t* xg,
                                               int64_t n_begin, int64_t n_end, int64_t k0,
                                               int64_t k1, float* sums, int64_t sums_stride) {
  const Bf16PairDecoder d = MakeBf16PairDecoder();
  const Bf16TableRule rule = MakeBf16TableRule(a.w.code);
  const Packed4bit& w = a.w;
  // Double quant: a block's absmax from its group's table (the tables were a
  // tile's absmax expanded 16 blocks at a time by a gather into a buffer
  // first: 1.20x the time of a float32 absmax at one row, for 8% fewer
  // bytes).
  const bool nested = w.absmax == nullptr;
  NestedGroupTable nested_group;
  // Block b's absmax; `fast` cleared unless its group's all hold the rule.
  const auto nested_absmax = [&](int64_t b, bool& fast) {
    if ((b >> kNestedBlockShift) != nested_group.group) {
      FillNestedGroup(w, rule, b >> kNestedBlockShift, nested_group);
    }
    fast = fast && nested_group.all_fast;
    return nested_group.table[w.absmax_codes[b]];
  };
  const bool x_spills = int64_t{R} * (k1 - k0) * int64_t{sizeof(uint16_t)} > kBf16XInL1Bytes;
  const auto prefetch = [x_spills](const uint8_t* p) {
    if (x_spills) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kBf16FarPrefetchBytes), _MM_HINT_T1);
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(p + kBf16PrefetchBytes), _MM_HINT_T0);
    }
  };
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m512 acc0[R], acc1[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    const int64_t b_begin = (n * a.in + k0) / 64, b_end = (n * a.in + k1) / 64;
    const uint16_t* x = xg + k0 * R;  // group k0 / 128
    if (nested) {
      const uint8_t* p = w.packed + b_begin * 32;
      int64_t b = b_begin;
      for (; b + 2 <= b_end; b += 2, p += 64, x += int64_t{128} * R) {
        prefetch(p);
        bool fast = true;
        const float first = nested_absmax(b, fast), second = nested_absmax(b + 1, fast);
        fast = fast || (Bf16Fast(rule, first) && Bf16Fast(rule, second));
        Bf16PairStep<R>(acc0, acc1, p, Bf16PairTable(rule, first, second, fast), d, x);
      }
      if (b < b_end) {
        bool fast = true;
        Bf16SingleStep<R>(acc0, acc1, p, Bf16Table(rule, nested_absmax(b, fast)), x);
      }
    }
    for (int64_t b = b_begin; !nested && b < b_end; b += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, b_end - b));
      const auto lanes = static_cast<__mmask16>((1u << count) - 1);
      const float* am = w.absmax + b;
      const __m512 magnitude = _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes, am));
      const __mmask16 fast =
          _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(rule.min_fast), _CMP_GE_OQ) &
          _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ);
      const uint8_t* p = w.packed + b * 32;
      const int pairs_end = count & ~1;
      for (int i = 0; i < pairs_end; i += 2, p += 64, x += int64_t{128} * R) {
        prefetch(p);
        const bool both = ((fast >> i) & 3) == 3;
        Bf16PairStep<R>(acc0, acc1, p, Bf16PairTable(rule, am[i], am[i + 1], both), d, x);
      }
      if (count != pairs_end) {
        Bf16SingleStep<R>(acc0, acc1, p, Bf16Table(rule, am[pairs_end]), x);
        x += int64_t{64} * R;
      }
    }
    float* sn = sums + (n - n_begin) * sums_stride;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sn[r] += _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
  }
}

// The bfloat16 kernels for R rows: any layout on x row by row, and the
// common one on x interleaved.
struct Bf16Kernels {
  void (*rows)(const Gemv4bitArgs&, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
               float*, int64_t);
  void (*blocks64)(const Gemv4bitArgs&, const uint16_t*, int64_t, int64_t, int64_t, int64_t, float*,
                   int64_t);
};

// Dequantize4bit to bfloat16 at the AVX512-BF16 level: 32 elements a step,
// decoded as the bfloat16 GEMV decodes them (Decode32 on the block's table
// from Bf16Table, code x absmax in float32 rounded as c10::BFloat16 rounds),
// where the AVX-512 level takes 16 a step through a float32 table and the
// integer rounding. Prefill of a 256-token prompt on Mixtral dequantizes
// every expert it reaches: that decode was 40% of the prompt's samples.
ACCEL_TARGET_AVX512_BF16 void DecodeRangeBf16(const Packed4bit& w, int64_t begin, int64_t end,
                                              void* out) {
  const Bf16Decoder d = MakeBf16Decoder();
  const Bf16TableRule rule = MakeBf16TableRule(w.code);
  auto* words = static_cast<uint16_t*>(out);
  int64_t block = begin / w.blocksize;
  for (int64_t j = begin; j < end; ++block) {
    const int64_t e = std::min(end, (block + 1) * w.blocksize);
    if ((j & 1) != 0) {
      StoreScalar<DenseType::kBFloat16, false>(out, j - begin, DecodeScalar(w, j));
      ++j;
    }
    if (j + 32 <= e) {
      const __m512i table = Bf16Table(rule, BlockAbsmax(w, block));
      for (; j + 32 <= e; j += 32) {
        _mm512_storeu_si512(words + (j - begin),
                            Decode32(LoadBytes16(w.packed + (j >> 1)), table, d));
      }
    }
    for (; j < e; ++j) StoreScalar<DenseType::kBFloat16, false>(out, j - begin, DecodeScalar(w, j));
  }
}

// The kernels for 1-8 rows.
template <int R = 1>
Bf16Kernels PickBf16(int64_t m) {
  if (m == R) return {GemvBf16Avx512<R>, GemvBf16Blocks64<R>};
  if constexpr (R < 8) return PickBf16<R + 1>(m);
  return {nullptr, nullptr};
}

#endif  // __x86_64__

// Rows of x in passes of at most max_rows, as even as possible (9 = 5 + 4):
// (first row, rows) of each.
std::vector<std::pair<int64_t, int64_t>> SplitRows(int64_t m, int64_t max_rows) {
  const int64_t passes = (m + max_rows - 1) / max_rows;
  std::vector<std::pair<int64_t, int64_t>> split;
  for (int64_t p = 0, i0 = 0; p < passes; ++p) {
    const int64_t rows = (m - i0) / (passes - p);
    split.emplace_back(i0, rows);
    i0 += rows;
  }
  return split;
}

// at::parallel_for over the weight rows [0, n), handed out as the threads
// ask for them: pieces of about n / (threads * kPiecesPerThread) rows (at
// least `grain`, whole kRowTile tiles), in ascending order from one atomic
// counter. at::parallel_for gives each thread one fixed share, so a thread
// the OS takes away for a while (the expert reader, the sampler, another
// process on a 2-core machine) makes the others wait for it at the end: a
// profile of a sampled big-model decode found 11% of its samples in
// libgomp's wait at the end of a product. The rows each piece computes,
// and so the numbers, are the same.
inline constexpr int64_t kPiecesPerThread = 8;

template <typename F>
void ParallelRows(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  int64_t piece =
      std::max<int64_t>(grain, (n + threads * kPiecesPerThread - 1) / (threads * kPiecesPerThread));
  piece = (piece + kRowTile - 1) / kRowTile * kRowTile;
  if (threads <= 1 || piece >= n) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t pieces = (n + piece - 1) / piece;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, pieces), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < pieces; i = next.fetch_add(1)) {
      f(i * piece, std::min(n, (i + 1) * piece));
    }
  });
}

// Gemv4bit's register paths: weight rows split over the threads and taken
// kRowTile at a time through every tile of columns, rows of x in `passes`
// (SplitRows). Columns go in tiles whose rows of x (x_bytes an element)
// take at most tile_bytes: by default they fit in the L1 cache next to the
// weights streaming through, as the float32 kernels need (4 rows of 4096
// float32 columns, 64 KiB, would come from L2 for every weight row, which
// bounds a kernel at 4 rows to a quarter of its speed at 1, measured); the
// bfloat16 kernels up to kBf16WholeRows rows take kBf16XTileBytes. Tiles
// are whole multiples of k_align columns.
// pass(i0, rows, n0, n1, k0, k1, sums) adds the products of weight rows
// [n0, n1), columns [k0, k1) and rows [i0, i0 + rows) of x to
// sums[(n - n0) * a.m + i0 + i].
template <typename Pass>
void RunRegisterPasses(const Gemv4bitArgs& a, int64_t grain,
                       const std::vector<std::pair<int64_t, int64_t>>& passes, int64_t x_bytes,
                       const Pass& pass, int64_t tile_bytes = kXTileBytes, int64_t k_align = 64) {
  const int64_t pass_rows = passes.front().second;  // the most
  const int64_t k_tile =
      std::max<int64_t>(k_align, (tile_bytes / (x_bytes * pass_rows)) / k_align * k_align);
  ParallelRows(a.out, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(static_cast<size_t>(kRowTile * a.m));
    for (int64_t n0 = begin; n0 < end; n0 += kRowTile) {
      const int64_t n1 = std::min(end, n0 + kRowTile);
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t k0 = 0; k0 < a.in; k0 += k_tile) {
        const int64_t k1 = std::min(a.in, k0 + k_tile);
        for (const auto& [i0, rows] : passes) pass(i0, rows, n0, n1, k0, k1, sums.data() + i0);
      }
      for (int64_t n = n0; n < n1; ++n) {
        const float bias = a.bias != nullptr ? a.bias[n] : 0.0f;
        for (int64_t i = 0; i < a.m; ++i) {
          a.y[i * a.y_stride + n] = sums[static_cast<size_t>((n - n0) * a.m + i)] + bias;
        }
      }
    }
  });
}

struct Support {
  bool avx2 = false;
  bool avx512 = false;
  bool avx512_bf16 = false;
};

Support Detect() {
  const CpuFeatures& f = CpuFeaturesOfThisMachine();
  Support s;
  s.avx2 = f.avx2_fma_f16c;
  s.avx512 = s.avx2 && f.avx512_f_bw && f.avx512_vl_vbmi && f.avx512_vnni;
  s.avx512_bf16 = s.avx512 && f.avx512_bf16;
  return s;
}

const Support& CpuSupport() {
  static const Support support = Detect();
  return support;
}

// -1: none; otherwise a CpuIsa.
std::atomic<int> g_isa_override{-1};

// Decoding a range of flat elements, by ISA and output.
using DecodeFn = void (*)(const Packed4bit&, int64_t, int64_t, void*);

template <bool kFloatOut>
DecodeFn PickDecode(CpuIsa isa, DenseType type) {
#if defined(__x86_64__)
  if (isa == CpuIsa::kAvx512Bf16 && type == DenseType::kBFloat16 && !kFloatOut) {
    return DecodeRangeBf16;
  }
  if (isa >= CpuIsa::kAvx512) {
    switch (type) {
      case DenseType::kFloat32:
        return DecodeRangeAvx512<DenseType::kFloat32, kFloatOut>;
      case DenseType::kBFloat16:
        return DecodeRangeAvx512<DenseType::kBFloat16, kFloatOut>;
      case DenseType::kFloat16:
        return DecodeRangeAvx512<DenseType::kFloat16, kFloatOut>;
    }
  }
  if (isa == CpuIsa::kAvx2) {
    switch (type) {
      case DenseType::kFloat32:
        return DecodeRangeAvx2<DenseType::kFloat32, kFloatOut>;
      case DenseType::kBFloat16:
        return DecodeRangeAvx2<DenseType::kBFloat16, kFloatOut>;
      case DenseType::kFloat16:
        return DecodeRangeAvx2<DenseType::kFloat16, kFloatOut>;
    }
  }
#endif
  switch (type) {
    case DenseType::kFloat32:
      return DecodeRangeScalar<DenseType::kFloat32, kFloatOut>;
    case DenseType::kBFloat16:
      return DecodeRangeScalar<DenseType::kBFloat16, kFloatOut>;
    case DenseType::kFloat16:
      break;
  }
  return DecodeRangeScalar<DenseType::kFloat16, kFloatOut>;
}

}  // namespace

void CheckSupported(CpuIsa isa, const char* what) {
  if (!CpuIsaSupported(isa)) {
    std::fprintf(stderr, "%s: this CPU cannot run the %s kernels\n", what, CpuIsaName(isa).data());
    std::abort();
  }
}

absl::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

bool CpuIsaSupported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
      return CpuSupport().avx2;
    case CpuIsa::kAvx512:
      return CpuSupport().avx512;
    case CpuIsa::kAvx512Bf16:
      return CpuSupport().avx512_bf16;
  }
  return false;
}

CpuIsa ActiveIsa() {
  const int forced = g_isa_override.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<CpuIsa>(forced);
  if (CpuSupport().avx512_bf16) return CpuIsa::kAvx512Bf16;
  if (CpuSupport().avx512) return CpuIsa::kAvx512;
  return CpuSupport().avx2 ? CpuIsa::kAvx2 : CpuIsa::kScalar;
}

void SetIsaOverrideForTesting(std::optional<CpuIsa> isa) {
  if (isa) CheckSupported(*isa, "SetIsaOverrideForTesting");
  g_isa_override.store(isa ? static_cast<int>(*isa) : -1, std::memory_order_relaxed);
}

void Dequantize4bit(CpuIsa isa, const Packed4bit& w, DenseType type, void* out) {
  Dequantize4bitRange(isa, w, type, 0, w.numel, out);
}

namespace {

void DecodeRangeThreaded(CpuIsa isa, const Packed4bit& w, DenseType type, bool float_out,
                         int64_t first, int64_t last, void* out) {
  CheckSupported(isa, "Dequantize4bit");
  if (first % 16 != 0) {
    std::fprintf(stderr, "Dequantize4bitRange: first (%lld) is not a multiple of 16\n",
                 static_cast<long long>(first));
    std::abort();
  }
  last = std::min(last, w.numel);
  if (last <= first) return;
  const DecodeFn decode = float_out ? PickDecode<true>(isa, type) : PickDecode<false>(isa, type);
  const int64_t element = float_out || type == DenseType::kFloat32 ? 4 : 2;
  // Ranges of whole 16-element groups, so a thread's part starts on a byte.
  const int64_t groups = (last - first + 15) / 16;
  at::parallel_for(0, groups, kMinBytesPerTask / (16 * element), [&](int64_t begin, int64_t end) {
    const int64_t from = first + begin * 16, to = std::min(last, first + end * 16);
    decode(w, from, to, static_cast<char*>(out) + (from - first) * element);
  });
}

}  // namespace

void Dequantize4bitRange(CpuIsa isa, const Packed4bit& w, DenseType type, int64_t first,
                         int64_t last, void* out) {
  DecodeRangeThreaded(isa, w, type, /*float_out=*/false, first, last, out);
}

void Dequantize4bitRangeAsFloat(CpuIsa isa, const Packed4bit& w, DenseType round, int64_t first,
                                int64_t last, float* out) {
  DecodeRangeThreaded(isa, w, round, /*float_out=*/true, first, last, out);
}

void Gemv4bit(CpuIsa isa, const Gemv4bitArgs& a) {
  CheckSupported(isa, "Gemv4bit");
  if (a.m <= 0 || a.out <= 0) return;
  const DecodeFn decode = PickDecode<true>(isa, a.round);
  auto dot = isa == CpuIsa::kScalar ? DotRowsScalar : nullptr;
#if defined(__x86_64__)
  if (isa != CpuIsa::kScalar) dot = DotRowsAvx2Any;
#endif
  const int64_t row_bytes = std::max<int64_t>(1, a.in / 2);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / row_bytes);
  bool nibble_layout = false;
#if defined(__x86_64__)
  // Decoded straight into registers: with AVX-512 any number of rows, in
  // passes of at most 8 (a lookup costs two instructions, so decoding a
  // weight tile again from L1 is cheaper than a buffer). With AVX2 and the
  // common layout (quant/internal/nibble_avx2.h: byte lookups over a
  // rearranged x) 1-4 rows: since its tables are built a group ahead and
  // rows are walked whole, 3 and 4 rows in registers beat the buffer below
  // (14336 x 4096, two threads: 3 rows 4.0 against 6.4 ms, 4 rows 5.5
  // against 7.2; two passes of 2 rows would be 6.6), where they had lost to
  // it before (one 4096 x 4096 weight from cache, one thread: 3 rows 3.8
  // against 4.5 ms); 5 rows on take the buffer (8 rows: 10.6 ms against
  // two passes of 4, 11). With AVX2 and other layouts up to 4 (4 rows 4.9
  // against the buffer's 5.1, 3 rows slower).
  // With AVX512-BF16 and bfloat16 rounding, weights and x as bfloat16 and
  // vdpbf16ps for the products, any number of rows in passes of 8.
  if (isa == CpuIsa::kAvx512Bf16 && a.round == DenseType::kBFloat16) {
    constexpr int64_t kMaxRows = 8;
    const bool blocks64 = a.w.blocksize == 64 && a.in % 64 == 0;
    const std::vector<std::pair<int64_t, int64_t>> passes = SplitRows(a.m, kMaxRows);
    std::vector<uint16_t> xb(static_cast<size_t>(a.m * a.in));
    if (blocks64) {
      for (const auto& [i0, rows] : passes) {
        ToBf16Groups(a, i0, rows, xb.data() + i0 * a.in);
      }
    } else {
      ToBf16Rows(a, xb.data());
    }
    RunRegisterPasses(
        a, grain, passes, sizeof(uint16_t),
        [&](int64_t i0, int64_t rows, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* sums) {
          const Bf16Kernels kernels = PickBf16(rows);
          const uint16_t* x = xb.data() + i0 * a.in;
          if (blocks64) {
            kernels.blocks64(a, x, n0, n1, k0, k1, sums, a.m);
          } else {
            kernels.rows(a, x, a.in, n0, n1, k0, k1, sums, a.m);
          }
        },
        passes.front().second <= kBf16WholeRows ? kBf16XTileBytes : kXTileBytes,
        blocks64 ? 128 : 64);  // GemvBf16Blocks64's tiles: whole block pairs
    return;
  }
  const int64_t max_direct = isa >= CpuIsa::kAvx512 ? 8 : 4;
  nibble_layout = isa == CpuIsa::kAvx2 && NibbleGemvApplies(a);
  const bool nibble = nibble_layout && a.m <= kNibbleMaxRows;
  if (isa >= CpuIsa::kAvx512 || nibble || (isa == CpuIsa::kAvx2 && !nibble_layout && a.m <= 4)) {
    std::vector<float> permuted;
    Gemv4bitArgs src = a;
    if (nibble) {
      permuted.resize(static_cast<size_t>(a.m * a.in));
      NibblePermuteX(a, permuted.data());
      src.x = permuted.data();
      src.x_stride = a.m * 64;
    }
    RunRegisterPasses(
        a, grain, SplitRows(a.m, max_direct), sizeof(float),
        [&](int64_t i0, int64_t rows, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* sums) {
          Gemv4bitArgs part = src;
          part.m = rows;
          part.x = src.x + i0 * (nibble ? 64 : src.x_stride);
          const GemvRangeFn kernel =
              nibble ? NibbleKernel(a.round, rows) : PickDirect(isa, a.round, rows);
          kernel(part, n0, n1, k0, k1, sums, a.m);
        },
        // The nibble kernels take whole rows: cut into column tiles that
        // keep x in L1, each weight row became pieces of a few KiB out of
        // order, and the AVX2 machine read them slower than whole rows
        // with x from L2 (4096 x 14336, one row, two threads: 3.19 against
        // 2.63 ms; docs/BENCHMARKS.md, "AVX2: tables built a group ahead,
        // rows whole").
        nibble ? a.in * a.m * int64_t{sizeof(float)} : kXTileBytes);
    return;
  }
#endif
  // More rows (AVX2, scalar): each weight row decoded once, a chunk at a time, into the L1
  // cache, then dotted with every row of x from there, two weight rows at a
  // time (each x vector loaded serves both).
  // AVX2 with the nibble layout: rows decoded by byte lookups, x rearranged
  // row by row to match.
  std::vector<float> permuted;
  const float* x = a.x;
  int64_t x_stride = a.x_stride;
  if (nibble_layout) {
    permuted.resize(static_cast<size_t>(a.m * a.in));
    NibblePermuteRows(a, permuted.data());
    x = permuted.data();
    x_stride = a.in;
  }
  ParallelRows(a.out, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float chunks[2][kChunk];
    const float* w[2] = {chunks[0], chunks[1]};
    std::vector<float> sums(static_cast<size_t>(2 * a.m));
    float* s[2] = {sums.data(), sums.data() + a.m};
    for (int64_t n = begin; n < end; n += 2) {
      const int64_t cols = std::min<int64_t>(2, end - n);
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t k0 = 0; k0 < a.in; k0 += kChunk) {
        const int64_t len = std::min(kChunk, a.in - k0);
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t first = (n + c) * a.in + k0;
          if (nibble_layout) {
            NibbleDecodeRow(a, n + c, k0, k0 + len, chunks[c]);
          } else {
            decode(a.w, first, first + len, chunks[c]);
          }
        }
        dot(w, cols, len, x + k0, x_stride, a.m, s);
      }
      for (int64_t c = 0; c < cols; ++c) {
        const float bias = a.bias != nullptr ? a.bias[n + c] : 0.0f;
        for (int64_t i = 0; i < a.m; ++i) a.y[i * a.y_stride + n + c] = s[c][i] + bias;
      }
    }
  });
}

namespace {

template <DenseType T>
using DenseTag = std::integral_constant<DenseType, T>;

// fn(DenseTag<a>(), DenseTag<b>()): a run-time pair of dense types as
// compile-time ones.
template <typename Fn>
void WithDenseTypes(DenseType a, DenseType b, Fn&& fn) {
  auto with_b = [&](auto a_tag) {
    switch (b) {
      case DenseType::kFloat32:
        return fn(a_tag, DenseTag<DenseType::kFloat32>());
      case DenseType::kBFloat16:
        return fn(a_tag, DenseTag<DenseType::kBFloat16>());
      case DenseType::kFloat16:
        break;
    }
    return fn(a_tag, DenseTag<DenseType::kFloat16>());
  };
  switch (a) {
    case DenseType::kFloat32:
      return with_b(DenseTag<DenseType::kFloat32>());
    case DenseType::kBFloat16:
      return with_b(DenseTag<DenseType::kBFloat16>());
    case DenseType::kFloat16:
      break;
  }
  return with_b(DenseTag<DenseType::kFloat16>());
}

}  // namespace

void LoadRounded(CpuIsa isa, const void* in, DenseType from, int64_t n, DenseType round,
                 float* out) {
  CheckSupported(isa, "LoadRounded");
  WithDenseTypes(from, round, [&](auto from_tag, auto round_tag) {
    constexpr DenseType kFrom = decltype(from_tag)::value, kRound = decltype(round_tag)::value;
#if defined(__x86_64__)
    if (isa != CpuIsa::kScalar) return LoadRoundedAvx2<kFrom, kRound>(in, n, out);
#endif
    LoadRoundedScalar<kFrom, kRound>(in, n, out);
  });
}

void StoreRounded(CpuIsa isa, const float* in, int64_t n, DenseType round, DenseType to,
                  void* out) {
  CheckSupported(isa, "StoreRounded");
  WithDenseTypes(round, to, [&](auto round_tag, auto to_tag) {
    constexpr DenseType kRound = decltype(round_tag)::value, kTo = decltype(to_tag)::value;
#if defined(__x86_64__)
    if (isa != CpuIsa::kScalar) return StoreRoundedAvx2<kRound, kTo>(in, n, out);
#endif
    StoreRoundedScalar<kRound, kTo>(in, n, out);
  });
}

}  // namespace accel::quant::internal
