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
  for (const Family& f : SupportedFamilies()) names.push_back(f.architecture);
  std::string got = !config.architectures.empty()
                        ? config.architectures[0]
                        : absl::StrCat("model_type '", config.model_type, "'");
  return absl::InvalidArgumentError(absl::StrCat("config.json: unsupported architecture ", got,
                                                 " (supported: ", absl::StrJoin(names, ", "), ")"));
}

absl::StatusOr<std::vector<loader::TensorSpec>> CheckpointTensors(const loader::ModelConfig& c,
                                                                  c10::ScalarType dtype) {
  ACCEL_RETURN_IF_ERROR(c.Validate());
  ACCEL_ASSIGN_OR_RETURN(Family family, FamilyOf(c));
  std::vector<loader::TensorSpec> specs;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    specs.push_back({std::move(name), dtype, std::move(shape)});
  };
  const int64_t h = c.hidden_size;
  const int64_t v = c.vocab_size;
  const int64_t inter = c.intermediate_size;

  if (std::string(family.model_type) == "gpt2") {
    // GPT-2's Conv1D stores weights as [in, out].
    add("transformer.wte.weight", {v, h});
    add("transformer.wpe.weight", {c.max_position_embeddings, h});
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      std::string p = absl::StrCat("transformer.h.", i, ".");
      add(p + "ln_1.weight", {h});
      add(p + "ln_1.bias", {h});
      add(p + "attn.c_attn.weight", {h, 3 * h});
      add(p + "attn.c_attn.bias", {3 * h});
      add(p + "attn.c_proj.weight", {h, h});
      add(p + "attn.c_proj.bias", {h});
      add(p + "ln_2.weight", {h});
      add(p + "ln_2.bias", {h});
      add(p + "mlp.c_fc.weight", {h, inter});
      add(p + "mlp.c_fc.bias", {inter});
      add(p + "mlp.c_proj.weight", {inter, h});
      add(p + "mlp.c_proj.bias", {h});
    }
    add("transformer.ln_f.weight", {h});
    add("transformer.ln_f.bias", {h});
    if (!c.tie_word_embeddings) add("lm_head.weight", {v, h});
    return specs;
  }

  // Llama, Mistral and Qwen2 share one layout; they differ in biases.
  const bool qwen2 = std::string(family.model_type) == "qwen2";
  const bool qkv_bias = qwen2 || c.attention_bias;
  const bool o_bias = !qwen2 && c.attention_bias;
  const int64_t q_out = c.num_attention_heads * c.head_size();
  const int64_t kv_out = c.kv_heads() * c.head_size();
  add("model.embed_tokens.weight", {v, h});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "self_attn.q_proj.weight", {q_out, h});
    if (qkv_bias) add(p + "self_attn.q_proj.bias", {q_out});
    add(p + "self_attn.k_proj.weight", {kv_out, h});
    if (qkv_bias) add(p + "self_attn.k_proj.bias", {kv_out});
    add(p + "self_attn.v_proj.weight", {kv_out, h});
    if (qkv_bias) add(p + "self_attn.v_proj.bias", {kv_out});
    add(p + "self_attn.o_proj.weight", {h, q_out});
    if (o_bias) add(p + "self_attn.o_proj.bias", {h});
    add(p + "mlp.gate_proj.weight", {inter, h});
    add(p + "mlp.up_proj.weight", {inter, h});
    add(p + "mlp.down_proj.weight", {h, inter});
    add(p + "input_layernorm.weight", {h});
    add(p + "post_attention_layernorm.weight", {h});
  }
  add("model.norm.weight", {h});
  if (!c.tie_word_embeddings) add("lm_head.weight", {v, h});
  return specs;
}

}  // namespace accel::models
