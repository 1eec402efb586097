// models/families.h: the model families accel knows, keyed by config.json
// "architectures": what each one is made of (its traits, read by the model
// code in models/internal/decoder_lm.cc), and the module tree and checkpoint
// tensors a HuggingFace model of each has.
//
// Adding a family is one entry in SupportedFamilies() plus whatever layer it
// needs that no family had before. The module tree is derived from the model
// itself (built on empty weights), so planning (accel-device-map), the
// generator (accel-make-model) and loading cannot disagree on a name.
#ifndef ACCEL_MODELS_FAMILIES_H_
#define ACCEL_MODELS_FAMILIES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"

#include "dispatch/module_tree.h"
#include "loader/config.h"
#include "loader/loader.h"
#include "models/parallel_options.h"

namespace accel::models {

enum class NormKind {
  kRms,         // x / rms(x) in float32, cast back, times w (LlamaRMSNorm)
  kRmsOnePlus,  // x / rms(x) times (1 + w), all in float32, cast back (Gemma2RMSNorm)
  kLayerNorm,   // GPT-2
};

enum class MlpKind {
  kGated,       // down(act(gate(x)) * up(x)): gate_proj, up_proj, down_proj
  kFusedGated,  // the same from one gate_up_proj, gate half first (Phi3MLP)
  kGpt2,        // c_proj(act(c_fc(x)))
};

// Who gets biases in attention.
enum class AttentionBias {
  kNone,    // none, whatever the config says (Mistral, Mixtral, Phi-3)
  kConfig,  // q, k, v and o when config.attention_bias (Llama, Qwen3, Gemma)
  kQkv,     // q, k and v always, o never (Qwen2, Qwen2-MoE)
};

enum class MoeKind {
  kNone,
  kMixtral,     // block_sparse_moe: gate + experts.E.{w1, w2, w3}, in every layer
  kQwen,        // mlp: gate + experts.E.{gate_proj, up_proj, down_proj}, in the layers
                // decoder_sparse_step and mlp_only_layers pick (Qwen3-MoE)
  kQwenShared,  // kQwen plus shared_expert and its sigmoid shared_expert_gate (Qwen2-MoE)
};

// Where embeddings are multiplied by sqrt(hidden) in the model dtype.
enum class EmbeddingScale {
  kNone,
  kInModel,   // by the decoder stack (Gemma2Model)
  kInModule,  // by the embedding, from its embed_scale buffer (Gemma3TextScaledWordEmbedding)
};

// Which layers attend through config.sliding_window.
enum class SlidingLayers {
  kNone,       // none (Llama; the Qwen families, whose use_sliding_window must be off)
  kAll,        // all, when the config sets a window (Mistral, Mixtral, Phi-3)
  kAlternate,  // layers 0, 2, 4, ... (Gemma 2)
  kPattern,    // layer_types, else all but every sliding_window_pattern-th (Gemma 3)
};

struct Family {
  const char* architecture = "";  // config.json "architectures"[0]: "LlamaForCausalLM"
  const char* model_type = "";    // config.json "model_type": "llama"
  const char* prefix = "";        // class-name prefix: "Llama" -> LlamaAttention, LlamaMLP, ...
  const char* model_class = "";   // the decoder stack: "LlamaModel" ("GPT2Model", ...)
  const char* block_class = "";  // the decoder block, never split over devices: "LlamaDecoderLayer"
  NormKind norm = NormKind::kRms;
  MlpKind mlp = MlpKind::kGated;
  AttentionBias attention_bias = AttentionBias::kConfig;
  MoeKind moe = MoeKind::kNone;
  SlidingLayers sliding = SlidingLayers::kNone;
  bool qk_norm = false;         // a norm over each head of q and k before RoPE (Qwen3, Gemma 3)
  bool fused_qkv = false;       // one qkv_proj, o_proj registered first (Phi-3)
  bool sandwich_norms = false;  // post-attention and pre/post-feedforward norms (Gemma)
  EmbeddingScale embedding_scale = EmbeddingScale::kNone;
  bool local_rope = false;              // sliding layers have a RoPE of their own (Gemma 3)
  bool final_softcap = false;           // final_logit_softcapping is read (Gemma 2 / 3)
  bool partial_rotary = false;          // partial_rotary_factor is read (Phi-3)
  bool residual_dropouts = false;       // resid_attn_dropout, resid_mlp_dropout modules (Phi-3)
  bool divide_scores = false;           // scores / sqrt(head_dim), not * head_dim^-0.5 (Qwen2-MoE)
  bool norm_topk_default = true;        // norm_topk_prob when the config leaves it out
  bool norm_topk_configurable = false;  // the config's norm_topk_prob is read (Qwen MoE)
  // Family defaults transformers' config class applies to absent MoE fields.
  int64_t default_experts = 0, default_top_k = 0, default_moe_intermediate = 0,
          default_shared_intermediate = 0;
  const char* sources = "";  // the transformers files the formulas come from
};

// Every family accel serves, in a fixed order.
const std::vector<Family>& SupportedFamilies();

// The family of a config, by its first "architectures" entry (or, when that
// is missing, by "model_type"). InvalidArgument listing the supported
// architectures when it is unknown.
absl::StatusOr<Family> FamilyOf(const loader::ModelConfig& config);

// A config as a family runs it: the family's defaults applied and its
// fields checked. Every field that changes the arithmetic is either honoured
// here or refused by name (InvalidArgument: "config.json: field
// 'num_experts_per_tok' ..."), never ignored.
struct ResolvedConfig {
  loader::ModelConfig config;
  Family family;
  std::string activation;  // "silu", "gelu_pytorch_tanh", "gelu", "gelu_new"
  // Per layer: its attention window (nullopt: full attention), whether it
  // uses the local RoPE, and whether its MLP is a sparse MoE block.
  std::vector<std::optional<int64_t>> windows;
  std::vector<bool> local_rope;
  std::vector<bool> sparse;
  // Mixture of experts (num_experts 0: dense).
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t expert_intermediate = 0;
  int64_t shared_intermediate = 0;
  bool norm_topk = true;
  // Gemma: scores scaled by query_pre_attn_scalar^-0.5 instead of head_dim^-0.5.
  std::optional<double> query_pre_attn_scalar;
  std::optional<double> attn_softcap;
  std::optional<double> final_softcap;
  int64_t rotary_dim = 0;  // head_dim x partial_rotary_factor
};
absl::StatusOr<ResolvedConfig> ResolveConfig(const loader::ModelConfig& config);

// The module names of every expert list ("model.layers.3.block_sparse_moe.experts"),
// in layer order; empty for a dense model.
std::vector<std::string> ExpertLists(const ResolvedConfig& resolved);

// The module structure transformers builds for this config, with its class
// names (LlamaDecoderLayer, GPT2Block, ...), parameters in registration
// order, the rotary inv_freq buffers (not persistent) and the tied head:
// the model itself (BuildCausalLM) built on empty weights. Floating
// parameters get `dtype`. Validates the config (InvalidArgument).
absl::StatusOr<dispatch::ModuleTree> ModuleTreeFor(const loader::ModelConfig& config,
                                                   c10::ScalarType dtype);
// The module tree of rank `tp_rank`'s slice of the model split over
// `tp_size` ranks (models/tensor_parallel.h): what that rank holds.
absl::StatusOr<dispatch::ModuleTree> ModuleTreeFor(const loader::ModelConfig& config,
                                                   c10::ScalarType dtype, int tp_rank, int tp_size);
// The module tree of the slice `parallel` names (tensor and pipeline
// parallel: a stage holds only its layers, the embedding on the first, the
// final norm and lm_head on the last).
absl::StatusOr<dispatch::ModuleTree> ModuleTreeFor(const loader::ModelConfig& config,
                                                   c10::ScalarType dtype,
                                                   const TensorParallel& parallel);

// The tensors a checkpoint of this config holds, with HuggingFace's names
// and shapes, in the order transformers' state_dict() lists them, a tied
// head once: ModuleTreeFor()'s parameters and persistent buffers.
absl::StatusOr<std::vector<loader::TensorSpec>> CheckpointTensors(const loader::ModelConfig& config,
                                                                  c10::ScalarType dtype);

}  // namespace accel::models

#endif  // ACCEL_MODELS_FAMILIES_H_
