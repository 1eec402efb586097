#include "train/operations.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"

namespace accel::train {

absl::Status CheckDevice(const c10::Device& device) {
  if (device.is_cuda()) {
    // Checked here because torch's own failure would come back as an
    // Internal error from deep inside the copy.
    if (!at::globalContext().hasCUDA()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device \"", device.str(), "\": this libtorch has no CUDA, or this machine no GPU"));
    }
    const int64_t count = at::detail::getCUDAHooks().getNumGPUs();
    if (device.has_index() && device.index() >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("device \"", device.str(), "\": there are ", count, " GPU(s)"));
    }
    return absl::OkStatus();
  }
  if (device.is_cpu() || device.is_meta()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("device \"", device.str(), "\": only cpu, cuda and meta devices are supported"));
}

absl::StatusOr<c10::Device> ParseDevice(absl::string_view device) {
  std::optional<c10::Device> parsed;
  absl::Status status = CallTorch([&] { parsed = c10::Device(std::string(device)); });
  if (!status.ok() || !parsed) {
    return absl::InvalidArgumentError(
        absl::StrCat("device \"", device, "\" is not a device (cpu, cuda, cuda:N, meta)"));
  }
  ACCEL_RETURN_IF_ERROR(CheckDevice(*parsed));
  return *parsed;
}

namespace {
// `tensor` on `device`; Tensor::to returns the tensor itself when it is
// already there (no copy).
at::Tensor Moved(const at::Tensor& tensor, const c10::Device& device, bool non_blocking) {
  if (!tensor.defined()) return tensor;
  return tensor.to(device, non_blocking);
}
}  // namespace

absl::StatusOr<at::Tensor> SendToDevice(const at::Tensor& tensor, const c10::Device& device,
                                        const SendToDeviceOptions& options) {
  ACCEL_RETURN_IF_ERROR(CheckDevice(device));
  at::Tensor out;
  ACCEL_RETURN_IF_ERROR(
      Annotate(CallTorch([&] { out = Moved(tensor, device, options.non_blocking); }),
               absl::StrCat("send_to_device ", device.str())));
  return out;
}

absl::StatusOr<TensorList> SendToDevice(const TensorList& tensors, const c10::Device& device,
                                        const SendToDeviceOptions& options) {
  ACCEL_RETURN_IF_ERROR(CheckDevice(device));
  TensorList out;
  out.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    ACCEL_RETURN_IF_ERROR(
        Annotate(CallTorch([&] { out.push_back(Moved(tensors[i], device, options.non_blocking)); }),
                 absl::StrCat("send_to_device ", device.str(), ": tensor ", i)));
  }
  return out;
}

absl::StatusOr<TensorMap> SendToDevice(const TensorMap& tensors, const c10::Device& device,
                                       const SendToDeviceOptions& options) {
  ACCEL_RETURN_IF_ERROR(CheckDevice(device));
  TensorMap out;
  for (const auto& item : tensors) {
    // Named, not a structured binding: lambdas cannot capture those in C++17.
    const std::string& name = item.first;
    const at::Tensor& tensor = item.second;
    const bool skip = std::find(options.skip_keys.begin(), options.skip_keys.end(), name) !=
                      options.skip_keys.end();
    if (skip) {
      out.emplace(name, tensor);
      continue;
    }
    ACCEL_RETURN_IF_ERROR(
        Annotate(CallTorch([&] { out.emplace(name, Moved(tensor, device, options.non_blocking)); }),
                 absl::StrCat("send_to_device ", device.str(), ": \"", name, "\"")));
  }
  return out;
}

}  // namespace accel::train
