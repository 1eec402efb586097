// GemvTransposed: the small-batch product for weights stored [k, n] (GPT-2's
// Conv1D), y[i, n] = sum_j x[i, j] * w[j, n] (+ bias[n]).
//
// A weight row j is contiguous over the columns, so the kernels walk the
// weight row by row: for a tile of columns, the tile's accumulators (one
// float32 per row of x and column, in an L1-sized buffer) take D weight rows
// at a time, each column's products added in order of j by one fused
// multiply-add each. The scalar level adds the same products in the same
// order with std::fma, so every level gives the same bits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/x86_intrinsics.h"
#include "models/internal/gemv.h"

namespace accel::models::internal {
namespace {

// Rows of x a pass over the weights serves (the rest in further passes).
constexpr int kMaxRows = 4;
// Columns of a tile: its accumulators (kMaxRows x 1024 float32, 16 KiB) stay
// in the L1 cache while the weight rows stream past them.
constexpr int64_t kTileColumns = 1024;

float LoadOne(GemvWeight type, const void* w, int64_t index) {
  switch (type) {
    case GemvWeight::kFloat32:
      return static_cast<const float*>(w)[index];
    case GemvWeight::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(w)[index]);
    case GemvWeight::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(w)[index]);
  }
  return 0.0f;
}

// Columns [n0, n1) of rows [i0, i0 + rows) over all of k into acc (rows x
// cols, cols = n1 - n0 a row), one std::fma a product.
void ScalarTile(const GemvArgs& a, int64_t i0, int rows, int64_t n0, int64_t n1, float* acc,
                int64_t cols) {
  for (int64_t j = 0; j < a.k; ++j) {
    for (int64_t n = n0; n < n1; ++n) {
      const float w = LoadOne(a.w_type, a.w, j * a.w_stride + n);
      for (int r = 0; r < rows; ++r) {
        float& s = acc[r * cols + (n - n0)];
        s = std::fma(a.x[(i0 + r) * a.x_stride + j], w, s);
      }
    }
  }
}

#if defined(__x86_64__)

#define ACCEL_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ACCEL_INLINE inline __attribute__((always_inline))

template <GemvWeight T>
ACCEL_TARGET_AVX2 ACCEL_INLINE __m256 LoadEight(const void* w, int64_t index) {
  if constexpr (T == GemvWeight::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + index);
  } else {
    const __m128i bits =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + index));
    if constexpr (T == GemvWeight::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    } else {
      return _mm256_cvtph_ps(bits);
    }
  }
}

// Weight rows [j, j + D) into the accumulators of columns [n0, n0 + vecs * 8)
// (acc rows x cols), R rows of x: D x R broadcasts in registers, then per
// eight columns R accumulators loaded, D x R FMAs in order of j, R stored.
template <GemvWeight T, int R, int D>
ACCEL_TARGET_AVX2 void Rows(const GemvArgs& a, int64_t i0, int64_t j, int64_t n0, int64_t vecs,
                            float* acc, int64_t cols) {
  __m256 xb[D][R];
#pragma GCC unroll 8
  for (int d = 0; d < D; ++d) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xb[d][r] = _mm256_set1_ps(a.x[(i0 + r) * a.x_stride + j + d]);
  }
  for (int64_t v = 0; v < vecs; ++v) {
    const int64_t c = v * 8;
    __m256 s[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) s[r] = _mm256_loadu_ps(acc + r * cols + c);
#pragma GCC unroll 8
    for (int d = 0; d < D; ++d) {
      const __m256 w = LoadEight<T>(a.w, (j + d) * a.w_stride + n0 + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) s[r] = _mm256_fmadd_ps(xb[d][r], w, s[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * cols + c, s[r]);
  }
}

// Weight rows in steps of D (the broadcasts and accumulators fit the 16
// registers: D x R + R + 1), the last k % D one at a time; the columns past
// the last whole eight by ScalarTile, which adds the same products in the
// same order.
template <GemvWeight T, int R>
ACCEL_TARGET_AVX2 void Avx2Tile(const GemvArgs& a, int64_t i0, int64_t n0, int64_t n1, float* acc,
                                int64_t cols) {
  constexpr int D = R == 1 ? 8 : R == 2 ? 4 : 2;
  const int64_t vecs = (n1 - n0) / 8;
  int64_t j = 0;
  for (; j + D <= a.k; j += D) Rows<T, R, D>(a, i0, j, n0, vecs, acc, cols);
  for (; j < a.k; ++j) Rows<T, R, 1>(a, i0, j, n0, vecs, acc, cols);
  const int64_t tail = n0 + vecs * 8;
  if (tail < n1) ScalarTile(a, i0, R, tail, n1, acc + (tail - n0), cols);
}

template <GemvWeight T>
void Avx2ByRows(const GemvArgs& a, int64_t i0, int rows, int64_t n0, int64_t n1, float* acc,
                int64_t cols) {
  switch (rows) {
    case 1:
      return Avx2Tile<T, 1>(a, i0, n0, n1, acc, cols);
    case 2:
      return Avx2Tile<T, 2>(a, i0, n0, n1, acc, cols);
    case 3:
      return Avx2Tile<T, 3>(a, i0, n0, n1, acc, cols);
    default:
      return Avx2Tile<T, 4>(a, i0, n0, n1, acc, cols);
  }
}

void Avx2Tile(const GemvArgs& a, int64_t i0, int rows, int64_t n0, int64_t n1, float* acc,
              int64_t cols) {
  switch (a.w_type) {
    case GemvWeight::kFloat32:
      return Avx2ByRows<GemvWeight::kFloat32>(a, i0, rows, n0, n1, acc, cols);
    case GemvWeight::kBFloat16:
      return Avx2ByRows<GemvWeight::kBFloat16>(a, i0, rows, n0, n1, acc, cols);
    case GemvWeight::kFloat16:
      return Avx2ByRows<GemvWeight::kFloat16>(a, i0, rows, n0, n1, acc, cols);
  }
}

#endif  // __x86_64__

}  // namespace

void GemvTransposedWithIsa(GemvIsa isa, const GemvArgs& args, int64_t n_begin, int64_t n_end) {
  if (!GemvIsaSupported(isa)) {
    std::fprintf(stderr, "GemvTransposedWithIsa: this CPU cannot run the %s kernels\n",
                 GemvIsaName(isa).data());
    std::abort();
  }
  if (args.m <= 0 || n_begin >= n_end) return;
  std::vector<float> acc(static_cast<size_t>(kMaxRows * std::min(kTileColumns, n_end - n_begin)));
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kTileColumns) {
    const int64_t n1 = std::min(n_end, n0 + kTileColumns), cols = n1 - n0;
    for (int64_t i0 = 0; i0 < args.m; i0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, args.m - i0));
      std::fill(acc.begin(), acc.begin() + rows * cols, 0.0f);
#if defined(__x86_64__)
      if (isa != GemvIsa::kScalar) {
        Avx2Tile(args, i0, rows, n0, n1, acc.data(), cols);
      } else {
        ScalarTile(args, i0, rows, n0, n1, acc.data(), cols);
      }
#else
      ScalarTile(args, i0, rows, n0, n1, acc.data(), cols);
#endif
      for (int r = 0; r < rows; ++r) {
        float* y = args.y + (i0 + r) * args.y_stride;
        for (int64_t n = n0; n < n1; ++n) {
          const float sum = acc[r * cols + (n - n0)];
          y[n] = args.bias != nullptr ? sum + args.bias[n] : sum;
        }
      }
    }
  }
}

void GemvTransposed(const GemvArgs& args, int64_t n_begin, int64_t n_end) {
  GemvTransposedWithIsa(BestGemvIsa(), args, n_begin, n_end);
}

}  // namespace accel::models::internal
