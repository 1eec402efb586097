#include "core/device_copy.h"

#include <algorithm>

#include <ATen/ops/empty.h>

namespace accel {

at::Tensor HostStaging(at::IntArrayRef sizes, at::ScalarType dtype, const at::Device& device) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype).pinned_memory(device.is_cuda()));
}

at::Tensor SendToDevice(const at::Tensor& staged, const at::Device& device) {
  return staged.to(device, /*non_blocking=*/device.is_cuda());
}

at::Tensor ToDeviceAsync(const at::Tensor& host, const at::Device& device) {
  if (!device.is_cuda() || !host.is_cpu()) return host.to(device);
  at::Tensor staged = HostStaging(host.sizes(), host.scalar_type(), device);
  staged.copy_(host);
  return SendToDevice(staged, device);
}

at::Tensor Int64sOn(absl::Span<const int64_t> values, const at::Device& device) {
  at::Tensor staged = HostStaging({static_cast<int64_t>(values.size())}, at::kLong, device);
  std::copy(values.begin(), values.end(), staged.data_ptr<int64_t>());
  return SendToDevice(staged, device);
}

}  // namespace accel
