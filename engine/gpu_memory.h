// engine/gpu_memory.h: the KV cache of a model that runs on a CUDA device,
// sized as vLLM sizes it from --gpu_memory_utilization: the fraction of the
// device's total memory this process may use, less what the device holds
// once the weights are loaded, less the peak a profiling forward of the
// largest step adds; the rest is KV blocks.
//
// The device is read through DeviceMemoryProbe (the CUDA one is
// CudaMemoryProbe, engine/internal/cuda_memory_probe.cc, built where
// libtorch is a CUDA build), so the arithmetic below is a pure function and
// tested with made-up figures on a machine without a GPU.
//
//   ACCEL_RETURN_IF_ERROR(CheckGpuMemoryUtilization(0.9));
//   ACCEL_ASSIGN_OR_RETURN(DeviceMemoryProfile profile,
//                          ProfileDeviceMemory(*probe, [&] { return RunLargestStep(); }));
//   ACCEL_ASSIGN_OR_RETURN(int64_t blocks, KvBlocksFromDeviceMemory(0.9, profile, block_bytes));
//
// Torch-free header.
#ifndef ACCEL_ENGINE_GPU_MEMORY_H_
#define ACCEL_ENGINE_GPU_MEMORY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace accel::engine {

// What one CUDA device holds, as its driver and libtorch's caching
// allocator see it.
class DeviceMemoryProbe {
 public:
  virtual ~DeviceMemoryProbe() = default;
  // The device's total memory and what is in use on it (every process's,
  // the CUDA context and the allocator's cached blocks included).
  virtual absl::StatusOr<int64_t> TotalBytes() = 0;
  virtual absl::StatusOr<int64_t> UsedBytes() = 0;
  // libtorch's caching allocator: bytes allocated now, and the most
  // allocated since the last ResetPeak.
  virtual int64_t AllocatedBytes() = 0;
  virtual int64_t PeakAllocatedBytes() = 0;
  virtual void ResetPeak() = 0;
};

// The probe of CUDA device `device`; Unimplemented where this build's
// libtorch has no CUDA (the caller then leaves the KV cache to
// --kv_cache_memory).
absl::StatusOr<std::unique_ptr<DeviceMemoryProbe>> CudaMemoryProbe(int device);

struct DeviceMemoryProfile {
  int64_t total_bytes = 0;
  // In use on the device after loading (weights, context, cached blocks).
  int64_t used_after_load_bytes = 0;
  // What the profiling forward's peak added to the allocated bytes before it.
  int64_t activation_peak_bytes = 0;

  std::string ToString() const;  // "total 80.0 GiB, 16.2 GiB in use after loading, ..."
};

// InvalidArgument naming --gpu_memory_utilization unless 0 < utilization <= 1.
absl::Status CheckGpuMemoryUtilization(double utilization);

// Reads the device's total and used memory, then runs `profile_forward`
// (the largest step the engine will run, without a KV cache) between a
// reset and a read of the allocator's peak. The forward's error is returned
// as is.
absl::StatusOr<DeviceMemoryProfile> ProfileDeviceMemory(
    DeviceMemoryProbe& probe, const std::function<absl::Status()>& profile_forward);

// The KV bytes the device has room for: total x utilization - used after
// load - the activation peak (negative when there is none).
int64_t KvBytesFromDeviceMemory(double utilization, const DeviceMemoryProfile& profile);

// Those bytes in blocks of `block_bytes`. InvalidArgument naming
// --gpu_memory_utilization for a utilization outside (0, 1], and, with the
// figures, when not one block fits.
absl::StatusOr<int64_t> KvBlocksFromDeviceMemory(double utilization,
                                                 const DeviceMemoryProfile& profile,
                                                 int64_t block_bytes);

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_GPU_MEMORY_H_
