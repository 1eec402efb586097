// A host vector sent to a device once while it stays the same: every layer of
// a step sends the same indices or tables (the decode kernels' block tables,
// the general forward's KV write index), so each call site keeps its last
// copy (one LastUpload per call site and thread) and reuses it while the
// contents are unchanged, sent without waiting for the device
// (core/device_copy.h).
#ifndef ACCEL_MODELS_INTERNAL_DEVICE_UPLOAD_H_
#define ACCEL_MODELS_INTERNAL_DEVICE_UPLOAD_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/device_copy.h"

namespace accel::models::internal {

template <typename T>
class LastUpload {
 public:
  // `host` as a 1-D `dtype` tensor (T's own width) on `device`.
  at::Tensor To(const std::vector<T>& host, at::ScalarType dtype, const at::Device& device) {
    if (device_.defined() && device_.device() == device && host_ == host) return device_;
    at::Tensor staged = HostStaging({static_cast<int64_t>(host.size())}, dtype, device);
    std::copy(host.begin(), host.end(), static_cast<T*>(staged.data_ptr()));
    device_ = SendToDevice(staged, device);
    host_ = host;
    return device_;
  }

 private:
  std::vector<T> host_;
  at::Tensor device_;
};

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_DEVICE_UPLOAD_H_
