// The matcher against a vocabulary: masks equal a brute-force check of each
// token (a copy of the matcher accepting it), UTF-8 split across tokens,
// tokens spanning grammar symbols, stop tokens only where the grammar may
// end, rollback and forks.
#include "grammar/matcher.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "tests/testing/status_matchers.h"

namespace accel::grammar {
namespace {

using ::accel::test::IsOk;

bool Bit(const std::vector<uint64_t>& mask, int64_t id) { return mask[id >> 6] >> (id & 63) & 1; }

struct Fixture {
  std::shared_ptr<const TokenVocabulary> vocab;
  int64_t stop;
};

Fixture Vocab(std::vector<std::string> tokens) {
  Fixture f;
  f.stop = static_cast<int64_t>(tokens.size());
  tokens.emplace_back("</s>");
  std::vector<bool> special(tokens.size(), false);
  special.back() = true;
  f.vocab = TokenVocabulary::Create(tokens, special);
  return f;
}

int64_t Id(const Fixture& f, const std::string& bytes) {
  for (int64_t i = 0; i < f.vocab->size(); ++i) {
    if (f.vocab->token_bytes(i) == bytes && !f.vocab->special(i)) return i;
  }
  ADD_FAILURE() << "no token " << bytes;
  return -1;
}

std::shared_ptr<const Grammar> Gbnf(const std::string& text) {
  auto g = ParseGbnf(text);
  EXPECT_THAT(g, IsOk());
  return *g;
}

TEST(MatcherTest, Utf8SplitAcrossTokens) {
  const Fixture f = Vocab({"\xC3", "\xA9", "\xC3\xA9", "e", "\xA9x", "x"});
  GrammarMatcher m(CompiledGrammar::Create(Gbnf("root ::= \"é\" \"x\""), f.vocab), {f.stop});
  std::vector<uint64_t> mask(m.mask_words());
  m.FillNextTokenBitmask(mask.data());
  EXPECT_TRUE(Bit(mask, Id(f, "\xC3")));
  EXPECT_TRUE(Bit(mask, Id(f, "\xC3\xA9")));
  EXPECT_FALSE(Bit(mask, Id(f, "\xA9")));
  EXPECT_FALSE(Bit(mask, Id(f, "e")));
  EXPECT_FALSE(Bit(mask, f.stop));
  ASSERT_TRUE(m.AcceptToken(Id(f, "\xC3")));
  m.FillNextTokenBitmask(mask.data());
  EXPECT_TRUE(Bit(mask, Id(f, "\xA9")));
  EXPECT_TRUE(Bit(mask, Id(f, "\xA9x")));  // the character's end and the next symbol
  EXPECT_FALSE(Bit(mask, Id(f, "\xC3")));
  ASSERT_TRUE(m.AcceptToken(Id(f, "\xA9x")));
  EXPECT_TRUE(m.CanEnd());
  EXPECT_EQ(m.FillNextTokenBitmask(mask.data()), 1);
  EXPECT_TRUE(Bit(mask, f.stop));
  EXPECT_TRUE(m.AcceptToken(f.stop));
  EXPECT_TRUE(m.IsTerminated());
  EXPECT_FALSE(m.AcceptToken(Id(f, "x")));
}

TEST(MatcherTest, StopOnlyWhereTheGrammarMayEndAndRollback) {
  const Fixture f = Vocab({"a", "b", "ab", "ba", "bb"});
  GrammarMatcher m(CompiledGrammar::Create(Gbnf("root ::= \"a\" \"b\"{1,2}"), f.vocab), {f.stop});
  EXPECT_FALSE(m.AcceptToken(f.stop));
  EXPECT_FALSE(m.AcceptToken(Id(f, "b")));
  ASSERT_TRUE(m.AcceptToken(Id(f, "ab")));
  EXPECT_TRUE(m.CanEnd());
  GrammarMatcher fork = m;  // speculation: try a path on a copy
  ASSERT_TRUE(fork.AcceptToken(Id(f, "b")));
  EXPECT_FALSE(fork.AcceptToken(Id(f, "b")));
  ASSERT_TRUE(m.AcceptToken(Id(f, "b")));
  EXPECT_EQ(m.num_tokens(), 2);
  m.Rollback(1);
  EXPECT_EQ(m.num_tokens(), 1);
  std::vector<uint64_t> mask(m.mask_words());
  m.FillNextTokenBitmask(mask.data());
  EXPECT_TRUE(Bit(mask, Id(f, "b")));
  EXPECT_FALSE(Bit(mask, Id(f, "bb")));
  EXPECT_TRUE(Bit(mask, f.stop));
  m.Rollback(5);
  EXPECT_EQ(m.num_tokens(), 0);
  EXPECT_FALSE(m.CanEnd());
}

TEST(MatcherTest, DeadEndAllowsStop) {
  // The grammar needs a byte no token has: the mask falls back to stop.
  const Fixture f = Vocab({"a", "b"});
  GrammarMatcher m(CompiledGrammar::Create(Gbnf("root ::= \"a\" \"z\""), f.vocab), {f.stop});
  ASSERT_TRUE(m.AcceptToken(0));
  std::vector<uint64_t> mask(m.mask_words());
  EXPECT_EQ(m.FillNextTokenBitmask(mask.data()), 1);
  EXPECT_TRUE(Bit(mask, f.stop));
  EXPECT_TRUE(m.AcceptToken(f.stop));  // what the mask allows is accepted
  EXPECT_TRUE(m.IsTerminated());
}

// Masks against a brute force over the vocabulary, along random walks on
// the JSON grammar: the trie walk and the mask cache must not change them.
TEST(MatcherTest, MasksEqualBruteForce) {
  std::vector<std::string> tokens;
  for (int b = 32; b < 127; ++b) tokens.emplace_back(1, static_cast<char>(b));
  for (const char* t :
       {"{\"", "\":", "\": ", "\",", "\"}",  "},", "[1",   "true", "tr", "ue",       "null",
        "12",  "0.",  "e+",   "\\u", "\\\"", "é",  "\xC3", "\xA9", "日", "\xE6\x97", "\xA5",
        "  ",  "\n",  "\n ",  "ab",  "\"a",  "]}", "}]",   "{}",   "[]"}) {
    tokens.emplace_back(t);
  }
  const Fixture f = Vocab(tokens);
  auto compiled = CompiledGrammar::Create(JsonValueGrammar(), f.vocab);
  std::mt19937 rng(11);
  for (int walk = 0; walk < 20; ++walk) {
    GrammarMatcher m(compiled, {f.stop});
    std::vector<uint64_t> mask(m.mask_words());
    for (int step = 0; step < 30; ++step) {
      m.FillNextTokenBitmask(mask.data());
      std::vector<int64_t> allowed;
      for (int64_t t = 0; t < f.vocab->size(); ++t) {
        GrammarMatcher probe = m;
        const bool accepts = probe.AcceptToken(t);
        ASSERT_EQ(Bit(mask, t), accepts)
            << "token " << t << " '" << f.vocab->token_bytes(t) << "' at step " << step;
        if (accepts && t != f.stop) allowed.push_back(t);
      }
      if (allowed.empty()) break;
      ASSERT_TRUE(m.AcceptToken(allowed[rng() % allowed.size()]));
    }
  }
  EXPECT_GT(compiled->mask_cache_hits(), 0);
}

// The trie walk runs on a lazily built DFA of the arena's states; its masks
// must equal the brute force whether the table is kept (one big limit),
// started over between walks (a limit of a few states) or given up inside
// a walk for the plain per-stack walk (a limit of one state). Bounded
// repetitions (maxLength) make every position in a string its own state.
TEST(MatcherTest, DfaWalkMasksEqualBruteForceAtAnyTableLimit) {
  std::vector<std::string> tokens;
  for (int b = 32; b < 127; ++b) tokens.emplace_back(1, static_cast<char>(b));
  for (const char* t : {"{\"", "\":", "\",", "\"}", "ab", "abc", "abcd", "\"a", "12", "1.", "é",
                        "\xC3", "\xA9", "true", "\\n", "\",\"", "xyzzy", "  "}) {
    tokens.emplace_back(t);
  }
  const Fixture f = Vocab(tokens);
  auto schema = CompileJsonSchema(
      R"({"type": "object", "properties": {"a": {"type": "string", "maxLength": 6},
          "b": {"type": "integer", "minimum": -20, "maximum": 300},
          "c": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3},
                "maxItems": 3}},
          "required": ["a", "b", "c"]})");
  ASSERT_THAT(schema, IsOk());
  for (const int64_t limit : {int64_t{1}, int64_t{4}, int64_t{1} << 20}) {
    CompiledGrammar::Options options;
    options.max_dfa_states = limit;
    auto compiled = CompiledGrammar::Create(*schema, f.vocab, options);
    std::mt19937 rng(5);
    int64_t steps = 0;
    for (int walk = 0; walk < 12; ++walk) {
      GrammarMatcher m(compiled, {f.stop});
      std::vector<uint64_t> mask(m.mask_words());
      for (int step = 0; step < 40; ++step, ++steps) {
        m.FillNextTokenBitmask(mask.data());
        std::vector<int64_t> allowed;
        for (int64_t t = 0; t < f.vocab->size(); ++t) {
          GrammarMatcher probe = m;
          const bool accepts = probe.AcceptToken(t);
          ASSERT_EQ(Bit(mask, t), accepts) << "token " << t << " '" << f.vocab->token_bytes(t)
                                           << "' at step " << step << ", limit " << limit;
          if (accepts && t != f.stop) allowed.push_back(t);
        }
        if (allowed.empty()) break;
        ASSERT_TRUE(m.AcceptToken(allowed[rng() % allowed.size()]));
      }
    }
    EXPECT_GT(steps, 100);
    // The table stays within twice its limit (a walk may add states past
    // the limit; the next walk starts over).
    EXPECT_LE(compiled->dfa_states(), 2 * limit);
    if (limit > 1000) {
      EXPECT_GT(compiled->dfa_states(), 20);
    }
  }
}

TEST(MatcherTest, TrieKeepsDuplicateAndPrefixTokens) {
  // Equal byte strings under two ids, and tokens that are prefixes of others.
  const Fixture f = Vocab({"ab", "a", "ab", "abc", "b", "abd"});
  GrammarMatcher m(CompiledGrammar::Create(Gbnf("root ::= \"abc\""), f.vocab), {f.stop});
  std::vector<uint64_t> mask(m.mask_words());
  EXPECT_EQ(m.FillNextTokenBitmask(mask.data()), 4);
  for (int64_t id : {0, 1, 2, 3}) EXPECT_TRUE(Bit(mask, id)) << id;
  EXPECT_FALSE(Bit(mask, 4));
  EXPECT_FALSE(Bit(mask, 5));
}

}  // namespace
}  // namespace accel::grammar
