// Accelerate's device-map planning (../shared/reference/accelerate-big-model.md
// section 1), step for step. Comments name the upstream step they mirror.
#include "dispatch/device_map.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

#include "core/bytes.h"
#include "core/json.h"
#include "core/status.h"
#include "dispatch/internal/gpu_probe.h"
#include "dispatch/internal/host_memory.h"

namespace accel::dispatch {
namespace {

std::string Join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

// One entry of the planning queue: a module (node >= 0) or a tensor.
struct Entry {
  std::string name;
  int node = -1;
};

class Planner {
 public:
  Planner(const ModuleTree& tree, const ModuleSizes& sizes,
          const std::vector<std::string>& no_split)
      : tree_(tree),
        sizes_(sizes),
        no_split_(no_split.begin(), no_split.end()),
        memo_(tree.size()) {}

  bool Splittable(int node) const {
    return node >= 0 && !tree_.node(node).children.empty() &&
           no_split_.count(tree_.node(node).class_name) == 0;
  }

  // A module's direct parameters, its children, then its direct buffers.
  // (Accelerate drops the buffers when it splits a module, so they end up
  // with no device; keeping them is the fix.)
  std::vector<Entry> Expand(const std::string& name, int node) const {
    const ModuleTree::Node& n = tree_.node(node);
    std::vector<Entry> out;
    for (const TensorDecl& p : n.params) out.push_back({Join(name, p.name), -1});
    for (const auto& [child, id] : n.children) out.push_back({Join(name, child), id});
    for (const TensorDecl& b : n.buffers) out.push_back({Join(name, b.name), -1});
    return out;
  }

  // get_max_layer_size over `entries` (tensor entries only when asked).
  template <typename Container>
  LayerSize MaxOver(const Container& entries, bool include_tensors) {
    LayerSize best;
    for (const Entry& e : entries) {
      if (e.node < 0) {
        if (include_tensors) Combine(best, sizes_.at(e.name), {e.name});
      } else {
        const LayerSize& part = Max(e.name, e.node);
        Combine(best, part.bytes, part.names);
      }
    }
    return best;
  }

 private:
  // The running rule of get_max_layer_size: a larger layer replaces the
  // list, an equal one joins it (zero-size layers too, while best is 0).
  static void Combine(LayerSize& best, double bytes, const std::vector<std::string>& names) {
    if (bytes > best.bytes) {
      best.bytes = bytes;
      best.names = names;
    } else if (bytes == best.bytes) {
      best.names.insert(best.names.end(), names.begin(), names.end());
    }
  }

  // Only children are looked at when a module is split, never its direct
  // tensors; the answer for a node never changes, so it is computed once.
  const LayerSize& Max(const std::string& name, int node) {
    if (!memo_[node]) {
      LayerSize best;
      if (!Splittable(node)) {
        best.bytes = sizes_.at(name);
        best.names = {name};
      } else {
        for (const auto& [child, id] : tree_.node(node).children) {
          const LayerSize& part = Max(Join(name, child), id);
          Combine(best, part.bytes, part.names);
        }
      }
      memo_[node] = std::move(best);
    }
    return *memo_[node];
  }

 public:
  // Every layer of `name` (node `node`), as Max counts them, appended to `out`.
  void Layers(const std::string& name, int node, std::vector<double>* out) const {
    if (!Splittable(node)) {
      out->push_back(sizes_.at(name));
      return;
    }
    for (const Entry& e : Expand(name, node)) {
      if (e.node < 0) {
        out->push_back(sizes_.at(e.name));
      } else {
        Layers(e.name, e.node, out);
      }
    }
  }

 private:
  const ModuleTree& tree_;
  const ModuleSizes& sizes_;
  std::set<std::string> no_split_;
  std::vector<std::optional<LayerSize>> memo_;
};

// Tied parameters that live outside `name`. Upstream tests containment as a
// substring ("0." is found in "10.weight."), and so do we, for identical maps.
std::vector<std::string> ExternalTies(const std::string& name,
                                      const std::vector<std::vector<std::string>>& tied) {
  std::vector<std::string> out;
  const std::string needle = name + ".";
  for (const auto& group : tied) {
    bool any = false, all = true;
    for (const std::string& k : group) {
      bool inside = absl::StrContains(k + ".", needle);
      any |= inside;
      all &= inside;
    }
    if (!any || all) continue;
    for (const std::string& p : group) {
      if (!absl::StrContains(p + ".", needle)) out.push_back(p);
    }
  }
  return out;
}

struct WithTies {
  double bytes = 0;
  std::vector<Entry> modules;  // the queue entries holding each external tie
};

// get_module_size_with_ties. A tie whose holder is no longer queued was
// placed already; upstream would raise IndexError, we skip it.
template <typename Container>
WithTies SizeWithTies(const std::vector<std::string>& ties, double bytes, const ModuleSizes& sizes,
                      const Container& queue) {
  WithTies out{bytes, {}};
  for (const std::string& p : ties) {
    for (const Entry& e : queue) {
      if (absl::StartsWith(p, e.name + ".")) {
        out.modules.push_back(e);
        out.bytes += sizes.at(e.name) - sizes.at(p);
        break;
      }
    }
  }
  return out;
}

std::string FormatSize(double bytes) {
  return bytes == std::floor(bytes) ? absl::StrCat(static_cast<int64_t>(bytes))
                                    : absl::StrCat(bytes);
}

double& At(std::vector<std::pair<Placement, double>>& list, Placement p) {
  for (auto& [q, v] : list) {
    if (q == p) return v;
  }
  list.emplace_back(p, 0.0);
  return list.back().second;
}

}  // namespace

// ---- sizes -----------------------------------------------------------------

double DTypeByteSize(c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::Bool) return 0.125;
  return static_cast<double>(c10::elementSize(dtype));
}

double ModuleSizes::at(absl::string_view name) const {
  auto it = bytes_.find(name);
  return it == bytes_.end() ? 0.0 : it->second;
}

void ModuleSizes::Add(absl::string_view name, double bytes) {
  auto it = bytes_.find(name);
  if (it != bytes_.end()) {
    it->second += bytes;
    return;
  }
  bytes_.emplace(std::string(name), bytes);
  order_.emplace_back(name);
}

ModuleSizes ComputeModuleSizes(const ModuleTree& tree, const SizeOptions& options,
                               bool buffers_only) {
  std::vector<ModuleTree::Named> tensors = tree.NamedBuffers();
  if (!buffers_only) {
    std::vector<ModuleTree::Named> params = tree.NamedParameters();
    params.insert(params.end(), tensors.begin(), tensors.end());
    tensors = std::move(params);
  }
  ModuleSizes sizes;
  for (const ModuleTree::Named& t : tensors) {
    const double numel = static_cast<double>(t.decl->numel());
    double bytes;
    if (auto special = options.special_bytes.find(t.name); special != options.special_bytes.end()) {
      bytes = numel * special->second;
    } else if (!options.dtype || !c10::isFloatingType(t.decl->dtype)) {
      bytes = numel * DTypeByteSize(t.decl->dtype);
    } else {
      bytes = numel * std::min(DTypeByteSize(*options.dtype), DTypeByteSize(t.decl->dtype));
    }
    // Every prefix, from "" to the name itself.
    const absl::string_view name = t.name;
    sizes.Add("", bytes);
    for (size_t dot = name.find('.'); dot != absl::string_view::npos;
         dot = name.find('.', dot + 1)) {
      sizes.Add(name.substr(0, dot), bytes);
    }
    sizes.Add(name, bytes);
  }
  return sizes;
}

LayerSize GetMaxLayerSize(const ModuleTree& tree, const ModuleSizes& sizes,
                          const std::vector<std::string>& no_split) {
  Planner planner(tree, sizes, no_split);
  return planner.MaxOver(planner.Expand("", 0), /*include_tensors=*/true);
}

std::vector<double> LayerSizesOn(const ModuleTree& tree, const ModuleSizes& sizes,
                                 const std::vector<std::string>& no_split, const DeviceMap& map,
                                 const Placement& where) {
  const Planner planner(tree, sizes, no_split);
  std::vector<double> out;
  for (const auto& [name, placement] : map.entries()) {
    if (!(placement == where)) continue;
    if (absl::StatusOr<int> node = tree.FindModule(name); node.ok()) {
      planner.Layers(name, *node, &out);
    } else {  // a bare tensor
      out.push_back(sizes.at(name));
    }
  }
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}

// ---- max_memory ------------------------------------------------------------

absl::StatusOr<MaxMemory> ParseMaxMemory(absl::string_view spec) {
  std::map<Placement, double> budgets;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (!absl::StrContains(item, '=')) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_memory entry '", item, "' is not DEVICE=SIZE (e.g. 0=10GiB or cpu=30GiB)"));
    }
    auto device = Placement::Parse(kv.first);
    if (!device.ok())
      return Annotate(device.status(), absl::StrCat("max_memory entry '", item, "'"));
    auto bytes = ParseByteSize(kv.second);
    if (!bytes.ok()) return Annotate(bytes.status(), absl::StrCat("max_memory entry '", item, "'"));
    if (!budgets.emplace(*device, static_cast<double>(*bytes)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("max_memory names ", device->ToString(), " twice"));
    }
  }
  if (budgets.empty()) return absl::InvalidArgumentError("max_memory is empty");
  return MaxMemory(budgets.begin(), budgets.end());  // std::map order = Accelerate's order
}

absl::StatusOr<int64_t> AvailableHostMemory() {
  std::optional<int64_t> available = internal::MemAvailable();
  if (!available) return absl::UnavailableError("/proc/meminfo has no MemAvailable");
  // A container's limit (the process's own memory cgroup, v2 or v1), with
  // its reclaimable page cache counted as room.
  if (std::optional<internal::CgroupMemory> cgroup = internal::SelfCgroupMemory()) {
    available = std::min(*available, cgroup->available());
  }
  return *available;
}

absl::StatusOr<int64_t> TotalHostMemory() {
  std::optional<int64_t> total = internal::MemTotal();
  if (!total) return absl::UnavailableError("/proc/meminfo has no MemTotal");
  if (std::optional<internal::CgroupMemory> cgroup = internal::SelfCgroupMemory()) {
    total = std::min(*total, cgroup->limit);
  }
  return *total;
}

bool HostMemoryLimitedByCgroup() {
  const std::optional<int64_t> total = internal::MemTotal();
  const std::optional<internal::CgroupMemory> cgroup = internal::SelfCgroupMemory();
  return total && cgroup && cgroup->limit < *total;
}

absl::StatusOr<MaxMemory> ProbeMaxMemory() {
  MaxMemory mm;
  for (const auto& [index, free] : internal::ProbeGpuFreeMemory()) {
    mm.emplace_back(Placement::Cuda(index), static_cast<double>(free));
  }
  ACCEL_ASSIGN_OR_RETURN(int64_t host, AvailableHostMemory());
  mm.emplace_back(Placement::Cpu(), static_cast<double>(host));
  return mm;
}

// ---- device maps -------------------------------------------------------------

void DeviceMap::Set(const std::string& name, Placement placement) {
  auto it = index_.find(name);
  if (it != index_.end()) {
    entries_[it->second].second = placement;
    return;
  }
  index_.emplace(name, entries_.size());
  entries_.emplace_back(name, placement);
}

std::optional<Placement> DeviceMap::Lookup(absl::string_view name) const {
  std::string key(name);
  while (true) {
    if (auto it = index_.find(key); it != index_.end()) return entries_[it->second].second;
    if (key.empty()) return std::nullopt;
    auto dot = key.rfind('.');
    key = dot == std::string::npos ? "" : key.substr(0, dot);
  }
}

std::string DeviceMap::ToJson() const {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [name, p] : entries_) {
    if (p.is_cuda()) {
      j[name] = p.index();
    } else {
      j[name] = p.ToString();
    }
  }
  return j.dump();
}

absl::StatusOr<DeviceMap> DeviceMap::FromJson(absl::string_view text, absl::string_view label) {
  // A device map is one flat object, in the order it lists modules.
  JsonLimits limits;
  limits.max_depth = 4;
  ACCEL_ASSIGN_OR_RETURN(nlohmann::ordered_json j, ParseOrderedJson(text, label, limits));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": expected {\"module.name\": 0 | \"cpu\" | \"disk\"}"));
  }
  DeviceMap map;
  for (const auto& [name, value] : j.items()) {
    absl::StatusOr<Placement> p = absl::InvalidArgumentError("not a device");
    if (value.is_number_integer() && value.get<int64_t>() >= 0 &&
        value.get<int64_t>() < (1 << 20)) {
      p = Placement::Cuda(value.get<int>());
    } else if (value.is_string()) {
      p = Placement::Parse(value.get<std::string>());
    }
    if (!p.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": '", name, "': ", value.dump(),
                       " is not a device (a GPU index, \"cpu\" or \"disk\")"));
    }
    map.Set(name, *p);
  }
  return map;
}

namespace {

struct Trie {
  std::optional<Placement> value;
  std::map<std::string, std::unique_ptr<Trie>> children;  // sorted: deterministic
  size_t first_position = 0;                              // of any key in this subtree
};

void Collect(const Trie& t, std::vector<Placement>& out, size_t& count) {
  for (const auto& [name, child] : t.children) {
    if (child->value) {
      out.push_back(*child->value);
      ++count;
    }
    Collect(*child, out, count);
  }
}

void Emit(const Trie& t, const std::string& name,
          std::vector<std::tuple<size_t, std::string, Placement>>& out) {
  if (t.value) out.emplace_back(t.first_position, name, *t.value);
  for (const auto& [child_name, child] : t.children) Emit(*child, Join(name, child_name), out);
}

// clean_device_map: if every key below `t` has one device and there are at
// least two, they are replaced by `t` itself; otherwise recurse. Upstream
// counts the key "" itself among the keys below the root, and only there.
void Clean(Trie& t, bool is_root) {
  std::vector<Placement> below;
  size_t count = 0;
  if (is_root && t.value) {
    below.push_back(*t.value);
    ++count;
  }
  Collect(t, below, count);
  bool one_device =
      !below.empty() &&
      std::all_of(below.begin(), below.end(), [&](const Placement& p) { return p == below[0]; });
  if (one_device && count > 1) {
    t.value = below[0];
    t.children.clear();
    return;
  }
  for (auto& [name, child] : t.children) Clean(*child, false);
}

}  // namespace

DeviceMap CleanDeviceMap(const DeviceMap& map) {
  Trie root;
  root.first_position = std::numeric_limits<size_t>::max();
  for (size_t i = 0; i < map.entries().size(); ++i) {
    const auto& [name, p] = map.entries()[i];
    Trie* t = &root;
    root.first_position = std::min(root.first_position, i);
    if (!name.empty()) {
      for (absl::string_view part : absl::StrSplit(name, '.')) {
        auto& child = t->children[std::string(part)];
        if (!child) {
          child = std::make_unique<Trie>();
          child->first_position = i;
        }
        t = child.get();
      }
    }
    t->value = p;
  }
  Clean(root, /*is_root=*/true);
  std::vector<std::tuple<size_t, std::string, Placement>> flat;
  Emit(root, "", flat);
  std::stable_sort(flat.begin(), flat.end(),
                   [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  DeviceMap out;
  for (const auto& [pos, name, p] : flat) out.Set(name, p);
  return out;
}

absl::Status CheckDeviceMap(const ModuleTree& tree, const DeviceMap& map,
                            std::vector<std::string>* unknown) {
  if (unknown != nullptr) {
    std::set<std::string> known;
    for (const auto& [name, node] : tree.NamedModules()) known.insert(name);
    for (const std::string& key : tree.StateDictKeys()) known.insert(key);
    for (const auto& [name, p] : map.entries()) {
      if (!known.count(name)) unknown->push_back(name);
    }
  }
  std::vector<std::string> missing;
  for (const std::string& key : tree.StateDictKeys()) {
    if (!map.Lookup(key)) missing.push_back(key);
  }
  if (missing.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("the device map does not place these tensors: ", absl::StrJoin(missing, ", ")));
}

// ---- infer_auto_device_map ---------------------------------------------------

namespace {

absl::StatusOr<DeviceMap> Infer(const ModuleTree& tree, const ModuleSizes& sizes,
                                const MaxMemory& max_memory, const PlanOptions& options,
                                PlanReport* report);
MaxMemory Balance(const ModuleTree& tree, const ModuleSizes& sizes, const MaxMemory& max_memory,
                  const PlanOptions& options, bool low_zero, bool max_memory_was_probed);

}  // namespace

absl::StatusOr<DeviceMap> InferAutoDeviceMap(const ModuleTree& tree, const MaxMemory& max_memory,
                                             const PlanOptions& options, PlanReport* report) {
  return Infer(tree, ComputeModuleSizes(tree, options.sizes), max_memory, options, report);
}

MaxMemory GetBalancedMemory(const ModuleTree& tree, const MaxMemory& max_memory,
                            const PlanOptions& options, bool low_zero, bool max_memory_was_probed) {
  return Balance(tree, ComputeModuleSizes(tree, options.sizes), max_memory, options, low_zero,
                 max_memory_was_probed);
}

namespace {

absl::StatusOr<DeviceMap> Infer(const ModuleTree& tree, const ModuleSizes& sizes,
                                const MaxMemory& max_memory, const PlanOptions& options,
                                PlanReport* report) {
  std::vector<Placement> devices;
  std::map<Placement, double> budget;
  for (const auto& [p, bytes] : max_memory) {
    devices.push_back(p);
    budget[p] = bytes;
  }
  if (!budget.count(Placement::Disk()))
    devices.push_back(Placement::Disk());  // always last, unlimited
  std::vector<Placement> gpus;
  for (const Placement& p : devices) {
    if (p.is_cuda()) gpus.push_back(p);
  }
  std::set<Placement> main = {Placement::Cpu()};
  if (!gpus.empty()) main.insert(gpus[0]);

  const ModuleSizes buffer_sizes = ComputeModuleSizes(tree, options.sizes, /*buffers_only=*/true);
  const std::vector<std::vector<std::string>> tied = tree.TiedParameters();
  Planner planner(tree, sizes, options.no_split);

  std::deque<Entry> queue;
  for (Entry& e : planner.Expand("", 0)) queue.push_back(std::move(e));
  DeviceMap dmap;
  size_t current = 0;
  std::vector<std::pair<Placement, double>> used, buffers, min_required;

  LayerSize max_layer = planner.MaxOver(queue, /*include_tensors=*/true);
  std::set<std::string> max_names(max_layer.names.begin(), max_layer.names.end());
  auto recompute_max = [&] {
    max_layer = planner.MaxOver(queue, /*include_tensors=*/false);
    max_names = std::set<std::string>(max_layer.names.begin(), max_layer.names.end());
  };
  auto index_of = [&](const std::string& name) -> std::optional<size_t> {
    for (size_t i = 0; i < queue.size(); ++i) {
      if (queue[i].name == name) return i;
    }
    return std::nullopt;
  };

  while (!queue.empty()) {
    Entry entry = queue.front();
    queue.pop_front();
    // The entry and everything below it leave the "largest layer" list.
    max_names.erase(entry.name);
    const std::string below = entry.name + ".";
    max_names.erase(max_names.lower_bound(below), max_names.lower_bound(entry.name + "/"));
    if (max_names.empty()) recompute_max();

    const double module_bytes = sizes.at(entry.name);
    const std::vector<std::string> ties = ExternalTies(entry.name, tied);
    if (current >= devices.size())
      return absl::InternalError("device map planning ran past the disk");
    const Placement device = devices[current];
    double capacity = device.is_disk() ? std::numeric_limits<double>::infinity() : budget[device];
    double reserve = 0;
    if (main.count(device)) {
      capacity -= max_layer.bytes;
      reserve = max_layer.bytes;
    }
    WithTies with_ties = SizeWithTies(ties, module_bytes, sizes, queue);
    double& device_used = At(used, device);

    // (A) It fits, with the modules it is tied to.
    if (device_used + with_ties.bytes <= capacity) {
      device_used += with_ties.bytes;
      dmap.Set(entry.name, device);
      for (const Entry& tied_module : with_ties.modules) {
        if (auto i = index_of(tied_module.name))
          queue.erase(queue.begin() + static_cast<std::ptrdiff_t>(*i));
        dmap.Set(tied_module.name, device);
      }
      if (!options.offload_buffers && entry.node >= 0)
        At(buffers, device) += buffer_sizes.at(entry.name);
      continue;
    }

    // (B) It fits alone but not with its ties: split the first tied module that can be split.
    if (!ties.empty() && device_used + module_bytes <= capacity) {
      bool split = false;
      for (const Entry& tied_module : with_ties.modules) {
        if (!planner.Splittable(tied_module.node)) continue;
        std::vector<Entry> kids = planner.Expand(tied_module.name, tied_module.node);
        size_t i = *index_of(tied_module.name);
        std::deque<Entry> next;
        next.push_back(entry);
        next.insert(next.end(), queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(i));
        next.insert(next.end(), kids.begin(), kids.end());
        next.insert(next.end(), queue.begin() + static_cast<std::ptrdiff_t>(i) + 1, queue.end());
        queue = std::move(next);
        recompute_max();
        split = true;
        break;
      }
      if (split) continue;
    }

    // (C) It does not fit: split it, if it can be split.
    if (device_used + module_bytes >= capacity && planner.Splittable(entry.node)) {
      std::vector<Entry> kids = planner.Expand(entry.name, entry.node);
      queue.insert(queue.begin(), kids.begin(), kids.end());
      recompute_max();
      continue;
    }

    // (D) Opt-in: before leaving an empty device, look for anything later in
    // the queue that fits it (fallback_allocate).
    if (options.fallback_allocation && device_used == 0 && !device.is_disk()) {
      const double limit =
          budget[device] - std::max(max_layer.bytes, with_ties.bytes) - device_used;
      std::optional<Entry> found;
      if (limit >= 0) {
        std::deque<Entry> search = queue;
        while (!search.empty()) {
          Entry candidate = search.front();
          search.pop_front();
          WithTies w = SizeWithTies(ExternalTies(candidate.name, tied), sizes.at(candidate.name),
                                    sizes, search);
          if (w.bytes <= limit) {
            found = candidate;
            break;
          }
          if (!planner.Splittable(candidate.node)) continue;
          std::vector<Entry> kids = planner.Expand(candidate.name, candidate.node);
          search.insert(search.begin(), kids.begin(), kids.end());
        }
      }
      if (found) {
        // Expand the queue along the found entry's path, shortest prefix first.
        for (size_t dot = found->name.find('.'); dot != std::string::npos;
             dot = found->name.find('.', dot + 1)) {
          std::string prefix = found->name.substr(0, dot);
          if (auto i = index_of(prefix)) {
            Entry holder = queue[*i];
            std::vector<Entry> kids = planner.Expand(holder.name, holder.node);
            queue.erase(queue.begin() + static_cast<std::ptrdiff_t>(*i));
            queue.insert(queue.begin() + static_cast<std::ptrdiff_t>(*i), kids.begin(), kids.end());
          }
        }
        if (auto i = index_of(found->name))
          queue.erase(queue.begin() + static_cast<std::ptrdiff_t>(*i));
        queue.push_front(entry);
        queue.push_front(*found);
        continue;
      }
    }

    // (E) Move on to the next device; the reserve is charged on leaving.
    if (device_used == 0) min_required.emplace_back(device, with_ties.bytes + reserve);
    device_used += reserve;
    ++current;
    queue.push_front(entry);
  }

  if (options.clean_result) dmap = CleanDeviceMap(dmap);

  if (report != nullptr) {
    report->used.clear();
    for (const Placement& p : devices) {
      for (const auto& [q, u] : used) {
        if (q == p && u > 0) report->used.emplace_back(p, u);
      }
    }
    report->min_required = min_required;
    double offloaded_buffers = 0;
    for (const auto& [p, b] : buffers) {
      if (!p.is_cuda()) offloaded_buffers += b;
    }
    if (offloaded_buffers > 0 && !options.offload_buffers && !gpus.empty()) {
      bool room = false;
      for (const auto& [p, bytes] : max_memory) {
        double u = 0;
        for (const auto& [q, v] : used) {
          if (q == p) u = v;
        }
        if (p.is_cuda() && bytes >= offloaded_buffers + u) room = true;
      }
      if (!room) {
        report->warnings.push_back(absl::StrCat(
            "the buffers of offloaded modules need ", FormatSize(offloaded_buffers),
            " bytes on the execution GPU, and no GPU has that much left; pass offload_buffers to "
            "offload them with their modules"));
      }
    }
    for (const auto& [p, bytes] : min_required) {
      report->warnings.push_back(absl::StrCat("nothing could be placed on ", p.ToString(),
                                              ": the first module tried there needs at least ",
                                              FormatSize(bytes), " bytes"));
    }
  }
  return dmap;
}

// ---- get_balanced_memory -------------------------------------------------------

MaxMemory Balance(const ModuleTree& tree, const ModuleSizes& sizes, const MaxMemory& max_memory,
                  const PlanOptions& options, bool low_zero, bool max_memory_was_probed) {
  MaxMemory mm = max_memory;
  int gpus = 0;
  for (const auto& [p, bytes] : mm) {
    if (p.is_cuda() && bytes > 0) ++gpus;
  }
  if (gpus == 0) return mm;
  if (gpus == 1) {
    low_zero = false;
    if (max_memory_was_probed) {
      for (auto& [p, bytes] : mm) {
        if (p.is_cuda()) {
          bytes *= 0.9;
          break;
        }
      }
    }
  }
  double per_gpu = std::floor(sizes.total() / (low_zero ? gpus - 1 : gpus));

  // The first instance of each no-split class (upstream's rule: not the largest).
  double block = 0;
  if (!options.no_split.empty()) {
    std::map<std::string, int> node_of;
    for (const auto& [name, node] : tree.NamedModules()) node_of.emplace(name, node);
    std::set<std::string> wanted(options.no_split.begin(), options.no_split.end());
    std::set<std::string> recorded;
    for (const std::string& name : sizes.names()) {
      if (name.empty()) continue;
      auto it = node_of.find(name);
      if (it == node_of.end()) continue;  // a tensor
      const std::string& cls = tree.node(it->second).class_name;
      if (wanted.count(cls) && recorded.insert(cls).second) block = std::max(block, sizes.at(name));
      if (recorded.size() == wanted.size()) break;
    }
  }
  // Leaves of the size table are tensors; without them, the leaves are the
  // modules holding tensors directly: their mean size.
  auto leaves_of = [](const std::vector<std::string>& names) {
    std::set<std::string> with_child;
    for (const std::string& n : names) {
      if (n.empty()) continue;
      auto dot = n.rfind('.');
      with_child.insert(dot == std::string::npos ? "" : n.substr(0, dot));
    }
    std::vector<std::string> leaves;
    for (const std::string& n : names) {
      if (!n.empty() && !with_child.count(n)) leaves.push_back(n);
    }
    return leaves;
  };
  std::vector<std::string> tensors = leaves_of(sizes.names());
  std::set<std::string> tensor_set(tensors.begin(), tensors.end());
  std::vector<std::string> modules;
  for (const std::string& n : sizes.names()) {
    if (!tensor_set.count(n)) modules.push_back(n);
  }
  std::vector<std::string> final_modules = leaves_of(modules);
  double sum = 0;
  for (const std::string& n : final_modules) sum += sizes.at(n);
  const double mean = std::trunc(sum / std::max(static_cast<double>(final_modules.size()), 1.0));
  per_gpu += std::trunc(1.25 * std::max(block, mean));

  std::vector<size_t> ids;
  for (size_t i = 0; i < mm.size(); ++i) {
    if (mm[i].first.is_cuda() && mm[i].second > 0) ids.push_back(i);
  }
  // Every GPU but the last is capped; the last keeps its full budget.
  for (size_t k = 0; k + 1 < ids.size(); ++k) {
    double& bytes = mm[ids[k]].second;
    const bool first_low = low_zero && mm[ids[k]].first.index() == 0;
    bytes = std::min(first_low ? bytes : per_gpu, bytes);
  }
  if (low_zero) {
    double others = 0;
    for (size_t k : ids) {
      if (mm[k].first.index() != 0) others += mm[k].second;
    }
    for (auto& [p, bytes] : mm) {
      if (p == Placement::Cuda(0)) bytes = std::min(std::max(0.0, sizes.total() - others), bytes);
    }
  }
  return mm;
}

}  // namespace

namespace {

bool IsBelow(absl::string_view name, absl::string_view prefix) {
  return name == prefix || (name.size() > prefix.size() && name[prefix.size()] == '.' &&
                            absl::StartsWith(name, prefix));
}

// Replaces each key of `map` that holds an expert list (strictly above it)
// by the key's children and direct tensors on the same device, down to the
// lists, which are left out: their experts are placed one by one after.
DeviceMap SplitAroundExpertLists(const ModuleTree& tree, const DeviceMap& map,
                                 const std::vector<std::string>& lists) {
  const auto holds_list = [&](const std::string& name) {
    for (const std::string& l : lists) {
      if (name != l && IsBelow(l, name)) return true;
    }
    return false;
  };
  const auto is_list = [&](const std::string& name) {
    return std::find(lists.begin(), lists.end(), name) != lists.end();
  };
  DeviceMap out;
  std::function<void(const std::string&, Placement)> expand = [&](const std::string& name,
                                                                  Placement p) {
    if (is_list(name)) return;
    if (!holds_list(name)) {
      out.Set(name, p);
      return;
    }
    absl::StatusOr<int> node = tree.FindModule(name);
    if (!node.ok()) return;
    const ModuleTree::Node& n = tree.node(*node);
    for (const TensorDecl& t : n.params) out.Set(Join(name, t.name), p);
    for (const TensorDecl& t : n.buffers) out.Set(Join(name, t.name), p);
    for (const auto& [child, id] : n.children) expand(Join(name, child), p);
  };
  for (const auto& [name, p] : map.entries()) {
    if (holds_list(name) || is_list(name)) {
      expand(name, p);
    } else {
      out.Set(name, p);
    }
  }
  return out;
}

// The expert phase of PlanDeviceMap (see PlanOptions::expert_lists).
absl::StatusOr<DeviceMap> PlanWithExperts(const ModuleTree& tree, const MaxMemory& mm,
                                          const PlanOptions& options, PlanReport* report) {
  // The experts, in order, with their sizes.
  const ModuleSizes sizes = ComputeModuleSizes(tree, options.sizes);
  std::vector<std::pair<std::string, double>> experts;
  for (const std::string& list : options.expert_lists) {
    ACCEL_ASSIGN_OR_RETURN(int node, tree.FindModule(list));
    for (const auto& [child, id] : tree.node(node).children) {
      const std::string name = Join(list, child);
      experts.emplace_back(name, sizes.at(name));
    }
  }
  // Everything else, with the experts weighing nothing.
  PlanOptions dense = options;
  dense.expert_lists.clear();
  dense.clean_result = false;
  for (const ModuleTree::Named& t : tree.NamedParameters()) {
    for (const std::string& list : options.expert_lists) {
      if (IsBelow(t.name, list)) dense.sizes.special_bytes[t.name] = 0;
    }
  }
  for (const ModuleTree::Named& t : tree.NamedBuffers()) {
    for (const std::string& list : options.expert_lists) {
      if (IsBelow(t.name, list)) dense.sizes.special_bytes[t.name] = 0;
    }
  }
  PlanReport dense_report;
  ACCEL_ASSIGN_OR_RETURN(DeviceMap dense_map, Infer(tree, ComputeModuleSizes(tree, dense.sizes), mm,
                                                    dense, &dense_report));
  DeviceMap map = SplitAroundExpertLists(tree, dense_map, options.expert_lists);

  std::vector<Placement> devices;
  std::map<Placement, double> budget;
  for (const auto& [p, bytes] : mm) {
    devices.push_back(p);
    budget[p] = bytes;
  }
  if (!budget.count(Placement::Disk())) devices.push_back(Placement::Disk());
  Placement execution = Placement::Cpu();
  for (const Placement& p : devices) {
    if (p.is_cuda()) {
      execution = p;
      break;
    }
  }
  std::map<Placement, double> used;
  for (const auto& [p, bytes] : dense_report.used) used[p] = bytes;
  // Experts start on the last device the rest reached.
  size_t first = 0;
  for (size_t i = 0; i < devices.size(); ++i) {
    if (used[devices[i]] > 0) first = i;
  }
  // Placed without a cache reserve first; if an expert lands past the
  // execution device, again with the reserve.
  const auto place = [&](double reserve, std::vector<std::pair<std::string, Placement>>& placed,
                         std::map<Placement, double>& fill) {
    fill = used;
    size_t current = first;
    bool spilled = false;
    for (const auto& [name, bytes] : experts) {
      while (true) {
        const Placement d = devices[current];
        double capacity = d.is_disk() ? std::numeric_limits<double>::infinity() : budget[d];
        if (d == execution) capacity -= reserve;
        if (fill[d] + bytes <= capacity || current + 1 == devices.size()) {
          fill[d] += bytes;
          placed.emplace_back(name, d);
          if (d != execution && !(execution.is_cpu() && d.is_cuda())) spilled = true;
          break;
        }
        ++current;
      }
    }
    return spilled;
  };
  std::vector<std::pair<std::string, Placement>> placed;
  std::map<Placement, double> fill;
  double reserve = 0;
  if (place(0, placed, fill)) {
    placed.clear();
    reserve = options.expert_cache_bytes;
    place(reserve, placed, fill);
  }
  for (const auto& [name, p] : placed) map.Set(name, p);
  if (options.clean_result) map = CleanDeviceMap(map);
  if (report != nullptr) {
    *report = dense_report;
    report->used.clear();
    for (const Placement& p : devices) {
      const double u = fill[p] + (p == execution ? reserve : 0);
      if (u > 0) report->used.emplace_back(p, u);
    }
    report->expert_cache_bytes = reserve;
  }
  return map;
}

}  // namespace

absl::StatusOr<DeviceMap> PlanDeviceMap(const ModuleTree& tree, absl::string_view strategy,
                                        const MaxMemory& max_memory, const PlanOptions& options,
                                        bool max_memory_was_probed, PlanReport* report) {
  const ModuleSizes sizes = ComputeModuleSizes(tree, options.sizes);
  MaxMemory mm;
  if (strategy == "auto" || strategy == "balanced") {
    mm = Balance(tree, sizes, max_memory, options, /*low_zero=*/false, max_memory_was_probed);
  } else if (strategy == "balanced_low_0") {
    mm = Balance(tree, sizes, max_memory, options, /*low_zero=*/true, max_memory_was_probed);
  } else if (strategy == "sequential") {
    mm = max_memory;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown device map strategy '", strategy,
                     "' (auto, balanced, balanced_low_0, sequential)"));
  }
  if (!options.expert_lists.empty()) return PlanWithExperts(tree, mm, options, report);
  return Infer(tree, sizes, mm, options, report);
}

}  // namespace accel::dispatch
