#include "engine/request.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace accel::engine {
namespace {

absl::Status Bad(absl::string_view name, double value, const char* want) {
  return absl::InvalidArgumentError(absl::StrCat(name, " must be ", want, ", got ", value));
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    return Bad("temperature", p.temperature, "0 or more");
  if (p.top_k < 0) return Bad("top_k", static_cast<double>(p.top_k), "0 (off) or more");
  if (!(p.top_p > 0 && p.top_p <= 1)) return Bad("top_p", p.top_p, "in (0, 1]");
  if (!(p.min_p >= 0 && p.min_p <= 1)) return Bad("min_p", p.min_p, "in [0, 1]");
  // The penalty divides or multiplies logits, computed in float64 (Sampler::Process). Inside
  // [1e-30, 1e30] any float32 / bfloat16 / float16 logit (|x| <= 3.4e38, smallest 1.4e-45)
  // stays finite and nonzero after it, so the order it sets is exact; far past it, 1e-300 or
  // 1e300, products overflow to inf (and inf / inf is NaN), which drew the last token, often
  // eos, at every step (issue 19). Such values are refused rather than clamped: the client
  // asked for something that cannot be computed, and 1e30 already moves a logit by thirty
  // orders of magnitude, so nothing useful lies beyond. transformers and vLLM only ask > 0.
  if (!(p.repetition_penalty >= kMinRepetitionPenalty &&
        p.repetition_penalty <= kMaxRepetitionPenalty)) {
    return Bad("repetition_penalty", p.repetition_penalty, "in [1e-30, 1e30] (1: off)");
  }
  if (!(p.presence_penalty >= -2 && p.presence_penalty <= 2)) {
    return Bad("presence_penalty", p.presence_penalty, "in [-2, 2]");
  }
  if (!(p.frequency_penalty >= -2 && p.frequency_penalty <= 2)) {
    return Bad("frequency_penalty", p.frequency_penalty, "in [-2, 2]");
  }
  for (const auto& [id, bias] : p.logit_bias) {
    if (!(bias >= -100 && bias <= 100)) {
      return Bad(absl::StrCat("logit_bias[", id, "]"), bias, "in [-100, 100]");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateGenerationRequest(const GenerationRequest& request,
                                       const RequestLimits& limits) {
  const int64_t prompt = static_cast<int64_t>(request.prompt_ids.size());
  if (prompt == 0) {
    return absl::InvalidArgumentError(request.prompt.has_value()
                                          ? "prompt: the text encodes to no tokens"
                                          : "the prompt is empty");
  }
  for (const auto& [id, bias] : request.sampling.logit_bias) {
    if (id < 0 || id >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logit_bias: token id ", id, " is outside the vocabulary [0, ", limits.vocab_size, ")"));
    }
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
  if (request.n < 1 || request.n > kMaxChoices) {
    return absl::InvalidArgumentError(
        absl::StrCat("n: must be in [1, ", kMaxChoices, "], got ", request.n));
  }
  if (request.min_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_tokens: must be 0 or more, got ", request.min_tokens));
  }
  if (request.max_new_tokens > 0 && request.min_tokens > request.max_new_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("min_tokens: ", request.min_tokens,
                                                   " is more than max_new_tokens (",
                                                   request.max_new_tokens, ")"));
  }
  for (size_t i = 0; i < request.stop_token_ids.size(); ++i) {
    const int64_t id = request.stop_token_ids[i];
    if (id < 0 || id >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids[", i, "]: token id ", id,
                                                     " is outside the vocabulary [0, ",
                                                     limits.vocab_size, ")"));
    }
  }
  if (absl::Status sampling = ValidateSamplingParams(request.sampling); !sampling.ok()) {
    return sampling;
  }
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

absl::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStop:
      return "stop";
  }
  return "length";
}

}  // namespace accel::engine
