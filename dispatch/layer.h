// dispatch/layer.h: the base class of accel's own layers (accel::nn).
#ifndef ACCEL_DISPATCH_LAYER_H_
#define ACCEL_DISPATCH_LAYER_H_

#include <set>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace accel::dispatch {

// The base of accel's own layers: a torch::nn::Module whose tensors are
// made through NewParameter() / NewBuffer(), and which knows which of its
// buffers are not persistent (not in the state dict: computed, like rotary
// frequencies), as torch's Python modules do and libtorch's do not.
class Layer : public torch::nn::Module {
 public:
  explicit Layer(const std::string& class_name) : torch::nn::Module(class_name) {}
  bool IsPersistentBuffer(const std::string& local_name) const {
    return non_persistent_.count(local_name) == 0;
  }

 protected:
  at::Tensor AddParameter(const std::string& name, at::IntArrayRef shape, at::ScalarType dtype);
  at::Tensor AddBuffer(const std::string& name, const at::Tensor& value, bool persistent);

 private:
  std::set<std::string> non_persistent_;
};

}  // namespace accel::dispatch

#endif  // ACCEL_DISPATCH_LAYER_H_
