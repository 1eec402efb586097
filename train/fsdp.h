// train/fsdp.h: fully sharded data parallel (PyTorch FSDP / ZeRO-3
// semantics) on the dispatch core's module hooks (dispatch/module_hooks.h).
//
// The model's trainable parameters are grouped into units (auto_wrap: one per
// decoder layer, say, plus the root holding what no unit took). Each unit's
// parameters are flattened, padded to a multiple of P, and each rank keeps
// 1/P of them (its shard, float32 master values), 1/P of their gradient and
// so 1/P of the optimizer's state: the optimizer steps this rank's piece of
// each original parameter (use_orig_params), so its param groups and
// options stay as the program made them.
//
// The module's parameter tensors stay what they were (the same TensorImpls,
// the same names), but their storage is the unit's gathered buffer, which
// FULL_SHARD allocates and all-gathers just before the unit runs
// (PreForward), frees after it (PostForward), gathers again when the
// gradient reaches the unit's output, and frees once the unit's gradients
// are reduce-scattered into the shards (after each unit's backward, while
// backward goes on). SHARD_GRAD_OP keeps a unit gathered from its forward to
// the end of its backward; NO_SHARD keeps everything and all-reduces, as
// data parallel does. The root unit stays gathered (its embeddings and
// head run outside any unit), refreshed after each optimizer step.
//
// A program's own modules tell the hooks when a unit runs by calling it
// through dispatch::RunModule(name, fn); accel's models do so for every
// block. A unit that gets gradients in the first step without having been
// run through the hooks is kept gathered from then on (a warning says so):
// the arithmetic is right either way, only its memory is not sharded.
#ifndef ACCEL_TRAIN_FSDP_H_
#define ACCEL_TRAIN_FSDP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "dispatch/module_hooks.h"
#include "train/ddp.h"
#include "train/env.h"
#include "train/process_group.h"

namespace torch::nn {
class Module;
}

namespace accel::train {

// torch.distributed.fsdp.ShardingStrategy.
enum class ShardingStrategy { kFullShard, kShardGradOp, kNoShard, kHybridShard };
// What a save writes: the whole model from rank 0, or each rank's shards.
enum class StateDictType { kFullStateDict, kShardedStateDict };
enum class BackwardPrefetch { kBackwardPre, kBackwardPost, kNoPrefetch };
enum class AutoWrapPolicy { kTransformerBasedWrap, kSizeBasedWrap, kNoWrap };

// torch.distributed.fsdp.MixedPrecision: the dtype units compute in
// (param_dtype: the gathered parameters and so their gradients), the dtype
// gradients are reduced in, and the buffers' dtype. Unset: the parameters'
// own (float32). Inputs are not cast: use it with the Accelerator's
// mixed_precision (autocast), as Accelerate does.
struct FsdpMixedPrecision {
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
  std::optional<c10::ScalarType> buffer_dtype;
};

// Accelerate's FullyShardedDataParallelPlugin, field by field.
struct FullyShardedDataParallelPlugin {
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  AutoWrapPolicy auto_wrap_policy = AutoWrapPolicy::kTransformerBasedWrap;
  // Module class names (torch::nn::Module::name(), e.g. "LlamaDecoderLayer")
  // that become units. Empty: the model's decoder layers, i.e. each module
  // held in a ModuleList (what transformers' _no_split_modules names).
  std::vector<std::string> transformer_cls_names_to_wrap;
  // SIZE_BASED_WRAP: a module whose not-yet-wrapped parameters reach this
  // count becomes a unit (innermost first, as size_based_auto_wrap_policy).
  int64_t min_num_params = 100000000;
  // Shards, their gradients and the optimizer state live on the cpu; units
  // are gathered on the execution device (on a cpu device: where they are).
  bool cpu_offload = false;
  FsdpMixedPrecision mixed_precision_policy;
  StateDictType state_dict_type = StateDictType::kFullStateDict;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  // Gathers the unit expected next while one runs forward.
  bool forward_prefetch = false;
  // The optimizer sees the original parameters (their pieces); false, flat
  // parameters per unit, is refused: it would change the optimizer's groups.
  bool use_orig_params = true;
  // Rank 0's parameters and buffers reach every rank before sharding.
  bool sync_module_states = true;
  // Refused when true: activation checkpointing needs recomputation hooks
  // that libtorch's C++ modules do not have.
  bool activation_checkpointing = false;
  // Accepted: the model is built on every rank before prepare in C++, and
  // sync_module_states already makes rank 0's weights everyone's.
  bool cpu_ram_efficient_loading = false;

  // From accel-launch's / Accelerate's environment (FSDP_SHARDING_STRATEGY,
  // FSDP_AUTO_WRAP_POLICY, ...). InvalidArgument naming the variable for a
  // value that is not one of Accelerate's.
  static absl::StatusOr<FullyShardedDataParallelPlugin> FromEnv(const EnvLookup& env);
};

absl::StatusOr<ShardingStrategy> ParseShardingStrategy(absl::string_view text);
absl::StatusOr<StateDictType> ParseStateDictType(absl::string_view text);
absl::StatusOr<BackwardPrefetch> ParseBackwardPrefetch(absl::string_view text);
absl::StatusOr<AutoWrapPolicy> ParseAutoWrapPolicy(absl::string_view text);
const char* ShardingStrategyName(ShardingStrategy strategy);

// One original parameter's slice of this rank's shard.
struct ParameterPiece {
  std::string name;            // the parameter's (first) name in the module
  std::vector<int64_t> shape;  // the whole parameter's shape
  int64_t offset = 0;          // where the piece starts in the flattened parameter
  at::Tensor piece;            // 1-D, possibly empty: a view of the shard
};

class ShardedModel : public dispatch::ModuleHooks {
 public:
  // Groups, flattens and shards `module`'s trainable parameters over `group`
  // (all ranks call it, with the same model). `num_nodes` decides whether
  // HYBRID_SHARD is FULL_SHARD (one node) or refused.
  static absl::StatusOr<std::unique_ptr<ShardedModel>> Wrap(
      std::shared_ptr<torch::nn::Module> module, ProcessGroup& group,
      const FullyShardedDataParallelPlugin& plugin, c10::Device device, int num_nodes);
  ~ShardedModel() override;

  // Units in the order they were made; "" is the root.
  virtual std::vector<std::string> unit_names() const = 0;
  // Every trainable parameter's piece on this rank, in module order.
  virtual const std::vector<ParameterPiece>& pieces() const = 0;
  // The piece standing for `parameter` (one of the module's tensors), or
  // an undefined tensor when it is not sharded here.
  virtual at::Tensor PieceOf(const at::Tensor& parameter) const = 0;
  virtual ShardingStrategy strategy() const = 0;

  // no_sync: false leaves the gathered gradients on the parameters, where
  // backward accumulates them; the next synced backward reduces the sum.
  virtual void set_require_sync(bool require_sync) = 0;
  virtual bool require_sync() const = 0;
  virtual bool received_gradients() const = 0;
  // After backward: reduces the units whose gradients did not complete
  // during it (parameters a step did not use count as zero), frees what the
  // strategy frees, and points each piece's grad at its shard's gradient.
  virtual absl::Status Finish() = 0;
  // zero_grad (set_to_none): drops the pieces' gradients and the shard
  // gradients behind them, and any gathered gradients no_sync left.
  virtual void ZeroGrad() = 0;
  // After the optimizer changed the shards: gathers the units kept
  // gathered (the root) again. Collective.
  virtual absl::Status ShardsChanged() = 0;

  // The whole model, float32 on the cpu, on every rank (collective):
  // named_parameters (every name of a tied tensor) and named_buffers.
  virtual absl::StatusOr<NamedTensors> FullStateDict() = 0;
  // Sets this rank's shards from whole tensors (every rank passes the same),
  // then gathers the units kept gathered. Collective. InvalidArgument naming
  // a missing or misshapen parameter.
  virtual absl::Status LoadFullStateDict(const NamedTensors& state) = 0;

  // SHARDED_STATE_DICT: this rank's file in folder `dir`
  // (rank<r>-of-<P>.safetensors): each parameter's piece under its name, with
  // its offset and whole shape in the metadata, and the tensors that are not
  // sharded (buffers, frozen parameters) whole. Written atomically.
  virtual absl::Status SaveShards(const std::string& dir) = 0;
  // Reads this rank's file of `dir` back (the same world size and
  // sharding), then gathers the units kept gathered. Collective.
  // FailedPrecondition when `dir` was saved by another number of ranks.
  virtual absl::Status LoadShards(const std::string& dir) = 0;

  // Bytes this rank holds now for parameters (shards plus whatever is
  // gathered) and for gradients (shard gradients plus gathered ones).
  virtual int64_t parameter_bytes() const = 0;
  virtual int64_t gradient_bytes() const = 0;
  // The most parameter_bytes() + gradient_bytes() seen, sampled after each
  // gather and before each reduction frees the gathered gradients.
  virtual int64_t peak_bytes() const = 0;
  // Starts peak_bytes() over from what is held now (e.g. after warm-up steps:
  // the first step keeps every unit gathered while it learns the order).
  virtual void ResetPeakBytes() = 0;
  // Seconds spent in all-gathers and reductions (waiting), since Wrap.
  virtual double communication_seconds() const = 0;
};

// accel-merge-weights (Accelerate's merge-weights): the rank files of a
// SHARDED_STATE_DICT folder into one model, written as model.safetensors
// (sharded with an index past `max_shard_bytes`) in `output_dir`, float32 as
// the shards hold it. DataLoss naming the parameter when the files do not
// cover it exactly; FailedPrecondition when a rank's file is missing.
absl::Status MergeShardedState(const std::string& dir, const std::string& output_dir,
                               int64_t max_shard_bytes);

}  // namespace accel::train

#endif  // ACCEL_TRAIN_FSDP_H_
