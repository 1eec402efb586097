// The decoder-only families (Llama, Mistral, Qwen2, Mixtral, Qwen3,
// Qwen3-MoE, Qwen2-MoE, Gemma 2, Gemma 3, Phi-3): one model whose parts
// follow the family's traits (models/families.h), with transformers' module
// names and arithmetic.
#ifndef ACCEL_MODELS_INTERNAL_DECODER_LM_H_
#define ACCEL_MODELS_INTERNAL_DECODER_LM_H_

#include <memory>

#include <c10/core/ScalarType.h>

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
