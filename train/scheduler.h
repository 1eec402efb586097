// train/scheduler.h: learning-rate schedulers for torch::optim optimizers
// (libtorch 1.13 ships StepLR only, without state). Each keeps torch's
// counters, last_epoch and _step_count, so Accelerate's stepping rules
// (AcceleratedScheduler) and a resumed run behave as in Python; the lrs are
// torch's closed forms.
#ifndef ACCEL_TRAIN_SCHEDULER_H_
#define ACCEL_TRAIN_SCHEDULER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace torch::optim {
class Optimizer;
}

namespace accel::train {

// torch's LRScheduler.state_dict() fields that matter to resume.
struct SchedulerState {
  int64_t last_epoch = 0;
  int64_t step_count = 1;  // _step_count: 1 after construction, as torch
  std::vector<double> base_lrs;
  std::vector<double> last_lrs;
};

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  // One tick: last_epoch += 1, then the lrs of every param group are set.
  // Past total_steps (OneCycleLR) the lrs stay at the last allowed step's.
  void Step();
  // Step, or OutOfRange past total_steps as torch's OneCycleLR raises
  // ("Tried to step N times. The specified number of total steps is T").
  absl::Status TryStep();
  int64_t last_epoch() const { return last_epoch_; }
  int64_t step_count() const { return step_count_; }
  // Accelerate's adjust_scheduler bumps _step_count alone.
  void IncrementStepCount() { ++step_count_; }
  const std::vector<double>& last_lrs() const { return last_lrs_; }
  // OneCycleLR's total_steps: Accelerate stops stepping past it.
  virtual std::optional<int64_t> total_steps() const { return std::nullopt; }

  SchedulerState state() const;
  // InvalidArgument when the number of param groups differs.
  absl::Status LoadState(const SchedulerState& state);

 protected:
  // Takes base_lrs from the optimizer's groups and applies lr(0) (torch's
  // constructor does one initial step to last_epoch 0).
  explicit LRScheduler(torch::optim::Optimizer& optimizer);
  void Initialize();
  // The lr of group `group` at last_epoch `epoch`.
  virtual double LrAt(int64_t epoch, size_t group) const = 0;
  const std::vector<double>& base_lrs() const { return base_lrs_; }

 private:
  void Apply();
  torch::optim::Optimizer& optimizer_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lrs_;
  int64_t last_epoch_ = 0;
  int64_t step_count_ = 1;
};

// LambdaLR: base_lr * factor(last_epoch).
std::unique_ptr<LRScheduler> MakeLambdaLR(torch::optim::Optimizer& optimizer,
                                          std::function<double(int64_t)> factor);
// transformers' get_linear_schedule_with_warmup.
std::unique_ptr<LRScheduler> MakeLinearWarmupLR(torch::optim::Optimizer& optimizer,
                                                int64_t warmup_steps, int64_t total_steps);
// transformers' get_cosine_schedule_with_warmup (num_cycles 0.5).
std::unique_ptr<LRScheduler> MakeCosineWarmupLR(torch::optim::Optimizer& optimizer,
                                                int64_t warmup_steps, int64_t total_steps);
// torch's StepLR.
std::unique_ptr<LRScheduler> MakeStepLR(torch::optim::Optimizer& optimizer, int64_t step_size,
                                        double gamma);
// torch's OneCycleLR (cosine annealing, three_phase false; lr only, no momentum cycling).
struct OneCycleOptions {
  double max_lr = 0.01;
  int64_t total_steps = 0;  // or epochs * steps_per_epoch
  double pct_start = 0.3;
  double div_factor = 25.0;
  double final_div_factor = 1e4;
};
absl::StatusOr<std::unique_ptr<LRScheduler>> MakeOneCycleLR(torch::optim::Optimizer& optimizer,
                                                            const OneCycleOptions& options);

}  // namespace accel::train

#endif  // ACCEL_TRAIN_SCHEDULER_H_
