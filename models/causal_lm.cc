// The Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM):
// one implementation, with transformers' module layout and arithmetic
// (eager attention with the softmax in float32, rotate-half rotary, GQA by
// repeating key/value heads); and GPT2LMHeadModel.
#include "models/causal_lm.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

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

// Writes this step's keys and values [kv_heads, n, head_dim] after the
// cache's `length` tokens in layer `layer`'s buffers (growing them by
// doubling) and returns views of everything so far, [kv_heads, length + n,
// head_dim]. `length` itself is advanced by Forward() once every layer ran.
std::pair<at::Tensor, at::Tensor> AppendToCache(KvCache* cache, size_t layer, const at::Tensor& k,
                                                const at::Tensor& v) {
  at::Tensor& key_buffer = cache->keys[layer];
  at::Tensor& value_buffer = cache->values[layer];
  const int64_t past = cache->length, n = k.size(1), needed = past + n;
  if (!key_buffer.defined() || key_buffer.size(1) < needed || key_buffer.device() != k.device() ||
      key_buffer.scalar_type() != k.scalar_type()) {
    const int64_t old = key_buffer.defined() ? key_buffer.size(1) : 0;
    const int64_t capacity = std::max<int64_t>({needed, 2 * old, 16});
    at::Tensor keys = at::empty({k.size(0), capacity, k.size(2)}, k.options());
    at::Tensor values = at::empty({v.size(0), capacity, v.size(2)}, v.options());
    if (past > 0) {
      keys.narrow(1, 0, past).copy_(key_buffer.narrow(1, 0, past));
      values.narrow(1, 0, past).copy_(value_buffer.narrow(1, 0, past));
    }
    key_buffer = keys;
    value_buffer = values;
  }
  key_buffer.narrow(1, past, n).copy_(k);
  value_buffer.narrow(1, past, n).copy_(v);
  return {key_buffer.narrow(1, 0, needed), value_buffer.narrow(1, 0, needed)};
}

// Causal attention of each chunk's queries over its cache and its own keys.
// q [heads, total, d] and k, v [kv_heads, total, d] hold the packed tokens;
// returns [total, heads * d]. Query heads share key/value heads in groups
// (GQA) by viewing q as [kv_heads, group * n, d]: no copy of the cache.
// `scale` turns q.k into scores exactly as the family's transformers code
// does (a multiply or a divide: the last bit differs).
template <typename Scale>
at::Tensor AttendPacked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        absl::Span<const SequenceChunk> chunks, size_t layer,
                        std::optional<int64_t> window, const Scale& scale) {
  const int64_t heads = q.size(0), kv_heads = k.size(0), d = q.size(2);
  const int64_t group = heads / kv_heads;
  std::vector<at::Tensor> outs;
  outs.reserve(chunks.size());
  int64_t offset = 0;
  for (const SequenceChunk& chunk : chunks) {
    const int64_t n = chunk.tokens;
    at::Tensor keys = k.narrow(1, offset, n), values = v.narrow(1, offset, n);
    int64_t past = 0;
    if (chunk.cache != nullptr) {
      past = chunk.cache->length;
      std::tie(keys, values) = AppendToCache(chunk.cache, layer, keys, values);
    }
    const int64_t total = past + n;
    at::Tensor queries = q.narrow(1, offset, n).reshape({kv_heads, group * n, d});
    at::Tensor scores =
        scale(nn::MatMul(queries, keys.transpose(1, 2))).view({kv_heads, group, n, total});
    // Query i (at position past + i) sees key j when j <= past + i and, with
    // a sliding window, past + i - j < window. A lone query without a window
    // sees everything.
    if (n > 1 || (window && total > *window)) {
      at::Tensor query_pos = at::arange(past, total, q.options().dtype(at::kLong)).unsqueeze(1);
      at::Tensor key_pos = at::arange(0, total, q.options().dtype(at::kLong)).unsqueeze(0);
      at::Tensor allowed = key_pos <= query_pos;
      if (window) allowed = allowed.logical_and(query_pos - key_pos < *window);
      scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity());
    }
    at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
    at::Tensor out = nn::MatMul(probs.view({kv_heads, group * n, total}), values);
    outs.push_back(out.view({heads, n, d}).transpose(0, 1).reshape({n, heads * d}));
    offset += n;
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
}

// Checks the chunks against the ids, prepares the caches, and returns the
// positions [1, total] (int64, cpu).
absl::StatusOr<at::Tensor> PreparePositions(const at::Tensor& input_ids,
                                            absl::Span<const SequenceChunk> chunks,
                                            const loader::ModelConfig& config, size_t layers) {
  if (input_ids.dim() != 1 || input_ids.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError("input_ids must be one int64 row of packed tokens");
  }
  if (chunks.empty()) return absl::InvalidArgumentError("no sequences in the batch");
  int64_t total = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const SequenceChunk& chunk = chunks[i];
    if (chunk.tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", i, " has ", chunk.tokens, " tokens; each needs at least 1"));
    }
    total += chunk.tokens;
    if (chunk.cache == nullptr) continue;
    for (size_t j = 0; j < i; ++j) {
      if (chunks[j].cache == chunk.cache) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequences ", j, " and ", i, " share one KV cache"));
      }
    }
    if (chunk.cache->length > 0 && chunk.cache->keys.size() != layers) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, "'s KV cache has ",
                                                     chunk.cache->keys.size(),
                                                     " layers but the model has ", layers));
    }
    if (chunk.cache->length < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", i, "'s KV cache has length ", chunk.cache->length));
    }
  }
  if (total != input_ids.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the sequences have ", total, " tokens in all but input_ids has ", input_ids.numel()));
  }
  at::Tensor positions = at::empty({1, total}, at::kLong);
  int64_t* out = positions.data_ptr<int64_t>();
  for (const SequenceChunk& chunk : chunks) {
    const int64_t first = chunk.cache != nullptr ? chunk.cache->length : 0;
    for (int64_t t = 0; t < chunk.tokens; ++t) *out++ = first + t;
  }
  int64_t low = 0, high = 0;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    low = input_ids.min().item<int64_t>();
    high = input_ids.max().item<int64_t>();
  }));
  if (low < 0 || high >= config.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("token id ", low < 0 ? low : high,
                                                   " is outside the vocabulary [0, ",
                                                   config.vocab_size, ")"));
  }
  for (const SequenceChunk& chunk : chunks) {
    if (chunk.cache != nullptr && chunk.cache->keys.size() != layers) {
      chunk.cache->keys.assign(layers, at::Tensor());
      chunk.cache->values.assign(layers, at::Tensor());
    }
  }
  return positions;
}

// Each chunk's last token, as indices into the packed tokens.
at::Tensor LastTokens(absl::Span<const SequenceChunk> chunks) {
  std::vector<int64_t> last;
  int64_t offset = 0;
  for (const SequenceChunk& chunk : chunks) last.push_back((offset += chunk.tokens) - 1);
  return at::tensor(last, at::kLong);
}

void AdvanceCaches(absl::Span<const SequenceChunk> chunks) {
  for (const SequenceChunk& chunk : chunks) {
    if (chunk.cache != nullptr) chunk.cache->length += chunk.tokens;
  }
}

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

  // x [1, total, hidden]: the packed tokens of `chunks`.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     absl::Span<const SequenceChunk> chunks, size_t layer) {
    const int64_t t = x.size(1);
    at::Tensor q = q_proj->forward(x).view({1, t, s_.heads, s_.head_dim}).transpose(1, 2);
    at::Tensor k = k_proj->forward(x).view({1, t, s_.kv_heads, s_.head_dim}).transpose(1, 2);
    at::Tensor v = v_proj->forward(x).view({1, t, s_.kv_heads, s_.head_dim}).transpose(1, 2);
    q = nn::ApplyRotary(q, cos, sin);
    k = nn::ApplyRotary(k, cos, sin);
    const double scaling = 1.0 / std::sqrt(static_cast<double>(s_.head_dim));
    at::Tensor out = AttendPacked(q[0], k[0], v[0], chunks, layer, s_.window,
                                  [&](const at::Tensor& scores) { return scores * scaling; });
    return o_proj->forward(out.unsqueeze(0));
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
    return down_proj->forward(nn::Silu(gate_proj->forward(x)) * up_proj->forward(x));
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
                     absl::Span<const SequenceChunk> chunks, size_t layer) {
    x = x + self_attn->forward(input_layernorm->forward(x), cos, sin, chunks, layer);
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
      : CausalLM(family.architecture, c, dtype) {
    model = register_module("model", std::make_shared<DecoderModel>(prefix, c, s, qkv_bias, o_bias,
                                                                    std::move(rotary), dtype));
    at::Tensor shared = c.tie_word_embeddings ? model->embed_tokens->weight : at::Tensor();
    lm_head = register_module(
        "lm_head", std::make_shared<nn::Linear>(s.hidden, c.vocab_size, false, dtype, shared));
  }

  absl::StatusOr<at::Tensor> Forward(const at::Tensor& input_ids,
                                     absl::Span<const SequenceChunk> chunks, Logits which,
                                     dispatch::DispatchedModel* dispatched) override {
    const size_t n = model->layers.size();
    ACCEL_ASSIGN_OR_RETURN(at::Tensor positions, PreparePositions(input_ids, chunks, config(), n));
    const at::Device home = input_ids.device();
    ACCEL_ASSIGN_OR_RETURN(
        at::Tensor x, InScope(dispatched, "model.embed_tokens", home, [&](const at::Device& d) {
          return model->embed_tokens->forward(input_ids.to(d).unsqueeze(0));
        }));
    at::Tensor cos, sin;
    ACCEL_RETURN_IF_ERROR(InScope(dispatched, "model.rotary_emb", home, [&](const at::Device& d) {
                            std::tie(cos, sin) =
                                model->rotary_emb->forward(positions.to(d), dtype());
                            return cos;
                          }).status());
    for (size_t i = 0; i < n; ++i) {
      ACCEL_ASSIGN_OR_RETURN(
          x, InScope(dispatched, absl::StrCat("model.layers.", i), home, [&](const at::Device& d) {
            return model->layers[i]->forward(x.to(d), cos.to(d), sin.to(d), chunks, i);
          }));
    }
    if (which == Logits::kLastOfEach) {
      ACCEL_RETURN_IF_ERROR(
          CallTorch([&] { x = x.index_select(1, LastTokens(chunks).to(x.device())); }));
    }
    ACCEL_ASSIGN_OR_RETURN(x, InScope(dispatched, "model.norm", home, [&](const at::Device& d) {
                             return model->norm->forward(x.to(d));
                           }));
    ACCEL_ASSIGN_OR_RETURN(x, InScope(dispatched, "lm_head", home, [&](const at::Device& d) {
                             return lm_head->forward(x.to(d));
                           }));
    AdvanceCaches(chunks);
    return x[0].to(home, at::kFloat);
  }

  std::shared_ptr<DecoderModel> model;
  std::shared_ptr<nn::Linear> lm_head;
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
  at::Tensor forward(const at::Tensor& x, absl::Span<const SequenceChunk> chunks, size_t layer) {
    const int64_t t = x.size(1), d = hidden_ / heads_;
    std::vector<at::Tensor> qkv = c_attn->forward(x)[0].split(hidden_, -1);
    at::Tensor q = qkv[0].view({t, heads_, d}).transpose(0, 1);
    at::Tensor k = qkv[1].view({t, heads_, d}).transpose(0, 1);
    at::Tensor v = qkv[2].view({t, heads_, d}).transpose(0, 1);
    const double divisor = std::sqrt(static_cast<double>(d));
    at::Tensor out = AttendPacked(q, k, v, chunks, layer, std::nullopt,
                                  [&](const at::Tensor& scores) { return scores / divisor; });
    return c_proj->forward(out.unsqueeze(0));
  }
  std::shared_ptr<nn::Conv1D> c_attn, c_proj;

 private:
  int64_t hidden_, heads_;
};

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
  at::Tensor forward(at::Tensor x, absl::Span<const SequenceChunk> chunks, size_t layer) {
    x = x + attn->forward(ln_1->forward(x), chunks, layer);
    return x + c_proj->forward(nn::GeluNew(c_fc->forward(ln_2->forward(x))));
  }
  std::shared_ptr<nn::LayerNorm> ln_1, ln_2;
  std::shared_ptr<Gpt2Attention> attn;
  std::shared_ptr<nn::Conv1D> c_fc, c_proj;
};

class Gpt2LM : public CausalLM {
 public:
  Gpt2LM(const loader::ModelConfig& c, at::ScalarType dtype)
      : CausalLM("GPT2LMHeadModel", c, dtype) {
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
  }

  absl::StatusOr<at::Tensor> Forward(const at::Tensor& input_ids,
                                     absl::Span<const SequenceChunk> chunks, Logits which,
                                     dispatch::DispatchedModel* dispatched) override {
    const size_t n = blocks.size();
    ACCEL_ASSIGN_OR_RETURN(at::Tensor positions, PreparePositions(input_ids, chunks, config(), n));
    const int64_t limit = config().max_position_embeddings;
    if (const int64_t last = positions.max().item<int64_t>(); last >= limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("position ", last, " is past GPT-2's ", limit, " positions"));
    }
    const at::Device home = input_ids.device();
    ACCEL_ASSIGN_OR_RETURN(at::Tensor x,
                           InScope(dispatched, "transformer.wte", home, [&](const at::Device& d) {
                             return wte->forward(input_ids.to(d).unsqueeze(0));
                           }));
    ACCEL_ASSIGN_OR_RETURN(
        x, InScope(dispatched, "transformer.wpe", home,
                   [&](const at::Device& d) { return x.to(d) + wpe->forward(positions.to(d)); }));
    for (size_t i = 0; i < n; ++i) {
      ACCEL_ASSIGN_OR_RETURN(
          x, InScope(dispatched, absl::StrCat("transformer.h.", i), home,
                     [&](const at::Device& d) { return blocks[i]->forward(x.to(d), chunks, i); }));
    }
    if (which == Logits::kLastOfEach) {
      ACCEL_RETURN_IF_ERROR(
          CallTorch([&] { x = x.index_select(1, LastTokens(chunks).to(x.device())); }));
    }
    ACCEL_ASSIGN_OR_RETURN(x, InScope(dispatched, "transformer.ln_f", home,
                                      [&](const at::Device& d) { return ln_f->forward(x.to(d)); }));
    ACCEL_ASSIGN_OR_RETURN(x, InScope(dispatched, "lm_head", home, [&](const at::Device& d) {
                             return lm_head->forward(x.to(d));
                           }));
    AdvanceCaches(chunks);
    return x[0].to(home, at::kFloat);
  }

  std::shared_ptr<dispatch::Layer> transformer;
  std::shared_ptr<nn::Embedding> wte, wpe;
  std::vector<std::shared_ptr<Gpt2Block>> blocks;
  std::shared_ptr<nn::LayerNorm> ln_f;
  std::shared_ptr<nn::Linear> lm_head;
};

}  // namespace

int64_t KvCache::bytes() const {
  int64_t total = 0;
  for (const std::vector<at::Tensor>* buffers : {&keys, &values}) {
    for (const at::Tensor& buffer : *buffers) {
      if (buffer.defined()) total += static_cast<int64_t>(buffer.nbytes());
    }
  }
  return total;
}

void KvCache::Clear() {
  keys.clear();
  values.clear();
  length = 0;
}

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
