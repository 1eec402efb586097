// Copies an offloaded module's weights to its GPU on a copy stream of their
// own, so that the next module's weights cross the bus while the current one
// computes (Accelerate's offload hooks copy on the compute stream, in line).
//
// Written against c10's device-generic streams and events (c10::Stream,
// c10::Event, c10::StreamGuard), not c10/cuda: it builds with every libtorch,
// and on a CUDA libtorch the CUDA guard implementation does the work.
//
// The protocol, two threads:
//   reader thread:  Stage(host) -> device tensors, complete when it returns
//   compute thread: uses them on its current stream, then Released() before
//                   dropping the last reference.
// Stage() allocates on the copy stream, so a block freed after a module ran
// can come back to the next Stage(); the copy stream first waits for the
// compute stream's work up to the latest Released(), so no copy overwrites
// weights that a queued kernel still reads. Stage() waits for its copies to
// finish before it returns: the host buffers are free again, and the compute
// stream needs no event to see the data.
#ifndef ACCEL_DISPATCH_INTERNAL_DEVICE_STAGER_H_
#define ACCEL_DISPATCH_INTERNAL_DEVICE_STAGER_H_

#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include "absl/status/statusor.h"

namespace accel::dispatch::internal {

class DeviceStager {
 public:
  // A stager for `device`, with a stream from the device's pool. Errors when
  // this libtorch cannot use the device (a CPU-only build).
  static absl::StatusOr<std::unique_ptr<DeviceStager>> Create(const at::Device& device);

  DeviceStager(const DeviceStager&) = delete;
  DeviceStager& operator=(const DeviceStager&) = delete;

  // Device copies of `host` (pinned for a copy that overlaps; pageable works,
  // synchronously), same shapes and dtypes; complete on return.
  absl::StatusOr<std::vector<at::Tensor>> Stage(const std::vector<at::Tensor>& host);

  // Marks the end of the compute stream's use of tensors this stager made.
  // Call on the thread that ran the module, before dropping them.
  absl::Status Released();

  const at::Device& device() const { return device_; }

 private:
  DeviceStager(const at::Device& device, c10::Stream copy_stream);

  const at::Device device_;
  const c10::Stream copy_stream_;
  std::mutex mu_;        // guards released_: recorded and waited on by two threads
  c10::Event released_;  // on the compute stream, at the latest Released()
};

}  // namespace accel::dispatch::internal

#endif  // ACCEL_DISPATCH_INTERNAL_DEVICE_STAGER_H_
