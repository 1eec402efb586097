// dispatch/module_hooks.h: what runs around a module's forward, by the
// module's name. A model tells the dispatch core when each of its modules
// runs (models/internal/packed.h's InScope for accel's models, RunModule for
// any torch::nn::Module a program writes); the offload hooks of
// DispatchedModel bring that module's weights in for the call, and the hooks
// installed here let sharded training (train/fsdp.h) gather a wrapped unit's
// parameter shards just before it runs and free them after, with the
// gradient-time gather attached to the module's output.
//
//   ScopedModuleHooks installed(&sharded_model);   // for one forward
//   ACCEL_ASSIGN_OR_RETURN(at::Tensor h, RunModule("layers.0", [&] { return layer0->forward(x);
//   }));
#ifndef ACCEL_DISPATCH_MODULE_HOOKS_H_
#define ACCEL_DISPATCH_MODULE_HOOKS_H_

#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "core/status.h"

namespace accel::dispatch {

class ModuleHooks {
 public:
  virtual ~ModuleHooks() = default;
  // Before module `name` (its full dotted path in the model) runs.
  virtual absl::Status PreForward(absl::string_view name) = 0;
  // After it ran and returned `output`, which the hooks may replace (with
  // the same values: e.g. a tensor whose gradient hook runs before the
  // module's backward).
  virtual absl::StatusOr<at::Tensor> PostForward(absl::string_view name, at::Tensor output) = 0;
};

// The hooks installed on the calling thread (nullptr when none).
ModuleHooks* CurrentModuleHooks();

// Installs `hooks` on the calling thread for the scope's life (nullptr:
// none), restoring the previous ones after. Moves only.
class ScopedModuleHooks {
 public:
  explicit ScopedModuleHooks(ModuleHooks* hooks);
  ScopedModuleHooks(ScopedModuleHooks&& other) noexcept;
  ScopedModuleHooks& operator=(ScopedModuleHooks&&) = delete;
  ScopedModuleHooks(const ScopedModuleHooks&) = delete;
  ~ScopedModuleHooks();

 private:
  ModuleHooks* previous_ = nullptr;
  bool active_ = true;
};

// Runs `fn` (returning an at::Tensor) as module `name`: through the
// thread's hooks when there are any. libtorch exceptions come back as a
// Status.
template <typename Fn>
absl::StatusOr<at::Tensor> RunModule(absl::string_view name, Fn&& fn) {
  ModuleHooks* hooks = CurrentModuleHooks();
  if (hooks != nullptr) ACCEL_RETURN_IF_ERROR(hooks->PreForward(name));
  at::Tensor out;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] { out = fn(); }));
  if (hooks != nullptr) return hooks->PostForward(name, std::move(out));
  return out;
}

}  // namespace accel::dispatch

#endif  // ACCEL_DISPATCH_MODULE_HOOKS_H_
