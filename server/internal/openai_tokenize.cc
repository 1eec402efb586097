#include "server/internal/openai_tokenize.h"

#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "core/json.h"
#include "server/internal/openai_convert.h"

namespace accel::server::internal {
namespace {

using json = nlohmann::ordered_json;

absl::Status FieldError(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

absl::StatusOr<json> ParseBody(absl::string_view body) {
  JsonLimits limits;
  limits.max_depth = kMaxOpenAiJsonDepth;
  limits.max_keys = kMaxOpenAiJsonKeys;
  absl::StatusOr<json> parsed = ParseOrderedJson(body, "the body", limits);
  if (!parsed.ok()) return parsed.status();
  if (!parsed->is_object()) return absl::InvalidArgumentError("the body must be a JSON object");
  return parsed;
}

const json* Field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status GetModel(const json& body, std::string& model) {
  if (const json* value = Field(body, "model")) {
    if (!value->is_string()) return FieldError("model", "expected a string");
    model = value->get<std::string>();
  }
  return absl::OkStatus();
}

absl::Status GetBool(const json& body, const char* name, bool& out) {
  if (const json* value = Field(body, name)) {
    if (!value->is_boolean()) return FieldError(name, "expected a boolean");
    out = value->get<bool>();
  }
  return absl::OkStatus();
}

std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body) {
  absl::StatusOr<json> parsed = ParseBody(body);
  if (!parsed.ok()) return parsed.status();
  const json& request = *parsed;
  TokenizeRequest out;
  if (absl::Status s = GetModel(request, out.input.model); !s.ok()) return s;
  const json* prompt = Field(request, "prompt");
  const json* messages = Field(request, "messages");
  if ((prompt == nullptr) == (messages == nullptr)) {
    return FieldError("prompt", "send exactly one of \"prompt\" and \"messages\"");
  }
  if (prompt != nullptr) {
    if (!prompt->is_string()) return FieldError("prompt", "expected a string");
    out.input.prompt = prompt->get<std::string>();
    out.add_special_tokens = true;
  } else {
    // The chat parser's rules (content parts, tool-call arguments, tools).
    json chat = json::object();
    chat["messages"] = *messages;
    if (const json* tools = Field(request, "tools")) chat["tools"] = *tools;
    absl::StatusOr<OpenAiRequest> rendered = ParseOpenAiRequest(OpenAiEndpoint::kChat, Dump(chat));
    if (!rendered.ok()) return rendered.status();
    out.input.chat = std::move(rendered->generation.chat);
    bool add_generation_prompt = true;
    if (absl::Status s = GetBool(request, "add_generation_prompt", add_generation_prompt);
        !s.ok()) {
      return s;
    }
    out.input.chat->add_generation_prompt = add_generation_prompt;
    out.add_special_tokens = false;
  }
  if (absl::Status s = GetBool(request, "add_special_tokens", out.add_special_tokens); !s.ok()) {
    return s;
  }
  return out;
}

std::string TokenizeResponse(const std::vector<int64_t>& tokens, int64_t max_model_len) {
  return Dump(json{{"count", tokens.size()},
                   {"max_model_len", max_model_len},
                   {"tokens", tokens},
                   {"token_strs", nullptr}});
}

absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(absl::string_view body,
                                                         int64_t vocab_size) {
  absl::StatusOr<json> parsed = ParseBody(body);
  if (!parsed.ok()) return parsed.status();
  const json& request = *parsed;
  DetokenizeRequest out;
  if (absl::Status s = GetModel(request, out.model); !s.ok()) return s;
  const json* tokens = Field(request, "tokens");
  if (tokens == nullptr) return FieldError("tokens", "required");
  if (!tokens->is_array()) return FieldError("tokens", "expected an array of token ids");
  out.tokens.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const json& id = (*tokens)[i];
    const std::string field = absl::StrCat("tokens[", i, "]");
    if (!id.is_number_integer()) return FieldError(field, "expected a token id (an integer)");
    if (id.is_number_unsigned() && id.get<uint64_t>() >= static_cast<uint64_t>(vocab_size)) {
      return FieldError(field, absl::StrCat("token id ", id.get<uint64_t>(),
                                            " is outside the vocabulary [0, ", vocab_size, ")"));
    }
    const int64_t value = id.get<int64_t>();
    if (value < 0 || value >= vocab_size) {
      return FieldError(field, absl::StrCat("token id ", value, " is outside the vocabulary [0, ",
                                            vocab_size, ")"));
    }
    out.tokens.push_back(value);
  }
  return out;
}

std::string DetokenizeResponse(const std::string& prompt) { return Dump(json{{"prompt", prompt}}); }

}  // namespace accel::server::internal
