#include "dispatch/internal/expert_cache.h"

#include <algorithm>
#include <limits>

#include <ATen/Functions.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"

namespace accel::dispatch::internal {
namespace {

// Guesses beyond this many are stale: the oldest go.
constexpr size_t kMaxGuesses = 64;

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

int ExpertCache::AddUnit(std::vector<int> tensors, int position) {
  Unit unit;
  for (int i : tensors) unit.bytes += static_cast<int64_t>(tensors_[i].source.nbytes);
  unit.tensors = std::move(tensors);
  unit.position = position;
  std::lock_guard<std::mutex> lock(mu_);
  units_.push_back(std::move(unit));
  return static_cast<int>(units_.size()) - 1;
}

int64_t ExpertCache::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_bytes_;
}

bool ExpertCache::Cached(int unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.count(unit) > 0;
}

void ExpertCache::AddStats(OffloadStats& stats) const {
  std::lock_guard<std::mutex> lock(mu_);
  stats.expert_fetches += stats_.expert_fetches;
  stats.expert_cache_hits += stats_.expert_cache_hits;
  stats.expert_misses += stats_.expert_misses;
  stats.expert_prefetch_hits += stats_.expert_prefetch_hits;
  stats.expert_guess_reads += stats_.expert_guess_reads;
  stats.expert_guess_hits += stats_.expert_guess_hits;
  stats.expert_bytes_read += stats_.expert_bytes_read;
  stats.bytes_read += stats_.expert_bytes_read;
  stats.bytes_to_device += stats_.bytes_to_device;
}

void ExpertCache::CountGuess(bool used) {
  constexpr double kWeight = 0.1;  // about the last 10 guesses
  guess_rate_ = (1 - kWeight) * guess_rate_ + kWeight * (used ? 1.0 : 0.0);
  if (used) stats_.expert_guess_hits++;
}

int ExpertCache::Distance(int unit) const {
  const int n = std::max(options_.positions, 1);
  // The next layer 0, ..., the layer being run n - 1.
  return ((units_[unit].position - current_position_ - 1) % n + n) % n;
}

bool ExpertCache::MakeRoom(int64_t bytes, int unit) {
  while (used_bytes_ + bytes > options_.budget_bytes) {
    auto victim = entries_.end();
    int victim_distance = -1;
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->second.pins > 0) continue;
      const int d = Distance(it->first);
      if (d > victim_distance ||
          (d == victim_distance && it->second.last_use < victim->second.last_use)) {
        victim = it;
        victim_distance = d;
      }
    }
    // A guess takes only the room of units to be used after it.
    if (victim == entries_.end() || (unit >= 0 && victim_distance <= Distance(unit))) return false;
    used_bytes_ -= units_[victim->first].bytes;
    if (victim->second.prefetched && victim->second.guess) CountGuess(false);
    std::vector<at::Tensor> freed = std::move(victim->second.buffers);
    entries_.erase(victim);  // drops its values, the views of the buffers
    for (at::Tensor& b : freed) buffers_.Give(std::move(b));
  }
  return true;
}

absl::StatusOr<ExpertCache::Entry> ExpertCache::Read(int unit) {
  std::vector<const Source*> disk;
  std::vector<std::string> names;
  std::vector<size_t> disk_slot;
  Entry entry;
  const std::vector<int>& members = units_[unit].tensors;
  entry.values.resize(members.size());
  for (size_t m = 0; m < members.size(); ++m) {
    const Offloaded& t = tensors_[members[m]];
    if (t.source.host.defined()) {
      entry.values[m] = t.source.host;  // in RAM already (a GPU execution device)
    } else {
      disk.push_back(&t.source);
      names.push_back(t.name);
      disk_slot.push_back(m);
    }
  }
  uint64_t read = 0;
  if (!disk.empty()) {
    const bool pinned = options_.stager != nullptr;
    ACCEL_ASSIGN_OR_RETURN(ReadTensors got,
                           ReadCoalesced(disk, names, options_.direct, [&](uint64_t bytes) {
                             return buffers_.Take(bytes, pinned);
                           }));
    for (size_t k = 0; k < disk.size(); ++k) entry.values[disk_slot[k]] = std::move(got.values[k]);
    entry.buffers = std::move(got.buffers);
    read = got.bytes_read;
  }
  int64_t to_device = 0;
  if (options_.stager != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(std::vector<at::Tensor> staged, options_.stager->Stage(entry.values));
    for (const at::Tensor& t : staged) to_device += static_cast<int64_t>(t.nbytes());
    entry.values = std::move(staged);
    // The host buffers are free again once the copies are done.
    for (at::Tensor& b : std::exchange(entry.buffers, {})) buffers_.Give(std::move(b));
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.expert_fetches++;
  stats_.expert_bytes_read += static_cast<int64_t>(read);
  stats_.bytes_to_device += to_device;
  return entry;
}

absl::StatusOr<std::vector<std::vector<at::Tensor>>> ExpertCache::Acquire(
    absl::Span<const int> units) {
  std::vector<std::vector<at::Tensor>> out(units.size());
  std::vector<size_t> missing;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!units.empty()) current_position_ = units_[units[0]].position;
    for (size_t k = 0; k < units.size(); ++k) {
      const int unit = units[k];
      // Being read by the reader: wait for it rather than read it twice.
      cv_.wait(lock, [&] { return !in_flight_.count(unit); });
      auto it = entries_.find(unit);
      if (it == entries_.end()) {
        needed_.erase(std::remove(needed_.begin(), needed_.end(), unit), needed_.end());
        guesses_.erase(std::remove(guesses_.begin(), guesses_.end(), unit), guesses_.end());
        in_flight_[unit] = false;
        stats_.expert_misses++;
        missing.push_back(k);
        continue;
      }
      Entry& e = it->second;
      stats_.expert_cache_hits++;
      if (e.prefetched) stats_.expert_prefetch_hits++;
      if (e.prefetched && e.guess) CountGuess(true);
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

void ExpertCache::Prefetch(absl::Span<const int> units, bool needed) {
  std::lock_guard<std::mutex> lock(mu_);
  std::deque<int>& queue = needed ? needed_ : guesses_;
  if (!needed && guess_rate_ < kMinGuessRate && guesses_seen_++ % kGuessProbe != 0) return;
  for (int unit : units) {
    if (entries_.count(unit) || in_flight_.count(unit)) continue;
    if (std::find(queue.begin(), queue.end(), unit) != queue.end()) continue;
    queue.push_back(unit);
  }
  while (guesses_.size() > kMaxGuesses) guesses_.pop_front();
  cv_.notify_all();
}

void ExpertCache::ReaderLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !needed_.empty() || !guesses_.empty(); });
    if (stop_) return;
    const bool needed = !needed_.empty();
    std::deque<int>& queue = needed ? needed_ : guesses_;
    const int unit = queue.front();
    queue.pop_front();
    if (entries_.count(unit) || in_flight_.count(unit)) continue;
    const int64_t bytes = units_[unit].bytes;
    if (bytes > options_.budget_bytes || !MakeRoom(bytes, needed ? -1 : unit)) continue;
    in_flight_[unit] = true;
    used_bytes_ += bytes;  // its room is taken while it is read
    lock.unlock();
    absl::StatusOr<Entry> entry = Read(unit);
    lock.lock();
    in_flight_.erase(unit);
    if (entry.ok()) {
      entry->prefetched = true;
      entry->guess = !needed;
      if (!needed) stats_.expert_guess_reads++;
      entry->last_use = ++clock_;
      entries_[unit] = *std::move(entry);
    } else {
      used_bytes_ -= bytes;
    }
    cv_.notify_all();
  }
}

}  // namespace accel::dispatch::internal
