// engine/model_runner.h: a SchedulerOutput turned into one forward pass
// (vLLM v1's GPUModelRunner): the scheduled chunks packed without padding,
// each request's paged KV cache pointed at its blocks, the model run once,
// then sampling, draft verification and the next step's drafts.
//
// The engine core (engine/engine_core.h) talks to ModelRunnerInterface, so
// the scheduler and the step loop are tested with a fake runner; ModelRunner
// is the real one over a models::CausalLM. It owns the forward: tensor- or
// pipeline-parallel execution belongs behind this interface.
//
// Speculative decoding (engine/speculative_config.h): a request with k
// drafts runs 1 + k tokens, its last sampled token and the drafts, in the
// same pass as everyone else; the target's logits at those 1 + k positions
// decide, by the speculative-sampling rule (Leviathan et al. 2023; Chen et
// al. 2023), how many drafts are accepted, and one more token is sampled
// from the target: with temperature 0 exactly the tokens of decoding
// without drafts, otherwise tokens of the target's own distribution. The
// keys and values of rejected drafts are rolled back (the cache's length
// goes back; the next step overwrites them). Drafts come from prompt lookup
// (engine/ngram_proposer.h) or a draft model, which keeps its own keys and
// values in blocks of its own store at the same block ids as the target's,
// so preemption and prefix caching hold for both at once.
//
// The header is torch-free; ModelRunner's code needs libtorch
// (accel::engine).
#ifndef ACCEL_ENGINE_MODEL_RUNNER_H_
#define ACCEL_ENGINE_MODEL_RUNNER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/speculative_config.h"

namespace accel::models {
class CausalLM;
}  // namespace accel::models
namespace accel::dispatch {
class DispatchedModel;
}  // namespace accel::dispatch

namespace accel::engine {

class LogitsProcessor;

struct ModelRunnerOutput {
  // One per scheduled request that sampled (read the rest of its input).
  std::vector<SampledTokens> sampled;
  // Drafts for requests' next steps.
  std::map<uint64_t, std::vector<int64_t>> drafts;
};

class ModelRunnerInterface {
 public:
  virtual ~ModelRunnerInterface() = default;
  // A request joins (its sampler, its logits processor); it runs in a later
  // Execute. InvalidArgument for sampling values the sampler refuses.
  virtual absl::Status AddRequest(uint64_t id, const GenerationRequest& request) = 0;
  virtual void RemoveRequest(uint64_t id) = 0;
  // One forward pass over `output` (its preempted requests' caches dropped
  // first). On an error nothing advanced: every cache keeps the length it
  // had, no sampler drew, so the step can be scheduled again.
  virtual absl::StatusOr<ModelRunnerOutput> Execute(const SchedulerOutput& output) = 0;

  // Steps the engine core may keep in flight (pipeline parallel: vLLM's
  // batch queue); with 1 (the default) it only calls Execute. With more
  // it calls Submit, which starts a step (its first stage runs, the rest go
  // on in other processes) and returns a ticket without the step's tokens,
  // and Collect(ticket), which waits for them, tickets in the order they
  // were submitted. The SchedulerOutput submitted (and the spans it holds)
  // stays valid and its requests unchanged until collected. On an error of
  // either the step did not advance its requests (the caches keep their
  // lengths); after one the engine core abandons every step in flight.
  virtual int max_steps_in_flight() const { return 1; }
  virtual absl::StatusOr<uint64_t> Submit(const SchedulerOutput& output) {
    (void)output;
    return absl::UnimplementedError("this model runner runs one step at a time");
  }
  virtual absl::StatusOr<ModelRunnerOutput> Collect(uint64_t ticket) {
    (void)ticket;
    return absl::UnimplementedError("this model runner runs one step at a time");
  }
  virtual void AbandonSubmitted() {}

  // The KV store the scheduler's blocks index.
  virtual int64_t num_blocks() const = 0;
  virtual int64_t block_size() const = 0;
  // Whether equal tokens always have equal keys (false for LongRoPE, whose
  // keys depend on the sequence's length): blocks may then be shared.
  virtual bool supports_prefix_caching() const = 0;
  // The most positions a sequence may use (prompt plus generated).
  virtual int64_t position_limit() const = 0;
  // Blocks a decoding request should hold past its step for the draft
  // model's keys and values (0 without one).
  virtual int64_t lookahead_tokens() const = 0;
  // Memory of the KV storage made so far (the draft model's included).
  virtual int64_t kv_cache_bytes() const = 0;
};

// A per-request hook in the sampling path (structured output, bans): made
// for each request by ModelRunnerOptions::logits_processors, applied to the
// raw logits of every position the request samples from, drafts' included.
using LogitsProcessorFactory =
    std::function<std::unique_ptr<LogitsProcessor>(const GenerationRequest& request)>;

struct ModelRunnerOptions {
  // KV blocks in the store; 0: enough for four sequences at the position
  // limit, at most 1 GiB.
  int64_t num_blocks = 0;
  int64_t block_size = 16;  // tokens a block
  SpeculativeConfig speculative;
  // The draft model (speculative.method kDraftModel), already loaded.
  std::shared_ptr<models::CausalLM> draft_model;
  dispatch::DispatchedModel* draft_dispatched = nullptr;
  LogitsProcessorFactory logits_processors;  // may be empty
  // Decode steps padded to batch-size buckets (engine/decode_graphs.h;
  // ascending, e.g. DecodeBatchBuckets(max_batch_size)): a step whose
  // sequences all decode one token runs as the smallest bucket that holds
  // it, its inputs copied into that bucket's static buffer, the padded rows
  // writing and reading a scratch KV block (one block more in the store,
  // nobody's) and their logits dropped. This is the step a CUDA graph per
  // bucket replays (vLLM's); here it is called directly. Empty (the
  // default): every step runs unpadded.
  std::vector<int64_t> decode_buckets;
  // With decode_buckets on a CUDA device: capture each bucket's step as a
  // CUDA graph on first use and replay it (internal/decode_graph_runner.h).
  // The model's decode step must be capturable: dense, on one device, no
  // LongRoPE (LlmEngine checks). Off: the step is called directly.
  bool capture_decode_graphs = false;
  // A step of one-token decodes that is not padded (no decode_buckets, a
  // batch past the largest, padded steps turned off): run as the model's
  // static decode step at its own size, its inputs (ids, positions, slots,
  // block tables) built once and copied to the device in two copies, where
  // the general forward writes each sequence's key and value with its own
  // copies and uploads the tables again in every layer. kAuto: on a CUDA
  // execution device, for a model with a static decode step. kAlways: on
  // the cpu too (tests compare it with the general forward there).
  enum class UnpaddedStaticDecode { kOff, kAuto, kAlways };
  UnpaddedStaticDecode unpadded_static_decode = UnpaddedStaticDecode::kAuto;
  // Steps in flight (a pipeline-parallel model whose CausalLM::Submit
  // returns before the last stage's logits): the engine core keeps up to
  // this many steps over disjoint requests. Create makes it 1 with
  // speculative decoding (a step's drafts come from the step before) or
  // decode_buckets (one static buffer per bucket).
  int steps_in_flight = 1;
};

class ModelRunner : public ModelRunnerInterface {
 public:
  // `dispatched` may be null (a model with real weights on one device).
  // InvalidArgument when the speculative config does not fit the models (a
  // draft model with another vocabulary, a LongRoPE model).
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(
      std::shared_ptr<models::CausalLM> model, dispatch::DispatchedModel* dispatched,
      ModelRunnerOptions options = {});
  ~ModelRunner() override;

  absl::Status AddRequest(uint64_t id, const GenerationRequest& request) override;
  void RemoveRequest(uint64_t id) override;
  absl::StatusOr<ModelRunnerOutput> Execute(const SchedulerOutput& output) override;
  int max_steps_in_flight() const override;
  absl::StatusOr<uint64_t> Submit(const SchedulerOutput& output) override;
  absl::StatusOr<ModelRunnerOutput> Collect(uint64_t ticket) override;
  void AbandonSubmitted() override;
  int64_t num_blocks() const override;
  int64_t block_size() const override;
  bool supports_prefix_caching() const override;
  int64_t position_limit() const override;
  int64_t lookahead_tokens() const override;
  int64_t kv_cache_bytes() const override;
  // Steps that ran padded to a bucket (decode_buckets), and the padded rows
  // they added.
  int64_t padded_decode_steps() const;
  int64_t padded_decode_rows() const;
  // Steps that ran as an unpadded static decode step (unpadded_static_decode).
  int64_t unpadded_static_decode_steps() const;

 private:
  struct Impl;
  explicit ModelRunner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_MODEL_RUNNER_H_
