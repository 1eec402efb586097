// engine/engine_args.h: the one owner of the engine's options (vLLM's
// EngineArgs): the model, how it loads (models/load_options.h), the KV
// cache, batching, limits, speculative decoding. Every tool that runs the
// engine (accel-serve, accel-generate) registers the same flags, reads them
// the same way and checks them before it opens a port or reads a byte of
// the model:
//
//   EngineArgs::RegisterFlags();   // before absl::ParseCommandLine
//   ... absl::ParseCommandLine(argc, argv) ...
//   ACCEL_ASSIGN_OR_RETURN(EngineOptions options, EngineArgs::FromFlags().Resolve());
//   ACCEL_ASSIGN_OR_RETURN(auto engine, LlmEngine::Load(options, &stats));
#ifndef ACCEL_ENGINE_ENGINE_ARGS_H_
#define ACCEL_ENGINE_ENGINE_ARGS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "engine/llm_engine.h"
#include "models/load_options.h"

namespace accel::engine {

struct EngineArgs {
  std::string model;  // a model folder; empty: the embedded default model
  std::string served_model_name;
  models::ModelLoadOptions load;
  int threads = 0;
  int max_batch_size = 32;
  int max_queue = 256;
  int64_t max_num_batched_tokens = 512;
  std::string kv_cache_memory = "auto";
  double gpu_memory_utilization = 0.9;  // vLLM's; CUDA execution devices only
  bool enforce_eager = true;            // vLLM's: no CUDA graphs for decode steps (see the flag)
  int64_t kv_block_size = 16;
  bool enable_prefix_caching = true;
  int64_t max_input_tokens = 0;
  int64_t max_total_tokens = 0;
  int64_t default_max_new_tokens = 16;
  absl::Duration request_timeout = absl::ZeroDuration();
  std::string speculative_config;  // JSON, as vLLM's --speculative-config
  // One model over several processes (issue 36): tensor / pipeline sizes
  // and where this process stands (--nnodes ...: dist::ResolveRankLayout),
  // a pipeline step's micro-batches (0: one per stage), the bound on every
  // collective.
  dist::ParallelFlags parallel;
  int pipeline_micro_batches = 0;
  int pipeline_batches_in_flight = 0;  // 0: --pipeline_parallel_size
  absl::Duration parallel_timeout = absl::Seconds(60);

  // Links the flags (engine/engine_args.cc, with models::RegisterLoadFlags's)
  // into the tool; call before absl::ParseCommandLine.
  static void RegisterFlags();
  static EngineArgs FromFlags();

  // Every option checked, nothing of the model read but whether its folder
  // (and the draft's) holds a config.json: numbers in range, the load
  // options (models::CheckLoadOptions: dtype, device map, budgets,
  // quantization), --kv_cache_memory's form, --gpu_memory_utilization in
  // (0, 1], the speculative config parsed.
  // InvalidArgument (NotFound for a missing folder) naming the flag.
  absl::StatusOr<EngineOptions> Resolve() const;
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_ENGINE_ARGS_H_
