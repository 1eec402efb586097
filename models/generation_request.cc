#include "models/generation_request.h"

#include "absl/strings/str_cat.h"

#include "models/sampling.h"

namespace accel::models {

absl::Status ValidateGenerationRequest(const GenerationRequest& request,
                                       const RequestLimits& limits) {
  const int64_t prompt = static_cast<int64_t>(request.prompt_ids.size());
  if (prompt == 0) {
    return absl::InvalidArgumentError(request.prompt.has_value()
                                          ? "prompt: the text encodes to no tokens"
                                          : "the prompt is empty");
  }
  for (size_t i = 0; i < request.prompt_ids.size(); ++i) {
    const int64_t id = request.prompt_ids[i];
    if (id < 0 || id >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("input_ids[", i, "]: token id ", id,
                                                     " is outside the vocabulary [0, ",
                                                     limits.vocab_size, ")"));
    }
  }
  if (limits.max_input_tokens > 0 && prompt > limits.max_input_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("the prompt has ", prompt, " tokens, over the limit of ",
                     limits.max_input_tokens, " (", limits.input_limit_name, ")"));
  }
  if (request.top_logprobs < 0 || request.top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("top_logprobs must be in [0, ", kMaxTopLogprobs,
                                                   "], got ", request.top_logprobs));
  }
  if (request.top_logprobs > 0 && !request.logprobs) {
    return absl::InvalidArgumentError("top_logprobs needs logprobs");
  }
  if (request.max_new_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens must be 0 (the default) or more, got ", request.max_new_tokens));
  }
  if (limits.max_total_tokens > 0 && request.max_new_tokens > limits.max_total_tokens - prompt) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt (", prompt, " tokens) + max_new_tokens (", request.max_new_tokens,
                     ") is over the limit of ", limits.max_total_tokens, " tokens (",
                     limits.total_limit_name, ")"));
  }
  absl::Status sampling = Sampler::Create(request.sampling).status();
  if (!sampling.ok()) return sampling;
  for (size_t i = 0; i < request.stop_strings.size(); ++i) {
    if (request.stop_strings[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] is empty"));
    }
  }
  if (!request.stop_strings.empty() && !limits.has_text_streams) {
    return absl::InvalidArgumentError(
        "stop: this model has no tokenizer.json to match text with; stop strings need a "
        "tokenizer");
  }
  return absl::OkStatus();
}

}  // namespace accel::models
