// Unit tests of tokenizer/tokenizer.h on small hand-written tokenizer.json files:
// one component at a time, every error path, and round trips. Expected
// splits come from HuggingFace tokenizers' own documentation and tests where
// those give them; tests/tokenizer/reference_test.cc checks real
// files against the library itself.
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tokenizer/bpe_trainer.h"
#include "tokenizer/internal/regex.h"
#include "tokenizer/internal/unicode.h"

namespace accel::tokenizer {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// A BPE tokenizer.json whose vocabulary is `tokens` (ids in order), with
// `merges` and everything else null; tests set the component they check.
Json BpeJson(const std::vector<std::string>& tokens, const std::vector<std::string>& merges = {}) {
  Json vocab = Json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = i;
  Json merge_list = Json::array();
  for (const std::string& m : merges) merge_list.push_back(m);
  return Json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", Json::array()},
              {"normalizer", nullptr},
              {"pre_tokenizer", nullptr},
              {"post_processor", nullptr},
              {"decoder", nullptr},
              {"model",
               {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"vocab", vocab},
                {"merges", merge_list}}}};
}

// Every single character of `text`, plus `extra`: a vocabulary in which any
// split of `text` into characters can be spelled.
std::vector<std::string> CharsOf(absl::string_view text, std::vector<std::string> extra = {}) {
  std::vector<std::string> out = std::move(extra);
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t start = pos;
    internal::NextChar(text, &pos);
    std::string c(text.substr(start, pos - start));
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  }
  return out;
}

Json AddedToken(int64_t id, const std::string& content, bool special, bool normalized,
                bool single_word = false, bool lstrip = false, bool rstrip = false) {
  return Json{{"id", id},          {"content", content}, {"single_word", single_word},
              {"lstrip", lstrip},  {"rstrip", rstrip},   {"normalized", normalized},
              {"special", special}};
}

Tokenizer Load(const Json& json) {
  absl::StatusOr<Tokenizer> tok = Tokenizer::FromJson(json.dump(), "test.json");
  EXPECT_THAT(tok, IsOk());
  if (!tok.ok()) std::abort();
  return *std::move(tok);
}

// The token strings `text` encodes to (no special tokens).
std::vector<std::string> Tokens(const Tokenizer& tok, absl::string_view text) {
  absl::StatusOr<std::vector<int64_t>> ids = tok.Encode(text, false);
  EXPECT_THAT(ids, IsOk());
  std::vector<std::string> out;
  if (!ids.ok()) return out;
  for (int64_t id : *ids) out.push_back(tok.IdToToken(id).value_or("<no token>"));
  return out;
}

std::vector<int64_t> Ids(const Tokenizer& tok, absl::string_view text, bool special = false) {
  absl::StatusOr<std::vector<int64_t>> ids = tok.Encode(text, special);
  EXPECT_THAT(ids, IsOk());
  return ids.ok() ? *ids : std::vector<int64_t>{};
}

std::string DecodeOrDie(const Tokenizer& tok, const std::vector<int64_t>& ids, bool skip) {
  absl::StatusOr<std::string> text = tok.Decode(ids, skip);
  EXPECT_THAT(text, IsOk());
  return text.ok() ? *text : std::string();
}

// ---- Errors -----------------------------------------------------------------------

TEST(TokenizerErrorsTest, MissingFileIsNotFound) {
  test::TempDir dir;
  EXPECT_THAT(Tokenizer::FromFile(dir.File("tokenizer.json")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("tokenizer.json")));
}

TEST(TokenizerErrorsTest, FromFileReadsTheFile) {
  test::TempDir dir;
  const std::string path = dir.Write("tokenizer.json", BpeJson({"a", "b"}).dump());
  ACCEL_ASSERT_OK_AND_ASSIGN(Tokenizer tok, Tokenizer::FromFile(path));
  EXPECT_THAT(Ids(tok, "ba"), ElementsAre(1, 0));
  EXPECT_THAT(Tokenizer::FromFile(dir.Write("bad.json", "{\"model\": ")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad.json")));
}

TEST(TokenizerErrorsTest, InvalidJson) {
  for (absl::string_view text : {"", "{", "[1, 2]", "{\"model\": nul}", "\xFF"}) {
    EXPECT_THAT(Tokenizer::FromJson(text, "x.json"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x.json")))
        << text;
  }
}

TEST(TokenizerErrorsTest, DeepNestingIsRefused) {
  std::string deep = "{\"model\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_THAT(Tokenizer::FromJson(deep, "deep.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nests deeper")));
}

TEST(TokenizerErrorsTest, UnknownComponentTypesAreUnimplemented) {
  struct Case {
    const char* field;
    Json value;
    const char* type;
  };
  const std::vector<Case> cases = {
      {"normalizer", {{"type", "BertNormalizer"}}, "BertNormalizer"},
      {"pre_tokenizer", {{"type", "BertPreTokenizer"}}, "BertPreTokenizer"},
      {"decoder", {{"type", "WordPiece"}, {"prefix", "##"}}, "WordPiece"},
      {"post_processor", {{"type", "Unknown"}}, "Unknown"},
  };
  for (const Case& c : cases) {
    Json json = BpeJson({"a"});
    json[c.field] = c.value;
    EXPECT_THAT(
        Tokenizer::FromJson(json.dump(), "t.json"),
        StatusIs(absl::StatusCode::kUnimplemented,
                 ::testing::AllOf(HasSubstr("t.json"), HasSubstr(c.type), HasSubstr(c.field))));
  }
  Json json = BpeJson({"a"});
  json["model"]["type"] = "WordPiece";
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("WordPiece")));
  json = BpeJson({"a"});
  json["model"]["dropout"] = 0.1;
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("model.dropout")));
  json["model"]["dropout"] = 0.0;  // HF's "no dropout"
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"), IsOk());
  json = BpeJson({"a"});
  json["truncation"] = {{"max_length", 512}};
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("truncation")));
}

TEST(TokenizerErrorsTest, MalformedFieldsNameTheirPath) {
  Json json = BpeJson({"a", "b"}, {"a c"});
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("t.json"), HasSubstr("model.merges[0]"),
                                        HasSubstr("\"c\""))));
  json = BpeJson({"a", "b"}, {"a b"});  // "ab" is missing
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"ab\"")));
  json = BpeJson({"a", "b", "ab"}, {"a  b"});
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.merges[0]")));
  json = BpeJson({"a"});
  json["model"]["vocab"]["b"] = "one";
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.vocab[\"b\"]")));
  json = BpeJson({"a"});
  json["model"]["vocab"]["b"] = -1;
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.vocab[\"b\"]")));
  json = BpeJson({"a"});
  json["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "ab"}};
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pre_tokenizer.replacement")));
  json = BpeJson({"a"});
  json["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       Json::array({Json{{"type", "Split"}, {"pattern", {{"String", "a"}}}, {"behavior", "X"}}})}};
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("pre_tokenizer.pretokenizers[0].behavior")));
  json = BpeJson({"a"});
  json["added_tokens"] = Json::array({Json{{"id", 5}}});
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("added_tokens[0].content")));
  json = BpeJson({"a"});
  json["post_processor"] = {{"type", "TemplateProcessing"},
                            {"single", Json::array({Json{{"SpecialToken", {{"id", "<s>"}}}},
                                                    Json{{"Sequence", {{"id", "A"}}}}})},
                            {"special_tokens", Json::object()}};
  EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("post_processor.single[0].SpecialToken.id")));
}

// A Sequence of each component kind refuses a null member and a list that
// is not an array, naming the member's path.
TEST(TokenizerErrorsTest, SequencesRefuseNullMembers) {
  struct Case {
    const char* field;
    const char* list;
    const char* what;
  };
  for (const Case& c : {Case{"normalizer", "normalizers", "normalizer"},
                        Case{"pre_tokenizer", "pretokenizers", "pre-tokenizer"},
                        Case{"decoder", "decoders", "decoder"},
                        Case{"post_processor", "processors", "post-processor"}}) {
    SCOPED_TRACE(c.field);
    Json json = BpeJson({"a"});
    json[c.field] = {{"type", "Sequence"}, {c.list, Json::array({nullptr})}};
    EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr(std::string(c.field) + "." + c.list + "[0]"),
                                          HasSubstr(std::string("must be a ") + c.what))));
    json[c.field] = {{"type", "Sequence"}, {c.list, "none"}};
    EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(std::string(c.field) + "." + c.list)));
  }
}

TEST(TokenizerErrorsTest, UnsupportedRegexIsUnimplementedNamingThePattern) {
  for (const char* pattern : {"(?<=a)b", "a(?=b)", "(?>ab)", "a++", "\\bword", "^a", "(a)\\1",
                              "[[:alpha:]]", "[a&&b]", "(?x) a"}) {
    Json json = BpeJson({"a", "b"});
    json["pre_tokenizer"] = {{"type", "Split"},
                             {"pattern", {{"Regex", pattern}}},
                             {"behavior", "Isolated"},
                             {"invert", false}};
    EXPECT_THAT(Tokenizer::FromJson(json.dump(), "t.json"),
                StatusIs(absl::StatusCode::kUnimplemented,
                         ::testing::AllOf(HasSubstr("t.json"), HasSubstr("pattern.Regex"))))
        << pattern;
  }
}

TEST(TokenizerErrorsTest, EncodeRefusesInvalidUtf8) {
  Tokenizer tok = Load(BpeJson({"a"}));
  for (absl::string_view bad : {absl::string_view("\x80"), absl::string_view("a\xC3"),
                                absl::string_view("\xC0\x80"), absl::string_view("\xED\xA0\x80"),
                                absl::string_view("\xF4\x90\x80\x80"), absl::string_view("\xFF")}) {
    EXPECT_THAT(tok.Encode(bad, true),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("UTF-8")));
  }
}

TEST(TokenizerErrorsTest, DecodeRefusesOutOfRangeIds) {
  Tokenizer tok = Load(BpeJson({"a", "b"}));
  EXPECT_THAT(tok.Decode({0, 2}, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("id 2")));
  EXPECT_THAT(tok.Decode({-1}, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("id -1")));
  IncrementalDecoder stream(tok, false);
  EXPECT_THAT(stream.Next(7), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("id 7")));
}

TEST(TokenizerErrorsTest, MissingUnkTokenFailsAtEncode) {
  Json json = BpeJson({"a"});
  json["model"]["unk_token"] = "<unk>";
  Tokenizer tok = Load(json);
  EXPECT_THAT(tok.Encode("a", false), IsOk());
  EXPECT_THAT(tok.Encode("ab", false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("<unk>")));
}

// ---- The BPE model ------------------------------------------------------------------

TEST(BpeTest, LowestRankMergesFirst) {
  // "abc": (b,c) outranks (a,b), so abc comes from a + bc.
  Tokenizer tok = Load(BpeJson({"a", "b", "c", "ab", "bc", "abc"}, {"b c", "a b", "a bc"}));
  EXPECT_THAT(Tokens(tok, "abc"), ElementsAre("abc"));
  EXPECT_THAT(Tokens(tok, "ab"), ElementsAre("ab"));
  Tokenizer other = Load(BpeJson({"a", "b", "c", "ab", "bc", "abc"}, {"a b", "b c", "a bc"}));
  // (a,b) wins first; "ab c" is no merge, so the word stays in two.
  EXPECT_THAT(Tokens(other, "abc"), ElementsAre("ab", "c"));
}

TEST(BpeTest, EqualRanksMergeLeftmostFirst) {
  // "aaa": the pair (a,a) at 0 merges before the one at 1.
  Tokenizer tok = Load(BpeJson({"a", "aa"}, {"a a"}));
  EXPECT_THAT(Tokens(tok, "aaa"), ElementsAre("aa", "a"));
  EXPECT_THAT(Tokens(tok, "aaaa"), ElementsAre("aa", "aa"));
}

TEST(BpeTest, MergesAsPairsEqualMergesAsStrings) {
  Json strings = BpeJson({"a", "b", "c", "ab", "abc"}, {"a b", "ab c"});
  Json pairs = strings;
  pairs["model"]["merges"] = Json::array({Json::array({"a", "b"}), Json::array({"ab", "c"})});
  Tokenizer s = Load(strings);
  Tokenizer p = Load(pairs);
  for (absl::string_view text : {"abc", "abcabc", "cab", "ba"}) {
    EXPECT_EQ(Ids(s, text), Ids(p, text)) << text;
  }
  EXPECT_THAT(Tokens(p, "abcab"), ElementsAre("abc", "ab"));
  pairs["model"]["merges"] = {{"a", "b"}, "ab c"};
  EXPECT_THAT(Tokenizer::FromJson(pairs.dump(), "t.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.merges[1]")));
}

TEST(BpeTest, UnknownCharactersAndFuseUnk) {
  Json json = BpeJson({"<unk>", "a"});
  json["model"]["unk_token"] = "<unk>";
  Tokenizer plain = Load(json);
  EXPECT_THAT(Tokens(plain, "xya"), ElementsAre("<unk>", "<unk>", "a"));
  json["model"]["fuse_unk"] = true;
  Tokenizer fused = Load(json);
  EXPECT_THAT(Tokens(fused, "xya"), ElementsAre("<unk>", "a"));
  EXPECT_THAT(Tokens(fused, "xaxx"), ElementsAre("<unk>", "a", "<unk>"));
  // Without an unk_token, an unknown character vanishes.
  Tokenizer none = Load(BpeJson({"a"}));
  EXPECT_THAT(Tokens(none, "xa"), ElementsAre("a"));
}

TEST(BpeTest, ByteFallback) {
  std::vector<std::string> vocab = {"<unk>", "a"};
  for (int b = 0; b < 256; ++b) vocab.push_back(absl::StrFormat("<0x%02X>", b));
  Json json = BpeJson(vocab);
  json["model"]["unk_token"] = "<unk>";
  json["model"]["byte_fallback"] = true;
  json["decoder"] = {{"type", "ByteFallback"}};
  Tokenizer tok = Load(json);
  EXPECT_THAT(Tokens(tok, "a\xE2\x82\xAC"), ElementsAre("a", "<0xE2>", "<0x82>", "<0xAC>"));
  EXPECT_EQ(DecodeOrDie(tok, Ids(tok, "a\xE2\x82\xAC"), false), "a\xE2\x82\xAC");
  // An invalid run decodes as one U+FFFD per byte (HF's ByteFallback, not lossy UTF-8).
  const int64_t e2 = *tok.TokenToId("<0xE2>");
  const int64_t x82 = *tok.TokenToId("<0x82>");
  EXPECT_EQ(DecodeOrDie(tok, {e2, x82, 1}, false),
            "\xEF\xBF\xBD\xEF\xBF\xBD"
            "a");
}

TEST(BpeTest, IgnoreMergesEmitsVocabularyWordsWhole) {
  Json json = BpeJson({"a", "b", "c", "bc", "abc"}, {"b c"});
  Tokenizer merging = Load(json);
  EXPECT_THAT(Tokens(merging, "abc"), ElementsAre("a", "bc"));
  json["model"]["ignore_merges"] = true;
  Tokenizer ignoring = Load(json);
  EXPECT_THAT(Tokens(ignoring, "abc"), ElementsAre("abc"));
  EXPECT_THAT(Tokens(ignoring, "cbc"), ElementsAre("c", "bc"));
}

TEST(BpeTest, SubwordPrefixAndWordSuffix) {
  Json json = BpeJson({"a", "##b", "##c</w>", "##bc</w>", "a##bc</w>", "c</w>"},
                      {"##b ##c</w>", "a ##bc</w>"});
  json["model"]["continuing_subword_prefix"] = "##";
  json["model"]["end_of_word_suffix"] = "</w>";
  // The merge "a ##bc</w>" makes "a" + "bc</w>" (the prefix of the second part dropped).
  json["model"]["vocab"]["abc</w>"] = 6;
  json["model"]["merges"] = {"##b ##c</w>", "a ##bc</w>"};
  Tokenizer tok = Load(json);
  EXPECT_THAT(Tokens(tok, "abc"), ElementsAre("abc</w>"));
  EXPECT_THAT(Tokens(tok, "c"), ElementsAre("c</w>"));
}

// ---- Normalizers ----------------------------------------------------------------

TEST(NormalizerTest, EachKind) {
  struct Case {
    Json normalizer;
    std::string input;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {{{"type", "Lowercase"}}, "ABc\xC4\xB0", {"a", "b", "c", "i", "\xCC\x87"}},
      {{{"type", "NFC"}}, "e\xCC\x81", {"\xC3\xA9"}},
      {{{"type", "NFD"}}, "\xC3\xA9", {"e", "\xCC\x81"}},
      {{{"type", "NFKC"}}, "\xEF\xAC\x81", {"f", "i"}},  // the fi ligature
      {{{"type", "NFKD"}}, "\xE2\x91\xA0", {"1"}},       // circled one
      {{{"type", "Strip"}, {"strip_left", true}, {"strip_right", false}}, " \ta ", {"a", " "}},
      {{{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}},
       "\xC2\xA0"
       "a\n",
       {"a"}},
      {{{"type", "Prepend"}, {"prepend", "_"}}, "ab", {"_", "a", "b"}},
      {{{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "_"}},
       "a b",
       {"a", "_", "b"}},
      {{{"type", "Replace"}, {"pattern", {{"Regex", "\\s+"}}}, {"content", " "}},
       "a \t\xE3\x80\x80 b",
       {"a", " ", "b"}},
      {{{"type", "Sequence"},
        {"normalizers",
         Json::array({Json{{"type", "Lowercase"}}, Json{{"type", "Prepend"}, {"prepend", "_"}}})}},
       "AB",
       {"_", "a", "b"}},
  };
  for (const Case& c : cases) {
    Json json = BpeJson(CharsOf("abcefi1_ \t\n\xC3\xA9\xCC\x81\xCC\x87"));
    json["normalizer"] = c.normalizer;
    Tokenizer tok = Load(json);
    EXPECT_THAT(Tokens(tok, c.input), ElementsAreArray(c.expected)) << c.normalizer.dump();
  }
}

TEST(NormalizerTest, PrependAppliesToEachPieceBetweenAddedTokens) {
  Json json = BpeJson(CharsOf("ab_"));
  json["normalizer"] = {{"type", "Prepend"}, {"prepend", "_"}};
  json["model"]["vocab"]["<s>"] = 3;
  json["added_tokens"] = Json::array({AddedToken(3, "<s>", true, false)});
  Tokenizer tok = Load(json);
  EXPECT_THAT(Tokens(tok, "a<s>b"), ElementsAre("_", "a", "<s>", "_", "b"));
  EXPECT_THAT(Tokens(tok, ""), ElementsAre());
}

// ---- Pre-tokenizers ---------------------------------------------------------------

// A model that spells each piece as one token when it can (ignore_merges), so
// the tokens show the pre-tokenizer's pieces.
Tokenizer PieceTokenizer(const Json& pre_tokenizer, const std::vector<std::string>& pieces) {
  Json json = BpeJson(pieces);
  json["model"]["ignore_merges"] = true;
  json["pre_tokenizer"] = pre_tokenizer;
  return Load(json);
}

Json SplitOn(const Json& pattern, const std::string& behavior, bool invert = false) {
  return Json{{"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", invert}};
}

TEST(PreTokenizerTest, SplitBehaviors) {
  // The examples of HF's SplitDelimiterBehavior documentation.
  const std::vector<std::string> pieces = {"the",  "final",  "countdown", "-",         "--",
                                           "the-", "final-", "-final",    "-countdown"};
  const std::string text = "the-final--countdown";
  for (const Json& pattern : {Json{{"String", "-"}}, Json{{"Regex", "-"}}}) {
    EXPECT_THAT(Tokens(PieceTokenizer(SplitOn(pattern, "Removed"), pieces), text),
                ElementsAre("the", "final", "countdown"));
    EXPECT_THAT(Tokens(PieceTokenizer(SplitOn(pattern, "Isolated"), pieces), text),
                ElementsAre("the", "-", "final", "-", "-", "countdown"));
    EXPECT_THAT(Tokens(PieceTokenizer(SplitOn(pattern, "MergedWithPrevious"), pieces), text),
                ElementsAre("the-", "final-", "-", "countdown"));
    EXPECT_THAT(Tokens(PieceTokenizer(SplitOn(pattern, "MergedWithNext"), pieces), text),
                ElementsAre("the", "-final", "-", "-countdown"));
    EXPECT_THAT(Tokens(PieceTokenizer(SplitOn(pattern, "Contiguous"), pieces), text),
                ElementsAre("the", "-", "final", "--", "countdown"));
  }
  // invert: the matches are the pieces kept, the rest is the delimiter.
  EXPECT_THAT(
      Tokens(PieceTokenizer(SplitOn(Json{{"Regex", "[a-z]+"}}, "Removed", true), pieces), text),
      ElementsAre("the", "final", "countdown"));
  EXPECT_THAT(Tokens(PieceTokenizer(SplitOn(Json{{"String", "-"}}, "Removed", true), pieces), text),
              ElementsAre("-", "-", "-"));
}

TEST(PreTokenizerTest, WhitespaceLookaheadIdiom) {
  // GPT-2's pattern: a run of spaces before a word leaves its last space to the word.
  const Json split = SplitOn(
      Json{{"Regex",
            "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"}},
      "Isolated");
  Tokenizer tok =
      PieceTokenizer(split, {"a", "b", " b", "  ", " ", "   ", "\xC2\xA0", " \xC2\xA0"});
  EXPECT_THAT(Tokens(tok, "a   b"), ElementsAre("a", "  ", " b"));
  EXPECT_THAT(Tokens(tok, "a "), ElementsAre("a", " "));
  EXPECT_THAT(Tokens(tok, "a   "), ElementsAre("a", "   "));
  EXPECT_THAT(Tokens(tok, "a b"), ElementsAre("a", " b"));
  // U+00A0 is whitespace for Oniguruma's \s: the run " \u00A0" splits before "b".
  EXPECT_THAT(Tokens(tok,
                     "a \xC2\xA0"
                     "b"),
              ElementsAre("a", " ", "\xC2\xA0", "b"));
}

TEST(PreTokenizerTest, Metaspace) {
  const std::vector<std::string> pieces =
      CharsOf("Hello world<s>\xE2\x96\x81", {"\xE2\x96\x81Hello", "\xE2\x96\x81world"});
  auto make = [&](const std::string& scheme, bool split) {
    Json json = BpeJson(pieces);
    json["model"]["ignore_merges"] = true;
    json["pre_tokenizer"] = {{"type", "Metaspace"},
                             {"replacement", "\xE2\x96\x81"},
                             {"prepend_scheme", scheme},
                             {"split", split}};
    json["model"]["vocab"]["<s>"] = pieces.size();
    json["added_tokens"] =
        Json::array({AddedToken(static_cast<int64_t>(pieces.size()), "<s>", true, false)});
    return Load(json);
  };
  EXPECT_THAT(Tokens(make("always", true), "Hello world"),
              ElementsAre("\xE2\x96\x81Hello", "\xE2\x96\x81world"));
  EXPECT_THAT(Tokens(make("never", true), "Hello world"),
              ElementsAre("H", "e", "l", "l", "o", "\xE2\x96\x81world"));
  // "first": only a piece that starts the text gets the prefix.
  EXPECT_THAT(Tokens(make("first", true), "world<s>Hello"),
              ElementsAre("\xE2\x96\x81world", "<s>", "H", "e", "l", "l", "o"));
  EXPECT_THAT(Tokens(make("always", true), "world<s>Hello"),
              ElementsAre("\xE2\x96\x81world", "<s>", "\xE2\x96\x81Hello"));
  // Legacy files: add_prefix_space instead of prepend_scheme.
  Json legacy = BpeJson(pieces);
  legacy["model"]["ignore_merges"] = true;
  legacy["pre_tokenizer"] = {
      {"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"add_prefix_space", true}};
  EXPECT_THAT(Tokens(Load(legacy), "Hello"), ElementsAre("\xE2\x96\x81Hello"));
}

TEST(PreTokenizerTest, DigitsAndWhitespace) {
  const std::vector<std::string> pieces = {"abc", "1", "2", "3", "123", "a", "b", "!?", "c"};
  EXPECT_THAT(
      Tokens(PieceTokenizer({{"type", "Digits"}, {"individual_digits", true}}, pieces), "abc123"),
      ElementsAre("abc", "1", "2", "3"));
  EXPECT_THAT(
      Tokens(PieceTokenizer({{"type", "Digits"}, {"individual_digits", false}}, pieces), "abc123"),
      ElementsAre("abc", "123"));
  EXPECT_THAT(Tokens(PieceTokenizer({{"type", "WhitespaceSplit"}}, pieces),
                     " a \t b\xE3\x80\x80"
                     "c"),
              ElementsAre("a", "b", "c"));
  EXPECT_THAT(Tokens(PieceTokenizer({{"type", "Whitespace"}}, pieces), "abc!? 123"),
              ElementsAre("abc", "!?", "123"));
}

TEST(PreTokenizerTest, ByteLevelMapsBytesAndAddsPrefixSpace) {
  const std::vector<std::string>& symbols = ByteToSymbol();
  std::vector<std::string> vocab = ByteAlphabet();
  Json json = BpeJson(vocab);
  json["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  Tokenizer tok = Load(json);
  // "a b" -> " a" and " b" (the prefix space), each byte its symbol.
  EXPECT_THAT(Tokens(tok, "a b"), ElementsAre(symbols[' '], "a", symbols[' '], "b"));
  EXPECT_THAT(Tokens(tok, "\xC3\xA9"), ElementsAre(symbols[' '], symbols[0xC3], symbols[0xA9]));
}

// ---- Added tokens -----------------------------------------------------------------

// HF's added_vocabulary tests (options_use_cases, test_single_word_is_correct,
// test_lstrip_unicode_space), with a character model to show the pieces.
TEST(AddedTokensTest, OptionsAsHuggingFaceTestsThem) {
  const std::string text = "[CLS] My name is Anthony [SEP]";
  Json json = BpeJson(CharsOf(" mynaeisthoAMNCLSEP[]<>k\t\xE2\x80\x80"));
  json["normalizer"] = {{"type", "Lowercase"}};
  const int64_t base = static_cast<int64_t>(json["model"]["vocab"].size());
  json["added_tokens"] = Json::array(
      {AddedToken(base, "my", false, true, false, true, true),
       AddedToken(base + 1, "name", false, true), AddedToken(base + 2, "ony", false, true, true),
       AddedToken(base + 3, "[CLS]", true, false), AddedToken(base + 4, "[SEP]", true, false)});
  Tokenizer tok = Load(json);
  std::vector<std::string> expected = {"[CLS]", "my", "name"};
  for (char c : std::string(" is anthony ")) expected.emplace_back(1, c);
  expected.emplace_back("[SEP]");
  EXPECT_THAT(Tokens(tok, text), ElementsAreArray(expected));

  Json mask = BpeJson(CharsOf(" mynaeisthorAM\t\xE2\x80\x80"));
  mask["normalizer"] = {{"type", "Lowercase"}};
  const int64_t id = static_cast<int64_t>(mask["model"]["vocab"].size());
  mask["added_tokens"] = Json::array({AddedToken(id, "<mask>", false, true, true)});
  Tokenizer single = Load(mask);
  // "<mask> My name <mask> A<mask> <mask>ony <mask>": masks glued to words stay text.
  std::vector<int64_t> ids = Ids(single, "<mask> My name <mask> A<mask> <mask>ony <mask>");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), id), 3);
  EXPECT_EQ(ids.front(), id);
  EXPECT_EQ(ids.back(), id);

  mask["added_tokens"] = Json::array({AddedToken(id, "<mask>", false, true, true, true, true)});
  Tokenizer strip = Load(mask);
  // lstrip/rstrip swallow Unicode whitespace too, and never overlap.
  EXPECT_THAT(Tokens(strip, "Hi <mask> there\t<mask>\t<mask>\xE2\x80\x80"),
              ElementsAre("h", "i", "<mask>", "t", "h", "e", "r", "e", "<mask>", "<mask>"));
}

TEST(AddedTokensTest, LeftmostLongestAndSkippingSpecials) {
  Json json = BpeJson(CharsOf("ab "));
  const int64_t base = static_cast<int64_t>(json["model"]["vocab"].size());
  json["added_tokens"] = Json::array({AddedToken(base, "<a>", true, false),
                                      AddedToken(base + 1, "<a><b>", true, false),
                                      AddedToken(base + 2, "b>", false, false)});
  Tokenizer tok = Load(json);
  EXPECT_THAT(Tokens(tok, "a<a><b>b"), ElementsAre("a", "<a><b>", "b"));
  EXPECT_THAT(Tokens(tok, "<a>b> "), ElementsAre("<a>", "b>", " "));
  EXPECT_TRUE(tok.IsSpecial(base));
  EXPECT_FALSE(tok.IsSpecial(base + 2));
  EXPECT_FALSE(tok.IsSpecial(0));
  const std::vector<int64_t> ids = Ids(tok, "a<a>b>");
  EXPECT_EQ(DecodeOrDie(tok, ids, false), "a <a> b>");  // no decoder: joined with spaces
  EXPECT_EQ(DecodeOrDie(tok, ids, true), "a b>");
  EXPECT_EQ(tok.vocab_size(), base + 3);
  EXPECT_EQ(tok.TokenToId("<a><b>"), base + 1);
  EXPECT_EQ(tok.IdToToken(base + 2), "b>");
  EXPECT_EQ(tok.IdToToken(base + 3), std::nullopt);
}

// ---- Post-processors --------------------------------------------------------------

TEST(PostProcessorTest, TemplateAndRoberta) {
  Json json = BpeJson({"<s>", "</s>", "a"});
  json["added_tokens"] =
      Json::array({AddedToken(0, "<s>", true, false), AddedToken(1, "</s>", true, false)});
  json["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", Json::array({Json{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                              Json{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              Json{{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}})},
      {"pair", Json::array()},
      {"special_tokens",
       {{"<s>", {{"id", "<s>"}, {"ids", Json::array({0})}, {"tokens", Json::array({"<s>"})}}},
        {"</s>", {{"id", "</s>"}, {"ids", Json::array({1})}, {"tokens", Json::array({"</s>"})}}}}}};
  Tokenizer tok = Load(json);
  EXPECT_THAT(Ids(tok, "aa", true), ElementsAre(0, 2, 2, 1));
  EXPECT_THAT(Ids(tok, "aa", false), ElementsAre(2, 2));
  EXPECT_THAT(Ids(tok, "", true), ElementsAre(0, 1));
  json["post_processor"] = {{"type", "Sequence"},
                            {"processors", Json::array({Json{{"type", "ByteLevel"}},
                                                        Json{{"type", "RobertaProcessing"},
                                                             {"sep", Json::array({"</s>", 1})},
                                                             {"cls", Json::array({"<s>", 0})}}})}};
  EXPECT_THAT(Ids(Load(json), "a", true), ElementsAre(0, 2, 1));
}

// ---- Decoders ---------------------------------------------------------------------

TEST(DecoderTest, Chains) {
  const std::string u2581 = "\xE2\x96\x81";
  std::vector<std::string> vocab = {u2581 + "Hello", u2581 + "world", "!",      u2581,
                                    "<0x41>",        "<0xE2>",        "<0x82>", "<0xAC>"};
  Json json = BpeJson(vocab);
  // Llama 2's decoder.
  json["decoder"] = {
      {"type", "Sequence"},
      {"decoders",
       Json::array({Json{{"type", "Replace"}, {"pattern", {{"String", u2581}}}, {"content", " "}},
                    Json{{"type", "ByteFallback"}}, Json{{"type", "Fuse"}},
                    Json{{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}};
  Tokenizer llama = Load(json);
  EXPECT_EQ(DecodeOrDie(llama, {0, 1, 2}, false), "Hello world!");
  EXPECT_EQ(DecodeOrDie(llama, {3, 3, 0}, false), "  Hello");
  EXPECT_EQ(DecodeOrDie(llama, {5, 6, 7, 4}, false),
            "\xE2\x82\xAC"
            "A");
  EXPECT_EQ(DecodeOrDie(llama, {5, 6, 2}, false), "\xEF\xBF\xBD\xEF\xBF\xBD!");
  // Metaspace drops the replacement characters of the first token only.
  json["decoder"] = {{"type", "Metaspace"}, {"replacement", u2581}, {"prepend_scheme", "always"}};
  Tokenizer meta = Load(json);
  EXPECT_EQ(DecodeOrDie(meta, {0, 1, 2}, false), "Hello world!");
  EXPECT_EQ(DecodeOrDie(meta, {2, 0}, false), "! Hello");
  json["decoder"]["prepend_scheme"] = "never";
  EXPECT_EQ(DecodeOrDie(Load(json), {0, 1}, false), " Hello world");
  // Strip at both ends.
  json["decoder"] = {{"type", "Strip"}, {"content", "!"}, {"start", 0}, {"stop", 1}};
  EXPECT_EQ(DecodeOrDie(Load(json), {2, 0}, false), u2581 + "Hello");
}

TEST(DecoderTest, ByteLevelIsLossy) {
  std::vector<std::string> vocab = ByteAlphabet();
  vocab.emplace_back("<|end|>");
  Json json = BpeJson(vocab);
  json["decoder"] = {{"type", "ByteLevel"}};
  json["added_tokens"] = Json::array({AddedToken(256, "<|end|>", true, false)});
  Tokenizer tok = Load(json);
  const std::vector<std::string>& symbols = ByteToSymbol();
  auto id = [&](int byte) { return *tok.TokenToId(symbols[byte]); };
  EXPECT_EQ(DecodeOrDie(tok, {id('a'), id(0xE2), id(0x82), id(0xAC)}, false), "a\xE2\x82\xAC");
  // An incomplete character at the end and a stray continuation byte: one U+FFFD each.
  EXPECT_EQ(DecodeOrDie(tok, {id(0xE2), id(0x82), id('a'), id(0x82)}, false),
            "\xEF\xBF\xBD"
            "a\xEF\xBF\xBD");
  EXPECT_EQ(DecodeOrDie(tok, {id('a'), 256, id('b')}, false), "a<|end|>b");
  EXPECT_EQ(DecodeOrDie(tok, {id('a'), 256, id('b')}, true), "ab");
}

// The raw bytes each token adds in the middle of a text (what a grammar
// matches): Llama 2's chain keeps a word's leading space and a byte token's
// byte; byte-level tokens give their bytes even when they are part of a
// character; added tokens their content.
TEST(DecoderTest, TokenBytes) {
  const std::string u2581 = "\xE2\x96\x81";
  Json json = BpeJson({u2581 + "Hello", "!", "<0xE2>", "<0x41>"});
  json["decoder"] = {
      {"type", "Sequence"},
      {"decoders",
       Json::array({Json{{"type", "Replace"}, {"pattern", {{"String", u2581}}}, {"content", " "}},
                    Json{{"type", "ByteFallback"}}, Json{{"type", "Fuse"}},
                    Json{{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}};
  Tokenizer llama = Load(json);
  EXPECT_THAT(llama.TokenBytes(0), test::IsOkAndHolds(std::string(" Hello")));
  EXPECT_THAT(llama.TokenBytes(1), test::IsOkAndHolds(std::string("!")));
  EXPECT_THAT(llama.TokenBytes(2), test::IsOkAndHolds(std::string("\xE2")));
  EXPECT_THAT(llama.TokenBytes(3), test::IsOkAndHolds(std::string("A")));
  EXPECT_THAT(llama.TokenBytes(4), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("4")));

  std::vector<std::string> vocab = ByteAlphabet();
  const std::vector<std::string>& symbols = ByteToSymbol();
  vocab.push_back(symbols[' '] + "w");
  vocab.emplace_back("<|end|>");
  Json byte_level = BpeJson(vocab);
  byte_level["decoder"] = {{"type", "ByteLevel"}};
  byte_level["added_tokens"] = Json::array({AddedToken(257, "<|end|>", true, false)});
  Tokenizer tok = Load(byte_level);
  EXPECT_THAT(tok.TokenBytes(*tok.TokenToId(symbols[0xE2])),
              test::IsOkAndHolds(std::string("\xE2")));
  EXPECT_THAT(tok.TokenBytes(256), test::IsOkAndHolds(std::string(" w")));
  EXPECT_THAT(tok.TokenBytes(257), test::IsOkAndHolds(std::string("<|end|>")));
}

TEST(UnicodeTest, LossyUtf8MatchesRust) {
  using internal::LossyUtf8;
  EXPECT_EQ(LossyUtf8("ab"), "ab");
  // Rust's documented example: maximal subparts each give one U+FFFD.
  EXPECT_EQ(LossyUtf8("Hello \xF0\x90\x80World"), "Hello \xEF\xBF\xBDWorld");
  EXPECT_EQ(LossyUtf8("\xC0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(LossyUtf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(LossyUtf8("\xE2\x82"), "\xEF\xBF\xBD");
  EXPECT_EQ(LossyUtf8("\xF4\x90\x80\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(RegexTest, OnigurumaWhitespaceIsUnicode) {
  ACCEL_ASSERT_OK_AND_ASSIGN(auto regex, internal::Regex::FromOniguruma("\\s+"));
  std::vector<std::pair<size_t, size_t>> matches;
  const std::string text =
      "a\xC2\xA0"
      "b\xE3\x80\x80"
      "c\xC2\x85"
      "d\xE2\x80\x8B"
      "e\xE2\x80\xA8"
      "f\x0B"
      "g";
  regex->FindAll(text, &matches);
  // U+00A0, U+3000, U+0085, U+2028, \v are whitespace; U+200B is not.
  EXPECT_THAT(matches,
              ElementsAre(std::make_pair(1, 3), std::make_pair(4, 7), std::make_pair(8, 10),
                          std::make_pair(15, 18), std::make_pair(19, 20)));
  ACCEL_ASSERT_OK_AND_ASSIGN(auto digits, internal::Regex::FromOniguruma("\\d+"));
  matches.clear();
  digits->FindAll("a12\xD9\xA3x", &matches);  // Arabic-Indic three is \d
  EXPECT_THAT(matches, ElementsAre(std::make_pair(1, 5)));
}

TEST(RegexTest, EmptyMatchesFollowOnigFindIter) {
  ACCEL_ASSERT_OK_AND_ASSIGN(auto regex, internal::Regex::FromOniguruma("a*"));
  std::vector<std::pair<size_t, size_t>> matches;
  regex->FindAll("baab", &matches);
  // Empty at 0, "aa" at 1, then no empty match right after it, empty at the end.
  EXPECT_THAT(matches,
              ElementsAre(std::make_pair(0, 0), std::make_pair(1, 3), std::make_pair(4, 4)));
}

// ---- Round trips, streams, threads ---------------------------------------------------

// The tokenizer accel-make-model writes (same merges, same special tokens).
Tokenizer GeneratorTokenizer() {
  auto merges = TrainMerges(SampleEnglishText(), 400);
  std::string json =
      ByteLevelTokenizerJson(merges, {{"<|begin_of_text|>", 1000}, {"<|end_of_text|>", 1001}});
  absl::StatusOr<Tokenizer> tok = Tokenizer::FromJson(json, "generated");
  EXPECT_THAT(tok, IsOk());
  if (!tok.ok()) std::abort();
  return *std::move(tok);
}

std::string RandomUtf8(std::mt19937_64& rng) {
  static const std::vector<std::pair<char32_t, char32_t>> kRanges = {
      {0x20, 0x7E},     {0x09, 0x0D},       {0xA0, 0x2FF}, {0x400, 0x4FF},   {0x3000, 0x30FF},
      {0x4E00, 0x4FFF}, {0x1F300, 0x1F64F}, {0x0, 0x1F},   {0xE000, 0xFFFD}, {0x10000, 0x10FFFF}};
  std::string out;
  const int n = static_cast<int>(rng() % 40);
  for (int i = 0; i < n; ++i) {
    const auto& [lo, hi] = kRanges[rng() % kRanges.size()];
    internal::AppendUtf8(static_cast<char32_t>(lo + rng() % (hi - lo + 1)), &out);
    if (rng() % 4 == 0) out.push_back(' ');
  }
  return out;
}

TEST(RoundTripTest, ByteLevelDecodesWhatItEncodes) {
  Tokenizer tok = GeneratorTokenizer();
  std::mt19937_64 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const std::string text = RandomUtf8(rng);
    const std::vector<int64_t> ids = Ids(tok, text, true);
    ASSERT_EQ(DecodeOrDie(tok, ids, false), text) << absl::CEscape(text);
  }
  const std::string sample(SampleEnglishText());
  const std::vector<int64_t> ids = Ids(tok, sample);
  EXPECT_LT(ids.size() * 2, sample.size()) << "the merges should compress English";
  EXPECT_EQ(DecodeOrDie(tok, ids, true), sample);
  EXPECT_TRUE(tok.IsSpecial(1000));
  EXPECT_TRUE(tok.IsSpecial(1001));
  EXPECT_THAT(Ids(tok, "<|end_of_text|>"), ElementsAre(1001));
}

// Feeds `ids` to an IncrementalDecoder and checks each piece and the total.
void ExpectStreamMatchesDecode(const Tokenizer& tok, const std::vector<int64_t>& ids, bool skip) {
  IncrementalDecoder stream(tok, skip);
  std::string streamed;
  for (int64_t id : ids) {
    absl::StatusOr<std::string> piece = stream.Next(id);
    ASSERT_THAT(piece, IsOk());
    EXPECT_TRUE(internal::IsValidUtf8(*piece)) << absl::CEscape(*piece);
    streamed += *piece;
  }
  const std::string rest = stream.Flush();
  EXPECT_TRUE(internal::IsValidUtf8(rest));
  EXPECT_EQ(streamed + rest, DecodeOrDie(tok, ids, skip));
}

TEST(IncrementalDecoderTest, ByteLevelStreamsEqualDecode) {
  Tokenizer tok = GeneratorTokenizer();
  std::mt19937_64 rng(11);
  for (int i = 0; i < 300; ++i) {
    ExpectStreamMatchesDecode(tok, Ids(tok, RandomUtf8(rng), true), i % 2 == 0);
    std::vector<int64_t> random_ids;
    random_ids.reserve(12);
    for (int k = 0; k < 12; ++k) random_ids.push_back(static_cast<int64_t>(rng() % 1002));
    ExpectStreamMatchesDecode(tok, random_ids, i % 2 == 0);
  }
}

TEST(IncrementalDecoderTest, HoldsByteFallbackRunsUntilTheyEnd) {
  std::vector<std::string> vocab = {"<unk>", "<s>",
                                    "\xE2\x96\x81"
                                    "b"};
  for (int b = 0; b < 256; ++b) vocab.push_back(absl::StrFormat("<0x%02X>", b));
  Json json = BpeJson(vocab);
  json["model"]["byte_fallback"] = true;
  json["added_tokens"] = Json::array({AddedToken(1, "<s>", true, false)});
  json["decoder"] = {
      {"type", "Sequence"},
      {"decoders",
       Json::array(
           {Json{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
            Json{{"type", "ByteFallback"}}, Json{{"type", "Fuse"}},
            Json{{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}};
  Tokenizer tok = Load(json);
  auto byte = [&](int b) { return *tok.TokenToId(absl::StrFormat("<0x%02X>", b)); };
  // "A" then E2 alone: the run [41 E2] is invalid as a whole, so "A" must not
  // be returned before the run ends.
  ExpectStreamMatchesDecode(tok, {byte(0x41), byte(0xE2), 2}, false);
  ExpectStreamMatchesDecode(tok, {byte(0xE2), 1, byte(0x82), byte(0xAC), 2}, true);
  ExpectStreamMatchesDecode(tok, {2, 2, byte(0x20), 2}, false);
  IncrementalDecoder stream(tok, false);
  EXPECT_EQ(*stream.Next(byte(0x41)), "");
  EXPECT_EQ(*stream.Next(2), "A b");
  EXPECT_EQ(stream.Flush(), "");
}

TEST(TokenizerThreadsTest, ConcurrentEncodesAgree) {
  Tokenizer tok = GeneratorTokenizer();
  std::mt19937_64 rng(3);
  std::vector<std::string> texts;
  texts.reserve(200);
  for (int i = 0; i < 200; ++i) texts.push_back(RandomUtf8(rng) + " the server and the model");
  std::vector<std::vector<int64_t>> expected;
  expected.reserve(texts.size());
  for (const std::string& t : texts) expected.push_back(Ids(tok, t));
  std::vector<std::thread> threads;
  threads.reserve(4);
  std::vector<int> failures(4, 0);
  for (size_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      // A copy per thread: copies share the tables and the cache, which is what runs here.
      // NOLINTNEXTLINE(performance-unnecessary-copy-initialization)
      const Tokenizer copy = tok;
      for (int round = 0; round < 5; ++round) {
        for (size_t i = 0; i < texts.size(); ++i) {
          const size_t k = (i + t * 37) % texts.size();
          auto ids = copy.Encode(texts[k], false);
          if (!ids.ok() || *ids != expected[k]) ++failures[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_THAT(failures, ElementsAre(0, 0, 0, 0));
}

}  // namespace
}  // namespace accel::tokenizer
