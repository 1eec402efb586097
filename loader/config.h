// loader/config.h: config.json and generation_config.json as typed structs.
//
// Fields we know are typed; every other field is kept verbatim (as JSON text)
// in `extra` and written back by ToJson(), so a config survives a round trip.
// GPT-2's own names (n_embd, n_layer, n_head, n_positions, n_inner,
// layer_norm_epsilon, activation_function) read into the common fields, as
// transformers' attribute_map does, and are written back under those names.
#ifndef ACCEL_LOADER_CONFIG_H_
#define ACCEL_LOADER_CONFIG_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::loader {

struct RopeScaling {
  std::string rope_type;                             // "llama3", "linear", "longrope", "yarn", ...
  std::map<std::string, double> numbers;             // factor, low_freq_factor, ...
  std::map<std::string, std::vector<double>> lists;  // longrope: short_factor, long_factor
};

// The mixture-of-experts fields of a config. Mixtral names the expert count
// num_local_experts, Qwen2-MoE and Qwen3-MoE num_experts; both read into
// `num_experts` and are written back under the family's own name.
struct MoeFields {
  int64_t num_experts = 0;                                 // 0: a dense model
  int64_t num_experts_per_tok = 0;                         // top-k
  std::optional<int64_t> moe_intermediate_size;            // Qwen MoE: each expert's MLP
  std::optional<int64_t> shared_expert_intermediate_size;  // Qwen2-MoE
  std::optional<bool> norm_topk_prob;                      // unset: the family's default
  std::optional<int64_t> decoder_sparse_step;              // Qwen MoE; unset: 1
  std::vector<int64_t> mlp_only_layers;                    // Qwen MoE: dense layers
  bool has_mlp_only_layers = false;                        // the field was present

  bool enabled() const { return num_experts > 0; }
};

struct ModelConfig {
  std::vector<std::string> architectures;  // "LlamaForCausalLM", ...
  std::string model_type;                  // "llama", "mistral", "qwen2", "gpt2", ...
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // GPT-2: n_inner, 4 x hidden_size when null
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // 0 in the file means num_attention_heads
  int64_t head_dim = 0;             // 0 means hidden_size / num_attention_heads
  int64_t max_position_embeddings = 0;
  double norm_eps = 1e-6;  // rms_norm_eps, or GPT-2's layer_norm_epsilon
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;
  bool tie_word_embeddings = false;  // transformers' default: true for gpt2, else per family
  bool attention_bias = false;
  std::optional<int64_t> sliding_window;
  std::string hidden_act = "silu";
  std::string torch_dtype;  // "float32", "bfloat16", ... or empty
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // "eos_token_id" may be one id or a list
  std::optional<int64_t> pad_token_id;
  MoeFields moe;
  // Gemma 2 / 3 (defaults as transformers' Gemma2Config / Gemma3TextConfig
  // for those model types; a null in the file disables a soft-cap).
  std::optional<std::string> hidden_activation;  // "gelu_pytorch_tanh"
  std::optional<double> query_pre_attn_scalar;
  std::optional<double> attn_logit_softcapping;
  std::optional<double> final_logit_softcapping;
  std::optional<int64_t> sliding_window_pattern;  // Gemma 3: every n-th layer is global
  std::vector<std::string> layer_types;           // "sliding_attention" | "full_attention"
  std::optional<double> rope_local_base_freq;     // Gemma 3: RoPE base of sliding layers
  // Phi-3 (and Qwen's window switches, which accel refuses when on).
  std::optional<int64_t> original_max_position_embeddings;
  std::optional<double> partial_rotary_factor;
  std::optional<bool> use_sliding_window;
  std::optional<bool> qkv_bias;              // Qwen2-MoE: biases on q, k and v (its default: true)
  std::map<std::string, std::string> extra;  // unknown field -> its JSON text

  // The number of key/value heads and the head size with defaults applied.
  int64_t kv_heads() const {
    return num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads;
  }
  int64_t head_size() const;

  // InvalidArgument naming the field when a required size is missing or the
  // shapes do not divide (hidden_size by heads, heads by kv heads).
  absl::Status Validate() const;
  std::string ToJson() const;
};

struct GenerationConfig {
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> pad_token_id;
  std::optional<bool> do_sample;
  std::optional<double> temperature;
  std::optional<int64_t> top_k;
  std::optional<double> top_p;
  std::optional<double> min_p;
  std::optional<double> repetition_penalty;
  std::optional<int64_t> max_new_tokens;
  std::optional<int64_t> max_length;
  std::map<std::string, std::string> extra;

  std::string ToJson() const;
};

// Parse JSON text; `label` (usually the path) names the source in errors,
// which also name the field: "config.json: field 'hidden_size': expected a
// non-negative integer, got \"x\"". InvalidArgument for every malformed input.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json, absl::string_view label);
absl::StatusOr<GenerationConfig> ParseGenerationConfig(absl::string_view json,
                                                       absl::string_view label);

// Read a file: NotFound if it is missing, else as the parsers above.
absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& path);
absl::StatusOr<GenerationConfig> ReadGenerationConfig(const std::string& path);

}  // namespace accel::loader

#endif  // ACCEL_LOADER_CONFIG_H_
