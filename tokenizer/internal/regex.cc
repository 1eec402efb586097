#include "tokenizer/internal/regex.h"

#include <re2/re2.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

#include "core/status.h"
#include "tokenizer/internal/unicode.h"

namespace accel::tokenizer::internal {
namespace {

// Unicode White_Space, which Oniguruma's \s matches (RE2's \s is ASCII only).
constexpr absl::string_view kSpaceItems =
    "\\x{09}-\\x{0D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";
constexpr absl::string_view kWordItems = "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";
constexpr absl::string_view kIdiom = "\\s+(?!\\S)";
constexpr absl::string_view kFallback = "\\s+";

absl::Status Unsupported(absl::string_view pattern, absl::string_view what) {
  return absl::UnimplementedError(
      absl::StrCat("regex pattern \"", absl::CEscape(pattern), "\": ", what,
                   " is not supported (Oniguruma patterns run on RE2)"));
}

// Splits `pattern` at its top-level `|` (outside groups and classes).
std::vector<absl::string_view> TopLevelAlternatives(absl::string_view pattern) {
  std::vector<absl::string_view> out;
  int depth = 0;
  bool in_class = false;
  size_t class_start = 0;
  size_t start = 0;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      ++i;
      continue;
    }
    if (in_class) {
      // A ']' right after '[' or '[^' is a literal.
      const bool first = i == class_start || (i == class_start + 1 && pattern[class_start] == '^');
      if (c == ']' && !first) in_class = false;
      continue;
    }
    if (c == '[') {
      in_class = true;
      class_start = i + 1;
    } else if (c == '(') {
      ++depth;
    } else if (c == ')') {
      --depth;
    } else if (c == '|' && depth == 0) {
      out.push_back(pattern.substr(start, i - start));
      start = i + 1;
    }
  }
  out.push_back(pattern.substr(start));
  return out;
}

class Translator {
 public:
  explicit Translator(absl::string_view pattern) : pattern_(pattern) {}

  // Translates one alternative (or any fragment without the idiom) into out_.
  absl::Status Fragment(absl::string_view text) {
    size_t i = 0;
    while (i < text.size()) {
      const char c = text[i];
      if (c == '\\') {
        ACCEL_RETURN_IF_ERROR(Escape(text, &i, /*in_class=*/false));
      } else if (c == '[') {
        ACCEL_RETURN_IF_ERROR(Class(text, &i));
      } else if (c == '(') {
        ACCEL_RETURN_IF_ERROR(Group(text, &i));
      } else if (c == '^' || c == '$') {
        return Unsupported(pattern_, "the anchor ^ or $");
      } else if (c == '*' || c == '+' || c == '?' || c == '}') {
        if (i + 1 < text.size() && text[i + 1] == '+') {
          return Unsupported(pattern_, "a possessive quantifier");
        }
        out_.push_back(c);
        ++i;
      } else {
        out_.push_back(c);
        ++i;
      }
    }
    return absl::OkStatus();
  }

  std::string& out() { return out_; }

 private:
  // A property name after \p or \P: \pL, \p{L}, \p{^L}.
  absl::Status Property(absl::string_view text, size_t* i, bool negated) {
    // text[*i] is 'p' or 'P'.
    size_t j = *i + 1;
    if (j >= text.size()) return Unsupported(pattern_, "a truncated \\p");
    if (text[j] != '{') {
      absl::StrAppend(&out_, negated ? "\\P" : "\\p", text.substr(j, 1));
      *i = j + 1;
      return absl::OkStatus();
    }
    const size_t close = text.find('}', j);
    if (close == absl::string_view::npos) return Unsupported(pattern_, "an unterminated \\p{");
    absl::string_view name = text.substr(j + 1, close - j - 1);
    if (absl::ConsumePrefix(&name, "^")) negated = !negated;
    if (name.empty()) return Unsupported(pattern_, "an empty \\p{}");
    for (char ch : name) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(ch)) && ch != '_') {
        return Unsupported(pattern_, "a property name with punctuation");
      }
    }
    absl::StrAppend(&out_, negated ? "\\P{" : "\\p{", name, "}");
    *i = close + 1;
    return absl::OkStatus();
  }

  absl::Status Escape(absl::string_view text, size_t* i, bool in_class) {
    if (*i + 1 >= text.size()) return Unsupported(pattern_, "a trailing backslash");
    const char e = text[*i + 1];
    switch (e) {
      case 's':
        absl::StrAppend(&out_, in_class ? "" : "[", kSpaceItems, in_class ? "" : "]");
        break;
      case 'S':
        if (in_class) return Unsupported(pattern_, "\\S inside a class");
        absl::StrAppend(&out_, "[^", kSpaceItems, "]");
        break;
      case 'd':
        out_.append("\\p{Nd}");
        break;
      case 'D':
        out_.append("\\P{Nd}");
        break;
      case 'w':
        absl::StrAppend(&out_, in_class ? "" : "[", kWordItems, in_class ? "" : "]");
        break;
      case 'W':
        if (in_class) return Unsupported(pattern_, "\\W inside a class");
        absl::StrAppend(&out_, "[^", kWordItems, "]");
        break;
      case 'h':
        out_.append(in_class ? "0-9a-fA-F" : "[0-9a-fA-F]");
        break;
      case 'H':
        if (in_class) return Unsupported(pattern_, "\\H inside a class");
        out_.append("[^0-9a-fA-F]");
        break;
      case 'p':
      case 'P':
        ++*i;
        return Property(text, i, e == 'P');
      case 'u': {
        if (*i + 6 > text.size()) return Unsupported(pattern_, "a truncated \\u escape");
        absl::string_view hex = text.substr(*i + 2, 4);
        for (char h : hex) {
          if (!absl::ascii_isxdigit(static_cast<unsigned char>(h))) {
            return Unsupported(pattern_, "a malformed \\u escape");
          }
        }
        absl::StrAppend(&out_, "\\x{", hex, "}");
        *i += 6;
        return absl::OkStatus();
      }
      case 'x': {
        size_t j = *i + 2;
        if (j < text.size() && text[j] == '{') {
          const size_t close = text.find('}', j);
          if (close == absl::string_view::npos)
            return Unsupported(pattern_, "an unterminated \\x{");
          out_.append(text.data() + *i, close + 1 - *i);
          *i = close + 1;
          return absl::OkStatus();
        }
        size_t k = j;
        while (k < text.size() && k < j + 2 &&
               absl::ascii_isxdigit(static_cast<unsigned char>(text[k]))) {
          ++k;
        }
        if (k == j) return Unsupported(pattern_, "a malformed \\x escape");
        absl::StrAppend(&out_, "\\x{", text.substr(j, k - j), "}");
        *i = k;
        return absl::OkStatus();
      }
      case 't':
      case 'n':
      case 'r':
      case 'f':
      case 'v':
      case 'a':
        out_.push_back('\\');
        out_.push_back(e);
        break;
      case 'e':
        out_.append("\\x{1B}");
        break;
      case 'A':
      case 'z':
        if (in_class) return Unsupported(pattern_, "an anchor inside a class");
        out_.push_back('\\');
        out_.push_back(e);
        break;
      default:
        if (absl::ascii_isalnum(static_cast<unsigned char>(e))) {
          return Unsupported(pattern_, absl::StrCat("the escape \\", absl::string_view(&e, 1)));
        }
        if (static_cast<unsigned char>(e) >= 0x80) {
          // An escaped non-ASCII character is that character.
          const size_t n = Utf8Length(static_cast<unsigned char>(e));
          out_.append(text.data() + *i + 1, std::min(n, text.size() - *i - 1));
          *i += 1 + n;
          return absl::OkStatus();
        }
        out_.push_back('\\');
        out_.push_back(e);
        break;
    }
    *i += 2;
    return absl::OkStatus();
  }

  absl::Status Class(absl::string_view text, size_t* i) {
    size_t j = *i + 1;
    out_.push_back('[');
    if (j < text.size() && text[j] == '^') {
      out_.push_back('^');
      ++j;
    }
    if (j < text.size() && text[j] == ']') {  // a leading ']' is a literal
      out_.append("\\]");
      ++j;
    }
    while (j < text.size()) {
      const char c = text[j];
      if (c == ']') {
        out_.push_back(']');
        *i = j + 1;
        return absl::OkStatus();
      }
      if (c == '\\') {
        ACCEL_RETURN_IF_ERROR(Escape(text, &j, /*in_class=*/true));
        continue;
      }
      if (c == '[') return Unsupported(pattern_, "a nested class or [:name:]");
      if (c == '&' && j + 1 < text.size() && text[j + 1] == '&') {
        return Unsupported(pattern_, "class intersection &&");
      }
      out_.push_back(c);
      ++j;
    }
    return Unsupported(pattern_, "an unterminated class");
  }

  absl::Status Group(absl::string_view text, size_t* i) {
    size_t j = *i + 1;
    if (j >= text.size() || text[j] != '?') {
      out_.append("(?:");  // capturing groups do not matter for splitting
      *i = j;
      return absl::OkStatus();
    }
    ++j;
    if (j >= text.size()) return Unsupported(pattern_, "a truncated group");
    const char k = text[j];
    if (k == ':') {
      out_.append("(?:");
      *i = j + 1;
      return absl::OkStatus();
    }
    if (k == '=' || k == '!') return Unsupported(pattern_, "a lookahead");
    if (k == '>') return Unsupported(pattern_, "an atomic group");
    if (k == '~') return Unsupported(pattern_, "an absent operator");
    if (k == '#') {
      const size_t close = text.find(')', j);
      if (close == absl::string_view::npos) return Unsupported(pattern_, "an unterminated comment");
      *i = close + 1;
      return absl::OkStatus();
    }
    if (k == '<' && j + 1 < text.size() && (text[j + 1] == '=' || text[j + 1] == '!')) {
      return Unsupported(pattern_, "a lookbehind");
    }
    if (k == '<' || k == 'P' || k == '\'') {
      const char close_char = k == '\'' ? '\'' : '>';
      const size_t close = text.find(close_char, j + 1);
      if (close == absl::string_view::npos)
        return Unsupported(pattern_, "an unterminated group name");
      out_.append("(?:");
      *i = close + 1;
      return absl::OkStatus();
    }
    // Inline flags: (?i) (?-i) (?i:...). Oniguruma's m and x differ from RE2's.
    size_t f = j;
    while (f < text.size() && (text[f] == 'i' || text[f] == '-')) ++f;
    if (f < text.size() && f > j && (text[f] == ')' || text[f] == ':')) {
      absl::StrAppend(&out_, "(?", text.substr(j, f - j), absl::string_view(&text[f], 1));
      *i = f + 1;
      return absl::OkStatus();
    }
    return Unsupported(pattern_, "a group flag other than i");
  }

  absl::string_view pattern_;
  std::string out_;
};

}  // namespace

absl::StatusOr<TranslatedPattern> TranslateOniguruma(absl::string_view pattern) {
  TranslatedPattern result;
  Translator translator(pattern);
  std::vector<absl::string_view> alternatives = TopLevelAlternatives(pattern);
  for (size_t a = 0; a < alternatives.size(); ++a) {
    if (a > 0) translator.out().push_back('|');
    absl::string_view alt = alternatives[a];
    if (alt == kIdiom) {
      if (result.idiom != WhitespaceIdiom::kNone) {
        return Unsupported(pattern, "a second \\s+(?!\\S)");
      }
      absl::StrAppend(&translator.out(), "([", kSpaceItems, "]+)");
      if (a + 1 < alternatives.size() && alternatives[a + 1] == kFallback) {
        result.idiom = WhitespaceIdiom::kWithFallback;
        ++a;  // `(\s+)` already covers the fallback alternative
      } else if (a + 1 == alternatives.size()) {
        result.idiom = WhitespaceIdiom::kAlone;
      } else {
        return Unsupported(pattern, "\\s+(?!\\S) not followed by |\\s+ nor last");
      }
      continue;
    }
    ACCEL_RETURN_IF_ERROR(translator.Fragment(alt));
  }
  result.re2_pattern = std::move(translator.out());
  return result;
}

Regex::~Regex() = default;

absl::StatusOr<std::unique_ptr<Regex>> Regex::FromOniguruma(absl::string_view pattern) {
  ACCEL_ASSIGN_OR_RETURN(TranslatedPattern translated, TranslateOniguruma(pattern));
  RE2::Options options;
  options.set_encoding(RE2::Options::EncodingUTF8);
  options.set_log_errors(false);
  options.set_max_mem(int64_t{64} << 20);
  auto re = std::make_unique<RE2>(translated.re2_pattern, options);
  if (!re->ok()) {
    return absl::UnimplementedError(absl::StrCat("regex pattern \"", absl::CEscape(pattern),
                                                 "\" cannot run on RE2: ", re->error()));
  }
  std::unique_ptr<Regex> regex(new Regex());
  regex->re_ = std::move(re);
  regex->idiom_ = translated.idiom;
  return regex;
}

absl::StatusOr<std::unique_ptr<Regex>> Regex::FromLiteral(absl::string_view literal) {
  if (literal.empty()) return absl::UnimplementedError("an empty string pattern is not supported");
  std::unique_ptr<Regex> regex(new Regex());
  regex->literal_ = std::string(literal);
  return regex;
}

void Regex::FindAll(absl::string_view text, std::vector<std::pair<size_t, size_t>>* out) const {
  if (re_ == nullptr) {
    // A non-empty literal never matches empty, so plain non-overlapping search is find_iter.
    for (size_t pos = text.find(literal_); pos != absl::string_view::npos;
         pos = text.find(literal_, pos + literal_.size())) {
      out->emplace_back(pos, pos + literal_.size());
    }
    return;
  }
  const re2::StringPiece input(text.data(), text.size());
  re2::StringPiece match[2];
  size_t last_end = 0;
  bool have_last = false;
  size_t last_match_end = 0;
  while (last_end <= text.size()) {
    // Pre-tokenizer patterns usually match right where the last match ended;
    // an anchored search finds that match with one forward DFA pass, which
    // is much cheaper than an unanchored one. (A match starting at last_end
    // is the leftmost, and anchoring does not change which one is chosen.)
    if (!re_->Match(input, last_end, text.size(), RE2::ANCHOR_START, match, 1) &&
        !re_->Match(input, last_end, text.size(), RE2::UNANCHORED, match, 1)) {
      break;
    }
    const size_t start = static_cast<size_t>(match[0].data() - text.data());
    size_t end = start + match[0].size();
    // Whether the idiom's group made this match: only a whitespace run can
    // be it, and only then are the groups worth computing.
    bool idiom_match = false;
    if (idiom_ != WhitespaceIdiom::kNone && end < text.size() && end > start) {
      bool all_space = true;
      for (size_t pos = start; pos < end && all_space;)
        all_space = IsWhitespace(NextChar(text, &pos));
      if (all_space) {
        re2::StringPiece groups[2];
        idiom_match = re_->Match(input, start, text.size(), RE2::ANCHOR_START, groups, 2) &&
                      groups[1].data() != nullptr;
      }
    }
    if (idiom_match) {
      // The whitespace run is followed by a non-space (the run is maximal).
      // \s+(?!\S) leaves its last character to the next match, or fails on
      // a single character.
      size_t last_char = end - 1;
      while ((static_cast<unsigned char>(text[last_char]) & 0xC0) == 0x80) --last_char;
      if (last_char > start) {
        end = last_char;
      } else if (idiom_ == WhitespaceIdiom::kAlone) {
        last_end = start + Utf8Length(static_cast<unsigned char>(text[start]));
        continue;
      }
    }
    if (start == end && have_last && last_match_end == end) {
      // onig's find_iter: no empty match right after the previous match.
      last_end +=
          last_end < text.size() ? Utf8Length(static_cast<unsigned char>(text[last_end])) : 1;
      continue;
    }
    last_end = end;
    have_last = true;
    last_match_end = end;
    out->emplace_back(start, end);
  }
}

void FindSegments(const Regex& regex, absl::string_view text, std::vector<Segment>* out) {
  out->clear();
  if (text.empty()) {
    out->push_back({0, 0, false});
    return;
  }
  std::vector<std::pair<size_t, size_t>> matches;
  regex.FindAll(text, &matches);
  size_t prev = 0;
  for (const auto& [start, end] : matches) {
    if (prev != start) out->push_back({prev, start, false});
    out->push_back({start, end, true});
    prev = end;
  }
  if (prev != text.size()) out->push_back({prev, text.size(), false});
}

}  // namespace accel::tokenizer::internal
