// engine/scheduler.h: who runs in the next step and with how many tokens
// (vLLM v1's Scheduler). Pure policy: no tensors, no model. Given the
// waiting and running requests and the KV blocks (engine/kv_cache_manager.h)
// Schedule() returns a SchedulerOutput (who runs, how many tokens each, which
// of them are drafted tokens to verify, who was preempted); the model runner
// turns it into one forward pass, and UpdateFromOutput() takes what the pass
// sampled back: tokens appended, drafts that were rejected rolled back,
// stop tokens and length limits applied, full blocks cached, finished
// requests freed.
//
//   Scheduler scheduler(options, &kv);
//   scheduler.Add(id, request);
//   SchedulerOutput out = scheduler.Schedule();
//   ... runner.Execute(out) ...
//   std::vector<RequestUpdate> updates = scheduler.UpdateFromOutput(out, sampled);
//
// The policy, as the Generator had it before the engine was split:
// - Memory in blocks. A request waits until the blocks of its whole input
//   are free (after reusing a cached prefix); when a running request needs a
//   block and none is free, the most recently admitted request is preempted
//   (its blocks freed; it goes back to the front of the queue and is
//   recomputed when it resumes: prompt and generated tokens are prefilled
//   again, and its output goes on where it was).
// - Running requests go first, oldest first; waiting ones join in order
//   while memory and the budgets allow.
// - Chunked prefill: with max_num_batched_tokens, every decoding request's
//   token is budgeted first, drafted tokens next, and prompts are read in
//   chunks from what is left; when several prompts are to be read, one takes
//   at most half of that a step (vLLM's long_prefill_token_threshold).
// - Speculative decoding: a decoding request with drafts (SetDrafts) runs
//   1 + k tokens: its last sampled token and the k drafts, verified in the
//   same pass. Drafts are cut to the budget, to the request's remaining
//   max_new_tokens and the model's position limit, and dropped before anyone
//   is preempted for their blocks.
// - Steps in flight (pipeline parallel, vLLM's batch queue): the engine
//   core may schedule the next step before an earlier one's tokens are
//   back. A request in such a step (MarkInFlight, until UpdateFromOutput
//   takes its step back) has no next token yet: Schedule() skips it, never
//   preempts it, and the engine core defers finishing it, so the steps in
//   flight hold disjoint requests over the one block pool. A step may be
//   capped at some requests (Schedule's max_requests) so that the requests
//   split into several batches.
//
// Torch-free and not thread-safe: the engine core's thread owns it.
#ifndef ACCEL_ENGINE_SCHEDULER_H_
#define ACCEL_ENGINE_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "absl/types/span.h"

#include "engine/kv_cache_manager.h"
#include "engine/request.h"

namespace accel::engine {

struct SchedulerOptions {
  // Tokens in one step's forward pass: one per decoding request first, then
  // drafted tokens, then prompt chunks; 0: no limit (whole prompts). At
  // least 1 prompt token runs a step whatever the limit, so a prompt always
  // makes progress.
  int64_t max_num_batched_tokens = 0;
  int max_num_seqs = 0;  // requests holding blocks; 0: no limit
  // The most positions a request may use (prompt plus generated tokens).
  int64_t position_limit = 0;  // 0: no limit
  // Blocks reserved past a decoding request's step for a draft model, which
  // writes its own keys and values that far ahead (engine/model_runner.h);
  // dropped, not preempted for, when memory is short.
  int64_t lookahead_tokens = 0;
};

// One request as the scheduler tracks it.
struct SchedulerRequest {
  uint64_t id = 0;
  std::vector<int64_t> token_ids;  // prompt, then generated
  int64_t num_prompt_tokens = 0;
  // Tokens whose keys and values are in the cache (a prefix hit counts).
  int64_t num_computed_tokens = 0;
  int64_t max_new_tokens = 0;
  int64_t min_tokens = 0;        // a stop token ends it only after this many were generated
  bool prompt_logprobs = false;  // reads its whole prompt (no cached prefix)
  std::vector<int64_t> stop_token_ids;
  // Drafted tokens to verify in the next step.
  std::vector<int64_t> draft_token_ids;
  bool running = false;  // holds blocks

  int64_t num_output_tokens() const {
    return static_cast<int64_t>(token_ids.size()) - num_prompt_tokens;
  }
  // Tokens not in the cache yet (1 for a decoding request).
  int64_t num_pending_tokens() const {
    return static_cast<int64_t>(token_ids.size()) - num_computed_tokens;
  }
};

// One request in a step.
struct ScheduledRequest {
  uint64_t id = 0;
  // Its tokens so far (prompt and generated), valid until UpdateFromOutput.
  absl::Span<const int64_t> token_ids;
  int64_t num_computed_tokens = 0;  // before the step: where its chunk starts
  // Tokens of the step: token_ids[num_computed_tokens, +num_tokens - k)
  // followed by the k draft_token_ids.
  int64_t num_tokens = 0;
  std::vector<int64_t> draft_token_ids;
  // Reads the rest of its input: the step samples for it (1 + k positions).
  bool samples = false;
  // Its block table, valid until UpdateFromOutput.
  absl::Span<const int32_t> block_table;
};

struct SchedulerOutput {
  std::vector<ScheduledRequest> scheduled;  // in the order their tokens are packed
  // Preempted in this schedule: their keys and values are gone (the runner
  // drops its caches for them); they recompute when they resume.
  std::vector<uint64_t> preempted;
  int64_t total_tokens = 0;
  int64_t prompt_tokens = 0;  // tokens of requests reading their input (recomputation too)
};

// What the model runner sampled for one scheduled request.
struct SampledTokens {
  uint64_t id = 0;
  // Accepted drafts, then one token sampled by the target (empty for a
  // prompt chunk).
  std::vector<int64_t> token_ids;
  std::vector<std::optional<float>> logprobs;           // one per token
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // one per token
  std::vector<PromptLogprob> prompt_logprobs;           // with the first token, when asked
  int64_t num_drafts = 0;                               // drafts verified (k)
  int64_t num_accepted_drafts = 0;                      // of them, accepted
};

// The tokens one step added to one request.
struct RequestUpdate {
  uint64_t id = 0;
  std::vector<int64_t> token_ids;  // cut after a stop token or the length limit
  std::vector<std::optional<float>> logprobs;
  std::vector<std::vector<TokenLogprob>> top_logprobs;
  std::optional<FinishReason> finish;          // kEos or kLength; the scheduler freed it
  std::vector<PromptLogprob> prompt_logprobs;  // with a request's first token, when asked
};

class Scheduler {
 public:
  // `kv` outlives the scheduler.
  Scheduler(SchedulerOptions options, KvCacheManager* kv);

  // Queues a request (prompt_ids, max_new_tokens >= 1 and stop tokens as
  // the input processor left them) under a new id.
  void Add(uint64_t id, const GenerationRequest& request);
  // Drops a request, waiting or running, and frees its blocks; false if
  // unknown.
  bool Finish(uint64_t id);

  // At most `max_requests` requests in the step (0: no cap beyond
  // max_num_seqs); requests marked in flight are skipped.
  SchedulerOutput Schedule(int max_requests = 0);

  // The requests of `output` are in a step in flight until
  // UpdateFromOutput(output, ...) takes it back (or ClearInFlight).
  void MarkInFlight(const SchedulerOutput& output);
  // Every step in flight is abandoned (its requests can be scheduled, or
  // finished, again; their computed tokens did not move).
  void ClearInFlight() { in_flight_.clear(); }
  bool in_flight(uint64_t id) const { return in_flight_.count(id) > 0; }

  // Appends what `sampled` holds (one per request of `output` that sampled,
  // in any order) and returns the tokens each request got, cut at a stop
  // token, max_new_tokens or the position limit; those requests are done
  // and freed. Drafts rejected in verification are rolled back (they leave
  // num_computed_tokens), and drafts are cleared.
  std::vector<RequestUpdate> UpdateFromOutput(const SchedulerOutput& output,
                                              absl::Span<const SampledTokens> sampled);

  // Drafts to verify in `id`'s next step; ignored for a request that is not
  // decoding (it is reading its input, or unknown).
  void SetDrafts(uint64_t id, std::vector<int64_t> drafts);

  const SchedulerRequest* request(uint64_t id) const;
  size_t num_requests() const { return requests_.size(); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t preemptions() const { return preemptions_; }
  const SchedulerOptions& options() const { return options_; }

 private:
  void Preempt(uint64_t id);

  const SchedulerOptions options_;
  KvCacheManager* const kv_;
  std::map<uint64_t, SchedulerRequest> requests_;
  std::deque<uint64_t> waiting_;     // preempted first, then in arrival order
  std::vector<uint64_t> running_;    // holding blocks, in admission order
  std::vector<uint64_t> preempted_;  // by the Schedule() running now
  std::set<uint64_t> in_flight_;     // in a step not yet taken back
  int64_t preemptions_ = 0;
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_SCHEDULER_H_
