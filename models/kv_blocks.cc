#include "models/kv_blocks.h"

#include <algorithm>
#include <cassert>

namespace accel::models {
namespace {

// SplitMix64's finaliser: a strong 64-bit mix, so chained keys spread.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

KvBlockManager::KvBlockManager(int64_t num_blocks, int64_t block_size, bool prefix_caching)
    : block_size_(std::max<int64_t>(block_size, 1)),
      prefix_caching_(prefix_caching),
      blocks_(static_cast<size_t>(std::max<int64_t>(num_blocks, 0))) {
  free_.reserve(blocks_.size());
  // A stack handing out low ids first.
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

uint64_t KvBlockManager::ChainKey(uint64_t parent, absl::Span<const int64_t> ids) {
  uint64_t key = Mix(parent ^ 0x5bd1e995ULL);
  for (int64_t id : ids) key = Mix(key ^ static_cast<uint64_t>(id));
  // 0 means "no parent": keep it out of the keys.
  return key == 0 ? 1 : key;
}

KvBlockManager::Prefix KvBlockManager::MatchPrefix(absl::Span<const int64_t> ids,
                                                   int64_t max_tokens) {
  Prefix prefix;
  if (!prefix_caching_) return prefix;
  const int64_t full =
      std::min<int64_t>(static_cast<int64_t>(ids.size()), max_tokens) / block_size_;
  query_tokens_ += full * block_size_;
  uint64_t key = 0;
  for (int64_t b = 0; b < full; ++b) {
    const absl::Span<const int64_t> block_ids = ids.subspan(b * block_size_, block_size_);
    key = ChainKey(key, block_ids);
    auto found = by_key_.find(key);
    if (found == by_key_.end()) break;
    Block& block = blocks_[static_cast<size_t>(found->second)];
    if (!std::equal(block.ids.begin(), block.ids.end(), block_ids.begin(), block_ids.end())) break;
    if (block.refs == 0) evictable_.erase(block.lru);
    ++block.refs;
    prefix.blocks.push_back(found->second);
    prefix.key = key;
  }
  prefix.tokens = static_cast<int64_t>(prefix.blocks.size()) * block_size_;
  hit_tokens_ += prefix.tokens;
  return prefix;
}

std::optional<int32_t> KvBlockManager::Allocate() {
  int32_t id = 0;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else if (!evictable_.empty()) {
    id = evictable_.front();
    evictable_.pop_front();
    Forget(id);
  } else {
    return std::nullopt;
  }
  Block& block = blocks_[static_cast<size_t>(id)];
  assert(block.refs == 0);
  block.refs = 1;
  return id;
}

void KvBlockManager::Seal(int32_t id, uint64_t key, absl::Span<const int64_t> ids) {
  if (!prefix_caching_) return;
  Block& block = blocks_[static_cast<size_t>(id)];
  if (block.key.has_value() || by_key_.count(key) > 0) return;
  block.key = key;
  block.ids.assign(ids.begin(), ids.end());
  by_key_.emplace(key, id);
}

void KvBlockManager::Release(int32_t id) {
  Block& block = blocks_[static_cast<size_t>(id)];
  assert(block.refs > 0);
  if (--block.refs > 0) return;
  if (block.key.has_value()) {
    block.lru = evictable_.insert(evictable_.end(), id);
  } else {
    free_.push_back(id);
  }
}

void KvBlockManager::Forget(int32_t id) {
  Block& block = blocks_[static_cast<size_t>(id)];
  if (block.key.has_value()) by_key_.erase(*block.key);
  block.key.reset();
  block.ids.clear();
}

}  // namespace accel::models
