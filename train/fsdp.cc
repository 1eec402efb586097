#include "train/fsdp.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

#include "core/json.h"
#include "core/status.h"
#include "loader/loader.h"

namespace accel::train {
namespace {

// ---- The plugin's text forms (Accelerate's names, or the enum's 1-based number) ----

template <typename E>
absl::StatusOr<E> ParseChoice(absl::string_view text, absl::string_view what,
                              const std::vector<std::pair<std::string, E>>& choices) {
  const std::string upper = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  int number = 0;
  const bool numeric = absl::SimpleAtoi(upper, &number);
  for (size_t i = 0; i < choices.size(); ++i) {
    if (upper == choices[i].first || (numeric && number == static_cast<int>(i) + 1)) {
      return choices[i].second;
    }
  }
  std::vector<std::string> names;
  names.reserve(choices.size());
  for (const auto& c : choices) names.push_back(c.first);
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": \"", text, "\" is not one of ", absl::StrJoin(names, ", ")));
}

absl::StatusOr<bool> ParseBool(const EnvLookup& env, const std::string& name, bool fallback) {
  std::optional<std::string> v = env(name);
  if (!v || v->empty()) return fallback;
  const std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(*v));
  if (lower == "true" || lower == "1" || lower == "yes") return true;
  if (lower == "false" || lower == "0" || lower == "no") return false;
  return absl::InvalidArgumentError(absl::StrCat(name, ": \"", *v, "\" is not true or false"));
}

// ---- Storage that comes and goes under the same tensors ----

// The unit's gathered buffer keeps one StorageImpl for its life: the
// module's parameters and whatever autograd saved of them (weight.t(), ...)
// point into it, so freeing and gathering change its bytes, never the
// tensors. (PyTorch FSDP does the same with storage().resize_(0).)
void FreeStorage(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == 0) return;
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void AllocateStorage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == nbytes) return;
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

size_t StorageBytes(const at::Tensor& t) {
  return t.defined() ? t.storage().unsafeGetStorageImpl()->nbytes() : 0;
}

constexpr char kShardsKey[] = "accel_fsdp";

std::string RankFileName(int rank, int world) {
  return absl::StrCat("rank", rank, "-of-", world, ".safetensors");
}

// "torch::nn::LinearImpl" and "Linear" are one class.
std::string ShortClassName(const std::string& name) {
  absl::string_view s = name;
  const size_t colon = s.rfind("::");
  if (colon != absl::string_view::npos) s.remove_prefix(colon + 2);
  absl::ConsumeSuffix(&s, "Impl");
  return std::string(s);
}

bool IsModuleList(const torch::nn::Module& m) { return ShortClassName(m.name()) == "ModuleList"; }

struct Slot {
  std::string name;
  at::Tensor param;    // the module's tensor (its storage: the unit's buffer)
  int64_t offset = 0;  // in the unit's flat buffer
  int64_t numel = 0;
  size_t piece = 0;  // index into pieces_
};

struct Unit {
  std::string name;  // "" for the root
  std::vector<Slot> slots;
  int64_t numel = 0;
  int64_t padded = 0;
  int64_t shard_numel = 0;
  at::Tensor full;        // [padded], compute dtype, on the device
  at::Tensor shard;       // [shard_numel], master dtype: this rank's values
  at::Tensor shard_grad;  // [shard_numel], master dtype
  bool gathered = false;
  bool resident = false;  // never freed (root, or run outside the hooks)
  std::string entered_by;
  bool ever_entered = false;
  size_t grads_seen = 0;
  bool reduced = false;
  std::unique_ptr<PendingWork> gather_work;
  at::Tensor gather_source;  // what the pending gather reads
};

// A unit's gradients on their way: the flat copy that travels, where this
// rank's reduced chunk lands, and the collective.
struct PendingReduction {
  size_t unit = 0;
  at::Tensor flat;
  at::Tensor out;
  std::unique_ptr<std::vector<at::Tensor>> keep;  // AllReduceAsync's argument
  std::unique_ptr<PendingWork> work;
};

class Sharded;

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(Sharded* owner, std::shared_ptr<bool> alive, size_t unit)
      : owner_(owner), alive_(std::move(alive)), unit_(unit) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override;

 private:
  Sharded* owner_;
  std::shared_ptr<bool> alive_;
  size_t unit_;
};

void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw std::runtime_error(status.ToString());
}

class Sharded : public ShardedModel {
 public:
  Sharded(std::shared_ptr<torch::nn::Module> module, ProcessGroup& group,
          const FullyShardedDataParallelPlugin& plugin, c10::Device device)
      : module_(std::move(module)), group_(group), plugin_(plugin), device_(device) {}

  ~Sharded() override {
    *alive_ = false;
    for (Unit& u : units_) {
      if (u.gather_work) (void)u.gather_work->Wait();
    }
    for (PendingReduction& r : reductions_) (void)r.work->Wait();
  }

  absl::Status Init(int num_nodes) {
    if (plugin_.activation_checkpointing) {
      return absl::InvalidArgumentError(
          "FSDP activation_checkpointing: libtorch's C++ modules have no recomputation hooks; "
          "turn it off");
    }
    if (!plugin_.use_orig_params) {
      return absl::InvalidArgumentError(
          "FSDP use_orig_params=false: the optimizer must see the original parameters here "
          "(their pieces); flat parameters would change its param groups");
    }
    strategy_ = plugin_.sharding_strategy;
    if (strategy_ == ShardingStrategy::kHybridShard) {
      if (num_nodes > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "FSDP sharding_strategy HYBRID_SHARD over ", num_nodes,
            " nodes needs a process group per node, which accel's ProcessGroup does not make; use "
            "FULL_SHARD (on one node HYBRID_SHARD is FULL_SHARD)"));
      }
      strategy_ = ShardingStrategy::kFullShard;
    }
    world_ = group_.size();
    rank_ = group_.rank();
    shard_count_ = strategy_ == ShardingStrategy::kNoShard ? 1 : world_;
    shard_device_ = plugin_.cpu_offload ? c10::Device(c10::kCPU) : device_;

    // Trainable tensors once each (tied weights are one tensor), with every name.
    std::vector<std::pair<std::string, at::Tensor>> params;
    std::map<const c10::TensorImpl*, size_t> index_of;
    for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
      const at::Tensor& t = item.value();
      auto [it, fresh] = index_of.emplace(t.unsafeGetTensorImpl(), params.size());
      if (fresh) params.emplace_back(item.key(), t);
      names_of_[t.unsafeGetTensorImpl()].push_back(item.key());
    }
    c10::optional<c10::ScalarType> dtype;
    for (const auto& [name, t] : params) {
      if (!t.requires_grad()) continue;
      if (!t.is_leaf()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "FSDP: parameter ", name, " is not a leaf tensor (it was computed from others)"));
      }
      if (!at::isFloatingType(t.scalar_type())) {
        return absl::InvalidArgumentError(
            absl::StrCat("FSDP: parameter ", name, " is not floating point"));
      }
      if (dtype && *dtype != t.scalar_type()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "FSDP: parameter ", name, " is ", c10::toString(t.scalar_type()), " but others are ",
            c10::toString(*dtype), ": the shards hold one dtype (convert the model first)"));
      }
      dtype = t.scalar_type();
    }
    master_dtype_ = dtype.value_or(at::kFloat);
    compute_dtype_ = plugin_.mixed_precision_policy.param_dtype.value_or(master_dtype_);
    reduce_dtype_ = plugin_.mixed_precision_policy.reduce_dtype.value_or(compute_dtype_);

    // Rank 0's weights and buffers everywhere, before anything is cut.
    if (plugin_.sync_module_states && world_ > 1) {
      at::NoGradGuard no_grad;
      for (auto& [name, t] : params) {
        at::Tensor tensor = t;
        absl::Status s = group_.Broadcast(tensor, 0);
        if (!s.ok()) return Annotate(s, absl::StrCat("FSDP: broadcasting parameter ", name));
      }
      for (const auto& item : module_->named_buffers(true)) {
        at::Tensor tensor = item.value();
        absl::Status s = group_.Broadcast(tensor, 0);
        if (!s.ok()) return Annotate(s, absl::StrCat("FSDP: broadcasting buffer ", item.key()));
      }
    }
    if (plugin_.mixed_precision_policy.buffer_dtype) {
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        at::NoGradGuard no_grad;
        for (const auto& item : module_->named_buffers(true)) {
          at::Tensor b = item.value();
          if (at::isFloatingType(b.scalar_type())) {
            b.set_data(b.to(*plugin_.mixed_precision_policy.buffer_dtype));
          }
        }
      }));
    }

    // Units: by policy, then every trainable tensor to the unit whose
    // module holds all of its names (tied across units: the root).
    ACCEL_ASSIGN_OR_RETURN(std::vector<std::string> prefixes, ChooseUnits(params));
    units_.emplace_back();  // the root
    units_[0].resident = true;
    for (const std::string& p : prefixes) {
      unit_of_name_[p] = units_.size();
      units_.emplace_back();
      units_.back().name = p;
    }
    for (const auto& [name, t] : params) {
      if (!t.requires_grad()) continue;
      std::set<size_t> homes;
      for (const std::string& n : names_of_[t.unsafeGetTensorImpl()]) homes.insert(UnitOfParam(n));
      const size_t home = homes.size() == 1 ? *homes.begin() : 0;
      Slot slot;
      slot.name = name;
      slot.param = t;
      slot.numel = t.numel();
      units_[home].slots.push_back(std::move(slot));
    }
    // A unit left without parameters (all tied away) is dropped.
    std::vector<Unit> kept;
    for (Unit& u : units_) {
      if (u.name.empty() || !u.slots.empty()) kept.push_back(std::move(u));
    }
    units_ = std::move(kept);
    unit_of_name_.clear();
    for (size_t i = 1; i < units_.size(); ++i) unit_of_name_[units_[i].name] = i;

    absl::Status built = CallTorch([&] {
      at::NoGradGuard no_grad;
      for (Unit& u : units_) BuildUnit(u);
    });
    if (!built.ok()) return Annotate(built, "FSDP: sharding the parameters");

    for (size_t i = 0; i < units_.size(); ++i) {
      for (Slot& s : units_[i].slots) {
        absl::Status hooked = CallTorch([&] {
          std::shared_ptr<torch::autograd::Node> acc =
              torch::autograd::impl::grad_accumulator(s.param);
          acc->add_post_hook(std::make_unique<GradReadyHook>(this, alive_, i));
          accumulators_.push_back(std::move(acc));
        });
        if (!hooked.ok()) return Annotate(hooked, absl::StrCat("FSDP: hooking ", s.name));
      }
    }
    return absl::OkStatus();
  }

  // ---- ShardedModel ----

  std::vector<std::string> unit_names() const override {
    std::vector<std::string> out;
    for (const Unit& u : units_) out.push_back(u.name);
    return out;
  }
  const std::vector<ParameterPiece>& pieces() const override { return pieces_; }
  at::Tensor PieceOf(const at::Tensor& parameter) const override {
    auto it = piece_of_.find(parameter.unsafeGetTensorImpl());
    return it == piece_of_.end() ? at::Tensor() : pieces_[it->second].piece;
  }
  ShardingStrategy strategy() const override { return strategy_; }
  void set_require_sync(bool require_sync) override { require_sync_ = require_sync; }
  bool require_sync() const override { return require_sync_; }
  bool received_gradients() const override { return received_; }

  absl::Status PreForward(absl::string_view name) override {
    const size_t i = UnitFor(name);
    if (i == 0) return absl::OkStatus();
    Unit& u = units_[i];
    if (!u.entered_by.empty()) return absl::OkStatus();  // a module inside the unit
    u.entered_by = std::string(name);
    u.ever_entered = true;
    if (learning_ && std::find(order_.begin(), order_.end(), i) == order_.end()) {
      order_.push_back(i);
    }
    ACCEL_RETURN_IF_ERROR(Gather(u));
    if (plugin_.forward_prefetch && !learning_ && at::GradMode::is_enabled()) {
      ACCEL_RETURN_IF_ERROR(Prefetch(Neighbour(i, +1)));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<at::Tensor> PostForward(absl::string_view name, at::Tensor output) override {
    const size_t i = UnitFor(name);
    if (i == 0 || units_[i].entered_by != name) return output;
    Unit& u = units_[i];
    u.entered_by.clear();
    const bool backward_follows =
        at::GradMode::is_enabled() && output.defined() && output.requires_grad();
    if (backward_follows) {
      std::shared_ptr<bool> alive = alive_;
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        output.register_hook([this, alive, i](const at::Tensor&) {
          if (*alive) ThrowIfError(PreBackward(i));
        });
      }));
      if (strategy_ == ShardingStrategy::kFullShard) Free(u);
    } else if (strategy_ != ShardingStrategy::kNoShard) {
      Free(u);
    }
    return output;
  }

  absl::Status Finish() override {
    // Units whose every parameter got a gradient were reduced during
    // backward; the rest (some parameters unused this step) now, in one
    // order on every rank.
    for (size_t i = units_.size(); i-- > 0;) {
      Unit& u = units_[i];
      if (!u.reduced && u.grads_seen > 0) ACCEL_RETURN_IF_ERROR(Reduce(u));
    }
    while (!reductions_.empty()) ACCEL_RETURN_IF_ERROR(CompleteOldestReduction());
    if (learning_) {
      learning_ = false;
      for (size_t i = 1; i < units_.size(); ++i) {
        Unit& u = units_[i];
        if (!u.ever_entered) {
          u.resident = true;
          std::fprintf(stderr,
                       "accel FSDP: unit %s ran outside dispatch::RunModule (or not at all) in the "
                       "first step; it stays gathered\n",
                       u.name.c_str());
        }
      }
    }
    for (Unit& u : units_) {
      u.grads_seen = 0;
      u.reduced = false;
      // A gather prefetched for a unit this backward never reached would
      // land the shards as they are before the optimizer steps them.
      ACCEL_RETURN_IF_ERROR(CompletePendingGather(u));
      if (strategy_ != ShardingStrategy::kNoShard) Free(u);
    }
    received_ = false;
    return absl::OkStatus();
  }

  void ZeroGrad() override {
    for (Unit& u : units_) {
      for (const Slot& s : u.slots) {
        s.param.mutable_grad() = at::Tensor();
        pieces_[s.piece].piece.mutable_grad() = at::Tensor();
      }
      u.shard_grad = at::Tensor();
    }
  }

  absl::Status ShardsChanged() override {
    for (Unit& u : units_) {
      ACCEL_RETURN_IF_ERROR(CompletePendingGather(u));  // it read the old shards
      if (!u.gathered) continue;
      u.gathered = false;
      ACCEL_RETURN_IF_ERROR(Gather(u));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<NamedTensors> FullStateDict() override {
    std::map<const c10::TensorImpl*, at::Tensor> whole;
    for (Unit& u : units_) {
      at::Tensor all = u.shard;
      if (shard_count_ > 1) {
        ACCEL_RETURN_IF_ERROR(
            CallTorch([&] { all = at::empty({u.padded}, u.shard.options().device(device_)); }));
        ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<PendingWork> work,
                               group_.AllGatherIntoAsync(Wire(u.shard, master_dtype_), all));
        ACCEL_RETURN_IF_ERROR(TimedWait(*work, "FSDP: gathering the full state"));
      }
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        for (const Slot& s : u.slots) {
          whole[s.param.unsafeGetTensorImpl()] = all.narrow(0, s.offset, s.numel)
                                                     .view(s.param.sizes())
                                                     .to(at::kCPU, at::kFloat)
                                                     .clone();
        }
      }));
    }
    NamedTensors out;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      for (const auto& item : module_->named_parameters(true)) {
        auto it = whole.find(item.value().unsafeGetTensorImpl());
        out.emplace_back(item.key(),
                         it != whole.end() ? it->second : item.value().detach().to(at::kCPU));
      }
      for (const auto& item : module_->named_buffers(true)) {
        out.emplace_back(item.key(), item.value().detach().to(at::kCPU));
      }
    }));
    return out;
  }

  absl::Status LoadFullStateDict(const NamedTensors& state) override {
    std::map<std::string, at::Tensor> by_name(state.begin(), state.end());
    auto find = [&](const at::Tensor& t, const std::string& first) -> absl::StatusOr<at::Tensor> {
      for (const std::string& n : names_of_[t.unsafeGetTensorImpl()]) {
        auto it = by_name.find(n);
        if (it == by_name.end()) continue;
        if (it->second.numel() != t.numel() || it->second.sizes() != t.sizes()) {
          return absl::InvalidArgumentError(absl::StrCat("FSDP state: \"", n, "\" has shape ",
                                                         c10::str(it->second.sizes()),
                                                         ", the model ", c10::str(t.sizes())));
        }
        return it->second;
      }
      return absl::NotFoundError(absl::StrCat("FSDP state: no tensor \"", first, "\""));
    };
    for (Unit& u : units_) {
      for (const Slot& s : u.slots) {
        ACCEL_ASSIGN_OR_RETURN(at::Tensor t, find(s.param, s.name));
        const ParameterPiece& p = pieces_[s.piece];
        ACCEL_RETURN_IF_ERROR(CallTorch([&] {
          at::NoGradGuard no_grad;
          p.piece.copy_(t.reshape({-1}).narrow(0, p.offset, p.piece.numel()));
        }));
      }
    }
    for (const auto& item : module_->named_parameters(true)) {
      if (piece_of_.count(item.value().unsafeGetTensorImpl())) continue;
      ACCEL_ASSIGN_OR_RETURN(at::Tensor t, find(item.value(), item.key()));
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        at::NoGradGuard no_grad;
        item.value().copy_(t);
      }));
    }
    for (const auto& item : module_->named_buffers(true)) {
      auto it = by_name.find(item.key());
      if (it == by_name.end()) {
        return absl::NotFoundError(absl::StrCat("FSDP state: no buffer \"", item.key(), "\""));
      }
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        at::NoGradGuard no_grad;
        item.value().copy_(it->second);
      }));
    }
    return ShardsChanged();
  }

  absl::Status SaveShards(const std::string& dir) override {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return absl::PermissionDeniedError(absl::StrCat(dir, ": ", ec.message()));
    std::vector<loader::NamedTensor> tensors;
    nlohmann::json meta;
    meta["world_size"] = shard_count_ == 1 ? 1 : world_;
    meta["rank"] = shard_count_ == 1 ? 0 : rank_;
    nlohmann::json pieces = nlohmann::json::object();
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      for (const ParameterPiece& p : pieces_) {
        tensors.emplace_back(p.name, p.piece.to(at::kCPU).contiguous());
        pieces[p.name] = {{"shape", p.shape}, {"offset", p.offset}};
      }
      for (const auto& [name, t] : Unsharded())
        tensors.emplace_back(name, t.to(at::kCPU).contiguous());
    }));
    meta["pieces"] = pieces;
    return loader::WriteSafetensors(
        absl::StrCat(dir, "/",
                     RankFileName(meta["rank"].get<int>(), meta["world_size"].get<int>())),
        tensors, {{"format", "pt"}, {kShardsKey, meta.dump()}});
  }

  absl::Status LoadShards(const std::string& dir) override {
    const int world = shard_count_ == 1 ? 1 : world_;
    const int rank = shard_count_ == 1 ? 0 : rank_;
    const std::string path = absl::StrCat(dir, "/", RankFileName(rank, world));
    if (!std::filesystem::exists(path)) {
      std::vector<std::string> found;
      std::error_code ec;
      for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
        found.push_back(e.path().filename().string());
      }
      return absl::FailedPreconditionError(absl::StrCat(
          path, " does not exist: the sharded state must be loaded by as many ranks as saved it (",
          world, " here; the folder holds ", absl::StrJoin(found, ", "),
          "); accel-merge-weights makes one model of it"));
    }
    ACCEL_ASSIGN_OR_RETURN(loader::SafetensorsFile file, loader::SafetensorsFile::Open(path));
    for (const ParameterPiece& p : pieces_) {
      absl::StatusOr<at::Tensor> t = file.Tensor(p.name);
      if (!t.ok()) return Annotate(t.status(), path);
      if (t->numel() != p.piece.numel()) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": \"", p.name, "\" holds ", t->numel(), " values, this rank's piece ",
            p.piece.numel(), " (another model or sharding)"));
      }
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        at::NoGradGuard no_grad;
        p.piece.copy_(*t);
      }));
    }
    for (const auto& item : Unsharded()) {
      const std::string& name = item.first;
      at::Tensor tensor = item.second;
      absl::StatusOr<at::Tensor> t = file.Tensor(name);
      if (!t.ok()) return Annotate(t.status(), path);
      if (t->sizes() != tensor.sizes()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": \"", name, "\" has shape ",
                                                       c10::str(t->sizes()), ", the model ",
                                                       c10::str(tensor.sizes())));
      }
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        at::NoGradGuard no_grad;
        tensor.copy_(*t);
      }));
    }
    return ShardsChanged();
  }

  int64_t parameter_bytes() const override {
    int64_t n = 0;
    for (const Unit& u : units_) {
      n += static_cast<int64_t>(StorageBytes(u.shard));
      if (!u.full.is_same(u.shard)) n += static_cast<int64_t>(StorageBytes(u.full));
    }
    return n;
  }
  int64_t gradient_bytes() const override {
    int64_t n = 0;
    for (const Unit& u : units_) {
      n += static_cast<int64_t>(StorageBytes(u.shard_grad));
      for (const Slot& s : u.slots) {
        if (s.param.grad().defined()) n += static_cast<int64_t>(s.param.grad().nbytes());
      }
    }
    // Gradients on their way.
    for (const PendingReduction& r : reductions_) {
      n += static_cast<int64_t>(StorageBytes(r.flat));
      if (!r.out.is_same(r.flat)) n += static_cast<int64_t>(StorageBytes(r.out));
    }
    return n;
  }
  double communication_seconds() const override { return comm_seconds_; }
  int64_t peak_bytes() const override { return peak_bytes_; }
  void ResetPeakBytes() override { peak_bytes_ = parameter_bytes() + gradient_bytes(); }

  // ---- Called from autograd ----

  void GradReady(size_t unit) {
    Unit& u = units_[unit];
    received_ = true;
    if (++u.grads_seen == u.slots.size()) ThrowIfError(Reduce(u));
  }

 private:
  // Buffers and parameters that are not sharded (frozen), under their names.
  NamedTensors Unsharded() const {
    NamedTensors out;
    std::set<const c10::TensorImpl*> seen;
    for (const auto& item : module_->named_parameters(true)) {
      const c10::TensorImpl* impl = item.value().unsafeGetTensorImpl();
      if (piece_of_.count(impl) || !seen.insert(impl).second) continue;
      out.emplace_back(item.key(), item.value().detach());
    }
    for (const auto& item : module_->named_buffers(true)) {
      out.emplace_back(item.key(), item.value().detach());
    }
    return out;
  }

  // ---- Building ----

  // Which module paths become units.
  absl::StatusOr<std::vector<std::string>> ChooseUnits(
      const std::vector<std::pair<std::string, at::Tensor>>& params) {
    std::vector<std::string> chosen;
    if (plugin_.auto_wrap_policy == AutoWrapPolicy::kNoWrap) return chosen;
    auto inside_chosen = [&](const std::string& path) {
      for (const std::string& c : chosen) {
        if (path == c || absl::StartsWith(path, c + ".")) return true;
      }
      return false;
    };
    if (plugin_.auto_wrap_policy == AutoWrapPolicy::kTransformerBasedWrap) {
      std::set<std::string> wanted;
      for (const std::string& n : plugin_.transformer_cls_names_to_wrap) {
        wanted.insert(ShortClassName(n));
      }
      std::map<std::string, std::shared_ptr<torch::nn::Module>> by_path;
      std::set<std::string> found;
      for (const auto& item : module_->named_modules("", /*include_self=*/false)) {
        by_path[item.key()] = item.value();
        const std::string& path = item.key();
        if (inside_chosen(path)) continue;
        const std::string cls = ShortClassName(item.value()->name());
        bool take = false;
        if (wanted.empty()) {
          const size_t dot = path.rfind('.');
          const std::string parent = dot == std::string::npos ? "" : path.substr(0, dot);
          auto it = by_path.find(parent);
          take = it != by_path.end() && IsModuleList(*it->second);
        } else {
          take = wanted.count(cls) > 0;
        }
        if (take) {
          chosen.push_back(path);
          found.insert(cls);
        }
      }
      for (const std::string& w : wanted) {
        if (found.count(w) == 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("FSDP transformer_cls_names_to_wrap: no module of class \"", w,
                           "\" in the model (torch::nn::Module::name() of its modules)"));
        }
      }
      return chosen;
    }
    // SIZE_BASED_WRAP: innermost first.
    std::map<std::string, int64_t> numel_of;
    for (const auto& [name, t] : params) {
      if (t.requires_grad()) numel_of[name] = t.numel();
    }
    std::function<void(const std::string&, torch::nn::Module&)> visit = [&](const std::string& path,
                                                                            torch::nn::Module& m) {
      for (const auto& child : m.named_children()) {
        visit(path.empty() ? child.key() : path + "." + child.key(), *child.value());
      }
      if (path.empty()) return;
      int64_t unwrapped = 0;
      for (const auto& [name, n] : numel_of) {
        if (absl::StartsWith(name, path + ".") && !inside_chosen(name)) unwrapped += n;
      }
      if (unwrapped >= plugin_.min_num_params) chosen.push_back(path);
    };
    visit("", *module_);
    return chosen;
  }

  size_t UnitOfParam(const std::string& param_name) const {
    size_t best = 0;
    size_t best_len = 0;
    for (const auto& [prefix, i] : unit_of_name_) {
      if (absl::StartsWith(param_name, prefix + ".") && prefix.size() > best_len) {
        best = i;
        best_len = prefix.size();
      }
    }
    return best;
  }

  // The unit module `name` belongs to (0: none, the root's).
  size_t UnitFor(absl::string_view name) const {
    std::string key(name);
    while (true) {
      auto it = unit_of_name_.find(key);
      if (it != unit_of_name_.end()) return it->second;
      const size_t dot = key.rfind('.');
      if (dot == std::string::npos) return 0;
      key.resize(dot);
    }
  }

  void BuildUnit(Unit& u) {
    for (Slot& s : u.slots) {
      s.offset = u.numel;
      u.numel += s.numel;
    }
    u.padded = (u.numel + shard_count_ - 1) / shard_count_ * shard_count_;
    u.shard_numel = u.padded / shard_count_;
    const int shard_index = shard_count_ == 1 ? 0 : rank_;
    const int64_t begin = shard_index * u.shard_numel;
    // This rank's shard, straight from the parameters.
    at::TensorOptions master = at::TensorOptions().dtype(master_dtype_).device(shard_device_);
    u.shard = at::zeros({u.shard_numel}, master);
    for (Slot& s : u.slots) {
      const int64_t lo = std::max(s.offset, begin);
      const int64_t hi = std::min(s.offset + s.numel, begin + u.shard_numel);
      ParameterPiece p;
      p.name = s.name;
      p.shape = s.param.sizes().vec();
      const int64_t len = std::max<int64_t>(hi - lo, 0);
      p.offset = len > 0 ? lo - s.offset : 0;
      p.piece = u.shard.narrow(0, len > 0 ? lo - begin : 0, len);
      if (len > 0) {
        p.piece.copy_(s.param.detach().reshape({-1}).narrow(0, p.offset, len));
      }
      s.piece = pieces_.size();
      piece_of_[s.param.unsafeGetTensorImpl()] = pieces_.size();
      pieces_.push_back(std::move(p));
    }
    // The gathered buffer, which the parameters now live in. Unsharded and
    // in the master dtype, it is the shard itself (NO_SHARD: no second copy).
    if (shard_count_ == 1 && compute_dtype_ == master_dtype_ && shard_device_ == device_) {
      u.full = u.shard;
    } else {
      u.full = at::empty({u.padded}, at::TensorOptions().dtype(compute_dtype_).device(device_));
    }
    for (Slot& s : u.slots) {
      at::Tensor alias = u.full.narrow(0, s.offset, s.numel).view(s.param.sizes());
      alias.copy_(s.param.detach());
      s.param.set_data(alias.detach());
    }
    if (u.padded > u.numel) u.full.narrow(0, u.numel, u.padded - u.numel).zero_();
    // Until the first step has shown which units run through the hooks,
    // everything stays gathered.
    u.gathered = true;
  }

  // ---- Gathering ----

  // The shard as it travels: the compute dtype, on the execution device.
  at::Tensor Wire(const at::Tensor& shard, c10::ScalarType dtype) const {
    if (shard.scalar_type() == dtype && shard.device() == device_) return shard;
    return shard.to(device_, dtype);
  }

  absl::Status StartGather(Unit& u) {
    if (u.gathered || u.gather_work) return absl::OkStatus();
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      AllocateStorage(u.full, static_cast<size_t>(u.padded) * u.full.element_size());
      u.gather_source = Wire(u.shard, compute_dtype_);
    }));
    if (shard_count_ == 1) {
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        if (!u.gather_source.is_same(u.full)) u.full.copy_(u.gather_source);
      }));
      u.gathered = true;
      return absl::OkStatus();
    }
    ACCEL_ASSIGN_OR_RETURN(u.gather_work, group_.AllGatherIntoAsync(u.gather_source, u.full));
    return absl::OkStatus();
  }

  absl::Status Gather(Unit& u) {
    ACCEL_RETURN_IF_ERROR(StartGather(u));
    return CompletePendingGather(u);
  }

  // Waits for a gather in flight (none: nothing to do).
  absl::Status CompletePendingGather(Unit& u) {
    if (u.gather_work) {
      absl::Status s = TimedWait(*u.gather_work, absl::StrCat("FSDP: gathering unit ", u.name));
      u.gather_work.reset();
      u.gather_source = at::Tensor();
      ACCEL_RETURN_IF_ERROR(s);
      u.gathered = true;
      TrackPeak();
    }
    return absl::OkStatus();
  }

  void TrackPeak() { peak_bytes_ = std::max(peak_bytes_, parameter_bytes() + gradient_bytes()); }

  absl::Status Prefetch(size_t i) {
    if (i == 0 || i >= units_.size()) return absl::OkStatus();
    return StartGather(units_[i]);
  }

  // The unit after (+1) or before (-1) unit `i` in forward order; 0 when none.
  size_t Neighbour(size_t i, int direction) const {
    auto it = std::find(order_.begin(), order_.end(), i);
    if (it == order_.end()) return 0;
    const auto at = static_cast<int64_t>(it - order_.begin()) + direction;
    if (at < 0 || at >= static_cast<int64_t>(order_.size())) return 0;
    return order_[static_cast<size_t>(at)];
  }

  void Free(Unit& u) {
    if (u.resident || learning_ || !u.gathered || shard_count_ == 1 || !u.entered_by.empty()) {
      return;
    }
    FreeStorage(u.full);
    u.gathered = false;
  }

  absl::Status PreBackward(size_t i) {
    Unit& u = units_[i];
    ACCEL_RETURN_IF_ERROR(Gather(u));
    if (plugin_.backward_prefetch == BackwardPrefetch::kBackwardPre && !learning_) {
      ACCEL_RETURN_IF_ERROR(Prefetch(Neighbour(i, -1)));
    }
    return absl::OkStatus();
  }

  // ---- Reducing ----

  // Starts reducing unit `u`'s gradients (asynchronously: backward goes on
  // while they travel) and frees what it gathered. One reduction stays in
  // flight past this call; Finish completes it.
  absl::Status Reduce(Unit& u) {
    u.reduced = true;
    TrackPeak();
    if (require_sync_) {
      PendingReduction pending;
      pending.unit = static_cast<size_t>(&u - units_.data());
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        at::NoGradGuard no_grad;
        pending.flat =
            at::zeros({u.padded}, at::TensorOptions().dtype(reduce_dtype_).device(device_));
        for (const Slot& s : u.slots) {
          const at::Tensor& g = s.param.grad();
          if (g.defined()) pending.flat.narrow(0, s.offset, s.numel).copy_(g.reshape({-1}));
          // The copy travels; the gathered gradient goes now.
          s.param.mutable_grad() = at::Tensor();
        }
        pending.out =
            shard_count_ == 1 ? pending.flat : at::empty({u.shard_numel}, pending.flat.options());
      }));
      const std::string what = absl::StrCat("FSDP: reducing unit ", u.name);
      if (shard_count_ == 1) {
        auto whole = std::make_unique<std::vector<at::Tensor>>(1, pending.flat);
        absl::StatusOr<std::unique_ptr<PendingWork>> work =
            group_.AllReduceAsync(*whole, ReduceOp::kSum);
        if (!work.ok()) return Annotate(work.status(), what);
        pending.work = *std::move(work);
        pending.keep = std::move(whole);
      } else {
        absl::StatusOr<std::unique_ptr<PendingWork>> work =
            group_.ReduceScatterAsync(pending.flat, pending.out);
        if (!work.ok()) return Annotate(work.status(), what);
        pending.work = *std::move(work);
      }
      reductions_.push_back(std::move(pending));
      TrackPeak();
      // One unit's gradients travel while the next unit's backward runs;
      // more in flight would hold more gathered-size buffers.
      if (reductions_.size() > 1) ACCEL_RETURN_IF_ERROR(CompleteOldestReduction());
    }
    if (strategy_ != ShardingStrategy::kNoShard) Free(u);
    if (plugin_.backward_prefetch == BackwardPrefetch::kBackwardPost && !learning_) {
      const auto it = unit_of_name_.find(u.name);
      if (it != unit_of_name_.end()) ACCEL_RETURN_IF_ERROR(Prefetch(Neighbour(it->second, -1)));
    }
    return absl::OkStatus();
  }

  // Waits for the oldest reduction in flight and adds its mean gradient to
  // the unit's shard gradient, which the pieces' grads then view.
  absl::Status CompleteOldestReduction() {
    PendingReduction pending = std::move(reductions_.front());
    reductions_.pop_front();
    Unit& u = units_[pending.unit];
    ACCEL_RETURN_IF_ERROR(TimedWait(*pending.work, absl::StrCat("FSDP: reducing unit ", u.name)));
    return CallTorch([&] {
      at::NoGradGuard no_grad;
      pending.out.div_(world_);
      // A piece whose grad the optimizer's zero_grad dropped starts over.
      const bool accumulate = !u.slots.empty() && pieces_[u.slots[0].piece].piece.grad().defined();
      const at::Tensor mine = pending.out.to(shard_device_, master_dtype_);
      if (accumulate && u.shard_grad.defined()) {
        u.shard_grad.add_(mine);
      } else {
        // Allocated per step: zero_grad (set_to_none) releases it.
        u.shard_grad = mine;
      }
      for (const Slot& s : u.slots) {
        ParameterPiece& p = pieces_[s.piece];
        const int64_t start_in_shard =
            p.piece.numel() == 0 ? 0 : p.piece.storage_offset() - u.shard.storage_offset();
        p.piece.mutable_grad() = u.shard_grad.narrow(0, start_in_shard, p.piece.numel());
      }
    });
  }

  absl::Status TimedWait(PendingWork& work, absl::string_view what) {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = work.Wait();
    comm_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return Annotate(s, what);
  }

  std::shared_ptr<torch::nn::Module> module_;
  ProcessGroup& group_;
  FullyShardedDataParallelPlugin plugin_;
  c10::Device device_;
  c10::Device shard_device_ = c10::Device(c10::kCPU);
  ShardingStrategy strategy_ = ShardingStrategy::kFullShard;
  int world_ = 1;
  int rank_ = 0;
  int shard_count_ = 1;
  c10::ScalarType master_dtype_ = at::kFloat;
  c10::ScalarType compute_dtype_ = at::kFloat;
  c10::ScalarType reduce_dtype_ = at::kFloat;
  std::vector<Unit> units_;
  std::map<std::string, size_t> unit_of_name_;
  std::map<const c10::TensorImpl*, std::vector<std::string>> names_of_;
  std::vector<ParameterPiece> pieces_;
  std::map<const c10::TensorImpl*, size_t> piece_of_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<size_t> order_;  // units in the order the first forward ran them
  std::deque<PendingReduction> reductions_;
  bool learning_ = true;
  bool require_sync_ = true;
  bool received_ = false;
  double comm_seconds_ = 0;
  int64_t peak_bytes_ = 0;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

torch::autograd::variable_list GradReadyHook::operator()(
    const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
  if (*alive_) owner_->GradReady(unit_);
  return outputs;
}

}  // namespace

absl::StatusOr<ShardingStrategy> ParseShardingStrategy(absl::string_view text) {
  return ParseChoice<ShardingStrategy>(text, "FSDP sharding_strategy",
                                       {{"FULL_SHARD", ShardingStrategy::kFullShard},
                                        {"SHARD_GRAD_OP", ShardingStrategy::kShardGradOp},
                                        {"NO_SHARD", ShardingStrategy::kNoShard},
                                        {"HYBRID_SHARD", ShardingStrategy::kHybridShard}});
}

absl::StatusOr<StateDictType> ParseStateDictType(absl::string_view text) {
  if (absl::AsciiStrToUpper(text) == "LOCAL_STATE_DICT") {
    return absl::InvalidArgumentError(
        "FSDP state_dict_type LOCAL_STATE_DICT is refused: use SHARDED_STATE_DICT (each rank's "
        "shards, with the offsets accel-merge-weights needs) or FULL_STATE_DICT");
  }
  return ParseChoice<StateDictType>(text, "FSDP state_dict_type",
                                    {{"FULL_STATE_DICT", StateDictType::kFullStateDict},
                                     {"SHARDED_STATE_DICT", StateDictType::kShardedStateDict}});
}

absl::StatusOr<BackwardPrefetch> ParseBackwardPrefetch(absl::string_view text) {
  return ParseChoice<BackwardPrefetch>(text, "FSDP backward_prefetch",
                                       {{"BACKWARD_PRE", BackwardPrefetch::kBackwardPre},
                                        {"BACKWARD_POST", BackwardPrefetch::kBackwardPost},
                                        {"NO_PREFETCH", BackwardPrefetch::kNoPrefetch}});
}

absl::StatusOr<AutoWrapPolicy> ParseAutoWrapPolicy(absl::string_view text) {
  return ParseChoice<AutoWrapPolicy>(
      text, "FSDP auto_wrap_policy",
      {{"TRANSFORMER_BASED_WRAP", AutoWrapPolicy::kTransformerBasedWrap},
       {"SIZE_BASED_WRAP", AutoWrapPolicy::kSizeBasedWrap},
       {"NO_WRAP", AutoWrapPolicy::kNoWrap}});
}

const char* ShardingStrategyName(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
    case ShardingStrategy::kHybridShard:
      return "HYBRID_SHARD";
  }
  return "?";
}

absl::StatusOr<FullyShardedDataParallelPlugin> FullyShardedDataParallelPlugin::FromEnv(
    const EnvLookup& env) {
  FullyShardedDataParallelPlugin p;
  auto with_name = [](const absl::Status& s, const std::string& var) {
    return absl::InvalidArgumentError(absl::StrCat(var, ": ", s.message()));
  };
  if (auto v = env("FSDP_SHARDING_STRATEGY"); v && !v->empty()) {
    absl::StatusOr<ShardingStrategy> s = ParseShardingStrategy(*v);
    if (!s.ok()) return with_name(s.status(), "FSDP_SHARDING_STRATEGY");
    p.sharding_strategy = *s;
  }
  if (auto v = env("FSDP_AUTO_WRAP_POLICY"); v && !v->empty()) {
    absl::StatusOr<AutoWrapPolicy> s = ParseAutoWrapPolicy(*v);
    if (!s.ok()) return with_name(s.status(), "FSDP_AUTO_WRAP_POLICY");
    p.auto_wrap_policy = *s;
  }
  if (auto v = env("FSDP_TRANSFORMER_CLS_TO_WRAP"); v && !v->empty()) {
    for (absl::string_view part : absl::StrSplit(*v, ',', absl::SkipWhitespace())) {
      p.transformer_cls_names_to_wrap.emplace_back(absl::StripAsciiWhitespace(part));
    }
  }
  if (auto v = env("FSDP_MIN_NUM_PARAMS"); v && !v->empty()) {
    if (!absl::SimpleAtoi(*v, &p.min_num_params) || p.min_num_params < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("FSDP_MIN_NUM_PARAMS: \"", *v, "\" is not a count"));
    }
  }
  if (auto v = env("FSDP_STATE_DICT_TYPE"); v && !v->empty()) {
    absl::StatusOr<StateDictType> s = ParseStateDictType(*v);
    if (!s.ok()) return with_name(s.status(), "FSDP_STATE_DICT_TYPE");
    p.state_dict_type = *s;
  }
  if (auto v = env("FSDP_BACKWARD_PREFETCH"); v && !v->empty()) {
    absl::StatusOr<BackwardPrefetch> s = ParseBackwardPrefetch(*v);
    if (!s.ok()) return with_name(s.status(), "FSDP_BACKWARD_PREFETCH");
    p.backward_prefetch = *s;
  }
  ACCEL_ASSIGN_OR_RETURN(p.cpu_offload, ParseBool(env, "FSDP_OFFLOAD_PARAMS", p.cpu_offload));
  ACCEL_ASSIGN_OR_RETURN(p.forward_prefetch,
                         ParseBool(env, "FSDP_FORWARD_PREFETCH", p.forward_prefetch));
  ACCEL_ASSIGN_OR_RETURN(p.use_orig_params,
                         ParseBool(env, "FSDP_USE_ORIG_PARAMS", p.use_orig_params));
  ACCEL_ASSIGN_OR_RETURN(p.sync_module_states,
                         ParseBool(env, "FSDP_SYNC_MODULE_STATES", p.sync_module_states));
  ACCEL_ASSIGN_OR_RETURN(p.activation_checkpointing,
                         ParseBool(env, "FSDP_ACTIVATION_CHECKPOINTING", false));
  ACCEL_ASSIGN_OR_RETURN(p.cpu_ram_efficient_loading,
                         ParseBool(env, "FSDP_CPU_RAM_EFFICIENT_LOADING", false));
  ACCEL_ASSIGN_OR_RETURN(const bool reshard, ParseBool(env, "FSDP_RESHARD_AFTER_FORWARD", true));
  if (!reshard && p.sharding_strategy == ShardingStrategy::kFullShard) {
    return absl::InvalidArgumentError(
        "FSDP_RESHARD_AFTER_FORWARD=false is FSDP2's spelling of SHARD_GRAD_OP: with fsdp_version "
        "1 set fsdp_sharding_strategy SHARD_GRAD_OP instead");
  }
  if (auto v = env("FSDP_IGNORED_MODULES"); v && !v->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FSDP_IGNORED_MODULES \"", *v,
        "\": ignored modules are not implemented; freeze them (requires_grad false: they are "
        "then kept whole on every rank) instead"));
  }
  if (auto v = env("FSDP_VERSION"); v && !v->empty() && *v != "1") {
    return absl::InvalidArgumentError(absl::StrCat(
        "FSDP_VERSION: \"", *v, "\": accel implements FSDP1's plugin (fsdp_version: 1)"));
  }
  return p;
}

absl::Status MergeShardedState(const std::string& dir, const std::string& output_dir,
                               int64_t max_shard_bytes) {
  if (!std::filesystem::is_directory(dir)) {
    return absl::NotFoundError(absl::StrCat(dir, " is not a folder"));
  }
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, "rank") && absl::EndsWith(name, ".safetensors")) {
      files.push_back(e.path().string());
    }
  }
  if (files.empty()) {
    return absl::NotFoundError(absl::StrCat(
        dir, " holds no rank<r>-of-<P>.safetensors files (a SHARDED_STATE_DICT save)"));
  }
  int world = -1;
  std::map<int, loader::SafetensorsFile> by_rank;
  std::map<int, nlohmann::json> meta_of;
  for (const std::string& path : files) {
    ACCEL_ASSIGN_OR_RETURN(loader::SafetensorsFile file, loader::SafetensorsFile::Open(path));
    auto it = file.metadata().find(kShardsKey);
    if (it == file.metadata().end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": no \"", kShardsKey, "\" metadata (not an accel FSDP shard file)"));
    }
    const absl::StatusOr<nlohmann::json> parsed = ParseJson(it->second, path);
    nlohmann::json meta = parsed.ok() ? *parsed : nlohmann::json();
    if (!meta.contains("world_size") || !meta.contains("rank") || !meta.contains("pieces") ||
        !meta["world_size"].is_number_integer() || !meta["rank"].is_number_integer() ||
        !meta["pieces"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": malformed \"", kShardsKey, "\" metadata"));
    }
    const int w = meta["world_size"].get<int>();
    const int r = meta["rank"].get<int>();
    if (world != -1 && w != world) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": saved by ", w, " ranks, other files of ", dir, " by ", world));
    }
    world = w;
    if (r < 0 || r >= w || by_rank.count(r)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": rank ", r, " out of place"));
    }
    meta_of[r] = std::move(meta);
    by_rank.emplace(r, std::move(file));
  }
  for (int r = 0; r < world; ++r) {
    if (!by_rank.count(r)) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir, ": the file of rank ", r, " of ", world, " is missing"));
    }
  }
  // Whole tensors in rank 0's order, pieces assembled.
  std::vector<loader::NamedTensor> merged;
  const loader::SafetensorsFile& first = by_rank.at(0);
  for (const auto& info : first.tensors()) {
    const std::string& name = info.name;
    const nlohmann::json& pieces0 = meta_of[0]["pieces"];
    ACCEL_ASSIGN_OR_RETURN(at::Tensor t0, first.Tensor(name));
    if (!pieces0.contains(name)) {
      merged.emplace_back(name, t0.clone());
      continue;
    }
    const nlohmann::json& entry = pieces0[name];
    bool integers = entry.is_object() && entry.contains("shape") && entry["shape"].is_array();
    for (const nlohmann::json& d : integers ? entry["shape"] : nlohmann::json::array()) {
      integers = integers && d.is_number_integer();
    }
    if (!integers) {
      return absl::InvalidArgumentError(
          absl::StrCat(first.path(), ": \"", name, "\" has no shape of integers"));
    }
    std::vector<int64_t> shape = entry["shape"].get<std::vector<int64_t>>();
    int64_t numel = 1;
    for (int64_t d : shape) {
      if (d < 0 || (d > 0 && numel > (int64_t{1} << 40) / d)) {
        return absl::InvalidArgumentError(
            absl::StrCat(first.path(), ": \"", name, "\" has a bad shape"));
      }
      numel *= d;
    }
    at::Tensor whole = at::zeros({numel}, t0.options());
    int64_t covered = 0;
    for (int r = 0; r < world; ++r) {
      const nlohmann::json& pieces = meta_of[r]["pieces"];
      if (!pieces.contains(name) || !pieces[name].contains("offset") ||
          !pieces[name]["offset"].is_number_integer()) {
        return absl::DataLossError(
            absl::StrCat(by_rank.at(r).path(), ": no piece of \"", name, "\""));
      }
      ACCEL_ASSIGN_OR_RETURN(at::Tensor piece, by_rank.at(r).Tensor(name));
      const int64_t offset = pieces[name]["offset"].get<int64_t>();
      if (offset < 0 || piece.dim() != 1 || offset + piece.numel() > numel ||
          piece.scalar_type() != whole.scalar_type()) {
        return absl::DataLossError(absl::StrCat(by_rank.at(r).path(), ": the piece of \"", name,
                                                "\" does not fit its parameter"));
      }
      if (piece.numel() > 0) whole.narrow(0, offset, piece.numel()).copy_(piece);
      covered += piece.numel();
    }
    if (covered != numel) {
      return absl::DataLossError(absl::StrCat(dir, ": the pieces of \"", name, "\" cover ", covered,
                                              " of its ", numel, " values"));
    }
    merged.emplace_back(name, whole.view(shape));
  }
  loader::CheckpointWriteOptions options;
  options.max_shard_size = max_shard_bytes;
  return loader::WriteCheckpoint(output_dir, merged, options).status();
}

absl::StatusOr<std::unique_ptr<ShardedModel>> ShardedModel::Wrap(
    std::shared_ptr<torch::nn::Module> module, ProcessGroup& group,
    const FullyShardedDataParallelPlugin& plugin, c10::Device device, int num_nodes) {
  if (module == nullptr) return absl::InvalidArgumentError("FSDP: the module is null");
  auto sharded = std::make_unique<Sharded>(std::move(module), group, plugin, device);
  ACCEL_RETURN_IF_ERROR(sharded->Init(num_nodes));
  return std::unique_ptr<ShardedModel>(std::move(sharded));
}

ShardedModel::~ShardedModel() = default;

}  // namespace accel::train
