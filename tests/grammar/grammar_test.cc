// GBNF, regular expressions and choice lists: the compiled grammars against
// independent answers (RE2 for regular expressions, hand-written sentences
// for GBNF), and every refusal with its message.
#include "grammar/grammar.h"

#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <re2/re2.h>

#include "grammar/matcher.h"
#include "tests/testing/status_matchers.h"

namespace accel::grammar {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

std::shared_ptr<const Grammar> Gbnf(const std::string& text) {
  auto g = ParseGbnf(text);
  EXPECT_THAT(g, IsOk()) << text;
  return g.ok() ? *g : nullptr;
}

TEST(GbnfTest, LiteralsAlternativesAndGroups) {
  auto g = Gbnf(R"(root ::= "yes" | "no" | ("may" "be"))");
  EXPECT_TRUE(g->Matches("yes"));
  EXPECT_TRUE(g->Matches("no"));
  EXPECT_TRUE(g->Matches("maybe"));
  EXPECT_FALSE(g->Matches("ye"));
  EXPECT_FALSE(g->Matches("yesno"));
  EXPECT_FALSE(g->Matches(""));
}

TEST(GbnfTest, RulesRepetitionAndComments) {
  auto g = Gbnf(R"(
# a list of digits
root ::= item ("," item)*   # more
item ::= [0-9]+
)");
  EXPECT_TRUE(g->Matches("1"));
  EXPECT_TRUE(g->Matches("12,3,456"));
  EXPECT_FALSE(g->Matches("12,"));
  EXPECT_FALSE(g->Matches(",1"));
  EXPECT_FALSE(g->Matches("1a"));
}

TEST(GbnfTest, BoundedRepetition) {
  auto g = Gbnf(R"(root ::= "a"{2,3} "b"? "c"{2} "d"{1,})");
  EXPECT_TRUE(g->Matches("aaccd"));
  EXPECT_TRUE(g->Matches("aaabccddd"));
  EXPECT_FALSE(g->Matches("accd"));
  EXPECT_FALSE(g->Matches("aaaaccd"));
  EXPECT_FALSE(g->Matches("aacd"));
  EXPECT_FALSE(g->Matches("aacc"));
}

// Stacked postfix operators apply in turn (llama.cpp's reading), a run of
// *, +, ? (or {0,}, {1,}, {0,1}, {1}) as one operator over the atom: the
// grammar is the size of one operator's whatever the run's length.
TEST(GbnfTest, StackedOperatorsAreOneOverTheAtom) {
  auto star = Gbnf(R"(root ::= "a"+? "b")");  // (a+)? = a*
  EXPECT_TRUE(star->Matches("b"));
  EXPECT_TRUE(star->Matches("aaab"));
  EXPECT_FALSE(star->Matches("ab b"));
  auto plus = Gbnf(R"(root ::= ("x" "y")+{1,}+)");  // (xy)+
  EXPECT_TRUE(plus->Matches("xyxy"));
  EXPECT_FALSE(plus->Matches(""));
  EXPECT_FALSE(plus->Matches("xyx"));
  auto even = Gbnf(R"(root ::= "d"{2}+)");  // (dd)+
  EXPECT_TRUE(even->Matches("dd"));
  EXPECT_TRUE(even->Matches("dddd"));
  EXPECT_FALSE(even->Matches("ddd"));
  EXPECT_FALSE(even->Matches(""));
  auto optional = Gbnf(R"(root ::= "q"?{0,1}?)");  // q?
  EXPECT_TRUE(optional->Matches(""));
  EXPECT_TRUE(optional->Matches("q"));
  EXPECT_FALSE(optional->Matches("qq"));
  auto one = Gbnf(R"(root ::= "1"+)");
  auto run = Gbnf(R"(root ::= "1"+)" + std::string(3000, '+'));
  EXPECT_EQ(run->num_elements(), one->num_elements());
  EXPECT_EQ(run->num_rules(), one->num_rules());
  EXPECT_TRUE(run->Matches("11"));
}

TEST(GbnfTest, UnicodeClassesAreUtf8) {
  auto g = Gbnf(R"(root ::= [^a] [α-ω] "日" .)");
  EXPECT_TRUE(g->Matches("bβ日x"));
  EXPECT_TRUE(
      g->Matches("\xF0\x9F\x98\x80"
                 "α日\xE2\x82\xAC"));  // an emoji, a euro sign
  EXPECT_FALSE(g->Matches("aβ日x"));
  EXPECT_FALSE(g->Matches("bb日x"));
  // Half a character is not a character; an invalid byte is not one either.
  EXPECT_FALSE(
      g->Matches("\xCE"
                 "β日x"));
  EXPECT_FALSE(
      g->Matches("\xFF"
                 "β日x"));
  // A surrogate's encoding (ED A0 80) is not UTF-8.
  EXPECT_FALSE(g->Matches("bβ日\xED\xA0\x80"));
}

TEST(GbnfTest, Escapes) {
  auto g = Gbnf(R"(root ::= "\"\\\n\t\x41\u00e9\U0001F600" [\]\-])");
  EXPECT_TRUE(g->Matches("\"\\\n\tA\xC3\xA9\xF0\x9F\x98\x80]"));
  EXPECT_TRUE(g->Matches("\"\\\n\tA\xC3\xA9\xF0\x9F\x98\x80-"));
}

TEST(GbnfTest, Refusals) {
  EXPECT_THAT(ParseGbnf(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(ParseGbnf("a ::= \"x\""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no `root` rule")));
  EXPECT_THAT(ParseGbnf("root ::= item"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rule 'item' is used but never defined")));
  EXPECT_THAT(ParseGbnf("root ::= root \"x\" | \"y\""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("left recursion")));
  EXPECT_THAT(ParseGbnf("root ::= (\"x\"?)*"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("left recursion")));
  EXPECT_THAT(ParseGbnf("root ::= \"x\"\nroot ::= \"y\""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("defined twice")));
  EXPECT_THAT(ParseGbnf("root ::= \"abc", "the grammar field"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the grammar field: line 1, column 14: unterminated")));
  EXPECT_THAT(ParseGbnf("root ::=\n  \"a\" \\q"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 2, column 7")));
  EXPECT_THAT(ParseGbnf("root ::= [z-a]"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ends before it starts")));
  EXPECT_THAT(ParseGbnf("root ::= \"a\"{3,2}"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("below its minimum")));
  EXPECT_THAT(ParseGbnf("root ::= \"a\"{20000}"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("over the limit")));
  EXPECT_THAT(ParseGbnf("root ::= \"\\uD800\""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a Unicode scalar")));
  EXPECT_THAT(ParseGbnf("root ::= ( \"a\""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected ')'")));
}

// Ambiguity past 128 live parses is cut (found by grammar_fuzz: a regex of
// 244 optional copies took seconds a byte); ordinary ambiguity is not.
TEST(GbnfTest, AmbiguityIsBounded) {
  auto g = Gbnf(R"(root ::= ("a"?){300} "b")");
  EXPECT_FALSE(g->Matches(std::string(200, 'a') + "b"));
  auto mild = Gbnf(R"(root ::= [a-z]* "x" [a-z]*)");
  EXPECT_TRUE(mild->Matches("abxcdxe"));
  EXPECT_TRUE(Gbnf(R"(root ::= ("a"?){20} "b")")->Matches("aaab"));
}

TEST(ChoicesTest, ExactlyOneChoice) {
  auto g = CompileChoices({"red", "green", "gr\"een\\"});
  ASSERT_THAT(g, IsOk());
  EXPECT_TRUE((*g)->Matches("red"));
  EXPECT_TRUE((*g)->Matches("gr\"een\\"));
  EXPECT_FALSE((*g)->Matches("redgreen"));
  EXPECT_FALSE((*g)->Matches("gre"));
  EXPECT_THAT(CompileChoices({}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(CompileChoices({"a", ""}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("choice[1]")));
}

// A vocabulary of the 256 single bytes: a masked walk is a walk over bytes.
std::shared_ptr<const TokenVocabulary> ByteVocabulary() {
  std::vector<std::string> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(1, static_cast<char>(b));
  bytes.emplace_back("");  // 256: the stop token
  std::vector<bool> special(257, false);
  special[256] = true;
  return TokenVocabulary::Create(bytes, special);
}

// A random sentence of `grammar` (empty optional: the walk got stuck or ran long).
std::optional<std::string> RandomSentence(const std::shared_ptr<const Grammar>& grammar,
                                          std::mt19937& rng, int max_bytes = 60) {
  static const auto vocab = ByteVocabulary();
  GrammarMatcher matcher(CompiledGrammar::Create(grammar, vocab), {256});
  std::vector<uint64_t> mask(matcher.mask_words());
  std::string out;
  for (int i = 0; i < max_bytes * 4; ++i) {
    matcher.FillNextTokenBitmask(mask.data());
    std::vector<int> allowed;
    for (int t = 0; t < 257; ++t) {
      if (mask[t >> 6] >> (t & 63) & 1) allowed.push_back(t);
    }
    if (allowed.empty()) return std::nullopt;
    const bool can_end = mask[256 >> 6] >> (256 & 63) & 1;
    if (can_end && (out.size() >= static_cast<size_t>(max_bytes) || rng() % 4 == 0)) return out;
    int t = allowed[rng() % allowed.size()];
    if (t == 256) {
      if (allowed.size() == 1) return out;
      t = allowed[rng() % (allowed.size() - 1)];
    }
    EXPECT_TRUE(matcher.AcceptToken(t));
    out.push_back(static_cast<char>(t));
  }
  return std::nullopt;
}

// Random strings near the pattern's alphabet (and outside it).
std::string RandomString(std::mt19937& rng, const std::string& alphabet) {
  std::string s;
  const int n = static_cast<int>(rng() % 8);
  for (int i = 0; i < n; ++i) {
    if (rng() % 10 == 0) {
      s += "é";
    } else {
      s.push_back(alphabet[rng() % alphabet.size()]);
    }
  }
  return s;
}

TEST(RegexTest, AgreesWithRe2) {
  const std::vector<std::string> patterns = {
      "abc",
      "a|b|cd",
      "[a-c]+x?",
      "(ab)*c{2,3}",
      "\\d{3}-\\d{4}",
      "[^a-c]*",
      "(?:foo|bar)+baz",
      "a.c",
      "\\w+@\\w+\\.com",
      "[\\d\\s]{1,4}",
      "x(y|z)?(?P<n>w)",
      "^(0|[1-9][0-9]*)$",
      "[-+]?\\d*\\.?\\d+",
      "colou?r",
      "\\.\\*\\+",
      "a{2}b{0,}c{1,2}?",
      "[é-ü]x",
      "(a|ab)(c|bcd)(d*)",
  };
  std::mt19937 rng(7);
  const std::string alphabet = "abcdxyzw0123456789-+.@ fobarzomc\n";
  for (const std::string& pattern : patterns) {
    auto grammar = CompileRegex(pattern);
    ASSERT_THAT(grammar, IsOk()) << pattern;
    RE2 re(pattern);
    ASSERT_TRUE(re.ok()) << pattern;
    for (int i = 0; i < 400; ++i) {
      const std::string s = RandomString(rng, alphabet);
      EXPECT_EQ((*grammar)->Matches(s), RE2::FullMatch(s, re)) << pattern << " on '" << s << "'";
    }
    // Sentences the grammar generates all match.
    for (int i = 0; i < 100; ++i) {
      std::optional<std::string> s = RandomSentence(*grammar, rng);
      if (!s) continue;
      EXPECT_TRUE(RE2::FullMatch(*s, re)) << pattern << " generated '" << *s << "'";
      EXPECT_TRUE((*grammar)->Matches(*s));
    }
  }
}

TEST(RegexTest, Refusals) {
  EXPECT_THAT(CompileRegex("(a)\\1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("backreferences")));
  EXPECT_THAT(CompileRegex("a(?=b)"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lookaround")));
  EXPECT_THAT(CompileRegex("a\\bc"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("word boundaries")));
  EXPECT_THAT(CompileRegex("a^b"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'^'")));
  EXPECT_THAT(CompileRegex("a$b"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'$'")));
  EXPECT_THAT(CompileRegex("(ab"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("')'")));
  EXPECT_THAT(CompileRegex("ab)"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("')'")));
  EXPECT_THAT(CompileRegex("*a"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nothing to repeat")));
  EXPECT_THAT(CompileRegex("[b-a]"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ends before it starts")));
}

// Stacked quantifiers apply in turn, and a run of *, +, ? (or {0,}, {1,},
// {0,1}, {1}) is one quantifier over the atom, so the grammar stays the
// size of one whatever the run's length (nested, a run of 90 made the
// matcher's closures quadratic: seconds a byte). After each quantifier a `?`
// or `+` is its lazy or possessive mark (the same language), so `a+++` is
// (a++)+, `d{2}+` is d{2} and `d{2}++` is (d{2})+. Each against RE2 on the
// equivalent pattern.
TEST(RegexTest, StackedQuantifiersAreOneOverTheAtom) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"a+++", "a+"},
      {"b*??", "b*"},
      {"(ab)?{1,}c", "(ab)*c"},
      {"c+{0,1}", "c*"},
      {"d{2}+", "dd"},
      {"d{2}++", "(dd)+"},
      {"e?++f", "e*f"},
      {"(a|b){1}{1}c", "(a|b)c"},
      {"f{0,1}?{0,}", "f*"},
      {"a{1,2}+b", "a{1,2}b"},
      {"a{1,2}++b", "(a{1,2})+b"},
  };
  std::mt19937 rng(11);
  for (const auto& [pattern, equivalent] : cases) {
    auto grammar = CompileRegex(pattern);
    ASSERT_THAT(grammar, IsOk()) << pattern;
    RE2 re(equivalent);
    ASSERT_TRUE(re.ok()) << equivalent;
    for (int i = 0; i < 300; ++i) {
      const std::string s = RandomString(rng, "abcdef");
      EXPECT_EQ((*grammar)->Matches(s), RE2::FullMatch(s, re)) << pattern << " on '" << s << "'";
    }
  }
  auto one = CompileRegex("1+");
  auto run = CompileRegex("1+" + std::string(3000, '+'));
  ASSERT_THAT(one, IsOk());
  ASSERT_THAT(run, IsOk());
  EXPECT_EQ((*run)->num_elements(), (*one)->num_elements());
  EXPECT_TRUE((*run)->Matches("111"));
  EXPECT_FALSE((*run)->Matches(""));
}

// Nested loops, each level a group of its own: ((x)+)+... is x+ however
// deep. A loop's first pass and its later ones return to the same place, so
// a level keeps one parse stack: deep nesting neither refuses text for
// holding too many parses at once (eight levels of `+` did: 2^8 stacks, past
// the matcher's 128, refused "xxx") nor makes each byte slower. Against RE2
// on the same pattern.
TEST(RegexTest, NestedLoopsKeepOneParseALevel) {
  // The outermost level also as `*` (its group cannot match empty), so ""
  // is in the language.
  for (const auto& [op, outer] :
       std::vector<std::pair<std::string, std::string>>{{"+", "+"}, {"{1,}", "{1,}"}, {"+", "*"}}) {
    for (int depth : {1, 8, 20, 100}) {
      std::string pattern;
      for (int i = 0; i < depth; ++i) pattern += "(";
      pattern += "x";
      for (int i = 0; i < depth; ++i) pattern += ")" + (i + 1 == depth ? outer : op);
      SCOPED_TRACE(pattern);
      auto grammar = CompileRegex(pattern);
      ASSERT_THAT(grammar, IsOk());
      RE2 re(pattern);
      ASSERT_TRUE(re.ok());
      for (int n = 0; n <= 40; ++n) {
        const std::string text(static_cast<size_t>(n), 'x');
        EXPECT_EQ((*grammar)->Matches(text), RE2::FullMatch(text, re)) << n;
      }
      EXPECT_TRUE((*grammar)->Matches(std::string(500, 'x')));
      for (const char* text : {"xy", "yx", "xxxxy", "y"}) {
        EXPECT_FALSE((*grammar)->Matches(text)) << text;
      }
    }
  }
}

TEST(RegexTest, JsonStringModeEscapes) {
  auto expression = RegexToGbnf("a\"[\\\\x]\n", /*json_string=*/true);
  ASSERT_THAT(expression, IsOk());
  auto g = ParseGbnf("root ::= " + *expression);
  ASSERT_THAT(g, IsOk());
  EXPECT_TRUE((*g)->Matches("a\\\"\\\\\\n"));
  EXPECT_TRUE((*g)->Matches("a\\\"x\\n"));
  EXPECT_FALSE((*g)->Matches("a\"x\n"));
}

}  // namespace
}  // namespace accel::grammar
