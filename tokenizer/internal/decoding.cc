#include "tokenizer/internal/decoding.h"

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/status.h"
#include "tokenizer/bpe_trainer.h"
#include "tokenizer/internal/regex.h"
#include "tokenizer/internal/unicode.h"

namespace accel::tokenizer::internal {
namespace {

constexpr absl::string_view kReplacementChar = "\xEF\xBF\xBD";

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts)
      : parts_(std::move(parts)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (const auto& p : parts_) p->DecodeChain(tokens);
  }
  void DecodeChainBytes(std::vector<std::string>* tokens) const override {
    for (const auto& p : parts_) p->DecodeChainBytes(tokens);
  }
  bool GroupsByteTokens() const override {
    for (const auto& p : parts_) {
      if (p->GroupsByteTokens()) return true;
    }
    return false;
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

// The bytes behind GPT-2's byte symbols; a token with any other character
// contributes its own UTF-8 bytes. The whole result is decoded lossily.
class ByteLevelDecoder : public Decoder {
 public:
  ByteLevelDecoder() {
    const std::vector<std::string>& symbols = ByteToSymbol();
    for (int b = 0; b < 256; ++b) {
      size_t pos = 0;
      char_to_byte_[NextChar(symbols[b], &pos)] = static_cast<unsigned char>(b);
    }
  }
  void DecodeChain(std::vector<std::string>* tokens) const override {
    DecodeChainBytes(tokens);
    (*tokens)[0] = LossyUtf8((*tokens)[0]);
  }
  void DecodeChainBytes(std::vector<std::string>* tokens) const override {
    std::string bytes;
    for (const std::string& token : *tokens) {
      const size_t mark = bytes.size();
      size_t pos = 0;
      bool all = true;
      while (pos < token.size()) {
        auto it = char_to_byte_.find(NextChar(token, &pos));
        if (it == char_to_byte_.end()) {
          all = false;
          break;
        }
        bytes.push_back(static_cast<char>(it->second));
      }
      if (!all) {
        bytes.resize(mark);
        bytes.append(token);
      }
    }
    tokens->assign(1, std::move(bytes));
  }

 private:
  absl::flat_hash_map<char32_t, unsigned char> char_to_byte_;
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, bool strip_first)
      : replacement_(replacement), strip_first_(strip_first) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t i = 0; i < tokens->size(); ++i) {
      std::string& token = (*tokens)[i];
      std::string out;
      out.reserve(token.size());
      size_t pos = 0;
      while (pos < token.size()) {
        const size_t start = pos;
        const char32_t c = NextChar(token, &pos);
        if (c != replacement_) {
          out.append(token, start, pos - start);
        } else if (i != 0 || !strip_first_) {
          out.push_back(' ');
        }
      }
      token = std::move(out);
    }
  }

 private:
  char32_t replacement_;
  bool strip_first_;  // prepend_scheme is not "never"
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(std::unique_ptr<Regex> regex, std::string content)
      : regex_(std::move(regex)), content_(std::move(content)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::vector<Segment> segments;
    for (std::string& token : *tokens) {
      FindSegments(*regex_, token, &segments);
      std::string out;
      for (const Segment& s : segments) {
        if (s.is_match) {
          out.append(content_);
        } else {
          out.append(token, s.start, s.end - s.start);
        }
      }
      token = std::move(out);
    }
  }

 private:
  std::unique_ptr<Regex> regex_;
  std::string content_;
};

// Runs of <0xNN> tokens become the string they spell when it is valid UTF-8,
// else one U+FFFD per byte (HF's ByteFallback, which is not lossy decoding).
class ByteFallbackDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override { Decode(tokens, false); }
  void DecodeChainBytes(std::vector<std::string>* tokens) const override { Decode(tokens, true); }
  bool GroupsByteTokens() const override { return true; }

 private:
  static void Decode(std::vector<std::string>* tokens, bool raw) {
    std::vector<std::string> out;
    out.reserve(tokens->size());
    std::string run;
    auto flush = [&] {
      if (run.empty()) return;
      if (raw || IsValidUtf8(run)) {
        out.push_back(run);
      } else {
        for (size_t i = 0; i < run.size(); ++i) out.emplace_back(kReplacementChar);
      }
      run.clear();
    };
    for (std::string& token : *tokens) {
      if (std::optional<unsigned char> byte = ByteFallbackValue(token)) {
        run.push_back(static_cast<char>(*byte));
        continue;
      }
      flush();
      out.push_back(std::move(token));
    }
    flush();
    *tokens = std::move(out);
  }
};

class FuseDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    tokens->assign(1, absl::StrJoin(*tokens, ""));
  }
};

// Removes up to `start` leading and `stop` trailing `content` characters of each token.
class StripDecoder : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& token : *tokens) {
      std::vector<size_t> offsets;  // byte offset of each character, then the end
      std::vector<char32_t> chars;
      size_t pos = 0;
      while (pos < token.size()) {
        offsets.push_back(pos);
        chars.push_back(NextChar(token, &pos));
      }
      offsets.push_back(token.size());
      size_t start_cut = 0;
      for (size_t i = 0; i < start_ && i < chars.size() && chars[i] == content_; ++i) {
        start_cut = i + 1;
      }
      size_t stop_cut = chars.size();
      for (size_t i = 0; i < stop_ && i < chars.size(); ++i) {
        const size_t index = chars.size() - i - 1;
        if (chars[index] != content_) break;
        stop_cut = index;
      }
      // HF panics when the cuts cross; an empty token is the sane reading.
      if (stop_cut < start_cut) stop_cut = start_cut;
      token = token.substr(offsets[start_cut], offsets[stop_cut] - offsets[start_cut]);
    }
  }

 private:
  char32_t content_;
  size_t start_;
  size_t stop_;
};

class SequenceProcessor : public PostProcessor {
 public:
  explicit SequenceProcessor(std::vector<std::unique_ptr<PostProcessor>> parts)
      : parts_(std::move(parts)) {}
  void Process(std::vector<int64_t>* ids) const override {
    for (const auto& p : parts_) p->Process(ids);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> parts_;
};

class NoOpProcessor : public PostProcessor {
 public:
  void Process(std::vector<int64_t>*) const override {}
};

// The single-sequence template: ids before and after the sequence.
class TemplateProcessor : public PostProcessor {
 public:
  TemplateProcessor(std::vector<int64_t> before, std::vector<int64_t> after)
      : before_(std::move(before)), after_(std::move(after)) {}
  void Process(std::vector<int64_t>* ids) const override {
    ids->insert(ids->begin(), before_.begin(), before_.end());
    ids->insert(ids->end(), after_.begin(), after_.end());
  }

 private:
  std::vector<int64_t> before_;
  std::vector<int64_t> after_;
};

absl::StatusOr<std::unique_ptr<Regex>> ParseDecoderPattern(const JsonReader& reader,
                                                           const Json& obj,
                                                           const std::string& path) {
  const std::string pattern_path = JsonReader::Child(path, "pattern");
  const Json* pattern = JsonReader::Find(obj, "pattern");
  if (pattern == nullptr) return reader.Invalid(pattern_path, "is missing");
  ACCEL_RETURN_IF_ERROR(reader.ExpectObject(*pattern, pattern_path));
  if (pattern->size() == 1 && JsonReader::Find(*pattern, "String") != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(std::string literal, reader.String(*pattern, pattern_path, "String"));
    if (literal.empty()) {
      return reader.Unsupported(JsonReader::Child(pattern_path, "String"), "an empty pattern");
    }
    return Regex::FromLiteral(literal);
  }
  if (pattern->size() == 1 && JsonReader::Find(*pattern, "Regex") != nullptr) {
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
  return reader.Invalid(pattern_path, "must hold exactly one of \"String\" or \"Regex\"");
}

// A [token, id] pair of RobertaProcessing / BertProcessing.
absl::StatusOr<int64_t> ParseTokenPair(const JsonReader& reader, const Json& obj,
                                       const std::string& path, absl::string_view key) {
  const std::string pair_path = JsonReader::Child(path, key);
  ACCEL_ASSIGN_OR_RETURN(const Json* pair, reader.Array(obj, path, key));
  if (pair->size() != 2 || !(*pair)[0].is_string()) {
    return reader.Invalid(pair_path, "must be a pair [token, id]");
  }
  return reader.IntValue((*pair)[1], JsonReader::Index(pair_path, 1), 0, int64_t{0xFFFFFFFF});
}

absl::StatusOr<std::unique_ptr<PostProcessor>> ParseTemplate(const JsonReader& reader,
                                                             const Json& value,
                                                             const std::string& path) {
  // special_tokens: name -> {"id": name, "ids": [...], "tokens": [...]}.
  const std::string specials_path = JsonReader::Child(path, "special_tokens");
  absl::flat_hash_map<std::string, std::vector<int64_t>> specials;
  if (const Json* map = JsonReader::Find(value, "special_tokens"); map != nullptr) {
    ACCEL_RETURN_IF_ERROR(reader.ExpectObject(*map, specials_path));
    for (auto it = map->begin(); it != map->end(); ++it) {
      const std::string entry_path =
          absl::StrCat(specials_path, "[\"", absl::CEscape(it.key()), "\"]");
      ACCEL_RETURN_IF_ERROR(reader.ExpectObject(it.value(), entry_path));
      ACCEL_ASSIGN_OR_RETURN(const Json* ids, reader.Array(it.value(), entry_path, "ids"));
      std::vector<int64_t> list;
      for (size_t i = 0; i < ids->size(); ++i) {
        ACCEL_ASSIGN_OR_RETURN(
            int64_t id,
            reader.IntValue((*ids)[i], JsonReader::Index(JsonReader::Child(entry_path, "ids"), i),
                            0, int64_t{0xFFFFFFFF}));
        list.push_back(id);
      }
      ACCEL_ASSIGN_OR_RETURN(std::string name, reader.String(it.value(), entry_path, "id"));
      specials[name] = std::move(list);
    }
  }
  const std::string single_path = JsonReader::Child(path, "single");
  ACCEL_ASSIGN_OR_RETURN(const Json* single, reader.Array(value, path, "single"));
  std::vector<int64_t> before;
  std::vector<int64_t> after;
  bool seen_sequence = false;
  for (size_t i = 0; i < single->size(); ++i) {
    const std::string piece_path = JsonReader::Index(single_path, i);
    const Json& piece = (*single)[i];
    ACCEL_RETURN_IF_ERROR(reader.ExpectObject(piece, piece_path));
    if (const Json* seq = JsonReader::Find(piece, "Sequence"); seq != nullptr) {
      const std::string seq_path = JsonReader::Child(piece_path, "Sequence");
      ACCEL_RETURN_IF_ERROR(reader.ExpectObject(*seq, seq_path));
      ACCEL_ASSIGN_OR_RETURN(std::string id, reader.String(*seq, seq_path, "id"));
      if (id != "A") {
        return reader.Invalid(JsonReader::Child(seq_path, "id"),
                              "a single-sequence template can only hold sequence A");
      }
      if (seen_sequence) return reader.Invalid(piece_path, "sequence A appears twice");
      seen_sequence = true;
    } else if (const Json* special = JsonReader::Find(piece, "SpecialToken"); special != nullptr) {
      const std::string special_path = JsonReader::Child(piece_path, "SpecialToken");
      ACCEL_RETURN_IF_ERROR(reader.ExpectObject(*special, special_path));
      ACCEL_ASSIGN_OR_RETURN(std::string id, reader.String(*special, special_path, "id"));
      auto it = specials.find(id);
      if (it == specials.end()) {
        return reader.Invalid(JsonReader::Child(special_path, "id"),
                              absl::StrCat("names \"", absl::CEscape(id),
                                           "\", which special_tokens does not define"));
      }
      std::vector<int64_t>& out = seen_sequence ? after : before;
      out.insert(out.end(), it->second.begin(), it->second.end());
    } else {
      return reader.Invalid(piece_path, "must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    }
  }
  if (!seen_sequence) return reader.Invalid(single_path, "has no sequence A");
  return std::unique_ptr<PostProcessor>(new TemplateProcessor(std::move(before), std::move(after)));
}

}  // namespace

std::optional<unsigned char> ByteFallbackValue(absl::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return std::nullopt;
  // u8::from_str_radix(.., 16) also takes a leading '+'.
  const char hi = token[3];
  const char lo = token[4];
  if (hi == '+') {
    const int d = HexDigit(lo);
    if (d < 0) return std::nullopt;
    return static_cast<unsigned char>(d);
  }
  const int h = HexDigit(hi);
  const int l = HexDigit(lo);
  if (h < 0 || l < 0) return std::nullopt;
  return static_cast<unsigned char>(h * 16 + l);
}

absl::StatusOr<std::unique_ptr<Decoder>> ParseDecoder(const JsonReader& reader, const Json& value,
                                                      const std::string& path) {
  if (value.is_null()) return std::unique_ptr<Decoder>();
  ACCEL_RETURN_IF_ERROR(reader.ExpectObject(value, path));
  ACCEL_ASSIGN_OR_RETURN(std::string type, reader.Type(value, path));
  if (type == "Sequence") {
    ACCEL_ASSIGN_OR_RETURN(
        auto parts, reader.Components<Decoder>(value, path, "decoders", "decoder", ParseDecoder));
    return std::unique_ptr<Decoder>(new SequenceDecoder(std::move(parts)));
  }
  if (type == "ByteLevel") return std::unique_ptr<Decoder>(new ByteLevelDecoder());
  if (type == "Metaspace") {
    ACCEL_ASSIGN_OR_RETURN(std::string replacement, reader.Char(value, path, "replacement"));
    size_t pos = 0;
    const char32_t c = NextChar(replacement, &pos);
    ACCEL_ASSIGN_OR_RETURN(auto scheme, reader.OptionalString(value, path, "prepend_scheme"));
    bool strip_first = true;
    if (scheme.has_value()) {
      if (*scheme != "always" && *scheme != "first" && *scheme != "never") {
        return reader.Invalid(JsonReader::Child(path, "prepend_scheme"),
                              absl::StrCat("unknown prepend scheme \"", *scheme, "\""));
      }
      strip_first = *scheme != "never";
    } else {
      ACCEL_ASSIGN_OR_RETURN(strip_first, reader.Bool(value, path, "add_prefix_space", true));
    }
    return std::unique_ptr<Decoder>(new MetaspaceDecoder(c, strip_first));
  }
  if (type == "Replace") {
    ACCEL_ASSIGN_OR_RETURN(auto regex, ParseDecoderPattern(reader, value, path));
    ACCEL_ASSIGN_OR_RETURN(std::string content, reader.String(value, path, "content"));
    return std::unique_ptr<Decoder>(new ReplaceDecoder(std::move(regex), std::move(content)));
  }
  if (type == "ByteFallback") return std::unique_ptr<Decoder>(new ByteFallbackDecoder());
  if (type == "Fuse") return std::unique_ptr<Decoder>(new FuseDecoder());
  if (type == "Strip") {
    ACCEL_ASSIGN_OR_RETURN(std::string content, reader.Char(value, path, "content"));
    size_t pos = 0;
    const char32_t c = NextChar(content, &pos);
    ACCEL_ASSIGN_OR_RETURN(int64_t start, reader.Int(value, path, "start", 0, int64_t{1} << 32));
    ACCEL_ASSIGN_OR_RETURN(int64_t stop, reader.Int(value, path, "stop", 0, int64_t{1} << 32));
    return std::unique_ptr<Decoder>(
        new StripDecoder(c, static_cast<size_t>(start), static_cast<size_t>(stop)));
  }
  return reader.Unsupported(JsonReader::Child(path, "type"),
                            absl::StrCat("the decoder type \"", type, "\""));
}

absl::StatusOr<std::unique_ptr<PostProcessor>> ParsePostProcessor(const JsonReader& reader,
                                                                  const Json& value,
                                                                  const std::string& path) {
  if (value.is_null()) return std::unique_ptr<PostProcessor>();
  ACCEL_RETURN_IF_ERROR(reader.ExpectObject(value, path));
  ACCEL_ASSIGN_OR_RETURN(std::string type, reader.Type(value, path));
  if (type == "Sequence") {
    ACCEL_ASSIGN_OR_RETURN(
        auto parts, reader.Components<PostProcessor>(value, path, "processors", "post-processor",
                                                     ParsePostProcessor));
    return std::unique_ptr<PostProcessor>(new SequenceProcessor(std::move(parts)));
  }
  // ByteLevel only trims offsets, which ids do not have.
  if (type == "ByteLevel") return std::unique_ptr<PostProcessor>(new NoOpProcessor());
  if (type == "TemplateProcessing") return ParseTemplate(reader, value, path);
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    ACCEL_ASSIGN_OR_RETURN(int64_t cls, ParseTokenPair(reader, value, path, "cls"));
    ACCEL_ASSIGN_OR_RETURN(int64_t sep, ParseTokenPair(reader, value, path, "sep"));
    return std::unique_ptr<PostProcessor>(
        new TemplateProcessor(std::vector<int64_t>{cls}, std::vector<int64_t>{sep}));
  }
  return reader.Unsupported(JsonReader::Child(path, "type"),
                            absl::StrCat("the post-processor type \"", type, "\""));
}

}  // namespace accel::tokenizer::internal
