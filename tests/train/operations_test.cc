// send_to_device: tensors, lists and maps (with skip_keys) onto a device,
// and the device checks that turn a bad device into a clear error.
#include "train/operations.h"

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

// The meta device is the one device besides the CPU that every libtorch
// has: a move there is a real move (the data stays behind).
const c10::Device kMeta(c10::kMeta);

TEST(SendToDevice, MovesATensor) {
  at::Tensor t = at::arange(6, at::kFloat).reshape({2, 3});
  auto moved = SendToDevice(t, kMeta);
  ASSERT_THAT(moved, IsOk());
  EXPECT_TRUE(moved->is_meta());
  EXPECT_EQ(moved->sizes(), t.sizes());
  EXPECT_EQ(moved->scalar_type(), at::kFloat);
  EXPECT_TRUE(t.device().is_cpu());  // the input is left as it was
}

TEST(SendToDevice, ATensorAlreadyThereIsNotCopied) {
  at::Tensor t = at::ones({4});
  auto same = SendToDevice(t, c10::Device(c10::kCPU));
  ASSERT_THAT(same, IsOk());
  EXPECT_TRUE(same->is_same(t));
}

TEST(SendToDevice, MovesAList) {
  TensorList list = {at::ones({2}), at::zeros({3}, at::kLong), at::Tensor()};
  SendToDeviceOptions options;
  options.non_blocking = true;
  auto moved = SendToDevice(list, kMeta, options);
  ASSERT_THAT(moved, IsOk());
  ASSERT_EQ(moved->size(), 3u);
  EXPECT_TRUE((*moved)[0].is_meta());
  EXPECT_TRUE((*moved)[1].is_meta());
  EXPECT_EQ((*moved)[1].scalar_type(), at::kLong);
  EXPECT_FALSE((*moved)[2].defined());  // undefined stays undefined
}

TEST(SendToDevice, MovesAMapExceptItsSkipKeys) {
  TensorMap batch = {{"input_ids", at::ones({2, 5}, at::kLong)},
                     {"labels", at::zeros({2}, at::kLong)},
                     {"ids", at::arange(2)}};
  SendToDeviceOptions options;
  options.skip_keys = {"ids", "not_in_the_batch"};
  auto moved = SendToDevice(batch, kMeta, options);
  ASSERT_THAT(moved, IsOk());
  ASSERT_EQ(moved->size(), 3u);
  EXPECT_TRUE(moved->at("input_ids").is_meta());
  EXPECT_TRUE(moved->at("labels").is_meta());
  EXPECT_TRUE(moved->at("ids").device().is_cpu());
  EXPECT_TRUE(moved->at("ids").is_same(batch.at("ids")));
}

TEST(ParseDevice, NamesAndIndices) {
  auto cpu = ParseDevice("cpu");
  ASSERT_THAT(cpu, IsOk());
  EXPECT_TRUE(cpu->is_cpu());
  auto meta = ParseDevice("meta");
  ASSERT_THAT(meta, IsOk());
  EXPECT_TRUE(meta->is_meta());
}

TEST(ParseDevice, BadDevicesNameTheArgument) {
  EXPECT_THAT(ParseDevice("gpu0"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device \"gpu0\"")));
  EXPECT_THAT(ParseDevice(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device")));
  EXPECT_THAT(ParseDevice("cuda:-3"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device")));
  // A GPU past those there are (none on a CPU libtorch).
  EXPECT_THAT(ParseDevice("cuda:63"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device \"cuda:63\"")));
}

TEST(SendToDevice, ADeviceThisProcessLacksIsAnArgumentError) {
  if (at::globalContext().hasCUDA()) GTEST_SKIP() << "this libtorch and machine have CUDA";
  const c10::Device gpu(c10::kCUDA, 0);
  EXPECT_THAT(SendToDevice(at::ones({2}), gpu),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device \"cuda:0\"")));
  EXPECT_THAT(SendToDevice(TensorMap{{"x", at::ones({2})}}, gpu),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no CUDA")));
}

}  // namespace
}  // namespace accel::train
