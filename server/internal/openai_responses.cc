#include "server/internal/openai_responses.h"

#include <mutex>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "core/json.h"
#include "grammar/tool_calls.h"
#include "server/internal/openai_json.h"

namespace accel::server::internal {
namespace {

using json = nlohmann::ordered_json;

std::string Quoted(const std::string& text) { return Dump(json(text.substr(0, 32))); }

// A message's or an output's content: a string, or input_text (output_text,
// text) parts joined.
absl::StatusOr<std::string> PartsText(const json& content, const std::string& field) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) return FieldError(field, "expected a string or an array of parts");
  std::string text;
  for (size_t j = 0; j < content.size(); ++j) {
    const json& part = content[j];
    const std::string part_field = absl::StrCat(field, "[", j, "]");
    if (!part.is_object()) return FieldError(part_field, "expected an object");
    const json* type = Field(part, "type");
    if (type == nullptr || !type->is_string()) return FieldError(part_field + ".type", "required");
    const std::string kind = type->get<std::string>();
    if (kind != "input_text" && kind != "output_text" && kind != "text") {
      return FieldError(part_field + ".type",
                        absl::StrCat("only input_text parts are supported, not ", Quoted(kind)));
    }
    const json* part_text = Field(part, "text");
    if (part_text == nullptr || !part_text->is_string()) {
      return FieldError(part_field + ".text", "expected a string");
    }
    text += part_text->get<std::string>();
  }
  return text;
}

absl::Status RequiredString(const json& item, const char* name, const std::string& field,
                            std::string& out) {
  const json* value = Field(item, name);
  if (value == nullptr || !value->is_string()) {
    return FieldError(absl::StrCat(field, ".", name), "required, a string");
  }
  out = value->get<std::string>();
  return absl::OkStatus();
}

// input (a string or items) and instructions -> chat messages.
absl::Status InputMessages(const json& body, json& messages) {
  if (const json* instructions = Field(body, "instructions")) {
    if (!instructions->is_string()) return FieldError("instructions", "expected a string");
    messages.push_back({{"role", "system"}, {"content", *instructions}});
  }
  const json* input = Field(body, "input");
  if (input == nullptr) return FieldError("input", "required");
  if (input->is_string()) {
    messages.push_back({{"role", "user"}, {"content", *input}});
    return absl::OkStatus();
  }
  if (!input->is_array()) return FieldError("input", "expected a string or an array of items");
  if (input->empty()) return FieldError("input", "must not be empty");
  bool calls_open = false;  // the last message is an assistant turn of function calls
  for (size_t i = 0; i < input->size(); ++i) {
    const json& item = (*input)[i];
    const std::string field = absl::StrCat("input[", i, "]");
    if (!item.is_object()) return FieldError(field, "expected an object");
    std::string type = "message";
    if (const json* t = Field(item, "type")) {
      if (!t->is_string()) return FieldError(field + ".type", "expected a string");
      type = t->get<std::string>();
    }
    if (type == "message") {
      std::string role;
      if (absl::Status s = RequiredString(item, "role", field, role); !s.ok()) return s;
      if (role == "developer") role = "system";  // what chat templates know
      if (role != "user" && role != "assistant" && role != "system") {
        return FieldError(
            field + ".role",
            absl::StrCat("expected user, assistant, system or developer, got ", Quoted(role)));
      }
      const json* content = Field(item, "content");
      if (content == nullptr) return FieldError(field + ".content", "required");
      absl::StatusOr<std::string> text = PartsText(*content, field + ".content");
      if (!text.ok()) return text.status();
      messages.push_back({{"role", role}, {"content", *std::move(text)}});
      calls_open = false;
    } else if (type == "function_call") {
      std::string call_id, name, arguments;
      if (absl::Status s = RequiredString(item, "call_id", field, call_id); !s.ok()) return s;
      if (absl::Status s = RequiredString(item, "name", field, name); !s.ok()) return s;
      if (absl::Status s = RequiredString(item, "arguments", field, arguments); !s.ok()) return s;
      json call = {{"id", call_id},
                   {"type", "function"},
                   {"function", {{"name", name}, {"arguments", arguments}}}};
      if (!calls_open) {
        messages.push_back(
            {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", json::array()}});
        calls_open = true;
      }
      messages.back()["tool_calls"].push_back(std::move(call));
    } else if (type == "function_call_output") {
      std::string call_id;
      if (absl::Status s = RequiredString(item, "call_id", field, call_id); !s.ok()) return s;
      const json* output = Field(item, "output");
      if (output == nullptr) return FieldError(field + ".output", "required");
      absl::StatusOr<std::string> text = PartsText(*output, field + ".output");
      if (!text.ok()) return text.status();
      messages.push_back({{"role", "tool"}, {"tool_call_id", call_id}, {"content", *text}});
      calls_open = false;
    } else {
      return FieldError(
          field + ".type",
          absl::StrCat("expected message, function_call or function_call_output, got ",
                       Quoted(type)));
    }
  }
  return absl::OkStatus();
}

// text.format -> response_format.
absl::Status TextFormat(const json& body, json& chat) {
  const json* text = Field(body, "text");
  if (text == nullptr) return absl::OkStatus();
  if (!text->is_object()) return FieldError("text", "expected an object");
  const json* format = Field(*text, "format");
  if (format == nullptr) return absl::OkStatus();
  if (!format->is_object()) return FieldError("text.format", "expected an object");
  const json* type = Field(*format, "type");
  if (type == nullptr || !type->is_string()) return FieldError("text.format.type", "required");
  const std::string kind = type->get<std::string>();
  if (kind == "text") return absl::OkStatus();
  if (kind == "json_object") {
    chat["response_format"] = {{"type", "json_object"}};
    return absl::OkStatus();
  }
  if (kind != "json_schema") {
    return FieldError(
        "text.format.type",
        absl::StrCat("expected text, json_object or json_schema, got ", Quoted(kind)));
  }
  json schema = json::object();
  if (const json* name = Field(*format, "name")) schema["name"] = *name;
  const json* value = Field(*format, "schema");
  if (value == nullptr) return FieldError("text.format.schema", "required");
  schema["schema"] = *value;
  if (const json* strict = Field(*format, "strict")) schema["strict"] = *strict;
  chat["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(schema)}};
  return absl::OkStatus();
}

// tools and tool_choice -> the chat shapes.
absl::Status Tools(const json& body, json& chat) {
  if (const json* tools = Field(body, "tools")) {
    if (!tools->is_array()) return FieldError("tools", "expected an array");
    json converted = json::array();
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& tool = (*tools)[i];
      const std::string field = absl::StrCat("tools[", i, "]");
      if (!tool.is_object()) return FieldError(field, "expected an object");
      const json* type = Field(tool, "type");
      if (type == nullptr || !type->is_string() || *type != "function") {
        return FieldError(field + ".type", absl::StrCat("only function tools are supported, not ",
                                                        type != nullptr && type->is_string()
                                                            ? Quoted(type->get<std::string>())
                                                            : std::string("that")));
      }
      std::string name;
      if (absl::Status s = RequiredString(tool, "name", field, name); !s.ok()) return s;
      json function = {{"name", name}};
      if (const json* description = Field(tool, "description")) {
        function["description"] = *description;
      }
      if (const json* parameters = Field(tool, "parameters")) function["parameters"] = *parameters;
      converted.push_back({{"type", "function"}, {"function", std::move(function)}});
    }
    chat["tools"] = std::move(converted);
  }
  if (const json* choice = Field(body, "tool_choice")) {
    if (choice->is_string()) {
      chat["tool_choice"] = *choice;
    } else if (choice->is_object()) {
      const json* type = Field(*choice, "type");
      if (type == nullptr || *type != "function") {
        return FieldError("tool_choice.type", "expected \"function\" (only function tools exist)");
      }
      std::string name;
      if (absl::Status s = RequiredString(*choice, "name", "tool_choice", name); !s.ok()) return s;
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", name}}}};
    } else {
      return FieldError("tool_choice", "expected a string or an object");
    }
  }
  return absl::OkStatus();
}

// A chat field's name (or a message beginning with it) as this request
// spelt it.
std::string RenamedField(const std::string& text) {
  for (const auto& [chat, responses] : std::vector<std::pair<std::string, std::string>>{
           {"max_tokens", "max_output_tokens"},
           {"response_format.json_schema", "text.format"},
           {"response_format", "text.format"},
           {"messages", "input"},
           {"tool_choice.function.name", "tool_choice.name"}}) {
    if (absl::StartsWith(text, chat)) return absl::StrCat(responses, text.substr(chat.size()));
  }
  return text;
}

absl::Status Renamed(const absl::Status& status) {
  if (!absl::IsInvalidArgument(status)) return status;
  return absl::InvalidArgumentError(RenamedField(std::string(status.message())));
}

}  // namespace

absl::StatusOr<ResponsesRequest> ParseResponsesRequest(absl::string_view body,
                                                       const std::function<absl::Status()>& check) {
  JsonLimits limits;
  limits.max_depth = kMaxOpenAiJsonDepth;
  limits.max_keys = kMaxOpenAiJsonKeys;
  limits.check = check;
  absl::StatusOr<json> parsed = ParseOrderedJson(body, "the body", limits);
  if (!parsed.ok()) return parsed.status();
  if (!parsed->is_object()) return absl::InvalidArgumentError("the body must be a JSON object");
  const json& request = *parsed;
  if (Field(request, "previous_response_id") != nullptr) {
    return FieldError("previous_response_id",
                      "this server keeps no responses (it is stateless); send the whole "
                      "conversation in input");
  }
  if (const json* store = Field(request, "store")) {
    if (!store->is_boolean()) return FieldError("store", "expected a boolean");
    if (store->get<bool>()) {
      return FieldError("store", "this server keeps no responses; send store: false");
    }
  }
  if (Field(request, "conversation") != nullptr) {
    return FieldError("conversation", "this server keeps no conversations (it is stateless)");
  }
  ResponsesRequest out;
  json chat = json::object();
  if (const json* model = Field(request, "model")) chat["model"] = *model;
  json messages = json::array();
  if (absl::Status s = InputMessages(request, messages); !s.ok()) return s;
  chat["messages"] = std::move(messages);
  if (const json* max = Field(request, "max_output_tokens")) {
    chat["max_tokens"] = *max;
    out.max_output_tokens_json = Dump(*max);
  }
  // Sampling, as on chat (top_k, min_p, seed, ignore_eos: vLLM's extensions).
  for (const char* name : {"temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos",
                           "presence_penalty", "frequency_penalty", "stream"}) {
    if (const json* value = Field(request, name)) chat[name] = *value;
  }
  if (absl::Status s = TextFormat(request, chat); !s.ok()) return s;
  if (absl::Status s = Tools(request, chat); !s.ok()) return s;
  absl::StatusOr<OpenAiRequest> converted =
      ParseOpenAiRequest(OpenAiEndpoint::kChat, Dump(chat), check);
  if (!converted.ok()) return Renamed(converted.status());
  out.chat = *std::move(converted);
  // The grammar compiles at submission: its errors name this request's field.
  if (out.chat.generation.structured) {
    out.chat.generation.structured->field = RenamedField(out.chat.generation.structured->field);
  }
  if (const json* value = Field(request, "instructions")) out.instructions_json = Dump(*value);
  if (const json* value = Field(request, "text")) out.text_json = Dump(*value);
  if (const json* value = Field(request, "tools")) out.tools_json = Dump(*value);
  if (const json* value = Field(request, "tool_choice")) out.tool_choice_json = Dump(*value);
  if (const json* value = Field(request, "metadata")) out.metadata_json = Dump(*value);
  out.temperature = out.chat.generation.sampling.temperature;
  out.top_p = out.chat.generation.sampling.top_p;
  return out;
}

namespace {
json MessageItem(const std::string& id, const std::string& status, const std::string& text,
                 bool with_content);
json CallItem(const std::string& id, const std::string& status, const grammar::ToolCall& call,
              const std::string& arguments);
}  // namespace

struct ResponsesWriter::State {
  std::string text;  // unary: all of it
  std::unique_ptr<grammar::ToolCallStreamParser> tools;
  int64_t sequence = 0;
  json output = json::array();  // the output items so far (streaming: done ones)
  // Streaming: the item being written (-1: none), and what it has so far.
  enum class Open { kNone, kMessage, kCall } open = Open::kNone;
  json item;
  std::string item_text;  // the message's text, or the call's arguments
  std::optional<grammar::ToolCall> call;

  // One SSE event: "event: TYPE" and its data, numbered.
  std::string Emit(const std::string& type, const json& fields) {
    json data = {{"type", type}, {"sequence_number", sequence++}};
    for (const auto& [key, value] : fields.items()) data[key] = value;
    return absl::StrCat("event: ", type, "\ndata: ", Dump(data), "\n\n");
  }
  int64_t OutputIndex() const { return static_cast<int64_t>(output.size()); }

  std::string Text(const std::string& delta) {
    std::string events;
    if (open == Open::kCall) events += Close();
    if (open == Open::kNone) {
      open = Open::kMessage;
      item = MessageItem(RandomId("msg_", 32), "in_progress", "", /*with_content=*/false);
      item_text.clear();
      events +=
          Emit("response.output_item.added", {{"output_index", OutputIndex()}, {"item", item}});
      events += Emit("response.content_part.added", {{"item_id", item["id"]},
                                                     {"output_index", OutputIndex()},
                                                     {"content_index", 0},
                                                     {"part",
                                                      {{"type", "output_text"},
                                                       {"text", ""},
                                                       {"annotations", json::array()},
                                                       {"logprobs", json::array()}}}});
    }
    item_text += delta;
    events += Emit("response.output_text.delta", {{"item_id", item["id"]},
                                                  {"output_index", OutputIndex()},
                                                  {"content_index", 0},
                                                  {"delta", delta},
                                                  {"logprobs", json::array()}});
    return events;
  }

  std::string OpenCall(const grammar::ToolCall& begun) {
    std::string events = Close();
    open = Open::kCall;
    call = begun;
    item_text.clear();
    item = CallItem(RandomId("fc_", 32), "in_progress", begun, "");
    events += Emit("response.output_item.added", {{"output_index", OutputIndex()}, {"item", item}});
    if (!begun.arguments.empty()) events += Arguments(begun.arguments);
    return events;
  }

  std::string Arguments(const std::string& delta) {
    if (open != Open::kCall) return "";
    item_text += delta;
    return Emit("response.function_call_arguments.delta",
                {{"item_id", item["id"]}, {"output_index", OutputIndex()}, {"delta", delta}});
  }

  // The open item's .done events; the item joins the output.
  std::string Close() {
    std::string events;
    if (open == Open::kMessage) {
      const json part = {{"type", "output_text"},
                         {"text", item_text},
                         {"annotations", json::array()},
                         {"logprobs", json::array()}};
      events += Emit("response.output_text.done", {{"item_id", item["id"]},
                                                   {"output_index", OutputIndex()},
                                                   {"content_index", 0},
                                                   {"text", item_text},
                                                   {"logprobs", json::array()}});
      events += Emit("response.content_part.done", {{"item_id", item["id"]},
                                                    {"output_index", OutputIndex()},
                                                    {"content_index", 0},
                                                    {"part", part}});
      item["status"] = "completed";
      item["content"] = json::array({part});
    } else if (open == Open::kCall) {
      events += Emit("response.function_call_arguments.done", {{"item_id", item["id"]},
                                                               {"output_index", OutputIndex()},
                                                               {"name", call->name},
                                                               {"arguments", item_text}});
      item["status"] = "completed";
      item["arguments"] = item_text;
    } else {
      return events;
    }
    events += Emit("response.output_item.done", {{"output_index", OutputIndex()}, {"item", item}});
    output.push_back(std::move(item));
    item = json();
    open = Open::kNone;
    return events;
  }

  std::string Events(std::vector<grammar::ToolCallStreamParser::Event> parsed) {
    std::string events;
    for (auto& e : parsed) {
      if (!e.content.empty()) events += Text(e.content);
      if (e.call) events += OpenCall(*e.call);
      if (!e.arguments.empty()) events += Arguments(e.arguments);
    }
    return events;
  }
};

ResponsesWriter::ResponsesWriter(const ResponsesRequest& request, std::string model,
                                 int64_t created_at, std::string id)
    : request_(request),
      model_(std::move(model)),
      created_at_(created_at),
      id_(std::move(id)),
      state_(std::make_unique<State>()) {
  if (id_.empty()) id_ = RandomId("resp_", 32);
  if (request.chat.tool_call_format != grammar::ToolCallFormat::kNone) {
    state_->tools = std::make_unique<grammar::ToolCallStreamParser>(request.chat.tool_call_format);
  }
}

ResponsesWriter::~ResponsesWriter() = default;

namespace {

json MessageItem(const std::string& id, const std::string& status, const std::string& text,
                 bool with_content) {
  json content = json::array();
  if (with_content) {
    content.push_back({{"type", "output_text"},
                       {"text", text},
                       {"annotations", json::array()},
                       {"logprobs", json::array()}});
  }
  return {{"id", id},
          {"type", "message"},
          {"status", status},
          {"role", "assistant"},
          {"content", std::move(content)}};
}

json CallItem(const std::string& id, const std::string& status, const grammar::ToolCall& call,
              const std::string& arguments) {
  return {{"id", id},           {"type", "function_call"},
          {"status", status},   {"arguments", arguments},
          {"call_id", call.id}, {"name", call.name}};
}

json ParsedOrNull(const std::string& text) {
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  return value.is_discarded() ? json(nullptr) : value;
}

}  // namespace

namespace {
// The response object.
json ResponseJson(const ResponsesRequest& request, const std::string& id, int64_t created_at,
                  const std::string& model, const std::string& status, const json& output,
                  const engine::Completion* completion) {
  json usage = nullptr;
  if (completion != nullptr) {
    usage = {{"input_tokens", completion->prompt_tokens},
             {"input_tokens_details", {{"cached_tokens", 0}}},
             {"output_tokens", completion->generated_tokens},
             {"output_tokens_details", {{"reasoning_tokens", 0}}},
             {"total_tokens", completion->prompt_tokens + completion->generated_tokens}};
  }
  json incomplete = nullptr;
  if (status == "incomplete") incomplete = {{"reason", "max_output_tokens"}};
  return {{"id", id},
          {"object", "response"},
          {"created_at", created_at},
          {"status", status},
          {"error", nullptr},
          {"incomplete_details", std::move(incomplete)},
          {"instructions", ParsedOrNull(request.instructions_json)},
          {"max_output_tokens", ParsedOrNull(request.max_output_tokens_json)},
          {"model", model},
          {"output", output},
          {"parallel_tool_calls", true},
          {"previous_response_id", nullptr},
          {"reasoning", {{"effort", nullptr}, {"summary", nullptr}}},
          {"store", false},
          {"temperature", request.temperature},
          {"text", ParsedOrNull(request.text_json)},
          {"tool_choice", ParsedOrNull(request.tool_choice_json)},
          {"tools", ParsedOrNull(request.tools_json)},
          {"top_p", request.top_p},
          {"truncation", "disabled"},
          {"usage", std::move(usage)},
          {"user", nullptr},
          {"metadata", ParsedOrNull(request.metadata_json)}};
}

const char* StatusOf(const engine::Completion& completion) {
  return completion.finish == engine::Finish::kLength ? "incomplete" : "completed";
}
}  // namespace

void ResponsesWriter::Add(const engine::TokenChunk& chunk) { state_->text += chunk.text; }

std::string ResponsesWriter::Final(const engine::Completion& completion) {
  json output = json::array();
  std::vector<grammar::ToolCall> calls;
  std::string text = state_->text;
  if (request_.chat.tool_call_format != grammar::ToolCallFormat::kNone) {
    grammar::ParsedToolCalls parsed = grammar::ParseToolCalls(request_.chat.tool_call_format, text);
    calls = std::move(parsed.calls);
    if (!calls.empty()) text = std::move(parsed.content);
  }
  if (!text.empty() || calls.empty()) {
    output.push_back(MessageItem(RandomId("msg_", 32), "completed", text, /*with_content=*/true));
  }
  for (const grammar::ToolCall& call : calls) {
    output.push_back(CallItem(RandomId("fc_", 32), "completed", call, call.arguments));
  }
  return Dump(
      ResponseJson(request_, id_, created_at_, model_, StatusOf(completion), output, &completion));
}

std::string ResponsesWriter::StreamStart() {
  const json response =
      ResponseJson(request_, id_, created_at_, model_, "in_progress", json::array(), nullptr);
  std::string events = state_->Emit("response.created", {{"response", response}});
  events += state_->Emit("response.in_progress", {{"response", response}});
  return events;
}

std::string ResponsesWriter::StreamChunk(const engine::TokenChunk& chunk) {
  if (chunk.text.empty()) return "";
  if (state_->tools != nullptr) return state_->Events(state_->tools->Add(chunk.text));
  return state_->Text(chunk.text);
}

std::string ResponsesWriter::StreamEnd(const engine::Completion& completion) {
  std::string events;
  if (state_->tools != nullptr) events += state_->Events(state_->tools->Finish());
  events += state_->Close();
  const std::string status = StatusOf(completion);
  events += state_->Emit(status == "completed" ? "response.completed" : "response.incomplete",
                         {{"response", ResponseJson(request_, id_, created_at_, model_, status,
                                                    state_->output, &completion)}});
  return events;
}

std::string ResponsesWriter::StreamError(const OpenAiError& error) {
  return state_->Emit("error",
                      {{"code", error.code.empty() ? json(nullptr) : json(error.code)},
                       {"message", error.message},
                       {"param", error.param.empty() ? json(nullptr) : json(error.param)}});
}

}  // namespace accel::server::internal
