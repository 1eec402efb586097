// models/cuda/internal/device_exec.cuh: the `Exec` of the device kernels
// (the thread's index, the CTA barrier, a full-warp shuffle), which the
// kernels' shared code (internal/paged_decode.h, internal/fused_ops.h) calls
// where the host emulation (tests/testing/cta_emulator.h) has its own.
#ifndef ACCEL_MODELS_CUDA_INTERNAL_DEVICE_EXEC_CUH_
#define ACCEL_MODELS_CUDA_INTERNAL_DEVICE_EXEC_CUH_

#include <cstdint>
#include <cuda_runtime.h>

namespace accel::models::cuda::internal {

struct DeviceExec {
  __device__ __forceinline__ int32_t tid() const { return static_cast<int32_t>(threadIdx.x); }
  __device__ __forceinline__ void Sync() { __syncthreads(); }
  __device__ __forceinline__ float XorLanes(float v, int32_t mask) {
    return __shfl_xor_sync(0xffffffffu, v, mask);
  }
};

}  // namespace accel::models::cuda::internal

#endif  // ACCEL_MODELS_CUDA_INTERNAL_DEVICE_EXEC_CUH_
