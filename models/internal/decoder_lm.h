// The decoder-only families (Llama, Mistral, Qwen2, Mixtral, Qwen3,
// Qwen3-MoE, Qwen2-MoE, Gemma 2, Gemma 3, Phi-3): one model whose parts
// follow the family's traits (models/families.h), with transformers' module
// names and arithmetic.
#ifndef ACCEL_MODELS_INTERNAL_DECODER_LM_H_
#define ACCEL_MODELS_INTERNAL_DECODER_LM_H_

#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "models/causal_lm.h"
#include "models/families.h"
#include "models/tensor_parallel.h"

namespace accel::models::internal {

// A model of `config`'s family with uninitialised weights (meta under a
// dispatch::EmptyWeightsGuard). InvalidArgument for a bad RoPE setting.
// With `tp.size` > 1, rank `tp.rank`'s slice (`shape`, ShardShapeFor).
absl::StatusOr<std::shared_ptr<CausalLM>> BuildDecoderLM(const ResolvedConfig& config,
                                                         at::ScalarType dtype,
                                                         const TensorParallel& tp,
                                                         const ShardShape& shape);

// What a step carries through the layers: the dispatcher, the ranks of a
// tensor-parallel model, and a failure that must keep its own status (an
// expert read, a collective) while the layer unwinds.
struct StepState {
  dispatch::DispatchedModel* dispatched = nullptr;
  const TensorParallel* tp = nullptr;
  absl::Status failure;
};

// Unwinds the layer's torch code with `status` kept for Forward to return.
[[noreturn]] void Fail(StepState& step, absl::Status status, const char* what);

// The sum over the ranks of each rank's partial `x` (after a row-parallel
// product, an expert-parallel block or a vocab-parallel embedding); `x`
// itself on one process. A failed all-reduce unwinds through Fail.
at::Tensor SumOverRanks(const at::Tensor& x, StepState& step);

// Every rank's vocab-parallel logits [1, n, shard.vocab] side by side:
// [1, n, vocab_size] (each slice padded to shard.vocab_stride for the
// gather). A failed gather unwinds through Fail.
at::Tensor GatherVocab(const at::Tensor& logits, const TensorParallel& tp, const ShardShape& shard,
                       int64_t vocab_size, StepState& step);

// Adds a collective's time to CollectiveSeconds(), which
// TensorParallelCollectiveSeconds() reports.
void AddCollectiveNanos(int64_t nanos);
double CollectiveSeconds();
// Bytes this rank hands to the all-reduces and gathers inside steps (its
// payload: what a ring moves is 2 (N - 1) / N of it per all-reduce).
void AddCollectiveBytes(int64_t bytes);
int64_t CollectiveBytes();
// Pipeline micro-batches this process's stage has run.
int64_t MicroBatchesRun();

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_DECODER_LM_H_
