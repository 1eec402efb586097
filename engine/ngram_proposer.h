// engine/ngram_proposer.h: prompt lookup (vLLM's ngram method): the drafts
// for a sequence are the tokens that followed an earlier occurrence of its
// last n tokens, for the longest n in [min, max] that has one (the earliest
// occurrence of it, so a quote continues from the text being quoted).
// No model runs; an extractive answer (a summary, a quote, an edit of a
// file in the prompt) repeats long spans, which then cost one verification
// step instead of a step a token. Torch-free.
#ifndef ACCEL_ENGINE_NGRAM_PROPOSER_H_
#define ACCEL_ENGINE_NGRAM_PROPOSER_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace accel::engine {

class NgramProposer {
 public:
  NgramProposer(int64_t min_n, int64_t max_n, int64_t num_speculative_tokens)
      : min_n_(min_n), max_n_(max_n), k_(num_speculative_tokens) {}

  // Up to `limit` (at most num_speculative_tokens) drafts to follow `ids`;
  // empty when no n-gram matches.
  std::vector<int64_t> Propose(absl::Span<const int64_t> ids, int64_t limit) const;

 private:
  int64_t min_n_, max_n_, k_;
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_NGRAM_PROPOSER_H_
