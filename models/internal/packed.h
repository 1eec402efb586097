// The packed batch every model's Forward() runs: sequences' tokens one after
// another without padding, attention per sequence against its own KV cache,
// and each module run inside its dispatch scope. Shared by the GPT-2 and the
// decoder families (models/internal/decoder_lm.h).
#ifndef ACCEL_MODELS_INTERNAL_PACKED_H_
#define ACCEL_MODELS_INTERNAL_PACKED_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "core/status.h"
#include "dispatch/dispatch.h"
#include "dispatch/module_hooks.h"
#include "loader/config.h"
#include "models/causal_lm.h"
#include "models/internal/paged_attention.h"  // ScoreRule

namespace accel::models::internal {

// Causal attention of each chunk's queries over its cache and its own keys.
// q [heads, total, d] and k, v [kv_heads, total, d] hold the packed tokens;
// returns [total, heads * d]. Query heads share key/value heads in groups
// (GQA) by viewing q as [kv_heads, group * n, d]: no copy of the cache. With
// a window, query position p sees key position j when 0 <= p - j < window
// (transformers' sliding_window_overlay). Appends each chunk's keys and
// values to its cache's layer `layer`: a contiguous cache's buffers, or a
// paged cache's blocks. A paged chunk of one token attends in place, all
// such chunks of the step in one call: on the cpu (PagedDecodeAttention),
// and on a CUDA device where the kernels take the blocks
// (PagedDecodeAttentionCuda). Longer paged chunks (prefill) gather the
// blocks first; on a CUDA device, with libtorch 2.5+ and no soft-cap, they
// (and contiguous caches) run through scaled_dot_product_attention
// (SdpaAttention), elsewhere through the matmul path below.
at::Tensor AttendPacked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        absl::Span<const SequenceChunk> chunks, size_t layer,
                        std::optional<int64_t> window, const ScoreRule& rule);

// While one lives on this thread, AttendPacked runs every chunk as a row of
// a static decode step (CausalLM::ForwardStaticDecode): keys and values
// written through inputs' slots by one indexed copy per tensor, attention
// over inputs' block tables and totals (on the cpu read from them; on a
// CUDA device by the kernels, with a plan fixed by max_total).
class StaticDecodeScope {
 public:
  explicit StaticDecodeScope(const StaticDecodeInputs* inputs);
  ~StaticDecodeScope();
  StaticDecodeScope(const StaticDecodeScope&) = delete;
  StaticDecodeScope& operator=(const StaticDecodeScope&) = delete;

 private:
  const StaticDecodeInputs* previous_;
};

struct StepDecodePlan;

// While one lives on this thread (a general forward's layers: RunLayers),
// AttendPacked plans the step's one-token chunks on paged caches at its
// first call, the caches not moving until every layer ran: their rows among
// the step's tokens, block tables and totals go to the device once, and
// each layer attends them as one batch as the static decode step does (one
// gather of their queries, the kernels, one scatter of their outputs)
// instead of a query, a table and a few views a row and layer, host work
// that bounded a served step of 128 sequences on a GPU. Prompt chunks and
// draft verifications run as before. On a CUDA device only, where the
// kernels take the blocks; on the cpu where PlanStepDecodesOnCpu(true)
// asked (tests: the same rows attended by the cpu kernel, bit for bit the
// unplanned step).
class StepDecodePlanScope {
 public:
  StepDecodePlanScope();
  ~StepDecodePlanScope();
  StepDecodePlanScope(const StepDecodePlanScope&) = delete;
  StepDecodePlanScope& operator=(const StepDecodePlanScope&) = delete;

 private:
  std::unique_ptr<StepDecodePlan> plan_;
  StepDecodePlan* previous_;
};

// Whether StepDecodePlanScope plans on the cpu too (off by default).
void PlanStepDecodesOnCpu(bool on);

// Layers whose decodes AttendPacked attended through a plan, in this
// process (tests: that the planned path ran).
int64_t PlannedDecodeAttentions();

// Under a StaticDecodeScope on a CUDA device, the attention of a decoder
// layer from its unrotated q, k and v [1, rows, heads | kv_heads, d] and the
// rotary cos and sin [1, rows, d]: q and k rotated and k and v written to
// the rows' slots by one kernel (FusedRotaryStore), then the static paged
// attention; [rows, heads * dv] as AttendPacked gives. nullopt where that
// does not apply (no scope, the cpu, a partial rotary, the kernels off):
// then the caller rotates and calls AttendPacked.
std::optional<at::Tensor> AttendStaticDecodeRotating(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, const at::Tensor& cos,
                                                     const at::Tensor& sin,
                                                     absl::Span<const SequenceChunk> chunks,
                                                     size_t layer, std::optional<int64_t> window,
                                                     const ScoreRule& rule);

// Writes rows [kv_heads, n, d] at positions [past, past + n) of a layer's
// blocks [num_blocks, kv_heads, block_size, d] through a block table, as one
// indexed copy (what AttendPacked does for a prompt off the cpu, where a
// copy per block run would be a kernel launch each).
void WriteRowsIndexed(at::Tensor blocks, absl::Span<const int32_t> table, int64_t past,
                      const at::Tensor& rows);

// Writes a step's keys and values [kv_heads, T, d] (the chunks' tokens
// packed in order) at every paged chunk's next positions (from its cache's
// length) in layer `layer` of their store, as one indexed copy per tensor
// with the positions uploaded once: what AttendPacked does off the cpu, where
// a copy per run of positions is a kernel each (two a decoding sequence a
// layer). Chunks without a paged cache are skipped. False, with nothing
// written, when the paged chunks do not share one store.
bool WriteStepBlocks(absl::Span<const SequenceChunk> chunks, size_t layer, const at::Tensor& k,
                     const at::Tensor& v);

// Checks the chunks against the ids, prepares the caches, and returns the
// positions [1, total] (int64, cpu).
absl::StatusOr<at::Tensor> PreparePositions(const at::Tensor& input_ids,
                                            absl::Span<const SequenceChunk> chunks,
                                            const loader::ModelConfig& config, size_t layers);

// DataLoss once a weights file has faulted (core/file_faults.h: a mapped
// page read as zeros, or a failed read): every step fails from then on, so
// nothing computed from those bytes is answered. Called when a step starts
// and again before its caches advance.
absl::Status CheckWeightFiles();

// Each chunk's last logit_tokens tokens, as indices into the packed tokens, on
// `device` (core/device_copy.h: without waiting for it).
at::Tensor LastTokens(absl::Span<const SequenceChunk> chunks, const at::Device& device);

// After a whole step: each cache's length grows by its chunk, and it keeps
// the chunk's ids (input_ids, cpu int64, packed as `chunks`).
void AdvanceCaches(const at::Tensor& input_ids, absl::Span<const SequenceChunk> chunks);

// Runs `fn` on module `name`'s execution device, inside its scope when the
// model is dispatched; without a dispatcher, on `fallback`.
template <typename Fn>
absl::StatusOr<at::Tensor> InScope(dispatch::DispatchedModel* dispatched, const std::string& name,
                                   const at::Device& fallback, Fn&& fn) {
  std::optional<dispatch::DispatchedModel::Scope> scope;
  at::Device device = fallback;
  if (dispatched != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(dispatch::DispatchedModel::Scope entered, dispatched->Enter(name));
    device = entered.device();
    scope.emplace(std::move(entered));
  }
  // Sharded training's hooks (dispatch/module_hooks.h) when a trainer installed them.
  return dispatch::RunModule(name, [&] { return fn(device); });
}

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_PACKED_H_
