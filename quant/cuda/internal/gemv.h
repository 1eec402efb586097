// quant/cuda/internal/gemv.h: the 4-bit GEMV kernels one by one, for the
// tests and the benchmark to compare them (kernels.h's Gemv4bit and
// Gemv4bitRows pick one). Private to quant/cuda (and its tests and
// benchmarks).
#ifndef ACCEL_QUANT_CUDA_INTERNAL_GEMV_H_
#define ACCEL_QUANT_CUDA_INTERNAL_GEMV_H_

#include <cstdint>
#include <cuda_runtime_api.h>

#include "quant/cuda/kernels.h"

namespace accel::quant::cuda::internal {

enum class GemvKernel {
  kAuto,          // the tensor-core kernel where it applies (pipelined up to 4 rows), else the
                  // chunk / element one
  kMma,           // the tensor-core kernel only (cudaErrorInvalidValue where it does not apply)
  kMmaPipelined,  // its pipelined form (gemv_mma.h), up to 4 rows; likewise
  kChunk,         // the warp-per-row kernel (chunk or element path), a row of x at a time
};

// Whether the tensor-core kernel takes these arguments.
bool MmaApplies(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                const void* packed);

// Gemv4bitRows through the given kernel.
cudaError_t Gemv4bitWith(GemvKernel kernel, const void* x, int64_t m, const uint8_t* packed,
                         const float* absmax, const float* code, int64_t n_rows, int64_t k,
                         int64_t blocksize, const void* bias, DType dtype, void* y,
                         cudaStream_t stream);

// One row of x through the warp-per-row kernel.
cudaError_t GemvOneRow(const void* x, const uint8_t* packed, const float* absmax, const float* code,
                       int64_t n_rows, int64_t k, int64_t blocksize, const void* bias, DType dtype,
                       void* y, cudaStream_t stream);

}  // namespace accel::quant::cuda::internal

#endif  // ACCEL_QUANT_CUDA_INTERNAL_GEMV_H_
