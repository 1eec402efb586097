// The launchers of models/cuda/fused_kernels.h: RMSNorm one CTA a row over
// internal::RmsNormRow, the rotary embedding and SiLU-times-up one thread an
// element (a grid-stride loop) over internal::RotaryPair / SiluMulAt. The
// same code runs on the host in tests/models/cuda_fused_ops_test.cc.
#include <cuda_runtime.h>

#include "models/cuda/fused_kernels.h"
#include "models/cuda/internal/device_exec.cuh"
#include "models/cuda/internal/fused_ops.h"

namespace accel::models::cuda {
namespace internal {
namespace {

template <typename Tag>
__global__ void __launch_bounds__(kRmsNormThreads) RmsNormKernel(const RmsNormParams p) {
  __shared__ float shared[kRmsNormThreads / 32];
  DeviceExec exec;
  RmsNormRow<Tag>(p, static_cast<int64_t>(blockIdx.x), kRmsNormThreads, shared, exec);
}

constexpr int32_t kElementThreads = 256;

template <typename Tag>
__global__ void __launch_bounds__(kElementThreads) RotaryKernel(const RotaryParams p, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    RotaryPair<Tag>(p, i);
  }
}

template <typename Tag>
__global__ void __launch_bounds__(kElementThreads)
    RotaryStoreKernel(const RotaryStoreParams p, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    RotaryStoreItem<Tag>(p, i);
  }
}

template <typename Tag>
__global__ void __launch_bounds__(kElementThreads) SiluMulKernel(const SiluMulParams p, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    SiluMulAt<Tag>(p, i);
  }
}

unsigned ElementBlocks(int64_t n) {
  const int64_t blocks = (n + kElementThreads - 1) / kElementThreads;
  return static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
}

template <template <typename> class Launch, typename Params>
cudaError_t ByDType(const Params& p, KvDType dtype, cudaStream_t stream) {
  return WithStorage(dtype, cudaErrorInvalidValue,
                     [&](auto tag) { return Launch<decltype(tag)>::Run(p, stream); });
}

template <typename Tag>
struct LaunchRmsNorm {
  static cudaError_t Run(const RmsNormParams& p, cudaStream_t stream) {
    RmsNormKernel<Tag><<<static_cast<unsigned>(p.rows), kRmsNormThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
};

template <typename Tag>
struct LaunchRotary {
  static cudaError_t Run(const RotaryParams& p, cudaStream_t stream) {
    const int64_t n = static_cast<int64_t>(p.batch) * p.heads * p.tokens * (p.dim / 2);
    RotaryKernel<Tag><<<ElementBlocks(n), kElementThreads, 0, stream>>>(p, n);
    return cudaGetLastError();
  }
};

template <typename Tag>
struct LaunchRotaryStore {
  static cudaError_t Run(const RotaryStoreParams& p, cudaStream_t stream) {
    const int64_t n = RotaryStoreItems(p);
    RotaryStoreKernel<Tag><<<ElementBlocks(n), kElementThreads, 0, stream>>>(p, n);
    return cudaGetLastError();
  }
};

template <typename Tag>
struct LaunchSiluMul {
  static cudaError_t Run(const SiluMulParams& p, cudaStream_t stream) {
    const int64_t n = p.rows * p.dim;
    SiluMulKernel<Tag><<<ElementBlocks(n), kElementThreads, 0, stream>>>(p, n);
    return cudaGetLastError();
  }
};

}  // namespace
}  // namespace internal

cudaError_t RmsNorm(const RmsNormParams& params, KvDType dtype, cudaStream_t stream) {
  if (CheckRmsNormParams(params) != nullptr) return cudaErrorInvalidValue;
  return internal::ByDType<internal::LaunchRmsNorm>(params, dtype, stream);
}

cudaError_t Rotary(const RotaryParams& params, KvDType dtype, cudaStream_t stream) {
  if (CheckRotaryParams(params) != nullptr) return cudaErrorInvalidValue;
  return internal::ByDType<internal::LaunchRotary>(params, dtype, stream);
}

cudaError_t RotaryStore(const RotaryStoreParams& params, KvDType dtype, cudaStream_t stream) {
  if (CheckRotaryStoreParams(params) != nullptr) return cudaErrorInvalidValue;
  return internal::ByDType<internal::LaunchRotaryStore>(params, dtype, stream);
}

cudaError_t SiluMul(const SiluMulParams& params, KvDType dtype, cudaStream_t stream) {
  if (CheckSiluMulParams(params) != nullptr) return cudaErrorInvalidValue;
  return internal::ByDType<internal::LaunchSiluMul>(params, dtype, stream);
}

}  // namespace accel::models::cuda
