// LR schedulers against torch's / transformers' formulas written out here.
#include "train/scheduler.h"

#include <cmath>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "tests/testing/status_matchers.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

struct Opt {
  at::Tensor w = at::zeros({2}).set_requires_grad(true);
  torch::optim::SGD sgd{std::vector<at::Tensor>{w}, torch::optim::SGDOptions(1.0)};
  double lr() { return sgd.param_groups()[0].options().get_lr(); }
};

TEST(LambdaLR, UpstreamLambdaTest) {
  Opt o;
  auto s = MakeLambdaLR(o.sgd, [](int64_t n) { return 1.0 - static_cast<double>(n) / 10; });
  EXPECT_EQ(s->last_epoch(), 0);
  EXPECT_EQ(s->step_count(), 1);
  EXPECT_DOUBLE_EQ(o.lr(), 1.0);
  s->Step();
  EXPECT_DOUBLE_EQ(o.lr(), 0.9);
  s->Step();
  EXPECT_DOUBLE_EQ(o.lr(), 0.8);
  EXPECT_EQ(s->step_count(), 3);
  s->IncrementStepCount();
  EXPECT_EQ(s->step_count(), 4);
  EXPECT_EQ(s->last_epoch(), 2);  // adjust_scheduler moves the count only
}

TEST(LinearWarmup, TransformersFormula) {
  Opt o;
  auto s = MakeLinearWarmupLR(o.sgd, 3, 10);
  for (int step = 0; step <= 12; ++step) {
    const double want = step < 3 ? step / 3.0 : std::max(0.0, (10.0 - step) / 7.0);
    EXPECT_NEAR(o.lr(), want, 1e-12) << step;
    s->Step();
  }
}

TEST(CosineWarmup, TransformersFormula) {
  Opt o;
  auto s = MakeCosineWarmupLR(o.sgd, 2, 12);
  for (int step = 0; step <= 12; ++step) {
    double want = step / 2.0;
    if (step >= 2) {
      const double progress = (step - 2) / 10.0;
      want = std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
    }
    EXPECT_NEAR(o.lr(), want, 1e-12) << step;
    s->Step();
  }
}

TEST(StepLR, GammaEveryStepSize) {
  Opt o;
  auto s = MakeStepLR(o.sgd, 3, 0.5);
  const double want[] = {1, 1, 1, 0.5, 0.5, 0.5, 0.25};
  for (double w : want) {
    EXPECT_DOUBLE_EQ(o.lr(), w);
    s->Step();
  }
}

TEST(OneCycleLR, TorchsCosinePhases) {
  Opt o;
  OneCycleOptions c;
  c.max_lr = 0.01;
  c.total_steps = 10;
  auto s = MakeOneCycleLR(o.sgd, c);
  ASSERT_THAT(s, IsOk());
  const double initial = 0.01 / 25, min_lr = initial / 1e4;
  const double up_end = 0.3 * 10 - 1, down_end = 9;
  auto cosine = [](double a, double b, double pct) {
    return b + (a - b) / 2 * (std::cos(M_PI * pct) + 1);
  };
  for (int step = 0; step < 10; ++step) {
    const double want = step <= up_end
                            ? cosine(initial, 0.01, step / up_end)
                            : cosine(0.01, min_lr, (step - up_end) / (down_end - up_end));
    EXPECT_NEAR(o.lr(), want, 1e-12) << step;
    (*s)->Step();
  }
  // torch allows last_epoch == total_steps: the last phase's pct passes 1.
  EXPECT_NEAR(o.lr(), cosine(0.01, min_lr, (10 - up_end) / (down_end - up_end)), 1e-12);
  EXPECT_EQ((*s)->total_steps(), 10);
  EXPECT_THAT(
      (*s)->TryStep(),
      StatusIs(absl::StatusCode::kOutOfRange,
               HasSubstr("Tried to step 11 times. The specified number of total steps is 10")));
  const double at_total = o.lr();
  (*s)->Step();  // stays at total_steps' lr rather than running off the cosine
  EXPECT_DOUBLE_EQ(o.lr(), at_total);
  OneCycleOptions bad = c;
  bad.total_steps = 0;
  EXPECT_THAT(MakeOneCycleLR(o.sgd, bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("total_steps")));
  bad = c;
  bad.pct_start = 0.1;  // a warm-up of zero steps: torch divides by zero
  EXPECT_THAT(MakeOneCycleLR(o.sgd, bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pct_start * total_steps")));
  bad = c;
  bad.max_lr = 0;
  EXPECT_THAT(MakeOneCycleLR(o.sgd, bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_lr")));
  bad = c;
  bad.pct_start = 1.5;
  EXPECT_THAT(MakeOneCycleLR(o.sgd, bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pct_start")));
}

TEST(OneCycleLR, ShortCycleStartsInTheSecondPhase) {
  // pct_start * total_steps - 1 < 0: torch's first phase ends before step 0.
  Opt o;
  OneCycleOptions c;
  c.max_lr = 1;
  c.total_steps = 3;
  auto s = MakeOneCycleLR(o.sgd, c);
  ASSERT_THAT(s, IsOk());
  const double up_end = 0.3 * 3 - 1, down_end = 2, min_lr = 1.0 / 25 / 1e4;
  for (int step = 0; step < 3; ++step) {
    const double pct = (step - up_end) / (down_end - up_end);
    EXPECT_NEAR(o.lr(), min_lr + (1 - min_lr) / 2 * (std::cos(M_PI * pct) + 1), 1e-12) << step;
    ASSERT_THAT((*s)->TryStep(), IsOk());
  }
}

TEST(LRScheduler, StateRoundTripContinuesIdentically) {
  Opt a, b;
  auto first = MakeLinearWarmupLR(a.sgd, 2, 20);
  for (int i = 0; i < 5; ++i) first->Step();
  auto second = MakeLinearWarmupLR(b.sgd, 2, 20);
  ASSERT_THAT(second->LoadState(first->state()), IsOk());
  EXPECT_EQ(second->last_epoch(), 5);
  EXPECT_EQ(second->step_count(), 6);
  for (int i = 0; i < 4; ++i) {
    first->Step();
    second->Step();
    EXPECT_DOUBLE_EQ(a.lr(), b.lr());
  }
  SchedulerState wrong = first->state();
  wrong.base_lrs.push_back(1.0);
  EXPECT_THAT(second->LoadState(wrong),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("parameter groups")));
}

TEST(LRScheduler, WorksWithAdam) {
  at::Tensor w = at::zeros({2}).set_requires_grad(true);
  torch::optim::Adam adam({w}, torch::optim::AdamOptions(0.5));
  auto s = MakeLambdaLR(adam, [](int64_t n) { return 1.0 / (1.0 + static_cast<double>(n)); });
  s->Step();
  EXPECT_DOUBLE_EQ(adam.param_groups()[0].options().get_lr(), 0.25);
}

}  // namespace
}  // namespace accel::train
