// engine/kv_cache_manager.h: the KV-cache memory of the engine as fixed-size
// blocks (vLLM's BlockPool and KVCacheManager). Torch-free and not
// thread-safe: the engine core's thread owns it. The tensors behind the
// blocks are models::KvBlockStore's (models/causal_lm.h); this is the
// accounting.
//
// BlockPool: a fixed pool of blocks. Block b holds the keys and values of a
// sequence's tokens [b' * block_size, (b' + 1) * block_size) in every layer,
// where b' is b's place in that sequence's block table. Blocks come from a
// fixed pool, so the memory a batch may use is known before it runs, and a
// sequence that cannot get a block can be preempted instead of failing.
//
// Prefix caching: a full block is keyed by the hash chain of its tokens
// (its parent block's key and its own token ids), so two requests that share
// a prompt prefix share its blocks (reference counted). A released block
// that is keyed stays cached until its memory is needed, then is evicted
// least recently used first.
//
//   BlockPool pool(/*num_blocks=*/1024, /*block_size=*/16, /*prefix_caching=*/true);
//   BlockPool::Prefix hit = pool.MatchPrefix(prompt_ids, prompt_ids.size() - 1);
//   std::vector<int32_t> table = hit.blocks;      // hit.tokens tokens are computed
//   while (needs more) table.push_back(*pool.Allocate());
//   pool.Seal(table[i], key, ids_of_block_i);     // once block i is full
//   for (int32_t b : table) pool.Release(b);      // the sequence ends
//
// KvCacheManager: each request's block table over one pool, what the
// scheduler asks of KV memory (a request's computed prefix, room for its
// next tokens, caching its full blocks, freeing it).
#ifndef ACCEL_ENGINE_KV_CACHE_MANAGER_H_
#define ACCEL_ENGINE_KV_CACHE_MANAGER_H_

#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace accel::engine {

class BlockPool {
 public:
  BlockPool(int64_t num_blocks, int64_t block_size, bool prefix_caching);

  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }
  // Blocks Allocate() can hand out now: never used, released, or cached and
  // unreferenced (evictable).
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size() + evictable_.size()); }
  // Blocks some sequence holds.
  int64_t used_blocks() const { return num_blocks() - free_blocks(); }
  // Blocks that hold `tokens` tokens.
  int64_t BlocksFor(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  // The key of a full block: its parent's key (0 for the first block) and
  // its token ids.
  static uint64_t ChainKey(uint64_t parent, absl::Span<const int64_t> ids);

  struct Prefix {
    std::vector<int32_t> blocks;  // referenced for the caller; Release each
    int64_t tokens = 0;           // blocks.size() * block_size
    uint64_t key = 0;             // the last block's key (0: none)
  };
  // The longest run of cached full blocks that begins `ids`, covering at
  // most `max_tokens` tokens. Counts a query of the full blocks asked and
  // the hits. Empty without prefix caching.
  Prefix MatchPrefix(absl::Span<const int64_t> ids, int64_t max_tokens);

  // A block for one sequence (reference count 1): a free one, or the least
  // recently used cached one, whose key is forgotten. nullopt when every
  // block is held.
  std::optional<int32_t> Allocate();

  // Block `block` (held) is full with `ids` and keyed `key`: later requests
  // can find it. If another block already has that key, nothing changes.
  void Seal(int32_t block, uint64_t key, absl::Span<const int64_t> ids);

  // Drops one reference; at zero the block is free, or cached when keyed.
  void Release(int32_t block);

  int ref_count(int32_t block) const { return blocks_[static_cast<size_t>(block)].refs; }
  // Cached blocks (keyed), held or not.
  int64_t cached_blocks() const { return static_cast<int64_t>(by_key_.size()); }

  // Prefix-cache counters, in tokens of full blocks, as vLLM counts them.
  int64_t prefix_query_tokens() const { return query_tokens_; }
  int64_t prefix_hit_tokens() const { return hit_tokens_; }

 private:
  struct Block {
    int refs = 0;
    std::optional<uint64_t> key;
    std::vector<int64_t> ids;  // when keyed: checked on a match, so a hash collision is a miss
    std::list<int32_t>::iterator lru;  // in evictable_ when refs == 0 and keyed
  };
  void Forget(int32_t block);

  const int64_t block_size_;
  const bool prefix_caching_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;     // never used or released unkeyed (a stack)
  std::list<int32_t> evictable_;  // keyed, unreferenced; least recently used first
  std::unordered_map<uint64_t, int32_t> by_key_;
  int64_t query_tokens_ = 0;
  int64_t hit_tokens_ = 0;
};

class KvCacheManager {
 public:
  KvCacheManager(int64_t num_blocks, int64_t block_size, bool prefix_caching)
      : pool_(num_blocks, block_size, prefix_caching) {}

  int64_t num_blocks() const { return pool_.num_blocks(); }
  int64_t block_size() const { return pool_.block_size(); }
  int64_t free_blocks() const { return pool_.free_blocks(); }
  int64_t used_blocks() const { return pool_.used_blocks(); }
  int64_t BlocksFor(int64_t tokens) const { return pool_.BlocksFor(tokens); }
  // Tokens the pool holds in all.
  int64_t capacity_tokens() const { return num_blocks() * block_size(); }
  const BlockPool& pool() const { return pool_; }

  // A waiting request joins: its longest cached prefix (at most
  // ids.size() - 1 tokens: one token is always computed) and blocks for its
  // first `first_tokens` tokens after it, if the blocks its whole input
  // needs are free (the rest of a prompt read in chunks must not wait for
  // memory). Returns the prefix's tokens (computed already), or nullopt
  // with nothing held. `first_tokens` is capped to what is left of `ids`.
  // `use_prefix` false: no cached prefix is taken (the whole input is
  // computed; its full blocks are still cached for others).
  std::optional<int64_t> Admit(uint64_t request, absl::Span<const int64_t> ids,
                               int64_t first_tokens, bool use_prefix = true);

  // Blocks so that `request`'s table covers `tokens` positions; false (and
  // nothing allocated) when not enough are free.
  bool AllocateSlots(uint64_t request, int64_t tokens);

  // Keys every full block among `request`'s first `computed` tokens (`ids`
  // holds at least that many) for the prefix cache.
  void CacheFullBlocks(uint64_t request, absl::Span<const int64_t> ids, int64_t computed);

  // Releases every block of `request` (it finished, or is preempted).
  void Free(uint64_t request);

  // `request`'s blocks, in order (empty when it holds none).
  const std::vector<int32_t>& block_table(uint64_t request) const;

 private:
  struct Table {
    std::vector<int32_t> blocks;
    int64_t sealed = 0;  // blocks keyed for the prefix cache
    uint64_t key = 0;    // the last keyed block's key
  };
  BlockPool pool_;
  std::unordered_map<uint64_t, Table> tables_;
};

// The KV cache's bytes as --kv_cache_memory asks ("4GiB", a fraction of
// `available` such as "0.5", or "auto": `auto_bytes`, at most half of
// `available`). InvalidArgument naming --kv_cache_memory for a bad value.
absl::StatusOr<int64_t> KvCacheBytes(const std::string& spec, double available, int64_t auto_bytes);

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_KV_CACHE_MANAGER_H_
