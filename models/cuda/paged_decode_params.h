// models/cuda/paged_decode_params.h: what the paged decode attention kernels
// (models/cuda/attention_kernels.h) compute, their parameters, and the plan
// they follow: which positions a split covers, where a position's key lives
// in the block store, how a CTA's threads and shared memory are laid out.
// Torch-free and CUDA-free: the functions are host + device under nvcc and
// plain inline functions elsewhere, so the kernels and the tests on a
// machine without a GPU use the same code.
//
// One query token per sequence attends over the keys and values of its
// blocks, read in place through its block table (the layout of
// models::KvBlockStore: [num_blocks, kv_heads, block_size, head_dim] per
// layer). Query heads share kv heads in groups (GQA: one CTA reads a kv
// head's keys and values once for its whole group). With a window, the query
// at position total - 1 sees key j when total - 1 - j < window. Scores are
// q.k with q scaled first (float(q) * scale in float32), then, with a
// soft-cap, tanh(s / cap) * cap; the softmax and the weighted sum run in
// float32 whatever the storage dtype, and the output is rounded once to it.
//
// Long contexts are split over the sequence (flash-decoding): each CTA takes
// one (kv head, sequence, split of `partition` positions) and writes its
// unnormalised weighted sum with the split's max score and sum of
// exponentials; a reduce kernel combines a sequence's splits. When every
// sequence has one split the decode kernel writes the output itself.
#ifndef ACCEL_MODELS_CUDA_PAGED_DECODE_PARAMS_H_
#define ACCEL_MODELS_CUDA_PAGED_DECODE_PARAMS_H_

#include <cstdint>

#if defined(__CUDACC__)
#define ACCEL_MODELS_HD __host__ __device__ __forceinline__
#else
#define ACCEL_MODELS_HD inline
#endif

namespace accel::models::cuda {

// Storage of q, keys, values and the output. bfloat16 and float16 are their
// 16-bit patterns (at::BFloat16 / at::Half / __nv_bfloat16 / __half).
enum class KvDType { kFloat32, kBFloat16, kFloat16 };

ACCEL_MODELS_HD int32_t KvDTypeSize(KvDType dtype) { return dtype == KvDType::kFloat32 ? 4 : 2; }

// head_dim and value_dim: a multiple of 8 and at most this (every supported
// family: 64, 80, 96, 128, 256).
inline constexpr int32_t kMaxHeadDim = 256;
// Threads of a decode CTA.
inline constexpr int32_t kDecodeThreads = 128;
// Positions per split before the occupancy rule (vLLM's paged attention v2
// uses 512 too), and the smallest split the plan makes.
inline constexpr int32_t kDefaultPartition = 512;
inline constexpr int32_t kMinPartition = 32;
// Query heads whose weighted sums a thread holds in registers at once.
inline constexpr int32_t kValueHeadTile = 4;
// Each thread of a key or value row holds at most this many 16-byte chunks
// of it (head_dim, value_dim <= 256 with 128 threads).
inline constexpr int32_t kMaxChunksPerLane = 2;
// Rows a thread loads before it uses the first: reads in flight.
inline constexpr int32_t kKeyUnroll = 4;
inline constexpr int32_t kValueUnroll = 2;
// The decode kernel's shared memory stays within the default limit.
inline constexpr int64_t kDecodeSharedLimit = 48 * 1024;

struct PagedDecodeParams {
  const void* q = nullptr;             // [seqs, heads, head_dim]
  const void* key_blocks = nullptr;    // [num_blocks, kv_heads, block_size, head_dim]
  const void* value_blocks = nullptr;  // [num_blocks, kv_heads, block_size, value_dim]
  // [seqs, table_stride]: sequence s's blocks in order; the first
  // ceil(totals[s] / block_size) are read.
  const int32_t* block_tables = nullptr;
  const int32_t* totals = nullptr;  // [seqs]: positions attended (past + this token), >= 1
  void* out = nullptr;              // [seqs, heads, value_dim]
  // The splits' partial results, PagedDecodeWorkspaceFloats floats (unused
  // when max_splits == 1).
  float* workspace = nullptr;
  int64_t num_blocks = 0;
  int32_t seqs = 0, heads = 0, kv_heads = 0, block_size = 0, head_dim = 0, value_dim = 0;
  int32_t table_stride = 0;
  int32_t window = 0;     // 0: none
  int32_t partition = 0;  // positions per split
  // Splits of the sequence that has most: PagedDecodeSplits over the totals.
  int32_t max_splits = 1;
  float scale = 1.0f;    // q * scale (a rule that divides passes 1 / its divisor)
  float softcap = 0.0f;  // 0: none
};

// The first position a query at total - 1 sees.
ACCEL_MODELS_HD int32_t FirstAttended(int32_t total, int32_t window) {
  return window > 0 && total > window ? total - window : 0;
}

// Splits of a sequence of `total` positions: the attended positions cut at
// multiples of `partition` (positions before the window are not split).
ACCEL_MODELS_HD int32_t PagedDecodeSplits(int32_t total, int32_t window, int32_t partition) {
  return (total + partition - 1) / partition - FirstAttended(total, window) / partition;
}

// The most splits a sequence of at most `max_total` positions has: what a
// static step (its plan fixed by a longest context, every row's total read on
// the device) must launch. Without a window the longest sequence has the
// most; with one, a shorter sequence can have one more than the longest,
// since its window of `window` positions may straddle one more cut: at most
// ceil((window - 1) / partition) + 1 splits.
ACCEL_MODELS_HD int32_t PagedDecodeMaxSplits(int32_t max_total, int32_t window, int32_t partition) {
  const int32_t unwindowed = (max_total + partition - 1) / partition;
  if (window <= 0 || max_total <= window) return unwindowed;
  const int32_t windowed = (window - 1 + partition - 1) / partition + 1;
  return windowed < unwindowed ? windowed : unwindowed;
}

struct PositionRange {
  int32_t begin = 0, end = 0;  // [begin, end); empty when begin >= end
};

// The positions split `split` of a sequence covers; empty past its last split.
ACCEL_MODELS_HD PositionRange SplitPositions(int32_t total, int32_t window, int32_t partition,
                                             int32_t split) {
  const int32_t first = FirstAttended(total, window);
  const int32_t cut = first / partition + split;
  PositionRange r;
  r.begin = cut * partition > first ? cut * partition : first;
  r.end = (cut + 1) * partition < total ? (cut + 1) * partition : total;
  return r;
}

// Where position `pos` of kv head `kv_head` starts in a layer's blocks of
// rows `width` elements long, through the sequence's block table.
ACCEL_MODELS_HD int64_t KvRowOffset(const int32_t* table, int32_t pos, int32_t block_size,
                                    int32_t kv_heads, int32_t kv_head, int32_t width) {
  const int64_t block = table[pos / block_size];
  return ((block * kv_heads + kv_head) * block_size + pos % block_size) * width;
}

// How a decode CTA of `threads` threads divides its work, and its shared
// memory (in floats, one region after another).
struct DecodeLayout {
  int32_t group = 0;          // query heads per kv head
  int32_t vec = 0;            // elements per 16-byte load
  int32_t chunks = 0;         // head_dim / vec
  int32_t lanes = 0;          // threads per key: a power of two <= 32
  int32_t keys_per_pass = 0;  // threads / lanes
  int32_t value_chunks = 0;   // value_dim / vec
  int32_t value_lanes = 0;    // threads per value row: a power of two <= 32
  int32_t value_slots = 0;    // value rows at a time: threads / value_lanes
  int64_t q_floats = 0;       // [group, head_dim]: q * scale
  // [warps, kValueHeadTile, value_dim]: the warps' weighted sums, in the
  // region of q (read only before them).
  int64_t warp_sum_floats = 0;
  int64_t q_region_floats = 0;  // the larger of the two
  int64_t score_floats = 0;     // [group, partition]: scores, then exponentials
  int64_t stat_floats = 0;      // [2, group]: each head's max and sum of exponentials
  int64_t total_floats = 0;
};

// Threads a row of `chunks` 16-byte chunks is read by: the least power of
// two that holds it at kMaxChunksPerLane a thread, at most a warp.
ACCEL_MODELS_HD int32_t LanesFor(int32_t chunks) {
  int32_t lanes = 1;
  while (lanes < 32 && lanes < chunks) lanes *= 2;
  return lanes;
}

ACCEL_MODELS_HD DecodeLayout MakeDecodeLayout(int32_t heads, int32_t kv_heads, int32_t head_dim,
                                              int32_t value_dim, int32_t partition,
                                              int32_t elem_size, int32_t threads) {
  DecodeLayout l;
  l.group = heads / kv_heads;
  l.vec = 16 / elem_size;
  l.chunks = head_dim / l.vec;
  l.lanes = LanesFor(l.chunks);
  l.keys_per_pass = threads / l.lanes;
  l.value_chunks = value_dim / l.vec;
  l.value_lanes = LanesFor(l.value_chunks);
  l.value_slots = threads / l.value_lanes;
  l.q_floats = static_cast<int64_t>(l.group) * head_dim;
  l.warp_sum_floats = static_cast<int64_t>(threads / 32) * kValueHeadTile * value_dim;
  l.q_region_floats = l.q_floats > l.warp_sum_floats ? l.q_floats : l.warp_sum_floats;
  l.score_floats = static_cast<int64_t>(l.group) * partition;
  l.stat_floats = 2 * static_cast<int64_t>(l.group);
  l.total_floats = l.q_region_floats + l.score_floats + l.stat_floats;
  return l;
}

// Floats of workspace for max_splits > 1: per (sequence, head, split) a
// value_dim sum, then per (sequence, head, split) a max, then a sum.
ACCEL_MODELS_HD int64_t PagedDecodeWorkspaceFloats(int32_t seqs, int32_t heads, int32_t value_dim,
                                                   int32_t max_splits) {
  if (max_splits <= 1) return 0;
  return static_cast<int64_t>(seqs) * heads * max_splits * (value_dim + 2);
}

// The split workspace's three arrays.
struct SplitWorkspace {
  float* sums = nullptr;      // [seqs, heads, max_splits, value_dim]
  float* maxes = nullptr;     // [seqs, heads, max_splits]
  float* exp_sums = nullptr;  // [seqs, heads, max_splits]
};

ACCEL_MODELS_HD SplitWorkspace SplitArrays(const PagedDecodeParams& p) {
  SplitWorkspace w;
  const int64_t entries = static_cast<int64_t>(p.seqs) * p.heads * p.max_splits;
  w.sums = p.workspace;
  w.maxes = p.workspace + entries * p.value_dim;
  w.exp_sums = w.maxes + entries;
  return w;
}

// Shared memory, in bytes, of one decode CTA.
inline int64_t PagedDecodeSharedBytes(const PagedDecodeParams& p, KvDType dtype) {
  const DecodeLayout l = MakeDecodeLayout(p.heads, p.kv_heads, p.head_dim, p.value_dim, p.partition,
                                          KvDTypeSize(dtype), kDecodeThreads);
  return l.total_floats * static_cast<int64_t>(sizeof(float));
}

// The split length for a step whose longest sequence has `max_total`
// positions: kDefaultPartition, halved (down to kMinPartition) until a CTA's
// scores fit the shared-memory limit; then, with `sm_count` > 0, halved
// (down to 64) while the step has fewer than two CTAs per SM, which is what
// flash-decoding is for: a batch of one long sequence would otherwise run
// on kv_heads SMs. (The longest sequence counts for all: a step's CTAs of
// shorter ones may have less to do.)
inline int32_t ChoosePagedPartition(int32_t seqs, int32_t heads, int32_t kv_heads, int32_t head_dim,
                                    int32_t value_dim, int32_t max_total, int32_t window,
                                    KvDType dtype, int32_t sm_count) {
  int32_t p = kDefaultPartition;
  auto shared_bytes = [&](int32_t partition) {
    const DecodeLayout l = MakeDecodeLayout(heads, kv_heads, head_dim, value_dim, partition,
                                            KvDTypeSize(dtype), kDecodeThreads);
    return l.total_floats * static_cast<int64_t>(sizeof(float));
  };
  while (p > kMinPartition && shared_bytes(p) > kDecodeSharedLimit) p /= 2;
  if (sm_count > 0) {
    while (p > 64 &&
           static_cast<int64_t>(seqs) * kv_heads * PagedDecodeSplits(max_total, window, p) <
               2 * static_cast<int64_t>(sm_count)) {
      p /= 2;
    }
  }
  return p;
}

// Why the kernels cannot take these parameters, or null when they can. The
// device data (totals, block numbers) is the caller's to check.
inline const char* CheckPagedDecodeParams(const PagedDecodeParams& p, KvDType dtype) {
  if (p.q == nullptr || p.key_blocks == nullptr || p.value_blocks == nullptr ||
      p.block_tables == nullptr || p.totals == nullptr || p.out == nullptr) {
    return "a null pointer";
  }
  if (p.max_splits > 1 && p.workspace == nullptr) return "no workspace for the splits";
  if (p.seqs < 1 || p.seqs > 65535) return "seqs outside [1, 65535]";
  if (p.heads < 1 || p.kv_heads < 1 || p.heads % p.kv_heads != 0) {
    return "heads must be a positive multiple of kv_heads";
  }
  if (p.block_size < 1 || p.num_blocks < 1 || p.table_stride < 1) {
    return "block_size, num_blocks and table_stride must be positive";
  }
  if (p.head_dim < 8 || p.head_dim > kMaxHeadDim || p.head_dim % 8 != 0 || p.value_dim < 8 ||
      p.value_dim > kMaxHeadDim || p.value_dim % 8 != 0) {
    return "head_dim and value_dim must be multiples of 8 in [8, 256]";
  }
  if (p.window < 0 || p.partition < 1 || p.max_splits < 1 || p.max_splits > 65535) {
    return "window, partition or max_splits out of range";
  }
  if (!(p.softcap >= 0.0f) || !(p.scale == p.scale)) return "a NaN or negative soft-cap or scale";
  const auto address = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); };
  if (address(p.key_blocks) % 16 != 0 || address(p.value_blocks) % 16 != 0) {
    return "the key and value blocks must be 16-byte aligned";
  }
  if (PagedDecodeSharedBytes(p, dtype) > kDecodeSharedLimit) {
    return "a split's scores do not fit the shared memory (a smaller partition)";
  }
  return nullptr;
}

}  // namespace accel::models::cuda

#endif  // ACCEL_MODELS_CUDA_PAGED_DECODE_PARAMS_H_
