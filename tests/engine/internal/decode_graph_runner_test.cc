// The decode graph runner. Where graphs cannot be captured (this machine's
// libtorch has no CUDA): each Run calls the step, its failure comes back as
// a status, and asking for capture is refused by name. On a CUDA device
// (scripts/gpu_check.sh): a step captured per bucket and replayed on new
// inputs gives what running it eagerly gives.
#include "engine/internal/decode_graph_runner.h"

#include <map>
#include <stdexcept>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::engine::internal {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

TEST(DecodeGraphRunnerTest, WithoutCaptureEachRunCallsTheStep) {
  DecodeGraphRunner runner(/*capture=*/false);
  EXPECT_FALSE(runner.capturing());
  int calls = 0;
  for (int64_t bucket : {1, 8, 1, 8, 16}) {
    EXPECT_THAT(runner.Run(bucket, [&] { ++calls; }), IsOk());
  }
  EXPECT_EQ(calls, 5);
  EXPECT_EQ(runner.graphs(), 0);
  EXPECT_EQ(runner.replays(), 0);
  EXPECT_THAT(runner.Run(2, [] { throw std::runtime_error("step failed"); }),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("step failed")));
}

TEST(DecodeGraphRunnerTest, CaptureWithoutACudaLibtorchIsRefused) {
  if (DecodeGraphRunner::CanCapture()) GTEST_SKIP() << "a CUDA build: the device script tests it";
  DecodeGraphRunner runner(/*capture=*/true);
  int calls = 0;
  EXPECT_THAT(
      runner.Run(4, [&] { ++calls; }),
      StatusIs(absl::StatusCode::kUnimplemented,
               HasSubstr("CUDA graphs (decode batch 4): this build's libtorch has no CUDA")));
  EXPECT_EQ(calls, 0);
}

TEST(DecodeGraphRunnerTest, CapturedStepsReplayWhatEagerStepsGive) {
  if (!DecodeGraphRunner::CanCapture() || !at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device: the device script runs this";
  }
  const at::TensorOptions cuda = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const at::Tensor weight = at::randn({64, 64}, cuda), bias = at::randn({64}, cuda);
  // Each bucket's static input and output, as the model runner keeps them.
  std::map<int64_t, at::Tensor> inputs, outputs;
  DecodeGraphRunner runner(/*capture=*/true);
  for (int round = 0; round < 3; ++round) {
    for (int64_t bucket : {1, 8}) {
      if (!inputs.count(bucket)) {
        inputs[bucket] = at::empty({bucket, 64}, cuda);
        outputs[bucket] = at::empty({bucket, 64}, cuda);
      }
      const at::Tensor x = at::randn({bucket, 64}, cuda);
      inputs[bucket].copy_(x);
      const at::Tensor& in = inputs[bucket];
      at::Tensor& out = outputs[bucket];
      ASSERT_THAT(
          runner.Run(bucket, [&] { out.copy_(at::relu(at::addmm(bias, in, weight)).softmax(-1)); }),
          IsOk());
      const at::Tensor eager = at::relu(at::addmm(bias, x, weight)).softmax(-1);
      EXPECT_TRUE(at::allclose(out, eager, 1e-5, 1e-6))
          << "bucket " << bucket << ", round " << round;
    }
  }
  EXPECT_EQ(runner.graphs(), 2);
  EXPECT_EQ(runner.replays(), 6);
}

}  // namespace
}  // namespace accel::engine::internal
