#include "models/internal/gemv.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/cpu_features.h"
#include "core/x86_intrinsics.h"

namespace accel::models::internal {

float BFloat16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

float HalfToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  uint32_t wide;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float32.
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    std::memcpy(&wide, &magnitude, sizeof(wide));
    wide |= sign;
  } else if (exponent == 0x1f) {
    wide = sign | 0x7f800000u | (mantissa << 13);  // infinity or NaN (payload kept)
  } else {
    wide = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

namespace {

// ---- Portable ---------------------------------------------------------------

template <GemvWeight T>
float LoadScalar(const void* w, int64_t index);
template <>
inline float LoadScalar<GemvWeight::kFloat32>(const void* w, int64_t index) {
  return static_cast<const float*>(w)[index];
}
template <>
inline float LoadScalar<GemvWeight::kBFloat16>(const void* w, int64_t index) {
  return BFloat16ToFloat(static_cast<const uint16_t*>(w)[index]);
}
template <>
inline float LoadScalar<GemvWeight::kFloat16>(const void* w, int64_t index) {
  return HalfToFloat(static_cast<const uint16_t*>(w)[index]);
}

// Column by column, every row per column, so each weight row is read from
// memory once and from cache for the other rows.
template <GemvWeight T>
void RunScalar(const GemvArgs& a, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int64_t row = n * a.w_stride;
    for (int64_t i = 0; i < a.m; ++i) {
      const float* x = a.x + i * a.x_stride;
      float sum = 0.0f;
      for (int64_t j = 0; j < a.k; ++j) sum += x[j] * LoadScalar<T>(a.w, row + j);
      if (a.bias != nullptr) sum += a.bias[n];
      a.y[i * a.y_stride + n] = sum;
    }
  }
}

// ---- The blocked driver, shared by the vector levels --------------------------
//
// Rows are cut into `blocks` blocks of R or R - 1 rows (R <= Isa::kMaxRows),
// columns into groups of Isa::Cols(R); a kernel call computes one block of
// rows for one group of columns over the whole of k, with R x C accumulators
// in registers. Columns are the outer loop, so a group's weight rows come
// from memory for the first row block and from cache for the others.

template <class Isa, GemvWeight T, int R, int C>
void ColumnGroup(const GemvArgs& a, int64_t n, int64_t blocks, int64_t full_blocks) {
  int64_t i0 = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (b < full_blocks) {
      Isa::template Kernel<T, R, C>(a, i0, n);
      i0 += R;
    } else if constexpr (R > 1) {
      Isa::template Kernel<T, R - 1, C>(a, i0, n);
      i0 += R - 1;
    }
  }
}

template <class Isa, GemvWeight T, int R>
void RunRows(const GemvArgs& a, int64_t n_begin, int64_t n_end) {
  constexpr int C = Isa::Cols(R);
  const int64_t blocks = (a.m + R - 1) / R;
  const int64_t full_blocks = a.m - blocks * (R - 1);  // blocks of R rows; the rest R - 1
  int64_t n = n_begin;
  for (; n + C <= n_end; n += C) ColumnGroup<Isa, T, R, C>(a, n, blocks, full_blocks);
  for (; n < n_end; ++n) ColumnGroup<Isa, T, R, 1>(a, n, blocks, full_blocks);
}

template <class Isa, GemvWeight T, int R = 1>
void DispatchRows(int rows, const GemvArgs& a, int64_t n_begin, int64_t n_end) {
  if (rows == R) {
    RunRows<Isa, T, R>(a, n_begin, n_end);
  } else if constexpr (R < Isa::kMaxRows) {
    DispatchRows<Isa, T, R + 1>(rows, a, n_begin, n_end);
  }
}

template <class Isa, GemvWeight T>
void RunVector(const GemvArgs& a, int64_t n_begin, int64_t n_end) {
  // As few blocks as the registers allow, as even as possible.
  const int64_t blocks = (a.m + Isa::kMaxRows - 1) / Isa::kMaxRows;
  const int rows = static_cast<int>((a.m + blocks - 1) / blocks);
  DispatchRows<Isa, T>(rows, a, n_begin, n_end);
}

#if defined(__x86_64__)

#define ACCEL_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ACCEL_TARGET_AVX512 __attribute__((target("avx512f,avx512bw")))
#define ACCEL_INLINE inline __attribute__((always_inline))

// Keeps a loaded x vector in a register for its C uses. Left alone, the
// compilers fold the load into every FMA, which makes the kernel bound by
// loads (C per row instead of one): about 40% slower at m = 8 from cache.
ACCEL_TARGET_AVX2 ACCEL_INLINE void InRegister(__m256& v) { asm("" : "+x"(v)); }
ACCEL_TARGET_AVX512 ACCEL_INLINE void InRegister(__m512& v) { asm("" : "+v"(v)); }

// ---- AVX2 + FMA + F16C: 8 floats per register, 16 registers -------------------

template <GemvWeight T>
struct Avx2Load;
template <>
struct Avx2Load<GemvWeight::kFloat32> {
  using Elem = float;
  ACCEL_TARGET_AVX2 static ACCEL_INLINE __m256 Load(const Elem* p) { return _mm256_loadu_ps(p); }
};
template <>
struct Avx2Load<GemvWeight::kBFloat16> {
  using Elem = uint16_t;
  ACCEL_TARGET_AVX2 static ACCEL_INLINE __m256 Load(const Elem* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
};
template <>
struct Avx2Load<GemvWeight::kFloat16> {
  using Elem = uint16_t;
  ACCEL_TARGET_AVX2 static ACCEL_INLINE __m256 Load(const Elem* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

ACCEL_TARGET_AVX2 ACCEL_INLINE float Sum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct Avx2 {
  static constexpr int kMaxRows = 4;
  // Accumulators R x C, plus C weights and one x in 16 registers.
  static constexpr int Cols(int rows) { return rows == 1 ? 4 : rows == 2 ? 4 : rows == 3 ? 3 : 2; }

  template <GemvWeight T, int R, int C>
  ACCEL_TARGET_AVX2 static void Kernel(const GemvArgs& a, int64_t i0, int64_t n) {
    using L = Avx2Load<T>;
    using E = typename L::Elem;
    const E* w = static_cast<const E*>(a.w) + n * a.w_stride;
    const float* x = a.x + i0 * a.x_stride;
    const int64_t ws = a.w_stride, xs = a.x_stride, k = a.k;
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
      __m256 wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) wv[c] = L::Load(w + c * ws + j);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256 xv = _mm256_loadu_ps(x + r * xs + j);
        if constexpr (C > 1) InRegister(xv);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        float sum = Sum256(acc[r][c]);
        for (int64_t t = j; t < k; ++t) sum += x[r * xs + t] * LoadScalar<T>(w, c * ws + t);
        if (a.bias != nullptr) sum += a.bias[n + c];
        a.y[(i0 + r) * a.y_stride + n + c] = sum;
      }
    }
  }
};

// ---- AVX-512 (F + BW): 16 floats per register, 32 registers ---------------------
//
// The k tail is read with masked loads (no element past k is touched); 16-bit
// weights use the byte-and-word masked load, hence BW.

template <GemvWeight T>
struct Avx512Load;
template <>
struct Avx512Load<GemvWeight::kFloat32> {
  using Elem = float;
  ACCEL_TARGET_AVX512 static ACCEL_INLINE __m512 Load(const Elem* p) { return _mm512_loadu_ps(p); }
  ACCEL_TARGET_AVX512 static ACCEL_INLINE __m512 LoadTail(const Elem* p, __mmask16 mask) {
    return _mm512_maskz_loadu_ps(mask, p);
  }
};
template <>
struct Avx512Load<GemvWeight::kBFloat16> {
  using Elem = uint16_t;
  ACCEL_TARGET_AVX512 static ACCEL_INLINE __m512 Widen(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  ACCEL_TARGET_AVX512 static ACCEL_INLINE __m512 Load(const Elem* p) {
    return Widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ACCEL_TARGET_AVX512 static ACCEL_INLINE __m512 LoadTail(const Elem* p, __mmask16 mask) {
    return Widen(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(mask, p)));
  }
};
template <>
struct Avx512Load<GemvWeight::kFloat16> {
  using Elem = uint16_t;
  ACCEL_TARGET_AVX512 static ACCEL_INLINE __m512 Load(const Elem* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ACCEL_TARGET_AVX512 static ACCEL_INLINE __m512 LoadTail(const Elem* p, __mmask16 mask) {
    return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(mask, p)));
  }
};

struct Avx512 {
  static constexpr int kMaxRows = 8;
  // Accumulators R x C, plus C weights and one x, within 32 registers, with
  // at least 8 independent accumulators (FMA latency 4 x 2 ports).
  static constexpr int Cols(int rows) {
    constexpr int kCols[] = {0, 8, 6, 5, 4, 4, 3, 3, 3};
    return kCols[rows];
  }

  template <GemvWeight T, int R, int C>
  ACCEL_TARGET_AVX512 static void Kernel(const GemvArgs& a, int64_t i0, int64_t n) {
    using L = Avx512Load<T>;
    using E = typename L::Elem;
    const E* w = static_cast<const E*>(a.w) + n * a.w_stride;
    const float* x = a.x + i0 * a.x_stride;
    const int64_t ws = a.w_stride, xs = a.x_stride, k = a.k;
    __m512 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
      __m512 wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) wv[c] = L::Load(w + c * ws + j);
        // The next group's rows at the same offset: they are in cache when
        // that group starts, and twice as many rows stream from memory at once.
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (C + c) * ws + j), _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512 xv = _mm512_loadu_ps(x + r * xs + j);
        if constexpr (C > 1) InRegister(xv);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
    if (j < k) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (k - j)) - 1);
      __m512 wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) wv[c] = L::LoadTail(w + c * ws + j, mask);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * xs + j);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        float sum = _mm512_reduce_add_ps(acc[r][c]);
        if (a.bias != nullptr) sum += a.bias[n + c];
        a.y[(i0 + r) * a.y_stride + n + c] = sum;
      }
    }
  }
};

#endif  // __x86_64__

template <template <GemvWeight> class Run>
void ByWeight(const GemvArgs& a, int64_t n_begin, int64_t n_end) {
  switch (a.w_type) {
    case GemvWeight::kFloat32:
      return Run<GemvWeight::kFloat32>::Go(a, n_begin, n_end);
    case GemvWeight::kBFloat16:
      return Run<GemvWeight::kBFloat16>::Go(a, n_begin, n_end);
    case GemvWeight::kFloat16:
      return Run<GemvWeight::kFloat16>::Go(a, n_begin, n_end);
  }
}

template <GemvWeight T>
struct ScalarRun {
  static void Go(const GemvArgs& a, int64_t n_begin, int64_t n_end) {
    RunScalar<T>(a, n_begin, n_end);
  }
};
#if defined(__x86_64__)
template <GemvWeight T>
struct Avx2Run {
  static void Go(const GemvArgs& a, int64_t n_begin, int64_t n_end) {
    RunVector<Avx2, T>(a, n_begin, n_end);
  }
};
template <GemvWeight T>
struct Avx512Run {
  static void Go(const GemvArgs& a, int64_t n_begin, int64_t n_end) {
    RunVector<Avx512, T>(a, n_begin, n_end);
  }
};
#endif

struct Support {
  bool avx2 = false;
  bool avx512 = false;
};

Support Detect() {
  const CpuFeatures& f = CpuFeaturesOfThisMachine();
  Support s;
  s.avx2 = f.avx2_fma_f16c;
  s.avx512 = f.avx512_f_bw;
  return s;
}

const Support& CpuSupport() {
  static const Support support = Detect();
  return support;
}

}  // namespace

absl::string_view GemvIsaName(GemvIsa isa) {
  switch (isa) {
    case GemvIsa::kScalar:
      return "scalar";
    case GemvIsa::kAvx2:
      return "avx2";
    case GemvIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool GemvIsaSupported(GemvIsa isa) {
  switch (isa) {
    case GemvIsa::kScalar:
      return true;
    case GemvIsa::kAvx2:
      return CpuSupport().avx2;
    case GemvIsa::kAvx512:
      return CpuSupport().avx512;
  }
  return false;
}

GemvIsa BestGemvIsa() {
  if (CpuSupport().avx512) return GemvIsa::kAvx512;
  if (CpuSupport().avx2) return GemvIsa::kAvx2;
  return GemvIsa::kScalar;
}

void GemvWithIsa(GemvIsa isa, const GemvArgs& args, int64_t n_begin, int64_t n_end) {
  if (!GemvIsaSupported(isa)) {
    std::fprintf(stderr, "GemvWithIsa: this CPU cannot run the %s kernels\n",
                 GemvIsaName(isa).data());
    std::abort();
  }
  if (args.m <= 0 || n_begin >= n_end) return;
  switch (isa) {
    case GemvIsa::kScalar:
      return ByWeight<ScalarRun>(args, n_begin, n_end);
#if defined(__x86_64__)
    case GemvIsa::kAvx2:
      return ByWeight<Avx2Run>(args, n_begin, n_end);
    case GemvIsa::kAvx512:
      return ByWeight<Avx512Run>(args, n_begin, n_end);
#else
    default:
      return ByWeight<ScalarRun>(args, n_begin, n_end);
#endif
  }
}

void Gemv(const GemvArgs& args, int64_t n_begin, int64_t n_end) {
  GemvWithIsa(BestGemvIsa(), args, n_begin, n_end);
}

}  // namespace accel::models::internal
