// The tokenizer behind tokenizer/tokenizer.h: tokenizer.json parsed into its
// components, and encode / decode in HuggingFace's order (added tokens in
// the raw text, normalizer, added tokens in the normalized text,
// pre-tokenizer, model, post-processor; decoding: ids -> tokens, special
// tokens skipped on request, decoder chain, joined).
#ifndef ACCEL_TOKENIZER_INTERNAL_IMPL_H_
#define ACCEL_TOKENIZER_INTERNAL_IMPL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

#include "tokenizer/internal/added.h"
#include "tokenizer/internal/bpe.h"
#include "tokenizer/internal/decoding.h"
#include "tokenizer/internal/pipeline.h"

namespace accel::tokenizer::internal {

// tokenizer.json nests far less than this; deeper text is refused before
// nlohmann's recursive parser could overflow the stack.
inline constexpr int kMaxJsonDepth = 64;
inline constexpr size_t kMaxTokenizerFileBytes = size_t{1} << 30;

class TokenizerImpl {
 public:
  static absl::StatusOr<std::unique_ptr<TokenizerImpl>> FromJson(absl::string_view json,
                                                                 absl::string_view source);

  absl::StatusOr<std::vector<int64_t>> Encode(absl::string_view text,
                                              bool add_special_tokens) const;
  absl::StatusOr<std::string> Decode(absl::Span<const int64_t> ids, bool skip_special_tokens) const;
  absl::StatusOr<std::string> TokenBytes(int64_t id) const;

  // The token string of `id` as decoding sees it (an added token's content
  // first), or null when the id has none.
  const std::string* TokenOf(int64_t id) const;
  std::optional<int64_t> TokenToId(absl::string_view token) const;
  bool IsSpecialContent(absl::string_view token) const { return special_contents_.contains(token); }
  int64_t vocab_size() const { return vocab_size_; }
  // Whether a trailing <0xNN> token may still change the decoded text.
  bool GroupsByteTokens() const { return decoder_ != nullptr && decoder_->GroupsByteTokens(); }

 private:
  TokenizerImpl() = default;

  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<PostProcessor> post_processor_;
  std::unique_ptr<Decoder> decoder_;
  std::unique_ptr<AddedVocabulary> added_;
  absl::flat_hash_map<int64_t, std::string> added_by_id_;
  absl::flat_hash_map<std::string, int64_t> added_by_content_;
  absl::flat_hash_set<std::string> special_contents_;
  int64_t vocab_size_ = 0;
};

}  // namespace accel::tokenizer::internal

#endif  // ACCEL_TOKENIZER_INTERNAL_IMPL_H_
