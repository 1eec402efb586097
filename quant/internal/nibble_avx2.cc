#include "quant/internal/nibble_avx2.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include <c10/util/BFloat16.h>

#include "core/cpu_features.h"
#include "quant/internal/x86_targets.h"

namespace accel::quant::internal {
namespace {

constexpr int64_t kGroup = 64;  // elements a load decodes: 32 packed bytes
constexpr int64_t kSpan = 16;   // groups whose tables are built ahead

// Where element `slot` (0-63) of a group's decoded vectors comes from in
// memory (the group's element index). Vector v = 8 * parity-part + ...:
// the high nibbles (even elements) decode to vectors 0-3, the low nibbles
// (odd elements) to 4-7; within a parity, vpunpck{l,h}bw of the two byte
// lookups gives u = 0 (bytes 0-7 of each 128-bit lane) and u = 1 (bytes
// 8-15), and each of those 16-bit vectors widens to two float vectors:
//   bfloat16: s = 0 the even 16-bit positions (a shift), s = 1 the odd ones
//             (a mask): float lane t (lane l = t / 4, q = t % 4) holds byte
//             16 l + 8 u + 2 q + s;
//   float16:  h = 0 the low 128 bits, h = 1 the high ones (vcvtph2ps):
//             float lane t holds byte 16 h + 8 u + t.
// Byte b holds elements 2 b (high nibble) and 2 b + 1 (low nibble).
int SourceElement(DenseType round, int slot) {
  const int v = slot / 8, t = slot % 8;
  const int parity = v / 4, u = (v / 2) % 2, s = v % 2;
  const int byte =
      round == DenseType::kBFloat16 ? 16 * (t / 4) + 8 * u + 2 * (t % 4) + s : 16 * s + 8 * u + t;
  return 2 * byte + parity;
}

std::array<int, kGroup> MakeOrder(DenseType round) {
  std::array<int, kGroup> order{};
  for (int slot = 0; slot < kGroup; ++slot) order[slot] = SourceElement(round, slot);
  return order;
}

const std::array<int, kGroup>& OrderOf(DenseType round) {
  static const std::array<int, kGroup> bf16_order = MakeOrder(DenseType::kBFloat16);
  static const std::array<int, kGroup> f16_order = MakeOrder(DenseType::kFloat16);
  return round == DenseType::kBFloat16 ? bf16_order : f16_order;
}

#if defined(__x86_64__)

// A block's 16 rounded values as two byte tables, each in both 128-bit lanes.
struct ByteTables {
  __m256i lo, hi;
};

// The 16-bit values of codes 0-7 in lane 0 and 8-15 in lane 1, split into
// byte tables.
ACCEL_TARGET_AVX2 ACCEL_INLINE ByteTables SplitTables(__m256i values16) {
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2,
                                         4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i q = _mm256_shuffle_epi8(values16, split);
  return {_mm256_permute4x64_epi64(q, _MM_SHUFFLE(2, 0, 2, 0)),
          _mm256_permute4x64_epi64(q, _MM_SHUFFLE(3, 1, 3, 1))};
}

// The code table as the table builders read it: bfloat16 in the order that
// vpackusdw turns into codes 0-7 / 8-15 per lane, float16 as it is.
struct CodeRegs {
  __m256 a, b;
};

template <DenseType T>
ACCEL_TARGET_AVX2 ACCEL_INLINE CodeRegs LoadCodes(const float* code) {
  if constexpr (T == DenseType::kBFloat16) {
    return {
        _mm256_setr_ps(code[0], code[1], code[2], code[3], code[8], code[9], code[10], code[11]),
        _mm256_setr_ps(code[4], code[5], code[6], code[7], code[12], code[13], code[14], code[15])};
  } else {
    return {_mm256_loadu_ps(code), _mm256_loadu_ps(code + 8)};
  }
}

// bfloat16 bits (in the low half of each lane) of finite float32 values,
// rounded to nearest even as c10::BFloat16 does.
ACCEL_TARGET_AVX2 ACCEL_INLINE __m256i Bf16BitsOfFinite(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                           16);
}

// A non-finite absmax (NaN / inf in a damaged checkpoint): the values as
// c10::BFloat16 rounds them, NaN included.
__attribute__((noinline, cold)) std::array<uint16_t, 16> Bf16TableSlow(const float* code,
                                                                       float absmax) {
  std::array<uint16_t, 16> out{};
  for (int c = 0; c < 16; ++c) out[c] = c10::BFloat16(code[c] * absmax).x;
  return out;
}

// The tables of a block whose absmax (broadcast in `scale`) is finite.
template <DenseType T>
ACCEL_TARGET_AVX2 ACCEL_INLINE ByteTables FiniteBlockTables(const CodeRegs& codes, __m256 scale) {
  if constexpr (T == DenseType::kBFloat16) {
    return SplitTables(_mm256_packus_epi32(Bf16BitsOfFinite(_mm256_mul_ps(codes.a, scale)),
                                           Bf16BitsOfFinite(_mm256_mul_ps(codes.b, scale))));
  } else {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m128i lo = _mm256_cvtps_ph(_mm256_mul_ps(codes.a, scale), kRound);
    const __m128i hi = _mm256_cvtps_ph(_mm256_mul_ps(codes.b, scale), kRound);
    return SplitTables(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
  }
}

template <DenseType T>
ACCEL_TARGET_AVX2 ACCEL_INLINE ByteTables BlockTables(const CodeRegs& codes, const float* code,
                                                      float absmax) {
  if constexpr (T == DenseType::kBFloat16) {
    if (__builtin_expect(!std::isfinite(absmax), 0)) {
      const std::array<uint16_t, 16> slow = Bf16TableSlow(code, absmax);
      return SplitTables(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(slow.data())));
    }
  }
  return FiniteBlockTables<T>(codes, _mm256_set1_ps(absmax));
}

// Whether the n floats at v are all finite.
ACCEL_TARGET_AVX2 ACCEL_INLINE bool AllFinite(const float* v, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    // Not less than infinity, or unordered: inf or NaN.
    bad = _mm256_or_ps(
        bad, _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), magnitude), inf, _CMP_NLT_UQ));
  }
  bool finite = _mm256_movemask_ps(bad) == 0;
  for (; i < n; ++i) finite = finite && std::isfinite(v[i]);
  return finite;
}

// The two float vectors of one 16-bit vector (see SourceElement).
template <DenseType T>
ACCEL_TARGET_AVX2 ACCEL_INLINE void Widen(__m256i v16, __m256* first, __m256* second) {
  if constexpr (T == DenseType::kBFloat16) {
    *first = _mm256_castsi256_ps(_mm256_slli_epi32(v16, 16));
    *second = _mm256_castsi256_ps(
        _mm256_and_si256(v16, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    *first = _mm256_cvtph_ps(_mm256_castsi256_si128(v16));
    *second = _mm256_cvtph_ps(_mm256_extracti128_si256(v16, 1));
  }
}

ACCEL_TARGET_AVX2 ACCEL_INLINE float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One parity of a group: the 32 values of `index` (one nibble a byte) as
// four float vectors, each multiplied into the R rows' accumulators with
// the x vectors at xk + 64 r + 8 v.
template <DenseType T>
ACCEL_TARGET_AVX2 ACCEL_INLINE void DecodeParity(__m256i index, const ByteTables& t,
                                                 __m256 (&w)[4]) {
  const __m256i lo = _mm256_shuffle_epi8(t.lo, index);
  const __m256i hi = _mm256_shuffle_epi8(t.hi, index);
  Widen<T>(_mm256_unpacklo_epi8(lo, hi), &w[0], &w[1]);
  Widen<T>(_mm256_unpackhi_epi8(lo, hi), &w[2], &w[3]);
}

template <DenseType T, int R, int kAcc, int kFirst>
ACCEL_TARGET_AVX2 ACCEL_INLINE void DotParity(__m256i index, const ByteTables& t, const float* xk,
                                              __m256 (&acc)[R][kAcc]) {
  __m256 w[4];
  DecodeParity<T>(index, t, w);
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256& a = acc[r][(kFirst + v) % kAcc];
      a = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xk + r * kGroup + int64_t{8} * v), a);
    }
  }
}

// Blocks of exactly one group (bnb's default blocksize), in chunks of at
// most kAbsmaxChunk: the chunk's absmax checked finite with a few vector
// compares, then each group's tables built in the decode loop from a
// broadcast load, with no check and no branch (a chunk with a non-finite
// absmax takes the checked tables). The packed bytes, x and the block are
// walked by pointer. The general loop below builds tables into a buffer and
// reloads them, and divides for each group's byte and x offsets: about 80
// instructions a group against about 57 here (accel-bench-quant, 4096 x
// 4096, one row, one thread, on a Zen 3 class EPYC: see docs/BENCHMARKS.md).
// A group's absmax: absmax[g] in place, or with double quant (kNested) its
// nested group's table of 256 read by the block's code, absmax[codes[g]].
constexpr int64_t kAbsmaxChunk = 256;

template <bool kNested>
ACCEL_INLINE const float* AbsmaxAt(const float* absmax, const uint8_t* codes, int64_t g) {
  if constexpr (kNested) {
    return absmax + codes[g];
  } else {
    (void)codes;
    return absmax + g;
  }
}

template <DenseType T, int R, int kAcc, bool kChecked, bool kNested>
ACCEL_TARGET_AVX2 ACCEL_INLINE void NibbleGroups64(const CodeRegs& codes, const float* code,
                                                   const float* absmax, const uint8_t* absmax_codes,
                                                   int64_t groups, const uint8_t* packed,
                                                   const float* xk, int64_t x_stride,
                                                   __m256 (&acc)[R][kAcc]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  if constexpr (kChecked) {
    for (int64_t g = 0; g < groups; ++g, packed += kGroup / 2, xk += x_stride) {
      const ByteTables t = BlockTables<T>(codes, code, *AbsmaxAt<kNested>(absmax, absmax_codes, g));
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
      DotParity<T, R, kAcc, 0>(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), t, xk, acc);
      DotParity<T, R, kAcc, 4>(_mm256_and_si256(bytes, nibble), t, xk + 32, acc);
    }
  } else {
    // Each group's tables are built one iteration ahead, so that the
    // lookups never wait for the chain that builds them (multiply, round,
    // pack, split: about 15 cycles): 19.3 -> 17.0 cycles a group on a Zen 3
    // class core (docs/BENCHMARKS.md, "AVX2: tables built a group ahead").
    // The last group builds its own tables again rather than read past
    // the chunk.
    if (groups <= 0) return;
    ByteTables t = FiniteBlockTables<T>(
        codes, _mm256_broadcast_ss(AbsmaxAt<kNested>(absmax, absmax_codes, 0)));
    for (int64_t g = 0; g < groups; ++g, packed += kGroup / 2, xk += x_stride) {
      const ByteTables next =
          FiniteBlockTables<T>(codes, _mm256_broadcast_ss(AbsmaxAt<kNested>(
                                          absmax, absmax_codes, std::min(g + 1, groups - 1))));
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
      DotParity<T, R, kAcc, 0>(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), t, xk, acc);
      DotParity<T, R, kAcc, 4>(_mm256_and_si256(bytes, nibble), t, xk + 32, acc);
      t = next;
    }
  }
}

// Double quant: the 256 absmax a block of nested group `group` can have
// (nested_code[c] * nested_absmax[group] + offset, BlockAbsmax's two
// roundings), made once a group and kept across a call's rows instead of
// made once a block (docs/BENCHMARKS.md, "AVX2: tables built a group
// ahead"), and whether all 256 are finite.
// NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): see `table`.
struct NestedTable {
  // Not zeroed: Fill writes it before any read (group -1).
  alignas(32) float table[256];
  int64_t group = -1;
  bool finite = false;
};

ACCEL_TARGET_AVX2 void FillNestedTable(const Packed4bit& w, int64_t group, NestedTable& t) {
  const __m256 scale = _mm256_set1_ps(w.nested_absmax[group]);
  const __m256 offset = _mm256_set1_ps(w.nested_offset);
  for (int c = 0; c < 256; c += 8) {
    __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(w.nested_code + c), scale);
    asm("" : "+x"(scaled));  // two roundings, as bnb's two steps
    _mm256_store_ps(t.table + c, _mm256_add_ps(scaled, offset));
  }
  t.group = group;
  t.finite = AllFinite(t.table, 256);
}

template <DenseType T, int R, int kAcc>
ACCEL_TARGET_AVX2 ACCEL_INLINE void NibbleRowBlocks64(const Gemv4bitArgs& a, const CodeRegs& codes,
                                                      const uint8_t* packed, int64_t block,
                                                      int64_t groups, const float* xk,
                                                      NestedTable& nested, __m256 (&acc)[R][kAcc]) {
  const Packed4bit& w = a.w;
  if (w.absmax != nullptr) {
    for (int64_t c = 0; c < groups; c += kAbsmaxChunk) {
      const int64_t n = std::min(kAbsmaxChunk, groups - c);
      const float* absmax = w.absmax + block + c;
      const uint8_t* p = packed + c * (kGroup / 2);
      const float* x = xk + c * a.x_stride;
      if (__builtin_expect(AllFinite(absmax, n), 1)) {
        NibbleGroups64<T, R, kAcc, false, false>(codes, w.code, absmax, nullptr, n, p, x,
                                                 a.x_stride, acc);
      } else {
        NibbleGroups64<T, R, kAcc, true, false>(codes, w.code, absmax, nullptr, n, p, x, a.x_stride,
                                                acc);
      }
    }
    return;
  }
  // Double quant: chunks end at the nested groups' ends, each group's table
  // made when the first chunk in it starts.
  for (int64_t c = 0; c < groups;) {
    const int64_t b = block + c;
    const int64_t group = b >> kNestedBlockShift;
    const int64_t n = std::min(groups - c, ((group + 1) << kNestedBlockShift) - b);
    if (group != nested.group) FillNestedTable(w, group, nested);
    const uint8_t* p = packed + c * (kGroup / 2);
    const float* x = xk + c * a.x_stride;
    const uint8_t* ac = w.absmax_codes + b;
    if (__builtin_expect(nested.finite, 1)) {
      NibbleGroups64<T, R, kAcc, false, true>(codes, w.code, nested.table, ac, n, p, x, a.x_stride,
                                              acc);
    } else {
      NibbleGroups64<T, R, kAcc, true, true>(codes, w.code, nested.table, ac, n, p, x, a.x_stride,
                                             acc);
    }
    c += n;
  }
}

template <DenseType T, int R>
ACCEL_TARGET_AVX2 void NibbleRows(const Gemv4bitArgs& a, int64_t n_begin, int64_t n_end, int64_t k0,
                                  int64_t k1, float* sums, int64_t sums_stride) {
  // Independent chains per row while the registers last (an accumulator
  // spilled to the stack puts a store and a load into its chain).
  constexpr int kAcc = R == 1 ? 4 : 2;
  const Packed4bit& w = a.w;
  const CodeRegs codes = LoadCodes<T>(w.code);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  NestedTable nested;
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m256 acc[R][kAcc];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < kAcc; ++c) acc[r][c] = _mm256_setzero_ps();
    }
    const int64_t row = n * a.in;
    const uint8_t* packed = w.packed + row / 2;
    if (w.blocksize == kGroup) {
      NibbleRowBlocks64<T, R, kAcc>(a, codes, packed + k0 / 2, (row + k0) / kGroup,
                                    (k1 - k0) / kGroup, a.x + (k0 / kGroup) * a.x_stride, nested,
                                    acc);
    } else {
      // Blocks of several groups: in spans of kSpan groups, first every
      // group's tables into an L1 buffer, then the groups (written when a
      // table built in this loop stalled the decode behind it; with the loop
      // walked by pointer, as for blocks of 64 above, that stall did not
      // show). One division a row: a 64-bit divide per block would cost as
      // much as decoding it.
      int64_t block = (row + k0) / w.blocksize;
      int64_t block_end = (block + 1) * w.blocksize - row;
      for (int64_t span = k0; span < k1; span += kSpan * kGroup) {
        const int64_t span_end = std::min(k1, span + kSpan * kGroup);
        ByteTables tables[kSpan];
        for (int64_t k = span, g = 0; k < span_end;) {
          const ByteTables t = BlockTables<T>(codes, w.code, BlockAbsmax(w, block));
          for (const int64_t e = std::min(span_end, block_end); k < e; k += kGroup) tables[g++] = t;
          if (k == block_end) {
            ++block;
            block_end += w.blocksize;
          }
        }
        for (int64_t k = span, g = 0; k < span_end; k += kGroup, ++g) {
          const __m256i bytes =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + k / 2));
          const float* xk = a.x + (k / kGroup) * a.x_stride;
          DotParity<T, R, kAcc, 0>(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), tables[g],
                                   xk, acc);
          DotParity<T, R, kAcc, 4>(_mm256_and_si256(bytes, nibble), tables[g], xk + 32, acc);
        }
      }
    }
    float* sn = sums + (n - n_begin) * sums_stride;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256 total = acc[r][0];
#pragma GCC unroll 8
      for (int c = 1; c < kAcc; ++c) total = _mm256_add_ps(total, acc[r][c]);
      sn[r] += Sum8(total);
    }
  }
}

// Weight row n, columns [k0, k1), as float32 in the kernels' order.
template <DenseType T>
ACCEL_TARGET_AVX2 void NibbleDecodeRow(const Gemv4bitArgs& a, int64_t n, int64_t k0, int64_t k1,
                                       float* out) {
  const Packed4bit& w = a.w;
  const CodeRegs codes = LoadCodes<T>(w.code);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const int64_t row = n * a.in;
  const uint8_t* packed = w.packed + row / 2;
  int64_t block = (row + k0) / w.blocksize;
  int64_t block_end = (block + 1) * w.blocksize - row;
  for (int64_t k = k0; k < k1; ++block, block_end += w.blocksize) {
    const ByteTables t = BlockTables<T>(codes, w.code, BlockAbsmax(w, block));
    for (const int64_t e = std::min(k1, block_end); k < e; k += kGroup) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + k / 2));
      float* o = out + (k - k0);
      __m256 v[4];
      DecodeParity<T>(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), t, v);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + int64_t{8} * i, v[i]);
      DecodeParity<T>(_mm256_and_si256(bytes, nibble), t, v);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 32 + int64_t{8} * i, v[i]);
    }
  }
}

template <DenseType T>
GemvRangeFn KernelForRows(int64_t rows) {
  switch (rows) {
    case 1:
      return NibbleRows<T, 1>;
    case 2:
      return NibbleRows<T, 2>;
    case 3:
      return NibbleRows<T, 3>;
    case 4:
      return NibbleRows<T, 4>;
    default:
      return nullptr;
  }
}

#endif  // __x86_64__

}  // namespace

bool NibbleGemvApplies(const Gemv4bitArgs& a) {
#if defined(__x86_64__)
  if (!CpuFeaturesOfThisMachine().avx2_fma_f16c) return false;
  if (a.round != DenseType::kBFloat16 && a.round != DenseType::kFloat16) return false;
  if (a.in % kGroup != 0 || a.w.blocksize % kGroup != 0) return false;
  for (int c = 0; c < 16; ++c) {
    if (!std::isfinite(a.w.code[c])) return false;
  }
  return true;
#else
  (void)a;
  return false;
#endif
}

void NibblePermuteX(const Gemv4bitArgs& a, float* out) {
  const std::array<int, kGroup>& order = OrderOf(a.round);
  for (int64_t i = 0; i < a.m; ++i) {
    const float* x = a.x + i * a.x_stride;
    for (int64_t g = 0; g < a.in; g += kGroup) {
      float* o = out + (g * a.m + i * kGroup);
      for (int slot = 0; slot < kGroup; ++slot) o[slot] = x[g + order[slot]];
    }
  }
}

void NibblePermuteRows(const Gemv4bitArgs& a, float* out) {
  const std::array<int, kGroup>& order = OrderOf(a.round);
  for (int64_t i = 0; i < a.m; ++i) {
    const float* x = a.x + i * a.x_stride;
    float* o = out + i * a.in;
    for (int64_t g = 0; g < a.in; g += kGroup) {
      for (int slot = 0; slot < kGroup; ++slot) o[g + slot] = x[g + order[slot]];
    }
  }
}

void NibbleDecodeRow(const Gemv4bitArgs& a, int64_t n, int64_t k0, int64_t k1, float* out) {
#if defined(__x86_64__)
  if (a.round == DenseType::kBFloat16) {
    NibbleDecodeRow<DenseType::kBFloat16>(a, n, k0, k1, out);
  } else {
    NibbleDecodeRow<DenseType::kFloat16>(a, n, k0, k1, out);
  }
#else
  (void)a;
  (void)n;
  (void)k0;
  (void)k1;
  (void)out;
#endif
}

GemvRangeFn NibbleKernel(DenseType round, int64_t rows) {
#if defined(__x86_64__)
  return round == DenseType::kBFloat16 ? KernelForRows<DenseType::kBFloat16>(rows)
                                       : KernelForRows<DenseType::kFloat16>(rows);
#else
  (void)round;
  (void)rows;
  return nullptr;
#endif
}

}  // namespace accel::quant::internal
