// jinja/jinja.h: HuggingFace chat templates (tokenizer_config.json
// "chat_template"), rendered byte for byte as @huggingface/jinja renders them
// (the interpreter transformers.js uses; tests/jinja/reference/ pins it).
//
//   ACCEL_ASSIGN_OR_RETURN(jinja::Template t, jinja::Template::Parse(source));
//   ACCEL_ASSIGN_OR_RETURN(std::string prompt,
//                          t.Render({{"messages", messages}, {"add_generation_prompt", true}}));
//
// Where @huggingface/jinja and Python's Jinja2 differ, this follows
// @huggingface/jinja (true prints "true", str.strip() ignores its argument,
// `~` prints 1.0 as "1", only its filters and tests exist). Known differences
// from it: division by zero and integer overflow are errors (not Infinity),
// upper/lower/title/capitalize change ASCII letters only, sort_keys orders
// keys case-insensitively rather than by ICU collation, and strftime_now
// passes every directive to strftime(3). Dicts from `context` keep their
// keys' order (an ordered_json), as Python's dicts and JS objects do, so
// `tool | tojson` prints a tool as transformers prints it.
// Hostile templates are bounded: nesting, macro recursion, loop work, value
// sizes and the output (64 MiB) end in an error, never a crash or a hang.
//
// A Template is immutable after Parse and cheap to copy (it shares its tree);
// Render may be called from many threads at once. Torch-free: target accel_jinja.
#ifndef ACCEL_JINJA_JINJA_H_
#define ACCEL_JINJA_JINJA_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "nlohmann/json_fwd.hpp"

namespace accel::jinja {

namespace internal {
struct Program;
}  // namespace internal

struct TemplateOptions {
  bool trim_blocks = true;  // as transformers sets them for chat templates
  bool lstrip_blocks = true;
  bool keep_trailing_newline = false;
};

class Template {
 public:
  // Errors are InvalidArgument naming the line: "chat template line 3:
  // unknown filter 'foo'". Unknown tags, filters and tests are errors here.
  static absl::StatusOr<Template> Parse(absl::string_view source, TemplateOptions options = {});

  // `context` is a JSON object whose members are the template's variables.
  // raise_exception('msg') gives InvalidArgument whose message contains msg.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;

 private:
  explicit Template(std::shared_ptr<const internal::Program> program)
      : program_(std::move(program)) {}

  std::shared_ptr<const internal::Program> program_;
};

}  // namespace accel::jinja

#endif  // ACCEL_JINJA_JINJA_H_
