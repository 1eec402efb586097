// engine/stat_logger.h: what the engine reports as it runs, for whoever
// exports it (vLLM v1's StatLoggerBase). The engine loop calls a StatLogger
// on its own thread at the points it changes: the server's implementation
// (server/server_metrics.h) turns the calls into Prometheus metrics under
// vLLM's names. Calls must not block. Torch-free.
#ifndef ACCEL_ENGINE_STAT_LOGGER_H_
#define ACCEL_ENGINE_STAT_LOGGER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

#include "engine/engine_core.h"

namespace accel::engine {

// The loop's state now (gauges).
struct SchedulerStats {
  int64_t running = 0;  // holding KV blocks
  int64_t waiting = 0;  // queued, or in the engine core waiting for blocks
  int64_t kv_cache_bytes = 0;
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_used = 0;
};

// One step.
struct IterationStats {
  int64_t batch_size = 0;        // requests running in it
  int64_t scheduled_tokens = 0;  // tokens of its forward pass
  int64_t generated_tokens = 0;  // tokens it gave
  double seconds = 0;
  // One entry per request that got its first token in this step, and one
  // per request that got a later token (once a step, whatever how many
  // tokens it got: speculative decoding gives several).
  std::vector<double> time_to_first_token;
  std::vector<double> inter_token_latency;
};

// A request that ended well.
struct FinishedRequestStats {
  std::string finish;  // "length", "eos", "stop", "cancelled"
  // Whether it reached the engine core (a request cancelled while queued did
  // not: it has no latency or tokens to count).
  bool scheduled = false;
  double e2e_seconds = 0;
  int64_t generated_tokens = 0;
};

class StatLogger {
 public:
  virtual ~StatLogger() = default;
  virtual void RecordScheduler(const SchedulerStats& stats) = 0;
  // The engine core's counters grew by `delta` (only its counter fields are
  // set: preemptions, prefix queries and hits, prompt tokens, speculative
  // decoding's).
  virtual void RecordCounters(const EngineStats& delta) = 0;
  virtual void RecordIteration(const IterationStats& stats) = 0;
  // A request was handed to the engine core after `queue_seconds`.
  virtual void RecordScheduled(double queue_seconds, int64_t prompt_tokens) = 0;
  // A request ended well, `finish` as the API names it ("length", "eos",
  // "stop", "cancelled").
  virtual void RecordFinished(const FinishedRequestStats& stats) = 0;
  // A request ended in an error, by reason: invalid, not_found, overloaded,
  // unavailable, cancelled, timeout, internal.
  virtual void RecordFailed(absl::string_view reason) = 0;
};

// `now` minus `before` in the counter fields (everything else zero).
EngineStats CountersSince(const EngineStats& now, const EngineStats& before);

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_STAT_LOGGER_H_
