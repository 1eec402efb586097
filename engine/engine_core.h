// engine/engine_core.h: one engine step (vLLM v1's EngineCore): the
// scheduler decides who runs (engine/scheduler.h), the model runner runs one
// forward pass and samples (engine/model_runner.h), the scheduler takes the
// tokens back, and the output processor turns them into text, stop strings
// and finish reasons (engine/output_processor.h). Requests join (Add) and
// leave (they finish, or Cancel) between steps: continuous batching on a
// paged KV cache, with preemption, prefix caching, chunked prefill and
// speculative decoding.
//
//   ACCEL_ASSIGN_OR_RETURN(auto runner, ModelRunner::Create(model, dispatched.get()));
//   EngineCore core(std::move(runner), TokenizerTextStreams(tokenizer));
//   ACCEL_ASSIGN_OR_RETURN(uint64_t id, core.Add(request));  // as the input processor left it
//   while (core.num_requests() > 0) {
//     ACCEL_ASSIGN_OR_RETURN(std::vector<TokenEvent> events, core.Step());
//     for (const TokenEvent& e : events) std::cout << e.text;  // streams valid UTF-8
//   }
//
// Torch-free header and code: the model is behind ModelRunnerInterface.
// Not thread-safe: one thread (the engine loop, engine/engine_loop.h)
// drives an EngineCore.
#ifndef ACCEL_ENGINE_ENGINE_CORE_H_
#define ACCEL_ENGINE_ENGINE_CORE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "engine/kv_cache_manager.h"
#include "engine/model_runner.h"
#include "engine/output_processor.h"
#include "engine/request.h"
#include "engine/scheduler.h"

namespace accel::engine {

// An engine core's state and counters (the counters only grow).
struct EngineStats {
  int64_t running = 0;  // requests holding KV blocks
  int64_t waiting = 0;  // added, or preempted, and waiting for blocks
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_used = 0;  // held by a request (cached free blocks are free)
  int64_t kv_block_size = 0;   // tokens a block
  int64_t kv_cache_bytes = 0;  // memory of the KV storage made so far
  int64_t preemptions = 0;
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t prompt_tokens = 0;      // prompt tokens computed (recomputation included)
  int64_t generation_tokens = 0;  // tokens generated
  int64_t steps = 0;
  int64_t last_step_tokens = 0;  // tokens in the last step's forward pass
  // Steps submitted while another was in flight (pipeline parallel: the
  // stages ran two steps at once).
  int64_t overlapped_steps = 0;
  // Speculative decoding, as vLLM counts it: drafts verified (a request's
  // drafts in one step are one draft), their tokens, the tokens accepted,
  // and the tokens accepted at each draft position (0: the first draft).
  int64_t spec_num_drafts = 0;
  int64_t spec_num_draft_tokens = 0;
  int64_t spec_num_accepted_tokens = 0;
  std::vector<int64_t> spec_accepted_per_position;
};

// What the engine loop needs of an engine core: add requests, step, cancel,
// read its counters. EngineCore is the real one; the loop's tests use fakes
// that fail, stall or run out of KV blocks on demand.
class EngineCoreInterface {
 public:
  virtual ~EngineCoreInterface() = default;
  // Queues a request (completed and validated by the input processor); it
  // starts in a later Step().
  virtual absl::StatusOr<uint64_t> Add(GenerationRequest request) = 0;
  // One step over what runs (and what memory lets join). On an error nothing
  // advanced: the step can be retried.
  virtual absl::StatusOr<std::vector<TokenEvent>> Step() = 0;
  // Drops a request and frees its memory at once; false if unknown.
  virtual bool Cancel(uint64_t id) = 0;
  virtual EngineStats stats() const = 0;
  // Steps submitted and not yet collected (pipeline parallel): the loop
  // keeps stepping while there are any, even with no request of its own
  // left (their requests were cancelled while in flight).
  virtual int64_t steps_in_flight() const { return 0; }
};

struct EngineCoreOptions {
  bool prefix_caching = true;  // also off where the runner cannot share blocks (LongRoPE)
  // Tokens in one step's forward pass (engine/scheduler.h); 0: no limit.
  int64_t max_num_batched_tokens = 0;
  int max_num_seqs = 0;  // requests holding blocks; 0: no limit
};

class EngineCore : public EngineCoreInterface {
 public:
  // Without `text_streams`, events carry no text.
  EngineCore(std::unique_ptr<ModelRunnerInterface> runner, TextStreamFactory text_streams,
             EngineCoreOptions options = {});
  ~EngineCore() override;
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

  // `request` as the input processor leaves it: prompt_ids, max_new_tokens
  // >= 1, stop tokens, valid sampling. The one check here is memory:
  // ResourceExhausted when the request could never fit the KV cache
  // (prompt + max_new_tokens, up to the position limit, over its tokens);
  // the input processor's limits keep that from happening in a server.
  absl::StatusOr<uint64_t> Add(GenerationRequest request) override;

  // One forward pass over what is scheduled, and the tokens of each request
  // that read its whole input (one, or with speculative decoding the
  // accepted drafts and one more). Finished requests are removed (their
  // blocks freed) before it returns. On an error nothing advances (caches
  // keep their length; no token is taken): the step can be retried.
  //
  // With a runner that keeps M > 1 steps in flight (a pipeline-parallel
  // model: ModelRunnerInterface::max_steps_in_flight), a Step is vLLM's
  // step_with_batch_queue: while fewer than M steps are in flight it
  // schedules the requests not in one (at most 1 / M of the requests, so
  // that M batches exist) and submits them, returning no events while the
  // queue fills; otherwise, or when nothing could be scheduled, it collects
  // the oldest step and returns its events. On an error every step in
  // flight is abandoned (none advanced).
  absl::StatusOr<std::vector<TokenEvent>> Step() override;

  // Drops a request, running or waiting, and frees its blocks at once; one
  // in a step in flight is dropped when that step is collected (its blocks
  // are being written), and gives no more events.
  bool Cancel(uint64_t id) override;
  int64_t steps_in_flight() const override { return static_cast<int64_t>(in_flight_.size()); }

  EngineStats stats() const override;
  // Requests added and not finished (running or waiting).
  size_t num_requests() const { return scheduler_.num_requests(); }
  // The most positions a request may use (prompt plus generated tokens).
  int64_t position_limit() const { return runner_->position_limit(); }
  // Tokens the KV cache holds in all.
  int64_t kv_capacity_tokens() const { return kv_.capacity_tokens(); }

 private:
  struct SubmittedStep {
    SchedulerOutput output;
    uint64_t ticket = 0;
  };
  absl::StatusOr<std::vector<TokenEvent>> StepWithBatchQueue();
  // The scheduler and counters take a step's tokens back; its events.
  std::vector<TokenEvent> TakeBack(const SchedulerOutput& scheduled, ModelRunnerOutput ran);
  // After an error: no step is in flight any more; deferred cancels run.
  void AbandonSteps();
  void RunDeferredCancels();

  std::unique_ptr<ModelRunnerInterface> runner_;
  const size_t max_in_flight_;            // the runner's max_steps_in_flight()
  std::deque<SubmittedStep> in_flight_;   // oldest first
  std::set<uint64_t> cancel_after_step_;  // cancelled while in a step in flight
  KvCacheManager kv_;
  Scheduler scheduler_;
  OutputProcessor output_;
  uint64_t next_id_ = 1;
  EngineStats counters_;
};

struct GenerationResult {
  std::vector<int64_t> token_ids;              // generated only
  std::vector<float> logprobs;                 // one per token when asked
  std::vector<PromptLogprob> prompt_logprobs;  // one per prompt token when asked
  std::string text;
  FinishReason finish_reason = FinishReason::kLength;
};

// Runs the requests together until each finishes; results in request order.
// For tools and tests: the requests must be complete (engine/input_processor.h).
absl::StatusOr<std::vector<GenerationResult>> Generate(EngineCoreInterface& core,
                                                       std::vector<GenerationRequest> requests);

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_ENGINE_CORE_H_
