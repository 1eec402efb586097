// The argument checks of quant/matmul.h and quant/cuda_matmul.h, one set for
// both: the same contracts, with every tensor on `device` (the cpu, or x's
// CUDA device). Each error is InvalidArgument and names the argument.
#ifndef ACCEL_QUANT_INTERNAL_ARGUMENTS_H_
#define ACCEL_QUANT_INTERNAL_ARGUMENTS_H_

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

#include "quant/matmul.h"

namespace accel::quant::internal {

// Defined, strided, on `device` ("a dense cpu tensor" on the cpu, "a dense
// tensor on cuda:N (x's device)" elsewhere).
absl::Status CheckOnDevice(const at::Tensor& t, absl::string_view name, const at::Device& device);
absl::Status CheckDType(const at::Tensor& t, absl::string_view name, at::ScalarType want);

// x [..., in] of a compute dtype (its device checked already).
absl::Status CheckInputShape(const at::Tensor& x, int64_t in);
// bias: undefined, or [out] of a compute dtype on `device`.
absl::Status CheckBias(const at::Tensor& bias, int64_t out, const at::Device& device);
// A 4-bit weight's tensors and sizes, on `device`.
absl::Status CheckWeight4bit(const Weight4bit& w, const at::Device& device);
// A dtype argument (`name`: compute_dtype, dtype) that must be float32,
// bfloat16 or float16.
absl::Status CheckComputeDType(at::ScalarType dtype, absl::string_view name);
// LLM.int8's weight: cb int8 [out, in] with in > 0, scb float32 [out].
absl::Status CheckInt8Weight(const at::Tensor& cb, const at::Tensor& scb, const at::Device& device);
// LLM.int8's outlier threshold: finite, >= 0.
absl::Status CheckThreshold(double threshold);

}  // namespace accel::quant::internal

#endif  // ACCEL_QUANT_INTERNAL_ARGUMENTS_H_
