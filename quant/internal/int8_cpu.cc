// The int8 kernels of kernels_cpu.h (Int8Matmul, QuantizeInt8Rows,
// Int8Rescale): LLM.int8's activation quantization, exact int8 product and
// rescale, at the same levels as the 4-bit kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Compiled with -fopenmp and without the shared PCH (accel_torch_parallel in
// quant/CMakeLists.txt): at::parallel_for is serial otherwise.
#include <ATen/Parallel.h>

#include "quant/internal/kernels_cpu.h"
#include "quant/internal/x86_targets.h"

namespace accel::quant::internal {
namespace {

// Rows of A from which the AVX-512 int8 product keeps rows in lanes
// (Int8VnniLanes) instead of in registers of their own.
constexpr int64_t kInt8LanesMinRows = 12;

// ---- Portable ---------------------------------------------------------------

void Int8Scalar(const int8_t* a, const int8_t* b, int64_t m, int64_t k, int64_t n_begin,
                int64_t n_end, int32_t* c) {
  for (int64_t col = n_begin; col < n_end; ++col) {
    const int8_t* bc = b + col * k;
    for (int64_t i = 0; i < m; ++i) {
      const int8_t* ai = a + i * k;
      int32_t sum = 0;
      for (int64_t t = 0; t < k; ++t) sum += static_cast<int32_t>(ai[t]) * bc[t];
      c[col * m + i] = sum;
    }
  }
}

// QuantizeInt8Rows one element at a time. Always inlined, so that in the
// AVX2 wrapper std::nearbyint becomes one vroundss (a libm call otherwise).
inline __attribute__((always_inline)) void QuantizeInt8RowsBody(const float* a, int64_t m,
                                                                int64_t k, float threshold,
                                                                uint8_t* outlier_col, float* sca,
                                                                int8_t* codes) {
  const bool decompose = threshold > 0.0f;
  std::memset(outlier_col, 0, static_cast<size_t>(k));
  for (int64_t i = 0; decompose && i < m; ++i) {
    for (int64_t t = 0; t < k; ++t) {
      if (std::fabs(a[i * k + t]) >= threshold) outlier_col[t] = 1;
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    const float* ai = a + i * k;
    int8_t* ci = codes + i * k;
    float absmax = 0.0f;
    for (int64_t t = 0; t < k; ++t) {
      const float v = std::fabs(ai[t]);
      if (!(decompose && v >= threshold)) absmax = std::max(absmax, v);  // NaN: kept out
    }
    sca[i] = absmax;
    if (absmax == 0.0f) {
      std::memset(ci, 0, static_cast<size_t>(k));
      continue;
    }
    const float scale = 127.0f / absmax;
    for (int64_t t = 0; t < k; ++t) {
      const bool zero =
          (decompose && std::fabs(ai[t]) >= threshold) || (m > 1 && outlier_col[t] != 0);
      const float r = std::nearbyint(ai[t] * scale);
      ci[t] = !zero && r >= -128.0f && r <= 127.0f ? static_cast<int8_t>(r) : int8_t{0};
    }
  }
}

void QuantizeInt8RowsScalar(const float* a, int64_t m, int64_t k, float threshold,
                            uint8_t* outlier_col, float* sca, int8_t* codes) {
  QuantizeInt8RowsBody(a, m, k, threshold, outlier_col, sca, codes);
}

// 16 outputs (a cache line of y) at a time, row by row: neither c nor y is
// walked along a column, whose values, a row apart, fall in the same L1 sets.
void Int8RescaleScalar(const Int8RescaleArgs& a, int64_t n_begin, int64_t n_end) {
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
    const int64_t n1 = std::min(n_end, n0 + 16);
    for (int64_t m = 0; m < a.rows; ++m) {
      for (int64_t n = n0; n < n1; ++n) {
        float v = static_cast<float>(a.c[n * a.rows + m]) * (a.sca[m] * a.scb[n]);
        v *= kInv127Squared;
        if (a.bias != nullptr) {
          Unfused(v);
          v += a.bias[n];
        }
        if (a.nout > 0) {
          float extra = 0.0f;
          for (int64_t j = 0; j < a.nout; ++j) {
            float p = a.outlier_x[m * a.nout + j] * a.outlier_w[j * a.out + n];
            Unfused(p);
            extra += p;
          }
          v += extra;
        }
        a.y[m * a.out + n] = v;
      }
    }
  }
}

// ---- AVX2 -------------------------------------------------------------------

#if defined(__x86_64__)

ACCEL_TARGET_AVX2 ACCEL_INLINE int32_t SumInt8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

ACCEL_TARGET_AVX2 void QuantizeInt8RowsAvx2(const float* a, int64_t m, int64_t k, float threshold,
                                            uint8_t* outlier_col, float* sca, int8_t* codes) {
  QuantizeInt8RowsBody(a, m, k, threshold, outlier_col, sca, codes);
}

// C[i0 + r, n0 + c] for r < R, c < C: int8 sign-extended to int16, products
// summed in pairs by vpmaddwd (exact: |pair| <= 2 * 128^2) into int32 lanes.
// a16 is A already widened to int16, so each row is widened once per call.
template <int R, int C>
ACCEL_TARGET_AVX2 void Int8Avx2(const int16_t* a16, const int8_t* b, int64_t k, int64_t m,
                                int64_t i0, int64_t n0, int32_t* c) {
  __m256i acc[R][C] = {};  // zeros
  const int8_t* bn = b + n0 * k;
  const int16_t* ai = a16 + i0 * k;
  int64_t t = 0;
  for (; t + 16 <= k; t += 16) {
    __m256i wv[C];
#pragma GCC unroll 4
    for (int cc = 0; cc < C; ++cc) {
      wv[cc] =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bn + cc * k + t)));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ai + r * k + t));
#pragma GCC unroll 4
      for (int cc = 0; cc < C; ++cc) {
        acc[r][cc] = _mm256_add_epi32(acc[r][cc], _mm256_madd_epi16(xv, wv[cc]));
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int cc = 0; cc < C; ++cc) {
      int32_t sum = SumInt8(acc[r][cc]);
      for (int64_t u = t; u < k; ++u) sum += static_cast<int32_t>(ai[r * k + u]) * bn[cc * k + u];
      c[(n0 + cc) * m + i0 + r] = sum;
    }
  }
}

// Columns of rows in blocks of R with C columns each (registers: R x C
// accumulators, C weights, one x), the column group outermost so its weight
// rows stay in the L1 cache for every block of rows.
template <int R>
void Int8Avx2Rows(const int16_t* a16, const int8_t* b, int64_t k, int64_t m, int64_t i0,
                  int64_t n_begin, int64_t n_end, int32_t* c) {
  constexpr int C = R <= 2 ? 4 : R == 3 ? 3 : 2;
  int64_t col = n_begin;
  for (; col + C <= n_end; col += C) Int8Avx2<R, C>(a16, b, k, m, i0, col, c);
  for (; col < n_end; ++col) Int8Avx2<R, 1>(a16, b, k, m, i0, col, c);
}

// Calls rows(std::integral_constant<int, R>{}, i) for the blocks [i, i + R)
// of up to 4 of m rows: the int8 kernels keep R rows in registers.
template <typename Rows>
void ForEachRowBlock(int64_t m, Rows&& rows) {
  for (int64_t i = 0; i < m; i += 4) {
    switch (std::min<int64_t>(4, m - i)) {
      case 1:
        rows(std::integral_constant<int, 1>{}, i);
        break;
      case 2:
        rows(std::integral_constant<int, 2>{}, i);
        break;
      case 3:
        rows(std::integral_constant<int, 3>{}, i);
        break;
      default:
        rows(std::integral_constant<int, 4>{}, i);
        break;
    }
  }
}

// Columns [n_begin, n_end) for every row of a, in blocks of up to 4 rows.
void Int8Avx2Tile(const int16_t* a16, const int8_t* b, int64_t m, int64_t k, int64_t n_begin,
                  int64_t n_end, int32_t* c) {
  ForEachRowBlock(m, [&](auto r, int64_t i) {
    Int8Avx2Rows<decltype(r)::value>(a16, b, k, m, i, n_begin, n_end, c);
  });
}

// ---- AVX-512 (F, BW, VL, VNNI) ----------------------------------------------

// C[i0 + r, n0 + c] for r < R, c < C with vpdpbusd, which sums 4 products of
// an unsigned byte and a signed byte into each int32 lane: 64 multiplies an
// instruction against 16 for the AVX2 vpmaddwd on widened values. The weight
// is signed, so it goes in as w ^ 0x80 = w + 128 (unsigned) and the product
// is sum((w + 128) * a) - 128 * sum(a); a_sum128[i] is 128 * sum(a[i, :]).
// Lanes wrap modulo 2^32 (vpdpbusd does not saturate), and the true result
// fits in int32 for any K below 2^17, so the difference is exact. A tail
// below 64 is loaded under a mask: its weight bytes read 0, i.e. 128 after
// the flip, against a's 0.
template <int R, int C>
ACCEL_TARGET_AVX512 ACCEL_INLINE void Int8VnniStep(__m512i (&acc)[R][C], const int8_t* ai,
                                                   const int8_t* bn, int64_t k, int64_t t,
                                                   __mmask64 mask) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i wv[C];
#pragma GCC unroll 8
  for (int cc = 0; cc < C; ++cc) {
    wv[cc] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, bn + cc * k + t), flip);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512i xv = _mm512_maskz_loadu_epi8(mask, ai + r * k + t);
#pragma GCC unroll 8
    for (int cc = 0; cc < C; ++cc) acc[r][cc] = _mm512_dpbusd_epi32(acc[r][cc], wv[cc], xv);
  }
}

template <int R, int C>
ACCEL_TARGET_AVX512 void Int8Vnni(const int8_t* a, const int32_t* a_sum128, const int8_t* b,
                                  int64_t k, int64_t m, int64_t i0, int64_t n0, int32_t* c) {
  __m512i acc[R][C] = {};  // zeros
  const int8_t* bn = b + n0 * k;
  const int8_t* ai = a + i0 * k;
  int64_t t = 0;
  for (; t + 64 <= k; t += 64) Int8VnniStep<R, C>(acc, ai, bn, k, t, ~__mmask64{0});
  if (t < k) Int8VnniStep<R, C>(acc, ai, bn, k, t, (~__mmask64{0}) >> (64 - (k - t)));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int cc = 0; cc < C; ++cc) {
      const uint32_t sum = static_cast<uint32_t>(_mm512_reduce_add_epi32(acc[r][cc])) -
                           static_cast<uint32_t>(a_sum128[i0 + r]);
      c[(n0 + cc) * m + i0 + r] = static_cast<int32_t>(sum);
    }
  }
}

// Columns [n_begin, n_end) for every row of a, in blocks of up to 4 rows
// (registers: R x C accumulators, C weights and one x of the 32).
template <int R>
ACCEL_TARGET_AVX512 void Int8VnniRows(const int8_t* a, const int32_t* a_sum128, const int8_t* b,
                                      int64_t k, int64_t m, int64_t i0, int64_t n_begin,
                                      int64_t n_end, int32_t* c) {
  constexpr int C = R <= 2 ? 8 : 4;
  int64_t col = n_begin;
  for (; col + C <= n_end; col += C) Int8Vnni<R, C>(a, a_sum128, b, k, m, i0, col, c);
  for (; col < n_end; ++col) Int8Vnni<R, 1>(a, a_sum128, b, k, m, i0, col, c);
}

void Int8VnniTile(const int8_t* a, const int32_t* a_sum128, const int8_t* b, int64_t m, int64_t k,
                  int64_t n_begin, int64_t n_end, int32_t* c) {
  ForEachRowBlock(m, [&](auto r, int64_t i) {
    Int8VnniRows<decltype(r)::value>(a, a_sum128, b, k, m, i, n_begin, n_end, c);
  });
}

// QuantizeInt8Rows 16 values at a time: the same float32 compares, maxima,
// products and roundings as the body above, so the same bytes.
ACCEL_TARGET_AVX512 void QuantizeInt8RowsAvx512(const float* a, int64_t m, int64_t k,
                                                float threshold, uint8_t* outlier_col, float* sca,
                                                int8_t* codes) {
  const bool decompose = threshold > 0.0f;
  const __m512 limit = _mm512_set1_ps(threshold);
  std::memset(outlier_col, 0, static_cast<size_t>(k));
  for (int64_t i = 0; decompose && i < m; ++i) {
    for (int64_t t = 0; t < k; t += 16) {
      const __mmask16 in = k - t >= 16 ? __mmask16{0xFFFF} : __mmask16((1u << (k - t)) - 1);
      const __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(in, a + i * k + t));
      for (uint32_t out = _mm512_mask_cmp_ps_mask(in, v, limit, _CMP_GE_OQ); out != 0;
           out &= out - 1) {
        outlier_col[t + __builtin_ctz(out)] = 1;
      }
    }
  }
  const bool column_zeros = decompose && m > 1;
  for (int64_t i = 0; i < m; ++i) {
    const float* ai = a + i * k;
    int8_t* ci = codes + i * k;
    __m512 most = _mm512_setzero_ps();
    for (int64_t t = 0; t < k; t += 16) {
      const __mmask16 in = k - t >= 16 ? __mmask16{0xFFFF} : __mmask16((1u << (k - t)) - 1);
      const __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(in, ai + t));
      const __mmask16 keep =
          decompose ? _mm512_mask_cmp_ps_mask(in, v, limit, _CMP_NGE_UQ) : in;  // NaN kept...
      most = _mm512_mask_max_ps(most, keep, v, most);  // ... and ignored: max(NaN, m) = m
    }
    const float absmax = _mm512_reduce_max_ps(most);
    sca[i] = absmax;
    if (absmax == 0.0f) {
      std::memset(ci, 0, static_cast<size_t>(k));
      continue;
    }
    const __m512 scale = _mm512_set1_ps(127.0f / absmax);
    const __m512 low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
    for (int64_t t = 0; t < k; t += 16) {
      const __mmask16 in = k - t >= 16 ? __mmask16{0xFFFF} : __mmask16((1u << (k - t)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(in, ai + t);
      __mmask16 keep = in;
      if (decompose) keep &= _mm512_cmp_ps_mask(_mm512_abs_ps(v), limit, _CMP_NGE_UQ);
      if (column_zeros) {
        const __m128i col = _mm_maskz_loadu_epi8(in, outlier_col + t);
        keep &= static_cast<__mmask16>(~_mm_test_epi8_mask(col, col));
      }
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, scale),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      keep &= _mm512_cmp_ps_mask(r, low, _CMP_GE_OQ) & _mm512_cmp_ps_mask(r, high, _CMP_LE_OQ);
      _mm512_mask_cvtepi32_storeu_epi8(ci + t, in, _mm512_maskz_cvtps_epi32(keep, r));
    }
  }
}

// out[i] = 128 * sum(a[i, :]) modulo 2^32 (the lanes' arithmetic) for the
// int8 kernels' correction, 64 bytes a vpdpbusd (by 1).
ACCEL_TARGET_AVX512 void RowSums128(const int8_t* a, int64_t m, int64_t k, int32_t* out) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t i = 0; i < m; ++i) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t t = 0; t < k; t += 64) {
      const __mmask64 in = k - t >= 64 ? ~__mmask64{0} : (~__mmask64{0}) >> (64 - (k - t));
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_loadu_epi8(in, a + i * k + t));
    }
    out[i] = static_cast<int32_t>(static_cast<uint32_t>(_mm512_reduce_add_epi32(acc)) * 128u);
  }
}

// Int8Rescale 16 outputs at a time: a row's 16 values of C, `rows` apart,
// in one gather (their cache lines serve the next 15 rows too).
ACCEL_TARGET_AVX512 void Int8RescaleAvx512(const Int8RescaleArgs& a, int64_t n_begin,
                                           int64_t n_end) {
  const __m512 inv = _mm512_set1_ps(kInv127Squared);
  const __m512i index =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int32_t>(a.rows)));
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
    const __mmask16 in =
        n_end - n0 >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (n_end - n0)) - 1);
    const __m512 scb = _mm512_maskz_loadu_ps(in, a.scb + n0);
    const __m512 bias = a.bias != nullptr ? _mm512_maskz_loadu_ps(in, a.bias + n0) : __m512{};
    const int32_t* cn = a.c + n0 * a.rows;
    for (int64_t m = 0; m < a.rows; ++m) {
      const __m512i cv = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in, index, cn + m, 4);
      __m512 v =
          _mm512_mul_ps(_mm512_cvtepi32_ps(cv), _mm512_mul_ps(_mm512_set1_ps(a.sca[m]), scb));
      v = _mm512_mul_ps(v, inv);
      if (a.bias != nullptr) {
        Unfused(v);
        v = _mm512_add_ps(v, bias);
      }
      if (a.nout > 0) {
        __m512 extra = _mm512_setzero_ps();
        for (int64_t j = 0; j < a.nout; ++j) {
          __m512 p = _mm512_mul_ps(_mm512_set1_ps(a.outlier_x[m * a.nout + j]),
                                   _mm512_maskz_loadu_ps(in, a.outlier_w + j * a.out + n0));
          Unfused(p);
          extra = _mm512_add_ps(extra, p);
        }
        v = _mm512_add_ps(v, extra);
      }
      _mm512_mask_storeu_ps(a.y + m * a.out + n0, in, v);
    }
  }
}

// For more rows, rows in lanes: the kernels above keep a row's partial sums
// across a register's lanes, re-read each weight tile for every block of 4
// rows and end every output with a horizontal sum. Here A is repacked once per
// call so that one register holds 4 consecutive bytes of 16 rows
// (RowsInLanes), and vpdpbusd multiplies it by a weight's 4 bytes broadcast to
// every lane: a lane accumulates one row's output, a weight byte is loaded
// once for 16 to 64 rows, and no sums cross lanes.

// ap[((g * quads + q) * 16 + r) * 4 + j] = a[(16 g + r) * k + 4 q + j], 0 past
// m rows or k columns (those pad bytes meet weight bytes that are not there
// and contribute 0); quads = ceil(k / 4), groups = ceil(m / 16).
void PackRowsInLanes(const int8_t* a, int64_t m, int64_t k, int8_t* ap) {
  const int64_t quads = (k + 3) / 4, groups = (m + 15) / 16, whole = k / 4;
  std::memset(ap, 0, static_cast<size_t>(groups * quads * 64));
  for (int64_t i = 0; i < m; ++i) {
    const int8_t* row = a + i * k;
    int8_t* lane = ap + ((i / 16) * quads * 16 + i % 16) * 4;
    for (int64_t q = 0; q < whole; ++q) std::memcpy(lane + q * 64, row + 4 * q, 4);
    if (whole < quads) std::memcpy(lane + whole * 64, row + 4 * whole, static_cast<size_t>(k % 4));
  }
}

// Weight row bn's bytes 4q .. 4q + 3 as one int32 (fewer at the end of a
// row: the rest 0), flipped to unsigned.
ACCEL_TARGET_AVX512 ACCEL_INLINE __m512i WeightQuad(const int8_t* bn, int64_t k, int64_t q,
                                                    bool whole) {
  int32_t word = 0;
  std::memcpy(&word, bn + 4 * q, whole ? 4 : static_cast<size_t>(k - 4 * q));
  return _mm512_xor_si512(_mm512_set1_epi32(word), _mm512_set1_epi8(static_cast<char>(0x80)));
}

// One step of Int8VnniLanes: quad q of G row groups (ag: the first) times C
// weight rows (bn: the first).
template <int G, int C>
ACCEL_TARGET_AVX512 ACCEL_INLINE void Int8LanesStep(__m512i (&acc)[G][C], const int8_t* ag,
                                                    int64_t quads, const int8_t* bn, int64_t k,
                                                    int64_t q, bool whole) {
  __m512i xv[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) xv[g] = _mm512_loadu_si512(ag + (g * quads + q) * 64);
#pragma GCC unroll 32
  for (int cc = 0; cc < C; ++cc) {
    const __m512i w = WeightQuad(bn + cc * k, k, q, whole);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) acc[g][cc] = _mm512_dpbusd_epi32(acc[g][cc], w, xv[g]);
  }
}

// C[16 (g0 + g) + r, n0 + c] for g < G, c < C and the rows r < 16 that exist
// (m rows in all): G x C accumulators, G row registers and a weight, 30 of
// the 32 registers at G x C = 24.
template <int G, int C>
ACCEL_TARGET_AVX512 void Int8VnniLanes(const int8_t* ap, const int32_t* a_sum128, int64_t quads,
                                       int64_t g0, const int8_t* b, int64_t m, int64_t k,
                                       int64_t n0, int32_t* c) {
  __m512i acc[G][C] = {};  // zeros
  const int8_t* bn = b + n0 * k;
  const int8_t* ag = ap + g0 * quads * 64;
  const int64_t whole = k / 4;
  for (int64_t q = 0; q < whole; ++q) Int8LanesStep<G, C>(acc, ag, quads, bn, k, q, true);
  if (whole < quads) Int8LanesStep<G, C>(acc, ag, quads, bn, k, whole, false);
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const int64_t r0 = (g0 + g) * 16;
    const int64_t rows = std::min<int64_t>(16, m - r0);
    const __mmask16 valid = rows == 16 ? __mmask16{0xFFFF} : __mmask16((1u << rows) - 1);
    const __m512i sum128 = _mm512_loadu_si512(a_sum128 + r0);
#pragma GCC unroll 32
    for (int cc = 0; cc < C; ++cc) {
      _mm512_mask_storeu_epi32(c + (n0 + cc) * m + r0, valid, _mm512_sub_epi32(acc[g][cc], sum128));
    }
  }
}

// Columns [n_begin, n_end) of the row groups [g0, g0 + G).
template <int G>
ACCEL_TARGET_AVX512 void Int8VnniLanesRows(const int8_t* ap, const int32_t* a_sum128, int64_t quads,
                                           int64_t g0, const int8_t* b, int64_t m, int64_t k,
                                           int64_t n_begin, int64_t n_end, int32_t* c) {
  constexpr int C = 24 / G;
  int64_t col = n_begin;
  for (; col + C <= n_end; col += C) {
    Int8VnniLanes<G, C>(ap, a_sum128, quads, g0, b, m, k, col, c);
  }
  for (; col + 2 <= n_end; col += 2) {
    Int8VnniLanes<G, 2>(ap, a_sum128, quads, g0, b, m, k, col, c);
  }
  if (col < n_end) Int8VnniLanes<G, 1>(ap, a_sum128, quads, g0, b, m, k, col, c);
}

// Every row of a (packed by PackRowsInLanes; a_sum128 padded to whole groups
// of 16) for columns [n_begin, n_end), 64 rows (4 groups) at a time.
void Int8VnniLanesTile(const int8_t* ap, const int32_t* a_sum128, const int8_t* b, int64_t m,
                       int64_t k, int64_t n_begin, int64_t n_end, int32_t* c) {
  const int64_t quads = (k + 3) / 4, groups = (m + 15) / 16;
  for (int64_t g = 0; g < groups; g += 4) {
    switch (std::min<int64_t>(4, groups - g)) {
      case 1:
        Int8VnniLanesRows<1>(ap, a_sum128, quads, g, b, m, k, n_begin, n_end, c);
        break;
      case 2:
        Int8VnniLanesRows<2>(ap, a_sum128, quads, g, b, m, k, n_begin, n_end, c);
        break;
      case 3:
        Int8VnniLanesRows<3>(ap, a_sum128, quads, g, b, m, k, n_begin, n_end, c);
        break;
      default:
        Int8VnniLanesRows<4>(ap, a_sum128, quads, g, b, m, k, n_begin, n_end, c);
        break;
    }
  }
}

#endif  // __x86_64__

}  // namespace

void Int8Matmul(CpuIsa isa, const int8_t* a, const int8_t* b, int64_t m, int64_t n, int64_t k,
                int32_t* c, const Int8Gather* gather) {
  CheckSupported(isa, "Int8Matmul");
  if (m <= 0 || n <= 0) return;
  // Columns in tiles whose weights (up to 64 KiB) stay in the L2 cache for
  // every row of a and for the gather; a multiple of 24 columns, which every
  // kernel's column block divides.
  const int64_t tile =
      std::max<int64_t>(24, (int64_t{64} << 10) / std::max<int64_t>(1, k) / 24 * 24);
  std::vector<int16_t> a16;       // AVX2: a widened to int16
  std::vector<int32_t> a_sum128;  // AVX-512: 128 * each row's sum
  std::vector<int8_t> a_lanes;    // AVX-512 above kInt8LanesMinRows: a in RowsInLanes order
  const bool lanes = isa >= CpuIsa::kAvx512 && m >= kInt8LanesMinRows;
#if defined(__x86_64__)
  if (isa == CpuIsa::kAvx2) {
    a16.resize(static_cast<size_t>(m * k));
    // int8 codes, sign-extended on purpose.
    for (size_t i = 0; i < a16.size(); ++i) {
      a16[i] = static_cast<int16_t>(a[i]);  // NOLINT(bugprone-signed-char-misuse)
    }
  } else if (isa >= CpuIsa::kAvx512) {
    // Padded to whole groups of 16 rows for the lanes kernel's loads.
    a_sum128.assign(static_cast<size_t>((m + 15) / 16 * 16), 0);
    RowSums128(a, m, k, a_sum128.data());
    if (lanes) {
      a_lanes.resize(static_cast<size_t>((m + 15) / 16 * ((k + 3) / 4) * 64));
      PackRowsInLanes(a, m, k, a_lanes.data());
    }
  }
#endif
  at::parallel_for(0, n, std::max<int64_t>(1, kMinBytesPerTask / std::max<int64_t>(1, k)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; t += tile) {
                       const int64_t t_end = std::min(end, t + tile);
#if defined(__x86_64__)
                       if (lanes) {
                         Int8VnniLanesTile(a_lanes.data(), a_sum128.data(), b, m, k, t, t_end, c);
                       } else if (isa >= CpuIsa::kAvx512) {
                         Int8VnniTile(a, a_sum128.data(), b, m, k, t, t_end, c);
                       } else if (isa == CpuIsa::kAvx2) {
                         Int8Avx2Tile(a16.data(), b, m, k, t, t_end, c);
                       } else {
                         Int8Scalar(a, b, m, k, t, t_end, c);
                       }
#else
                       Int8Scalar(a, b, m, k, t, t_end, c);
#endif
                       if (gather == nullptr) continue;
                       for (int64_t col = t; col < t_end; ++col) {
                         for (int64_t j = 0; j < gather->count; ++j) {
                           gather->out[col * gather->count + j] = b[col * k + gather->cols[j]];
                         }
                       }
                     }
                   });
}

void QuantizeInt8Rows(CpuIsa isa, const float* a, int64_t m, int64_t k, float threshold,
                      uint8_t* outlier_col, float* sca, int8_t* codes) {
  CheckSupported(isa, "QuantizeInt8Rows");
#if defined(__x86_64__)
  if (isa >= CpuIsa::kAvx512)
    return QuantizeInt8RowsAvx512(a, m, k, threshold, outlier_col, sca, codes);
  if (isa == CpuIsa::kAvx2)
    return QuantizeInt8RowsAvx2(a, m, k, threshold, outlier_col, sca, codes);
#endif
  QuantizeInt8RowsScalar(a, m, k, threshold, outlier_col, sca, codes);
}

void Int8Rescale(CpuIsa isa, const Int8RescaleArgs& args, int64_t n_begin, int64_t n_end) {
  CheckSupported(isa, "Int8Rescale");
#if defined(__x86_64__)
  if (isa >= CpuIsa::kAvx512) return Int8RescaleAvx512(args, n_begin, n_end);
#endif
  Int8RescaleScalar(args, n_begin, n_end);
}

}  // namespace accel::quant::internal
