// engine/rejection_sampler.h: which drafts the target model accepts
// (speculative sampling: Leviathan et al. 2023, "Fast Inference from
// Transformers via Speculative Decoding"; Chen et al. 2023). For draft i,
// with p the target's distribution at its position (after the request's
// processing: penalty, temperature, top-k/p, min-p) and q the draft's:
// accept with probability min(1, p(d_i) / q(d_i)); at the first rejection
// draw from norm(max(0, p - q)) instead and stop; when every draft is
// accepted draw one more token from p at the position after them. The
// tokens then have exactly the target's distribution. Prompt lookup's drafts
// are certain (q is one token with probability 1), so a draft is accepted
// with probability p(d_i) and the residual is p without d_i. At temperature
// 0 a draft is accepted when it is the target's argmax, and the token after
// is the argmax: exactly the tokens of decoding without drafts.
#ifndef ACCEL_ENGINE_REJECTION_SAMPLER_H_
#define ACCEL_ENGINE_REJECTION_SAMPLER_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/types/span.h"

#include "engine/logits_processor.h"
#include "engine/sampler.h"

namespace accel::engine {

struct Verification {
  std::vector<int64_t> token_ids;  // the accepted drafts, then the target's token
  int64_t accepted = 0;            // drafts accepted
};

// `logits` [1 + k, vocab]: the target's raw logits at the last token's
// position and at each draft's (k = drafts.size()); `previous` the ids
// before the first of them. `draft_probs` [k, draft vocab <= vocab] float64
// the distributions the drafts were drawn from, or undefined for certain
// drafts (prompt lookup). `processor` (may be null) sees each position's
// logits first. Draws come from `sampler`.
Verification VerifyDrafts(Sampler& sampler, const at::Tensor& logits,
                          absl::Span<const int64_t> previous, absl::Span<const int64_t> drafts,
                          const at::Tensor& draft_probs, LogitsProcessor* processor);

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_REJECTION_SAMPLER_H_
