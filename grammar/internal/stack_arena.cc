#include "grammar/internal/stack_arena.h"

#include <algorithm>

namespace accel::grammar::internal {
namespace {

void SortUnique(std::vector<int32_t>* v) {
  std::sort(v->begin(), v->end());
  v->erase(std::unique(v->begin(), v->end()), v->end());
}

}  // namespace

StackArena::StackArena(const GrammarData* grammar) : grammar_(grammar) {
  nodes_.push_back({-1, -1});  // kAccept
  for (int32_t start : grammar_->alternatives[grammar_->root]) {
    Closure(MakeNode(start, -1), &initial_);
  }
  SortUnique(&initial_);
}

int32_t StackArena::MakeNode(int32_t pos, int32_t parent) {
  const uint64_t key =
      (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 32) | static_cast<uint32_t>(parent + 1);
  auto [it, inserted] = node_ids_.try_emplace(key, static_cast<int32_t>(nodes_.size()));
  if (inserted) nodes_.push_back({pos, parent});
  return it->second;
}

void StackArena::Closure(int32_t node, std::vector<int32_t>* out) {
  // Iterative, with the nodes seen in this closure skipped: a grammar
  // without left recursion reaches each (position, parent) pair once.
  // The seen marks are this call's stamp in a table by node id (a search of
  // a list of the seen nodes made a closure quadratic in its size: a regex
  // of 90 nested repetitions, `((1+)+)+...`, took seconds a byte).
  if (++closure_stamp_ == 0) {
    std::fill(seen_.begin(), seen_.end(), 0);
    closure_stamp_ = 1;
  }
  std::vector<int32_t> work = {node};
  while (!work.empty()) {
    const int32_t n = work.back();
    work.pop_back();
    if (static_cast<size_t>(n) >= seen_.size()) {
      seen_.resize(std::max(nodes_.size(), 2 * seen_.size()), 0);
    }
    if (seen_[n] == closure_stamp_) continue;
    seen_[n] = closure_stamp_;
    const Node current = nodes_[n];
    const Element& e = grammar_->elements[current.pos];
    switch (e.kind) {
      case Element::kByte:
        out->push_back(n);
        break;
      case Element::kEnd:
        if (current.parent < 0) {
          out->push_back(kAccept);
        } else {
          work.push_back(current.parent);
        }
        break;
      case Element::kRule: {
        // A rule called last in its alternative returns straight to the
        // caller's parent (a tail call): `star ::= x star` then keeps one
        // stack however often it repeats, so its states repeat and hit the
        // mask cache.
        const bool tail = grammar_->elements[current.pos + 1].kind == Element::kEnd;
        const int32_t next = tail ? current.parent : MakeNode(current.pos + 1, current.parent);
        for (int32_t start : grammar_->alternatives[e.rule]) {
          work.push_back(MakeNode(start, next));
        }
        break;
      }
    }
  }
}

void StackArena::StepNode(int32_t node, uint8_t byte, const int32_t** begin, const int32_t** end) {
  const uint64_t key = (static_cast<uint64_t>(node) << 8) | byte;
  auto it = step_memo_.find(key);
  if (it == step_memo_.end()) {
    scratch_.clear();
    if (node != kAccept) {
      const Node current = nodes_[node];
      const Element& e = grammar_->elements[current.pos];
      if (e.kind == Element::kByte && byte >= e.lo && byte <= e.hi) {
        Closure(MakeNode(current.pos + 1, current.parent), &scratch_);
        SortUnique(&scratch_);
      }
    }
    const auto offset = static_cast<uint32_t>(step_results_.size());
    step_results_.insert(step_results_.end(), scratch_.begin(), scratch_.end());
    it = step_memo_.emplace(key, std::make_pair(offset, static_cast<uint32_t>(scratch_.size())))
             .first;
  }
  *begin = step_results_.data() + it->second.first;
  *end = *begin + it->second.second;
}

void StackArena::Step(const State& state, uint8_t byte, State* out) {
  out->clear();
  int matched = 0;
  for (int32_t node : state) {
    // Most stacks refuse the byte by their top element's range: checked
    // before the memo's hash lookup (a trie walk makes millions of steps).
    if (node == kAccept) continue;
    const Element& e = grammar_->elements[nodes_[node].pos];
    if (byte < e.lo || byte > e.hi) continue;
    const int32_t* begin;
    const int32_t* end;
    StepNode(node, byte, &begin, &end);
    if (begin == end) continue;
    out->insert(out->end(), begin, end);
    ++matched;
  }
  if (matched > 1) SortUnique(out);
  // A grammar so ambiguous that this many parses are alive at once (say
  // `(x?){500}`) would cost each byte time in the square of that: the text
  // is refused there instead (documented in grammar.h).
  if (out->size() > kMaxStacks) {
    out->clear();
    ++overflows_;
  }
}

int64_t StackArena::memory_bytes() const {
  return static_cast<int64_t>(nodes_.capacity() * sizeof(Node) +
                              node_ids_.capacity() * (sizeof(uint64_t) + sizeof(int32_t) + 1) +
                              step_memo_.capacity() * (sizeof(uint64_t) + 9) +
                              step_results_.capacity() * sizeof(int32_t) +
                              seen_.capacity() * sizeof(uint32_t));
}

}  // namespace accel::grammar::internal
