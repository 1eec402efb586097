#include "dispatch/layer.h"

#include "dispatch/empty_weights.h"

namespace accel::dispatch {

at::Tensor Layer::AddParameter(const std::string& name, at::IntArrayRef shape,
                               at::ScalarType dtype) {
  return register_parameter(name, NewParameter(shape, dtype));
}

at::Tensor Layer::AddBuffer(const std::string& name, const at::Tensor& value, bool persistent) {
  if (!persistent) non_persistent_.insert(name);
  return register_buffer(name, value);
}

}  // namespace accel::dispatch
