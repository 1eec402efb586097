// train/operations.h: Accelerate's send_to_device (utils/operations.py) for
// the containers C++ batches come in: a tensor, a list of tensors, or a map
// of named tensors (a Batch).
//
//   ACCEL_ASSIGN_OR_RETURN(c10::Device gpu, ParseDevice("cuda:1"));
//   SendToDeviceOptions options;
//   options.non_blocking = true;
//   options.skip_keys = {"metadata"};
//   ACCEL_ASSIGN_OR_RETURN(batch, SendToDevice(batch, gpu, options));
#ifndef ACCEL_TRAIN_OPERATIONS_H_
#define ACCEL_TRAIN_OPERATIONS_H_

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "train/collectives.h"

namespace accel::train {

struct SendToDeviceOptions {
  // Tensor.to(non_blocking=...): a copy from pinned host memory to a GPU may
  // overlap the host's work; elsewhere the copy is synchronous anyway.
  bool non_blocking = false;
  // Map keys whose tensors stay where they are (maps only, as Accelerate's
  // skip_keys applies to mappings).
  std::vector<std::string> skip_keys;
};

// "cpu", "meta", "cuda", "cuda:N": InvalidArgument naming `device` for a
// string torch cannot parse, or a device this process cannot use (CUDA
// without a CUDA libtorch or GPU, an index past the GPUs there are).
absl::StatusOr<c10::Device> ParseDevice(absl::string_view device);
// The same checks on a device already made.
absl::Status CheckDevice(const c10::Device& device);

// Each tensor on `device` (a tensor already there is returned as it is, no
// copy); undefined tensors stay undefined. The device is checked first.
absl::StatusOr<at::Tensor> SendToDevice(const at::Tensor& tensor, const c10::Device& device,
                                        const SendToDeviceOptions& options = {});
absl::StatusOr<TensorList> SendToDevice(const TensorList& tensors, const c10::Device& device,
                                        const SendToDeviceOptions& options = {});
absl::StatusOr<TensorMap> SendToDevice(const TensorMap& tensors, const c10::Device& device,
                                       const SendToDeviceOptions& options = {});

}  // namespace accel::train

#endif  // ACCEL_TRAIN_OPERATIONS_H_
