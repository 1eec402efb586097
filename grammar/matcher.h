// grammar/matcher.h: a grammar against a model's vocabulary, one matcher per
// sequence.
//
//   auto vocab = TokenVocabulary::Create(token_bytes, special);  // once per model
//   auto compiled = CompiledGrammar::Create(grammar, vocab);     // once per grammar
//   GrammarMatcher matcher(compiled, {eos_id});                  // per sequence
//   matcher.FillNextTokenBitmask(mask.data());                   // each step
//   matcher.AcceptToken(sampled);
//
// Tokens are byte strings: a token may end in the middle of a UTF-8
// character or span several grammar symbols; the matcher runs the grammar's
// pushdown automaton (grammar/internal/stack_arena.h) byte by byte. What
// does not depend on the step is computed once and shared by every matcher
// of a CompiledGrammar: the vocabulary's byte trie (walked in preorder, a
// subtree skipped as soon as its prefix is refused), each (stack, byte)
// transition, and the mask of every state met so far (states repeat: inside
// a string, between a number's digits), so a step in a state seen before
// costs one hash lookup and a copy of vocab/8 bytes. A state not seen before
// walks the trie on a lazily built DFA over the parse states (one table load
// per trie node once its transitions are known; each bounded position in a
// string is a new state whose transitions mostly are), about 1-2 ms at a
// 128K vocabulary instead of 16 ms stepping every stack at every node.
//
// Thread-safe: matchers of one CompiledGrammar may run on different threads
// (they share its caches under a lock); one matcher is not.
#ifndef ACCEL_GRAMMAR_MATCHER_H_
#define ACCEL_GRAMMAR_MATCHER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

#include "grammar/grammar.h"

namespace accel::grammar {

namespace internal {
struct CompiledGrammarState;
}

class TokenVocabulary {
 public:
  // token_bytes[i]: the bytes token i adds to the text; special[i] (or an
  // empty token): never allowed by a grammar (stop tokens are handled by the
  // matcher).
  static std::shared_ptr<const TokenVocabulary> Create(std::vector<std::string> token_bytes,
                                                       std::vector<bool> special);
  int64_t size() const { return static_cast<int64_t>(token_bytes_.size()); }
  // 64-bit words of a mask over the vocabulary.
  int64_t mask_words() const { return (size() + 63) / 64; }
  const std::string& token_bytes(int64_t id) const { return token_bytes_[id]; }
  bool special(int64_t id) const { return special_[id]; }
  int64_t num_trie_nodes() const { return static_cast<int64_t>(byte_.size()); }

 private:
  friend class GrammarMatcher;
  friend struct internal::CompiledGrammarState;
  std::vector<std::string> token_bytes_;
  std::vector<bool> special_;
  // The byte trie of the allowed tokens, in preorder; node 0 is the root.
  std::vector<uint8_t> byte_;
  std::vector<int32_t> depth_;
  std::vector<int32_t> subtree_end_;   // one past the node's last descendant
  std::vector<int32_t> tokens_begin_;  // tokens ending at node i: tokens_[begin_[i], end_[i])
  std::vector<int32_t> tokens_end_;
  std::vector<int32_t> tokens_;
  int32_t max_depth_ = 0;
};

// A grammar bound to a vocabulary, with the caches its matchers share.
class CompiledGrammar {
 public:
  struct Options {
    // The states of the DFA that the mask's trie walk runs on (each one
    // 1 KiB of transitions); past it the table starts over.
    int64_t max_dfa_states = 16384;
  };
  static std::shared_ptr<CompiledGrammar> Create(std::shared_ptr<const Grammar> grammar,
                                                 std::shared_ptr<const TokenVocabulary> vocabulary,
                                                 const Options& options);
  static std::shared_ptr<CompiledGrammar> Create(
      std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenVocabulary> vocabulary) {
    return Create(std::move(grammar), std::move(vocabulary), Options());
  }
  ~CompiledGrammar();
  const TokenVocabulary& vocabulary() const { return *vocabulary_; }
  const Grammar& grammar() const { return *grammar_; }
  // Masks computed by walking the trie, and masks found in the cache.
  int64_t mask_walks() const;
  int64_t mask_cache_hits() const;
  // States in the trie walk's DFA now.
  int64_t dfa_states() const;

 private:
  friend class GrammarMatcher;
  CompiledGrammar(std::shared_ptr<const Grammar> grammar,
                  std::shared_ptr<const TokenVocabulary> vocabulary, const Options& options);
  std::shared_ptr<const Grammar> grammar_;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::unique_ptr<internal::CompiledGrammarState> state_;
};

class GrammarMatcher {
 public:
  // `stop_token_ids`: allowed (and accepted) only where the grammar may end.
  GrammarMatcher(std::shared_ptr<CompiledGrammar> compiled, std::vector<int64_t> stop_token_ids);
  GrammarMatcher(const GrammarMatcher&) = default;  // a fork, for speculation
  GrammarMatcher& operator=(const GrammarMatcher&) = default;

  // Advances by one token; false (and nothing changes) when the grammar does
  // not allow it here, or after termination. A stop token is accepted where
  // the grammar may end (or where nothing else is allowed), and terminates
  // the matcher.
  bool AcceptToken(int64_t id);
  // Advances by raw bytes (not counted as a token for Rollback).
  bool AcceptBytes(absl::string_view bytes);
  // Undoes the last `num_tokens` accepted tokens (at most num_tokens()).
  void Rollback(int64_t num_tokens);
  int64_t num_tokens() const { return static_cast<int64_t>(history_.size()) - 1; }
  // Whether the text so far is a whole sentence of the grammar.
  bool CanEnd() const;
  // Whether a stop token was accepted.
  bool IsTerminated() const { return terminated_.back(); }
  // Sets bit i of `mask` (mask_words() words) for each token allowed next:
  // tokens that keep the text inside the grammar, and the stop tokens where
  // it may end. When nothing would be allowed (a grammar the vocabulary
  // cannot spell on), the stop tokens are. Returns how many bits are set.
  int64_t FillNextTokenBitmask(uint64_t* mask);
  int64_t mask_words() const;

 private:
  std::shared_ptr<CompiledGrammar> compiled_;
  std::vector<int64_t> stop_token_ids_;
  // history_[k]: the state after k tokens (and the bytes accepted with them).
  std::vector<std::vector<int32_t>> history_;
  std::vector<bool> terminated_;
};

}  // namespace accel::grammar

#endif  // ACCEL_GRAMMAR_MATCHER_H_
