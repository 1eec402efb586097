// models/make_model.h: writes a HuggingFace-format model folder with seeded
// random weights, for tests and benchmarks (nothing is ever downloaded).
//
//   MakeModelOptions options;
//   options.family = "llama";
//   options.target_bytes = int64_t{1} << 30;  // about 1 GiB: layers are added to get there
//   ACCEL_RETURN_IF_ERROR(MakeModel("/tmp/llama-1g", options).status());
#ifndef ACCEL_MODELS_MAKE_MODEL_H_
#define ACCEL_MODELS_MAKE_MODEL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"

#include "core/progress.h"
#include "loader/config.h"

namespace accel::models {

struct MakeModelOptions {
  // A model_type: llama | mistral | qwen2 | gpt2 | mixtral | qwen3 | qwen3_moe |
  // qwen2_moe | gemma2 | gemma3_text (or gemma3) | phi3.
  std::string family = "llama";
  int64_t vocab_size = 512;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 0;  // 0: 4 x hidden (gpt2), else about 8/3 x hidden rounded to 8
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 0;  // 0: num_heads (no grouping); ignored for gpt2
  int64_t max_position_embeddings = 256;
  bool tie_word_embeddings = false;  // gpt2 always ties
  bool attention_bias = false;       // llama: q/k/v/o biases; qwen2 always has q/k/v biases
  // mistral, mixtral, phi3, gemma2, gemma3_text (Gemma's own default 4096
  // when unset).
  std::optional<int64_t> sliding_window;
  int64_t head_dim = 0;  // 0: hidden / heads (written out for qwen3 and Gemma)
  // Mixture of experts (mixtral, qwen3_moe, qwen2_moe): 0 takes 8 experts,
  // top-2, an expert MLP of intermediate_size (Mixtral) or half of it (Qwen),
  // a shared expert of intermediate_size (qwen2_moe).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;
  std::optional<bool> norm_topk_prob;  // Qwen MoE; unset: true for qwen3_moe, false for qwen2_moe
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  // gemma3_text: every n-th layer attends globally.
  int64_t sliding_window_pattern = 6;
  // phi3: LongRoPE over a context this many times original_max_position_embeddings
  // (which is then max_position_embeddings / longrope_factor); 0: no rope scaling.
  int64_t longrope_factor = 0;
  double partial_rotary_factor = 1.0;  // phi3
  c10::ScalarType dtype = c10::ScalarType::Float;
  uint64_t seed = 0;
  // When set, num_layers is chosen so the weights come closest to this size.
  std::optional<int64_t> target_bytes;
  int64_t max_shard_size = 5'000'000'000;
  // The text tokenizer.json's byte-level BPE merges are learned from
  // (deterministically); empty: a few built-in paragraphs of English.
  std::string tokenizer_text;
  // The model of a real config.json instead of the shape options above
  // (family, sizes, layers, experts and every other field as it says; only
  // bos/eos become the made tokenizer's, the top two ids of the vocabulary,
  // and a quantization_config it holds is dropped unless `quantize` asks).
  std::optional<loader::ModelConfig> config;
  // Writes the checkpoint pre-quantized, as accel-quantize writes it from the
  // same weights (the same bytes): "none", "nf4", "fp4" or "int8" (LLM.int8),
  // the linear layers but lm_head and routers, transformers' layout. Each
  // layer is made, quantized and written in turn (several at once, one per
  // CPU), so memory holds a few layers whatever the model's size.
  std::string quantize = "none";
  bool double_quant = false;     // 4-bit: the absmaxes quantized too
  int64_t quant_blocksize = 64;  // 4-bit
  double int8_threshold = 6.0;   // int8: the outlier threshold written to config.json
  Progress::Style progress = Progress::Style::kSilent;
};

struct MadeModel {
  loader::ModelConfig config;
  int64_t parameters = 0;
  uint64_t bytes = 0;
  int files = 0;
};

// The config MakeModel would write, without writing anything
// (InvalidArgument naming the option that is out of range).
absl::StatusOr<loader::ModelConfig> MakeModelConfig(const MakeModelOptions& options);

// Writes config.json, generation_config.json, the weights (model.safetensors,
// or shards and an index past max_shard_size) and tokenizer.json into
// `out_dir`, creating it. Weights are streamed tensor by tensor, so a model
// larger than memory can be made (a checkpoint over 4 GiB is written back
// and dropped from the page cache as it is written). Each tensor depends only
// on the seed and its name: N(0, 0.02) for matrices and biases, 1 + N(0,
// 0.02) for norm weights (tensors over 4M elements drawn in 4M-element pieces
// on the intra-op threads, each piece from its own seeded generator).
absl::StatusOr<MadeModel> MakeModel(const std::string& out_dir, const MakeModelOptions& options);

}  // namespace accel::models

#endif  // ACCEL_MODELS_MAKE_MODEL_H_
