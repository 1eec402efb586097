// The CPU kernels behind quant/matmul.h, torch-free in their interface (raw
// pointers), split over libtorch's intra-op threads (at::parallel_for):
//
//   Dequantize4bit  the packed 4-bit weight as dense float32 / bfloat16 /
//                   float16 values (bnb's dequantize_4bit, bit for bit);
//   Gemv4bit        y = x W^T for a few rows of x, decoding the packed weight
//                   on the fly (the decode path: the weight is read once and
//                   never materialized);
//   Int8Matmul      C = A B^T for int8 A [M, K], B [N, K], exact in int32;
//   QuantizeInt8Rows, Int8Rescale
//                   LLM.int8's activation quantization and rescale (these
//                   three in int8_cpu.cc).
//
// Every kernel has an AVX2 level (with FMA and F16C; each function carries its
// own target attribute, so the library builds for plain x86-64) and a portable
// scalar one; an AVX-512 level too (F, BW, VL, VBMI and VNNI: Ice Lake,
// Sapphire Rapids, Zen 4 and later), where the 4-bit kernels look up 16 values
// with two instructions and Int8Matmul multiplies 64 bytes by 64 with one
// vpdpbusd; and an AVX-512 BF16 level (AVX-512 and AVX512-BF16: Cooper Lake,
// Sapphire Rapids, Zen 4 and later), the AVX-512 one but for Gemv4bit with
// bfloat16 rounding, which decodes 32 weights to bfloat16 at a time and
// multiplies with vdpbf16ps. The best level this CPU runs is picked at run
// time (ActiveIsa()). All give the same results: the dequantized values and
// the int32 products bit for bit, the float32 sums of Gemv4bit up to the
// order of their additions, except that vdpbf16ps (like oneDNN's bfloat16
// product, which uses it) reads subnormal inputs as 0 and flushes subnormal
// sums to 0.
#ifndef ACCEL_QUANT_INTERNAL_KERNELS_CPU_H_
#define ACCEL_QUANT_INTERNAL_KERNELS_CPU_H_

#include <cstdint>
#include <optional>

#include "absl/strings/string_view.h"

namespace accel::quant::internal {

// In order: each level has every feature of the ones before it.
enum class CpuIsa { kScalar, kAvx2, kAvx512, kAvx512Bf16 };

absl::string_view CpuIsaName(CpuIsa isa);
// Whether this CPU (and build) can run `isa`; kScalar always can.
bool CpuIsaSupported(CpuIsa isa);
// The level quant/matmul.cc uses: the best supported one, unless a test set
// an override.
CpuIsa ActiveIsa();
// Aborts, naming `what`, unless this CPU can run `isa`: every kernel checks
// the level it is handed.
void CheckSupported(CpuIsa isa, const char* what);
// Makes ActiveIsa() return `isa` (which must be supported: checked, an
// unsupported level aborts) until reset with nullopt. For tests, which run
// the public functions at every level; not thread-safe against running kernels.
void SetIsaOverrideForTesting(std::optional<CpuIsa> isa);

// Weight bytes per thread below which a kernel is not split further: a split
// costs a few microseconds, about what 64 KiB take to stream.
inline constexpr int64_t kMinBytesPerTask = int64_t{64} << 10;

// The dtype values are rounded to (round to nearest even), and for
// Dequantize4bit also the type of the output elements.
enum class DenseType { kFloat32, kBFloat16, kFloat16 };

// A 4-bit weight over the flat index j < numel: code index
// (j even) ? packed[j / 2] >> 4 : packed[j / 2] & 0xF, value
// float32(code[index]) * BlockAbsmax(w, j / blocksize), then rounded.
struct Packed4bit {
  const uint8_t* packed = nullptr;  // (numel + 1) / 2 bytes
  const float* absmax = nullptr;    // ceil(numel / blocksize), or null: double quant
  const float* code = nullptr;      // 16
  int64_t blocksize = 64;           // > 0, any value (blocks may cross rows)
  int64_t numel = 0;
  // Double quant (absmax null), read as stored: one byte a block instead of
  // a float32 expanded at load. Block b's absmax is
  // nested_code[absmax_codes[b]] * nested_absmax[b / 256] + nested_offset,
  // a float32 multiply then an add (bnb's dequantize_blockwise, then
  // absmax += offset), computed per block as the kernels reach it.
  const uint8_t* absmax_codes = nullptr;  // ceil(numel / blocksize)
  const float* nested_absmax = nullptr;   // ceil(blocks / 256)
  const float* nested_code = nullptr;     // 256
  float nested_offset = 0.0f;
};

// bnb's nested blocksize (quant/bnb.h), fixed: a shift, not a divide.
inline constexpr int kNestedBlockShift = 8;

// A float32 value kept from being fused with the next operation: a fused
// multiply-add rounds once, and GCC fuses by default where the target has one
// (x86_targets.h has the same for a 16-float register).
inline __attribute__((always_inline)) void Unfused(float& v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#else
  asm("" : "+m"(v));
#endif
}

// Block b's absmax, either way it is stored.
inline float BlockAbsmax(const Packed4bit& w, int64_t b) {
  if (w.absmax != nullptr) return w.absmax[b];
  float scaled = w.nested_code[w.absmax_codes[b]] * w.nested_absmax[b >> kNestedBlockShift];
  Unfused(scaled);  // two roundings, as bnb's two steps
  return scaled + w.nested_offset;
}

// Activations in and out of the kernels without a libtorch op (whose
// dispatch and allocation cost more than the work at decode sizes; a
// scalar float16 conversion costs ~15 ns a value). LoadRounded: n values
// stored as `from` (float32, or bfloat16 / float16 bits) into float32,
// rounded to `round`. StoreRounded: n float32 values rounded to `round`,
// then to `to`, stored as `to`. Both round to nearest even (bfloat16 NaN
// as c10 makes it); every level gives the same bits. Not threaded.
void LoadRounded(CpuIsa isa, const void* in, DenseType from, int64_t n, DenseType round,
                 float* out);
void StoreRounded(CpuIsa isa, const float* in, int64_t n, DenseType round, DenseType to, void* out);

// out[j] for every j < w.numel, of `type` (float*, or uint16_t* bits for
// bfloat16 / float16). Threaded.
void Dequantize4bit(CpuIsa isa, const Packed4bit& w, DenseType type, void* out);
// The same for j in [first, last) only, into out[j - first]; `first` a
// multiple of 16 (a byte and a decode group).
void Dequantize4bitRange(CpuIsa isa, const Packed4bit& w, DenseType type, int64_t first,
                         int64_t last, void* out);
// The same values rounded to `round`, written as float32 (exactly: each
// dtype's values are float32 values).
void Dequantize4bitRangeAsFloat(CpuIsa isa, const Packed4bit& w, DenseType round, int64_t first,
                                int64_t last, float* out);

// y[i, n] = sum_k W[n, k] * x[i, k] (+ bias[n]) for i < m, n < out, with W =
// w viewed [out, in] (w.numel == out * in) and its values rounded to
// `round`. x holds values already in that dtype (as float32); products and
// sums are float32. Each thread takes a range of output rows n and decodes
// each weight row once, a chunk at a time into the L1 cache, for all m rows
// of x. Meant for m <= 16 (any m works). Threaded.
struct Gemv4bitArgs {
  int64_t m = 0, in = 0, out = 0;
  const float* x = nullptr;  // x[i, k] = x[i * x_stride + k]
  int64_t x_stride = 0;
  Packed4bit w;
  DenseType round = DenseType::kFloat32;
  const float* bias = nullptr;  // [out], or null
  float* y = nullptr;           // y[i, n] = y[i * y_stride + n]
  int64_t y_stride = 0;
};
void Gemv4bit(CpuIsa isa, const Gemv4bitArgs& args);

// C[i, j] = sum_k a[i, k] * b[j, k] in int32 (exact while |sum| < 2^31: any
// K up to 131072), a [m, k], b [n, k], all contiguous, stored transposed:
// c[j * m + i] (c is [n, m]). Threaded over n. Column-major because the
// kernels for many rows hold 16 rows of one column in a register, and rows
// of C `n` values apart would put all of a column's stores in the same L1
// sets.
// With `gather`, also copies b[n, gather->cols[j]] to gather->out[n * count + j]
// while row n is in the cache (LLM.int8's outlier columns: picked from a
// weight that is no longer cached, they cost more than the product).
struct Int8Gather {
  const int64_t* cols = nullptr;
  int64_t count = 0;
  int8_t* out = nullptr;
};
void Int8Matmul(CpuIsa isa, const int8_t* a, const int8_t* b, int64_t m, int64_t n, int64_t k,
                int32_t* c, const Int8Gather* gather = nullptr);

// LLM.int8's activation quantization (bnb's int8_vectorwise_quant with a
// threshold) of a [m, k] float32, all compares and products in float32:
// outlier_col[t] = 1 where some row holds |a| >= threshold (threshold > 0;
// else no outliers), else 0; sca[i] = the largest |a[i, t]| below the
// threshold (NaN ignored); codes[i, t] = rint(a[i, t] * (127 / sca[i])), ties
// to even, and 0 for an element at or above the threshold, for every element
// of an outlier column when m > 1, for a row with sca 0, and where the
// rounded value is not in [-128, 127] (NaN: an inf against sca inf). Every
// level gives the same bytes. Not threaded (a few microseconds a call).
void QuantizeInt8Rows(CpuIsa isa, const float* a, int64_t m, int64_t k, float threshold,
                      uint8_t* outlier_col, float* sca, int8_t* codes);

// 1/16129 = 1/127^2 rounded to float32: the constant of bnb's CUDA
// int8_mm_dequant (the default backend's 6.200124e-05 has two digits swapped).
inline constexpr float kInv127Squared = 1.0f / 16129.0f;

// LLM.int8's epilogue for the outputs [n_begin, n_end) of every row m:
// y[m * out + n] = float32(c[n * rows + m]) * (sca[m] * scb[n]) *
// kInv127Squared (+ bias[n]), then + the outlier dot sum_j
// outlier_x[m * nout + j] * outlier_w[j * out + n] summed in float32 from 0 in
// the order of j; each a float32 operation of its own (no fused
// multiply-add), so every level gives the same bits. Not threaded: a caller
// splits the outputs.
struct Int8RescaleArgs {
  const int32_t* c = nullptr;  // Int8Matmul's [out, rows]
  int64_t rows = 0, out = 0;
  const float* sca = nullptr;        // [rows]
  const float* scb = nullptr;        // [out]
  const float* bias = nullptr;       // [out], or null
  int64_t nout = 0;                  // outlier columns (0: none)
  const float* outlier_x = nullptr;  // [rows, nout]
  const float* outlier_w = nullptr;  // [nout, out]
  float* y = nullptr;                // [rows, out]
};
void Int8Rescale(CpuIsa isa, const Int8RescaleArgs& args, int64_t n_begin, int64_t n_end);

}  // namespace accel::quant::internal

#endif  // ACCEL_QUANT_INTERNAL_KERNELS_CPU_H_
