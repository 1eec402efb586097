// Regular expressions to GBNF: a recursive-descent parser that writes the
// equivalent GBNF expression as it reads (the regex's language, matched
// against the whole text).
#include <algorithm>
#include <cctype>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "grammar/grammar.h"
#include "grammar/internal/repeats.h"
#include "grammar/internal/utf8_ranges.h"

namespace accel::grammar {
namespace {

using internal::CodepointRange;

int HexDigitValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::vector<CodepointRange> DigitRanges() { return {{'0', '9'}}; }
std::vector<CodepointRange> WordRanges() {
  return {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
}
// RE2's \s: [\t\n\f\r ] (no \v).
std::vector<CodepointRange> SpaceRanges() { return {{'\t', '\n'}, {'\f', '\r'}, {' ', ' '}}; }

class RegexConverter {
 public:
  RegexConverter(absl::string_view pattern, bool json_string)
      : pattern_(pattern), json_string_(json_string) {}

  absl::StatusOr<std::string> Convert() {
    if (Peek() == '^') ++pos_;
    auto expression = ParseAlternation(0);
    if (!expression.ok()) return expression.status();
    if (!AtEnd()) {
      if (Peek() == ')') return Error("unbalanced ')'");
      return Error("unexpected character");
    }
    return *expression;
  }

 private:
  bool AtEnd() const { return pos_ >= pattern_.size(); }
  char Peek() const { return AtEnd() ? '\0' : pattern_[pos_]; }

  absl::Status Error(absl::string_view message) const {
    return absl::InvalidArgumentError(
        absl::StrFormat("regex: %s at offset %d of the pattern", message, pos_));
  }

  absl::StatusOr<std::string> ParseAlternation(int depth) {
    if (depth > 100) return Error("groups nest too deeply");
    std::vector<std::string> branches;
    while (true) {
      auto branch = ParseConcatenation(depth);
      if (!branch.ok()) return branch.status();
      branches.push_back(*std::move(branch));
      if (Peek() != '|') break;
      ++pos_;
    }
    if (branches.size() == 1) return branches.front();
    std::string out = "(";
    for (size_t i = 0; i < branches.size(); ++i) {
      absl::StrAppend(&out, i ? " | " : "", branches[i]);
    }
    return out + ")";
  }

  absl::StatusOr<std::string> ParseConcatenation(int depth) {
    std::string out;
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      if (Peek() == '$') {
        ++pos_;
        if (AtEnd() || (depth == 0 && Peek() == '|')) continue;
        --pos_;
        return Error("'$' is only supported at the end");
      }
      if (Peek() == '^') {
        if (out.empty() && depth == 0) {
          ++pos_;
          continue;
        }
        return Error("'^' is only supported at the start");
      }
      auto atom = ParseAtom(depth);
      if (!atom.ok()) return atom.status();
      auto quantified = ParseQuantifiers(*std::move(atom));
      if (!quantified.ok()) return quantified.status();
      if (!quantified->empty()) absl::StrAppend(&out, out.empty() ? "" : " ", *quantified);
    }
    return out.empty() ? std::string("\"\"") : out;
  }

  // Stacked quantifiers apply in turn, but a run of *, +, ? (and {0,},
  // {1,}, {0,1}, {1}) is written as one over the atom ((x+)+ is x+, (x?)+
  // is x*), as the GBNF parser does (internal/repeats.h: nesting each made
  // the matcher's closures quadratic in the run's length).
  absl::StatusOr<std::string> ParseQuantifiers(std::string atom) {
    // The run so far, if any: {min, max}, max -1 unbounded.
    bool has_pending = false;
    std::pair<int, int> pending(1, 1);
    const auto flush = [&] {
      if (!has_pending) return;
      const char* op =
          pending.first == 0 ? (pending.second < 0 ? "*" : "?") : (pending.second < 0 ? "+" : "");
      atom = absl::StrCat("(", atom, ")", op);
      has_pending = false;
      pending = {1, 1};
    };
    while (!AtEnd()) {
      const char c = Peek();
      std::string op;
      bool is_simple = false;
      std::pair<int, int> simple(1, 1);
      if (c == '*' || c == '+' || c == '?') {
        is_simple = true;
        simple = c == '*'   ? std::make_pair(0, -1)
                 : c == '+' ? std::make_pair(1, -1)
                            : std::make_pair(0, 1);
        ++pos_;
      } else if (c == '{') {
        const size_t start = pos_;
        size_t p = pos_ + 1;
        while (p < pattern_.size() &&
               (std::isdigit(static_cast<unsigned char>(pattern_[p])) || pattern_[p] == ',')) {
          ++p;
        }
        const absl::string_view body = pattern_.substr(start + 1, p - start - 1);
        if (p >= pattern_.size() || pattern_[p] != '}' || body.empty() || body[0] == ',' ||
            body.find(',') != body.rfind(',')) {
          break;  // not a quantifier: `{` is then a literal character, read next
        }
        if (body == "0," || body == "1," || body == "0,1" || body == "1") {
          is_simple = true;
          simple = std::make_pair(body[0] - '0', body == "0,1" || body == "1" ? 1 : -1);
        } else {
          op = absl::StrCat("{", body, "}");
        }
        pos_ = p + 1;
      } else {
        break;
      }
      if (Peek() == '?' || Peek() == '+') ++pos_;  // lazy / possessive: the same language
      if (is_simple) {
        pending = internal::ComposeRepeats(pending, simple);
        has_pending = true;
        continue;
      }
      flush();
      atom = absl::StrCat("(", atom, ")", op);
    }
    flush();
    return atom;
  }

  absl::StatusOr<std::string> ParseAtom(int depth) {
    const char c = Peek();
    if (c == '(') {
      ++pos_;
      if (Peek() == '?') {
        ++pos_;
        const char kind = Peek();
        if (kind == ':') {
          ++pos_;
        } else if (const bool more = pos_ + 1 < pattern_.size();
                   (kind == 'P' && more && pattern_[pos_ + 1] == '<') ||
                   (kind == '<' && more && pattern_[pos_ + 1] != '=' &&
                    pattern_[pos_ + 1] != '!')) {
          // A named group: (?P<name>...) (Python) or (?<name>...).
          pos_ = pattern_.find('>', pos_);
          if (pos_ == absl::string_view::npos) {
            pos_ = pattern_.size();
            return Error("unterminated group name");
          }
          ++pos_;
        } else {
          return Error(
              "lookaround and inline flags ((?=, (?!, (?<=, (?<!, (?i)) are not supported");
        }
      }
      auto inner = ParseAlternation(depth + 1);
      if (!inner.ok()) return inner.status();
      if (Peek() != ')') return Error("missing ')'");
      ++pos_;
      return absl::StrCat("(", *inner, ")");
    }
    if (c == '[') return ParseClass();
    if (c == '.') {
      ++pos_;
      return ClassExpression(internal::ComplementRanges({{'\n', '\n'}}));
    }
    if (c == '*' || c == '+' || c == '?') return Error("a quantifier with nothing to repeat");
    if (c == '\\') {
      std::vector<CodepointRange> ranges;
      auto single = ParseEscape(&ranges, /*in_class=*/false);
      if (!single.ok()) return single.status();
      if (*single < 0) return ClassExpression(internal::NormalizeRanges(ranges));
      return Literal(static_cast<uint32_t>(*single));
    }
    auto cp = ReadCodepoint();
    if (!cp.ok()) return cp.status();
    return Literal(*cp);
  }

  absl::StatusOr<uint32_t> ReadCodepoint() {
    const auto c = static_cast<unsigned char>(pattern_[pos_]);
    int length = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
    if (length == 0 || pos_ + length > pattern_.size()) return Error("invalid UTF-8");
    uint32_t cp = length == 1 ? c : (c & (0x7F >> length));
    for (int i = 1; i < length; ++i) {
      const auto b = static_cast<unsigned char>(pattern_[pos_ + i]);
      if ((b & 0xC0) != 0x80) return Error("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3F);
    }
    if (cp > internal::kMaxCodepoint || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return Error("invalid UTF-8");
    }
    pos_ += length;
    return cp;
  }

  // An escape after '\\': a single character (returned), or a class (-1,
  // its ranges appended to *ranges).
  absl::StatusOr<int64_t> ParseEscape(std::vector<CodepointRange>* ranges, bool in_class) {
    ++pos_;  // '\\'
    if (AtEnd()) return Error("a pattern cannot end with '\\'");
    const char e = pattern_[pos_++];
    auto add = [&](std::vector<CodepointRange> r, bool negate) {
      r = internal::NormalizeRanges(std::move(r));
      if (negate) r = internal::ComplementRanges(r);
      ranges->insert(ranges->end(), r.begin(), r.end());
      return int64_t{-1};
    };
    switch (e) {
      case 'd':
        return add(DigitRanges(), false);
      case 'D':
        return add(DigitRanges(), true);
      case 'w':
        return add(WordRanges(), false);
      case 'W':
        return add(WordRanges(), true);
      case 's':
        return add(SpaceRanges(), false);
      case 'S':
        return add(SpaceRanges(), true);
      case 'n':
        return int64_t{'\n'};
      case 't':
        return int64_t{'\t'};
      case 'r':
        return int64_t{'\r'};
      case 'f':
        return int64_t{'\f'};
      case 'v':
        return int64_t{'\v'};
      case '0':
        return int64_t{0};
      case 'x':
      case 'u': {
        const int digits = e == 'x' ? 2 : 4;
        int64_t value = 0;
        for (int i = 0; i < digits; ++i) {
          const int h = AtEnd() ? -1 : HexDigitValue(Peek());
          if (h < 0) return Error(absl::StrCat("expected ", digits, " hex digits"));
          value = value * 16 + h;
          ++pos_;
        }
        if (value >= 0xD800 && value <= 0xDFFF) return Error("a surrogate code point");
        return value;
      }
      case 'b':
        if (in_class) return int64_t{'\b'};
        return Error("word boundaries (\\b) are not supported");
      case 'B':
      case 'A':
      case 'z':
      case 'Z':
      case 'G':
        return Error(absl::StrCat("the anchor \\", std::string(1, e), " is not supported"));
      case 'p':
      case 'P':
        return Error("Unicode properties (\\p) are not supported");
      default:
        if (e >= '1' && e <= '9') return Error("backreferences are not supported");
        if (std::isalnum(static_cast<unsigned char>(e))) {
          return Error(absl::StrCat("unknown escape \\", std::string(1, e)));
        }
        return int64_t{static_cast<unsigned char>(e)};
    }
  }

  absl::StatusOr<std::string> ParseClass() {
    ++pos_;  // [
    bool negated = false;
    if (Peek() == '^') {
      negated = true;
      ++pos_;
    }
    std::vector<CodepointRange> ranges;
    bool first = true;
    while (true) {
      if (AtEnd()) return Error("unterminated character class");
      if (Peek() == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      int64_t lo;
      if (Peek() == '\\') {
        auto single = ParseEscape(&ranges, /*in_class=*/true);
        if (!single.ok()) return single.status();
        if (*single < 0) continue;
        lo = *single;
      } else if (Peek() == '[' && pos_ + 1 < pattern_.size() && pattern_[pos_ + 1] == ':') {
        return Error("POSIX classes ([:alpha:]) are not supported");
      } else {
        auto cp = ReadCodepoint();
        if (!cp.ok()) return cp.status();
        lo = *cp;
      }
      int64_t hi = lo;
      if (Peek() == '-' && pos_ + 1 < pattern_.size() && pattern_[pos_ + 1] != ']') {
        ++pos_;
        if (Peek() == '\\') {
          std::vector<CodepointRange> unused;
          auto single = ParseEscape(&unused, /*in_class=*/true);
          if (!single.ok()) return single.status();
          if (*single < 0) return Error("a class escape cannot end a range");
          hi = *single;
        } else {
          auto cp = ReadCodepoint();
          if (!cp.ok()) return cp.status();
          hi = *cp;
        }
        if (hi < lo) return Error("a character range ends before it starts");
      }
      ranges.emplace_back(static_cast<uint32_t>(lo), static_cast<uint32_t>(hi));
    }
    ranges = internal::NormalizeRanges(std::move(ranges));
    if (negated) ranges = internal::ComplementRanges(ranges);
    if (ranges.empty()) return Error("the character class matches nothing");
    return ClassExpression(ranges);
  }

  static std::string ClassBody(const std::vector<CodepointRange>& ranges) {
    std::string out = "[";
    for (const auto& [lo, hi] : ranges) {
      absl::StrAppendFormat(&out, "\\U%08X", lo);
      if (hi != lo) absl::StrAppendFormat(&out, "-\\U%08X", hi);
    }
    return out + "]";
  }

  // In a JSON string, `"`, `\` and control characters are written escaped.
  std::string ClassExpression(const std::vector<CodepointRange>& ranges) const {
    if (!json_string_) return ClassBody(ranges);
    std::vector<std::string> branches;
    std::vector<CodepointRange> plain;
    for (const auto& [lo, hi] : ranges) {
      for (uint32_t special : {uint32_t{'"'}, uint32_t{'\\'}}) {
        if (lo <= special && special <= hi) branches.push_back(Literal(special));
      }
      plain.emplace_back(lo, hi);
    }
    // Control characters are left out (a JSON escape for each would make
    // the grammar large for no use); the quote and the backslash come back
    // escaped above.
    std::vector<CodepointRange> excluded =
        internal::NormalizeRanges({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}});
    std::vector<CodepointRange> kept;
    const std::vector<CodepointRange> allowed = internal::ComplementRanges(excluded);
    // Intersect `plain` with `allowed`.
    for (const auto& a : internal::NormalizeRanges(plain)) {
      for (const auto& b : allowed) {
        const uint32_t lo = std::max(a.first, b.first);
        const uint32_t hi = std::min(a.second, b.second);
        if (lo <= hi) kept.emplace_back(lo, hi);
      }
    }
    if (!kept.empty()) branches.insert(branches.begin(), ClassBody(kept));
    if (branches.empty()) return "[^\\U00000000-\\U0010FFFF]";  // nothing: refused by the parser
    if (branches.size() == 1) return branches.front();
    std::string out = "(";
    for (size_t i = 0; i < branches.size(); ++i) absl::StrAppend(&out, i ? " | " : "", branches[i]);
    return out + ")";
  }

  std::string Literal(uint32_t cp) const {
    std::string text;
    if (json_string_) {
      if (cp == '"') return GbnfLiteral("\\\"");
      if (cp == '\\') return GbnfLiteral("\\\\");
      if (cp == '\n') return GbnfLiteral("\\n");
      if (cp == '\t') return GbnfLiteral("\\t");
      if (cp == '\r') return GbnfLiteral("\\r");
      if (cp < 0x20) return GbnfLiteral(absl::StrFormat("\\u%04x", cp));
    }
    internal::AppendUtf8(cp, &text);
    return GbnfLiteral(text);
  }

  absl::string_view pattern_;
  bool json_string_;
  size_t pos_ = 0;
};

}  // namespace

absl::StatusOr<std::string> RegexToGbnf(absl::string_view pattern, bool json_string) {
  return RegexConverter(pattern, json_string).Convert();
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileRegex(absl::string_view pattern) {
  auto expression = RegexToGbnf(pattern);
  if (!expression.ok()) return expression.status();
  return ParseGbnf(absl::StrCat("root ::= ", *expression), "regex");
}

}  // namespace accel::grammar
