// quant/cuda/internal/common.cuh: what the .cu files of quant/cuda share:
// the element types behind DType, exact conversions, the dtype switch and
// launch sizes. Private to quant/cuda (callers include kernels.h only).
#ifndef ACCEL_QUANT_CUDA_INTERNAL_COMMON_CUH_
#define ACCEL_QUANT_CUDA_INTERNAL_COMMON_CUH_

#include <cstdint>
#include <cuda_runtime.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "quant/cuda/kernels.h"

namespace accel::quant::cuda::internal {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

// float32 -> T, round to nearest even (the rounding of at::Tensor::to).
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

// Calls fn(T{}) with the element type of `dtype`.
template <typename Fn>
cudaError_t DispatchDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(float{});
    case DType::kBFloat16:
      return fn(__nv_bfloat16{});
    case DType::kFloat16:
      return fn(__half{});
  }
  return cudaErrorInvalidValue;
}

inline bool ValidDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16;
}

inline bool AlignedTo(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Blocks for a grid-stride loop over `items` with `threads` per block: enough
// to fill any current GPU many times over, few enough that the launch stays
// cheap for huge tensors.
inline unsigned GridFor(int64_t items, int threads) {
  constexpr int64_t kMaxBlocks = int64_t{1} << 16;
  int64_t blocks = (items + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned>(blocks);
}

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridThreads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

}  // namespace accel::quant::cuda::internal

#endif  // ACCEL_QUANT_CUDA_INTERNAL_COMMON_CUH_
