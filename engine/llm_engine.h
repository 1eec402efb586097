// engine/llm_engine.h: the engine as its users see it (vLLM's LLMEngine /
// AsyncLLM): one model loaded with its tokenizer, KV cache and (optional)
// draft model, requests completed and checked once (engine/input_processor.h)
// and run by the engine loop on its own thread (engine/engine_loop.h, over
// engine/engine_core.h). accel-serve's wire adapters (accel.v1, KServe v2,
// the OpenAI HTTP API) and accel-generate all go through Submit, so they
// validate and default alike.
//
//   ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<LlmEngine> engine, LlmEngine::Load(options, &logger));
//   ACCEL_ASSIGN_OR_RETURN(uint64_t id, engine->Submit(request, sink));
//
// Torch-free header.
#ifndef ACCEL_ENGINE_LLM_ENGINE_H_
#define ACCEL_ENGINE_LLM_ENGINE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "dispatch/offload_stats.h"
#include "dist/launch.h"
#include "engine/engine_loop.h"
#include "engine/request.h"
#include "engine/speculative_config.h"
#include "engine/stat_logger.h"
#include "models/load_options.h"

namespace accel::tokenizer {
class Tokenizer;
}  // namespace accel::tokenizer

namespace accel::engine {

// What LlmEngine::Load takes; engine/engine_args.h makes it from the flags,
// checked.
struct EngineOptions {
  std::string model_dir;
  std::string served_model_name;  // empty: the model folder's name
  models::ModelLoadOptions load;  // the model's (and the draft model's) placement, dtype, ...
  int threads = 0;                // libtorch's intra-op threads; 0: core/threads.h's default
  EngineLoopOptions loop;
  // KV-cache memory: bytes ("4GiB"), a fraction of what the device holding
  // most weights has free after them ("0.5"), or "auto": max_batch_size
  // sequences of max_total_tokens, within half of what is free.
  std::string kv_cache_memory = "auto";
  int64_t kv_block_size = 16;  // tokens a KV block
  // On a CUDA execution device with kv_cache_memory "auto": the fraction of
  // the device's total memory this process may use; the KV cache gets what
  // it leaves after the weights and a profiled step (engine/gpu_memory.h).
  // No effect on the cpu.
  double gpu_memory_utilization = 0.9;
  // vLLM's --enforce_eager: decode steps on a CUDA device never replay
  // CUDA graphs (engine/decode_graphs.h). True by default until a device
  // run has checked graphs against eager (issue 37; vLLM's default is
  // false); false turns them on where the model allows.
  bool enforce_eager = true;
  bool enable_prefix_caching = true;
  // Tokens in one forward step (decoding sequences first, then prompt
  // chunks); 0: whole prompts.
  int64_t max_num_batched_tokens = 512;
  int64_t max_input_tokens = 0;  // prompt tokens; 0: the model's context - 1
  int64_t max_total_tokens = 0;  // prompt + generated; 0: the model's context
  int64_t default_max_new_tokens = 16;
  absl::Duration request_timeout = absl::ZeroDuration();  // zero: none
  // Speculative decoding (engine/speculative_config.h); off by default.
  SpeculativeConfig speculative;
  // A run over several processes (EngineArgs's): the tool that loads the
  // engine starts and joins the group (dist/launch.h) and places the model
  // (load.tensor_parallel) before LlmEngine::Load.
  dist::ParallelFlags parallel;
  int pipeline_micro_batches = 0;
  // Steps the leader keeps in flight over disjoint requests with pipeline
  // stages (vLLM's virtual engines); 0: one per stage, 1: one at a time.
  // Speculative decoding runs one at a time whatever it says.
  int pipeline_batches_in_flight = 0;
  absl::Duration parallel_timeout = absl::Seconds(60);
};

struct ModelInfo {
  std::string name;
  std::string architecture;
  std::string model_type;
  int64_t parameters = 0;
  std::string dtype;
  std::string quantization = "none";
  std::vector<std::pair<std::string, std::string>> device_map;  // module -> "0" | "cpu" | "disk"
  std::map<std::string, int64_t> bytes_per_device;
  int64_t max_context = 0;
  int64_t max_input_tokens = 0;
  int64_t max_total_tokens = 0;
  int64_t vocab_size = 0;
  std::vector<int64_t> eos_token_ids;
  bool has_tokenizer = false;
  bool has_chat_template = false;  // Chat / chat completions work
  double load_seconds = 0;
  // How loading planned the cpu's memory (models::MemoryPlan): weights read
  // from disk as used, weights resident, the expert cache, read-ahead
  // buffers, the KV cache's share (-1: not planned) within the budget.
  int64_t disk_weight_bytes = 0;
  int64_t resident_weight_bytes = 0;
  int64_t expert_cache_bytes = 0;
  int64_t read_buffer_bytes = 0;
  int64_t planned_kv_cache_bytes = -1;
  int64_t memory_budget_bytes = -1;
  bool direct_reads = false;
  // The KV cache: blocks, bytes a block (every layer's), and how it was
  // sized (the flag and, on a GPU, the device's figures).
  // The batch buckets whose decode steps replay CUDA graphs (empty: every
  // step eager: the cpu, --enforce_eager, or a model that cannot).
  std::vector<int64_t> cuda_graph_buckets;
  int64_t kv_blocks = 0;
  int64_t kv_block_bytes = 0;
  std::string kv_sizing;
  // Speculative decoding: "none", "ngram" or "draft_model", and the draft.
  std::string speculative_method = "none";
  std::string draft_model;
};

class LlmEngine {
 public:
  // Loads the model (a minute for a big one), and the draft model when the
  // speculative config names one. `stats` may be null; it outlives the
  // engine.
  static absl::StatusOr<std::unique_ptr<LlmEngine>> Load(const EngineOptions& options,
                                                         StatLogger* stats);
  ~LlmEngine();
  LlmEngine(const LlmEngine&) = delete;
  LlmEngine& operator=(const LlmEngine&) = delete;

  // Completes a request as the wire adapters fill it and checks it once
  // (engine/input_processor.h, with the server's limits), then queues it;
  // returns its id for Cancel. Errors name the field: NotFound for another
  // model name; InvalidArgument for a bad request; ResourceExhausted when
  // the queue is full; Unavailable when draining.
  //
  // n > 1: n sequences of the same prompt (sharing its KV blocks: it is
  // prefilled once), choice i seeded seed + i; each chunk carries its
  // choice's index, a choice's last chunk its finish, and OnDone comes once,
  // after the last choice, with the tokens of all of them (OpenAI's usage).
  absl::StatusOr<uint64_t> Submit(GenerationRequest request, std::shared_ptr<RequestSink> sink);
  // Several prompts as one answer (OpenAI's list of prompts): each request
  // completed and checked (the first error names its prompt), then run as
  // Submit runs n choices, prompt p's choice j tagged index p * n + j (the
  // order OpenAI and vLLM give); OnDone's usage counts every prompt's
  // tokens and every choice's.
  absl::StatusOr<uint64_t> SubmitBatch(std::vector<GenerationRequest> requests,
                                       std::shared_ptr<RequestSink> sink);
  // With n > 1 the id stands for all the choices: Cancel ends them all.
  void Cancel(uint64_t id);
  // One token's text, as the OpenAI API's logprobs show it: the token
  // decoded alone (special tokens included; a piece of a UTF-8 character
  // decodes to U+FFFD). Empty without a tokenizer or for an unknown id.
  std::string TokenText(int64_t token_id) const;
  // POST /tokenize: InputProcessor::Tokenize with this server's model.
  absl::StatusOr<std::vector<int64_t>> Tokenize(const GenerationRequest& request,
                                                bool add_special_tokens) const;
  // The model's tokenizer (null without tokenizer.json).
  const tokenizer::Tokenizer* tokenizer() const;

  const ModelInfo& info() const { return info_; }
  EngineLoop& loop() { return *loop_; }
  // The model's offload counters so far (the draft model's added).
  dispatch::OffloadStats offload_stats() const;

 private:
  struct Model;
  LlmEngine() = default;
  // Queues request.n choices (Submit, n > 1).
  absl::StatusOr<uint64_t> SubmitChoices(std::vector<GenerationRequest> requests,
                                         std::shared_ptr<RequestSink> sink);
  // The input processor and the structured-output checks of Submit.
  absl::Status Complete(GenerationRequest& request);
  void RecordRefused(const absl::Status& status);

  EngineOptions options_;
  StatLogger* stats_ = nullptr;
  ModelInfo info_;
  std::unique_ptr<Model> model_;  // the loaded models and the input processor (torch types)
  std::unique_ptr<EngineLoop> loop_;
  // n > 1: the first choice's id -> every choice's, while they run.
  struct Choices;
  std::shared_ptr<Choices> choices_;
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_LLM_ENGINE_H_
