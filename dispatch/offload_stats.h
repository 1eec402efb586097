// dispatch/offload_stats.h: what a DispatchedModel's offloading has done so
// far. Apart from dispatch.h so that readers of the counters (the server's
// metrics) need no libtorch headers.
#ifndef ACCEL_DISPATCH_OFFLOAD_STATS_H_
#define ACCEL_DISPATCH_OFFLOAD_STATS_H_

#include <cstdint>

namespace accel::dispatch {

struct OffloadStats {
  int64_t fetches = 0;        // modules brought in
  int64_t prefetch_hits = 0;  // of which the reader thread had already read
  int64_t bytes_read = 0;     // from disk into buffers
  // Disk weights used in place from their file's mapping (LoadOptions::
  // map_disk): brought in by the page cache, read from disk where it lacked
  // them; and of those, the bytes dropped from the process behind their
  // module to keep within the memory budget.
  int64_t bytes_mapped = 0;
  int64_t bytes_dropped = 0;
  // Copied to the main GPU on the copy stream (cpu and disk entries), by
  // the reader thread for prefetched modules.
  int64_t bytes_to_device = 0;
  // The expert cache (mixture-of-experts models with experts offloaded one
  // by one): experts read from their source (disk, or RAM for a GPU), uses
  // served from the cache, and of those the ones the reader had read ahead.
  int64_t expert_fetches = 0;
  int64_t expert_cache_hits = 0;
  int64_t expert_misses = 0;  // uses read in line, not cached (fetches = misses + read-aheads)
  int64_t expert_prefetch_hits = 0;
  // Guessed experts read ahead (the next layer's router on this layer's
  // stream), and how many of them were then used.
  int64_t expert_guess_reads = 0;
  int64_t expert_guess_hits = 0;
  int64_t expert_bytes_read = 0;  // from disk; also counted in bytes_read
  // Where a step's time goes: microseconds the running thread waited for
  // expert reads (in line, or for the reader to finish one it needed), and
  // microseconds spent reading experts (by either thread; overlapped with
  // compute when the reader did it ahead).
  int64_t expert_wait_us = 0;
  int64_t expert_read_us = 0;
  // Cached experts whose pages the kernel reclaimed under memory pressure and
  // that were read back before use (also in expert_bytes_read).
  int64_t expert_bytes_reread = 0;
  // Evicted experts whose pages the cache dropped from the page cache to keep
  // its free memory floor (ExpertCache::Options::keep_memory_free).
  int64_t expert_units_uncached = 0;

  // Every counter added: two models' offloading (a target and its draft) read as one.
  OffloadStats& operator+=(const OffloadStats& other) {
    fetches += other.fetches;
    prefetch_hits += other.prefetch_hits;
    bytes_read += other.bytes_read;
    bytes_mapped += other.bytes_mapped;
    bytes_dropped += other.bytes_dropped;
    bytes_to_device += other.bytes_to_device;
    expert_fetches += other.expert_fetches;
    expert_cache_hits += other.expert_cache_hits;
    expert_misses += other.expert_misses;
    expert_prefetch_hits += other.expert_prefetch_hits;
    expert_guess_reads += other.expert_guess_reads;
    expert_guess_hits += other.expert_guess_hits;
    expert_bytes_read += other.expert_bytes_read;
    expert_wait_us += other.expert_wait_us;
    expert_read_us += other.expert_read_us;
    expert_bytes_reread += other.expert_bytes_reread;
    expert_units_uncached += other.expert_units_uncached;
    return *this;
  }
};

}  // namespace accel::dispatch

#endif  // ACCEL_DISPATCH_OFFLOAD_STATS_H_
