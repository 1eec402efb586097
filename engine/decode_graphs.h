// engine/decode_graphs.h: the batch-size buckets of decode steps, as vLLM
// captures CUDA graphs for them (vllm/config: 1, 2, 4, then every multiple
// of 8 up to the largest batch). A step whose sequences all decode one
// token is padded up to the smallest bucket that holds it: its inputs are
// copied into the bucket's static buffers, the padded rows write a scratch
// KV block nobody reads and their logits are dropped, so one graph per
// bucket serves every batch size (engine/model_runner.h's
// DecodePadding). Larger batches, prefill and mixed steps run eagerly.
//
//   std::vector<int64_t> buckets = DecodeBatchBuckets(/*max_batch_size=*/48);  // 1 2 4 8 ... 48
//   std::optional<int64_t> padded = DecodeBucketFor(buckets, 5);                // 8
//
// Torch-free header.
#ifndef ACCEL_ENGINE_DECODE_GRAPHS_H_
#define ACCEL_ENGINE_DECODE_GRAPHS_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"

namespace accel::engine {

// vLLM's largest captured batch by default.
inline constexpr int64_t kMaxDecodeBucket = 256;

// 1, 2, 4, 8, 16, 24, ... : every bucket up to the first that holds
// min(max_batch_size, largest) sequences (largest is rounded up to a multiple
// of 8 when above 8). Empty for max_batch_size < 1.
std::vector<int64_t> DecodeBatchBuckets(int64_t max_batch_size, int64_t largest = kMaxDecodeBucket);

// The smallest bucket of `buckets` (ascending) that holds `batch` rows;
// nullopt for a batch above the largest (or below 1): it runs eagerly.
std::optional<int64_t> DecodeBucketFor(absl::Span<const int64_t> buckets, int64_t batch);

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_DECODE_GRAPHS_H_
