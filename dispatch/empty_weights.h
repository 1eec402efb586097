// dispatch/empty_weights.h: building models without memory, and setting
// their tensors one by one.
//
//   {
//     dispatch::EmptyWeightsGuard empty;              // init_empty_weights()
//     model = std::make_shared<MyModel>(config);      // layers call NewParameter()
//   }                                                 // costs no memory for weights
//   ACCEL_RETURN_IF_ERROR(dispatch::SetModuleTensor(*model, "layers.0.mlp.weight",
//                                                   at::kCPU, value));
//
// Note [In-place tensor moves]: libtorch 1.13 refuses Module::to(kMeta) and
// set_data() between meta and a real device. SetModuleTensor instead swaps
// the storage and metadata of the tensor's own TensorImpl
// (TensorImpl::shallow_copy_from, what set_data does after its check). Every
// handle to that tensor sees the change at once: the registered parameter,
// the layer's member (LinearImpl::weight), and every module it is tied to,
// which therefore stay tied on every device with no re-tying step. Autograd
// metadata (requires_grad, .grad) stays with the tensor.
#ifndef ACCEL_DISPATCH_EMPTY_WEIGHTS_H_
#define ACCEL_DISPATCH_EMPTY_WEIGHTS_H_

#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace torch::nn {
class Module;
}

namespace accel::dispatch {

// While alive, on this thread, NewParameter() creates tensors on the meta
// device (and NewBuffer() too when include_buffers): Accelerate's
// init_empty_weights. Guards nest. Not movable.
class EmptyWeightsGuard {
 public:
  explicit EmptyWeightsGuard(bool include_buffers = false);
  ~EmptyWeightsGuard();
  EmptyWeightsGuard(const EmptyWeightsGuard&) = delete;
  EmptyWeightsGuard& operator=(const EmptyWeightsGuard&) = delete;

 private:
  bool previous_params_;
  bool previous_buffers_;
};

// What layers call to make their tensors: empty (uninitialised) CPU tensors,
// or meta tensors under an EmptyWeightsGuard. Layers initialise real ones.
at::Tensor NewParameter(at::IntArrayRef shape, at::ScalarType dtype);
at::Tensor NewBuffer(at::IntArrayRef shape, at::ScalarType dtype);

// Sets the parameter or buffer `name` ("layers.0.mlp.weight") of `module` in
// place (see the Note above), on `device`:
// - with `value`: its data, converted to `dtype`, or else to the tensor's
//   current dtype (integer and bool values keep theirs). A CPU value that
//   needs no conversion is aliased, not copied.
// - without: an empty tensor on `device`, which must be meta (to release a
//   tensor's memory) unless the tensor already has data to move.
// NotFound for an unknown name; InvalidArgument for a shape mismatch, or for
// a meta tensor moved to a real device without a value. Not thread-safe for
// one module.
absl::Status SetModuleTensor(torch::nn::Module& module, absl::string_view name,
                             const at::Device& device, const at::Tensor& value = at::Tensor(),
                             std::optional<at::ScalarType> dtype = std::nullopt);

// The same for a tensor found already: `target` is the module's own tensor
// (its parameter or buffer, by identity), `name` only labels errors. What
// SetModuleTensor does after its lookup, which walks every tensor of the
// module: code that moves the same tensors again and again (the dispatch
// core, each forward) looks them up once.
absl::Status SetTensorInPlace(const at::Tensor& target, absl::string_view name,
                              const at::Device& device, const at::Tensor& value = at::Tensor(),
                              std::optional<at::ScalarType> dtype = std::nullopt);

// Moves every parameter and buffer of `module` to meta in place, freeing
// their memory: for libtorch's own layers, whose constructors allocate.
absl::Status EmptyModule(torch::nn::Module& module);

}  // namespace accel::dispatch

#endif  // ACCEL_DISPATCH_EMPTY_WEIGHTS_H_
