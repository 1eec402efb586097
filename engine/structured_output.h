// engine/structured_output.h: grammar-constrained decoding for the engine
// (GenerationRequest::structured): each request's grammar (a JSON Schema,
// any JSON object, a regular expression, a choice list or GBNF) compiled
// against the model's vocabulary once and cached, and run per request by a
// logits processor (engine/grammar_logits_processor.h) that masks every
// sampled position to the tokens the grammar allows, the stop tokens only
// where it may end. Torch-free.
#ifndef ACCEL_ENGINE_STRUCTURED_OUTPUT_H_
#define ACCEL_ENGINE_STRUCTURED_OUTPUT_H_

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

#include "engine/request.h"
#include "grammar/matcher.h"
#include "tokenizer/tokenizer.h"

namespace accel::engine {

class StructuredOutputCompiler {
 public:
  // The vocabulary of `tokenizer`, padded with tokens no grammar allows up to
  // `model_vocab_size` (a model's embedding may be larger than its tokenizer).
  StructuredOutputCompiler(const tokenizer::Tokenizer& tokenizer, int64_t model_vocab_size);

  // The request's grammar, compiled (from the cache when seen before).
  // InvalidArgument naming the field ("response_format.json_schema: ...",
  // "guided_regex: ...") when it does not compile, or when more than one
  // kind is set.
  absl::StatusOr<std::shared_ptr<grammar::CompiledGrammar>> Compile(
      const StructuredOutputs& structured);
  const grammar::TokenVocabulary& vocabulary() const { return *vocabulary_; }

 private:
  std::shared_ptr<const grammar::TokenVocabulary> vocabulary_;
  absl::Mutex mu_;
  // key -> compiled, most recently used first (kCapacity of them).
  std::list<std::pair<std::string, std::shared_ptr<grammar::CompiledGrammar>>> lru_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, decltype(lru_)::iterator> index_ ABSL_GUARDED_BY(mu_);
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_STRUCTURED_OUTPUT_H_
