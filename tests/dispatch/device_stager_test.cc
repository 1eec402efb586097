// The copy stream that brings offloaded weights to the GPU: its refusals
// everywhere, and on a machine with a CUDA device, that copies land whole
// and never overwrite weights that queued kernels still read.
#include "dispatch/internal/device_stager.h"

#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::dispatch::internal {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

TEST(DeviceStagerTest, HostMemoryHasNoCopyStream) {
  EXPECT_THAT(DeviceStager::Create(at::Device(at::kCPU)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cpu")));
}

TEST(DeviceStagerTest, ALibtorchWithoutCudaNamesTheDevice) {
  if (at::hasCUDA()) GTEST_SKIP() << "this libtorch has CUDA and a device";
  auto stager = DeviceStager::Create(at::Device(at::kCUDA, 0));
  EXPECT_FALSE(stager.ok());
  EXPECT_THAT(stager.status().message(), HasSubstr("copy stream for cuda:0"));
}

// Everything below needs a CUDA libtorch and a device.
class DeviceStagerGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (at::hasCUDA)";
  }
  const at::Device gpu_{at::kCUDA, 0};
};

TEST_F(DeviceStagerGpuTest, StagedTensorsAreCompleteCopiesOnTheDevice) {
  ACCEL_ASSERT_OK_AND_ASSIGN(auto stager, DeviceStager::Create(gpu_));
  std::vector<at::Tensor> host = {at::randn({64, 32}).pin_memory(),
                                  at::arange(100, at::kLong).pin_memory(),
                                  at::randn({7}).to(at::kBFloat16)};  // pageable works too
  ACCEL_ASSERT_OK_AND_ASSIGN(std::vector<at::Tensor> staged, stager->Stage(host));
  ASSERT_EQ(staged.size(), host.size());
  for (size_t i = 0; i < host.size(); ++i) {
    EXPECT_EQ(staged[i].device(), gpu_);
    EXPECT_EQ(staged[i].scalar_type(), host[i].scalar_type());
    EXPECT_TRUE(at::equal(staged[i].cpu(), host[i])) << i;
  }
  EXPECT_THAT(stager->Released(), IsOk());
}

// Each round stages a new weight, queues a long chain of kernels that read
// it on the compute stream, releases and drops it. The next round's copy
// lands in the same block (the caching allocator hands it back): were it not
// ordered after the queued kernels, they would read the next round's values.
TEST_F(DeviceStagerGpuTest, ACopyNeverOverwritesWeightsThatQueuedKernelsRead) {
  ACCEL_ASSERT_OK_AND_ASSIGN(auto stager, DeviceStager::Create(gpu_));
  constexpr int kRounds = 8;
  constexpr int kChain = 50;
  const int64_t n = 1024;
  at::Tensor x = at::randn({n, n}, at::TensorOptions().device(gpu_)) / 32;
  std::vector<at::Tensor> results, weights;
  for (int round = 0; round < kRounds; ++round) {
    at::Tensor w = (at::randn({n, n}) / 32).pin_memory();
    weights.push_back(w.clone());
    ACCEL_ASSERT_OK_AND_ASSIGN(std::vector<at::Tensor> staged, stager->Stage({w}));
    at::Tensor y = x;
    for (int k = 0; k < kChain; ++k) y = at::tanh(at::matmul(y, staged[0]));
    results.push_back(y);
    ASSERT_THAT(stager->Released(), IsOk());
    staged.clear();   // back to the allocator while the chain may still run
    w.fill_(1000.0);  // the pinned source changes too: the copy was complete
  }
  for (int round = 0; round < kRounds; ++round) {
    at::Tensor w = weights[round].to(gpu_);
    at::Tensor y = x;
    for (int k = 0; k < kChain; ++k) y = at::tanh(at::matmul(y, w));
    EXPECT_TRUE(at::equal(results[round], y)) << "round " << round;
  }
}

}  // namespace
}  // namespace accel::dispatch::internal
