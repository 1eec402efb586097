// models/families.h: the model families accel knows, keyed by config.json
// "architectures", and the tensors a HuggingFace checkpoint of each holds.
//
// This is the layout knowledge shared by the generator (accel-make-model),
// planning without weights (accel-device-map) and the model code itself.
#ifndef ACCEL_MODELS_FAMILIES_H_
#define ACCEL_MODELS_FAMILIES_H_

#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"

#include "dispatch/module_tree.h"
#include "loader/config.h"
#include "loader/loader.h"

namespace accel::models {

struct Family {
  const char* architecture;  // config.json "architectures"[0]: "LlamaForCausalLM"
  const char* model_type;    // config.json "model_type": "llama"
  const char* block_class;   // the decoder block, never split over devices: "LlamaDecoderLayer"
};

// Every family accel serves, in a fixed order.
const std::vector<Family>& SupportedFamilies();

// The family of a config, by its first "architectures" entry (or, when that
// is missing, by "model_type"). InvalidArgument listing the supported
// architectures when it is unknown.
absl::StatusOr<Family> FamilyOf(const loader::ModelConfig& config);

// The module structure transformers builds for this config, with its class
// names (LlamaDecoderLayer, GPT2Block, ...), parameters in registration
// order, the rotary inv_freq buffer (not persistent) and the tied head.
// Floating parameters get `dtype`. Validates the config (InvalidArgument).
absl::StatusOr<dispatch::ModuleTree> ModuleTreeFor(const loader::ModelConfig& config,
                                                   c10::ScalarType dtype);

// The tensors a checkpoint of this config holds, with HuggingFace's names
// and shapes, in the order transformers' state_dict() lists them, a tied
// head once: ModuleTreeFor()'s parameters and persistent buffers.
absl::StatusOr<std::vector<loader::TensorSpec>> CheckpointTensors(const loader::ModelConfig& config,
                                                                  c10::ScalarType dtype);

}  // namespace accel::models

#endif  // ACCEL_MODELS_FAMILIES_H_
