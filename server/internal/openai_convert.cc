#include "server/internal/openai_convert.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "core/json.h"
#include "core/status.h"
#include "server/internal/openai_json.h"

namespace accel::server::internal {
namespace {

// Ordered: messages and tools reach the chat template in the client's key order.
using json = nlohmann::ordered_json;

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

// The most prompts one completions request may list.
constexpr size_t kMaxPrompts = 256;

// Completions: a string, [string, ...], [ids] or [[ids], ...]; `out` takes
// the first, `more` the rest.
absl::Status ParsePrompt(const json& body, engine::GenerationRequest& out,
                         std::vector<engine::GenerationRequest>& more) {
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
    if (prompt->size() > kMaxPrompts) {
      return FieldError("prompt",
                        absl::StrCat("at most ", kMaxPrompts, " prompts, got ", prompt->size()));
    }
    for (size_t i = 0; i < prompt->size(); ++i) {
      const json& item = (*prompt)[i];
      engine::GenerationRequest& into = i == 0 ? out : more.emplace_back();
      const std::string field = absl::StrCat("prompt[", i, "]");
      if (first.is_string()) {
        if (!item.is_string()) return WrongType(field, "a string, as prompt[0]", item);
        into.prompt = item.get<std::string>();
      } else {
        if (!item.is_array()) return WrongType(field, "an array of token ids, as prompt[0]", item);
        if (item.empty()) return FieldError(field, "must not be empty");
        if (absl::Status s = TokenIds(item, field, into.prompt_ids); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
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

// A schema or grammar field: a JSON value kept as text (an object, or a
// string holding one, as vLLM also takes).
absl::StatusOr<std::string> SchemaText(const json& value, const std::string& field) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() || value.is_boolean()) return Dump(value);
  return WrongType(field, "a JSON Schema (an object)", value);
}

// response_format (OpenAI), structured_outputs (vLLM) and vLLM's older
// guided_json / guided_regex / guided_choice / guided_grammar: at most one
// grammar per request.
absl::Status ParseStructuredOutputs(const json& body, engine::GenerationRequest& g) {
  std::vector<engine::StructuredOutputs> found;
  if (const json* format = Field(body, "response_format")) {
    if (!format->is_object()) return WrongType("response_format", "an object", *format);
    auto type = format->find("type");
    if (type == format->end() || !type->is_string()) {
      return FieldError("response_format.type",
                        "expected \"text\", \"json_object\" or \"json_schema\"");
    }
    engine::StructuredOutputs s;
    if (*type == "json_object") {
      s.json_object = true;
      s.field = "response_format";
      found.push_back(s);
    } else if (*type == "json_schema") {
      auto spec = format->find("json_schema");
      if (spec == format->end() || !spec->is_object()) {
        return FieldError("response_format.json_schema",
                          "expected an object {\"name\", \"schema\", \"strict\"}");
      }
      auto schema = spec->find("schema");
      s.field = "response_format.json_schema.schema";
      if (schema == spec->end()) {
        s.json_schema = "{}";  // OpenAI: no schema, any JSON
      } else {
        ACCEL_ASSIGN_OR_RETURN(s.json_schema, SchemaText(*schema, s.field));
      }
      found.push_back(s);
    } else if (*type != "text") {
      return FieldError("response_format.type",
                        "expected \"text\", \"json_object\" or \"json_schema\"");
    }
  }
  auto add = [&](const json& v, const std::string& kind, const std::string& field) -> absl::Status {
    engine::StructuredOutputs s;
    s.field = field;
    if (kind == "json") {
      ACCEL_ASSIGN_OR_RETURN(s.json_schema, SchemaText(v, field));
    } else if (kind == "json_object") {
      if (!v.is_boolean()) return WrongType(field, "a boolean", v);
      if (!v.get<bool>()) return absl::OkStatus();
      s.json_object = true;
    } else if (kind == "regex" || kind == "grammar") {
      if (!v.is_string()) return WrongType(field, "a string", v);
      (kind == "regex" ? s.regex : s.grammar) = v.get<std::string>();
      if (v.get<std::string>().empty()) return FieldError(field, "is empty");
    } else if (kind == "choice") {
      if (!v.is_array() || v.empty()) return WrongType(field, "a non-empty array of strings", v);
      for (size_t i = 0; i < v.size(); ++i) {
        if (!v[i].is_string()) return WrongType(absl::StrCat(field, "[", i, "]"), "a string", v[i]);
        s.choice.push_back(v[i].get<std::string>());
      }
    }
    found.push_back(std::move(s));
    return absl::OkStatus();
  };
  if (const json* so = Field(body, "structured_outputs")) {
    if (!so->is_object()) return WrongType("structured_outputs", "an object", *so);
    for (const char* kind : {"json", "regex", "choice", "grammar", "json_object"}) {
      auto it = so->find(kind);
      if (it == so->end() || it->is_null()) continue;
      ACCEL_RETURN_IF_ERROR(add(*it, kind, absl::StrCat("structured_outputs.", kind)));
    }
  }
  for (const char* kind : {"json", "regex", "choice", "grammar"}) {
    const std::string name = absl::StrCat("guided_", kind);
    if (const json* v = Field(body, name.c_str())) ACCEL_RETURN_IF_ERROR(add(*v, kind, name));
  }
  if (found.size() > 1) {
    return FieldError(found[1].field, absl::StrCat("only one structured output per request (",
                                                   found[0].field, " is set too)"));
  }
  if (!found.empty()) g.structured = std::move(found[0]);
  return absl::OkStatus();
}

// tool_choice: "auto" | "none" | "required" | {"type": "function",
// "function": {"name"}} (a name that must be among the tools).
absl::Status ParseToolChoice(const json& body, OpenAiRequest& out) {
  const json* tools = Field(body, "tools");
  if (tools != nullptr && tools->is_array() && !tools->empty()) out.tools_json = Dump(*tools);
  const json* choice = Field(body, "tool_choice");
  if (choice == nullptr) return absl::OkStatus();
  if (choice->is_string()) {
    const std::string c = choice->get<std::string>();
    if (c != "auto" && c != "none" && c != "required") {
      return FieldError("tool_choice",
                        absl::StrCat("expected \"auto\", \"none\", \"required\" or "
                                     "{\"type\": \"function\", \"function\": {\"name\"}}, got \"",
                                     c, "\""));
    }
    out.tool_choice = c;
  } else if (choice->is_object()) {
    auto function = choice->find("function");
    if (function == choice->end() || !function->is_object() || !function->contains("name") ||
        !(*function)["name"].is_string()) {
      return FieldError("tool_choice.function.name", "expected a string");
    }
    out.tool_choice = "function";
    out.tool_choice_function = (*function)["name"].get<std::string>();
    bool found = false;
    if (tools != nullptr && tools->is_array()) {
      for (const json& tool : *tools) {
        auto f = tool.find("function");
        if (f != tool.end() && f->is_object() && f->contains("name") &&
            (*f)["name"] == out.tool_choice_function) {
          found = true;
        }
      }
    }
    if (!found) {
      return FieldError("tool_choice.function.name",
                        absl::StrCat("no tool named \"", out.tool_choice_function, "\""));
    }
  } else {
    return WrongType("tool_choice", "a string or an object", *choice);
  }
  if ((out.tool_choice == "required") && out.tools_json.empty()) {
    return FieldError("tool_choice", "\"required\" needs tools");
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
    if (absl::Status s = ParsePrompt(body, g, out.prompts); !s.ok()) return s;
  }

  std::optional<int64_t> max_tokens;
  const char* max_name = "max_tokens";
  if (endpoint == OpenAiEndpoint::kChat && Field(body, "max_completion_tokens") != nullptr) {
    max_name = "max_completion_tokens";
  }
  if (absl::Status s = GetInt(body, max_name, &max_tokens); !s.ok()) return s;
  std::optional<bool> echo;
  if (absl::Status s = GetBool(body, "echo", &echo); !s.ok()) return s;
  if (echo.value_or(false)) {
    if (endpoint == OpenAiEndpoint::kChat) {
      return FieldError("echo", "is a /v1/completions field, not a chat one");
    }
    out.echo = true;
  }
  // Chat without max_tokens runs to the end of the context, as OpenAI's
  // does; completions keep the server's default (OpenAI's legacy 16).
  if (!max_tokens && endpoint == OpenAiEndpoint::kChat) g.max_new_tokens_to_context = true;
  if (max_tokens) {
    if (*max_tokens < 0 || (*max_tokens == 0 && !out.echo)) {
      return FieldError(max_name, "must be at least 1 (0 only with echo)");
    }
    g.max_new_tokens = *max_tokens;
    if (*max_tokens == 0) {
      // The prompt alone: one token is generated (the engine always samples
      // one) and left out of the answer.
      out.echo_only = true;
      g.max_new_tokens = 1;
    }
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

  // n choices (range checked with the other request values:
  // engine/request.h).
  std::optional<int64_t> n;
  if (absl::Status s = GetInt(body, "n", &n); !s.ok()) return s;
  if (n) g.n = *n;
  // best_of (vLLM's; OpenAI's legacy completions) would rank best_of
  // candidates by their likelihood server-side: not done here, so only the
  // value that ranks nothing (n) is accepted.
  std::optional<int64_t> best_of;
  if (absl::Status s = GetInt(body, "best_of", &best_of); !s.ok()) return s;
  if (best_of && *best_of != g.n) {
    return FieldError("best_of",
                      absl::StrCat("only best_of equal to n (", g.n,
                                   ") is supported (no server-side ranking), got ", *best_of));
  }
  // vLLM's extensions: stop tokens, the least tokens before a stop, and the
  // stop string kept in the text.
  if (const json* stops = Field(body, "stop_token_ids")) {
    if (!stops->is_array()) return WrongType("stop_token_ids", "an array of token ids", *stops);
    if (absl::Status s = TokenIds(*stops, "stop_token_ids", g.stop_token_ids); !s.ok()) return s;
  }
  std::optional<int64_t> min_tokens;
  if (absl::Status s = GetInt(body, "min_tokens", &min_tokens); !s.ok()) return s;
  if (min_tokens) g.min_tokens = *min_tokens;
  std::optional<bool> include_stop;
  if (absl::Status s = GetBool(body, "include_stop_str_in_output", &include_stop); !s.ok()) {
    return s;
  }
  g.include_stop_str_in_output = include_stop.value_or(false);
  if (const json* suffix = Field(body, "suffix")) {
    if (!suffix->is_string()) return WrongType("suffix", "a string", *suffix);
    if (!suffix->get<std::string>().empty()) return FieldError("suffix", "is not supported");
  }
  // OpenAI's penalties and biases (ranges checked with the other sampling
  // values: engine/request.h).
  std::optional<double> presence;
  if (absl::Status s = GetNumber(body, "presence_penalty", &presence); !s.ok()) return s;
  if (presence) g.sampling.presence_penalty = *presence;
  std::optional<double> frequency;
  if (absl::Status s = GetNumber(body, "frequency_penalty", &frequency); !s.ok()) return s;
  if (frequency) g.sampling.frequency_penalty = *frequency;
  if (const json* bias = Field(body, "logit_bias")) {
    if (!bias->is_object()) return WrongType("logit_bias", "an object", *bias);
    for (const auto& [key, value] : bias->items()) {
      int64_t id = 0;
      if (!absl::SimpleAtoi(key, &id)) {
        return FieldError("logit_bias", absl::StrCat("keys must be token ids, got \"", key, "\""));
      }
      if (!value.is_number()) return WrongType(absl::StrCat("logit_bias.", key), "a number", value);
      g.sampling.logit_bias.emplace_back(id, value.get<double>());
    }
  }
  if (absl::Status st = ParseStructuredOutputs(body, g); !st.ok()) return st;
  if (const json* user = Field(body, "user")) {
    if (!user->is_string()) return WrongType("user", "a string", *user);
  }

  if (endpoint == OpenAiEndpoint::kChat) {
    if (absl::Status st = ParseToolChoice(body, out); !st.ok()) return st;
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
  // echo with logprobs: the prompt tokens' too, from the prefill's logits.
  g.prompt_logprobs = out.echo && out.logprobs;

  std::optional<bool> stream;
  if (absl::Status s = GetBool(body, "stream", &stream); !s.ok()) return s;
  out.stream = stream.value_or(false);
  if (!out.prompts.empty()) {
    // Several prompts: every one with the request's other fields.
    std::vector<engine::GenerationRequest> prompts;
    prompts.push_back(g);
    for (engine::GenerationRequest& p : out.prompts) {
      engine::GenerationRequest each = g;
      each.prompt = std::move(p.prompt);
      each.prompt_ids = std::move(p.prompt_ids);
      prompts.push_back(std::move(each));
    }
    out.prompts = std::move(prompts);
  }
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
      // engine/request.cc's two context checks: OpenAI's code for them.
      if (absl::StartsWith(error.message, "the prompt has ") ||
          (absl::StartsWith(error.message, "prompt (") &&
           absl::StrContains(error.message, "is over the limit"))) {
        error.code = "context_length_exceeded";
        error.param = "messages";
      }
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

absl::Status ApplyToolChoice(OpenAiRequest& request, grammar::ToolCallFormat format) {
  request.tool_call_format = grammar::ToolCallFormat::kNone;
  if (request.endpoint != OpenAiEndpoint::kChat || request.tools_json.empty() ||
      request.tool_choice == "none") {
    return absl::OkStatus();
  }
  if (request.tool_choice == "required" || request.tool_choice == "function") {
    if (format == grammar::ToolCallFormat::kNone) {
      return FieldError("tool_choice",
                        "a forced call needs the server's --tool_call_parser (hermes, "
                        "llama3_json or mistral; auto found none for this model)");
    }
    if (request.generation.structured) {
      return FieldError("tool_choice", absl::StrCat("a forced call cannot be combined with ",
                                                    request.generation.structured->field));
    }
    std::optional<std::string> name;
    if (request.tool_choice == "function") name = request.tool_choice_function;
    absl::StatusOr<std::string> gbnf = grammar::ToolCallGbnf(format, request.tools_json, name);
    if (!gbnf.ok()) return FieldError("tools", gbnf.status().message());
    engine::StructuredOutputs s;
    s.grammar = *std::move(gbnf);
    s.field = "tool_choice";
    request.generation.structured = std::move(s);
  }
  request.tool_call_format = format;
  return absl::OkStatus();
}

namespace {
json ToolCallJson(const grammar::ToolCall& call, std::optional<int> index) {
  json out = json::object();
  if (index) out["index"] = *index;
  out["id"] = call.id;
  out["type"] = "function";
  out["function"] = {{"name", call.name}, {"arguments", call.arguments}};
  return out;
}
}  // namespace

struct OpenAiResponseWriter::State {
  std::string text;
  // Chat with tools: the calls parsed out of the stream as it comes.
  std::unique_ptr<grammar::ToolCallStreamParser> tools;
  // Chat: logprobs.content entries. Completions: the four parallel arrays.
  json content = json::array();
  json tokens = json::array();
  json token_logprobs = json::array();
  json top_logprobs = json::array();
  json text_offset = json::array();
  int64_t offset = 0;                    // completions: text bytes so far, for text_offset
  std::optional<engine::Finish> finish;  // n > 1: how this choice ended
  std::string prompt_text;               // echo: what goes before the text
  bool prompt_added = false;

  // echo: the prompt's text, and with logprobs its tokens' entries (the
  // first token's logprob and top_logprobs null), before the completion's.
  void AddPrompt(const OpenAiRequest& request, const engine::GenerationRequest& g,
                 const TokenTextFn& token_text, const engine::TokenChunk& chunk) {
    if (prompt_added || !request.echo) return;
    prompt_added = true;
    std::string joined;
    for (const engine::PromptLogprob& p : chunk.prompt_logprobs) {
      const std::string token = token_text(p.token_id);
      joined += token;
      if (!request.logprobs) continue;
      tokens.push_back(token);
      token_logprobs.push_back(p.logprob ? json(*p.logprob) : json(nullptr));
      if (!p.logprob) {
        top_logprobs.push_back(nullptr);
      } else {
        json top = json::object();
        for (const engine::TokenLogprob& t : p.top_logprobs)
          top[token_text(t.token_id)] = t.logprob;
        top_logprobs.push_back(std::move(top));
      }
      text_offset.push_back(offset);
      offset += static_cast<int64_t>(token.size());
    }
    if (g.prompt.has_value()) {
      prompt_text = *g.prompt;
    } else if (!joined.empty()) {
      prompt_text = joined;
    } else {
      for (int64_t id : g.prompt_ids) prompt_text += token_text(id);
    }
  }

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
      id_(std::move(id)) {
  if (id_.empty()) {
    id_ = RandomId(request.endpoint == OpenAiEndpoint::kChat ? "chatcmpl-" : "cmpl-", 24);
  }
  const int64_t n = std::max<int64_t>(request.generation.n, 1) *
                    std::max<int64_t>(static_cast<int64_t>(request.prompts.size()), 1);
  for (int64_t i = 0; i < n; ++i) {
    auto state = std::make_unique<State>();
    if (request.endpoint == OpenAiEndpoint::kChat &&
        request.tool_call_format != grammar::ToolCallFormat::kNone) {
      state->tools = std::make_unique<grammar::ToolCallStreamParser>(request.tool_call_format);
    }
    states_.push_back(std::move(state));
  }
}

OpenAiResponseWriter::~OpenAiResponseWriter() = default;

const engine::GenerationRequest& OpenAiResponseWriter::PromptOf(int64_t index) const {
  // Choice p * n + j is prompt p's.
  const int64_t n = std::max<int64_t>(request_.generation.n, 1);
  const auto prompt = static_cast<size_t>(std::max<int64_t>(index, 0) / n);
  return prompt < request_.prompts.size() ? request_.prompts[prompt] : request_.generation;
}

OpenAiResponseWriter::State& OpenAiResponseWriter::Choice(int64_t index) const {
  // The engine numbers choices 0..n-1; anything else goes to the last.
  const size_t i =
      static_cast<size_t>(std::clamp<int64_t>(index, 0, static_cast<int64_t>(states_.size()) - 1));
  return *states_[i];
}

void OpenAiResponseWriter::Add(const engine::TokenChunk& chunk) {
  State& state = Choice(chunk.index);
  if (chunk.finish) state.finish = *chunk.finish;
  if (chunk.token_ids.empty()) return;  // a choice's end (n > 1)
  state.AddPrompt(request_, PromptOf(chunk.index), token_text_, chunk);
  if (request_.echo_only) return;  // the token generated to read the prompt
  state.text += chunk.text;
  if (request_.logprobs) state.AddLogprobs(request_, token_text_, chunk);
}

std::string OpenAiResponseWriter::Final(const engine::Completion& completion) const {
  const bool chat = request_.endpoint == OpenAiEndpoint::kChat;
  engine::Completion usage = completion;
  if (request_.echo_only) usage.generated_tokens = 0;  // nothing generated is shown
  json choices = json::array();
  for (size_t index = 0; index < states_.size(); ++index) {
    const State& state = *states_[index];
    // n > 1: each choice's own end; one choice: the request's.
    const engine::Finish ended = state.finish.value_or(completion.finish);
    json choice;
    if (chat) {
      json message = {{"role", "assistant"}, {"content", state.text}};
      std::string finish = OpenAiFinishReason(ended);
      if (request_.tool_call_format != grammar::ToolCallFormat::kNone) {
        grammar::ParsedToolCalls parsed =
            grammar::ParseToolCalls(request_.tool_call_format, state.text);
        if (!parsed.calls.empty()) {
          message["content"] = parsed.content.empty() ? json(nullptr) : json(parsed.content);
          json calls = json::array();
          for (const grammar::ToolCall& call : parsed.calls) {
            calls.push_back(ToolCallJson(call, std::nullopt));
          }
          message["tool_calls"] = std::move(calls);
          finish = "tool_calls";
        }
      }
      choice = {{"index", index},
                {"message", std::move(message)},
                {"logprobs", state.Logprobs(request_)},
                {"finish_reason", finish}};
    } else {
      choice = {{"index", index},
                {"text", state.prompt_text + state.text},
                {"logprobs", state.Logprobs(request_)},
                {"finish_reason", request_.echo_only ? "length" : OpenAiFinishReason(ended)}};
    }
    choices.push_back(std::move(choice));
  }
  json body = {{"id", id_},
               {"object", chat ? "chat.completion" : "text_completion"},
               {"created", created_},
               {"model", model_},
               {"choices", std::move(choices)},
               {"usage", Usage(usage)}};
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
  std::string events;
  for (size_t index = 0; index < states_.size(); ++index) {
    json chunk = ChunkEnvelope(request_, id_, created_, model_);
    chunk["choices"] = json::array({{{"index", index},
                                     {"delta", {{"role", "assistant"}, {"content", ""}}},
                                     {"logprobs", nullptr},
                                     {"finish_reason", nullptr}}});
    events += Event(chunk);
  }
  return events;
}

namespace {
// The chat deltas of tool-parser events, as OpenAI streams calls: a call's
// first delta alone (index, id, type, name, arguments ""), then deltas of
// content and of argument pieces (index and arguments only; pieces of one
// call in a row are one entry). Empty when the events carry nothing.
std::vector<json> ToolDeltas(std::vector<grammar::ToolCallStreamParser::Event> events) {
  std::vector<json> deltas;
  std::string content;
  json calls = json::array();
  const auto flush = [&] {
    json delta = json::object();
    if (!content.empty()) delta["content"] = std::move(content);
    if (!calls.empty()) delta["tool_calls"] = std::move(calls);
    content.clear();
    calls = json::array();
    if (!delta.empty()) deltas.push_back(std::move(delta));
  };
  for (auto& e : events) {
    content += e.content;
    if (e.call) {
      flush();
      grammar::ToolCall head = *e.call;
      std::string arguments = std::move(head.arguments);
      head.arguments.clear();
      deltas.push_back({{"tool_calls", json::array({ToolCallJson(head, e.index)})}});
      e.arguments = arguments + e.arguments;
    }
    if (e.arguments.empty()) continue;
    if (!calls.empty() && calls.back()["index"] == e.index) {
      json& arguments = calls.back()["function"]["arguments"];
      arguments = arguments.get<std::string>() + e.arguments;
    } else {
      calls.push_back({{"index", e.index}, {"function", {{"arguments", e.arguments}}}});
    }
  }
  flush();
  return deltas;
}
}  // namespace

std::string OpenAiResponseWriter::StreamChunk(const engine::TokenChunk& chunk) {
  State& state = Choice(chunk.index);
  const int64_t index = chunk.index;
  const bool has_logprobs = request_.logprobs && !chunk.logprobs.empty();
  // echo (completions only): the prompt goes out with the choice's first chunk.
  const bool echo_now = request_.echo && !state.prompt_added && !chunk.token_ids.empty();
  std::string events;
  if (request_.echo_only && !echo_now) {
    // Nothing generated is shown (max_tokens 0).
  } else if (!chunk.text.empty() || has_logprobs || echo_now) {
    if (state.tools != nullptr) {
      state.ClearLogprobs();
      if (has_logprobs) state.AddLogprobs(request_, token_text_, chunk);
      std::vector<json> deltas = ToolDeltas(state.tools->Add(chunk.text));
      if (deltas.empty() && has_logprobs) deltas.push_back({{"content", ""}});
      for (size_t i = 0; i < deltas.size(); ++i) {
        json out = ChunkEnvelope(request_, id_, created_, model_);
        // The chunk's logprobs go with its first event.
        out["choices"] = json::array({{{"index", index},
                                       {"delta", std::move(deltas[i])},
                                       {"logprobs", i == 0 ? state.Logprobs(request_) : json()},
                                       {"finish_reason", nullptr}}});
        events += Event(out);
      }
    } else {
      json out = ChunkEnvelope(request_, id_, created_, model_);
      state.ClearLogprobs();
      std::string text = chunk.text;
      if (echo_now) {
        // The prompt before the choice's first text, as vLLM streams echo
        // (its tokens' logprobs entries before the generated ones').
        state.AddPrompt(request_, PromptOf(index), token_text_, chunk);
        text = state.prompt_text + (request_.echo_only ? "" : text);
      }
      if (has_logprobs && !request_.echo_only) {
        // text_offset counts from the start of the whole completion (offset is kept).
        state.AddLogprobs(request_, token_text_, chunk);
      }
      if (request_.endpoint == OpenAiEndpoint::kChat) {
        out["choices"] = json::array({{{"index", index},
                                       {"delta", {{"content", chunk.text}}},
                                       {"logprobs", state.Logprobs(request_)},
                                       {"finish_reason", nullptr}}});
      } else {
        out["choices"] = json::array({{{"index", index},
                                       {"text", text},
                                       {"logprobs", state.Logprobs(request_)},
                                       {"finish_reason", nullptr}}});
      }
      events += Event(out);
    }
  }
  // n > 1: a choice that ended gets its finish event now (StreamEnd has
  // only the usage then).
  if (chunk.finish) events += FinishEvent(index, *chunk.finish);
  return events;
}

std::string OpenAiResponseWriter::FinishEvent(int64_t index, engine::Finish ended) const {
  State& state = Choice(index);
  json last = ChunkEnvelope(request_, id_, created_, model_);
  std::string events;  // held tool-call deltas first
  if (request_.endpoint == OpenAiEndpoint::kChat) {
    std::string finish = OpenAiFinishReason(ended);
    json delta = json::object();
    if (state.tools != nullptr) {
      // What the parser still held: content, or the last call.
      std::vector<json> deltas = ToolDeltas(state.tools->Finish());
      if (state.tools->num_calls() > 0) finish = "tool_calls";
      if (!deltas.empty()) {
        delta = std::move(deltas.back());
        deltas.pop_back();
      }
      for (json& held : deltas) {
        json out = ChunkEnvelope(request_, id_, created_, model_);
        out["choices"] = json::array({{{"index", index},
                                       {"delta", std::move(held)},
                                       {"logprobs", nullptr},
                                       {"finish_reason", nullptr}}});
        events += Event(out);
      }
    }
    last["choices"] = json::array({{{"index", index},
                                    {"delta", std::move(delta)},
                                    {"logprobs", nullptr},
                                    {"finish_reason", finish}}});
  } else {
    last["choices"] = json::array(
        {{{"index", index},
          {"text", ""},
          {"logprobs", nullptr},
          {"finish_reason", request_.echo_only ? "length" : OpenAiFinishReason(ended)}}});
  }
  return events + Event(last);
}

std::string OpenAiResponseWriter::StreamEnd(const engine::Completion& completion) const {
  std::string events;
  // One choice: its end is the request's. n > 1: each choice's end went out
  // with its last chunk.
  if (states_.size() == 1) events += FinishEvent(0, completion.finish);
  if (request_.include_usage) {
    json usage = ChunkEnvelope(request_, id_, created_, model_);
    usage["choices"] = json::array();
    engine::Completion counted = completion;
    if (request_.echo_only) counted.generated_tokens = 0;  // nothing generated is shown
    usage["usage"] = Usage(counted);
    events += Event(usage);
  }
  events += "data: [DONE]\n\n";
  return events;
}

std::string OpenAiResponseWriter::StreamError(const OpenAiError& error) {
  return absl::StrCat("data: ", ErrorBody(error), "\n\n", "data: [DONE]\n\n");
}

}  // namespace accel::server::internal
