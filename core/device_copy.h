// core/device_copy.h: host-built tensors sent to a device without waiting
// for it.
//
// libtorch copies pageable host memory to a CUDA device with memcpy_and_sync:
// the host waits until every kernel queued before the copy has run. A step
// that sends an index in each layer (the experts' rows, a cache's block
// table) then runs its layers with the host and the device taking turns
// instead of the host queueing ahead. These copy through pinned memory,
// ordered on the current stream like a kernel; libtorch's caching host
// allocator keeps the pinned buffer until its copy is done. Off a CUDA
// device they are plain copies (`to`).
#ifndef ACCEL_CORE_DEVICE_COPY_H_
#define ACCEL_CORE_DEVICE_COPY_H_

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/types/span.h"

namespace accel {

// An uninitialized host tensor to fill and then send with SendToDevice:
// pinned where `device` is a CUDA device.
at::Tensor HostStaging(at::IntArrayRef sizes, at::ScalarType dtype, const at::Device& device);

// `staged` (from HostStaging for `device`) on `device`: asynchronous from
// pinned memory on a CUDA device, a plain copy elsewhere.
at::Tensor SendToDevice(const at::Tensor& staged, const at::Device& device);

// `host` (a cpu tensor) on `device`.
at::Tensor ToDeviceAsync(const at::Tensor& host, const at::Device& device);

// `values` as a 1-D int64 tensor on `device`.
at::Tensor Int64sOn(absl::Span<const int64_t> values, const at::Device& device);

}  // namespace accel

#endif  // ACCEL_CORE_DEVICE_COPY_H_
