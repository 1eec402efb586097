// tokenizer/tokenizer.h: HuggingFace tokenizer.json, encoding and decoding with
// the same ids and text as the HuggingFace tokenizers library (Rust).
//
//   ACCEL_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::FromFile("/m/tokenizer.json"));
//   ACCEL_ASSIGN_OR_RETURN(std::vector<int64_t> ids, tok.Encode("Hello", true));
//   ACCEL_ASSIGN_OR_RETURN(std::string text, tok.Decode(ids, /*skip_special_tokens=*/true));
//
// Supported: the BPE model; normalizers NFC, NFD, NFKC, NFKD, Lowercase,
// Strip, Prepend, Replace and Sequence; pre-tokenizers ByteLevel, Split,
// Metaspace, Digits, Whitespace, WhitespaceSplit and Sequence; added tokens
// with all their options; post-processors TemplateProcessing (single
// sequence), ByteLevel, RobertaProcessing, BertProcessing and Sequence;
// decoders ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip and
// Sequence. Anything else is Unimplemented, naming the component and the
// file. Regexes written for Oniguruma run on RE2 (tokenizer/internal/regex.h).
//
// A Tokenizer is immutable after loading and cheap to copy (it shares its
// tables); every const method may be called from many threads at once.
// Torch-free: target accel_tokenizer.
#ifndef ACCEL_TOKENIZER_TOKENIZER_H_
#define ACCEL_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace accel::tokenizer {

namespace internal {
class TokenizerImpl;
}

// Whether `text` is well-formed UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing past U+10FFFF), as protobuf and HF tokenizers require.
bool IsValidUtf8(absl::string_view text);

class Tokenizer {
 public:
  // Reads tokenizer.json. NotFound for a missing file; InvalidArgument for
  // malformed JSON or fields (naming the file and the JSON path);
  // Unimplemented for a component type this tokenizer does not have.
  static absl::StatusOr<Tokenizer> FromFile(const std::string& path);
  // The same from text; `source_name` stands for the file in messages.
  static absl::StatusOr<Tokenizer> FromJson(absl::string_view json, absl::string_view source_name);

  // The ids of `text`; add_special_tokens applies the post-processor (BOS
  // and the like). InvalidArgument when `text` is not valid UTF-8.
  absl::StatusOr<std::vector<int64_t>> Encode(absl::string_view text,
                                              bool add_special_tokens) const;
  // The text of `ids` (invalid UTF-8 becomes U+FFFD as HF does). InvalidArgument
  // naming the id when one is outside [0, vocab_size()).
  absl::StatusOr<std::string> Decode(absl::Span<const int64_t> ids, bool skip_special_tokens) const;

  // The bytes token `id` adds to a text it is in the middle of: raw bytes
  // (a byte-level token may hold part of a UTF-8 character), a
  // SentencePiece token's leading space included; an added token's content.
  // What a grammar matches tokens by (grammar/matcher.h). InvalidArgument
  // for an id outside [0, vocab_size()).
  absl::StatusOr<std::string> TokenBytes(int64_t id) const;
  std::optional<int64_t> TokenToId(absl::string_view token) const;
  std::optional<std::string> IdToToken(int64_t id) const;
  // Largest id of the vocabulary or the added tokens, plus one.
  int64_t vocab_size() const;
  // Whether `id` is a special added token (what skip_special_tokens drops).
  bool IsSpecial(int64_t id) const;

 private:
  friend class IncrementalDecoder;
  explicit Tokenizer(std::shared_ptr<const internal::TokenizerImpl> impl);
  std::shared_ptr<const internal::TokenizerImpl> impl_;
};

// Turns a stream of ids into text as it arrives. Every piece Next() returns is
// valid UTF-8, and the pieces followed by Flush() are exactly
// Decode(all ids). It decodes a window of recent ids and returns what the
// newest ids added to it (transformers' prefix_offset / read_offset scheme),
// holding text back while it ends in U+FFFD (an incomplete character) or in a
// byte-fallback token whose run may still grow. While the text keeps ending
// in U+FFFD (a model emitting stray bytes) the window grows, and each Next()
// costs time in its length, as in transformers. One per stream; not
// thread-safe; keeps its own reference to the tokenizer.
class IncrementalDecoder {
 public:
  IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens);

  // The text that `id` completes, possibly empty. InvalidArgument for an id
  // outside [0, vocab_size()) (the id is then not part of the stream).
  absl::StatusOr<std::string> Next(int64_t id);
  // Everything not returned yet; the decoder then starts a new, empty stream.
  std::string Flush();

 private:
  std::shared_ptr<const internal::TokenizerImpl> impl_;
  bool skip_special_tokens_;
  std::vector<int64_t> ids_;
  size_t prefix_offset_ = 0;
  size_t read_offset_ = 0;
  bool last_kept_is_byte_ = false;
  std::string emitted_;  // everything returned so far, to check Flush against
};

}  // namespace accel::tokenizer

#endif  // ACCEL_TOKENIZER_TOKENIZER_H_
