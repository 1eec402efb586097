// accel-make-model OUT_DIR [flags]: a HuggingFace-format model with seeded
// random weights, from kilobytes to many gigabytes.
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"

#include "core/bytes.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/tool_main.h"
#include "models/make_model.h"

ABSL_FLAG(std::string, family, "llama", "llama | mistral | qwen2 | gpt2");
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
ABSL_FLAG(int64_t, sliding_window, 0, "mistral: attention window; 0: none.");
ABSL_FLAG(std::string, dtype, "float32", "float32 | float16 | bfloat16");
ABSL_FLAG(uint64_t, seed, 0, "Seed: the same flags and seed give the same bytes.");
ABSL_FLAG(std::string, size, "",
          "Target weight size (e.g. 1GiB, 500MB): picks --num_layers to match.");
ABSL_FLAG(std::string, max_shard_size, "5GB", "Shard the weights past this size (e.g. 2GB).");

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
      "  accel-make-model /tmp/big --family llama --hidden_size 2048 --size 4GiB --dtype bfloat16");
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
  options.seed = absl::GetFlag(FLAGS_seed);
  auto dtype = accel::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail(accel::Annotate(dtype.status(), "--dtype"));
  options.dtype = *dtype;
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
  std::cout << absl::StrFormat("%s: %s, %d layers, %d parameters, %s of weights in %d file(s)\n",
                               args[1], made->config.architectures[0],
                               made->config.num_hidden_layers, made->parameters,
                               accel::FormatBytes(static_cast<int64_t>(made->bytes)), made->files);
  return 0;
}

int main(int argc, char** argv) { return accel::ToolMain("accel-make-model", argc, argv, Main); }
