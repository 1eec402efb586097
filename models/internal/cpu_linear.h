// The torch side of the GEMV kernels (models/internal/gemv.h): y = x W^T + b
// for CPU tensors with any number of rows, columns split over libtorch's
// intra-op threads. A decode step streams the weights once at close to memory
// bandwidth; a prefill runs the same kernels over chunks of its rows.
#ifndef ACCEL_MODELS_INTERNAL_CPU_LINEAR_H_
#define ACCEL_MODELS_INTERNAL_CPU_LINEAR_H_

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace accel::models::internal {

// The most rows (x's elements / in) one kernel call takes. Up to this many
// (decode steps, small batches) are one chunk, which reads each weight once.
// More (prefill) are cut into ceil(rows / kFastLinearChunkRows) chunks of
// about equal size; each thread takes its columns in tiles of 512 KiB of
// weights through every chunk, so a tile comes from memory once and from the
// L2 cache for the other chunks, and a chunk of x (256 KiB at in = 4096) stays
// in L2 while the tile's columns are computed.
inline constexpr int64_t kFastLinearChunkRows = 16;

// at::linear(x, weight, bias) when all of these hold, nullopt otherwise (the
// caller then calls at::linear):
//   - x, weight (and bias) are dense CPU tensors;
//   - weight is contiguous [out, in], float32, bfloat16 or float16, and x and
//     bias have its dtype (bias [out], or undefined);
//   - x is [..., in] (any strides) with at least one row, in > 0, out > 0;
//   - in bfloat16, at most kFastLinearChunkRows rows where libtorch has
//     oneDNN's bfloat16 product (faster above that: measured; cpu_linear.cc),
//     any number where it has not (core/cpu_features.h);
//   - no autograd graph is needed (grad mode off, or nothing requires grad).
// x's rows are converted to float32, products accumulate in float32, and y
// is rounded to x's dtype (nearest even), shaped [..., out]. Each element is
// summed in the same order whatever the row count and thread count.
std::optional<at::Tensor> FastLinear(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias);

// x @ weight (+ bias) for GPT-2's Conv1D, weight contiguous [in, out], when
// x, weight (and bias [out]) are dense CPU tensors of one dtype (float32,
// bfloat16 or float16), x is [..., in] with 1 to kFastLinearChunkRows rows,
// and no autograd graph is needed; nullopt otherwise. GemvTransposed's sums
// (float32, in order of the input), y rounded to x's dtype once, [..., out].
// No float32 copy of the weight: what libtorch's product would need for
// bfloat16 without oneDNN's product, and for float16 always.
std::optional<at::Tensor> FastConv1D(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias);

// FastLinear without the bfloat16 row limit: what it would run there, for
// accel-bench-gemv's comparison with oneDNN and for tests.
std::optional<at::Tensor> FastLinearAnyRows(const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& bias);

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_CPU_LINEAR_H_
