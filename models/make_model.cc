#include "models/make_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "core/bytes.h"
#include "core/dtype.h"
#include "core/status.h"
#include "loader/loader.h"
#include "models/families.h"
#include "models/internal/bpe_trainer.h"

namespace accel::models {
namespace {

constexpr int kMaxMerges = 400;

uint64_t Fnv1a(absl::string_view text, uint64_t seed) {
  uint64_t h = 1469598103934665603ULL ^ (seed * 0x9E3779B97F4A7C15ULL);
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

bool IsNormWeight(const std::string& name) {
  return absl::StrContains(name, "norm.weight") || absl::StrContains(name, "ln_1.weight") ||
         absl::StrContains(name, "ln_2.weight") || absl::StrContains(name, "ln_f.weight");
}

absl::StatusOr<uint64_t> WeightBytes(const loader::ModelConfig& config, c10::ScalarType dtype) {
  ACCEL_ASSIGN_OR_RETURN(std::vector<loader::TensorSpec> specs, CheckpointTensors(config, dtype));
  uint64_t total = 0;
  for (const auto& s : specs) {
    uint64_t n = c10::elementSize(s.dtype);
    for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
    total += n;
  }
  return total;
}

absl::Status Positive(const char* flag, int64_t value) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be positive, got ", value));
}

}  // namespace

absl::StatusOr<loader::ModelConfig> MakeModelConfig(const MakeModelOptions& o) {
  loader::ModelConfig c;
  bool known = false;
  for (const Family& f : SupportedFamilies()) {
    if (o.family == f.model_type) {
      c.architectures = {f.architecture};
      c.model_type = f.model_type;
      known = true;
    }
  }
  if (!known) {
    return absl::InvalidArgumentError(absl::StrCat("--family: unknown family '", o.family,
                                                   "' (known: llama, mistral, qwen2, gpt2)"));
  }
  const bool gpt2 = o.family == "gpt2";
  ACCEL_RETURN_IF_ERROR(Positive("hidden_size", o.hidden_size));
  ACCEL_RETURN_IF_ERROR(Positive("num_heads", o.num_heads));
  ACCEL_RETURN_IF_ERROR(Positive("max_position_embeddings", o.max_position_embeddings));
  if (!o.target_bytes) ACCEL_RETURN_IF_ERROR(Positive("num_layers", o.num_layers));
  if (o.hidden_size % o.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--hidden_size ", o.hidden_size, " is not divisible by --num_heads ", o.num_heads));
  }
  const int64_t kv = (gpt2 || o.num_kv_heads == 0) ? o.num_heads : o.num_kv_heads;
  if (kv <= 0 || o.num_heads % kv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_kv_heads ", o.num_kv_heads, " must divide --num_heads ", o.num_heads));
  }
  // The tokenizer needs the 256 byte tokens, its merges and two special tokens.
  if (o.vocab_size < 258) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--vocab_size must be at least 258 (256 bytes + 2 special tokens), got ", o.vocab_size));
  }
  c.vocab_size = o.vocab_size;
  c.hidden_size = o.hidden_size;
  c.intermediate_size = o.intermediate_size > 0 ? o.intermediate_size
                        : gpt2                  ? 4 * o.hidden_size
                                                : (o.hidden_size * 8 / 3 + 7) / 8 * 8;
  c.num_hidden_layers = std::max<int64_t>(o.num_layers, 1);
  c.num_attention_heads = o.num_heads;
  c.num_key_value_heads = kv;
  c.max_position_embeddings = o.max_position_embeddings;
  c.tie_word_embeddings = gpt2 || o.tie_word_embeddings;
  c.attention_bias = !gpt2 && o.attention_bias;
  if (o.family == "mistral") c.sliding_window = o.sliding_window;
  c.torch_dtype = std::string(DTypeName(o.dtype));
  if (gpt2) {
    c.hidden_act = "gelu_new";
    c.norm_eps = 1e-5;
  } else {
    c.hidden_act = "silu";
    c.norm_eps = 1e-5;
    c.rope_theta = 10000.0;
  }
  // Special tokens sit at the top of the vocabulary (GPT-2's 50256 habit).
  c.bos_token_id = o.vocab_size - 2;
  c.eos_token_ids = {o.vocab_size - 1};
  c.extra["initializer_range"] = "0.02";

  if (o.target_bytes) {
    if (*o.target_bytes <= 0) return absl::InvalidArgumentError("--size must be positive");
    loader::ModelConfig one = c;
    one.num_hidden_layers = 1;
    loader::ModelConfig two = c;
    two.num_hidden_layers = 2;
    ACCEL_ASSIGN_OR_RETURN(uint64_t one_bytes, WeightBytes(one, o.dtype));
    ACCEL_ASSIGN_OR_RETURN(uint64_t two_bytes, WeightBytes(two, o.dtype));
    const double per_layer = static_cast<double>(two_bytes - one_bytes);
    const double fixed = static_cast<double>(one_bytes) - per_layer;
    c.num_hidden_layers = std::max<int64_t>(
        1, std::llround((static_cast<double>(*o.target_bytes) - fixed) / per_layer));
  }
  ACCEL_RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::StatusOr<MadeModel> MakeModel(const std::string& out_dir, const MakeModelOptions& options) {
  if (!c10::isFloatingType(options.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype must be a floating type, got ", DTypeName(options.dtype)));
  }
  ACCEL_ASSIGN_OR_RETURN(loader::ModelConfig config, MakeModelConfig(options));
  ACCEL_ASSIGN_OR_RETURN(std::vector<loader::TensorSpec> specs,
                         CheckpointTensors(config, options.dtype));

  const uint64_t seed = options.seed;
  auto produce = [seed](const loader::TensorSpec& spec) -> absl::StatusOr<at::Tensor> {
    at::Tensor t;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(Fnv1a(spec.name, seed));
      t = at::normal(0.0, 0.02, spec.shape, gen, at::TensorOptions().dtype(at::kFloat));
      if (IsNormWeight(spec.name)) t.add_(1.0);
      t = t.to(spec.dtype);
    }));
    return t;
  };
  loader::CheckpointWriteOptions write_options;
  write_options.max_shard_size = options.max_shard_size;
  ACCEL_ASSIGN_OR_RETURN(loader::CheckpointWriteResult written,
                         loader::WriteCheckpoint(out_dir, specs, produce, write_options));

  loader::GenerationConfig generation;
  generation.bos_token_id = config.bos_token_id;
  generation.eos_token_ids = config.eos_token_ids;
  generation.max_new_tokens = 64;
  ACCEL_RETURN_IF_ERROR(loader::WriteFileAtomically(out_dir + "/config.json", config.ToJson()));
  ACCEL_RETURN_IF_ERROR(
      loader::WriteFileAtomically(out_dir + "/generation_config.json", generation.ToJson()));

  const int64_t room = config.vocab_size - 256 - 2;
  // The built-in sample holds enough text for kMaxMerges merges; a corpus of
  // the caller's may fill the whole vocabulary.
  auto merges = options.tokenizer_text.empty()
                    ? internal::TrainMerges(internal::SampleEnglishText(),
                                            static_cast<int>(std::min<int64_t>(room, kMaxMerges)))
                    : internal::TrainMerges(options.tokenizer_text, static_cast<int>(room));
  const bool gpt2 = config.model_type == "gpt2";
  std::vector<internal::SpecialToken> specials = {
      {gpt2 ? "<|startoftext|>" : "<|begin_of_text|>", *config.bos_token_id},
      {gpt2 ? "<|endoftext|>" : "<|end_of_text|>", config.eos_token_ids[0]}};
  ACCEL_RETURN_IF_ERROR(loader::WriteFileAtomically(
      out_dir + "/tokenizer.json", internal::ByteLevelTokenizerJson(merges, specials)));

  MadeModel made;
  made.config = std::move(config);
  made.bytes = written.total_bytes;
  made.files = static_cast<int>(written.files.size());
  for (const auto& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    made.parameters += n;
  }
  return made;
}

}  // namespace accel::models
