// The decoder families, after transformers v4.53.0's modeling files
// (src/transformers/models/<family>/modeling_<family>.py; each family's file
// is named in its Family entry): eager attention with the softmax in
// float32, rotate-half rotary, GQA by sharing key/value heads, and the
// family's own parts where it has them. Module names and registration order
// are transformers', so ModuleTreeFor() (derived from this model) plans the
// device maps Accelerate plans and checkpoints load as they are.
#include "models/internal/decoder_lm.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include "absl/strings/str_cat.h"

#include "core/device_copy.h"
#include "core/status.h"
#include "dispatch/empty_weights.h"
#include "dispatch/layer.h"
#include "dist/process_group.h"
#include "models/internal/fused_ops.h"
#include "models/internal/packed.h"
#include "models/nn.h"
#include "quant/cuda_matmul.h"

namespace accel::models::internal {

[[noreturn]] void Fail(StepState& step, absl::Status status, const char* what) {
  step.failure = std::move(status);
  TORCH_CHECK(false, what, " failed");
  std::abort();  // not reached
}

at::Tensor SumOverRanks(const at::Tensor& x, StepState& step) {
  if (step.tp == nullptr || step.tp->size == 1) return x;
  const auto start = std::chrono::steady_clock::now();
  // gloo updates the tensor in place on its own threads, outside this
  // thread's InferenceMode, where an inference tensor cannot be written: the
  // sum goes into a normal tensor.
  c10::InferenceMode normal(false);
  std::vector<at::Tensor> tensors = {at::empty_like(x, at::MemoryFormat::Contiguous)};
  tensors[0].copy_(x);
  AddCollectiveBytes(static_cast<int64_t>(tensors[0].nbytes()));
  absl::Status reduced = step.tp->group->AllReduce(tensors, dist::ReduceOp::kSum);
  AddCollectiveNanos(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  if (!reduced.ok()) {
    Fail(step,
         absl::UnavailableError(absl::StrCat("tensor parallel all-reduce: ", reduced.message())),
         "all-reduce");
  }
  return tensors[0];
}

at::Tensor EmbedVocabParallel(const at::Tensor& ids,
                              const std::function<at::Tensor(const at::Tensor&)>& embed,
                              const TensorParallel& tp, const ShardShape& shard, StepState& step) {
  if (tp.size == 1) return embed(ids);
  const at::Tensor rows = ids - shard.first_vocab;
  const at::Tensor outside = (rows < 0).logical_or_(rows >= shard.vocab);
  return SumOverRanks(embed(rows.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0),
                      step);
}

at::Tensor GatherVocab(const at::Tensor& logits, const TensorParallel& tp, const ShardShape& shard,
                       int64_t vocab_size, StepState& step) {
  // Equal shapes for the gather: each slice padded to the stride, as
  // rows [vocab slice, n], gathered along dim 0 in rank order.
  at::Tensor rows = logits[0].t();
  const int64_t pad = shard.vocab_stride - shard.vocab;
  if (pad > 0) rows = at::cat({rows, at::zeros({pad, rows.size(1)}, rows.options())});
  const auto start = std::chrono::steady_clock::now();
  AddCollectiveBytes(static_cast<int64_t>(rows.nbytes()));
  absl::StatusOr<at::Tensor> all;
  {
    c10::InferenceMode normal(false);  // gloo fills the output on its own threads
    all = tp.group->AllGather(rows.contiguous());
  }
  AddCollectiveNanos(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  if (!all.ok()) {
    Fail(step,
         absl::UnavailableError(
             absl::StrCat("tensor parallel logits gather: ", all.status().message())),
         "logits gather");
  }
  return all->narrow(0, 0, vocab_size).t().unsqueeze(0);
}

namespace {

using dispatch::Layer;

std::atomic<int64_t> collective_nanos{0}, collective_bytes{0}, micro_batches_run{0};
std::atomic<int64_t> device_routed_layers{0};
std::atomic<bool> route_on_device_on_cpu{false};
// -1 until read from $ACCEL_CUDA_EXPERT_ROUTING ("0": off) or set.
std::atomic<int> route_on_device{-1};

bool ExpertsRouteOnDevice() {
  int on = route_on_device.load(std::memory_order_relaxed);
  if (on < 0) {
    const char* env = std::getenv("ACCEL_CUDA_EXPERT_ROUTING");
    int unset = -1;
    route_on_device.compare_exchange_strong(unset,
                                            env != nullptr && std::string(env) == "0" ? 0 : 1);
    on = route_on_device.load(std::memory_order_relaxed);
  }
  return on == 1;
}

// The tensors `parts` as one, when they lie one after another in one
// storage, each contiguous (rows of one width, or vectors): what
// PackLinears leaves; nullopt otherwise.
std::optional<at::Tensor> AdjacentSpan(const std::vector<const at::Tensor*>& parts) {
  const at::Tensor& first = *parts.front();
  if (!first.defined() || first.is_meta() || first.dim() < 1 || first.dim() > 2) {
    return std::nullopt;
  }
  int64_t rows = 0, next = first.storage_offset();
  for (const at::Tensor* t : parts) {
    if (!t->defined() || !t->is_contiguous() || t->dim() != first.dim() ||
        t->scalar_type() != first.scalar_type() || t->device() != first.device() ||
        !t->storage().is_alias_of(first.storage()) || t->storage_offset() != next ||
        (first.dim() == 2 && t->size(1) != first.size(1))) {
      return std::nullopt;
    }
    next += t->numel();
    rows += t->size(0);
  }
  if (first.dim() == 1) return first.as_strided({rows}, {1}, first.storage_offset());
  return first.as_strided({rows, first.size(1)}, {first.size(1), 1}, first.storage_offset());
}

// The weight and bias (undefined without one) of linears packed by
// PackLinears (`packed` set there) as one each, or nullopt when they are not
// adjacent any more (a layer quantized, or moved by a dispatch hook) or not
// on x's device.
std::optional<std::pair<at::Tensor, at::Tensor>> PackedSpans(
    bool packed, const at::Tensor& x, std::initializer_list<const nn::Linear*> parts) {
  if (!packed) return std::nullopt;
  std::vector<const at::Tensor*> weights, biases;
  for (const nn::Linear* p : parts) {
    if (p->quantization().enabled()) return std::nullopt;
    weights.push_back(&p->weight);
    biases.push_back(&p->bias);
  }
  const bool has_bias = biases.front()->defined();
  std::optional<at::Tensor> weight = AdjacentSpan(weights);
  std::optional<at::Tensor> bias = has_bias ? AdjacentSpan(biases) : std::nullopt;
  if (!weight || (has_bias && !bias) || weight->device() != x.device()) return std::nullopt;
  return std::make_pair(*std::move(weight), bias ? *std::move(bias) : at::Tensor());
}

// y for linears packed by PackLinears as one product, or nullopt (as
// PackedSpans).
std::optional<at::Tensor> PackedForward(bool packed, const at::Tensor& x,
                                        std::initializer_list<const nn::Linear*> parts) {
  std::optional<std::pair<at::Tensor, at::Tensor>> spans = PackedSpans(packed, x, parts);
  if (!spans) return std::nullopt;
  return nn::DenseLinear(x, spans->first, spans->second);
}

// `norm` of x (+ residual) and the packed product of it in one kernel
// (nn::RMSNorm::NormThenLinear: a decode step on a CUDA device), or nullopt.
std::optional<std::pair<at::Tensor, at::Tensor>> NormThenPacked(
    nn::RMSNorm& norm, const at::Tensor& x, const at::Tensor& residual, bool packed,
    std::initializer_list<const nn::Linear*> parts) {
  // (Prefill and larger batches go the other way at once: no spans made twice.)
  if (!DecodeGemvMayTake(x)) return std::nullopt;
  std::optional<std::pair<at::Tensor, at::Tensor>> spans = PackedSpans(packed, x, parts);
  if (!spans) return std::nullopt;
  return norm.NormThenLinear(x, residual, spans->first, spans->second);
}

// Copies the weights (and biases) of `parts` into one tensor each and makes
// every layer's own a view of it, in place (dispatch/empty_weights.h), when
// they are unquantized, on one device (a CUDA one with `cuda_only`), of one
// dtype and width. True when they are packed now.
absl::StatusOr<bool> PackLinears(const std::vector<nn::Linear*>& parts, bool cuda_only) {
  const nn::Linear& first = *parts[0];
  for (const nn::Linear* p : parts) {
    if (p->quantization().enabled() || !p->weight.defined() || p->weight.is_meta() ||
        p->weight.dim() != 2 || p->weight.device() != first.weight.device() ||
        p->weight.scalar_type() != first.weight.scalar_type() ||
        p->weight.size(1) != first.weight.size(1) || p->bias.defined() != first.bias.defined() ||
        (p->bias.defined() && p->bias.scalar_type() != first.bias.scalar_type())) {
      return false;
    }
  }
  const at::Device device = first.weight.device();
  if (cuda_only && !device.is_cuda()) return false;
  at::Tensor weights, biases;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    c10::InferenceMode mode(first.weight.is_inference());
    std::vector<at::Tensor> w, b;
    for (const nn::Linear* p : parts) {
      w.push_back(p->weight);
      if (p->bias.defined()) b.push_back(p->bias.to(device));
    }
    weights = at::cat(w, 0);
    if (!b.empty()) biases = at::cat(b, 0);
  }));
  int64_t row = 0;
  for (nn::Linear* p : parts) {
    const int64_t rows = p->weight.size(0);
    ACCEL_RETURN_IF_ERROR(
        dispatch::SetTensorInPlace(p->weight, "weight", device, weights.narrow(0, row, rows)));
    if (biases.defined()) {
      ACCEL_RETURN_IF_ERROR(
          dispatch::SetTensorInPlace(p->bias, "bias", device, biases.narrow(0, row, rows)));
    }
    row += rows;
  }
  // The old weights' blocks back to the driver at once: a packed tensor is
  // larger than any of them, so the caching allocator could not reuse them
  // for the next group, and the model's packing would end holding its
  // packed weights twice (and the KV sizing would count the copy as in use).
  if (device.is_cuda()) ReleaseCachedCudaMemory();
  return true;
}

std::shared_ptr<nn::Linear> NewLinear(int64_t in, int64_t out, bool bias, at::ScalarType dtype) {
  return std::make_shared<nn::Linear>(in, out, bias, dtype);
}

std::string Cls(const Family& f, const char* what) { return absl::StrCat(f.prefix, what); }

std::shared_ptr<nn::RMSNorm> NewNorm(const ResolvedConfig& r, int64_t dim, at::ScalarType dtype) {
  return std::make_shared<nn::RMSNorm>(Cls(r.family, "RMSNorm"), dim, r.config.norm_eps, dtype,
                                       r.family.norm == NormKind::kRmsOnePlus);
}

// A gated MLP under one of its three namings:
//   kGated:  gate_proj, up_proj, down_proj, act_fn       (LlamaMLP and most)
//   kFused:  gate_up_proj (gate half first), down_proj, activation_fn (Phi3MLP)
//   kMixtral: w1 (gate), w2 (down), w3 (up), act_fn      (MixtralBlockSparseTop2MLP)
// All compute down(act(gate(x)) * up(x)).
class GatedMlp : public Layer {
 public:
  enum class Names { kGated, kFused, kMixtral };
  GatedMlp(const std::string& class_name, Names names, int64_t hidden, int64_t inter,
           const std::string& activation, at::ScalarType dtype)
      : Layer(class_name), activation_(activation), inter_(inter) {
    const std::string act_class = nn::ActivationClass(activation);
    switch (names) {
      case Names::kGated:
        gate_ = register_module("gate_proj", NewLinear(hidden, inter, false, dtype));
        up_ = register_module("up_proj", NewLinear(hidden, inter, false, dtype));
        down_ = register_module("down_proj", NewLinear(inter, hidden, false, dtype));
        register_module("act_fn", std::make_shared<Layer>(act_class));
        break;
      case Names::kFused:
        gate_up_ = register_module("gate_up_proj", NewLinear(hidden, 2 * inter, false, dtype));
        down_ = register_module("down_proj", NewLinear(inter, hidden, false, dtype));
        register_module("activation_fn", std::make_shared<Layer>(act_class));
        break;
      case Names::kMixtral:
        gate_ = register_module("w1", NewLinear(hidden, inter, false, dtype));
        down_ = register_module("w2", NewLinear(inter, hidden, false, dtype));
        up_ = register_module("w3", NewLinear(hidden, inter, false, dtype));
        register_module("act_fn", std::make_shared<Layer>(act_class));
        break;
    }
  }

  // gate and up as one product (CausalLM::PackProjections).
  absl::Status PackProjections(bool cuda_only) {
    if (!gate_ || !up_) return absl::OkStatus();
    ACCEL_ASSIGN_OR_RETURN(packed_, PackLinears({gate_.get(), up_.get()}, cuda_only));
    return absl::OkStatus();
  }

  // `norm` of x (+ residual) and the gate and up products of it in one
  // kernel: {x + residual, gate | up} for ForwardGateUp, or nullopt.
  std::optional<std::pair<at::Tensor, at::Tensor>> NormedGateUp(nn::RMSNorm& norm,
                                                                const at::Tensor& x,
                                                                const at::Tensor& residual) {
    if (gate_up_ && !gate_up_->quantization().enabled()) {
      return norm.NormThenLinear(x, residual, gate_up_->weight, gate_up_->bias);
    }
    return NormThenPacked(norm, x, residual, packed_, {gate_.get(), up_.get()});
  }

  // The rest of the MLP from the gate | up product (packed, or Phi-3's).
  // SiLU's on a CUDA device at decode: the activation inside the down
  // projection's kernel (FusedSiluMulLinear).
  at::Tensor ForwardGateUp(const at::Tensor& both) {
    if (activation_ == "silu" && !down_->quantization().enabled()) {
      if (std::optional<at::Tensor> y = FusedSiluMulLinear(both, down_->weight, down_->bias)) {
        return *y;
      }
    }
    return down_->forward(nn::ActivationTimes(activation_, both.narrow(-1, 0, inter_),
                                              both.narrow(-1, inter_, inter_)));
  }

  // gate, up and down apart (null for Phi-3's gate_up_proj), and the
  // activation: what a mixture's experts routed on the device run.
  nn::Linear* gate_linear() const { return gate_.get(); }
  nn::Linear* up_linear() const { return up_.get(); }
  nn::Linear* down_linear() const { return down_.get(); }
  const std::string& activation() const { return activation_; }

  at::Tensor forward(const at::Tensor& x) {
    if (std::optional<at::Tensor> both = PackedForward(packed_, x, {gate_.get(), up_.get()})) {
      return ForwardGateUp(*both);
    }
    // Phi3MLP: gate, up_states = gate_up_proj(x).chunk(2, dim=-1)
    if (gate_up_) return ForwardGateUp(gate_up_->forward(x));
    return down_->forward(nn::ActivationTimes(activation_, gate_->forward(x), up_->forward(x)));
  }

 private:
  std::string activation_;
  int64_t inter_;
  std::shared_ptr<nn::Linear> gate_, up_, down_, gate_up_;
  bool packed_ = false;
};

class Attention : public Layer {
 public:
  // `shard`: the heads this rank holds (all of them on one process).
  Attention(const ResolvedConfig& r, const ShardShape& shard, at::ScalarType dtype,
            std::shared_ptr<nn::RotaryEmbedding> unused_rotary)
      : Layer(Cls(r.family, "Attention")),
        heads_(shard.heads),
        kv_heads_(shard.kv_heads),
        head_dim_(r.config.head_size()) {
    const Family& f = r.family;
    const int64_t hidden = r.config.hidden_size;
    const int64_t q_out = heads_ * head_dim_, kv_out = kv_heads_ * head_dim_;
    bool qkv_bias = false, o_bias = false;
    switch (f.attention_bias) {
      case AttentionBias::kNone:
        break;
      case AttentionBias::kConfig:
        qkv_bias = o_bias = r.config.attention_bias;
        break;
      case AttentionBias::kQkv:
        qkv_bias = r.config.qkv_bias.value_or(true);
        break;
    }
    if (f.fused_qkv) {
      // Phi3Attention registers o_proj first.
      o_proj_ = register_module("o_proj", NewLinear(q_out, hidden, false, dtype));
      qkv_proj_ = register_module("qkv_proj", NewLinear(hidden, q_out + 2 * kv_out, false, dtype));
    } else {
      q_proj_ = register_module("q_proj", NewLinear(hidden, q_out, qkv_bias, dtype));
      k_proj_ = register_module("k_proj", NewLinear(hidden, kv_out, qkv_bias, dtype));
      v_proj_ = register_module("v_proj", NewLinear(hidden, kv_out, qkv_bias, dtype));
      o_proj_ = register_module("o_proj", NewLinear(q_out, hidden, o_bias, dtype));
    }
    // Qwen2MoeAttention (v4.53.0) holds a rotary embedding it never uses.
    if (unused_rotary) register_module("rotary_emb", std::move(unused_rotary));
    if (f.qk_norm) {
      q_norm_ = register_module("q_norm", NewNorm(r, head_dim_, dtype));
      k_norm_ = register_module("k_norm", NewNorm(r, head_dim_, dtype));
    }
    if (f.divide_scores) {
      rule_.scale = std::sqrt(static_cast<double>(head_dim_));
      rule_.divide = true;
    } else if (r.query_pre_attn_scalar) {
      rule_.scale = std::pow(*r.query_pre_attn_scalar, -0.5);
    } else {
      rule_.scale = std::pow(static_cast<double>(head_dim_), -0.5);
    }
    rule_.softcap = r.attn_softcap;
  }

  // q, k and v as one product (CausalLM::PackProjections).
  absl::Status PackProjections(bool cuda_only) {
    if (!q_proj_) return absl::OkStatus();
    ACCEL_ASSIGN_OR_RETURN(packed_,
                           PackLinears({q_proj_.get(), k_proj_.get(), v_proj_.get()}, cuda_only));
    return absl::OkStatus();
  }

  // `norm` of x (+ residual) and the packed q | k | v product of it in one
  // kernel: {x + residual, q | k | v} for ForwardQkv, or nullopt.
  std::optional<std::pair<at::Tensor, at::Tensor>> NormedQkv(nn::RMSNorm& norm, const at::Tensor& x,
                                                             const at::Tensor& residual) {
    if (qkv_proj_ && !qkv_proj_->quantization().enabled()) {
      return norm.NormThenLinear(x, residual, qkv_proj_->weight, qkv_proj_->bias);
    }
    return NormThenPacked(norm, x, residual, packed_,
                          {q_proj_.get(), k_proj_.get(), v_proj_.get()});
  }

  // x [1, total, hidden]: the packed tokens of `chunks`.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     absl::Span<const SequenceChunk> chunks, size_t layer,
                     std::optional<int64_t> window) {
    if (std::optional<at::Tensor> qkv =
            PackedForward(packed_, x, {q_proj_.get(), k_proj_.get(), v_proj_.get()})) {
      return ForwardQkv(*qkv, cos, sin, chunks, layer, window);
    }
    if (qkv_proj_) return ForwardQkv(qkv_proj_->forward(x), cos, sin, chunks, layer, window);
    return ForwardProjected(q_proj_->forward(x), k_proj_->forward(x), v_proj_->forward(x), cos, sin,
                            chunks, layer, window);
  }

  // The rest from one q | k | v product [1, total, q_out + 2 kv_out].
  at::Tensor ForwardQkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        absl::Span<const SequenceChunk> chunks, size_t layer,
                        std::optional<int64_t> window) {
    const int64_t q_out = heads_ * head_dim_, kv_out = kv_heads_ * head_dim_;
    return ForwardProjected(qkv.narrow(-1, 0, q_out), qkv.narrow(-1, q_out, kv_out),
                            qkv.narrow(-1, q_out + kv_out, kv_out), cos, sin, chunks, layer,
                            window);
  }

 private:
  at::Tensor ForwardProjected(at::Tensor q, at::Tensor k, at::Tensor v, const at::Tensor& cos,
                              const at::Tensor& sin, absl::Span<const SequenceChunk> chunks,
                              size_t layer, std::optional<int64_t> window) {
    const int64_t t = q.size(1);
    q = q.reshape({1, t, heads_, head_dim_});
    k = k.reshape({1, t, kv_heads_, head_dim_});
    v = v.reshape({1, t, kv_heads_, head_dim_});
    // Per head, before RoPE (Qwen3 before the transpose, Gemma 3 after: the
    // same numbers, as the norm runs over the last dimension).
    if (q_norm_) {
      q = q_norm_->forward(q);
      k = k_norm_->forward(k);
    }
    // A static decode step on a CUDA device: the rotary embedding and the KV
    // write as one kernel.
    if (std::optional<at::Tensor> out =
            AttendStaticDecodeRotating(q, k, v, cos, sin, chunks, layer, window, rule_)) {
      return o_proj_->forward(out->unsqueeze(0));
    }
    q = nn::ApplyRotary(q.transpose(1, 2), cos, sin);
    k = nn::ApplyRotary(k.transpose(1, 2), cos, sin);
    at::Tensor out = AttendPacked(q[0], k[0], v.transpose(1, 2)[0], chunks, layer, window, rule_);
    return o_proj_->forward(out.unsqueeze(0));
  }

  int64_t heads_, kv_heads_, head_dim_;
  ScoreRule rule_;
  std::shared_ptr<nn::Linear> q_proj_, k_proj_, v_proj_, o_proj_, qkv_proj_;
  std::shared_ptr<nn::RMSNorm> q_norm_, k_norm_;
  bool packed_ = false;
};

// A sparse mixture-of-experts block (MixtralSparseMoeBlock,
// Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock): the router's softmax in
// float32 over every expert, the top k, renormalised where the family does,
// cast to the model dtype; each expert that was picked runs once on the rows
// routed to it, and its weighted output is added into those rows, experts in
// ascending order (index_add_, as transformers accumulates). No expert that
// was not picked runs.
class SparseMoe : public Layer {
 public:
  // `shard`: the experts this rank holds, [first_expert, first_expert +
  // experts), registered under local indices 0, 1, ... (so the dispatch
  // core's expert lists index them), and its slice of the shared expert.
  SparseMoe(const ResolvedConfig& r, const ShardShape& shard, std::string experts_name,
            at::ScalarType dtype)
      : Layer(Cls(r.family, "SparseMoeBlock")),
        experts_name_(std::move(experts_name)),
        num_experts_(r.num_experts),
        top_k_(r.top_k),
        norm_topk_(r.norm_topk),
        first_expert_(shard.first_expert) {
    const Family& f = r.family;
    const int64_t hidden = r.config.hidden_size;
    gate = register_module("gate", NewLinear(hidden, r.num_experts, false, dtype));
    auto list = register_module("experts", std::make_shared<Layer>("ModuleList"));
    const bool mixtral = f.moe == MoeKind::kMixtral;
    for (int64_t e = 0; e < shard.experts; ++e) {
      experts_.push_back(list->register_module(
          absl::StrCat(e), std::make_shared<GatedMlp>(
                               mixtral ? std::string("MixtralBlockSparseTop2MLP") : Cls(f, "MLP"),
                               mixtral ? GatedMlp::Names::kMixtral : GatedMlp::Names::kGated,
                               hidden, r.expert_intermediate, r.activation, dtype)));
    }
    if (f.moe == MoeKind::kQwenShared) {
      shared_expert_ = register_module(
          "shared_expert",
          std::make_shared<GatedMlp>(Cls(f, "MLP"), GatedMlp::Names::kGated, hidden,
                                     shard.shared_intermediate, r.activation, dtype));
      shared_expert_gate_ =
          register_module("shared_expert_gate", NewLinear(hidden, 1, false, dtype));
    }
  }

  const std::string& experts_name() const { return experts_name_; }

  // Each expert's (and the shared expert's) gate and up as one product:
  // those that are resident where packing applies (CausalLM::PackProjections).
  // Also where the experts are 4-bit and resident on a CUDA device, their
  // pointer tables for routing on the device (DeviceRoutedForward).
  absl::Status PackProjections(bool cuda_only) {
    for (const std::shared_ptr<GatedMlp>& expert : experts_) {
      ACCEL_RETURN_IF_ERROR(expert->PackProjections(cuda_only));
    }
    if (shared_expert_) ACCEL_RETURN_IF_ERROR(shared_expert_->PackProjections(cuda_only));
    MakeDeviceExperts();
    return absl::OkStatus();
  }

  // The routing of rows h [T, hidden]: weights [T, k] (model dtype) and the
  // experts [T, k] (int64).
  std::pair<at::Tensor, at::Tensor> Route(const at::Tensor& h) {
    at::Tensor probs = at::softmax(gate->forward(h), 1, at::kFloat);
    auto [weights, selected] = at::topk(probs, top_k_, -1);
    if (norm_topk_) weights = weights / weights.sum(-1, /*keepdim=*/true);
    return {weights.to(h.scalar_type()), selected};
  }

  // The most decode rows this block routes on the device (their slots
  // within kDeviceRoutedMaxSlots), or 0 where it reads the routing on the
  // host (CausalLM::MaxCapturedDecodeRows).
  int64_t DeviceRoutedRows() const {
    return device_experts_ && ExpertsRouteOnDevice() ? kDeviceRoutedMaxSlots / top_k_ : 0;
  }

  // Whether the router's weights are here (it can guess ahead).
  bool CanRoute() const { return !gate->weight.is_meta(); }

  at::Tensor forward(const at::Tensor& x, StepState& step) {
    const int64_t hidden = x.size(-1);
    at::Tensor h = x.reshape({-1, hidden});
    const int64_t tokens = h.size(0);
    at::Tensor weights, selected;
    std::tie(weights, selected) = Route(h);
    if (RoutesOnDevice(h, step)) return DeviceRoutedForward(x, h, weights, selected);
    // The rows of each expert, in transformers' order (top-k slot, then token).
    const at::Tensor picks = selected.to(at::kCPU).contiguous();
    const int64_t* pick = picks.data_ptr<int64_t>();
    // Indexed by local expert (global index - first_expert_); experts of
    // other ranks are theirs to run.
    std::vector<std::vector<int64_t>> rows(experts_.size()), slots(experts_.size());
    for (int64_t j = 0; j < top_k_; ++j) {
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t e = pick[t * top_k_ + j] - first_expert_;
        if (e < 0 || e >= static_cast<int64_t>(experts_.size())) continue;
        rows[e].push_back(t);
        slots[e].push_back(j);
      }
    }
    std::vector<int64_t> hit;
    for (size_t e = 0; e < rows.size(); ++e) {
      if (!rows[e].empty()) hit.push_back(static_cast<int64_t>(e));
    }
    TraceRouting(rows);
    // The picked experts' rows and top-k slots, sent to the device at once
    // (one copy a layer, not waiting for it): expert e's n rows at
    // where[e], its slots n after them.
    std::vector<int64_t> packed, where(experts_.size(), 0);
    for (int64_t e : hit) {
      const size_t u = static_cast<size_t>(e);
      where[u] = static_cast<int64_t>(packed.size());
      packed.insert(packed.end(), rows[u].begin(), rows[u].end());
      packed.insert(packed.end(), slots[u].begin(), slots[u].end());
    }
    const at::Tensor on_device = Int64sOn(packed, h.device());
    const auto rows_of = [&](int64_t e) {
      return on_device.narrow(0, where[static_cast<size_t>(e)],
                              static_cast<int64_t>(rows[static_cast<size_t>(e)].size()));
    };
    // Each picked expert's weighted output, added in ascending order below.
    std::vector<at::Tensor> outputs(experts_.size());
    const auto run = [&](int64_t e) {
      const int64_t n = static_cast<int64_t>(rows[static_cast<size_t>(e)].size());
      at::Tensor idx = rows_of(e);
      at::Tensor slot = on_device.narrow(0, where[static_cast<size_t>(e)] + n, n);
      at::Tensor w = weights.index_select(0, idx).gather(1, slot.unsqueeze(1));
      outputs[e] = experts_[e]->forward(h.index_select(0, idx)) * w;
    };
    const auto enter = [&](const std::vector<int64_t>& which) {
      auto entered = step.dispatched->EnterExperts(experts_name_, which);
      if (!entered.ok()) Fail(step, entered.status(), "bringing in experts");
      return *std::move(entered);
    };
    if (step.dispatched != nullptr && step.dispatched->FetchesExpertsOf(experts_name_)) {
      // The picked experts that are here run first, held while they do; the
      // reader reads the others in order meanwhile, and each runs as it comes.
      std::vector<int64_t> ready, missing;
      for (int64_t e : hit) {
        (step.dispatched->ExpertReady(experts_name_, e) ? ready : missing).push_back(e);
      }
      {
        dispatch::DispatchedModel::ExpertScope held = enter(ready);
        step.dispatched->PrefetchExperts(experts_name_, missing, /*needed=*/true);
        for (int64_t e : ready) run(e);
      }
      for (int64_t e : missing) {
        dispatch::DispatchedModel::ExpertScope held = enter({e});
        run(e);
      }
    } else {
      std::optional<dispatch::DispatchedModel::ExpertScope> held;
      if (step.dispatched != nullptr) held.emplace(enter(hit));
      for (int64_t e : hit) run(e);
    }
    at::Tensor out = at::zeros({tokens, hidden}, h.options());
    for (int64_t e : hit) {
      out.index_add_(0, rows_of(e), outputs[e].to(out.scalar_type()));
    }
    if (shared_expert_) {
      out = out + at::sigmoid(shared_expert_gate_->forward(h)) * shared_expert_->forward(h);
    }
    return out.view(x.sizes());
  }

  std::shared_ptr<nn::Linear> gate;

  // This rank's local indices of global experts `picked` (others dropped).
  std::vector<int64_t> Local(const std::vector<int64_t>& picked) const {
    std::vector<int64_t> local;
    for (int64_t e : picked) {
      const int64_t l = e - first_expert_;
      if (l >= 0 && l < static_cast<int64_t>(experts_.size())) local.push_back(l);
    }
    return local;
  }

 private:
  // The experts' linears of one kind, in order.
  enum class Part { kGate, kUp, kDown };
  nn::Linear* PartOf(const GatedMlp& expert, Part part) const {
    switch (part) {
      case Part::kGate:
        return expert.gate_linear();
      case Part::kUp:
        return expert.up_linear();
      case Part::kDown:
        return expert.down_linear();
    }
    return nullptr;
  }
  std::vector<quant::Weight4bit> Weights4bit(Part part) const {
    std::vector<quant::Weight4bit> weights;
    for (const std::shared_ptr<GatedMlp>& expert : experts_) {
      weights.push_back(PartOf(*expert, part)->Weight4bitView());
    }
    return weights;
  }

  // Whether every expert of this block (all of the model's: no expert
  // parallelism) is a 4-bit gated MLP without bias or double quant, one
  // compute dtype.
  bool Experts4bitGated() const {
    if (first_expert_ != 0 || static_cast<int64_t>(experts_.size()) != num_experts_) return false;
    for (const std::shared_ptr<GatedMlp>& expert : experts_) {
      for (Part part : {Part::kGate, Part::kUp, Part::kDown}) {
        const nn::Linear* linear = PartOf(*expert, part);
        if (linear == nullptr || linear->bias.defined() || linear->weight_state == nullptr) {
          return false;
        }
        const nn::LinearQuantization& how = linear->quantization();
        if (!how.enabled() || how.method == nn::LinearQuantization::Method::kInt8 ||
            how.double_quant ||
            how.compute_dtype !=
                PartOf(*experts_.front(), Part::kGate)->quantization().compute_dtype) {
          return false;
        }
      }
    }
    return true;
  }

  // The experts' tables for Linear4bitExpertsCuda, where every expert is
  // 4-bit and resident on one CUDA device in a form its kernel takes; none
  // otherwise (the block then routes on the host).
  void MakeDeviceExperts() {
    device_experts_.reset();
    if (!quant::CudaKernelsBuilt() || !Experts4bitGated()) return;
    DeviceExperts made;
    for (Part part : {Part::kGate, Part::kUp, Part::kDown}) {
      const at::ScalarType compute = PartOf(*experts_.front(), part)->quantization().compute_dtype;
      absl::StatusOr<quant::Experts4bitCuda> table =
          quant::MakeExperts4bitCuda(Weights4bit(part), compute);
      if (!table.ok()) return;  // not resident on a device, or not a form the kernel takes
      made.parts[static_cast<size_t>(part)] = *std::move(table);
    }
    device_experts_ = std::move(made);
  }

  // Whether this step's rows route on the device: a few decode rows (each
  // of the k slots a token reads its expert's weights, so at many tokens
  // the host's grouping, which reads each picked expert once, reads less),
  // the experts resident as the tables hold them (not brought in one by
  // one, not moved since), and no routing trace asked for.
  bool RoutesOnDevice(const at::Tensor& h, const StepState& step) const {
    if (h.size(0) * top_k_ > kDeviceRoutedMaxSlots || RoutingTraced()) return false;
    if (h.is_cuda()) {
      if (!device_experts_ || !ExpertsRouteOnDevice()) return false;
    } else if (!(h.device().is_cpu() && route_on_device_on_cpu.load() && Experts4bitGated())) {
      return false;
    }
    if (step.dispatched != nullptr && step.dispatched->FetchesExpertsOf(experts_name_)) {
      return false;
    }
    return !h.is_cuda() || DeviceExpertsInPlace();
  }

  // Whether every expert's packed weights are where the tables point (one
  // pointer a linear: a dispatch hook moves a layer's tensors together).
  bool DeviceExpertsInPlace() const {
    for (Part part : {Part::kGate, Part::kUp, Part::kDown}) {
      const std::vector<const void*>& packed =
          device_experts_->parts[static_cast<size_t>(part)].packed;
      for (size_t e = 0; e < experts_.size(); ++e) {
        const at::Tensor& weight = PartOf(*experts_[e], part)->weight;
        if (!weight.has_storage() || weight.data_ptr() != packed[e]) return false;
      }
    }
    return true;
  }

  // Each slot's row (x row s / slots_per_x) times its expert's `part`:
  // [slots, out]. On a CUDA device one kernel reading the experts' indices
  // there; on the cpu (RouteExpertsOnDeviceOnCpu, tests) each slot's row
  // through its expert's own layer.
  at::Tensor SlotProducts(Part part, const at::Tensor& x, int64_t slots_per_x,
                          const at::Tensor& ids) const {
    if (x.is_cuda()) {
      absl::StatusOr<at::Tensor> y = quant::Linear4bitExpertsCuda(
          x, slots_per_x, ids, device_experts_->parts[static_cast<size_t>(part)]);
      TORCH_CHECK(y.ok(), experts_name_, ": ", y.status().message());
      return *std::move(y);
    }
    const at::Tensor picks = ids.to(at::kCPU).contiguous();
    std::vector<at::Tensor> rows;
    for (int64_t s = 0; s < picks.numel(); ++s) {
      const GatedMlp& expert = *experts_[static_cast<size_t>(picks.data_ptr<int64_t>()[s])];
      rows.push_back(PartOf(expert, part)->forward(x.narrow(0, s / slots_per_x, 1)));
    }
    return at::cat(rows, 0);
  }

  // The block's output with the routing left on the device: every slot's
  // expert product at once (gate and up of the token's row, the activation,
  // down), each weighted by its routing weight in the model dtype, then a
  // token's slots added into zeros in ascending expert order: the host
  // path's index_add_ over its experts, bit for bit (each slot's product is
  // the one-row product of its expert).
  at::Tensor DeviceRoutedForward(const at::Tensor& x, const at::Tensor& h,
                                 const at::Tensor& weights, const at::Tensor& selected) {
    device_routed_layers.fetch_add(1, std::memory_order_relaxed);
    const int64_t tokens = h.size(0), hidden = h.size(1), slots = tokens * top_k_;
    const at::Tensor ids = selected.reshape({slots}).contiguous();
    const GatedMlp& first = *experts_.front();
    const at::Tensor gate_rows = SlotProducts(Part::kGate, h, top_k_, ids);
    const at::Tensor up_rows = SlotProducts(Part::kUp, h, top_k_, ids);
    const at::Tensor down_rows = SlotProducts(
        Part::kDown, nn::ActivationTimes(first.activation(), gate_rows, up_rows), 1, ids);
    at::Tensor parts = (down_rows * weights.reshape({slots, 1})).view({tokens, top_k_, hidden});
    if (top_k_ > 2) {
      // Two slots add the same either way; more in ascending expert order.
      const at::Tensor order = at::argsort(selected, /*dim=*/int64_t{1});
      parts = parts.gather(1, order.unsqueeze(-1).expand({tokens, top_k_, hidden}));
    }
    at::Tensor out = at::zeros({tokens, hidden}, h.options());
    for (int64_t j = 0; j < top_k_; ++j) out.add_(parts.select(1, j));
    if (shared_expert_) {
      out = out + at::sigmoid(shared_expert_gate_->forward(h)) * shared_expert_->forward(h);
    }
    return out.view(x.sizes());
  }

  static bool RoutingTraced() {
    static const bool traced = [] {
      const char* path = std::getenv("ACCEL_ROUTING_TRACE");
      return path != nullptr && *path != '\0';
    }();
    return traced;
  }

  // With $ACCEL_ROUTING_TRACE set, a line per block and step: the block's
  // experts list, then "expert:rows" for each expert picked (for studying
  // the expert cache's policy on real routing).
  void TraceRouting(const std::vector<std::vector<int64_t>>& rows) const {
    static std::FILE* trace = [] {
      const char* path = std::getenv("ACCEL_ROUTING_TRACE");
      return path != nullptr && *path != '\0' ? std::fopen(path, "a") : nullptr;
    }();
    if (trace == nullptr) return;
    std::string line = experts_name_;
    for (size_t e = 0; e < rows.size(); ++e) {
      if (!rows[e].empty()) absl::StrAppend(&line, " ", e, ":", rows[e].size());
    }
    std::fprintf(trace, "%s\n", line.c_str());
    std::fflush(trace);
  }

  std::string experts_name_;
  struct DeviceExperts {
    std::array<quant::Experts4bitCuda, 3> parts;  // Part order
  };
  std::optional<DeviceExperts> device_experts_;
  int64_t num_experts_;
  int64_t top_k_;
  bool norm_topk_;
  int64_t first_expert_;
  std::vector<std::shared_ptr<GatedMlp>> experts_;
  std::shared_ptr<GatedMlp> shared_expert_;
  std::shared_ptr<nn::Linear> shared_expert_gate_;
};

class DecoderLayer : public Layer {
 public:
  DecoderLayer(const ResolvedConfig& r, const ShardShape& shard, size_t index, at::ScalarType dtype,
               std::shared_ptr<nn::RotaryEmbedding> unused_rotary)
      : Layer(r.family.block_class), window_(r.windows[index]), local_(r.local_rope[index]) {
    const Family& f = r.family;
    const int64_t hidden = r.config.hidden_size;
    self_attn = register_module(
        "self_attn", std::make_shared<Attention>(r, shard, dtype, std::move(unused_rotary)));
    if (r.sparse[index]) {
      const char* block = f.moe == MoeKind::kMixtral ? "block_sparse_moe" : "mlp";
      moe = register_module(
          block,
          std::make_shared<SparseMoe>(
              r, shard, absl::StrCat("model.layers.", index, ".", block, ".experts"), dtype));
    } else {
      mlp = register_module(
          "mlp", std::make_shared<GatedMlp>(Cls(f, "MLP"),
                                            f.mlp == MlpKind::kFusedGated ? GatedMlp::Names::kFused
                                                                          : GatedMlp::Names::kGated,
                                            hidden, shard.intermediate, r.activation, dtype));
    }
    input_layernorm = register_module("input_layernorm", NewNorm(r, hidden, dtype));
    post_attention_layernorm =
        register_module("post_attention_layernorm", NewNorm(r, hidden, dtype));
    if (f.sandwich_norms) {
      pre_feedforward_layernorm =
          register_module("pre_feedforward_layernorm", NewNorm(r, hidden, dtype));
      post_feedforward_layernorm =
          register_module("post_feedforward_layernorm", NewNorm(r, hidden, dtype));
    }
    if (f.residual_dropouts) {
      register_module("resid_attn_dropout", std::make_shared<Layer>("Dropout"));
      register_module("resid_mlp_dropout", std::make_shared<Layer>("Dropout"));
    }
  }

  bool uses_local_rope() const { return local_; }

  // With `carry` null, the layer's output. Otherwise the output is
  // x + *carry: a defined *carry on the way in is the previous layer's last
  // branch, not yet added, which this layer's input norm adds (as the
  // post-attention norm adds the attention's branch: one kernel each on a
  // CUDA device, nn::RMSNorm::AddForward); on the way out *carry is this
  // layer's last branch, for the next layer, or for RunLayers to add after
  // the last.
  at::Tensor forward(at::Tensor x, at::Tensor* carry, const at::Tensor& cos, const at::Tensor& sin,
                     absl::Span<const SequenceChunk> chunks, size_t layer, StepState& step) {
    at::Tensor normed;
    const at::Tensor residual = carry != nullptr ? *carry : at::Tensor();
    at::Tensor h;
    // A decode step on a CUDA device: each norm inside the product after it
    // (one kernel, models/cuda/decode_gemv.h); else the norm, then the layer.
    if (auto fused = self_attn->NormedQkv(*input_layernorm, x, residual)) {
      if (residual.defined()) x = std::move(fused->first);
      h = SumOverRanks(self_attn->ForwardQkv(fused->second, cos, sin, chunks, layer, window_),
                       step);
    } else {
      if (residual.defined()) {
        std::tie(x, normed) = input_layernorm->AddForward(x, residual);
      } else {
        normed = input_layernorm->forward(x);
      }
      h = SumOverRanks(self_attn->forward(normed, cos, sin, chunks, layer, window_), step);
    }
    at::Tensor branch;
    if (pre_feedforward_layernorm) {
      // Gemma's sandwich: each branch normalised on the way in and the way out.
      x = x + post_attention_layernorm->forward(h);
      branch =
          post_feedforward_layernorm->forward(Mlp(pre_feedforward_layernorm->forward(x), step));
    } else if (std::optional<std::pair<at::Tensor, at::Tensor>> fused =
                   mlp ? mlp->NormedGateUp(*post_attention_layernorm, x, h) : std::nullopt) {
      x = std::move(fused->first);
      if (next_sparse != nullptr && step.dispatched != nullptr) GuessNext(x, step);
      branch = SumOverRanks(mlp->ForwardGateUp(fused->second), step);
    } else {
      std::tie(x, normed) = post_attention_layernorm->AddForward(x, h);
      if (next_sparse != nullptr && step.dispatched != nullptr) GuessNext(x, step);
      branch = Mlp(normed, step);
    }
    if (carry == nullptr) return x + branch;
    *carry = std::move(branch);
    return x;
  }

  std::shared_ptr<Attention> self_attn;
  std::shared_ptr<GatedMlp> mlp;
  std::shared_ptr<SparseMoe> moe;
  std::shared_ptr<nn::RMSNorm> input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
      post_feedforward_layernorm;
  // The next layer with a sparse block, whose experts this one guesses.
  DecoderLayer* next_sparse = nullptr;

 private:
  at::Tensor Mlp(const at::Tensor& x, StepState& step) {
    return SumOverRanks(moe ? moe->forward(x, step) : mlp->forward(x), step);
  }

  // Reads ahead the experts the next sparse layers' routers would pick for
  // this layer's residual stream: it changes little from one layer to the
  // next, so the guess is mostly right for the next layer and less so
  // farther on; a wrong one costs a read. Several layers ahead, because a
  // read from disk takes as long as many layers' compute: the cache reads
  // the nearest layer's guesses first and keeps a rate of use per distance.
  void GuessNext(const at::Tensor& x, StepState& step) {
    DecoderLayer* next = next_sparse;
    for (int ahead = 0; ahead < kGuessLayers && next != nullptr;
         ++ahead, next = next->next_sparse) {
      if (!next->moe->CanRoute() || next->post_attention_layernorm->weight.is_meta() ||
          !step.dispatched->FetchesExpertsOf(next->moe->experts_name())) {
        return;
      }
      const at::Tensor& w = next->post_attention_layernorm->weight;
      at::Tensor h = next->post_attention_layernorm->forward(x.to(w.device()));
      at::Tensor picked = std::get<1>(next->moe->Route(h.reshape({-1, h.size(-1)})));
      at::Tensor unique = std::get<0>(at::_unique(picked.reshape({-1}).to(at::kCPU)));
      std::vector<int64_t> experts(unique.data_ptr<int64_t>(),
                                   unique.data_ptr<int64_t>() + unique.numel());
      step.dispatched->PrefetchExperts(next->moe->experts_name(), next->moe->Local(experts));
    }
  }

  // How many sparse layers ahead GuessNext reads.
  static constexpr int kGuessLayers = 3;

  std::optional<int64_t> window_;
  bool local_;
};

nn::RopeSettings GlobalRope(const ResolvedConfig& r) {
  nn::RopeSettings s;
  s.dim = r.rotary_dim;
  s.theta = r.config.rope_theta;
  s.scaling = r.config.rope_scaling;
  s.max_position_embeddings = r.config.max_position_embeddings;
  s.original_max_position_embeddings = r.config.original_max_position_embeddings;
  // Phi3Config always has one (default 4096); LongRoPE divides by it.
  if (r.family.partial_rotary && !s.original_max_position_embeddings) {
    s.original_max_position_embeddings = 4096;
  }
  return s;
}

class DecoderModel : public Layer {
 public:
  DecoderModel(const ResolvedConfig& r, const TensorParallel& tp, const ShardShape& shard,
               at::ScalarType dtype, std::vector<std::shared_ptr<nn::RotaryEmbedding>> rotaries)
      : Layer(r.family.model_class) {
    const Family& f = r.family;
    const loader::ModelConfig& c = r.config;
    std::tie(first_layer, last_layer) =
        PipelineLayers(c.num_hidden_layers, tp.pipeline_rank, tp.pipeline_size);
    first_stage = tp.pipeline_rank == 0;
    last_stage = tp.pipeline_rank == tp.pipeline_size - 1;
    // A pipeline stage holds its own layers only: the embedding on the first
    // stage (and on the last when lm_head shares it), the final norm on the
    // last.
    if (!first_stage && !(last_stage && c.tie_word_embeddings)) {
      // No embedding here.
    } else if (f.embedding_scale == EmbeddingScale::kInModule) {
      // Gemma3TextScaledWordEmbedding: sqrt(hidden) in a buffer.
      scaled_embed = std::make_shared<nn::ScaledEmbedding>(
          "Gemma3TextScaledWordEmbedding", shard.vocab, c.hidden_size, dtype,
          std::pow(static_cast<double>(c.hidden_size), 0.5));
      embed_tokens = register_module("embed_tokens", std::shared_ptr<nn::Embedding>(scaled_embed));
    } else {
      embed_tokens = register_module(
          "embed_tokens", std::make_shared<nn::Embedding>(shard.vocab, c.hidden_size, dtype));
    }
    auto list = register_module("layers", std::make_shared<Layer>("ModuleList"));
    size_t next_rotary = 2;  // rotaries: global, local, then one per layer (Qwen2-MoE)
    layers.resize(static_cast<size_t>(c.num_hidden_layers));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      std::shared_ptr<nn::RotaryEmbedding> unused;
      if (next_rotary < rotaries.size()) unused = rotaries[next_rotary++];
      if (i < first_layer || i >= last_layer) continue;  // another stage's
      layers[static_cast<size_t>(i)] = (list->register_module(
          absl::StrCat(i), std::make_shared<DecoderLayer>(r, shard, static_cast<size_t>(i), dtype,
                                                          std::move(unused))));
    }
    DecoderLayer* next = nullptr;
    for (size_t i = layers.size(); i-- > 0;) {
      if (!layers[i]) continue;
      layers[i]->next_sparse = next;
      if (layers[i]->moe) next = layers[i].get();
    }
    if (last_stage) norm = register_module("norm", NewNorm(r, c.hidden_size, dtype));
    rotary_emb = register_module("rotary_emb", rotaries[0]);
    if (rotaries[1]) rotary_emb_local = register_module("rotary_emb_local", rotaries[1]);
  }

  std::shared_ptr<nn::Embedding> embed_tokens;
  std::shared_ptr<nn::ScaledEmbedding> scaled_embed;  // Gemma 3: embed_tokens itself
  std::vector<std::shared_ptr<DecoderLayer>> layers;  // null: another stage's
  int64_t first_layer = 0, last_layer = 0;            // this stage's [first, last)
  bool first_stage = true, last_stage = true;
  std::shared_ptr<nn::RMSNorm> norm;
  std::shared_ptr<nn::RotaryEmbedding> rotary_emb, rotary_emb_local;
};

class DecoderLM : public StagedLM {
 public:
  DecoderLM(const ResolvedConfig& r, const TensorParallel& tp, const ShardShape& shard,
            at::ScalarType dtype, std::vector<std::shared_ptr<nn::RotaryEmbedding>> rotaries)
      : StagedLM(r.family.architecture, r.config, dtype, tp), r_(r), shard_(shard) {
    model = register_module(
        "model", std::make_shared<DecoderModel>(r, tp, shard, dtype, std::move(rotaries)));
    if (model->last_stage) {
      at::Tensor shared = r.config.tie_word_embeddings ? model->embed_tokens->weight : at::Tensor();
      lm_head = register_module(
          "lm_head",
          std::make_shared<nn::Linear>(r.config.hidden_size, shard.vocab, false, dtype, shared));
    }
  }

  absl::StatusOr<at::Tensor> Forward(const at::Tensor& input_ids,
                                     absl::Span<const SequenceChunk> given, Logits which,
                                     dispatch::DispatchedModel* dispatched) override {
    const size_t n = model->layers.size();
    ACCEL_RETURN_IF_ERROR(CheckWeightFiles());
    ACCEL_RETURN_IF_ERROR(PreparePositions(input_ids, given, config(), n).status());
    ACCEL_ASSIGN_OR_RETURN(Recompute rc, PlanRecompute(input_ids, given));
    const at::Tensor& ids = rc.ids;
    std::vector<SequenceChunk>& chunks = rc.chunks;
    ACCEL_ASSIGN_OR_RETURN(at::Tensor positions, PreparePositions(ids, chunks, config(), n));

    StepState step;
    step.dispatched = dispatched;
    step.tp = &tp_;
    const at::Device home = input_ids.device();
    if (tp_.pipeline_size > 1) {
      ACCEL_ASSIGN_OR_RETURN(at::Tensor logits,
                             PipelineForward(ids, chunks, which, dispatched, step));
      rc.Replace(given);
      return rc.StepRows(logits, which);
    }
    ACCEL_ASSIGN_OR_RETURN(at::Tensor x, Embed(ids, home, dispatched, step));
    ACCEL_ASSIGN_OR_RETURN(x, RunLayers(std::move(x), positions, chunks, home, dispatched, step));
    if (which == Logits::kLastOfEach) {
      ACCEL_RETURN_IF_ERROR(
          CallTorch([&] { x = x.index_select(1, LastTokens(chunks, x.device())); }));
    } else if (rc.any) {
      ACCEL_RETURN_IF_ERROR(
          CallTorch([&] { x = x.index_select(1, Int64sOn(rc.rows, x.device())); }));
    }
    ACCEL_ASSIGN_OR_RETURN(x, Head(x, home, dispatched, step));
    ACCEL_RETURN_IF_ERROR(CheckWeightFiles());  // a fault during this step
    AdvanceCaches(ids, chunks);
    rc.Replace(given);
    return x[0].to(home, at::kFloat);
  }

  int64_t recompute_after() const override { return model->rotary_emb->long_after(); }

  int64_t MaxCapturedDecodeRows() const override {
    int64_t most = -1;
    for (const std::shared_ptr<DecoderLayer>& layer : model->layers) {
      if (layer == nullptr || layer->moe == nullptr) continue;
      const int64_t rows = layer->moe->DeviceRoutedRows();
      if (rows == 0) return 0;
      most = most < 0 ? rows : std::min(most, rows);
    }
    return most;
  }

  absl::Status PackProjections(bool cuda_only) override {
    // On a CUDA device only where the replaced weights' memory can be given
    // back (ReleaseCachedCudaMemory), else packing would hold it twice.
    if (cuda_only && !FusedCudaOpsBuilt()) return absl::OkStatus();
    for (const std::shared_ptr<DecoderLayer>& layer : model->layers) {
      if (layer == nullptr) continue;  // another pipeline stage's
      ACCEL_RETURN_IF_ERROR(layer->self_attn->PackProjections(cuda_only));
      if (layer->mlp) ACCEL_RETURN_IF_ERROR(layer->mlp->PackProjections(cuda_only));
      if (layer->moe) ACCEL_RETURN_IF_ERROR(layer->moe->PackProjections(cuda_only));
    }
    return absl::OkStatus();
  }

 protected:
  bool first_stage() const override { return model->first_stage; }
  bool last_stage() const override { return model->last_stage; }
  absl::StatusOr<at::Tensor> StageEmbed(const at::Tensor& ids, const at::Tensor& positions,
                                        const std::vector<SequenceChunk>& chunks,
                                        const at::Device& home,
                                        dispatch::DispatchedModel* dispatched,
                                        StepState& step) override {
    (void)positions;
    (void)chunks;
    return Embed(ids, home, dispatched, step);
  }
  absl::StatusOr<at::Tensor> StageLayers(at::Tensor x, const at::Tensor& positions,
                                         const std::vector<SequenceChunk>& chunks,
                                         const at::Device& home,
                                         dispatch::DispatchedModel* dispatched,
                                         StepState& step) override {
    return RunLayers(std::move(x), positions, chunks, home, dispatched, step);
  }
  absl::StatusOr<at::Tensor> StageHead(const at::Tensor& x, const at::Device& home,
                                       dispatch::DispatchedModel* dispatched,
                                       StepState& step) override {
    return Head(x, home, dispatched, step);
  }

 public:
  bool SupportsStaticDecode() const override {
    return model->rotary_emb->long_after() == 0 && tp_.size == 1 && tp_.pipeline_size == 1;
  }

  absl::StatusOr<at::Tensor> ForwardStaticDecode(const at::Tensor& input_ids,
                                                 absl::Span<const SequenceChunk> given,
                                                 const StaticDecodeInputs& inputs,
                                                 dispatch::DispatchedModel* dispatched) override {
    if (!SupportsStaticDecode()) {
      return absl::UnimplementedError(
          "a static decode step needs a model on one rank without LongRoPE (whose factors "
          "depend on each sequence's length)");
    }
    if (input_ids.dim() != 1 || input_ids.numel() != static_cast<int64_t>(given.size()) ||
        !inputs.positions.defined() || inputs.positions.numel() != input_ids.numel()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a static decode step takes one id and one position per chunk: ", input_ids.numel(),
          " ids for ", given.size(), " chunks"));
    }
    ACCEL_RETURN_IF_ERROR(CheckWeightFiles());
    const std::vector<SequenceChunk> chunks(given.begin(), given.end());
    StepState step;
    step.dispatched = dispatched;
    step.tp = &tp_;
    const at::Device home = input_ids.device();
    StaticDecodeScope scope(&inputs);
    ACCEL_ASSIGN_OR_RETURN(at::Tensor x, Embed(input_ids, home, dispatched, step));
    ACCEL_ASSIGN_OR_RETURN(
        x, RunLayers(std::move(x), inputs.positions, chunks, home, dispatched, step));
    ACCEL_ASSIGN_OR_RETURN(x, Head(x, home, dispatched, step));
    at::Tensor logits;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { logits = x[0].to(home, at::kFloat); }));
    return logits;
  }

  std::shared_ptr<DecoderModel> model;
  std::shared_ptr<nn::Linear> lm_head;

 private:
  // LongRoPE: a sequence whose step crosses the original context is run
  // again whole with the long factors (Phi3ForCausalLM drops the cache
  // then), into a fresh cache that replaces its own once the step
  // succeeds. On one rank the fresh cache is contiguous. On split ranks it
  // is the sequence's own paged blocks, rewritten from position 0: every
  // rank's cache is a view of its block store at the leader's block ids
  // (nothing of a sequence lives on a worker between steps), the blocks
  // cover every position the step writes, and they are not shared (the
  // engine turns prefix caching off for LongRoPE). A step that fails after
  // writing has failed a collective, which breaks the group anyway.
  struct Recompute {
    bool any = false;
    at::Tensor ids;                     // the step's ids, with the recomputed sequences' past
    std::vector<SequenceChunk> chunks;  // their chunks from position 0
    std::vector<KvCache> fresh;         // the recomputed sequences' caches
    std::vector<int64_t> rows;          // the rows of `ids` that belong to the step (kAll)

    void Replace(absl::Span<const SequenceChunk> given) {
      for (size_t i = 0; i < chunks.size(); ++i) {
        if (chunks[i].cache == &fresh[i]) *given[i].cache = std::move(fresh[i]);
      }
    }
    // Logits [rows, vocab] of the step's own rows (kAll: not the past's).
    absl::StatusOr<at::Tensor> StepRows(const at::Tensor& logits, Logits which) const {
      if (!any || which != Logits::kAll || !logits.defined()) return logits;
      at::Tensor out;
      ACCEL_RETURN_IF_ERROR(
          CallTorch([&] { out = logits.index_select(0, Int64sOn(rows, logits.device())); }));
      return out;
    }
  };

  absl::StatusOr<Recompute> PlanRecompute(const at::Tensor& input_ids,
                                          absl::Span<const SequenceChunk> given) {
    Recompute rc;
    rc.ids = input_ids;
    rc.chunks.assign(given.begin(), given.end());
    rc.fresh.resize(given.size());
    const int64_t long_after = model->rotary_emb->long_after();
    const auto crossing = [long_after](const SequenceChunk& c) {
      return long_after > 0 && c.cache != nullptr && c.cache->length > 0 &&
             c.cache->length <= long_after && c.cache->length + c.tokens > long_after;
    };
    for (const SequenceChunk& c : given) rc.any |= crossing(c);
    if (!rc.any) return rc;
    for (size_t i = 0; i < given.size(); ++i) {
      if (crossing(given[i]) &&
          given[i].cache->token_ids.size() != static_cast<size_t>(given[i].cache->length)) {
        return absl::FailedPreconditionError(
            absl::StrCat("sequence ", i,
                         " crosses the original context of a LongRoPE model and must be "
                         "recomputed, but its KV cache does not hold the ids of its tokens"));
      }
    }
    const bool split = tp_.size > 1 || tp_.pipeline_size > 1;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      const at::Tensor cpu = input_ids.to(at::kCPU).contiguous();
      const int64_t* data = cpu.data_ptr<int64_t>();
      std::vector<int64_t> all;
      int64_t row = 0;
      for (size_t i = 0; i < rc.chunks.size(); ++i) {
        SequenceChunk& c = rc.chunks[i];
        if (crossing(given[i])) {
          const std::vector<int64_t>& past = c.cache->token_ids;
          all.insert(all.end(), past.begin(), past.end());
          row += static_cast<int64_t>(past.size());
          c.tokens += static_cast<int64_t>(past.size());
          if (split && c.cache->paged()) {
            rc.fresh[i].store = c.cache->store;
            rc.fresh[i].block_table = c.cache->block_table;
          }
          c.cache = &rc.fresh[i];
        }
        for (int64_t t = 0; t < given[i].tokens; ++t) {
          all.push_back(*data++);
          rc.rows.push_back(row++);
        }
      }
      rc.ids = Int64sOn(all, input_ids.device());
    }));
    return rc;
  }

  // cos / sin of every packed position, on `device`; with LongRoPE, each
  // chunk with the factors its last position calls for (read from the
  // positions as the step built them: on the host, no wait for the device).
  std::pair<at::Tensor, at::Tensor> Rotary(nn::RotaryEmbedding& rope, const at::Tensor& positions,
                                           const at::Device& device,
                                           const std::vector<SequenceChunk>& chunks) {
    const at::Tensor on_device = ToDeviceAsync(positions, device);
    if (rope.long_after() == 0) return rope.forward(on_device, dtype());
    std::vector<at::Tensor> cos, sin;
    int64_t offset = 0;
    for (const SequenceChunk& c : chunks) {
      at::Tensor p = on_device.narrow(1, offset, c.tokens);
      const int64_t last = positions[0][offset + c.tokens - 1].item<int64_t>();
      auto [a, b] = rope.forward(p, dtype(), /*long_factors=*/last + 1 > rope.long_after());
      cos.push_back(a);
      sin.push_back(b);
      offset += c.tokens;
    }
    return {at::cat(cos, 1), at::cat(sin, 1)};
  }

  // [1, n, hidden]: the embedding of `ids` (vocab-parallel: each rank's
  // rows, summed over the ranks), scaled as the family scales it.
  absl::StatusOr<at::Tensor> Embed(const at::Tensor& ids, const at::Device& home,
                                   dispatch::DispatchedModel* dispatched, StepState& step) {
    absl::StatusOr<at::Tensor> embedded =
        InScope(dispatched, "model.embed_tokens", home, [&](const at::Device& d) {
          at::Tensor e = EmbedVocabParallel(
              ToDeviceAsync(ids, d).unsqueeze(0),
              [&](const at::Tensor& rows) {
                return model->scaled_embed ? model->scaled_embed->forward(rows)
                                           : model->embed_tokens->forward(rows);
              },
              tp_, shard_, step);
          if (r_.family.embedding_scale == EmbeddingScale::kInModel) {
            // Gemma2Model: hidden * torch.tensor(hidden_size**0.5, dtype=hidden.dtype)
            e = e * at::scalar_tensor(std::pow(static_cast<double>(config().hidden_size), 0.5),
                                      e.options());
          }
          return e;
        });
    if (!embedded.ok()) return Kept(step, embedded.status());
    return embedded;
  }

  // This stage's layers on `x` [1, n, hidden] at `positions`.
  absl::StatusOr<at::Tensor> RunLayers(at::Tensor x, const at::Tensor& positions,
                                       const std::vector<SequenceChunk>& chunks,
                                       const at::Device& home,
                                       dispatch::DispatchedModel* dispatched, StepState& step) {
    const StepDecodePlanScope decode_plan;  // the step's decodes, planned once (AttendPacked)
    at::Tensor cos, sin, local_cos, local_sin;
    ACCEL_RETURN_IF_ERROR(InScope(dispatched, "model.rotary_emb", home, [&](const at::Device& d) {
                            std::tie(cos, sin) = Rotary(*model->rotary_emb, positions, d, chunks);
                            return cos;
                          }).status());
    if (model->rotary_emb_local) {
      ACCEL_RETURN_IF_ERROR(
          InScope(dispatched, "model.rotary_emb_local", home, [&](const at::Device& d) {
            std::tie(local_cos, local_sin) = Rotary(*model->rotary_emb_local, positions, d, chunks);
            return local_cos;
          }).status());
    }
    // Each layer's last branch, added by the next layer's input norm; not
    // when autograd records (training): a branch's backward must run inside
    // its own layer, where FSDP and the offload hooks gather its weights.
    at::Tensor carry;
    at::Tensor* const carried = c10::GradMode::is_enabled() ? nullptr : &carry;
    for (size_t i = static_cast<size_t>(model->first_layer);
         i < static_cast<size_t>(model->last_layer); ++i) {
      DecoderLayer& layer = *model->layers[i];
      const bool local = layer.uses_local_rope();
      absl::StatusOr<at::Tensor> out =
          InScope(dispatched, absl::StrCat("model.layers.", i), home, [&](const at::Device& d) {
            if (carry.defined()) carry = carry.to(d);
            return layer.forward(x.to(d), carried, (local ? local_cos : cos).to(d),
                                 (local ? local_sin : sin).to(d), chunks, i, step);
          });
      if (!out.ok()) return Kept(step, out.status());
      x = *std::move(out);
    }
    // The last layer's branch (a pipeline stage hands on the whole stream).
    if (carry.defined()) {
      ACCEL_RETURN_IF_ERROR(CallTorch([&] { x = x + carry.to(x.device()); }));
    }
    return x;
  }

  // The final norm and lm_head on the rows of `x` that are sampled:
  // [1, rows, vocab] in the model's dtype (vocab-parallel: gathered).
  absl::StatusOr<at::Tensor> Head(const at::Tensor& x, const at::Device& home,
                                  dispatch::DispatchedModel* dispatched, StepState& step) {
    ACCEL_ASSIGN_OR_RETURN(at::Tensor normed,
                           InScope(dispatched, "model.norm", home, [&](const at::Device& d) {
                             return model->norm->forward(x.to(d));
                           }));
    absl::StatusOr<at::Tensor> head =
        InScope(dispatched, "lm_head", home, [&](const at::Device& d) {
          at::Tensor logits = lm_head->forward(normed.to(d));
          if (r_.final_softcap) {
            // Gemma2ForCausalLM, in the logits' dtype.
            logits = at::tanh(logits / *r_.final_softcap) * *r_.final_softcap;
          }
          return tp_.size > 1 ? GatherVocab(logits, step) : logits;
        });
    if (!head.ok()) return Kept(step, head.status());
    return head;
  }

  // Pipeline parallel: the stage runs now, the logits are waited for by
  // the returned PendingLogits (the leader keeps several steps in flight).
  absl::StatusOr<std::unique_ptr<PendingLogits>> Submit(
      const at::Tensor& input_ids, absl::Span<const SequenceChunk> given, Logits which,
      dispatch::DispatchedModel* dispatched) override {
    if (tp_.pipeline_size <= 1) return CausalLM::Submit(input_ids, given, which, dispatched);
    ACCEL_RETURN_IF_ERROR(CheckWeightFiles());
    ACCEL_RETURN_IF_ERROR(
        PreparePositions(input_ids, given, config(), model->layers.size()).status());
    ACCEL_ASSIGN_OR_RETURN(Recompute rc, PlanRecompute(input_ids, given));
    ACCEL_RETURN_IF_ERROR(
        PreparePositions(rc.ids, rc.chunks, config(), model->layers.size()).status());
    StepState step;
    step.dispatched = dispatched;
    step.tp = &tp_;
    ACCEL_ASSIGN_OR_RETURN(std::shared_ptr<PipelineStep> started,
                           PipelineStart(rc.ids, rc.chunks, which, dispatched, step));
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { AdvanceCaches(rc.ids, rc.chunks); }));
    rc.Replace(given);
    auto recompute = std::make_shared<Recompute>();
    recompute->any = rc.any;
    recompute->rows = std::move(rc.rows);
    return std::make_unique<PendingLogits>(
        [this, started, recompute, which]() -> absl::StatusOr<at::Tensor> {
          ACCEL_ASSIGN_OR_RETURN(at::Tensor logits, PipelineFinish(started));
          return recompute->StepRows(logits, which);
        });
  }

  at::Tensor GatherVocab(const at::Tensor& logits, StepState& step) {
    return internal::GatherVocab(logits, tp_, shard_, config().vocab_size, step);
  }

  ResolvedConfig r_;
  ShardShape shard_;
};

}  // namespace

// ---------------------------------------------------------------------------
// StagedLM: the pipeline-parallel step every staged model shares.

StagedLM::StagedLM(const std::string& class_name, const loader::ModelConfig& config,
                   at::ScalarType dtype, const TensorParallel& tp)
    : CausalLM(class_name, config, dtype), tp_(tp) {}

// A pipeline step whose stage has run on this rank: its sends and the
// leader's logits receives still in flight.
struct StagedLM::PipelineMicroBatch {
  at::Tensor ids;
  std::vector<SequenceChunk> chunks;
  at::Tensor inbox, logits;  // the previous stage's hidden states; the leader's logits
  std::unique_ptr<dist::PendingWork> received, logits_received;
};
struct StagedLM::PipelineStep {
  at::Device home = at::kCPU;
  int last_stage_first = 0;
  std::vector<PipelineMicroBatch> batches;
  std::vector<std::unique_ptr<dist::PendingWork>> sends;
};

// Posts a send or receive to world rank `peer` (pipeline parallel).
// Unavailable naming what moves when it cannot be posted.
template <typename Post>
absl::StatusOr<std::unique_ptr<dist::PendingWork>> StagedLM::Transfer(Post post, bool send,
                                                                      int peer, const char* what) {
  absl::StatusOr<std::unique_ptr<dist::PendingWork>> work;
  {
    c10::InferenceMode normal(false);  // gloo reads and fills buffers on its own threads
    work = post();
  }
  if (!work.ok()) return Moved(work.status(), send, peer, what);
  return work;
}

// Waits for a posted send or receive, counted as collective time.
// Unavailable naming what moved when the peer is gone or silent past the
// group's timeout.
absl::Status StagedLM::Wait(dist::PendingWork& work, bool send, int peer, const char* what) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status moved;
  {
    c10::InferenceMode normal(false);
    moved = work.Wait();
  }
  AddCollectiveNanos(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  return moved.ok() ? moved : Moved(moved, send, peer, what);
}

absl::Status StagedLM::Moved(const absl::Status& status, bool send, int peer, const char* what) {
  return absl::UnavailableError(
      absl::StrCat("pipeline parallel: ", send ? "sending " : "receiving ", what,
                   peer >= 0 ? absl::StrCat(send ? " to" : " from", " rank ", peer) : std::string(),
                   " failed: ", status.message()));
}

// One pipeline-parallel step on this rank's stage. The step's chunks are
// cut into micro-batches (PipelineMicroBatches, the same cut on every
// rank); every receive of the step is posted first and every send is
// asynchronous, so a stage runs micro-batch k + 1 while the next stage
// runs k and the bytes of k + 2 travel (GPipe's fill and drain within
// the step). The last stage's first rank sends each micro-batch's float32
// logits to world rank 0, whose Forward returns them concatenated in the
// step's row order (the micro-batches are contiguous). Sequences' KV
// caches are their own, so the micro-batches are independent; the caches
// advance once every micro-batch has run.
absl::StatusOr<at::Tensor> StagedLM::PipelineForward(const at::Tensor& ids,
                                                     const std::vector<SequenceChunk>& chunks,
                                                     Logits which,
                                                     dispatch::DispatchedModel* dispatched,
                                                     StepState& step) {
  ACCEL_ASSIGN_OR_RETURN(std::shared_ptr<PipelineStep> started,
                         PipelineStart(ids, chunks, which, dispatched, step));
  ACCEL_ASSIGN_OR_RETURN(at::Tensor logits, PipelineFinish(started));
  AdvanceCaches(ids, chunks);
  return logits;
}

// The stage's part of the step: receives posted, every micro-batch run
// and its output sent. The caches have not advanced.
absl::StatusOr<std::shared_ptr<StagedLM::PipelineStep>> StagedLM::PipelineStart(
    const at::Tensor& ids, const std::vector<SequenceChunk>& chunks, Logits which,
    dispatch::DispatchedModel* dispatched, StepState& step) {
  const at::Device home = ids.device();
  auto started = std::make_shared<PipelineStep>();
  started->home = home;
  const size_t n = static_cast<size_t>(config().num_hidden_layers);
  std::vector<int64_t> tokens;
  int64_t step_tokens = 0;
  for (const SequenceChunk& c : chunks) {
    tokens.push_back(c.tokens);
    step_tokens += c.tokens;
  }
  const std::vector<std::pair<size_t, size_t>> cuts =
      PipelineMicroBatches(tokens, tp_.pipeline_micro_batches > 0
                                       ? tp_.pipeline_micro_batches
                                       : PipelineAutoMicroBatches(step_tokens, tp_.pipeline_size));
  const int previous = tp_.world_rank() - tp_.size, next = tp_.world_rank() + tp_.size;
  const int last_stage_first = (tp_.pipeline_size - 1) * tp_.size;
  const bool leader = tp_.world_rank() == 0;
  const bool sends_logits = last_stage() && tp_.rank == 0;
  started->last_stage_first = last_stage_first;
  std::vector<PipelineMicroBatch>& batches = started->batches;
  batches.resize(cuts.size());
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    int64_t offset = 0;
    for (size_t k = 0; k < cuts.size(); ++k) {
      PipelineMicroBatch& b = batches[k];
      b.chunks.assign(chunks.begin() + static_cast<std::ptrdiff_t>(cuts[k].first),
                      chunks.begin() + static_cast<std::ptrdiff_t>(cuts[k].second));
      int64_t count = 0, rows = 0;
      for (const SequenceChunk& c : b.chunks) {
        count += c.tokens;
        rows += std::min(std::max<int64_t>(c.logit_tokens, 1), c.tokens);
      }
      b.ids = ids.narrow(0, offset, count);
      offset += count;
      // gloo fills these on its own threads: normal tensors, not inference ones.
      c10::InferenceMode normal(false);
      if (!first_stage()) {
        b.inbox = at::empty({1, count, config().hidden_size}, at::dtype(dtype()));
      }
      if (leader) {
        b.logits =
            at::empty({which == Logits::kAll ? count : rows, config().vocab_size}, at::kFloat);
      }
    }
  }));
  // Every receive of the step, posted up front.
  for (PipelineMicroBatch& b : batches) {
    if (b.inbox.defined()) {
      ACCEL_ASSIGN_OR_RETURN(
          b.received, Transfer([&] { return tp_.world->RecvAsync(b.inbox, previous); }, false,
                               previous, "hidden states"));
    }
    if (b.logits.defined()) {
      ACCEL_ASSIGN_OR_RETURN(
          b.logits_received,
          Transfer([&] { return tp_.world->RecvAsync(b.logits, last_stage_first); }, false,
                   last_stage_first, "logits"));
    }
  }
  std::vector<std::unique_ptr<dist::PendingWork>>& sends = started->sends;
  const auto send = [&](at::Tensor tensor, int peer, const char* what) -> absl::Status {
    AddCollectiveBytes(static_cast<int64_t>(tensor.nbytes()));
    ACCEL_ASSIGN_OR_RETURN(
        std::unique_ptr<dist::PendingWork> work,
        Transfer([&] { return tp_.world->SendAsync(tensor, peer); }, true, peer, what));
    sends.push_back(std::move(work));
    return absl::OkStatus();
  };
  for (PipelineMicroBatch& b : batches) {
    at::Tensor x;
    ACCEL_ASSIGN_OR_RETURN(at::Tensor positions, PreparePositions(b.ids, b.chunks, config(), n));
    if (first_stage()) {
      ACCEL_ASSIGN_OR_RETURN(x, StageEmbed(b.ids, positions, b.chunks, home, dispatched, step));
    } else {
      ACCEL_RETURN_IF_ERROR(Wait(*b.received, false, previous, "hidden states"));
      x = b.inbox;
    }
    ACCEL_ASSIGN_OR_RETURN(x,
                           StageLayers(std::move(x), positions, b.chunks, home, dispatched, step));
    if (!last_stage()) {
      ACCEL_RETURN_IF_ERROR(CallTorch([&] { x = x.to(at::kCPU, dtype()).contiguous(); }));
      ACCEL_RETURN_IF_ERROR(send(x, next, "hidden states"));
    } else {
      if (which == Logits::kLastOfEach) {
        ACCEL_RETURN_IF_ERROR(
            CallTorch([&] { x = x.index_select(1, LastTokens(b.chunks, x.device())); }));
      }
      // Every rank of the stage takes part (a vocab-parallel head gathers);
      // the first sends the logits to the leader, world rank 0, on the
      // first stage.
      ACCEL_ASSIGN_OR_RETURN(at::Tensor logits, StageHead(x, home, dispatched, step));
      if (sends_logits) {
        ACCEL_RETURN_IF_ERROR(
            CallTorch([&] { logits = logits[0].to(at::kCPU, at::kFloat).contiguous(); }));
        ACCEL_RETURN_IF_ERROR(send(logits, 0, "logits"));
      }
    }
    micro_batches_run += 1;
  }
  return started;
}

// The rest of a started step: its sends done, and on the leader the
// logits of its micro-batches, concatenated (nothing on other ranks).
absl::StatusOr<at::Tensor> StagedLM::PipelineFinish(
    const std::shared_ptr<PipelineStep>& step_started) {
  PipelineStep& started = *step_started;
  const int last_stage_first = started.last_stage_first;
  std::vector<std::unique_ptr<dist::PendingWork>>& sends = started.sends;
  std::vector<at::Tensor> outputs;
  for (size_t i = 0; i < sends.size(); ++i) {
    ACCEL_RETURN_IF_ERROR(Wait(*sends[i], true, -1, "a micro-batch"));
  }
  for (PipelineMicroBatch& b : started.batches) {
    if (!b.logits_received) continue;
    ACCEL_RETURN_IF_ERROR(Wait(*b.logits_received, false, last_stage_first, "logits"));
    outputs.push_back(b.logits);
  }
  ACCEL_RETURN_IF_ERROR(CheckWeightFiles());  // a fault during this step
  if (outputs.empty()) return at::Tensor();   // a worker with nothing to sample
  at::Tensor logits;
  ACCEL_RETURN_IF_ERROR(CallTorch(
      [&] { logits = (outputs.size() == 1 ? outputs[0] : at::cat(outputs)).to(started.home); }));
  return logits;
}

void AddCollectiveNanos(int64_t nanos) { collective_nanos += nanos; }
void AddCollectiveBytes(int64_t bytes) { collective_bytes += bytes; }
int64_t CollectiveBytes() { return collective_bytes.load(); }
int64_t MicroBatchesRun() { return micro_batches_run.load(); }

void RouteExpertsOnDevice(bool on) { route_on_device.store(on ? 1 : 0); }
void RouteExpertsOnDeviceOnCpu(bool on) { route_on_device_on_cpu.store(on); }
int64_t DeviceRoutedLayers() { return device_routed_layers.load(); }

double CollectiveSeconds() { return static_cast<double>(collective_nanos.load()) * 1e-9; }

absl::StatusOr<std::shared_ptr<CausalLM>> BuildDecoderLM(const ResolvedConfig& r,
                                                         at::ScalarType dtype,
                                                         const TensorParallel& tp,
                                                         const ShardShape& shape) {
  const Family& f = r.family;
  std::vector<std::shared_ptr<nn::RotaryEmbedding>> rotaries(2);
  ACCEL_ASSIGN_OR_RETURN(rotaries[0],
                         nn::RotaryEmbedding::Create(Cls(f, "RotaryEmbedding"), GlobalRope(r)));
  if (f.local_rope) {
    // Gemma3TextModel: a copy of the config with rope_theta = rope_local_base_freq
    // and default RoPE, for the sliding layers.
    nn::RopeSettings local;
    local.dim = r.rotary_dim;
    local.theta = *r.config.rope_local_base_freq;
    ACCEL_ASSIGN_OR_RETURN(rotaries[1],
                           nn::RotaryEmbedding::Create(Cls(f, "RotaryEmbedding"), local));
  }
  if (f.moe == MoeKind::kQwenShared) {
    for (int64_t i = 0; i < r.config.num_hidden_layers; ++i) {
      ACCEL_ASSIGN_OR_RETURN(std::shared_ptr<nn::RotaryEmbedding> unused,
                             nn::RotaryEmbedding::Create(Cls(f, "RotaryEmbedding"), GlobalRope(r)));
      rotaries.push_back(std::move(unused));
    }
  }
  std::shared_ptr<CausalLM> model;
  ACCEL_RETURN_IF_ERROR(CallTorch(
      [&] { model = std::make_shared<DecoderLM>(r, tp, shape, dtype, std::move(rotaries)); }));
  return model;
}

}  // namespace accel::models::internal
