// quant/cuda_matmul.h: the forward paths of quant/matmul.h on a CUDA device,
// through the kernels of quant/cuda/kernels.h, for the layers Linear4bit and
// Linear8bitLt of accel::nn when x is on cuda:N. Same contracts and numerics
// as the cpu functions, with every tensor on x's CUDA device.
//
// They compile against any libtorch: a build without the kernels (no nvcc,
// or a CPU libtorch, where no tensor can be on a CUDA device and the CUDA
// runtime is not linked) keeps these functions, which then return
// Unimplemented after checking their arguments; CudaKernelsBuilt() says which
// build this is. Kernels run on the device of x (set for the call, then
// restored) and on libtorch's current stream.
#ifndef ACCEL_QUANT_CUDA_MATMUL_H_
#define ACCEL_QUANT_CUDA_MATMUL_H_

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

#include "quant/matmul.h"

namespace accel::quant {

// Whether this build calls the CUDA kernels (quant/cuda/, target
// accel_quant_cuda, linked where libtorch is a CUDA build). Says nothing
// about devices being present.
bool CudaKernelsBuilt();

// Linear4bitForward on a CUDA device: x [..., in] (float32, bfloat16 or
// float16) and the weight's tensors (packed, absmax, code and, with double
// quant, nested_absmax and nested_code) on one CUDA device; bias undefined
// or [out] there too. One row (decode), and up to 8 where the tensor-core
// kernel takes the shapes (quant/cuda/kernels.h: Gemv4bitRowsFused), run the
// fused 4-bit GEMV, which reads the packed weight once (with double quant
// the absmax is expanded to float32 first); more rows dequantize the weight
// to dense compute_dtype a slab of rows at a time (a quarter of the device's
// L2 cache: internal::DequantSlabRows) and multiply each slab by cuBLAS
// while it is still in the cache, bias added in the product (bnb
// dequantizes the whole weight, then calls at::linear: the same products,
// with the dense weight written to device memory and read back). y in x's
// dtype, [..., out].
// InvalidArgument naming the argument for shapes, dtypes or devices that do
// not fit; Internal naming the kernel for a CUDA error.
absl::StatusOr<at::Tensor> Linear4bitForwardCuda(const at::Tensor& x, const Weight4bit& weight,
                                                 const at::Tensor& bias,
                                                 at::ScalarType compute_dtype);

// Int8LinearForward on a CUDA device (LLM.int8): x cast to float16 and
// quantized per row, the int8 product in int32, rescaled in float32 with
// bias (float32) added; with threshold > 0, the outlier columns' product in
// x's dtype (weight dequantized as CB * SCB * (1/127), rounded to x's
// dtype, summed in float32) is added before the one rounding to x's dtype.
// `cb` int8 [out, in], `scb` float32 [out], all on x's device.
absl::StatusOr<at::Tensor> Int8LinearForwardCuda(const at::Tensor& x, const at::Tensor& cb,
                                                 const at::Tensor& scb, const at::Tensor& bias,
                                                 double threshold);

}  // namespace accel::quant

#endif  // ACCEL_QUANT_CUDA_MATMUL_H_
