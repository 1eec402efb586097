// The Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM):
// one implementation, with transformers' module layout and arithmetic
// (eager attention with the softmax in float32, rotate-half rotary, GQA by
// repeating key/value heads); and GPT2LMHeadModel.
#include "models/causal_lm.h"

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "models/families.h"
#include "models/nn.h"

namespace accel::models {
namespace {

struct Sizes {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  std::optional<int64_t> window;
};

class Attention : public dispatch::Layer {
 public:
  Attention(const std::string& prefix, const Sizes& s, bool qkv_bias, bool o_bias,
            at::ScalarType dtype)
      : dispatch::Layer(prefix + "Attention"), s_(s) {
    q_proj = register_module(
        "q_proj", std::make_shared<nn::Linear>(s.hidden, s.heads * s.head_dim, qkv_bias, dtype));
    k_proj = register_module(
        "k_proj", std::make_shared<nn::Linear>(s.hidden, s.kv_heads * s.head_dim, qkv_bias, dtype));
    v_proj = register_module(
        "v_proj", std::make_shared<nn::Linear>(s.hidden, s.kv_heads * s.head_dim, qkv_bias, dtype));
    o_proj = register_module(
        "o_proj", std::make_shared<nn::Linear>(s.heads * s.head_dim, s.hidden, o_bias, dtype));
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor* k_cache, at::Tensor* v_cache) {
    const int64_t b = x.size(0), t = x.size(1);
    at::Tensor q = q_proj->forward(x).view({b, t, s_.heads, s_.head_dim}).transpose(1, 2);
    at::Tensor k = k_proj->forward(x).view({b, t, s_.kv_heads, s_.head_dim}).transpose(1, 2);
    at::Tensor v = v_proj->forward(x).view({b, t, s_.kv_heads, s_.head_dim}).transpose(1, 2);
    q = nn::ApplyRotary(q, cos, sin);
    k = nn::ApplyRotary(k, cos, sin);
    if (k_cache != nullptr) {
      if (k_cache->defined()) {
        k = at::cat({*k_cache, k}, 2);
        v = at::cat({*v_cache, v}, 2);
      }
      *k_cache = k;
      *v_cache = v;
    }
    const int64_t total = k.size(2), past = total - t;
    const int64_t repeat = s_.heads / s_.kv_heads;
    at::Tensor keys = repeat > 1 ? k.repeat_interleave(repeat, 1) : k;
    at::Tensor values = repeat > 1 ? v.repeat_interleave(repeat, 1) : v;
    at::Tensor scores =
        at::matmul(q, keys.transpose(2, 3)) / std::sqrt(static_cast<double>(s_.head_dim));
    // Query i (at absolute position past + i) sees key j when j <= past + i
    // and, with a sliding window, past + i - j < window.
    at::Tensor query_pos = at::arange(past, total, x.options().dtype(at::kLong)).unsqueeze(1);
    at::Tensor key_pos = at::arange(0, total, x.options().dtype(at::kLong)).unsqueeze(0);
    at::Tensor allowed = key_pos <= query_pos;
    if (s_.window) allowed = allowed.logical_and(query_pos - key_pos < *s_.window);
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity());
    at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
    at::Tensor out =
        at::matmul(probs, values).transpose(1, 2).reshape({b, t, s_.heads * s_.head_dim});
    return o_proj->forward(out);
  }

  std::shared_ptr<nn::Linear> q_proj, k_proj, v_proj, o_proj;

 private:
  Sizes s_;
};

class Mlp : public dispatch::Layer {
 public:
  Mlp(const std::string& prefix, const Sizes& s, at::ScalarType dtype)
      : dispatch::Layer(prefix + "MLP") {
    gate_proj = register_module(
        "gate_proj", std::make_shared<nn::Linear>(s.hidden, s.intermediate, false, dtype));
    up_proj = register_module("up_proj",
                              std::make_shared<nn::Linear>(s.hidden, s.intermediate, false, dtype));
    down_proj = register_module(
        "down_proj", std::make_shared<nn::Linear>(s.intermediate, s.hidden, false, dtype));
    register_module("act_fn", std::make_shared<dispatch::Layer>("SiLU"));
  }
  at::Tensor forward(const at::Tensor& x) {
    return down_proj->forward(at::silu(gate_proj->forward(x)) * up_proj->forward(x));
  }
  std::shared_ptr<nn::Linear> gate_proj, up_proj, down_proj;
};

class DecoderLayer : public dispatch::Layer {
 public:
  DecoderLayer(const std::string& prefix, const Sizes& s, bool qkv_bias, bool o_bias, double eps,
               at::ScalarType dtype)
      : dispatch::Layer(prefix + "DecoderLayer") {
    self_attn = register_module("self_attn",
                                std::make_shared<Attention>(prefix, s, qkv_bias, o_bias, dtype));
    mlp = register_module("mlp", std::make_shared<Mlp>(prefix, s, dtype));
    input_layernorm = register_module(
        "input_layernorm", std::make_shared<nn::RMSNorm>(prefix + "RMSNorm", s.hidden, eps, dtype));
    post_attention_layernorm =
        register_module("post_attention_layernorm",
                        std::make_shared<nn::RMSNorm>(prefix + "RMSNorm", s.hidden, eps, dtype));
  }
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor* k_cache, at::Tensor* v_cache) {
    x = x + self_attn->forward(input_layernorm->forward(x), cos, sin, k_cache, v_cache);
    return x + mlp->forward(post_attention_layernorm->forward(x));
  }
  std::shared_ptr<Attention> self_attn;
  std::shared_ptr<Mlp> mlp;
  std::shared_ptr<nn::RMSNorm> input_layernorm, post_attention_layernorm;
};

class DecoderModel : public dispatch::Layer {
 public:
  DecoderModel(const std::string& prefix, const loader::ModelConfig& c, const Sizes& s,
               bool qkv_bias, bool o_bias, std::shared_ptr<nn::RotaryEmbedding> rotary,
               at::ScalarType dtype)
      : dispatch::Layer(prefix + "Model") {
    embed_tokens = register_module("embed_tokens",
                                   std::make_shared<nn::Embedding>(c.vocab_size, s.hidden, dtype));
    auto list = register_module("layers", std::make_shared<dispatch::Layer>("ModuleList"));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      layers.push_back(list->register_module(
          absl::StrCat(i),
          std::make_shared<DecoderLayer>(prefix, s, qkv_bias, o_bias, c.norm_eps, dtype)));
    }
    norm = register_module(
        "norm", std::make_shared<nn::RMSNorm>(prefix + "RMSNorm", s.hidden, c.norm_eps, dtype));
    rotary_emb = register_module("rotary_emb", std::move(rotary));
  }
  std::shared_ptr<nn::Embedding> embed_tokens;
  std::vector<std::shared_ptr<DecoderLayer>> layers;
  std::shared_ptr<nn::RMSNorm> norm;
  std::shared_ptr<nn::RotaryEmbedding> rotary_emb;
};

// Runs `fn` on module `name`'s execution device, inside its scope when the
// model is dispatched; without a dispatcher, on `fallback`.
template <typename Fn>
absl::StatusOr<at::Tensor> InScope(dispatch::DispatchedModel* dispatched, const std::string& name,
                                   const at::Device& fallback, Fn&& fn) {
  std::optional<dispatch::DispatchedModel::Scope> scope;
  at::Device device = fallback;
  if (dispatched != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(dispatch::DispatchedModel::Scope entered, dispatched->Enter(name));
    device = entered.device();
    scope.emplace(std::move(entered));
  }
  at::Tensor out;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] { out = fn(device); }));
  return out;
}

class LlamaFamilyLM : public CausalLM {
 public:
  LlamaFamilyLM(const Family& family, const std::string& prefix, const loader::ModelConfig& c,
                const Sizes& s, bool qkv_bias, bool o_bias,
                std::shared_ptr<nn::RotaryEmbedding> rotary, at::ScalarType dtype)
      : CausalLM(family.architecture), dtype_(dtype) {
    model = register_module("model", std::make_shared<DecoderModel>(prefix, c, s, qkv_bias, o_bias,
                                                                    std::move(rotary), dtype));
    at::Tensor shared = c.tie_word_embeddings ? model->embed_tokens->weight : at::Tensor();
    lm_head = register_module(
        "lm_head", std::make_shared<nn::Linear>(s.hidden, c.vocab_size, false, dtype, shared));
  }

  absl::StatusOr<at::Tensor> Forward(const at::Tensor& input_ids, const at::Tensor& positions,
                                     KvCache* cache,
                                     dispatch::DispatchedModel* dispatched) override {
    if (input_ids.dim() != 2 || positions.sizes() != input_ids.sizes()) {
      return absl::InvalidArgumentError("input_ids and positions must both be [batch, tokens]");
    }
    const at::Device home = input_ids.device();
    const size_t n = model->layers.size();
    if (cache != nullptr && cache->keys.size() != n) {
      cache->keys.assign(n, at::Tensor());
      cache->values.assign(n, at::Tensor());
    }
    ACCEL_ASSIGN_OR_RETURN(
        at::Tensor x, InScope(dispatched, "model.embed_tokens", home, [&](const at::Device& d) {
          return model->embed_tokens->forward(input_ids.to(d));
        }));
    at::Tensor cos, sin;
    ACCEL_RETURN_IF_ERROR(InScope(dispatched, "model.rotary_emb", home, [&](const at::Device& d) {
                            std::tie(cos, sin) =
                                model->rotary_emb->forward(positions.to(d), dtype_);
                            return cos;
                          }).status());
    for (size_t i = 0; i < n; ++i) {
      ACCEL_ASSIGN_OR_RETURN(
          x, InScope(dispatched, absl::StrCat("model.layers.", i), home, [&](const at::Device& d) {
            return model->layers[i]->forward(x.to(d), cos.to(d), sin.to(d),
                                             cache ? &cache->keys[i] : nullptr,
                                             cache ? &cache->values[i] : nullptr);
          }));
    }
    ACCEL_ASSIGN_OR_RETURN(x, InScope(dispatched, "model.norm", home, [&](const at::Device& d) {
                             return model->norm->forward(x.to(d));
                           }));
    ACCEL_ASSIGN_OR_RETURN(x, InScope(dispatched, "lm_head", home, [&](const at::Device& d) {
                             return lm_head->forward(x.to(d));
                           }));
    return x.to(home, at::kFloat);
  }

  std::shared_ptr<DecoderModel> model;
  std::shared_ptr<nn::Linear> lm_head;

 private:
  at::ScalarType dtype_;
};

// GPT-2: learned positions, LayerNorm, Conv1D projections, gelu_new, a tied head.
class Gpt2Attention : public dispatch::Layer {
 public:
  Gpt2Attention(int64_t hidden, int64_t heads, at::ScalarType dtype)
      : dispatch::Layer("GPT2Attention"), hidden_(hidden), heads_(heads) {
    c_attn = register_module("c_attn", std::make_shared<nn::Conv1D>(hidden, 3 * hidden, dtype));
    c_proj = register_module("c_proj", std::make_shared<nn::Conv1D>(hidden, hidden, dtype));
    register_module("attn_dropout", std::make_shared<dispatch::Layer>("Dropout"));
    register_module("resid_dropout", std::make_shared<dispatch::Layer>("Dropout"));
  }
  at::Tensor forward(const at::Tensor& x, at::Tensor* k_cache, at::Tensor* v_cache) {
    const int64_t b = x.size(0), t = x.size(1), d = hidden_ / heads_;
    std::vector<at::Tensor> qkv = c_attn->forward(x).split(hidden_, -1);
    at::Tensor q = qkv[0].view({b, t, heads_, d}).transpose(1, 2);
    at::Tensor k = qkv[1].view({b, t, heads_, d}).transpose(1, 2);
    at::Tensor v = qkv[2].view({b, t, heads_, d}).transpose(1, 2);
    if (k_cache != nullptr) {
      if (k_cache->defined()) {
        k = at::cat({*k_cache, k}, 2);
        v = at::cat({*v_cache, v}, 2);
      }
      *k_cache = k;
      *v_cache = v;
    }
    const int64_t total = k.size(2), past = total - t;
    at::Tensor scores = at::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(d));
    at::Tensor query_pos = at::arange(past, total, x.options().dtype(at::kLong)).unsqueeze(1);
    at::Tensor key_pos = at::arange(0, total, x.options().dtype(at::kLong)).unsqueeze(0);
    scores = scores.masked_fill(key_pos > query_pos, -std::numeric_limits<float>::infinity());
    at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
    return c_proj->forward(at::matmul(probs, v).transpose(1, 2).reshape({b, t, hidden_}));
  }
  std::shared_ptr<nn::Conv1D> c_attn, c_proj;

 private:
  int64_t hidden_, heads_;
};

// transformers' NewGELUActivation ("gelu_new"): the tanh approximation.
at::Tensor GeluNew(const at::Tensor& x) {
  return 0.5 * x * (1.0 + at::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * at::pow(x, 3.0))));
}

class Gpt2Block : public dispatch::Layer {
 public:
  Gpt2Block(const loader::ModelConfig& c, at::ScalarType dtype) : dispatch::Layer("GPT2Block") {
    ln_1 =
        register_module("ln_1", std::make_shared<nn::LayerNorm>(c.hidden_size, c.norm_eps, dtype));
    attn = register_module(
        "attn", std::make_shared<Gpt2Attention>(c.hidden_size, c.num_attention_heads, dtype));
    ln_2 =
        register_module("ln_2", std::make_shared<nn::LayerNorm>(c.hidden_size, c.norm_eps, dtype));
    auto mlp = register_module("mlp", std::make_shared<dispatch::Layer>("GPT2MLP"));
    c_fc = mlp->register_module(
        "c_fc", std::make_shared<nn::Conv1D>(c.hidden_size, c.intermediate_size, dtype));
    c_proj = mlp->register_module(
        "c_proj", std::make_shared<nn::Conv1D>(c.intermediate_size, c.hidden_size, dtype));
    mlp->register_module("act", std::make_shared<dispatch::Layer>("NewGELUActivation"));
    mlp->register_module("dropout", std::make_shared<dispatch::Layer>("Dropout"));
  }
  at::Tensor forward(at::Tensor x, at::Tensor* k_cache, at::Tensor* v_cache) {
    x = x + attn->forward(ln_1->forward(x), k_cache, v_cache);
    return x + c_proj->forward(GeluNew(c_fc->forward(ln_2->forward(x))));
  }
  std::shared_ptr<nn::LayerNorm> ln_1, ln_2;
  std::shared_ptr<Gpt2Attention> attn;
  std::shared_ptr<nn::Conv1D> c_fc, c_proj;
};

class Gpt2LM : public CausalLM {
 public:
  Gpt2LM(const loader::ModelConfig& c, at::ScalarType dtype) : CausalLM("GPT2LMHeadModel") {
    transformer = register_module("transformer", std::make_shared<dispatch::Layer>("GPT2Model"));
    wte = transformer->register_module(
        "wte", std::make_shared<nn::Embedding>(c.vocab_size, c.hidden_size, dtype));
    wpe = transformer->register_module(
        "wpe", std::make_shared<nn::Embedding>(c.max_position_embeddings, c.hidden_size, dtype));
    transformer->register_module("drop", std::make_shared<dispatch::Layer>("Dropout"));
    auto list = transformer->register_module("h", std::make_shared<dispatch::Layer>("ModuleList"));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      blocks.push_back(
          list->register_module(absl::StrCat(i), std::make_shared<Gpt2Block>(c, dtype)));
    }
    ln_f = transformer->register_module(
        "ln_f", std::make_shared<nn::LayerNorm>(c.hidden_size, c.norm_eps, dtype));
    at::Tensor shared = c.tie_word_embeddings ? wte->weight : at::Tensor();
    lm_head = register_module(
        "lm_head", std::make_shared<nn::Linear>(c.hidden_size, c.vocab_size, false, dtype, shared));
    max_positions_ = c.max_position_embeddings;
  }

  absl::StatusOr<at::Tensor> Forward(const at::Tensor& input_ids, const at::Tensor& positions,
                                     KvCache* cache,
                                     dispatch::DispatchedModel* dispatched) override {
    if (input_ids.dim() != 2 || positions.sizes() != input_ids.sizes()) {
      return absl::InvalidArgumentError("input_ids and positions must both be [batch, tokens]");
    }
    if (positions.numel() > 0 && positions.max().item<int64_t>() >= max_positions_) {
      return absl::InvalidArgumentError(absl::StrCat("position ", positions.max().item<int64_t>(),
                                                     " is past GPT-2's ", max_positions_,
                                                     " positions"));
    }
    const at::Device home = input_ids.device();
    const size_t n = blocks.size();
    if (cache != nullptr && cache->keys.size() != n) {
      cache->keys.assign(n, at::Tensor());
      cache->values.assign(n, at::Tensor());
    }
    ACCEL_ASSIGN_OR_RETURN(
        at::Tensor x, InScope(dispatched, "transformer.wte", home,
                              [&](const at::Device& d) { return wte->forward(input_ids.to(d)); }));
    ACCEL_ASSIGN_OR_RETURN(
        x, InScope(dispatched, "transformer.wpe", home,
                   [&](const at::Device& d) { return x.to(d) + wpe->forward(positions.to(d)); }));
    for (size_t i = 0; i < n; ++i) {
      ACCEL_ASSIGN_OR_RETURN(
          x, InScope(dispatched, absl::StrCat("transformer.h.", i), home, [&](const at::Device& d) {
            return blocks[i]->forward(x.to(d), cache ? &cache->keys[i] : nullptr,
                                      cache ? &cache->values[i] : nullptr);
          }));
    }
    ACCEL_ASSIGN_OR_RETURN(x, InScope(dispatched, "transformer.ln_f", home,
                                      [&](const at::Device& d) { return ln_f->forward(x.to(d)); }));
    ACCEL_ASSIGN_OR_RETURN(x, InScope(dispatched, "lm_head", home, [&](const at::Device& d) {
                             return lm_head->forward(x.to(d));
                           }));
    return x.to(home, at::kFloat);
  }

  std::shared_ptr<dispatch::Layer> transformer;
  std::shared_ptr<nn::Embedding> wte, wpe;
  std::vector<std::shared_ptr<Gpt2Block>> blocks;
  std::shared_ptr<nn::LayerNorm> ln_f;
  std::shared_ptr<nn::Linear> lm_head;

 private:
  int64_t max_positions_ = 0;
};

}  // namespace

absl::StatusOr<std::shared_ptr<CausalLM>> BuildCausalLM(const loader::ModelConfig& c,
                                                        at::ScalarType dtype) {
  ACCEL_RETURN_IF_ERROR(c.Validate());
  ACCEL_ASSIGN_OR_RETURN(Family family, FamilyOf(c));
  const std::string type = family.model_type;
  if (type == "gpt2") {
    std::shared_ptr<CausalLM> model;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { model = std::make_shared<Gpt2LM>(c, dtype); }));
    return model;
  }
  const std::string prefix = type == "llama" ? "Llama" : type == "mistral" ? "Mistral" : "Qwen2";
  Sizes s{c.hidden_size, c.num_attention_heads, c.kv_heads(),
          c.head_size(), c.intermediate_size,   std::nullopt};
  if (type == "mistral") s.window = c.sliding_window;
  const bool qkv_bias = type == "qwen2" || c.attention_bias;
  const bool o_bias = type != "qwen2" && c.attention_bias;
  ACCEL_ASSIGN_OR_RETURN(
      auto rotary, nn::RotaryEmbedding::Create(prefix + "RotaryEmbedding", s.head_dim, c.rope_theta,
                                               c.rope_scaling));
  std::shared_ptr<CausalLM> model;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    model = std::make_shared<LlamaFamilyLM>(family, prefix, c, s, qkv_bias, o_bias,
                                            std::move(rotary), dtype);
  }));
  return model;
}

}  // namespace accel::models
