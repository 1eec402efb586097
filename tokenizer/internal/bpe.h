// The BPE model of tokenizer.json, as HuggingFace tokenizers' models::bpe
// (without dropout): vocab, ranked merges, unk_token / fuse_unk,
// byte_fallback, ignore_merges, continuing_subword_prefix,
// end_of_word_suffix. Words are merged with a priority queue over a linked
// list of symbols (lowest rank first, then leftmost), exactly as HF does, and
// cached per word in a bounded, mutex-guarded cache.
#ifndef ACCEL_TOKENIZER_INTERNAL_BPE_H_
#define ACCEL_TOKENIZER_INTERNAL_BPE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "tokenizer/internal/json.h"

namespace accel::tokenizer::internal {

// Ids above this are refused: a vocabulary is a dense table of that size.
inline constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

class BpeModel {
 public:
  // `value` is tokenizer.json's "model".
  static absl::StatusOr<std::unique_ptr<BpeModel>> Parse(const JsonReader& reader,
                                                         const Json& value,
                                                         const std::string& path);
  ~BpeModel();

  // Appends the ids of one pre-tokenized word. Fails only when unk_token is
  // needed and missing from the vocabulary (as HF does).
  absl::Status Tokenize(absl::string_view word, std::vector<int64_t>* ids) const;

  std::optional<int64_t> TokenToId(absl::string_view token) const;
  // Null for an id the vocabulary does not have.
  const std::string* IdToToken(int64_t id) const;
  // The largest id in the vocabulary, -1 when empty.
  int64_t max_id() const { return static_cast<int64_t>(id_to_token_.size()) - 1; }
  // The number of entries in the vocabulary (HF's get_vocab_size).
  int64_t num_tokens() const { return static_cast<int64_t>(vocab_.size()); }

 private:
  struct MergeInfo {
    uint32_t rank;
    int32_t new_id;
  };
  class Cache;

  BpeModel();
  absl::Status MergeWord(absl::string_view word, std::vector<int32_t>* ids) const;
  void MergeAll(std::vector<int32_t>* ids, const std::vector<uint32_t>& lens) const;
  const MergeInfo* FindMerge(int32_t a, int32_t b) const;

  absl::flat_hash_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_id_;
  absl::flat_hash_map<uint64_t, MergeInfo> merges_;
  // Single-character tokens by code point: the common case needs no string.
  absl::flat_hash_map<char32_t, int32_t> char_ids_;
  std::array<int32_t, 256> byte_ids_{};  // <0xNN> tokens, -1 when absent
  std::optional<std::string> unk_token_;
  std::string prefix_;  // continuing_subword_prefix ("" when none)
  std::string suffix_;  // end_of_word_suffix ("" when none)
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::unique_ptr<Cache> cache_;
};

}  // namespace accel::tokenizer::internal

#endif  // ACCEL_TOKENIZER_INTERNAL_BPE_H_
