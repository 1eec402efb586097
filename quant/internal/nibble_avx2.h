// The AVX2 register kernels of Gemv4bit for the common layout: rows of a
// multiple of 64 elements and blocks of a multiple of 64, so every group of
// 64 elements (32 packed bytes, one load) lies in one block and starts a
// byte. A block's table of 16 rounded values is held as two byte tables (the
// low and high bytes of its 16-bit values), and a group decodes with
// in-register byte lookups (vpshufb): 32 nibbles a lookup instead of the 8 of
// a float permute. The weights come out of a group in a fixed order other
// than memory's, so x is rearranged once per call into that order
// (NibblePermuteX) and each product pairs the same weight and x as before;
// only the order of the float32 additions differs.
//
// bfloat16 and float16 tables are 16-bit; float32 ones would need four byte
// tables, so float32 compute stays with the float permute kernels.
#ifndef ACCEL_QUANT_INTERNAL_NIBBLE_AVX2_H_
#define ACCEL_QUANT_INTERNAL_NIBBLE_AVX2_H_

#include <cstdint>

#include "quant/internal/kernels_cpu.h"

namespace accel::quant::internal {

// Adds the dot products of weight rows [n_begin, n_end) and a.m rows of x over
// columns [k0, k1) to sums[(n - n_begin) * sums_stride + i].
using GemvRangeFn = void (*)(const Gemv4bitArgs&, int64_t, int64_t, int64_t, int64_t, float*,
                             int64_t);

// Whether the nibble kernels take `a`: AVX2 on this CPU, bfloat16 or float16
// rounding, a.in and blocksize multiples of 64, and a code table of finite
// values.
bool NibbleGemvApplies(const Gemv4bitArgs& a);

// x in the kernels' order, the rows of a group side by side: group g of row
// i at out[(g * a.m + i) * 64], rearranged within (a.m * a.in floats).
void NibblePermuteX(const Gemv4bitArgs& a, float* out);

// For more rows, a weight row decoded once into a buffer and dotted with
// every row of x from there: x rearranged in place, row by row
// (out[i * a.in + k]), and weight row n's columns [k0, k1) (multiples of 64)
// decoded into out[0, k1 - k0) in the same order.
void NibblePermuteRows(const Gemv4bitArgs& a, float* out);
void NibbleDecodeRow(const Gemv4bitArgs& a, int64_t n, int64_t k0, int64_t k1, float* out);

// The kernel for `rows` (1 to 4; else null) rows of permuted x: a.x the first row's first
// group in NibblePermuteX's output, a.x_stride the floats from one group to
// the next (64 x the rows permuted); k0 and k1 multiples of 64.
GemvRangeFn NibbleKernel(DenseType round, int64_t rows);

}  // namespace accel::quant::internal

#endif  // ACCEL_QUANT_INTERNAL_NIBBLE_AVX2_H_
