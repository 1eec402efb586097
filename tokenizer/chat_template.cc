#include "tokenizer/chat_template.h"

#include <algorithm>
#include <optional>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#include "core/json.h"
#include "core/status.h"
#include "jinja/jinja.h"
#include "tokenizer/internal/read_file.h"
#include "tokenizer/tokenizer.h"

namespace accel::tokenizer {
namespace {

// Ordered: templates print dicts (tools, tool-call arguments) in their own order.
using Json = nlohmann::ordered_json;

constexpr uint64_t kMaxConfigBytes = uint64_t{64} << 20;

// Tokens templates end a turn with; one of them written by the template is
// where the model stops. (eos_token is always one.)
constexpr const char* kTurnEndTokens[] = {
    "<|eot_id|>",    "<|eom_id|>", "<|im_end|>",      "<end_of_turn>",        "<|end|>",
    "<|endoftext|>", "</s>",       "<|end_of_text|>", "<|END_OF_TURN_TOKEN|>"};

// The special-token names transformers passes to templates (special_tokens_map).
constexpr const char* kSpecialTokenNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                              "pad_token", "cls_token", "mask_token"};

// A special token as tokenizer_config.json writes it: a string, or an
// AddedToken object ({"__type": "AddedToken", "content": ...}); null: none.
absl::StatusOr<std::optional<std::string>> TokenText(const Json& value, absl::string_view where) {
  if (value.is_null()) return std::nullopt;
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string()) {
    return value["content"].get<std::string>();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": expected a string or an object with a string \"content\""));
}

}  // namespace

struct ChatTemplate::Parsed {
  std::map<std::string, jinja::Template> templates;  // by name; "default" for a lone one
  std::map<std::string, std::string> special_tokens;
  std::vector<std::string> additional_special_tokens;
};

ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::ChatTemplate(const ChatTemplate&) = default;
ChatTemplate& ChatTemplate::operator=(const ChatTemplate&) = default;
ChatTemplate::~ChatTemplate() = default;

namespace {

absl::StatusOr<jinja::Template> ParseTemplate(absl::string_view source,
                                              absl::string_view source_name) {
  absl::StatusOr<jinja::Template> parsed = jinja::Template::Parse(source);
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(),
                        absl::StrCat(source_name, ": ", parsed.status().message()));
  }
  return parsed;
}

std::vector<std::string> TurnEnds(const std::vector<std::string>& sources,
                                  const std::map<std::string, std::string>& special_tokens) {
  std::vector<std::string> ends;
  auto add = [&](const std::string& token) {
    if (!token.empty() && std::find(ends.begin(), ends.end(), token) == ends.end()) {
      ends.push_back(token);
    }
  };
  if (auto eos = special_tokens.find("eos_token"); eos != special_tokens.end()) add(eos->second);
  for (const char* token : kTurnEndTokens) {
    for (const std::string& source : sources) {
      if (source.find(token) != std::string::npos) add(token);
    }
  }
  return ends;
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::FromSource(
    absl::string_view source, std::map<std::string, std::string> special_tokens,
    absl::string_view source_name) {
  auto parsed = std::make_shared<Parsed>();
  ACCEL_ASSIGN_OR_RETURN(jinja::Template tmpl, ParseTemplate(source, source_name));
  parsed->templates.emplace("default", std::move(tmpl));
  ChatTemplate chat;
  chat.end_of_turn_ = TurnEnds({std::string(source)}, special_tokens);
  parsed->special_tokens = std::move(special_tokens);
  chat.source_name_ = std::string(source_name);
  chat.parsed_ = std::move(parsed);
  return chat;
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromModelDir(const std::string& dir) {
  const std::string config_path = dir + "/tokenizer_config.json";
  const std::string jinja_path = dir + "/chat_template.jinja";
  auto parsed = std::make_shared<Parsed>();
  std::vector<std::string> sources;
  std::string source_name;

  Json config = Json::object();
  absl::StatusOr<std::string> config_text =
      internal::ReadWholeFile(config_path, kMaxConfigBytes, "tokenizer_config.json");
  if (config_text.ok()) {
    ACCEL_ASSIGN_OR_RETURN(config, ParseOrderedJson(*config_text, config_path));
    if (!config.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(config_path, ": expected a JSON object"));
    }
  } else if (!absl::IsNotFound(config_text.status())) {
    return config_text.status();
  }
  for (const char* name : kSpecialTokenNames) {
    if (!config.contains(name)) continue;
    ACCEL_ASSIGN_OR_RETURN(std::optional<std::string> text,
                           TokenText(config[name], absl::StrCat(config_path, ": ", name)));
    if (text) parsed->special_tokens[name] = *text;
  }
  if (config.contains("additional_special_tokens")) {
    const Json& extra = config["additional_special_tokens"];
    if (!extra.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(config_path, ": additional_special_tokens: expected an array"));
    }
    for (size_t i = 0; i < extra.size(); ++i) {
      ACCEL_ASSIGN_OR_RETURN(
          std::optional<std::string> text,
          TokenText(extra[i], absl::StrCat(config_path, ": additional_special_tokens[", i, "]")));
      if (text) parsed->additional_special_tokens.push_back(*text);
    }
  }

  absl::StatusOr<std::string> jinja_text =
      internal::ReadWholeFile(jinja_path, kMaxConfigBytes, "chat template");
  if (jinja_text.ok()) {
    source_name = jinja_path;
    ACCEL_ASSIGN_OR_RETURN(jinja::Template tmpl, ParseTemplate(*jinja_text, jinja_path));
    parsed->templates.emplace("default", std::move(tmpl));
    sources.push_back(*std::move(jinja_text));
  } else if (!absl::IsNotFound(jinja_text.status())) {
    return jinja_text.status();
  } else if (config.contains("chat_template") && !config["chat_template"].is_null()) {
    source_name = absl::StrCat(config_path, ": chat_template");
    const Json& field = config["chat_template"];
    if (field.is_string()) {
      ACCEL_ASSIGN_OR_RETURN(jinja::Template tmpl,
                             ParseTemplate(field.get<std::string>(), source_name));
      parsed->templates.emplace("default", std::move(tmpl));
      sources.push_back(field.get<std::string>());
    } else if (field.is_array()) {
      for (size_t i = 0; i < field.size(); ++i) {
        const Json& entry = field[i];
        const std::string where = absl::StrCat(source_name, "[", i, "]");
        if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
            !entry.contains("template") || !entry["template"].is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": expected an object with string \"name\" and \"template\""));
        }
        const std::string name = entry["name"].get<std::string>();
        const std::string source = entry["template"].get<std::string>();
        ACCEL_ASSIGN_OR_RETURN(jinja::Template tmpl,
                               ParseTemplate(source, absl::StrCat(where, " (", name, ")")));
        if (!parsed->templates.emplace(name, std::move(tmpl)).second) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": a second template named '", name, "'"));
        }
        sources.push_back(source);
      }
      if (parsed->templates.count("default") == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(source_name, ": several templates and none named 'default'"));
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(source_name, ": expected a string or a list of named templates"));
    }
  }
  if (parsed->templates.empty()) {
    return absl::NotFoundError(absl::StrCat(
        dir, " has no chat template (no chat_template.jinja, and no \"chat_template\" in ",
        config_text.ok() ? config_path : "a tokenizer_config.json", ")"));
  }
  ChatTemplate chat;
  chat.end_of_turn_ = TurnEnds(sources, parsed->special_tokens);
  chat.source_name_ = std::move(source_name);
  chat.parsed_ = std::move(parsed);
  return chat;
}

std::vector<int64_t> ChatTemplate::EndOfTurnIds(const Tokenizer& tokenizer) const {
  std::vector<int64_t> ids;
  for (const std::string& token : end_of_turn_) {
    if (std::optional<int64_t> id = tokenizer.TokenToId(token)) ids.push_back(*id);
  }
  return ids;
}

absl::StatusOr<std::string> ChatTemplate::Render(absl::string_view messages_json,
                                                 absl::string_view tools_json,
                                                 bool add_generation_prompt) const {
  ACCEL_ASSIGN_OR_RETURN(Json messages, ParseOrderedJson(messages_json, "messages"));
  if (!messages.is_array()) return absl::InvalidArgumentError("messages: expected an array");
  for (size_t i = 0; i < messages.size(); ++i) {
    const Json& message = messages[i];
    if (!message.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "]: expected an object"));
    }
    if (!message.contains("role") || !message["role"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].role: expected a string"));
    }
  }
  Json tools = nullptr;
  if (!tools_json.empty()) {
    ACCEL_ASSIGN_OR_RETURN(tools, ParseOrderedJson(tools_json, "tools"));
    if (!tools.is_array() && !tools.is_null()) {
      return absl::InvalidArgumentError("tools: expected an array");
    }
  }
  const bool has_tools = tools.is_array() && !tools.empty();
  auto chosen = parsed_->templates.find(has_tools ? "tool_use" : "default");
  if (chosen == parsed_->templates.end()) chosen = parsed_->templates.find("default");

  Json context = Json::object();
  for (const auto& [name, token] : parsed_->special_tokens) context[name] = token;
  if (!parsed_->additional_special_tokens.empty()) {
    context["additional_special_tokens"] = parsed_->additional_special_tokens;
  }
  context["messages"] = std::move(messages);
  context["tools"] = std::move(tools);
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  absl::StatusOr<std::string> text = chosen->second.Render(context);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat(source_name_, ": ", text.status().message()));
  }
  return text;
}

}  // namespace accel::tokenizer
