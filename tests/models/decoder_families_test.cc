// The decoder families (Mixtral, Qwen3, Qwen3-MoE, Qwen2-MoE, Gemma 2,
// Gemma 3, Phi-3, and the Llama family they grew from) against a
// straightforward reference written here from the checkpoint's raw tensors
// and transformers' formulas: double precision, eager, one sequence at a
// time, no cache (every greedy step recomputes the whole sequence), loops
// over heads, tokens and experts. Then: packed batches change nothing,
// experts on disk (fetched one by one through the expert cache, or with
// their block) change nothing, quantized experts follow the reference run on
// the dequantized weights, and malformed configs and checkpoints are clear
// errors.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "dispatch/empty_weights.h"
#include "loader/config.h"
#include "loader/loader.h"
#include "models/causal_lm.h"
#include "models/families.h"
#include "models/internal/decoder_lm.h"
#include "models/internal/packed.h"
#include "models/load_model.h"
#include "models/make_model.h"
#include "models/nn.h"
#include "quant/bnb.h"
#include "quant/cuda_matmul.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::models {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

// ---- the reference ------------------------------------------------------------

struct Reference {
  const loader::Checkpoint& ckpt;
  const loader::ModelConfig& c;
  // Dequantized weights of quantized layers, by tensor name ("<layer>.weight").
  std::map<std::string, at::Tensor> dequantized;

  const std::string& type() const { return c.model_type; }
  bool Gemma() const { return type() == "gemma2" || type() == "gemma3_text"; }
  bool Moe() const { return type() == "mixtral" || type() == "qwen3_moe" || type() == "qwen2_moe"; }

  at::Tensor W(const std::string& name) const {
    auto it = dequantized.find(name);
    if (it != dequantized.end()) return it->second;
    return ckpt.Tensor(name)->to(at::kDouble);
  }
  bool Has(const std::string& name) const { return ckpt.Find(name) != nullptr; }

  // Over the last dimension; Gemma scales by (1 + w).
  at::Tensor Norm(const at::Tensor& x, const std::string& weight) const {
    at::Tensor n = x / at::sqrt(x.pow(2).mean({-1}, true) + c.norm_eps);
    return Gemma() ? n * (1 + W(weight)) : n * W(weight);
  }
  at::Tensor Proj(const at::Tensor& x, const std::string& name) const {
    at::Tensor y = at::matmul(x, W(name + ".weight").t());
    return Has(name + ".bias") ? y + W(name + ".bias") : y;
  }
  at::Tensor Act(const at::Tensor& x) const {
    if (Gemma()) return 0.5 * x * (1 + at::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x.pow(3))));
    return x * at::sigmoid(x);
  }
  // down(act(gate(x)) * up(x)).
  at::Tensor Gated(const at::Tensor& x, const std::string& gate, const std::string& up,
                   const std::string& down) const {
    return Proj(Act(Proj(x, gate)) * Proj(x, up), down);
  }

  int64_t HeadDim() const { return c.head_size(); }
  int64_t RotaryDim() const {
    return static_cast<int64_t>(static_cast<double>(HeadDim()) *
                                c.partial_rotary_factor.value_or(1.0));
  }
  bool LongRope() const { return c.rope_scaling && c.rope_scaling->rope_type == "longrope"; }

  bool Sliding(int64_t layer) const {
    if (!c.sliding_window) return false;
    if (type() == "gemma2") return layer % 2 == 0;
    if (type() == "gemma3_text") return (layer + 1) % c.sliding_window_pattern.value_or(6) != 0;
    return type() == "mistral" || type() == "mixtral" || type() == "phi3";
  }
  bool Sparse(int64_t layer) const {
    if (type() == "mixtral") return true;
    if (!Moe()) return false;
    const auto& dense = c.moe.mlp_only_layers;
    return std::find(dense.begin(), dense.end(), layer) == dense.end() &&
           (layer + 1) % c.moe.decoder_sparse_step.value_or(1) == 0;
  }

  // Rotates pairs (i, i + dim/2) of the first `dim` channels of each row t
  // of x [T, head_dim] by t x frequency i; the rest pass.
  at::Tensor Rotate(const at::Tensor& x, const std::vector<double>& freq, double scale) const {
    at::Tensor out = x.clone();
    const int64_t dim = RotaryDim(), half = dim / 2;
    auto a = x.accessor<double, 2>();
    auto o = out.accessor<double, 2>();
    for (int64_t t = 0; t < x.size(0); ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(t) * freq[i];
        const double cs = std::cos(angle) * scale, sn = std::sin(angle) * scale;
        o[t][i] = a[t][i] * cs - a[t][i + half] * sn;
        o[t][i + half] = a[t][i + half] * cs + a[t][i] * sn;
      }
    }
    return out;
  }
  // The frequencies of a layer for a sequence of `length` tokens.
  std::vector<double> Frequencies(bool sliding, int64_t length) const {
    const int64_t dim = RotaryDim();
    const bool local = type() == "gemma3_text" && sliding;
    const double theta = local ? *c.rope_local_base_freq : c.rope_theta;
    std::vector<double> freq;
    for (int64_t i = 0; i < dim / 2; ++i) {
      double f = std::pow(theta, -2.0 * i / dim);
      if (!local && c.rope_scaling && c.rope_scaling->rope_type == "linear") {
        f /= c.rope_scaling->numbers.at("factor");
      }
      if (LongRope()) {
        const bool use_long = length > *c.original_max_position_embeddings;
        f /= c.rope_scaling->lists.at(use_long ? "long_factor" : "short_factor")[i];
      }
      freq.push_back(f);
    }
    return freq;
  }
  double RopeScale() const {
    if (!LongRope()) return 1.0;
    const double s = static_cast<double>(c.max_position_embeddings) /
                     static_cast<double>(*c.original_max_position_embeddings);
    return s <= 1 ? 1.0
                  : std::sqrt(1 + std::log(s) / std::log(static_cast<double>(
                                                    *c.original_max_position_embeddings)));
  }

  at::Tensor Attention(const at::Tensor& h, int64_t layer) const {
    const std::string p = absl::StrCat("model.layers.", layer, ".self_attn.");
    const int64_t T = h.size(0), d = HeadDim(), heads = c.num_attention_heads;
    const int64_t group = heads / c.kv_heads();
    at::Tensor q, k, v;
    if (type() == "phi3") {
      at::Tensor qkv = Proj(h, p + "qkv_proj");
      q = qkv.narrow(1, 0, heads * d);
      k = qkv.narrow(1, heads * d, c.kv_heads() * d);
      v = qkv.narrow(1, (heads + c.kv_heads()) * d, c.kv_heads() * d);
    } else {
      q = Proj(h, p + "q_proj");
      k = Proj(h, p + "k_proj");
      v = Proj(h, p + "v_proj");
    }
    const bool sliding = Sliding(layer);
    const std::vector<double> freq = Frequencies(sliding, T);
    const double scale = c.query_pre_attn_scalar ? std::pow(*c.query_pre_attn_scalar, -0.5)
                                                 : 1 / std::sqrt(static_cast<double>(d));
    at::Tensor out = at::zeros({T, heads * d}, at::kDouble);
    for (int64_t hh = 0; hh < heads; ++hh) {
      const int64_t kv = hh / group;
      at::Tensor qh = q.narrow(1, hh * d, d), kh = k.narrow(1, kv * d, d);
      const at::Tensor vh = v.narrow(1, kv * d, d);
      if (Has(p + "q_norm.weight")) {
        qh = Norm(qh, p + "q_norm.weight");
        kh = Norm(kh, p + "k_norm.weight");
      }
      qh = Rotate(qh.contiguous(), freq, RopeScale());
      kh = Rotate(kh.contiguous(), freq, RopeScale());
      for (int64_t t = 0; t < T; ++t) {
        const int64_t first = sliding ? std::max<int64_t>(0, t - *c.sliding_window + 1) : 0;
        std::vector<double> scores;
        for (int64_t s = first; s <= t; ++s) {
          double score = at::dot(qh[t], kh[s]).item<double>() * scale;
          if (type() == "gemma2" && c.attn_logit_softcapping) {
            score = std::tanh(score / *c.attn_logit_softcapping) * *c.attn_logit_softcapping;
          }
          scores.push_back(score);
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        double total = 0;
        for (double& s : scores) total += (s = std::exp(s - top));
        at::Tensor acc = at::zeros({d}, at::kDouble);
        for (int64_t s = first; s <= t; ++s) acc += scores[s - first] / total * vh[s];
        out[t].narrow(0, hh * d, d).copy_(acc);
      }
    }
    return Proj(out, p + "o_proj");
  }

  // One token's mixture of experts: its top k by router probability.
  at::Tensor Experts(const at::Tensor& x, int64_t layer) const {
    const std::string block = type() == "mixtral" ? "block_sparse_moe" : "mlp";
    const std::string p = absl::StrCat("model.layers.", layer, ".", block, ".");
    at::Tensor probs = at::softmax(Proj(x.unsqueeze(0), p + "gate")[0], 0);
    std::vector<int64_t> order(probs.size(0));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return probs[a].item<double>() > probs[b].item<double>();
    });
    const int64_t k = c.moe.num_experts_per_tok;
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += probs[order[j]].item<double>();
    const bool renormalise = type() == "mixtral" || c.moe.norm_topk_prob.value_or(false);
    at::Tensor y = at::zeros_like(x);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = order[j];
      double w = probs[e].item<double>();
      if (renormalise) w /= sum;
      const std::string ex = absl::StrCat(p, "experts.", e, ".");
      at::Tensor out = type() == "mixtral" ? Gated(x.unsqueeze(0), ex + "w1", ex + "w3", ex + "w2")
                                           : Gated(x.unsqueeze(0), ex + "gate_proj", ex + "up_proj",
                                                   ex + "down_proj");
      y += w * out[0];
    }
    if (type() == "qwen2_moe") {
      const std::string sh = p + "shared_expert.";
      at::Tensor shared =
          Gated(x.unsqueeze(0), sh + "gate_proj", sh + "up_proj", sh + "down_proj")[0];
      y += at::sigmoid(Proj(x.unsqueeze(0), p + "shared_expert_gate")[0]) * shared;
    }
    return y;
  }

  at::Tensor FeedForward(const at::Tensor& h, int64_t layer) const {
    const std::string p = absl::StrCat("model.layers.", layer, ".mlp.");
    if (Sparse(layer)) {
      std::vector<at::Tensor> rows;
      for (int64_t t = 0; t < h.size(0); ++t) rows.push_back(Experts(h[t], layer));
      return at::stack(rows);
    }
    if (type() == "phi3") {
      at::Tensor both = Proj(h, p + "gate_up_proj");
      const int64_t n = both.size(1) / 2;
      return Proj(both.narrow(1, n, n) * Act(both.narrow(1, 0, n)), p + "down_proj");
    }
    return Gated(h, p + "gate_proj", p + "up_proj", p + "down_proj");
  }

  at::Tensor Logits(const std::vector<int64_t>& ids) const {
    at::Tensor x = W("model.embed_tokens.weight").index_select(0, at::tensor(ids, at::kLong));
    if (Gemma()) x = x * std::sqrt(static_cast<double>(c.hidden_size));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string p = absl::StrCat("model.layers.", l, ".");
      at::Tensor a = Attention(Norm(x, p + "input_layernorm.weight"), l);
      if (Gemma()) {
        x = x + Norm(a, p + "post_attention_layernorm.weight");
        at::Tensor f = FeedForward(Norm(x, p + "pre_feedforward_layernorm.weight"), l);
        x = x + Norm(f, p + "post_feedforward_layernorm.weight");
      } else {
        x = x + a;
        x = x + FeedForward(Norm(x, p + "post_attention_layernorm.weight"), l);
      }
    }
    x = Norm(x, "model.norm.weight");
    const std::string head = Has("lm_head.weight") ? "lm_head.weight" : "model.embed_tokens.weight";
    at::Tensor logits = at::matmul(x, W(head).t());
    if (type() == "gemma2" && c.final_logit_softcapping) {
      logits = at::tanh(logits / *c.final_logit_softcapping) * *c.final_logit_softcapping;
    }
    return logits;
  }

  // Greedy decoding, recomputing the whole sequence at every step; each
  // step's logits in `logits` when given.
  std::vector<int64_t> Greedy(std::vector<int64_t> ids, int steps,
                              std::vector<at::Tensor>* logits = nullptr) const {
    std::vector<int64_t> out;
    for (int i = 0; i < steps; ++i) {
      const at::Tensor last = Logits(ids)[-1];
      if (logits != nullptr) logits->push_back(last.to(at::kFloat));
      const int64_t next = last.argmax().item<int64_t>();
      out.push_back(next);
      ids.push_back(next);
    }
    return out;
  }
};

// ---- the models under test ------------------------------------------------------

struct Case {
  const char* name;
  MakeModelOptions options;
};

MakeModelOptions Base(const char* family) {
  MakeModelOptions o;
  o.family = family;
  o.hidden_size = 32;
  o.num_heads = 4;
  o.num_kv_heads = 2;
  o.num_layers = 2;
  o.vocab_size = 300;
  o.max_position_embeddings = 64;
  return o;
}

// Every family, with what sets it apart switched on and small windows, so
// that a prompt of 10 tokens crosses them.
std::vector<Case> Cases() {
  std::vector<Case> cases;
  {
    MakeModelOptions o = Base("mixtral");
    o.sliding_window = 4;
    o.num_experts = 4;
    o.num_experts_per_tok = 2;
    cases.push_back({"mixtral", o});
  }
  {
    MakeModelOptions o = Base("qwen3");
    o.head_dim = 16;  // heads x head_dim != hidden, as Qwen3's explicit head_dim allows
    o.tie_word_embeddings = true;
    cases.push_back({"qwen3", o});
  }
  {
    MakeModelOptions o = Base("qwen3_moe");
    o.num_layers = 3;
    o.num_experts = 6;
    o.num_experts_per_tok = 3;
    o.moe_intermediate_size = 24;
    o.mlp_only_layers = {1};
    cases.push_back({"qwen3_moe", o});
  }
  {
    MakeModelOptions o = Base("qwen2_moe");
    o.num_experts = 4;
    o.num_experts_per_tok = 2;
    o.moe_intermediate_size = 24;
    o.shared_expert_intermediate_size = 40;
    o.decoder_sparse_step = 1;
    cases.push_back({"qwen2_moe", o});
  }
  {
    MakeModelOptions o = Base("gemma2");
    o.sliding_window = 4;
    o.tie_word_embeddings = true;
    cases.push_back({"gemma2", o});
  }
  {
    MakeModelOptions o = Base("gemma3_text");
    o.num_layers = 3;
    o.sliding_window = 4;
    o.sliding_window_pattern = 2;  // layers 0 and 2 slide with the local RoPE, 1 is global
    o.tie_word_embeddings = true;
    cases.push_back({"gemma3_text", o});
  }
  {
    MakeModelOptions o = Base("phi3");
    o.sliding_window = 5;
    o.max_position_embeddings = 48;
    o.longrope_factor = 4;  // original context 12: a prompt of 10 plus 6 tokens crosses it
    cases.push_back({"phi3", o});
  }
  {
    MakeModelOptions o = Base("phi3");
    o.partial_rotary_factor = 0.5;
    cases.push_back({"phi3_partial_rotary", o});
  }
  return cases;
}

const std::vector<int64_t> kPrompt = {5, 17, 299, 42, 42, 0, 7, 123, 64, 3};

struct Loaded {
  loader::ModelConfig config;
  std::shared_ptr<CausalLM> model;
  std::unique_ptr<dispatch::DispatchedModel> dispatched;
};

Loaded Load(const std::string& dir, const dispatch::DeviceMap& map,
            const dispatch::LoadOptions& extra = {}) {
  Loaded out;
  auto config = loader::ReadModelConfig(dir + "/config.json");
  EXPECT_THAT(config, IsOk());
  out.config = *config;
  {
    dispatch::EmptyWeightsGuard empty;
    auto model = BuildCausalLM(out.config, at::kFloat);
    EXPECT_THAT(model, IsOk());
    out.model = *model;
  }
  dispatch::LoadOptions options = extra;
  options.progress = Progress::Style::kSilent;
  auto dispatched = dispatch::DispatchedModel::Load(out.model, dir, map, options);
  EXPECT_THAT(dispatched, IsOk());
  if (dispatched.ok()) out.dispatched = *std::move(dispatched);
  return out;
}

dispatch::DeviceMap All(Placement p) {
  dispatch::DeviceMap map;
  map.Set("", p);
  return map;
}

at::Tensor Logits(CausalLM& model, dispatch::DispatchedModel* dispatched,
                  const std::vector<int64_t>& ids, KvCache* cache = nullptr) {
  c10::InferenceMode inference;
  const SequenceChunk chunk{cache, static_cast<int64_t>(ids.size())};
  auto logits = model.Forward(at::tensor(ids, at::kLong), {chunk}, Logits::kAll, dispatched);
  EXPECT_THAT(logits, IsOk());
  return logits.ok() ? *logits : at::zeros({static_cast<int64_t>(ids.size()), 1});
}

// Greedy decoding with the model's KV cache: the prompt once, then a token a step.
std::vector<int64_t> Greedy(CausalLM& model, dispatch::DispatchedModel* dispatched,
                            const std::vector<int64_t>& prompt, int steps,
                            std::vector<at::Tensor>* step_logits = nullptr) {
  KvCache cache;
  std::vector<int64_t> out;
  at::Tensor logits = Logits(model, dispatched, prompt, &cache);
  for (int i = 0; i < steps; ++i) {
    if (step_logits != nullptr) step_logits->push_back(logits[-1]);
    const int64_t next = logits[-1].argmax().item<int64_t>();
    out.push_back(next);
    if (i + 1 < steps) logits = Logits(model, dispatched, {next}, &cache);
  }
  return out;
}

double MaxDifference(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

class DecoderFamiliesTest : public ::testing::TestWithParam<Case> {};

TEST_P(DecoderFamiliesTest, LogitsAndGreedyTokensFollowTheReference) {
  const Case& c = GetParam();
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), c.options), IsOk());
  Loaded m = Load(dir.path(), All(Placement::Cpu()));
  ASSERT_NE(m.dispatched, nullptr);
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
  const Reference reference{ckpt, m.config, {}};

  at::Tensor logits = Logits(*m.model, m.dispatched.get(), kPrompt);
  at::Tensor expected = reference.Logits(kPrompt).to(at::kFloat);
  EXPECT_TRUE(at::allclose(logits, expected, /*rtol=*/1e-4, /*atol=*/1e-5))
      << "max difference " << MaxDifference(logits, expected);
  // The logits are not flat: a greedy pick means something.
  EXPECT_GT((std::get<0>(expected.max(1)) - std::get<0>(expected.min(1))).min().item<double>(),
            0.05);

  // Token by token through the KV cache, each step's logits as well as its
  // token (a LongRoPE model crosses its original context on the way).
  const int steps = 6;
  std::vector<at::Tensor> got_steps, want_steps;
  EXPECT_EQ(Greedy(*m.model, m.dispatched.get(), kPrompt, steps, &got_steps),
            reference.Greedy(kPrompt, steps, &want_steps));
  ASSERT_EQ(got_steps.size(), want_steps.size());
  for (size_t i = 0; i < got_steps.size(); ++i) {
    EXPECT_TRUE(at::allclose(got_steps[i], want_steps[i], 1e-4, 1e-5))
        << "step " << i << ": max difference " << MaxDifference(got_steps[i], want_steps[i]);
  }
}

// Sequences packed into one step give each sequence's own logits, in prefill
// and in the decode step after it.
TEST_P(DecoderFamiliesTest, APackedBatchEqualsEachSequenceAlone) {
  const Case& c = GetParam();
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), c.options), IsOk());
  Loaded m = Load(dir.path(), All(Placement::Cpu()));
  ASSERT_NE(m.dispatched, nullptr);
  const std::vector<std::vector<int64_t>> prompts = {kPrompt, {9, 8, 7}, {250, 1}};
  std::vector<at::Tensor> alone_prefill, alone_decode;
  for (const auto& p : prompts) {
    KvCache cache;
    alone_prefill.push_back(Logits(*m.model, m.dispatched.get(), p, &cache)[-1]);
    alone_decode.push_back(Logits(*m.model, m.dispatched.get(), {11}, &cache)[0]);
  }
  c10::InferenceMode inference;
  std::vector<KvCache> caches(prompts.size());
  std::vector<int64_t> packed;
  std::vector<SequenceChunk> chunks;
  for (size_t i = 0; i < prompts.size(); ++i) {
    packed.insert(packed.end(), prompts[i].begin(), prompts[i].end());
    chunks.push_back({&caches[i], static_cast<int64_t>(prompts[i].size())});
  }
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor prefill,
                             m.model->Forward(at::tensor(packed, at::kLong), chunks,
                                              Logits::kLastOfEach, m.dispatched.get()));
  for (auto& chunk : chunks) chunk.tokens = 1;
  ACCEL_ASSERT_OK_AND_ASSIGN(
      at::Tensor decode, m.model->Forward(at::tensor(std::vector<int64_t>{11, 11, 11}, at::kLong),
                                          chunks, Logits::kLastOfEach, m.dispatched.get()));
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_TRUE(at::allclose(prefill[i], alone_prefill[i], 1e-5, 1e-6)) << "sequence " << i;
    EXPECT_TRUE(at::allclose(decode[i], alone_decode[i], 1e-5, 1e-6)) << "sequence " << i;
  }
}

// A step that mixes prompt chunks and one-token decodes on paged caches, in
// any order, with the decodes planned once a step and attended as one batch
// through their tables (internal::StepDecodePlanScope, what a general step
// does on a CUDA device; asked for on the cpu here): the unplanned steps'
// logits bit for bit, over three steps (prompts alone; decodes around a new
// prompt and a prompt's second chunk; decodes alone, which read what the
// step before wrote into every cache).
TEST_P(DecoderFamiliesTest, PlannedDecodeRowsGiveTheUnplannedStepsLogits) {
  const Case& c = GetParam();
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), c.options), IsOk());
  Loaded m = Load(dir.path(), All(Placement::Cpu()));
  ASSERT_NE(m.dispatched, nullptr);
  c10::InferenceMode inference;
  const int64_t layers = m.config.num_hidden_layers, block_size = 4;
  struct Run {
    std::vector<at::Tensor> logits;
    int64_t planned = 0;  // layers attended through a plan
  };
  const auto run = [&](bool planned) {
    internal::PlanStepDecodesOnCpu(planned);
    const int64_t before = internal::PlannedDecodeAttentions();
    Run out;
    KvBlockStore store(48, block_size, static_cast<size_t>(layers));
    std::vector<KvCache> caches(5);
    for (size_t i = 0; i < caches.size(); ++i) {
      caches[i].store = &store;
      for (int32_t b = 0; b < 8; ++b) {  // blocks out of order, as after churn
        caches[i].block_table.push_back(static_cast<int32_t>(47 - (i * 8 + (b * 3) % 8)));
      }
    }
    // Each step: (cache, ids) in order.
    using Step = std::vector<std::pair<size_t, std::vector<int64_t>>>;
    const std::vector<Step> steps = {
        {{0, kPrompt}, {1, {9, 8, 7}}, {2, {250, 1, 4, 4, 31}}, {3, {60, 61, 62, 63, 64}}},
        {{0, {11}}, {4, {3, 1, 4, 1, 5, 9}}, {1, {12}}, {3, {65, 66, 67}}, {2, {13}}},
        {{2, {14}}, {4, {2}}, {0, {15}}, {3, {16}}, {1, {17}}},
    };
    for (const Step& step : steps) {
      std::vector<int64_t> ids;
      std::vector<SequenceChunk> chunks;
      for (const auto& [cache, tokens] : step) {
        ids.insert(ids.end(), tokens.begin(), tokens.end());
        chunks.push_back({&caches[cache], static_cast<int64_t>(tokens.size())});
      }
      auto logits = m.model->Forward(at::tensor(ids, at::kLong), chunks, Logits::kLastOfEach,
                                     m.dispatched.get());
      EXPECT_THAT(logits, IsOk());
      if (logits.ok()) out.logits.push_back(*logits);
    }
    out.planned = internal::PlannedDecodeAttentions() - before;
    internal::PlanStepDecodesOnCpu(false);
    return out;
  };
  const Run plain = run(false), planned = run(true);
  EXPECT_EQ(plain.planned, 0);
  // Steps 2 and 3 in every layer.
  EXPECT_EQ(planned.planned, 2 * layers);
  ASSERT_EQ(plain.logits.size(), 3u);
  ASSERT_EQ(planned.logits.size(), 3u);
  for (size_t s = 0; s < plain.logits.size(); ++s) {
    EXPECT_TRUE(at::equal(planned.logits[s], plain.logits[s]))
        << "step " << s << ": max difference " << MaxDifference(planned.logits[s], plain.logits[s]);
  }
}

// CausalLM::PackProjections (what a CUDA load does, here on the cpu): q, k
// and v (and each gate and up) become views of one tensor, in order, and the
// model still gives the reference's logits and greedy tokens.
TEST_P(DecoderFamiliesTest, PackedProjectionsGiveTheReferencesLogits) {
  const Case& c = GetParam();
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), c.options), IsOk());
  Loaded m = Load(dir.path(), All(Placement::Cpu()));
  ASSERT_NE(m.dispatched, nullptr);
  ASSERT_THAT(m.model->PackProjections(/*cuda_only=*/true), IsOk());  // the cpu: nothing
  ASSERT_THAT(m.model->PackProjections(/*cuda_only=*/false), IsOk());
  const auto params = m.model->named_parameters(/*recurse=*/true);
  const auto adjacent = [&](const std::vector<std::string>& names) {
    const at::Tensor* first = params.find(names[0]);
    if (first == nullptr) return false;
    int64_t next = first->storage_offset();
    for (const std::string& name : names) {
      const at::Tensor* t = params.find(name);
      if (t == nullptr || !t->storage().is_alias_of(first->storage()) ||
          t->storage_offset() != next) {
        return false;
      }
      next += t->numel();
    }
    return true;
  };
  const std::string attn = "model.layers.1.self_attn.";
  if (params.find(attn + "q_proj.weight") != nullptr) {
    EXPECT_TRUE(adjacent({attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"}));
    if (params.find(attn + "q_proj.bias") != nullptr) {
      EXPECT_TRUE(adjacent({attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"}));
    }
  }
  const std::string mlp = "model.layers.1.mlp.";
  if (params.find(mlp + "gate_proj.weight") != nullptr) {
    EXPECT_TRUE(adjacent({mlp + "gate_proj.weight", mlp + "up_proj.weight"}));
  }
  const std::string expert = "model.layers.1.block_sparse_moe.experts.1.";
  if (params.find(expert + "w1.weight") != nullptr) {
    EXPECT_TRUE(adjacent({expert + "w1.weight", expert + "w3.weight"}));
  }
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
  const Reference reference{ckpt, m.config, {}};
  at::Tensor logits = Logits(*m.model, m.dispatched.get(), kPrompt);
  at::Tensor expected = reference.Logits(kPrompt).to(at::kFloat);
  EXPECT_TRUE(at::allclose(logits, expected, /*rtol=*/1e-4, /*atol=*/1e-5))
      << "max difference " << MaxDifference(logits, expected);
  EXPECT_EQ(Greedy(*m.model, m.dispatched.get(), kPrompt, 6), reference.Greedy(kPrompt, 6));
}

INSTANTIATE_TEST_SUITE_P(Families, DecoderFamiliesTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- the module trees ------------------------------------------------------------

TEST(DecoderFamiliesTreeTest, ClassNamesAndOrderAreTransformers) {
  struct Expect {
    const char* family;
    const char* module;
    const char* cls;
  };
  const Expect expects[] = {
      {"mixtral", "model.layers.0", "MixtralDecoderLayer"},
      {"mixtral", "model.layers.0.block_sparse_moe", "MixtralSparseMoeBlock"},
      {"mixtral", "model.layers.0.block_sparse_moe.experts.3", "MixtralBlockSparseTop2MLP"},
      {"qwen3_moe", "model.layers.0.mlp", "Qwen3MoeSparseMoeBlock"},
      {"qwen3_moe", "model.layers.0.mlp.experts.0", "Qwen3MoeMLP"},
      {"qwen3_moe", "model.layers.0.self_attn.q_norm", "Qwen3MoeRMSNorm"},
      {"qwen2_moe", "model.layers.0.mlp.shared_expert", "Qwen2MoeMLP"},
      {"qwen2_moe", "model.layers.0.self_attn.rotary_emb", "Qwen2MoeRotaryEmbedding"},
      {"gemma2", "model.layers.1.pre_feedforward_layernorm", "Gemma2RMSNorm"},
      {"gemma2", "model.layers.1.mlp.act_fn", "PytorchGELUTanh"},
      {"gemma3_text", "model", "Gemma3TextModel"},
      {"gemma3_text", "model.embed_tokens", "Gemma3TextScaledWordEmbedding"},
      {"gemma3_text", "model.rotary_emb_local", "Gemma3RotaryEmbedding"},
      {"phi3", "model.layers.0.mlp.activation_fn", "SiLU"},
      {"phi3", "model.layers.0.resid_mlp_dropout", "Dropout"},
  };
  for (const Expect& e : expects) {
    MakeModelOptions o = Base(e.family);
    ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config, MakeModelConfig(o));
    ACCEL_ASSERT_OK_AND_ASSIGN(dispatch::ModuleTree tree, ModuleTreeFor(config, at::kFloat));
    ACCEL_ASSERT_OK_AND_ASSIGN(int node, tree.FindModule(e.module));
    EXPECT_EQ(tree.node(node).class_name, e.cls) << e.family << " " << e.module;
  }
  // Registration order: Mixtral's block before its norms; Phi-3's o_proj first.
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig mixtral, MakeModelConfig(Base("mixtral")));
  ACCEL_ASSERT_OK_AND_ASSIGN(dispatch::ModuleTree tree, ModuleTreeFor(mixtral, at::kFloat));
  std::vector<std::string> children;
  for (const auto& [name, id] : tree.node(*tree.FindModule("model.layers.0")).children)
    children.push_back(name);
  EXPECT_EQ(children, (std::vector<std::string>{"self_attn", "block_sparse_moe", "input_layernorm",
                                                "post_attention_layernorm"}));
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig phi3, MakeModelConfig(Base("phi3")));
  ACCEL_ASSERT_OK_AND_ASSIGN(tree, ModuleTreeFor(phi3, at::kFloat));
  children.clear();
  for (const auto& [name, id] : tree.node(*tree.FindModule("model.layers.0.self_attn")).children)
    children.push_back(name);
  EXPECT_EQ(children, (std::vector<std::string>{"o_proj", "qkv_proj"}));
  // Gemma 3's embed_scale is a buffer outside the state dict.
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig gemma3, MakeModelConfig(Base("gemma3_text")));
  ACCEL_ASSERT_OK_AND_ASSIGN(tree, ModuleTreeFor(gemma3, at::kBFloat16));
  const auto keys = tree.StateDictKeys();
  EXPECT_EQ(std::count(keys.begin(), keys.end(), "model.embed_tokens.embed_scale"), 0);
}

// ---- experts offloaded -------------------------------------------------------------

// Experts on disk, fetched one at a time through a cache smaller than one
// layer's experts (so it evicts), or with their block: the same logits and
// tokens as the model in RAM, and the counters say what was read.
TEST(DecoderFamiliesOffloadTest, ExpertsOnDiskGiveTheSameTokens) {
  for (const Case& c : Cases()) {
    ResolvedConfig resolved;
    {
      ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config, MakeModelConfig(c.options));
      ACCEL_ASSERT_OK_AND_ASSIGN(resolved, ResolveConfig(config));
    }
    const std::vector<std::string> lists = ExpertLists(resolved);
    if (lists.empty()) continue;
    SCOPED_TRACE(c.name);
    TempDir dir;
    ASSERT_THAT(MakeModel(dir.path(), c.options), IsOk());
    Loaded ram = Load(dir.path(), All(Placement::Cpu()));
    const at::Tensor want = Logits(*ram.model, ram.dispatched.get(), kPrompt);
    const std::vector<int64_t> tokens = Greedy(*ram.model, ram.dispatched.get(), kPrompt, 6);

    // Everything in RAM but the experts, which are on disk.
    dispatch::DeviceMap map;
    map.Set("", Placement::Cpu());
    for (const std::string& list : lists) map.Set(list, Placement::Disk());
    int64_t expert_bytes = 0;
    {
      ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
      for (const auto& entry : ckpt.tensors()) {
        if (absl::StartsWith(entry.info.name, lists[0] + ".0.")) {
          expert_bytes += static_cast<int64_t>(entry.info.nbytes());
        }
      }
    }
    for (bool one_by_one : {true, false}) {
      SCOPED_TRACE(one_by_one ? "experts one by one" : "experts with their block");
      dispatch::LoadOptions options;
      if (one_by_one) {
        options.expert_lists = lists;
        options.expert_cache_bytes = (resolved.top_k + 1) * expert_bytes;
      }
      options.direct_reads = one_by_one;  // and the mapping with whole blocks
      Loaded disk = Load(dir.path(), map, options);
      ASSERT_NE(disk.dispatched, nullptr);
      EXPECT_EQ(disk.dispatched->FetchesExpertsOf(lists[0]), one_by_one);
      at::Tensor got = Logits(*disk.model, disk.dispatched.get(), kPrompt);
      EXPECT_TRUE(at::equal(got, want)) << "max difference " << MaxDifference(got, want);
      EXPECT_EQ(Greedy(*disk.model, disk.dispatched.get(), kPrompt, 6), tokens);
      const dispatch::OffloadStats stats = disk.dispatched->stats();
      EXPECT_GT(one_by_one ? stats.bytes_read : stats.bytes_mapped, 0);
      if (one_by_one) {
        EXPECT_GT(stats.expert_fetches, 0);
        // Each read is an expert's tensors in one request (widened to 4 KiB
        // boundaries for O_DIRECT).
        EXPECT_GE(stats.expert_bytes_read, stats.expert_fetches * expert_bytes);
        EXPECT_LE(stats.expert_bytes_read, stats.expert_fetches * (expert_bytes + 8192));
        EXPECT_EQ(stats.bytes_read, stats.expert_bytes_read);  // nothing else is on disk
        // A decode step reads at most the routed experts of each sparse layer.
        const dispatch::OffloadStats before = disk.dispatched->stats();
        KvCache cache;
        Logits(*disk.model, disk.dispatched.get(), kPrompt, &cache);
        const dispatch::OffloadStats mid = disk.dispatched->stats();
        Logits(*disk.model, disk.dispatched.get(), {tokens[0]}, &cache);
        const dispatch::OffloadStats after = disk.dispatched->stats();
        const int64_t used = (after.expert_fetches - mid.expert_fetches) +
                             (after.expert_cache_hits - mid.expert_cache_hits);
        EXPECT_GE(after.expert_cache_hits - before.expert_cache_hits, 0);
        // Uses: exactly top-k per sparse layer for one token; reads beyond
        // those are the reader's guesses for the next layer.
        EXPECT_LE(after.expert_cache_hits - mid.expert_cache_hits,
                  static_cast<int64_t>(lists.size()) * resolved.top_k);
        EXPECT_GE(used, static_cast<int64_t>(lists.size()) * resolved.top_k);
      }
    }
  }
}

// ---- quantized experts -------------------------------------------------------------

// The weight a quantized layer computes with, dequantized as bitsandbytes does.
at::Tensor Dequantized(const nn::QuantizableLinear& layer) {
  const nn::LinearQuantization& how = layer.quantization();
  if (how.method == nn::LinearQuantization::Method::kInt8) {
    return layer.weight.to(at::kDouble) * layer.scb.to(at::kDouble).unsqueeze(1) / 127.0;
  }
  const at::Tensor bytes = layer.weight.reshape({-1});
  const int64_t n = layer.out_features() * layer.in_features();
  const at::Tensor codes =
      at::stack({bytes.__rshift__(4), bytes.__and__(0xF)}, 1).reshape({-1}).narrow(0, 0, n);
  at::Tensor absmax = layer.weight_state->absmax;
  if (how.double_quant) {
    quant::Quantized4bit q;
    q.packed = layer.weight;
    q.absmax = layer.weight_state->absmax;
    q.quant_map = layer.weight_state->quant_map;
    q.nested_absmax = layer.weight_state->nested_absmax;
    q.nested_quant_map = layer.weight_state->nested_quant_map;
    q.state = layer.quant_state;
    absmax = quant::BlockAbsmax(q).value();
  }
  const at::Tensor scale = absmax.to(at::kDouble).repeat_interleave(how.blocksize).narrow(0, 0, n);
  return (layer.weight_state->quant_map.to(at::kDouble).index_select(0, codes.to(at::kLong)) *
          scale)
      .view({layer.out_features(), layer.in_features()});
}

// A small mixture whose experts quantize in whole 4-bit blocks of 64.
MakeModelOptions SmallQuantizableMoe(const char* family, int64_t experts, int64_t top_k) {
  MakeModelOptions o = Base(family);
  o.hidden_size = 64;
  o.num_experts = experts;
  o.num_experts_per_tok = top_k;
  o.intermediate_size = 128;
  o.moe_intermediate_size = 64;
  o.shared_expert_intermediate_size = 64;
  return o;
}

TEST(DecoderFamiliesQuantizedTest, QuantizedExpertsFollowTheDequantizedReference) {
  for (const char* family : {"mixtral", "qwen2_moe"}) {
    for (const char* method : {"nf4", "fp4", "int8"}) {
      SCOPED_TRACE(absl::StrCat(family, " ", method));
      const MakeModelOptions o = SmallQuantizableMoe(family, 4, 2);
      TempDir dir;
      ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
      ModelLoadOptions options;
      options.device_map = "cpu";
      options.quantize = method;
      options.double_quant = std::string(method) == "nf4";
      options.progress = Progress::Style::kSilent;
      ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel loaded, LoadModel(dir.path(), options));
      // Experts are quantized; the router is not (transformers v5's rule).
      const std::string block = std::string(family) == "mixtral" ? "model.layers.0.block_sparse_moe"
                                                                 : "model.layers.0.mlp";
      EXPECT_EQ(loaded.quantization.count(block + ".gate"), 0u);
      EXPECT_EQ(loaded.quantization.count(block + (std::string(family) == "mixtral"
                                                       ? ".experts.1.w2"
                                                       : ".experts.1.down_proj")),
                1u);
      ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
      Reference reference{ckpt, loaded.config, {}};
      for (const auto& item : loaded.model->named_modules()) {
        if (loaded.quantization.count(item.key())) {
          const auto* layer = dynamic_cast<const nn::QuantizableLinear*>(item.value().get());
          ASSERT_NE(layer, nullptr) << item.key();
          reference.dequantized[item.key() + ".weight"] = Dequantized(*layer);
        }
      }
      ASSERT_GT(reference.dequantized.size(), 8u);
      // Packing leaves quantized layers as they are (their products stay
      // apart; the router and attention are packed).
      ASSERT_THAT(loaded.model->PackProjections(/*cuda_only=*/false), IsOk());
      at::Tensor logits = Logits(*loaded.model, loaded.dispatched.get(), kPrompt);
      at::Tensor expected = reference.Logits(kPrompt).to(at::kFloat);
      if (std::string(method) == "int8") {
        // LLM.int8 rounds the activations to 8 bits too: about 1% of the spread.
        const double spread = (expected.max() - expected.min()).item<double>();
        EXPECT_LT(MaxDifference(logits, expected) / spread, 0.03);
      } else {
        EXPECT_TRUE(at::allclose(logits, expected, 1e-4, 1e-5))
            << "max difference " << MaxDifference(logits, expected);
      }
    }
  }
}

// A mixture's 4-bit experts routed on the device (a step of at most
// internal::kDeviceRoutedMaxSlots top-k slots: each slot's expert index
// read where it was computed, never by the host; asked for on the cpu
// here, each slot through its expert's own layer): the host-routed logits
// bit for bit for one decoding sequence (each picked expert runs one row
// either way), and within float32's rounding for a step of three decodes
// (the host runs an expert's rows together). Mixtral (top 2), Qwen3-MoE
// (top 3: a token's slots added in ascending expert order, as index_add_
// over the experts adds them) and Qwen2-MoE (a shared expert beside them);
// NF4 and FP4. The prompt (more slots) routes on the host either way.
TEST(DecoderFamiliesQuantizedTest, ExpertsRoutedOnTheDeviceGiveTheHostRoutedLogits) {
  struct Family {
    const char* name;
    int64_t experts, top_k;
  };
  for (const Family& f :
       {Family{"mixtral", 4, 2}, Family{"qwen3_moe", 6, 3}, Family{"qwen2_moe", 4, 2}}) {
    for (const char* method : {"nf4", "fp4"}) {
      SCOPED_TRACE(absl::StrCat(f.name, " ", method));
      const MakeModelOptions o = SmallQuantizableMoe(f.name, f.experts, f.top_k);
      TempDir dir;
      ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
      ModelLoadOptions options;
      options.device_map = "cpu";
      options.quantize = method;
      options.progress = Progress::Style::kSilent;
      ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel loaded, LoadModel(dir.path(), options));
      ASSERT_THAT(loaded.model->PackProjections(/*cuda_only=*/false), IsOk());
      c10::InferenceMode inference;
      struct Run {
        std::vector<at::Tensor> alone;  // one sequence: prompt, then 3 decodes
        at::Tensor batch;               // three sequences' decode step
        int64_t routed = 0;             // blocks routed on the device
      };
      const auto run = [&](bool on_device) {
        internal::RouteExpertsOnDeviceOnCpu(on_device);
        const int64_t before = internal::DeviceRoutedLayers();
        Run out;
        KvCache cache;
        out.alone.push_back(Logits(*loaded.model, loaded.dispatched.get(), kPrompt, &cache));
        for (int64_t id : {11, 250, 3}) {
          out.alone.push_back(Logits(*loaded.model, loaded.dispatched.get(), {id}, &cache));
        }
        std::vector<KvCache> caches(3);
        std::vector<SequenceChunk> chunks;
        for (size_t i = 0; i < caches.size(); ++i) {
          (void)Logits(*loaded.model, loaded.dispatched.get(), {static_cast<int64_t>(i + 1), 9},
                       &caches[i]);
          chunks.push_back({&caches[i], 1});
        }
        auto batch = loaded.model->Forward(at::tensor(std::vector<int64_t>{4, 5, 6}, at::kLong),
                                           chunks, Logits::kLastOfEach, loaded.dispatched.get());
        EXPECT_THAT(batch, IsOk());
        if (batch.ok()) out.batch = *batch;
        out.routed = internal::DeviceRoutedLayers() - before;
        internal::RouteExpertsOnDeviceOnCpu(false);
        return out;
      };
      const Run host = run(false), device = run(true);
      EXPECT_EQ(host.routed, 0);
      // Every sparse layer of each one-token step, of the two-token prompts
      // and of the batch where their slots fit; never of the long prompt.
      const auto fits = [&](int64_t tokens) {
        return tokens * f.top_k <= internal::kDeviceRoutedMaxSlots ? 1 : 0;
      };
      EXPECT_EQ(device.routed, o.num_layers * (3 + 3 * fits(2) + fits(3)));
      ASSERT_EQ(host.alone.size(), device.alone.size());
      for (size_t i = 0; i < host.alone.size(); ++i) {
        EXPECT_TRUE(at::equal(host.alone[i], device.alone[i]))
            << "step " << i << ": max difference " << MaxDifference(host.alone[i], device.alone[i]);
      }
      ASSERT_TRUE(host.batch.defined() && device.batch.defined());
      EXPECT_TRUE(at::allclose(host.batch, device.batch, 1e-5, 1e-6))
          << "max difference " << MaxDifference(host.batch, device.batch);
    }
  }
}

// The same on a CUDA device, where the path runs by default: a Mixtral of
// NF4 experts in bfloat16, its widths multiples of 256 (what the experts
// kernel takes), all on cuda:0. Each one-token step's logits bit for bit
// those of the host's routing (nn::SetCudaExpertRouting(false)), and every
// sparse layer of those steps routed on the device.
TEST(DecoderFamiliesQuantizedTest, OnACudaDeviceExpertsRouteThereAndGiveTheHostRoutedLogits) {
  if (!quant::CudaKernelsBuilt() || !at::hasCUDA() || at::getNumGPUs() == 0) {
    GTEST_SKIP() << "needs the quant CUDA kernels, a CUDA libtorch and a CUDA device";
  }
  MakeModelOptions o = Base("mixtral");
  o.hidden_size = 256;
  o.intermediate_size = 512;
  o.num_experts = 8;
  o.num_experts_per_tok = 2;
  o.dtype = at::kBFloat16;
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
  ModelLoadOptions options;
  options.device_map = "cuda:0";
  options.quantize = "nf4";
  options.progress = Progress::Style::kSilent;
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel loaded, LoadModel(dir.path(), options));
  c10::InferenceMode inference;
  const auto run = [&](bool on_device, int64_t* routed) {
    nn::SetCudaExpertRouting(on_device);
    const int64_t before = internal::DeviceRoutedLayers();
    std::vector<at::Tensor> steps;
    KvCache cache;
    steps.push_back(Logits(*loaded.model, loaded.dispatched.get(), kPrompt, &cache).to(at::kCPU));
    for (int64_t id : {11, 250, 3, 42}) {
      steps.push_back(Logits(*loaded.model, loaded.dispatched.get(), {id}, &cache).to(at::kCPU));
    }
    *routed = internal::DeviceRoutedLayers() - before;
    nn::SetCudaExpertRouting(true);
    return steps;
  };
  int64_t host_routed = 0, device_routed = 0;
  const std::vector<at::Tensor> host = run(false, &host_routed);
  const std::vector<at::Tensor> device = run(true, &device_routed);
  EXPECT_EQ(host_routed, 0);
  EXPECT_EQ(device_routed, 4 * o.num_layers);
  ASSERT_EQ(host.size(), device.size());
  for (size_t i = 0; i < host.size(); ++i) {
    EXPECT_TRUE(at::equal(host[i], device[i]))
        << "step " << i << ": max difference " << MaxDifference(host[i], device[i]);
  }
}

// ---- refusals ----------------------------------------------------------------------

loader::ModelConfig ConfigOf(const char* family) {
  auto config = MakeModelConfig(Base(family));
  EXPECT_THAT(config, IsOk());
  return *config;
}

TEST(DecoderFamiliesConfigTest, MalformedConfigsNameTheField) {
  {
    loader::ModelConfig c = ConfigOf("mixtral");
    c.moe.num_experts_per_tok = 9;
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("num_experts_per_tok"), HasSubstr("num_local_experts"))));
  }
  {
    loader::ModelConfig c = ConfigOf("qwen3_moe");
    c.moe.mlp_only_layers = {7};
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mlp_only_layers")));
  }
  {
    loader::ModelConfig c = ConfigOf("qwen3_moe");
    c.moe.decoder_sparse_step = 0;
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("decoder_sparse_step")));
  }
  {
    loader::ModelConfig c = ConfigOf("qwen3");
    c.use_sliding_window = true;
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("use_sliding_window")));
  }
  {
    loader::ModelConfig c = ConfigOf("gemma3_text");
    c.layer_types = {"sliding_attention"};
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer_types")));
    c.layer_types = {"sliding_attention", "chunked_attention"};
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("chunked_attention")));
  }
  {
    loader::ModelConfig c = ConfigOf("gemma2");
    c.hidden_activation = "relu";
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("hidden_activation"), HasSubstr("relu"))));
  }
  {
    MakeModelOptions o = Base("phi3");
    o.longrope_factor = 4;
    ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig c, MakeModelConfig(o));
    c.rope_scaling->lists["long_factor"].pop_back();
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("long_factor")));
    c.rope_scaling->rope_type = "yarn";
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'yarn'")));
  }
  {
    loader::ModelConfig c = ConfigOf("phi3");
    c.partial_rotary_factor = 1.5;
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("partial_rotary_factor")));
  }
  {
    loader::ModelConfig c = ConfigOf("mixtral");
    c.architectures = {"MixtralForSequenceClassification"};
    EXPECT_THAT(ModuleTreeFor(c, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("MixtralForSequenceClassification"),
                               HasSubstr("MixtralForCausalLM"))));
  }
}

// A checkpoint that lacks an expert's tensor, or whose experts have another
// shape than the config says, is refused naming the tensor.
TEST(DecoderFamiliesConfigTest, MissingAndMisshapenExpertsNameTheTensor) {
  TempDir dir;
  MakeModelOptions o = Base("mixtral");
  o.num_experts = 4;
  ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
  std::vector<loader::TensorSpec> specs;
  for (const auto& entry : ckpt.tensors()) {
    if (entry.info.name == "model.layers.1.block_sparse_moe.experts.3.w2.weight") continue;
    ACCEL_ASSERT_OK_AND_ASSIGN(at::ScalarType dtype, loader::TorchDType(entry.info.dtype));
    specs.push_back({entry.info.name, dtype, entry.info.shape});
  }
  TempDir broken;
  auto produce = [&](const loader::TensorSpec& spec) { return ckpt.Tensor(spec.name); };
  ASSERT_THAT(loader::WriteCheckpoint(broken.path(), specs, produce, {}), IsOk());
  ASSERT_THAT(loader::WriteFileAtomically(broken.path() + "/config.json",
                                          loader::ReadFile(dir.path() + "/config.json").value()),
              IsOk());
  ModelLoadOptions options;
  options.device_map = "cpu";
  options.progress = Progress::Style::kSilent;
  EXPECT_THAT(LoadModel(broken.path(), options),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("model.layers.1.block_sparse_moe.experts.3.w2.weight")));

  // The config says experts are wider than the checkpoint's.
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config,
                             loader::ReadModelConfig(dir.path() + "/config.json"));
  config.intermediate_size += 8;
  ASSERT_THAT(loader::WriteFileAtomically(dir.path() + "/config.json", config.ToJson()), IsOk());
  EXPECT_THAT(LoadModel(dir.path(), options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model.layers.0.block_sparse_moe.experts.0.w1.weight"),
                             HasSubstr("shape"))));
}

}  // namespace
}  // namespace accel::models
