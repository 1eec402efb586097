#include "grammar/grammar.h"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

#include "grammar/internal/grammar_data.h"
#include "grammar/internal/repeats.h"
#include "grammar/internal/stack_arena.h"
#include "grammar/internal/utf8_ranges.h"

namespace accel::grammar {
namespace {

using internal::ByteRange;
using internal::CodepointRange;
using internal::Element;
using internal::GrammarData;

using Sequence = std::vector<Element>;
using Alternatives = std::vector<Sequence>;

Element ByteElement(uint8_t lo, uint8_t hi) {
  Element e;
  e.kind = Element::kByte;
  e.lo = lo;
  e.hi = hi;
  return e;
}

Element RuleElement(int32_t rule) {
  Element e;
  e.kind = Element::kRule;
  e.rule = rule;
  return e;
}

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_';
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Rules under construction: named ones (made on first mention) and the
// anonymous ones groups, repetitions and character classes need.
class RuleSet {
 public:
  int32_t Named(const std::string& name) {
    auto [it, inserted] = by_name_.try_emplace(name, static_cast<int32_t>(names_.size()));
    if (inserted) Add(name);
    return it->second;
  }
  int32_t Anonymous(const std::string& hint, Alternatives alternatives) {
    const int32_t id = Add(absl::StrCat(hint, "_", names_.size()));
    defined_[id] = true;
    rules_[id] = std::move(alternatives);
    return id;
  }
  // A character class's rule, shared by every class with the same ranges.
  int32_t Class(std::vector<CodepointRange> ranges) {
    ranges = internal::NormalizeRanges(std::move(ranges));
    std::string key;
    for (const auto& [lo, hi] : ranges) absl::StrAppend(&key, lo, "-", hi, ",");
    auto it = classes_.find(key);
    if (it != classes_.end()) return it->second;
    Alternatives alternatives;
    for (const auto& sequence : internal::Utf8Sequences(ranges)) {
      Sequence s;
      for (const ByteRange& b : sequence) s.push_back(ByteElement(b.first, b.second));
      alternatives.push_back(std::move(s));
    }
    const int32_t id = Anonymous("class", std::move(alternatives));
    classes_.emplace(key, id);
    return id;
  }
  void Define(int32_t id, Alternatives alternatives) {
    defined_[id] = true;
    rules_[id] = std::move(alternatives);
  }
  bool defined(int32_t id) const { return defined_[id]; }
  int32_t size() const { return static_cast<int32_t>(names_.size()); }
  const std::string& name(int32_t id) const { return names_[id]; }
  const Alternatives& rule(int32_t id) const { return rules_[id]; }
  std::optional<int32_t> Find(const std::string& name) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) return std::nullopt;
    return it->second;
  }
  int64_t elements() const {
    int64_t n = 0;
    for (const auto& r : rules_) {
      for (const auto& s : r) n += static_cast<int64_t>(s.size()) + 1;
    }
    return n;
  }
  std::vector<std::string> TakeNames() { return std::move(names_); }
  std::vector<Alternatives> TakeRules() { return std::move(rules_); }

 private:
  int32_t Add(const std::string& name) {
    names_.push_back(name);
    rules_.emplace_back();
    defined_.push_back(false);
    return static_cast<int32_t>(names_.size() - 1);
  }
  std::vector<std::string> names_;
  std::vector<Alternatives> rules_;
  std::vector<bool> defined_;
  std::map<std::string, int32_t> by_name_;
  absl::flat_hash_map<std::string, int32_t> classes_;
};

class GbnfParser {
 public:
  GbnfParser(absl::string_view text, absl::string_view what) : text_(text), what_(what) {}

  absl::StatusOr<std::unique_ptr<GrammarData>> Parse() {
    SkipSpace();
    if (AtEnd()) return Error("is empty (it needs a `root ::= ...` rule)");
    while (!AtEnd()) {
      const size_t name_at = pos_;
      std::string name = ReadName();
      if (name.empty()) return Error("expected a rule name");
      SkipSpace();
      if (text_.substr(pos_, 3) != "::=")
        return Error(absl::StrCat("expected ::= after '", name, "'"));
      pos_ += 3;
      const int32_t id = rules_.Named(name);
      if (rules_.defined(id)) {
        pos_ = name_at;
        return Error(absl::StrCat("rule '", name, "' is defined twice"));
      }
      current_rule_ = name;
      auto alternatives = ParseAlternatives(/*depth=*/0);
      if (!alternatives.ok()) return alternatives.status();
      rules_.Define(id, *std::move(alternatives));
      SkipSpace();
    }
    return Finish(rules_, what_);
  }

  static absl::StatusOr<std::unique_ptr<GrammarData>> Finish(RuleSet& rules,
                                                             absl::string_view what) {
    const std::optional<int32_t> root = rules.Find("root");
    if (!root || !rules.defined(*root)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": there is no `root` rule"));
    }
    for (int32_t id = 0; id < rules.size(); ++id) {
      if (!rules.defined(id)) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": rule '", rules.name(id), "' is used but never defined"));
      }
    }
    if (rules.elements() > kMaxGrammarElements) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": the grammar has ", rules.elements(),
                                                     " elements, over the limit of ",
                                                     kMaxGrammarElements));
    }
    if (absl::Status s = CheckLeftRecursion(rules, what); !s.ok()) return s;
    auto data = std::make_unique<GrammarData>();
    data->root = *root;
    const std::vector<Alternatives> all = rules.TakeRules();
    data->rule_names = rules.TakeNames();
    data->alternatives.resize(all.size());
    for (size_t r = 0; r < all.size(); ++r) {
      for (const Sequence& s : all[r]) {
        data->alternatives[r].push_back(static_cast<int32_t>(data->elements.size()));
        data->elements.insert(data->elements.end(), s.begin(), s.end());
        data->elements.push_back(Element{});  // kEnd
      }
    }
    return data;
  }

 private:
  // Left recursion (a rule reaching itself before a byte is read) would make
  // the matcher's expansion endless: refused, naming the cycle.
  static absl::Status CheckLeftRecursion(const RuleSet& rules, absl::string_view what) {
    const int32_t n = rules.size();
    std::vector<bool> nullable(n, false);
    for (bool changed = true; changed;) {
      changed = false;
      for (int32_t r = 0; r < n; ++r) {
        if (nullable[r]) continue;
        for (const Sequence& s : rules.rule(r)) {
          bool all = true;
          for (const Element& e : s) {
            if (e.kind == Element::kByte || !nullable[e.rule]) {
              all = false;
              break;
            }
          }
          if (all) {
            nullable[r] = true;
            changed = true;
            break;
          }
        }
      }
    }
    std::vector<std::vector<int32_t>> first(n);
    for (int32_t r = 0; r < n; ++r) {
      for (const Sequence& s : rules.rule(r)) {
        for (const Element& e : s) {
          if (e.kind == Element::kByte) break;
          first[r].push_back(e.rule);
          if (!nullable[e.rule]) break;
        }
      }
    }
    std::vector<int> color(n, 0);  // 0 new, 1 on the path, 2 done
    std::vector<int32_t> path;
    std::function<std::optional<std::vector<int32_t>>(int32_t)> visit =
        [&](int32_t r) -> std::optional<std::vector<int32_t>> {
      color[r] = 1;
      path.push_back(r);
      for (int32_t next : first[r]) {
        if (color[next] == 1) {
          auto from = std::find(path.begin(), path.end(), next);
          std::vector<int32_t> cycle(from, path.end());
          cycle.push_back(next);
          return cycle;
        }
        if (color[next] == 0) {
          if (auto cycle = visit(next)) return cycle;
        }
      }
      path.pop_back();
      color[r] = 2;
      return std::nullopt;
    };
    for (int32_t r = 0; r < n; ++r) {
      if (color[r] != 0) continue;
      if (auto cycle = visit(r)) {
        std::vector<std::string> names;
        for (int32_t id : *cycle) names.push_back(rules.name(id));
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": left recursion: rule '", names.front(),
            "' can reach itself before reading a character (", absl::StrJoin(names, " -> "),
            "); a repeated expression must not match the empty string"));
      }
    }
    return absl::OkStatus();
  }

  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek() const { return AtEnd() ? '\0' : text_[pos_]; }

  absl::Status Error(absl::string_view message) const {
    int line = 1;
    int column = 1;
    for (size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: line %d, column %d: %s", what_, line, column, message));
  }

  void SkipSpace() {
    while (!AtEnd()) {
      const char c = Peek();
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else if (c == '#') {
        while (!AtEnd() && Peek() != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  std::string ReadName() {
    const size_t start = pos_;
    while (!AtEnd() && IsNameChar(Peek())) ++pos_;
    return std::string(text_.substr(start, pos_ - start));
  }

  // Whether a rule definition (`name ::=`) starts at pos_.
  bool AtDefinition() const {
    size_t p = pos_;
    while (p < text_.size() && IsNameChar(text_[p])) ++p;
    if (p == pos_) return false;
    while (p < text_.size() &&
           (text_[p] == ' ' || text_[p] == '\t' || text_[p] == '\n' || text_[p] == '\r')) {
      ++p;
    }
    return text_.substr(p, 3) == "::=";
  }

  absl::StatusOr<Alternatives> ParseAlternatives(int depth) {
    if (depth > 200) return Error("groups nest too deeply");
    Alternatives alternatives;
    while (true) {
      auto sequence = ParseSequence(depth);
      if (!sequence.ok()) return sequence.status();
      alternatives.push_back(*std::move(sequence));
      SkipSpace();
      if (Peek() == '|') {
        ++pos_;
        continue;
      }
      return alternatives;
    }
  }

  absl::StatusOr<Sequence> ParseSequence(int depth) {
    Sequence sequence;
    while (true) {
      SkipSpace();
      if (AtEnd() || Peek() == '|' || Peek() == ')') return sequence;
      if (AtDefinition()) return sequence;
      Sequence atom;
      const char c = Peek();
      if (c == '"') {
        auto bytes = ParseLiteral();
        if (!bytes.ok()) return bytes.status();
        for (unsigned char b : *bytes) atom.push_back(ByteElement(b, b));
      } else if (c == '[') {
        auto ranges = ParseClass();
        if (!ranges.ok()) return ranges.status();
        if (ranges->empty()) return Error("the character class matches nothing");
        atom.push_back(RuleElement(rules_.Class(*ranges)));
      } else if (c == '.') {
        ++pos_;
        atom.push_back(RuleElement(rules_.Class({{0, internal::kMaxCodepoint}})));
      } else if (c == '(') {
        ++pos_;
        auto inner = ParseAlternatives(depth + 1);
        if (!inner.ok()) return inner.status();
        SkipSpace();
        if (Peek() != ')') return Error("expected ')'");
        ++pos_;
        if (inner->size() == 1) {
          atom = std::move(inner->front());
        } else {
          atom.push_back(RuleElement(rules_.Anonymous(current_rule_, *std::move(inner))));
        }
      } else if (IsNameChar(c)) {
        atom.push_back(RuleElement(rules_.Named(ReadName())));
      } else {
        return Error(absl::StrCat("unexpected character '", std::string(1, c), "'"));
      }
      // Postfix operators. Stacked ones apply in turn (llama.cpp's reading),
      // but a run of *, +, ? (and {0,}, {1,}, {0,1}, {1}) is one operator
      // over the atom: (x+)+ is x+, (x?)+ and (x+)? are x*, and so on. Each
      // one nested instead made a rule a level, and a closure through n
      // nested loops visits n^2 stacks: 90 '+' in a row took seconds a byte.
      // A run of those, not applied yet (has_pending), as {min, max}.
      bool has_pending = false;
      std::pair<int, int> pending(1, 1);
      const auto apply = [&](int min, int max) -> absl::Status {
        atom = Repeat(std::move(atom), min, max);
        if (rules_.elements() + static_cast<int64_t>(atom.size()) > kMaxGrammarElements) {
          return Error("the grammar grows over its element limit");
        }
        return absl::OkStatus();
      };
      while (!AtEnd()) {
        const char op = Peek();
        int min = 0;
        int max = -1;  // unbounded
        if (op == '*') {
          ++pos_;
        } else if (op == '+') {
          ++pos_;
          min = 1;
        } else if (op == '?') {
          ++pos_;
          max = 1;
        } else if (op == '{') {
          auto bounds = ParseBounds();
          if (!bounds.ok()) return bounds.status();
          std::tie(min, max) = *bounds;
        } else {
          break;
        }
        if (internal::IsSimpleRepeat(min, max)) {
          pending = internal::ComposeRepeats(pending, {min, max});
          has_pending = true;
          continue;
        }
        if (has_pending) {
          if (absl::Status s = apply(pending.first, pending.second); !s.ok()) return s;
          has_pending = false;
          pending = {1, 1};
        }
        if (absl::Status s = apply(min, max); !s.ok()) return s;
      }
      if (has_pending) {
        if (absl::Status s = apply(pending.first, pending.second); !s.ok()) return s;
      }
      sequence.insert(sequence.end(), atom.begin(), atom.end());
    }
  }

  Sequence Repeat(const Sequence& atom, int min, int max) {
    Sequence out;
    Sequence unit = atom;
    if (atom.size() != 1) {
      unit = {RuleElement(rules_.Anonymous(current_rule_, {atom}))};
    }
    if (max < 0 && min >= 1) {
      // unit{min,}: min - 1 units, then
      //   plus ::= unit rest    rest ::= plus | (empty)
      // not `unit star`: there the first unit returns into the sequence and
      // the others into star, two stacks for one place in the text, and
      // nested loops ((x)+)+... multiply them, 2^n at n levels (eight
      // levels passed the matcher's 128 stacks and refused "xxx"). Here the
      // unit is called from one place, its return always to `rest`, and
      // `rest` and `plus` are tail calls: one stack a level.
      for (int i = 0; i + 1 < min; ++i) out.insert(out.end(), unit.begin(), unit.end());
      const int32_t plus = rules_.Anonymous(absl::StrCat(current_rule_, "_plus"), {});
      const int32_t rest =
          rules_.Anonymous(absl::StrCat(current_rule_, "_rest"), {{RuleElement(plus)}, {}});
      Sequence once = unit;
      once.push_back(RuleElement(rest));
      rules_.Define(plus, {once});
      out.push_back(RuleElement(plus));
      return out;
    }
    for (int i = 0; i < min; ++i) out.insert(out.end(), unit.begin(), unit.end());
    if (max < 0) {
      // star ::= unit star | (empty)
      const int32_t star = rules_.Anonymous(absl::StrCat(current_rule_, "_star"), {});
      Sequence loop = unit;
      loop.push_back(RuleElement(star));
      rules_.Define(star, {loop, {}});
      out.push_back(RuleElement(star));
    } else if (max > min) {
      // opt_k ::= unit opt_{k-1} | (empty), opt_1 ::= unit | (empty)
      int32_t inner = -1;
      for (int k = 1; k <= max - min; ++k) {
        Sequence first = unit;
        if (inner >= 0) first.push_back(RuleElement(inner));
        inner = rules_.Anonymous(absl::StrCat(current_rule_, "_opt"), {first, {}});
      }
      out.push_back(RuleElement(inner));
    }
    return out;
  }

  absl::StatusOr<std::pair<int, int>> ParseBounds() {
    ++pos_;  // {
    auto number = [&]() -> std::optional<int> {
      SkipSpace();
      const size_t start = pos_;
      int64_t value = 0;
      while (!AtEnd() && Peek() >= '0' && Peek() <= '9') {
        value = value * 10 + (Peek() - '0');
        if (value > kMaxRepetition) value = kMaxRepetition + 1;
        ++pos_;
      }
      if (pos_ == start) return std::nullopt;
      return static_cast<int>(value);
    };
    std::optional<int> min = number();
    if (!min) return Error("expected a number after '{'");
    std::optional<int> max = min;
    SkipSpace();
    if (Peek() == ',') {
      ++pos_;
      SkipSpace();
      max = Peek() == '}' ? std::optional<int>(-1) : number();
      if (!max) return Error("expected a number or '}' after ','");
    }
    SkipSpace();
    if (Peek() != '}') return Error("expected '}'");
    ++pos_;
    if (*min > kMaxRepetition || *max > kMaxRepetition) {
      return Error(absl::StrCat("a repetition bound is over the limit of ", kMaxRepetition));
    }
    if (*max >= 0 && *max < *min) return Error("a repetition's maximum is below its minimum");
    return std::make_pair(*min, *max);
  }

  // One character of a literal or class (an escape or UTF-8), as a code point.
  absl::StatusOr<uint32_t> ParseChar() {
    if (AtEnd()) return Error("unexpected end of the grammar");
    const auto c = static_cast<unsigned char>(text_[pos_]);
    if (c == '\\') {
      ++pos_;
      if (AtEnd()) return Error("unexpected end after '\\'");
      const char e = text_[pos_++];
      switch (e) {
        case 'n':
          return '\n';
        case 'r':
          return '\r';
        case 't':
          return '\t';
        case '0':
          return 0;
        case '\\':
        case '"':
        case '\'':
        case '[':
        case ']':
        case '-':
        case '^':
        case '/':
          return static_cast<uint32_t>(e);
        case 'x':
        case 'u':
        case 'U': {
          const int digits = e == 'x' ? 2 : (e == 'u' ? 4 : 8);
          uint32_t value = 0;
          for (int i = 0; i < digits; ++i) {
            const int h = AtEnd() ? -1 : HexValue(text_[pos_]);
            if (h < 0)
              return Error(
                  absl::StrCat("expected ", digits, " hex digits after \\", std::string(1, e)));
            value = value * 16 + static_cast<uint32_t>(h);
            ++pos_;
          }
          if (value > internal::kMaxCodepoint || (value >= 0xD800 && value <= 0xDFFF)) {
            return Error(absl::StrFormat("\\%c%X is not a Unicode scalar value", e, value));
          }
          return value;
        }
        default:
          --pos_;
          return Error(absl::StrCat("unknown escape '\\", std::string(1, e), "'"));
      }
    }
    // UTF-8.
    int length = 1;
    uint32_t cp = c;
    if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      cp = c & 0x07;
    } else if (c >= 0xE0) {
      length = 3;
      cp = c & 0x0F;
    } else if (c >= 0xC2 && c <= 0xDF) {
      length = 2;
      cp = c & 0x1F;
    } else if (c >= 0x80) {
      return Error("invalid UTF-8");
    }
    if (pos_ + length > text_.size()) return Error("invalid UTF-8");
    for (int i = 1; i < length; ++i) {
      const auto b = static_cast<unsigned char>(text_[pos_ + i]);
      if ((b & 0xC0) != 0x80) return Error("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3F);
    }
    if ((length == 3 && cp < 0x800) || (length == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return Error("invalid UTF-8");
    }
    pos_ += length;
    return cp;
  }

  absl::StatusOr<std::string> ParseLiteral() {
    ++pos_;  // "
    std::string bytes;
    while (true) {
      if (AtEnd() || Peek() == '\n') return Error("unterminated string literal");
      if (Peek() == '"') {
        ++pos_;
        return bytes;
      }
      auto cp = ParseChar();
      if (!cp.ok()) return cp.status();
      internal::AppendUtf8(*cp, &bytes);
    }
  }

  absl::StatusOr<std::vector<CodepointRange>> ParseClass() {
    ++pos_;  // [
    bool negated = false;
    if (Peek() == '^') {
      negated = true;
      ++pos_;
    }
    std::vector<CodepointRange> ranges;
    while (true) {
      if (AtEnd()) return Error("unterminated character class");
      if (Peek() == ']') {
        ++pos_;
        break;
      }
      auto lo = ParseChar();
      if (!lo.ok()) return lo.status();
      uint32_t hi = *lo;
      if (Peek() == '-' && pos_ + 1 < text_.size() && text_[pos_ + 1] != ']') {
        ++pos_;
        auto h = ParseChar();
        if (!h.ok()) return h.status();
        hi = *h;
        if (hi < *lo) return Error("a character range ends before it starts");
      }
      ranges.emplace_back(*lo, hi);
    }
    ranges = internal::NormalizeRanges(std::move(ranges));
    if (negated) ranges = internal::ComplementRanges(ranges);
    return ranges;
  }

  absl::string_view text_;
  absl::string_view what_;
  size_t pos_ = 0;
  RuleSet rules_;
  std::string current_rule_;
};

}  // namespace

Grammar::Grammar(std::unique_ptr<internal::GrammarData> data) : data_(std::move(data)) {}
Grammar::~Grammar() = default;

bool Grammar::Matches(absl::string_view text) const {
  internal::StackArena arena(data_.get());
  internal::State state = arena.initial();
  internal::State next;
  for (unsigned char b : text) {
    arena.Step(state, b, &next);
    if (next.empty()) return false;
    state.swap(next);
  }
  return internal::StackArena::CanEnd(state);
}

int64_t Grammar::num_rules() const { return static_cast<int64_t>(data_->alternatives.size()); }
int64_t Grammar::num_elements() const { return static_cast<int64_t>(data_->elements.size()); }

absl::StatusOr<std::shared_ptr<const Grammar>> ParseGbnf(absl::string_view text,
                                                         absl::string_view what) {
  GbnfParser parser(text, what);
  auto data = parser.Parse();
  if (!data.ok()) return data.status();
  return std::make_shared<const Grammar>(*std::move(data));
}

std::string GbnfLiteral(absl::string_view text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20 || c == 0x7F) {
          absl::StrAppendFormat(&out, "\\x%02X", c);
        } else if (c >= 0x80) {
          // A byte of a multi-byte character: \x escapes would name code
          // points, so pass the UTF-8 through (the parser decodes it).
          out.push_back(static_cast<char>(c));
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out += "\"";
  return out;
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileChoices(
    const std::vector<std::string>& choices) {
  if (choices.empty()) return absl::InvalidArgumentError("choice: the list is empty");
  std::vector<std::string> literals;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("choice[", i, "] is empty"));
    }
    literals.push_back(GbnfLiteral(choices[i]));
  }
  return ParseGbnf(absl::StrCat("root ::= ", absl::StrJoin(literals, " | ")), "choice");
}

}  // namespace accel::grammar
