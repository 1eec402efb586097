// models/causal_lm.h: a language model of a supported family, built from its
// config on accel::nn layers, with the module structure and tensor names of
// transformers (so models::ModuleTreeFor() describes it exactly and HF
// checkpoints load into it through dispatch::DispatchedModel).
//
// One Forward() call runs any mix of sequences: a whole prompt for a new one
// (prefill), one token for a running one (decode). Their tokens are packed
// one after another, without padding, so every linear layer reads its
// weights once for the whole step; attention runs per sequence against that
// sequence's own KV cache. This is the shape continuous batching needs:
// sequences join and leave between steps.
//
//   ACCEL_ASSIGN_OR_RETURN(auto model, BuildCausalLM(config, at::kBFloat16));  // empty weights
//   ACCEL_ASSIGN_OR_RETURN(auto dispatched, dispatch::DispatchedModel::Load(model, dir, map, {}));
//   KvCache a, b;
//   std::vector<SequenceChunk> chunks = {{&a, 5}, {&b, 3}};  // prompts of 5 and 3 tokens
//   ACCEL_ASSIGN_OR_RETURN(at::Tensor logits,  // [2, vocab]: each prompt's last token
//       model->Forward(packed_ids, chunks, Logits::kLastOfEach, dispatched.get()));
#ifndef ACCEL_MODELS_CAUSAL_LM_H_
#define ACCEL_MODELS_CAUSAL_LM_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "dispatch/dispatch.h"
#include "dispatch/layer.h"
#include "loader/config.h"
#include "models/parallel_options.h"

namespace accel::models {

// The keys and values of many sequences in fixed-size blocks (the storage
// behind models/kv_blocks.h's accounting): layer l's keys and values are
// [num_blocks, kv_heads, block_size, head_dim] on that layer's device, in
// the model's dtype, made when the layer first writes (so a split model's
// blocks live where its layers run). One store per server.
class KvBlockStore {
 public:
  KvBlockStore(int64_t num_blocks, int64_t block_size, size_t layers);
  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  // Layer `layer`'s key and value blocks, made like `k` and `v` ([kv_heads,
  // n, head_dim]) on first use.
  std::pair<at::Tensor, at::Tensor> Layer(size_t layer, const at::Tensor& k, const at::Tensor& v);
  // Memory of the blocks made so far.
  int64_t bytes() const;
  // Bytes one block takes in every layer, for sizing the pool.
  static int64_t BytesPerBlock(const loader::ModelConfig& config, at::ScalarType dtype,
                               int64_t block_size);
  // What one block takes on the rank that holds most of it when the model
  // is split (`parallel`'s size and pipeline_size): its key/value heads
  // (kv_heads / size, or one replicated head when fewer than the ranks) in
  // the layers of the largest pipeline stage. Every rank keeps its blocks at
  // the leader's block ids, so the pool grows with N x M for the same bytes
  // per rank.
  static int64_t BytesPerBlock(const loader::ModelConfig& config, at::ScalarType dtype,
                               int64_t block_size, const TensorParallel& parallel);

 private:
  int64_t num_blocks_, block_size_;
  std::vector<at::Tensor> keys_, values_;
};

// The keys and values of one sequence for every layer, in one of two forms.
// Contiguous (store null): buffers [kv_heads, capacity, head_dim] per layer
// on its layer's device; capacity doubles when full, so a decode step
// appends in place. Paged (store set): the tokens' keys and values live in
// the store's blocks listed in block_table, which must cover every position
// a Forward() writes; attention reads them in place. `length` advances when
// a whole Forward() succeeds: a failed step leaves it as it was (its writes
// past `length` are overwritten by the next).
struct KvCache {
  std::vector<at::Tensor> keys;
  std::vector<at::Tensor> values;
  KvBlockStore* store = nullptr;
  std::vector<int32_t> block_table;
  int64_t length = 0;  // tokens seen; the next token's position
  // Those tokens' ids, in order: a model that must recompute its cache (a
  // LongRoPE model crossing its original context) reads them back, into a
  // contiguous cache that replaces a paged one.
  std::vector<int64_t> token_ids;

  bool paged() const { return store != nullptr; }
  int64_t bytes() const;  // memory held by contiguous buffers (paged: 0, the store holds it)
  void Clear();           // frees the buffers and forgets the blocks
};

// `tokens` of the packed input ids belong to the sequence whose cache is
// `cache`; its positions continue from cache->length. A null cache is a
// sequence starting at position 0 whose keys and values are not kept.
// With Logits::kLastOfEach the chunk's last `logit_tokens` tokens get logits
// (1: decoding; 1 + k: verifying k drafted tokens).
struct SequenceChunk {
  KvCache* cache = nullptr;
  int64_t tokens = 0;
  int64_t logit_tokens = 1;
};

// A decode step whose every changing value lives in tensors on the model's
// execution device, so that the forward reads them there and never needs
// the host: the step a CUDA graph per batch bucket replays
// (engine/decode_graphs.h). Row r of the step is chunk r (one token each);
// the caches' host state (length, block_table) is not read, nor advanced.
struct StaticDecodeInputs {
  at::Tensor positions;     // [1, rows] int64: each row's position
  at::Tensor slot_blocks;   // [rows] int64: the block its key and value go to
  at::Tensor slot_offsets;  // [rows] int64: ... and the offset in that block
  at::Tensor block_tables;  // [rows, max_blocks] int32: each row's blocks in order
  at::Tensor totals;        // [rows] int32: positions each row attends (position + 1)
  // The most positions a row may attend: fixes the attention's plan (its
  // splits), whatever the rows' lengths this step.
  int64_t max_total = 0;
};

enum class Logits {
  kAll,        // [total tokens, vocab]
  kLastOfEach  // [sum of logit_tokens, vocab]: each chunk's last logit_tokens tokens
};

// A forward pass that CausalLM::Submit started and whose logits are not
// back yet: Wait() gives what Forward would have returned (called once).
class PendingLogits {
 public:
  explicit PendingLogits(std::function<absl::StatusOr<at::Tensor>()> wait)
      : wait_(std::move(wait)) {}
  absl::StatusOr<at::Tensor> Wait() { return wait_(); }

 private:
  std::function<absl::StatusOr<at::Tensor>()> wait_;
};

class CausalLM : public dispatch::Layer {
 public:
  using dispatch::Layer::Layer;

  // input_ids [total] (int64, on the cpu or the main device), the chunks in
  // the order their tokens are packed; logits in float32 on the device of
  // input_ids. With `dispatched`, each block runs inside its execution scope
  // (offloaded weights brought in, inputs moved to its device).
  // InvalidArgument for chunk sizes that do not add up to the ids, a cache
  // used twice, an id outside the vocabulary, or a position past the
  // model's limit (GPT-2's learned positions).
  virtual absl::StatusOr<at::Tensor> Forward(const at::Tensor& input_ids,
                                             absl::Span<const SequenceChunk> chunks, Logits which,
                                             dispatch::DispatchedModel* dispatched) = 0;

  // One-token rows on paged caches of one store, with `inputs` instead of
  // the caches' host state: logits [rows, vocab] in float32 on the device of
  // input_ids, every row's key and value written; the caches are not
  // advanced (the caller does, after the step). Nothing in it reads a
  // tensor's value on the host, so it can be captured in a CUDA graph
  // (up to MaxCapturedDecodeRows() rows).
  // Unimplemented for models that cannot (SupportsStaticDecode() false:
  // GPT-2, LongRoPE, split models).
  virtual bool SupportsStaticDecode() const { return false; }
  // The most rows such a step may hold and still read nothing on the host,
  // so that it can be captured in a CUDA graph: -1 for any. A mixture-of-
  // experts model whose blocks route a few rows on the device (nn::
  // SetCudaExpertRouting: 4-bit experts resident on a CUDA device) gives
  // the rows their top-k slots allow; 0 where its blocks read the routing
  // on the host.
  virtual int64_t MaxCapturedDecodeRows() const { return -1; }
  virtual absl::StatusOr<at::Tensor> ForwardStaticDecode(const at::Tensor& input_ids,
                                                         absl::Span<const SequenceChunk> chunks,
                                                         const StaticDecodeInputs& inputs,
                                                         dispatch::DispatchedModel* dispatched) {
    (void)input_ids;
    (void)chunks;
    (void)inputs;
    (void)dispatched;
    return absl::UnimplementedError("this model has no static decode step");
  }

  // Forward, started: where later pipeline stages run in other processes
  // (pipeline_size() > 1), this process's stage runs now and the logits'
  // receive is posted, so that the caller can start the next step before
  // this one's logits are back. The chunks' caches have advanced when it
  // returns (a failed Wait leaves them advanced: the caller puts them back).
  // The default runs Forward now.
  virtual absl::StatusOr<std::unique_ptr<PendingLogits>> Submit(
      const at::Tensor& input_ids, absl::Span<const SequenceChunk> chunks, Logits which,
      dispatch::DispatchedModel* dispatched);
  // Pipeline stages the model is split into (models/tensor_parallel.h).
  virtual int pipeline_size() const { return 1; }
  // A LongRoPE model's original context: a step whose chunk takes a cache
  // of at most this many tokens past it recomputes the sequence from the
  // cache's token_ids (so a tensor-parallel leader sends those ids to the
  // other ranks then). 0: never.
  virtual int64_t recompute_after() const { return 0; }
  // Puts the weights of projections that read the same input (q, k and v;
  // gate and up) one after another in one tensor, so that each group runs
  // as one matrix product (one kernel where there were three or two, and
  // one larger GEMV). Only unquantized layers whose weights are on one
  // device, and with `cuda_only` only on a CUDA device (where a launch
  // costs what the product of a small matrix does). The parameters keep
  // their names and shapes (views of the packed tensor); the old storage is
  // freed. A model without such projections does nothing.
  virtual absl::Status PackProjections(bool cuda_only) {
    (void)cuda_only;
    return absl::OkStatus();
  }

  const loader::ModelConfig& config() const { return config_; }
  at::ScalarType dtype() const { return dtype_; }

 protected:
  CausalLM(const std::string& class_name, const loader::ModelConfig& config, at::ScalarType dtype)
      : dispatch::Layer(class_name), config_(config), dtype_(dtype) {}

 private:
  loader::ModelConfig config_;
  at::ScalarType dtype_;
};

// A model of the config's family with uninitialised weights (meta weights
// under a dispatch::EmptyWeightsGuard). InvalidArgument for an unknown
// architecture (listing the supported ones) or an invalid config. With
// `tp.size` > 1, rank `tp.rank`'s slice of it (models/tensor_parallel.h;
// CheckTensorParallel's refusals).
absl::StatusOr<std::shared_ptr<CausalLM>> BuildCausalLM(const loader::ModelConfig& config,
                                                        at::ScalarType dtype,
                                                        const TensorParallel& tp = {});

}  // namespace accel::models

#endif  // ACCEL_MODELS_CAUSAL_LM_H_
