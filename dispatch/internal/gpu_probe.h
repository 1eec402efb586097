// Free memory of each GPU, read through NVML loaded at run time (dlopen of
// libnvidia-ml.so.1, which ships with the NVIDIA driver): no CUDA is needed
// to build, and a machine without the driver has no GPUs.
#ifndef ACCEL_DISPATCH_INTERNAL_GPU_PROBE_H_
#define ACCEL_DISPATCH_INTERNAL_GPU_PROBE_H_

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace accel::dispatch::internal {

// CUDA_VISIBLE_DEVICES as physical indexes: nullopt when unset or when it
// uses GPU UUIDs (then every GPU counts); an empty list hides them all
// (CUDA stops at the first invalid entry, and so do we).
std::optional<std::vector<int>> ParseVisibleDevices(const char* env);

// (CUDA index as this process sees it, free bytes), in CUDA index order.
// NVML counts GPUs in PCI bus order, which is CUDA's order when
// CUDA_DEVICE_ORDER=PCI_BUS_ID (the usual server setting).
std::vector<std::pair<int, int64_t>> ProbeGpuFreeMemory();

}  // namespace accel::dispatch::internal

#endif  // ACCEL_DISPATCH_INTERNAL_GPU_PROBE_H_
