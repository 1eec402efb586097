// models/tensor_parallel.h: one model split over the ranks of a process
// group, as Megatron-LM splits it (Shoeybi et al. 2019), so that each rank
// holds and reads only its slice of the checkpoint:
//
//   q/k/v_proj   column-parallel by heads (rank r: query heads
//                [r H/N, (r+1) H/N) and the key/value heads they read; with
//                fewer key/value heads than ranks, each rank holds the one
//                its query heads share, replicated on N / KV ranks)
//   o_proj       row-parallel (the same heads' columns), then all-reduce
//   gate/up_proj column-parallel, down_proj row-parallel, then all-reduce
//   experts      expert parallel: rank r holds experts [r E/N, (r+1) E/N),
//                every rank routes with the whole router and runs its own
//                picked experts; the block's output is all-reduced
//   embed_tokens vocab-parallel rows [r ceil(V/N), ...): ids outside the
//                slice read zeros, then all-reduce
//   lm_head      vocab-parallel rows, logits all-gathered
//   norms, routers, the shared expert's gate: replicated
//   GPT-2        the same split of its Conv1D layers (W [in, out]: columns
//                where the others take rows): c_attn by heads within each
//                of its q, k, v thirds, attn.c_proj / mlp.c_proj by rows,
//                mlp.c_fc by columns, wte as embed_tokens; wpe replicated
//
// Biases of row-parallel layers are held by rank 0 only (the others hold
// zeros), so the all-reduce adds them once. Quantization (nf4 / int8) runs
// on each rank's slice, as bitsandbytes would quantize that slice.
//
//   TensorParallel tp{group->rank(), group->size(), group.get()};
//   ACCEL_RETURN_IF_ERROR(CheckTensorParallel(config, tp.size));
//   model = BuildCausalLM(config, dtype, tp);       // this rank's shapes
//   load.hook = MakeShardingHook(config, tp, dtype, quant_hook).get();
//
// The ranks run every step together: rank 0 (the leader) drives the model
// through a TensorParallelLeader, which sends each step's ids and KV block
// tables to the workers before running its own slice; each worker runs
// RunTensorParallelWorker until the leader stops it.
#ifndef ACCEL_MODELS_TENSOR_PARALLEL_H_
#define ACCEL_MODELS_TENSOR_PARALLEL_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

#include "dispatch/dispatch.h"
#include "loader/config.h"
#include "models/causal_lm.h"

namespace accel::dist {
class PendingWork;
class ProcessGroup;
}  // namespace accel::dist

namespace accel::models {

// What one rank of `size` holds of a config's model.
struct ShardShape {
  int64_t heads = 0;          // query heads
  int64_t kv_heads = 0;       // key/value heads
  int64_t first_head = 0;     // its first query head
  int64_t first_kv_head = 0;  // its first key/value head
  int64_t intermediate = 0;   // dense MLP width
  int64_t shared_intermediate = 0;
  int64_t experts = 0;  // experts per sparse block
  int64_t first_expert = 0;
  int64_t vocab = 0;         // embedding / head rows
  int64_t first_vocab = 0;   // its first row
  int64_t vocab_stride = 0;  // ceil(V / N): every rank's slice padded to it
};

// InvalidArgument naming the field when `config`'s model cannot be split
// over `size` ranks: query heads, key/value heads (unless fewer than `size`
// and dividing it), intermediate_size, the shared expert's width or the
// expert count not divisible by `size`. OK for size 1. GPT-2 splits as the
// others (its Conv1D layers' [in, out] weights sliced by columns where the
// others' [out, in] are sliced by rows, c_attn by heads within each of its
// q, k, v thirds); a LongRoPE step that recomputes a sequence gets its ids
// in the step message.
absl::Status CheckTensorParallel(const loader::ModelConfig& config, int size);

// Pipeline parallel: the layers [first, last) stage `stage` of `stages`
// runs, as vLLM's get_pp_indices splits them: layers / stages each, and the
// remainder one each to the stages before the last, counting back from the
// second-to-last (the last stage also runs the final norm and lm_head).
std::pair<int64_t, int64_t> PipelineLayers(int64_t layers, int stage, int stages);

// The micro-batches of a pipeline-parallel step whose chunks (sequences)
// hold `chunk_tokens` tokens each, as [first, end) ranges of chunks: the
// stages overlap within the step (GPipe's fill and drain), stage s + 1
// running micro-batch k while stage s runs k + 1. Every rank applies it to
// the step the leader broadcast, so they agree without another message.
// The rule: min(requested, chunks) contiguous micro-batches (at least one;
// requested below 1 counts as 1), each of at least one chunk, cut where the
// tokens so far first reach the next equal share of the step's tokens
// (a prefill chunk weighs as its tokens, so it is not queued behind
// decodes), and cut early only so that every later micro-batch keeps a
// chunk. Contiguous ranges keep the step's row order: the logits of the
// micro-batches, concatenated, are the step's.
std::vector<std::pair<size_t, size_t>> PipelineMicroBatches(absl::Span<const int64_t> chunk_tokens,
                                                            int requested);

// The micro-batches a step of `step_tokens` tokens asks for when
// --pipeline_micro_batches is 0 (auto): one per stage, but none under
// kMinPipelineMicroBatchTokens tokens, so a decode step of a few sequences
// runs whole. Each micro-batch reads every weight of its stage again, which a
// handful of decode rows do not repay (measured in docs/BENCHMARKS.md: 2
// micro-batches of 4 decode rows each cost 18-37% of decode tokens/s, while
// 64-token prefill chunks gained 23%).
inline constexpr int64_t kMinPipelineMicroBatchTokens = 32;
int PipelineAutoMicroBatches(int64_t step_tokens, int stages);

// InvalidArgument naming the field when `config`'s model cannot be split
// into `stages` pipeline stages (more stages than num_hidden_layers, fewer
// than 1). OK for 1. Every family splits, GPT-2 included (wte and wpe on
// the first stage, ln_f and the tied head on the last).
absl::Status CheckPipelineParallel(const loader::ModelConfig& config, int stages);

// This rank's place in `world`, a group of `size` x stages ranks (world
// rank = stage * size + rank within the stage): makes every stage's
// tensor-parallel group (all ranks of `world` call it together, in the same
// order), keeps this rank's in `*stage_group` and returns the
// TensorParallel a load of its slice takes. One stage: `world` itself is
// the tensor-parallel group. InvalidArgument when `world`'s size is not a
// multiple of `size`.
absl::StatusOr<TensorParallel> JoinParallelGroups(dist::ProcessGroup& world, int size,
                                                  std::unique_ptr<dist::ProcessGroup>* stage_group);

// Rank `rank` of `size`'s shapes (after CheckTensorParallel).
absl::StatusOr<ShardShape> ShardShapeFor(const loader::ModelConfig& config, int rank, int size);

// The dispatch::LoadHook that gives this rank its slices: sliced tensors
// are read from the checkpoint's mapping (only their own bytes), converted
// to `dtype`, then handed to `inner` (the quantization hook, which then
// quantizes the slice) when it claims the name; other ranks' experts are
// skipped unread, this rank's renamed to their local index; tensors that
// are not split go to `inner` or load as they are. `inner` may be null and
// must outlive the hook. InvalidArgument naming the tensor for a shape
// that does not match the config.
absl::StatusOr<std::unique_ptr<dispatch::LoadHook>> MakeShardingHook(
    const loader::ModelConfig& config, const TensorParallel& tp, at::ScalarType dtype,
    dispatch::LoadHook* inner);

// Rank 0's view of a tensor-parallel model: a CausalLM whose Forward sends
// the step (ids, and each chunk's position and KV block table) to the other
// ranks, then runs this rank's slice with them. Every other rank runs
// RunTensorParallelWorker. Chunks need paged caches (or no cache): a
// worker's keys and values live in its own block store, at the block ids
// the leader's tables name. Thread-safe: steps and heartbeats are
// serialised.
class TensorParallelLeader : public CausalLM {
 public:
  // `shard`: this rank's model (BuildCausalLM with rank 0's TensorParallel),
  // loaded.
  // With `heartbeat` above zero, a thread sends a heartbeat whenever no
  // step has run for that long (set it well under the group's timeout, which
  // a waiting worker would otherwise reach while the server is idle).
  TensorParallelLeader(std::shared_ptr<CausalLM> shard, dispatch::DispatchedModel* dispatched,
                       dist::ProcessGroup* group, absl::Duration heartbeat = absl::ZeroDuration());
  ~TensorParallelLeader() override;

  // InvalidArgument (nothing sent) for a contiguous cache or chunks that do
  // not match the ids; Unavailable once a collective failed (a worker died
  // or stopped answering within the group's timeout): the group is broken
  // from then on, every later step fails at once.
  absl::StatusOr<at::Tensor> Forward(const at::Tensor& input_ids,
                                     absl::Span<const SequenceChunk> chunks, Logits which,
                                     dispatch::DispatchedModel* dispatched) override;
  // Pipeline parallel: the step message goes point to point to each rank
  // (not waited for), the first stage runs, and the returned PendingLogits
  // waits for the last stage's logits: the engine submits the next step
  // meanwhile (several steps in flight). Errors as Forward.
  absl::StatusOr<std::unique_ptr<PendingLogits>> Submit(
      const at::Tensor& input_ids, absl::Span<const SequenceChunk> chunks, Logits which,
      dispatch::DispatchedModel* dispatched) override;
  int pipeline_size() const override;
  int64_t recompute_after() const override;

  // Tells the workers the leader is alive while no step runs (they wait for
  // the next message within the group's timeout). Unavailable as Forward.
  absl::Status Heartbeat();
  // Ends the workers' loops (they return OK). Idempotent; the destructor
  // calls it.
  absl::Status Stop();
  // Whether every collective so far succeeded.
  bool healthy() const;

 private:
  absl::Status Send(const std::string& message);  // with mu_ held
  // The step's message to the workers (Unavailable once the group broke);
  // with mu_ held.
  absl::Status SendStep(const at::Tensor& input_ids, absl::Span<const SequenceChunk> chunks,
                        Logits which);
  // The step's message (InvalidArgument, nothing sent, for chunks that do
  // not match the ids or a contiguous cache).
  // `recompute_after`: the shard's recompute_after() (the chunks crossing it
  // carry their caches' token ids).
  static absl::StatusOr<std::string> StepMessage(const at::Tensor& input_ids,
                                                 absl::Span<const SequenceChunk> chunks,
                                                 Logits which, int64_t recompute_after);
  // A step's failure after its message went out: the group is broken
  // (Unavailable) unless it failed before any collective.
  absl::Status Failed(const absl::Status& status);
  void HeartbeatLoop(absl::Duration interval);

  std::shared_ptr<CausalLM> shard_;
  dispatch::DispatchedModel* dispatched_;
  dist::ProcessGroup* group_;
  // Pipeline parallel: step messages go point to point (Send), and those
  // sends still unconfirmed.
  const bool point_to_point_;
  std::deque<std::unique_ptr<dist::PendingWork>> message_sends_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool broken_ = false, stopped_ = false;
  std::chrono::steady_clock::time_point last_message_;
  std::thread heartbeat_;
};

// Why the tensor-parallel group of this process broke (the first failure:
// a worker that died or went silent, the leader gone for a worker), or
// nullopt while it works. A server stops being ready on it, as on a weights
// file fault, and exits once drained, so that the group is restarted whole.
std::optional<std::string> TensorParallelFault();

// A worker rank's loop: receives each step from rank 0 and runs `shard`
// (this rank's model) on it, until the leader stops it (OK) or a collective
// fails (Unavailable naming it: the leader died or went silent).
absl::Status RunTensorParallelWorker(CausalLM& shard, dispatch::DispatchedModel* dispatched,
                                     dist::ProcessGroup& group);

// Seconds this process has spent in tensor-parallel collectives (the
// all-reduces and gathers inside steps, and the leader's step messages).
double TensorParallelCollectiveSeconds();
// Bytes this process has handed to those collectives (its payload).
int64_t TensorParallelCollectiveBytes();
// Pipeline-parallel micro-batches this process has run (its stage's part
// of each), over all steps.
int64_t PipelineMicroBatchesRun();

// What one token of a step costs each rank in collectives, on paper: the
// all-reduces (the embedding's, then attention's and the MLP's in every
// layer) of hidden_size values and the logits' gather of a vocab slice, in
// the model's dtype. payload_bytes is what the rank hands to them (what
// TensorParallelCollectiveBytes counts); wire_bytes what it sends with a
// ring all-reduce (2 (N - 1) / N of each all-reduce's payload) and an
// all-gather ((N - 1) slices).
//
// With `stages` pipeline stages the figures are the first stage's ranks'
// (its layers' all-reduces; no gather: the last stage's), and
// stage_send_bytes is what one rank sends the next stage per token (its
// hidden state, in the model's dtype; the last stage's rank 0 sends each
// sampled position's float32 logits, logits_bytes, to the leader instead).
struct TensorParallelTraffic {
  int64_t all_reduces = 0;
  int64_t payload_bytes = 0;
  double wire_bytes = 0;
  int64_t stage_send_bytes = 0;
  int64_t logits_bytes = 0;
};
TensorParallelTraffic TensorParallelTrafficPerToken(const loader::ModelConfig& config,
                                                    at::ScalarType dtype, int size, int stages = 1);

}  // namespace accel::models

#endif  // ACCEL_MODELS_TENSOR_PARALLEL_H_
