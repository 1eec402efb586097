// engine/internal/decode_graph_runner.h: one CUDA graph per decode batch
// bucket (engine/decode_graphs.h), captured on first use and replayed after,
// as vLLM's CUDAGraphRunner: the step runs once on a side stream (warm-up:
// lazy allocations, cuBLAS handles and workspaces happen outside the
// capture), is captured on that stream into a graph sharing one memory pool
// with the other buckets' graphs, and is replayed on the current stream.
// Without capture (the cpu; a build whose libtorch has no CUDA;
// --enforce_eager) Run calls the step directly: the same padded step.
//
//   DecodeGraphRunner graphs(/*capture=*/DecodeGraphRunner::CanCapture());
//   ACCEL_RETURN_IF_ERROR(graphs.Run(bucket, [&] { logits.copy_(Step(static_ids)); }));
//
// A captured step must read only its bucket's static inputs and write only
// its static outputs, and do nothing that needs the host on the way: no
// .item(), no host logic on tensor values, no allocation whose size depends
// on values (docs/ARCHITECTURE.md, "CUDA graphs", lists what the decode path
// still does that breaks this).
//
// Torch-free header.
#ifndef ACCEL_ENGINE_INTERNAL_DECODE_GRAPH_RUNNER_H_
#define ACCEL_ENGINE_INTERNAL_DECODE_GRAPH_RUNNER_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"

namespace accel::engine::internal {

class DecodeGraphRunner {
 public:
  // Whether this build can capture CUDA graphs (libtorch is a CUDA build:
  // ACCEL_WITH_ENGINE_CUDA).
  static bool CanCapture();

  // capture: capture and replay (refused by Run where CanCapture() is
  // false); otherwise every Run calls the step.
  explicit DecodeGraphRunner(bool capture);
  ~DecodeGraphRunner();
  DecodeGraphRunner(const DecodeGraphRunner&) = delete;
  DecodeGraphRunner& operator=(const DecodeGraphRunner&) = delete;

  // Runs bucket `bucket`'s step: the first time captured (after a warm-up
  // run) and replayed, later replayed only. A failure (an exception of the
  // step, a capture libtorch refuses) is returned and leaves no graph for
  // the bucket, so the next Run tries again.
  absl::Status Run(int64_t bucket, const std::function<void()>& step);

  bool capturing() const { return capture_; }
  int64_t graphs() const;  // buckets captured so far
  int64_t replays() const { return replays_; }

 private:
  struct Graphs;
  bool capture_;
  std::unique_ptr<Graphs> graphs_;
  int64_t replays_ = 0;
};

}  // namespace accel::engine::internal

#endif  // ACCEL_ENGINE_INTERNAL_DECODE_GRAPH_RUNNER_H_
