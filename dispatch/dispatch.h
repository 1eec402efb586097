// dispatch/dispatch.h: loading a checkpoint into a model built on empty
// (meta) weights, each tensor to the device its device map names, and
// running the modules whose weights live on the cpu or on disk.
//
//   ACCEL_ASSIGN_OR_RETURN(auto dispatched,
//                          DispatchedModel::Load(model, "/models/llama", map, options));
//   ...
//   {
//     ACCEL_ASSIGN_OR_RETURN(auto scope, dispatched->Enter("model.layers.7"));
//     x = layer->forward(x.to(scope.device()));     // weights present here
//   }                                               // and released here
//
// Placement rules (Accelerate's load_checkpoint_and_dispatch, with its
// offload hooks): a GPU entry holds its weights on that GPU; a "cpu" entry
// holds them in RAM and, when the main device (the first GPU) is a GPU, they
// are copied there for each forward; a "disk" entry's weights are read from
// disk for each forward: straight from the checkpoint file when no dtype
// conversion is needed, otherwise from an offload folder written once in
// Accelerate's format (index.json + one raw <name>.dat per tensor). While a
// module runs, the next offloaded module's weights are read by a background
// thread and, with a GPU main device, copied there from pinned host memory
// on a copy stream of their own (internal/device_stager.h). Tied parameters share one tensor (Note
// [In-place tensor moves]), so they stay tied on every device.
#ifndef ACCEL_DISPATCH_DISPATCH_H_
#define ACCEL_DISPATCH_DISPATCH_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

#include "core/progress.h"
#include "dispatch/device_map.h"
#include "dispatch/offload_stats.h"

namespace torch::nn {
class Module;
}

namespace accel::dispatch {

// A tensor a LoadHook makes: placed under `name` with its own dtype.
struct HookTensor {
  std::string name;
  at::Tensor value;
};

// Takes over the checkpoint tensors that do not load as they are stored:
// quantization turns a float weight into the tensors of a quantized layer,
// and reads a quantized checkpoint's metadata. Called on the loading thread,
// in checkpoint order.
class LoadHook {
 public:
  virtual ~LoadHook() = default;
  // Whether checkpoint tensor `name` goes through Convert().
  virtual bool Claims(absl::string_view name) const = 0;
  // `stored`: the checkpoint tensor, on the cpu, as stored. Returns the model
  // tensors to place in its stead (each must exist in the model with that
  // shape and dtype); none when it keeps the tensor for later (metadata, or a
  // part of something not yet complete). An error aborts the load. Handing
  // back `stored` itself under `name` places it as stored, in its own dtype:
  // a disk placement then uses the checkpoint's bytes, as for a tensor that
  // no hook claims, and the offload folder is not needed for it.
  virtual absl::StatusOr<std::vector<HookTensor>> Convert(const std::string& name,
                                                          const at::Tensor& stored) = 0;
  // After the last tensor: an error for anything still incomplete.
  virtual absl::Status Finish() { return absl::OkStatus(); }
};

struct LoadOptions {
  // Floating tensors are converted to this; unset: to the model tensor's dtype.
  std::optional<at::ScalarType> dtype;
  // Modules (dotted names) kept in float32 when `dtype` is 16-bit.
  std::vector<std::string> keep_in_fp32_modules;
  // Where disk tensors that need a dtype conversion are written (created if
  // missing). Needed only then.
  std::string offload_folder;
  // Tensors in the checkpoint that the model lacks are an error (otherwise
  // they are listed in unexpected()). Parameters the checkpoint lacks are
  // always an error.
  bool strict = false;
  // Buffers of disk modules are offloaded with them (otherwise they stay
  // on the execution device, as Accelerate does).
  bool offload_buffers = false;
  // Buffers of disk modules whose checkpoint bytes can be used in place (same
  // dtype, stored contiguous) are offloaded with them; the others stay on the
  // execution device, never written. LoadModel's choice for quantized
  // layers: a quant state (absmax, SCB) is weight data that goes with its
  // weight, while a tensor made on loading (int8's weight_format) is a few
  // bytes not worth a file.
  bool offload_buffers_in_place = false;
  // Read the next offloaded module while the current one runs, and the
  // experts a model expects next (PrefetchExperts).
  bool prefetch = true;
  Progress::Style progress = Progress::Style::kAuto;
  // Not owned; null: every tensor loads as it is stored.
  LoadHook* hook = nullptr;
  // Where cpu and disk entries run (Accelerate's execution_device / main
  // device); unset: the first GPU in the map, else the cpu. A GPU here
  // streams a model held in RAM or on disk through it.
  std::optional<at::Device> execution_device;
  // Expert lists (ModuleLists of mixture-of-experts blocks, as
  // PlanOptions::expert_lists) whose offloaded experts are brought in one at
  // a time by EnterExperts(), through a cache of `expert_cache_bytes` on the
  // execution device, instead of all together by Enter() of their block.
  std::vector<std::string> expert_lists;
  int64_t expert_cache_bytes = 0;
  // Mapped experts the cache evicts stay in the page cache (unmapped from
  // the process, so its resident memory is the cache's budget; the kernel
  // reclaims them first when it needs memory, and until then a miss on one
  // is read at memory speed), rather than being dropped from it. Measured on
  // Mixtral-8x7B NF4 (docs/BENCHMARKS.md): 1.35x decode on a whole 24 GiB
  // machine, and 0.95x in a 16 GiB memory cgroup, whose limit reclaim then
  // took the cache's own units too. Kept above a free memory floor by the
  // cache (ExpertCache::Options::keep_memory_free): reads land in free
  // memory rather than wait for the kernel's reclaim.
  bool keep_evicted_expert_pages = false;
  // Disk reads bypass the page cache (O_DIRECT; a buffered read whose pages
  // are dropped after, where the file system refuses it), so offloaded
  // weights live in the process's buffers only: a memory budget that holds,
  // and large reads at the device's rate.
  bool direct_reads = false;
  // Disk entries that run on the cpu and need no conversion are used in
  // place from a read-only mapping of their file (zero copies, as cpu entries
  // alias the checkpoint), unless direct_reads asks for reads that bypass the
  // page cache. The reader thread maps the next modules' pages in ahead of
  // use (MADV_POPULATE_READ), reading what the page cache lacks.
  bool map_disk = true;
  // Bytes of mapped disk weights that may stay in the process between uses
  // (what max_memory's cpu budget leaves them). Past it, modules' pages are
  // dropped behind them as they are released, oldest first (MADV_DONTNEED;
  // the page cache keeps them), so the process's resident weights stay within
  // the budget plus the read-ahead window. Negative: no limit.
  int64_t mapped_resident_bytes = -1;
  // Bytes of mapped disk weights the page cache is to keep between uses once
  // they leave the process (see mapped_resident_bytes): the modules that run
  // last in a pass (the first pass tells the order) whose pages fit this stay
  // cached; the others' pages are evicted from the page cache as they are
  // dropped (POSIX_FADV_DONTNEED); until the order is known the kernel decides.
  // A model read whole every token and larger than memory otherwise gets no
  // page-cache hits at all: LRU loses each page before its next use.
  // Negative: the kernel decides, and every dropped page stays cached.
  int64_t page_cache_keep_bytes = -1;
  // How many offloaded modules ahead of the running one the reader works
  // (at least 1): mapped ones are made resident, others read into buffers.
  int prefetch_depth = 2;
  // Read the weights placed in RAM, exactly their bytes (MADV_WILLNEED, then
  // made resident), on a thread of its own from the end of Load on: Load
  // returns once they are mapped. Left to fault in during the first forward, each
  // fault reads a read-ahead window around it (megabytes of the offloaded
  // weights beside them in the shards), which a model larger than memory
  // cannot afford to keep and the kernel then reclaims with the rest.
  bool populate_resident = false;
};

class DispatchedModel {
 public:
  // Brings the weights of one module in for its life; moves only.
  class Scope {
   public:
    Scope(Scope&& other) noexcept;
    Scope& operator=(Scope&& other) = delete;
    Scope(const Scope&) = delete;
    ~Scope();
    // Where the module runs: move its inputs here.
    const at::Device& device() const { return device_; }

   private:
    friend class DispatchedModel;
    Scope(DispatchedModel* owner, int group, at::Device device)
        : owner_(owner), group_(group), device_(device) {}
    DispatchedModel* owner_;
    int group_;  // -1: nothing to release
    at::Device device_;
  };

  // Brings in chosen experts of one expert list for its life; moves only.
  class ExpertScope {
   public:
    ExpertScope(ExpertScope&& other) noexcept;
    ExpertScope& operator=(ExpertScope&& other) = delete;
    ExpertScope(const ExpertScope&) = delete;
    ~ExpertScope();

   private:
    friend class DispatchedModel;
    ExpertScope(DispatchedModel* owner, std::vector<int> units)
        : owner_(owner), units_(std::move(units)) {}
    DispatchedModel* owner_;
    std::vector<int> units_;  // expert-cache units to release
  };

  using Stats = OffloadStats;

  // Loads `checkpoint` (a file, index or folder; see loader::Checkpoint)
  // into `model`, whose tensors may be meta. Errors name the tensor or the
  // path: InvalidArgument for a tensor with no device in `map`, a shape
  // mismatch or a dtype that cannot be converted; NotFound for parameters
  // the checkpoint lacks (and, when strict, InvalidArgument for tensors the
  // model lacks); the errno status of a failed write to the offload folder,
  // whose files are each written atomically.
  static absl::StatusOr<std::unique_ptr<DispatchedModel>> Load(
      std::shared_ptr<torch::nn::Module> model, const std::string& checkpoint, const DeviceMap& map,
      const LoadOptions& options);
  ~DispatchedModel();
  DispatchedModel(const DispatchedModel&) = delete;
  DispatchedModel& operator=(const DispatchedModel&) = delete;

  torch::nn::Module& module() { return *model_; }
  const DeviceMap& device_map() const { return map_; }
  // Where cpu and disk entries run: LoadOptions::execution_device, else the
  // first GPU in the map, else the cpu.
  const at::Device& main_device() const { return main_; }
  // Where module (or tensor) `name` runs: its GPU, or the main device for
  // cpu and disk entries.
  at::Device ExecutionDevice(absl::string_view name) const;
  const std::vector<std::string>& unexpected() const { return unexpected_; }

  // Brings in the offloaded weights at or below module `name` (nothing to do
  // for resident modules) and starts reading the module expected next.
  // Not thread-safe: one thread runs the model.
  absl::StatusOr<Scope> Enter(absl::string_view name);
  // Whether the experts of `list` are brought in one by one (offloaded, and
  // named in LoadOptions::expert_lists); otherwise Enter() of the block
  // holding them brought them all.
  bool FetchesExpertsOf(absl::string_view list) const;
  // Brings in experts `experts` (indices into `list`, distinct) from the
  // expert cache, reading those not cached; the others stay empty. Call
  // inside the scope of the block holding the list. A no-op scope when
  // !FetchesExpertsOf(list). InvalidArgument for an index outside the list.
  absl::StatusOr<ExpertScope> EnterExperts(absl::string_view list,
                                           absl::Span<const int64_t> experts);
  // Has the reader thread read these experts of `list` into the cache ahead
  // of use. `needed`: the step enters them next, in this order (read first,
  // evicting what is not pinned); otherwise a guess (read when nothing is
  // needed, into room that evicts nothing needed sooner, and only with
  // LoadOptions::prefetch). Nothing fails here. No-op when not FetchesExpertsOf.
  void PrefetchExperts(absl::string_view list, absl::Span<const int64_t> experts,
                       bool needed = false);
  // Whether EnterExperts(list, {expert}) would read nothing: the expert is
  // resident or cached (always, when not FetchesExpertsOf).
  bool ExpertReady(absl::string_view list, int64_t expert) const;

  // The order modules will be entered in, for prefetching. Unset, it is
  // learned from the first pass of Enter() calls.
  void SetExecutionOrder(std::vector<std::string> names);

  Stats stats() const;

 private:
  struct Impl;
  explicit DispatchedModel(std::unique_ptr<Impl> impl);
  void Release(int group);
  void ReleaseExperts(const std::vector<int>& units);
  absl::Status SetUpExpertCache(const LoadOptions& options);

  std::unique_ptr<Impl> impl_;
  std::shared_ptr<torch::nn::Module> model_;
  DeviceMap map_;
  at::Device main_ = at::kCPU;
  std::vector<std::string> unexpected_;
};

}  // namespace accel::dispatch

#endif  // ACCEL_DISPATCH_DISPATCH_H_
