// Regular expressions of tokenizer.json, written for Oniguruma (what
// HuggingFace tokenizers compiles them with), run on RE2.
//
// Translation (TranslateOniguruma): \s and \S mean Unicode White_Space as in
// Oniguruma (RE2's \s is ASCII), also inside classes; \d is \p{Nd}, \w is
// [\p{L}\p{M}\p{Nd}\p{Pc}], \h is a hex digit; \uHHHH becomes \x{HHHH};
// every group becomes non-capturing. The lookahead idiom `\s+(?!\S)` of the
// GPT-2, Llama 3 and Qwen2 patterns, which RE2 lacks, is replaced by a
// capturing `(\s+)` and the match is cut afterwards (see Regex::FindAll).
// Anything else RE2 cannot mean the same way (other lookarounds, atomic
// groups, possessive quantifiers, backreferences, \b, ^ and $, nested
// classes, flags other than i) is Unimplemented, naming the pattern.
#ifndef ACCEL_TOKENIZER_INTERNAL_REGEX_H_
#define ACCEL_TOKENIZER_INTERNAL_REGEX_H_

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace re2 {
class RE2;
}

namespace accel::tokenizer::internal {

// How the whitespace lookahead idiom appeared in the pattern.
enum class WhitespaceIdiom {
  kNone,
  kWithFallback,  // `\s+(?!\S)|\s+`: a run followed by a non-space keeps all but its last char
  kAlone,         // `\s+(?!\S)` as the last alternative: a single space before a non-space fails
};

struct TranslatedPattern {
  std::string re2_pattern;
  WhitespaceIdiom idiom = WhitespaceIdiom::kNone;
};

absl::StatusOr<TranslatedPattern> TranslateOniguruma(absl::string_view pattern);

// A compiled pattern: an Oniguruma regex on RE2, or a literal string.
class Regex {
 public:
  // Unimplemented for a construct RE2 cannot match the same way, naming the pattern.
  static absl::StatusOr<std::unique_ptr<Regex>> FromOniguruma(absl::string_view pattern);
  // Matches `literal` exactly (what HF does with regex::escape). Unimplemented when empty.
  static absl::StatusOr<std::unique_ptr<Regex>> FromLiteral(absl::string_view literal);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The (start, end) byte offsets of successive non-overlapping matches in
  // `text`, following the onig crate's find_iter: an empty match right where
  // the previous match ended is skipped by advancing one character.
  void FindAll(absl::string_view text, std::vector<std::pair<size_t, size_t>>* out) const;

 private:
  Regex() = default;
  std::unique_ptr<re2::RE2> re_;  // null for a literal
  std::string literal_;
  WhitespaceIdiom idiom_ = WhitespaceIdiom::kNone;
};

// A stretch of text and whether it was a match (HF's Pattern::find_matches):
// the stretches cover the whole text in order; an empty text gives one empty
// non-match.
struct Segment {
  size_t start;
  size_t end;
  bool is_match;
};
void FindSegments(const Regex& regex, absl::string_view text, std::vector<Segment>* out);

}  // namespace accel::tokenizer::internal

#endif  // ACCEL_TOKENIZER_INTERNAL_REGEX_H_
