// models/load_model.h: everything between a HuggingFace model folder and a
// model ready to generate, as accel-serve and accel-generate need it:
// config.json (and generation_config.json when present), the device map
// (planned from max_memory, or given), the model built on empty weights and
// loaded with cpu/disk offload, and the stop tokens.
//
//   ModelLoadOptions options;
//   options.device_map = "auto";
//   options.max_memory = "cpu=8GiB,disk=100GiB";
//   ACCEL_ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel("/models/llama", options));
//   Generator generator(loaded.model, loaded.dispatched.get());
#ifndef ACCEL_MODELS_LOAD_MODEL_H_
#define ACCEL_MODELS_LOAD_MODEL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "core/progress.h"
#include "dispatch/device_map.h"
#include "dispatch/dispatch.h"
#include "loader/config.h"
#include "models/causal_lm.h"
#include "models/families.h"
#include "models/load_options.h"
#include "models/nn.h"
#include "tokenizer/tokenizer.h"

namespace accel::models {

// What loading keeps in memory on the cpu, as planned before any weight is
// read (accel-estimate-memory prints it; a benchmark checks it against the
// process's peak RSS).
struct MemoryPlan {
  // The cpu budget the map was planned in: max_memory's, or what the machine
  // (its memory cgroup) has available, at most 85% of its memory, less the
  // reserves below. -1 without a strategy (a device or a map file).
  int64_t budget_bytes = -1;
  int64_t resident_weight_bytes = 0;  // weights planned on the cpu (mapped from the checkpoint)
  int64_t disk_weight_bytes = 0;      // weights read from disk as they are used
  int64_t expert_cache_bytes = 0;     // experts brought in from disk, kept within this
  int64_t read_buffer_bytes = 0;      // disk modules read ahead of use
  int64_t kv_cache_bytes = -1;        // set aside for the KV cache (-1: not planned)
  int64_t runtime_bytes = 0;          // activations, libtorch, allocator
  bool fits = true;                   // the whole model fits the budget
  bool offload_experts = false;       // experts placed and fetched one by one
  bool direct_reads = false;          // disk reads bypass the page cache
  // What the process should hold at most: resident weights, the expert
  // cache (when experts are fetched one by one), the read buffers, KV and
  // runtime.
  int64_t resident_bytes() const;
};

struct LoadedModel {
  std::string dir;
  loader::ModelConfig config;
  loader::GenerationConfig generation_config;  // defaults without the file
  at::ScalarType dtype = at::kFloat;
  dispatch::DeviceMap device_map;
  // The quantized linear layers (empty: none), and whether the checkpoint
  // was stored quantized.
  std::map<std::string, nn::LinearQuantization> quantization;
  bool prequantized = false;
  // Expert lists whose experts are fetched one by one, and the cache's bytes.
  std::vector<std::string> expert_lists;
  int64_t expert_cache_bytes = 0;
  // How memory was planned (LoadPlan's figures).
  MemoryPlan memory;
  std::shared_ptr<CausalLM> model;
  std::unique_ptr<dispatch::DispatchedModel> dispatched;
  // What loading warned about (also written to stderr as it happened), as
  // transformers warns: checkpoint tensors the model does not use, eos ids
  // outside the vocabulary (dropped from config / generation_config).
  std::vector<std::string> warnings;

  // generation_config.json's eos ids, else config.json's.
  std::vector<int64_t> eos_token_ids() const;
};

// Plans `dir` as LoadModel would (config, quantization, device map, the
// memory budget and its reserves) without reading any weight. With
// `config_only`, a folder with only a config.json will do: a
// quantization_config there is planned as transformers quantizes (every
// linear but lm_head and the routers) instead of read from the checkpoint.
struct LoadPlan {
  loader::ModelConfig config;
  at::ScalarType dtype = at::kFloat;
  std::map<std::string, nn::LinearQuantization> quantization;
  bool prequantized = false;
  dispatch::DeviceMap device_map;
  std::vector<std::string> expert_lists;  // fetched one by one
  int64_t cpu_room = -1;                  // mapped_resident_bytes for the dispatch core
  MemoryPlan memory;
};
absl::StatusOr<LoadPlan> PlanLoad(const std::string& dir, const ModelLoadOptions& options,
                                  bool config_only = false);

// The expert cache's bytes for `expert_cache` ("auto" or a size, as
// ModelLoadOptions::expert_cache): "auto" is the experts one token routes to
// in every sparse layer of `resolved`, sized on `tree` with `sizes`, at most
// half the budget of the first GPU or cpu in `max_memory` (when it has one).
// 0 for a dense model. InvalidArgument naming expert_cache for a bad size.
absl::StatusOr<int64_t> ExpertCacheBytes(const std::string& expert_cache,
                                         const ResolvedConfig& resolved,
                                         const dispatch::ModuleTree& tree,
                                         const dispatch::SizeOptions& sizes,
                                         const dispatch::MaxMemory& max_memory);

// Checked when a server starts, before the model loads: every id the
// tokenizer can produce is inside config.json's vocab_size (an id past it
// would index past the embedding), and it encodes a probe text and decodes
// it back. InvalidArgument naming `tokenizer_path` and what failed.
absl::Status CheckTokenizer(const tokenizer::Tokenizer& tokenizer,
                            const loader::ModelConfig& config, const std::string& tokenizer_path);

// Errors name the file or the option: NotFound for a folder without
// config.json; InvalidArgument for a bad option (naming it), an unsupported
// architecture, a GPU in the map on a build without CUDA; and whatever
// loading the weights reports (dispatch::DispatchedModel::Load).
absl::StatusOr<LoadedModel> LoadModel(const std::string& dir, const ModelLoadOptions& options);

}  // namespace accel::models

#endif  // ACCEL_MODELS_LOAD_MODEL_H_
