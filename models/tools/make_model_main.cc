// accel-make-model OUT_DIR [flags]: a HuggingFace-format model with seeded
// random weights, from kilobytes to many gigabytes.
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "core/bytes.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/tool_main.h"
#include "loader/config.h"
#include "models/make_model.h"

ABSL_FLAG(std::string, family, "llama",
          "llama | mistral | qwen2 | gpt2 | mixtral | qwen3 | qwen3_moe | qwen2_moe | gemma2 | "
          "gemma3_text | phi3");
ABSL_FLAG(int64_t, vocab_size, 512, "Vocabulary size (at least 258).");
ABSL_FLAG(int64_t, hidden_size, 64, "Hidden size.");
ABSL_FLAG(int64_t, intermediate_size, 0, "MLP size; 0: 4 x hidden (gpt2) or about 8/3 x hidden.");
ABSL_FLAG(int64_t, num_layers, 2, "Decoder layers (ignored with --size).");
ABSL_FLAG(int64_t, num_heads, 4, "Attention heads.");
ABSL_FLAG(int64_t, num_kv_heads, 0, "Key/value heads for grouped-query attention; 0: num_heads.");
ABSL_FLAG(int64_t, max_position_embeddings, 256, "Context length.");
ABSL_FLAG(bool, tie_word_embeddings, false,
          "Share the embedding with the output head (gpt2 always does).");
ABSL_FLAG(bool, attention_bias, false, "llama: biases on q/k/v/o (qwen2 always has q/k/v biases).");
ABSL_FLAG(int64_t, sliding_window, 0,
          "Attention window of the sliding layers (mistral, mixtral, phi3, gemma2, gemma3_text); "
          "0: none (Gemma: 4096).");
ABSL_FLAG(int64_t, head_dim, 0, "Head size; 0: hidden_size / num_heads.");
ABSL_FLAG(int64_t, num_experts, 0, "MoE families: experts per layer (0: 8).");
ABSL_FLAG(int64_t, num_experts_per_tok, 0, "MoE families: experts each token is routed to (0: 2).");
ABSL_FLAG(int64_t, moe_intermediate_size, 0,
          "qwen3_moe, qwen2_moe: each expert's MLP size (0: intermediate_size / 2).");
ABSL_FLAG(int64_t, shared_expert_intermediate_size, 0,
          "qwen2_moe: the shared expert's MLP size (0: intermediate_size).");
ABSL_FLAG(
    std::string, norm_topk_prob, "auto",
    "Qwen MoE: renormalise the top-k weights (auto: true for qwen3_moe, false for qwen2_moe).");
ABSL_FLAG(int64_t, decoder_sparse_step, 1, "Qwen MoE: every n-th layer is sparse.");
ABSL_FLAG(std::vector<std::string>, mlp_only_layers, {},
          "Qwen MoE: layers with a dense MLP, comma-separated.");
ABSL_FLAG(int64_t, sliding_window_pattern, 6, "gemma3_text: every n-th layer attends globally.");
ABSL_FLAG(int64_t, longrope_factor, 0,
          "phi3: LongRoPE over max_position_embeddings = factor x the original context; 0: none.");
ABSL_FLAG(double, partial_rotary_factor, 1.0, "phi3: the rotated fraction of each head.");
ABSL_FLAG(std::string, dtype, "auto",
          "float32 | float16 | bfloat16 | auto (--config's torch_dtype, else float32)");
ABSL_FLAG(uint64_t, seed, 0, "Seed: the same flags and seed give the same bytes.");
ABSL_FLAG(std::string, size, "",
          "Target weight size (e.g. 1GiB, 500MB): picks --num_layers to match.");
ABSL_FLAG(std::string, max_shard_size, "5GB", "Shard the weights past this size (e.g. 2GB).");
ABSL_FLAG(std::string, config, "",
          "A real config.json to make the model of (family, shapes, experts, RoPE...), instead "
          "of the shape flags; bos/eos become the made tokenizer's.");
ABSL_FLAG(std::string, quantize, "none",
          "Write the checkpoint pre-quantized, as accel-quantize would from the same weights "
          "(bitsandbytes' layout): none | nf4 | fp4 | int8. Streams layer by layer.");
ABSL_FLAG(bool, double_quant, false, "With nf4 / fp4: quantize the absmaxes too.");
ABSL_FLAG(int64_t, quant_blocksize, 64, "With nf4 / fp4: elements per absmax.");

namespace {

int Fail(const absl::Status& status) {
  std::cerr << "accel-make-model: " << status.message() << "\n";
  return 1;
}

}  // namespace

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "accel-make-model OUT_DIR [flags]\n"
      "Writes config.json, generation_config.json, model.safetensors (or shards + index)\n"
      "and tokenizer.json with seeded random weights. Example:\n"
      "  accel-make-model /tmp/tiny --family llama --num_kv_heads 2\n"
      "  accel-make-model /tmp/big --family llama --hidden_size 2048 --size 4GiB --dtype bfloat16\n"
      "  accel-make-model /tmp/mixtral-nf4 --config mixtral-8x7b.json --quantize nf4");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::cerr << "accel-make-model: expected exactly one OUT_DIR (see --help)\n";
    return 1;
  }
  accel::models::MakeModelOptions options;
  options.family = absl::GetFlag(FLAGS_family);
  options.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  options.hidden_size = absl::GetFlag(FLAGS_hidden_size);
  options.intermediate_size = absl::GetFlag(FLAGS_intermediate_size);
  options.num_layers = absl::GetFlag(FLAGS_num_layers);
  options.num_heads = absl::GetFlag(FLAGS_num_heads);
  options.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  options.max_position_embeddings = absl::GetFlag(FLAGS_max_position_embeddings);
  options.tie_word_embeddings = absl::GetFlag(FLAGS_tie_word_embeddings);
  options.attention_bias = absl::GetFlag(FLAGS_attention_bias);
  if (absl::GetFlag(FLAGS_sliding_window) > 0)
    options.sliding_window = absl::GetFlag(FLAGS_sliding_window);
  options.head_dim = absl::GetFlag(FLAGS_head_dim);
  options.num_experts = absl::GetFlag(FLAGS_num_experts);
  options.num_experts_per_tok = absl::GetFlag(FLAGS_num_experts_per_tok);
  options.moe_intermediate_size = absl::GetFlag(FLAGS_moe_intermediate_size);
  options.shared_expert_intermediate_size = absl::GetFlag(FLAGS_shared_expert_intermediate_size);
  if (const std::string norm = absl::GetFlag(FLAGS_norm_topk_prob); norm != "auto") {
    if (norm != "true" && norm != "false") {
      return Fail(absl::InvalidArgumentError("--norm_topk_prob: expected auto, true or false"));
    }
    options.norm_topk_prob = norm == "true";
  }
  options.decoder_sparse_step = absl::GetFlag(FLAGS_decoder_sparse_step);
  for (const std::string& layer : absl::GetFlag(FLAGS_mlp_only_layers)) {
    int64_t i = 0;
    if (!absl::SimpleAtoi(layer, &i) || i < 0) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--mlp_only_layers: '", layer, "' is not a layer number")));
    }
    options.mlp_only_layers.push_back(i);
  }
  options.sliding_window_pattern = absl::GetFlag(FLAGS_sliding_window_pattern);
  options.longrope_factor = absl::GetFlag(FLAGS_longrope_factor);
  options.partial_rotary_factor = absl::GetFlag(FLAGS_partial_rotary_factor);
  options.seed = absl::GetFlag(FLAGS_seed);
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    auto config = accel::loader::ReadModelConfig(path);
    if (!config.ok()) return Fail(accel::Annotate(config.status(), "--config"));
    options.config = *std::move(config);
  }
  std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  if (dtype_name == "auto") {
    dtype_name = options.config && !options.config->torch_dtype.empty()
                     ? options.config->torch_dtype
                     : "float32";
  }
  auto dtype = accel::ParseDType(dtype_name);
  if (!dtype.ok()) return Fail(accel::Annotate(dtype.status(), "--dtype"));
  options.dtype = *dtype;
  options.quantize = absl::GetFlag(FLAGS_quantize);
  options.double_quant = absl::GetFlag(FLAGS_double_quant);
  options.quant_blocksize = absl::GetFlag(FLAGS_quant_blocksize);
  options.progress = accel::Progress::Style::kAuto;
  if (std::string size = absl::GetFlag(FLAGS_size); !size.empty()) {
    auto bytes = accel::ParseByteSize(size);
    if (!bytes.ok()) return Fail(accel::Annotate(bytes.status(), "--size"));
    options.target_bytes = *bytes;
  }
  auto shard = accel::ParseByteSize(absl::GetFlag(FLAGS_max_shard_size));
  if (!shard.ok()) return Fail(accel::Annotate(shard.status(), "--max_shard_size"));
  options.max_shard_size = *shard;

  auto made = accel::models::MakeModel(args[1], options);
  if (!made.ok()) return Fail(made.status());
  std::cout << absl::StrFormat(
      "%s: %s, %d layers, %d parameters, %s of weights%s in %d file(s)\n", args[1],
      made->config.architectures[0], made->config.num_hidden_layers, made->parameters,
      accel::FormatBytes(static_cast<int64_t>(made->bytes)),
      options.quantize == "none" ? "" : absl::StrCat(" (", options.quantize, ")"), made->files);
  return 0;
}

int main(int argc, char** argv) { return accel::ToolMain("accel-make-model", argc, argv, Main); }
