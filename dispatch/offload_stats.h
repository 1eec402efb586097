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
  int64_t bytes_read = 0;     // from disk
  // Copied to the main GPU on the copy stream (cpu and disk entries), by
  // the reader thread for prefetched modules.
  int64_t bytes_to_device = 0;
};

}  // namespace accel::dispatch

#endif  // ACCEL_DISPATCH_OFFLOAD_STATS_H_
