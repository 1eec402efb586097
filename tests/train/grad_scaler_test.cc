// The gradient scaler: torch's update rule (test_grad_scaling_update_scale),
// Accelerate's GradScalerKwargs defaults, and a real optimizer that skips
// its step on inf/NaN gradients.
#include "train/grad_scaler.h"

#include <cmath>
#include <limits>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "tests/testing/status_matchers.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

TEST(UpdateScaleRule, TorchsSequence) {
  // growth 2, backoff 0.25, interval 2, scale 4, tracker 0.
  auto [s1, t1] = UpdateScaleRule(4.0, 0, false, 2.0, 0.25, 2);
  EXPECT_EQ(s1, 4.0);
  EXPECT_EQ(t1, 1);
  auto [s2, t2] = UpdateScaleRule(s1, t1, false, 2.0, 0.25, 2);
  EXPECT_EQ(s2, 8.0);
  EXPECT_EQ(t2, 0);
  auto [s3, t3] = UpdateScaleRule(s2, t2, true, 2.0, 0.25, 2);
  EXPECT_EQ(s3, 2.0);
  EXPECT_EQ(t3, 0);
}

TEST(GradScaler, KwargsDefaults) {
  GradScalerOptions o;
  o.init_scale = 1024;
  o.growth_factor = 2;
  auto scaler = GradScaler::Create(o);
  ASSERT_THAT(scaler, IsOk());
  GradScalerState s = scaler->state();
  EXPECT_EQ(s.scale, 1024.0);
  EXPECT_EQ(s.growth_factor, 2.0);
  EXPECT_EQ(s.backoff_factor, 0.5);
  EXPECT_EQ(s.growth_interval, 2000);
  EXPECT_EQ(s.growth_tracker, 0);
  EXPECT_TRUE(scaler->enabled());
  EXPECT_EQ(GradScalerOptions{}.init_scale, 65536.0);
}

TEST(GradScaler, OptionsAreChecked) {
  auto bad = [](auto mutate, const char* field) {
    GradScalerOptions o;
    mutate(o);
    EXPECT_THAT(GradScaler::Create(o),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(field)));
  };
  bad([](GradScalerOptions& o) { o.growth_factor = 1.0; }, "growth_factor");
  bad([](GradScalerOptions& o) { o.backoff_factor = 1.0; }, "backoff_factor");
  bad([](GradScalerOptions& o) { o.backoff_factor = 0; }, "backoff_factor");
  bad([](GradScalerOptions& o) { o.growth_interval = 0; }, "growth_interval");
  bad([](GradScalerOptions& o) { o.init_scale = -1; }, "init_scale");
}

struct TinyModel {
  torch::nn::Linear net{nullptr};
  std::unique_ptr<torch::optim::SGD> sgd;
  TinyModel() {
    at::manual_seed(0);
    net = torch::nn::Linear(3, 2);
    sgd = std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
  }
  at::Tensor Loss() { return net->forward(at::ones({4, 3})).pow(2).mean(); }
};

TEST(GradScaler, CleanStepsUnscaleExactlyAndGrow) {
  GradScalerOptions o;
  o.init_scale = 8;
  o.growth_interval = 2;
  auto scaler = GradScaler::Create(o);
  ASSERT_THAT(scaler, IsOk());
  TinyModel s;
  // The reference gradient, unscaled.
  s.Loss().backward();
  at::Tensor want = s.net->weight.grad().clone();
  s.sgd->zero_grad();
  scaler->Scale(s.Loss()).backward();
  EXPECT_TRUE(at::allclose(s.net->weight.grad(), want * 8));
  ASSERT_THAT(scaler->Unscale(*s.sgd), IsOk());
  EXPECT_TRUE(at::allclose(s.net->weight.grad(), want));
  EXPECT_THAT(scaler->Unscale(*s.sgd),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already")));
  at::Tensor before = s.net->weight.detach().clone();
  auto stepped = scaler->Step(*s.sgd);
  ASSERT_THAT(stepped, IsOk());
  EXPECT_TRUE(*stepped);
  EXPECT_FALSE(scaler->step_was_skipped());
  EXPECT_TRUE(at::allclose(s.net->weight, before - 0.1 * want));
  EXPECT_THAT(scaler->Step(*s.sgd),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("step() has already")));
  ASSERT_THAT(scaler->Update(), IsOk());
  EXPECT_EQ(scaler->scale(), 8);
  EXPECT_EQ(scaler->growth_tracker(), 1);
  // A second clean step reaches growth_interval: the scale doubles.
  s.sgd->zero_grad();
  scaler->Scale(s.Loss()).backward();
  ASSERT_THAT(scaler->Step(*s.sgd), IsOk());
  ASSERT_THAT(scaler->Update(), IsOk());
  EXPECT_EQ(scaler->scale(), 16);
  EXPECT_EQ(scaler->growth_tracker(), 0);
}

TEST(GradScaler, InfOrNanSkipsTheStepAndBacksOff) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    auto scaler = GradScaler::Create({});
    ASSERT_THAT(scaler, IsOk());
    TinyModel s;
    at::Tensor before = s.net->weight.detach().clone();
    scaler->Scale(s.Loss() * bad).backward();
    auto stepped = scaler->Step(*s.sgd);
    ASSERT_THAT(stepped, IsOk());
    EXPECT_FALSE(*stepped);
    EXPECT_TRUE(scaler->step_was_skipped());
    EXPECT_TRUE(at::equal(s.net->weight, before));
    ASSERT_THAT(scaler->Update(), IsOk());
    EXPECT_EQ(scaler->scale(), 32768);
    EXPECT_EQ(scaler->growth_tracker(), 0);
  }
}

TEST(GradScaler, StateRoundTripAndDisabled) {
  auto scaler = GradScaler::Create({});
  GradScalerState s = scaler->state();
  s.scale = 128;
  s.growth_tracker = 5;
  ASSERT_THAT(scaler->LoadState(s), IsOk());
  EXPECT_EQ(scaler->scale(), 128);
  EXPECT_EQ(scaler->growth_tracker(), 5);
  GradScalerState negative = s;
  negative.growth_tracker = -1;
  EXPECT_THAT(scaler->LoadState(negative),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("_growth_tracker")));
  s.backoff_factor = 2;
  EXPECT_THAT(scaler->LoadState(s),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("backoff_factor")));
  EXPECT_EQ(scaler->state().backoff_factor, 0.5);  // a refused state changes nothing
  ASSERT_THAT(scaler->Update(256.0), IsOk());
  EXPECT_EQ(scaler->scale(), 256);
  EXPECT_THAT(scaler->Update(0.0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("new_scale")));

  GradScalerOptions off;
  off.enabled = false;
  auto disabled = GradScaler::Create(off);
  TinyModel t;
  at::Tensor loss = t.Loss();
  EXPECT_TRUE(at::equal(disabled->Scale(loss), loss));
  loss.backward();
  auto stepped = disabled->Step(*t.sgd);
  ASSERT_THAT(stepped, IsOk());
  EXPECT_TRUE(*stepped);
  EXPECT_THAT(disabled->LoadState(GradScalerState{}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("disabled")));
}

TEST(GradScaler, UnscaleAfterStepIsRefused) {
  auto scaler = GradScaler::Create({});
  TinyModel s;
  scaler->Scale(s.Loss()).backward();
  ASSERT_THAT(scaler->Step(*s.sgd), IsOk());
  EXPECT_THAT(scaler->Unscale(*s.sgd),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("after step()")));
  // Update clears the per-optimizer record: the next iteration may unscale.
  ASSERT_THAT(scaler->Update(), IsOk());
  s.sgd->zero_grad();
  scaler->Scale(s.Loss()).backward();
  EXPECT_THAT(scaler->Unscale(*s.sgd), IsOk());
}

TEST(GradScaler, TwoOptimizersAreTrackedApart) {
  // An inf in one optimizer's gradients skips that one only; Update backs off.
  auto scaler = GradScaler::Create({});
  TinyModel a, b;
  at::Tensor a_before = a.net->weight.detach().clone();
  at::Tensor b_before = b.net->weight.detach().clone();
  (scaler->Scale(a.Loss()) + scaler->Scale(b.Loss() * std::numeric_limits<float>::infinity()))
      .backward();
  auto a_stepped = scaler->Step(*a.sgd);
  auto b_stepped = scaler->Step(*b.sgd);
  ASSERT_THAT(a_stepped, IsOk());
  ASSERT_THAT(b_stepped, IsOk());
  EXPECT_TRUE(*a_stepped);
  EXPECT_FALSE(*b_stepped);
  EXPECT_FALSE(at::equal(a.net->weight, a_before));
  EXPECT_TRUE(at::equal(b.net->weight, b_before));
  ASSERT_THAT(scaler->Update(), IsOk());
  EXPECT_EQ(scaler->scale(), 32768);
}

TEST(GradScaler, RefusesFp16Gradients) {
  auto scaler = GradScaler::Create({});
  at::Tensor w = at::ones({2}, at::kHalf).set_requires_grad(true);
  w.mutable_grad() = at::ones({2}, at::kHalf);
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  EXPECT_THAT(scaler->Unscale(sgd), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("Attempting to unscale FP16 gradients")));
}

}  // namespace
}  // namespace accel::train
