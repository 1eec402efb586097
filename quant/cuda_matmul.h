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

#include <vector>

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

// The 4-bit weights of a mixture's experts (one shape, blocksize and code
// length; float32 absmax, so no double quant), made once for
// Linear4bitExpertsCuda: each expert's packed, absmax and code device
// pointers in one int64 tensor [3, experts] on their CUDA device. It holds
// the experts' storages, so the pointers stay valid while it lives; a
// caller compares its layers' packed weights with `packed` to see that they
// still point where they did (a weight moved by a dispatch hook, even in
// place, does not; the absmax and code move with it).
struct Experts4bitCuda {
  at::Tensor pointers;              // int64 [3, experts], on the device
  std::vector<c10::Storage> held;   // what they point into
  std::vector<const void*> packed;  // each expert's packed weight, in order
  int64_t experts = 0;
  int64_t out_features = 0;
  int64_t in_features = 0;
  int64_t blocksize = 0;
  at::ScalarType compute_dtype = at::kFloat;
};

// FailedPrecondition where the experts kernel (quant/cuda/kernels.h:
// Gemv4bitExperts) does not take these weights with this compute dtype
// (different shapes or blocksizes, double quant, float32 compute, a shape
// or alignment the tensor-core kernel does not take, not one CUDA device),
// Unimplemented in a build without the kernels; InvalidArgument naming the
// expert for an inconsistent weight.
absl::StatusOr<Experts4bitCuda> MakeExperts4bitCuda(const std::vector<Weight4bit>& experts,
                                                    at::ScalarType compute_dtype);

// The routed rows of a decode step without the host reading the routing: x
// [rows, in] (x's dtype) on the experts' device, expert_ids int64 [slots]
// there (a router's top-k, flattened); slot s is x row s / slots_per_x
// times its expert's weight: y [slots, out] in x's dtype, each row what
// Linear4bitForwardCuda gives for that one row and expert, bit for bit
// (the same kernel for one row). An index outside [0, experts) gives a row
// of zeros. InvalidArgument naming the argument for shapes, dtypes or
// devices that do not fit.
absl::StatusOr<at::Tensor> Linear4bitExpertsCuda(const at::Tensor& x, int64_t slots_per_x,
                                                 const at::Tensor& expert_ids,
                                                 const Experts4bitCuda& experts);

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
