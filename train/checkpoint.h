// train/checkpoint.h: the files of Accelerate's save_state / load_state and
// save_model, each written atomically (temporary file, then rename), and the
// automatic checkpoint naming with total_limit pruning.
//
// A save_state folder holds (names as Accelerate's): model.safetensors
// (model_{i} for the i-th extra model), optimizer.bin, scheduler.bin,
// scaler.pt, random_states_{rank}.pkl, custom_checkpoint_{i}.pkl, and ours,
// dataloader_positions_{rank}.pkl. The .bin /
// .pkl / .pt files are torch pickles (torch::pickle_save of a dict), which
// Python's torch.load reads; the optimizer's is libtorch's own archive
// (its state layout differs from Python's).
#ifndef ACCEL_TRAIN_CHECKPOINT_H_
#define ACCEL_TRAIN_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "train/grad_scaler.h"
#include "train/scheduler.h"

namespace torch::optim {
class Optimizer;
}

namespace accel::train {

using StateDict = std::vector<std::pair<std::string, at::Tensor>>;

// ---- save_model ----

// "10GB", "500MB", "100KB" (decimal units, huggingface_hub's rule; KiB/MiB/GiB
// binary) or a plain byte count. InvalidArgument naming the text.
absl::StatusOr<int64_t> ParseShardSize(absl::string_view text);

struct SaveModelOptions {
  int64_t max_shard_size = 10'000'000'000;  // "10GB"
  // Stem of the files: "model" gives model.safetensors or
  // model-0000i-of-0000n.safetensors + model.safetensors.index.json.
  std::string weights_name = "model";
};

// Writes `state_dict` (huggingface_hub's greedy split: state-dict order, a
// tensor over the limit a shard of its own, appended at once) as safetensors
// with metadata {"format": "pt"}; the index is JSON with indent 2, sorted keys
// and a trailing newline. A name whose tensor is exactly an earlier name's
// (tied weights: same storage, offset, shape, strides, dtype) is dropped, the
// first kept (clean_state_dict_for_safetensors); a different view of an
// earlier tensor's storage is written as a copy in that tensor's shard
// (Accelerate would drop it). All files are written under temporary names and
// renamed once all succeeded, the index last; then this stem's shards, index
// or single file of an earlier save that the new one does not use are removed.
absl::Status SaveModel(const StateDict& state_dict, const std::string& dir,
                       const SaveModelOptions& options = {});
// Reads back what SaveModel wrote (one file or the index and its shards), on CPU.
absl::StatusOr<StateDict> LoadModelWeights(const std::string& dir,
                                           absl::string_view weights_name = "model");

// ---- state files ----

absl::Status SaveOptimizer(torch::optim::Optimizer& optimizer, const std::string& path);
absl::Status LoadOptimizer(torch::optim::Optimizer& optimizer, const std::string& path);

absl::Status SaveSchedulerState(const SchedulerState& state, const std::string& path);
absl::StatusOr<SchedulerState> LoadSchedulerState(const std::string& path);

absl::Status SaveScalerState(const GradScalerState& state, const std::string& path);
absl::StatusOr<GradScalerState> LoadScalerState(const std::string& path);

// random_states_{rank}.pkl: {"step": accumulation step, "torch_manual_seed":
// the CPU generator state, "torch_cuda_manual_seed": one state per CUDA
// device}. Restore sets the CPU generator and, where CUDA is present, the
// first min(saved, visible) devices' generators (torch.cuda.set_rng_state_all).
struct RandomStates {
  int64_t step = 0;
  at::Tensor cpu_state;                 // uint8, at::CPUGeneratorImpl::get_state()
  std::vector<at::Tensor> cuda_states;  // empty without CUDA
};
RandomStates CaptureRandomStates(int64_t step);
absl::Status RestoreRandomStates(const RandomStates& states);
absl::Status SaveRandomStates(const RandomStates& states, const std::string& path);
absl::StatusOr<RandomStates> LoadRandomStates(const std::string& path);

// dataloader_positions_{rank}.pkl (ours; Accelerate saves a map-style
// sampler's position only through torchdata's StatefulDataLoader): one entry
// per prepared loader, in the order they were prepared, as {"epoch": [...],
// "batches_yielded": [...], "pass_started": [...], "generator_state": [...]}
// (the last two for use_seedable_sampler false; an empty uint8 tensor for
// no state).
struct SavedLoaderPosition {
  int64_t epoch = 0;
  int64_t batches_yielded = 0;
  bool pass_started = false;
  at::Tensor generator_state;  // undefined: none
};
absl::Status SaveLoaderPositions(const std::vector<SavedLoaderPosition>& positions,
                                 const std::string& path);
absl::StatusOr<std::vector<SavedLoaderPosition>> LoadLoaderPositions(const std::string& path);

// A registered object's state (register_for_checkpointing): named tensors.
absl::Status SaveCustomState(const std::map<std::string, at::Tensor>& state,
                             const std::string& path);
absl::StatusOr<std::map<std::string, at::Tensor>> LoadCustomState(const std::string& path);

// ---- automatic checkpoint naming and atomic folders ----

// What save_state with automatic naming writes, and what it prunes once
// that is in place.
struct CheckpointPlan {
  std::string dir;  // project_dir/checkpoints/checkpoint_{iteration}
  // With total_limit: the oldest checkpoint folders (by their number, never
  // lexicographically) to remove so that with `dir` at most total_limit remain.
  std::vector<std::string> to_prune;
};
// Creates project_dir/checkpoints; FailedPrecondition if the target already
// exists (Accelerate's ValueError). Only folders named checkpoint_<int>
// count and are pruned (Accelerate counts every entry): a save's temporary
// folder, or anything else kept there, is never removed.
absl::StatusOr<CheckpointPlan> PlanCheckpoint(const std::string& project_dir, int64_t iteration,
                                              std::optional<int64_t> total_limit);
// remove_all of each folder; the first error names its folder.
absl::Status RemoveCheckpoints(const std::vector<std::string>& dirs);
// The checkpoint_<int> folder of project_dir/checkpoints with the largest
// number (a folder save_state is still writing has another name); NotFound
// when there is none.
absl::StatusOr<std::string> LatestCheckpointDir(const std::string& project_dir);

// Moves the complete folder `tmp` (written beside `dir`) to `dir`: one
// rename when `dir` does not exist, so `dir` appears whole or not at all;
// into an existing folder (an explicit save_state output_dir) file by file,
// each replaced atomically, and other files there are kept. A `tmp` that
// another process already moved (save_on_each_node on a shared file
// system) is fine.
absl::Status CommitCheckpointDir(const std::string& tmp, const std::string& dir);

}  // namespace accel::train

#endif  // ACCEL_TRAIN_CHECKPOINT_H_
