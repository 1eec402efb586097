// Decode attention over a paged KV cache: one query token per sequence
// against the keys and values in its blocks, read in place (no gather of the
// past into a contiguous buffer), on the cpu (PagedDecodeAttention) and on a
// CUDA device (PagedDecodeAttentionCuda). Scores, softmax and the weighted
// sum run in float32 whatever the storage dtype.
#ifndef ACCEL_MODELS_INTERNAL_PAGED_ATTENTION_H_
#define ACCEL_MODELS_INTERNAL_PAGED_ATTENTION_H_

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/types/span.h"

#include "models/cuda/paged_decode_params.h"

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

// The same for queries that are rows of one q [heads, tokens, head_dim] (a
// step's packed tokens): query i is row rows[i].row, attending through its
// table to its total. q is copied once for all of them, not a view and a
// copy a query (a step of 128 decodes on 32 layers made about 16000 ops of
// those).
struct PagedRow {
  int64_t row = 0;
  absl::Span<const int32_t> table;
  int64_t total = 0;
};
at::Tensor PagedDecodeAttentionRows(const at::Tensor& q, absl::Span<const PagedRow> rows,
                                    const at::Tensor& key_blocks, const at::Tensor& value_blocks,
                                    std::optional<int64_t> window, const ScoreRule& rule);

// Tests: with `portable` the kernel runs its plain loops instead of AVX2;
// returns whether the AVX2 loops run now.
bool UsePortablePagedAttention(bool portable);

// The same on a CUDA device, through models/cuda's kernels (flash-decoding
// splits for long contexts; models/cuda/paged_decode_params.h): the blocks
// on cuda:N, float32, bfloat16 or float16, head dims a multiple of 8 up to
// 256 (PagedCudaTakes). `partition` 0 lets the plan choose the split length.
// Runs on libtorch's current stream; returns [queries, heads * dv] in the
// storage dtype. A build without the kernels (no nvcc, or a CPU libtorch)
// refuses with an error (PagedAttentionCudaBuilt() says which build this is).
at::Tensor PagedDecodeAttentionCuda(absl::Span<const PagedQuery> queries,
                                    const at::Tensor& key_blocks, const at::Tensor& value_blocks,
                                    std::optional<int64_t> window, const ScoreRule& rule,
                                    int32_t partition = 0);
// A static decode step's (CausalLM::ForwardStaticDecode) attention: q [rows,
// heads, d] on the device, each row's blocks and total read by the kernels
// from block_tables [rows, max_blocks] and totals [rows] (int32, on the
// device), the plan (splits, partition, window) fixed by max_total, so that
// nothing here reads a value on the host and a CUDA graph can replay it.
at::Tensor PagedDecodeAttentionCudaStatic(const at::Tensor& q, const at::Tensor& key_blocks,
                                          const at::Tensor& value_blocks,
                                          const at::Tensor& block_tables, const at::Tensor& totals,
                                          int64_t max_total, std::optional<int64_t> window,
                                          const ScoreRule& rule);
bool PagedAttentionCudaBuilt();
// Whether the CUDA kernels take these blocks (built, dtype, dims, alignment)
// for `heads` query heads; AttendPacked gathers the blocks otherwise.
bool PagedCudaTakes(const at::Tensor& key_blocks, const at::Tensor& value_blocks, int64_t heads);

// The host half of PagedDecodeAttentionCuda, apart so that it is tested
// without a device (its plan run through the kernels' code on the host):
// checks the queries as PagedDecodeAttention does, packs the block tables
// ([queries, table_stride], unused entries 0) followed by the totals
// ([queries]) into one int32 buffer, and fills the kernel parameters but
// their pointers. `sm_count` 0 skips the occupancy rule of the split plan.
struct PagedCudaPlan {
  cuda::PagedDecodeParams params;
  cuda::KvDType dtype = cuda::KvDType::kFloat32;
  std::vector<int32_t> tables_and_totals;
};
PagedCudaPlan PlanPagedDecodeCuda(absl::Span<const PagedQuery> queries,
                                  const at::Tensor& key_blocks, const at::Tensor& value_blocks,
                                  std::optional<int64_t> window, const ScoreRule& rule,
                                  int32_t sm_count, int32_t partition);
// The host half of PagedDecodeAttentionCudaStatic: its parameters but the
// pointers, from the shapes of q [rows, heads, d] and the blocks, tables of
// `table_stride` blocks and the longest context `max_total` (the tables and
// totals themselves stay on the device).
PagedCudaPlan PlanPagedDecodeCudaStatic(const at::Tensor& q, const at::Tensor& key_blocks,
                                        const at::Tensor& value_blocks, int64_t table_stride,
                                        int64_t max_total, std::optional<int64_t> window,
                                        const ScoreRule& rule, int32_t sm_count);

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_PAGED_ATTENTION_H_
