#include "dispatch/empty_weights.h"

#include <memory>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

#include "tests/testing/process_memory.h"
#include "tests/testing/status_matchers.h"

namespace accel::dispatch {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::VirtualBytes;
using ::testing::HasSubstr;

// A layer built the way accel::nn layers are: through NewParameter().
struct Block : torch::nn::Module {
  explicit Block(int64_t hidden) : torch::nn::Module("Block") {
    up = register_parameter("up", NewParameter({4 * hidden, hidden}, at::kBFloat16));
    down = register_parameter("down", NewParameter({hidden, 4 * hidden}, at::kBFloat16));
    scale = register_buffer("scale", NewBuffer({hidden}, at::kFloat));
  }
  at::Tensor up, down, scale;
};

TEST(EmptyWeightsGuardTest, MakesParametersMetaAndBuffersOnlyWhenAsked) {
  EXPECT_FALSE(NewParameter({2}, at::kFloat).is_meta());
  {
    EmptyWeightsGuard empty;
    EXPECT_TRUE(NewParameter({2}, at::kFloat).is_meta());
    EXPECT_FALSE(NewBuffer({2}, at::kFloat).is_meta());
    {
      EmptyWeightsGuard with_buffers(/*include_buffers=*/true);
      EXPECT_TRUE(NewBuffer({2}, at::kFloat).is_meta());
    }
    EXPECT_FALSE(NewBuffer({2}, at::kFloat).is_meta());
  }
  EXPECT_FALSE(NewParameter({2}, at::kFloat).is_meta());
}

TEST(EmptyWeightsGuardTest, AMultiGigabyteModelCostsNoMemory) {
  const int64_t before = VirtualBytes();
  std::vector<std::shared_ptr<Block>> layers;
  {
    EmptyWeightsGuard empty;
    // 64 layers of hidden 4096 in bf16: 64 x 2 x 4096 x 16384 x 2 bytes = 17.2 GB.
    for (int i = 0; i < 64; ++i) layers.push_back(std::make_shared<Block>(4096));
  }
  const int64_t grown = VirtualBytes() - before;
  EXPECT_LT(grown, int64_t{256} << 20) << "grew by " << grown << " bytes";
  EXPECT_TRUE(layers[63]->up.is_meta());
  EXPECT_EQ(layers[63]->up.sizes(), (std::vector<int64_t>{16384, 4096}));
  EXPECT_FALSE(layers[63]->scale.is_meta());
}

TEST(SetModuleTensorTest, MovesMetaToCpuInPlaceForEveryHandle) {
  torch::nn::Linear linear(4, 3);
  ASSERT_THAT(EmptyModule(*linear), IsOk());
  EXPECT_TRUE(linear->weight.is_meta());
  EXPECT_TRUE(linear->named_parameters()["bias"].is_meta());

  at::Tensor w = at::arange(12, at::kFloat).reshape({3, 4});
  ASSERT_THAT(SetModuleTensor(*linear, "weight", at::kCPU, w), IsOk());
  ASSERT_THAT(SetModuleTensor(*linear, "bias", at::kCPU, at::zeros({3})), IsOk());
  // The member, the registered parameter and the value share one buffer: no copy.
  EXPECT_EQ(linear->weight.data_ptr(), w.data_ptr());
  EXPECT_EQ(linear->named_parameters()["weight"].data_ptr(), w.data_ptr());
  EXPECT_TRUE(linear->weight.requires_grad());
  at::Tensor y = linear->forward(at::ones({1, 4}));
  EXPECT_TRUE(at::equal(y, at::tensor({6.f, 22.f, 38.f}).reshape({1, 3})));
  y.sum().backward();
  EXPECT_EQ(linear->weight.grad().sizes(), w.sizes());

  ASSERT_THAT(SetModuleTensor(*linear, "weight", at::kMeta), IsOk());
  EXPECT_TRUE(linear->weight.is_meta());
}

TEST(SetModuleTensorTest, TiedParametersStayTied) {
  struct Tied : torch::nn::Module {
    Tied() {
      a = register_module("a", torch::nn::Linear(2, 2));
      b = register_module("b", torch::nn::Linear(2, 2));
      b->weight = a->weight;  // b's forward now uses a's TensorImpl
    }
    torch::nn::Linear a{nullptr}, b{nullptr};
  };
  Tied model;
  ASSERT_THAT(SetModuleTensor(model, "a.weight", at::kMeta), IsOk());
  EXPECT_TRUE(model.b->weight.is_meta());
  ASSERT_THAT(SetModuleTensor(model, "a.weight", at::kCPU, at::ones({2, 2})), IsOk());
  EXPECT_EQ(model.b->weight.sum().item<float>(), 4.0f);
}

TEST(SetModuleTensorTest, ConvertsDtypesButKeepsIntegerValues) {
  torch::nn::BatchNorm1d norm(4);
  ASSERT_THAT(SetModuleTensor(*norm, "weight", at::kCPU, at::ones({4}, at::kDouble)), IsOk());
  EXPECT_EQ(norm->weight.scalar_type(), at::kFloat);  // the tensor's own dtype
  ASSERT_THAT(SetModuleTensor(*norm, "weight", at::kCPU, at::ones({4}), at::kBFloat16), IsOk());
  EXPECT_EQ(norm->weight.scalar_type(), at::kBFloat16);
  ASSERT_THAT(
      SetModuleTensor(*norm, "num_batches_tracked", at::kCPU, at::scalar_tensor(7, at::kInt)),
      IsOk());
  EXPECT_EQ(norm->named_buffers()["num_batches_tracked"].scalar_type(), at::kInt);
  EXPECT_EQ(norm->named_buffers()["num_batches_tracked"].item<int>(), 7);
}

TEST(SetModuleTensorTest, ValuesMadeUnderInferenceModeBehaveAsNormalTensors) {
  torch::nn::Linear linear(2, 2);
  at::Tensor value;
  {
    c10::InferenceMode inference;
    value = at::ones({2, 2});
    ASSERT_TRUE(value.is_inference());
    ASSERT_THAT(SetModuleTensor(*linear, "weight", at::kCPU, value), IsOk());
  }
  EXPECT_FALSE(linear->weight.is_inference());
  linear->forward(at::ones({1, 2})).sum().backward();
  EXPECT_TRUE(linear->weight.grad().defined());
}

TEST(SetModuleTensorTest, AModelBuiltUnderInferenceModeStaysUsable) {
  // Its tensors are inference tensors (no version counter); what is moved
  // into them must be too, or the next view of them fails.
  c10::InferenceMode inference;
  torch::nn::Linear linear(2, 2);
  ASSERT_TRUE(linear->weight.is_inference());
  ASSERT_THAT(EmptyModule(*linear), IsOk());
  {
    c10::InferenceMode off(false);
    ASSERT_THAT(SetModuleTensor(*linear, "weight", at::kCPU, at::ones({2, 2})), IsOk());
    ASSERT_THAT(SetModuleTensor(*linear, "bias", at::kCPU, at::zeros({2})), IsOk());
  }
  EXPECT_EQ(linear->forward(at::ones({1, 2})).sum().item<float>(), 4.0f);
}

TEST(SetModuleTensorTest, ErrorsNameTheTensor) {
  torch::nn::Linear linear(4, 3);
  EXPECT_THAT(SetModuleTensor(*linear, "weight", at::kCPU, at::ones({4, 3})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'weight' has shape [3, 4]")));
  EXPECT_THAT(SetModuleTensor(*linear, "nope", at::kCPU, at::ones({1})),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope'")));
  ASSERT_THAT(SetModuleTensor(*linear, "bias", at::kMeta), IsOk());
  EXPECT_THAT(SetModuleTensor(*linear, "bias", at::kCPU),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs a value")));
}

}  // namespace
}  // namespace accel::dispatch
