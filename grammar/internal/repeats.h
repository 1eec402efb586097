// The repetitions that compose into one of their own kind, shared by the GBNF
// parser (grammar.cc) and the regex translator (regex.cc): a run of *, +, ?
// (and {0,}, {1,}, {0,1}, {1}) over one atom is one repetition of it ((x+)+
// is x+, (x?)+ and (x+)? are x*), not a rule a level.
#ifndef ACCEL_GRAMMAR_INTERNAL_REPEATS_H_
#define ACCEL_GRAMMAR_INTERNAL_REPEATS_H_

#include <utility>

namespace accel::grammar::internal {

// {min, max} (max < 0: unbounded) is {0,1} (?), {0,} (*), {1,} (+) or {1}.
inline bool IsSimpleRepeat(int min, int max) {
  return (min == 0 || min == 1) && (max == 1 || max < 0);
}

// `outer` applied to `inner` repeated, both simple: at least 0 times if
// either may be absent, unbounded if either is.
inline std::pair<int, int> ComposeRepeats(std::pair<int, int> inner, std::pair<int, int> outer) {
  return {inner.first * outer.first, inner.second < 0 || outer.second < 0 ? -1 : 1};
}

}  // namespace accel::grammar::internal

#endif  // ACCEL_GRAMMAR_INTERNAL_REPEATS_H_
