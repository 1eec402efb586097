#include "engine/ngram_proposer.h"

#include <algorithm>

namespace accel::engine {

std::vector<int64_t> NgramProposer::Propose(absl::Span<const int64_t> ids, int64_t limit) const {
  std::vector<int64_t> drafts;
  const int64_t size = static_cast<int64_t>(ids.size());
  limit = std::min(limit, k_);
  if (limit <= 0) return drafts;
  // Longest n first. A match of n tokens ending before the last one: its
  // continuation starts at most at the sequence's last token.
  for (int64_t n = std::min(max_n_, size - 1); n >= min_n_; --n) {
    const absl::Span<const int64_t> suffix = ids.subspan(size - n, n);
    for (int64_t start = 0; start + n < size; ++start) {
      if (!std::equal(suffix.begin(), suffix.end(), ids.begin() + start)) continue;
      const int64_t from = start + n;
      const int64_t count = std::min(limit, size - from);
      drafts.assign(ids.begin() + from, ids.begin() + from + count);
      return drafts;
    }
  }
  return drafts;
}

}  // namespace accel::engine
