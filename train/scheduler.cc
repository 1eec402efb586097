#include "train/scheduler.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <torch/optim/optimizer.h>

#include "absl/strings/str_cat.h"

namespace accel::train {

LRScheduler::LRScheduler(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {
  for (auto& group : optimizer_.param_groups()) base_lrs_.push_back(group.options().get_lr());
}

void LRScheduler::Initialize() {
  // torch's _initial_step(): one step from last_epoch -1 to 0.
  last_epoch_ = 0;
  step_count_ = 1;
  Apply();
}

void LRScheduler::Step() {
  ++step_count_;
  ++last_epoch_;
  Apply();
}

absl::Status LRScheduler::TryStep() {
  const std::optional<int64_t> total = total_steps();
  if (total && last_epoch_ + 1 > *total) {
    return absl::OutOfRangeError(absl::StrCat("Tried to step ", last_epoch_ + 1,
                                              " times. The specified number of total steps is ",
                                              *total));
  }
  Step();
  return absl::OkStatus();
}

void LRScheduler::Apply() {
  last_lrs_.clear();
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const double lr = LrAt(last_epoch_, g);
    groups[g].options().set_lr(lr);
    last_lrs_.push_back(lr);
  }
}

SchedulerState LRScheduler::state() const {
  SchedulerState s;
  s.last_epoch = last_epoch_;
  s.step_count = step_count_;
  s.base_lrs = base_lrs_;
  s.last_lrs = last_lrs_;
  return s;
}

absl::Status LRScheduler::LoadState(const SchedulerState& state) {
  if (state.base_lrs.size() != base_lrs_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler state has ", state.base_lrs.size(),
                                                   " parameter groups; the optimizer has ",
                                                   base_lrs_.size()));
  }
  base_lrs_ = state.base_lrs;
  last_epoch_ = state.last_epoch;
  step_count_ = state.step_count;
  Apply();
  return absl::OkStatus();
}

namespace {

class LambdaLR : public LRScheduler {
 public:
  LambdaLR(torch::optim::Optimizer& optimizer, std::function<double(int64_t)> factor)
      : LRScheduler(optimizer), factor_(std::move(factor)) {}

 protected:
  double LrAt(int64_t epoch, size_t group) const override {
    return base_lrs()[group] * factor_(epoch);
  }

 private:
  std::function<double(int64_t)> factor_;
};

class StepLR : public LRScheduler {
 public:
  StepLR(torch::optim::Optimizer& optimizer, int64_t step_size, double gamma)
      : LRScheduler(optimizer), step_size_(step_size), gamma_(gamma) {}

 protected:
  double LrAt(int64_t epoch, size_t group) const override {
    // Whole step_size periods completed: the division floors on purpose.
    const int64_t periods = epoch / step_size_;
    return base_lrs()[group] * std::pow(gamma_, static_cast<double>(periods));
  }

 private:
  int64_t step_size_;
  double gamma_;
};

class OneCycleLR : public LRScheduler {
 public:
  OneCycleLR(torch::optim::Optimizer& optimizer, const OneCycleOptions& o)
      : LRScheduler(optimizer), o_(o) {}
  std::optional<int64_t> total_steps() const override { return o_.total_steps; }

 protected:
  double LrAt(int64_t epoch, size_t) const override {
    const double initial = o_.max_lr / o_.div_factor;
    const double min_lr = initial / o_.final_div_factor;
    // torch's two phases (three_phase=False), cosine annealing. torch allows
    // last_epoch == total_steps (the last phase's pct is then past 1) and
    // raises beyond it; Step() stays at total_steps there, TryStep refuses.
    const double end_up = o_.pct_start * static_cast<double>(o_.total_steps) - 1;
    const double end_down = static_cast<double>(o_.total_steps) - 1;
    const double step = static_cast<double>(std::min(epoch, o_.total_steps));
    auto cosine = [](double start, double end, double pct) {
      return end + (start - end) / 2.0 * (std::cos(M_PI * pct) + 1);
    };
    if (step <= end_up) return cosine(initial, o_.max_lr, step / end_up);
    return cosine(o_.max_lr, min_lr, (step - end_up) / (end_down - end_up));
  }

 private:
  OneCycleOptions o_;
};

template <typename T, typename... Args>
std::unique_ptr<LRScheduler> Make(torch::optim::Optimizer& optimizer, Args&&... args) {
  auto s = std::make_unique<T>(optimizer, std::forward<Args>(args)...);
  s->Initialize();
  return s;
}

// Exposes Initialize() to Make (it is protected in the base).
template <typename Base>
class Init : public Base {
 public:
  using Base::Base;
  using Base::Initialize;
};

}  // namespace

std::unique_ptr<LRScheduler> MakeLambdaLR(torch::optim::Optimizer& optimizer,
                                          std::function<double(int64_t)> factor) {
  return Make<Init<LambdaLR>>(optimizer, std::move(factor));
}

std::unique_ptr<LRScheduler> MakeLinearWarmupLR(torch::optim::Optimizer& optimizer,
                                                int64_t warmup_steps, int64_t total_steps) {
  return MakeLambdaLR(optimizer, [warmup_steps, total_steps](int64_t step) {
    if (step < warmup_steps) {
      return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_steps));
    }
    return std::max(0.0, static_cast<double>(total_steps - step) /
                             static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps)));
  });
}

std::unique_ptr<LRScheduler> MakeCosineWarmupLR(torch::optim::Optimizer& optimizer,
                                                int64_t warmup_steps, int64_t total_steps) {
  return MakeLambdaLR(optimizer, [warmup_steps, total_steps](int64_t step) {
    if (step < warmup_steps) {
      return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_steps));
    }
    const double progress = static_cast<double>(step - warmup_steps) /
                            static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
    return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * 2.0 * 0.5 * progress)));
  });
}

std::unique_ptr<LRScheduler> MakeStepLR(torch::optim::Optimizer& optimizer, int64_t step_size,
                                        double gamma) {
  return Make<Init<StepLR>>(optimizer, std::max<int64_t>(1, step_size), gamma);
}

absl::StatusOr<std::unique_ptr<LRScheduler>> MakeOneCycleLR(torch::optim::Optimizer& optimizer,
                                                            const OneCycleOptions& options) {
  if (options.total_steps <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("OneCycleLR total_steps must be > 0, got ", options.total_steps));
  }
  if (!(options.pct_start > 0 && options.pct_start < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("OneCycleLR pct_start must be in (0, 1), got ", options.pct_start));
  }
  if (!(options.max_lr > 0) || !(options.div_factor > 0) || !(options.final_div_factor > 0)) {
    return absl::InvalidArgumentError(
        "OneCycleLR max_lr, div_factor, final_div_factor must be > 0");
  }
  if (options.pct_start * static_cast<double>(options.total_steps) == 1.0) {
    // The warm-up phase would span zero steps: torch divides by zero there.
    return absl::InvalidArgumentError(absl::StrCat(
        "OneCycleLR pct_start * total_steps must not be 1 (the warm-up phase would be empty), got ",
        options.pct_start, " * ", options.total_steps));
  }
  return Make<Init<OneCycleLR>>(optimizer, options);
}

}  // namespace accel::train
