// engine/penalty_logits_processor.h: OpenAI's logit_bias and presence /
// frequency penalties (SamplingParams), as a logits processor: each
// position's logits plus the biases, minus presence_penalty for every token
// generated before it and frequency_penalty times its count (drafts ahead of
// the position included, as they would be had they been sampled). And a
// processor that runs others in order (penalties, then a grammar's mask).
#ifndef ACCEL_ENGINE_PENALTY_LOGITS_PROCESSOR_H_
#define ACCEL_ENGINE_PENALTY_LOGITS_PROCESSOR_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/logits_processor.h"
#include "engine/request.h"

namespace accel::engine {

// Null when `params` asks for no bias and no penalty.
std::unique_ptr<LogitsProcessor> MakePenaltyLogitsProcessor(const SamplingParams& params,
                                                            int64_t prompt_tokens);

// Masks `stop_token_ids` (-inf) at every position before `min_tokens`
// tokens were generated (vLLM's min_tokens); null when min_tokens is 0 or
// there is no stop token.
std::unique_ptr<LogitsProcessor> MakeMinTokensLogitsProcessor(std::vector<int64_t> stop_token_ids,
                                                              int64_t min_tokens,
                                                              int64_t prompt_tokens);

// Runs `parts` (nulls skipped) in order; null when none is left, the one
// when one is.
std::unique_ptr<LogitsProcessor> ChainLogitsProcessors(
    std::vector<std::unique_ptr<LogitsProcessor>> parts);

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_PENALTY_LOGITS_PROCESSOR_H_
