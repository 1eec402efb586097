// train/grad_scaler.h: dynamic loss scaling for fp16 (torch.amp.GradScaler).
// libtorch 1.13 has no C++ GradScaler and its _amp_* ops have CUDA kernels
// only: on CUDA tensors this calls them, elsewhere a host implementation
// with the same rule (the unscale-and-check and the four-branch update).
//
//   ACCEL_ASSIGN_OR_RETURN(GradScaler scaler, GradScaler::Create({}));
//   scaler.Scale(loss).backward();
//   ACCEL_ASSIGN_OR_RETURN(bool stepped, scaler.Step(optimizer));
//   ACCEL_RETURN_IF_ERROR(scaler.Update());
#ifndef ACCEL_TRAIN_GRAD_SCALER_H_
#define ACCEL_TRAIN_GRAD_SCALER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace torch::optim {
class Optimizer;
}

namespace accel::train {

// Accelerate's GradScalerKwargs (and torch's defaults).
struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
};

// torch's GradScaler.state_dict(): {"scale", "growth_factor",
// "backoff_factor", "growth_interval", "_growth_tracker"}.
struct GradScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;
};

class GradScaler {
 public:
  // InvalidArgument unless growth_factor > 1, 0 < backoff_factor < 1,
  // growth_interval > 0 and init_scale > 0 (naming the field).
  static absl::StatusOr<GradScaler> Create(const GradScalerOptions& options);

  bool enabled() const;
  // loss * scale (the loss unchanged when disabled). The scale tensor is made
  // lazily on the loss's device, float32, as torch does.
  at::Tensor Scale(const at::Tensor& loss);
  // Divides the optimizer's gradients by the scale in place and records
  // whether any is inf or NaN. FailedPrecondition if called twice for one
  // optimizer before Update, InvalidArgument for fp16 gradients.
  absl::Status Unscale(torch::optim::Optimizer& optimizer);
  // Unscale if not done, then optimizer.step() unless an inf/NaN was found.
  // Returns whether the optimizer stepped.
  absl::StatusOr<bool> Step(torch::optim::Optimizer& optimizer);
  // The scale for the next iteration: backoff after an inf/NaN, growth after
  // growth_interval clean steps; or `new_scale` when given.
  absl::Status Update(std::optional<double> new_scale = std::nullopt);

  double scale() const;
  int64_t growth_tracker() const;
  // Whether the last Step skipped the optimizer (AcceleratedOptimizer.step_was_skipped).
  bool step_was_skipped() const;

  GradScalerState state() const;
  // InvalidArgument when disabled (torch's "empty state dict" rule) or invalid.
  absl::Status LoadState(const GradScalerState& state);

 private:
  GradScaler() = default;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// The update rule of _amp_update_scale_, on host values (shared by the host
// path and its test): returns {new scale, new growth tracker}.
std::pair<double, int64_t> UpdateScaleRule(double scale, int64_t growth_tracker, bool found_inf,
                                           double growth_factor, double backoff_factor,
                                           int64_t growth_interval);

}  // namespace accel::train

#endif  // ACCEL_TRAIN_GRAD_SCALER_H_
