// A CUDA thread block (CTA) emulated on the host, for kernels written as
// host + device functions over an `Exec` (models/cuda/internal/paged_decode.h,
// quant/cuda/internal/gemv_mma.h): each thread of the block is a fiber
// (ucontext) on the calling thread, run until it reaches a barrier, so the
// threads advance from barrier to barrier as on the device, in a fixed order
// (deterministic). Exec offers what such code needs:
//   tid()                 threadIdx.x
//   Sync()                __syncthreads: every thread of the block
//   WarpSync()            __syncwarp: every thread of the warp
//   XorLanes(v, mask)     __shfl_xor_sync over the full warp: the value of the
//                         lane whose index differs in `mask`
//   WarpGather(p, n, all) every lane's n bytes at p, 32 * n bytes into `all`
//                         (what a warp-wide matrix instruction sees)
//
// It is stricter than the device: every thread of a warp must reach the same
// warp-level calls in the same order, and every thread of the block the same
// block barriers (the device needs that of a full-warp shuffle and of
// __syncthreads, and leaves the rest undefined). Run() returns a description
// of the first place where the threads did not meet, or "" when they did.
#ifndef ACCEL_TESTS_TESTING_CTA_EMULATOR_H_
#define ACCEL_TESTS_TESTING_CTA_EMULATOR_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <ucontext.h>
#include <vector>

namespace accel::testing {

class CtaEmulator {
 public:
  class Exec {
   public:
    int32_t tid() const { return tid_; }
    void Sync() { cta_->Wait(tid_, kBlockScope, kSync); }
    void WarpSync() { cta_->Wait(tid_, kWarpScope, kSync); }
    float XorLanes(float value, int32_t mask) {
      float all[32];
      WarpGather(&value, sizeof(value), all, kExchange + mask);
      return all[(tid_ ^ mask) % 32];
    }
    void WarpGather(const void* mine, size_t bytes, void* all) {
      WarpGather(mine, bytes, all, kGather + static_cast<int64_t>(bytes));
    }

   private:
    friend class CtaEmulator;
    Exec(CtaEmulator* cta, int32_t tid) : cta_(cta), tid_(tid) {}
    void WarpGather(const void* mine, size_t bytes, void* all, int64_t kind) {
      Fiber& self = cta_->fibers_[static_cast<size_t>(tid_)];
      // Two slot buffers by parity: a lane cannot write exchange k + 2
      // before every lane of its warp has read exchange k.
      const int parity = static_cast<int>(self.exchanges++ % 2);
      std::memcpy(cta_->Slot(parity, tid_), mine, bytes);
      cta_->Wait(tid_, kWarpScope, kind);
      const int32_t first = tid_ / 32 * 32;
      for (int32_t lane = 0; lane < 32; ++lane) {
        std::memcpy(static_cast<char*>(all) + static_cast<size_t>(lane) * bytes,
                    cta_->Slot(parity, first + lane), bytes);
      }
    }
    CtaEmulator* cta_;
    int32_t tid_;
  };

  // `threads` a multiple of 32.
  explicit CtaEmulator(int32_t threads, size_t stack_bytes = 64 * 1024)
      : threads_(threads), stack_bytes_(stack_bytes), fibers_(static_cast<size_t>(threads)) {
    for (Fiber& f : fibers_) f.stack.reset(new char[stack_bytes]);
    for (auto& slots : slots_) slots.resize(static_cast<size_t>(threads) * kSlotBytes);
  }
  CtaEmulator(const CtaEmulator&) = delete;
  CtaEmulator& operator=(const CtaEmulator&) = delete;

  int32_t threads() const { return threads_; }
  // Block barriers the last Run() passed.
  int64_t barriers() const { return barriers_; }

  // Runs body(exec) as every thread of one block.
  std::string Run(const std::function<void(Exec&)>& body) {
    body_ = &body;
    barriers_ = 0;
    for (size_t t = 0; t < fibers_.size(); ++t) {
      Fiber& f = fibers_[t];
      f.state = kRunnable;
      f.scope = f.kind = -1;
      f.exchanges = 0;
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack.get();
      f.context.uc_stack.ss_size = stack_bytes_;
      f.context.uc_link = &main_;
      makecontext(&f.context, &CtaEmulator::Start, 0);
    }
    for (;;) {
      for (size_t t = 0; t < fibers_.size(); ++t) {
        if (fibers_[t].state != kRunnable) continue;
        current_ = static_cast<int32_t>(t);
        running_ = this;
        swapcontext(&main_, &fibers_[t].context);
      }
      // Every thread has finished or waits. Release whole warps waiting at
      // the same warp-level call; else the whole block at the same barrier.
      bool released = false;
      for (int32_t w = 0; w < threads_ / 32; ++w) {
        std::string error;
        if (ReleaseWarp(w, &error)) released = true;
        if (!error.empty()) return error;
      }
      if (released) continue;
      int64_t kind = -1;
      int32_t waiting = 0, done = 0;
      for (size_t t = 0; t < fibers_.size(); ++t) {
        const Fiber& f = fibers_[t];
        if (f.state == kDone) {
          ++done;
          continue;
        }
        ++waiting;
        if (f.scope != kBlockScope) {
          return "thread " + std::to_string(t) + " waits at " + Describe(f.scope, f.kind) +
                 " while its warp cannot get there";
        }
        if (kind == -1) kind = f.kind;
        if (f.kind != kind) {
          return "block barrier " + std::to_string(barriers_) + ": thread " + std::to_string(t) +
                 " waits at " + Describe(f.scope, f.kind) + ", others at " +
                 Describe(kBlockScope, kind);
        }
      }
      if (waiting == 0) return "";
      if (done > 0) {
        return "block barrier " + std::to_string(barriers_) + ": " + std::to_string(done) +
               " threads finished while " + std::to_string(waiting) + " wait at " +
               Describe(kBlockScope, kind);
      }
      for (Fiber& f : fibers_) f.state = kRunnable;
      ++barriers_;
    }
  }

 private:
  static constexpr int64_t kSync = 0;
  static constexpr int64_t kExchange = 1000;  // + the lane mask
  static constexpr int64_t kGather = 2000;    // + the bytes
  static constexpr int64_t kBlockScope = 0, kWarpScope = 1;
  static constexpr size_t kSlotBytes = 64;
  enum State { kRunnable, kWaiting, kDone };

  struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    State state = kRunnable;
    int64_t scope = -1, kind = -1;  // what it waits at
    int64_t exchanges = 0;
  };

  static std::string Describe(int64_t scope, int64_t kind) {
    std::string what =
        kind == kSync       ? "Sync()"
        : kind >= kGather   ? "WarpGather(" + std::to_string(kind - kGather) + " bytes)"
        : kind >= kExchange ? "XorLanes(mask " + std::to_string(kind - kExchange) + ")"
                            : "?";
    if (kind == kSync && scope == kWarpScope) what = "WarpSync()";
    return what;
  }

  // Releases warp `w` when all its threads wait at the same warp-level call;
  // sets `error` when they wait at different ones or some have finished.
  bool ReleaseWarp(int32_t w, std::string* error) {
    int64_t kind = -1;
    int32_t at_warp = 0, done = 0, at_block = 0;
    for (int32_t lane = 0; lane < 32; ++lane) {
      const Fiber& f = fibers_[static_cast<size_t>(w * 32 + lane)];
      if (f.state == kDone) {
        ++done;
      } else if (f.scope == kBlockScope) {
        ++at_block;
      } else {
        ++at_warp;
        if (kind == -1) kind = f.kind;
        if (f.kind != kind) {
          *error = "warp " + std::to_string(w) + ": lane " + std::to_string(lane) + " waits at " +
                   Describe(kWarpScope, f.kind) + ", others at " + Describe(kWarpScope, kind);
          return false;
        }
      }
    }
    if (at_warp == 0) return false;
    if (at_warp != 32) {
      *error = "warp " + std::to_string(w) + ": " + std::to_string(at_warp) + " lanes wait at " +
               Describe(kWarpScope, kind) + " while " + std::to_string(done) + " finished and " +
               std::to_string(at_block) + " wait at a block barrier";
      return false;
    }
    for (int32_t lane = 0; lane < 32; ++lane) {
      fibers_[static_cast<size_t>(w * 32 + lane)].state = kRunnable;
    }
    return true;
  }

  char* Slot(int parity, int32_t tid) {
    return slots_[parity].data() + static_cast<size_t>(tid) * kSlotBytes;
  }

  static void Start() {
    CtaEmulator* cta = running_;
    const int32_t tid = cta->current_;
    Exec exec(cta, tid);
    (*cta->body_)(exec);
    cta->fibers_[static_cast<size_t>(tid)].state = kDone;
    // Returning resumes uc_link: the scheduler in Run().
  }

  void Wait(int32_t tid, int64_t scope, int64_t kind) {
    Fiber& f = fibers_[static_cast<size_t>(tid)];
    f.state = kWaiting;
    f.scope = scope;
    f.kind = kind;
    swapcontext(&f.context, &main_);
  }

  static inline thread_local CtaEmulator* running_ = nullptr;
  int32_t threads_;
  size_t stack_bytes_;
  std::vector<Fiber> fibers_;
  std::vector<char> slots_[2];
  ucontext_t main_;
  const std::function<void(Exec&)>* body_ = nullptr;
  int32_t current_ = 0;
  int64_t barriers_ = 0;
};

}  // namespace accel::testing

#endif  // ACCEL_TESTS_TESTING_CTA_EMULATOR_H_
