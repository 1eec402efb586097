// The decoder-only families (Llama, Mistral, Qwen2, Mixtral, Qwen3,
// Qwen3-MoE, Qwen2-MoE, Gemma 2, Gemma 3, Phi-3): one model whose parts
// follow the family's traits (models/families.h), with transformers' module
// names and arithmetic.
#ifndef ACCEL_MODELS_INTERNAL_DECODER_LM_H_
#define ACCEL_MODELS_INTERNAL_DECODER_LM_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

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

// The embedding of `ids` [1, n] by `embed`: under tensor parallel
// (`tp.size` > 1) each rank's table holds its vocabulary slice, so ids
// outside it read row 0, are zeroed, and the ranks' rows are summed.
at::Tensor EmbedVocabParallel(const at::Tensor& ids,
                              const std::function<at::Tensor(const at::Tensor&)>& embed,
                              const TensorParallel& tp, const ShardShape& shard, StepState& step);

// A failure the layers kept (an expert read, a collective) wins over the
// torch error that unwound them.
inline absl::Status Kept(const StepState& step, absl::Status status) {
  return step.failure.ok() ? status : step.failure;
}

// Every rank's vocab-parallel logits [1, n, shard.vocab] side by side:
// [1, n, vocab_size] (each slice padded to shard.vocab_stride for the
// gather). A failed gather unwinds through Fail.
at::Tensor GatherVocab(const at::Tensor& logits, const TensorParallel& tp, const ShardShape& shard,
                       int64_t vocab_size, StepState& step);

// A model whose layers split into pipeline stages (the decoder families'
// DecoderLM, GPT-2's model): the pipeline-parallel step, with this rank's
// stage given by the model's three parts. The step's chunks are cut into
// micro-batches (PipelineMicroBatches, the same cut on every rank); every
// receive of the step is posted first and every send is asynchronous, so a
// stage runs micro-batch k + 1 while the next stage runs k (GPipe's fill and
// drain within the step). The last stage's first rank sends each
// micro-batch's float32 logits to world rank 0.
class StagedLM : public CausalLM {
 public:
  int pipeline_size() const override { return tp_.pipeline_size; }

 protected:
  StagedLM(const std::string& class_name, const loader::ModelConfig& config, at::ScalarType dtype,
           const TensorParallel& tp);

  // This rank's stage: whether it embeds the ids, whether it runs the head.
  virtual bool first_stage() const = 0;
  virtual bool last_stage() const = 0;
  // [1, n, hidden]: the embedding of `ids` at `positions` (first stage).
  virtual absl::StatusOr<at::Tensor> StageEmbed(const at::Tensor& ids, const at::Tensor& positions,
                                                const std::vector<SequenceChunk>& chunks,
                                                const at::Device& home,
                                                dispatch::DispatchedModel* dispatched,
                                                StepState& step) = 0;
  // The stage's layers on `x` [1, n, hidden].
  virtual absl::StatusOr<at::Tensor> StageLayers(at::Tensor x, const at::Tensor& positions,
                                                 const std::vector<SequenceChunk>& chunks,
                                                 const at::Device& home,
                                                 dispatch::DispatchedModel* dispatched,
                                                 StepState& step) = 0;
  // The final norm and head on the sampled rows of `x` (last stage):
  // [1, rows, vocab], gathered when vocab-parallel.
  virtual absl::StatusOr<at::Tensor> StageHead(const at::Tensor& x, const at::Device& home,
                                               dispatch::DispatchedModel* dispatched,
                                               StepState& step) = 0;

  struct PipelineMicroBatch;
  // A step whose stage has run on this rank: its sends and the leader's
  // logits receives still in flight.
  struct PipelineStep;
  // The whole step: started, finished, the caches advanced; on the leader
  // the step's logits (nothing on other ranks).
  absl::StatusOr<at::Tensor> PipelineForward(const at::Tensor& ids,
                                             const std::vector<SequenceChunk>& chunks, Logits which,
                                             dispatch::DispatchedModel* dispatched,
                                             StepState& step);
  // The stage's part of the step: receives posted, every micro-batch run
  // and its output sent. The caches have not advanced.
  absl::StatusOr<std::shared_ptr<PipelineStep>> PipelineStart(
      const at::Tensor& ids, const std::vector<SequenceChunk>& chunks, Logits which,
      dispatch::DispatchedModel* dispatched, StepState& step);
  // The rest of a started step: its sends done, and on the leader the
  // logits of its micro-batches, concatenated.
  absl::StatusOr<at::Tensor> PipelineFinish(const std::shared_ptr<PipelineStep>& started);

  TensorParallel tp_;

 private:
  template <typename Post>
  absl::StatusOr<std::unique_ptr<dist::PendingWork>> Transfer(Post post, bool send, int peer,
                                                              const char* what);
  absl::Status Wait(dist::PendingWork& work, bool send, int peer, const char* what);
  static absl::Status Moved(const absl::Status& status, bool send, int peer, const char* what);
};

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

// A mixture's sparse block routes a step's rows on the device, the host
// never reading the routing, when they make at most this many top-k slots
// and its experts are 4-bit and resident on a CUDA device (quant/
// cuda_matmul.h: Linear4bitExpertsCuda reads each slot's expert index
// there); otherwise the host groups the rows by expert, reading each picked
// expert once. Each slot reads its expert's weights, so at batch 4 of a
// top-2 model up to 8 experts' worth where the host's grouping reads ~5.5:
// where the crossing lies is for a device run to measure.
inline constexpr int64_t kDeviceRoutedMaxSlots = 8;
// Whether a CUDA device runs that path where it applies (on by default,
// unless $ACCEL_CUDA_EXPERT_ROUTING is "0"; off: the host's routing, for
// comparing the two).
void RouteExpertsOnDevice(bool on);
// Whether the cpu runs that path too, each slot through its expert's own
// layer (tests: its logits against the host's routing). Off by default.
void RouteExpertsOnDeviceOnCpu(bool on);
// Sparse blocks run with the routing on the device, in this process.
int64_t DeviceRoutedLayers();

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_DECODER_LM_H_
