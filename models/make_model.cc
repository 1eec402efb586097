#include "models/make_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/bytes.h"
#include "core/dtype.h"
#include "core/status.h"
#include "loader/loader.h"
#include "models/families.h"
#include "tokenizer/bpe_trainer.h"

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

// Elements drawn from one generator: a larger tensor is drawn in pieces of
// this many, each from its own generator (the first seeded as a small
// tensor's is), on the intra-op threads. An 8B-parameter model's weights are
// then made in seconds instead of a minute of one thread; the values depend
// on the seed and the name only, never on the thread count.
constexpr int64_t kRandomPiece = int64_t{1} << 22;

// t (float32, contiguous) ~ N(0, std_dev).
void FillNormal(at::Tensor& t, double std_dev, absl::string_view name, uint64_t seed) {
  const int64_t n = t.numel();
  const uint64_t base = Fnv1a(name, seed);
  if (n <= kRandomPiece) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(base);
    t.normal_(0.0, std_dev, gen);
    return;
  }
  at::Tensor flat = t.view({n});
  const int64_t pieces = (n + kRandomPiece - 1) / kRandomPiece;
  at::parallel_for(0, pieces, 1, [&](int64_t begin, int64_t end) {
    for (int64_t piece = begin; piece < end; ++piece) {
      const uint64_t piece_seed = piece == 0 ? base : base ^ (0x9E3779B97F4A7C15ULL * piece);
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(piece_seed);
      flat.narrow(0, piece * kRandomPiece, std::min(kRandomPiece, n - piece * kRandomPiece))
          .normal_(0.0, std_dev, gen);
    }
  });
}

bool IsNormWeight(const std::string& name) {
  return absl::StrContains(name, "norm.weight") || absl::StrContains(name, "ln_1.weight") ||
         absl::StrContains(name, "ln_2.weight") || absl::StrContains(name, "ln_f.weight");
}

// A mixture-of-experts router ("block_sparse_moe.gate.weight", "mlp.gate.weight").
bool IsRouterWeight(const std::string& name) {
  return absl::EndsWith(name, "block_sparse_moe.gate.weight") ||
         absl::EndsWith(name, "mlp.gate.weight");
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
  std::optional<Family> family;
  const std::string wanted = o.family == "gemma3" ? "gemma3_text" : o.family;
  std::vector<std::string> known;
  for (const Family& f : SupportedFamilies()) {
    known.emplace_back(f.model_type);
    if (wanted == f.model_type) {
      c.architectures = {f.architecture};
      c.model_type = f.model_type;
      family = f;
    }
  }
  if (!family) {
    return absl::InvalidArgumentError(absl::StrCat("--family: unknown family '", o.family,
                                                   "' (known: ", absl::StrJoin(known, ", "), ")"));
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
  if (family->sliding != SlidingLayers::kNone) c.sliding_window = o.sliding_window;
  if (o.head_dim < 0) return absl::InvalidArgumentError("--head_dim must not be negative");
  c.head_dim = o.head_dim;
  const int64_t head_dim = o.head_dim > 0 ? o.head_dim : o.hidden_size / o.num_heads;
  if (gpt2) {
    c.hidden_act = "gelu_new";
    c.norm_eps = 1e-5;
  } else {
    c.hidden_act = "silu";
    c.norm_eps = 1e-5;
    c.rope_theta = 10000.0;
  }
  if (family->moe != MoeKind::kNone) {
    const bool mixtral = family->moe == MoeKind::kMixtral;
    c.moe.num_experts = o.num_experts > 0 ? o.num_experts : 8;
    c.moe.num_experts_per_tok = o.num_experts_per_tok > 0 ? o.num_experts_per_tok : 2;
    if (!mixtral) {
      c.moe.moe_intermediate_size =
          o.moe_intermediate_size > 0 ? o.moe_intermediate_size : c.intermediate_size / 2;
      c.moe.norm_topk_prob = o.norm_topk_prob.value_or(family->moe == MoeKind::kQwen);
      c.moe.decoder_sparse_step = o.decoder_sparse_step;
      c.moe.mlp_only_layers = o.mlp_only_layers;
      c.moe.has_mlp_only_layers = true;
    }
    if (family->moe == MoeKind::kQwenShared) {
      c.moe.shared_expert_intermediate_size = o.shared_expert_intermediate_size > 0
                                                  ? o.shared_expert_intermediate_size
                                                  : c.intermediate_size;
      c.qkv_bias = true;
    }
  }
  if (family->model_type == std::string("qwen3") || family->norm == NormKind::kRmsOnePlus) {
    c.head_dim = head_dim;  // Qwen3Config's and Gemma's defaults are not hidden / heads
  }
  if (family->norm == NormKind::kRmsOnePlus) {
    c.hidden_activation = "gelu_pytorch_tanh";
    c.hidden_act = "gelu_pytorch_tanh";
    c.norm_eps = 1e-6;
    c.rope_theta = family->local_rope ? 1'000'000.0 : 10'000.0;
    c.query_pre_attn_scalar = static_cast<double>(head_dim);
    if (!c.sliding_window) c.sliding_window = 4096;
    if (family->model_type == std::string("gemma2")) {
      c.attn_logit_softcapping = 50.0;
      c.final_logit_softcapping = 30.0;
    } else {
      c.sliding_window_pattern = o.sliding_window_pattern;
      c.rope_local_base_freq = 10000.0;
    }
  }
  if (family->partial_rotary) {
    c.partial_rotary_factor = o.partial_rotary_factor;
    if (o.longrope_factor > 0) {
      if (o.max_position_embeddings % o.longrope_factor != 0) {
        return absl::InvalidArgumentError(absl::StrCat("--longrope_factor ", o.longrope_factor,
                                                       " must divide --max_position_embeddings ",
                                                       o.max_position_embeddings));
      }
      c.original_max_position_embeddings = o.max_position_embeddings / o.longrope_factor;
      // Factors that grow across the frequencies, as LongRoPE's searched ones do.
      const int64_t n =
          static_cast<int64_t>(static_cast<double>(head_dim) * o.partial_rotary_factor) / 2;
      loader::RopeScaling scaling;
      scaling.rope_type = "longrope";
      for (int64_t i = 0; i < n; ++i) {
        const double x = n > 1 ? static_cast<double>(i) / static_cast<double>(n - 1) : 0.0;
        scaling.lists["short_factor"].push_back(1.0 + 0.5 * x);
        scaling.lists["long_factor"].push_back(1.0 + static_cast<double>(o.longrope_factor) * x);
      }
      c.rope_scaling = scaling;
    } else {
      c.original_max_position_embeddings = o.max_position_embeddings;
    }
  }
  c.torch_dtype = std::string(DTypeName(o.dtype));
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
      // Routers get a spread of logits a few units wide whatever the hidden
      // size, so the top experts stand apart (a router at N(0, 0.02) gives
      // near-ties that any rounding may flip).
      const double std_dev = IsRouterWeight(spec.name) && !spec.shape.empty()
                                 ? 2.0 / std::sqrt(static_cast<double>(spec.shape.back()))
                                 : 0.02;
      t = at::empty(spec.shape, at::TensorOptions().dtype(at::kFloat));
      FillNormal(t, std_dev, spec.name, seed);
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
                    ? tokenizer::TrainMerges(tokenizer::SampleEnglishText(),
                                             static_cast<int>(std::min<int64_t>(room, kMaxMerges)))
                    : tokenizer::TrainMerges(options.tokenizer_text, static_cast<int>(room));
  const bool gpt2 = config.model_type == "gpt2";
  std::vector<tokenizer::SpecialToken> specials = {
      {gpt2 ? "<|startoftext|>" : "<|begin_of_text|>", *config.bos_token_id},
      {gpt2 ? "<|endoftext|>" : "<|end_of_text|>", config.eos_token_ids[0]}};
  ACCEL_RETURN_IF_ERROR(loader::WriteFileAtomically(
      out_dir + "/tokenizer.json", tokenizer::ByteLevelTokenizerJson(merges, specials)));
  ACCEL_RETURN_IF_ERROR(loader::WriteFileAtomically(
      out_dir + "/tokenizer_config.json",
      tokenizer::TokenizerConfigJson(specials[0].content, specials[1].content)));

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
