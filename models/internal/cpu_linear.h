// The torch side of the decode-path GEMV kernels (models/internal/gemv.h):
// y = x W^T + b for CPU tensors with a few rows, the weights streamed once at
// close to memory bandwidth, columns split over libtorch's intra-op threads.
#ifndef ACCEL_MODELS_INTERNAL_CPU_LINEAR_H_
#define ACCEL_MODELS_INTERNAL_CPU_LINEAR_H_

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace accel::models::internal {

// The most rows (x's elements / in) FastLinear takes: decode steps and small
// batches. Prefill goes to libtorch's GEMM, which is compute-bound there.
inline constexpr int64_t kFastLinearMaxRows = 16;

// at::linear(x, weight, bias) when all of these hold, nullopt otherwise (the
// caller then calls at::linear):
//   - x, weight (and bias) are dense CPU tensors;
//   - weight is contiguous [out, in], float32, bfloat16 or float16, and x and
//     bias have its dtype (bias [out], or undefined);
//   - x is [..., in] (any strides) with 1..kFastLinearMaxRows rows, in > 0, out > 0;
//   - no autograd graph is needed (grad mode off, or nothing requires grad).
// x's rows are converted to float32, products accumulate in float32, and y
// is rounded to x's dtype (nearest even), shaped [..., out].
std::optional<at::Tensor> FastLinear(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias);

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_CPU_LINEAR_H_
