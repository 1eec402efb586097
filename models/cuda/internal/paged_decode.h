// models/cuda/internal/paged_decode.h: the work of one decode CTA (one kv
// head, one sequence, one split) and of the split reduce, written once for
// the device kernels (models/cuda/paged_attention.cu) and for a host
// emulation that runs the same code on a machine without a GPU
// (tests/models/cuda_paged_decode_test.cc: every thread of a CTA as a fiber,
// switched at each barrier). `Exec` is what differs: the thread's index,
// the CTA barrier, and the exchange of a value with the lane whose index
// differs in `mask` (a warp shuffle on the device). Every barrier and
// exchange is reached by every thread of the CTA the same number of times
// (loops over positions are CTA-uniform, with a `valid` flag on the tail),
// which is what a full-warp shuffle needs and what the emulation checks.
#ifndef ACCEL_MODELS_CUDA_INTERNAL_PAGED_DECODE_H_
#define ACCEL_MODELS_CUDA_INTERNAL_PAGED_DECODE_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>

#include "core/float16_bits.h"
#include "models/cuda/paged_decode_params.h"

namespace accel::models::cuda::internal {

// Storage types of q, the blocks and the output.
struct Float32 {
  using Storage = float;
};
struct BFloat16 {
  using Storage = uint16_t;
};
struct Float16 {
  using Storage = uint16_t;
};

ACCEL_MODELS_HD float NegativeInfinity() { return float16_bits::BitsToFloat(0xff800000u); }

// fn(Tag{}) with `dtype`'s storage tag: how a launcher picks its kernel's
// instance. What fn returns, or (an unknown dtype) `otherwise`.
template <typename Result, typename Fn>
Result WithStorage(KvDType dtype, Result otherwise, const Fn& fn) {
  switch (dtype) {
    case KvDType::kFloat32:
      return fn(Float32{});
    case KvDType::kBFloat16:
      return fn(BFloat16{});
    case KvDType::kFloat16:
      return fn(Float16{});
  }
  return otherwise;
}

// Exact widening to float32, and rounding to nearest even back
// (core/float16_bits.h).
ACCEL_MODELS_HD float ToFloat(Float32, float v) { return v; }
ACCEL_MODELS_HD float ToFloat(BFloat16, uint16_t v) { return float16_bits::BFloat16ToFloat(v); }
ACCEL_MODELS_HD float ToFloat(Float16, uint16_t v) { return float16_bits::HalfToFloat(v); }
ACCEL_MODELS_HD float FromFloat(Float32, float v) { return v; }
ACCEL_MODELS_HD uint16_t FromFloat(BFloat16, float v) { return float16_bits::FloatToBFloat16(v); }
ACCEL_MODELS_HD uint16_t FromFloat(Float16, float v) { return float16_bits::FloatToHalf(v); }

// 16 bytes of storage (16-byte aligned) as floats.
template <typename Tag>
ACCEL_MODELS_HD void LoadChunk(const typename Tag::Storage* src,
                               float (&out)[16 / sizeof(typename Tag::Storage)]) {
  using Storage = typename Tag::Storage;
  constexpr int kVec = 16 / sizeof(Storage);
#if defined(__CUDA_ARCH__)
  union {
    uint4 raw;
    Storage values[kVec];
  } chunk;
  chunk.raw = __ldg(reinterpret_cast<const uint4*>(src));
#else
  struct {
    Storage values[kVec];
  } chunk;
  std::memcpy(chunk.values, src, 16);
#endif
  for (int e = 0; e < kVec; ++e) out[e] = ToFloat(Tag{}, chunk.values[e]);
}

// Asks the L2 cache for `bytes` at `row` (a no-op on the host): thread
// `lane` of `lanes` takes every lanes-th 128-byte line. At decode the CTA's
// reads are a chain (q, the keys, then after the softmax the values) of
// memory round trips; lines asked for ahead come back from L2.
ACCEL_MODELS_HD void PrefetchRow(const void* row, int64_t bytes, int32_t lane, int32_t lanes) {
#if defined(__CUDA_ARCH__)
  for (int64_t at = static_cast<int64_t>(lane) * 128; at < bytes;
       at += static_cast<int64_t>(lanes) * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(row) + at));
  }
#else
  (void)row;
  (void)bytes;
  (void)lane;
  (void)lanes;
#endif
}

ACCEL_MODELS_HD float Softcap(float score, float cap) {
  return cap > 0.0f ? tanhf(score / cap) * cap : score;
}

// One decode CTA: the `group` query heads of kv head `kv_head` of sequence
// `seq`, over the positions of split `split`. `shared` holds
// MakeDecodeLayout(...).total_floats floats.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Tag, typename Exec>
ACCEL_MODELS_HD void DecodeSplit(const PagedDecodeParams& p, int32_t kv_head, int32_t seq,
                                 int32_t split, float* shared, Exec& exec) {
  using Storage = typename Tag::Storage;
  constexpr int32_t kVec = 16 / sizeof(Storage);
  const DecodeLayout l = MakeDecodeLayout(p.heads, p.kv_heads, p.head_dim, p.value_dim, p.partition,
                                          static_cast<int32_t>(sizeof(Storage)), kDecodeThreads);
  const int32_t total = p.totals[seq];
  const PositionRange range = SplitPositions(total, p.window, p.partition, split);
  if (range.begin >= range.end) return;  // past the sequence's last split: the whole CTA
  const int32_t n = range.end - range.begin;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.table_stride;
  const int32_t tid = exec.tid();
  const int32_t head0 = kv_head * l.group;
  const int64_t first_row = static_cast<int64_t>(seq) * p.heads + head0;  // of q and out
  float* q_s = shared;
  float* scores = q_s + l.q_region_floats;  // [group, partition]
  float* stats = scores + l.score_floats;

  const Storage* keys = static_cast<const Storage*>(p.key_blocks);
  const Storage* values = static_cast<const Storage*>(p.value_blocks);
  const int32_t lane = tid % l.lanes, slot = tid / l.lanes;
  const int32_t keys_per_round = l.keys_per_pass * kKeyUnroll;
  const int64_t key_bytes = static_cast<int64_t>(p.head_dim) * sizeof(Storage);
  const int64_t value_bytes = static_cast<int64_t>(p.value_dim) * sizeof(Storage);
  // The first round's keys asked for while q loads (no effect on the host).
  for (int32_t u = 0; u < kKeyUnroll; ++u) {
    const int32_t pos = range.begin + u * l.keys_per_pass + slot;
    if (pos >= range.end) break;
    PrefetchRow(keys + KvRowOffset(table, pos, p.block_size, p.kv_heads, kv_head, p.head_dim),
                key_bytes, lane, l.lanes);
  }

  // 1. The group's queries, scaled, in float32.
  const Storage* q = static_cast<const Storage*>(p.q) + first_row * p.head_dim;
  for (int64_t i = tid; i < l.q_floats; i += kDecodeThreads) {
    q_s[i] = ToFloat(Tag{}, q[i]) * p.scale;
  }
  exec.Sync();

  // 2. Scores: `lanes` threads a key, each holding 16-byte chunks of it
  // (consecutive lanes, consecutive chunks: coalesced), the dot products
  // summed over the lanes by exchanges. Each thread loads kKeyUnroll keys
  // before it uses any, so that as many reads are in flight, and asks L2 for
  // the next round's keys and for this key's value (step 4 reads it).
  for (int32_t base = range.begin; base < range.end; base += keys_per_round) {
    float k[kKeyUnroll][kMaxChunksPerLane][kVec];
    for (int32_t u = 0; u < kKeyUnroll; ++u) {
      const int32_t pos = base + u * l.keys_per_pass + slot;
      const bool valid = pos < range.end;
      const int64_t row =
          valid ? KvRowOffset(table, pos, p.block_size, p.kv_heads, kv_head, p.head_dim) : 0;
      if (valid) {
        PrefetchRow(
            values + KvRowOffset(table, pos, p.block_size, p.kv_heads, kv_head, p.value_dim),
            value_bytes, lane, l.lanes);
        if (pos + keys_per_round < range.end) {
          PrefetchRow(keys + KvRowOffset(table, pos + keys_per_round, p.block_size, p.kv_heads,
                                         kv_head, p.head_dim),
                      key_bytes, lane, l.lanes);
        }
      }
      for (int32_t i = 0; i < kMaxChunksPerLane; ++i) {
        const int32_t c = lane + i * l.lanes;
        if (valid && c < l.chunks) {
          LoadChunk<Tag>(keys + row + static_cast<int64_t>(c) * kVec, k[u][i]);
        } else {
          for (int32_t e = 0; e < kVec; ++e) k[u][i][e] = 0.0f;
        }
      }
    }
    for (int32_t u = 0; u < kKeyUnroll; ++u) {
      const int32_t pos = base + u * l.keys_per_pass + slot;
      const bool valid = pos < range.end;
      for (int32_t h = 0; h < l.group; ++h) {
        float dot = 0.0f;
        for (int32_t i = 0; i < kMaxChunksPerLane; ++i) {
          const int32_t c = lane + i * l.lanes;
          if (c >= l.chunks) break;
          const float* qc =
              q_s + static_cast<int64_t>(h) * p.head_dim + static_cast<int64_t>(c) * kVec;
          for (int32_t e = 0; e < kVec; ++e) dot = fmaf(qc[e], k[u][i][e], dot);
        }
        for (int32_t mask = l.lanes / 2; mask >= 1; mask /= 2) dot += exec.XorLanes(dot, mask);
        if (valid && lane == 0) {
          scores[static_cast<int64_t>(h) * p.partition + (pos - range.begin)] =
              Softcap(dot, p.softcap);
        }
      }
    }
  }
  exec.Sync();

  // 3. Per head (a warp each): the split's max score, the exponentials in
  // place of the scores, and their sum.
  constexpr int32_t kWarps = kDecodeThreads / 32;
  const int32_t warp = tid / 32, warp_lane = tid % 32;
  for (int32_t h0 = 0; h0 < l.group; h0 += kWarps) {
    const int32_t h = h0 + warp;
    const bool active = h < l.group;
    float* s = scores + static_cast<int64_t>(active ? h : 0) * p.partition;
    float top = NegativeInfinity();
    if (active) {
      for (int32_t j = warp_lane; j < n; j += 32) top = fmaxf(top, s[j]);
    }
    for (int32_t mask = 16; mask >= 1; mask /= 2) top = fmaxf(top, exec.XorLanes(top, mask));
    float sum = 0.0f;
    if (active) {
      for (int32_t j = warp_lane; j < n; j += 32) {
        const float e = expf(s[j] - top);
        s[j] = e;
        sum += e;
      }
    }
    for (int32_t mask = 16; mask >= 1; mask /= 2) sum += exec.XorLanes(sum, mask);
    if (active && warp_lane == 0) {
      stats[h] = top;
      stats[l.group + h] = sum;
    }
  }
  exec.Sync();

  // 4. The weighted sum of the values, as the keys were read: `value_lanes`
  // threads a value row, each holding 16-byte chunks of it, `value_slots`
  // rows at a time, kValueUnroll rows a thread loaded before any is used;
  // heads kValueHeadTile at a time. A thread's sums over its rows are added
  // to the other slots' of its warp by exchanges, then across the warps
  // through shared memory (the region q used: q is not read again).
  const int32_t value_lane = tid % l.value_lanes, value_slot = tid / l.value_lanes;
  float* warp_sums = q_s;  // [warps, kValueHeadTile, value_dim]
  const bool split_output = p.max_splits > 1;
  const SplitWorkspace ws = SplitArrays(p);
  const int32_t rows_per_round = l.value_slots * kValueUnroll;
  for (int32_t h0 = 0; h0 < l.group; h0 += kValueHeadTile) {
    const int32_t tile = l.group - h0 < kValueHeadTile ? l.group - h0 : kValueHeadTile;
    float acc[kValueHeadTile][kMaxChunksPerLane][kVec];
    for (int32_t hh = 0; hh < kValueHeadTile; ++hh) {
      for (int32_t i = 0; i < kMaxChunksPerLane; ++i) {
        for (int32_t e = 0; e < kVec; ++e) acc[hh][i][e] = 0.0f;
      }
    }
    for (int32_t base = 0; base < n; base += rows_per_round) {
      float v[kValueUnroll][kMaxChunksPerLane][kVec];
      float w[kValueUnroll][kValueHeadTile];
      for (int32_t u = 0; u < kValueUnroll; ++u) {
        const int32_t j = base + u * l.value_slots + value_slot;
        const bool valid = j < n;
        const int64_t row = valid ? KvRowOffset(table, range.begin + j, p.block_size, p.kv_heads,
                                                kv_head, p.value_dim)
                                  : 0;
        for (int32_t i = 0; i < kMaxChunksPerLane; ++i) {
          const int32_t c = value_lane + i * l.value_lanes;
          if (valid && c < l.value_chunks) {
            LoadChunk<Tag>(values + row + static_cast<int64_t>(c) * kVec, v[u][i]);
          } else {
            for (int32_t e = 0; e < kVec; ++e) v[u][i][e] = 0.0f;
          }
        }
        for (int32_t hh = 0; hh < kValueHeadTile; ++hh) {
          w[u][hh] =
              valid && hh < tile ? scores[static_cast<int64_t>(h0 + hh) * p.partition + j] : 0.0f;
        }
      }
      for (int32_t u = 0; u < kValueUnroll; ++u) {
        for (int32_t hh = 0; hh < kValueHeadTile; ++hh) {
          for (int32_t i = 0; i < kMaxChunksPerLane; ++i) {
            for (int32_t e = 0; e < kVec; ++e)
              acc[hh][i][e] = fmaf(w[u][hh], v[u][i][e], acc[hh][i][e]);
          }
        }
      }
    }
    // The slots of a warp: lanes that differ in the bits above value_lanes.
    for (int32_t mask = l.value_lanes; mask < 32; mask *= 2) {
      for (int32_t hh = 0; hh < kValueHeadTile; ++hh) {
        for (int32_t i = 0; i < kMaxChunksPerLane; ++i) {
          for (int32_t e = 0; e < kVec; ++e) acc[hh][i][e] += exec.XorLanes(acc[hh][i][e], mask);
        }
      }
    }
    const int32_t warp_of_thread = tid / 32;
    if (tid % 32 < l.value_lanes) {  // the warp's first slot holds its sums
      for (int32_t hh = 0; hh < tile; ++hh) {
        for (int32_t i = 0; i < kMaxChunksPerLane; ++i) {
          const int32_t c = value_lane + i * l.value_lanes;
          if (c >= l.value_chunks) break;
          float* dst = warp_sums +
                       (static_cast<int64_t>(warp_of_thread) * kValueHeadTile + hh) * p.value_dim +
                       static_cast<int64_t>(c) * kVec;
          for (int32_t e = 0; e < kVec; ++e) dst[e] = acc[hh][i][e];
        }
      }
    }
    exec.Sync();
    for (int32_t k_out = tid; k_out < tile * p.value_dim; k_out += kDecodeThreads) {
      const int32_t hh = k_out / p.value_dim, col = k_out % p.value_dim;
      float total = 0.0f;
      for (int32_t wi = 0; wi < kWarps; ++wi) {
        total += warp_sums[(static_cast<int64_t>(wi) * kValueHeadTile + hh) * p.value_dim + col];
      }
      const int64_t out_row = first_row + h0 + hh;
      if (split_output) {
        ws.sums[(out_row * p.max_splits + split) * p.value_dim + col] = total;
      } else {
        static_cast<Storage*>(p.out)[out_row * p.value_dim + col] =
            FromFloat(Tag{}, total / stats[l.group + h0 + hh]);
      }
    }
    exec.Sync();  // before the next tile writes warp_sums again
  }
  if (split_output && tid < l.group) {
    const int64_t entry = (first_row + tid) * p.max_splits + split;
    ws.maxes[entry] = stats[tid];
    ws.exp_sums[entry] = stats[l.group + tid];
  }
}

// The reduce over a sequence's splits for one (sequence, head): thread `tid`
// of `threads` writes columns tid, tid + threads, ... Each split's sum and
// sum of exponentials are rescaled by exp(its max - the overall max).
template <typename Tag>
ACCEL_MODELS_HD void ReduceSplits(const PagedDecodeParams& p, int32_t seq, int32_t head,
                                  int32_t tid, int32_t threads) {
  using Storage = typename Tag::Storage;
  const int32_t count = PagedDecodeSplits(p.totals[seq], p.window, p.partition);
  const SplitWorkspace ws = SplitArrays(p);
  const int64_t row = static_cast<int64_t>(seq) * p.heads + head;
  const int64_t entry = row * p.max_splits;
  float top = NegativeInfinity();
  for (int32_t s = 0; s < count; ++s) top = fmaxf(top, ws.maxes[entry + s]);
  float denominator = 0.0f;
  for (int32_t s = 0; s < count; ++s) {
    denominator = fmaf(expf(ws.maxes[entry + s] - top), ws.exp_sums[entry + s], denominator);
  }
  for (int32_t col = tid; col < p.value_dim; col += threads) {
    float numerator = 0.0f;
    for (int32_t s = 0; s < count; ++s) {
      numerator = fmaf(expf(ws.maxes[entry + s] - top), ws.sums[(entry + s) * p.value_dim + col],
                       numerator);
    }
    static_cast<Storage*>(p.out)[row * p.value_dim + col] =
        FromFloat(Tag{}, numerator / denominator);
  }
}

}  // namespace accel::models::cuda::internal

#endif  // ACCEL_MODELS_CUDA_INTERNAL_PAGED_DECODE_H_
