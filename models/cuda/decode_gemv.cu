// DecodeGemv (decode_gemv.h): internal::DecodeGemvCta a CTA, x' (the norm
// of x, or SiLU(gate) * up) in dynamic shared memory when there is one. The grid is at most a few
// CTAs an SM (each CTA's warps then take several rows of W), so that the norm's prologue, which
// every CTA repeats, is paid a few times an SM and not once for every eight rows of W.
#include <atomic>
#include <cuda_runtime.h>

#include "models/cuda/fused_kernels.h"
#include "models/cuda/internal/decode_gemv.h"
#include "models/cuda/internal/device_exec.cuh"

namespace accel::models::cuda {
namespace internal {
namespace {

// CTAs an SM the grid allows (two fit by registers; the rest queue).
constexpr int64_t kCtasPerSm = 4;

template <typename Tag, int32_t kRows, DecodeGemvPrologue kPrologue>
__global__ void __launch_bounds__(kDecodeGemvThreads) DecodeGemvKernel(const DecodeGemvParams p) {
  extern __shared__ uint4 staged[];
  __shared__ float reduce[kDecodeGemvWarps];
  DeviceExec exec;
  DecodeGemvCta<Tag, kRows, kPrologue>(
      p, static_cast<int64_t>(blockIdx.x), static_cast<int64_t>(gridDim.x),
      reinterpret_cast<typename Tag::Storage*>(staged), reduce, exec);
}

template <typename Tag, DecodeGemvPrologue kPrologue, typename Launch>
cudaError_t ByRows(int32_t rows, const Launch& launch) {
  if (rows <= 1) return launch(DecodeGemvKernel<Tag, 1, kPrologue>);
  if (rows <= 2) return launch(DecodeGemvKernel<Tag, 2, kPrologue>);
  if (rows <= 4) return launch(DecodeGemvKernel<Tag, 4, kPrologue>);
  return launch(DecodeGemvKernel<Tag, 8, kPrologue>);
}

// The device's SM count, asked once a device.
int64_t SmCount() {
  static std::atomic<int> counts[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  int count = counts[device].load(std::memory_order_relaxed);
  if (count == 0) {
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        count <= 0) {
      return 132;
    }
    counts[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

template <typename Tag>
cudaError_t Launch(const DecodeGemvParams& p, KvDType dtype, cudaStream_t stream) {
  const int64_t groups = (p.n + kDecodeGemvWarps - 1) / kDecodeGemvWarps;
  const int64_t most = SmCount() * kCtasPerSm;
  const unsigned ctas = static_cast<unsigned>(groups < most ? groups : most);
  const DecodeGemvPrologue prologue = PrologueOf(p);
  const size_t shared = prologue != DecodeGemvPrologue::kNone
                            ? static_cast<size_t>(p.rows) * p.k * KvDTypeSize(dtype)
                            : 0;
  auto launch = [&](auto kernel) {
    kernel<<<ctas, kDecodeGemvThreads, shared, stream>>>(p);
    return cudaGetLastError();
  };
  switch (prologue) {
    case DecodeGemvPrologue::kNone:
      return ByRows<Tag, DecodeGemvPrologue::kNone>(p.rows, launch);
    case DecodeGemvPrologue::kNorm:
      return ByRows<Tag, DecodeGemvPrologue::kNorm>(p.rows, launch);
    case DecodeGemvPrologue::kSiluMul:
      return ByRows<Tag, DecodeGemvPrologue::kSiluMul>(p.rows, launch);
  }
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace internal

cudaError_t DecodeGemv(const DecodeGemvParams& params, KvDType dtype, cudaStream_t stream) {
  if (CheckDecodeGemvParams(params, dtype) != nullptr) return cudaErrorInvalidValue;
  switch (dtype) {
    case KvDType::kFloat32:
      return internal::Launch<internal::Float32>(params, dtype, stream);
    case KvDType::kBFloat16:
      return internal::Launch<internal::BFloat16>(params, dtype, stream);
    case KvDType::kFloat16:
      return internal::Launch<internal::Float16>(params, dtype, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace accel::models::cuda
