// train/autocast.h: an RAII autocast region. libtorch 1.13 has only
// thread-local setters; this does what Python's torch.autocast __enter__ /
// __exit__ do: save the state, set enabled and dtype, count the nesting, and
// on leaving the outermost region clear the cast cache (forgetting that keeps
// casted weight copies alive), then restore.
#ifndef ACCEL_TRAIN_AUTOCAST_H_
#define ACCEL_TRAIN_AUTOCAST_H_

#include <optional>

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace accel::train {

class AutocastScope {
 public:
  // device: kCPU (1.13 supports bfloat16 only there: float16 is refused by
  // disabling, as Python does, with a warning) or kCUDA.
  AutocastScope(c10::DeviceType device, bool enabled, c10::ScalarType dtype,
                std::optional<bool> cache_enabled = std::nullopt);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

}  // namespace accel::train

#endif  // ACCEL_TRAIN_AUTOCAST_H_
