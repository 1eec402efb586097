// DecodeGemv (decode_gemv.h): internal::DecodeGemvCta a CTA, x' (the norm
// of x, or SiLU(gate) * up) in dynamic shared memory when there is one. The
// grid is what fits the device at once (DecodeGemvCtas over the kernel's
// occupancy at its shared memory), each warp taking the same number of rows
// of W, so that a prologue, which every CTA repeats, is paid once a resident
// CTA and not once for every eight rows of W.
#include <cuda_runtime.h>
#include <map>
#include <mutex>
#include <utility>

#include "models/cuda/fused_kernels.h"
#include "models/cuda/internal/decode_gemv.h"
#include "models/cuda/internal/device_exec.cuh"

namespace accel::models::cuda {
namespace internal {
namespace {

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

// CTAs of `kernel` with `shared` bytes that the current device holds at
// once (its SMs times the occupancy), asked once a (device, kernel, shared
// size); an error: one an SM of an H200.
int64_t ResidentCtas(const void* kernel, size_t shared) {
  static std::mutex mutex;
  static std::map<std::pair<int, std::pair<const void*, size_t>>, int64_t> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 132;
  const auto key = std::make_pair(device, std::make_pair(kernel, shared));
  std::lock_guard<std::mutex> lock(mutex);
  auto found = known.find(key);
  if (found != known.end()) return found->second;
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kDecodeGemvThreads, shared) !=
          cudaSuccess ||
      sms < 1 || per_sm < 1) {
    (void)cudaGetLastError();  // (not left for the launch's check)
    return 132;
  }
  return known[key] = static_cast<int64_t>(sms) * per_sm;
}

template <typename Tag>
cudaError_t Launch(const DecodeGemvParams& p, KvDType dtype, cudaStream_t stream) {
  const DecodeGemvPrologue prologue = PrologueOf(p);
  const size_t shared = prologue != DecodeGemvPrologue::kNone
                            ? static_cast<size_t>(p.rows) * p.k * KvDTypeSize(dtype)
                            : 0;
  auto launch = [&](auto kernel) {
    const int64_t ctas =
        DecodeGemvCtas(p.n, ResidentCtas(reinterpret_cast<const void*>(kernel), shared));
    if (ctas > 0x7fffffff) return cudaErrorInvalidValue;
    kernel<<<static_cast<unsigned>(ctas), kDecodeGemvThreads, shared, stream>>>(p);
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
  return internal::WithStorage(dtype, cudaErrorInvalidValue, [&](auto tag) {
    return internal::Launch<decltype(tag)>(params, dtype, stream);
  });
}

}  // namespace accel::models::cuda
