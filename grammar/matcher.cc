#include "grammar/matcher.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"

#include "grammar/internal/stack_arena.h"

namespace accel::grammar {
namespace internal {

struct CompiledGrammarState {
  CompiledGrammarState(const GrammarData* grammar, int64_t max_dfa_states)
      : arena(grammar), max_dfa_states(max_dfa_states) {}
  std::mutex mu;
  StackArena arena;
  // state -> the grammar's part of its mask (stop tokens not included).
  absl::flat_hash_map<State, std::shared_ptr<const std::vector<uint64_t>>, absl::Hash<State>> masks;
  int64_t mask_bytes = 0;
  int64_t walks = 0;
  int64_t hits = 0;

  // A lazily built DFA over the arena's states, for the trie walk: a state
  // (a set of stacks) gets an id the first time it is met, and each (id,
  // byte) its successor's id, so a trie node costs one table load instead
  // of a hash lookup per stack. The walk of a state never seen before then
  // mostly runs on transitions other walks filled (inside a string, position
  // k+1's transitions are position k's shifted by one). Ids live only
  // between walks: the table starts over when it outgrows max_dfa_states.
  static constexpr int32_t kUnknown = -2;
  static constexpr int32_t kDead = -1;
  const int64_t max_dfa_states;
  absl::flat_hash_map<State, int32_t, absl::Hash<State>> dfa_ids;
  std::vector<State> dfa_states;
  std::vector<int32_t> dfa_next;  // id * 256 + byte -> id, kDead or kUnknown
  std::vector<int32_t> by_depth;  // the trie walk's state ids, one per depth
  State scratch;

  int32_t Intern(const State& state) {
    auto [it, inserted] = dfa_ids.try_emplace(state, static_cast<int32_t>(dfa_states.size()));
    if (inserted) {
      dfa_states.push_back(state);
      dfa_next.resize(dfa_next.size() + 256, kUnknown);
    }
    return it->second;
  }
  int32_t Next(int32_t id, uint8_t byte) {
    const size_t slot = static_cast<size_t>(id) * 256 + byte;
    if (dfa_next[slot] != kUnknown) return dfa_next[slot];
    arena.Step(dfa_states[id], byte, &scratch);
    const int32_t next = scratch.empty() ? kDead : Intern(scratch);
    dfa_next[slot] = next;
    return next;
  }
  void ClearDfa() {
    dfa_ids.clear();
    dfa_states.clear();
    dfa_next.clear();
  }
  // Set the bit of every token `state` allows (the grammar's part). The DFA
  // walk returns false, with `out` partly filled, when the table outgrows
  // twice its limit; the plain walk steps the arena's stacks at each node.
  bool WalkTrieDfa(const TokenVocabulary& vocab, const State& state, uint64_t* out);
  void WalkTriePlain(const TokenVocabulary& vocab, const State& state, uint64_t* out);
};

bool CompiledGrammarState::WalkTrieDfa(const TokenVocabulary& vocab, const State& state,
                                       uint64_t* out) {
  by_depth.resize(static_cast<size_t>(vocab.max_depth_) + 1);
  by_depth[0] = Intern(state);
  const auto nodes = static_cast<int32_t>(vocab.byte_.size());
  const int32_t* depth = vocab.depth_.data();
  const uint8_t* byte = vocab.byte_.data();
  const int32_t* tokens_begin = vocab.tokens_begin_.data();
  const int32_t* tokens_end = vocab.tokens_end_.data();
  const int32_t* tokens = vocab.tokens_.data();
  for (int32_t i = 1; i < nodes;) {
    const int32_t d = depth[i];
    const int32_t next = Next(by_depth[d - 1], byte[i]);
    if (next == kDead) {
      i = vocab.subtree_end_[i];
      continue;
    }
    by_depth[d] = next;
    for (int32_t t = tokens_begin[i]; t < tokens_end[i]; ++t) {
      const int32_t id = tokens[t];
      out[id >> 6] |= uint64_t{1} << (id & 63);
    }
    ++i;
    if (static_cast<int64_t>(dfa_states.size()) > 2 * max_dfa_states) return false;
  }
  return true;
}

void CompiledGrammarState::WalkTriePlain(const TokenVocabulary& vocab, const State& state,
                                         uint64_t* out) {
  std::vector<State> states(static_cast<size_t>(vocab.max_depth_) + 1);
  states[0] = state;
  const auto nodes = static_cast<int32_t>(vocab.byte_.size());
  for (int32_t i = 1; i < nodes;) {
    const int32_t d = vocab.depth_[i];
    State& here = states[d];
    arena.Step(states[d - 1], vocab.byte_[i], &here);
    if (here.empty()) {
      i = vocab.subtree_end_[i];
      continue;
    }
    for (int32_t t = vocab.tokens_begin_[i]; t < vocab.tokens_end_[i]; ++t) {
      const int32_t id = vocab.tokens_[t];
      out[id >> 6] |= uint64_t{1} << (id & 63);
    }
    ++i;
  }
}

}  // namespace internal

namespace {
// The cached masks of one compiled grammar, at most (then the cache starts over).
constexpr int64_t kMaxMaskCacheBytes = int64_t{256} << 20;
}  // namespace

std::shared_ptr<const TokenVocabulary> TokenVocabulary::Create(std::vector<std::string> token_bytes,
                                                               std::vector<bool> special) {
  auto vocab = std::shared_ptr<TokenVocabulary>(new TokenVocabulary());
  special.resize(token_bytes.size(), false);
  std::vector<int32_t> order;
  for (size_t i = 0; i < token_bytes.size(); ++i) {
    if (!special[i] && !token_bytes[i].empty()) order.push_back(static_cast<int32_t>(i));
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const int c = token_bytes[a].compare(token_bytes[b]);
    return c != 0 ? c < 0 : a < b;
  });
  // Sorted strings give the trie in preorder: a node is made at its first
  // visit, and the token equal to its path comes before any extending it.
  vocab->byte_.push_back(0);
  vocab->depth_.push_back(0);
  vocab->subtree_end_.push_back(0);
  vocab->tokens_begin_.push_back(0);
  vocab->tokens_end_.push_back(0);
  std::vector<int32_t> path = {0};  // node at each depth of the current string
  const std::string* previous = nullptr;
  for (int32_t id : order) {
    const std::string& s = token_bytes[id];
    size_t common = 0;
    if (previous != nullptr) {
      while (common < s.size() && common < previous->size() && s[common] == (*previous)[common] &&
             common + 1 < path.size()) {
        ++common;
      }
    }
    // Close the nodes deeper than the common prefix.
    while (path.size() > common + 1) {
      vocab->subtree_end_[path.back()] = static_cast<int32_t>(vocab->byte_.size());
      path.pop_back();
    }
    for (size_t d = common; d < s.size(); ++d) {
      const auto node = static_cast<int32_t>(vocab->byte_.size());
      vocab->byte_.push_back(static_cast<uint8_t>(s[d]));
      vocab->depth_.push_back(static_cast<int32_t>(d + 1));
      vocab->subtree_end_.push_back(0);
      vocab->tokens_begin_.push_back(static_cast<int32_t>(vocab->tokens_.size()));
      vocab->tokens_end_.push_back(static_cast<int32_t>(vocab->tokens_.size()));
      path.push_back(node);
    }
    vocab->tokens_.push_back(id);
    vocab->tokens_end_[path.back()] = static_cast<int32_t>(vocab->tokens_.size());
    vocab->max_depth_ = std::max(vocab->max_depth_, static_cast<int32_t>(s.size()));
    previous = &s;
  }
  while (!path.empty()) {
    vocab->subtree_end_[path.back()] = static_cast<int32_t>(vocab->byte_.size());
    path.pop_back();
  }
  vocab->token_bytes_ = std::move(token_bytes);
  vocab->special_ = std::move(special);
  return vocab;
}

CompiledGrammar::CompiledGrammar(std::shared_ptr<const Grammar> grammar,
                                 std::shared_ptr<const TokenVocabulary> vocabulary,
                                 const Options& options)
    : grammar_(std::move(grammar)),
      vocabulary_(std::move(vocabulary)),
      state_(std::make_unique<internal::CompiledGrammarState>(&grammar_->data(),
                                                              options.max_dfa_states)) {}

CompiledGrammar::~CompiledGrammar() = default;

std::shared_ptr<CompiledGrammar> CompiledGrammar::Create(
    std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenVocabulary> vocabulary,
    const Options& options) {
  return std::shared_ptr<CompiledGrammar>(
      new CompiledGrammar(std::move(grammar), std::move(vocabulary), options));
}

int64_t CompiledGrammar::dfa_states() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return static_cast<int64_t>(state_->dfa_states.size());
}

int64_t CompiledGrammar::mask_walks() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->walks;
}

int64_t CompiledGrammar::mask_cache_hits() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->hits;
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<CompiledGrammar> compiled,
                               std::vector<int64_t> stop_token_ids)
    : compiled_(std::move(compiled)), stop_token_ids_(std::move(stop_token_ids)) {
  history_.push_back(compiled_->state_->arena.initial());
  terminated_.push_back(false);
}

int64_t GrammarMatcher::mask_words() const { return compiled_->vocabulary_->mask_words(); }

bool GrammarMatcher::CanEnd() const { return internal::StackArena::CanEnd(history_.back()); }

bool GrammarMatcher::AcceptToken(int64_t id) {
  if (IsTerminated()) return false;
  const TokenVocabulary& vocab = *compiled_->vocabulary_;
  if (std::find(stop_token_ids_.begin(), stop_token_ids_.end(), id) != stop_token_ids_.end()) {
    if (!CanEnd()) {
      // Also where nothing else is allowed (the mask's fallback).
      std::vector<uint64_t> mask(static_cast<size_t>(vocab.mask_words()));
      const int64_t allowed = FillNextTokenBitmask(mask.data());
      int64_t stops = 0;
      for (int64_t s : stop_token_ids_) {
        stops += s >= 0 && s < vocab.size() && (mask[s >> 6] >> (s & 63) & 1);
      }
      if (allowed != stops) return false;
    }
    history_.push_back(history_.back());
    terminated_.push_back(true);
    return true;
  }
  if (id < 0 || id >= vocab.size() || vocab.special(id) || vocab.token_bytes(id).empty()) {
    return false;
  }
  internal::State state = history_.back();
  internal::State next;
  {
    std::lock_guard<std::mutex> lock(compiled_->state_->mu);
    for (unsigned char b : vocab.token_bytes(id)) {
      compiled_->state_->arena.Step(state, b, &next);
      if (next.empty()) return false;
      state.swap(next);
    }
  }
  history_.push_back(std::move(state));
  terminated_.push_back(false);
  return true;
}

bool GrammarMatcher::AcceptBytes(absl::string_view bytes) {
  if (IsTerminated()) return false;
  internal::State state = history_.back();
  internal::State next;
  {
    std::lock_guard<std::mutex> lock(compiled_->state_->mu);
    for (unsigned char b : bytes) {
      compiled_->state_->arena.Step(state, b, &next);
      if (next.empty()) return false;
      state.swap(next);
    }
  }
  history_.back() = std::move(state);
  return true;
}

void GrammarMatcher::Rollback(int64_t num_tokens) {
  num_tokens = std::min(num_tokens, this->num_tokens());
  for (int64_t i = 0; i < num_tokens; ++i) {
    history_.pop_back();
    terminated_.pop_back();
  }
}

int64_t GrammarMatcher::FillNextTokenBitmask(uint64_t* mask) {
  const TokenVocabulary& vocab = *compiled_->vocabulary_;
  const int64_t words = vocab.mask_words();
  std::memset(mask, 0, static_cast<size_t>(words) * sizeof(uint64_t));
  int64_t allowed = 0;
  if (!IsTerminated()) {
    internal::CompiledGrammarState& shared = *compiled_->state_;
    std::shared_ptr<const std::vector<uint64_t>> grammar_mask;
    const internal::State& state = history_.back();
    {
      std::lock_guard<std::mutex> lock(shared.mu);
      auto it = shared.masks.find(state);
      if (it != shared.masks.end()) {
        grammar_mask = it->second;
        ++shared.hits;
      } else {
        ++shared.walks;
        auto bits = std::make_shared<std::vector<uint64_t>>(words, 0);
        if (static_cast<int64_t>(shared.dfa_states.size()) > shared.max_dfa_states) {
          shared.ClearDfa();
        }
        if (!shared.WalkTrieDfa(vocab, state, bits->data())) {
          // One walk met more new states than the table may hold (a grammar
          // with very many parses alive): this state's mask the plain way.
          shared.ClearDfa();
          std::fill(bits->begin(), bits->end(), 0);
          shared.WalkTriePlain(vocab, state, bits->data());
        }
        const auto bytes = static_cast<int64_t>(words * sizeof(uint64_t));
        if (shared.mask_bytes + bytes > kMaxMaskCacheBytes) {
          shared.masks.clear();
          shared.mask_bytes = 0;
        }
        shared.masks.emplace(state, bits);
        shared.mask_bytes += bytes;
        grammar_mask = std::move(bits);
      }
    }
    for (int64_t w = 0; w < words; ++w) {
      mask[w] = (*grammar_mask)[w];
      allowed += __builtin_popcountll(mask[w]);
    }
  }
  if (CanEnd() || allowed == 0) {
    for (int64_t id : stop_token_ids_) {
      if (id < 0 || id >= vocab.size()) continue;
      if (!(mask[id >> 6] & (uint64_t{1} << (id & 63)))) {
        mask[id >> 6] |= uint64_t{1} << (id & 63);
        ++allowed;
      }
    }
  }
  return allowed;
}

}  // namespace accel::grammar
