// server/engine.h: the served model behind the gRPC services. Loads the
// model and its tokenizer, turns a request in the terms clients use (text or
// ids, sampling, stops, limits) into a scheduler Request, checking every
// field, and hands it to the Scheduler. Both accel.v1.Generation and the
// KServe v2 service go through Engine::Submit, so they validate alike.
//
// Torch-free header: server/ headers include no libtorch.
#ifndef ACCEL_SERVER_ENGINE_H_
#define ACCEL_SERVER_ENGINE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "dispatch/offload_stats.h"
#include "models/generation_request.h"
#include "server/scheduler.h"

namespace accel::server {

class ServerMetrics;

struct EngineOptions {
  std::string model_dir;
  std::string served_model_name;  // empty: the model folder's name
  // As models::ModelLoadOptions takes them.
  std::string device_map = "auto";
  std::string max_memory;
  std::string offload_folder;
  std::string dtype = "auto";
  std::string quantize = "none";  // none | int8 | nf4 | fp4
  bool double_quant = false;
  bool offload_experts = false;
  std::string expert_cache = "auto";
  std::string execution_device = "auto";
  int threads = 0;  // libtorch's intra-op threads; 0: core/threads.h's default
  SchedulerOptions scheduler;
  // KV-cache memory: bytes ("4GiB"), a fraction of what the device holding
  // most weights has free after them ("0.5"), or "auto": max_batch_size
  // sequences of max_total_tokens, within half of what is free.
  std::string kv_cache_memory = "auto";
  int64_t kv_block_size = 16;  // tokens a KV block
  bool enable_prefix_caching = true;
  // Tokens in one forward step (decoding sequences first, then prompt
  // chunks); 0: whole prompts.
  int64_t max_num_batched_tokens = 512;
  int64_t max_input_tokens = 0;  // prompt tokens; 0: the model's context - 1
  int64_t max_total_tokens = 0;  // prompt + generated; 0: the model's context
  int64_t default_max_new_tokens = 16;
  absl::Duration request_timeout = absl::ZeroDuration();  // zero: none
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
};

class Engine {
 public:
  // Loads the model (a minute for a big one). `metrics` may be null.
  static absl::StatusOr<std::unique_ptr<Engine>> Load(const EngineOptions& options,
                                                      ServerMetrics* metrics);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Completes a request as the wire adapters fill it (tokenizes the
  // prompt, applies --default_max_new_tokens, adds the model's eos,
  // --request_timeout), validates it once (models::ValidateGenerationRequest
  // with the server's limits) and queues it; returns its id for Cancel.
  // Errors name the field: NotFound for another model name; InvalidArgument
  // for a bad request; ResourceExhausted when the queue is full; Unavailable
  // when draining.
  absl::StatusOr<uint64_t> Submit(models::GenerationRequest request,
                                  std::shared_ptr<RequestSink> sink);
  void Cancel(uint64_t id) { scheduler_->Cancel(id); }
  // One token's text, as the OpenAI API's logprobs show it: the token
  // decoded alone (special tokens included; a piece of a UTF-8 character
  // decodes to U+FFFD). Empty without a tokenizer or for an unknown id.
  std::string TokenText(int64_t token_id) const;

  const ModelInfo& info() const { return info_; }
  Scheduler& scheduler() { return *scheduler_; }
  // The model's offload counters so far.
  dispatch::OffloadStats offload_stats() const;

 private:
  struct Model;
  Engine() = default;
  absl::Status Complete(models::GenerationRequest& request) const;

  EngineOptions options_;
  ServerMetrics* metrics_ = nullptr;
  ModelInfo info_;
  std::string total_limit_name_;  // set when the KV cache bounds max_total_tokens
  std::unique_ptr<Model> model_;  // the loaded model and tokenizer (torch types)
  std::unique_ptr<Scheduler> scheduler_;
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_ENGINE_H_
