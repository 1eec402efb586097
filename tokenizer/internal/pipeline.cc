#include "tokenizer/internal/pipeline.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "tokenizer/bpe_trainer.h"
#include "tokenizer/internal/unicode.h"

namespace accel::tokenizer::internal {
namespace {

// GPT-2's pre-tokenization pattern, which the ByteLevel pre-tokenizer uses.
constexpr absl::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// HF's Pattern for a char predicate: every matching character is a match of
// its own, the stretches between them are non-matches.
template <typename Pred>
void CharSegments(absl::string_view text, Pred pred, std::vector<Segment>* out) {
  out->clear();
  if (text.empty()) {
    out->push_back({0, 0, false});
    return;
  }
  size_t last = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t start = pos;
    const char32_t c = NextChar(text, &pos);
    if (pred(c)) {
      if (last < start) out->push_back({last, start, false});
      out->push_back({start, pos, true});
      last = pos;
    }
  }
  if (last < text.size()) out->push_back({last, text.size(), false});
}

// NormalizedString::split: the pieces `segments` leave under `behavior`.
void SplitBySegments(const Piece& piece, const std::vector<Segment>& segments,
                     SplitBehavior behavior, std::vector<Piece>* out) {
  struct Range {
    size_t start;
    size_t end;
    bool remove;
  };
  std::vector<Range> ranges;
  ranges.reserve(segments.size());
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Segment& s : segments) ranges.push_back({s.start, s.end, false});
      break;
    case SplitBehavior::kRemoved:
      for (const Segment& s : segments) ranges.push_back({s.start, s.end, s.is_match});
      break;
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Segment& s : segments) {
        if (s.is_match == previous_match && !ranges.empty()) {
          ranges.back().end = s.end;
        } else {
          ranges.push_back({s.start, s.end, false});
        }
        previous_match = s.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Segment& s : segments) {
        if (s.is_match && !previous_match && !ranges.empty()) {
          ranges.back().end = s.end;
        } else {
          ranges.push_back({s.start, s.end, false});
        }
        previous_match = s.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->is_match && !previous_match && !ranges.empty()) {
          ranges.back().start = it->start;
        } else {
          ranges.push_back({it->start, it->end, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(ranges.begin(), ranges.end());
      break;
    }
  }
  for (const Range& r : ranges) {
    if (!r.remove && r.end > r.start) out->push_back(SlicePiece(piece, r.start, r.end));
  }
}

// Runs `fn(piece, out)` on every piece that is not an added token and keeps
// the non-empty results (PreTokenizedString::split).
template <typename Fn>
void SplitPieces(std::vector<Piece>* pieces, Fn fn) {
  std::vector<Piece> result;
  result.reserve(pieces->size());
  for (Piece& piece : *pieces) {
    if (piece.token >= 0) {
      result.push_back(std::move(piece));
      continue;
    }
    const size_t first = result.size();
    fn(std::move(piece), &result);
    result.erase(std::remove_if(result.begin() + static_cast<std::ptrdiff_t>(first), result.end(),
                                [](const Piece& p) { return p.text.empty(); }),
                 result.end());
  }
  pieces->swap(result);
}

// NormalizedString::replace: every match becomes `content`. A replacement
// takes the alignment of the last byte it replaces (of the byte before an
// empty match), which decides whether it is still aligned to offset 0.
void ReplaceSegments(std::string* text, size_t* zero_len, const std::vector<Segment>& segments,
                     absl::string_view content) {
  std::string out;
  out.reserve(text->size());
  const size_t zl = *zero_len;
  bool aligned = zl > 0;
  size_t new_zero = 0;
  for (const Segment& s : segments) {
    if (!s.is_match) {
      out.append(*text, s.start, s.end - s.start);
      if (aligned) {
        if (s.start < zl) new_zero += std::min(s.end, zl) - s.start;
        if (s.end > zl) aligned = false;
      }
      continue;
    }
    out.append(content.data(), content.size());
    if (aligned && !content.empty()) {
      const bool zero = s.end > s.start ? s.end - 1 < zl : (s.start == 0 || s.start - 1 < zl);
      if (zero) {
        new_zero += content.size();
      } else {
        aligned = false;
      }
    }
  }
  *text = std::move(out);
  *zero_len = new_zero;
}

// Rounds `n` up to a character boundary of `text`, at most its size.
size_t CharBoundaryAtOrAfter(absl::string_view text, size_t n) {
  if (n >= text.size()) return text.size();
  while (n < text.size() && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) ++n;
  return n;
}

// ---- Normalizers -------------------------------------------------------------

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  void Normalize(std::string* text, size_t* zero_len) const override {
    for (const auto& p : parts_) p->Normalize(text, zero_len);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  void Normalize(std::string* text, size_t* zero_len) const override {
    std::string normalized = NormalizeUnicode(*text, form_);
    if (*zero_len > 0) {
      // What the characters aligned to offset 0 became (they compose or
      // decompose among themselves).
      const size_t n =
          NormalizeUnicode(absl::string_view(*text).substr(0, *zero_len), form_).size();
      *zero_len = CharBoundaryAtOrAfter(normalized, n);
    }
    *text = std::move(normalized);
  }

 private:
  NormalForm form_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  void Normalize(std::string* text, size_t* zero_len) const override {
    std::string out;
    out.reserve(text->size());
    size_t pos = 0;
    size_t new_zero = 0;
    while (pos < text->size()) {
      const size_t start = pos;
      AppendLowercase(NextChar(*text, &pos), &out);
      if (start < *zero_len) new_zero = out.size();
    }
    *text = std::move(out);
    *zero_len = new_zero;
  }
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prepend) : prepend_(std::move(prepend)) {}
  void Normalize(std::string* text, size_t* zero_len) const override {
    if (text->empty()) return;
    text->insert(0, prepend_);
    if (*zero_len > 0) *zero_len += prepend_.size();
  }

 private:
  std::string prepend_;
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(std::unique_ptr<Regex> regex, std::string content)
      : regex_(std::move(regex)), content_(std::move(content)) {}
  void Normalize(std::string* text, size_t* zero_len) const override {
    std::vector<Segment> segments;
    FindSegments(*regex_, *text, &segments);
    ReplaceSegments(text, zero_len, segments, content_);
  }

 private:
  std::unique_ptr<Regex> regex_;
  std::string content_;
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void Normalize(std::string* text, size_t* zero_len) const override {
    size_t begin = 0;
    size_t end = text->size();
    if (left_) {
      while (begin < end) {
        size_t next = begin;
        if (!IsWhitespace(NextChar(*text, &next))) break;
        begin = next;
      }
    }
    if (right_) {
      while (end > begin) {
        size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>((*text)[start]) & 0xC0) == 0x80) {
          --start;
        }
        size_t probe = start;
        if (!IsWhitespace(NextChar(*text, &probe))) break;
        end = start;
      }
    }
    if (begin == 0 && end == text->size()) return;
    *zero_len = *zero_len > begin ? std::min(*zero_len, end) - begin : 0;
    *text = text->substr(begin, end - begin);
  }

 private:
  bool left_;
  bool right_;
};

// ---- Pre-tokenizers ------------------------------------------------------------

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts)
      : parts_(std::move(parts)) {}
  void PreTokenize(std::vector<Piece>* pieces) const override {
    for (const auto& p : parts_) p->PreTokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(std::unique_ptr<Regex> regex, SplitBehavior behavior, bool invert)
      : regex_(std::move(regex)), behavior_(behavior), invert_(invert) {}
  void PreTokenize(std::vector<Piece>* pieces) const override {
    std::vector<Segment> segments;
    SplitPieces(pieces, [&](Piece&& piece, std::vector<Piece>* out) {
      FindSegments(*regex_, piece.text, &segments);
      if (invert_) {
        for (Segment& s : segments) s.is_match = !s.is_match;
      }
      SplitBySegments(piece, segments, behavior_, out);
    });
  }

 private:
  std::unique_ptr<Regex> regex_;
  SplitBehavior behavior_;
  bool invert_;
};

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, const Regex* regex)
      : add_prefix_space_(add_prefix_space), regex_(regex) {}
  void PreTokenize(std::vector<Piece>* pieces) const override {
    std::vector<Segment> segments;
    SplitPieces(pieces, [&](Piece&& piece, std::vector<Piece>* out) {
      if (add_prefix_space_ && !piece.text.empty() && piece.text[0] != ' ') {
        piece.text.insert(0, " ");
        if (piece.zero_len > 0) ++piece.zero_len;
      }
      if (regex_ != nullptr) {
        FindSegments(*regex_, piece.text, &segments);
        SplitBySegments(piece, segments, SplitBehavior::kIsolated, out);
      } else {
        out->push_back(std::move(piece));
      }
    });
    const std::vector<std::string>& symbols = ByteToSymbol();
    for (Piece& piece : *pieces) {
      if (piece.token >= 0) continue;
      std::string mapped;
      mapped.reserve(piece.text.size() * 2);
      size_t new_zero = 0;
      for (size_t i = 0; i < piece.text.size(); ++i) {
        mapped.append(symbols[static_cast<unsigned char>(piece.text[i])]);
        if (i < piece.zero_len) new_zero = mapped.size();
      }
      piece.text = std::move(mapped);
      piece.zero_len = new_zero;
    }
  }

 private:
  bool add_prefix_space_;
  const Regex* regex_;  // GPT-2's pattern (static), or null for use_regex false
};

enum class PrependScheme { kAlways, kFirst, kNever };

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {
    size_t pos = 0;
    replacement_char_ = NextChar(replacement_, &pos);
  }
  void PreTokenize(std::vector<Piece>* pieces) const override {
    std::vector<Segment> segments;
    SplitPieces(pieces, [&](Piece&& piece, std::vector<Piece>* out) {
      CharSegments(
          piece.text, [](char32_t c) { return c == ' '; }, &segments);
      ReplaceSegments(&piece.text, &piece.zero_len, segments, replacement_);
      const bool prepend = !absl::StartsWith(piece.text, replacement_) &&
                           (scheme_ == PrependScheme::kAlways ||
                            (scheme_ == PrependScheme::kFirst && piece.at_origin));
      if (prepend && !piece.text.empty()) {
        piece.text.insert(0, replacement_);
        if (piece.zero_len > 0) piece.zero_len += replacement_.size();
      }
      if (split_) {
        const char32_t r = replacement_char_;
        CharSegments(
            piece.text, [r](char32_t c) { return c == r; }, &segments);
        SplitBySegments(piece, segments, SplitBehavior::kMergedWithNext, out);
      } else {
        out->push_back(std::move(piece));
      }
    });
  }

 private:
  std::string replacement_;
  char32_t replacement_char_ = 0;
  PrependScheme scheme_;
  bool split_;
};

class DigitsPreTokenizer : public PreTokenizer {
 public:
  explicit DigitsPreTokenizer(bool individual) : individual_(individual) {}
  void PreTokenize(std::vector<Piece>* pieces) const override {
    std::vector<Segment> segments;
    SplitPieces(pieces, [&](Piece&& piece, std::vector<Piece>* out) {
      CharSegments(piece.text, IsNumeric, &segments);
      SplitBySegments(piece, segments,
                      individual_ ? SplitBehavior::kIsolated : SplitBehavior::kContiguous, out);
    });
  }

 private:
  bool individual_;
};

class WhitespaceSplitPreTokenizer : public PreTokenizer {
 public:
  void PreTokenize(std::vector<Piece>* pieces) const override {
    std::vector<Segment> segments;
    SplitPieces(pieces, [&](Piece&& piece, std::vector<Piece>* out) {
      CharSegments(piece.text, IsWhitespace, &segments);
      SplitBySegments(piece, segments, SplitBehavior::kRemoved, out);
    });
  }
};

// Compiled once, never freed (a function-local static is initialised thread-safely).
const Regex* Gpt2Regex() {
  static const Regex* const kRegex = [] {
    auto regex = Regex::FromOniguruma(kGpt2Pattern);
    return regex.ok() ? regex->release() : nullptr;
  }();
  return kRegex;
}

// HF's Whitespace pre-tokenizer: `\w+|[^\w\s]+` (inverted, removed), with the
// regex crate's \w: Alphabetic (letters, Nl, Other_Alphabetic), marks, Nd,
// Pc and the join controls, rather than Oniguruma's.
const Regex* WhitespaceRegex() {
  static const Regex* const kRegex = [] {
    constexpr absl::string_view kWord =
        R"(\p{L}\p{M}\p{Nd}\p{Nl}\p{Pc}\x{200C}\x{200D}\x{24B6}-\x{24E9}\x{1F130}-\x{1F149})"
        R"(\x{1F150}-\x{1F169}\x{1F170}-\x{1F189})";
    auto regex = Regex::FromOniguruma(absl::StrCat("[", kWord, "]+|[^", kWord, "\\s]+"));
    return regex.ok() ? regex->release() : nullptr;
  }();
  return kRegex;
}

class WhitespacePreTokenizer : public PreTokenizer {
 public:
  explicit WhitespacePreTokenizer(const Regex* regex) : regex_(regex) {}
  void PreTokenize(std::vector<Piece>* pieces) const override {
    std::vector<Segment> segments;
    SplitPieces(pieces, [&](Piece&& piece, std::vector<Piece>* out) {
      FindSegments(*regex_, piece.text, &segments);
      for (Segment& s : segments) s.is_match = !s.is_match;
      SplitBySegments(piece, segments, SplitBehavior::kRemoved, out);
    });
  }

 private:
  const Regex* regex_;
};

// {"String": "..."} or {"Regex": "..."}.
absl::StatusOr<std::unique_ptr<Regex>> ParsePattern(const JsonReader& reader, const Json& obj,
                                                    const std::string& path) {
  const std::string pattern_path = JsonReader::Child(path, "pattern");
  const Json* pattern = JsonReader::Find(obj, "pattern");
  if (pattern == nullptr) return reader.Invalid(pattern_path, "is missing");
  ACCEL_RETURN_IF_ERROR(reader.ExpectObject(*pattern, pattern_path));
  if (pattern->size() != 1) {
    return reader.Invalid(pattern_path, "must hold exactly one of \"String\" or \"Regex\"");
  }
  if (JsonReader::Find(*pattern, "String") != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(std::string literal, reader.String(*pattern, pattern_path, "String"));
    auto regex = Regex::FromLiteral(literal);
    if (!regex.ok()) {
      return reader.Unsupported(JsonReader::Child(pattern_path, "String"), "an empty pattern");
    }
    return regex;
  }
  if (JsonReader::Find(*pattern, "Regex") != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(std::string text, reader.String(*pattern, pattern_path, "Regex"));
    auto regex = Regex::FromOniguruma(text);
    if (!regex.ok()) {
      return absl::Status(
          regex.status().code(),
          absl::StrCat(reader.source(), ": ", JsonReader::Child(pattern_path, "Regex"), ": ",
                       regex.status().message()));
    }
    return regex;
  }
  return reader.Invalid(pattern_path, "must hold \"String\" or \"Regex\"");
}

absl::StatusOr<SplitBehavior> ParseBehavior(const JsonReader& reader, const Json& obj,
                                            const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(std::string name, reader.String(obj, path, "behavior"));
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return reader.Invalid(JsonReader::Child(path, "behavior"),
                        absl::StrCat("unknown split behavior \"", name, "\""));
}

}  // namespace

Piece SlicePiece(const Piece& piece, size_t start, size_t end) {
  Piece out;
  out.text = piece.text.substr(start, end - start);
  out.at_origin = piece.at_origin && start < piece.zero_len;
  out.zero_len = out.at_origin ? std::min(piece.zero_len, end) - start : 0;
  return out;
}

absl::StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(const JsonReader& reader,
                                                            const Json& value,
                                                            const std::string& path) {
  if (value.is_null()) return std::unique_ptr<Normalizer>();
  ACCEL_RETURN_IF_ERROR(reader.ExpectObject(value, path));
  ACCEL_ASSIGN_OR_RETURN(std::string type, reader.Type(value, path));
  if (type == "Sequence") {
    ACCEL_ASSIGN_OR_RETURN(
        auto parts,
        reader.Components<Normalizer>(value, path, "normalizers", "normalizer", ParseNormalizer));
    return std::unique_ptr<Normalizer>(new SequenceNormalizer(std::move(parts)));
  }
  if (type == "NFC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfc));
  if (type == "NFD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfd));
  if (type == "NFKC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfkc));
  if (type == "NFKD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfkd));
  if (type == "Lowercase") return std::unique_ptr<Normalizer>(new LowercaseNormalizer());
  if (type == "Prepend") {
    ACCEL_ASSIGN_OR_RETURN(std::string prepend, reader.String(value, path, "prepend"));
    return std::unique_ptr<Normalizer>(new PrependNormalizer(std::move(prepend)));
  }
  if (type == "Replace") {
    ACCEL_ASSIGN_OR_RETURN(auto regex, ParsePattern(reader, value, path));
    ACCEL_ASSIGN_OR_RETURN(std::string content, reader.String(value, path, "content"));
    return std::unique_ptr<Normalizer>(new ReplaceNormalizer(std::move(regex), std::move(content)));
  }
  if (type == "Strip") {
    ACCEL_ASSIGN_OR_RETURN(bool left, reader.Bool(value, path, "strip_left", true));
    ACCEL_ASSIGN_OR_RETURN(bool right, reader.Bool(value, path, "strip_right", true));
    return std::unique_ptr<Normalizer>(new StripNormalizer(left, right));
  }
  return reader.Unsupported(JsonReader::Child(path, "type"),
                            absl::StrCat("the normalizer type \"", type, "\""));
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(const JsonReader& reader,
                                                                const Json& value,
                                                                const std::string& path) {
  if (value.is_null()) return std::unique_ptr<PreTokenizer>();
  ACCEL_RETURN_IF_ERROR(reader.ExpectObject(value, path));
  ACCEL_ASSIGN_OR_RETURN(std::string type, reader.Type(value, path));
  if (type == "Sequence") {
    ACCEL_ASSIGN_OR_RETURN(
        auto parts, reader.Components<PreTokenizer>(value, path, "pretokenizers", "pre-tokenizer",
                                                    ParsePreTokenizer));
    return std::unique_ptr<PreTokenizer>(new SequencePreTokenizer(std::move(parts)));
  }
  if (type == "ByteLevel") {
    ACCEL_ASSIGN_OR_RETURN(bool add_prefix_space,
                           reader.Bool(value, path, "add_prefix_space", true));
    ACCEL_ASSIGN_OR_RETURN(bool use_regex, reader.Bool(value, path, "use_regex", true));
    ACCEL_RETURN_IF_ERROR(reader.Bool(value, path, "trim_offsets", true).status());
    if (use_regex && Gpt2Regex() == nullptr)
      return absl::InternalError("GPT-2's pattern does not compile");
    return std::unique_ptr<PreTokenizer>(
        new ByteLevelPreTokenizer(add_prefix_space, use_regex ? Gpt2Regex() : nullptr));
  }
  if (type == "Split") {
    ACCEL_ASSIGN_OR_RETURN(auto regex, ParsePattern(reader, value, path));
    ACCEL_ASSIGN_OR_RETURN(SplitBehavior behavior, ParseBehavior(reader, value, path));
    ACCEL_ASSIGN_OR_RETURN(bool invert, reader.Bool(value, path, "invert", false));
    return std::unique_ptr<PreTokenizer>(new SplitPreTokenizer(std::move(regex), behavior, invert));
  }
  if (type == "Metaspace") {
    ACCEL_ASSIGN_OR_RETURN(std::string replacement, reader.Char(value, path, "replacement"));
    ACCEL_ASSIGN_OR_RETURN(bool split, reader.Bool(value, path, "split", true));
    PrependScheme scheme = PrependScheme::kAlways;
    ACCEL_ASSIGN_OR_RETURN(auto scheme_name, reader.OptionalString(value, path, "prepend_scheme"));
    if (scheme_name.has_value()) {
      if (*scheme_name == "always") {
        scheme = PrependScheme::kAlways;
      } else if (*scheme_name == "first") {
        scheme = PrependScheme::kFirst;
      } else if (*scheme_name == "never") {
        scheme = PrependScheme::kNever;
      } else {
        return reader.Invalid(JsonReader::Child(path, "prepend_scheme"),
                              absl::StrCat("unknown prepend scheme \"", *scheme_name, "\""));
      }
    } else {
      // Files written before prepend_scheme existed say add_prefix_space.
      ACCEL_ASSIGN_OR_RETURN(bool add_prefix_space,
                             reader.Bool(value, path, "add_prefix_space", true));
      scheme = add_prefix_space ? PrependScheme::kAlways : PrependScheme::kNever;
    }
    return std::unique_ptr<PreTokenizer>(
        new MetaspacePreTokenizer(std::move(replacement), scheme, split));
  }
  if (type == "Digits") {
    ACCEL_ASSIGN_OR_RETURN(bool individual, reader.Bool(value, path, "individual_digits", false));
    return std::unique_ptr<PreTokenizer>(new DigitsPreTokenizer(individual));
  }
  if (type == "WhitespaceSplit") {
    return std::unique_ptr<PreTokenizer>(new WhitespaceSplitPreTokenizer());
  }
  if (type == "Whitespace") {
    if (WhitespaceRegex() == nullptr)
      return absl::InternalError("\\w+|[^\\w\\s]+ does not compile");
    return std::unique_ptr<PreTokenizer>(new WhitespacePreTokenizer(WhitespaceRegex()));
  }
  return reader.Unsupported(JsonReader::Child(path, "type"),
                            absl::StrCat("the pre-tokenizer type \"", type, "\""));
}

}  // namespace accel::tokenizer::internal
