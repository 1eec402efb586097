// models/generator.h: text generation over a CausalLM with continuous
// batching. Requests join (Add) and leave (they finish, or Cancel) between
// steps; each Step() is one Forward() over every running sequence, prompts
// of new ones and the last token of the others packed together, so the
// weights are read once per step whatever the batch.
//
//   Generator generator(model, dispatched.get(), TokenizerTextStreams(tokenizer));
//   ACCEL_ASSIGN_OR_RETURN(uint64_t id, generator.Add(request));
//   while (generator.running() > 0) {
//     ACCEL_ASSIGN_OR_RETURN(std::vector<TokenEvent> events, generator.Step());
//     for (const TokenEvent& e : events) std::cout << e.text;  // streams valid UTF-8
//   }
//
// Not thread-safe: one thread (the server's scheduler) drives a Generator.
#ifndef ACCEL_MODELS_GENERATOR_H_
#define ACCEL_MODELS_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "dispatch/dispatch.h"
#include "models/causal_lm.h"
#include "models/generation_request.h"
#include "models/sampling.h"

namespace accel::models {

enum class FinishReason {
  kLength,  // max_new_tokens, or the model's position limit
  kEos,     // a stop token id was generated (it is the last of token_ids)
  kStop,    // a stop string appeared in the text (which ends before it)
};
// "length", "eos", "stop".
absl::string_view FinishReasonName(FinishReason reason);

// Turns one sequence's generated ids into text as they arrive: every piece
// is valid UTF-8 and the pieces plus Flush() are the decoded text (a
// tokenizer's incremental decoder). An id the tokenizer lacks (models often
// pad their vocabulary past the tokenizer's) decodes to nothing, as
// HuggingFace's decode skips it.
class TextStream {
 public:
  virtual ~TextStream() = default;
  virtual std::string Next(int64_t id) = 0;
  virtual std::string Flush() = 0;
};
using TextStreamFactory = std::function<std::unique_ptr<TextStream>()>;

class Tokenizer;
// Text streams from the tokenizer's incremental decoder, skipping special
// tokens (so an eos reads as nothing). The factory keeps its own copy of
// the tokenizer (a shared, immutable table).
TextStreamFactory TokenizerTextStreams(const Tokenizer& tokenizer);

// What one step produced for one sequence.
struct TokenEvent {
  uint64_t sequence = 0;
  int64_t token_id = 0;
  // log p(token) under the model's own distribution (log-softmax of the raw
  // logits, before sampling's processing); set when the request asked.
  std::optional<float> logprob;
  std::string text;  // text that became final with this token (may be empty)
  std::optional<FinishReason> finish;
};

class Generator {
 public:
  // `dispatched` may be null (a model with real weights on one device).
  // Without `text_streams`, events carry no text and stop strings are refused.
  Generator(std::shared_ptr<CausalLM> model, dispatch::DispatchedModel* dispatched,
            TextStreamFactory text_streams = nullptr);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Validates (ValidateGenerationRequest, with the model's position limit
  // for the prompt) and queues a request on prompt_ids; it starts with the
  // next Step(). max_new_tokens 0 is kDefaultMaxNewTokens; generation ends
  // at the model's position limit whatever max_new_tokens says.
  absl::StatusOr<uint64_t> Add(GenerationRequest request);

  // One forward pass over every running sequence and one token for each.
  // Finished sequences are removed (their KV caches freed) before it
  // returns. On an error nothing advances: the step can be retried.
  absl::StatusOr<std::vector<TokenEvent>> Step();

  // Drops a sequence and frees its cache at once; false if unknown.
  bool Cancel(uint64_t sequence);

  size_t running() const { return sequences_.size(); }
  int64_t kv_cache_bytes() const;
  // The most positions a sequence may use (prompt plus generated tokens).
  int64_t position_limit() const { return position_limit_; }

 private:
  struct Sequence;
  std::shared_ptr<CausalLM> model_;
  dispatch::DispatchedModel* dispatched_;
  TextStreamFactory text_streams_;
  int64_t position_limit_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Sequence>> sequences_;  // in arrival order
};

struct GenerationResult {
  std::vector<int64_t> token_ids;  // generated only
  std::vector<float> logprobs;     // one per token when asked
  std::string text;
  FinishReason finish_reason = FinishReason::kLength;
};

// Runs the requests together until each finishes; results in request order.
absl::StatusOr<std::vector<GenerationResult>> Generate(Generator& generator,
                                                       std::vector<GenerationRequest> requests);

}  // namespace accel::models

#endif  // ACCEL_MODELS_GENERATOR_H_
