#include "jinja/internal/lexer.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace accel::jinja::internal {
namespace {

// Text with the source line of every byte, so errors name lines of the
// template as written although preprocessing removes text.
struct Source {
  std::string text;
  std::vector<int> lines;

  void Append(const Source& from, size_t begin, size_t end) {
    text.append(from.text, begin, end - begin);
    lines.insert(lines.end(), from.lines.begin() + static_cast<std::ptrdiff_t>(begin),
                 from.lines.begin() + static_cast<std::ptrdiff_t>(end));
  }
  void Truncate(size_t size) {
    text.resize(size);
    lines.resize(size);
  }
};

bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsWord(char c) {
  return IsDigit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

// JavaScript's multiline ^ matches after \n, \r, U+2028 and U+2029.
bool AtLineStart(absl::string_view s, size_t i) {
  if (i == 0) return true;
  const char prev = s[i - 1];
  if (prev == '\n' || prev == '\r') return true;
  return i >= 3 && s[i - 3] == '\xE2' && s[i - 2] == '\x80' &&
         (s[i - 1] == '\xA8' || s[i - 1] == '\xA9');
}

// /^[ \t]*({[#%-])/gm -> "$1"
Source LstripBlocks(const Source& in) {
  Source out;
  const absl::string_view s = in.text;
  size_t i = 0;
  while (i < s.size()) {
    if (AtLineStart(s, i)) {
      size_t j = i;
      while (j < s.size() && (s[j] == ' ' || s[j] == '\t')) ++j;
      if (j + 1 < s.size() && s[j] == '{' &&
          (s[j + 1] == '#' || s[j + 1] == '%' || s[j + 1] == '-')) {
        out.Append(in, j, j + 2);
        i = j + 2;
        continue;
      }
    }
    out.Append(in, i, i + 1);
    ++i;
  }
  return out;
}

// /([#%-]})\n/g -> "$1"
Source TrimBlocks(const Source& in) {
  Source out;
  const absl::string_view s = in.text;
  size_t i = 0;
  while (i < s.size()) {
    if (i + 2 < s.size() && (s[i] == '#' || s[i] == '%' || s[i] == '-') && s[i + 1] == '}' &&
        s[i + 2] == '\n') {
      out.Append(in, i, i + 2);
      i += 3;
      continue;
    }
    out.Append(in, i, i + 1);
    ++i;
  }
  return out;
}

// The tag at s[i] if it is {%-? (end)?generation -?%}: its end, and its dashes.
bool MatchGenerationTag(absl::string_view s, size_t i, size_t* end, bool* lstrip, bool* rstrip) {
  if (s.substr(i, 2) != "{%") return false;
  size_t j = i + 2;
  *lstrip = j < s.size() && s[j] == '-';
  if (*lstrip) ++j;
  while (int n = JsSpaceAt(s, j)) j += static_cast<size_t>(n);
  if (s.substr(j, 3) == "end") j += 3;
  if (s.substr(j, 10) != "generation") return false;
  j += 10;
  while (int n = JsSpaceAt(s, j)) j += static_cast<size_t>(n);
  *rstrip = j < s.size() && s[j] == '-';
  if (*rstrip) ++j;
  if (s.substr(j, 2) != "%}") return false;
  *end = j + 2;
  return true;
}

// /(\s*){%(-?)\s*(?:end)?generation\s*(-?)%}(\s*)/gs: transformers' training
// markers render their body; the dashes strip the whitespace around them.
Source StripGenerationTags(const Source& in) {
  Source out;
  const absl::string_view s = in.text;
  size_t boundary = 0;  // where the last match ended, in `out`
  size_t i = 0;
  while (i < s.size()) {
    size_t end = 0;
    bool lstrip = false;
    bool rstrip = false;
    if (s[i] == '{' && MatchGenerationTag(s, i, &end, &lstrip, &rstrip)) {
      if (lstrip) {
        size_t keep = out.text.size();
        while (keep > boundary) {
          const int n = JsSpaceBefore(out.text, keep);
          if (n == 0) break;
          keep -= static_cast<size_t>(n);
        }
        out.Truncate(keep);
      }
      size_t after = end;
      while (int n = JsSpaceAt(s, after)) after += static_cast<size_t>(n);
      if (!rstrip) out.Append(in, end, after);
      boundary = out.text.size();
      i = after;
      continue;
    }
    out.Append(in, i, i + 1);
    ++i;
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(Source src) : src_(std::move(src)), s_(src_.text) {}

  absl::StatusOr<std::vector<Token>> Run();

 private:
  absl::Status Error(size_t at, absl::string_view message) const {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template line ", LineAt(at), ": ", message));
  }
  int LineAt(size_t at) const {
    if (src_.lines.empty()) return 1;
    return src_.lines[at < src_.lines.size() ? at : src_.lines.size() - 1];
  }
  void Push(TokenType type, std::string value, size_t at) {
    tokens_.push_back(Token{type, std::move(value), LineAt(at)});
  }
  bool LastIs(TokenType type) const { return !tokens_.empty() && tokens_.back().type == type; }
  void StripTrailingWhitespace() {
    if (tokens_.empty() || tokens_.back().type != TokenType::kText) return;
    std::string& text = tokens_.back().value;
    size_t keep = text.size();
    while (int n = JsSpaceBefore(text, keep)) keep -= static_cast<size_t>(n);
    text.resize(keep);
    if (text.empty()) tokens_.pop_back();
  }
  void SkipWhitespace() {
    while (int n = JsSpaceAt(s_, pos_)) pos_ += static_cast<size_t>(n);
  }
  // Like the reference's consumeWhile: running into the end of the input is
  // an error, and backslash escapes are decoded (only strings meet them).
  template <typename Pred>
  absl::StatusOr<std::string> ConsumeWhile(Pred pred);
  static void AppendUtf16(std::string* out, uint32_t unit, uint32_t* pending_high);

  Source src_;
  absl::string_view s_;
  size_t pos_ = 0;
  int curly_depth_ = 0;
  std::vector<Token> tokens_;
};

void Lexer::AppendUtf16(std::string* out, uint32_t unit, uint32_t* pending_high) {
  auto put = [out](uint32_t cp) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  };
  if (*pending_high != 0) {
    const uint32_t high = *pending_high;
    *pending_high = 0;
    if (unit >= 0xDC00 && unit <= 0xDFFF) {
      put(0x10000 + ((high - 0xD800) << 10) + (unit - 0xDC00));
      return;
    }
    put(0xFFFD);  // a lone surrogate has no UTF-8 form
  }
  if (unit >= 0xD800 && unit <= 0xDBFF) {
    *pending_high = unit;
  } else if (unit >= 0xDC00 && unit <= 0xDFFF) {
    put(0xFFFD);
  } else {
    put(unit);
  }
}

template <typename Pred>
absl::StatusOr<std::string> Lexer::ConsumeWhile(Pred pred) {
  std::string str;
  uint32_t pending_high = 0;
  const size_t start = pos_;
  auto flush = [&] {
    if (pending_high != 0) {
      pending_high = 0;
      str.append("\xEF\xBF\xBD");  // a lone surrogate has no UTF-8 form: U+FFFD
    }
  };
  while (pred(pos_ < s_.size() ? s_[pos_] : '\0', pos_ < s_.size())) {
    if (pos_ >= s_.size()) return Error(start, "unexpected end of input");
    if (s_[pos_] == '\\') {
      ++pos_;
      if (pos_ >= s_.size()) return Error(start, "unexpected end of input");
      const char escaped = s_[pos_++];
      if (escaped == 'x' || escaped == 'u') {
        const size_t length = escaped == 'x' ? 2 : 4;
        const absl::string_view hex = s_.substr(pos_, length);
        uint32_t unit = 0;
        bool ok = hex.size() == length;
        for (char c : hex) {
          unit <<= 4;
          if (IsDigit(c)) {
            unit |= static_cast<uint32_t>(c - '0');
          } else if (c >= 'a' && c <= 'f') {
            unit |= static_cast<uint32_t>(c - 'a' + 10);
          } else if (c >= 'A' && c <= 'F') {
            unit |= static_cast<uint32_t>(c - 'A' + 10);
          } else {
            ok = false;
          }
        }
        if (!ok) {
          return Error(start, absl::StrCat("invalid hexadecimal escape sequence: \\",
                                           std::string(1, escaped), hex));
        }
        AppendUtf16(&str, unit, &pending_high);
        pos_ += length;
        continue;
      }
      flush();
      switch (escaped) {
        case 'n':
          str.push_back('\n');
          break;
        case 't':
          str.push_back('\t');
          break;
        case 'r':
          str.push_back('\r');
          break;
        case 'b':
          str.push_back('\b');
          break;
        case 'f':
          str.push_back('\f');
          break;
        case 'v':
          str.push_back('\v');
          break;
        case '\'':
        case '"':
        case '\\':
          str.push_back(escaped);
          break;
        default:
          return Error(start,
                       absl::StrCat("unexpected escaped character: ", std::string(1, escaped)));
      }
      continue;
    }
    flush();
    str.push_back(s_[pos_++]);
    if (pos_ >= s_.size()) return Error(start, "unexpected end of input");
  }
  flush();
  return str;
}

absl::StatusOr<std::vector<Token>> Lexer::Run() {
  static constexpr std::pair<const char*, TokenType> kTable[] = {
      {"{%", TokenType::kOpenStatement},  {"%}", TokenType::kCloseStatement},
      {"{{", TokenType::kOpenExpression}, {"}}", TokenType::kCloseExpression},
      {"(", TokenType::kOpenParen},       {")", TokenType::kCloseParen},
      {"{", TokenType::kOpenCurly},       {"}", TokenType::kCloseCurly},
      {"[", TokenType::kOpenSquare},      {"]", TokenType::kCloseSquare},
      {",", TokenType::kComma},           {".", TokenType::kDot},
      {":", TokenType::kColon},           {"|", TokenType::kPipe},
      {"<=", TokenType::kComparison},     {">=", TokenType::kComparison},
      {"==", TokenType::kComparison},     {"!=", TokenType::kComparison},
      {"<", TokenType::kComparison},      {">", TokenType::kComparison},
      {"+", TokenType::kAdditive},        {"-", TokenType::kAdditive},
      {"~", TokenType::kAdditive},        {"**", TokenType::kPower},
      {"*", TokenType::kMultiplicative},  {"//", TokenType::kMultiplicative},
      {"/", TokenType::kMultiplicative},  {"%", TokenType::kMultiplicative},
      {"=", TokenType::kEquals},
  };
  while (pos_ < s_.size()) {
    if (tokens_.empty() || LastIs(TokenType::kCloseStatement) ||
        LastIs(TokenType::kCloseExpression) || LastIs(TokenType::kComment)) {
      const size_t start = pos_;
      while (pos_ < s_.size() &&
             !(s_[pos_] == '{' && pos_ + 1 < s_.size() &&
               (s_[pos_ + 1] == '%' || s_[pos_ + 1] == '{' || s_[pos_ + 1] == '#'))) {
        ++pos_;
      }
      if (pos_ > start) {
        Push(TokenType::kText, std::string(s_.substr(start, pos_ - start)), start);
        continue;
      }
    }
    if (s_.substr(pos_, 2) == "{#") {
      const size_t start = pos_;
      pos_ += 2;
      const bool strip_before = pos_ < s_.size() && s_[pos_] == '-';
      if (strip_before) ++pos_;
      const size_t body = pos_;
      while (!(pos_ + 1 < s_.size() && s_[pos_] == '#' && s_[pos_ + 1] == '}')) {
        if (pos_ + 2 >= s_.size()) return Error(start, "missing end of comment tag");
        ++pos_;
      }
      std::string comment(s_.substr(body, pos_ - body));
      const bool strip_after = !comment.empty() && comment.back() == '-';
      if (strip_after) comment.pop_back();
      if (strip_before) StripTrailingWhitespace();
      Push(TokenType::kComment, std::move(comment), start);
      pos_ += 2;
      if (strip_after) SkipWhitespace();
      continue;
    }
    if (s_.substr(pos_, 3) == "{%-") {
      StripTrailingWhitespace();
      Push(TokenType::kOpenStatement, "{%", pos_);
      pos_ += 3;
      continue;
    }
    if (s_.substr(pos_, 3) == "{{-") {
      StripTrailingWhitespace();
      Push(TokenType::kOpenExpression, "{{", pos_);
      curly_depth_ = 0;
      pos_ += 3;
      continue;
    }
    while (int n = JsSpaceAt(s_, pos_)) {
      pos_ += static_cast<size_t>(n);
      if (pos_ >= s_.size()) return Error(pos_ - 1, "unexpected end of input");
    }
    if (s_.substr(pos_, 3) == "-%}") {
      Push(TokenType::kCloseStatement, "%}", pos_);
      pos_ += 3;
      SkipWhitespace();
      continue;
    }
    if (s_.substr(pos_, 3) == "-}}") {
      Push(TokenType::kCloseExpression, "}}", pos_);
      pos_ += 3;
      SkipWhitespace();
      continue;
    }
    if (pos_ >= s_.size()) break;
    const char c = s_[pos_];
    if (c == '-' || c == '+') {
      if (tokens_.empty() || LastIs(TokenType::kText)) {
        return Error(pos_, absl::StrCat("unexpected character: ", std::string(1, c)));
      }
      const TokenType last = tokens_.back().type;
      if (last != TokenType::kIdentifier && last != TokenType::kNumber &&
          last != TokenType::kString && last != TokenType::kCloseParen &&
          last != TokenType::kCloseSquare) {
        const size_t start = pos_++;
        absl::StatusOr<std::string> num =
            ConsumeWhile([](char ch, bool in) { return in && IsDigit(ch); });
        if (!num.ok()) return num.status();
        if (!num->empty() && pos_ + 1 < s_.size() && s_[pos_] == '.' && IsDigit(s_[pos_ + 1])) {
          ++pos_;
          absl::StatusOr<std::string> frac =
              ConsumeWhile([](char ch, bool in) { return in && IsDigit(ch); });
          if (!frac.ok()) return frac.status();
          *num = absl::StrCat(*num, ".", *frac);
        }
        const bool is_number = !num->empty();
        Push(is_number ? TokenType::kNumber : TokenType::kUnary, std::string(1, c) + *num, start);
        continue;
      }
    }
    bool matched = false;
    for (const auto& [seq, type] : kTable) {
      const absl::string_view want(seq);
      if (want == "}}" && curly_depth_ > 0) continue;
      if (s_.substr(pos_, want.size()) != want) continue;
      Push(type, std::string(want), pos_);
      if (type == TokenType::kOpenExpression) {
        curly_depth_ = 0;
      } else if (type == TokenType::kOpenCurly) {
        ++curly_depth_;
      } else if (type == TokenType::kCloseCurly) {
        --curly_depth_;
      }
      pos_ += want.size();
      matched = true;
      break;
    }
    if (matched) continue;
    if (c == '\'' || c == '"') {
      const size_t start = pos_++;
      absl::StatusOr<std::string> str =
          ConsumeWhile([c](char ch, bool in) { return !in || ch != c; });
      if (!str.ok()) return str.status();
      Push(TokenType::kString, *std::move(str), start);
      ++pos_;
      continue;
    }
    if (IsDigit(c)) {
      const size_t start = pos_;
      absl::StatusOr<std::string> num =
          ConsumeWhile([](char ch, bool in) { return in && IsDigit(ch); });
      if (!num.ok()) return num.status();
      if (!LastIs(TokenType::kDot) && pos_ + 1 < s_.size() && s_[pos_] == '.' &&
          IsDigit(s_[pos_ + 1])) {
        ++pos_;
        absl::StatusOr<std::string> frac =
            ConsumeWhile([](char ch, bool in) { return in && IsDigit(ch); });
        if (!frac.ok()) return frac.status();
        *num = absl::StrCat(*num, ".", *frac);
      }
      Push(TokenType::kNumber, *std::move(num), start);
      continue;
    }
    if (IsWord(c)) {
      const size_t start = pos_;
      absl::StatusOr<std::string> word =
          ConsumeWhile([](char ch, bool in) { return in && IsWord(ch); });
      if (!word.ok()) return word.status();
      Push(TokenType::kIdentifier, *std::move(word), start);
      continue;
    }
    return Error(pos_, absl::StrCat("unexpected character: '", std::string(1, c), "'"));
  }
  return std::move(tokens_);
}

}  // namespace

int JsSpaceAt(absl::string_view s, size_t i) {
  if (i >= s.size()) return 0;
  const auto b = [&](size_t k) {
    return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0U;
  };
  const unsigned char c = b(0);
  if (c == ' ' || (c >= '\t' && c <= '\r')) return 1;
  if (c == 0xC2 && b(1) == 0xA0) return 2;
  if (c == 0xE1 && b(1) == 0x9A && b(2) == 0x80) return 3;
  if (c == 0xE2 && b(1) == 0x80 &&
      ((b(2) >= 0x80 && b(2) <= 0x8A) || b(2) == 0xA8 || b(2) == 0xA9 || b(2) == 0xAF)) {
    return 3;
  }
  if (c == 0xE2 && b(1) == 0x81 && b(2) == 0x9F) return 3;
  if (c == 0xE3 && b(1) == 0x80 && b(2) == 0x80) return 3;
  if (c == 0xEF && b(1) == 0xBB && b(2) == 0xBF) return 3;
  return 0;
}

int JsSpaceBefore(absl::string_view s, size_t end) {
  for (size_t n = 1; n <= 3 && n <= end; ++n) {
    if (JsSpaceAt(s, end - n) == static_cast<int>(n)) return static_cast<int>(n);
  }
  return 0;
}

absl::StatusOr<std::vector<Token>> Tokenize(absl::string_view source,
                                            const TemplateOptions& options) {
  Source src;
  src.text = std::string(source);
  src.lines.reserve(source.size());
  int line = 1;
  for (char c : source) {
    src.lines.push_back(line);
    if (c == '\n') ++line;
  }
  if (!options.keep_trailing_newline && !src.text.empty() && src.text.back() == '\n') {
    src.Truncate(src.text.size() - 1);
  }
  if (options.lstrip_blocks) src = LstripBlocks(src);
  if (options.trim_blocks) src = TrimBlocks(src);
  return Lexer(StripGenerationTags(src)).Run();
}

}  // namespace accel::jinja::internal
