// The expert cache: offloaded experts of mixture-of-experts blocks, brought
// to the execution device one expert at a time, as the router picks them,
// and kept there within a byte budget.
//
// Accelerate's hooks load an offloaded expert each time it runs and drop it
// after; a whole-block fetch loads every expert of the block. Here a step
// reads only the experts its tokens were routed to that are not cached; the
// reader thread reads the rest of a block's picked experts while the first
// ones compute, and reads ahead experts a caller guesses it will need.
//
// Replacement keeps what the routing reuses: each unit has a score, its uses
// counted with a decay of kScoreDecay a step (a pass over the sparse layers),
// so it follows how often the router picks it lately; the cache evicts the
// unpinned unit of the lowest score. Among equal scores (units never used, or
// a step that uses every expert once, as a long prompt's does) it evicts the
// unit whose next use can come latest: experts are used in a cycle, the
// sparse layers in order, so that is the one whose layer comes farthest
// after the layer being run (the layer just run first, the next layer last),
// the least recently used among those. Frequency is what decode at batch 1
// needs (its routing picks a few experts per layer again and again: the ones
// it picks most stay); the cycle is what a step whose experts do not all fit
// needs (a stable part of them stays, where least-recently-used evicts each
// expert just before its layer comes round and hits nothing).
//
// Guesses cost a read when wrong, which on a disk-bound step is read time a
// needed expert waits for, and save only the overlap with compute when
// right: the cache keeps a running rate of guesses used for each distance
// (guesses for the next sparse layer, the one after, ...), and while a
// distance's rate is under kMinGuessRate reads only one of its guesses in
// kGuessProbe (to notice when guessing gets better). The reader reads the
// guess for the nearest layer first, and drops guesses for layers passed.
//
// Where units come from: a unit whose tensors are mapped from their files
// (a cpu execution device, Source::mapping) is used in place, the page
// cache's own pages: reading it makes them resident (MADV_WILLNEED, so the
// kernel reads in large requests several at once, then MADV_POPULATE_READ),
// and evicting it unmaps them (the page cache keeps them until the kernel
// needs the memory: a second level of cache; or drops them too with
// Options::release_pages), so the cache's budget is the memory its units
// hold and a warm page cache (a run before this one) is read at memory speed. Other
// units are read into buffers (ReadCoalesced, O_DIRECT when asked), and
// staged to a GPU execution device.
//
// Two threads: the compute thread calls Acquire / Release / Prefetch; the
// reader thread serves Prefetch. An acquired unit is pinned (never evicted)
// until released; a unit needed now and not cached is read on the compute
// thread, past the budget if pinned units leave no room (the budget is then
// restored as they are released), so a step never fails for want of room.
#ifndef ACCEL_DISPATCH_INTERNAL_EXPERT_CACHE_H_
#define ACCEL_DISPATCH_INTERNAL_EXPERT_CACHE_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "dispatch/internal/device_stager.h"
#include "dispatch/internal/offloaded.h"
#include "dispatch/offload_stats.h"

namespace accel::dispatch::internal {

// Below this share of guesses used, guessing is mostly off (see ExpertCache).
inline constexpr double kMinGuessRate = 0.7;
inline constexpr uint64_t kGuessProbe = 8;
// Guesses are told apart by distance up to this many layers ahead.
inline constexpr int kGuessDistances = 4;
// A use's weight in a unit's score after n steps: kScoreDecay^n (a half-life
// of about 23 steps).
inline constexpr double kScoreDecay = 0.97;

class ExpertCache {
 public:
  struct Options {
    int64_t budget_bytes = 0;
    DeviceStager* stager = nullptr;  // a GPU execution device's copy stream; not owned
    bool direct = false;             // disk reads bypass the page cache (ReadCoalesced)
    int positions = 1;               // sparse layers in the cycle
    // Mapped units: an evicted unit's pages leave the page cache too, rather
    // than stay there (as a second level of cache the kernel reclaims first).
    bool release_pages = false;
    // Mapped units kept in the page cache after eviction (release_pages
    // false) stay there only while the machine's free memory is above a
    // floor (four of the largest units and 256 MiB) plus the unit about to
    // be read: below it, the cache drops the pages of the units it evicted
    // longest ago before it reads, so a read lands in free memory. Left to
    // the kernel, every read into a full page cache waited for reclaim and
    // compaction (kswapd's scans, direct compaction stalls) on the same two
    // cores as the forward.
    bool keep_memory_free = false;
    // The machine's free memory in bytes (tests stand in their own); unset:
    // FreeHostMemory().
    std::function<int64_t()> free_memory;
  };

  // `tensors` is the dispatch core's table of offloaded tensors; it must
  // outlive the cache and not change while it runs.
  ExpertCache(const std::vector<Offloaded>& tensors, const Options& options);
  ~ExpertCache();  // stops the reader thread
  ExpertCache(const ExpertCache&) = delete;
  ExpertCache& operator=(const ExpertCache&) = delete;

  // A unit (one expert) made of these entries of `tensors`, in the sparse
  // layer at `position` of the cycle; returns its id. Before any use.
  int AddUnit(std::vector<int> tensors, int position);
  const std::vector<int>& members(int unit) const { return units_[unit].tensors; }

  // Pins `units` (distinct) and returns their values (on the execution
  // device, in member order), reading those that are not cached; waits for
  // the reader where it is reading one. Errors are the read's, naming the
  // tensor; nothing stays pinned then.
  absl::StatusOr<std::vector<std::vector<at::Tensor>>> Acquire(absl::Span<const int> units);
  // Unpins what Acquire pinned.
  void Release(absl::Span<const int> units);
  // Asks the reader thread to read these. `needed`: units a step is about to
  // acquire, read first, in order, evicting as needed (never a pinned unit).
  // Otherwise guesses, read after those, only into room that evicts nothing
  // pinned and nothing needed sooner. Best effort: a failed read is
  // forgotten here and surfaces, if it persists, in Acquire.
  void Prefetch(absl::Span<const int> units, bool needed);
  // Whether the unit is cached now.
  bool Cached(int unit) const;

  // Adds the expert counters (and the bytes read) to `stats`.
  void AddStats(OffloadStats& stats) const;
  int64_t cached_bytes() const;

 private:
  struct Unit {
    std::vector<int> tensors;
    int64_t bytes = 0;
    int position = 0;
    double score = 0;  // decayed uses, as of step `score_step`
    uint64_t score_step = 0;
  };
  // A range of a mapped file that a unit uses in place.
  using Span = MappedSpan;
  struct Entry {
    std::vector<at::Tensor> values;
    std::vector<at::Tensor> buffers;  // host buffers (disk reads), reused after eviction
    std::vector<Span> spans;          // mapped units: given back on eviction
    int pins = 0;
    uint64_t last_use = 0;
    bool prefetched = false;  // brought by the reader and not used since
    bool guess = false;       // ... as a guess
    int guess_distance = 0;   // ... made this many sparse layers ahead
  };

  // A guess read ahead was used (or evicted unused): the running rate.
  void CountGuess(bool used, int distance);  // mu_ held
  // One expert read of `bytes` from disk that took since `start`.
  void CountRead(std::chrono::steady_clock::time_point start, int64_t bytes);
  // Reads one unit (no lock held).
  absl::StatusOr<Entry> Read(int unit);
  // A mapped unit's file ranges (adjacent ones merged); empty for a unit
  // that is read into buffers.
  std::vector<Span> MappedSpans(int unit) const;
  // Starts reading a mapped unit's pages (no lock needed).
  void Advise(int unit) const;
  // How far after the layer being run a unit's layer comes (larger: used later).
  int Distance(int unit) const;  // mu_ held
  // The unit's decayed uses now, and one more use of it.
  double Score(int unit) const;  // mu_ held
  void CountUse(int unit);       // mu_ held
  // Whether `a` should be evicted before `b` (lower score; then used later).
  bool EvictsBefore(int a, int b) const;  // mu_ held
  // Evicts unpinned entries that will be used later than `unit` would be
  // (any, for unit -1), farthest first, until `bytes` more fit; whether they do.
  bool MakeRoom(int64_t bytes, int unit = -1);  // mu_ held
  void ReaderLoop();
  // Before a read of `incoming` bytes: drops evicted units' pages from the
  // page cache, those evicted longest ago first, until the free memory
  // floor (Options::keep_memory_free) and `incoming` fit or none is left
  // (no lock held).
  void KeepMemoryFree(int64_t incoming);

  const std::vector<Offloaded>& tensors_;
  const Options options_;
  std::vector<Unit> units_;  // complete before use

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<int, Entry> entries_;
  std::unordered_map<int, bool> in_flight_;  // unit -> being read (by the reader: true)
  std::deque<int> needed_;                   // prefetch requests, in order
  std::deque<int> guesses_;
  BufferPool buffers_;  // reused by reads after evictions
  int64_t used_bytes_ = 0;
  uint64_t clock_ = 0;
  int current_position_ = 0;  // the layer of the latest Acquire
  uint64_t step_ = 0;         // passes over the sparse layers (scores decay by them)
  // Running share of guesses read that were used, by distance.
  double guess_rate_[kGuessDistances] = {1.0, 1.0, 1.0, 1.0};
  uint64_t guesses_seen_[kGuessDistances] = {};
  // By unit: when it was last evicted with its pages left in the page cache
  // (an eviction count), 0 once they are dropped or for units never evicted;
  // the oldest of the units not cached again are dropped first.
  std::vector<uint64_t> evicted_at_;
  uint64_t evictions_ = 0;
  int64_t largest_unit_bytes_ = 0;
  bool stop_ = false;
  OffloadStats stats_;
  std::thread reader_;
};

}  // namespace accel::dispatch::internal

#endif  // ACCEL_DISPATCH_INTERNAL_EXPERT_CACHE_H_
