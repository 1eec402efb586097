#include "engine/speculative_config.h"

#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "core/json.h"

namespace accel::engine {
namespace {

constexpr char kFlag[] = "--speculative_config";

absl::Status Bad(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(kFlag, ": \"", field, "\" ", why));
}

absl::StatusOr<int64_t> Integer(const nlohmann::json& value, absl::string_view field, int64_t low,
                                int64_t high) {
  if (!value.is_number_integer()) return Bad(field, "must be an integer");
  const int64_t v = value.get<int64_t>();
  if (v < low || v > high) {
    return Bad(field, absl::StrCat("must be in [", low, ", ", high, "], got ", v));
  }
  return v;
}

}  // namespace

absl::string_view SpeculativeMethodName(SpeculativeConfig::Method method) {
  switch (method) {
    case SpeculativeConfig::Method::kNone:
      return "none";
    case SpeculativeConfig::Method::kNgram:
      return "ngram";
    case SpeculativeConfig::Method::kDraftModel:
      return "draft_model";
  }
  return "none";
}

absl::StatusOr<SpeculativeConfig> ParseSpeculativeConfig(absl::string_view text) {
  SpeculativeConfig config;
  if (text.empty()) return config;
  JsonLimits limits;
  limits.max_depth = 4;
  limits.max_keys = 64;
  limits.refuse_duplicate_keys = true;
  absl::StatusOr<nlohmann::json> parsed = ParseJson(text, kFlag, limits);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        parsed.status().message(),
        "; give an object such as {\"method\": \"ngram\", \"num_speculative_tokens\": 4}"));
  }
  const nlohmann::json json = *std::move(parsed);
  if (!json.is_object()) return absl::InvalidArgumentError(absl::StrCat(kFlag, ": not an object"));
  std::optional<std::string> method;
  bool has_min = false, has_max = false, has_tokens = false;
  for (const auto& [key, value] : json.items()) {
    if (key == "method") {
      if (!value.is_string()) return Bad(key, "must be a string");
      method = value.get<std::string>();
    } else if (key == "model") {
      if (!value.is_string() || value.get<std::string>().empty()) {
        return Bad(key, "must be a model folder (a non-empty string)");
      }
      config.model = value.get<std::string>();
    } else if (key == "num_speculative_tokens") {
      absl::StatusOr<int64_t> v = Integer(value, key, 1, kMaxSpeculativeTokens);
      if (!v.ok()) return v.status();
      config.num_speculative_tokens = *v;
      has_tokens = true;
    } else if (key == "prompt_lookup_min" || key == "prompt_lookup_max") {
      absl::StatusOr<int64_t> v = Integer(value, key, 1, kMaxPromptLookup);
      if (!v.ok()) return v.status();
      (key == "prompt_lookup_min" ? config.prompt_lookup_min : config.prompt_lookup_max) = *v;
      (key == "prompt_lookup_min" ? has_min : has_max) = true;
    } else if (key == "quantization") {
      if (!value.is_string()) return Bad(key, "must be a string");
      const std::string q = value.get<std::string>();
      if (q != "none" && q != "int8" && q != "nf4" && q != "fp4") {
        return Bad(key, absl::StrCat("must be none, int8, nf4 or fp4, got \"", q, "\""));
      }
      config.quantization = q;
    } else if (key == "disable_by_batch_size") {
      absl::StatusOr<int64_t> v = Integer(value, key, 0, int64_t{1} << 30);
      if (!v.ok()) return v.status();
      config.disable_by_batch_size = *v;
    } else {
      return Bad(key,
                 "is not a setting accel knows (method, model, num_speculative_tokens, "
                 "prompt_lookup_min, prompt_lookup_max, quantization, "
                 "disable_by_batch_size)");
    }
  }
  if (!method.has_value()) {
    if (config.model.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kFlag, ": give \"method\" (\"ngram\") or a draft \"model\" folder"));
    }
    method = config.model == "ngram" ? "ngram" : "draft_model";  // vLLM's older spelling
    if (*method == "ngram") config.model.clear();
  }
  if (*method == "ngram") {
    config.method = SpeculativeConfig::Method::kNgram;
    if (!config.model.empty()) return Bad("model", "is not used by the ngram method");
    if (config.quantization) return Bad("quantization", "is not used by the ngram method");
    if (!has_min && !has_max) config.prompt_lookup_min = config.prompt_lookup_max = 5;
    if (!has_min) config.prompt_lookup_min = std::min<int64_t>(config.prompt_lookup_max, 5);
    if (!has_max) config.prompt_lookup_max = std::max<int64_t>(config.prompt_lookup_min, 5);
    if (config.prompt_lookup_min > config.prompt_lookup_max) {
      return Bad("prompt_lookup_min", absl::StrCat("(", config.prompt_lookup_min,
                                                   ") must not be above prompt_lookup_max (",
                                                   config.prompt_lookup_max, ")"));
    }
  } else if (*method == "draft_model") {
    config.method = SpeculativeConfig::Method::kDraftModel;
    if (config.model.empty()) return Bad("model", "is needed: the draft model's folder");
    if (has_min || has_max) {
      return Bad(has_min ? "prompt_lookup_min" : "prompt_lookup_max",
                 "is for the ngram method, not a draft model");
    }
  } else {
    return Bad("method",
               absl::StrCat("must be \"ngram\" or \"draft_model\", got \"", *method, "\""));
  }
  if (!has_tokens) return Bad("num_speculative_tokens", "is needed (how many drafts a step)");
  return config;
}

}  // namespace accel::engine
