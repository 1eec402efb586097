#include "train/autocast.h"

#include <iostream>
#include <mutex>

#include <ATen/autocast_mode.h>

namespace accel::train {

AutocastScope::AutocastScope(c10::DeviceType device, bool enabled, c10::ScalarType dtype,
                             std::optional<bool> cache_enabled)
    : device_(device) {
  const bool cpu = device == c10::DeviceType::CPU;
  if (cpu && enabled && dtype != c10::ScalarType::BFloat16) {
    // What Python's torch.autocast does in 1.13: CPU autocast is bfloat16 only.
    // Said once per process: a training loop enters a region every step.
    static std::once_flag warned;
    std::call_once(warned, [] {
      std::cerr << "accel: CPU autocast in libtorch 1.13 supports only bfloat16; fp16 regions "
                   "run in the current dtype\n";
    });
    enabled = false;
    // 1.13 refuses any other CPU autocast dtype: keep the current one.
    dtype = at::autocast::get_autocast_cpu_dtype();
  }
  prev_enabled_ = cpu ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
  prev_dtype_ =
      cpu ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
  prev_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  if (cpu) {
    at::autocast::set_cpu_enabled(enabled);
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_enabled(enabled);
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
  if (cache_enabled) at::autocast::set_autocast_cache_enabled(*cache_enabled);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  const bool cpu = device_ == c10::DeviceType::CPU;
  // Leaving the outermost region frees the casted weight copies.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  if (cpu) {
    at::autocast::set_cpu_enabled(prev_enabled_);
    at::autocast::set_autocast_cpu_dtype(prev_dtype_);
  } else {
    at::autocast::set_enabled(prev_enabled_);
    at::autocast::set_autocast_gpu_dtype(prev_dtype_);
  }
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

}  // namespace accel::train
