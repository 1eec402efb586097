#include "quant/cuda_matmul.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#include "core/status.h"
#include "quant/internal/arguments.h"
#include "quant/internal/slabs.h"

// ACCEL_WITH_QUANT_CUDA: accel_quant_cuda is built and linked, which
// quant/CMakeLists.txt does only where libtorch is a CUDA build, so its
// current stream can be asked for.
#ifdef ACCEL_WITH_QUANT_CUDA
#include <cuda_runtime_api.h>

#include <c10/cuda/CUDAStream.h>

#include "quant/cuda/kernels.h"
#endif

namespace accel::quant {
namespace {

// x itself: a dense tensor on some CUDA device.
absl::Status CheckCudaInput(const at::Tensor& x) {
  if (!x.defined()) return absl::InvalidArgumentError("x is undefined");
  if (!x.is_cuda() || x.layout() != at::kStrided) {
    return absl::InvalidArgumentError(
        absl::StrCat("x must be a dense tensor on a CUDA device, got one on ", x.device().str()));
  }
  return absl::OkStatus();
}

#ifdef ACCEL_WITH_QUANT_CUDA

// Up to this many rows (a decode step's batch) run the fused GEMV where it
// reads the weights once for all of them (cuda::Gemv4bitRowsFused: the
// tensor-core kernel, its tiled form above 8 rows).
constexpr int64_t kFusedRows = 32;

// Up to this many rows run it in passes of kFusedRows, each reading the
// packed weight once (0.56 bytes a weight a pass); more dequantize a slab at
// a time and call libtorch's GEMM on each, which moves about 4.5 bytes a
// weight whatever the rows (on the H200, 2026-11-30, NF4 steps of 32 and
// 128 decodes took 4.0x and 3.3x bfloat16's through the slabs). Four passes
// move about half the slabs' bytes; where the crossing lies is for a device
// run to measure (scripts/gpu_check.sh's NF4 rows).
constexpr int64_t kFusedPassRows = 128;

// Up to this many rows (a step of decodes, or decodes and a short prompt)
// dequantize a slab of the weight at a time; more (a long prompt's chunk)
// the whole weight, then one GEMM: on the H200 (2026-11-30) slabs made a
// 2048-token prompt's first token 101.7 ms against 66.9 with the whole
// weight, while at 32 rows they took a step from 32.9 ms to 25.3. Where
// between the two the crossing lies was not measured.
constexpr int64_t kSlabRows = 256;

// bnb's int8_vectorwise_dequant multiplies by this float32 constant (1/127),
// as Int8LinearForward does for the outlier columns.
constexpr float kInv127 = static_cast<float>(7.874015718698502e-3);

std::vector<int64_t> OutputShape(const at::Tensor& x, int64_t out) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out;
  return shape;
}

cuda::DType KernelDType(at::ScalarType type) {
  switch (type) {
    case at::kBFloat16:
      return cuda::DType::kBFloat16;
    case at::kHalf:
      return cuda::DType::kFloat16;
    default:
      return cuda::DType::kFloat32;
  }
}

// A CUDA error as a Status naming what returned it.
absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("quant/cuda ", what, ": ", cudaGetErrorName(error), " (",
                                          cudaGetErrorString(error), ")"));
}

// Makes `device` the current CUDA device for the scope, then restores the
// previous one (the kernels launch on the current device).
class DeviceScope {
 public:
  DeviceScope() = default;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (restore_) (void)cudaSetDevice(previous_);
  }

  absl::Status Enter(int device) {
    ACCEL_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&previous_), "cudaGetDevice"));
    if (previous_ == device) return absl::OkStatus();
    ACCEL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
    restore_ = true;
    return absl::OkStatus();
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

// The dense slab a product of many rows dequantizes at a time: a quarter of
// the current device's L2 cache (12.5 MiB on an H100 or H200), so the slab,
// x and the slab's output stay there between the two kernels.
int64_t SlabBytes() {
  int device = 0;
  int l2 = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess || l2 <= 0) {
    (void)cudaGetLastError();  // not sticky; a smaller slab is only slower
    return int64_t{4} << 20;
  }
  return static_cast<int64_t>(l2) / 4;
}

// libtorch's current stream on `device`, so our kernels order with its ops.
cudaStream_t CurrentStream(const at::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

#else

absl::Status NotBuilt() {
  return absl::UnimplementedError(
      "the quant CUDA kernels are not in this build (quant/cuda/ needs nvcc "
      "and a CUDA libtorch: ACCEL_WITH_CUDA)");
}

#endif  // ACCEL_WITH_QUANT_CUDA

}  // namespace

bool CudaKernelsBuilt() {
#ifdef ACCEL_WITH_QUANT_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<at::Tensor> Linear4bitForwardCuda(const at::Tensor& x, const Weight4bit& weight,
                                                 const at::Tensor& bias,
                                                 at::ScalarType compute_dtype) {
  ACCEL_RETURN_IF_ERROR(CheckCudaInput(x));
  const at::Device device = x.device();
  ACCEL_RETURN_IF_ERROR(internal::CheckWeight4bit(weight, device));
  ACCEL_RETURN_IF_ERROR(internal::CheckComputeDType(compute_dtype, "compute_dtype"));
  const int64_t in = weight.in_features, out = weight.out_features;
  ACCEL_RETURN_IF_ERROR(internal::CheckInputShape(x, in));
  ACCEL_RETURN_IF_ERROR(internal::CheckBias(bias, out, device));
#ifndef ACCEL_WITH_QUANT_CUDA
  return NotBuilt();
#else
  DeviceScope scope;
  ACCEL_RETURN_IF_ERROR(scope.Enter(device.index()));
  at::Tensor y;
  absl::Status kernels;  // the first CUDA error, if any
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    const int64_t rows = x.numel() / in;
    const std::vector<int64_t> shape = OutputShape(x, out);
    if (rows == 0) {
      y = at::empty(shape, x.options());
      return;
    }
    cudaStream_t stream = CurrentStream(device);
    const cuda::DType compute = KernelDType(compute_dtype);
    const int64_t blocks = weight.absmax.numel();
    const at::TensorOptions options = x.options();
    // Double quant: the block absmax in float32 first (bnb's
    // dequantize_blockwise, then + offset), for the 4-bit kernels to read.
    at::Tensor absmax = weight.absmax;
    if (absmax.scalar_type() == at::kByte) {
      absmax = at::empty({blocks}, options.dtype(at::kFloat));
      kernels =
          CudaStatus(cuda::DequantizeAbsmaxDq(
                         weight.absmax.data_ptr<uint8_t>(), weight.nested_absmax.data_ptr<float>(),
                         weight.nested_code.data_ptr<float>(), weight.nested_offset, blocks,
                         absmax.data_ptr<float>(), stream),
                     "DequantizeAbsmaxDq");
      if (!kernels.ok()) return;
    }
    at::Tensor b;
    if (bias.defined()) b = bias.to(compute_dtype).contiguous();
    const at::Tensor xc = rows <= kFusedPassRows
                              ? x.reshape({rows, in}).to(compute_dtype).contiguous()
                              : at::Tensor();
    const int64_t pass = std::min(rows, kFusedRows);
    if (rows == 1 || (rows <= kFusedPassRows &&
                      cuda::Gemv4bitRowsFused(pass, in, weight.blocksize, compute, xc.data_ptr(),
                                              weight.packed.data_ptr<uint8_t>()))) {
      // Decode: the fused GEMV reads the packed weight once for all rows of
      // a pass; x and bias in the compute dtype, sums in float32, one
      // rounding to compute_dtype. A pass's x starts a whole number of rows
      // in: K * 2 bytes, a multiple of 16 where the tensor cores take it.
      // Passes of more than 8 rows through the wide form (a CTA over 128
      // rows of W reads x once for them; K split over CTAs where W has few
      // rows, their sums in a float32 workspace).
      const at::Tensor yc = at::empty({rows, out}, options.dtype(compute_dtype));
      const int64_t size = cuda::DTypeSize(compute);
      const bool wide =
          pass > 8 && cuda::Gemm4bitRowsWideTakes(pass, in, weight.blocksize, compute,
                                                  xc.data_ptr(), weight.packed.data_ptr<uint8_t>());
      const int64_t workspace_bytes = wide ? cuda::Gemm4bitRowsWideWorkspace(pass, out, in) : 0;
      const at::Tensor workspace = workspace_bytes > 0
                                       ? at::empty({workspace_bytes / 4}, options.dtype(at::kFloat))
                                       : at::Tensor();
      for (int64_t first = 0; first < rows; first += pass) {
        const int64_t m = std::min(pass, rows - first);
        const void* x_pass = static_cast<const uint8_t*>(xc.data_ptr()) + first * in * size;
        void* y_pass = static_cast<uint8_t*>(yc.data_ptr()) + first * out * size;
        const void* bias_ptr = b.defined() ? b.data_ptr() : nullptr;
        if (wide && m > 8) {
          kernels = CudaStatus(
              cuda::Gemm4bitRowsWide(x_pass, m, weight.packed.data_ptr<uint8_t>(),
                                     absmax.data_ptr<float>(), weight.code.data_ptr<float>(), out,
                                     in, weight.blocksize, bias_ptr, compute, y_pass,
                                     workspace.defined() ? workspace.data_ptr<float>() : nullptr,
                                     workspace_bytes, stream),
              "Gemm4bitRowsWide");
        } else {
          kernels = CudaStatus(
              cuda::Gemv4bitRows(x_pass, m, weight.packed.data_ptr<uint8_t>(),
                                 absmax.data_ptr<float>(), weight.code.data_ptr<float>(), out, in,
                                 weight.blocksize, bias_ptr, compute, y_pass, stream),
              "Gemv4bitRows");
        }
        if (!kernels.ok()) return;
      }
      y = yc.to(x.scalar_type()).view(shape);
      return;
    }
    // More rows: the dense weight a slab of rows at a time (up to kSlabRows
    // rows of x; past them the whole weight as one slab), each slab's
    // product by libtorch's GEMM while the slab is still in the L2 cache, so
    // the weight crosses device memory once, packed (0.56 bytes a weight).
    // Dequantizing the whole weight first (bnb's way) wrote it out and read
    // it back, 4.5 bytes a weight against bfloat16's own 2: 1096 against
    // 1864 tok/s at batch 32 on the H200 (docs/BENCHMARKS.md).
    const int64_t slab = rows > kSlabRows
                             ? out
                             : internal::DequantSlabRows(out, in, weight.blocksize,
                                                         cuda::DTypeSize(compute), SlabBytes());
    const at::Tensor xs = x.reshape({rows, in}).to(compute_dtype);
    const at::Tensor yc = at::empty({rows, out}, options.dtype(compute_dtype));
    const at::Tensor w = at::empty({slab, in}, options.dtype(compute_dtype));
    for (int64_t first = 0; first < out; first += slab) {
      const int64_t n_rows = std::min(slab, out - first);
      const int64_t start = first * in;  // a whole block and 32 values in (DequantSlabRows)
      kernels = CudaStatus(cuda::Dequantize4bit(weight.packed.data_ptr<uint8_t>() + start / 2,
                                                absmax.data_ptr<float>() + start / weight.blocksize,
                                                weight.code.data_ptr<float>(), n_rows * in,
                                                weight.blocksize, compute, w.data_ptr(), stream),
                           "Dequantize4bit");
      if (!kernels.ok()) return;
      // The slab's columns of y [rows, out] (row stride out): cuBLAS writes
      // them in place; bias added in the product's float32, one rounding.
      at::Tensor part = yc.narrow(1, first, n_rows);
      const at::Tensor ws = w.narrow(0, 0, n_rows).t();
      if (b.defined()) {
        at::addmm_out(part, b.narrow(0, first, n_rows), xs, ws);
      } else {
        at::mm_out(part, xs, ws);
      }
    }
    y = yc.to(x.scalar_type()).view(shape);
  }));
  ACCEL_RETURN_IF_ERROR(kernels);
  return y;
#endif
}

absl::StatusOr<Experts4bitCuda> MakeExperts4bitCuda(const std::vector<Weight4bit>& experts,
                                                    at::ScalarType compute_dtype) {
  if (experts.empty()) return absl::InvalidArgumentError("no experts");
  const Weight4bit& first = experts.front();
  if (!first.packed.defined() || !first.packed.is_cuda()) {
    return absl::FailedPreconditionError("expert 0's weight is not on a CUDA device");
  }
  const at::Device device = first.packed.device();
  ACCEL_RETURN_IF_ERROR(internal::CheckComputeDType(compute_dtype, "compute_dtype"));
  for (size_t e = 0; e < experts.size(); ++e) {
    const Weight4bit& w = experts[e];
    absl::Status valid = internal::CheckWeight4bit(w, device);
    if (!valid.ok()) {
      return absl::Status(valid.code(), absl::StrCat("expert ", e, ": ", valid.message()));
    }
    if (w.absmax.scalar_type() != at::kFloat) {
      return absl::FailedPreconditionError(
          absl::StrCat("expert ", e, " has double quant (uint8 absmax)"));
    }
    if (w.out_features != first.out_features || w.in_features != first.in_features ||
        w.blocksize != first.blocksize) {
      return absl::FailedPreconditionError(
          absl::StrCat("expert ", e, " is [", w.out_features, ", ", w.in_features,
                       "] in blocks of ", w.blocksize, ", expert 0 [", first.out_features, ", ",
                       first.in_features, "] in blocks of ", first.blocksize));
    }
  }
#ifndef ACCEL_WITH_QUANT_CUDA
  return NotBuilt();
#else
  const cuda::DType compute = KernelDType(compute_dtype);
  Experts4bitCuda out;
  out.experts = static_cast<int64_t>(experts.size());
  out.out_features = first.out_features;
  out.in_features = first.in_features;
  out.blocksize = first.blocksize;
  out.compute_dtype = compute_dtype;
  std::vector<int64_t> pointers(3 * experts.size());
  for (size_t e = 0; e < experts.size(); ++e) {
    const Weight4bit& w = experts[e];
    // x's rows are checked at each call; here each weight's alignment (a
    // 16-byte aligned address stands in for x's).
    alignas(16) static const uint8_t kAligned[16] = {};
    if (!cuda::Gemv4bitExpertsTakes(first.in_features, first.blocksize, compute, kAligned,
                                    w.packed.data_ptr())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the experts kernel does not take expert ", e, " ([", w.out_features, ", ", w.in_features,
          "], blocks of ", w.blocksize, ", ", c10::toString(compute_dtype), ")"));
    }
    for (const at::Tensor* t : {&w.packed, &w.absmax, &w.code}) out.held.push_back(t->storage());
    out.packed.push_back(w.packed.data_ptr());
    pointers[e] = reinterpret_cast<int64_t>(w.packed.data_ptr());
    pointers[experts.size() + e] = reinterpret_cast<int64_t>(w.absmax.data_ptr());
    pointers[2 * experts.size() + e] = reinterpret_cast<int64_t>(w.code.data_ptr());
  }
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    out.pointers = at::empty({3, out.experts}, at::TensorOptions().dtype(at::kLong));
    std::copy(pointers.begin(), pointers.end(), out.pointers.data_ptr<int64_t>());
    out.pointers = out.pointers.to(device);
  }));
  return out;
#endif
}

absl::StatusOr<at::Tensor> Linear4bitExpertsCuda(const at::Tensor& x, int64_t slots_per_x,
                                                 const at::Tensor& expert_ids,
                                                 const Experts4bitCuda& experts) {
  ACCEL_RETURN_IF_ERROR(CheckCudaInput(x));
  const at::Device device = x.device();
  if (!experts.pointers.defined() || experts.pointers.device() != device) {
    return absl::InvalidArgumentError("experts: not made for x's device (MakeExperts4bitCuda)");
  }
  ACCEL_RETURN_IF_ERROR(internal::CheckInputShape(x, experts.in_features));
  ACCEL_RETURN_IF_ERROR(internal::CheckOnDevice(expert_ids, "expert_ids", device));
  ACCEL_RETURN_IF_ERROR(internal::CheckDType(expert_ids, "expert_ids", at::kLong));
  const int64_t rows = x.numel() / experts.in_features;
  const int64_t slots = expert_ids.numel();
  if (slots_per_x < 1 || (slots + slots_per_x - 1) / slots_per_x > rows) {
    return absl::InvalidArgumentError(absl::StrCat("expert_ids: ", slots, " slots at ", slots_per_x,
                                                   " a row of x need more than x's ", rows,
                                                   " rows"));
  }
#ifndef ACCEL_WITH_QUANT_CUDA
  return NotBuilt();
#else
  DeviceScope scope;
  ACCEL_RETURN_IF_ERROR(scope.Enter(device.index()));
  at::Tensor y;
  absl::Status kernels;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    const cuda::DType compute = KernelDType(experts.compute_dtype);
    // As Linear4bitForwardCuda: x in the compute dtype, y in it, then x's.
    at::Tensor xc = x.reshape({rows, experts.in_features}).to(experts.compute_dtype).contiguous();
    if (reinterpret_cast<uintptr_t>(xc.data_ptr()) % 16 != 0) xc = xc.clone();
    const at::Tensor ids = expert_ids.reshape({slots}).contiguous();
    const at::Tensor yc =
        at::empty({slots, experts.out_features}, x.options().dtype(experts.compute_dtype));
    const auto* table = reinterpret_cast<const void* const*>(experts.pointers.data_ptr<int64_t>());
    kernels = CudaStatus(
        cuda::Gemv4bitExperts(xc.data_ptr(), slots_per_x, ids.data_ptr<int64_t>(), slots,
                              reinterpret_cast<const uint8_t* const*>(table),
                              reinterpret_cast<const float* const*>(table + experts.experts),
                              reinterpret_cast<const float* const*>(table + 2 * experts.experts),
                              experts.experts, experts.out_features, experts.in_features,
                              experts.blocksize, compute, yc.data_ptr(), CurrentStream(device)),
        "Gemv4bitExperts");
    if (!kernels.ok()) return;
    y = yc.to(x.scalar_type());
  }));
  ACCEL_RETURN_IF_ERROR(kernels);
  return y;
#endif
}

absl::StatusOr<at::Tensor> Int8LinearForwardCuda(const at::Tensor& x, const at::Tensor& cb,
                                                 const at::Tensor& scb, const at::Tensor& bias,
                                                 double threshold) {
  ACCEL_RETURN_IF_ERROR(CheckCudaInput(x));
  const at::Device device = x.device();
  ACCEL_RETURN_IF_ERROR(internal::CheckInt8Weight(cb, scb, device));
  const int64_t out = cb.size(0), in = cb.size(1);
  ACCEL_RETURN_IF_ERROR(internal::CheckInputShape(x, in));
  ACCEL_RETURN_IF_ERROR(internal::CheckBias(bias, out, device));
  ACCEL_RETURN_IF_ERROR(internal::CheckThreshold(threshold));
#ifndef ACCEL_WITH_QUANT_CUDA
  return NotBuilt();
#else
  DeviceScope scope;
  ACCEL_RETURN_IF_ERROR(scope.Enter(device.index()));
  at::Tensor y;
  absl::Status kernels;  // the first CUDA error, if any
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    const int64_t rows = x.numel() / in;
    const std::vector<int64_t> shape = OutputShape(x, out);
    if (rows == 0 || out == 0) {
      y = at::empty(shape, x.options());
      return;
    }
    cudaStream_t stream = CurrentStream(device);
    const at::TensorOptions options = x.options();
    const float limit = static_cast<float>(threshold);
    const bool decompose = limit > 0.0f;
    const at::Tensor x2 = x.reshape({rows, in});

    // A: x rounded to float16 (bnb's MatMul8bitLt casts it), quantized per
    // row; outlier columns (any |A| >= threshold) zeroed and marked.
    const at::Tensor a = x2.to(at::kHalf).contiguous();
    const at::Tensor ca = at::empty({rows, in}, options.dtype(at::kChar));
    const at::Tensor sca = at::empty({rows}, options.dtype(at::kFloat));
    at::Tensor outlier_cols;
    if (decompose) outlier_cols = at::empty({in}, options.dtype(at::kByte));
    kernels = CudaStatus(
        cuda::Int8RowQuantize(static_cast<const uint16_t*>(a.data_ptr()), rows, in, limit,
                              ca.data_ptr<int8_t>(), sca.data_ptr<float>(),
                              decompose ? outlier_cols.data_ptr<uint8_t>() : nullptr, stream),
        "Int8RowQuantize");
    if (!kernels.ok()) return;

    // The exact int32 product, then float32(C) * (SCA * SCB) * (1/16129)
    // + bias (float32, as the cpu path reads it).
    const at::Tensor cb_c = cb.contiguous();
    const at::Tensor scb_c = scb.contiguous();
    const at::Tensor c = at::empty({rows, out}, options.dtype(at::kInt));
    kernels = CudaStatus(cuda::Int8Matmul(ca.data_ptr<int8_t>(), cb_c.data_ptr<int8_t>(), rows, out,
                                          in, c.data_ptr<int32_t>(), stream),
                         "Int8Matmul");
    if (!kernels.ok()) return;
    at::Tensor b32;
    if (bias.defined()) b32 = bias.to(at::kFloat).contiguous();
    at::Tensor y32 = at::empty({rows, out}, options.dtype(at::kFloat));
    kernels = CudaStatus(
        cuda::Int8Dequant(c.data_ptr<int32_t>(), sca.data_ptr<float>(), scb_c.data_ptr<float>(),
                          b32.defined() ? b32.data_ptr() : nullptr, rows, out,
                          cuda::DType::kFloat32, y32.data_ptr(), stream),
        "Int8Dequant");
    if (!kernels.ok()) return;

    if (decompose) {
      // The outlier part, bnb's int8_mixed_scaled_mm: x's own values in the
      // outlier columns times the weight's columns dequantized to x's dtype,
      // round(CB * SCB * (1/127)), summed in float32 and added before the
      // one rounding to x's dtype. Finding the columns reads the mask back
      // (a synchronization, as bnb's torch.nonzero does).
      const at::Tensor cols = outlier_cols.nonzero().view({-1});
      if (cols.numel() > 0) {
        const at::Tensor sub_a = x2.index_select(1, cols).to(at::kFloat);
        const at::Tensor sub_b = cb_c.index_select(1, cols)
                                     .to(at::kFloat)
                                     .mul(scb_c.unsqueeze(1))
                                     .mul(kInv127)
                                     .to(x.scalar_type())
                                     .to(at::kFloat);
        y32.add_(sub_a.matmul(sub_b.t()));
      }
    }
    y = y32.to(x.scalar_type()).view(shape);
  }));
  ACCEL_RETURN_IF_ERROR(kernels);
  return y;
#endif
}

}  // namespace accel::quant
