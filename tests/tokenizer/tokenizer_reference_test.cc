// Checks tokenizer/tokenizer.h against HuggingFace tokenizers (Rust) on real
// tokenizer.json files: every encoding (with and without special tokens),
// every decoding (skipping special tokens or not) of the corpus and of random
// id sequences that scripts/tokenizer_references.sh wrote with the library
// itself, and the IncrementalDecoder on all of them. The references live in
// $ACCEL_TOKENIZER_REFS, by default <build>/tokenizer-refs next to
// $ACCEL_BIN_DIR (<build>/bin, which CMake passes); without them every test
// here fails.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "tests/testing/status_matchers.h"
#include "tokenizer/internal/unicode.h"
#include "tokenizer/tokenizer.h"

namespace accel::tokenizer {
namespace {

using Json = nlohmann::json;

// Mismatches printed in full per test; the rest are counted.
constexpr int kMaxReports = 15;

std::string RefsDir() {
  if (const char* dir = std::getenv("ACCEL_TOKENIZER_REFS"); dir != nullptr) return dir;
  const char* bin = std::getenv("ACCEL_BIN_DIR");
  return bin == nullptr ? std::string("build/tokenizer-refs")
                        : std::string(bin) + "/../tokenizer-refs";
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::string Show(const std::vector<int64_t>& ids) { return "[" + absl::StrJoin(ids, ", ") + "]"; }

class TokenizerReferenceTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const std::string dir = RefsDir();
    const std::string refs = dir + "/" + GetParam() + ".refs.json";
    if (dir.empty() || !std::filesystem::exists(refs)) {
      GTEST_FAIL() << "no reference file " << refs << " (ACCEL_TOKENIZER_REFS=" << dir
                   << "): run scripts/tokenizer_references.sh "
                   << "build (it writes build/tokenizer-refs/ with HuggingFace tokenizers)";
    }
    refs_ = Json::parse(ReadAll(refs));
    const std::string file = dir + "/" + refs_["tokenizer"].get<std::string>();
    absl::StatusOr<Tokenizer> tok = Tokenizer::FromFile(file);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = std::make_unique<Tokenizer>(*std::move(tok));
  }

  // Reports a mismatch (the first few in full) and counts it.
  void Mismatch(const std::string& what, const std::string& text, const std::string& expected,
                const std::string& actual) {
    if (++mismatches_ <= kMaxReports) {
      ADD_FAILURE() << GetParam() << ": " << what << "\n  text:     \"" << absl::CEscape(text)
                    << "\"\n  expected: " << expected << "\n  actual:   " << actual;
    }
  }

  void Summarize(const std::string& what, int cases) {
    EXPECT_EQ(mismatches_, 0) << GetParam() << ": " << mismatches_ << " of " << cases << " " << what
                              << " differ from HuggingFace tokenizers";
    std::cout << GetParam() << ": " << cases << " " << what << ", " << mismatches_
              << " mismatches\n";
  }

  std::vector<int64_t> IdsOf(const Json& list) { return list.get<std::vector<int64_t>>(); }

  // Streams `ids` and compares with `expected` (= Decode).
  void CheckStream(const std::string& label, const std::string& text,
                   const std::vector<int64_t>& ids, bool skip, const std::string& expected) {
    IncrementalDecoder stream(*tokenizer_, skip);
    std::string streamed;
    for (int64_t id : ids) {
      absl::StatusOr<std::string> piece = stream.Next(id);
      if (!piece.ok()) {
        Mismatch(label + " (stream error)", text, "ok", piece.status().ToString());
        return;
      }
      if (!internal::IsValidUtf8(*piece)) {
        Mismatch(label + " (stream piece not UTF-8)", text, "valid UTF-8",
                 "\"" + absl::CEscape(*piece) + "\"");
        return;
      }
      streamed += *piece;
    }
    streamed += stream.Flush();
    if (streamed != expected) {
      Mismatch(label + " (stream)", text, "\"" + absl::CEscape(expected) + "\"",
               "\"" + absl::CEscape(streamed) + "\"");
    }
  }

  Json refs_;
  std::unique_ptr<Tokenizer> tokenizer_;
  int mismatches_ = 0;
};

TEST_P(TokenizerReferenceTest, Encode) {
  int cases = 0;
  for (const Json& c : refs_["encode"]) {
    const std::string text = c["text"].get<std::string>();
    for (bool special : {true, false}) {
      ++cases;
      const std::vector<int64_t> expected = IdsOf(c[special ? "ids_special" : "ids_plain"]);
      absl::StatusOr<std::vector<int64_t>> ids = tokenizer_->Encode(text, special);
      if (!ids.ok()) {
        Mismatch(absl::StrCat("encode add_special_tokens=", special), text, Show(expected),
                 ids.status().ToString());
      } else if (*ids != expected) {
        Mismatch(absl::StrCat("encode add_special_tokens=", special), text, Show(expected),
                 Show(*ids));
      }
    }
  }
  EXPECT_GT(cases, 800);
  Summarize("encodings", cases);
}

TEST_P(TokenizerReferenceTest, Decode) {
  int cases = 0;
  auto check = [&](const std::string& label, const std::string& text,
                   const std::vector<int64_t>& ids, bool skip, const std::string& expected) {
    ++cases;
    absl::StatusOr<std::string> decoded = tokenizer_->Decode(ids, skip);
    if (!decoded.ok()) {
      Mismatch(label, text, "\"" + absl::CEscape(expected) + "\"", decoded.status().ToString());
    } else if (*decoded != expected) {
      Mismatch(label + " " + Show(ids), text, "\"" + absl::CEscape(expected) + "\"",
               "\"" + absl::CEscape(*decoded) + "\"");
    }
  };
  for (const Json& c : refs_["encode"]) {
    const std::string text = c["text"].get<std::string>();
    const std::vector<int64_t> special = IdsOf(c["ids_special"]);
    const std::vector<int64_t> plain = IdsOf(c["ids_plain"]);
    check("decode of ids_special, keep", text, special, false, c["decode_special_keep"]);
    check("decode of ids_special, skip", text, special, true, c["decode_special_skip"]);
    check("decode of ids_plain, keep", text, plain, false, c["decode_plain_keep"]);
    check("decode of ids_plain, skip", text, plain, true, c["decode_plain_skip"]);
  }
  for (const Json& c : refs_["decode"]) {
    check("decode of random ids", "", IdsOf(c["ids"]), c["skip_special_tokens"].get<bool>(),
          c["text"]);
  }
  EXPECT_GT(cases, 2000);
  Summarize("decodings", cases);
}

TEST_P(TokenizerReferenceTest, IncrementalDecoderEqualsDecode) {
  int cases = 0;
  for (const Json& c : refs_["encode"]) {
    const std::string text = c["text"].get<std::string>();
    cases += 2;
    CheckStream("ids_special, keep", text, IdsOf(c["ids_special"]), false,
                c["decode_special_keep"]);
    CheckStream("ids_plain, skip", text, IdsOf(c["ids_plain"]), true, c["decode_plain_skip"]);
  }
  for (const Json& c : refs_["decode"]) {
    ++cases;
    CheckStream(absl::StrCat("random ids ", Show(IdsOf(c["ids"]))), "", IdsOf(c["ids"]),
                c["skip_special_tokens"].get<bool>(), c["text"]);
  }
  Summarize("streams", cases);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, TokenizerReferenceTest,
                         ::testing::Values("llama2", "llama2-metaspace", "llama3", "qwen3", "gpt2",
                                           "accel-make-model", "synthetic-sentencepiece",
                                           "synthetic-bytelevel", "synthetic-whitespace"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace accel::tokenizer
