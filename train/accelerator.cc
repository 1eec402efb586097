#include "train/accelerator.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <new>
#include <regex>
#include <set>
#include <unistd.h>
#include <utility>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/nn/module.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "core/status.h"
#include "train/checkpoint.h"

namespace accel::train {
namespace {

std::atomic<uint64_t> g_last_seed{0};

bool EnvTrue(const EnvLookup& env, const std::string& name) {
  std::optional<std::string> v = env(name);
  if (!v) return false;
  std::string s = absl::AsciiStrToLower(*v);
  return s == "1" || s == "true" || s == "yes";
}

std::string Indexed(absl::string_view stem, size_t i, absl::string_view ext) {
  return i == 0 ? absl::StrCat(stem, ext) : absl::StrCat(stem, "_", i, ext);
}

// The number that ends a checkpoint folder's name, or -1.
int64_t TrailingNumber(const std::string& path) {
  std::string name = std::filesystem::path(path).filename().string();
  if (name.empty()) name = std::filesystem::path(path).parent_path().filename().string();
  std::smatch m;
  static const std::regex kDigits("(\\d+)$");
  int64_t n = -1;
  if (std::regex_search(name, m, kDigits) && absl::SimpleAtoi(m.str(1), &n)) return n;
  return -1;
}

// A Status as bytes for a collective ("code\tmessage"; empty for OK), and
// back, prefixed with `what` and the rank it came from.
std::string EncodeFailure(const absl::Status& status) {
  return status.ok() ? "" : absl::StrCat(static_cast<int>(status.code()), "\t", status.message());
}
absl::Status DecodeFailure(absl::string_view failure, absl::string_view what, size_t rank) {
  const size_t tab = failure.find('\t');
  int code = static_cast<int>(absl::StatusCode::kUnknown);
  if (!absl::SimpleAtoi(failure.substr(0, tab), &code)) {
    code = static_cast<int>(absl::StatusCode::kUnknown);
  }
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat(what, ": rank ", rank, " failed: ",
                                   tab == absl::string_view::npos ? "" : failure.substr(tab + 1)));
}

// Every rank's outcome of one step of a collective operation, on every rank:
// OK when all succeeded; else the failing rank keeps its own error and the
// others get its code, with the rank named. Everyone returns together, so no
// rank is left waiting in a collective that a failed rank never reaches.
absl::Status AgreeOnOutcome(ProcessGroup& group, const absl::Status& local,
                            absl::string_view what) {
  absl::StatusOr<std::vector<std::string>> all = group.AllGatherBytes(EncodeFailure(local));
  if (!local.ok()) return local;
  if (!all.ok()) return Annotate(all.status(), what);
  for (size_t r = 0; r < all->size(); ++r) {
    if (!(*all)[r].empty()) return DecodeFailure((*all)[r], what, r);
  }
  return absl::OkStatus();
}

// Whether a parameter or buffer of `module` is somewhere other than `device`
// (a model already there is not touched: Module::to would rewrap every tensor).
bool ModuleOffDevice(const torch::nn::Module& module, const c10::Device& device) {
  for (const at::Tensor& p : module.parameters(/*recurse=*/true)) {
    if (p.device() != device) return true;
  }
  for (const at::Tensor& b : module.buffers(/*recurse=*/true)) {
    if (b.defined() && b.device() != device) return true;
  }
  return false;
}

}  // namespace

// ---- Prepared objects ----

NamedTensors PreparedModel::StateDict() const {
  NamedTensors out;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value().detach());
  }
  for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value().detach());
  }
  return out;
}

absl::Status PreparedOptimizer::Step() {
  if (!accelerator_->sync_gradients()) return absl::OkStatus();
  GradScaler* scaler = accelerator_->scaler();
  if (scaler != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(bool stepped, scaler->Step(*optimizer_));
    ACCEL_RETURN_IF_ERROR(scaler->Update());
    step_was_skipped_ = !stepped;
  } else {
    step_was_skipped_ = false;
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] { optimizer_->step(); }), "optimizer step"));
  }
  // The optimizer stepped the shards: what a sharded model keeps gathered
  // (its root) is gathered again, on every rank together.
  for (const auto& model : accelerator_->models_) {
    if (ShardedModel* sharded = model->sharded()) {
      ACCEL_RETURN_IF_ERROR(Annotate(sharded->ShardsChanged(), "FSDP after the optimizer step"));
    }
  }
  return absl::OkStatus();
}

void PreparedOptimizer::ZeroGrad() {
  if (!accelerator_->sync_gradients()) return;
  // set_to_none, Accelerate's default: the next backward writes fresh
  // gradients instead of adding to zeros.
  for (auto& group : optimizer_->param_groups()) {
    for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
  }
  // A sharded model's gradients go too: the shard gradients behind the
  // pieces, and any gathered ones no_sync left on the parameters.
  for (const auto& model : accelerator_->models_) {
    if (ShardedModel* sharded = model->sharded()) sharded->ZeroGrad();
  }
}

absl::Status PreparedScheduler::Step() {
  const Accelerator& acc = *accelerator_;
  if (!acc.options_.step_scheduler_with_optimizer) {
    scheduler_->Step();
    return absl::OkStatus();
  }
  if (!acc.sync_gradients()) {
    if (acc.plugin_.adjust_scheduler) scheduler_->IncrementStepCount();
    return absl::OkStatus();
  }
  for (const auto& opt : acc.optimizers_) {
    if (opt->step_was_skipped()) return absl::OkStatus();
  }
  // The loss is averaged over num_processes times the per-process batch, so
  // one optimizer step covers that many single-process steps (Accelerate).
  const int ticks = acc.dataloader_config_.split_batches ? 1 : acc.num_processes();
  for (int i = 0; i < ticks; ++i) {
    std::optional<int64_t> total = scheduler_->total_steps();
    if (total && scheduler_->step_count() > *total) break;
    scheduler_->Step();
  }
  return absl::OkStatus();
}

AccumulateScope::AccumulateScope(AccumulateScope&& other) noexcept
    : restore_(std::move(other.restore_)), restore_sharded_(std::move(other.restore_sharded_)) {
  other.restore_.clear();
  other.restore_sharded_.clear();
}

AccumulateScope::~AccumulateScope() {
  for (auto& [sync, previous] : restore_) sync->set_require_sync(previous);
  for (auto& [sharded, previous] : restore_sharded_) sharded->set_require_sync(previous);
}

// ---- Accelerator ----

absl::StatusOr<std::unique_ptr<Accelerator>> Accelerator::Create(const AcceleratorOptions& options,
                                                                 const EnvLookup& env) {
  auto acc = std::unique_ptr<Accelerator>(new Accelerator());
  acc->options_ = options;

  // What a C++ program cannot do is refused, never ignored.
  std::string dynamo = options.dynamo_backend;
  if (std::optional<std::string> v = env("ACCELERATE_DYNAMO_BACKEND"); v && dynamo == "no") {
    dynamo = *v;
  }
  if (absl::AsciiStrToLower(dynamo) != "no") {
    return absl::InvalidArgumentError(
        absl::StrCat("dynamo_backend \"", dynamo,
                     "\": torch.compile backends exist only in Python; a C++ program runs eagerly "
                     "(use \"no\")"));
  }
  if (options.use_deepspeed || EnvTrue(env, "ACCELERATE_USE_DEEPSPEED")) {
    return absl::InvalidArgumentError("use_deepspeed: DeepSpeed is not available to C++ programs");
  }
  if (options.use_fsdp || options.fsdp_plugin || EnvTrue(env, "ACCELERATE_USE_FSDP")) {
    if (options.fsdp_plugin) {
      acc->fsdp_ = *options.fsdp_plugin;
    } else {
      ACCEL_ASSIGN_OR_RETURN(acc->fsdp_, FullyShardedDataParallelPlugin::FromEnv(env));
    }
    if (acc->fsdp_->activation_checkpointing) {
      return absl::InvalidArgumentError(
          "FSDP activation_checkpointing: libtorch's C++ modules have no recomputation hooks");
    }
    if (!acc->fsdp_->use_orig_params) {
      return absl::InvalidArgumentError(
          "FSDP use_orig_params=false: the optimizer steps the original parameters' pieces here");
    }
  }
  if (options.use_megatron_lm) {
    return absl::InvalidArgumentError("use_megatron_lm: Megatron-LM is not available to C++");
  }
  if (!options.dataloader_config.use_seedable_sampler && options.dataloader_config.data_seed) {
    return absl::InvalidArgumentError(
        "dataloader_config.data_seed seeds the seedable sampler only: with use_seedable_sampler "
        "false the shuffle comes from the global RNG (SetSeed) or the loader's own seed");
  }
  if (options.dataloader_config.use_stateful_dataloader) {
    return absl::InvalidArgumentError(
        "dataloader_config.use_stateful_dataloader: torchdata's StatefulDataLoader is Python-only; "
        "save_state records the loaders' epoch and position instead");
  }

  // Mixed precision: the argument, else $ACCELERATE_MIXED_PRECISION, else "no".
  std::string precision = "no";
  if (!options.mixed_precision.empty()) {
    precision = options.mixed_precision;
  } else if (std::optional<std::string> v = env("ACCELERATE_MIXED_PRECISION")) {
    precision = absl::AsciiStrToLower(*v);
  }
  absl::StatusOr<PrecisionType> parsed = ParsePrecision(precision);
  if (!parsed.ok()) return Annotate(parsed.status(), "mixed_precision");
  acc->precision_ = *parsed;

  // Gradient accumulation.
  if (options.gradient_accumulation_steps && options.gradient_accumulation_plugin) {
    return absl::InvalidArgumentError(
        "gradient_accumulation_steps and gradient_accumulation_plugin are both set: set the steps "
        "in the plugin (num_steps) only");
  }
  if (options.gradient_accumulation_plugin) acc->plugin_ = *options.gradient_accumulation_plugin;
  if (options.gradient_accumulation_steps) {
    acc->plugin_.num_steps = *options.gradient_accumulation_steps;
  }
  if (std::optional<std::string> v = env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(*v, &n)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ACCELERATE_GRADIENT_ACCUMULATION_STEPS=\"", *v, "\" is not an integer"));
    }
    acc->plugin_.num_steps = n;
  }
  if (acc->plugin_.num_steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient_accumulation_steps must be >= 1, got ", acc->plugin_.num_steps));
  }

  // Kwargs handlers.
  if (options.ddp_kwargs) {
    const DistributedDataParallelKwargs& ddp = *options.ddp_kwargs;
    if (ddp.dim != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("DistributedDataParallelKwargs.dim = ", ddp.dim,
                       ": batches are split along dimension 0 only"));
    }
    if (!ddp.comm_hook.empty() && ddp.comm_hook != "no" && ddp.comm_hook != "fp16" &&
        ddp.comm_hook != "bf16") {
      return absl::InvalidArgumentError(
          absl::StrCat("DistributedDataParallelKwargs.comm_hook \"", ddp.comm_hook,
                       "\": supported are \"fp16\" and \"bf16\" (power_sgd is not implemented)"));
    }
    if (ddp.bucket_cap_mb <= 0) {
      return absl::InvalidArgumentError("DistributedDataParallelKwargs.bucket_cap_mb must be > 0");
    }
    if (ddp.static_graph) {
      return absl::InvalidArgumentError(
          "DistributedDataParallelKwargs.static_graph = true: PyTorch's static-graph mode is not "
          "implemented (its buckets are fixed at prepare here anyway; use false)");
    }
    if (ddp.check_reduction) {
      return absl::InvalidArgumentError(
          "DistributedDataParallelKwargs.check_reduction = true: deprecated in PyTorch, where it "
          "does nothing; not implemented here (use false)");
    }
  }
  ProcessGroupOptions group_options;
  if (options.init_process_group_kwargs) {
    const InitProcessGroupKwargs& pg = *options.init_process_group_kwargs;
    if (!pg.init_method.empty() && pg.init_method != "env://") {
      return absl::InvalidArgumentError(
          absl::StrCat("InitProcessGroupKwargs.init_method \"", pg.init_method,
                       "\": only env:// (the launcher's MASTER_ADDR / MASTER_PORT) is supported"));
    }
    group_options.backend = pg.backend;
    if (pg.timeout) group_options.timeout = *pg.timeout;
  }

  ACCEL_ASSIGN_OR_RETURN(acc->environment_, DetectProcessEnvironment(env));
  acc->debug_ = EnvTrue(env, "ACCELERATE_DEBUG_MODE");
  const bool use_cpu =
      options.cpu || acc->environment_.use_cpu || EnvTrue(env, "ACCELERATE_USE_CPU");
  if (!use_cpu && at::globalContext().hasCUDA()) {
    acc->device_ =
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(
                                    acc->environment_.local_rank %
                                    std::max<int64_t>(1, at::detail::getCUDAHooks().getNumGPUs())));
  }
  group_options.use_cuda = acc->device_.is_cuda();
  if (acc->environment_.world_size > 1) {
    acc->distributed_type_ =
        acc->device_.is_cuda() ? DistributedType::kMultiGpu : DistributedType::kMultiCpu;
    ACCEL_ASSIGN_OR_RETURN(acc->group_, ProcessGroup::Connect(acc->environment_, group_options));
  } else {
    acc->group_ = ProcessGroup::Single();
  }

  if (acc->fsdp_) {
    acc->distributed_type_ = DistributedType::kFsdp;
    if (acc->precision_ == PrecisionType::kFp16) {
      // Each rank's inf check would see only its own shards, and ranks
      // could disagree on skipping a step (PyTorch's ShardedGradScaler
      // all-reduces found_inf for this).
      return absl::InvalidArgumentError(
          "mixed_precision fp16 with FSDP: the loss scaler does not shard its inf check; use bf16");
    }
  }
  if (acc->precision_ == PrecisionType::kFp16) {
    GradScalerOptions scaler_options = options.grad_scaler_kwargs.value_or(GradScalerOptions{});
    absl::StatusOr<GradScaler> scaler = GradScaler::Create(scaler_options);
    if (!scaler.ok()) return Annotate(scaler.status(), "GradScalerKwargs");
    acc->scaler_ = std::make_unique<GradScaler>(*std::move(scaler));
  }

  acc->dataloader_config_ = options.dataloader_config;
  acc->project_ = options.project_config;
  if (acc->project_.logging_dir.empty()) acc->project_.logging_dir = acc->project_.project_dir;
  if (acc->project_.automatic_checkpoint_naming && acc->project_.project_dir.empty()) {
    return absl::InvalidArgumentError(
        "ProjectConfiguration.automatic_checkpoint_naming needs project_dir");
  }
  if (acc->project_.total_limit && *acc->project_.total_limit < 1) {
    return absl::InvalidArgumentError("ProjectConfiguration.total_limit must be >= 1");
  }
  for (const std::string& name : options.log_with) {
    if (name != "jsonl" && name != "tensorboard" && name != "all") {
      return absl::InvalidArgumentError(absl::StrCat("log_with: unknown tracker \"", name,
                                                     "\" (known: jsonl, tensorboard, all)"));
    }
  }
  return acc;
}

Accelerator::~Accelerator() = default;

absl::StatusOr<PreparedModel*> Accelerator::PrepareModel(std::shared_ptr<torch::nn::Module> module,
                                                         std::optional<bool> device_placement) {
  if (module == nullptr) return absl::InvalidArgumentError("PrepareModel: the module is null");
  auto prepared = std::make_unique<PreparedModel>();
  prepared->module_ = std::move(module);
  if (device_placement.value_or(options_.device_placement) &&
      ModuleOffDevice(*prepared->module_, device_)) {
    ACCEL_RETURN_IF_ERROR(
        Annotate(CallTorch([&] { prepared->module_->to(device_); }), "moving the model"));
  }
  if (fsdp_) {
    for (const auto& m : models_) {
      if (m->sharded() != nullptr) {
        return absl::InvalidArgumentError(
            "PrepareModel: FSDP shards one model per Accelerator (its module hooks are the "
            "thread's); prepare the others before, or train them with another Accelerator");
      }
    }
    const int nodes =
        std::max(1, environment_.world_size / std::max(1, environment_.local_world_size));
    ACCEL_ASSIGN_OR_RETURN(prepared->sharded_,
                           ShardedModel::Wrap(prepared->module_, *group_, *fsdp_, device_, nodes));
    prepared_hooks_ = std::make_unique<dispatch::ScopedModuleHooks>(prepared->sharded_.get());
    models_.push_back(std::move(prepared));
    return models_.back().get();
  }
  if (num_processes() > 1) {
    DdpOptions ddp;
    if (options_.ddp_kwargs) {
      const DistributedDataParallelKwargs& k = *options_.ddp_kwargs;
      ddp.bucket_cap_mb = k.bucket_cap_mb;
      ddp.find_unused_parameters = k.find_unused_parameters;
      ddp.gradient_as_bucket_view = k.gradient_as_bucket_view;
      ddp.broadcast_buffers = k.broadcast_buffers;
      ddp.comm_hook = k.comm_hook == "fp16"   ? CommHook::kFp16
                      : k.comm_hook == "bf16" ? CommHook::kBf16
                                              : CommHook::kNone;
    }
    // Tied weights are one tensor under two names: reduce it once.
    NamedTensors params;
    std::set<const void*> seen;
    for (const auto& item : prepared->module_->named_parameters(true)) {
      if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
        params.emplace_back(item.key(), item.value());
      }
    }
    NamedTensors buffers;
    for (const auto& item : prepared->module_->named_buffers(true)) {
      buffers.emplace_back(item.key(), item.value());
    }
    ACCEL_ASSIGN_OR_RETURN(
        prepared->synchronizer_,
        GradientSynchronizer::Attach(std::move(params), std::move(buffers), *group_, ddp));
  }
  models_.push_back(std::move(prepared));
  return models_.back().get();
}

absl::StatusOr<PreparedOptimizer*> Accelerator::PrepareOptimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer) {
  if (optimizer == nullptr) return absl::InvalidArgumentError("PrepareOptimizer: null optimizer");
  auto prepared = std::make_unique<PreparedOptimizer>();
  prepared->accelerator_ = this;
  prepared->optimizer_ = std::move(optimizer);
  // Under FSDP the optimizer steps this rank's piece of each parameter:
  // its groups keep their options, their tensors become the pieces.
  for (const auto& model : models_) {
    ShardedModel* sharded = model->sharded();
    if (sharded == nullptr) continue;
    if (!prepared->optimizer_->state().empty()) {
      return absl::FailedPreconditionError(
          "PrepareOptimizer: the optimizer has state already; under FSDP prepare it before its "
          "first step (its state must be the shards')");
    }
    for (auto& group : prepared->optimizer_->param_groups()) {
      for (at::Tensor& p : group.params()) {
        at::Tensor piece = sharded->PieceOf(p);
        if (piece.defined()) p = piece;
      }
    }
  }
  optimizers_.push_back(std::move(prepared));
  return optimizers_.back().get();
}

absl::StatusOr<PreparedScheduler*> Accelerator::PrepareScheduler(
    std::shared_ptr<LRScheduler> scheduler) {
  if (scheduler == nullptr) return absl::InvalidArgumentError("PrepareScheduler: null scheduler");
  auto prepared = std::make_unique<PreparedScheduler>();
  prepared->accelerator_ = this;
  prepared->scheduler_ = std::move(scheduler);
  schedulers_.push_back(std::move(prepared));
  return schedulers_.back().get();
}

absl::StatusOr<std::unique_ptr<DataLoader>> Accelerator::PrepareDataLoader(
    const DataLoader& loader, std::optional<bool> device_placement) {
  const bool place = device_placement.value_or(options_.device_placement);
  PrepareOptions prepare;
  prepare.shard.num_processes = num_processes();
  prepare.shard.process_index = process_index();
  prepare.shard.split_batches = dataloader_config_.split_batches;
  prepare.shard.even_batches = dataloader_config_.even_batches;
  // Accelerate's default: dispatch an iterable dataset's batches, when
  // batches are placed on the device.
  prepare.dispatch_batches =
      dataloader_config_.dispatch_batches.value_or(loader.is_iterable() && place);
  prepare.use_seedable_sampler = dataloader_config_.use_seedable_sampler;
  prepare.data_seed = dataloader_config_.data_seed;
  if (!prepare.data_seed) prepare.data_seed = loader.options().seed;
  if (!prepare.data_seed) prepare.data_seed = LastSeed();
  prepare.device = place ? std::optional<c10::Device>(device_) : std::nullopt;
  prepare.non_blocking = dataloader_config_.non_blocking;
  ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<DataLoader> prepared,
                         DataLoader::Prepare(loader, *group_, &active_loaders_, prepare));
  loader_cursors_.push_back(prepared->cursor());
  return prepared;
}

std::unique_ptr<DataLoader> Accelerator::SkipFirstBatches(const DataLoader& loader,
                                                          int64_t num_batches) const {
  return loader.SkipFirstBatches(num_batches);
}

void Accelerator::DoSync() {
  const LoaderProgress* active = active_loaders_.active();
  if (plugin_.sync_with_dataloader && active != nullptr && active->end_of_dataloader) {
    step_ = 0;
    sync_gradients_ = true;
  } else {
    step_ += 1;
    sync_gradients_ = step_ % plugin_.num_steps == 0;
  }
}

absl::StatusOr<AccumulateScope> Accelerator::Accumulate(const std::vector<PreparedModel*>& models) {
  DoSync();
  AccumulateScope scope;
  const bool skip_sync = !(sync_gradients_ || (num_processes() > 1 && plugin_.sync_each_batch));
  if (skip_sync) {
    for (PreparedModel* m : models) {
      if (m == nullptr) return absl::InvalidArgumentError("Accumulate: a null model");
      if (GradientSynchronizer* s = m->synchronizer()) {
        scope.restore_.emplace_back(s, s->require_sync());
        s->set_require_sync(false);
      }
      if (ShardedModel* s = m->sharded()) {
        scope.restore_sharded_.emplace_back(s, s->require_sync());
        s->set_require_sync(false);
      }
    }
  }
  return scope;
}

AccumulateScope Accelerator::NoSync(const std::vector<PreparedModel*>& models) {
  AccumulateScope scope;
  for (PreparedModel* m : models) {
    if (m == nullptr) continue;
    if (GradientSynchronizer* s = m->synchronizer()) {
      scope.restore_.emplace_back(s, s->require_sync());
      s->set_require_sync(false);
    }
    if (ShardedModel* s = m->sharded()) {
      scope.restore_sharded_.emplace_back(s, s->require_sync());
      s->set_require_sync(false);
    }
  }
  return scope;
}

std::unique_ptr<AutocastScope> Accelerator::Autocast(const AutocastKwargs& kwargs) const {
  const bool enabled = kwargs.enabled && precision_ != PrecisionType::kNo;
  const c10::ScalarType dtype =
      precision_ == PrecisionType::kFp16 ? c10::ScalarType::Half : c10::ScalarType::BFloat16;
  return std::make_unique<AutocastScope>(device_.type(), enabled, dtype, kwargs.cache_enabled);
}

absl::StatusOr<ForwardScope> Accelerator::BeginForward(const PreparedModel& model) {
  if (GradientSynchronizer* s = model.synchronizer()) {
    ACCEL_RETURN_IF_ERROR(Annotate(s->PrepareForward(), "broadcasting buffers before forward"));
  }
  ForwardScope scope;
  if (model.sharded() != nullptr) {
    scope.hooks_ = std::make_unique<dispatch::ScopedModuleHooks>(model.sharded());
  }
  if (precision_ != PrecisionType::kNo) {
    scope.autocast_ = Autocast(options_.autocast_kwargs.value_or(AutocastKwargs{}));
  }
  return scope;
}

absl::Status Accelerator::Backward(const at::Tensor& loss) {
  if (!loss.defined()) return absl::InvalidArgumentError("Backward: the loss is undefined");
  if (!loss.requires_grad()) {
    return absl::InvalidArgumentError(
        "Backward: the loss does not require grad (computed under NoGradGuard, or from parameters "
        "that do not require grad?)");
  }
  ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                   at::Tensor scaled = loss / plugin_.num_steps;
                                   if (scaler_ != nullptr) scaled = scaler_->Scale(scaled);
                                   scaled.backward();
                                 }),
                                 "backward"));
  // Only the models this backward reached: with two prepared models and a
  // backward each (a GAN, a teacher and a student), the other model's
  // reduction waits for its own backward, as each DDP module's does. (A
  // model that one rank's loss reaches and another's does not cannot be
  // told apart from that; find_unused_parameters covers parts of a model.)
  for (const auto& model : models_) {
    GradientSynchronizer* s = model->synchronizer();
    if (s != nullptr && s->require_sync() && s->received_gradients()) {
      ACCEL_RETURN_IF_ERROR(Annotate(s->Finish(), "gradient all-reduce"));
    }
    // A sharded model finishes every backward (no_sync ones too: it frees
    // what backward gathered).
    ShardedModel* sharded = model->sharded();
    if (sharded != nullptr && sharded->received_gradients()) {
      ACCEL_RETURN_IF_ERROR(Annotate(sharded->Finish(), "FSDP gradient reduce-scatter"));
    }
  }
  return absl::OkStatus();
}

absl::Status Accelerator::UnscaleGradients() {
  if (scaler_ == nullptr) return absl::OkStatus();
  for (const auto& opt : optimizers_) {
    ACCEL_RETURN_IF_ERROR(scaler_->Unscale(opt->optimizer()));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> Accelerator::ClipGradNorm(const std::vector<at::Tensor>& parameters,
                                                 double max_norm, double norm_type) {
  ACCEL_RETURN_IF_ERROR(UnscaleGradients());
  // Parameters of a sharded model: the norm over every rank's pieces (as
  // FSDP's clip_grad_norm_), and each rank clips its own. Under NO_SHARD a
  // rank's piece is the whole (already reduced) gradient, the same on every
  // rank: summing it over the ranks would count it P times.
  std::vector<GradientPiece> pieces;
  for (const at::Tensor& p : parameters) {
    for (const auto& model : models_) {
      if (model->sharded() == nullptr) continue;
      at::Tensor piece = model->sharded()->PieceOf(p);
      if (piece.defined()) {
        pieces.push_back({piece, model->sharded()->strategy() == ShardingStrategy::kNoShard});
      }
    }
  }
  if (!pieces.empty()) {
    if (pieces.size() != parameters.size()) {
      return absl::InvalidArgumentError(
          "ClipGradNorm: some parameters are sharded (FSDP) and some are not; clip them apart");
    }
    return ClipShardedGradNorm(pieces, max_norm, norm_type);
  }
  double norm = 0;
  ACCEL_RETURN_IF_ERROR(Annotate(
      CallTorch([&] { norm = torch::nn::utils::clip_grad_norm_(parameters, max_norm, norm_type); }),
      "clip_grad_norm_"));
  return norm;
}

absl::StatusOr<double> Accelerator::ClipShardedGradNorm(const std::vector<GradientPiece>& pieces,
                                                        double max_norm, double norm_type) {
  const bool inf = std::isinf(norm_type);
  // [0]: this rank's share of the sharded pieces (reduced over the ranks);
  // [1]: the replicated pieces (NO_SHARD), which every rank holds whole and
  // which are therefore counted once, from this rank. A max needs no such
  // care, but takes the same path.
  at::Tensor local;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    at::NoGradGuard no_grad;
    local = at::zeros({2}, at::kDouble);
    for (const GradientPiece& p : pieces) {
      const at::Tensor& g = p.piece.grad();
      if (!g.defined() || g.numel() == 0) continue;
      at::Tensor d = g.to(at::kDouble);
      at::Tensor slot = local.narrow(0, p.replicated ? 1 : 0, 1);
      if (inf) {
        slot.copy_(at::maximum(slot, d.abs().max().reshape({1})));
      } else {
        slot.add_(d.abs().pow(norm_type).sum().reshape({1}));
      }
    }
  }));
  const double replicated = local[1].item<double>();
  std::vector<at::Tensor> one = {local};
  ACCEL_RETURN_IF_ERROR(Annotate(group_->AllReduce(one, inf ? ReduceOp::kMax : ReduceOp::kSum),
                                 "clip_grad_norm_ (FSDP)"));
  const double sharded = local[0].item<double>();
  const double total =
      inf ? std::max(sharded, replicated) : std::pow(sharded + replicated, 1.0 / norm_type);
  // torch's rule: scale by max_norm / (total + 1e-6) when that is below 1.
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      at::NoGradGuard no_grad;
      for (const GradientPiece& p : pieces) {
        if (p.piece.grad().defined()) p.piece.grad().mul_(coef);
      }
    }));
  }
  return total;
}

std::vector<at::Tensor> Accelerator::GradientHolders(
    const std::vector<at::Tensor>& parameters) const {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : parameters) {
    at::Tensor holder = p;
    for (const auto& model : models_) {
      if (model->sharded() == nullptr) continue;
      at::Tensor piece = model->sharded()->PieceOf(p);
      if (piece.defined()) holder = piece;
    }
    out.push_back(holder);
  }
  return out;
}

absl::Status Accelerator::ClipGradValue(const std::vector<at::Tensor>& parameters,
                                        double clip_value) {
  ACCEL_RETURN_IF_ERROR(UnscaleGradients());
  // Elementwise: each rank clips its own pieces of a sharded model.
  const std::vector<at::Tensor> holders = GradientHolders(parameters);
  return Annotate(CallTorch([&] { torch::nn::utils::clip_grad_value_(holders, clip_value); }),
                  "clip_grad_value_");
}

// ---- Collectives ----

namespace {
// A tensor's shape as Accelerate's get_shape prints it: [2, 5].
std::string ShapeText(const at::Tensor& t) {
  if (!t.defined()) return "None";
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
}
std::string ShapeText(const TensorMap& tensors) {
  std::vector<std::string> items;
  for (const auto& [name, t] : tensors)
    items.push_back(absl::StrCat("'", name, "': ", ShapeText(t)));
  return absl::StrCat("{", absl::StrJoin(items, ", "), "}");
}
}  // namespace

absl::Status Accelerator::VerifyOperation(absl::string_view operation,
                                          const std::string& shapes) const {
  if (!debug_ || group_->size() <= 1) return absl::OkStatus();
  ACCEL_ASSIGN_OR_RETURN(std::vector<std::string> all, train::GatherObject(*group_, shapes));
  if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all[0]; })) {
    return absl::OkStatus();
  }
  std::string listing;
  for (size_t i = 0; i < all.size(); ++i)
    absl::StrAppend(&listing, "\n  - Process ", i, ": ", all[i]);
  return absl::InvalidArgumentError(absl::StrCat(
      "Cannot apply desired operation due to shape mismatches. All shapes across devices must "
      "be valid.\n\nOperation: `",
      operation, "`\nInput shapes:", listing));
}

absl::StatusOr<at::Tensor> Accelerator::Gather(const at::Tensor& tensor) const {
  ACCEL_RETURN_IF_ERROR(VerifyOperation("Accelerator::Gather", ShapeText(tensor)));
  return train::Gather(*group_, tensor);
}

absl::StatusOr<TensorMap> Accelerator::Gather(const TensorMap& tensors) const {
  ACCEL_RETURN_IF_ERROR(VerifyOperation("Accelerator::Gather", ShapeText(tensors)));
  return train::Gather(*group_, tensors);
}

namespace {
// gather_for_metrics' rule: only at the end of the loader, and only when the
// dataset did not divide evenly, keep the first `remainder` rows.
int64_t MetricsRows(const ActiveLoaders& loaders) {
  const LoaderProgress* active = loaders.active();
  if (active == nullptr || !active->end_of_dataloader || active->remainder <= 0) return -1;
  return active->remainder;
}
}  // namespace

absl::StatusOr<at::Tensor> Accelerator::GatherForMetrics(const at::Tensor& tensor) const {
  ACCEL_ASSIGN_OR_RETURN(at::Tensor gathered, Gather(tensor));
  const int64_t rows = MetricsRows(active_loaders_);
  if (rows < 0 || gathered.dim() == 0 || rows >= gathered.size(0)) return gathered;
  return gathered.narrow(0, 0, rows);
}

absl::StatusOr<TensorMap> Accelerator::GatherForMetrics(const TensorMap& tensors) const {
  ACCEL_ASSIGN_OR_RETURN(TensorMap gathered, Gather(tensors));
  const int64_t rows = MetricsRows(active_loaders_);
  if (rows < 0) return gathered;
  for (auto& [name, t] : gathered) {
    if (t.dim() > 0 && rows < t.size(0)) t = t.narrow(0, 0, rows);
  }
  return gathered;
}

absl::StatusOr<at::Tensor> Accelerator::Reduce(const at::Tensor& tensor,
                                               Reduction reduction) const {
  ACCEL_RETURN_IF_ERROR(VerifyOperation("Accelerator::Reduce", ShapeText(tensor)));
  return train::Reduce(*group_, tensor, reduction);
}

absl::StatusOr<at::Tensor> Accelerator::PadAcrossProcesses(const at::Tensor& tensor,
                                                           const PadOptions& options) const {
  return train::PadAcrossProcesses(*group_, tensor, options);
}

absl::StatusOr<at::Tensor> Accelerator::Broadcast(const at::Tensor& tensor, int src) const {
  ACCEL_RETURN_IF_ERROR(VerifyOperation("Accelerator::Broadcast", ShapeText(tensor)));
  return BroadcastFrom(*group_, tensor, src);
}

absl::Status Accelerator::WaitForEveryone() const { return group_->Barrier(); }

void Accelerator::Print(absl::string_view text) const {
  if (is_main_process()) std::cout << text << std::endl;
}

// ---- Objects ----

absl::StatusOr<std::vector<std::string>> Accelerator::GatherObject(absl::string_view bytes) const {
  return train::GatherObject(*group_, bytes);
}

absl::StatusOr<std::vector<std::string>> Accelerator::GatherObject(
    const std::vector<std::string>& items) const {
  return train::GatherObject(*group_, items);
}

absl::Status Accelerator::BroadcastObjectList(std::vector<std::string>& objects,
                                              int from_process) const {
  ACCEL_ASSIGN_OR_RETURN(objects, train::BroadcastObjectList(*group_, objects, from_process));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> Accelerator::GatherForMetrics(
    const std::vector<std::string>& items) const {
  ACCEL_ASSIGN_OR_RETURN(std::vector<std::string> gathered, train::GatherObject(*group_, items));
  const int64_t rows = MetricsRows(active_loaders_);
  if (rows >= 0 && rows < static_cast<int64_t>(gathered.size())) gathered.resize(rows);
  return gathered;
}

absl::StatusOr<at::Tensor> Accelerator::GatherForMetrics(const at::Tensor& tensor,
                                                         bool use_gather_object) const {
  if (!use_gather_object) return GatherForMetrics(tensor);
  if (!tensor.defined()) return absl::InvalidArgumentError("gather_for_metrics: undefined tensor");
  ACCEL_ASSIGN_OR_RETURN(TensorMap gathered, GatherForMetrics(TensorMap{{"", tensor}}, true));
  return gathered.at("");
}

absl::StatusOr<TensorMap> Accelerator::GatherForMetrics(const TensorMap& tensors,
                                                        bool use_gather_object) const {
  if (!use_gather_object) return GatherForMetrics(tensors);
  ACCEL_ASSIGN_OR_RETURN(std::vector<TensorMap> ranks, GatherTensorObjects(*group_, tensors));
  const int64_t rows = MetricsRows(active_loaders_);
  TensorMap out;
  for (const auto& [name, mine] : tensors) {
    // A 0-d tensor is one row, as Gather counts it.
    const auto row_shape = [](const at::Tensor& t) {
      return t.dim() == 0 ? std::vector<int64_t>{} : t.sizes().slice(1).vec();
    };
    std::vector<at::Tensor> parts;
    for (size_t r = 0; r < ranks.size(); ++r) {
      auto it = ranks[r].find(name);
      if (it == ranks[r].end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gather_for_metrics(use_gather_object): rank ", r, " has no \"", name, "\""));
      }
      const at::Tensor& theirs = it->second;
      if (theirs.scalar_type() != mine.scalar_type() || row_shape(theirs) != row_shape(mine)) {
        return absl::InvalidArgumentError(
            absl::StrCat("gather_for_metrics(use_gather_object): \"", name, "\" is ",
                         c10::toString(theirs.scalar_type()), c10::str(theirs.sizes()), " on rank ",
                         r, " but ", c10::toString(mine.scalar_type()), c10::str(mine.sizes()),
                         " on this rank (", process_index(), "): the rows must agree past dim 0"));
      }
      parts.push_back(theirs.dim() == 0 ? theirs.reshape({1}) : theirs);
    }
    at::Tensor all;
    const c10::Device device = mine.device();  // a structured binding: not capturable in C++17
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] { all = at::cat(parts).to(device); }),
                                   absl::StrCat("gather_for_metrics \"", name, "\"")));
    if (rows >= 0 && rows < all.size(0)) all = all.narrow(0, 0, rows);
    out.emplace(name, std::move(all));
  }
  return out;
}

// ---- Checkpoints ----

void Accelerator::RegisterForCheckpointing(std::shared_ptr<Checkpointable> object) {
  custom_objects_.push_back(std::move(object));
}

absl::Status Accelerator::WriteStateFiles(const std::string& dir) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(dir, ": ", ec.message()));
  const bool writer = is_main_process() || (project_.save_on_each_node && is_local_main_process());
  // A sharded model is saved by every rank together: gathered whole
  // (FULL_STATE_DICT, written by the writer) or each rank its own shards
  // (SHARDED_STATE_DICT, pytorch_model_fsdp_<i>/, as Accelerate names it).
  std::vector<std::optional<NamedTensors>> states(models_.size());
  bool any_sharded = false;
  for (size_t i = 0; i < models_.size(); ++i) {
    ShardedModel* sharded = models_[i]->sharded();
    if (sharded == nullptr) {
      if (writer) states[i] = models_[i]->StateDict();
      continue;
    }
    any_sharded = true;
    if (fsdp_->state_dict_type == StateDictType::kShardedStateDict) {
      ACCEL_RETURN_IF_ERROR(
          sharded->SaveShards(absl::StrCat(dir, "/", Indexed("pytorch_model_fsdp", i, ""))));
    } else {
      ACCEL_ASSIGN_OR_RETURN(states[i], sharded->FullStateDict());
    }
  }
  // The optimizers' state is the shards' under FSDP: one file per rank.
  if (any_sharded) {
    for (size_t i = 0; i < optimizers_.size(); ++i) {
      ACCEL_RETURN_IF_ERROR(
          SaveOptimizer(optimizers_[i]->optimizer(),
                        absl::StrCat(dir, "/", Indexed("optimizer", i, ""), ".rank",
                                     process_index(), "-of-", num_processes(), ".bin")));
    }
  }
  if (writer) {
    for (size_t i = 0; i < models_.size(); ++i) {
      if (!states[i]) continue;
      SaveModelOptions save;
      save.max_shard_size = int64_t{1} << 62;  // one file, as save_state does
      save.weights_name = Indexed("model", i, "");
      ACCEL_RETURN_IF_ERROR(train::SaveModel(*states[i], dir, save));
    }
    for (size_t i = 0; i < optimizers_.size() && !any_sharded; ++i) {
      ACCEL_RETURN_IF_ERROR(SaveOptimizer(optimizers_[i]->optimizer(),
                                          absl::StrCat(dir, "/", Indexed("optimizer", i, ".bin"))));
    }
    for (size_t i = 0; i < schedulers_.size(); ++i) {
      ACCEL_RETURN_IF_ERROR(
          SaveSchedulerState(schedulers_[i]->scheduler().state(),
                             absl::StrCat(dir, "/", Indexed("scheduler", i, ".bin"))));
    }
    if (scaler_ != nullptr) {
      ACCEL_RETURN_IF_ERROR(SaveScalerState(scaler_->state(), dir + "/scaler.pt"));
    }
    for (size_t i = 0; i < custom_objects_.size(); ++i) {
      ACCEL_RETURN_IF_ERROR(SaveCustomState(custom_objects_[i]->StateDict(),
                                            absl::StrCat(dir, "/custom_checkpoint_", i, ".pkl")));
    }
  }
  ACCEL_RETURN_IF_ERROR(SaveRandomStates(
      CaptureRandomStates(step_), absl::StrCat(dir, "/random_states_", process_index(), ".pkl")));
  if (!loader_cursors_.empty()) {
    // Every rank its own: with even_batches off the ranks' counts can differ.
    std::vector<SavedLoaderPosition> positions;
    for (const auto& cursor : loader_cursors_) {
      const LoaderPosition p = cursor->position();
      positions.push_back({p.epoch, p.batches_yielded, p.pass_started, p.generator_state});
    }
    ACCEL_RETURN_IF_ERROR(SaveLoaderPositions(
        positions, absl::StrCat(dir, "/dataloader_positions_", process_index(), ".pkl")));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Accelerator::SaveState(const std::string& output_dir) {
  if (!project_.automatic_checkpoint_naming && output_dir.empty()) {
    return absl::InvalidArgumentError(
        "SaveState: no output_dir, and ProjectConfiguration.automatic_checkpoint_naming is off");
  }
  // The folder: rank 0 picks it (with automatic naming the next
  // checkpoint_N, which must not exist) and names the temporary folder
  // beside it after its pid; the state is written there and moved into place
  // only when complete, so a folder LoadState can pick is never half written.
  // Each step's outcome is shared (rank 0's by its broadcast, the others'
  // through AgreeOnOutcome), so a failure anywhere fails SaveState on every
  // rank instead of leaving the others in a barrier.
  std::string dir = output_dir;
  std::vector<std::string> to_prune;
  absl::Status planned;
  if (is_main_process() && project_.automatic_checkpoint_naming) {
    absl::StatusOr<CheckpointPlan> plan =
        PlanCheckpoint(project_.project_dir, project_.iteration, project_.total_limit);
    if (plan.ok()) {
      dir = plan->dir;
      to_prune = std::move(plan->to_prune);
    } else {
      planned = plan.status();
    }
  }
  // Rank 0's message: "ok\n<pid>\n<dir>", or "error\n<code>\t<message>".
  ACCEL_ASSIGN_OR_RETURN(
      std::string chosen,
      group_->BroadcastBytes(planned.ok() ? absl::StrCat("ok\n", ::getpid(), "\n", dir)
                                          : absl::StrCat("error\n", EncodeFailure(planned)),
                             0));
  if (!planned.ok()) return planned;
  std::vector<std::string> fields = absl::StrSplit(chosen, absl::MaxSplits('\n', 2));
  if (fields.size() == 2 && fields[0] == "error") return DecodeFailure(fields[1], "SaveState", 0);
  if (fields.size() != 3 || fields[0] != "ok") {
    return absl::DataLossError("SaveState: a bad message from rank 0");
  }
  dir = std::filesystem::path(fields[2]).lexically_normal().string();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string tmp = absl::StrCat(dir, ".tmp-", fields[1]);
  // Those who write the shared files also make and move the folder (one per
  // node with save_on_each_node).
  const bool committer =
      is_main_process() || (project_.save_on_each_node && is_local_main_process());
  auto discard = [&] {
    std::error_code ec;
    if (committer) std::filesystem::remove_all(tmp, ec);
  };
  absl::Status made;
  if (committer) {
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);  // a crashed save's, with a reused pid
    std::filesystem::create_directories(tmp, ec);
    if (ec) made = absl::PermissionDeniedError(absl::StrCat(tmp, ": ", ec.message()));
  }
  ACCEL_RETURN_IF_ERROR(AgreeOnOutcome(*group_, made, "SaveState"));
  absl::Status written = AgreeOnOutcome(*group_, WriteStateFiles(tmp), "SaveState");
  if (!written.ok()) {
    discard();
    return written;
  }
  absl::Status committed = AgreeOnOutcome(
      *group_, committer ? CommitCheckpointDir(tmp, dir) : absl::OkStatus(), "SaveState");
  if (!committed.ok()) {
    discard();
    return committed;
  }
  project_.iteration += 1;
  // Pruned only once the new checkpoint is in place.
  ACCEL_RETURN_IF_ERROR(
      AgreeOnOutcome(*group_, is_main_process() ? RemoveCheckpoints(to_prune) : absl::OkStatus(),
                     absl::StrCat("SaveState (", dir, " is saved; pruning older checkpoints)")));
  return dir;
}

absl::Status Accelerator::LoadState(const std::string& input_dir) {
  std::string dir = input_dir;
  if (dir.empty()) {
    if (!project_.automatic_checkpoint_naming) {
      return absl::InvalidArgumentError(
          "LoadState: no input_dir, and ProjectConfiguration.automatic_checkpoint_naming is off");
    }
    ACCEL_ASSIGN_OR_RETURN(dir, LatestCheckpointDir(project_.project_dir));
  }
  if (!std::filesystem::is_directory(dir)) {
    return absl::NotFoundError(absl::StrCat("LoadState: ", dir, " is not a folder"));
  }
  bool any_sharded = false;
  for (size_t i = 0; i < models_.size(); ++i) {
    const std::string stem = Indexed("model", i, "");
    if (ShardedModel* sharded = models_[i]->sharded()) {
      // Whichever the checkpoint holds: each rank's shards, or the whole model.
      any_sharded = true;
      const std::string shards = absl::StrCat(dir, "/", Indexed("pytorch_model_fsdp", i, ""));
      if (std::filesystem::is_directory(shards)) {
        ACCEL_RETURN_IF_ERROR(sharded->LoadShards(shards));
      } else {
        ACCEL_ASSIGN_OR_RETURN(StateDict saved, LoadModelWeights(dir, stem));
        ACCEL_RETURN_IF_ERROR(
            Annotate(sharded->LoadFullStateDict(saved), absl::StrCat(dir, "/", stem)));
      }
      continue;
    }
    ACCEL_ASSIGN_OR_RETURN(StateDict saved, LoadModelWeights(dir, stem));
    std::map<std::string, at::Tensor> by_name(saved.begin(), saved.end());
    NamedTensors live = models_[i]->StateDict();
    // Tied tensors were saved once, under their first name: a missing name
    // whose storage another saved name shares is restored through that one.
    std::map<std::pair<const void*, int64_t>, std::string> saved_storage;
    for (const auto& [name, tensor] : live) {
      if (by_name.count(name)) {
        saved_storage.emplace(std::make_pair(tensor.storage().data(), tensor.storage_offset()),
                              name);
      }
    }
    std::set<std::string> expected;
    NamedTensors to_copy;
    for (auto& [name, tensor] : live) {
      expected.insert(name);
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        if (saved_storage.count({tensor.storage().data(), tensor.storage_offset()})) continue;
        return absl::NotFoundError(
            absl::StrCat(dir, "/", stem, ".safetensors: no tensor \"", name, "\""));
      }
      to_copy.emplace_back(name, tensor);
      if (it->second.sizes() != tensor.sizes()) {
        return absl::InvalidArgumentError(
            absl::StrCat(dir, "/", stem, ".safetensors: \"", name, "\" has shape ",
                         c10::str(it->second.sizes()), ", the model ", c10::str(tensor.sizes())));
      }
    }
    for (const auto& [name, tensor] : by_name) {
      if (expected.count(name) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            dir, "/", stem, ".safetensors: unexpected tensor \"", name, "\" (not in the model)"));
      }
    }
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                     at::NoGradGuard no_grad;
                                     for (auto& [name, tensor] : to_copy) {
                                       tensor.copy_(by_name.at(name));
                                     }
                                   }),
                                   "restoring the model's weights"));
  }
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    const std::string path = any_sharded
                                 ? absl::StrCat(dir, "/", Indexed("optimizer", i, ""), ".rank",
                                                process_index(), "-of-", num_processes(), ".bin")
                                 : absl::StrCat(dir, "/", Indexed("optimizer", i, ".bin"));
    if (any_sharded && !std::filesystem::exists(path)) {
      return absl::FailedPreconditionError(absl::StrCat(
          path,
          " does not exist: an FSDP optimizer's state is each rank's shards, so resume with "
          "the number of processes that saved it"));
    }
    ACCEL_RETURN_IF_ERROR(LoadOptimizer(optimizers_[i]->optimizer(), path));
  }
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    ACCEL_ASSIGN_OR_RETURN(SchedulerState state, LoadSchedulerState(absl::StrCat(
                                                     dir, "/", Indexed("scheduler", i, ".bin"))));
    ACCEL_RETURN_IF_ERROR(schedulers_[i]->scheduler().LoadState(state));
  }
  if (scaler_ != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(GradScalerState state, LoadScalerState(dir + "/scaler.pt"));
    ACCEL_RETURN_IF_ERROR(scaler_->LoadState(state));
  }
  // As Accelerate: the number of custom_checkpoint_N.pkl files must match.
  size_t custom_files = 0;
  static const std::regex kCustom("custom_checkpoint_\\d+\\.pkl");
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (std::regex_match(entry.path().filename().string(), kCustom)) ++custom_files;
  }
  if (custom_files != custom_objects_.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " holds ", custom_files, " custom_checkpoint files but ",
                     custom_objects_.size(), " objects are registered for checkpointing"));
  }
  for (size_t i = 0; i < custom_objects_.size(); ++i) {
    ACCEL_ASSIGN_OR_RETURN(auto state,
                           LoadCustomState(absl::StrCat(dir, "/custom_checkpoint_", i, ".pkl")));
    ACCEL_RETURN_IF_ERROR(custom_objects_[i]->LoadStateDict(state));
  }
  ACCEL_ASSIGN_OR_RETURN(
      RandomStates states,
      LoadRandomStates(absl::StrCat(dir, "/random_states_", process_index(), ".pkl")));
  ACCEL_RETURN_IF_ERROR(RestoreRandomStates(states));
  step_ = states.step;
  const std::string positions_file =
      absl::StrCat(dir, "/dataloader_positions_", process_index(), ".pkl");
  if (std::filesystem::exists(positions_file)) {
    ACCEL_ASSIGN_OR_RETURN(std::vector<SavedLoaderPosition> positions,
                           LoadLoaderPositions(positions_file));
    // Matched by the order of preparation: another number of loaders would
    // put one loader's position on another.
    if (!loader_cursors_.empty() && positions.size() != loader_cursors_.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat(positions_file, " holds the positions of ", positions.size(),
                       " data loader(s), but ", loader_cursors_.size(),
                       " are prepared: prepare the same loaders, in the same order, as the run "
                       "that saved it"));
    }
    for (size_t i = 0; i < positions.size() && i < loader_cursors_.size(); ++i) {
      const SavedLoaderPosition& saved = positions[i];
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        loader_cursors_[i]->Restore(
            {saved.epoch, saved.batches_yielded, saved.pass_started, saved.generator_state});
      }));
    }
  }
  if (project_.automatic_checkpoint_naming) {
    const int64_t n = TrailingNumber(dir);
    if (n >= 0) project_.iteration = n + 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<NamedTensors> Accelerator::GetStateDict(const PreparedModel& model) const {
  if (model.sharded() != nullptr) return model.sharded()->FullStateDict();
  return model.StateDict();
}

absl::Status Accelerator::SaveModel(const PreparedModel& model, const std::string& dir,
                                    const std::string& max_shard_size) const {
  SaveModelOptions save;
  absl::StatusOr<int64_t> limit = ParseShardSize(max_shard_size);
  if (!limit.ok()) return Annotate(limit.status(), "SaveModel max_shard_size");
  save.max_shard_size = *limit;
  if (model.sharded() != nullptr) {
    // Every rank gathers; the main process writes.
    ACCEL_ASSIGN_OR_RETURN(NamedTensors state, model.sharded()->FullStateDict());
    if (!is_main_process()) return absl::OkStatus();
    return train::SaveModel(state, dir, save);
  }
  if (!is_main_process()) return absl::OkStatus();
  return train::SaveModel(model.StateDict(), dir, save);
}

// ---- Trackers ----

absl::Status Accelerator::InitTrackers(const std::string& project_name,
                                       const std::map<std::string, std::string>& config) {
  if (!is_main_process() || options_.log_with.empty()) return absl::OkStatus();
  if (project_.logging_dir.empty()) {
    return absl::InvalidArgumentError(
        "InitTrackers: log_with is set but ProjectConfiguration has no logging_dir or project_dir");
  }
  std::vector<std::string> names;
  for (const std::string& name : options_.log_with) {
    if (name == "all") {
      names = {"jsonl", "tensorboard"};
      break;
    }
    names.push_back(name);
  }
  for (const std::string& name : names) {
    ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<Tracker> tracker,
                           MakeTracker(name, project_.logging_dir, project_name));
    ACCEL_RETURN_IF_ERROR(tracker->StoreConfig(config));
    trackers_.push_back(std::move(tracker));
  }
  return absl::OkStatus();
}

absl::Status Accelerator::Log(const std::map<std::string, double>& values, int64_t step) {
  for (auto& tracker : trackers_) ACCEL_RETURN_IF_ERROR(tracker->Log(values, step));
  return absl::OkStatus();
}

absl::Status Accelerator::EndTraining() {
  absl::Status status;
  for (auto& tracker : trackers_) status.Update(tracker->Finish());
  trackers_.clear();
  return status;
}

// ---- Free functions ----

void SetSeed(uint64_t seed, bool device_specific, int process_index, bool deterministic) {
  const uint64_t s = device_specific ? seed + static_cast<uint64_t>(process_index) : seed;
  at::manual_seed(s);
  g_last_seed = s;
  // torch.use_deterministic_algorithms(True): errors, not warnings, for ops
  // without a deterministic implementation.
  if (deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
}

uint64_t LastSeed() { return g_last_seed; }

absl::Status FindExecutableBatchSize(int64_t starting_batch_size,
                                     const std::function<absl::Status(int64_t)>& fn) {
  if (starting_batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "find_executable_batch_size: starting_batch_size ", starting_batch_size, " must be >= 1"));
  }
  for (int64_t batch_size = starting_batch_size; batch_size > 0; batch_size /= 2) {
    absl::Status status;
    try {
      status = fn(batch_size);
    } catch (const std::bad_alloc&) {
      status = absl::ResourceExhaustedError("out of memory (std::bad_alloc)");
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      if (what.find("out of memory") == std::string::npos &&
          what.find("OutOfMemory") == std::string::npos) {
        throw;
      }
      status = absl::ResourceExhaustedError(what);
    }
    if (status.code() != absl::StatusCode::kResourceExhausted) return status;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("find_executable_batch_size: no executable batch size found (halved from ",
                   starting_batch_size, " to 1, every size ran out of memory)"));
}

void FreeMemory(std::vector<at::Tensor>& tensors) {
  tensors.clear();
  tensors.shrink_to_fit();
}

}  // namespace accel::train
