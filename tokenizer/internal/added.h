// Added tokens (tokenizer.json's "added_tokens"), split out of the text as
// HuggingFace's AddedVocabulary does: leftmost-longest matching, single_word
// (no word character on either side), lstrip / rstrip (the token swallows
// the whitespace next to it). Tokens with normalized false are matched in the
// raw text, the others in the normalized pieces, against their normalized
// content.
#ifndef ACCEL_TOKENIZER_INTERNAL_ADDED_H_
#define ACCEL_TOKENIZER_INTERNAL_ADDED_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"

#include "tokenizer/internal/pipeline.h"

namespace accel::tokenizer::internal {

struct AddedToken {
  int64_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// Leftmost-longest matching of a set of strings (a byte trie; what HF's
// aho-corasick automaton with MatchKind::LeftmostLongest finds).
class TokenMatcher {
 public:
  // `patterns[i]` is reported as i; an empty pattern is ignored, a repeated
  // one keeps its first index.
  void Build(const std::vector<std::string>& patterns);
  bool empty() const { return nodes_.size() <= 1; }
  // The leftmost-longest match starting at or after `from`: true with
  // [*start, *end) and the pattern index.
  bool Find(absl::string_view text, size_t from, size_t* start, size_t* end, int* pattern) const;

 private:
  struct Node {
    int pattern = -1;
  };
  int Child(int node, unsigned char byte) const;
  std::vector<Node> nodes_;
  absl::flat_hash_map<uint64_t, int> edges_;  // (node << 8 | byte) -> child
  bool first_byte_[256] = {};
};

class AddedVocabulary {
 public:
  // `tokens` in HF's matching order (special ones first). `normalizer` (may
  // be null) gives the content that tokens with normalized true match.
  AddedVocabulary(std::vector<AddedToken> tokens, const Normalizer* normalizer);

  // Splits every non-token piece at the tokens found in it (HF's
  // split_with_indices): `normalized` picks the set to look for.
  void Split(std::vector<Piece>* pieces, bool normalized) const;

 private:
  void SplitPiece(Piece&& piece, const TokenMatcher& matcher, const std::vector<int>& index,
                  std::vector<Piece>* out) const;

  std::vector<AddedToken> tokens_;
  TokenMatcher raw_matcher_;
  std::vector<int> raw_index_;  // matcher pattern -> tokens_ index
  TokenMatcher normalized_matcher_;
  std::vector<int> normalized_index_;
};

}  // namespace accel::tokenizer::internal

#endif  // ACCEL_TOKENIZER_INTERNAL_ADDED_H_
