// train/accelerator.h: the Accelerator of HuggingFace Accelerate, in C++ on
// the dispatch core: one object that knows the process's place in the run
// (env.h), owns the process group, and prepares a model, optimizer, data
// loaders and scheduler so that the same training loop runs on one process
// or many, with gradient accumulation and mixed precision.
//
//   AcceleratorOptions options;
//   options.gradient_accumulation_steps = 4;
//   options.mixed_precision = "bf16";
//   ACCEL_ASSIGN_OR_RETURN(auto accelerator, Accelerator::Create(options));
//   ACCEL_ASSIGN_OR_RETURN(PreparedModel* model, accelerator->PrepareModel(net.ptr()));
//   ACCEL_ASSIGN_OR_RETURN(PreparedOptimizer* opt, accelerator->PrepareOptimizer(adam));
//   ACCEL_ASSIGN_OR_RETURN(auto loader, accelerator->PrepareDataLoader(*train_loader));
//   ACCEL_RETURN_IF_ERROR(loader->Start());
//   while (true) {
//     ACCEL_ASSIGN_OR_RETURN(std::optional<Batch> batch, loader->Next());
//     if (!batch) break;
//     ACCEL_ASSIGN_OR_RETURN(auto step, accelerator->Accumulate({model}));
//     at::Tensor loss;
//     {
//       ACCEL_ASSIGN_OR_RETURN(auto forward, accelerator->BeginForward(*model));
//       loss = Loss(net->forward((*batch)["x"]), (*batch)["y"]);
//     }
//     ACCEL_RETURN_IF_ERROR(accelerator->Backward(loss));
//     ACCEL_RETURN_IF_ERROR(opt->Step());      // acts only when sync_gradients()
//     opt->ZeroGrad();
//   }
#ifndef ACCEL_TRAIN_ACCELERATOR_H_
#define ACCEL_TRAIN_ACCELERATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

#include "train/autocast.h"
#include "train/collectives.h"
#include "train/data.h"
#include "train/ddp.h"
#include "train/env.h"
#include "train/fsdp.h"
#include "train/grad_scaler.h"
#include "train/process_group.h"
#include "train/scheduler.h"
#include "train/trackers.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace accel::train {

// ---- Configuration (Accelerate's dataclasses and kwargs handlers) ----

struct GradientAccumulationPlugin {
  int64_t num_steps = 1;
  // Accelerate's default is True, but its to_kwargs() drops defaults and the
  // gradient state then reads False: the branch never fires there (reference
  // §2.4). Here the field means what it says; set it to false for
  // Accelerate's observable behaviour (that is our default too).
  bool adjust_scheduler = false;
  bool sync_with_dataloader = true;
  bool sync_each_batch = false;
};

struct DataLoaderConfiguration {
  bool split_batches = false;
  // Unset: true for an IterableDataset (rank 0 reads the stream and sends
  // each rank its rows), false for a map-style one, as Accelerate; false too
  // without device placement (Accelerate ties dispatching to it; explicitly
  // true dispatches anyway here, the rows left on the cpu).
  std::optional<bool> dispatch_batches;
  bool even_batches = true;
  // true: shuffles are SeedableRandomSampler's (randperm seeded with
  // data_seed, else the loader's seed, else the last SetSeed, plus the
  // epoch), the same on every rank whatever their global RNG. false:
  // Accelerate's RandomSampler path, implemented as torch 1.13 draws it
  // (PrepareOptions::use_seedable_sampler in data.h): the order comes from a
  // generator seeded from the global RNG and synchronised from rank 0 at
  // every pass. Accelerate's default is false; ours is true, because only
  // the seedable sampler gives the same order for the same seed across runs
  // and process counts, which resuming and our tests rely on. Both resume
  // exactly through save_state / load_state (false: the generator is saved too).
  bool use_seedable_sampler = true;
  // The seedable sampler's seed; refused with use_seedable_sampler false
  // (Accelerate ignores it there).
  std::optional<uint64_t> data_seed;
  bool non_blocking = false;
  // Accelerate options with no C++ meaning; true is refused.
  bool use_stateful_dataloader = false;
};

struct ProjectConfiguration {
  std::string project_dir;
  std::string logging_dir;  // empty: project_dir
  bool automatic_checkpoint_naming = false;
  std::optional<int64_t> total_limit;
  int64_t iteration = 0;
  bool save_on_each_node = false;
};

struct AutocastKwargs {
  bool enabled = true;
  std::optional<bool> cache_enabled;
};

struct InitProcessGroupKwargs {
  std::string backend = "auto";  // "gloo", "nccl" or "auto"
  // Unset: 600 s when the backend is nccl, else 1800 s (Accelerate's
  // __post_init__, torch's defaults; DefaultProcessGroupTimeout).
  std::optional<absl::Duration> timeout;
  std::string init_method;  // only "" / "env://" (torchrun's variables) is supported
};

struct DistributedDataParallelKwargs {
  int64_t dim = 0;  // only 0
  bool broadcast_buffers = true;
  double bucket_cap_mb = 25;
  bool find_unused_parameters = false;
  bool check_reduction = false;  // true is refused: deprecated in PyTorch, a no-op there
  bool gradient_as_bucket_view = false;
  // true is refused: PyTorch's static-graph mode (reducer rebuilt after the
  // first iteration, unused parameters tolerated under reentrant checkpoints)
  // is not implemented; the buckets here are fixed at prepare anyway.
  bool static_graph = false;
  // "", "fp16" or "bf16" (DDPCommunicationHookType); power_sgd is refused.
  std::string comm_hook;
};

struct AcceleratorOptions {
  // "no", "fp16", "bf16"; empty: $ACCELERATE_MIXED_PRECISION, else "no".
  std::string mixed_precision;
  // At most one of the two; $ACCELERATE_GRADIENT_ACCUMULATION_STEPS overrides the count.
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<GradientAccumulationPlugin> gradient_accumulation_plugin;
  bool cpu = false;  // or $ACCELERATE_USE_CPU
  // false: prepare leaves models and batches where they are (the program
  // moves them); PrepareModel / PrepareDataLoader can say so per object.
  bool device_placement = true;
  DataLoaderConfiguration dataloader_config;
  ProjectConfiguration project_config;
  bool step_scheduler_with_optimizer = true;
  // Trackers by name ("jsonl", "tensorboard", "all").
  std::vector<std::string> log_with;
  // Kwargs handlers (one of each, as Accelerate requires).
  std::optional<GradScalerOptions> grad_scaler_kwargs;
  std::optional<AutocastKwargs> autocast_kwargs;
  std::optional<InitProcessGroupKwargs> init_process_group_kwargs;
  std::optional<DistributedDataParallelKwargs> ddp_kwargs;
  // Accelerate options a C++ program cannot have: anything but "no" / false
  // is refused with a message (never ignored).
  std::string dynamo_backend = "no";
  bool use_deepspeed = false;
  bool use_megatron_lm = false;
  // Fully sharded data parallel (train/fsdp.h): use_fsdp, or
  // $ACCELERATE_USE_FSDP (accel-launch's distributed_type FSDP), with this
  // plugin, else the one the FSDP_* variables describe.
  bool use_fsdp = false;
  std::optional<FullyShardedDataParallelPlugin> fsdp_plugin;
};

// ---- Prepared objects ----

class Accelerator;

// A model on its device, with the gradient all-reduce attached when distributed.
class PreparedModel {
 public:
  torch::nn::Module& module() const { return *module_; }
  const std::shared_ptr<torch::nn::Module>& shared() const { return module_; }
  // nullptr on one process, and under FSDP.
  GradientSynchronizer* synchronizer() const { return synchronizer_.get(); }
  // The FSDP wrapper; nullptr unless the Accelerator uses FSDP.
  ShardedModel* sharded() const { return sharded_.get(); }
  // named_parameters + named_buffers, the keys of model.safetensors. Not for
  // a sharded model, whose tensors are gathered only while they run: use
  // Accelerator::GetStateDict.
  NamedTensors StateDict() const;

 private:
  friend class Accelerator;
  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<GradientSynchronizer> synchronizer_;
  std::unique_ptr<ShardedModel> sharded_;
};

// AcceleratedOptimizer: Step and ZeroGrad act only when gradients are synced.
class PreparedOptimizer {
 public:
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  // optimizer.step() through the scaler (fp16): skipped on inf/NaN gradients.
  absl::Status Step();
  void ZeroGrad();  // set_to_none
  bool step_was_skipped() const { return step_was_skipped_; }

 private:
  friend class Accelerator;
  Accelerator* accelerator_ = nullptr;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  bool step_was_skipped_ = false;
};

// AcceleratedScheduler: steps with the optimizer, num_processes ticks per
// real step (one with split_batches), none when the step was skipped.
class PreparedScheduler {
 public:
  LRScheduler& scheduler() const { return *scheduler_; }
  absl::Status Step();

 private:
  friend class Accelerator;
  Accelerator* accelerator_ = nullptr;
  std::shared_ptr<LRScheduler> scheduler_;
};

// An object saved by save_state (register_for_checkpointing).
class Checkpointable {
 public:
  virtual ~Checkpointable() = default;
  virtual std::map<std::string, at::Tensor> StateDict() const = 0;
  virtual absl::Status LoadStateDict(const std::map<std::string, at::Tensor>& state) = 0;
};

// ---- Scopes ----

// What Accumulate() returns: while alive, the models skip the gradient
// all-reduce unless this step syncs.
class AccumulateScope {
 public:
  AccumulateScope(AccumulateScope&&) noexcept;
  ~AccumulateScope();

 private:
  friend class Accelerator;
  AccumulateScope() = default;
  std::vector<std::pair<GradientSynchronizer*, bool>> restore_;
  std::vector<std::pair<ShardedModel*, bool>> restore_sharded_;
};

// What BeginForward() returns: the autocast region of a forward.
class ForwardScope {
 public:
  ForwardScope(ForwardScope&&) noexcept = default;

 private:
  friend class Accelerator;
  ForwardScope() = default;
  std::unique_ptr<AutocastScope> autocast_;
  // A sharded model's hooks on the thread running the forward.
  std::unique_ptr<dispatch::ScopedModuleHooks> hooks_;
};

class Accelerator {
 public:
  // Reads the environment (torchrun / accel-launch / MPI / SLURM), connects
  // the process group when world_size > 1, and checks every option:
  // InvalidArgument naming the option for a value that is wrong or that a
  // C++ program cannot honour.
  static absl::StatusOr<std::unique_ptr<Accelerator>> Create(const AcceleratorOptions& options,
                                                             const EnvLookup& env = ProcessEnv());
  ~Accelerator();

  // ---- Where we are ----
  int process_index() const { return environment_.rank; }
  int num_processes() const { return environment_.world_size; }
  int local_process_index() const { return environment_.local_rank; }
  bool is_main_process() const { return process_index() == 0; }
  bool is_local_main_process() const { return local_process_index() == 0; }
  bool is_last_process() const { return process_index() == num_processes() - 1; }
  c10::Device device() const { return device_; }
  DistributedType distributed_type() const { return distributed_type_; }
  PrecisionType mixed_precision() const { return precision_; }
  // The FSDP plugin in force; nullptr without FSDP.
  const FullyShardedDataParallelPlugin* fsdp_plugin() const { return fsdp_ ? &*fsdp_ : nullptr; }
  ProcessGroup& group() const { return *group_; }
  const ProcessEnvironment& environment() const { return environment_; }
  const ProjectConfiguration& project_configuration() const { return project_; }

  // ---- prepare ----
  // `device_placement` (unset: AcceleratorOptions::device_placement) moves
  // every parameter and buffer not on device() there (Accelerate's
  // model.to(device)); off, the model stays where it is.
  absl::StatusOr<PreparedModel*> PrepareModel(std::shared_ptr<torch::nn::Module> module,
                                              std::optional<bool> device_placement = std::nullopt);
  absl::StatusOr<PreparedOptimizer*> PrepareOptimizer(
      std::shared_ptr<torch::optim::Optimizer> optimizer);
  absl::StatusOr<PreparedScheduler*> PrepareScheduler(std::shared_ptr<LRScheduler> scheduler);
  // The prepared loader's position (epoch, batches handed out) is recorded
  // by SaveState and restored by LoadState, whose caller then simply iterates
  // it: the first pass continues the saved epoch where it was.
  // `device_placement` (unset: the option): batches on device(), or left
  // where the dataset made them.
  absl::StatusOr<std::unique_ptr<DataLoader>> PrepareDataLoader(
      const DataLoader& loader, std::optional<bool> device_placement = std::nullopt);
  // The loader that skips the first `num_batches` of its epoch (resuming by
  // hand; it shares the position of `loader`, and its count replaces one
  // LoadState restored).
  std::unique_ptr<DataLoader> SkipFirstBatches(const DataLoader& loader, int64_t num_batches) const;

  // ---- The training step ----
  int64_t gradient_accumulation_steps() const { return plugin_.num_steps; }
  bool sync_gradients() const { return sync_gradients_; }
  int64_t accumulation_step() const { return step_; }
  // Moves the step counter (Accelerate's _do_sync) and turns the models'
  // all-reduce off for a non-sync step.
  absl::StatusOr<AccumulateScope> Accumulate(const std::vector<PreparedModel*>& models);
  // The all-reduce off for `models` while the scope lives (no_sync).
  AccumulateScope NoSync(const std::vector<PreparedModel*>& models);
  // Autocast for mixed precision and the DDP buffer broadcast.
  absl::StatusOr<ForwardScope> BeginForward(const PreparedModel& model);
  // An explicit autocast region (accelerator.autocast(AutocastKwargs)).
  std::unique_ptr<AutocastScope> Autocast(const AutocastKwargs& kwargs) const;
  // loss / gradient_accumulation_steps, scaled for fp16, backward, then the
  // gradient all-reduce of every prepared model that syncs this step.
  absl::Status Backward(const at::Tensor& loss);
  // Unscales (fp16) then clips; returns the total norm before clipping.
  absl::StatusOr<double> ClipGradNorm(const std::vector<at::Tensor>& parameters, double max_norm,
                                      double norm_type = 2.0);
  absl::Status ClipGradValue(const std::vector<at::Tensor>& parameters, double clip_value);
  // Unscales the prepared optimizers' gradients (fp16), once per step.
  absl::Status UnscaleGradients();
  GradScaler* scaler() const { return scaler_.get(); }

  // ---- Collectives ----
  // Accelerate's debug mode ($ACCELERATE_DEBUG_MODE, accel-launch --debug):
  // Gather, Reduce and Broadcast first share every rank's shapes and fail on
  // all ranks (InvalidArgument listing them) when they differ, instead of a
  // collective that hangs or fails obscurely (verify_operation).
  bool debug() const { return debug_; }
  absl::StatusOr<at::Tensor> Gather(const at::Tensor& tensor) const;
  absl::StatusOr<TensorMap> Gather(const TensorMap& tensors) const;
  // Gather, then at the end of the active prepared loader drop the samples
  // even_batches duplicated (the first `remainder` rows of the last batch).
  absl::StatusOr<at::Tensor> GatherForMetrics(const at::Tensor& tensor) const;
  absl::StatusOr<TensorMap> GatherForMetrics(const TensorMap& tensors) const;
  absl::StatusOr<at::Tensor> Reduce(const at::Tensor& tensor, Reduction reduction) const;
  absl::StatusOr<at::Tensor> PadAcrossProcesses(const at::Tensor& tensor,
                                                const PadOptions& options = {}) const;
  absl::StatusOr<at::Tensor> Broadcast(const at::Tensor& tensor, int src = 0) const;
  absl::Status WaitForEveryone() const;
  template <typename T>
  std::vector<T> SplitBetweenProcesses(const std::vector<T>& items,
                                       bool apply_padding = false) const {
    return train::SplitBetweenProcesses(items, process_index(), num_processes(), apply_padding);
  }
  // Printed by the main process only (a newline is added).
  void Print(absl::string_view text) const;

  // ---- Objects: gather_object, broadcast_object_list, gather_for_metrics(use_gather_object) ----
  // Values travel as byte strings: serialise them first (nlohmann::json's
  // dump() / parse(), a protobuf, ...). Collective, like the tensor ones.
  // gather_object of one value: every rank's, in rank order.
  absl::StatusOr<std::vector<std::string>> GatherObject(absl::string_view bytes) const;
  // gather_object of a list: every rank's items, concatenated in rank order.
  absl::StatusOr<std::vector<std::string>> GatherObject(
      const std::vector<std::string>& items) const;
  // broadcast_object_list: afterwards `objects` is from_process's list on
  // every rank (its length too). InvalidArgument naming from_process when it
  // is not a rank.
  absl::Status BroadcastObjectList(std::vector<std::string>& objects, int from_process = 0) const;
  // gather_for_metrics of non-tensors (the object path): every rank's items
  // in rank order; on the last batch of the active prepared loader, the
  // first `remainder` of them (the duplicates of even batches dropped), as
  // for tensors.
  absl::StatusOr<std::vector<std::string>> GatherForMetrics(
      const std::vector<std::string>& items) const;
  // gather_for_metrics(use_gather_object=true): each rank's tensor travels
  // as an object, so the ranks' first dimensions may differ (nothing to pad);
  // the result is their concatenation along dim 0 in rank order (Accelerate
  // returns the list of those rows), truncated as above, on this rank's
  // device. The ranks must agree on dtype and on the dims past 0
  // (InvalidArgument naming the rank). false: GatherForMetrics above.
  absl::StatusOr<at::Tensor> GatherForMetrics(const at::Tensor& tensor,
                                              bool use_gather_object) const;
  absl::StatusOr<TensorMap> GatherForMetrics(const TensorMap& tensors,
                                             bool use_gather_object) const;

  // ---- Checkpoints ----
  void RegisterForCheckpointing(std::shared_ptr<Checkpointable> object);
  // Accelerate's save_state: returns the folder written. With automatic
  // naming `output_dir` is ignored (project_dir/checkpoints/checkpoint_N).
  // The files are written into a temporary folder beside it
  // (checkpoint_N.tmp-PID), which is renamed once complete: a failed or
  // interrupted save leaves no checkpoint_N behind, and total_limit prunes
  // older checkpoint_<int> folders (nothing else) only after the new one is
  // in place. An existing output_dir is updated file by file, keeping the
  // other files in it. Collective: every rank calls it, and a failure on any
  // rank (rank 0 finding checkpoint_N exists, a writer failing) makes it
  // return an error on every rank, naming the rank that failed.
  absl::StatusOr<std::string> SaveState(const std::string& output_dir = "");
  // Empty `input_dir` with automatic naming: the latest checkpoint. Restores
  // models, optimizers, schedulers, scaler, RNG states, the accumulation
  // step, registered objects and the prepared loaders' positions (matched in
  // the order they were prepared: prepare the same loaders before loading,
  // another number is FailedPrecondition; a checkpoint without positions, or
  // no loader prepared yet, leaves them as they are); also sets project iteration to the loaded
  // checkpoint's number + 1 (Accelerate forgets this: issues #1601 / #3306).
  absl::Status LoadState(const std::string& input_dir = "");
  // get_state_dict: the model's named parameters and buffers. Collective for
  // a sharded model (every rank calls it and gets the whole model, float32
  // on the cpu).
  absl::StatusOr<NamedTensors> GetStateDict(const PreparedModel& model) const;
  // save_model: the model's state dict as (sharded) safetensors, written by
  // the main process. Collective for a sharded model (GetStateDict).
  absl::Status SaveModel(const PreparedModel& model, const std::string& dir,
                         const std::string& max_shard_size = "10GB") const;

  // ---- Trackers (main process only) ----
  absl::Status InitTrackers(const std::string& project_name,
                            const std::map<std::string, std::string>& config = {});
  absl::Status Log(const std::map<std::string, double>& values, int64_t step);
  absl::Status EndTraining();

  // The gradient state's loader stack (prepared loaders register here).
  ActiveLoaders* active_loaders() { return &active_loaders_; }

 private:
  friend class PreparedOptimizer;
  friend class PreparedScheduler;
  Accelerator() = default;
  void DoSync();
  // A sharded model's piece of a parameter; `replicated` when every rank
  // holds the same whole gradient (NO_SHARD), so that it counts once.
  struct GradientPiece {
    at::Tensor piece;
    bool replicated = false;
  };
  // ClipGradNorm over FSDP pieces: the norm of every rank's pieces together.
  absl::StatusOr<double> ClipShardedGradNorm(const std::vector<GradientPiece>& pieces,
                                             double max_norm, double norm_type);
  // The tensors ClipGradValue clips: a sharded model's pieces stand for its parameters.
  std::vector<at::Tensor> GradientHolders(const std::vector<at::Tensor>& parameters) const;
  // This rank's files of save_state, into `dir`.
  absl::Status WriteStateFiles(const std::string& dir) const;
  // With debug_: OK when every rank passed `shapes` alike (a collective).
  absl::Status VerifyOperation(absl::string_view operation, const std::string& shapes) const;

  ProcessEnvironment environment_;
  std::unique_ptr<ProcessGroup> group_;
  c10::Device device_ = c10::Device(c10::kCPU);
  DistributedType distributed_type_ = DistributedType::kNo;
  bool debug_ = false;
  PrecisionType precision_ = PrecisionType::kNo;
  GradientAccumulationPlugin plugin_;
  DataLoaderConfiguration dataloader_config_;
  ProjectConfiguration project_;
  AcceleratorOptions options_;
  std::unique_ptr<GradScaler> scaler_;
  ActiveLoaders active_loaders_;
  bool sync_gradients_ = true;
  int64_t step_ = 0;
  std::vector<std::unique_ptr<PreparedModel>> models_;
  std::vector<std::unique_ptr<PreparedOptimizer>> optimizers_;
  std::vector<std::unique_ptr<PreparedScheduler>> schedulers_;
  std::vector<std::shared_ptr<Checkpointable>> custom_objects_;
  // One per prepared loader, in order; they outlive the loaders.
  std::vector<std::shared_ptr<LoaderCursor>> loader_cursors_;
  std::vector<std::unique_ptr<Tracker>> trackers_;
  std::optional<FullyShardedDataParallelPlugin> fsdp_;
  // The sharded model's hooks on the thread that prepared it, for forwards
  // run outside BeginForward (evaluation).
  std::unique_ptr<dispatch::ScopedModuleHooks> prepared_hooks_;
};

// set_seed: seeds libtorch's CPU (and CUDA) generators with `seed`, plus the
// process index when device_specific; prepared loaders without data_seed
// shuffle from it. deterministic: torch.use_deterministic_algorithms(True)
// (at::globalContext().setDeterministicAlgorithms(true, false)): an op
// without a deterministic implementation then throws (a Status through
// CallTorch) instead of running; false leaves the setting as it is, as
// Accelerate does.
void SetSeed(uint64_t seed, bool device_specific = false, int process_index = 0,
             bool deterministic = false);
// The seed of the last SetSeed (0 before any).
uint64_t LastSeed();

// find_executable_batch_size: calls fn(batch_size), halving batch_size
// while it fails with ResourceExhausted (out of memory: a c10::OutOfMemoryError
// or std::bad_alloc turned into a Status), until it succeeds or reaches 0
// (ResourceExhausted "no executable batch size found").
absl::Status FindExecutableBatchSize(int64_t starting_batch_size,
                                     const std::function<absl::Status(int64_t)>& fn);
// free_memory: drops the references (and the vector's own storage). The CPU
// allocator keeps no cache to release; releasing CUDA's caching allocator
// (Accelerate's torch.cuda.empty_cache()) needs a CUDA build of the library,
// which is not made yet, so on a GPU the cached blocks stay with the process.
void FreeMemory(std::vector<at::Tensor>& tensors);

}  // namespace accel::train

#endif  // ACCEL_TRAIN_ACCELERATOR_H_
