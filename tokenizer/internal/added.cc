#include "tokenizer/internal/added.h"

#include <algorithm>
#include <utility>

#include "tokenizer/internal/unicode.h"

namespace accel::tokenizer::internal {
namespace {

// Start of the whitespace run that ends `text` (Rust regex `\s*$`).
size_t TrailingSpaceStart(absl::string_view text) {
  size_t start = text.size();
  while (start > 0) {
    size_t c = start - 1;
    while (c > 0 && (static_cast<unsigned char>(text[c]) & 0xC0) == 0x80) --c;
    size_t probe = c;
    if (!IsWhitespace(NextChar(text, &probe))) break;
    start = c;
  }
  return start;
}

// Length of the whitespace run that starts `text` (Rust regex `^\s*`).
size_t LeadingSpaceLength(absl::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t next = pos;
    if (!IsWhitespace(NextChar(text, &next))) break;
    pos = next;
  }
  return pos;
}

}  // namespace

void TokenMatcher::Build(const std::vector<std::string>& patterns) {
  nodes_.assign(1, Node{});
  edges_.clear();
  std::fill(std::begin(first_byte_), std::end(first_byte_), false);
  for (size_t i = 0; i < patterns.size(); ++i) {
    const std::string& p = patterns[i];
    if (p.empty()) continue;
    first_byte_[static_cast<unsigned char>(p[0])] = true;
    int node = 0;
    for (char ch : p) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(ch);
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        nodes_.push_back(Node{});
        it = edges_.emplace(key, static_cast<int>(nodes_.size()) - 1).first;
      }
      node = it->second;
    }
    if (nodes_[node].pattern < 0) nodes_[node].pattern = static_cast<int>(i);
  }
}

int TokenMatcher::Child(int node, unsigned char byte) const {
  auto it = edges_.find((static_cast<uint64_t>(node) << 8) | byte);
  return it == edges_.end() ? -1 : it->second;
}

bool TokenMatcher::Find(absl::string_view text, size_t from, size_t* start, size_t* end,
                        int* pattern) const {
  if (empty()) return false;
  for (size_t i = from; i < text.size(); ++i) {
    if (!first_byte_[static_cast<unsigned char>(text[i])]) continue;
    int node = 0;
    int best = -1;
    size_t best_end = 0;
    for (size_t j = i; j < text.size(); ++j) {
      node = Child(node, static_cast<unsigned char>(text[j]));
      if (node < 0) break;
      if (nodes_[node].pattern >= 0) {
        best = nodes_[node].pattern;
        best_end = j + 1;
      }
    }
    if (best >= 0) {
      *start = i;
      *end = best_end;
      *pattern = best;
      return true;
    }
  }
  return false;
}

AddedVocabulary::AddedVocabulary(std::vector<AddedToken> tokens, const Normalizer* normalizer)
    : tokens_(std::move(tokens)) {
  std::vector<std::string> raw;
  std::vector<std::string> normalized;
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const AddedToken& t = tokens_[i];
    if (t.normalized) {
      std::string content = t.content;
      size_t zero_len = 0;
      if (normalizer != nullptr) normalizer->Normalize(&content, &zero_len);
      normalized.push_back(std::move(content));
      normalized_index_.push_back(static_cast<int>(i));
    } else {
      raw.push_back(t.content);
      raw_index_.push_back(static_cast<int>(i));
    }
  }
  raw_matcher_.Build(raw);
  normalized_matcher_.Build(normalized);
}

void AddedVocabulary::Split(std::vector<Piece>* pieces, bool normalized) const {
  const TokenMatcher& matcher = normalized ? normalized_matcher_ : raw_matcher_;
  const std::vector<int>& index = normalized ? normalized_index_ : raw_index_;
  std::vector<Piece> out;
  out.reserve(pieces->size());
  for (Piece& piece : *pieces) {
    if (piece.token >= 0) {
      out.push_back(std::move(piece));
    } else {
      SplitPiece(std::move(piece), matcher, index, &out);
    }
  }
  pieces->swap(out);
}

void AddedVocabulary::SplitPiece(Piece&& piece, const TokenMatcher& matcher,
                                 const std::vector<int>& index, std::vector<Piece>* out) const {
  const absl::string_view text = piece.text;
  if (text.empty()) return;  // HF keeps one empty split, which is then dropped
  size_t start_offset = 0;
  size_t search_from = 0;
  size_t start = 0;
  size_t end = 0;
  int pattern = -1;
  while (matcher.Find(text, search_from, &start, &end, &pattern)) {
    // The automaton goes on after the match as found, whatever happens to it below.
    search_from = end;
    const AddedToken& token = tokens_[index[pattern]];
    if (token.single_word) {
      const bool start_space = start == 0 || !IsWordChar(LastChar(text.substr(0, start)));
      size_t probe = end;
      const bool stop_space = end == text.size() || !IsWordChar(NextChar(text, &probe));
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip) {
      start = std::max(TrailingSpaceStart(text.substr(0, start)), start_offset);
    }
    if (token.rstrip) end += LeadingSpaceLength(text.substr(end));
    if (start_offset < start) out->push_back(SlicePiece(piece, start_offset, start));
    Piece token_piece;
    token_piece.token = token.id;
    out->push_back(std::move(token_piece));
    start_offset = end;
  }
  if (start_offset < text.size()) out->push_back(SlicePiece(piece, start_offset, text.size()));
}

}  // namespace accel::tokenizer::internal
