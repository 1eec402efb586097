#include "engine/structured_output.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "grammar/grammar.h"
#include "grammar/json_schema.h"

namespace accel::engine {
namespace {

constexpr size_t kCapacity = 64;

absl::Status Named(absl::string_view field, const absl::Status& status) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", status.message()));
}

}  // namespace

StructuredOutputCompiler::StructuredOutputCompiler(const tokenizer::Tokenizer& tokenizer,
                                                   int64_t model_vocab_size) {
  const int64_t n = std::max(model_vocab_size, tokenizer.vocab_size());
  std::vector<std::string> bytes(static_cast<size_t>(n));
  std::vector<bool> special(static_cast<size_t>(n), true);
  for (int64_t id = 0; id < tokenizer.vocab_size(); ++id) {
    absl::StatusOr<std::string> b = tokenizer.TokenBytes(id);
    if (!b.ok()) continue;
    bytes[id] = *std::move(b);
    special[id] = tokenizer.IsSpecial(id);
  }
  vocabulary_ = grammar::TokenVocabulary::Create(std::move(bytes), std::move(special));
}

absl::StatusOr<std::shared_ptr<grammar::CompiledGrammar>> StructuredOutputCompiler::Compile(
    const StructuredOutputs& s) {
  std::vector<std::string> kinds;
  if (!s.json_schema.empty()) kinds.push_back("json");
  if (s.json_object) kinds.push_back("json_object");
  if (!s.regex.empty()) kinds.push_back("regex");
  if (!s.choice.empty()) kinds.push_back("choice");
  if (!s.grammar.empty()) kinds.push_back("grammar");
  if (kinds.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        s.field, ": exactly one of json, json_object, regex, choice or grammar must be given",
        kinds.empty() ? "" : absl::StrCat(" (got ", absl::StrJoin(kinds, ", "), ")")));
  }
  const std::string key = absl::StrCat(kinds[0], "\n", s.json_schema, s.regex,
                                       absl::StrJoin(s.choice, "\x1f"), s.grammar);
  {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(key);
    if (it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->second;
    }
  }
  absl::StatusOr<std::shared_ptr<const grammar::Grammar>> compiled;
  if (!s.json_schema.empty()) {
    compiled = grammar::CompileJsonSchema(s.json_schema);
  } else if (s.json_object) {
    compiled = grammar::JsonObjectGrammar();
  } else if (!s.regex.empty()) {
    compiled = grammar::CompileRegex(s.regex);
  } else if (!s.choice.empty()) {
    compiled = grammar::CompileChoices(s.choice);
  } else {
    compiled = grammar::ParseGbnf(s.grammar, "grammar");
  }
  if (!compiled.ok()) return Named(s.field, compiled.status());
  auto bound = grammar::CompiledGrammar::Create(*std::move(compiled), vocabulary_);
  absl::MutexLock lock(&mu_);
  if (index_.count(key) == 0) {
    lru_.emplace_front(key, bound);
    index_[key] = lru_.begin();
    while (lru_.size() > kCapacity) {
      index_.erase(lru_.back().first);
      lru_.pop_back();
    }
  }
  return bound;
}

}  // namespace accel::engine
