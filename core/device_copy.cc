#include "core/device_copy.h"

#include <algorithm>

#include <ATen/ops/empty.h>

namespace accel {

at::Tensor ToDeviceAsync(const at::Tensor& host, const at::Device& device) {
  if (!device.is_cuda() || !host.is_cpu()) return host.to(device);
  at::Tensor staged = at::empty(host.sizes(), host.options().pinned_memory(true));
  staged.copy_(host);
  return staged.to(device, /*non_blocking=*/true);
}

at::Tensor Int64sOn(absl::Span<const int64_t> values, const at::Device& device) {
  const bool pin = device.is_cuda();
  at::Tensor staged = at::empty({static_cast<int64_t>(values.size())},
                                at::TensorOptions().dtype(at::kLong).pinned_memory(pin));
  std::copy(values.begin(), values.end(), staged.data_ptr<int64_t>());
  return pin ? staged.to(device, /*non_blocking=*/true) : staged.to(device);
}

}  // namespace accel
