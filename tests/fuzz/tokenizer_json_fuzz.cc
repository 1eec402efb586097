// libFuzzer target for tokenizer.json (tokenizer/tokenizer.h; scripts/fuzz.sh
// runs it). Any input must load or give InvalidArgument / Unimplemented; a
// tokenizer that loads must encode and decode a few fixed inputs, and stream
// its ids, without crashing and with valid UTF-8 text. (That a stream equals
// Decode is checked by tokenizer_encode_fuzz and the reference test: decoder
// chains made up here, like Strip of several characters, may legitimately
// differ.)
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "tokenizer/internal/unicode.h"
#include "tokenizer/tokenizer.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void Exercise(const accel::tokenizer::Tokenizer& tok) {
  const std::vector<int64_t> empty;
  for (absl::string_view text :
       {absl::string_view("Hello world, it's 2024!\n  x\t\xC3\xA9\xE4\xBD\xA0 <s> <|endoftext|>"),
        absl::string_view(""), absl::string_view(" "), absl::string_view("ab  \xE2\x96\x81")}) {
    for (bool special : {false, true}) {
      absl::StatusOr<std::vector<int64_t>> ids = tok.Encode(text, special);
      if (!ids.ok()) {
        // Only a missing unk_token fails an encode of valid UTF-8.
        Check(ids.status().code() == absl::StatusCode::kInvalidArgument);
        continue;
      }
      if (special) {
        // A post-processor may name any id, as in HF; decoding then refuses it.
        absl::StatusOr<std::string> text = tok.Decode(*ids, true);
        Check(text.ok() || text.status().code() == absl::StatusCode::kInvalidArgument);
        continue;
      }
      for (int64_t id : *ids) Check(id >= 0 && id < tok.vocab_size());
      Check(tok.Decode(*ids, true).ok());
    }
  }
  // Every id up to a bound, as one sequence and as a stream.
  std::vector<int64_t> ids;
  for (int64_t id = 0; id < tok.vocab_size() && id < 300; ++id) ids.push_back(id);
  for (bool skip : {false, true}) {
    absl::StatusOr<std::string> text = tok.Decode(ids, skip);
    Check(text.ok() && accel::tokenizer::internal::IsValidUtf8(*text));
    accel::tokenizer::IncrementalDecoder stream(tok, skip);
    for (int64_t id : ids) {
      absl::StatusOr<std::string> piece = stream.Next(id);
      Check(piece.ok() && accel::tokenizer::internal::IsValidUtf8(*piece));
    }
    Check(accel::tokenizer::internal::IsValidUtf8(stream.Flush()));
  }
  Check(!tok.Decode({tok.vocab_size()}, false).ok());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view json(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<accel::tokenizer::Tokenizer> tok =
      accel::tokenizer::Tokenizer::FromJson(json, "fuzz.json");
  if (!tok.ok()) {
    const absl::StatusCode code = tok.status().code();
    Check(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kUnimplemented);
    return 0;
  }
  Exercise(*tok);
  return 0;
}
