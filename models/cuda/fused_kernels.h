// models/cuda/fused_kernels.h: the launchers of models/cuda/fused_ops.h's
// and decode_gemv.h's kernels (raw pointers and a stream; built with nvcc alone, as
// attention_kernels.h). Each checks its parameters (cudaErrorInvalidValue
// when they fail), enqueues one kernel on `stream` and returns the launch's
// status.
#ifndef ACCEL_MODELS_CUDA_FUSED_KERNELS_H_
#define ACCEL_MODELS_CUDA_FUSED_KERNELS_H_

#include <cuda_runtime_api.h>

#include "models/cuda/decode_gemv.h"
#include "models/cuda/fused_ops.h"

namespace accel::models::cuda {

cudaError_t RmsNorm(const RmsNormParams& params, KvDType dtype, cudaStream_t stream);
cudaError_t Rotary(const RotaryParams& params, KvDType dtype, cudaStream_t stream);
cudaError_t RotaryStore(const RotaryStoreParams& params, KvDType dtype, cudaStream_t stream);
cudaError_t SiluMul(const SiluMulParams& params, KvDType dtype, cudaStream_t stream);
// decode_gemv.h: a decode step's linear layer, with or without its norm.
cudaError_t DecodeGemv(const DecodeGemvParams& params, KvDType dtype, cudaStream_t stream);

}  // namespace accel::models::cuda

#endif  // ACCEL_MODELS_CUDA_FUSED_KERNELS_H_
