// The flags of models::ModelLoadOptions (models/load_options.h), declared
// once for accel-serve, accel-generate (through engine/engine_args.h) and
// accel-device-map. This file is linked only into the tools that call
// RegisterLoadFlags(), so the flags exist nowhere else.
#include <cstdint>
#include <string>

#include "absl/flags/flag.h"

#include "models/load_options.h"

ABSL_FLAG(std::string, device_map, "auto",
          "auto | balanced | balanced_low_0 | sequential (planned within --max_memory), one "
          "device for everything (cpu, 0, cuda:1, disk), or a JSON map file as accel-device-map "
          "prints it.");
ABSL_FLAG(std::string, max_memory, "",
          "Memory per device for planning, e.g. 0=20GiB,cpu=64GiB,disk=1TB. Empty: free GPU "
          "memory and the RAM available to this container.");
ABSL_FLAG(std::string, offload_folder, "",
          "Where disk-placed weights that need a dtype conversion are written (empty: a folder "
          "per model under $ACCEL_CACHE_DIR, $XDG_CACHE_HOME/accel or ~/.cache/accel).");
ABSL_FLAG(std::string, dtype, "auto",
          "auto (config.json's torch_dtype) | float32 | bfloat16 | float16");
ABSL_FLAG(std::string, quantize, "none",
          "Quantize the linear layers on loading, in bitsandbytes' formats: none | int8 "
          "(LLM.int8) | nf4 | fp4 (4-bit). lm_head stays as it is. A model saved quantized "
          "(accel-quantize, transformers) loads as it is.");
ABSL_FLAG(bool, double_quant, false,
          "With nf4/fp4: quantize the absmaxes too (8 bits, groups of 256).");
ABSL_FLAG(int64_t, quant_blocksize, 64, "With nf4/fp4: weights a block (32, 64, ..., 4096).");
ABSL_FLAG(double, int8_threshold, 6.0,
          "With int8: the outlier threshold (LLM.int8's; 0: no outliers, plain int8).");
ABSL_FLAG(std::string, quant_compute_dtype, "auto",
          "With nf4/fp4: the dtype the products run in (auto: the model's).");
ABSL_FLAG(std::string, offload_experts, "auto",
          "Mixture-of-experts models: place experts one by one and bring offloaded ones in as the "
          "router picks them, through an expert cache: auto (when the model does not fit memory), "
          "true, or false (whole blocks, as Accelerate).");
ABSL_FLAG(std::string, expert_cache, "auto",
          "The expert cache's size, e.g. 2GiB, inside max_memory (auto: on the cpu, all the memory "
          "the rest of the model leaves; on a GPU, the experts one token uses in every sparse "
          "layer, at most half its budget).");
ABSL_FLAG(std::string, execution_device, "auto",
          "Where cpu- and disk-placed weights run: auto (the first GPU in the map, else the cpu), "
          "cpu, or a GPU (0, cuda:1), through which a model held in RAM or on disk streams.");
ABSL_FLAG(bool, direct_reads, false,
          "Read disk-offloaded weights with O_DIRECT, past the page cache (a cold disk).");
ABSL_FLAG(bool, map_disk, true,
          "On the cpu, use disk-offloaded weights in place from their file's mapping (false: read "
          "them into buffers at each use).");
ABSL_FLAG(bool, prefetch, true,
          "Read ahead: the next offloaded module while one runs, and the experts the next sparse "
          "layer's router is expected to pick.");

namespace accel::models {

void RegisterLoadFlags() {}

ModelLoadOptions LoadOptionsFromFlags() {
  ModelLoadOptions o;
  o.device_map = absl::GetFlag(FLAGS_device_map);
  o.max_memory = absl::GetFlag(FLAGS_max_memory);
  o.offload_folder = absl::GetFlag(FLAGS_offload_folder);
  o.dtype = absl::GetFlag(FLAGS_dtype);
  o.quantize = absl::GetFlag(FLAGS_quantize);
  o.double_quant = absl::GetFlag(FLAGS_double_quant);
  o.quant_blocksize = absl::GetFlag(FLAGS_quant_blocksize);
  o.int8_threshold = absl::GetFlag(FLAGS_int8_threshold);
  o.quant_compute_dtype = absl::GetFlag(FLAGS_quant_compute_dtype);
  o.offload_experts = absl::GetFlag(FLAGS_offload_experts);
  o.expert_cache = absl::GetFlag(FLAGS_expert_cache);
  o.execution_device = absl::GetFlag(FLAGS_execution_device);
  o.direct_reads = absl::GetFlag(FLAGS_direct_reads);
  o.map_disk = absl::GetFlag(FLAGS_map_disk);
  o.prefetch = absl::GetFlag(FLAGS_prefetch);
  return o;
}

}  // namespace accel::models
