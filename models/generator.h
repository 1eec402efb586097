// models/generator.h: text generation over a CausalLM with continuous
// batching on a paged KV cache. Requests join (Add) and leave (they finish,
// or Cancel) between steps; each Step() is one Forward() over the running
// sequences (the last token of each decoding one, and a chunk of each
// prompt being read) packed together, so the weights are read once per step
// whatever the batch.
//
// Memory: the keys and values live in fixed-size blocks of one store sized
// by GeneratorOptions (models/kv_blocks.h). A request waits until blocks
// are free for it; when a running sequence needs a block and none is free,
// the most recently admitted sequence is preempted (its blocks freed, its
// tokens recomputed when it resumes, its stream going on where it was).
// Full blocks are shared between requests with the same prefix.
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
#include <deque>
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
#include "models/kv_blocks.h"
#include "models/sampling.h"
#include "models/token_generator.h"

namespace accel::tokenizer {
class Tokenizer;
}  // namespace accel::tokenizer

namespace accel::models {

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

// Text streams from the tokenizer's incremental decoder, skipping special
// tokens (so an eos reads as nothing). The factory keeps its own copy of
// the tokenizer (a shared, immutable table).
TextStreamFactory TokenizerTextStreams(const tokenizer::Tokenizer& tokenizer);

struct GeneratorOptions {
  // KV blocks in the store; 0: enough for four sequences at the position
  // limit, at most 1 GiB.
  int64_t kv_cache_blocks = 0;
  int64_t block_size = 16;     // tokens a block
  bool prefix_caching = true;  // off for LongRoPE models, whose keys depend on the length
  // Tokens in one step's forward pass: one per decoding sequence first, then
  // prompt chunks; 0: no limit (whole prompts). At least 1 prompt token runs
  // a step whatever the limit, so a prompt always makes progress.
  int64_t max_num_batched_tokens = 0;
  int max_num_seqs = 0;  // sequences holding blocks; 0: no limit
};

class Generator : public TokenGenerator {
 public:
  // `dispatched` may be null (a model with real weights on one device).
  // Without `text_streams`, events carry no text and stop strings are refused.
  Generator(std::shared_ptr<CausalLM> model, dispatch::DispatchedModel* dispatched,
            TextStreamFactory text_streams = nullptr, GeneratorOptions options = {});
  ~Generator() override;
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Validates (ValidateGenerationRequest, with the model's position limit
  // for the prompt) and queues a request on prompt_ids. max_new_tokens 0 is
  // kDefaultMaxNewTokens; generation ends at the model's position limit
  // whatever max_new_tokens says. ResourceExhausted when the request could
  // never fit the KV store (prompt + max_new_tokens over its tokens).
  absl::StatusOr<uint64_t> Add(GenerationRequest request) override;

  // One forward pass over what is scheduled and one token for each sequence
  // that read its whole input. Finished sequences are removed (their blocks
  // freed) before it returns. On an error nothing advances (caches keep
  // their length; no token is taken): the step can be retried.
  absl::StatusOr<std::vector<TokenEvent>> Step() override;

  // Drops a sequence, running or waiting, and frees its blocks at once.
  bool Cancel(uint64_t sequence) override;

  GeneratorStats stats() const override;
  // Sequences added and not finished (running or waiting).
  size_t running() const { return sequences_.size(); }
  // The most positions a sequence may use (prompt plus generated tokens).
  int64_t position_limit() const { return position_limit_; }
  // Tokens the KV store holds in all.
  int64_t kv_capacity_tokens() const;

 private:
  struct Sequence;
  std::shared_ptr<CausalLM> model_;
  dispatch::DispatchedModel* dispatched_;
  TextStreamFactory text_streams_;
  int64_t position_limit_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Sequence>> sequences_;  // in arrival order
  GeneratorOptions options_;
  std::unique_ptr<KvBlockStore> store_;
  std::unique_ptr<KvBlockManager> blocks_;
  std::deque<uint64_t> waiting_;    // preempted first, then in arrival order
  std::vector<uint64_t> admitted_;  // holding blocks, in admission order
  GeneratorStats counters_;

  void Preempt(uint64_t sequence);
  void ReleaseBlocks(Sequence& sequence);
  // Blocks for `tokens` more tokens of `sequence`; false if none are free.
  bool Reserve(Sequence& sequence, int64_t tokens);
  void Seal(Sequence& sequence);
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
