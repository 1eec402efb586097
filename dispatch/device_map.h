// dispatch/device_map.h: where each part of a model goes, planned on its
// ModuleTree the way HuggingFace Accelerate plans it (compute_module_sizes,
// get_max_layer_size, get_balanced_memory, infer_auto_device_map,
// clean_device_map, check_device_map), so the same inputs give the same map.
// Deliberate differences, each documented in docs/ARCHITECTURE.md: a split
// module keeps its direct buffers in the plan; a "disk" entry in max_memory
// is accepted by the balanced strategies; a tie whose partner was already
// placed is skipped instead of failing.
//
//   ACCEL_ASSIGN_OR_RETURN(MaxMemory mm, ParseMaxMemory("0=10GiB,1=10GiB,cpu=30GiB"));
//   PlanOptions options;
//   options.no_split = {"LlamaDecoderLayer"};
//   ACCEL_ASSIGN_OR_RETURN(DeviceMap map, PlanDeviceMap(tree, "auto", mm, options));
#ifndef ACCEL_DISPATCH_DEVICE_MAP_H_
#define ACCEL_DISPATCH_DEVICE_MAP_H_

#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "core/placement.h"
#include "dispatch/module_tree.h"

namespace accel::dispatch {

// Bytes per element as Accelerate counts them: bool 1/8, 8-bit types 1, ...
double DTypeByteSize(c10::ScalarType dtype);
// Accelerate's CustomDtype sizes for quantized storage.
inline constexpr double kInt4ByteSize = 0.5;
inline constexpr double kInt2ByteSize = 0.25;

struct SizeOptions {
  // Floating tensors are sized at min(this, their own dtype); integer and
  // bool tensors keep their own.
  std::optional<c10::ScalarType> dtype;
  // Full tensor name -> bytes per element, overriding everything.
  std::map<std::string, double> special_bytes;
};

// Bytes of every tensor and of every module prefix ("" is the whole model).
// Sizes can be fractional (bool, int4). A tied alias has no entry of its own.
class ModuleSizes {
 public:
  double at(absl::string_view name) const;  // 0 when there is no entry
  double total() const { return at(""); }
  // In first-appearance order (Accelerate's dict order).
  const std::vector<std::string>& names() const { return order_; }
  void Add(absl::string_view name, double bytes);

 private:
  absl::flat_hash_map<std::string, double> bytes_;
  std::vector<std::string> order_;
};

ModuleSizes ComputeModuleSizes(const ModuleTree& tree, const SizeOptions& options = {},
                               bool buffers_only = false);

// The largest unsplittable layer among the whole tree's top-level entries
// (root parameters, children, root buffers): a layer is a module without
// children, a module whose class is in `no_split`, or a bare tensor.
struct LayerSize {
  double bytes = 0;
  std::vector<std::string> names;  // every layer of that size
};
LayerSize GetMaxLayerSize(const ModuleTree& tree, const ModuleSizes& sizes,
                          const std::vector<std::string>& no_split);

// Budgets per device, in Accelerate's order (GPUs by index, cpu, disk).
using MaxMemory = std::vector<std::pair<Placement, double>>;

// "0=10GiB,1=10GiB,cpu=30GiB,disk=1TB": sizes as core/bytes.h reads them;
// GPUs named here are planned for whether or not this machine has them.
// InvalidArgument naming the entry for a bad device or size.
absl::StatusOr<MaxMemory> ParseMaxMemory(absl::string_view spec);
// What this machine offers: free memory of each visible GPU, then the RAM
// available to this process (MemAvailable, capped by the cgroup limit).
absl::StatusOr<MaxMemory> ProbeMaxMemory();
// RAM available to this process, as ProbeMaxMemory() counts it: the
// machine's MemAvailable, capped by what its memory cgroup (v2, or v1 with
// its ancestors) leaves, the cgroup's page cache counted as room.
absl::StatusOr<int64_t> AvailableHostMemory();
// All the RAM this process could have: MemTotal, or its memory cgroup's
// limit when smaller.
absl::StatusOr<int64_t> TotalHostMemory();
// Whether this process's memory cgroup limits it below the machine's
// MemTotal (so the limit, not the machine, is what reclaim works against).
bool HostMemoryLimitedByCgroup();

// Placement of each module or tensor, in planning order.
class DeviceMap {
 public:
  void Set(const std::string& name, Placement placement);  // keeps the first position
  const std::vector<std::pair<std::string, Placement>>& entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }
  // The placement of the longest key that is `name` or a dot-prefix of it
  // ("" covers everything); nullopt when none.
  std::optional<Placement> Lookup(absl::string_view name) const;
  // {"name": 0 | "cpu" | "disk", ...}
  std::string ToJson() const;
  // InvalidArgument naming `label` and the key for anything else.
  static absl::StatusOr<DeviceMap> FromJson(absl::string_view text, absl::string_view label);

  friend bool operator==(const DeviceMap& a, const DeviceMap& b) {
    return a.entries_ == b.entries_;
  }

 private:
  std::vector<std::pair<std::string, Placement>> entries_;
  std::unordered_map<std::string, size_t> index_;
};

// The sizes of every layer (as GetMaxLayerSize counts them) inside the
// entries of `map` placed on `where`, largest first: an offload reader that
// works a few modules ahead holds at most the first few of these.
std::vector<double> LayerSizesOn(const ModuleTree& tree, const ModuleSizes& sizes,
                                 const std::vector<std::string>& no_split, const DeviceMap& map,
                                 const Placement& where);

// Regroups entries that share a device under their parent (recursively),
// as Accelerate's clean_device_map: a whole model on one device is {"": d}.
DeviceMap CleanDeviceMap(const DeviceMap& map);

// InvalidArgument listing every state-dict tensor no key covers. Keys that
// are neither "" nor a module or tensor of the tree go into `unknown`.
absl::Status CheckDeviceMap(const ModuleTree& tree, const DeviceMap& map,
                            std::vector<std::string>* unknown = nullptr);

struct PlanOptions {
  std::vector<std::string> no_split;  // module classes never split over devices
  SizeOptions sizes;
  bool offload_buffers = false;  // buffers of offloaded modules go with them
  bool fallback_allocation = false;
  bool clean_result = true;
  // Expert-granular placement: the ModuleLists of mixture-of-experts blocks
  // ("model.layers.3.block_sparse_moe.experts") whose experts are placed one
  // by one. Everything else is planned first, as if the experts weighed
  // nothing; the experts then fill, in order, the room that leaves on each
  // device (sequentially from the device the rest ended on), and when any
  // of them lands past the execution device (the first GPU, else the cpu),
  // `expert_cache_bytes` of that device's budget is kept free for the expert
  // cache. Empty: Accelerate's plan.
  std::vector<std::string> expert_lists;
  double expert_cache_bytes = 0;
};

// What planning noticed that a user should hear about.
struct PlanReport {
  // Devices that got nothing, with the least memory that would have taken
  // the first module tried there (Accelerate's "insufficient memory" log).
  std::vector<std::pair<Placement, double>> min_required;
  // Bytes used per device (including the reserve charged on leaving it).
  std::vector<std::pair<Placement, double>> used;
  std::vector<std::string> warnings;
  // With expert lists: the bytes kept for the expert cache on the execution
  // device (0 when every expert fits there).
  double expert_cache_bytes = 0;
};

// infer_auto_device_map: fills devices in order (GPUs, cpu, then disk, which
// is always last and unlimited), splitting modules that do not fit, keeping
// tied parameters together, reserving room for the largest remaining layer
// on the first GPU and the cpu.
absl::StatusOr<DeviceMap> InferAutoDeviceMap(const ModuleTree& tree, const MaxMemory& max_memory,
                                             const PlanOptions& options,
                                             PlanReport* report = nullptr);

// get_balanced_memory: caps every GPU but the last so the model spreads
// evenly. `max_memory_was_probed` applies Accelerate's x0.9 on a single GPU.
MaxMemory GetBalancedMemory(const ModuleTree& tree, const MaxMemory& max_memory,
                            const PlanOptions& options, bool low_zero, bool max_memory_was_probed);

// "auto" (= "balanced"), "balanced", "balanced_low_0", "sequential".
// InvalidArgument for another strategy.
absl::StatusOr<DeviceMap> PlanDeviceMap(const ModuleTree& tree, absl::string_view strategy,
                                        const MaxMemory& max_memory, const PlanOptions& options,
                                        bool max_memory_was_probed = false,
                                        PlanReport* report = nullptr);

}  // namespace accel::dispatch

#endif  // ACCEL_DISPATCH_DEVICE_MAP_H_
