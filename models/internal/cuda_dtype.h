// models/internal/cuda_dtype.h: the storage dtype of models/cuda's kernels
// for a libtorch dtype (float32, bfloat16, float16; the rest are not theirs).
#ifndef ACCEL_MODELS_INTERNAL_CUDA_DTYPE_H_
#define ACCEL_MODELS_INTERNAL_CUDA_DTYPE_H_

#include <c10/core/ScalarType.h>

#include "models/cuda/paged_decode_params.h"

namespace accel::models::internal {

inline bool KvDTypeOf(at::ScalarType type, cuda::KvDType* out) {
  switch (type) {
    case at::kFloat:
      *out = cuda::KvDType::kFloat32;
      return true;
    case at::kBFloat16:
      *out = cuda::KvDType::kBFloat16;
      return true;
    case at::kHalf:
      *out = cuda::KvDType::kFloat16;
      return true;
    default:
      return false;
  }
}

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_CUDA_DTYPE_H_
