#include "models/families.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/status.h"

namespace accel::models {

const std::vector<Family>& SupportedFamilies() {
  static const std::vector<Family> kFamilies = {
      {"LlamaForCausalLM", "llama", "LlamaDecoderLayer"},
      {"MistralForCausalLM", "mistral", "MistralDecoderLayer"},
      {"Qwen2ForCausalLM", "qwen2", "Qwen2DecoderLayer"},
      {"GPT2LMHeadModel", "gpt2", "GPT2Block"},
  };
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

absl::StatusOr<dispatch::ModuleTree> ModuleTreeFor(const loader::ModelConfig& c,
                                                   c10::ScalarType dtype) {
  ACCEL_RETURN_IF_ERROR(c.Validate());
  ACCEL_ASSIGN_OR_RETURN(Family family, FamilyOf(c));
  const std::string type = family.model_type;
  dispatch::ModuleTree tree(family.architecture);
  auto param = [&](int node, const char* name, std::vector<int64_t> shape) {
    tree.AddParam(node, {name, std::move(shape), dtype, true});
  };
  auto linear = [&](int parent, const char* name, int64_t in, int64_t out, bool bias,
                    const char* cls = "Linear") {
    int id = tree.AddChild(parent, name, cls);
    // transformers' Linear stores [out, in]; GPT-2's Conv1D stores [in, out].
    param(id, "weight",
          std::string(cls) == "Conv1D" ? std::vector<int64_t>{in, out}
                                       : std::vector<int64_t>{out, in});
    if (bias) param(id, "bias", {out});
    return id;
  };
  auto leaf = [&](int parent, const char* name, const char* cls) {
    tree.AddChild(parent, name, cls);
  };
  const int64_t h = c.hidden_size;
  const int64_t v = c.vocab_size;
  const int64_t inter = c.intermediate_size;

  if (type == "gpt2") {
    int model = tree.AddChild(0, "transformer", "GPT2Model");
    param(tree.AddChild(model, "wte", "Embedding"), "weight", {v, h});
    param(tree.AddChild(model, "wpe", "Embedding"), "weight", {c.max_position_embeddings, h});
    leaf(model, "drop", "Dropout");
    int layers = tree.AddChild(model, "h", "ModuleList");
    auto layer_norm = [&](int parent, const char* name) {
      int id = tree.AddChild(parent, name, "LayerNorm");
      param(id, "weight", {h});
      param(id, "bias", {h});
    };
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      int block = tree.AddChild(layers, absl::StrCat(i), family.block_class);
      layer_norm(block, "ln_1");
      int attn = tree.AddChild(block, "attn", "GPT2Attention");
      linear(attn, "c_attn", h, 3 * h, true, "Conv1D");
      linear(attn, "c_proj", h, h, true, "Conv1D");
      leaf(attn, "attn_dropout", "Dropout");
      leaf(attn, "resid_dropout", "Dropout");
      layer_norm(block, "ln_2");
      int mlp = tree.AddChild(block, "mlp", "GPT2MLP");
      linear(mlp, "c_fc", h, inter, true, "Conv1D");
      linear(mlp, "c_proj", inter, h, true, "Conv1D");
      leaf(mlp, "act", "NewGELUActivation");
      leaf(mlp, "dropout", "Dropout");
    }
    layer_norm(model, "ln_f");
    linear(0, "lm_head", h, v, false);
    if (c.tie_word_embeddings)
      ACCEL_RETURN_IF_ERROR(tree.Tie({"transformer.wte.weight", "lm_head.weight"}));
    return tree;
  }

  // Llama, Mistral and Qwen2 share one layout; class names carry the family's prefix.
  const std::string prefix = type == "llama" ? "Llama" : type == "mistral" ? "Mistral" : "Qwen2";
  const bool qkv_bias = type == "qwen2" || c.attention_bias;
  const bool o_bias = type != "qwen2" && c.attention_bias;
  const int64_t q_out = c.num_attention_heads * c.head_size();
  const int64_t kv_out = c.kv_heads() * c.head_size();
  auto rms_norm = [&](int parent, const char* name) {
    param(tree.AddChild(parent, name, prefix + "RMSNorm"), "weight", {h});
  };
  int model = tree.AddChild(0, "model", prefix + "Model");
  param(tree.AddChild(model, "embed_tokens", "Embedding"), "weight", {v, h});
  int layers = tree.AddChild(model, "layers", "ModuleList");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    int block = tree.AddChild(layers, absl::StrCat(i), family.block_class);
    int attn = tree.AddChild(block, "self_attn", prefix + "Attention");
    linear(attn, "q_proj", h, q_out, qkv_bias);
    linear(attn, "k_proj", h, kv_out, qkv_bias);
    linear(attn, "v_proj", h, kv_out, qkv_bias);
    linear(attn, "o_proj", q_out, h, o_bias);
    int mlp = tree.AddChild(block, "mlp", prefix + "MLP");
    linear(mlp, "gate_proj", h, inter, false);
    linear(mlp, "up_proj", h, inter, false);
    linear(mlp, "down_proj", inter, h, false);
    leaf(mlp, "act_fn", "SiLU");
    rms_norm(block, "input_layernorm");
    rms_norm(block, "post_attention_layernorm");
  }
  rms_norm(model, "norm");
  int rotary = tree.AddChild(model, "rotary_emb", prefix + "RotaryEmbedding");
  tree.AddBuffer(rotary,
                 {"inv_freq", {c.head_size() / 2}, c10::ScalarType::Float, /*persistent=*/false});
  linear(0, "lm_head", h, v, false);
  if (c.tie_word_embeddings)
    ACCEL_RETURN_IF_ERROR(tree.Tie({"model.embed_tokens.weight", "lm_head.weight"}));
  return tree;
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
