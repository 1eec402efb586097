#include "engine/kv_cache_manager.h"

#include <algorithm>
#include <cassert>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "core/bytes.h"

namespace accel::engine {
namespace {

// SplitMix64's finaliser: a strong 64-bit mix, so chained keys spread.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

BlockPool::BlockPool(int64_t num_blocks, int64_t block_size, bool prefix_caching)
    : block_size_(std::max<int64_t>(block_size, 1)),
      prefix_caching_(prefix_caching),
      blocks_(static_cast<size_t>(std::max<int64_t>(num_blocks, 0))) {
  free_.reserve(blocks_.size());
  // A stack handing out low ids first.
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

uint64_t BlockPool::ChainKey(uint64_t parent, absl::Span<const int64_t> ids) {
  uint64_t key = Mix(parent ^ 0x5bd1e995ULL);
  for (int64_t id : ids) key = Mix(key ^ static_cast<uint64_t>(id));
  // 0 means "no parent": keep it out of the keys.
  return key == 0 ? 1 : key;
}

BlockPool::Prefix BlockPool::MatchPrefix(absl::Span<const int64_t> ids, int64_t max_tokens) {
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

std::optional<int32_t> BlockPool::Allocate() {
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

void BlockPool::Seal(int32_t id, uint64_t key, absl::Span<const int64_t> ids) {
  if (!prefix_caching_) return;
  Block& block = blocks_[static_cast<size_t>(id)];
  if (block.key.has_value() || by_key_.count(key) > 0) return;
  block.key = key;
  block.ids.assign(ids.begin(), ids.end());
  by_key_.emplace(key, id);
}

void BlockPool::Release(int32_t id) {
  Block& block = blocks_[static_cast<size_t>(id)];
  assert(block.refs > 0);
  if (--block.refs > 0) return;
  if (block.key.has_value()) {
    block.lru = evictable_.insert(evictable_.end(), id);
  } else {
    free_.push_back(id);
  }
}

void BlockPool::Forget(int32_t id) {
  Block& block = blocks_[static_cast<size_t>(id)];
  if (block.key.has_value()) by_key_.erase(*block.key);
  block.key.reset();
  block.ids.clear();
}

std::optional<int64_t> KvCacheManager::Admit(uint64_t request, absl::Span<const int64_t> ids,
                                             int64_t first_tokens, bool use_prefix) {
  const int64_t input = static_cast<int64_t>(ids.size());
  if (pool_.BlocksFor(input) > pool_.free_blocks() + pool_.cached_blocks()) return std::nullopt;
  BlockPool::Prefix prefix = pool_.MatchPrefix(ids, use_prefix ? input - 1 : 0);
  if (pool_.BlocksFor(input) - static_cast<int64_t>(prefix.blocks.size()) > pool_.free_blocks()) {
    for (int32_t block : prefix.blocks) pool_.Release(block);
    return std::nullopt;
  }
  Table& table = tables_[request];
  for (int32_t block : table.blocks) pool_.Release(block);  // none: a request joins once at a time
  table.blocks = std::move(prefix.blocks);
  table.sealed = static_cast<int64_t>(table.blocks.size());
  table.key = prefix.key;
  const int64_t take = std::min(first_tokens, input - prefix.tokens);
  AllocateSlots(request, prefix.tokens + take);  // fits: checked above
  return prefix.tokens;
}

bool KvCacheManager::AllocateSlots(uint64_t request, int64_t tokens) {
  Table& table = tables_[request];
  const int64_t needed = pool_.BlocksFor(tokens) - static_cast<int64_t>(table.blocks.size());
  if (needed <= 0) return true;
  if (pool_.free_blocks() < needed) return false;
  for (int64_t i = 0; i < needed; ++i) table.blocks.push_back(*pool_.Allocate());
  return true;
}

void KvCacheManager::CacheFullBlocks(uint64_t request, absl::Span<const int64_t> ids,
                                     int64_t computed) {
  auto found = tables_.find(request);
  if (found == tables_.end()) return;
  Table& table = found->second;
  const int64_t block_size = pool_.block_size();
  while ((table.sealed + 1) * block_size <= computed &&
         table.sealed < static_cast<int64_t>(table.blocks.size())) {
    const absl::Span<const int64_t> block_ids = ids.subspan(table.sealed * block_size, block_size);
    table.key = BlockPool::ChainKey(table.key, block_ids);
    pool_.Seal(table.blocks[static_cast<size_t>(table.sealed)], table.key, block_ids);
    ++table.sealed;
  }
}

void KvCacheManager::Free(uint64_t request) {
  auto found = tables_.find(request);
  if (found == tables_.end()) return;
  for (int32_t block : found->second.blocks) pool_.Release(block);
  tables_.erase(found);
}

const std::vector<int32_t>& KvCacheManager::block_table(uint64_t request) const {
  static const std::vector<int32_t>* const kNone = new std::vector<int32_t>();
  auto found = tables_.find(request);
  return found == tables_.end() ? *kNone : found->second.blocks;
}

absl::StatusOr<int64_t> KvCacheBytes(const std::string& spec, double available,
                                     int64_t auto_bytes) {
  const bool is_auto = spec.empty() || spec == "auto";
  if (is_auto) return std::min<int64_t>(auto_bytes, static_cast<int64_t>(0.5 * available));
  double fraction = 0;
  if (spec.find('.') != std::string::npos && absl::SimpleAtod(spec, &fraction)) {
    if (!(fraction > 0 && fraction <= 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv_cache_memory=", spec, ": a fraction must be in (0, 1]; or give bytes (\"4GiB\")"));
    }
    return static_cast<int64_t>(fraction * available);
  }
  absl::StatusOr<int64_t> bytes = ParseByteSize(spec);
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_cache_memory=", spec,
        ": give bytes (\"4GiB\"), a fraction of the free memory (\"0.5\") or \"auto\"; ",
        bytes.status().message()));
  }
  return *bytes;
}

}  // namespace accel::engine
