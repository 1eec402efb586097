// GPT2LMHeadModel, the KV cache, and BuildCausalLM, which picks the model
// of a config's family (the decoder families live in
// models/internal/decoder_lm.cc).
#include "models/causal_lm.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include "absl/strings/str_cat.h"

#include "core/device_copy.h"
#include "core/status.h"
#include "models/families.h"
#include "models/internal/decoder_lm.h"
#include "models/internal/packed.h"
#include "models/nn.h"
#include "models/tensor_parallel.h"

namespace accel::models {
namespace {

using internal::AdvanceCaches;
using internal::AttendPacked;
using internal::InScope;
using internal::LastTokens;
using internal::PreparePositions;

// GPT-2: learned positions, LayerNorm, Conv1D projections, gelu_new, a tied
// head. Split over tensor-parallel ranks as Megatron-LM splits it: c_attn
// column-parallel by heads (this rank's heads' columns of each of the q, k
// and v thirds), attn.c_proj row-parallel, mlp.c_fc column-parallel,
// mlp.c_proj row-parallel (their biases held by rank 0 alone, so the
// all-reduce adds them once), wte and the tied head vocab-parallel, wpe and
// the LayerNorms replicated.
class Gpt2Attention : public dispatch::Layer {
 public:
  Gpt2Attention(int64_t hidden, int64_t heads, int64_t head_dim, at::ScalarType dtype)
      : dispatch::Layer("GPT2Attention"), heads_(heads), head_dim_(head_dim) {
    const int64_t width = heads * head_dim;  // this rank's heads
    c_attn = register_module("c_attn", std::make_shared<nn::Conv1D>(hidden, 3 * width, dtype));
    c_proj = register_module("c_proj", std::make_shared<nn::Conv1D>(width, hidden, dtype));
    register_module("attn_dropout", std::make_shared<dispatch::Layer>("Dropout"));
    register_module("resid_dropout", std::make_shared<dispatch::Layer>("Dropout"));
  }
  at::Tensor forward(const at::Tensor& x, absl::Span<const SequenceChunk> chunks, size_t layer,
                     internal::StepState& step) {
    const int64_t t = x.size(1), d = head_dim_;
    std::vector<at::Tensor> qkv = c_attn->forward(x)[0].split(heads_ * d, -1);
    at::Tensor q = qkv[0].view({t, heads_, d}).transpose(0, 1);
    at::Tensor k = qkv[1].view({t, heads_, d}).transpose(0, 1);
    at::Tensor v = qkv[2].view({t, heads_, d}).transpose(0, 1);
    internal::ScoreRule rule;
    rule.scale = std::sqrt(static_cast<double>(d));
    rule.divide = true;
    at::Tensor out = AttendPacked(q, k, v, chunks, layer, std::nullopt, rule);
    return internal::SumOverRanks(c_proj->forward(out.unsqueeze(0)), step);
  }
  std::shared_ptr<nn::Conv1D> c_attn, c_proj;

 private:
  int64_t heads_, head_dim_;
};

class Gpt2Block : public dispatch::Layer {
 public:
  Gpt2Block(const loader::ModelConfig& c, const ShardShape& shard, at::ScalarType dtype)
      : dispatch::Layer("GPT2Block"), activation_(c.hidden_act) {
    ln_1 =
        register_module("ln_1", std::make_shared<nn::LayerNorm>(c.hidden_size, c.norm_eps, dtype));
    attn = register_module(
        "attn", std::make_shared<Gpt2Attention>(c.hidden_size, shard.heads, c.head_size(), dtype));
    ln_2 =
        register_module("ln_2", std::make_shared<nn::LayerNorm>(c.hidden_size, c.norm_eps, dtype));
    auto mlp = register_module("mlp", std::make_shared<dispatch::Layer>("GPT2MLP"));
    c_fc = mlp->register_module(
        "c_fc", std::make_shared<nn::Conv1D>(c.hidden_size, shard.intermediate, dtype));
    c_proj = mlp->register_module(
        "c_proj", std::make_shared<nn::Conv1D>(shard.intermediate, c.hidden_size, dtype));
    mlp->register_module("act",
                         std::make_shared<dispatch::Layer>(nn::ActivationClass(c.hidden_act)));
    mlp->register_module("dropout", std::make_shared<dispatch::Layer>("Dropout"));
  }
  at::Tensor forward(at::Tensor x, absl::Span<const SequenceChunk> chunks, size_t layer,
                     internal::StepState& step) {
    x = x + attn->forward(ln_1->forward(x), chunks, layer, step);
    return x +
           internal::SumOverRanks(
               c_proj->forward(nn::Activation(activation_, c_fc->forward(ln_2->forward(x)))), step);
  }
  std::shared_ptr<nn::LayerNorm> ln_1, ln_2;
  std::shared_ptr<Gpt2Attention> attn;
  std::shared_ptr<nn::Conv1D> c_fc, c_proj;

 private:
  std::string activation_;  // activation_function ("gelu_new")
};

class Gpt2LM : public internal::StagedLM {
 public:
  Gpt2LM(const loader::ModelConfig& c, const TensorParallel& tp, const ShardShape& shard,
         at::ScalarType dtype)
      : StagedLM("GPT2LMHeadModel", c, dtype, tp), shard_(shard) {
    std::tie(first_layer_, last_layer_) =
        PipelineLayers(c.num_hidden_layers, tp.pipeline_rank, tp.pipeline_size);
    first_stage_ = tp.pipeline_rank == 0;
    last_stage_ = tp.pipeline_rank == tp.pipeline_size - 1;
    // A pipeline stage holds its own blocks only: wte and wpe on the first
    // stage (wte on the last too, for the tied head), ln_f and the head on
    // the last.
    transformer = register_module("transformer", std::make_shared<dispatch::Layer>("GPT2Model"));
    if (first_stage_ || (last_stage_ && c.tie_word_embeddings)) {
      wte = transformer->register_module(
          "wte", std::make_shared<nn::Embedding>(shard.vocab, c.hidden_size, dtype));
    }
    if (first_stage_) {
      wpe = transformer->register_module(
          "wpe", std::make_shared<nn::Embedding>(c.max_position_embeddings, c.hidden_size, dtype));
    }
    transformer->register_module("drop", std::make_shared<dispatch::Layer>("Dropout"));
    auto list = transformer->register_module("h", std::make_shared<dispatch::Layer>("ModuleList"));
    blocks.resize(static_cast<size_t>(c.num_hidden_layers));
    for (int64_t i = first_layer_; i < last_layer_; ++i) {
      blocks[static_cast<size_t>(i)] =
          list->register_module(absl::StrCat(i), std::make_shared<Gpt2Block>(c, shard, dtype));
    }
    if (last_stage_) {
      ln_f = transformer->register_module(
          "ln_f", std::make_shared<nn::LayerNorm>(c.hidden_size, c.norm_eps, dtype));
      at::Tensor shared = c.tie_word_embeddings ? wte->weight : at::Tensor();
      lm_head = register_module("lm_head", std::make_shared<nn::Linear>(c.hidden_size, shard.vocab,
                                                                        false, dtype, shared));
    }
  }

  absl::StatusOr<at::Tensor> Forward(const at::Tensor& input_ids,
                                     absl::Span<const SequenceChunk> given, Logits which,
                                     dispatch::DispatchedModel* dispatched) override {
    ACCEL_ASSIGN_OR_RETURN(at::Tensor positions, Positions(input_ids, given));
    const std::vector<SequenceChunk> chunks(given.begin(), given.end());
    internal::StepState step;
    step.dispatched = dispatched;
    step.tp = &tp_;
    const at::Device home = input_ids.device();
    if (tp_.pipeline_size > 1) return PipelineForward(input_ids, chunks, which, dispatched, step);
    ACCEL_ASSIGN_OR_RETURN(at::Tensor x,
                           StageEmbed(input_ids, positions, chunks, home, dispatched, step));
    ACCEL_ASSIGN_OR_RETURN(x, StageLayers(std::move(x), positions, chunks, home, dispatched, step));
    if (which == Logits::kLastOfEach) {
      ACCEL_RETURN_IF_ERROR(
          CallTorch([&] { x = x.index_select(1, LastTokens(chunks, x.device())); }));
    }
    ACCEL_ASSIGN_OR_RETURN(x, StageHead(x, home, dispatched, step));
    ACCEL_RETURN_IF_ERROR(internal::CheckWeightFiles());  // a fault during this step
    AdvanceCaches(input_ids, chunks);
    return x[0].to(home, at::kFloat);
  }

  // Pipeline parallel: the stage runs now, the logits are waited for by
  // the returned PendingLogits (the leader keeps several steps in flight).
  absl::StatusOr<std::unique_ptr<PendingLogits>> Submit(
      const at::Tensor& input_ids, absl::Span<const SequenceChunk> given, Logits which,
      dispatch::DispatchedModel* dispatched) override {
    if (tp_.pipeline_size <= 1) return CausalLM::Submit(input_ids, given, which, dispatched);
    ACCEL_RETURN_IF_ERROR(Positions(input_ids, given).status());
    const std::vector<SequenceChunk> chunks(given.begin(), given.end());
    internal::StepState step;
    step.dispatched = dispatched;
    step.tp = &tp_;
    ACCEL_ASSIGN_OR_RETURN(std::shared_ptr<PipelineStep> started,
                           PipelineStart(input_ids, chunks, which, dispatched, step));
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { AdvanceCaches(input_ids, chunks); }));
    return std::make_unique<PendingLogits>(
        [this, started]() -> absl::StatusOr<at::Tensor> { return PipelineFinish(started); });
  }

  std::shared_ptr<dispatch::Layer> transformer;
  std::shared_ptr<nn::Embedding> wte, wpe;         // wte: first (and tied last) stage; wpe: first
  std::vector<std::shared_ptr<Gpt2Block>> blocks;  // null: another stage's
  std::shared_ptr<nn::LayerNorm> ln_f;             // last stage
  std::shared_ptr<nn::Linear> lm_head;             // last stage

 protected:
  bool first_stage() const override { return first_stage_; }
  bool last_stage() const override { return last_stage_; }

  // wte (vocab-parallel: this rank's rows, summed over the ranks) + wpe.
  absl::StatusOr<at::Tensor> StageEmbed(const at::Tensor& ids, const at::Tensor& positions,
                                        const std::vector<SequenceChunk>& chunks,
                                        const at::Device& home,
                                        dispatch::DispatchedModel* dispatched,
                                        internal::StepState& step) override {
    (void)chunks;
    absl::StatusOr<at::Tensor> x =
        InScope(dispatched, "transformer.wte", home, [&](const at::Device& d) {
          return internal::EmbedVocabParallel(
              ToDeviceAsync(ids, d).unsqueeze(0),
              [&](const at::Tensor& rows) { return wte->forward(rows); }, tp_, shard_, step);
        });
    if (!x.ok()) return internal::Kept(step, x.status());
    return InScope(dispatched, "transformer.wpe", home, [&](const at::Device& d) {
      return x->to(d) + wpe->forward(ToDeviceAsync(positions, d));
    });
  }

  absl::StatusOr<at::Tensor> StageLayers(at::Tensor x, const at::Tensor& positions,
                                         const std::vector<SequenceChunk>& chunks,
                                         const at::Device& home,
                                         dispatch::DispatchedModel* dispatched,
                                         internal::StepState& step) override {
    (void)positions;
    const internal::StepDecodePlanScope decode_plan;  // the step's decodes, planned once
    for (int64_t l = first_layer_; l < last_layer_; ++l) {
      const size_t i = static_cast<size_t>(l);
      absl::StatusOr<at::Tensor> out = InScope(
          dispatched, absl::StrCat("transformer.h.", i), home,
          [&](const at::Device& d) { return blocks[i]->forward(x.to(d), chunks, i, step); });
      if (!out.ok()) return internal::Kept(step, out.status());
      x = *std::move(out);
    }
    return x;
  }

  absl::StatusOr<at::Tensor> StageHead(const at::Tensor& x, const at::Device& home,
                                       dispatch::DispatchedModel* dispatched,
                                       internal::StepState& step) override {
    ACCEL_ASSIGN_OR_RETURN(at::Tensor normed,
                           InScope(dispatched, "transformer.ln_f", home,
                                   [&](const at::Device& d) { return ln_f->forward(x.to(d)); }));
    absl::StatusOr<at::Tensor> logits =
        InScope(dispatched, "lm_head", home, [&](const at::Device& d) {
          at::Tensor out = lm_head->forward(normed.to(d));
          return tp_.size > 1 ? internal::GatherVocab(out, tp_, shard_, config().vocab_size, step)
                              : out;
        });
    if (!logits.ok()) return internal::Kept(step, logits.status());
    return logits;
  }

 private:
  // The step's positions: InvalidArgument for chunks that do not match the
  // ids, an id outside the vocabulary, or a position past wpe's.
  absl::StatusOr<at::Tensor> Positions(const at::Tensor& input_ids,
                                       absl::Span<const SequenceChunk> chunks) {
    ACCEL_RETURN_IF_ERROR(internal::CheckWeightFiles());
    ACCEL_ASSIGN_OR_RETURN(
        at::Tensor positions,
        PreparePositions(input_ids, chunks, config(), static_cast<size_t>(blocks.size())));
    const int64_t limit = config().max_position_embeddings;
    if (const int64_t last = positions.max().item<int64_t>(); last >= limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("position ", last, " is past GPT-2's ", limit, " positions"));
    }
    return positions;
  }

  ShardShape shard_;
  int64_t first_layer_ = 0, last_layer_ = 0;
  bool first_stage_ = true, last_stage_ = true;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PendingLogits>> CausalLM::Submit(
    const at::Tensor& input_ids, absl::Span<const SequenceChunk> chunks, Logits which,
    dispatch::DispatchedModel* dispatched) {
  absl::StatusOr<at::Tensor> logits = Forward(input_ids, chunks, which, dispatched);
  if (!logits.ok()) return logits.status();
  return std::make_unique<PendingLogits>(
      [logits = *std::move(logits)]() -> absl::StatusOr<at::Tensor> { return logits; });
}

int64_t KvCache::bytes() const {
  int64_t total = 0;
  for (const std::vector<at::Tensor>* buffers : {&keys, &values}) {
    for (const at::Tensor& buffer : *buffers) {
      if (buffer.defined()) total += static_cast<int64_t>(buffer.nbytes());
    }
  }
  return total;
}

void KvCache::Clear() {
  keys.clear();
  values.clear();
  store = nullptr;
  block_table.clear();
  token_ids.clear();
  length = 0;
}

KvBlockStore::KvBlockStore(int64_t num_blocks, int64_t block_size, size_t layers)
    : num_blocks_(num_blocks), block_size_(block_size), keys_(layers), values_(layers) {}

std::pair<at::Tensor, at::Tensor> KvBlockStore::Layer(size_t layer, const at::Tensor& k,
                                                      const at::Tensor& v) {
  TORCH_CHECK(layer < keys_.size(), "KV block store: layer ", layer, " of ", keys_.size());
  at::Tensor& keys = keys_[layer];
  at::Tensor& values = values_[layer];
  if (!keys.defined() || keys.device() != k.device() || keys.scalar_type() != k.scalar_type()) {
    keys = at::empty({num_blocks_, k.size(0), block_size_, k.size(2)}, k.options());
    values = at::empty({num_blocks_, v.size(0), block_size_, v.size(2)}, v.options());
  }
  return {keys, values};
}

int64_t KvBlockStore::bytes() const {
  int64_t total = 0;
  for (const std::vector<at::Tensor>* buffers : {&keys_, &values_}) {
    for (const at::Tensor& buffer : *buffers) {
      if (buffer.defined()) total += static_cast<int64_t>(buffer.nbytes());
    }
  }
  return total;
}

int64_t KvBlockStore::BytesPerBlock(const loader::ModelConfig& config, at::ScalarType dtype,
                                    int64_t block_size) {
  return 2 * config.num_hidden_layers * config.kv_heads() * config.head_size() * block_size *
         static_cast<int64_t>(c10::elementSize(dtype));
}

int64_t KvBlockStore::BytesPerBlock(const loader::ModelConfig& config, at::ScalarType dtype,
                                    int64_t block_size, const TensorParallel& parallel) {
  const int size = std::max(parallel.size, 1), stages = std::max(parallel.pipeline_size, 1);
  const int64_t kv = config.kv_heads();
  const int64_t kv_per_rank = kv % size == 0 ? kv / size : 1;
  int64_t layers = 0;
  for (int s = 0; s < stages; ++s) {
    const auto [first, last] = PipelineLayers(config.num_hidden_layers, s, stages);
    layers = std::max(layers, last - first);
  }
  return 2 * layers * kv_per_rank * config.head_size() * block_size *
         static_cast<int64_t>(c10::elementSize(dtype));
}

absl::StatusOr<std::shared_ptr<CausalLM>> BuildCausalLM(const loader::ModelConfig& c,
                                                        at::ScalarType dtype,
                                                        const TensorParallel& tp) {
  ACCEL_ASSIGN_OR_RETURN(ResolvedConfig resolved, ResolveConfig(c));
  if (tp.size != 1) {
    ACCEL_RETURN_IF_ERROR(CheckTensorParallel(c, tp.size));
    if (tp.rank < 0 || tp.rank >= tp.size) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor parallel rank ", tp.rank, " is outside [0, ", tp.size, ")"));
    }
  }
  if (tp.pipeline_size != 1) {
    ACCEL_RETURN_IF_ERROR(CheckPipelineParallel(c, tp.pipeline_size));
    if (tp.pipeline_rank < 0 || tp.pipeline_rank >= tp.pipeline_size) {
      return absl::InvalidArgumentError(absl::StrCat("pipeline stage ", tp.pipeline_rank,
                                                     " is outside [0, ", tp.pipeline_size, ")"));
    }
  }
  ACCEL_ASSIGN_OR_RETURN(ShardShape shape, ShardShapeFor(c, tp.rank, tp.size));
  if (resolved.family.mlp == MlpKind::kGpt2) {
    std::shared_ptr<CausalLM> model;
    ACCEL_RETURN_IF_ERROR(
        CallTorch([&] { model = std::make_shared<Gpt2LM>(c, tp, shape, dtype); }));
    return model;
  }
  return internal::BuildDecoderLM(resolved, dtype, tp, shape);
}

}  // namespace accel::models
