#include "dispatch/internal/expert_cache.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include <ATen/Functions.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "core/thread_name.h"
#include "dispatch/internal/host_memory.h"

namespace accel::dispatch::internal {
namespace {

// Guesses beyond this many are stale: the oldest go.
constexpr size_t kMaxGuesses = 64;

}  // namespace

ExpertCache::ExpertCache(const std::vector<Offloaded>& tensors, const Options& options)
    : tensors_(tensors), options_(options) {
  reader_ = std::thread([this] {
    NameThisThread("accel-expert-rd");
    ReaderLoop();
  });
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
  largest_unit_bytes_ = std::max(largest_unit_bytes_, unit.bytes);
  units_.push_back(std::move(unit));
  evicted_at_.push_back(0);
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
  stats.expert_wait_us += stats_.expert_wait_us;
  stats.expert_read_us += stats_.expert_read_us;
  stats.expert_bytes_reread += stats_.expert_bytes_reread;
  stats.expert_units_uncached += stats_.expert_units_uncached;
  stats.bytes_read += stats_.expert_bytes_read;
  stats.bytes_to_device += stats_.bytes_to_device;
}

void ExpertCache::CountGuess(bool used, int distance) {
  constexpr double kWeight = 0.1;  // about the last 10 guesses
  double& rate = guess_rate_[std::clamp(distance, 0, kGuessDistances - 1)];
  rate = (1 - kWeight) * rate + kWeight * (used ? 1.0 : 0.0);
  if (used) stats_.expert_guess_hits++;
}

int ExpertCache::Distance(int unit) const {
  const int n = std::max(options_.positions, 1);
  // The next layer 0, ..., the layer being run n - 1.
  return ((units_[unit].position - current_position_ - 1) % n + n) % n;
}

double ExpertCache::Score(int unit) const {
  const Unit& u = units_[unit];
  return u.score * std::pow(kScoreDecay, static_cast<double>(step_ - u.score_step));
}

void ExpertCache::CountUse(int unit) {
  Unit& u = units_[unit];
  u.score = Score(unit) + 1.0;
  u.score_step = step_;
}

bool ExpertCache::EvictsBefore(int a, int b) const {
  // Scores within a hundredth of a use are equal: decayed counts of the same
  // history differ only by rounding.
  const double sa = Score(a), sb = Score(b);
  if (sa < sb - 0.01) return true;
  if (sb < sa - 0.01) return false;
  const int da = Distance(a), db = Distance(b);
  if (da != db) return da > db;
  const auto use = [&](int u) {
    auto it = entries_.find(u);
    return it == entries_.end() ? clock_ + 1 : it->second.last_use;  // not cached: newest
  };
  return use(a) < use(b);
}

bool ExpertCache::MakeRoom(int64_t bytes, int unit) {
  while (used_bytes_ + bytes > options_.budget_bytes) {
    int victim = -1;
    for (const auto& [id, entry] : entries_) {
      if (entry.pins > 0) continue;
      if (victim < 0 || EvictsBefore(id, victim)) victim = id;
    }
    // A guess takes only the room of units it would be evicted before.
    if (victim < 0 || (unit >= 0 && !EvictsBefore(victim, unit))) return false;
    auto it = entries_.find(victim);
    used_bytes_ -= units_[victim].bytes;
    if (it->second.prefetched && it->second.guess) CountGuess(false, it->second.guess_distance);
    std::vector<at::Tensor> freed = std::move(it->second.buffers);
    std::vector<Span> spans = std::move(it->second.spans);
    entries_.erase(it);  // drops its values, the views of the buffers
    for (at::Tensor& b : freed) buffers_.Give(std::move(b));
    // Its pages go back to the system: the budget is what the cache holds.
    for (const Span& sp : spans) {
      if (options_.release_pages) {
        sp.mapping->Evict(sp.offset, sp.bytes);
      } else {
        sp.mapping->Drop(sp.offset, sp.bytes);
      }
    }
    if (!spans.empty() && !options_.release_pages) evicted_at_[victim] = ++evictions_;
  }
  return true;
}

void ExpertCache::KeepMemoryFree(int64_t incoming) {
  if (options_.release_pages || !options_.keep_memory_free) return;
  const int64_t floor = 4 * largest_unit_bytes_ + (int64_t{256} << 20);
  const auto free_memory = [&]() -> int64_t {
    if (options_.free_memory) return options_.free_memory();
    return FreeHostMemory().value_or(std::numeric_limits<int64_t>::max());
  };
  while (free_memory() < floor + incoming) {
    int unit = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The unit evicted longest ago, not cached (or being read) again since.
      for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
        if (evicted_at_[u] == 0 || entries_.count(u) || in_flight_.count(u)) continue;
        if (unit < 0 || evicted_at_[u] < evicted_at_[unit]) unit = u;
      }
      if (unit < 0) return;  // none of the cache's pages left to give back
      evicted_at_[unit] = 0;
      stats_.expert_units_uncached++;
    }
    // Page-cache advice only: a range mapped again since keeps its pages.
    for (const Span& sp : MappedSpans(unit)) sp.mapping->DropFromPageCache(sp.offset, sp.bytes);
  }
}

std::vector<ExpertCache::Span> ExpertCache::MappedSpans(int unit) const {
  std::vector<Span> spans;
  if (options_.stager != nullptr) return spans;
  for (int m : units_[unit].tensors) {
    const Source& src = tensors_[m].source;
    if (!src.mapping) return {};
    spans.push_back({src.mapping.get(), src.offset, src.nbytes});
  }
  return MergeSpans(std::move(spans));
}

void ExpertCache::Advise(int unit) const {
  for (const Span& sp : MappedSpans(unit)) sp.mapping->WillNeed(sp.offset, sp.bytes);
}

absl::StatusOr<ExpertCache::Entry> ExpertCache::Read(int unit) {
  const auto start = std::chrono::steady_clock::now();
  if (std::vector<Span> spans = MappedSpans(unit); !spans.empty()) {
    // In place: the pages the page cache lacks are read from disk, counted
    // by this thread's I/O accounting (mincore() on the unmapped range looked
    // each page up in the page cache before the reads began).
    const uint64_t storage_before = ThreadStorageReadBytes();
    for (const Span& sp : spans) sp.mapping->WillNeed(sp.offset, sp.bytes);
    for (const Span& sp : spans) sp.mapping->Populate(sp.offset, sp.bytes);
    const uint64_t missing = ThreadStorageReadBytes() - storage_before;
    Entry entry;
    for (int m : units_[unit].tensors) {
      at::Tensor view = MappedView(tensors_[m].source);
      if (!view.defined()) {
        return absl::InternalError(
            absl::StrCat("tensor '", tensors_[m].name, "' is not aligned in its mapping"));
      }
      entry.values.push_back(std::move(view));
    }
    entry.spans = std::move(spans);
    CountRead(start, static_cast<int64_t>(missing));
    return entry;
  }
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
  CountRead(start, static_cast<int64_t>(read));
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_to_device += to_device;
  return entry;
}

void ExpertCache::CountRead(std::chrono::steady_clock::time_point start, int64_t bytes) {
  const int64_t us = std::chrono::duration_cast<std::chrono::microseconds>(
                         std::chrono::steady_clock::now() - start)
                         .count();
  std::lock_guard<std::mutex> lock(mu_);
  stats_.expert_fetches++;
  stats_.expert_read_us += us;
  stats_.expert_bytes_read += bytes;
}

absl::StatusOr<std::vector<std::vector<at::Tensor>>> ExpertCache::Acquire(
    absl::Span<const int> units) {
  std::vector<std::vector<at::Tensor>> out(units.size());
  std::vector<size_t> missing;
  std::vector<std::vector<Span>> refresh;
  const auto start = std::chrono::steady_clock::now();
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!units.empty()) {
      const int position = units_[units[0]].position;
      if (position < current_position_) ++step_;  // round again: a new step
      current_position_ = position;
    }
    for (int unit : units) CountUse(unit);
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
      if (e.prefetched && e.guess) CountGuess(true, e.guess_distance);
      e.prefetched = false;
      e.pins++;
      e.last_use = ++clock_;
      out[k] = e.values;
      if (!e.spans.empty()) refresh.push_back(e.spans);
    }
  }
  // A cached unit's pages may have been reclaimed since it was read (the
  // kernel takes mapped file pages under memory pressure): read back now, in
  // large requests, what faulting would read a window at a time in the
  // middle of the product.
  uint64_t refreshed = 0;
  for (const std::vector<Span>& spans : refresh) {
    uint64_t missing_bytes = 0;
    for (const Span& sp : spans) missing_bytes += sp.mapping->Missing(sp.offset, sp.bytes);
    if (missing_bytes == 0) continue;
    for (const Span& sp : spans) sp.mapping->WillNeed(sp.offset, sp.bytes);
    for (const Span& sp : spans) sp.mapping->Populate(sp.offset, sp.bytes);
    refreshed += missing_bytes;
  }
  if (refreshed > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.expert_bytes_read += static_cast<int64_t>(refreshed);
    stats_.expert_bytes_reread += static_cast<int64_t>(refreshed);
  }
  absl::Status failed;
  for (size_t k : missing) {
    const int unit = units[k];
    if (failed.ok()) KeepMemoryFree(units_[unit].bytes);
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
  {
    const int64_t us = std::chrono::duration_cast<std::chrono::microseconds>(
                           std::chrono::steady_clock::now() - start)
                           .count();
    std::lock_guard<std::mutex> lock(mu_);
    stats_.expert_wait_us += us;
  }
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
  std::vector<int> advise;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::deque<int>& queue = needed ? needed_ : guesses_;
    if (!needed && !units.empty()) {
      const int d = std::min(Distance(units[0]), kGuessDistances - 1);
      if (guess_rate_[d] < kMinGuessRate && guesses_seen_[d]++ % kGuessProbe != 0) return;
    }
    for (int unit : units) {
      if (entries_.count(unit) || in_flight_.count(unit)) continue;
      if (std::find(queue.begin(), queue.end(), unit) != queue.end()) continue;
      queue.push_back(unit);
      // The first two needed ones are asked of the disk now: the reader may
      // be busy with a guess, and the disk serves several requests at once.
      if (needed && advise.size() < 2) advise.push_back(unit);
    }
    while (guesses_.size() > kMaxGuesses) guesses_.pop_front();
    cv_.notify_all();
  }
  for (int unit : advise) Advise(unit);
}

void ExpertCache::ReaderLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !needed_.empty() || !guesses_.empty(); });
    if (stop_) return;
    const bool needed = !needed_.empty();
    int unit = -1;
    if (needed) {
      unit = needed_.front();
      needed_.pop_front();
    } else {
      // The guess for the nearest layer; guesses for the layer running now
      // or one passed are stale (its needed reads have been asked for).
      if (options_.positions > 1) {
        guesses_.erase(std::remove_if(guesses_.begin(), guesses_.end(),
                                      [&](int u) { return Distance(u) >= options_.positions - 1; }),
                       guesses_.end());
      }
      if (guesses_.empty()) continue;
      auto best = std::min_element(guesses_.begin(), guesses_.end(),
                                   [&](int a, int b) { return Distance(a) < Distance(b); });
      unit = *best;
      guesses_.erase(best);
    }
    if (entries_.count(unit) || in_flight_.count(unit)) continue;
    const int64_t bytes = units_[unit].bytes;
    if (bytes > options_.budget_bytes || !MakeRoom(bytes, needed ? -1 : unit)) continue;
    in_flight_[unit] = true;
    used_bytes_ += bytes;  // its room is taken while it is read
    // The next needed unit's pages are asked for now too, so the disk has
    // the next requests queued while this one's arrive (a unit small enough
    // to be read by the advice: FileMapping::WillNeed).
    const int after = needed && !needed_.empty() ? needed_.front() : -1;
    lock.unlock();
    KeepMemoryFree(bytes);
    if (after >= 0) Advise(after);
    absl::StatusOr<Entry> entry = Read(unit);
    lock.lock();
    in_flight_.erase(unit);
    if (entry.ok()) {
      entry->prefetched = true;
      entry->guess = !needed;
      entry->guess_distance = Distance(unit);
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
