// Small-batch matrix-vector products for the decode path, torch-free:
//
//   y[i, n] = sum_k x[i, k] * w[n, k] (+ bias[n])   for i < m, n_begin <= n < n_end
//
// x and y are float32, w is row-major [n, k] (transformers' Linear layout) in
// float32, bfloat16 or float16, bias float32 or null. Products and sums are
// float32 (fused multiply-adds in the vector paths); bfloat16 and float16
// weights are widened to float32 exactly, so the only rounding is float32
// accumulation. Each weight is read once per call for all m rows (rows are
// processed in blocks of up to 8 whose weights are re-read from cache), so a
// call streams the weights at close to memory bandwidth. Decoding a token at
// batch 1 is bound by exactly that read.
//
// The column range lets a caller split one product over threads: calls on
// disjoint column ranges write disjoint parts of y and may run concurrently.
//
// The implementation is picked at run time from the CPU's features:
// AVX-512 (F + BW), AVX2 (+ FMA + F16C), or portable C++. The binary itself
// is built for plain x86-64 (each vector function carries its own target
// attribute), so it runs on any x86-64 and compiles on other architectures
// (scalar only there). Tests run every level this CPU supports through
// GemvWithIsa().
#ifndef ACCEL_MODELS_INTERNAL_GEMV_H_
#define ACCEL_MODELS_INTERNAL_GEMV_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace accel::models::internal {

enum class GemvIsa { kScalar, kAvx2, kAvx512 };
enum class GemvWeight { kFloat32, kBFloat16, kFloat16 };

absl::string_view GemvIsaName(GemvIsa isa);

// Whether this CPU (and this build) can run `isa`. kScalar always can.
bool GemvIsaSupported(GemvIsa isa);

// The fastest level GemvIsaSupported() accepts; what Gemv() uses.
GemvIsa BestGemvIsa();

// One product. Strides are in elements; rows of x, w and y need not be
// contiguous with each other, but each row is (element stride 1).
struct GemvArgs {
  int64_t m = 0;  // rows of x and y (any m >= 0; meant for m <= 16)
  int64_t k = 0;  // the reduced dimension: columns of x and of w
  const float* x = nullptr;
  int64_t x_stride = 0;  // x[i, j] is x[i * x_stride + j]
  const void* w = nullptr;
  GemvWeight w_type = GemvWeight::kFloat32;
  int64_t w_stride = 0;         // w[n, j] is w[n * w_stride + j]
  const float* bias = nullptr;  // bias[n], or null for none
  float* y = nullptr;
  int64_t y_stride = 0;  // y[i, n] is y[i * y_stride + n]
};

// Computes y[i, n] for i < args.m and n in [n_begin, n_end) with
// BestGemvIsa(). Writes nothing else.
void Gemv(const GemvArgs& args, int64_t n_begin, int64_t n_end);

// The same with a given level, which must be supported (checked: an
// unsupported level aborts, since it would fault on an illegal instruction).
void GemvWithIsa(GemvIsa isa, const GemvArgs& args, int64_t n_begin, int64_t n_end);

// The same product for a weight stored [k, n] (GPT-2's Conv1D, which
// transformers multiplies as x @ w): y[i, n] = sum_j x[i, j] * w[j, n]
// (+ bias[n]), with w[j, n] at w[j * w_stride + n]. Each y[i, n] adds its k
// products in order of j, one fused multiply-add each (std::fma at the
// scalar level), then the bias, so neither the column range, the row count
// nor the level changes a bit (kAvx512 runs the AVX2 kernels). Rows of x in
// passes of 4 (a pass reads the weights once), columns in tiles of 1024.
void GemvTransposed(const GemvArgs& args, int64_t n_begin, int64_t n_end);
void GemvTransposedWithIsa(GemvIsa isa, const GemvArgs& args, int64_t n_begin, int64_t n_end);

// The weight format's element size in bytes.
inline int64_t GemvWeightBytes(GemvWeight type) { return type == GemvWeight::kFloat32 ? 4 : 2; }

// IEEE binary16 / bfloat16 bits -> float32, exactly (subnormals, infinities
// and NaN included). Portable; what the scalar path uses.
float HalfToFloat(uint16_t bits);
float BFloat16ToFloat(uint16_t bits);

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_GEMV_H_
