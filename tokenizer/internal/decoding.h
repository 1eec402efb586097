// Decoders and post-processors of tokenizer.json, as HuggingFace tokenizers
// applies them: a decoder rewrites the list of token strings (decode_chain)
// and the results are joined; a post-processor adds special tokens around the
// ids of one sequence when add_special_tokens is set.
#ifndef ACCEL_TOKENIZER_INTERNAL_DECODING_H_
#define ACCEL_TOKENIZER_INTERNAL_DECODING_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "tokenizer/internal/json.h"

namespace accel::tokenizer::internal {

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void DecodeChain(std::vector<std::string>* tokens) const = 0;
  // The same without the lossy steps (invalid UTF-8 to U+FFFD): the raw
  // bytes, for a grammar matching tokens byte by byte.
  virtual void DecodeChainBytes(std::vector<std::string>* tokens) const { DecodeChain(tokens); }
  // Whether a trailing token can still change with the tokens after it: the
  // ByteFallback decoder decodes a run of <0xNN> tokens as one group.
  virtual bool GroupsByteTokens() const { return false; }
};

// HF's ByteFallback test: "<0xNN>" with a hexadecimal NN (u8::from_str_radix).
std::optional<unsigned char> ByteFallbackValue(absl::string_view token);

absl::StatusOr<std::unique_ptr<Decoder>> ParseDecoder(const JsonReader& reader, const Json& value,
                                                      const std::string& path);

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Called only with add_special_tokens.
  virtual void Process(std::vector<int64_t>* ids) const = 0;
};

absl::StatusOr<std::unique_ptr<PostProcessor>> ParsePostProcessor(const JsonReader& reader,
                                                                  const Json& value,
                                                                  const std::string& path);

}  // namespace accel::tokenizer::internal

#endif  // ACCEL_TOKENIZER_INTERNAL_DECODING_H_
