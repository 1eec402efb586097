// jinja/internal/lexer.h: @huggingface/jinja's preprocessing (trailing
// newline, lstrip_blocks, trim_blocks, the generation tags) and tokenizer.
#ifndef ACCEL_JINJA_INTERNAL_LEXER_H_
#define ACCEL_JINJA_INTERNAL_LEXER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "jinja/jinja.h"

namespace accel::jinja::internal {

enum class TokenType {
  kText,
  kNumber,
  kString,
  kIdentifier,
  kEquals,
  kOpenParen,
  kCloseParen,
  kOpenStatement,
  kCloseStatement,
  kOpenExpression,
  kCloseExpression,
  kOpenSquare,
  kCloseSquare,
  kOpenCurly,
  kCloseCurly,
  kComma,
  kDot,
  kColon,
  kPipe,
  kAdditive,        // + - ~
  kMultiplicative,  // * / // %
  kPower,           // **
  kComparison,      // < > <= >= == !=
  kUnary,           // a sign with no digits after it
  kComment,
};

struct Token {
  TokenType type;
  std::string value;
  int line;  // in the source as given, before preprocessing
};

// Errors are InvalidArgument "chat template line N: ...".
absl::StatusOr<std::vector<Token>> Tokenize(absl::string_view source,
                                            const TemplateOptions& options);

// The byte length of the JavaScript whitespace character (\s) at s[i], or 0.
int JsSpaceAt(absl::string_view s, size_t i);
// The byte length of the JavaScript whitespace character ending at s[end - 1], or 0.
int JsSpaceBefore(absl::string_view s, size_t end);

}  // namespace accel::jinja::internal

#endif  // ACCEL_JINJA_INTERNAL_LEXER_H_
