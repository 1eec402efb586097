// The expert cache: offloaded experts of mixture-of-experts blocks, brought
// to the execution device one expert at a time, as the router picks them,
// and kept there within a byte budget (least recently used out first).
//
// Accelerate's hooks load an offloaded expert each time it runs and drop it
// after; a whole-block fetch loads every expert of the block. Here a step
// reads only the experts its tokens were routed to and are not cached, and
// the reader thread reads ahead the experts a caller expects next (the next
// layer's router applied to the current hidden state, for example).
//
// Two threads: the compute thread calls Acquire / Release / Prefetch; the
// reader thread serves Prefetch. An acquired unit is pinned (never evicted)
// until released; a unit needed now and not cached is read on the compute
// thread, past the budget if pinned units leave no room (the budget is then
// restored as they are released), so a step never fails for want of room.
#ifndef ACCEL_DISPATCH_INTERNAL_EXPERT_CACHE_H_
#define ACCEL_DISPATCH_INTERNAL_EXPERT_CACHE_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
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

class ExpertCache {
 public:
  struct Options {
    int64_t budget_bytes = 0;
    at::Device device = at::kCPU;    // the execution device
    DeviceStager* stager = nullptr;  // a GPU device's copy stream; not owned
    bool drop_pages = false;         // see ReadRange
  };

  // `tensors` is the dispatch core's table of offloaded tensors; it must
  // outlive the cache and not change while it runs.
  ExpertCache(const std::vector<Offloaded>& tensors, const Options& options);
  ~ExpertCache();  // stops the reader thread
  ExpertCache(const ExpertCache&) = delete;
  ExpertCache& operator=(const ExpertCache&) = delete;

  // A unit (one expert) made of these entries of `tensors`; returns its id.
  int AddUnit(std::vector<int> tensors);
  const std::vector<int>& members(int unit) const { return units_[unit].tensors; }

  // Pins `units` (distinct) and returns their values (device tensors, in member order),
  // reading those that are not cached. Errors are the read's, naming the tensor.
  absl::StatusOr<std::vector<std::vector<at::Tensor>>> Acquire(absl::Span<const int> units);
  // Unpins what Acquire pinned.
  void Release(absl::Span<const int> units);
  // Asks the reader thread to bring these in ahead of use, as far as the
  // budget allows without evicting pinned units. Best effort: a failed read
  // is forgotten here and surfaces, if it persists, in Acquire.
  void Prefetch(absl::Span<const int> units);

  // Adds the expert counters (and the bytes read) to `stats`.
  void AddStats(OffloadStats& stats) const;
  int64_t cached_bytes() const;

 private:
  struct Unit {
    std::vector<int> tensors;
    int64_t bytes = 0;
  };
  struct Entry {
    std::vector<at::Tensor> values;
    std::vector<at::Tensor> buffers;  // host buffers (disk reads), reused after eviction
    int pins = 0;
    uint64_t last_use = 0;
    bool prefetched = false;  // brought by the reader and not used since
  };

  // Reads one unit (no lock held). `reuse` are host buffers from evictions.
  absl::StatusOr<Entry> Read(int unit);
  // Evicts unpinned entries, oldest first, until `bytes` more fit; whether they do.
  bool MakeRoom(int64_t bytes);  // mu_ held
  void ReaderLoop();

  const std::vector<Offloaded>& tensors_;
  const Options options_;
  std::vector<Unit> units_;  // grows on the compute thread; guarded by mu_ for the reader

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<int, Entry> entries_;
  std::unordered_map<int, bool> in_flight_;  // unit -> read by the reader (true) or inline
  std::deque<int> queue_;                    // prefetch requests
  std::multimap<std::pair<uint64_t, int>, at::Tensor> free_buffers_;  // (bytes, dtype)
  int64_t used_bytes_ = 0;
  uint64_t clock_ = 0;
  bool stop_ = false;
  OffloadStats stats_;
  std::thread reader_;
};

}  // namespace accel::dispatch::internal

#endif  // ACCEL_DISPATCH_INTERNAL_EXPERT_CACHE_H_
