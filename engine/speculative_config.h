// engine/speculative_config.h: speculative decoding's settings as vLLM's
// --speculative-config takes them, as JSON:
//
//   {"method": "ngram", "num_speculative_tokens": 4,
//    "prompt_lookup_min": 2, "prompt_lookup_max": 4}     prompt lookup: drafts
//        are the tokens that followed the longest n-gram (between min and
//        max) that ends the sequence and occurred earlier in it; no second
//        model
//   {"model": "/models/small", "num_speculative_tokens": 4}   a draft model
//        with the target's tokenizer ("method": "draft_model" may be given)
//
// Also "quantization" (the draft model's: none | int8 | nf4 | fp4, default
// the target's --quantize) and "disable_by_batch_size" (no drafts while this
// many requests or more decode at once; 0: never). Every other key is
// refused by name, as vLLM refuses unknown fields. Torch-free.
#ifndef ACCEL_ENGINE_SPECULATIVE_CONFIG_H_
#define ACCEL_ENGINE_SPECULATIVE_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::engine {

// The most drafts a step verifies per request.
inline constexpr int64_t kMaxSpeculativeTokens = 32;
// The longest n-gram prompt lookup matches.
inline constexpr int64_t kMaxPromptLookup = 64;

struct SpeculativeConfig {
  enum class Method { kNone, kNgram, kDraftModel };
  Method method = Method::kNone;
  int64_t num_speculative_tokens = 0;
  // kNgram: the n-gram lengths tried, longest first (vLLM's defaults: 5 and 5
  // when neither is given; one given sets the other).
  int64_t prompt_lookup_min = 0;
  int64_t prompt_lookup_max = 0;
  // kDraftModel: the draft's folder and its quantization (unset: the
  // target's).
  std::string model;
  std::optional<std::string> quantization;
  int64_t disable_by_batch_size = 0;

  bool enabled() const { return method != Method::kNone; }
};

// "ngram", "draft_model" ("none" for kNone).
absl::string_view SpeculativeMethodName(SpeculativeConfig::Method method);

// Parses --speculative_config. Empty text: speculation off. InvalidArgument
// naming the flag and the field: text that is not a JSON object, an unknown
// key, a value of the wrong type, no method and no model, an unknown method,
// num_speculative_tokens missing or outside [1, 32], prompt lookup bounds
// outside [1, 64] or min > max, lookup bounds with a draft model, a draft
// model without "model", a quantization other than none/int8/nf4/fp4, a
// negative disable_by_batch_size. The draft folder itself is checked when it
// loads (engine/llm_engine.h).
absl::StatusOr<SpeculativeConfig> ParseSpeculativeConfig(absl::string_view json);

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_SPECULATIVE_CONFIG_H_
