#include "dispatch/module_hooks.h"

namespace accel::dispatch {
namespace {

// Per thread: a forward runs on one thread, and two models may train on two.
thread_local ModuleHooks* current_hooks = nullptr;

}  // namespace

ModuleHooks* CurrentModuleHooks() { return current_hooks; }

ScopedModuleHooks::ScopedModuleHooks(ModuleHooks* hooks) : previous_(current_hooks) {
  current_hooks = hooks;
}

ScopedModuleHooks::ScopedModuleHooks(ScopedModuleHooks&& other) noexcept
    : previous_(other.previous_) {
  other.active_ = false;
}

ScopedModuleHooks::~ScopedModuleHooks() {
  if (active_) current_hooks = previous_;
}

}  // namespace accel::dispatch
