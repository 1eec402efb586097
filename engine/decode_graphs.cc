#include "engine/decode_graphs.h"

#include <algorithm>

namespace accel::engine {

std::vector<int64_t> DecodeBatchBuckets(int64_t max_batch_size, int64_t largest) {
  std::vector<int64_t> buckets;
  const int64_t most = std::min(max_batch_size, largest);
  if (most < 1) return buckets;
  for (int64_t size : {1, 2, 4}) {
    buckets.push_back(size);
    if (size >= most) return buckets;
  }
  for (int64_t size = 8;; size += 8) {
    buckets.push_back(size);
    if (size >= most) return buckets;
  }
}

std::optional<int64_t> DecodeBucketFor(absl::Span<const int64_t> buckets, int64_t batch) {
  if (batch < 1) return std::nullopt;
  const auto found = std::lower_bound(buckets.begin(), buckets.end(), batch);
  if (found == buckets.end()) return std::nullopt;
  return *found;
}

}  // namespace accel::engine
