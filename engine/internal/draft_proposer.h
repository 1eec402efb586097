// The draft model of speculative decoding: a small model of the target's
// vocabulary that proposes the next k tokens of each decoding request, one
// forward pass a token for the whole batch. Its keys and values live in a
// store of its own indexed by the target's block tables (the same block ids
// hold the same positions in both stores), so the scheduler's blocks,
// preemption and prefix caching serve both. It follows the target: after
// each target step it reads what the target computed that it has not
// (prompt chunks, accepted drafts, the new token), then drafts.
#ifndef ACCEL_ENGINE_INTERNAL_DRAFT_PROPOSER_H_
#define ACCEL_ENGINE_INTERNAL_DRAFT_PROPOSER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "engine/sampler.h"
#include "models/causal_lm.h"

namespace accel::engine::internal {

class DraftProposer {
 public:
  // `k`: the most drafts a step.
  DraftProposer(std::shared_ptr<models::CausalLM> model, dispatch::DispatchedModel* dispatched,
                int64_t num_blocks, int64_t block_size, int64_t k);

  // Draws for a sampled request come from `sampler`'s parameters with a
  // generator of their own.
  void Add(uint64_t id, const Sampler& sampler);
  void Remove(uint64_t id);
  // The request's cache starts again, with `prefix` tokens found in the
  // prefix cache (their blocks hold the draft's keys and values too: every
  // token the target computes, the draft reads in the same step).
  void Reset(uint64_t id, int64_t prefix);

  struct Job {
    uint64_t id = 0;
    absl::Span<const int64_t> ids;  // every token known, this step's included
    int64_t computed = 0;           // tokens whose keys and values the target holds
    absl::Span<const int32_t> block_table;
    int64_t max_drafts = 0;  // 0: read what the target computed, draft nothing
  };
  struct Proposal {
    std::vector<int64_t> tokens;
    at::Tensor probs;  // [tokens, draft vocab] float64 they were drawn from (sampled requests)
  };
  // On an error every request's keys and values count as before (draws made
  // are not undone).
  absl::StatusOr<std::map<uint64_t, Proposal>> Run(absl::Span<const Job> jobs);

  int64_t position_limit() const { return position_limit_; }
  int64_t kv_cache_bytes() const;
  const models::CausalLM& model() const { return *model_; }

 private:
  struct State {
    explicit State(Sampler s) : sampler(std::move(s)) {}
    Sampler sampler;
    models::KvCache cache;
    int64_t written = 0;  // positions whose keys and values are the tokens' now
  };
  std::shared_ptr<models::CausalLM> model_;
  dispatch::DispatchedModel* dispatched_;
  std::unique_ptr<models::KvBlockStore> store_;
  int64_t block_size_;
  int64_t k_;
  int64_t position_limit_;
  std::map<uint64_t, std::unique_ptr<State>> states_;
};

}  // namespace accel::engine::internal

#endif  // ACCEL_ENGINE_INTERNAL_DRAFT_PROPOSER_H_
