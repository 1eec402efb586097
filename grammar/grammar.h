// grammar/grammar.h: the grammars of structured output, compiled to one form
// that the matcher (grammar/matcher.h) runs byte by byte.
//
//   ACCEL_ASSIGN_OR_RETURN(auto g, grammar::ParseGbnf("root ::= \"yes\" | \"no\""));
//   ACCEL_ASSIGN_OR_RETURN(auto r, grammar::CompileRegex("[0-9]{3}-[0-9]{4}"));
//   ACCEL_ASSIGN_OR_RETURN(auto c, grammar::CompileChoices({"red", "green"}));
//   bool ok = g->Matches("yes");
//
// GBNF is llama.cpp's grammar syntax: `name ::= alternatives`, "literals",
// [character classes] with ranges and ^, `.` (any character), ( groups ),
// and the postfix operators * + ? {m} {m,} {m,n}; `#` starts a comment; the
// start rule is `root`. Every other front end (regular expressions, choice
// lists, JSON Schema: grammar/json_schema.h) writes GBNF and goes through the
// same parser. A compiled Grammar works on bytes: character classes become
// alternatives of UTF-8 byte sequences, so a character may be split across
// tokens and a token may span several grammar symbols.
//
// Refused with InvalidArgument (naming what, and the line and column for
// GBNF): syntax errors, undefined rules, a missing root, left recursion (a
// rule that can reach itself before reading a byte, `a ::= a "x"` or
// `r ::= ("x"?)*`), repetition bounds over kMaxRepetition, grammars over
// kMaxGrammarElements. A grammar so ambiguous that more than 128 parses of
// the text are alive at once (`(x?){500}`) refuses the text there rather
// than spend time in the square of that per byte. Torch-free, on core only.
#ifndef ACCEL_GRAMMAR_GRAMMAR_H_
#define ACCEL_GRAMMAR_GRAMMAR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::grammar {

// The largest m or n of a bounded repetition {m,n}.
inline constexpr int kMaxRepetition = 10000;
// The most byte and rule elements a compiled grammar may hold.
inline constexpr int64_t kMaxGrammarElements = int64_t{1} << 22;

namespace internal {
struct GrammarData;
}

// A compiled grammar: immutable, shared by every matcher that runs it.
class Grammar {
 public:
  explicit Grammar(std::unique_ptr<internal::GrammarData> data);
  ~Grammar();
  Grammar(const Grammar&) = delete;
  Grammar& operator=(const Grammar&) = delete;

  // Whether the whole of `text` (bytes) is a sentence of the grammar.
  bool Matches(absl::string_view text) const;
  int64_t num_rules() const;
  int64_t num_elements() const;
  const internal::GrammarData& data() const { return *data_; }

 private:
  std::unique_ptr<internal::GrammarData> data_;
};

// `what` names the grammar in messages ("the grammar field").
absl::StatusOr<std::shared_ptr<const Grammar>> ParseGbnf(absl::string_view text,
                                                         absl::string_view what = "grammar");

// A regular expression (the common syntax of RE2, Python and ECMAScript:
// literals, escapes \d \w \s \D \W \S \n \t \xHH \uHHHH, classes, `.`,
// groups (...) and (?:...), |, * + ? {m} {m,} {m,n} and their lazy forms)
// matched against the whole output. ^ at the start and $ at the end are
// accepted; anchors elsewhere, backreferences and lookaround are
// InvalidArgument naming the construct.
absl::StatusOr<std::shared_ptr<const Grammar>> CompileRegex(absl::string_view pattern);
// The regex as a GBNF expression (for other front ends). With
// `json_string`: the text the expression matches is the inside of a JSON
// string whose decoded value matches the pattern (quotes and backslashes
// escaped; control characters left out).
absl::StatusOr<std::string> RegexToGbnf(absl::string_view pattern, bool json_string = false);

// Exactly one of `choices` (at least one, each non-empty).
absl::StatusOr<std::shared_ptr<const Grammar>> CompileChoices(
    const std::vector<std::string>& choices);

// `text` as a GBNF string literal, "..." with escapes.
std::string GbnfLiteral(absl::string_view text);

}  // namespace accel::grammar

#endif  // ACCEL_GRAMMAR_GRAMMAR_H_
