// quant/cuda/internal/gemv.h: the 4-bit GEMV kernels and the int8 product's
// kernels one by one, for the tests and the benchmark to compare them
// (kernels.h's Gemv4bit, Gemv4bitRows and Int8Matmul pick one). Private to quant/cuda (and its
// tests and benchmarks).
#ifndef ACCEL_QUANT_CUDA_INTERNAL_GEMV_H_
#define ACCEL_QUANT_CUDA_INTERNAL_GEMV_H_

#include <cstdint>
#include <cuda_runtime_api.h>

#include "quant/cuda/kernels.h"

namespace accel::quant::cuda::internal {

enum class GemvKernel {
  kAuto,          // the tensor-core kernel where it applies (up to 8 rows its scaled
                  // form, or its first form where the scaled one does not apply or
                  // UseScaledGemv() is off; its tiled form above), else the chunk /
                  // element one
  kMma,           // the tensor-core kernel's first form only, Dequantize4bit's weights to
                  // the bit (cudaErrorInvalidValue where it does not apply)
  kMmaScaled,     // its scaled form (gemv_mma.h), up to 8 rows: T(code) looked up from
                  // shared memory, each block's absmax applied to its float32 sum; likewise
  kMmaScaled3,    // the same bounded to three CTAs an SM (80 registers, spilling), by
                  // name: for the benchmark to compare
  kMmaPipelined,  // its pipelined form (gemv_mma.h), up to 4 rows; likewise
  kMmaTiled,      // its tiled form (gemv_mma.h), up to 32 rows (kAuto's above 8); likewise
  kMmaWide,       // its wide form (gemv_mma.h), up to 32 rows, a workspace from
                  // cudaMallocAsync where K is split; likewise
  kChunk,         // the warp-per-row kernel (chunk or element path), a row of x at a time
};

// Whether the tensor-core kernel takes these arguments.
bool MmaApplies(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                const void* packed);
// Whether its scaled form takes them (up to 8 rows, power-of-two blocksize).
bool ScaledApplies(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                   const void* packed);
// Whether kAuto runs the scaled form where it applies: yes unless
// $ACCEL_CUDA_4BIT_GEMV is "exact" (read once) or SetScaledGemv(false).
bool UseScaledGemv();
void SetScaledGemv(bool on);
// Whether its tiled form takes them (up to 32 rows).
bool MmaTiledApplies(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                     const void* packed);

// Gemm4bitRowsWide (kernels.h) itself.
cudaError_t Gemm4bitWide(const void* x, int64_t m, const uint8_t* packed, const float* absmax,
                         const float* code, int64_t n_rows, int64_t k, int64_t blocksize,
                         const void* bias, DType dtype, void* y, float* workspace,
                         int64_t workspace_bytes, cudaStream_t stream);

// Gemv4bitRows through the given kernel.
cudaError_t Gemv4bitWith(GemvKernel kernel, const void* x, int64_t m, const uint8_t* packed,
                         const float* absmax, const float* code, int64_t n_rows, int64_t k,
                         int64_t blocksize, const void* bias, DType dtype, void* y,
                         cudaStream_t stream);

// One row of x through the warp-per-row kernel.
cudaError_t GemvOneRow(const void* x, const uint8_t* packed, const float* absmax, const float* code,
                       int64_t n_rows, int64_t k, int64_t blocksize, const void* bias, DType dtype,
                       void* y, cudaStream_t stream);

// Int8Matmul's two kernels (int8.cu): the GEMV it runs for up to 8 rows of
// a where K is whole 16-byte chunks and both operands 16-byte aligned
// (Int8GemvApplies; cudaErrorInvalidValue elsewhere), and the tiled one it
// runs otherwise (any shape). Both exact: the same c to the bit.
bool Int8GemvApplies(int64_t m, int64_t k, const void* a, const void* b);
cudaError_t Int8Gemv(const int8_t* a, const int8_t* b, int64_t m, int64_t n, int64_t k, int32_t* c,
                     cudaStream_t stream);
cudaError_t Int8MatmulTiled(const int8_t* a, const int8_t* b, int64_t m, int64_t n, int64_t k,
                            int32_t* c, cudaStream_t stream);

}  // namespace accel::quant::cuda::internal

#endif  // ACCEL_QUANT_CUDA_INTERNAL_GEMV_H_
