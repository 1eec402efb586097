// models/load_options.h: how to load a model (the device map, memory
// budgets, dtype, quantization, offload), the one set of load options of
// every tool and of the engine, with its flags and its checks. Torch-free.
//
//   models::RegisterLoadFlags();              // before absl::ParseCommandLine
//   ... absl::ParseCommandLine(argc, argv) ...
//   ModelLoadOptions options = models::LoadOptionsFromFlags();
//   ACCEL_RETURN_IF_ERROR(models::CheckLoadOptions(options));   // before anything is read
#ifndef ACCEL_MODELS_LOAD_OPTIONS_H_
#define ACCEL_MODELS_LOAD_OPTIONS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"

#include "core/progress.h"
#include "models/parallel_options.h"

namespace accel::models {

struct ModelLoadOptions {
  // A strategy ("auto", "balanced", "balanced_low_0", "sequential"), a
  // single device for everything ("cpu", "0", "cuda:1", "disk"), or the path
  // of a JSON device map as accel-device-map prints it.
  std::string device_map = "auto";
  // Budgets as accel-device-map takes them ("0=10GiB,cpu=30GiB,disk=1TB");
  // empty: probed (free GPU memory, RAM available within the cgroup).
  std::string max_memory;
  // Where disk-placed weights that need a dtype conversion are written.
  std::string offload_folder;
  // "auto" (config.json's torch_dtype, float32 when it has none), or
  // float32, bfloat16, float16.
  std::string dtype = "auto";
  // Quantize the linear layers on loading (bitsandbytes' formats): "none",
  // "int8" (LLM.int8), "nf4" or "fp4". The head (lm_head) stays as it is. A
  // pre-quantized model (config.json's quantization_config) loads as it was
  // saved whatever this says, but a different method here is an error.
  std::string quantize = "none";
  bool double_quant = false;     // 4-bit: quantize the absmaxes too
  int64_t quant_blocksize = 64;  // 4-bit
  double int8_threshold = 6.0;   // int8: outlier threshold (0: none)
  // 4-bit compute dtype; "auto": the model's dtype.
  std::string quant_compute_dtype = "auto";
  // Mixture-of-experts models: plan the experts one by one (after everything
  // else, in the room it leaves: dispatch::PlanOptions::expert_lists) and
  // bring offloaded experts in as the router picks them, through an expert
  // cache on the execution device, instead of every expert of a block with
  // it. "auto" (the default): when the model does not fit its memory budget;
  // "true": always; "false": Accelerate's plan, whole blocks. A device map
  // file with keys inside an expert list turns it on too.
  std::string offload_experts = "auto";
  // The expert cache's size: "auto" or a size ("2GiB"), counted inside
  // max_memory. "auto" on the cpu: when experts do not fit, every byte the
  // budget leaves beside the rest of the model, its KV and runtime reserves
  // (no expert is then placed in RAM for good: the cache keeps the ones the
  // routing uses); on a GPU: the experts one token routes to in every sparse
  // layer, at most half of its budget.
  std::string expert_cache = "auto";
  // Bytes kept for the KV cache when memory is planned (max_memory probed):
  // -1 (auto): when the model does not fit, a 32nd of the budget within
  // [256 MiB, 1 GiB] (LoadedModel::memory.kv_cache_bytes, which the
  // engine's --kv_cache_memory auto stays within: engine/llm_engine.cc);
  // otherwise nothing is set aside and the KV store is sized as before.
  int64_t kv_cache_bytes = -1;
  // Where cpu and disk entries run: "auto" (the first GPU in the map, else
  // the cpu), "cpu", or a GPU ("0", "cuda:1"), which streams weights held in
  // RAM or on disk through it.
  std::string execution_device = "auto";
  // Disk reads of offloaded weights bypass the page cache (O_DIRECT) into
  // buffers. Unset (off): on a cpu execution device, disk weights are used
  // in place from their mapping (map_disk), the page cache's own pages,
  // made resident ahead of use.
  std::optional<bool> direct_reads;
  // Disk weights that run on the cpu are used in place from their file's
  // mapping, made resident ahead of use and dropped behind it where the cpu
  // budget of max_memory has no room to keep them (dispatch::LoadOptions::
  // map_disk); false: read into buffers for each use.
  bool map_disk = true;
  // Read ahead: the next offloaded module while one runs, and the experts the
  // next sparse layer's router is expected to pick.
  bool prefetch = true;
  Progress::Style progress = Progress::Style::kAuto;
  // Tensor parallel (models/tensor_parallel.h): load only rank
  // `tensor_parallel.rank`'s slice, quantized per slice; its device map is
  // planned on that slice. A pre-quantized checkpoint is refused (its
  // packed blocks do not split along heads). Rank 0's LoadedModel::model is
  // then a TensorParallelLeader that drives the other ranks' steps; theirs
  // is their slice, for RunTensorParallelWorker.
  TensorParallel tensor_parallel;
};

// Every option checked without reading a model: dtype, quantize (and
// double_quant, quant_blocksize, int8_threshold, quant_compute_dtype),
// device_map (a strategy, a device this build can use, or an existing file),
// max_memory (parsed, and only with a strategy), offload_experts, expert_cache,
// execution_device. InvalidArgument naming the option as the flags spell it.
absl::Status CheckLoadOptions(const ModelLoadOptions& options);

// The flags of ModelLoadOptions (--device_map, --max_memory, --dtype,
// --quantize, ...), declared once (models/load_flags.cc) for every tool that
// loads or plans a model. RegisterLoadFlags links them into the tool; call
// it before absl::ParseCommandLine. LoadOptionsFromFlags reads them.
void RegisterLoadFlags();
ModelLoadOptions LoadOptionsFromFlags();

}  // namespace accel::models

#endif  // ACCEL_MODELS_LOAD_OPTIONS_H_
