// PagedDecodeAttention (attention_kernels.h): the decode kernel runs
// internal::DecodeSplit (models/cuda/internal/paged_decode.h) with a warp
// shuffle for the lanes' exchange, one CTA per (kv head, sequence, split);
// the reduce kernel runs internal::ReduceSplits, one CTA per (head,
// sequence). The same code runs on the host in the emulation test.
#include <cuda_runtime.h>

#include "models/cuda/attention_kernels.h"
#include "models/cuda/internal/device_exec.cuh"
#include "models/cuda/internal/paged_decode.h"

namespace accel::models::cuda {
namespace internal {
namespace {

template <typename Tag>
__global__ void __launch_bounds__(kDecodeThreads) PagedDecodeKernel(const PagedDecodeParams p) {
  extern __shared__ float shared[];
  DeviceExec exec;
  DecodeSplit<Tag>(p, static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(blockIdx.y),
                   static_cast<int32_t>(blockIdx.z), shared, exec);
}

constexpr int32_t kReduceThreads = 128;

template <typename Tag>
__global__ void __launch_bounds__(kReduceThreads) PagedReduceKernel(const PagedDecodeParams p) {
  ReduceSplits<Tag>(p, static_cast<int32_t>(blockIdx.y), static_cast<int32_t>(blockIdx.x),
                    static_cast<int32_t>(threadIdx.x), kReduceThreads);
}

template <typename Tag>
cudaError_t Launch(const PagedDecodeParams& p, KvDType dtype, cudaStream_t stream) {
  const size_t shared = static_cast<size_t>(PagedDecodeSharedBytes(p, dtype));
  const dim3 grid(static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.seqs),
                  static_cast<unsigned>(p.max_splits));
  PagedDecodeKernel<Tag><<<grid, kDecodeThreads, shared, stream>>>(p);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || p.max_splits == 1) return status;
  const dim3 reduce_grid(static_cast<unsigned>(p.heads), static_cast<unsigned>(p.seqs));
  PagedReduceKernel<Tag><<<reduce_grid, kReduceThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace
}  // namespace internal

cudaError_t PagedDecodeAttention(const PagedDecodeParams& params, KvDType dtype,
                                 cudaStream_t stream) {
  if (CheckPagedDecodeParams(params, dtype) != nullptr) return cudaErrorInvalidValue;
  return internal::WithStorage(dtype, cudaErrorInvalidValue, [&](auto tag) {
    return internal::Launch<decltype(tag)>(params, dtype, stream);
  });
}

}  // namespace accel::models::cuda
