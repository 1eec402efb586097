// quant/cuda/internal/gemv_mma.h: the 4-bit GEMV of up to 8 activation rows
// on the tensor cores (up to 32 in its tiled form, at the end), written as
// host + device code: quant/cuda/gemv.cu runs
// it as a kernel, tests/quant/cuda_gemv_emulation_test.cc runs the same code
// on the host (tests/testing/cta_emulator.h), so its indexing is checked on
// a machine without a GPU. Private to quant/cuda.
//
// y [m, N] = x [m, K] W^T + bias for a bnb 4-bit W [N, K] and 16-bit x
// (bfloat16 or float16). A CTA of 8 warps takes 16 rows of W; its warps
// take K in chunks of 256 (warp w: chunks w, w + 8, ...) and add their sums
// at the end through shared memory (no atomics). For each chunk a lane
// (g = lane / 4, t = lane % 4) holds 32 bytes of rows g and g + 8: the 64
// weights k = 64t .. 64t + 63 of the chunk, one quantization block
// (blocksize a multiple of 64). Each weight is dequantized exactly as
// Dequantize4bit does (code * absmax in float32, rounded to the activation
// type): the block's 16 possible values are rounded once into registers
// as byte planes, and a nibble is looked up with byte permutes (prmt), four
// at a time, with no shared-memory traffic. The products run on
// mma.m16n8k16 (A = 16 rows of W, B = up to 8 activation rows, fp32
// accumulators): the k order inside a chunk is permuted so that each lane's
// own bytes are its A fragments, and x is staged through shared memory in
// the same permuted order for the B fragments. Products of two 16-bit
// values are exact in float32; the tensor cores add them in float32 in
// their own order.
#ifndef ACCEL_QUANT_CUDA_INTERNAL_GEMV_MMA_H_
#define ACCEL_QUANT_CUDA_INTERNAL_GEMV_MMA_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "core/float16_bits.h"

namespace accel::quant::cuda::internal {

inline constexpr int kMmaWarps = 8;
inline constexpr int kMmaThreads = kMmaWarps * 32;
inline constexpr int kMmaRows = 16;    // rows of W a CTA takes
inline constexpr int kMmaChunk = 256;  // k a warp takes at a time
inline constexpr int kMmaSlices = kMmaChunk / 16;
inline constexpr int kMmaMaxM = 8;  // activation rows

struct GemvMmaParams {
  const void* x = nullptr;          // [m, k], 16-byte aligned
  const uint8_t* packed = nullptr;  // 16-byte aligned
  const float* absmax = nullptr;
  const float* code = nullptr;
  const void* bias = nullptr;  // [n_rows] or null
  void* y = nullptr;           // [m, n_rows]
  int64_t n_rows = 0, k = 0, blocksize = 0;
  int32_t m = 1;
  // The wide kernel only: K split over this many CTAs, and with more than
  // one, their float32 sums [splits, m, n_rows] (the reduce adds them).
  int32_t splits = 1;
  float* workspace = nullptr;
};

// Activation types.
struct MmaBFloat16 {};
struct MmaFloat16 {};

ACCEL_HD float Widen(MmaBFloat16, uint16_t v) { return float16_bits::BFloat16ToFloat(v); }
ACCEL_HD float Widen(MmaFloat16, uint16_t v) { return float16_bits::HalfToFloat(v); }
ACCEL_HD uint16_t Narrow(MmaBFloat16, float v) { return float16_bits::FloatToBFloat16(v); }
ACCEL_HD uint16_t Narrow(MmaFloat16, float v) { return float16_bits::FloatToHalf(v); }

// Two floats rounded to the activation type, `lo` in the low 16 bits.
ACCEL_HD uint32_t PackRounded(MmaBFloat16, float lo, float hi) {
#if defined(__CUDA_ARCH__)
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
#else
  return static_cast<uint32_t>(float16_bits::FloatToBFloat16(lo)) |
         static_cast<uint32_t>(float16_bits::FloatToBFloat16(hi)) << 16;
#endif
}
ACCEL_HD uint32_t PackRounded(MmaFloat16, float lo, float hi) {
#if defined(__CUDA_ARCH__)
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
#else
  return static_cast<uint32_t>(float16_bits::FloatToHalf(lo)) |
         static_cast<uint32_t>(float16_bits::FloatToHalf(hi)) << 16;
#endif
}

// PTX prmt.b32 in its default mode: byte i of the result is byte
// s[4i+2:4i] of {b, a} (a holds bytes 0-3), or that byte's sign replicated
// when s[4i+3] is set.
ACCEL_HD uint32_t Prmt(uint32_t a, uint32_t b, uint32_t s) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
#else
  const uint64_t bytes = static_cast<uint64_t>(b) << 32 | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (s >> (4 * i)) & 0xfu;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (nibble & 7u))) & 0xffu;
    if (nibble & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
    d |= byte << (8 * i);
  }
  return d;
#endif
}

// A block's 16 values code[i] * scale rounded to the activation type, as
// byte planes: lo[q] byte i is the low byte of value 4q + i, hi[q] its high
// byte.
template <typename Tag>
ACCEL_HD void BuildPlanes(const float* code, float scale, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
  for (int q = 0; q < 4; ++q) {
    const uint32_t first = PackRounded(Tag{}, code[4 * q] * scale, code[4 * q + 1] * scale);
    const uint32_t second = PackRounded(Tag{}, code[4 * q + 2] * scale, code[4 * q + 3] * scale);
    lo[q] = Prmt(first, second, 0x6420u);
    hi[q] = Prmt(first, second, 0x7531u);
  }
}

// The four weights of two packed bytes (`half`: the byte at the lower address
// in bits 0-7), as the two 16-bit pairs an mma fragment holds: `first` the
// lower byte's elements (its high nibble, the even element, in the low half),
// `second` the upper byte's.
// From the two selectors of those bytes (prmt reads a selector's low 16 bits
// only, so one word's selectors serve its low half and, shifted, its high
// half): `index`, each nibble's low 3 bits; `pick`, its bit 3 (the upper 8
// values) as the choice between two candidate bytes.
ACCEL_HD void LookupSelected(uint32_t index, uint32_t pick, const uint32_t (&lo)[4],
                             const uint32_t (&hi)[4], uint32_t& first, uint32_t& second) {
  const uint32_t low = Prmt(Prmt(lo[0], lo[1], index), Prmt(lo[2], lo[3], index), pick);
  const uint32_t high = Prmt(Prmt(hi[0], hi[1], index), Prmt(hi[2], hi[3], index), pick);
  first = Prmt(low, high, 0x4051u);   // [low byte 1, high byte 1, low byte 0, high byte 0]
  second = Prmt(low, high, 0x6273u);  // the same for nibbles 3 and 2
}
// The selectors of every nibble of a word: LookupSelected(index, pick) for
// its low two bytes, (index >> 16, pick >> 16) for its high two.
ACCEL_HD uint32_t NibbleIndex(uint32_t word) { return word & 0x77777777u; }
ACCEL_HD uint32_t NibblePick(uint32_t word) { return ((word >> 1) & 0x44444444u) | 0x32103210u; }

ACCEL_HD void LookupPairs(uint32_t half, const uint32_t (&lo)[4], const uint32_t (&hi)[4],
                          uint32_t& first, uint32_t& second) {
  LookupSelected(NibbleIndex(half), NibblePick(half), lo, hi, first, second);
}

// x in shared memory, per warp: 8-byte units, unit (s, g, t) holding x[g]
// at k = 64t + 4s .. 64t + 4s + 3 of the chunk (the B fragment of lane
// (g, t) for slice s), rows of a slice `XStride` units apart (padded so
// that a warp's stores spread over the banks).
ACCEL_HD int XStride(int max_m) { return 4 * max_m + (max_m == 1 ? 6 : 2); }
ACCEL_HD int64_t XWarpBytes(int max_m) {
  return static_cast<int64_t>(kMmaSlices) * XStride(max_m) * 8;
}
// Shared memory of a CTA: the code (16 floats), the warps' sums
// ([warps][16 rows][8 activation rows] floats), each warp's x.
inline constexpr int64_t kMmaReduceOffset = 64;
inline constexpr int64_t kMmaXOffset = kMmaReduceOffset + kMmaWarps * kMmaRows * kMmaMaxM * 4;
ACCEL_HD int64_t MmaSharedBytes(int max_m) { return kMmaXOffset + kMmaWarps * XWarpBytes(max_m); }

// Whether the kernel takes these arguments (else the callers use the other
// kernels): 16-bit activations, K a multiple of 256, blocks a multiple of 64,
// x and packed 16-byte aligned, 1 <= m <= 8.
ACCEL_HD bool MmaTakes(int64_t m, int64_t k, int64_t blocksize, const void* x, const void* packed) {
  return m >= 1 && m <= kMmaMaxM && k > 0 && k % kMmaChunk == 0 && blocksize > 0 &&
         blocksize % 64 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(packed) % 16 == 0;
}

// 16 bytes at a 16-byte aligned address, as four words. `stream`: read once
// (the weights), so past the caches.
ACCEL_HD void Load16(const void* src, uint32_t (&out)[4], bool stream) {
#if defined(__CUDA_ARCH__)
  const uint4 v =
      stream ? __ldcs(static_cast<const uint4*>(src)) : __ldg(static_cast<const uint4*>(src));
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
#else
  (void)stream;
  std::memcpy(out, src, 16);
#endif
}

// 8 bytes at an 8-byte aligned shared-memory address, as two words (typed
// accesses on the device: a memcpy there may become byte loads).
ACCEL_HD void Store8(uint8_t* dst, uint32_t lo, uint32_t hi) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
#else
  const uint32_t words[2] = {lo, hi};
  std::memcpy(dst, words, 8);
#endif
}
ACCEL_HD void Load8(const uint8_t* src, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__)
  const uint2 v = *reinterpret_cast<const uint2*>(src);
  lo = v.x;
  hi = v.y;
#else
  uint32_t words[2];
  std::memcpy(words, src, 8);
  lo = words[0];
  hi = words[1];
#endif
}

// A lane's 32 bytes of a row for a chunk, and their block's absmax (zeros
// past the rows or the chunks).
struct RowChunk {
  uint32_t words[8];
  float scale;
};

// 64-weight segments: a row has k / 64, a block blocksize / 64 (computed once
// per thread: a 64-bit division per load would cost as much as the loads).
struct Segments {
  int64_t per_row = 0, per_block = 1;
};
ACCEL_HD Segments SegmentsOf(const GemvMmaParams& p) {
  Segments s;
  s.per_row = p.k / 64;
  s.per_block = p.blocksize / 64;
  return s;
}

ACCEL_HD void LoadRowChunk(const GemvMmaParams& p, const Segments& segments, int64_t row,
                           int64_t chunk, int t, RowChunk& out) {
  if (row >= p.n_rows || chunk * kMmaChunk >= p.k) {
    for (uint32_t& w : out.words) w = 0;
    out.scale = 0.0f;
    return;
  }
  const int64_t segment = row * segments.per_row + chunk * (kMmaChunk / 64) + t;
  const uint8_t* bytes = p.packed + segment * 32;
  uint32_t a[4], b[4];
  Load16(bytes, a, true);
  Load16(bytes + 16, b, true);
  for (int i = 0; i < 4; ++i) {
    out.words[i] = a[i];
    out.words[4 + i] = b[i];
  }
  const int64_t block = segments.per_block == 1 ? segment : segment / segments.per_block;
#if defined(__CUDA_ARCH__)
  out.scale = __ldg(p.absmax + block);
#else
  out.scale = p.absmax[block];
#endif
}

// B fragments from an x stage in shared memory (the first and wide forms):
// row r of x at k = 64t + 4s .. + 3 of the chunk is unit (s, r, t), `stride`
// units from one slice to the next; zeros for rows past m.
struct StagedFragments {
  const uint8_t* stage;
  int stride, m, g, t;
  // Tile j's fragments of slices 2w (words 0-1) and 2w + 1 (words 2-3).
  ACCEL_HD void operator()(int j, int w, uint32_t (&out)[4]) const {
    const int row = 8 * j + g;
    if (row >= m) {
      for (uint32_t& v : out) v = 0u;
      return;
    }
    const uint8_t* unit = stage + static_cast<int64_t>(2 * w * stride + row * 4 + t) * 8;
    Load8(unit, out[0], out[1]);
    Load8(unit + stride * 8, out[2], out[3]);
  }
};

// One round of a lane: its 32 bytes of rows g (`a`) and g + 8 (`b`) of a
// chunk looked up through their blocks' planes, each slice's A fragments
// multiplied on the tensor cores with kTiles B tiles (`fragments(j, w, out)`:
// tile j's fragments of slices 2w and 2w + 1) into the accumulators `c`.
// Each word's nibble selectors are computed once for both its halves.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, int kTiles, typename Fragments, typename Exec>
ACCEL_HD void MmaRound(const float* code_s, const RowChunk& a, const RowChunk& b,
                       const Fragments& fragments, float (&c)[kTiles][4], Exec& exec) {
  uint32_t lo_a[4], hi_a[4], lo_b[4], hi_b[4];
  BuildPlanes<Tag>(code_s, a.scale, lo_a, hi_a);
  BuildPlanes<Tag>(code_s, b.scale, lo_b, hi_b);
  for (int w = 0; w < kMmaSlices / 2; ++w) {
    // Word w: slices 2w (its low two bytes) and 2w + 1 (its high two);
    // slice s holds k = 64t + 4s .. + 3.
    uint32_t bx[kTiles][4];
    for (int j = 0; j < kTiles; ++j) fragments(j, w, bx[j]);
    const uint32_t index_a = NibbleIndex(a.words[w]), pick_a = NibblePick(a.words[w]);
    const uint32_t index_b = NibbleIndex(b.words[w]), pick_b = NibblePick(b.words[w]);
    for (int h = 0; h < 2; ++h) {
      const int shift = 16 * h;
      uint32_t a0, a1, a2, a3;
      LookupSelected(index_a >> shift, pick_a >> shift, lo_a, hi_a, a0, a2);
      LookupSelected(index_b >> shift, pick_b >> shift, lo_b, hi_b, a1, a3);
      for (int j = 0; j < kTiles; ++j) {
        exec.template Mma<Tag>(a0, a1, a2, a3, bx[j][2 * h], bx[j][2 * h + 1], c[j]);
      }
    }
  }
}

// The end of a CTA of any of the kernels: each warp's mma accumulators
// (tile j of lane (g, t) holds rows g, g + 8 of activation rows 8j + 2t,
// 8j + 2t + 1) into `sums_s` ([warps][16 rows][8 kTiles activation rows]
// floats), then y = their sum in warp order (+ bias), rounded to the
// activation type.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, int kTiles, typename Exec>
ACCEL_HD void AddWarpSumsAndStore(const GemvMmaParams& p, int64_t cta, const float (&c)[kTiles][4],
                                  float* sums_s, Exec& exec) {
  constexpr int kColumns = 8 * kTiles;
  const int tid = exec.tid(), warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  float* mine = sums_s + warp * kMmaRows * kColumns;
  for (int j = 0; j < kTiles; ++j) {
    const int column = 8 * j + 2 * t;
    mine[g * kColumns + column] = c[j][0];
    mine[g * kColumns + column + 1] = c[j][1];
    mine[(g + 8) * kColumns + column] = c[j][2];
    mine[(g + 8) * kColumns + column + 1] = c[j][3];
  }
  exec.Sync();
  const uint16_t* bias = static_cast<const uint16_t*>(p.bias);
  uint16_t* y = static_cast<uint16_t*>(p.y);
  for (int i = tid; i < kMmaRows * p.m; i += kMmaThreads) {
    const int r = i / p.m, m = i % p.m;
    const int64_t row = cta * kMmaRows + r;
    if (row >= p.n_rows) continue;
    float sum = 0.0f;
    for (int w = 0; w < kMmaWarps; ++w) sum += sums_s[(w * kMmaRows + r) * kColumns + m];
    if (bias != nullptr) sum += Widen(Tag{}, bias[row]);
    y[m * p.n_rows + row] = Narrow(Tag{}, sum);
  }
}

// CTA `cta` of the kernel: rows 16 cta .. 16 cta + 15. `shared` holds
// MmaSharedBytes(kMaxM) bytes, 16-byte aligned. Exec: tid(), Sync(),
// WarpSync(), and Mma<Tag>(a0, a1, a2, a3, b0, b1, c) (mma.m16n8k16,
// fp32 accumulators c[4]).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, int kMaxM, typename Exec>
ACCEL_HD void Gemv4bitMmaCta(const GemvMmaParams& p, int64_t cta, uint8_t* shared, Exec& exec) {
  const int tid = exec.tid(), warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  float* code_s = reinterpret_cast<float*>(shared);
  float* sums_s = reinterpret_cast<float*>(shared + kMmaReduceOffset);
  uint8_t* x_s = shared + kMmaXOffset + warp * XWarpBytes(kMaxM);
  if (tid < 16) code_s[tid] = p.code[tid];
  exec.Sync();
  const int stride = XStride(kMaxM);
  const int64_t row_a = cta * kMmaRows + g, row_b = row_a + 8;
  const int64_t chunks = p.k / kMmaChunk;
  const int64_t rounds = (chunks + kMmaWarps - 1) / kMmaWarps;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  float c[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
  // Software pipeline: a round's weights are loaded while the previous
  // round is computed.
  const Segments segments = SegmentsOf(p);
  RowChunk a, b, next_a, next_b;
  LoadRowChunk(p, segments, row_a, warp, t, a);
  LoadRowChunk(p, segments, row_b, warp, t, b);
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t chunk = round * kMmaWarps + warp;
    if (chunk >= chunks) break;  // uniform over the warp
    LoadRowChunk(p, segments, row_a, chunk + kMmaWarps, t, next_a);
    LoadRowChunk(p, segments, row_b, chunk + kMmaWarps, t, next_b);
    // The chunk's x, in the permuted order: lane l reads x[r] at k = 8l
    // of the chunk (coalesced), which is t' = l / 8, slices 2(l % 8) and
    // the next.
    exec.WarpSync();  // the previous chunk's reads of x_s are done
    for (int r = 0; r < p.m; ++r) {
      uint32_t v[4];
      Load16(x + r * p.k + chunk * kMmaChunk + 8 * lane, v, false);
      const int slice = 2 * (lane % 8), tt = lane / 8;
      uint8_t* unit = x_s + static_cast<int64_t>(slice * stride + r * 4 + tt) * 8;
      Store8(unit, v[0], v[1]);
      Store8(unit + stride * 8, v[2], v[3]);
    }
    exec.WarpSync();
    MmaRound<Tag, 1>(code_s, a, b, StagedFragments{x_s, stride, p.m, g, t}, c, exec);
    a = next_a;
    b = next_b;
  }
  AddWarpSumsAndStore<Tag, 1>(p, cta, c, sums_s, exec);
}

// --- The pipelined kernel ------------------------------------------------------------
//
// The same CTA (16 rows of W, K split over 8 warps in chunks of 256, the
// same lookups and mma fragments), for up to kMmaPipelinedMaxM activation
// rows, with the latency of each round taken off its critical path. The
// kernel above (measured on an H200, 2026-11-29: 0.34-0.42 of a device copy)
// makes each round wait twice: for the CTA's barrier on the code table
// before its first weights are even asked for, and for its x, loaded into
// registers and stored to shared memory at the round's start (an L2 round
// trip a round, two at K = 4096). Here a round's x comes into shared memory
// with cp.async, issued with that round's weights one round ahead (two x
// stages a warp), and the first round's loads are issued before the
// barrier, so it waits while they are in flight.
inline constexpr int kMmaPipelinedMaxM = 4;
ACCEL_HD int64_t MmaPipelinedSharedBytes(int max_m) {
  return kMmaXOffset + kMmaWarps * 2 * XWarpBytes(max_m);
}

// Round `chunk`'s x rows into a warp's x stage, in the permuted order (lane
// l takes x[r] at k = 8l of the chunk: t' = l / 8, slices 2(l % 8) and the
// next), as two asynchronous 8-byte copies a row.
template <int kMaxM, typename Exec>
ACCEL_HD void StageX(const GemvMmaParams& p, int64_t chunk, int lane, uint8_t* stage, Exec& exec) {
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  const int stride = XStride(kMaxM), slice = 2 * (lane % 8), tt = lane / 8;
  for (int r = 0; r < p.m; ++r) {
    const uint16_t* src = x + r * p.k + chunk * kMmaChunk + 8 * lane;
    uint8_t* unit = stage + static_cast<int64_t>(slice * stride + r * 4 + tt) * 8;
    exec.CopyAsync8(unit, src);
    exec.CopyAsync8(unit + stride * 8, src + 4);
  }
}

// CTA `cta`: rows 16 cta .. 16 cta + 15. `shared` holds
// MmaPipelinedSharedBytes(kMaxM) bytes, 16-byte aligned. Exec: as
// Gemv4bitMmaCta's, and CopyAsync8(dst, src) (cp.async of 8 bytes to shared
// memory), CommitCopies() (cp.async.commit_group: the copies since the last
// commit form a group) and WaitCopiesButLast() (cp.async.wait_group 1:
// every group of this thread but the newest has landed).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, int kMaxM, typename Exec>
ACCEL_HD void Gemv4bitMmaPipelinedCta(const GemvMmaParams& p, int64_t cta, uint8_t* shared,
                                      Exec& exec) {
  static_assert(kMaxM >= 1 && kMaxM <= kMmaPipelinedMaxM, "x stages sized for up to 4 rows");
  const int tid = exec.tid(), warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  float* code_s = reinterpret_cast<float*>(shared);
  float* sums_s = reinterpret_cast<float*>(shared + kMmaReduceOffset);
  const int64_t stage_bytes = XWarpBytes(kMaxM);
  uint8_t* x_s = shared + kMmaXOffset + warp * 2 * stage_bytes;
  const int stride = XStride(kMaxM);
  const int64_t row_a = cta * kMmaRows + g, row_b = row_a + 8;
  const int64_t chunks = p.k / kMmaChunk;
  // This warp's chunks: warp, warp + 8, ... (uniform over the warp).
  const int64_t rounds = chunks > warp ? (chunks - warp + kMmaWarps - 1) / kMmaWarps : 0;
  const Segments segments = SegmentsOf(p);
  RowChunk a, b, next_a, next_b;
  // Round 0's weights and x asked for first; the code table's barrier then
  // waits while they are in flight.
  LoadRowChunk(p, segments, row_a, warp, t, a);
  LoadRowChunk(p, segments, row_b, warp, t, b);
  if (rounds > 0) StageX<kMaxM>(p, warp, lane, x_s, exec);
  exec.CommitCopies();
  if (tid < 16) code_s[tid] = p.code[tid];
  exec.Sync();
  float c[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t chunk = round * kMmaWarps + warp;
    // The next round's weights and x (its stage was last read in the round
    // before this one: every lane is past those reads), then this round's x
    // waited for (every group but the one just committed) and made visible
    // to the warp.
    exec.WarpSync();
    LoadRowChunk(p, segments, row_a, chunk + kMmaWarps, t, next_a);
    LoadRowChunk(p, segments, row_b, chunk + kMmaWarps, t, next_b);
    if (round + 1 < rounds) {
      StageX<kMaxM>(p, chunk + kMmaWarps, lane, x_s + ((round + 1) % 2) * stage_bytes, exec);
    }
    exec.CommitCopies();
    exec.WaitCopiesButLast();
    exec.WarpSync();
    MmaRound<Tag, 1>(code_s, a, b,
                     StagedFragments{x_s + (round % 2) * stage_bytes, stride, p.m, g, t}, c, exec);
    a = next_a;
    b = next_b;
  }
  AddWarpSumsAndStore<Tag, 1>(p, cta, c, sums_s, exec);
}

// --- The tiled kernel: up to 32 activation rows ----------------------------------
//
// The same CTA (16 rows of W, K split over 8 warps in chunks of 256, the
// same lookups and A fragments, the software pipeline of the first form),
// for steps of 9 to 32 rows (decodes of a batch, a short prompt), where the
// weights would otherwise be dequantized to a dense slab and multiplied by
// a GEMM (4.5 bytes moved a weight against 0.56 here). Each slice's A
// fragments, looked up once, multiply kTiles B tiles of 8 activation rows.
// The B fragments come straight from x in global memory (L1 / L2: x is a
// few KiB a row and every CTA reads it): a lane's fragments of a slice pair
// are 16 contiguous bytes of one row of x in the permuted order (row 8j + g
// at k = 64t + 8w of the chunk), so no shared-memory stage, whose size
// would grow with the rows (the first form's at 32 rows: 133 KiB a CTA).
inline constexpr int kMmaTiledMaxTiles = 4;
inline constexpr int kMmaTiledMaxM = 8 * kMmaTiledMaxTiles;
ACCEL_HD int64_t MmaTiledSharedBytes(int tiles) {
  return kMmaReduceOffset + static_cast<int64_t>(kMmaWarps) * kMmaRows * 8 * tiles * 4;
}

// Whether the tiled kernel takes these arguments: MmaTakes's conditions
// with up to 32 rows.
ACCEL_HD bool MmaTiledTakes(int64_t m, int64_t k, int64_t blocksize, const void* x,
                            const void* packed) {
  return m >= 1 && m <= kMmaTiledMaxM && MmaTakes(1, k, blocksize, x, packed);
}

// B fragments from x itself (the tiled form): tile j's of slices 2w and
// 2w + 1 are 16 contiguous bytes of row 8j + g, at k = 64t + 8w of the
// chunk; zeros for rows past m.
struct GlobalFragments {
  const uint16_t* x;  // the chunk's x at k = 64t, row 0
  int64_t k;
  int m, g;
  ACCEL_HD void operator()(int j, int w, uint32_t (&out)[4]) const {
    const int row = 8 * j + g;
    if (row < m) {
      Load16(x + row * k + 8 * w, out, false);
    } else {
      for (uint32_t& v : out) v = 0u;
    }
  }
};

// CTA `cta` of the tiled kernel: rows 16 cta .. 16 cta + 15, for up to
// 8 kTiles activation rows. `shared` holds MmaTiledSharedBytes(kTiles)
// bytes, 16-byte aligned. Exec: as Gemv4bitMmaCta's.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, int kTiles, typename Exec>
ACCEL_HD void Gemm4bitMmaTiledCta(const GemvMmaParams& p, int64_t cta, uint8_t* shared,
                                  Exec& exec) {
  static_assert(kTiles >= 1 && kTiles <= kMmaTiledMaxTiles, "up to 32 activation rows");
  const int tid = exec.tid(), warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  float* code_s = reinterpret_cast<float*>(shared);
  float* sums_s = reinterpret_cast<float*>(shared + kMmaReduceOffset);
  if (tid < 16) code_s[tid] = p.code[tid];
  exec.Sync();
  const int64_t row_a = cta * kMmaRows + g, row_b = row_a + 8;
  const int64_t chunks = p.k / kMmaChunk;
  const int64_t rounds = (chunks + kMmaWarps - 1) / kMmaWarps;
  float c[kTiles][4];
  for (auto& tile : c) {
    for (float& v : tile) v = 0.0f;
  }
  const Segments segments = SegmentsOf(p);
  RowChunk a, b, next_a, next_b;
  LoadRowChunk(p, segments, row_a, warp, t, a);
  LoadRowChunk(p, segments, row_b, warp, t, b);
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t chunk = round * kMmaWarps + warp;
    if (chunk >= chunks) break;  // uniform over the warp
    LoadRowChunk(p, segments, row_a, chunk + kMmaWarps, t, next_a);
    LoadRowChunk(p, segments, row_b, chunk + kMmaWarps, t, next_b);
    const GlobalFragments fragments{static_cast<const uint16_t*>(p.x) + chunk * kMmaChunk + 64 * t,
                                    p.k, p.m, g};
    MmaRound<Tag, kTiles>(code_s, a, b, fragments, c, exec);
    a = next_a;
    b = next_b;
  }
  AddWarpSumsAndStore<Tag, kTiles>(p, cta, c, sums_s, exec);
}

// --- The wide kernel: up to 32 activation rows, 128 rows of W a CTA ----------------
//
// The tiled kernel reads x again for every 16 rows of W (its CTAs split K
// over their warps): at 32 rows of x an 8B model's step reads about 27 GB of
// x from the L2 cache against 4.2 GB of weights. Here a CTA's 8 warps take
// 16 rows of W each (128 rows) and go through the same chunks of K together,
// so x is read once a CTA: each chunk's x [m, 256] is staged in shared
// memory by the whole CTA, in the first form's permuted order (the B
// fragments), the next chunk's loaded into registers while this one is
// multiplied. The lookups, A fragments and mma are the other forms'. With
// few CTAs (N / 128 under about two an SM), K is split over `splits` CTAs
// as well, each writing float32 sums [split, m, N] to a workspace that a
// second kernel adds in split order, adds the bias to and rounds
// (ReduceWideSplits); with one split the CTA rounds and stores itself.
inline constexpr int kWideRows = kMmaWarps * kMmaRows;  // rows of W a CTA
inline constexpr int kWideMaxTiles = 4;
inline constexpr int kWideMaxM = 8 * kWideMaxTiles;
ACCEL_HD int64_t WideStageBytes(int tiles) {
  return static_cast<int64_t>(kMmaSlices) * XStride(8 * tiles) * 8;
}
// The code (16 floats), then two x stages.
ACCEL_HD int64_t WideSharedBytes(int tiles) { return kMmaReduceOffset + 2 * WideStageBytes(tiles); }

// The chunks of K split `split` of `p.splits` takes: [first, end).
ACCEL_HD void WideSplitChunks(const GemvMmaParams& p, int32_t split, int64_t& first, int64_t& end) {
  const int64_t chunks = p.k / kMmaChunk;
  const int64_t per = (chunks + p.splits - 1) / p.splits;
  first = split * per < chunks ? split * per : chunks;
  end = first + per < chunks ? first + per : chunks;
}

// Thread `tid`'s share of chunk `chunk`'s x: up to kWideMaxM / 8 loads of
// 16 bytes (row r, bytes 16 l .. of the chunk, for i = r * 32 + l in tid,
// tid + 256, ...), zeros past m.
struct WideXLoad {
  uint32_t words[kWideMaxTiles][4];
};

template <int kTiles>
ACCEL_HD void LoadWideX(const GemvMmaParams& p, int64_t chunk, int tid, WideXLoad& out) {
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  for (int u = 0; u < kTiles; ++u) {
    const int i = tid + u * kMmaThreads, r = i / 32, l = i % 32;
    if (r < p.m) {
      Load16(x + r * p.k + chunk * kMmaChunk + 8 * l, out.words[u], false);
    } else {
      for (uint32_t& w : out.words[u]) w = 0u;
    }
  }
}

// Those loads into a stage, in the permuted order: row r at k = 8 l of the
// chunk is t' = l / 8, slices 2 (l % 8) and the next.
template <int kTiles>
ACCEL_HD void StoreWideX(const WideXLoad& in, int tid, uint8_t* stage) {
  const int stride = XStride(8 * kTiles);
  for (int u = 0; u < kTiles; ++u) {
    const int i = tid + u * kMmaThreads, r = i / 32, l = i % 32;
    const int slice = 2 * (l % 8), tt = l / 8;
    uint8_t* unit = stage + static_cast<int64_t>(slice * stride + r * 4 + tt) * 8;
    Store8(unit, in.words[u][0], in.words[u][1]);
    Store8(unit + stride * 8, in.words[u][2], in.words[u][3]);
  }
}

// CTA (`cta`, `split`) of the wide kernel: rows 128 cta .. 128 cta + 127 of
// W, the chunks of split `split`, for up to 8 kTiles activation rows.
// `shared` holds WideSharedBytes(kTiles) bytes, 16-byte aligned. Exec: as
// Gemv4bitMmaCta's.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, int kTiles, typename Exec>
ACCEL_HD void Gemm4bitMmaWideCta(const GemvMmaParams& p, int64_t cta, int32_t split,
                                 uint8_t* shared, Exec& exec) {
  static_assert(kTiles >= 1 && kTiles <= kWideMaxTiles, "up to 32 activation rows");
  const int tid = exec.tid(), warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  float* code_s = reinterpret_cast<float*>(shared);
  uint8_t* stages = shared + kMmaReduceOffset;
  const int64_t stage_bytes = WideStageBytes(kTiles);
  const int stride = XStride(8 * kTiles);
  int64_t first = 0, end = 0;
  WideSplitChunks(p, split, first, end);
  const int64_t row_a = cta * kWideRows + warp * kMmaRows + g, row_b = row_a + 8;
  const Segments segments = SegmentsOf(p);
  // The first chunk's weights and x asked for before the code's barrier.
  RowChunk a, b, next_a, next_b;
  LoadRowChunk(p, segments, row_a, first, t, a);
  LoadRowChunk(p, segments, row_b, first, t, b);
  WideXLoad x_next;
  if (first < end) LoadWideX<kTiles>(p, first, tid, x_next);
  if (tid < 16) code_s[tid] = p.code[tid];
  if (first < end) StoreWideX<kTiles>(x_next, tid, stages);
  exec.Sync();
  float c[kTiles][4];
  for (auto& tile : c) {
    for (float& v : tile) v = 0.0f;
  }
  for (int64_t chunk = first; chunk < end; ++chunk) {  // uniform over the CTA
    const int64_t round = chunk - first;
    const uint8_t* x_s = stages + (round % 2) * stage_bytes;
    // The next chunk's weights and x (its stage was last read a round ago,
    // before the barrier every thread has passed).
    LoadRowChunk(p, segments, row_a, chunk + 1 < end ? chunk + 1 : p.k / kMmaChunk, t, next_a);
    LoadRowChunk(p, segments, row_b, chunk + 1 < end ? chunk + 1 : p.k / kMmaChunk, t, next_b);
    if (chunk + 1 < end) LoadWideX<kTiles>(p, chunk + 1, tid, x_next);
    MmaRound<Tag, kTiles>(code_s, a, b, StagedFragments{x_s, stride, p.m, g, t}, c, exec);
    if (chunk + 1 < end) StoreWideX<kTiles>(x_next, tid, stages + ((round + 1) % 2) * stage_bytes);
    exec.Sync();
    a = next_a;
    b = next_b;
  }
  // Lane (g, t), tile j: rows g and g + 8 of the warp's 16, activation rows
  // 8j + 2t and the next.
  const uint16_t* bias = static_cast<const uint16_t*>(p.bias);
  uint16_t* y = static_cast<uint16_t*>(p.y);
  for (int j = 0; j < kTiles; ++j) {
    for (int i = 0; i < 4; ++i) {
      const int64_t row = i < 2 ? row_a : row_b;
      const int m = 8 * j + 2 * t + i % 2;
      if (row >= p.n_rows || m >= p.m) continue;
      if (p.splits > 1) {
        p.workspace[(static_cast<int64_t>(split) * p.m + m) * p.n_rows + row] = c[j][i];
      } else {
        float sum = c[j][i];
        if (bias != nullptr) sum += Widen(Tag{}, bias[row]);
        y[m * p.n_rows + row] = Narrow(Tag{}, sum);
      }
    }
  }
}

// The wide kernel's reduce, for element `i` of y [m, N]: the splits' sums
// added in split order, the bias added, rounded once.
template <typename Tag>
ACCEL_HD void ReduceWideSplits(const GemvMmaParams& p, int64_t i) {
  const int64_t total = static_cast<int64_t>(p.m) * p.n_rows;
  if (i >= total) return;
  float sum = 0.0f;
  for (int32_t s = 0; s < p.splits; ++s) sum += p.workspace[s * total + i];
  const uint16_t* bias = static_cast<const uint16_t*>(p.bias);
  if (bias != nullptr) sum += Widen(Tag{}, bias[i % p.n_rows]);
  static_cast<uint16_t*>(p.y)[i] = Narrow(Tag{}, sum);
}

// The splits for a product of N rows of W and K: enough CTAs for about
// `target_ctas` (two an SM), at most one a chunk of K.
ACCEL_HD int32_t WideSplits(int64_t n_rows, int64_t k, int64_t target_ctas) {
  const int64_t ctas = (n_rows + kWideRows - 1) / kWideRows;
  const int64_t chunks = k / kMmaChunk;
  int64_t splits = ctas >= target_ctas ? 1 : (target_ctas + ctas - 1) / ctas;
  if (splits > chunks) splits = chunks;
  if (splits < 1) splits = 1;
  return static_cast<int32_t>(splits);
}

// --- The scaled form: up to 8 activation rows, each block's absmax after its sum ---
//
// The forms above look each nibble up with byte permutes from tables built a
// block at a time (T(code * absmax), Dequantize4bit's weight to the bit). On
// an H200 they read 0.35-0.40 of a device copy's rate at every shape
// (2026-11-30) while the int8 decode GEMV read 0.77-0.89: their loop issues
// about four integer-pipe instructions a weight (2.1 prmt, the nibble
// selectors, the x stage's addressing: counted in the PTX of the m = 1
// kernel, ~520 a lane a round of 128 weights), and the integer pipe executes
// 64 lanes a clock an SM, so the form cannot pass about half of HBM's rate
// however its loads are scheduled.
//
// Here the arithmetic moves off that pipe. The weight of nibble c in a block
// with absmax a is T(code[c]) (the code rounded to the activation type T),
// each block's products are summed on the tensor cores in float32, and the
// block's sum is multiplied by a into the row's float32 sum (one fused
// multiply-add a block):
//   y = sum over blocks b of a_b * (sum over k in b of x_k * T(code[c_k])) + bias.
// A weight so taken differs from Dequantize4bit's T(code[c] * a) by at most
// a rounding of T on each side (2^-8 of it in bfloat16): the class of
// bitsandbytes' own batch-1 kernel (kgemm_4bit_inference_naive rounds code
// and absmax to T, multiplies them in T and rounds each product x * w to T;
// its dequantize + GEMM path differs from it as well). GemvKernel::kMma keeps
// the bit-exact weights by name.
//
// The lookup: a table in shared memory of the 256 values of a byte -> its
// two weights' T(code) as a 16-bit pair (the high nibble's, the even k, in
// the low half), 32 copies interleaved so that lane L reads copy L from bank
// L: one 4-byte shared load for two weights whatever the bytes, with no
// bank conflict. The table is the same for every block of every row, so a
// CTA builds it once (32 KiB, a barrier) and then takes tiles of 16 rows of W
// until they are done (CTAs tile, tile + grid, ...: a grid of what the
// device holds at once amortizes it over several tiles where W has many).
//
// Layout: as the first form, a CTA's 8 warps take K in chunks of 256 (warp
// w: chunks w, w + 8, ...), rows g and g + 8 of the tile a lane (g, t). A
// chunk is 4 segments of 64 weights, each inside one block (the blocksize a
// power of two, at least 64). In a segment lane t holds bytes 8t .. 8t + 7
// of each of its rows: k = 16t .. 16t + 15. The segment's 4 mma k-steps:
// step s takes its bytes 2s (a0 / a1: k = 16t + 4s and the next) and 2s + 1
// (a2 / a3: the two after), and x row g at the same k (b0, b1: 32 contiguous
// bytes of x a segment, read from global memory, where L1 holds x for every
// warp); the steps of a segment start from zero accumulators, so the block's
// sum is in hand for its absmax. Lane (g, t) reads the absmax of its two rows'
// block itself (the four lanes of a row read the same address).
// Integer work left: a byte's extraction a lookup (0.5 a weight); the
// shared-memory pipe carries one 4-byte load for two weights (about two
// thirds of what it can do at HBM's rate on an H200-class SM).
inline constexpr int kScaledTableCopies = 32;  // LookupByte: entries 128 bytes apart
inline constexpr int64_t kScaledTableOffset =
    kMmaReduceOffset + static_cast<int64_t>(kMmaWarps) * kMmaRows * kMmaMaxM * 4;
// The warps' sums (as the first form's, 8 activation rows), then the table.
ACCEL_HD int64_t ScaledSharedBytes() {
  return kScaledTableOffset + int64_t{256} * kScaledTableCopies * 4;
}

// Whether the scaled form takes these arguments: MmaTakes's conditions with
// a power-of-two blocksize (bitsandbytes' blocksizes are 64 to 4096).
ACCEL_HD bool ScaledTakes(int64_t m, int64_t k, int64_t blocksize, const void* x,
                          const void* packed) {
  return MmaTakes(m, k, blocksize, x, packed) && (blocksize & (blocksize - 1)) == 0;
}

// 8 bytes at an 8-byte aligned global address, read once (the weights).
ACCEL_HD void LoadStream8(const void* src, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__)
  const uint2 v = __ldcs(static_cast<const uint2*>(src));
  lo = v.x;
  hi = v.y;
#else
  uint32_t words[2];
  std::memcpy(words, src, 8);
  lo = words[0];
  hi = words[1];
#endif
}

// 16 bytes to a 16-byte aligned shared-memory address.
ACCEL_HD void Store16(uint32_t* dst, uint32_t v0, uint32_t v1, uint32_t v2, uint32_t v3) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(dst) = make_uint4(v0, v1, v2, v3);
#else
  const uint32_t words[4] = {v0, v1, v2, v3};
  std::memcpy(dst, words, 16);
#endif
}

// Thread `tid` (of kMmaThreads = 256, one a byte value) makes entry tid:
// T(code[tid >> 4]) in the low half, T(code[tid & 15]) in the high, and
// writes its 32 copies (word tid * 32 + L is lane L's) as 8 stores of 16
// bytes, starting at quad tid % 8, so a warp's stores spread over the banks.
template <typename Tag>
ACCEL_HD void BuildScaledTable(const float* code, int tid, uint32_t* table) {
  const uint32_t pair = PackRounded(Tag{}, code[tid >> 4], code[tid & 15]);
  for (int q = 0; q < kScaledTableCopies / 4; ++q) {
    const int quad = (q + tid) % (kScaledTableCopies / 4);
    uint32_t* dst = table + tid * kScaledTableCopies + 4 * quad;
    Store16(dst, pair, pair, pair, pair);
  }
}

// A lane's bytes of one row for a chunk (segment s: words 2s, 2s + 1) and
// each segment's absmax (zeros past the rows or the chunks).
struct ScaledChunk {
  uint32_t words[8];
  float scale[4];
};

ACCEL_HD void LoadScaledChunk(const GemvMmaParams& p, int block_shift, int64_t row, int64_t chunk,
                              int t, ScaledChunk& out) {
  if (row >= p.n_rows || chunk * kMmaChunk >= p.k) {
    for (uint32_t& w : out.words) w = 0;
    for (float& s : out.scale) s = 0.0f;
    return;
  }
  const int64_t start = row * p.k + chunk * kMmaChunk;  // flat index of the chunk's first weight
  const uint8_t* bytes = p.packed + (start >> 1) + 8 * t;
  // The segments' blocks: the chunk's first, and the next where a segment
  // starts past its end (blocks of 64 or 128).
  const float* first_block = p.absmax + (start >> block_shift);
  const uint32_t offset = static_cast<uint32_t>(start & (p.blocksize - 1));
  for (int s = 0; s < 4; ++s) {
    LoadStream8(bytes + 32 * s, out.words[2 * s], out.words[2 * s + 1]);
    const float* scale = first_block + ((offset + 64u * static_cast<uint32_t>(s)) >> block_shift);
#if defined(__CUDA_ARCH__)
    out.scale[s] = __ldg(scale);
#else
    out.scale[s] = *scale;
#endif
  }
}

// A lane's copy of the table: word L of each entry (entries 128 bytes
// apart). On the device its shared-memory address, computed once, so that a
// lookup is one prmt (the byte, zero-extended) and one shift-add before the
// load (the compiler, given a pointer, recomputes (byte * 32 + lane) * 4 +
// table each time: four integer instructions).
struct TableLane {
  const uint32_t* words;  // the table + the lane
#if defined(__CUDA_ARCH__)
  uint32_t address;
#endif
  ACCEL_HD explicit TableLane(const uint32_t* table_lane) : words(table_lane) {
#if defined(__CUDA_ARCH__)
    address = static_cast<uint32_t>(__cvta_generic_to_shared(table_lane));
#endif
  }
  // Byte `byte` of `word`'s two weights.
  ACCEL_HD uint32_t operator()(uint32_t word, int byte) const {
#if defined(__CUDA_ARCH__)
    const uint32_t index = __byte_perm(word, 0u, 0x4440u + static_cast<uint32_t>(byte));
    uint32_t pair;
    // volatile: kept after the barrier that follows the table's stores.
    asm volatile("{\n .reg .u32 at;\n mad.lo.u32 at, %1, 128, %2;\n ld.shared.u32 %0, [at];\n}"
                 : "=r"(pair)
                 : "r"(index), "r"(address));
    return pair;
#else
    return words[((word >> (8 * byte)) & 0xffu) * kScaledTableCopies];
#endif
  }
};

// One chunk of lane (g, t): rows g (`a`) and g + 8 (`b`), x row g at the chunk's
// first k (null where g is past the activation rows: zeros), each segment's
// 4 k-steps on the tensor cores from zero, its sums then scaled into `sum`
// (C layout: sum[0], sum[1] row g, activation rows 2t and 2t + 1; sum[2],
// sum[3] row g + 8).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, typename Exec>
ACCEL_HD void ScaledRound(const TableLane& lookup, int t, const ScaledChunk& a,
                          const ScaledChunk& b, const uint16_t* x_chunk, float (&sum)[4],
                          Exec& exec) {
  for (int s = 0; s < 4; ++s) {
    uint32_t xv[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    if (x_chunk != nullptr) {
      uint32_t lo[4], hi[4];
      Load16(x_chunk + 64 * s + 16 * t, lo, false);
      Load16(x_chunk + 64 * s + 16 * t + 8, hi, false);
      for (int i = 0; i < 4; ++i) {
        xv[i] = lo[i];
        xv[4 + i] = hi[i];
      }
    }
    float block[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int step = 0; step < 4; ++step) {
      // Bytes 2 step and 2 step + 1 of the segment's 8: word 2s + step / 2.
      const int word = 2 * s + step / 2, first = 2 * (step % 2);
      const uint32_t a0 = lookup(a.words[word], first);
      const uint32_t a2 = lookup(a.words[word], first + 1);
      const uint32_t a1 = lookup(b.words[word], first);
      const uint32_t a3 = lookup(b.words[word], first + 1);
      exec.template Mma<Tag>(a0, a1, a2, a3, xv[2 * step], xv[2 * step + 1], block);
    }
#if defined(__CUDA_ARCH__)
    sum[0] = __fmaf_rn(a.scale[s], block[0], sum[0]);
    sum[1] = __fmaf_rn(a.scale[s], block[1], sum[1]);
    sum[2] = __fmaf_rn(b.scale[s], block[2], sum[2]);
    sum[3] = __fmaf_rn(b.scale[s], block[3], sum[3]);
#else
    sum[0] = std::fma(a.scale[s], block[0], sum[0]);
    sum[1] = std::fma(a.scale[s], block[1], sum[1]);
    sum[2] = std::fma(b.scale[s], block[2], sum[2]);
    sum[3] = std::fma(b.scale[s], block[3], sum[3]);
#endif
  }
}

// A CTA of the scaled form: the table built, then tiles first_tile,
// first_tile + tile_step, ... of 16 rows of W. `shared` holds
// ScaledSharedBytes() bytes, 16-byte aligned. Exec: as Gemv4bitMmaCta's.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, typename Exec>
ACCEL_HD void Gemv4bitScaledCta(const GemvMmaParams& p, int64_t first_tile, int64_t tile_step,
                                uint8_t* shared, Exec& exec) {
  const int tid = exec.tid(), warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  float* sums_s = reinterpret_cast<float*>(shared + kMmaReduceOffset);
  uint32_t* table = reinterpret_cast<uint32_t*>(shared + kScaledTableOffset);
  int block_shift = 0;
  while ((int64_t{1} << block_shift) < p.blocksize) ++block_shift;
  const int64_t tiles = (p.n_rows + kMmaRows - 1) / kMmaRows;
  const int64_t chunks = p.k / kMmaChunk;
  // This warp's chunks of a tile: warp, warp + 8, ... (uniform over the warp).
  const int64_t rounds = chunks > warp ? (chunks - warp + kMmaWarps - 1) / kMmaWarps : 0;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  // The first tile's first weights asked for before the table's barrier.
  ScaledChunk a, b, next_a, next_b;
  LoadScaledChunk(p, block_shift, first_tile * kMmaRows + g, warp, t, a);
  LoadScaledChunk(p, block_shift, first_tile * kMmaRows + g + 8, warp, t, b);
  BuildScaledTable<Tag>(p.code, tid, table);
  exec.Sync();
  const TableLane lookup(table + lane);
  for (int64_t tile = first_tile; tile < tiles; tile += tile_step) {
    float sum[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    for (int64_t round = 0; round < rounds; ++round) {
      const int64_t chunk = round * kMmaWarps + warp;
      // The next round's weights: this tile's next chunk, or the next
      // tile's first (zeros past the last tile).
      const bool last = round + 1 == rounds;
      const int64_t next_row = (last ? tile + tile_step : tile) * kMmaRows + g;
      const int64_t next_chunk = last ? warp : chunk + kMmaWarps;
      LoadScaledChunk(p, block_shift, next_row, next_chunk, t, next_a);
      LoadScaledChunk(p, block_shift, next_row + 8, next_chunk, t, next_b);
      const uint16_t* x_chunk = g < p.m ? x + g * p.k + chunk * kMmaChunk : nullptr;
      ScaledRound<Tag>(lookup, t, a, b, x_chunk, sum[0], exec);
      a = next_a;
      b = next_b;
    }
    AddWarpSumsAndStore<Tag, 1>(p, tile, sum, sums_s, exec);
    exec.Sync();  // every thread's reads of sums_s done before the next tile's writes
  }
}

// The scaled form's grid: a CTA a tile up to what the device holds at once
// (`resident`), fewer CTAs each taking several tiles beyond.
ACCEL_HD int64_t ScaledCtas(int64_t n_rows, int64_t resident) {
  const int64_t tiles = (n_rows + kMmaRows - 1) / kMmaRows;
  return tiles < resident || resident < 1 ? tiles : resident;
}

// --- A mixture of experts' routed rows (Gemv4bitExperts) ---------------------------
//
// A decode step's top-k slots, each the product of one row of x with the
// weight of the expert the router picked for it, the expert's index read
// from device memory, so that no host waits for the routing. Slot s reads x
// row s / slots_per_x (gate and up: a token's k slots share its row; down:
// a slot's own row) and writes y row s. A slot's product is the one-row
// product of its expert's weight, by the same CTA code as Gemv4bit's for one
// row (the first form or the scaled one), so its bits are that call's.
struct ExpertRows {
  const int64_t* expert_ids = nullptr;     // [slots]
  const uint8_t* const* packed = nullptr;  // [experts], each 16-byte aligned
  const float* const* absmax = nullptr;    // [experts], float32 absmax
  const float* const* code = nullptr;      // [experts], 16 floats each
  int64_t experts = 0;
  int64_t slots_per_x = 1;
};

// The one-row params of slot `slot` from `base` (x the first row of x, y
// the first row of y, the experts' shape; no bias), or false where its
// expert index lies outside [0, experts).
ACCEL_HD bool ExpertSlotParams(const GemvMmaParams& base, const ExpertRows& rows, int64_t slot,
                               GemvMmaParams& out) {
#if defined(__CUDA_ARCH__)
  const int64_t e = __ldg(rows.expert_ids + slot);
#else
  const int64_t e = rows.expert_ids[slot];
#endif
  if (e < 0 || e >= rows.experts) return false;
  out = base;
  out.m = 1;
  out.bias = nullptr;
  out.x = static_cast<const uint16_t*>(base.x) + (slot / rows.slots_per_x) * base.k;
  out.y = static_cast<uint16_t*>(base.y) + slot * base.n_rows;
  out.packed = rows.packed[e];
  out.absmax = rows.absmax[e];
  out.code = rows.code[e];
  return true;
}

// Zeros for tiles first_tile, first_tile + tile_step, ... of a slot whose
// expert index is out of range (never from a router's top-k): y row `y`.
template <typename Exec>
ACCEL_HD void ZeroExpertTiles(const GemvMmaParams& base, int64_t slot, int64_t first_tile,
                              int64_t tile_step, Exec& exec) {
  uint16_t* y = static_cast<uint16_t*>(base.y) + slot * base.n_rows;
  const int64_t tiles = (base.n_rows + kMmaRows - 1) / kMmaRows;
  for (int64_t tile = first_tile; tile < tiles; tile += tile_step) {
    const int64_t row = tile * kMmaRows + exec.tid();
    if (exec.tid() < kMmaRows && row < base.n_rows) y[row] = 0;
  }
}

// A CTA of slot `slot` in the first form (Gemv4bitMmaCta for one row):
// tile `cta` of its expert's rows.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, typename Exec>
ACCEL_HD void Gemv4bitExpertsMmaCta(const GemvMmaParams& base, const ExpertRows& rows, int64_t slot,
                                    int64_t cta, uint8_t* shared, Exec& exec) {
  GemvMmaParams p;
  if (!ExpertSlotParams(base, rows, slot, p)) {
    ZeroExpertTiles(base, slot, cta, (base.n_rows + kMmaRows - 1) / kMmaRows + 1, exec);
    return;
  }
  Gemv4bitMmaCta<Tag, 1>(p, cta, shared, exec);
}

// A CTA of slot `slot` in the scaled form (Gemv4bitScaledCta for one row).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, typename Exec>
ACCEL_HD void Gemv4bitExpertsScaledCta(const GemvMmaParams& base, const ExpertRows& rows,
                                       int64_t slot, int64_t first_tile, int64_t tile_step,
                                       uint8_t* shared, Exec& exec) {
  GemvMmaParams p;
  if (!ExpertSlotParams(base, rows, slot, p)) {
    ZeroExpertTiles(base, slot, first_tile, tile_step, exec);
    return;
  }
  Gemv4bitScaledCta<Tag>(p, first_tile, tile_step, shared, exec);
}

}  // namespace accel::quant::cuda::internal

#endif  // ACCEL_QUANT_CUDA_INTERNAL_GEMV_MMA_H_
