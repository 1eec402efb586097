// engine/grammar_logits_processor.h: the logits processor of structured
// output (engine/structured_output.h): one grammar matcher per request,
// brought to the ids before each sampled position (rolled back over
// rejected drafts, forward over accepted tokens), then every token the
// grammar does not allow set to -inf, the stop tokens allowed only where the
// grammar may end. Composes with batching (one per request), preemption
// (the matcher follows the ids, not the steps), prefix caching and stop
// strings (both outside the sampling path) and speculative decoding (a draft
// the grammar refuses gets probability 0 and is rejected).
#ifndef ACCEL_ENGINE_GRAMMAR_LOGITS_PROCESSOR_H_
#define ACCEL_ENGINE_GRAMMAR_LOGITS_PROCESSOR_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/logits_processor.h"
#include "grammar/matcher.h"

namespace accel::engine {

// `prompt_tokens`: how many of Apply's `previous` ids are the prompt.
std::unique_ptr<LogitsProcessor> MakeGrammarLogitsProcessor(
    std::shared_ptr<grammar::CompiledGrammar> compiled, std::vector<int64_t> stop_token_ids,
    int64_t prompt_tokens);

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_GRAMMAR_LOGITS_PROCESSOR_H_
