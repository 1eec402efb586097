// libFuzzer target for chat templates (jinja/jinja.h; scripts/fuzz.sh runs
// it). Any input must parse or give InvalidArgument; a template that parses
// must render a fixed conversation or give an error, within tight limits (so
// that a loop-heavy input stays fast), without crashing, leaking or hanging.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "jinja/internal/evaluator.h"
#include "jinja/internal/lexer.h"
#include "jinja/internal/parser.h"
#include "jinja/jinja.h"
#include "nlohmann/json.hpp"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

const nlohmann::ordered_json& Context() {
  static const auto* const context = new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Hi {{ x }} \u00e9 \ud83d\ude00"},
      {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [true, null, 2.5]}}}]},
      {"role": "tool", "content": "{\"ok\": 1}"}
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "n": 3, "f": 1.5
  })"));
  return *context;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  accel::jinja::TemplateOptions options;
  options.lstrip_blocks = size % 2 == 0;
  options.trim_blocks = size % 3 != 0;
  absl::StatusOr<std::vector<accel::jinja::internal::Token>> tokens =
      accel::jinja::internal::Tokenize(source, options);
  if (!tokens.ok()) {
    Check(tokens.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  absl::StatusOr<accel::jinja::internal::Program> program = accel::jinja::internal::Parse(*tokens);
  if (!program.ok()) {
    Check(program.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  accel::jinja::internal::Limits limits;
  limits.max_steps = 200'000;
  limits.max_output = size_t{1} << 20;
  limits.max_items = 10'000;
  limits.max_bytes = int64_t{32} << 20;
  absl::StatusOr<std::string> out =
      accel::jinja::internal::RenderProgram(*program, Context(), limits);
  if (out.ok()) {
    Check(out->size() <= limits.max_output);
  } else {
    Check(out.status().code() == absl::StatusCode::kInvalidArgument);
  }
  // The public entry point agrees with the parts it is made of.
  Check(accel::jinja::Template::Parse(source, options).ok());
  return 0;
}
