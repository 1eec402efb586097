// DecodeGraphRunner (decode_graph_runner.h). The capture half is built
// where libtorch is a CUDA build (ACCEL_WITH_ENGINE_CUDA, set by
// engine/CMakeLists.txt) and syntax-checked elsewhere by
// scripts/cuda_compile_check.sh.
#include "engine/internal/decode_graph_runner.h"

#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

#include "core/status.h"

#ifdef ACCEL_WITH_ENGINE_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace accel::engine::internal {

#ifdef ACCEL_WITH_ENGINE_CUDA

struct DecodeGraphRunner::Graphs {
  std::map<int64_t, std::unique_ptr<at::cuda::CUDAGraph>> by_bucket;
  // One memory pool for every bucket's graph (vLLM's graph_pool): the
  // buckets never replay at once, so their intermediates can share it.
  decltype(at::cuda::graph_pool_handle()) pool = at::cuda::graph_pool_handle();
};

bool DecodeGraphRunner::CanCapture() { return true; }

absl::Status DecodeGraphRunner::Run(int64_t bucket, const std::function<void()>& step) {
  if (!capture_) return CallTorch(step);
  auto found = graphs_->by_bucket.find(bucket);
  if (found != graphs_->by_bucket.end()) {
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { found->second->replay(); }));
    ++replays_;
    return absl::OkStatus();
  }
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  const absl::Status captured = CallTorch([&] {
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    // The side stream starts after what the current one has queued (the
    // static inputs' copies), and the current one resumes after the capture.
    at::cuda::CUDAEvent inputs_ready;
    inputs_ready.record(current);
    inputs_ready.block(side);
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      step();  // warm-up, outside the capture
      side.synchronize();
      graph->capture_begin(graphs_->pool);
      try {
        step();
      } catch (...) {
        // End the capture (it fails too: the graph is invalid) so that the
        // side stream leaves capture mode, then report the step's error.
        try {
          graph->capture_end();
        } catch (...) {
        }
        throw;
      }
      graph->capture_end();
    }
    at::cuda::CUDAEvent captured_event;
    captured_event.record(side);
    captured_event.block(current);
    // The capture ran nothing: this step's outputs come from a replay.
    graph->replay();
  });
  if (!captured.ok()) {
    return absl::Status(captured.code(), absl::StrCat("capturing the decode step of batch ", bucket,
                                                      " as a CUDA graph: ", captured.message()));
  }
  graphs_->by_bucket.emplace(bucket, std::move(graph));
  ++replays_;
  return absl::OkStatus();
}

int64_t DecodeGraphRunner::graphs() const {
  return static_cast<int64_t>(graphs_->by_bucket.size());
}

#else

struct DecodeGraphRunner::Graphs {};

bool DecodeGraphRunner::CanCapture() { return false; }

absl::Status DecodeGraphRunner::Run(int64_t bucket, const std::function<void()>& step) {
  if (capture_) {
    return absl::UnimplementedError(
        absl::StrCat("CUDA graphs (decode batch ", bucket, "): this build's libtorch has no CUDA"));
  }
  return CallTorch(step);
}

int64_t DecodeGraphRunner::graphs() const { return 0; }

#endif

DecodeGraphRunner::DecodeGraphRunner(bool capture)
    : capture_(capture), graphs_(std::make_unique<Graphs>()) {}

DecodeGraphRunner::~DecodeGraphRunner() = default;

}  // namespace accel::engine::internal
