#include "dispatch/internal/expert_cache.h"

#include <algorithm>
#include <limits>

#include <ATen/Functions.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"

namespace accel::dispatch::internal {
namespace {

// Prefetch requests beyond this many are stale guesses: the oldest go.
constexpr size_t kMaxQueued = 256;

}  // namespace

ExpertCache::ExpertCache(const std::vector<Offloaded>& tensors, const Options& options)
    : tensors_(tensors), options_(options) {
  reader_ = std::thread([this] { ReaderLoop(); });
}

ExpertCache::~ExpertCache() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  reader_.join();
}

int ExpertCache::AddUnit(std::vector<int> tensors) {
  Unit unit;
  for (int i : tensors) unit.bytes += static_cast<int64_t>(tensors_[i].source.nbytes);
  unit.tensors = std::move(tensors);
  std::lock_guard<std::mutex> lock(mu_);
  units_.push_back(std::move(unit));
  return static_cast<int>(units_.size()) - 1;
}

int64_t ExpertCache::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_bytes_;
}

void ExpertCache::AddStats(OffloadStats& stats) const {
  std::lock_guard<std::mutex> lock(mu_);
  stats.expert_fetches += stats_.expert_fetches;
  stats.expert_cache_hits += stats_.expert_cache_hits;
  stats.expert_prefetch_hits += stats_.expert_prefetch_hits;
  stats.expert_bytes_read += stats_.expert_bytes_read;
  stats.bytes_read += stats_.expert_bytes_read;
  stats.bytes_to_device += stats_.bytes_to_device;
}

bool ExpertCache::MakeRoom(int64_t bytes) {
  while (used_bytes_ + bytes > options_.budget_bytes) {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->second.pins == 0 &&
          (victim == entries_.end() || it->second.last_use < victim->second.last_use)) {
        victim = it;
      }
    }
    if (victim == entries_.end()) return false;
    used_bytes_ -= units_[victim->first].bytes;
    for (at::Tensor& b : victim->second.buffers) {
      // Back for the next read of the same size, unless someone still holds it.
      if (b.storage().use_count() == 1) {
        free_buffers_.emplace(std::make_pair(b.nbytes(), static_cast<int>(b.scalar_type())),
                              std::move(b));
      }
    }
    entries_.erase(victim);
  }
  return true;
}

absl::StatusOr<ExpertCache::Entry> ExpertCache::Read(int unit) {
  std::vector<int> members;
  {
    std::lock_guard<std::mutex> lock(mu_);
    members = units_[unit].tensors;
  }
  Entry entry;
  int64_t read = 0, to_device = 0;
  for (int i : members) {
    const Source& s = tensors_[i].source;
    at::Tensor host;
    if (s.host.defined()) {
      host = s.host;
    } else {
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = free_buffers_.find({s.nbytes, static_cast<int>(s.dtype)});
        if (it != free_buffers_.end()) {
          host = std::move(it->second);
          free_buffers_.erase(it);
        }
      }
      if (!host.defined()) {
        ACCEL_RETURN_IF_ERROR(CallTorch([&] {
          int64_t numel = 1;
          for (int64_t d : s.shape) numel *= d;
          host = at::empty({numel}, at::TensorOptions().dtype(s.dtype).pinned_memory(
                                        options_.stager != nullptr));
        }));
      }
      ACCEL_RETURN_IF_ERROR(
          Annotate(ReadRange(s.path, s.offset, host.data_ptr(), s.nbytes, options_.drop_pages),
                   absl::StrCat("tensor '", tensors_[i].name, "'")));
      read += static_cast<int64_t>(s.nbytes);
      entry.buffers.push_back(host);
      ACCEL_RETURN_IF_ERROR(CallTorch([&] { host = host.view(s.shape); }));
    }
    entry.values.push_back(std::move(host));
  }
  if (options_.stager != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(std::vector<at::Tensor> staged, options_.stager->Stage(entry.values));
    for (const at::Tensor& t : staged) to_device += static_cast<int64_t>(t.nbytes());
    entry.values = std::move(staged);
    // The host buffers are free again once the copies are done.
    std::lock_guard<std::mutex> lock(mu_);
    for (at::Tensor& b : entry.buffers) {
      free_buffers_.emplace(std::make_pair(b.nbytes(), static_cast<int>(b.scalar_type())),
                            std::move(b));
    }
    entry.buffers.clear();
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.expert_fetches++;
  stats_.expert_bytes_read += read;
  stats_.bytes_to_device += to_device;
  return entry;
}

absl::StatusOr<std::vector<std::vector<at::Tensor>>> ExpertCache::Acquire(
    absl::Span<const int> units) {
  std::vector<std::vector<at::Tensor>> out(units.size());
  std::vector<size_t> missing;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (size_t k = 0; k < units.size(); ++k) {
      const int unit = units[k];
      // Being read by the reader: wait for it rather than read it twice.
      cv_.wait(lock, [&] { return !in_flight_.count(unit); });
      auto it = entries_.find(unit);
      if (it == entries_.end()) {
        queue_.erase(std::remove(queue_.begin(), queue_.end(), unit), queue_.end());
        in_flight_[unit] = false;
        missing.push_back(k);
        continue;
      }
      Entry& e = it->second;
      stats_.expert_cache_hits++;
      if (e.prefetched) stats_.expert_prefetch_hits++;
      e.prefetched = false;
      e.pins++;
      e.last_use = ++clock_;
      out[k] = e.values;
    }
  }
  absl::Status failed;
  for (size_t k : missing) {
    const int unit = units[k];
    absl::StatusOr<Entry> entry =
        failed.ok() ? Read(unit) : absl::StatusOr<Entry>(absl::CancelledError());
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.erase(unit);
    if (!entry.ok()) {
      if (failed.ok()) failed = entry.status();
      continue;
    }
    // Room is made for it if unpinned entries allow; otherwise the cache runs
    // past its budget until pins are released.
    MakeRoom(units_[unit].bytes);
    entry->pins = 1;
    entry->last_use = ++clock_;
    out[k] = entry->values;
    used_bytes_ += units_[unit].bytes;
    entries_[unit] = *std::move(entry);
  }
  cv_.notify_all();
  if (!failed.ok()) {
    // Nothing stays pinned by a failed call.
    std::vector<int> pinned;
    for (size_t k = 0; k < units.size(); ++k) {
      if (!out[k].empty()) pinned.push_back(units[k]);
    }
    Release(pinned);
    return failed;
  }
  return out;
}

void ExpertCache::Release(absl::Span<const int> units) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int unit : units) {
    auto it = entries_.find(unit);
    if (it != entries_.end() && it->second.pins > 0) it->second.pins--;
  }
  MakeRoom(0);  // back within the budget if an inline read ran past it
}

void ExpertCache::Prefetch(absl::Span<const int> units) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int unit : units) {
    if (entries_.count(unit) || in_flight_.count(unit)) continue;
    if (std::find(queue_.begin(), queue_.end(), unit) != queue_.end()) continue;
    queue_.push_back(unit);
  }
  while (queue_.size() > kMaxQueued) queue_.pop_front();
  cv_.notify_all();
}

void ExpertCache::ReaderLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const int unit = queue_.front();
    queue_.pop_front();
    if (entries_.count(unit) || in_flight_.count(unit)) continue;
    // A guess never evicts what is pinned, nor runs past the budget.
    if (units_[unit].bytes > options_.budget_bytes || !MakeRoom(units_[unit].bytes)) continue;
    in_flight_[unit] = true;
    used_bytes_ += units_[unit].bytes;  // its room is taken while it is read
    lock.unlock();
    absl::StatusOr<Entry> entry = Read(unit);
    lock.lock();
    in_flight_.erase(unit);
    if (entry.ok()) {
      entry->prefetched = true;
      entry->last_use = ++clock_;
      entries_[unit] = *std::move(entry);
    } else {
      used_bytes_ -= units_[unit].bytes;
    }
    cv_.notify_all();
  }
}

}  // namespace accel::dispatch::internal
