// The pushdown automaton behind every matcher. A parse stack is a chain of
// nodes (a grammar position, the node to return to when its rule ends); nodes
// are hash-consed, so equal stacks are the same node id and a matcher's state
// (the set of stacks it may be in) is a sorted vector of ids. A state's
// stacks all have a byte element on top (or are kAccept: the grammar may end
// there). The arena only grows, so every state ever returned stays valid:
// rollback is keeping an old state. Step(node, byte) is memoized: after the
// first time, a byte costs one hash lookup per stack.
//
// Not thread-safe: the owner (grammar/matcher.cc's runtime) locks.
#ifndef ACCEL_GRAMMAR_INTERNAL_STACK_ARENA_H_
#define ACCEL_GRAMMAR_INTERNAL_STACK_ARENA_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"

#include "grammar/internal/grammar_data.h"

namespace accel::grammar::internal {

using State = std::vector<int32_t>;  // sorted node ids

class StackArena {
 public:
  static constexpr int32_t kAccept = 0;  // the node "the grammar may end here"
  // The most stacks a state may hold (parses alive at once).
  static constexpr size_t kMaxStacks = 128;

  explicit StackArena(const GrammarData* grammar);

  // The stacks before the first byte.
  const State& initial() const { return initial_; }
  // The state after `byte` from `state` (empty: the byte is not allowed).
  void Step(const State& state, uint8_t byte, State* out);
  // The stacks `byte` leads to from the one stack `node` (memoized).
  // Returns a span into an internal buffer: valid until the next call.
  void StepNode(int32_t node, uint8_t byte, const int32_t** begin, const int32_t** end);
  static bool CanEnd(const State& state) { return !state.empty() && state.front() == kAccept; }
  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size()); }
  int64_t memory_bytes() const;
  // Steps refused for holding more than kMaxStacks stacks.
  int64_t overflows() const { return overflows_; }

 private:
  struct Node {
    int32_t pos;
    int32_t parent;  // -1: the root's end
  };
  int32_t MakeNode(int32_t pos, int32_t parent);
  // Adds the byte-topped stacks (and kAccept) reachable from `node` without
  // reading a byte.
  void Closure(int32_t node, std::vector<int32_t>* out);

  const GrammarData* grammar_;
  std::vector<Node> nodes_;
  absl::flat_hash_map<uint64_t, int32_t> node_ids_;
  // (node << 8 | byte) -> [offset, offset + length) in step_results_.
  absl::flat_hash_map<uint64_t, std::pair<uint32_t, uint32_t>> step_memo_;
  std::vector<int32_t> step_results_;
  State initial_;
  std::vector<int32_t> scratch_;
  // Closure's seen marks: node n was seen in this call if seen_[n] is
  // closure_stamp_ (a new stamp a call, so nothing is cleared).
  std::vector<uint32_t> seen_;
  uint32_t closure_stamp_ = 0;
  int64_t overflows_ = 0;
};

}  // namespace accel::grammar::internal

#endif  // ACCEL_GRAMMAR_INTERNAL_STACK_ARENA_H_
