#include "dispatch/empty_weights.h"

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/module.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/status.h"

namespace accel::dispatch {
namespace {

thread_local bool empty_params = false;
thread_local bool empty_buffers = false;

std::string Shape(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The tensor registered under a dotted name: a handle to the module's own TensorImpl.
absl::StatusOr<at::Tensor> Find(torch::nn::Module& module, absl::string_view name) {
  const std::string key(name);
  // named_parameters() returns a fresh dictionary: keep it alive while
  // looking into it (ASan found the temporary's pointer dangling).
  const auto params = module.named_parameters(/*recurse=*/true);
  if (const at::Tensor* p = params.find(key)) return *p;
  const auto buffers = module.named_buffers(/*recurse=*/true);
  if (const at::Tensor* b = buffers.find(key)) return *b;
  return absl::NotFoundError(absl::StrCat("module has no parameter or buffer '", name, "'"));
}

// The source's metadata becomes the target's, but the target keeps its own
// version counter, which inference tensors lack: the two must agree on being
// inference tensors (a model built under InferenceMode has them). An alias of
// the same storage made in the target's mode settles a mismatch, no copy.
at::Tensor InModeOf(const at::Tensor& target, const at::Tensor& value) {
  const bool inference = target.is_inference();
  if (value.is_inference() == inference) return value;
  c10::InferenceMode mode(inference);
  at::Tensor alias = at::empty({0}, value.options());
  alias.set_(value.storage(), value.storage_offset(), value.sizes(), value.strides());
  return alias;
}

}  // namespace

EmptyWeightsGuard::EmptyWeightsGuard(bool include_buffers)
    : previous_params_(empty_params), previous_buffers_(empty_buffers) {
  empty_params = true;
  empty_buffers = empty_buffers || include_buffers;
}

EmptyWeightsGuard::~EmptyWeightsGuard() {
  empty_params = previous_params_;
  empty_buffers = previous_buffers_;
}

at::Tensor NewParameter(at::IntArrayRef shape, at::ScalarType dtype) {
  return at::empty(shape,
                   at::TensorOptions().dtype(dtype).device(empty_params ? at::kMeta : at::kCPU));
}

at::Tensor NewBuffer(at::IntArrayRef shape, at::ScalarType dtype) {
  return at::empty(shape,
                   at::TensorOptions().dtype(dtype).device(empty_buffers ? at::kMeta : at::kCPU));
}

absl::Status SetModuleTensor(torch::nn::Module& module, absl::string_view name,
                             const at::Device& device, const at::Tensor& value,
                             std::optional<at::ScalarType> dtype) {
  at::Tensor target;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    auto found = Find(module, name);
    if (found.ok()) target = *found;
  }));
  if (!target.defined())
    return absl::NotFoundError(absl::StrCat("module has no parameter or buffer '", name, "'"));
  return SetTensorInPlace(target, name, device, value, dtype);
}

absl::Status SetTensorInPlace(const at::Tensor& target, absl::string_view name,
                              const at::Device& device, const at::Tensor& value,
                              std::optional<at::ScalarType> dtype) {
  if (!target.defined()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' is undefined"));
  }
  at::Tensor source;
  if (value.defined()) {
    if (value.sizes() != target.sizes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "' has shape ", Shape(target.sizes()),
                       " but the value has shape ", Shape(value.sizes())));
    }
    at::ScalarType want = dtype.value_or(target.scalar_type());
    if (!dtype && (c10::isIntegralType(value.scalar_type(), /*includeBool=*/true)))
      want = value.scalar_type();
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { source = InModeOf(target, value.to(device, want)); }));
  } else if (device.is_meta()) {
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      c10::InferenceMode mode(target.is_inference());
      source =
          at::empty(target.sizes(),
                    target.options().device(at::kMeta).dtype(dtype.value_or(target.scalar_type())));
    }));
  } else {
    if (target.is_meta()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "' is empty (meta); moving it to ", device.str(), " needs a value"));
    }
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      source = InModeOf(target, target.to(device, dtype.value_or(target.scalar_type())));
    }));
  }
  if (source.unsafeGetTensorImpl() == target.unsafeGetTensorImpl()) return absl::OkStatus();
  return CallTorch(
      [&] { target.unsafeGetTensorImpl()->shallow_copy_from(source.getIntrusivePtr()); });
}

absl::Status EmptyModule(torch::nn::Module& module) {
  std::vector<std::string> names;
  for (const auto& p : module.named_parameters(true)) names.push_back(p.key());
  for (const auto& b : module.named_buffers(true)) names.push_back(b.key());
  for (const std::string& name : names)
    ACCEL_RETURN_IF_ERROR(SetModuleTensor(module, name, at::kMeta));
  return absl::OkStatus();
}

}  // namespace accel::dispatch
