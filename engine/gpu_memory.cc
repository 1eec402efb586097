#include "engine/gpu_memory.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "core/bytes.h"
#include "core/status.h"

namespace accel::engine {

std::string DeviceMemoryProfile::ToString() const {
  return absl::StrCat("device total ", FormatBytes(total_bytes), ", ",
                      FormatBytes(used_after_load_bytes), " in use after loading, ",
                      FormatBytes(activation_peak_bytes), " activation peak");
}

absl::Status CheckGpuMemoryUtilization(double utilization) {
  if (utilization > 0 && utilization <= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "--gpu_memory_utilization=%g: the fraction of the device's memory this process may use "
      "must be in (0, 1]",
      utilization));
}

absl::StatusOr<DeviceMemoryProfile> ProfileDeviceMemory(
    DeviceMemoryProbe& probe, const std::function<absl::Status()>& profile_forward) {
  DeviceMemoryProfile profile;
  ACCEL_ASSIGN_OR_RETURN(profile.total_bytes, probe.TotalBytes());
  ACCEL_ASSIGN_OR_RETURN(profile.used_after_load_bytes, probe.UsedBytes());
  const int64_t before = probe.AllocatedBytes();
  probe.ResetPeak();
  ACCEL_RETURN_IF_ERROR(profile_forward());
  profile.activation_peak_bytes = std::max<int64_t>(0, probe.PeakAllocatedBytes() - before);
  return profile;
}

int64_t KvBytesFromDeviceMemory(double utilization, const DeviceMemoryProfile& profile) {
  const auto allowed =
      static_cast<int64_t>(std::floor(utilization * static_cast<double>(profile.total_bytes)));
  return allowed - profile.used_after_load_bytes - profile.activation_peak_bytes;
}

absl::StatusOr<int64_t> KvBlocksFromDeviceMemory(double utilization,
                                                 const DeviceMemoryProfile& profile,
                                                 int64_t block_bytes) {
  ACCEL_RETURN_IF_ERROR(CheckGpuMemoryUtilization(utilization));
  if (block_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat("a KV block of ", block_bytes, " bytes"));
  }
  const int64_t bytes = KvBytesFromDeviceMemory(utilization, profile);
  if (bytes < block_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--gpu_memory_utilization=%g leaves %s for the KV cache (%s x %g = %s, less %s in use "
        "after loading and a %s activation peak), not one block of %s; raise it, or give "
        "--kv_cache_memory",
        utilization, FormatBytes(bytes), FormatBytes(profile.total_bytes), utilization,
        FormatBytes(static_cast<int64_t>(utilization * static_cast<double>(profile.total_bytes))),
        FormatBytes(profile.used_after_load_bytes), FormatBytes(profile.activation_peak_bytes),
        FormatBytes(block_bytes)));
  }
  return bytes / block_bytes;
}

}  // namespace accel::engine
