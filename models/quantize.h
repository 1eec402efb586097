// models/quantize.h: bitsandbytes quantization of a model's linear layers,
// as transformers does it (replace_with_bnb_linear + its bnb quantizers):
// which layers (a QuantPlan), what they weigh (the module tree the device
// map is planned on), turning a model's empty layers into quantized ones,
// loading (quantizing float weights on the way, or reading a pre-quantized
// checkpoint as it is) and the tensors a quantized checkpoint holds.
//
//   ACCEL_ASSIGN_OR_RETURN(QuantPlan plan, PlanQuantization(tree, config));
//   ACCEL_ASSIGN_OR_RETURN(tree, QuantizeModuleTree(tree, plan));     // sizes for the map
//   ACCEL_RETURN_IF_ERROR(QuantizeLinears(*model, plan));             // empty model
//   auto hook = MakeQuantizationHook(model, plan, dtype);
//   load_options.hook = hook.get();                                   // DispatchedModel::Load
#ifndef ACCEL_MODELS_QUANTIZE_H_
#define ACCEL_MODELS_QUANTIZE_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

#include "dispatch/dispatch.h"
#include "dispatch/module_tree.h"
#include "loader/loader.h"
#include "models/load_model.h"
#include "models/nn.h"
#include "quant/bnb.h"

namespace torch::nn {
class Module;
}

namespace accel::models {

// Linear module name -> how it is quantized.
using QuantPlan = std::map<std::string, nn::LinearQuantization>;

// The linear layers (classes Linear and Conv1D) of `tree` that `config`
// quantizes: all but its skip list and keep_in_fp32_modules, and never a
// layer whose weight is tied to another. Compute dtype for 4-bit:
// config.bnb_4bit_compute_dtype. InvalidArgument when the config enables
// nothing or when nothing is left to quantize.
absl::StatusOr<QuantPlan> PlanQuantization(const dispatch::ModuleTree& tree,
                                           const quant::BnbQuantizationConfig& config);

// The plan of a pre-quantized checkpoint: a layer is quantized when the
// checkpoint holds its quant tensors (transformers' rule), 8-bit when it
// holds "<layer>.SCB", 4-bit when it holds the quant state blob (its
// blocksize and type come from there). Threshold and compute dtype from
// `config` (config.json's quantization_config). InvalidArgument naming the
// tensor for an unreadable blob or a type the config does not name.
absl::StatusOr<QuantPlan> PlanFromCheckpoint(const loader::Checkpoint& checkpoint,
                                             const quant::BnbQuantizationConfig& config);

// What a caller asks of load-time quantization (flags, ModelLoadOptions).
struct QuantizeOptions {
  std::string method = "none";  // none | int8 | nf4 | fp4
  bool double_quant = false;    // 4-bit only
  int64_t blocksize = quant::kDefaultBlocksize4bit;
  double int8_threshold = 6.0;
  at::ScalarType compute_dtype = at::kFloat;  // 4-bit
};

// The BnbQuantizationConfig for `options` (method not "none"). InvalidArgument
// naming the option: an unknown method, double_quant without 4 bits, a
// blocksize bnb refuses, a negative threshold.
absl::StatusOr<quant::BnbQuantizationConfig> BnbConfigFor(const QuantizeOptions& options);

// The plan for the model in `dir` whose module tree is `tree`: as its
// checkpoint stores it when config.json has a quantization_config
// (`prequantized` set; a different method in `options` is InvalidArgument),
// else as `options` asks (empty for "none").
absl::StatusOr<QuantPlan> PlanForModel(const std::string& dir, const dispatch::ModuleTree& tree,
                                       const QuantizeOptions& options, bool* prequantized);

// config.json's "quantization_config", if it has one. InvalidArgument
// naming the file for a bad one.
absl::StatusOr<std::optional<quant::BnbQuantizationConfig>> ReadQuantizationConfig(
    const std::string& config_json_path);

// `tree` with the planned layers as they are stored quantized (the tensors
// nn::QuantizableLinear::Quantize makes), so sizes and device maps count
// quantized bytes. InvalidArgument for a planned name that is not a linear
// layer of the tree.
absl::StatusOr<dispatch::ModuleTree> QuantizeModuleTree(const dispatch::ModuleTree& tree,
                                                        const QuantPlan& plan);

// Size overrides that keep the float32 tensors of quantized layers
// (absmax, code maps, SCB) at 4 bytes when a device map sizes floating
// tensors at a 16-bit dtype: for dispatch::SizeOptions::special_bytes.
void AddQuantizedSizes(const QuantPlan& plan, std::map<std::string, double>& special_bytes);

// Quantizes the planned layers of `model` (empty weights: they become the
// empty quantized tensors; real weights: quantized now). InvalidArgument
// naming the layer.
absl::Status QuantizeLinears(torch::nn::Module& model, const QuantPlan& plan);

// The dispatch::LoadHook for a model after QuantizeLinears(): a float
// weight is converted to `dtype` (the model's) and quantized; a
// pre-quantized one is read as stored, its quant state parsed and checked.
// Keeps `model` alive.
std::unique_ptr<dispatch::LoadHook> MakeQuantizationHook(std::shared_ptr<torch::nn::Module> model,
                                                         const QuantPlan& plan,
                                                         at::ScalarType dtype);

// The name of a 4-bit layer's quant state blob:
// "<layer>.weight.quant_state.bitsandbytes__nf4".
std::string QuantStateBlobName(const std::string& layer, quant::QuantType4bit type);

// The tensors of the checkpoint transformers saves for the model of `tree`
// (not quantized) quantized by `plan`, in its state dict's order (module by
// module, each module's parameters then its persistent buffers, a tied
// parameter once; a 4-bit layer's quant state blob after its weight's quant
// state, where bitsandbytes writes it). `blob_bytes(layer)` is the length of
// a 4-bit layer's blob. What QuantizedStateDict() holds for a loaded model,
// so a writer of pre-quantized checkpoints (accel-make-model --quantize)
// shards and lays them out as accel-quantize does.
absl::StatusOr<std::vector<loader::TensorSpec>> QuantizedCheckpointSpecs(
    const dispatch::ModuleTree& tree, const QuantPlan& plan,
    const std::function<absl::StatusOr<int64_t>(const std::string& layer)>& blob_bytes);

// `config_json` (a config.json's text) with the quantization_config of
// layers quantized as `how` and torch_dtype `dtype`, as SaveQuantizedModel
// writes it. InvalidArgument naming `label` when it is not a JSON object.
absl::StatusOr<std::string> QuantizedConfigJson(absl::string_view config_json,
                                                const nn::LinearQuantization& how,
                                                at::ScalarType dtype, absl::string_view label);

// The model's state dict as transformers saves a bitsandbytes model: every
// persistent tensor (tied ones once, under the first name), on the cpu,
// plus each 4-bit layer's "weight.quant_state.bitsandbytes__<type>" blob, in
// the order of QuantizedCheckpointSpecs().
// Offloaded modules are read through `dispatched`. Errors name the tensor.
absl::StatusOr<std::vector<loader::NamedTensor>> QuantizedStateDict(
    torch::nn::Module& model, dispatch::DispatchedModel* dispatched);

// Writes `loaded` (loaded with quantization) as transformers saves a
// bitsandbytes model: the safetensors (QuantizedStateDict, sharded past
// max_shard_size), config.json with its quantization_config, and the
// folder's tokenizer and generation files copied. `out_dir` is created; it
// must not be the model's own folder. Each file is written atomically.
absl::Status SaveQuantizedModel(LoadedModel& loaded, const std::string& out_dir,
                                int64_t max_shard_size = 5'000'000'000);

}  // namespace accel::models

#endif  // ACCEL_MODELS_QUANTIZE_H_
