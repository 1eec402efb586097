// The text side of encoding: normalizers and pre-tokenizers of tokenizer.json,
// applied as HuggingFace tokenizers applies them to its NormalizedString and
// PreTokenizedString.
//
// HF keeps a full byte alignment between normalized and original text. We
// keep only what changes a result: whether a piece starts at offset 0 of the
// input (Metaspace's prepend_scheme "first" asks exactly that), and, for such
// a piece, how many of its leading bytes are aligned to offset 0 (so that a
// later split knows whether its pieces start there too).
#ifndef ACCEL_TOKENIZER_INTERNAL_PIPELINE_H_
#define ACCEL_TOKENIZER_INTERNAL_PIPELINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "tokenizer/internal/json.h"
#include "tokenizer/internal/regex.h"

namespace accel::tokenizer::internal {

struct Piece {
  std::string text;
  int64_t token = -1;      // an added token's id; such a piece is never split or normalized
  bool at_origin = false;  // HF's offsets_original().0 == 0
  size_t zero_len = 0;     // when at_origin: leading bytes aligned to original offset 0
};

// A slice [start, end) of a piece, with HF's offsets rule.
Piece SlicePiece(const Piece& piece, size_t start, size_t end);

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // Normalizes `text` in place; `zero_len` follows the bytes aligned to offset 0.
  virtual void Normalize(std::string* text, size_t* zero_len) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits and rewrites the pieces that are not added tokens; empty pieces are dropped.
  virtual void PreTokenize(std::vector<Piece>* pieces) const = 0;
};

// `value` is tokenizer.json's "normalizer" (at `path`); null gives nullptr.
absl::StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(const JsonReader& reader,
                                                            const Json& value,
                                                            const std::string& path);
// `value` is tokenizer.json's "pre_tokenizer"; null gives nullptr.
absl::StatusOr<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(const JsonReader& reader,
                                                                const Json& value,
                                                                const std::string& path);

}  // namespace accel::tokenizer::internal

#endif  // ACCEL_TOKENIZER_INTERNAL_PIPELINE_H_
