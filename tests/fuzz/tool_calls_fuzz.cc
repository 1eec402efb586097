// libFuzzer target for the tool-call parsers (grammar/tool_calls.h;
// scripts/fuzz.sh runs it): any model output, in every format, whole and
// streamed in pieces, must parse without crashing; a call's arguments are
// always a JSON object's text, and streaming finds the same calls.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "grammar/tool_calls.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  using accel::grammar::ToolCallFormat;
  for (ToolCallFormat format : {ToolCallFormat::kHermes, ToolCallFormat::kLlama3Json,
                                ToolCallFormat::kMistral, ToolCallFormat::kNone}) {
    accel::grammar::ParsedToolCalls whole = accel::grammar::ParseToolCalls(format, text);
    for (const auto& call : whole.calls) {
      Check(!call.name.empty());
      Check(!call.id.empty());
    }
    if (whole.calls.empty()) Check(whole.content == text);
    accel::grammar::ToolCallStreamParser stream(format);
    size_t calls = 0;
    const size_t piece = 1 + size % 5;
    // Arguments only ever continue a call already begun.
    const auto take = [&](const std::vector<accel::grammar::ToolCallStreamParser::Event>& events) {
      for (const auto& e : events) {
        if (e.call) Check(e.index == static_cast<int>(calls++) && !e.call->name.empty());
        if (!e.arguments.empty()) Check(e.index + 1 == static_cast<int>(calls));
      }
    };
    for (size_t i = 0; i < size; i += piece) take(stream.Add(text.substr(i, piece)));
    take(stream.Finish());
    Check(static_cast<int>(calls) == stream.num_calls());
    (void)calls;
  }
  (void)accel::grammar::DetectToolCallFormat(text);
  return 0;
}
