#include "dispatch/dispatch.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <sys/mman.h>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <utility>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/bytes.h"
#include "core/dtype.h"
#include "core/json.h"
#include "core/status.h"
#include "core/thread_name.h"
#include "dispatch/empty_weights.h"
#include "dispatch/internal/device_stager.h"
#include "dispatch/internal/expert_cache.h"
#include "dispatch/internal/offloaded.h"
#include "loader/loader.h"

namespace accel::dispatch {
namespace {

// Unmaps the whole pages inside `t`'s bytes from this process (MADV_DONTNEED),
// for a tensor over a read-only file mapping that nothing uses any more: its
// resident memory falls, and a later read faults the page cache's copy in.
// Only pages entirely inside the tensor, so no neighbour is touched.
void DropResidentPages(const at::Tensor& t) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + page - 1) & ~(page - 1);
  const uintptr_t last = (begin + t.nbytes()) & ~(page - 1);
  if (last > first) (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

using internal::Offloaded;
using internal::Source;

// A group's data, ready to set into the model.
struct Fetched {
  std::vector<at::Tensor> values;   // in group order, shaped; on the GPU when staged
  std::vector<at::Tensor> buffers;  // pooled host buffers the values use until released
  int64_t mapped_bytes = 0;         // of the values, used in place from a mapping
};

bool Below(absl::string_view name, absl::string_view prefix) {
  return prefix.empty() || name == prefix ||
         (name.size() > prefix.size() && name[prefix.size()] == '.' &&
          absl::StartsWith(name, prefix));
}

// Accelerate's keep_in_fp32_modules test: the module name appears as a dotted part.
bool KeepInFp32(const std::string& name, const std::vector<std::string>& modules) {
  for (const std::string& m : modules) {
    if (name == m || absl::StrContains(name, m + ".")) return true;
  }
  return false;
}

at::Device DeviceOf(const Placement& p) {
  return p.is_cuda() ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(p.index()))
                     : at::Device(at::kCPU);
}

// Accelerate's index.json dtype names (numpy's, plus "bfloat16").
std::string IndexDType(at::ScalarType t) { return std::string(DTypeName(t)); }

}  // namespace

struct DispatchedModel::Impl {
  std::vector<Offloaded> tensors;
  // The model's own tensor of each entry of `tensors` (by identity), so that
  // bringing it in and releasing it needs no lookup by name: a lookup walks
  // every tensor of the model, which at a few thousand tensors cost more than
  // a decode step's compute when experts come and go one by one.
  std::vector<at::Tensor> targets;
  std::unordered_map<const c10::TensorImpl*, int>
      by_impl;                           // the model's tensor -> index in `tensors`
  std::vector<std::vector<int>> groups;  // tensor indexes per entered name
  std::vector<std::string> group_names;
  std::unordered_map<std::string, int> group_of;
  std::vector<at::Device> group_device;
  bool prefetch = true;
  bool direct = false;             // disk reads bypass the page cache
  bool page_cache_chosen = false;  // ChoosePageCacheGroups has run
  // With a GPU main device (null otherwise): host buffers are pinned, and
  // fetched groups are copied to the GPU on its copy stream, by the reader
  // thread when prefetched.
  std::unique_ptr<internal::DeviceStager> stager;

  // Expert lists whose experts are fetched one by one: list -> the cache
  // unit of each expert (-1: resident, nothing to fetch). After `tensors`,
  // which the cache reads, so it is destroyed first.
  std::map<std::string, std::vector<int>, std::less<>> expert_units;
  std::unique_ptr<internal::ExpertCache> experts;
  bool InFetchedExpertList(absl::string_view name) const {
    for (const auto& [list, units] : expert_units) {
      if (name.size() > list.size() && name[list.size()] == '.' && absl::StartsWith(name, list))
        return true;
    }
    return false;
  }

  // Execution order for prefetching.
  std::vector<std::string> order;
  bool order_given = false;
  bool order_complete = false;

  // The reader thread works through `wanted` (the next `depth` groups after
  // the running one), leaving each result in `ready` until it is entered.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<int> wanted;
  std::map<int, absl::StatusOr<Fetched>> ready;
  int depth = 2;
  int reading = -1;  // the group the reader is on
  bool stop = false;
  std::thread reader;
  // LoadOptions::populate_resident: reads the cpu-resident weights in after
  // Load has returned, so the model is ready once it is mapped.
  std::thread populator;
  std::atomic<bool> stop_populating{false};
  Stats stats;

  // Mapped disk sources (LoadOptions::map_disk): the byte spans of each
  // group in its files, and the released groups whose pages are still in
  // the process, oldest first, within `mapped_allowance` bytes (<0: all).
  using Span = internal::MappedSpan;
  std::vector<std::vector<Span>> group_spans;
  int64_t mapped_allowance = -1;
  std::deque<int> kept;
  int64_t kept_bytes = 0;
  // LoadOptions::page_cache_keep_bytes: the groups that run last in a pass
  // whose pages the page cache keeps between uses while their bytes fit
  // `page_cache_room` (<0: no choice made, the kernel's LRU decides); the
  // others are evicted from it when dropped from the process. Until the
  // order is known none is (the kernel's LRU decides).
  int64_t page_cache_room = -1;
  std::vector<bool> group_evicted;  // per group: dropped from the page cache too

  // Once the order is known and every module in it has been entered: the
  // last groups of a pass that fit `page_cache_room` stay in the page cache.
  // Why the last and not the first: after a pass's last disk read the disk
  // waits while the groups after it, the next pass's modules held in memory
  // and the first groups it runs compute (the reader works `depth` groups
  // ahead, no further). Groups kept at the end of the pass fill that wait
  // with memory-speed compute, and the reader reads the next pass's first
  // groups meanwhile. And a group read afresh every pass lands in pages the
  // last eviction freed, which on a VM that hands freed memory back to its
  // host (virtio-balloon free page reporting, as on the build machine) are
  // slow to touch first: Llama-3-70B NF4's lm_head (2 GiB, last) took 1.75 s
  // a token to multiply that way; kept, its pages stay (docs/BENCHMARKS.md).
  void ChoosePageCacheGroups() {  // under mu
    if (page_cache_room < 0 || page_cache_chosen || !order_complete) return;
    for (const std::string& key : order) {
      if (group_of.find(key) == group_of.end()) return;  // not entered yet
    }
    page_cache_chosen = true;
    int64_t kept_in_cache = 0;
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      const int g = group_of.at(*it);
      if (g < 0) continue;
      const int64_t bytes = SpanBytes(group_spans[g]);
      const bool cached = bytes == 0 || kept_in_cache + bytes <= page_cache_room;
      if (cached) kept_in_cache += bytes;
      group_evicted[g] = !cached;
    }
  }

  static int64_t SpanBytes(const std::vector<Span>& spans) {
    int64_t n = 0;
    for (const Span& sp : spans) n += static_cast<int64_t>(sp.bytes);
    return n;
  }

  // The spans of `members`' mapped sources, adjacent ones merged.
  std::vector<Span> MappedSpans(const std::vector<int>& members) const {
    std::vector<Span> spans;
    for (int m : members) {
      const Source& src = tensors[m].source;
      if (!src.mapping) continue;
      spans.push_back({src.mapping.get(), src.offset, src.nbytes});
    }
    return MergeSpans(std::move(spans));
  }

  // `group` is in use or about to be: its pages must not be dropped.
  void Unkeep(int group) {  // under mu
    auto it = std::find(kept.begin(), kept.end(), group);
    if (it == kept.end()) return;
    kept_bytes -= SpanBytes(group_spans[group]);
    kept.erase(it);
  }

  // `group` was released: its pages stay while the allowance holds them.
  void Keep(int group) {
    std::vector<std::pair<int, bool>> drop;  // group, evicted from the page cache too
    {
      std::lock_guard<std::mutex> lock(mu);
      if (group_spans[group].empty()) return;
      Unkeep(group);
      kept.push_back(group);
      kept_bytes += SpanBytes(group_spans[group]);
      while (mapped_allowance >= 0 && kept_bytes > mapped_allowance && !kept.empty()) {
        const int g = kept.front();
        kept.pop_front();
        kept_bytes -= SpanBytes(group_spans[g]);
        stats.bytes_dropped += SpanBytes(group_spans[g]);
        drop.emplace_back(g, group_evicted[g]);
      }
    }
    for (const auto& [g, evicted] : drop) {
      for (const Span& sp : group_spans[g]) {
        if (evicted) {
          sp.mapping->Evict(sp.offset, sp.bytes);
        } else {
          sp.mapping->Drop(sp.offset, sp.bytes);
        }
      }
    }
  }

  // Staging buffers for disk reads, reused across forwards.
  internal::BufferPool pool;
  // The host buffers whose data a group's tensors use while it is entered.
  std::unordered_map<int, std::vector<at::Tensor>> active;

  void GiveBack(std::vector<at::Tensor> buffers) {
    for (at::Tensor& b : buffers) pool.Give(std::move(b));
  }

  // `ahead`: by the reader, before the group is entered, so mapped pages
  // are made resident now rather than faulted in as the module runs.
  absl::StatusOr<Fetched> Fetch(int group, bool ahead) {
    // Enter() adds groups while the reader runs: read ours under the lock.
    std::vector<int> members;
    std::vector<Span> spans;
    bool to_device = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      members = groups[group];
      spans = group_spans[group];
      to_device = stager != nullptr && group_device[group] == stager->device();
      Unkeep(group);
    }
    if (ahead) {
      // All of the group asked for first: small spans are read at once, in
      // one request each; large ones by the faults of the huge-page-advised
      // mapping, 2 MiB at a time (FileMapping::WillNeed says why).
      for (const Span& sp : spans) sp.mapping->WillNeed(sp.offset, sp.bytes);
      for (const Span& sp : spans) sp.mapping->Populate(sp.offset, sp.bytes);
    }
    Fetched out;
    out.values.resize(members.size());
    std::vector<const Source*> disk;
    std::vector<std::string> names;
    std::vector<size_t> slot;
    for (size_t k = 0; k < members.size(); ++k) {
      const Offloaded& t = tensors[members[k]];
      if (t.source.host.defined()) {
        out.values[k] = t.source.host;
      } else if (t.source.mapping) {
        out.values[k] = internal::MappedView(t.source);  // Load checked the alignment
        out.mapped_bytes += static_cast<int64_t>(t.source.nbytes);
      } else {
        disk.push_back(&t.source);
        names.push_back(t.name);
        slot.push_back(k);
      }
    }
    int64_t bytes = 0;
    if (!disk.empty()) {
      ACCEL_ASSIGN_OR_RETURN(internal::ReadTensors got,
                             internal::ReadCoalesced(disk, names, direct, [&](uint64_t n) {
                               return pool.Take(n, stager != nullptr);
                             }));
      for (size_t k = 0; k < disk.size(); ++k) out.values[slot[k]] = std::move(got.values[k]);
      out.buffers = std::move(got.buffers);
      bytes = static_cast<int64_t>(got.bytes_read);
    }
    int64_t staged_bytes = 0;
    if (to_device) {
      absl::StatusOr<std::vector<at::Tensor>> staged = stager->Stage(out.values);
      if (staged.ok()) {
        out.values = *std::move(staged);  // drops the views: the buffers are free again
        GiveBack(std::exchange(out.buffers, {}));
        for (const at::Tensor& v : out.values) staged_bytes += static_cast<int64_t>(v.nbytes());
      } else if (!absl::IsResourceExhausted(staged.status())) {
        return staged.status();
      }
      // Out of GPU memory: ahead of time, two modules' weights are on the GPU
      // at once, where the planner reserved room for one. The host data is
      // copied in line when the module is entered, after the last one's
      // release; an error then is a real one.
    }
    std::lock_guard<std::mutex> lock(mu);
    stats.bytes_read += bytes;
    stats.bytes_to_device += staged_bytes;
    return out;
  }

  void ReaderLoop() {
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
      cv.wait(lock, [&] { return stop || !wanted.empty(); });
      if (stop) return;
      const int group = wanted.front();
      wanted.pop_front();
      if (ready.count(group)) continue;
      reading = group;
      lock.unlock();
      auto result = Fetch(group, /*ahead=*/true);
      lock.lock();
      reading = -1;
      ready.emplace(group, std::move(result));
      cv.notify_all();
    }
  }

  // The data of `group`: from the reader if it has (or is reading) it.
  absl::StatusOr<Fetched> Take(int group) {
    {
      // Wanted groups are the next ones, nearest first: ours is the reader's
      // next job, or its current one.
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] {
        return stop ||
               (reading != group && std::find(wanted.begin(), wanted.end(), group) == wanted.end());
      });
      auto it = ready.find(group);
      if (it != ready.end()) {
        auto result = std::move(it->second);
        ready.erase(it);
        stats.prefetch_hits++;
        return result;
      }
    }
    return Fetch(group, /*ahead=*/false);
  }

  // The reader works on `next` (the groups after the running one, in order)
  // from now on; what it read for groups no longer expected is let go.
  void Request(const std::vector<int>& next) {
    std::vector<at::Tensor> unused;
    std::vector<int> dropped;  // mapped in, never used: may be dropped again
    {
      std::lock_guard<std::mutex> lock(mu);
      wanted.clear();
      for (int g : next) {
        if (g != reading && !ready.count(g)) wanted.push_back(g);
      }
      for (auto it = ready.begin(); it != ready.end();) {
        if (std::find(next.begin(), next.end(), it->first) == next.end()) {
          if (it->second.ok()) {
            for (at::Tensor& b : it->second->buffers) unused.push_back(std::move(b));
          }
          dropped.push_back(it->first);
          it = ready.erase(it);
        } else {
          ++it;
        }
      }
      cv.notify_all();
    }
    GiveBack(std::move(unused));
    for (int g : dropped) Keep(g);
  }
};

DispatchedModel::DispatchedModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DispatchedModel::~DispatchedModel() {
  if (impl_ && impl_->populator.joinable()) {
    impl_->stop_populating = true;
    impl_->populator.join();
  }
  if (impl_ && impl_->reader.joinable()) {
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      impl_->stop = true;
    }
    impl_->cv.notify_all();
    impl_->reader.join();
  }
}

DispatchedModel::Scope::Scope(Scope&& other) noexcept
    : owner_(other.owner_), group_(std::exchange(other.group_, -1)), device_(other.device_) {}

DispatchedModel::Scope::~Scope() {
  if (owner_ != nullptr && group_ >= 0) owner_->Release(group_);
}

at::Device DispatchedModel::ExecutionDevice(absl::string_view name) const {
  std::optional<Placement> p = map_.Lookup(name);
  if (p && p->is_cuda()) return DeviceOf(*p);
  return main_;
}

DispatchedModel::Stats DispatchedModel::stats() const {
  Stats out;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    out = impl_->stats;
  }
  if (impl_->experts != nullptr) impl_->experts->AddStats(out);
  return out;
}

DispatchedModel::ExpertScope::ExpertScope(ExpertScope&& other) noexcept
    : owner_(other.owner_), units_(std::exchange(other.units_, {})) {}

DispatchedModel::ExpertScope::~ExpertScope() {
  if (owner_ != nullptr && !units_.empty()) owner_->ReleaseExperts(units_);
}

bool DispatchedModel::FetchesExpertsOf(absl::string_view list) const {
  return impl_->expert_units.find(list) != impl_->expert_units.end();
}

absl::StatusOr<DispatchedModel::ExpertScope> DispatchedModel::EnterExperts(
    absl::string_view list, absl::Span<const int64_t> experts) {
  Impl& im = *impl_;
  auto found = im.expert_units.find(list);
  if (found == im.expert_units.end()) return ExpertScope(this, {});
  const std::vector<int>& table = found->second;
  std::vector<int> units;
  for (int64_t e : experts) {
    if (e < 0 || e >= static_cast<int64_t>(table.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert ", e, " of '", list, "', which has ", table.size(), " experts"));
    }
    if (table[e] >= 0 && std::find(units.begin(), units.end(), table[e]) == units.end()) {
      units.push_back(table[e]);
    }
  }
  if (units.empty()) return ExpertScope(this, {});
  ACCEL_ASSIGN_OR_RETURN(std::vector<std::vector<at::Tensor>> values, im.experts->Acquire(units));
  for (size_t k = 0; k < units.size(); ++k) {
    const std::vector<int>& members = im.experts->members(units[k]);
    for (size_t m = 0; m < members.size(); ++m) {
      const Offloaded& t = im.tensors[members[m]];
      absl::Status set =
          SetTensorInPlace(im.targets[members[m]], t.name, main_, values[k][m], t.source.dtype);
      if (!set.ok()) {
        ReleaseExperts(units);
        return set;
      }
    }
  }
  return ExpertScope(this, std::move(units));
}

void DispatchedModel::ReleaseExperts(const std::vector<int>& units) {
  Impl& im = *impl_;
  if (im.stager != nullptr) (void)im.stager->Released();
  for (int unit : units) {
    for (int i : im.experts->members(unit)) {
      // Cannot fail: the tensor exists and meta needs no value.
      (void)SetTensorInPlace(im.targets[i], im.tensors[i].name, at::kMeta);
    }
  }
  im.experts->Release(units);
}

void DispatchedModel::PrefetchExperts(absl::string_view list, absl::Span<const int64_t> experts,
                                      bool needed) {
  Impl& im = *impl_;
  auto found = im.expert_units.find(list);
  if (found == im.expert_units.end() || (!needed && !im.prefetch)) return;
  std::vector<int> units;
  for (int64_t e : experts) {
    if (e >= 0 && e < static_cast<int64_t>(found->second.size()) && found->second[e] >= 0) {
      units.push_back(found->second[e]);
    }
  }
  im.experts->Prefetch(units, needed);
}

bool DispatchedModel::ExpertReady(absl::string_view list, int64_t expert) const {
  const Impl& im = *impl_;
  auto found = im.expert_units.find(list);
  if (found == im.expert_units.end()) return true;
  if (expert < 0 || expert >= static_cast<int64_t>(found->second.size())) return false;
  const int unit = found->second[expert];
  return unit < 0 || im.experts->Cached(unit);
}

void DispatchedModel::SetExecutionOrder(std::vector<std::string> names) {
  impl_->order = std::move(names);
  impl_->order_given = true;
  impl_->order_complete = true;
}

absl::StatusOr<DispatchedModel::Scope> DispatchedModel::Enter(absl::string_view name) {
  Impl& im = *impl_;
  const std::string key(name);
  auto it = im.group_of.find(key);
  int group;
  if (it != im.group_of.end()) {
    group = it->second;
  } else {
    // Every offloaded tensor held under `key`, by identity: a tied alias
    // brings in the tensor it shares, wherever that was offloaded.
    std::set<int> member_set;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      auto collect = [&](const auto& named) {
        for (const auto& item : named) {
          if (!Below(item.key(), key) || im.InFetchedExpertList(item.key())) continue;
          auto found = im.by_impl.find(item.value().unsafeGetTensorImpl());
          if (found != im.by_impl.end()) member_set.insert(found->second);
        }
      };
      collect(model_->named_parameters(true));
      collect(model_->named_buffers(true));
    }));
    std::vector<int> members(member_set.begin(), member_set.end());
    std::lock_guard<std::mutex> lock(im.mu);  // the reader reads these
    group = members.empty() ? -1 : static_cast<int>(im.groups.size());
    if (group >= 0) {
      im.group_spans.push_back(im.MappedSpans(members));
      // A model read whole every token that is larger than memory: under LRU
      // the page cache holds the last groups read and loses each before its
      // next use, so it serves nothing. The last groups of a pass that fit its
      // room stay there for good (ChoosePageCacheGroups, once the order is
      // known); the others leave it as they leave the process.
      // Until then nothing is evicted: the last groups of the first pass,
      // read last, are still cached when chosen, not read again.
      im.group_evicted.push_back(false);
      im.groups.push_back(std::move(members));
      im.group_names.push_back(key);
      im.group_device.push_back(ExecutionDevice(key));
    }
    im.group_of.emplace(key, group);
    im.ChoosePageCacheGroups();  // a given order: once its last module is entered
  }
  if (group < 0) return Scope(this, -1, ExecutionDevice(name));

  // Learn the order from the first pass: it ends when a module comes again.
  if (!im.order_complete) {
    if (std::find(im.order.begin(), im.order.end(), key) != im.order.end()) {
      im.order_complete = true;
      std::lock_guard<std::mutex> lock(im.mu);
      im.ChoosePageCacheGroups();
    } else {
      im.order.push_back(key);
    }
  }

  absl::StatusOr<Fetched> data = im.Take(group);
  if (!data.ok()) return data.status();
  {
    std::lock_guard<std::mutex> lock(im.mu);
    im.stats.fetches++;
    im.stats.bytes_mapped += data->mapped_bytes;
  }
  // Disk buffers return to the pool when the scope ends (host sources are
  // the weights themselves and are kept; staged groups hold no buffers).
  im.active[group] = std::move(data->buffers);
  const at::Device device = im.group_device[group];
  for (size_t k = 0; k < im.groups[group].size(); ++k) {
    const Offloaded& t = im.tensors[im.groups[group][k]];
    absl::Status set = SetTensorInPlace(im.targets[im.groups[group][k]], t.name, device,
                                        data->values[k], t.source.dtype);
    if (!set.ok()) {
      data->values.clear();
      Release(group);
      return set;
    }
  }
  data->values.clear();  // the module holds them now: its release frees them

  // Read the modules expected next (wrapping: the next forward starts over).
  if (im.prefetch && im.order_complete && !im.order.empty()) {
    auto pos = std::find(im.order.begin(), im.order.end(), key);
    if (pos != im.order.end()) {
      std::vector<int> next;
      const size_t at = static_cast<size_t>(pos - im.order.begin());
      for (size_t step = 1; step < im.order.size() && static_cast<int>(next.size()) < im.depth;
           ++step) {
        auto found = im.group_of.find(im.order[(at + step) % im.order.size()]);
        if (found == im.group_of.end() || found->second < 0 || found->second == group) continue;
        if (std::find(next.begin(), next.end(), found->second) == next.end())
          next.push_back(found->second);
      }
      im.Request(next);
    }
  }
  return Scope(this, group, device);
}

void DispatchedModel::Release(int group) {
  // Before the last reference goes: a later copy into the same GPU memory
  // waits for the kernels queued so far. Cannot fail once Load made the stager.
  if (impl_->stager != nullptr) (void)impl_->stager->Released();
  for (int i : impl_->groups[group]) {
    // Cannot fail: the tensor exists and meta needs no value.
    (void)SetTensorInPlace(impl_->targets[i], impl_->tensors[i].name, at::kMeta);
  }
  auto staged = impl_->active.find(group);
  if (staged != impl_->active.end()) {
    impl_->GiveBack(std::move(staged->second));
    impl_->active.erase(staged);
  }
  impl_->Keep(group);
}

absl::Status DispatchedModel::SetUpExpertCache(const LoadOptions& options) {
  Impl& im = *impl_;
  if (options.expert_lists.empty()) return absl::OkStatus();
  // The experts of each list: its children, in order.
  std::map<std::string, int64_t> counts;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    for (const auto& item : model_->named_modules("", /*include_self=*/false)) {
      for (const std::string& list : options.expert_lists) {
        if (item.key() == list)
          counts[list] = static_cast<int64_t>(item.value()->children().size());
      }
    }
  }));
  std::map<std::string, std::vector<std::vector<int>>> members;
  for (const std::string& list : options.expert_lists) {
    if (!counts.count(list)) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert list '", list, "': the model has no such module"));
    }
    members[list].resize(counts[list]);
  }
  bool any = false;
  for (size_t i = 0; i < im.tensors.size(); ++i) {
    const std::string& name = im.tensors[i].name;
    for (auto& [list, experts] : members) {
      if (name.size() <= list.size() + 1 || !absl::StartsWith(name, list + ".")) continue;
      const size_t dot = name.find('.', list.size() + 1);
      int64_t e = -1;
      if (dot != std::string::npos &&
          absl::SimpleAtoi(name.substr(list.size() + 1, dot - list.size() - 1), &e) && e >= 0 &&
          e < static_cast<int64_t>(experts.size())) {
        experts[e].push_back(static_cast<int>(i));
        any = true;
      }
    }
  }
  if (!any) return absl::OkStatus();  // every expert is resident
  internal::ExpertCache::Options cache;
  cache.budget_bytes = options.expert_cache_bytes;
  cache.stager = im.stager.get();
  cache.direct = options.direct_reads;
  cache.positions = static_cast<int>(options.expert_lists.size());
  // Mapped experts the cache evicts: kept in the page cache (a second level
  // the kernel reclaims first, which whole-machine runs gain from), or
  // dropped from it too (under a tight memory cgroup, where the kernel's
  // reclaim took the cache's own units; see LoadOptions).
  cache.release_pages = !options.keep_evicted_expert_pages;
  cache.keep_memory_free = !options.direct_reads;
  im.experts = std::make_unique<internal::ExpertCache>(im.tensors, cache);
  for (size_t position = 0; position < options.expert_lists.size(); ++position) {
    const std::string& list = options.expert_lists[position];
    bool offloaded = false;
    std::vector<int> units;
    for (std::vector<int>& m : members[list]) {
      if (m.empty()) {
        units.push_back(-1);
      } else {
        offloaded = true;
        units.push_back(im.experts->AddUnit(std::move(m), static_cast<int>(position)));
      }
    }
    if (offloaded) im.expert_units.emplace(list, std::move(units));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DispatchedModel>> DispatchedModel::Load(
    std::shared_ptr<torch::nn::Module> model, const std::string& checkpoint, const DeviceMap& map,
    const LoadOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("no model to load into");
  ACCEL_ASSIGN_OR_RETURN(loader::Checkpoint ckpt, loader::Checkpoint::Open(checkpoint));

  auto impl = std::make_unique<Impl>();
  impl->prefetch = options.prefetch;
  impl->depth = std::max(1, options.prefetch_depth);
  impl->mapped_allowance = options.mapped_resident_bytes;
  impl->page_cache_room = options.page_cache_keep_bytes;
  std::unique_ptr<DispatchedModel> out(new DispatchedModel(std::move(impl)));
  out->model_ = model;
  out->map_ = map;
  for (const auto& [name, p] : map.entries()) {
    if (p.is_cuda()) {
      out->main_ = DeviceOf(p);
      break;
    }
  }
  if (options.execution_device) {
    const at::Device& d = *options.execution_device;
    if (!d.is_cpu() && !d.is_cuda()) {
      return absl::InvalidArgumentError(
          absl::StrCat("execution device ", d.str(), ": expected the cpu or a CUDA device"));
    }
    if (d.is_cuda() && !at::hasCUDA()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "execution device ", d.str(), ": this build of libtorch has no CUDA (or sees no GPU)"));
    }
    out->main_ = d;
  }
  Impl& im = *out->impl_;
  im.direct = options.direct_reads;
  // Disk entries used in place: their files mapped once each.
  const bool map_disk = options.map_disk && !options.direct_reads && out->main_.is_cpu();
  // Every disk source's file is opened here, once, and held until the model
  // goes: reads never reopen a path, so a file replaced or deleted while
  // serving changes nothing (internal::OpenFile).
  std::map<std::string, std::shared_ptr<const internal::OpenFile>> files;
  std::map<std::string, std::shared_ptr<const internal::FileMapping>> mappings;
  const auto mapped = [&](Source source) -> absl::StatusOr<Source> {
    auto& file = files[source.path];
    if (!file) {
      ACCEL_ASSIGN_OR_RETURN(file, internal::OpenFile::Open(source.path, options.direct_reads));
    }
    source.file = file;
    if (!map_disk) return source;
    auto& mapping = mappings[source.path];
    if (!mapping) {
      ACCEL_ASSIGN_OR_RETURN(mapping, internal::FileMapping::Open(*file));
    }
    source.mapping = mapping;
    // Bytes unaligned for their type (another writer's layout) are read.
    if (!internal::MappedView(source).defined()) source.mapping.reset();
    return source;
  };

  // The model's tensors by name; a tied tensor appears under each of its names.
  std::map<std::string, at::Tensor> params, buffers;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    for (const auto& p : model->named_parameters(true)) params.emplace(p.key(), p.value());
    for (const auto& b : model->named_buffers(true)) buffers.emplace(b.key(), b.value());
  }));
  std::set<const c10::TensorImpl*> loaded;

  nlohmann::ordered_json index = nlohmann::ordered_json::object();
  bool wrote_offload = false;
  // What this load adds to the offload folder is removed again when it fails,
  // so a failed load leaves the folder as it found it: the .dat files it made
  // (not those an earlier load left, which that load's index names), and the
  // folder itself when it made it and nothing else is in it. The index is
  // written last, once nothing can fail.
  struct Leftovers {
    std::vector<std::string> files;
    std::string folder;
    bool keep = false;
    ~Leftovers() {
      if (keep) return;
      std::error_code ec;
      for (const std::string& f : files) std::filesystem::remove(f, ec);
      if (!folder.empty()) std::filesystem::remove(folder, ec);  // only when empty
    }
  } leftovers;
  // What the offload folder will be given: each disk tensor whose checkpoint
  // bytes are not what the model holds (a dtype conversion, a tensor made on
  // loading), checked against the folder's free space before the first write.
  uint64_t to_write = 0;
  {
    std::set<const c10::TensorImpl*> seen;
    const auto count = [&](const std::string& name, const at::Tensor& target, bool is_buffer) {
      if (!seen.insert(target.unsafeGetTensorImpl()).second) return;
      std::optional<Placement> p = map.Lookup(name);
      if (!p || !p->is_disk() || (is_buffer && !options.offload_buffers)) return;
      at::ScalarType dtype = target.scalar_type();
      if (c10::isFloatingType(dtype) && options.dtype) {
        dtype = *options.dtype;
        if ((dtype == at::kHalf || dtype == at::kBFloat16) &&
            KeepInFp32(name, options.keep_in_fp32_modules)) {
          dtype = at::kFloat;
        }
      }
      const loader::Checkpoint::Entry* entry = ckpt.Find(name);
      if (entry != nullptr) {
        absl::StatusOr<at::ScalarType> stored = loader::TorchDType(entry->info.dtype);
        if (stored.ok() && *stored == dtype && entry->info.shape == target.sizes().vec()) return;
      }
      to_write += static_cast<uint64_t>(target.numel()) * c10::elementSize(dtype);
    };
    for (const auto& [name, t] : params) count(name, t, false);
    for (const auto& [name, t] : buffers) count(name, t, true);
  }
  bool space_checked = false;
  Progress progress("loading", static_cast<int64_t>(ckpt.total_bytes()),
                    static_cast<int64_t>(ckpt.tensors().size()), options.progress);

  // Places model tensor `name` from a checkpoint entry, or (entry null) from
  // `ready`, a tensor a LoadHook made, which keeps its dtype. `as_stored`: the
  // entry is a LoadHook's tensor that it handed back as stored (a
  // pre-quantized checkpoint's packed weight, absmax, SCB...): it keeps its
  // dtype, and disk placements use the checkpoint's own bytes.
  const auto place = [&](const std::string& name, const loader::Checkpoint::Entry* entry,
                         const at::Tensor& ready, bool as_stored = false) -> absl::Status {
    const auto label = [&](absl::string_view what) {
      return absl::StrCat("tensor '", name, "': ", what);
    };
    const bool is_buffer = buffers.count(name) > 0;
    auto found = is_buffer ? buffers.find(name) : params.find(name);
    if (found == (is_buffer ? buffers.end() : params.end())) {
      if (entry == nullptr) {
        return absl::InvalidArgumentError(
            label("made on loading, but the model has no such tensor"));
      }
      out->unexpected_.push_back(name);
      return absl::OkStatus();
    }
    at::Tensor target = found->second;
    std::optional<Placement> placement = map.Lookup(name);
    if (!placement) {
      return absl::InvalidArgumentError(label("the device map places no module that holds it"));
    }
    const std::vector<int64_t> shape = entry ? entry->info.shape : ready.sizes().vec();
    if (shape != target.sizes().vec()) {
      return absl::InvalidArgumentError(label(absl::StrCat(
          entry ? "the checkpoint holds" : "loading made", " shape [", absl::StrJoin(shape, ", "),
          "] but the model expects [", absl::StrJoin(target.sizes(), ", "), "]")));
    }
    at::ScalarType file_dtype = at::kFloat;
    if (entry) {
      auto parsed = loader::TorchDType(entry->info.dtype);
      if (!parsed.ok()) return Annotate(parsed.status(), absl::StrCat("tensor '", name, "'"));
      file_dtype = *parsed;
    } else {
      file_dtype = ready.scalar_type();
    }
    at::ScalarType dtype = target.scalar_type();
    if (entry == nullptr) {
      if (dtype != file_dtype) {
        return absl::InvalidArgumentError(label(absl::StrCat(
            "loading made ", DTypeName(file_dtype), " but the model expects ", DTypeName(dtype))));
      }
    } else if (c10::isFloatingType(file_dtype) && c10::isFloatingType(dtype) && options.dtype &&
               !as_stored) {
      dtype = *options.dtype;
      if ((dtype == at::kHalf || dtype == at::kBFloat16) &&
          KeepInFp32(name, options.keep_in_fp32_modules)) {
        dtype = at::kFloat;
      }
    }
    if (!c10::isFloatingType(dtype) && c10::isFloatingType(file_dtype)) {
      return absl::InvalidArgumentError(label(absl::StrCat(
          "cannot convert ", entry ? entry->info.dtype : std::string(DTypeName(file_dtype)), " to ",
          DTypeName(dtype))));
    }
    const auto value = [&]() -> absl::StatusOr<at::Tensor> {
      if (entry == nullptr) return ready;
      return ckpt.Tensor(name);
    };

    const std::optional<uint64_t> in_file =
        entry != nullptr ? ckpt.FileOffset(*entry) : std::nullopt;
    const bool offload_disk =
        placement->is_disk() &&
        (!is_buffer || options.offload_buffers ||
         (options.offload_buffers_in_place && in_file && dtype == file_dtype));
    const bool offload_cpu = placement->is_cpu() && out->main_.is_cuda();
    if (offload_disk && in_file && dtype == file_dtype) {
      // Read straight from the checkpoint for each forward: no copy is written.
      ACCEL_ASSIGN_OR_RETURN(Source source,
                             mapped({at::Tensor(), ckpt.shard_paths()[entry->shard], *in_file,
                                     entry->info.nbytes(), dtype, shape, nullptr, nullptr}));
      im.tensors.push_back({name, std::move(source)});
    } else if (offload_disk) {
      if (options.offload_folder.empty()) {
        return absl::InvalidArgumentError(label(absl::StrCat(
            "mapped to disk, and needs ",
            !entry ? std::string("writing (it was made on loading)")
            : !in_file
                ? absl::StrCat("copying from ", ckpt.shard_paths()[entry->shard],
                               ", which stores it as a strided view")
                : absl::StrCat("converting from ", entry->info.dtype, " to ", DTypeName(dtype)),
            "; give an offload folder to write it to")));
      }
      std::error_code ec;
      if (leftovers.folder.empty() && !std::filesystem::exists(options.offload_folder, ec)) {
        leftovers.folder = options.offload_folder;
      }
      if (!space_checked) {
        space_checked = true;
        // Where the folder is, or will be made.
        std::filesystem::path there = std::filesystem::absolute(options.offload_folder, ec);
        while (!ec && !there.empty() && !std::filesystem::exists(there, ec) &&
               there != there.parent_path()) {
          there = there.parent_path();
        }
        const std::filesystem::space_info space = std::filesystem::space(there, ec);
        // A margin for the file system's own blocks and the index.
        const uint64_t needed = to_write + to_write / 64 + (uint64_t{16} << 20);
        if (!ec && space.available < needed) {
          return absl::ResourceExhaustedError(
              absl::StrCat("offload folder ", options.offload_folder, " has ",
                           FormatBytes(static_cast<int64_t>(space.available)),
                           " free, and the weights it must hold (converted on loading) take ",
                           FormatBytes(static_cast<int64_t>(to_write)),
                           "; free some space or give another offload folder"));
        }
      }
      std::filesystem::create_directories(options.offload_folder, ec);
      if (ec)
        return ErrnoStatus(ec.value(),
                           absl::StrCat("creating offload folder ", options.offload_folder));
      ACCEL_ASSIGN_OR_RETURN(at::Tensor source, value());
      at::Tensor converted;
      ACCEL_RETURN_IF_ERROR(CallTorch([&] { converted = source.to(dtype).contiguous(); }));
      const std::string path = absl::StrCat(options.offload_folder, "/", name, ".dat");
      const uint64_t nbytes = converted.nbytes();
      if (!std::filesystem::exists(path, ec)) leftovers.files.push_back(path);
      ACCEL_RETURN_IF_ERROR(Annotate(
          loader::WriteFileAtomically(
              path, absl::string_view(static_cast<const char*>(converted.data_ptr()), nbytes)),
          absl::StrCat("offloading tensor '", name, "'")));
      index[name] = {{"dtype", IndexDType(dtype)}, {"shape", shape}};
      wrote_offload = true;
      ACCEL_ASSIGN_OR_RETURN(
          Source written, mapped({at::Tensor(), path, 0, nbytes, dtype, shape, nullptr, nullptr}));
      im.tensors.push_back({name, std::move(written)});
    } else if (offload_cpu) {
      ACCEL_ASSIGN_OR_RETURN(at::Tensor source, value());
      at::Tensor host;
      ACCEL_RETURN_IF_ERROR(CallTorch([&] { host = source.to(dtype).contiguous().pin_memory(); }));
      im.tensors.push_back({name, {host, "", 0, host.nbytes(), dtype, shape, nullptr, nullptr}});
    }

    if (offload_disk || offload_cpu) {
      im.by_impl[target.unsafeGetTensorImpl()] = static_cast<int>(im.tensors.size()) - 1;
      im.targets.push_back(target);
      ACCEL_RETURN_IF_ERROR(SetTensorInPlace(target, name, at::kMeta, at::Tensor(), dtype));
    } else {
      const at::Device device = placement->is_cuda() ? DeviceOf(*placement) : out->main_;
      ACCEL_ASSIGN_OR_RETURN(at::Tensor source, value());
      ACCEL_RETURN_IF_ERROR(
          Annotate(SetTensorInPlace(target, name, device, source, dtype), label("loading")));
    }
    loaded.insert(target.unsafeGetTensorImpl());
    return absl::OkStatus();
  };

  // Small tensors a hook reads (a quant state's JSON, code maps: a few
  // thousand of them in a large quantized model, spread over every shard)
  // are read with pread, without read-ahead: touched through the mapping,
  // each would fault in a read-ahead window of megabytes, and loading would
  // read gigabytes it does not need.
  constexpr uint64_t kSmall = 64 << 10;
  // Through the files held open for the model (a fault is recorded as any
  // read of the weights is), never the path again.
  const auto stored_tensor =
      [&](const loader::Checkpoint::Entry& entry) -> absl::StatusOr<at::Tensor> {
    const std::optional<uint64_t> offset = ckpt.FileOffset(entry);
    if (entry.info.nbytes() > kSmall || !offset) return ckpt.Tensor(entry.info.name);
    const std::string& path = ckpt.shard_paths()[entry.shard];
    auto& file = files[path];
    if (!file) {
      ACCEL_ASSIGN_OR_RETURN(file, internal::OpenFile::Open(path, options.direct_reads));
    }
    ACCEL_ASSIGN_OR_RETURN(at::ScalarType dtype, loader::TorchDType(entry.info.dtype));
    at::Tensor out;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { out = at::empty(entry.info.shape, dtype); }));
    ACCEL_RETURN_IF_ERROR(Annotate(internal::ReadRange(*file, *offset, out.data_ptr(),
                                                       entry.info.nbytes(), /*drop_pages=*/false),
                                   absl::StrCat("tensor '", entry.info.name, "'")));
    return out;
  };
  std::vector<at::Tensor> dropped;  // stored tensors whose pages were dropped
  for (const loader::Checkpoint::Entry& entry : ckpt.tensors()) {
    const std::string& name = entry.info.name;
    if (options.hook != nullptr && options.hook->Claims(name)) {
      ACCEL_ASSIGN_OR_RETURN(at::Tensor stored, stored_tensor(entry));
      ACCEL_ASSIGN_OR_RETURN(std::vector<HookTensor> made, options.hook->Convert(name, stored));
      const loader::SafetensorsFile* shard = ckpt.safetensors_shard(entry.shard);
      const loader::TensorInfo* info = shard != nullptr ? shard->Find(name) : nullptr;
      const bool mapped = info != nullptr && shard->Bytes(*info).data() == stored.data_ptr();
      for (HookTensor& t : made) {
        const bool as_stored = t.name == name && t.value.is_same(stored);
        // The stored bytes used in place under the hook's terms (a
        // tensor-parallel row slice, an expert renamed to its local index)
        // get a mapping of their own: a fault on the file's mapping maps the
        // page cache's whole folio around the page, other ranks' rows with
        // it (a rank held 497 MB of the checkpoint for its 351 MB of slices,
        // docs/BENCHMARKS.md); their own mapping stops at their pages.
        if (mapped && !as_stored && t.value.defined() && t.value.device().is_cpu() &&
            t.value.nbytes() > 0 && t.value.is_contiguous() &&
            t.value.data_ptr() >= stored.data_ptr() &&
            static_cast<const char*>(t.value.data_ptr()) + t.value.nbytes() <=
                static_cast<const char*>(stored.data_ptr()) + stored.nbytes()) {
          // Where it cannot (no descriptor left for the file), the view
          // of the whole mapping serves as before.
          if (absl::StatusOr<at::Tensor> alone = shard->MapAlone(t.value); alone.ok()) {
            t.value = *std::move(alone);
          }
        }
        // Handed back as stored: placed as a checkpoint tensor, so a disk
        // placement reads (or maps) the shard itself and nothing is written.
        if (as_stored) {
          ACCEL_RETURN_IF_ERROR(place(name, &entry, at::Tensor(), /*as_stored=*/true));
        } else {
          ACCEL_RETURN_IF_ERROR(place(t.name, nullptr, t.value));
        }
      }
      // The hook made tensors of its own (quantized, a tensor-parallel
      // slice): the stored bytes it read need not stay in this process's
      // resident memory when they are the safetensors file's mapping (the
      // page cache keeps them; a view the hook kept faults them in again).
      if (mapped) {
        DropResidentPages(stored);
        dropped.push_back(stored);
      }
    } else {
      ACCEL_RETURN_IF_ERROR(place(name, &entry, at::Tensor()));
    }
    progress.Add(static_cast<int64_t>(entry.info.nbytes()));
  }
  if (options.hook != nullptr) ACCEL_RETURN_IF_ERROR(options.hook->Finish());
  // Again, now that every tensor is read: a later tensor's read faulted the
  // page cache's whole folio around it in, an earlier neighbour's dropped
  // pages with it.
  for (const at::Tensor& stored : dropped) DropResidentPages(stored);
  dropped.clear();
  progress.Finish();

  if (options.strict && !out->unexpected_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the checkpoint holds tensors the model does not have: ",
                     absl::StrJoin(out->unexpected_, ", ")));
  }
  std::vector<std::string> missing;
  for (const auto& [name, t] : params) {
    if (!loaded.count(t.unsafeGetTensorImpl())) missing.push_back(name);
  }
  if (!missing.empty()) {
    return absl::NotFoundError(absl::StrCat("the checkpoint lacks parameters of the model: ",
                                            absl::StrJoin(missing, ", ")));
  }
  // Buffers the checkpoint does not hold (computed ones, like rotary
  // frequencies) keep their values and go to their module's device.
  for (const auto& [name, t] : buffers) {
    if (loaded.count(t.unsafeGetTensorImpl())) continue;
    if (t.is_meta()) {
      return absl::NotFoundError(
          absl::StrCat("buffer '", name, "' is empty and the checkpoint lacks it"));
    }
    ACCEL_RETURN_IF_ERROR(SetTensorInPlace(t, name, out->ExecutionDevice(name)));
  }

  if (out->main_.is_cuda() && !im.tensors.empty()) {
    ACCEL_ASSIGN_OR_RETURN(im.stager, internal::DeviceStager::Create(out->main_));
  }
  ACCEL_RETURN_IF_ERROR(out->SetUpExpertCache(options));
  if (wrote_offload) {
    // Merged with an index already there, as Accelerate does.
    const std::string index_path = options.offload_folder + "/index.json";
    if (absl::StatusOr<std::string> existing = loader::ReadFile(index_path); existing.ok()) {
      absl::StatusOr<nlohmann::ordered_json> old = ParseOrderedJson(*existing, index_path);
      if (old.ok() && old->is_object()) {
        for (const auto& [k, v] : old->items()) {
          if (!index.contains(k)) index[k] = v;
        }
      }
    }
    ACCEL_RETURN_IF_ERROR(loader::WriteFileAtomically(index_path, index.dump(2)));
  }
  leftovers.keep = true;
  if (options.populate_resident) {
    // Page ranges of the cpu tensors (mapped from the shards where no
    // conversion was needed), merged: asked for all at once, then made
    // resident, so the kernel reads them in large requests and nothing else.
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
    const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    std::set<const c10::TensorImpl*> seen;
    const auto add = [&](const at::Tensor& t) {
      if (!t.defined() || t.is_meta() || !t.device().is_cpu() || t.nbytes() == 0 ||
          !seen.insert(t.unsafeGetTensorImpl()).second) {
        return;
      }
      const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
      ranges.emplace_back(begin / page * page, (begin + t.nbytes() + page - 1) / page * page);
    };
    for (const auto& [name, t] : params) add(t);
    for (const auto& [name, t] : buffers) add(t);
    std::sort(ranges.begin(), ranges.end());
    std::vector<std::pair<uintptr_t, uintptr_t>> merged;
    for (const auto& r : ranges) {
      if (!merged.empty() && r.first <= merged.back().second) {
        merged.back().second = std::max(merged.back().second, r.second);
      } else {
        merged.push_back(r);
      }
    }
    // On a thread of its own, so that loading ends once the model is
    // mapped (Llama-3-70B NF4 keeps 13.5 GiB resident: 10-40 s of reads on
    // this machine's disk, which the first forward would wait for anyway,
    // and which now overlap what comes before it). A forward that gets ahead
    // of it faults the rest in itself; the reader's own prefetching of disk
    // layers is not held up behind it.
    Impl* im_ptr = &im;
    im.populator = std::thread([im_ptr, merged = std::move(merged)] {
      NameThisThread("accel-populate");
      for (const auto& [begin, end] : merged) {
        if (im_ptr->stop_populating) return;
        (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_WILLNEED);
      }
      constexpr uintptr_t kPiece = uintptr_t{64} << 20;  // a stop is seen within a piece
      for (const auto& [begin, end] : merged) {
        for (uintptr_t at = begin; at < end; at += kPiece) {
          if (im_ptr->stop_populating) return;
          const uintptr_t n = std::min(kPiece, end - at);
#ifdef MADV_POPULATE_READ
          (void)::madvise(reinterpret_cast<void*>(at), n, MADV_POPULATE_READ);
#endif
          // Kept resident where the process may lock memory: each token
          // reads these once, and under the machine's memory pressure the
          // kernel took them back between tokens, to fault them in again a
          // read-ahead window at a time (gigabytes of extra reads). Where it
          // may not, they stay ordinary page cache.
          // MLOCK_ONFAULT locks the pages just mapped as they are: a plain
          // mlock() faults a private writable mapping (the loader's) in for
          // writing, copying every page of it into anonymous memory (the
          // resident part twice in memory: 1.19 GiB of Mixtral-8x7B, 13.5
          // GiB of Llama-3-70B, copied at load).
#ifdef MLOCK_ONFAULT
          (void)::mlock2(reinterpret_cast<void*>(at), n, MLOCK_ONFAULT);
#endif
        }
      }
    });
  }
  if (options.prefetch && !im.tensors.empty()) {
    im.reader = std::thread([&im] {
      NameThisThread("accel-layer-rd");
      im.ReaderLoop();
    });
  }
  return out;
}

}  // namespace accel::dispatch
