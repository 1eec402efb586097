// engine/engine_loop.h: the engine's step loop (vLLM v1's EngineCoreProc
// busy loop). One thread owns the engine core (EngineCoreInterface);
// requests wait in a bounded queue and are handed to it, at most
// max_batch_size at a time. The core decides by KV memory which of them run
// each step (admitting while blocks are free, preempting the newest when a
// running one needs a block, reading long prompts in chunks); the loop
// streams the tokens to each request's sink, and ends requests that finish,
// are cancelled or pass their deadline, which frees their blocks at once.
//
//   EngineLoop loop(std::move(core), options, &stat_logger);
//   ACCEL_ASSIGN_OR_RETURN(uint64_t id, loop.Submit(std::move(request), sink));
//   ...  // sink->OnTokens(...) per step, then sink->OnDone(status, completion)
//   loop.Cancel(id);  // the client went away
//
// Sinks are called on the loop's thread and must not block. One request's
// failure ends that request only: a step that fails is retried without the
// requests that joined in it, so a request that breaks the model (say, out
// of memory on its prompt) cannot take the others down. Torch-free.
#ifndef ACCEL_ENGINE_ENGINE_LOOP_H_
#define ACCEL_ENGINE_ENGINE_LOOP_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "engine/engine_core.h"
#include "engine/request.h"
#include "engine/stat_logger.h"

namespace accel::engine {

enum class Finish { kLength, kEos, kStop, kCancelled };

// The tokens one step produced for one request.
struct TokenChunk {
  std::vector<int64_t> token_ids;
  std::vector<float> logprobs;  // one per token when the request asked
  // One per token when the request asked for top_logprobs.
  std::vector<std::vector<TokenLogprob>> top_logprobs;
  std::string text;  // text that became final (may be empty)
  // The choice it belongs to (GenerationRequest::n), 0 for a single one.
  int64_t index = 0;
  // With n > 1: set on a choice's last chunk (how it ended, its own token
  // count), since OnDone comes once for all of them.
  std::optional<Finish> finish;
  int64_t generated_tokens = 0;  // with `finish`: the choice's tokens
  // GenerationRequest::prompt_logprobs: one per prompt token, in the
  // request's first chunk.
  std::vector<PromptLogprob> prompt_logprobs;
};

// "length", "eos", "stop", "cancelled".
const char* FinishName(Finish finish);

struct Completion {
  Finish finish = Finish::kLength;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  absl::Duration queue_time;           // accepted -> scheduled
  absl::Duration time_to_first_token;  // accepted -> first token (zero if none)
  absl::Duration total;                // accepted -> done
};

class RequestSink {
 public:
  virtual ~RequestSink() = default;
  virtual void OnTokens(TokenChunk chunk) = 0;
  // Called once, last. OK: finished as `completion.finish` says (kCancelled
  // when the server ended it, e.g. a drain past its grace period). Else:
  // Cancelled (the client cancelled), DeadlineExceeded, InvalidArgument or
  // ResourceExhausted (the engine core refused it), Internal (the model
  // failed) or Unavailable (the loop is shutting down).
  virtual void OnDone(const absl::Status& status, const Completion& completion) = 0;
};

struct EngineLoopOptions {
  // Requests handed to the engine core at once (running, or waiting there
  // for KV blocks): the most sequences in one step.
  int max_batch_size = 32;
  // Requests waiting; past it Submit is ResourceExhausted.
  int max_queue = 256;
};

class EngineLoop {
 public:
  // `stats` may be null; it outlives the loop.
  EngineLoop(std::unique_ptr<EngineCoreInterface> core, EngineLoopOptions options,
             StatLogger* stats);
  // Ends what is left with Unavailable and joins the thread.
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Queues a request and returns its id. ResourceExhausted when max_queue
  // requests already wait; Unavailable once StopAdmission() was called.
  absl::StatusOr<uint64_t> Submit(GenerationRequest request, std::shared_ptr<RequestSink> sink)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The request stops before the next step and its sink gets Cancelled.
  // Unknown or finished ids are ignored.
  void Cancel(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // From now on Submit answers Unavailable; queued and running requests go on.
  void StopAdmission() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until nothing waits or runs, or `timeout` passes; true when idle.
  bool WaitIdle(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends every queued and running request now with Finish::kCancelled and
  // the output so far.
  void CancelAll() ABSL_LOCKS_EXCLUDED(mu_);

  struct Snapshot {
    int waiting = 0;  // queued here, or in the engine core waiting for KV blocks
    int running = 0;  // holding KV blocks
    int64_t kv_cache_bytes = 0;
    int64_t steps = 0;
    EngineStats engine;  // as of the last step
  };
  Snapshot snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  const EngineLoopOptions& options() const { return options_; }

 private:
  struct Pending;
  struct Running;
  void Loop();
  void Admit(std::vector<std::unique_ptr<Pending>> admitted);
  void RunStep();
  void EndRunning(uint64_t sequence, const absl::Status& status, Finish finish);
  void EndPending(Pending& pending, const absl::Status& status);
  // Sets the gauges from the guarded state. Called under mu_ wherever that
  // state changes, so a scrape never sees an older value land after a newer
  // one (two threads publish: request handlers and the scheduler).
  void PublishGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Ended() ABSL_LOCKS_EXCLUDED(mu_);
  // Reads the engine core's stats into stats_ (and reports the counters).
  void UpdateStatsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const EngineLoopOptions options_;
  StatLogger* const logger_;
  std::unique_ptr<EngineCoreInterface> core_;  // the loop's thread only

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Pending>> waiting_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> cancels_ ABSL_GUARDED_BY(mu_);
  bool cancel_all_ ABSL_GUARDED_BY(mu_) = false;
  bool admitting_ ABSL_GUARDED_BY(mu_) = true;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Published by the loop's thread for snapshot() and WaitIdle().
  int running_count_ ABSL_GUARDED_BY(mu_) = 0;  // handed to the engine core
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;      // accepted and not yet ended
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;

  // The loop's thread only: running requests by the engine core's id.
  std::map<uint64_t, std::unique_ptr<Running>> running_;

  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_ENGINE_LOOP_H_
