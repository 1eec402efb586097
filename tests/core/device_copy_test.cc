#include "core/device_copy.h"

#include <cstdint>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <gtest/gtest.h>

namespace accel {
namespace {

std::vector<at::Device> Devices() {
  std::vector<at::Device> devices = {at::Device(at::kCPU)};
  if (at::hasCUDA()) devices.emplace_back(at::kCUDA, 0);
  return devices;
}

// The values arrive, in order, on the device asked for; an empty list is an
// empty tensor. (Whether the copy waits for the device is the engine's CUDA
// test: StepsOnACudaDeviceWaitOnlyForWhatTheySampled.)
TEST(DeviceCopyTest, Int64sArriveInOrderOnTheDevice) {
  const std::vector<int64_t> values = {7, -1, int64_t{1} << 40, 0, 42};
  for (const at::Device& device : Devices()) {
    SCOPED_TRACE(device.str());
    const at::Tensor got = Int64sOn(values, device);
    EXPECT_EQ(got.device(), device);
    EXPECT_EQ(got.scalar_type(), at::kLong);
    ASSERT_EQ(got.dim(), 1);
    const at::Tensor host = got.to(at::kCPU);
    ASSERT_EQ(host.numel(), 5);
    for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(host[i].item<int64_t>(), values[i]) << i;
    EXPECT_EQ(Int64sOn({}, device).numel(), 0);
  }
}

// A host tensor keeps its values, shape and dtype; one already on the device
// is itself (no copy); a later change to the host tensor does not reach the
// device's copy.
TEST(DeviceCopyTest, ToDeviceAsyncCopiesHostTensorsAndLeavesDeviceOnesAlone) {
  for (const at::Device& device : Devices()) {
    SCOPED_TRACE(device.str());
    at::Tensor host = at::arange(12, at::kFloat).view({3, 4});
    const at::Tensor moved = ToDeviceAsync(host, device);
    EXPECT_EQ(moved.device(), device);
    EXPECT_EQ(moved.sizes(), host.sizes());
    EXPECT_EQ(moved.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(moved.to(at::kCPU), at::arange(12, at::kFloat).view({3, 4})));
    if (device.is_cuda()) {
      host.fill_(-1);
      EXPECT_TRUE(at::equal(moved.to(at::kCPU), at::arange(12, at::kFloat).view({3, 4})));
    }
    EXPECT_TRUE(ToDeviceAsync(moved, device).is_same(moved));
  }
}

}  // namespace
}  // namespace accel
