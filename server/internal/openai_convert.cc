#include "server/internal/openai_convert.h"

#include <cctype>
#include <cmath>
#include <limits>
#include <mutex>
#include <random>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "core/json.h"
#include "core/status.h"

namespace accel::server::internal {
namespace {

// Ordered: messages and tools reach the chat template in the client's key order.
using json = nlohmann::ordered_json;

// JSON text of a value; invalid UTF-8 (never expected: the texts are final
// decoded text) becomes U+FFFD rather than an exception.
std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

absl::Status FieldError(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

const char* TypeName(const json& value) {
  switch (value.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a number";
    default:
      return "an integer";
  }
}

absl::Status WrongType(absl::string_view field, absl::string_view expected, const json& got) {
  return FieldError(field, absl::StrCat("expected ", expected, ", got ", TypeName(got)));
}

// The field, or null when absent or null (OpenAI treats an explicit null as
// unset).
const json* Field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status GetInt(const json& body, const char* name, std::optional<int64_t>* out) {
  const json* value = Field(body, name);
  if (value == nullptr) return absl::OkStatus();
  if (value->is_number_integer()) {
    if (value->is_number_unsigned() &&
        value->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FieldError(name, "out of range");
    }
    *out = value->get<int64_t>();
    return absl::OkStatus();
  }
  // 3.0 is an integer to JavaScript clients.
  if (value->is_number_float()) {
    const double d = value->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
      *out = static_cast<int64_t>(d);
      return absl::OkStatus();
    }
  }
  return WrongType(name, "an integer", *value);
}

absl::Status GetNumber(const json& body, const char* name, std::optional<double>* out) {
  const json* value = Field(body, name);
  if (value == nullptr) return absl::OkStatus();
  if (!value->is_number()) return WrongType(name, "a number", *value);
  *out = value->get<double>();
  return absl::OkStatus();
}

absl::Status GetBool(const json& body, const char* name, std::optional<bool>* out) {
  const json* value = Field(body, name);
  if (value == nullptr) return absl::OkStatus();
  if (!value->is_boolean()) return WrongType(name, "a boolean", *value);
  *out = value->get<bool>();
  return absl::OkStatus();
}

// A message's content: a string, null, or an array of {type: "text", text}
// parts, joined.
absl::StatusOr<std::string> ContentText(const json& content, const std::string& field) {
  if (content.is_null()) return std::string();
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) {
    return WrongType(field, "a string, null or an array of content parts", content);
  }
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string part_field = absl::StrCat(field, "[", i, "]");
    if (!part.is_object()) return WrongType(part_field, "an object", part);
    auto type = part.find("type");
    if (type == part.end() || !type->is_string()) {
      return FieldError(part_field, "needs \"type\": \"text\"");
    }
    if (type->get<std::string>() != "text") {
      return FieldError(absl::StrCat(part_field, ".type"),
                        absl::StrCat("only text parts are supported, not \"",
                                     type->get<std::string>().substr(0, 32), "\""));
    }
    auto part_text = part.find("text");
    if (part_text == part.end() || !part_text->is_string()) {
      return FieldError(absl::StrCat(part_field, ".text"), "expected a string");
    }
    text += part_text->get<std::string>();
  }
  return text;
}

absl::Status ParseMessages(const json& body, const JsonLimits& limits, engine::ChatInput& chat) {
  const json* messages = Field(body, "messages");
  if (messages == nullptr) return FieldError("messages", "required");
  if (!messages->is_array()) return WrongType("messages", "an array", *messages);
  if (messages->empty()) return FieldError("messages", "must not be empty");
  json normalized = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& message = (*messages)[i];
    const std::string field = absl::StrCat("messages[", i, "]");
    if (!message.is_object()) return WrongType(field, "an object", message);
    auto role = message.find("role");
    if (role == message.end() || !role->is_string()) {
      return FieldError(absl::StrCat(field, ".role"), "required, a string");
    }
    json copy = message;
    // Text parts are joined into one string; null (an assistant turn that
    // only calls tools) stays null, as templates test `content is none`.
    auto content = message.find("content");
    if (content != message.end() && !content->is_null()) {
      absl::StatusOr<std::string> text = ContentText(*content, absl::StrCat(field, ".content"));
      if (!text.ok()) return text.status();
      copy["content"] = *std::move(text);
    }
    // The wire's tool-call arguments are JSON text; templates read them as
    // an object (transformers' and vLLM's shape).
    if (auto calls = copy.find("tool_calls"); calls != copy.end() && calls->is_array()) {
      for (size_t j = 0; j < calls->size(); ++j) {
        json& call = (*calls)[j];
        if (!call.is_object()) continue;
        auto function = call.find("function");
        if (function == call.end() || !function->is_object()) continue;
        auto arguments = function->find("arguments");
        if (arguments == function->end() || !arguments->is_string()) continue;
        const std::string where = absl::StrCat(field, ".tool_calls[", j, "].function.arguments");
        ACCEL_ASSIGN_OR_RETURN(*arguments,
                               ParseOrderedJson(arguments->get<std::string>(), where, limits));
      }
    }
    normalized.push_back(std::move(copy));
  }
  chat.messages_json = Dump(normalized);
  if (const json* tools = Field(body, "tools")) {
    if (!tools->is_array()) return WrongType("tools", "an array", *tools);
    if (!tools->empty()) chat.tools_json = Dump(*tools);
  }
  if (const json* choice = Field(body, "tool_choice")) {
    if (!choice->is_string() || (*choice != "auto" && *choice != "none")) {
      return FieldError("tool_choice",
                        "only \"auto\" and \"none\" are supported (the model's chat template "
                        "decides how tools are offered; no call is forced)");
    }
  }
  chat.add_generation_prompt = true;
  return absl::OkStatus();
}

absl::Status TokenIds(const json& array, const std::string& field, std::vector<int64_t>& ids) {
  for (size_t i = 0; i < array.size(); ++i) {
    const json& id = array[i];
    if (!id.is_number_integer()) {
      return WrongType(absl::StrCat(field, "[", i, "]"), "a token id (an integer)", id);
    }
    if (id.is_number_unsigned() &&
        id.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FieldError(absl::StrCat(field, "[", i, "]"), "out of range");
    }
    ids.push_back(id.get<int64_t>());
  }
  return absl::OkStatus();
}

// Completions: a string, [string], [ids] or [[ids]].
absl::Status ParsePrompt(const json& body, engine::GenerationRequest& out) {
  const json* prompt = Field(body, "prompt");
  if (prompt == nullptr) return FieldError("prompt", "required");
  if (prompt->is_string()) {
    out.prompt = prompt->get<std::string>();
    return absl::OkStatus();
  }
  if (!prompt->is_array()) {
    return WrongType("prompt", "a string, an array of one string or an array of token ids",
                     *prompt);
  }
  if (prompt->empty()) return FieldError("prompt", "must not be empty");
  const json& first = (*prompt)[0];
  if (first.is_string() || first.is_array()) {
    if (prompt->size() != 1) {
      return FieldError("prompt", "one prompt per request (this server does not batch prompts)");
    }
    if (first.is_string()) {
      out.prompt = first.get<std::string>();
      return absl::OkStatus();
    }
    return TokenIds(first, "prompt[0]", out.prompt_ids);
  }
  return TokenIds(*prompt, "prompt", out.prompt_ids);
}

absl::Status ParseStop(const json& body, std::vector<std::string>& stops) {
  const json* stop = Field(body, "stop");
  if (stop == nullptr) return absl::OkStatus();
  if (stop->is_string()) {
    stops.push_back(stop->get<std::string>());
    return absl::OkStatus();
  }
  if (!stop->is_array()) return WrongType("stop", "a string or an array of strings", *stop);
  if (stop->size() > 16) return FieldError("stop", "at most 16 stop strings");
  for (size_t i = 0; i < stop->size(); ++i) {
    if (!(*stop)[i].is_string()) {
      return WrongType(absl::StrCat("stop[", i, "]"), "a string", (*stop)[i]);
    }
    stops.push_back((*stop)[i].get<std::string>());
  }
  return absl::OkStatus();
}

absl::Status RequireZero(const json& body, const char* name) {
  std::optional<double> value;
  if (absl::Status s = GetNumber(body, name, &value); !s.ok()) return s;
  if (value && *value != 0) {
    return FieldError(name,
                      "is not supported by this server; send 0 or leave it out "
                      "(repetition_penalty is the penalty it supports)");
  }
  return absl::OkStatus();
}

absl::Status ParseBody(OpenAiEndpoint endpoint, const json& body, const JsonLimits& limits,
                       OpenAiRequest& out) {
  engine::GenerationRequest& g = out.generation;
  if (const json* model = Field(body, "model")) {
    if (!model->is_string()) return WrongType("model", "a string", *model);
    g.model = model->get<std::string>();
  }
  if (endpoint == OpenAiEndpoint::kChat) {
    engine::ChatInput chat;
    if (absl::Status s = ParseMessages(body, limits, chat); !s.ok()) return s;
    g.chat = std::move(chat);
  } else {
    if (absl::Status s = ParsePrompt(body, g); !s.ok()) return s;
  }

  std::optional<int64_t> max_tokens;
  const char* max_name = "max_tokens";
  if (endpoint == OpenAiEndpoint::kChat && Field(body, "max_completion_tokens") != nullptr) {
    max_name = "max_completion_tokens";
  }
  if (absl::Status s = GetInt(body, max_name, &max_tokens); !s.ok()) return s;
  if (max_tokens) {
    if (*max_tokens < 1) return FieldError(max_name, "must be at least 1");
    g.max_new_tokens = *max_tokens;
  }

  // OpenAI's default temperature is 1 (sampling); 0 is greedy.
  std::optional<double> temperature;
  if (absl::Status s = GetNumber(body, "temperature", &temperature); !s.ok()) return s;
  g.sampling.temperature = temperature.value_or(1.0);
  if (!(g.sampling.temperature >= 0 && g.sampling.temperature <= 2)) {
    return FieldError("temperature", absl::StrCat("must be in [0, 2], got ",
                                                  absl::StrFormat("%g", g.sampling.temperature)));
  }
  std::optional<double> top_p;
  if (absl::Status s = GetNumber(body, "top_p", &top_p); !s.ok()) return s;
  if (top_p) {
    if (!(*top_p > 0 && *top_p <= 1)) {
      return FieldError("top_p", absl::StrFormat("must be in (0, 1], got %g", *top_p));
    }
    g.sampling.top_p = *top_p;
  }
  // Extensions vLLM's OpenAI server accepts too.
  std::optional<int64_t> top_k;
  if (absl::Status s = GetInt(body, "top_k", &top_k); !s.ok()) return s;
  if (top_k) g.sampling.top_k = *top_k < 0 ? 0 : *top_k;  // -1: off, as vLLM
  std::optional<double> min_p;
  if (absl::Status s = GetNumber(body, "min_p", &min_p); !s.ok()) return s;
  if (min_p) g.sampling.min_p = *min_p;
  std::optional<double> repetition_penalty;
  if (absl::Status s = GetNumber(body, "repetition_penalty", &repetition_penalty); !s.ok()) {
    return s;
  }
  if (repetition_penalty) g.sampling.repetition_penalty = *repetition_penalty;
  std::optional<bool> ignore_eos;
  if (absl::Status s = GetBool(body, "ignore_eos", &ignore_eos); !s.ok()) return s;
  g.ignore_eos = ignore_eos.value_or(false);

  std::optional<int64_t> seed;
  if (absl::Status s = GetInt(body, "seed", &seed); !s.ok()) return s;
  if (seed) g.sampling.seed = static_cast<uint64_t>(*seed);
  if (absl::Status s = ParseStop(body, g.stop_strings); !s.ok()) return s;

  std::optional<int64_t> n;
  if (absl::Status s = GetInt(body, "n", &n); !s.ok()) return s;
  if (n && *n != 1) return FieldError("n", "only 1 is supported (one choice per request)");
  std::optional<int64_t> best_of;
  if (absl::Status s = GetInt(body, "best_of", &best_of); !s.ok()) return s;
  if (best_of && *best_of != 1) return FieldError("best_of", "only 1 is supported");
  std::optional<bool> echo;
  if (absl::Status s = GetBool(body, "echo", &echo); !s.ok()) return s;
  if (echo.value_or(false)) return FieldError("echo", "is not supported");
  if (const json* suffix = Field(body, "suffix")) {
    if (!suffix->is_string()) return WrongType("suffix", "a string", *suffix);
    if (!suffix->get<std::string>().empty()) return FieldError("suffix", "is not supported");
  }
  if (absl::Status s = RequireZero(body, "presence_penalty"); !s.ok()) return s;
  if (absl::Status s = RequireZero(body, "frequency_penalty"); !s.ok()) return s;
  if (const json* bias = Field(body, "logit_bias")) {
    if (!bias->is_object()) return WrongType("logit_bias", "an object", *bias);
    if (!bias->empty()) return FieldError("logit_bias", "is not supported");
  }
  if (const json* format = Field(body, "response_format")) {
    if (!format->is_object()) return WrongType("response_format", "an object", *format);
    auto type = format->find("type");
    if (type != format->end() && *type != "text") {
      return FieldError("response_format", "only {\"type\": \"text\"} is supported");
    }
  }
  if (const json* user = Field(body, "user")) {
    if (!user->is_string()) return WrongType("user", "a string", *user);
  }

  if (endpoint == OpenAiEndpoint::kChat) {
    std::optional<bool> logprobs;
    if (absl::Status s = GetBool(body, "logprobs", &logprobs); !s.ok()) return s;
    std::optional<int64_t> top;
    if (absl::Status s = GetInt(body, "top_logprobs", &top); !s.ok()) return s;
    out.logprobs = logprobs.value_or(false);
    if (top) {
      if (*top < 0 || *top > engine::kMaxTopLogprobs) {
        return FieldError("top_logprobs", absl::StrCat("must be in [0, ", engine::kMaxTopLogprobs,
                                                       "], got ", *top));
      }
      if (!out.logprobs && *top > 0) {
        return FieldError("top_logprobs", "needs \"logprobs\": true");
      }
      out.top_logprobs = *top;
    }
  } else {
    // Completions: logprobs is the number of top tokens, 0..5.
    const json* logprobs = Field(body, "logprobs");
    if (logprobs != nullptr && logprobs->is_boolean()) {
      // Some clients send the chat form; false is "off", true is 0 alternatives.
      out.logprobs = logprobs->get<bool>();
    } else {
      std::optional<int64_t> top;
      if (absl::Status s = GetInt(body, "logprobs", &top); !s.ok()) return s;
      if (top) {
        if (*top < 0 || *top > 5) {
          return FieldError("logprobs", absl::StrCat("must be in [0, 5], got ", *top));
        }
        out.logprobs = true;
        out.top_logprobs = *top;
      }
    }
  }
  g.logprobs = out.logprobs;
  g.top_logprobs = out.top_logprobs;

  std::optional<bool> stream;
  if (absl::Status s = GetBool(body, "stream", &stream); !s.ok()) return s;
  out.stream = stream.value_or(false);
  if (const json* options = Field(body, "stream_options")) {
    if (!options->is_object()) return WrongType("stream_options", "an object", *options);
    std::optional<bool> include_usage;
    if (absl::Status s = GetBool(*options, "include_usage", &include_usage); !s.ok()) {
      return FieldError("stream_options.include_usage", "expected a boolean");
    }
    out.include_usage = include_usage.value_or(false) && out.stream;
  }
  return absl::OkStatus();
}

std::string RandomId(absl::string_view prefix) {
  static std::mutex mu;
  static std::mt19937_64 engine{std::random_device{}()};
  uint64_t a, b;
  {
    std::lock_guard<std::mutex> lock(mu);
    a = engine();
    b = engine();
  }
  return absl::StrCat(prefix, absl::StrFormat("%016x%08x", a, b & 0xffffffffu));
}

json Bytes(absl::string_view text) {
  json bytes = json::array();
  for (unsigned char c : text) bytes.push_back(static_cast<int>(c));
  return bytes;
}

json Usage(const engine::Completion& completion) {
  return json{{"prompt_tokens", completion.prompt_tokens},
              {"completion_tokens", completion.generated_tokens},
              {"total_tokens", completion.prompt_tokens + completion.generated_tokens}};
}

std::string Event(const json& value) { return absl::StrCat("data: ", Dump(value), "\n\n"); }

// The first word of an InvalidArgument message when it names a field
// ("max_tokens: ..."), else empty.
std::string ParamOf(absl::string_view message) {
  const size_t colon = message.find(": ");
  if (colon > 64) return "";  // npos too
  const absl::string_view head = message.substr(0, colon);
  for (char c : head) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '[' ||
          c == ']')) {
      return "";
    }
  }
  return std::string(head);
}

}  // namespace

absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(OpenAiEndpoint endpoint, absl::string_view body,
                                                 const std::function<absl::Status()>& check) {
  JsonLimits limits;
  limits.max_depth = kMaxOpenAiJsonDepth;
  limits.max_keys = kMaxOpenAiJsonKeys;
  limits.check = check;
  absl::StatusOr<json> body_json = ParseOrderedJson(body, "the body", limits);
  if (!body_json.ok()) {
    if (!absl::IsInvalidArgument(body_json.status())) return body_json.status();
    return absl::InvalidArgumentError(absl::StrCat(
        body_json.status().message(), "; send Content-Type: application/json with a JSON object"));
  }
  json parsed = *std::move(body_json);
  if (!parsed.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the body must be a JSON object, got ", TypeName(parsed)));
  }
  OpenAiRequest out;
  out.endpoint = endpoint;
  absl::Status status;
  try {
    status = ParseBody(endpoint, parsed, limits, out);
  } catch (const json::exception& e) {  // a bug of ours; never a crash
    status = absl::InternalError(absl::StrCat("request parsing failed: ", e.what()));
  }
  if (!status.ok()) return status;
  return out;
}

OpenAiError ErrorForStatus(const absl::Status& status) {
  OpenAiError error;
  error.message = std::string(status.message());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      error.http_status = 400;
      error.type = "invalid_request_error";
      error.param = ParamOf(error.message);
      break;
    case absl::StatusCode::kNotFound:
      error.http_status = 404;
      error.type = "invalid_request_error";
      error.param = "model";
      error.code = "model_not_found";
      break;
    case absl::StatusCode::kUnauthenticated:
      error.http_status = 401;
      error.type = "invalid_request_error";
      error.code = "invalid_api_key";
      break;
    case absl::StatusCode::kPermissionDenied:
      error.http_status = 403;
      error.type = "invalid_request_error";
      break;
    case absl::StatusCode::kResourceExhausted:
      error.http_status = 429;
      error.type = "rate_limit_error";
      error.code = "rate_limit_exceeded";
      break;
    case absl::StatusCode::kUnavailable:
      error.http_status = 503;
      error.type = "server_error";
      error.code = "service_unavailable";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      error.http_status = 504;
      error.type = "server_error";
      error.code = "timeout";
      break;
    case absl::StatusCode::kCancelled:
      error.http_status = 499;
      error.type = "server_error";
      error.code = "cancelled";
      break;
    default:
      error.http_status = 500;
      error.type = "server_error";
      break;
  }
  return error;
}

std::string ErrorBody(const OpenAiError& error) {
  json body = {{"error",
                {{"message", error.message},
                 {"type", error.type},
                 {"param", error.param.empty() ? json(nullptr) : json(error.param)},
                 {"code", error.code.empty() ? json(nullptr) : json(error.code)}}}};
  return Dump(body);
}

const char* OpenAiFinishReason(engine::Finish finish) {
  switch (finish) {
    case engine::Finish::kEos:
    case engine::Finish::kStop:
      return "stop";
    case engine::Finish::kLength:
    case engine::Finish::kCancelled:
      return "length";
  }
  return "stop";
}

namespace {
json ModelJson(const std::string& model, int64_t created) {
  return json{{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "accel"}};
}
}  // namespace

std::string ModelObject(const std::string& model, int64_t created) {
  return Dump(ModelJson(model, created));
}

std::string ModelList(const std::string& model, int64_t created) {
  return Dump(json{{"object", "list"}, {"data", json::array({ModelJson(model, created)})}});
}

struct OpenAiResponseWriter::State {
  std::string text;
  // Chat: logprobs.content entries. Completions: the four parallel arrays.
  json content = json::array();
  json tokens = json::array();
  json token_logprobs = json::array();
  json top_logprobs = json::array();
  json text_offset = json::array();
  int64_t offset = 0;  // completions: text bytes so far, for text_offset

  // The logprobs of `chunk`'s tokens, appended to this state's arrays.
  void AddLogprobs(const OpenAiRequest& request, const TokenTextFn& token_text,
                   const engine::TokenChunk& chunk) {
    for (size_t i = 0; i < chunk.token_ids.size() && i < chunk.logprobs.size(); ++i) {
      const std::string token = token_text(chunk.token_ids[i]);
      const float logprob = chunk.logprobs[i];
      if (request.endpoint == OpenAiEndpoint::kChat) {
        json top = json::array();
        if (i < chunk.top_logprobs.size()) {
          for (const engine::TokenLogprob& t : chunk.top_logprobs[i]) {
            const std::string text = token_text(t.token_id);
            top.push_back({{"token", text}, {"logprob", t.logprob}, {"bytes", Bytes(text)}});
          }
        }
        content.push_back({{"token", token},
                           {"logprob", logprob},
                           {"bytes", Bytes(token)},
                           {"top_logprobs", std::move(top)}});
      } else {
        tokens.push_back(token);
        token_logprobs.push_back(logprob);
        json top = json::object();
        if (i < chunk.top_logprobs.size()) {
          for (const engine::TokenLogprob& t : chunk.top_logprobs[i]) {
            top[token_text(t.token_id)] = t.logprob;
          }
        }
        top_logprobs.push_back(std::move(top));
        text_offset.push_back(offset);
        offset += static_cast<int64_t>(token.size());
      }
    }
  }

  json Logprobs(const OpenAiRequest& request) const {
    if (!request.logprobs) return nullptr;
    if (request.endpoint == OpenAiEndpoint::kChat) return json{{"content", content}};
    return json{{"tokens", tokens},
                {"token_logprobs", token_logprobs},
                {"top_logprobs", top_logprobs},
                {"text_offset", text_offset}};
  }

  void ClearLogprobs() {
    content = json::array();
    tokens = json::array();
    token_logprobs = json::array();
    top_logprobs = json::array();
    text_offset = json::array();
  }
};

OpenAiResponseWriter::OpenAiResponseWriter(const OpenAiRequest& request, std::string model,
                                           TokenTextFn token_text, int64_t created, std::string id)
    : request_(request),
      model_(std::move(model)),
      token_text_(std::move(token_text)),
      created_(created),
      id_(std::move(id)),
      state_(std::make_unique<State>()) {
  if (id_.empty()) {
    id_ = RandomId(request.endpoint == OpenAiEndpoint::kChat ? "chatcmpl-" : "cmpl-");
  }
}

OpenAiResponseWriter::~OpenAiResponseWriter() = default;

void OpenAiResponseWriter::Add(const engine::TokenChunk& chunk) {
  state_->text += chunk.text;
  if (request_.logprobs) state_->AddLogprobs(request_, token_text_, chunk);
}

std::string OpenAiResponseWriter::Final(const engine::Completion& completion) const {
  const bool chat = request_.endpoint == OpenAiEndpoint::kChat;
  json choice;
  if (chat) {
    choice = {{"index", 0},
              {"message", {{"role", "assistant"}, {"content", state_->text}}},
              {"logprobs", state_->Logprobs(request_)},
              {"finish_reason", OpenAiFinishReason(completion.finish)}};
  } else {
    choice = {{"index", 0},
              {"text", state_->text},
              {"logprobs", state_->Logprobs(request_)},
              {"finish_reason", OpenAiFinishReason(completion.finish)}};
  }
  json body = {{"id", id_},
               {"object", chat ? "chat.completion" : "text_completion"},
               {"created", created_},
               {"model", model_},
               {"choices", json::array({std::move(choice)})},
               {"usage", Usage(completion)}};
  return Dump(body);
}

namespace {
json ChunkEnvelope(const OpenAiRequest& request, const std::string& id, int64_t created,
                   const std::string& model) {
  const bool chat = request.endpoint == OpenAiEndpoint::kChat;
  json chunk = {{"id", id},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created},
                {"model", model}};
  if (request.include_usage) chunk["usage"] = nullptr;
  return chunk;
}
}  // namespace

std::string OpenAiResponseWriter::StreamStart() const {
  if (request_.endpoint != OpenAiEndpoint::kChat) return "";
  json chunk = ChunkEnvelope(request_, id_, created_, model_);
  chunk["choices"] = json::array({{{"index", 0},
                                   {"delta", {{"role", "assistant"}, {"content", ""}}},
                                   {"logprobs", nullptr},
                                   {"finish_reason", nullptr}}});
  return Event(chunk);
}

std::string OpenAiResponseWriter::StreamChunk(const engine::TokenChunk& chunk) {
  const bool has_logprobs = request_.logprobs && !chunk.logprobs.empty();
  if (chunk.text.empty() && !has_logprobs) return "";
  state_->ClearLogprobs();
  if (has_logprobs) {
    // text_offset counts from the start of the whole completion (offset is kept).
    state_->AddLogprobs(request_, token_text_, chunk);
  }
  json out = ChunkEnvelope(request_, id_, created_, model_);
  if (request_.endpoint == OpenAiEndpoint::kChat) {
    out["choices"] = json::array({{{"index", 0},
                                   {"delta", {{"content", chunk.text}}},
                                   {"logprobs", state_->Logprobs(request_)},
                                   {"finish_reason", nullptr}}});
  } else {
    out["choices"] = json::array({{{"index", 0},
                                   {"text", chunk.text},
                                   {"logprobs", state_->Logprobs(request_)},
                                   {"finish_reason", nullptr}}});
  }
  return Event(out);
}

std::string OpenAiResponseWriter::StreamEnd(const engine::Completion& completion) const {
  json last = ChunkEnvelope(request_, id_, created_, model_);
  if (request_.endpoint == OpenAiEndpoint::kChat) {
    last["choices"] = json::array({{{"index", 0},
                                    {"delta", json::object()},
                                    {"logprobs", nullptr},
                                    {"finish_reason", OpenAiFinishReason(completion.finish)}}});
  } else {
    last["choices"] = json::array({{{"index", 0},
                                    {"text", ""},
                                    {"logprobs", nullptr},
                                    {"finish_reason", OpenAiFinishReason(completion.finish)}}});
  }
  std::string events = Event(last);
  if (request_.include_usage) {
    json usage = ChunkEnvelope(request_, id_, created_, model_);
    usage["choices"] = json::array();
    usage["usage"] = Usage(completion);
    events += Event(usage);
  }
  events += "data: [DONE]\n\n";
  return events;
}

std::string OpenAiResponseWriter::StreamError(const OpenAiError& error) {
  return absl::StrCat("data: ", ErrorBody(error), "\n\n", "data: [DONE]\n\n");
}

}  // namespace accel::server::internal
