// engine/internal/cuda_sync_counter.h: how often the host waits for the CUDA
// device, counted while in scope, through libtorch's sync debug mode (what
// torch.cuda.set_sync_debug_mode("warn") turns on): every synchronizing
// operation libtorch runs (a copy to or from pageable host memory, item(),
// a stream synchronize) raises a warning, which the counter takes instead of
// printing. A step that waits inside its layers runs them with the host and
// the device taking turns; a decode step needs to wait only for its tokens.
//
//   CudaSyncCounter syncs;
//   ... engine.Step() ...
//   syncs.count();  // the waits; syncs.Sites() where they came from
//
// Built with ACCEL_WITH_ENGINE_CUDA (a CUDA libtorch); elsewhere Available()
// is false and nothing is counted. One counter at a time, on the thread
// that runs the steps (libtorch's warning handler is that thread's).
//
// Torch-free header.
#ifndef ACCEL_ENGINE_INTERNAL_CUDA_SYNC_COUNTER_H_
#define ACCEL_ENGINE_INTERNAL_CUDA_SYNC_COUNTER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accel::engine::internal {

class CudaSyncCounter {
 public:
  // Whether this build can count (a CUDA libtorch).
  static bool Available();

  CudaSyncCounter();
  ~CudaSyncCounter();
  CudaSyncCounter(const CudaSyncCounter&) = delete;
  CudaSyncCounter& operator=(const CudaSyncCounter&) = delete;

  // The waits since the counter was made.
  int64_t count() const;

  // The call stacks of the first waits (up to 256 of them; `frames` frames
  // each, libtorch's own frames included), each with how often it was seen,
  // most often first.
  std::vector<std::pair<std::string, int64_t>> Sites() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace accel::engine::internal

#endif  // ACCEL_ENGINE_INTERNAL_CUDA_SYNC_COUNTER_H_
