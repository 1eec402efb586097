// models/token_generator.h: what a server's scheduler needs of a generator,
// torch-free: add requests, step, cancel, and read its counters. Generator
// (models/generator.h) is the real one; the scheduler's tests use fakes that
// fail, stall or run out of KV blocks on demand.
#ifndef ACCEL_MODELS_TOKEN_GENERATOR_H_
#define ACCEL_MODELS_TOKEN_GENERATOR_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "models/generation_request.h"

namespace accel::models {

enum class FinishReason {
  kLength,  // max_new_tokens, or the model's position limit
  kEos,     // a stop token id was generated (it is the last of token_ids)
  kStop,    // a stop string appeared in the text (which ends before it)
};
// "length", "eos", "stop".
absl::string_view FinishReasonName(FinishReason reason);

// What one step produced for one sequence.
struct TokenLogprob {
  int64_t token_id = 0;
  float logprob = 0;
};

struct TokenEvent {
  uint64_t sequence = 0;
  int64_t token_id = 0;
  // log p(token) under the model's own distribution (log-softmax of the raw
  // logits, before sampling's processing); set when the request asked.
  std::optional<float> logprob;
  // The request's top_logprobs most likely tokens, most likely first.
  std::vector<TokenLogprob> top_logprobs;
  std::string text;  // text that became final with this token (may be empty)
  std::optional<FinishReason> finish;
};

// A generator's state and counters (the counters only grow).
struct GeneratorStats {
  int64_t running = 0;  // sequences holding KV blocks
  int64_t waiting = 0;  // added, or preempted, and waiting for blocks
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_used = 0;  // held by a sequence (cached free blocks are free)
  int64_t kv_block_size = 0;   // tokens a block
  int64_t kv_cache_bytes = 0;  // memory of the KV storage made so far
  int64_t preemptions = 0;
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t prompt_tokens = 0;      // prompt tokens computed (recomputation included)
  int64_t generation_tokens = 0;  // tokens sampled
  int64_t steps = 0;
  int64_t last_step_tokens = 0;  // tokens in the last step's forward pass
};

class TokenGenerator {
 public:
  virtual ~TokenGenerator() = default;
  // Validates and queues a request on prompt_ids; it starts in a later Step().
  virtual absl::StatusOr<uint64_t> Add(GenerationRequest request) = 0;
  // One step over what runs (and what memory lets join). On an error nothing
  // advanced: the step can be retried.
  virtual absl::StatusOr<std::vector<TokenEvent>> Step() = 0;
  // Drops a sequence and frees its memory at once; false if unknown.
  virtual bool Cancel(uint64_t sequence) = 0;
  virtual GeneratorStats stats() const = 0;
};

}  // namespace accel::models

#endif  // ACCEL_MODELS_TOKEN_GENERATOR_H_
