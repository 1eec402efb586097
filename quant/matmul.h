// quant/matmul.h: y = x W^T + b with a quantized W, on the cpu, with
// bitsandbytes' numerics: the layers Linear4bit and Linear8bitLt of
// accel::nn call these. Kernels are vectorized (AVX2 when the cpu has it, a
// scalar path otherwise) and split over libtorch's intra-op threads; a few
// rows (decode) run a fused dequantize-GEMV that reads the packed weight once
// and never materializes it.
#ifndef ACCEL_QUANT_MATMUL_H_
#define ACCEL_QUANT_MATMUL_H_

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace accel::quant {

// A 4-bit weight ready for compute: what quant::Quantized4bit holds. With
// double quant, absmax holds the uint8 codes and the nested fields are set:
// the kernels dequantize each block's absmax as they reach it (bnb's
// dequantize_blockwise then + offset, in float32), so nothing is expanded.
struct Weight4bit {
  at::Tensor packed;  // uint8, (n+1)/2 bytes (any shape; contiguous), high nibble first
  at::Tensor absmax;  // [ceil(n / blocksize)]: float32, or uint8 codes (double quant)
  at::Tensor code;    // float32 [16]: the code table (the checkpoint's quant_map)
  int64_t blocksize = 64;
  int64_t out_features = 0;
  int64_t in_features = 0;
  // Double quant only (absmax uint8): float32 [ceil(blocks / 256)], float32
  // [256] (the nested quant_map), and the offset added after the multiply.
  at::Tensor nested_absmax;
  at::Tensor nested_code;
  float nested_offset = 0.0f;
};

// bnb's Linear4bit.forward: x [..., in] (float32, bfloat16 or float16, cpu)
// is cast to `compute_dtype`; W is dequantized to compute_dtype (code *
// absmax in float32, then rounded) and multiplied, accumulating in float32;
// bias (undefined, or [out]) is added; y is cast back to x's dtype,
// [..., out]. InvalidArgument naming the argument for shapes, dtypes or
// devices that do not fit.
absl::StatusOr<at::Tensor> Linear4bitForward(const at::Tensor& x, const Weight4bit& weight,
                                             const at::Tensor& bias, at::ScalarType compute_dtype);

// The weight as a dense [out, in] tensor of `dtype`, as Linear4bitForward
// sees it (the vectorized dequantize).
absl::StatusOr<at::Tensor> Dequantize4bitDense(const Weight4bit& weight, at::ScalarType dtype);

// bnb's MatMul8bitLt forward (LLM.int8): x [..., in] (float32, bfloat16 or
// float16) is cast to float16 and quantized per row (absmax over the values
// below `threshold`); with threshold > 0, the input columns holding any
// |x| >= threshold are taken out of the int8 product and multiplied in x's
// dtype against the dequantized int8 weight; the rest is int8 x int8 ->
// int32 (exact), rescaled by SCA * SCB / 127^2 in float32. bias added; y in
// x's dtype, [..., out]. `cb` int8 [out, in], `scb` float32 [out].
absl::StatusOr<at::Tensor> Int8LinearForward(const at::Tensor& x, const at::Tensor& cb,
                                             const at::Tensor& scb, const at::Tensor& bias,
                                             double threshold);

// The exact int32 product a [M, K] int8 x b [N, K] int8 -> [M, N] (b
// transposed): the kernel Int8LinearForward uses, for tests and benchmarks.
absl::StatusOr<at::Tensor> Int8MatmulInt32(const at::Tensor& a, const at::Tensor& b);

}  // namespace accel::quant

#endif  // ACCEL_QUANT_MATMUL_H_
