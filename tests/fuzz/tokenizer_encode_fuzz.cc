// libFuzzer target for encoding and decoding (tokenizer/tokenizer.h;
// scripts/fuzz.sh runs it) with fixed byte-level tokenizers built in: the one
// accel-make-model writes (GPT-2's pattern), and the same vocabulary behind
// Llama 3's and Qwen2's split patterns with added tokens. The first byte
// picks the tokenizer and the mode; the rest is the text, or ids to decode.
//
// Text: valid UTF-8 must encode, and Decode(Encode(x)) must be x (byte-level
// BPE loses nothing); anything else must be InvalidArgument. Ids: Decode
// must succeed. Either way an IncrementalDecoder over the ids must return
// valid UTF-8 pieces that add up to Decode.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "tokenizer/bpe_trainer.h"
#include "tokenizer/internal/unicode.h"
#include "tokenizer/tokenizer.h"

namespace {

using accel::tokenizer::IncrementalDecoder;
using accel::tokenizer::Tokenizer;
using Json = nlohmann::json;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

constexpr const char* kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

Json AddedToken(int64_t id, const char* content, bool special, bool normalized, bool single_word) {
  return Json{{"id", id},          {"content", content}, {"single_word", single_word},
              {"lstrip", false},   {"rstrip", false},    {"normalized", normalized},
              {"special", special}};
}

std::vector<Tokenizer> MakeTokenizers() {
  const auto merges = accel::tokenizer::TrainMerges(accel::tokenizer::SampleEnglishText(), 300);
  const Json base = Json::parse(accel::tokenizer::ByteLevelTokenizerJson(
      merges, {{"<|begin_of_text|>", 600}, {"<|end_of_text|>", 601}}));
  std::vector<Json> variants = {base, base, base};
  for (int k : {1, 2}) {
    Json split = {{"type", "Split"},
                  {"pattern", {{"Regex", k == 1 ? kLlama3Pattern : kQwen2Pattern}}},
                  {"behavior", "Isolated"},
                  {"invert", false}};
    Json byte_level = {{"type", "ByteLevel"},
                       {"add_prefix_space", false},
                       {"trim_offsets", true},
                       {"use_regex", false}};
    variants[k]["pre_tokenizer"] = {{"type", "Sequence"},
                                    {"pretokenizers", Json::array({split, byte_level})}};
    variants[k]["added_tokens"].push_back(AddedToken(602, "<tool_call>", false, false, false));
    variants[k]["added_tokens"].push_back(AddedToken(603, "hello", false, true, true));
  }
  variants[1]["model"]["ignore_merges"] = true;
  std::vector<Tokenizer> out;
  for (const Json& v : variants) {
    absl::StatusOr<Tokenizer> tok = Tokenizer::FromJson(v.dump(), "fuzz-builtin");
    Check(tok.ok());
    out.push_back(*std::move(tok));
  }
  return out;
}

void CheckStream(const Tokenizer& tok, const std::vector<int64_t>& ids, bool skip,
                 const std::string& expected) {
  IncrementalDecoder stream(tok, skip);
  std::string streamed;
  for (int64_t id : ids) {
    absl::StatusOr<std::string> piece = stream.Next(id);
    Check(piece.ok() && accel::tokenizer::internal::IsValidUtf8(*piece));
    streamed += *piece;
  }
  const std::string rest = stream.Flush();
  Check(accel::tokenizer::internal::IsValidUtf8(rest));
  Check(streamed + rest == expected);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<Tokenizer>* const kTokenizers =
      new std::vector<Tokenizer>(MakeTokenizers());
  if (size == 0) return 0;
  const Tokenizer& tok = (*kTokenizers)[data[0] % kTokenizers->size()];
  const bool decode_mode = (data[0] & 0x80) != 0;
  const bool skip = (data[0] & 0x40) != 0;
  absl::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);

  if (decode_mode) {
    // Two bytes per id, folded into the vocabulary.
    std::vector<int64_t> ids;
    for (size_t i = 0; i + 1 < rest.size(); i += 2) {
      const int64_t raw =
          static_cast<unsigned char>(rest[i]) << 8 | static_cast<unsigned char>(rest[i + 1]);
      ids.push_back(raw % tok.vocab_size());
    }
    absl::StatusOr<std::string> text = tok.Decode(ids, skip);
    Check(text.ok() && accel::tokenizer::internal::IsValidUtf8(*text));
    CheckStream(tok, ids, skip, *text);
    return 0;
  }

  absl::StatusOr<std::vector<int64_t>> ids = tok.Encode(rest, /*add_special_tokens=*/true);
  if (!accel::tokenizer::internal::IsValidUtf8(rest)) {
    Check(!ids.ok() && ids.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  Check(ids.ok());
  absl::StatusOr<std::string> text = tok.Decode(*ids, /*skip_special_tokens=*/false);
  Check(text.ok() && *text == rest);
  CheckStream(tok, *ids, false, *text);
  absl::StatusOr<std::string> skipped = tok.Decode(*ids, true);
  Check(skipped.ok());
  CheckStream(tok, *ids, true, *skipped);
  return 0;
}
