#include "dispatch/internal/device_stager.h"

#include <utility>

#include <ATen/Functions.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"

namespace accel::dispatch::internal {

absl::StatusOr<std::unique_ptr<DeviceStager>> DeviceStager::Create(const at::Device& device) {
  if (device.is_cpu() || device.is_meta()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no copy stream for ", device.str(), ": it is host memory"));
  }
  std::unique_ptr<DeviceStager> out;
  ACCEL_RETURN_IF_ERROR(
      Annotate(CallTorch([&] {
                 const c10::impl::VirtualGuardImpl impl(device.type());
                 out.reset(new DeviceStager(device, impl.getStreamFromGlobalPool(device)));
               }),
               absl::StrCat("a copy stream for ", device.str())));
  return out;
}

DeviceStager::DeviceStager(const at::Device& device, c10::Stream copy_stream)
    : device_(device), copy_stream_(copy_stream), released_(device.type()) {}

absl::StatusOr<std::vector<at::Tensor>> DeviceStager::Stage(const std::vector<at::Tensor>& host) {
  std::vector<at::Tensor> out;
  out.reserve(host.size());
  absl::Status status = CallTorch([&] {
    const c10::StreamGuard on_copy_stream(copy_stream_);
    // Allocations below may reuse blocks of modules already released: their
    // copies wait for the kernels queued before the release.
    std::vector<at::Tensor> targets;
    targets.reserve(host.size());
    for (const at::Tensor& h : host) {
      targets.push_back(at::empty(h.sizes(), at::TensorOptions(h.scalar_type()).device(device_)));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_.block(copy_stream_);
    }
    for (size_t i = 0; i < host.size(); ++i) {
      targets[i].copy_(host[i], /*non_blocking=*/true);
    }
    copy_stream_.synchronize();
    out = std::move(targets);
  });
  if (!status.ok()) return Annotate(status, absl::StrCat("copying weights to ", device_.str()));
  return out;
}

absl::Status DeviceStager::Released() {
  return CallTorch([&] {
    const c10::impl::VirtualGuardImpl impl(device_.type());
    std::lock_guard<std::mutex> lock(mu_);
    released_.record(impl.getStream(device_));
  });
}

}  // namespace accel::dispatch::internal
