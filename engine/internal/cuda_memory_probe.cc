// CudaMemoryProbe (engine/gpu_memory.h): the driver's total and free memory
// and libtorch's caching-allocator statistics of one CUDA device. Built with
// ACCEL_WITH_ENGINE_CUDA (engine/CMakeLists.txt: a CUDA libtorch); elsewhere
// the probe is Unimplemented and the engine keeps --kv_cache_memory's sizing.
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "engine/gpu_memory.h"

#ifdef ACCEL_WITH_ENGINE_CUDA
#include <cuda_runtime_api.h>

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace accel::engine {

#ifdef ACCEL_WITH_ENGINE_CUDA
namespace {

class CudaProbe final : public DeviceMemoryProbe {
 public:
  explicit CudaProbe(int device) : device_(device) {}

  absl::StatusOr<int64_t> TotalBytes() override {
    size_t free = 0, total = 0;
    ACCEL_RETURN_IF_ERROR(MemGetInfo(&free, &total));
    return static_cast<int64_t>(total);
  }
  absl::StatusOr<int64_t> UsedBytes() override {
    size_t free = 0, total = 0;
    ACCEL_RETURN_IF_ERROR(MemGetInfo(&free, &total));
    return static_cast<int64_t>(total - free);
  }
  // allocated_bytes[0] is the aggregate over the small and large pools
  // (StatType::AGGREGATE, 0 in libtorch 1.13 and 2.x, whose namespaces for
  // the enum differ).
  int64_t AllocatedBytes() override {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(Index()).allocated_bytes[0].current;
  }
  int64_t PeakAllocatedBytes() override {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(Index()).allocated_bytes[0].peak;
  }
  void ResetPeak() override { c10::cuda::CUDACachingAllocator::resetPeakStats(Index()); }

 private:
  c10::DeviceIndex Index() const { return static_cast<c10::DeviceIndex>(device_); }
  absl::Status MemGetInfo(size_t* free, size_t* total) const {
    c10::cuda::CUDAGuard guard(Index());
    const cudaError_t error = cudaMemGetInfo(free, total);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::InternalError(
          absl::StrCat("cudaMemGetInfo on cuda:", device_, ": ", cudaGetErrorString(error)));
    }
    return absl::OkStatus();
  }

  int device_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMemoryProbe>> CudaMemoryProbe(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrCat("cuda:", device, " is not a CUDA device of this machine (", count, " seen)"));
  }
  return std::make_unique<CudaProbe>(device);
}

#else

absl::StatusOr<std::unique_ptr<DeviceMemoryProbe>> CudaMemoryProbe(int device) {
  return absl::UnimplementedError(
      absl::StrCat("cuda:", device,
                   ": this build's libtorch has no CUDA, so the device's memory cannot be read"));
}

#endif

}  // namespace accel::engine
