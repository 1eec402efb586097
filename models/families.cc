#include "models/families.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/status.h"
#include "dispatch/empty_weights.h"
#include "models/causal_lm.h"

namespace accel::models {
namespace {

// transformers v4.53.0, src/transformers/models/<family>/modeling_<family>.py and
// configuration_<family>.py (the per-expert ModuleList era, which hub
// checkpoints are named after).
Family Llama() {
  Family f{"LlamaForCausalLM", "llama", "Llama", "LlamaModel", "LlamaDecoderLayer"};
  f.sources = "models/llama/modeling_llama.py";
  return f;
}
Family Mistral() {
  Family f{"MistralForCausalLM", "mistral", "Mistral", "MistralModel", "MistralDecoderLayer"};
  f.attention_bias = AttentionBias::kNone;
  f.sliding = SlidingLayers::kAll;
  f.sources = "models/mistral/modeling_mistral.py";
  return f;
}
Family Qwen2() {
  Family f{"Qwen2ForCausalLM", "qwen2", "Qwen2", "Qwen2Model", "Qwen2DecoderLayer"};
  f.attention_bias = AttentionBias::kQkv;
  f.sources = "models/qwen2/modeling_qwen2.py";
  return f;
}
Family Gpt2() {
  Family f{"GPT2LMHeadModel", "gpt2", "GPT2", "GPT2Model", "GPT2Block"};
  f.norm = NormKind::kLayerNorm;
  f.mlp = MlpKind::kGpt2;
  f.sources = "models/gpt2/modeling_gpt2.py";
  return f;
}
Family Mixtral() {
  Family f{"MixtralForCausalLM", "mixtral", "Mixtral", "MixtralModel", "MixtralDecoderLayer"};
  f.attention_bias = AttentionBias::kNone;
  f.moe = MoeKind::kMixtral;
  f.sliding = SlidingLayers::kAll;
  f.norm_topk_default = true;  // MixtralSparseMoeBlock always renormalises
  f.default_experts = 8;
  f.default_top_k = 2;
  f.sources = "models/mixtral/modeling_mixtral.py";
  return f;
}
Family Qwen3() {
  Family f{"Qwen3ForCausalLM", "qwen3", "Qwen3", "Qwen3Model", "Qwen3DecoderLayer"};
  f.qk_norm = true;
  f.sources = "models/qwen3/modeling_qwen3.py";
  return f;
}
Family Qwen3Moe() {
  Family f{"Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3Moe", "Qwen3MoeModel", "Qwen3MoeDecoderLayer"};
  f.qk_norm = true;
  f.moe = MoeKind::kQwen;
  f.norm_topk_default = false;
  f.norm_topk_configurable = true;
  f.default_experts = 128;
  f.default_top_k = 8;
  f.default_moe_intermediate = 768;
  f.sources = "models/qwen3_moe/modeling_qwen3_moe.py";
  return f;
}
Family Qwen2Moe() {
  Family f{"Qwen2MoeForCausalLM", "qwen2_moe", "Qwen2Moe", "Qwen2MoeModel", "Qwen2MoeDecoderLayer"};
  f.attention_bias = AttentionBias::kQkv;
  f.moe = MoeKind::kQwenShared;
  f.divide_scores = true;  // Qwen2MoeAttention: / math.sqrt(self.head_dim)
  f.norm_topk_default = false;
  f.norm_topk_configurable = true;
  f.default_experts = 60;
  f.default_top_k = 4;
  f.default_moe_intermediate = 1408;
  f.default_shared_intermediate = 5632;
  f.sources = "models/qwen2_moe/modeling_qwen2_moe.py";
  return f;
}
Family Gemma2() {
  Family f{"Gemma2ForCausalLM", "gemma2", "Gemma2", "Gemma2Model", "Gemma2DecoderLayer"};
  f.norm = NormKind::kRmsOnePlus;
  f.sandwich_norms = true;
  f.embedding_scale = EmbeddingScale::kInModel;
  f.sliding = SlidingLayers::kAlternate;
  f.final_softcap = true;
  f.sources = "models/gemma2/modeling_gemma2.py";
  return f;
}
Family Gemma3() {
  Family f{"Gemma3ForCausalLM", "gemma3_text", "Gemma3", "Gemma3TextModel", "Gemma3DecoderLayer"};
  f.norm = NormKind::kRmsOnePlus;
  f.qk_norm = true;
  f.sandwich_norms = true;
  f.embedding_scale = EmbeddingScale::kInModule;
  f.sliding = SlidingLayers::kPattern;
  f.local_rope = true;
  f.final_softcap = true;
  f.sources = "models/gemma3/modeling_gemma3.py";
  return f;
}
Family Phi3() {
  Family f{"Phi3ForCausalLM", "phi3", "Phi3", "Phi3Model", "Phi3DecoderLayer"};
  f.attention_bias = AttentionBias::kNone;
  f.mlp = MlpKind::kFusedGated;
  f.fused_qkv = true;
  f.sliding = SlidingLayers::kAll;
  f.partial_rotary = true;
  f.residual_dropouts = true;
  f.sources = "models/phi3/modeling_phi3.py";
  return f;
}

absl::Status FieldError(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: field '", field, "' ", what));
}

}  // namespace

const std::vector<Family>& SupportedFamilies() {
  static const std::vector<Family> kFamilies = {Llama(),   Mistral(), Qwen2(),    Gpt2(),
                                                Mixtral(), Qwen3(),   Qwen3Moe(), Qwen2Moe(),
                                                Gemma2(),  Gemma3(),  Phi3()};
  return kFamilies;
}

absl::StatusOr<Family> FamilyOf(const loader::ModelConfig& config) {
  for (const Family& f : SupportedFamilies()) {
    if (!config.architectures.empty() ? config.architectures[0] == f.architecture
                                      : config.model_type == f.model_type) {
      return f;
    }
  }
  std::vector<std::string> names;
  for (const Family& f : SupportedFamilies()) names.emplace_back(f.architecture);
  std::string got = !config.architectures.empty()
                        ? config.architectures[0]
                        : absl::StrCat("model_type '", config.model_type, "'");
  return absl::InvalidArgumentError(absl::StrCat("config.json: unsupported architecture ", got,
                                                 " (supported: ", absl::StrJoin(names, ", "), ")"));
}

absl::StatusOr<ResolvedConfig> ResolveConfig(const loader::ModelConfig& c) {
  ACCEL_RETURN_IF_ERROR(c.Validate());
  ACCEL_ASSIGN_OR_RETURN(Family f, FamilyOf(c));
  ResolvedConfig r;
  r.config = c;
  r.family = f;
  const int64_t layers = c.num_hidden_layers;

  // The activation: Gemma reads hidden_activation, the others hidden_act.
  r.activation = f.mlp == MlpKind::kGpt2                                  ? c.hidden_act
                 : f.norm == NormKind::kRmsOnePlus && c.hidden_activation ? *c.hidden_activation
                                                                          : c.hidden_act;
  static const char* kActivations[] = {"silu", "gelu_pytorch_tanh", "gelu", "gelu_new"};
  if (std::find(std::begin(kActivations), std::end(kActivations), r.activation) ==
      std::end(kActivations)) {
    return FieldError(f.norm == NormKind::kRmsOnePlus ? "hidden_activation" : "hidden_act",
                      absl::StrCat("'", r.activation,
                                   "' is not supported (silu, gelu_pytorch_tanh, gelu, gelu_new)"));
  }
  if (f.mlp == MlpKind::kGpt2) {
    r.windows.assign(layers, std::nullopt);
    r.local_rope.assign(layers, false);
    r.sparse.assign(layers, false);
    r.rotary_dim = c.head_size();
    return r;
  }

  // Windows. The Qwen families slide only with use_sliding_window, which
  // accel does not implement (its layer rules differ between transformers'
  // attention backends): refused rather than ignored.
  if (c.use_sliding_window.value_or(false) && f.sliding == SlidingLayers::kNone) {
    return FieldError("use_sliding_window", absl::StrCat("true is not supported for ", f.model_type,
                                                         " (sliding-window attention)"));
  }
  if (c.sliding_window && *c.sliding_window <= 0 && f.sliding != SlidingLayers::kNone) {
    return FieldError("sliding_window", "must be positive");
  }
  r.windows.assign(layers, std::nullopt);
  r.local_rope.assign(layers, false);
  std::vector<bool> sliding(layers, false);
  switch (f.sliding) {
    case SlidingLayers::kNone:
      break;
    case SlidingLayers::kAll:
      sliding.assign(layers, c.sliding_window.has_value());
      break;
    case SlidingLayers::kAlternate:
      for (int64_t i = 0; i < layers; ++i) sliding[i] = (i + 1) % 2 != 0;
      break;
    case SlidingLayers::kPattern:
      if (!c.layer_types.empty()) {
        if (static_cast<int64_t>(c.layer_types.size()) != layers) {
          return FieldError("layer_types", absl::StrCat("has ", c.layer_types.size(),
                                                        " entries for ", layers, " layers"));
        }
        for (int64_t i = 0; i < layers; ++i) {
          const std::string& t = c.layer_types[i];
          if (t != "sliding_attention" && t != "full_attention") {
            return FieldError("layer_types", absl::StrCat("entry ", i, " is '", t,
                                                          "' (sliding_attention, full_attention)"));
          }
          sliding[i] = t == "sliding_attention";
        }
      } else {
        const int64_t pattern = c.sliding_window_pattern.value_or(6);
        if (pattern <= 0) return FieldError("sliding_window_pattern", "must be positive");
        for (int64_t i = 0; i < layers; ++i) sliding[i] = (i + 1) % pattern != 0;
      }
      break;
  }
  for (int64_t i = 0; i < layers; ++i) {
    if (!sliding[i]) continue;
    if (!c.sliding_window) {
      if (f.sliding == SlidingLayers::kAll) continue;
      return FieldError("sliding_window", "is needed by the sliding-window layers");
    }
    r.windows[i] = *c.sliding_window;
    r.local_rope[i] = f.local_rope;
  }
  if (f.local_rope && !c.rope_local_base_freq) {
    return FieldError("rope_local_base_freq", "is needed by the sliding-window layers");
  }

  // Gemma's attention scale and soft-caps. Gemma 3's attention does not pass
  // its soft-cap on (Gemma3Attention.forward in v4.53.0): only Gemma 2's counts.
  if (f.norm == NormKind::kRmsOnePlus) {
    r.query_pre_attn_scalar = c.query_pre_attn_scalar;
    if (!r.query_pre_attn_scalar || *r.query_pre_attn_scalar <= 0) {
      return FieldError("query_pre_attn_scalar", "must be a positive number");
    }
    if (f.model_type == std::string("gemma2")) r.attn_softcap = c.attn_logit_softcapping;
  }
  if (f.final_softcap) r.final_softcap = c.final_logit_softcapping;
  for (const auto& [name, cap] : {std::make_pair("attn_logit_softcapping", r.attn_softcap),
                                  std::make_pair("final_logit_softcapping", r.final_softcap)}) {
    if (cap && !(*cap > 0)) return FieldError(name, "must be positive (or null: off)");
  }

  // Rotary dimensions.
  r.rotary_dim = c.head_size();
  if (f.partial_rotary && c.partial_rotary_factor) {
    const double factor = *c.partial_rotary_factor;
    if (!(factor > 0 && factor <= 1)) {
      return FieldError("partial_rotary_factor", "must be in (0, 1]");
    }
    r.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_size()) * factor);
  }
  if (r.rotary_dim <= 0 || r.rotary_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: the rotary dimension (head_dim x partial_rotary_factor) is ",
                     r.rotary_dim, "; it must be even and positive"));
  }
  if (f.moe == MoeKind::kQwenShared && c.num_attention_heads * c.head_size() != c.hidden_size) {
    // Qwen2MoeAttention raises on this too.
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: head_dim ", c.head_size(), " x num_attention_heads ", c.num_attention_heads,
        " must equal hidden_size ", c.hidden_size, " for qwen2_moe"));
  }

  // Mixture of experts.
  r.sparse.assign(layers, false);
  if (f.moe != MoeKind::kNone) {
    const char* experts_field = f.moe == MoeKind::kMixtral ? "num_local_experts" : "num_experts";
    r.num_experts = c.moe.num_experts > 0 ? c.moe.num_experts : f.default_experts;
    r.top_k = c.moe.num_experts_per_tok > 0 ? c.moe.num_experts_per_tok : f.default_top_k;
    if (r.top_k > r.num_experts) {
      return FieldError("num_experts_per_tok",
                        absl::StrCat(r.top_k, " is more than the ", r.num_experts, " experts of '",
                                     experts_field, "'"));
    }
    r.norm_topk = f.norm_topk_configurable ? c.moe.norm_topk_prob.value_or(f.norm_topk_default)
                                           : f.norm_topk_default;
    if (f.moe == MoeKind::kMixtral) {
      r.expert_intermediate = c.intermediate_size;
      std::fill(r.sparse.begin(), r.sparse.end(), true);
    } else {
      r.expert_intermediate = c.moe.moe_intermediate_size.value_or(f.default_moe_intermediate);
      if (r.expert_intermediate <= 0)
        return FieldError("moe_intermediate_size", "must be positive");
      const int64_t step = c.moe.decoder_sparse_step.value_or(1);
      if (step <= 0) return FieldError("decoder_sparse_step", "must be positive");
      for (int64_t layer : c.moe.mlp_only_layers) {
        if (layer >= layers) {
          return FieldError("mlp_only_layers",
                            absl::StrCat("names layer ", layer, " of a model with ", layers));
        }
      }
      for (int64_t i = 0; i < layers; ++i) {
        const bool dense = std::find(c.moe.mlp_only_layers.begin(), c.moe.mlp_only_layers.end(),
                                     i) != c.moe.mlp_only_layers.end();
        r.sparse[i] = !dense && (i + 1) % step == 0;
      }
    }
    if (f.moe == MoeKind::kQwenShared) {
      r.shared_intermediate =
          c.moe.shared_expert_intermediate_size.value_or(f.default_shared_intermediate);
      if (r.shared_intermediate <= 0) {
        return FieldError("shared_expert_intermediate_size", "must be positive");
      }
    }
    if (r.num_experts <= 0) return FieldError(experts_field, "must be positive");
    if (r.top_k <= 0) return FieldError("num_experts_per_tok", "must be positive");
  }
  return r;
}

std::vector<std::string> ExpertLists(const ResolvedConfig& r) {
  std::vector<std::string> lists;
  const char* block = r.family.moe == MoeKind::kMixtral ? "block_sparse_moe" : "mlp";
  for (size_t i = 0; i < r.sparse.size(); ++i) {
    if (r.sparse[i]) lists.push_back(absl::StrCat("model.layers.", i, ".", block, ".experts"));
  }
  return lists;
}

absl::StatusOr<dispatch::ModuleTree> ModuleTreeFor(const loader::ModelConfig& c,
                                                   c10::ScalarType dtype) {
  return ModuleTreeFor(c, dtype, 0, 1);
}

absl::StatusOr<dispatch::ModuleTree> ModuleTreeFor(const loader::ModelConfig& c,
                                                   c10::ScalarType dtype, int tp_rank,
                                                   int tp_size) {
  TensorParallel tp;
  tp.rank = tp_rank;
  tp.size = tp_size;
  return ModuleTreeFor(c, dtype, tp);
}

absl::StatusOr<dispatch::ModuleTree> ModuleTreeFor(const loader::ModelConfig& c,
                                                   c10::ScalarType dtype,
                                                   const TensorParallel& parallel) {
  std::shared_ptr<CausalLM> model;
  {
    dispatch::EmptyWeightsGuard empty;
    TensorParallel tp = parallel;
    tp.group = nullptr;
    tp.world = nullptr;
    ACCEL_ASSIGN_OR_RETURN(model, BuildCausalLM(c, dtype, tp));
  }
  return dispatch::ModuleTree::FromModule(*model);
}

absl::StatusOr<std::vector<loader::TensorSpec>> CheckpointTensors(const loader::ModelConfig& c,
                                                                  c10::ScalarType dtype) {
  ACCEL_ASSIGN_OR_RETURN(dispatch::ModuleTree tree, ModuleTreeFor(c, dtype));
  std::vector<loader::TensorSpec> specs;
  for (const auto& p : tree.NamedParameters())
    specs.push_back({p.name, p.decl->dtype, p.decl->shape});
  for (const auto& b : tree.NamedBuffers()) {
    if (b.decl->persistent) specs.push_back({b.name, b.decl->dtype, b.decl->shape});
  }
  return specs;
}

}  // namespace accel::models
