// The compiled form of a grammar: every rule's alternatives laid out in one
// flat array of elements, each alternative ended by kEnd. A position in the
// grammar is an index into `elements`; the matcher's stacks are chains of
// such positions (grammar/internal/stack_arena.h).
#ifndef ACCEL_GRAMMAR_INTERNAL_GRAMMAR_DATA_H_
#define ACCEL_GRAMMAR_INTERNAL_GRAMMAR_DATA_H_

#include <cstdint>
#include <string>
#include <vector>

namespace accel::grammar::internal {

struct Element {
  enum Kind : uint8_t { kByte, kRule, kEnd };
  Kind kind = kEnd;
  uint8_t lo = 0;  // kByte: the accepted bytes, [lo, hi]
  uint8_t hi = 0;
  int32_t rule = 0;  // kRule: the rule it expands
};

struct GrammarData {
  std::vector<Element> elements;
  // rule -> the position of each alternative's first element.
  std::vector<std::vector<int32_t>> alternatives;
  std::vector<std::string> rule_names;
  int32_t root = 0;
};

}  // namespace accel::grammar::internal

#endif  // ACCEL_GRAMMAR_INTERNAL_GRAMMAR_DATA_H_
