// Decode attention over a paged KV cache on the cpu: one query token per
// sequence against the keys and values in its blocks, read in place (no
// gather of the past into a contiguous buffer). Scores, softmax and the
// weighted sum run in float32 whatever the storage dtype.
#ifndef ACCEL_MODELS_INTERNAL_PAGED_ATTENTION_H_
#define ACCEL_MODELS_INTERNAL_PAGED_ATTENTION_H_

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/types/span.h"

namespace accel::models::internal {

// How q.k becomes an attention score; the families differ in the last bit.
struct ScoreRule {
  double scale = 1.0;
  bool divide = false;            // scores / scale (GPT-2, Qwen2-MoE); else scores * scale
  std::optional<double> softcap;  // then tanh(s / cap) * cap (Gemma 2)
};

// One sequence's decode query.
struct PagedQuery {
  at::Tensor q;                     // [heads, head_dim], the sequence's one token
  absl::Span<const int32_t> table;  // its blocks, in order
  int64_t total = 0;                // positions to attend: past + this token
};

// key_blocks / value_blocks [num_blocks, kv_heads, block_size, d] (cpu,
// float32, bfloat16 or float16); heads a multiple of kv_heads (GQA). With a
// window, the query at position total - 1 sees key j when total - 1 - j <
// window. Returns [queries, heads * dv] in the storage dtype, runs the
// queries' kv heads in parallel.
at::Tensor PagedDecodeAttention(absl::Span<const PagedQuery> queries, const at::Tensor& key_blocks,
                                const at::Tensor& value_blocks, std::optional<int64_t> window,
                                const ScoreRule& rule);

// Tests: with `portable` the kernel runs its plain loops instead of AVX2;
// returns whether the AVX2 loops run now.
bool UsePortablePagedAttention(bool portable);

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_PAGED_ATTENTION_H_
