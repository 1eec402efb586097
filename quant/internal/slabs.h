// How many rows of a 4-bit weight quant/cuda_matmul.cc dequantizes at a time
// for a product of more rows than the fused GEMV takes: a slab of the dense
// weight small enough to stay in the device's L2 cache between the
// dequantize kernel that writes it and the GEMM that reads it back, so the
// weight crosses device memory once, packed. Pure arithmetic, so it is
// tested on any machine (tests/quant/cuda_matmul_test.cc).
#ifndef ACCEL_QUANT_INTERNAL_SLABS_H_
#define ACCEL_QUANT_INTERNAL_SLABS_H_

#include <algorithm>
#include <cstdint>
#include <numeric>

namespace accel::quant::internal {

// Fewer rows than this a slab never has (each slab costs two launches).
inline constexpr int64_t kMinSlabRows = 256;

// Rows per slab of an [out, in] weight in `blocksize` blocks dequantized to
// `element_bytes`-wide values, aiming at `slab_bytes` of them: a multiple of
// the smallest row count whose slabs start on a quantization block and on a
// 16-byte boundary of the packed bytes (so each slab is a whole
// Dequantize4bit call on its own pointers), at least kMinSlabRows (or that
// row step), at most `out` (one slab: the whole weight, as before).
inline int64_t DequantSlabRows(int64_t out, int64_t in, int64_t blocksize, int64_t element_bytes,
                               int64_t slab_bytes) {
  if (out <= 0 || in <= 0 || blocksize <= 0 || element_bytes <= 0) return std::max<int64_t>(out, 0);
  // A slab of r rows holds r * in values: a whole number of blocks and of
  // 32 values (16 packed bytes).
  const int64_t values = std::lcm(blocksize, int64_t{32});
  const int64_t step = values / std::gcd(in, values);
  const int64_t target = std::max(slab_bytes / (in * element_bytes), kMinSlabRows);
  const int64_t rows = std::max(step, target / step * step);
  return std::min(rows, out);
}

}  // namespace accel::quant::internal

#endif  // ACCEL_QUANT_INTERNAL_SLABS_H_
