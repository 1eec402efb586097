#include "train/grad_scaler.h"

#include <map>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/optimizer.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"

namespace accel::train {

std::pair<double, int64_t> UpdateScaleRule(double scale, int64_t growth_tracker, bool found_inf,
                                           double growth_factor, double backoff_factor,
                                           int64_t growth_interval) {
  // _amp_update_scale_'s rule (AmpKernels.cu), in float32 as its scale is.
  if (found_inf) {
    return {static_cast<float>(static_cast<float>(scale) * static_cast<float>(backoff_factor)), 0};
  }
  const int64_t successful = growth_tracker + 1;
  if (successful == growth_interval) {
    return {static_cast<float>(static_cast<float>(scale) * static_cast<float>(growth_factor)), 0};
  }
  return {scale, successful};
}

struct GradScaler::Impl {
  GradScalerOptions options;
  double scale = 0;  // lazily set from init_scale
  int64_t growth_tracker = 0;
  bool initialized = false;
  // Per optimizer (by address) since the last Update: unscaled? found inf?
  struct PerOptimizer {
    bool unscaled = false;
    bool stepped = false;
    bool found_inf = false;
  };
  std::map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer;
  bool step_was_skipped = false;
  // Where Scale saw the loss: the update runs there (_amp_update_scale_ on CUDA).
  c10::Device device = c10::Device(c10::DeviceType::CPU);
};

absl::StatusOr<GradScaler> GradScaler::Create(const GradScalerOptions& options) {
  if (!(options.init_scale > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GradScaler init_scale must be > 0, got ", options.init_scale));
  }
  if (!(options.growth_factor > 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GradScaler growth_factor must be > 1, got ", options.growth_factor));
  }
  if (!(options.backoff_factor > 0 && options.backoff_factor < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GradScaler backoff_factor must be in (0, 1), got ", options.backoff_factor));
  }
  if (options.growth_interval < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("GradScaler growth_interval must be >= 1, got ", options.growth_interval));
  }
  GradScaler scaler;
  scaler.impl_ = std::make_shared<Impl>();
  scaler.impl_->options = options;
  scaler.impl_->scale = static_cast<float>(options.init_scale);
  return scaler;
}

bool GradScaler::enabled() const { return impl_->options.enabled; }

at::Tensor GradScaler::Scale(const at::Tensor& loss) {
  if (!enabled()) return loss;
  impl_->initialized = true;
  impl_->device = loss.device();
  // torch multiplies by a float32 0-d tensor on the loss's device.
  return loss * at::full({}, impl_->scale, loss.options().dtype(at::kFloat));
}

namespace {

std::vector<at::Tensor> Grads(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) grads.push_back(p.mutable_grad());
    }
  }
  return grads;
}

}  // namespace

absl::Status GradScaler::Unscale(torch::optim::Optimizer& optimizer) {
  if (!enabled()) return absl::OkStatus();
  Impl::PerOptimizer& state = impl_->per_optimizer[&optimizer];
  // torch's stage is STEPPED after step(): that message wins.
  if (state.stepped) {
    return absl::FailedPreconditionError("unscale_() is being called after step()");
  }
  if (state.unscaled) {
    return absl::FailedPreconditionError(
        "unscale_() has already been called on this optimizer since the last update()");
  }
  std::vector<at::Tensor> grads = Grads(optimizer);
  for (const at::Tensor& g : grads) {
    if (g.scalar_type() == at::kHalf) {
      return absl::InvalidArgumentError("Attempting to unscale FP16 gradients.");
    }
  }
  // inv_scale in double, then float32, as torch computes it.
  const float inv_scale = static_cast<float>(1.0 / impl_->scale);
  bool found_inf = false;
  absl::Status status = CallTorch([&] {
    at::NoGradGuard no_grad;
    // Grouped by (device, dtype) as torch does; keyed by their string form.
    std::map<std::string, std::vector<at::Tensor>> groups;
    for (at::Tensor& g : grads) {
      groups[g.device().str() + "/" + c10::toString(g.scalar_type())].push_back(g);
    }
    for (auto& [key, list] : groups) {
      if (list[0].is_cuda()) {
        at::Tensor found =
            at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(list[0].device()));
        at::Tensor inv = at::full({1}, inv_scale, found.options());
        at::_amp_foreach_non_finite_check_and_unscale_(list, found, inv);
        found_inf = found_inf || found.item<float>() != 0;
        continue;
      }
      // The host rule: any non-finite value anywhere; then grads *= inv_scale.
      for (at::Tensor& g : list) {
        if (!at::isfinite(g).all().item<bool>()) found_inf = true;
        if (inv_scale != 1.0f) g.mul_(inv_scale);
      }
    }
  });
  if (!status.ok()) return Annotate(status, "unscaling gradients");
  state.unscaled = true;
  state.found_inf = found_inf;
  return absl::OkStatus();
}

absl::StatusOr<bool> GradScaler::Step(torch::optim::Optimizer& optimizer) {
  if (!enabled()) {
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { optimizer.step(); }));
    impl_->step_was_skipped = false;
    return true;
  }
  Impl::PerOptimizer& state = impl_->per_optimizer[&optimizer];
  if (state.stepped) {
    return absl::FailedPreconditionError("step() has already been called since the last update()");
  }
  if (!state.unscaled) ACCEL_RETURN_IF_ERROR(Unscale(optimizer));
  Impl::PerOptimizer& after = impl_->per_optimizer[&optimizer];
  after.stepped = true;
  if (after.found_inf) {
    impl_->step_was_skipped = true;
    return false;
  }
  ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] { optimizer.step(); }), "optimizer step"));
  impl_->step_was_skipped = false;
  return true;
}

absl::Status GradScaler::Update(std::optional<double> new_scale) {
  if (!enabled()) return absl::OkStatus();
  if (new_scale) {
    if (!(*new_scale > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("update(new_scale): ", *new_scale, " <= 0"));
    }
    impl_->scale = static_cast<float>(*new_scale);
  } else {
    bool found_inf = false;
    for (const auto& [opt, state] : impl_->per_optimizer) found_inf |= state.found_inf;
    if (impl_->device.is_cuda()) {
      // torch's own kernel on the scale's device (float32 scale, int32 tracker).
      ACCEL_RETURN_IF_ERROR(Annotate(
          CallTorch([&] {
            const auto on = at::TensorOptions().device(impl_->device);
            at::Tensor scale = at::full({1}, impl_->scale, on.dtype(at::kFloat));
            at::Tensor tracker = at::full({1}, impl_->growth_tracker, on.dtype(at::kInt));
            at::Tensor found = at::full({1}, found_inf ? 1.0 : 0.0, on.dtype(at::kFloat));
            at::_amp_update_scale_(scale, tracker, found, impl_->options.growth_factor,
                                   impl_->options.backoff_factor, impl_->options.growth_interval);
            impl_->scale = scale.item<float>();
            impl_->growth_tracker = tracker.item<int>();
          }),
          "updating the loss scale"));
    } else {
      std::tie(impl_->scale, impl_->growth_tracker) = UpdateScaleRule(
          impl_->scale, impl_->growth_tracker, found_inf, impl_->options.growth_factor,
          impl_->options.backoff_factor, impl_->options.growth_interval);
    }
  }
  impl_->per_optimizer.clear();
  return absl::OkStatus();
}

double GradScaler::scale() const { return impl_->scale; }
int64_t GradScaler::growth_tracker() const { return impl_->growth_tracker; }
bool GradScaler::step_was_skipped() const { return impl_->step_was_skipped; }

GradScalerState GradScaler::state() const {
  GradScalerState s;
  s.scale = impl_->scale;
  s.growth_factor = impl_->options.growth_factor;
  s.backoff_factor = impl_->options.backoff_factor;
  s.growth_interval = impl_->options.growth_interval;
  s.growth_tracker = impl_->growth_tracker;
  return s;
}

absl::Status GradScaler::LoadState(const GradScalerState& state) {
  if (!enabled()) {
    return absl::InvalidArgumentError(
        "GradScaler is disabled: there is no state to load into it (torch refuses the same)");
  }
  GradScalerOptions o = impl_->options;
  o.growth_factor = state.growth_factor;
  o.backoff_factor = state.backoff_factor;
  o.growth_interval = state.growth_interval;
  o.init_scale = state.scale;
  absl::StatusOr<GradScaler> check = Create(o);
  if (!check.ok()) return Annotate(check.status(), "loading the scaler state");
  if (state.growth_tracker < 0) {
    return absl::InvalidArgumentError("scaler state: _growth_tracker < 0");
  }
  impl_->options = o;
  impl_->scale = static_cast<float>(state.scale);
  impl_->growth_tracker = state.growth_tracker;
  return absl::OkStatus();
}

}  // namespace accel::train
