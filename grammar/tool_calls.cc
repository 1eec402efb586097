#include "grammar/tool_calls.h"

#include <random>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "core/json.h"
#include "grammar/json_schema.h"

namespace accel::grammar {
namespace {

using Json = nlohmann::ordered_json;

constexpr absl::string_view kHermesOpen = "<tool_call>";
constexpr absl::string_view kHermesClose = "</tool_call>";
constexpr absl::string_view kPythonTag = "<|python_tag|>";
constexpr absl::string_view kMistralMarker = "[TOOL_CALLS]";
constexpr absl::string_view kMistralArgs = "[ARGS]";

// One past the end of the JSON object or array starting at `start`, or npos
// when the text ends first (strings and escapes are skipped).
size_t JsonValueEnd(absl::string_view text, size_t start) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = start; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return absl::string_view::npos;
}

// A call from its JSON object: "name" and "arguments" (or "parameters"),
// an object or a string holding one.
std::optional<ToolCall> CallFromJson(ToolCallFormat format, absl::string_view text) {
  JsonLimits limits;
  limits.max_depth = 64;
  auto value = ParseOrderedJson(text, "tool call", limits);
  if (!value.ok() || !value->is_object()) return std::nullopt;
  auto name = value->find("name");
  if (name == value->end() || !name->is_string() || name->get<std::string>().empty()) {
    return std::nullopt;
  }
  auto args = value->find("arguments");
  if (args == value->end()) args = value->find("parameters");
  ToolCall call;
  call.name = name->get<std::string>();
  call.id = NewToolCallId(format);
  if (args == value->end()) {
    call.arguments = "{}";
  } else if (args->is_string()) {
    call.arguments = args->get<std::string>();
  } else if (args->is_object()) {
    call.arguments = args->dump();
  } else {
    return std::nullopt;
  }
  return call;
}

// The calls in `text` (after the marker): JSON objects separated by the
// format's tags, commas, semicolons, brackets and whitespace. False when
// anything else is there or an object is not a call.
bool ParseCallList(ToolCallFormat format, absl::string_view text, std::vector<ToolCall>* calls) {
  size_t i = 0;
  while (i < text.size()) {
    const absl::string_view rest = text.substr(i);
    if (absl::StartsWith(rest, kHermesOpen)) {
      i += kHermesOpen.size();
    } else if (absl::StartsWith(rest, kHermesClose)) {
      i += kHermesClose.size();
    } else if (absl::StartsWith(rest, kPythonTag)) {
      i += kPythonTag.size();
    } else if (absl::StartsWith(rest, kMistralMarker)) {
      i += kMistralMarker.size();
    } else if (std::string(" \t\r\n;,[]").find(text[i]) != std::string::npos) {
      ++i;
    } else if (text[i] == '{') {
      const size_t end = JsonValueEnd(text, i);
      if (end == absl::string_view::npos) return false;
      auto call = CallFromJson(format, text.substr(i, end - i));
      if (!call) return false;
      calls->push_back(*std::move(call));
      i = end;
    } else if (format == ToolCallFormat::kMistral) {
      // Mistral's v11 form: name[ARGS]{...}
      const size_t args = rest.find(kMistralArgs);
      if (args == absl::string_view::npos) return false;
      const std::string name(absl::StripAsciiWhitespace(rest.substr(0, args)));
      const size_t start = i + args + kMistralArgs.size();
      if (start >= text.size() || text[start] != '{') return false;
      const size_t end = JsonValueEnd(text, start);
      if (end == absl::string_view::npos || name.empty()) return false;
      auto parsed = ParseOrderedJson(text.substr(start, end - start), "tool call arguments");
      if (!parsed.ok() || !parsed->is_object()) return false;
      calls->push_back({NewToolCallId(format), name, parsed->dump()});
      i = end;
    } else {
      return false;
    }
  }
  return true;
}

// Where the calls start in `text`, or npos.
size_t CallStart(ToolCallFormat format, absl::string_view text) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return text.find(kHermesOpen);
    case ToolCallFormat::kMistral: {
      const size_t marker = text.find(kMistralMarker);
      if (marker != absl::string_view::npos) return marker;
      const size_t first = text.find_first_not_of(" \t\r\n");
      if (first != absl::string_view::npos && absl::StartsWith(text.substr(first), "[{")) {
        return first;
      }
      return absl::string_view::npos;
    }
    case ToolCallFormat::kLlama3Json: {
      const size_t tag = text.find(kPythonTag);
      if (tag != absl::string_view::npos) return tag;
      const size_t first = text.find_first_not_of(" \t\r\n");
      if (first != absl::string_view::npos && text[first] == '{') return first;
      return absl::string_view::npos;
    }
    case ToolCallFormat::kNone:
      break;
  }
  return absl::string_view::npos;
}

// The markers whose start a stream may be holding back.
std::vector<absl::string_view> Markers(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return {kHermesOpen};
    case ToolCallFormat::kMistral:
      return {kMistralMarker};
    case ToolCallFormat::kLlama3Json:
      return {kPythonTag};
    case ToolCallFormat::kNone:
      break;
  }
  return {};
}

enum class HeadMatch { kYes, kNo, kMore };

// Whether `text` starts with a call object's head, {"name": "N",
// "arguments": (or "parameters") followed by '{': kYes with the name and
// the offset of that '{'; kMore when the text ends before it can tell.
HeadMatch MatchCallHead(absl::string_view text, std::string* name, size_t* args_start) {
  size_t i = 0;
  auto skip_space = [&] {
    while (i < text.size() && absl::ascii_isspace(static_cast<unsigned char>(text[i]))) ++i;
    return i < text.size();
  };
  // A literal: kYes when all there, kMore when the text ends inside it.
  auto literal = [&](absl::string_view word) {
    const absl::string_view rest = text.substr(i);
    if (rest.size() < word.size()) {
      return absl::StartsWith(word, rest) ? HeadMatch::kMore : HeadMatch::kNo;
    }
    if (!absl::StartsWith(rest, word)) return HeadMatch::kNo;
    i += word.size();
    return HeadMatch::kYes;
  };
  if (!skip_space()) return HeadMatch::kMore;
  if (HeadMatch m = literal("{"); m != HeadMatch::kYes) return m;
  if (!skip_space()) return HeadMatch::kMore;
  if (HeadMatch m = literal("\"name\""); m != HeadMatch::kYes) return m;
  if (!skip_space()) return HeadMatch::kMore;
  if (HeadMatch m = literal(":"); m != HeadMatch::kYes) return m;
  if (!skip_space()) return HeadMatch::kMore;
  if (text[i] != '"') return HeadMatch::kNo;
  const size_t name_start = i;
  for (++i;; ++i) {
    if (i >= text.size()) return HeadMatch::kMore;
    if (text[i] == '\\') {
      ++i;
      continue;
    }
    if (text[i] == '"') break;
  }
  ++i;
  auto parsed_name = ParseOrderedJson(text.substr(name_start, i - name_start), "tool call name");
  if (!parsed_name.ok() || !parsed_name->is_string() || parsed_name->get<std::string>().empty()) {
    return HeadMatch::kNo;
  }
  if (!skip_space()) return HeadMatch::kMore;
  if (HeadMatch m = literal(","); m != HeadMatch::kYes) return m;
  if (!skip_space()) return HeadMatch::kMore;
  HeadMatch key = literal("\"arguments\"");
  if (key == HeadMatch::kNo) key = literal("\"parameters\"");
  if (key != HeadMatch::kYes) return key;
  if (!skip_space()) return HeadMatch::kMore;
  if (HeadMatch m = literal(":"); m != HeadMatch::kYes) return m;
  if (!skip_space()) return HeadMatch::kMore;
  if (text[i] != '{') return HeadMatch::kNo;  // a string of JSON: whole, at its end
  *name = parsed_name->get<std::string>();
  *args_start = i;
  return HeadMatch::kYes;
}

}  // namespace

absl::StatusOr<ToolCallFormat> ToolCallFormatFromName(absl::string_view name) {
  if (name == "hermes") return ToolCallFormat::kHermes;
  if (name == "llama3_json") return ToolCallFormat::kLlama3Json;
  if (name == "mistral") return ToolCallFormat::kMistral;
  if (name == "none" || name.empty()) return ToolCallFormat::kNone;
  return absl::InvalidArgumentError(absl::StrCat("--tool_call_parser: unknown parser \"", name,
                                                 "\" (hermes, llama3_json, mistral, auto)"));
}

absl::string_view ToolCallFormatName(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return "hermes";
    case ToolCallFormat::kLlama3Json:
      return "llama3_json";
    case ToolCallFormat::kMistral:
      return "mistral";
    case ToolCallFormat::kNone:
      break;
  }
  return "none";
}

ToolCallFormat ToolCallFormatFromVocabulary(
    const std::function<bool(absl::string_view token)>& has_token) {
  if (has_token(kHermesOpen)) return ToolCallFormat::kHermes;
  if (has_token(kMistralMarker)) return ToolCallFormat::kMistral;
  if (has_token(kPythonTag)) return ToolCallFormat::kLlama3Json;
  return ToolCallFormat::kNone;
}

ToolCallFormat DetectToolCallFormat(absl::string_view chat_template) {
  if (absl::StrContains(chat_template, kHermesOpen)) return ToolCallFormat::kHermes;
  if (absl::StrContains(chat_template, kMistralMarker)) return ToolCallFormat::kMistral;
  if (absl::StrContains(chat_template, kPythonTag) ||
      (absl::StrContains(chat_template, "\"parameters\"") &&
       absl::StrContains(chat_template, "ipython"))) {
    return ToolCallFormat::kLlama3Json;
  }
  return ToolCallFormat::kNone;
}

std::string NewToolCallId(ToolCallFormat format) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  const int n = format == ToolCallFormat::kMistral ? 9 : 24;
  std::string id = format == ToolCallFormat::kMistral ? "" : "call_";
  for (int i = 0; i < n; ++i) id.push_back(kChars[rng() % (sizeof(kChars) - 1)]);
  return id;
}

ParsedToolCalls ParseToolCalls(ToolCallFormat format, absl::string_view text) {
  ParsedToolCalls out;
  const size_t start = CallStart(format, text);
  if (start == absl::string_view::npos) {
    out.content = std::string(text);
    return out;
  }
  std::vector<ToolCall> calls;
  if (!ParseCallList(format, text.substr(start), &calls) || calls.empty()) {
    out.content = std::string(text);
    return out;
  }
  out.content = std::string(absl::StripTrailingAsciiWhitespace(text.substr(0, start)));
  out.calls = std::move(calls);
  return out;
}

std::vector<ToolCallStreamParser::Event> ToolCallStreamParser::Add(absl::string_view piece) {
  buffer_.append(piece.data(), piece.size());
  return Drain(/*final=*/false);
}

std::vector<ToolCallStreamParser::Event> ToolCallStreamParser::Finish() {
  return Drain(/*final=*/true);
}

std::vector<ToolCallStreamParser::Event> ToolCallStreamParser::Drain(bool final) {
  std::vector<Event> events;
  if (format_ == ToolCallFormat::kNone) {
    if (!buffer_.empty()) events.push_back({std::move(buffer_), std::nullopt, "", 0});
    buffer_.clear();
    return events;
  }
  if (!in_calls_) {
    // Llama 3 and Mistral's bare forms only count at the start of the message.
    size_t start = seen_text_ ? absl::string_view::npos : CallStart(format_, buffer_);
    if (seen_text_) {
      for (absl::string_view marker : Markers(format_)) {
        start = std::min(start, buffer_.find(marker.data(), 0, marker.size()));
      }
    }
    if (start == absl::string_view::npos) {
      // Hold a tail that may begin a marker (or, before any text, a '{' / '[').
      size_t hold = 0;
      for (absl::string_view marker : Markers(format_)) {
        for (size_t n = std::min(marker.size() - 1, buffer_.size()); n > hold; --n) {
          if (absl::EndsWith(buffer_, marker.substr(0, n))) {
            hold = n;
            break;
          }
        }
      }
      // Whitespace before a call is not content (ParseToolCalls strips it):
      // held until text other than a call follows.
      while (hold < buffer_.size() &&
             absl::ascii_isspace(static_cast<unsigned char>(buffer_[buffer_.size() - hold - 1]))) {
        ++hold;
      }
      if (!seen_text_ && absl::StripAsciiWhitespace(buffer_).empty()) hold = buffer_.size();
      if (final) hold = 0;
      std::string content = buffer_.substr(0, buffer_.size() - hold);
      buffer_.erase(0, buffer_.size() - hold);
      if (!absl::StripAsciiWhitespace(content).empty()) seen_text_ = true;
      if (!content.empty()) events.push_back({std::move(content), std::nullopt, "", 0});
      return events;
    }
    std::string content = buffer_.substr(0, start);
    buffer_.erase(0, start);
    in_calls_ = true;
    content = std::string(absl::StripTrailingAsciiWhitespace(content));
    if (!content.empty()) events.push_back({std::move(content), std::nullopt, "", 0});
  }
  // In the calls: stream each call's arguments, or pass on each complete
  // object that is not in the streamable shape.
  while (true) {
    if (in_arguments_) {
      StreamArguments(events);
      if (in_arguments_) break;  // the buffer ended inside them
    }
    if (close_pending_) {
      size_t i = 0;
      while (i < buffer_.size() && absl::ascii_isspace(static_cast<unsigned char>(buffer_[i]))) ++i;
      if (i >= buffer_.size()) break;
      if (buffer_[i] == '}') buffer_.erase(0, i + 1);
      close_pending_ = false;
    }
    size_t i = 0;
    while (i < buffer_.size() && buffer_[i] != '{') ++i;
    if (i >= buffer_.size()) break;
    std::string name;
    size_t args_start = 0;
    const HeadMatch head = MatchCallHead(absl::string_view(buffer_).substr(i), &name, &args_start);
    if (head == HeadMatch::kMore && !final) break;
    if (head == HeadMatch::kYes) {
      ToolCall call;
      call.id = NewToolCallId(format_);
      call.name = std::move(name);
      events.push_back({"", std::move(call), "", emitted_++});
      buffer_.erase(0, i + args_start);
      in_arguments_ = true;
      depth_ = 0;
      in_string_ = false;
      escaped_ = false;
      continue;
    }
    const size_t end = JsonValueEnd(buffer_, i);
    if (end == std::string::npos) break;
    std::vector<ToolCall> calls;
    if (!ParseCallList(format_, absl::string_view(buffer_).substr(i, end - i), &calls) ||
        calls.size() != 1) {
      break;
    }
    ToolCall call = std::move(calls.front());
    events.push_back({"", std::move(call), "", emitted_++});
    buffer_.erase(0, end);
  }
  if (final && (in_arguments_ || close_pending_)) {
    // The text ended inside a streamed call: what came is all there is.
    in_arguments_ = false;
    close_pending_ = false;
    if (absl::StripAsciiWhitespace(buffer_).empty()) buffer_.clear();
  }
  if (final) {
    // What is left after streamed calls: their closing tags and separators.
    std::vector<ToolCall> none;
    if (emitted_ > 0 && ParseCallList(format_, buffer_, &none) && none.empty()) buffer_.clear();
  }
  if (final && !buffer_.empty()) {
    // The rest: calls in a form the loop above does not split (Mistral's
    // name[ARGS]{...}), separators, or what the model wrote as content.
    std::vector<ToolCall> rest;
    if (ParseCallList(format_, buffer_, &rest)) {
      for (ToolCall& call : rest) events.push_back({"", std::move(call), "", emitted_++});
    } else {
      events.push_back({std::move(buffer_), std::nullopt, "", 0});
    }
    buffer_.clear();
  }
  return events;
}

void ToolCallStreamParser::StreamArguments(std::vector<Event>& events) {
  size_t i = 0;
  bool done = false;
  for (; i < buffer_.size() && !done; ++i) {
    const char c = buffer_[i];
    if (in_string_) {
      if (escaped_) {
        escaped_ = false;
      } else if (c == '\\') {
        escaped_ = true;
      } else if (c == '"') {
        in_string_ = false;
      }
      continue;
    }
    if (c == '"') {
      in_string_ = true;
    } else if (c == '{' || c == '[') {
      ++depth_;
    } else if ((c == '}' || c == ']') && --depth_ == 0) {
      done = true;
    }
  }
  if (i > 0) events.push_back({"", std::nullopt, buffer_.substr(0, i), emitted_ - 1});
  buffer_.erase(0, i);
  if (done) {
    in_arguments_ = false;
    close_pending_ = true;
  }
}

absl::StatusOr<std::string> ToolCallGbnf(ToolCallFormat format, absl::string_view tools_json,
                                         std::optional<std::string> function_name) {
  if (format == ToolCallFormat::kNone) {
    return absl::InvalidArgumentError(
        "tool_choice: the model has no tool-call format (set --tool_call_parser)");
  }
  auto tools = ParseOrderedJson(tools_json, "tools");
  if (!tools.ok()) return tools.status();
  if (!tools->is_array() || tools->empty()) {
    return absl::InvalidArgumentError("tools: expected a non-empty array");
  }
  Json branches = Json::array();
  Json defs = Json::object();
  const char* args_key = format == ToolCallFormat::kLlama3Json ? "parameters" : "arguments";
  for (size_t i = 0; i < tools->size(); ++i) {
    const Json& tool = (*tools)[i];
    const Json* function =
        tool.is_object() && tool.contains("function") ? &tool["function"] : nullptr;
    if (function == nullptr || !function->is_object() || !function->contains("name") ||
        !(*function)["name"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tools[", i, "]: expected {\"type\": \"function\", \"function\": {\"name\", ...}}"));
    }
    const std::string name = (*function)["name"].get<std::string>();
    if (function_name && name != *function_name) continue;
    Json parameters =
        function->contains("parameters") ? (*function)["parameters"] : Json{{"type", "object"}};
    if (parameters.is_object()) {
      for (const char* key : {"$defs", "definitions"}) {
        if (!parameters.contains(key)) continue;
        for (const auto& [k, v] : parameters[key].items()) defs[k] = v;
        parameters.erase(key);
      }
    }
    Json call = {{"type", "object"},
                 {"properties", {{"name", {{"const", name}}}, {args_key, parameters}}},
                 {"required", {"name", args_key}},
                 {"additionalProperties", false}};
    branches.push_back(call);
  }
  if (branches.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tool_choice: no function named \"",
                                                   function_name.value_or(""), "\" in tools"));
  }
  Json schema = branches.size() == 1 ? branches[0] : Json{{"anyOf", branches}};
  if (format == ToolCallFormat::kMistral) {
    schema = {{"type", "array"}, {"items", schema}, {"minItems", 1}};
  }
  if (!defs.empty()) {
    // $refs into a function's $defs now point at the root's.
    std::string text = schema.dump();
    for (const char* from : {"#/definitions/"}) {
      for (size_t p; (p = text.find(from)) != std::string::npos;) {
        text.replace(p, std::string(from).size(), "#/$defs/");
      }
    }
    schema = Json::parse(text);
    schema["$defs"] = defs;
  }
  auto gbnf = JsonSchemaToGbnf(schema.dump());
  if (!gbnf.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tools: a function's parameters: ", gbnf.status().message()));
  }
  if (format != ToolCallFormat::kHermes) return gbnf;
  // root ::= X  ->  root ::= "<tool_call>\n" X "\n</tool_call>"
  const size_t eol = gbnf->find('\n');
  const std::string first = gbnf->substr(0, eol);
  constexpr absl::string_view kRoot = "root ::= ";
  return absl::StrCat(kRoot, GbnfLiteral("<tool_call>\n"), " ", first.substr(kRoot.size()), " ",
                      GbnfLiteral("\n</tool_call>"), gbnf->substr(eol));
}

}  // namespace accel::grammar
