// grammar/tool_calls.h: the tool calls a model writes, parsed out of its text
// (vLLM's --tool_call_parser names), and the grammar that makes a model write
// one (tool_choice "required" or a named function).
//
//   hermes       Hermes, Qwen 2.5 / Qwen 3: <tool_call>{"name": .., "arguments": {..}}</tool_call>
//   llama3_json  Llama 3.1 / 3.2: [<|python_tag|>]{"name": .., "parameters": {..}}[; {..}]
//   mistral      Mistral: [TOOL_CALLS][{"name": .., "arguments": {..}}, ..] (the marker is a
//                special token: text decoded without it starts at the '[')
//   auto         from the chat template (DetectToolCallFormat)
//
// Text before the first call stays content. Text that looks like a call but
// does not parse (bad JSON, no name) is content, as vLLM leaves it.
// Pure functions over text; ToolCallStreamParser does the same over a
// stream of text pieces.
#ifndef ACCEL_GRAMMAR_TOOL_CALLS_H_
#define ACCEL_GRAMMAR_TOOL_CALLS_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::grammar {

enum class ToolCallFormat { kNone, kHermes, kLlama3Json, kMistral };

// "hermes", "llama3_json", "mistral"; "auto" needs the template
// (DetectToolCallFormat). InvalidArgument naming the accepted names.
absl::StatusOr<ToolCallFormat> ToolCallFormatFromName(absl::string_view name);
absl::string_view ToolCallFormatName(ToolCallFormat format);
// The format of a vocabulary's call marker token (`has_token`: whether the
// vocabulary holds that token): <tool_call> hermes, [TOOL_CALLS] mistral,
// <|python_tag|> llama3_json; kNone without one (--tool_call_parser auto).
ToolCallFormat ToolCallFormatFromVocabulary(
    const std::function<bool(absl::string_view token)>& has_token);
// The format a chat template writes tool calls in (kNone when it writes none).
ToolCallFormat DetectToolCallFormat(absl::string_view chat_template);

struct ToolCall {
  std::string id;  // "call_" and 24 letters and digits (Mistral: 9)
  std::string name;
  std::string arguments;  // a JSON object, as text
};

struct ParsedToolCalls {
  std::string content;  // the text before the calls (all of it without calls)
  std::vector<ToolCall> calls;
};

ParsedToolCalls ParseToolCalls(ToolCallFormat format, absl::string_view text);

// A fresh call id in the format's shape.
std::string NewToolCallId(ToolCallFormat format);

// Streaming: content is passed on as it comes, except a tail that may be the
// start of a call marker, which is held. A call whose object starts
// {"name": "...", "arguments" (or "parameters"): {...  streams as OpenAI
// streams it: an event with the call (id, name, arguments "") as soon as its
// name is complete, then events with pieces of its arguments' JSON text as
// they are written (their concatenation is the arguments as the model wrote
// them). A call in another shape comes out whole, in one event, once it is
// complete.
class ToolCallStreamParser {
 public:
  struct Event {
    std::string content;           // text for delta.content (may be empty)
    std::optional<ToolCall> call;  // a call begins: id, name, its arguments so far
    std::string arguments;         // more of call `index`'s arguments (may be empty)
    int index = 0;                 // the call's index in the message
  };
  explicit ToolCallStreamParser(ToolCallFormat format) : format_(format) {}
  std::vector<Event> Add(absl::string_view piece);
  // The end of the text: a held tail is content, and an unfinished call's text too.
  std::vector<Event> Finish();
  // Calls begun so far.
  int num_calls() const { return emitted_; }

 private:
  std::vector<Event> Drain(bool final);
  // In a streamed call's arguments: passes on what the buffer holds of them.
  void StreamArguments(std::vector<Event>& events);
  ToolCallFormat format_;
  std::string buffer_;      // text not passed on yet
  bool in_calls_ = false;   // a call marker was seen
  bool seen_text_ = false;  // content (other than whitespace) came before
  int emitted_ = 0;
  // A call whose arguments are being streamed: the JSON scan's state.
  bool in_arguments_ = false;
  int depth_ = 0;
  bool in_string_ = false;
  bool escaped_ = false;
  bool close_pending_ = false;  // the call object's own '}' is still to come
};

// The GBNF a model must follow to call one of `tools_json` (an OpenAI tools
// array), or only `function_name` when given, in `format`'s syntax, with
// arguments matching the function's parameters schema. InvalidArgument
// naming the tool or the unknown function.
absl::StatusOr<std::string> ToolCallGbnf(ToolCallFormat format, absl::string_view tools_json,
                                         std::optional<std::string> function_name);

}  // namespace accel::grammar

#endif  // ACCEL_GRAMMAR_TOOL_CALLS_H_
