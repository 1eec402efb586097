// jinja/internal/parser.h: tokens -> Program, following @huggingface/jinja's
// grammar and precedence (filters bind tighter than `is`, which binds tighter
// than arithmetic). Unknown tags, filters and tests are errors here.
#ifndef ACCEL_JINJA_INTERNAL_PARSER_H_
#define ACCEL_JINJA_INTERNAL_PARSER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "jinja/internal/ast.h"
#include "jinja/internal/lexer.h"

namespace accel::jinja::internal {

// Deeper templates are errors (evaluation recurses on the tree).
inline constexpr int kMaxTreeDepth = 200;

absl::StatusOr<Program> Parse(const std::vector<Token>& tokens);

bool IsKnownFilter(const std::string& name);
bool IsKnownTest(const std::string& name);
// Jinja2's own filters and tests that @huggingface/jinja lacks: a template may
// name them in a branch it never takes, so using one is a render error.
bool IsJinja2Filter(const std::string& name);
bool IsJinja2Test(const std::string& name);

}  // namespace accel::jinja::internal

#endif  // ACCEL_JINJA_INTERNAL_PARSER_H_
