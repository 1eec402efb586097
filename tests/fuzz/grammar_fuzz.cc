// libFuzzer target for the grammar front ends (grammar/; scripts/fuzz.sh
// runs it). The first byte picks one: GBNF, JSON Schema or a regular
// expression; the rest is the text. Any input must compile or give
// InvalidArgument; a compiled grammar must answer Matches and run a short
// masked walk over a byte vocabulary without crashing, leaking or hanging.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"

#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

const std::shared_ptr<const accel::grammar::TokenVocabulary>& Bytes() {
  static const auto* vocab = [] {
    std::vector<std::string> tokens;
    for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
    for (const char* t : {"{\"", "\": ", "\",", "true", "null", "12", "\xC3", "\xA9", "ab"}) {
      tokens.emplace_back(t);
    }
    tokens.emplace_back("</s>");
    std::vector<bool> special(tokens.size(), false);
    special.back() = true;
    return new std::shared_ptr<const accel::grammar::TokenVocabulary>(
        accel::grammar::TokenVocabulary::Create(tokens, special));
  }();
  return *vocab;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Longer texts only repeat what short ones reach, at a cost in runs.
  if (size == 0 || size > 4096) return 0;
  const int mode = data[0] % 3;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  absl::StatusOr<std::shared_ptr<const accel::grammar::Grammar>> grammar;
  if (mode == 0) {
    grammar = accel::grammar::ParseGbnf(text);
  } else if (mode == 1) {
    auto gbnf = accel::grammar::JsonSchemaToGbnf(text);
    if (!gbnf.ok()) {
      Check(gbnf.status().code() == absl::StatusCode::kInvalidArgument);
      return 0;
    }
    grammar = accel::grammar::ParseGbnf(*gbnf, "json_schema");
    // What the converter writes always parses (or hits a stated limit).
    Check(grammar.ok() || absl::StrContains(grammar.status().message(), "limit"));
  } else {
    grammar = accel::grammar::CompileRegex(text);
  }
  if (!grammar.ok()) {
    Check(grammar.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  (void)(*grammar)->Matches(text);
  (void)(*grammar)->Matches("");
  (void)(*grammar)->Matches("{\"a\": 1}");
  const auto& vocab = Bytes();
  accel::grammar::GrammarMatcher matcher(accel::grammar::CompiledGrammar::Create(*grammar, vocab),
                                         {vocab->size() - 1});
  std::vector<uint64_t> mask(matcher.mask_words());
  uint32_t seed = static_cast<uint32_t>(size);
  for (int step = 0; step < 8; ++step) {
    const int64_t allowed = matcher.FillNextTokenBitmask(mask.data());
    Check(allowed > 0);
    seed = seed * 1103515245u + 12345u;
    int64_t pick = seed % vocab->size();
    while (!(mask[pick >> 6] >> (pick & 63) & 1)) pick = (pick + 1) % vocab->size();
    Check(matcher.AcceptToken(pick));
    if (matcher.IsTerminated()) break;
  }
  matcher.Rollback(3);
  return 0;
}
