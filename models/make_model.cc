#include "models/make_model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
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
#include "core/progress.h"
#include "core/status.h"
#include "core/threads.h"
#include "dispatch/module_tree.h"
#include "loader/loader.h"
#include "models/families.h"
#include "models/quantize.h"
#include "quant/bnb.h"
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

// A worker's buffers, reused from one weight to the next: a fresh
// allocation of a large weight costs page faults that take as long as
// drawing its values.
struct Scratch {
  at::Tensor f32, low;
};

// One weight as the maker makes it: N(0, 0.02) (routers wider), 1 + that for
// norms, drawn in float32 from a generator seeded by the seed and the
// tensor's name, then converted to `dtype` (what at::normal(...).to(dtype)
// gives). With `scratch`, the result is one of its buffers, valid until the
// next call; without, a tensor of its own.
absl::StatusOr<at::Tensor> MakeWeight(const std::string& name, const std::vector<int64_t>& shape,
                                      c10::ScalarType dtype, uint64_t seed,
                                      Scratch* scratch = nullptr) {
  at::Tensor t;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    // Routers get a spread of logits a few units wide whatever the hidden
    // size, so the top experts stand apart (a router at N(0, 0.02) gives
    // near-ties that any rounding may flip).
    const double std_dev = IsRouterWeight(name) && !shape.empty()
                               ? 2.0 / std::sqrt(static_cast<double>(shape.back()))
                               : 0.02;
    if (scratch == nullptr) {
      t = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
    } else {
      if (!scratch->f32.defined()) scratch->f32 = at::empty({0}, at::kFloat);
      t = scratch->f32.resize_(shape);
    }
    FillNormal(t, std_dev, name, seed);
    if (IsNormWeight(name)) t.add_(1.0);
    if (dtype == at::kFloat) return;
    if (scratch == nullptr) {
      t = t.to(dtype);
    } else {
      if (!scratch->low.defined() || scratch->low.scalar_type() != dtype) {
        scratch->low = at::empty({0}, dtype);
      }
      t = scratch->low.resize_(shape).copy_(t);
    }
  }));
  return t;
}

// A linear layer of the plan, made and quantized as accel-quantize quantizes
// it on loading (the weight in the model's dtype, [out, in]): its checkpoint
// tensors by name (the bias, made on its own, is not among them).
absl::StatusOr<std::map<std::string, at::Tensor>> MakeQuantizedLayer(
    const std::string& layer, const loader::TensorSpec& weight, bool transposed,
    const nn::LinearQuantization& how, uint64_t seed, Scratch& scratch) {
  ACCEL_ASSIGN_OR_RETURN(at::Tensor dense,
                         MakeWeight(weight.name, weight.shape, weight.dtype, seed, &scratch));
  if (transposed) ACCEL_RETURN_IF_ERROR(CallTorch([&] { dense = dense.t().contiguous(); }));
  const auto annotate = [&](const absl::Status& s) {
    return Annotate(s, absl::StrCat("quantizing tensor '", weight.name, "'"));
  };
  std::map<std::string, at::Tensor> out;
  if (how.method == nn::LinearQuantization::Method::kInt8) {
    absl::StatusOr<quant::QuantizedInt8> q = quant::QuantizeInt8(dense);
    if (!q.ok()) return annotate(q.status());
    out[layer + ".weight"] = q->weight;
    out[layer + ".SCB"] = q->scb;
    ACCEL_RETURN_IF_ERROR(
        CallTorch([&] { out[layer + ".weight_format"] = at::zeros({}, at::kByte); }));
    return out;
  }
  absl::StatusOr<quant::Quantized4bit> q =
      quant::Quantize4bit(dense, how.quant_type, how.blocksize, how.double_quant);
  if (!q.ok()) return annotate(q.status());
  out[layer + ".weight"] = q->packed;
  out[layer + ".weight.absmax"] = q->absmax;
  out[layer + ".weight.quant_map"] = q->quant_map;
  if (how.double_quant) {
    out[layer + ".weight.nested_absmax"] = q->nested_absmax;
    out[layer + ".weight.nested_quant_map"] = q->nested_quant_map;
  }
  const std::string json = quant::QuantState4bitToJson(q->state);
  at::Tensor blob;
  ACCEL_RETURN_IF_ERROR(
      CallTorch([&] { blob = at::empty({static_cast<int64_t>(json.size())}, at::kByte); }));
  std::memcpy(blob.data_ptr(), json.data(), json.size());
  out[QuantStateBlobName(layer, how.quant_type)] = blob;
  return out;
}

// Makes the checkpoint's tensors a unit at a time (one tensor, or a
// quantized layer's tensors) on worker threads of their own, at most
// `window` units ahead of the writer, and hands them over in the writer's
// order: the writer's thread does the I/O while the CPUs make what follows.
class UnitPipeline {
 public:
  using Made = absl::StatusOr<std::map<std::string, at::Tensor>>;
  using Make = std::function<Made(Scratch&)>;

  UnitPipeline(int threads, int window) : threads_(std::max(1, threads)), window_(window) {}
  ~UnitPipeline() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  // Before the first Take().
  void Add(const std::vector<std::string>& names, Make make) {
    for (const std::string& name : names) unit_of_[name] = units_.size();
    units_.push_back(std::move(make));
  }

  absl::StatusOr<at::Tensor> Take(const std::string& name) {
    auto found = unit_of_.find(name);
    if (found == unit_of_.end()) {
      return absl::InternalError(absl::StrCat("no unit makes tensor '", name, "'"));
    }
    const size_t unit = found->second;
    std::unique_lock<std::mutex> lock(mu_);
    if (workers_.empty()) {
      for (int t = 0; t < threads_; ++t) workers_.emplace_back([this] { Work(); });
    }
    wanted_ = std::max(wanted_, unit);
    cv_.notify_all();
    cv_.wait(lock, [&] { return made_.count(unit) > 0; });
    auto it = made_.find(unit);
    if (!it->second.ok()) return it->second.status();
    auto tensor = it->second->find(name);
    if (tensor == it->second->end()) {
      return absl::InternalError(absl::StrCat("tensor '", name, "' was not made"));
    }
    at::Tensor out = std::move(tensor->second);
    it->second->erase(tensor);
    if (it->second->empty()) made_.erase(it);
    return out;
  }

 private:
  void Work() {
    Scratch scratch;
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock,
               [&] { return stop_ || (next_ < units_.size() && next_ <= wanted_ + window_); });
      if (stop_) return;
      const size_t unit = next_++;
      lock.unlock();
      Made made = units_[unit](scratch);
      lock.lock();
      made_.emplace(unit, std::move(made));
      cv_.notify_all();
    }
  }

  const int threads_;
  const size_t window_;
  std::vector<Make> units_;
  std::map<std::string, size_t> unit_of_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t next_ = 0;              // the next unit to start
  size_t wanted_ = 0;            // the latest unit the writer asked for
  std::map<size_t, Made> made_;  // units made, with the tensors not yet taken
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

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

namespace {

absl::StatusOr<loader::ModelConfig> ConfigOf(const MakeModelOptions& options) {
  if (!options.config) return MakeModelConfig(options);
  loader::ModelConfig c = *options.config;
  if (c.vocab_size < 258) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: vocab_size must be at least 258 (256 bytes + 2 special tokens) "
                     "for the made tokenizer, got ",
                     c.vocab_size));
  }
  // The made tokenizer's special tokens (the top two ids) stand for the
  // config's; a quantization_config described weights that are not these.
  c.bos_token_id = c.vocab_size - 2;
  c.eos_token_ids = {c.vocab_size - 1};
  if (c.pad_token_id && (*c.pad_token_id < 0 || *c.pad_token_id >= c.vocab_size)) {
    c.pad_token_id.reset();
  }
  c.extra.erase("quantization_config");
  ACCEL_RETURN_IF_ERROR(Annotate(c.Validate(), "config"));
  return c;
}

// The quantized layer whose checkpoint tensor `name` is ("X" for "X.weight",
// "X.SCB", "X.weight.absmax", the blob...), or "" (the bias is made alone).
std::string QuantizedLayerOf(const std::string& name, const QuantPlan& plan) {
  for (absl::string_view suffix : {".weight", ".SCB", ".weight_format"}) {
    if (absl::EndsWith(name, suffix)) {
      std::string layer = name.substr(0, name.size() - suffix.size());
      if (plan.count(layer)) return layer;
    }
  }
  const size_t at = name.rfind(".weight.");
  if (at != std::string::npos && plan.count(name.substr(0, at))) return name.substr(0, at);
  return "";
}

}  // namespace

absl::StatusOr<MadeModel> MakeModel(const std::string& out_dir, const MakeModelOptions& options) {
  if (!c10::isFloatingType(options.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype must be a floating type, got ", DTypeName(options.dtype)));
  }
  ACCEL_ASSIGN_OR_RETURN(loader::ModelConfig config, ConfigOf(options));
  config.torch_dtype = std::string(DTypeName(options.dtype));
  ACCEL_ASSIGN_OR_RETURN(std::vector<loader::TensorSpec> float_specs,
                         CheckpointTensors(config, options.dtype));
  const uint64_t seed = options.seed;
  const c10::ScalarType dtype = options.dtype;
  const int window = IntraOpThreads(0);

  std::vector<loader::TensorSpec> specs;
  UnitPipeline pipeline(window, window);
  std::optional<nn::LinearQuantization> how;
  if (options.quantize == "none") {
    if (options.double_quant) {
      return absl::InvalidArgumentError("--double_quant needs --quantize nf4 or fp4");
    }
    specs = float_specs;
    for (const loader::TensorSpec& spec : specs) {
      pipeline.Add({spec.name}, [spec, seed](Scratch&) -> UnitPipeline::Made {
        ACCEL_ASSIGN_OR_RETURN(at::Tensor t, MakeWeight(spec.name, spec.shape, spec.dtype, seed));
        return std::map<std::string, at::Tensor>{{spec.name, t}};
      });
    }
  } else {
    QuantizeOptions asked;
    asked.method = options.quantize;
    asked.double_quant = options.double_quant;
    asked.blocksize = options.quant_blocksize;
    asked.int8_threshold = options.int8_threshold;
    asked.compute_dtype = dtype;
    absl::StatusOr<quant::BnbQuantizationConfig> bnb = BnbConfigFor(asked);
    if (!bnb.ok()) return Annotate(bnb.status(), "--quantize");
    ACCEL_ASSIGN_OR_RETURN(dispatch::ModuleTree tree, ModuleTreeFor(config, dtype));
    ACCEL_ASSIGN_OR_RETURN(QuantPlan plan, PlanQuantization(tree, *bnb));
    how = plan.begin()->second;
    std::map<std::string, loader::TensorSpec> by_name;
    for (const loader::TensorSpec& spec : float_specs) by_name.emplace(spec.name, spec);
    struct Layer {
      loader::TensorSpec weight;  // its float weight as the float model holds it
      bool transposed;
      nn::LinearQuantization how;
    };
    std::map<std::string, Layer> layers;
    for (const auto& [name, layer_how] : plan) {
      auto weight = by_name.find(name + ".weight");
      ACCEL_ASSIGN_OR_RETURN(int node, tree.FindModule(name));
      if (weight == by_name.end()) {
        return absl::InternalError(absl::StrCat("layer '", name, "' has no weight to quantize"));
      }
      layers[name] = {weight->second, tree.node(node).class_name == "Conv1D", layer_how};
    }
    // A 4-bit layer's quant state blob (JSON) has the length of its text,
    // known before its weight is made, except for double quant's offset (the
    // mean absmax, printed as Python prints a float): then each layer is made
    // once beforehand to learn it (double quant takes about twice as long).
    std::map<std::string, int64_t> blob_bytes;
    std::vector<std::string> measure;
    for (const auto& [name, layer] : layers) {
      if (layer.how.method != nn::LinearQuantization::Method::k4bit) continue;
      if (!layer.how.double_quant) {
        quant::QuantState4bit state;
        state.quant_type = layer.how.quant_type;
        state.blocksize = layer.how.blocksize;
        state.dtype = dtype;
        const std::vector<int64_t>& shape = layer.weight.shape;
        state.shape = layer.transposed ? std::vector<int64_t>{shape[1], shape[0]} : shape;
        blob_bytes[name] = static_cast<int64_t>(quant::QuantState4bitToJson(state).size());
      } else {
        measure.push_back(name);
      }
    }
    {
      std::mutex mu;
      absl::Status failed;
      std::atomic<size_t> next{0};
      std::vector<std::thread> threads;
      for (int t = 0; t < std::min<int>(window, static_cast<int>(measure.size())); ++t) {
        threads.emplace_back([&] {
          Scratch scratch;
          for (size_t i; (i = next++) < measure.size();) {
            const Layer& layer = layers.at(measure[i]);
            auto made = MakeQuantizedLayer(measure[i], layer.weight, layer.transposed, layer.how,
                                           seed, scratch);
            std::lock_guard<std::mutex> lock(mu);
            if (!made.ok()) {
              if (failed.ok()) failed = made.status();
              continue;
            }
            blob_bytes[measure[i]] =
                made->at(QuantStateBlobName(measure[i], layer.how.quant_type)).numel();
          }
        });
      }
      for (std::thread& t : threads) t.join();
      ACCEL_RETURN_IF_ERROR(failed);
    }
    ACCEL_ASSIGN_OR_RETURN(
        specs,
        QuantizedCheckpointSpecs(
            tree, plan, [&](const std::string& layer) -> absl::StatusOr<int64_t> {
              auto it = blob_bytes.find(layer);
              if (it == blob_bytes.end()) {
                return absl::InternalError(absl::StrCat("no quant state length for '", layer, "'"));
              }
              return it->second;
            }));
    std::map<std::string, std::vector<std::string>> parts;  // layer -> its tensors, in order
    std::vector<std::string> order;                         // units: a layer, or "=" + tensor
    for (const loader::TensorSpec& spec : specs) {
      const std::string layer = QuantizedLayerOf(spec.name, plan);
      if (layer.empty()) {
        order.push_back("=" + spec.name);
        continue;
      }
      if (!parts.count(layer)) order.push_back(layer);
      parts[layer].push_back(spec.name);
    }
    for (const std::string& unit : order) {
      if (unit[0] == '=') {
        auto found = by_name.find(unit.substr(1));
        if (found == by_name.end()) {
          return absl::InternalError(absl::StrCat("tensor '", unit.substr(1), "' is not made"));
        }
        const loader::TensorSpec spec = found->second;
        pipeline.Add({spec.name}, [spec, seed](Scratch&) -> UnitPipeline::Made {
          ACCEL_ASSIGN_OR_RETURN(at::Tensor t, MakeWeight(spec.name, spec.shape, spec.dtype, seed));
          return std::map<std::string, at::Tensor>{{spec.name, t}};
        });
        continue;
      }
      const Layer layer = layers.at(unit);
      pipeline.Add(parts[unit], [unit, layer, seed](Scratch& scratch) {
        return MakeQuantizedLayer(unit, layer.weight, layer.transposed, layer.how, seed, scratch);
      });
    }
  }

  uint64_t total = 0;
  for (const loader::TensorSpec& spec : specs) {
    uint64_t n = c10::elementSize(spec.dtype);
    for (int64_t d : spec.shape) n *= static_cast<uint64_t>(d);
    total += n;
  }
  Progress progress("making", static_cast<int64_t>(total), static_cast<int64_t>(specs.size()),
                    options.progress);
  auto produce = [&](const loader::TensorSpec& spec) -> absl::StatusOr<at::Tensor> {
    ACCEL_ASSIGN_OR_RETURN(at::Tensor t, pipeline.Take(spec.name));
    progress.Add(static_cast<int64_t>(t.nbytes()));
    return t;
  };
  loader::CheckpointWriteOptions write_options;
  write_options.max_shard_size = options.max_shard_size;
  // A checkpoint that could push the machine's page cache out is written back
  // as it goes (what is made is read back later, if at all).
  if (total > (uint64_t{4} << 30)) write_options.write_behind_bytes = int64_t{512} << 20;
  ACCEL_ASSIGN_OR_RETURN(loader::CheckpointWriteResult written,
                         loader::WriteCheckpoint(out_dir, specs, produce, write_options));
  progress.Finish();

  loader::GenerationConfig generation;
  generation.bos_token_id = config.bos_token_id;
  generation.eos_token_ids = config.eos_token_ids;
  generation.max_new_tokens = 64;
  std::string config_json = config.ToJson();
  if (how) {
    // As accel-quantize writes it for the float model's config.json.
    ACCEL_ASSIGN_OR_RETURN(config_json,
                           QuantizedConfigJson(config_json, *how, dtype, "config.json"));
  }
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
  // config.json last: a folder without it is not taken for a model.
  ACCEL_RETURN_IF_ERROR(loader::WriteFileAtomically(out_dir + "/config.json", config_json));

  MadeModel made;
  made.config = std::move(config);
  made.bytes = written.total_bytes;
  made.files = static_cast<int>(written.files.size());
  for (const auto& s : float_specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    made.parameters += n;
  }
  return made;
}

}  // namespace accel::models
