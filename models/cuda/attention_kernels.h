// models/cuda/attention_kernels.h: decode attention over a paged KV cache on
// a CUDA device, as raw-pointer kernels (like quant/cuda/kernels.h: they
// build with nvcc alone and never include libtorch; the at::Tensor wrapper is
// models/internal/paged_attention.h's PagedDecodeAttentionCuda). What the
// kernels compute, their parameters and the split plan are in
// models/cuda/paged_decode_params.h (torch-free and CUDA-free, so the plan is
// tested on any machine).
#ifndef ACCEL_MODELS_CUDA_ATTENTION_KERNELS_H_
#define ACCEL_MODELS_CUDA_ATTENTION_KERNELS_H_

#include <cuda_runtime_api.h>

#include "models/cuda/paged_decode_params.h"

namespace accel::models::cuda {

// Checks the parameters (CheckPagedDecodeParams; cudaErrorInvalidValue when
// they fail), then enqueues the decode kernel (and, when max_splits > 1, the
// reduce kernel) on `stream`; returns the launch status.
cudaError_t PagedDecodeAttention(const PagedDecodeParams& params, KvDType dtype,
                                 cudaStream_t stream);

}  // namespace accel::models::cuda

#endif  // ACCEL_MODELS_CUDA_ATTENTION_KERNELS_H_
