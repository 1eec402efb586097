// The Llama family against a straightforward reference written here from the
// checkpoint's raw tensors (double precision, loops over heads), plus: the
// module tree equals ModuleTreeFor(), the KV cache and batching change
// nothing, and a split over cpu and disk gives the same logits.
#include "models/causal_lm.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dispatch/empty_weights.h"
#include "dispatch/module_tree.h"
#include "loader/config.h"
#include "loader/loader.h"
#include "models/families.h"
#include "models/internal/packed.h"
#include "models/make_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::models {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::HasSubstr;

// ---- the reference ----------------------------------------------------------

struct Reference {
  const loader::Checkpoint& ckpt;
  const loader::ModelConfig& c;

  at::Tensor W(const std::string& name) const { return ckpt.Tensor(name)->to(at::kDouble); }
  bool Has(const std::string& name) const { return ckpt.Find(name) != nullptr; }

  at::Tensor RmsNorm(const at::Tensor& x, const std::string& weight) const {
    return x / at::sqrt(x.pow(2).mean({-1}, true) + c.norm_eps) * W(weight);
  }
  at::Tensor Proj(const at::Tensor& x, const std::string& name) const {
    at::Tensor y = at::matmul(x, W(name + ".weight").t());
    return Has(name + ".bias") ? y + W(name + ".bias") : y;
  }
  // Rotates pairs (i, i + d/2) of a [T, d] block by position x 1/theta^(2i/d).
  at::Tensor Rotate(const at::Tensor& x) const {
    at::Tensor out = x.clone();
    const int64_t d = x.size(1), half = d / 2;
    for (int64_t t = 0; t < x.size(0); ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const double angle = t * std::pow(c.rope_theta, -2.0 * i / d);
        const double a = x[t][i].item<double>(), b = x[t][i + half].item<double>();
        out[t][i] = a * std::cos(angle) - b * std::sin(angle);
        out[t][i + half] = b * std::cos(angle) + a * std::sin(angle);
      }
    }
    return out;
  }

  at::Tensor Logits(const std::vector<int64_t>& ids) const {
    const int64_t T = static_cast<int64_t>(ids.size()), d = c.head_size();
    const int64_t heads = c.num_attention_heads, group = heads / c.kv_heads();
    at::Tensor x = W("model.embed_tokens.weight").index_select(0, at::tensor(ids, at::kLong));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      at::Tensor h = RmsNorm(x, p + "input_layernorm.weight");
      at::Tensor q = Proj(h, p + "self_attn.q_proj"), k = Proj(h, p + "self_attn.k_proj");
      at::Tensor v = Proj(h, p + "self_attn.v_proj");
      at::Tensor out = at::zeros({T, heads * d}, at::kDouble);
      for (int64_t hh = 0; hh < heads; ++hh) {
        const int64_t kv = hh / group;
        at::Tensor qh = Rotate(q.narrow(1, hh * d, d)), kh = Rotate(k.narrow(1, kv * d, d));
        at::Tensor vh = v.narrow(1, kv * d, d);
        for (int64_t t = 0; t < T; ++t) {
          std::vector<double> scores;
          int64_t first = 0;
          if (c.sliding_window && c.model_type == "mistral")
            first = std::max<int64_t>(0, t - *c.sliding_window + 1);
          for (int64_t s = first; s <= t; ++s)
            scores.push_back(at::dot(qh[t], kh[s]).item<double>() / std::sqrt(d));
          const double top = *std::max_element(scores.begin(), scores.end());
          double total = 0;
          for (double& s : scores) total += (s = std::exp(s - top));
          at::Tensor acc = at::zeros({d}, at::kDouble);
          for (int64_t s = first; s <= t; ++s) acc += scores[s - first] / total * vh[s];
          out[t].narrow(0, hh * d, d).copy_(acc);
        }
      }
      x = x + Proj(out, p + "self_attn.o_proj");
      h = RmsNorm(x, p + "post_attention_layernorm.weight");
      at::Tensor gate = Proj(h, p + "mlp.gate_proj");
      x = x + Proj(gate * at::sigmoid(gate) * Proj(h, p + "mlp.up_proj"), p + "mlp.down_proj");
    }
    x = RmsNorm(x, "model.norm.weight");
    const std::string head = Has("lm_head.weight") ? "lm_head.weight" : "model.embed_tokens.weight";
    return at::matmul(x, W(head).t());
  }
};

// GPT-2, the same way: learned positions, LayerNorm, Conv1D ([in, out]), gelu_new.
struct Gpt2Reference {
  const loader::Checkpoint& ckpt;
  const loader::ModelConfig& c;

  at::Tensor W(const std::string& name) const { return ckpt.Tensor(name)->to(at::kDouble); }
  at::Tensor Norm(const at::Tensor& x, const std::string& p) const {
    at::Tensor mean = x.mean({-1}, true);
    at::Tensor var = (x - mean).pow(2).mean({-1}, true);
    return (x - mean) / at::sqrt(var + c.norm_eps) * W(p + ".weight") + W(p + ".bias");
  }
  at::Tensor Conv(const at::Tensor& x, const std::string& p) const {
    return at::matmul(x, W(p + ".weight")) + W(p + ".bias");
  }

  at::Tensor Logits(const std::vector<int64_t>& ids) const {
    const int64_t T = static_cast<int64_t>(ids.size()), H = c.hidden_size,
                  heads = c.num_attention_heads;
    const int64_t d = H / heads;
    at::Tensor x = W("transformer.wte.weight").index_select(0, at::tensor(ids, at::kLong)) +
                   W("transformer.wpe.weight").narrow(0, 0, T);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string p = "transformer.h." + std::to_string(l) + ".";
      at::Tensor qkv = Conv(Norm(x, p + "ln_1"), p + "attn.c_attn");
      at::Tensor out = at::zeros({T, H}, at::kDouble);
      for (int64_t hh = 0; hh < heads; ++hh) {
        at::Tensor q = qkv.narrow(1, hh * d, d), k = qkv.narrow(1, H + hh * d, d);
        at::Tensor v = qkv.narrow(1, 2 * H + hh * d, d);
        for (int64_t t = 0; t < T; ++t) {
          at::Tensor scores =
              at::matmul(k.narrow(0, 0, t + 1), q[t]) / std::sqrt(static_cast<double>(d));
          out[t]
              .narrow(0, hh * d, d)
              .copy_(at::matmul(at::softmax(scores, 0), v.narrow(0, 0, t + 1)));
        }
      }
      x = x + Conv(out, p + "attn.c_proj");
      at::Tensor h = Conv(Norm(x, p + "ln_2"), p + "mlp.c_fc");
      h = 0.5 * h * (1 + at::tanh(std::sqrt(2 / M_PI) * (h + 0.044715 * h.pow(3))));
      x = x + Conv(h, p + "mlp.c_proj");
    }
    return at::matmul(Norm(x, "transformer.ln_f"), W("transformer.wte.weight").t());
  }
};

// ---- helpers ------------------------------------------------------------------

MakeModelOptions Small(const std::string& family) {
  MakeModelOptions o;
  o.family = family;
  o.hidden_size = 32;
  o.num_heads = 4;
  o.num_kv_heads = 2;
  o.num_layers = 2;
  o.vocab_size = 300;
  return o;
}

struct Loaded {
  loader::ModelConfig config;
  std::shared_ptr<CausalLM> model;
  std::unique_ptr<dispatch::DispatchedModel> dispatched;
};

Loaded Load(const std::string& dir, const dispatch::DeviceMap& map,
            at::ScalarType dtype = at::kFloat) {
  Loaded out;
  auto config = loader::ReadModelConfig(dir + "/config.json");
  EXPECT_THAT(config, IsOk());
  out.config = *config;
  {
    dispatch::EmptyWeightsGuard empty;
    auto model = BuildCausalLM(out.config, dtype);
    EXPECT_THAT(model, IsOk());
    out.model = *model;
  }
  dispatch::LoadOptions options;
  options.progress = Progress::Style::kSilent;
  options.dtype = dtype;
  auto dispatched = dispatch::DispatchedModel::Load(out.model, dir, map, options);
  EXPECT_THAT(dispatched, IsOk());
  out.dispatched = *std::move(dispatched);
  return out;
}

dispatch::DeviceMap AllCpu() {
  dispatch::DeviceMap map;
  map.Set("", Placement::Cpu());
  return map;
}

// Logits of every token of one sequence, continuing `cache` when given.
at::Tensor Logits(Loaded& m, const std::vector<int64_t>& ids, KvCache* cache = nullptr) {
  c10::InferenceMode inference;
  const SequenceChunk chunk{cache, static_cast<int64_t>(ids.size())};
  auto logits =
      m.model->Forward(at::tensor(ids, at::kLong), {chunk}, Logits::kAll, m.dispatched.get());
  EXPECT_THAT(logits, IsOk());
  return logits.ok() ? *logits : at::Tensor();
}

std::vector<int64_t> Slice(const std::vector<int64_t>& ids, size_t from, size_t count) {
  return {ids.begin() + from, ids.begin() + from + count};
}

// ---- tests ----------------------------------------------------------------------

TEST(CausalLMTest, ItsModuleTreeIsExactlyModuleTreeFor) {
  for (const char* family : {"llama", "qwen2", "mistral", "gpt2"}) {
    for (bool tie : {false, true}) {
      MakeModelOptions o = Small(family);
      o.tie_word_embeddings = tie;
      o.attention_bias = tie;  // llama: q/k/v/o biases
      auto config = MakeModelConfig(o);
      ASSERT_THAT(config, IsOk());
      std::shared_ptr<CausalLM> model;
      {
        dispatch::EmptyWeightsGuard empty;
        auto built = BuildCausalLM(*config, at::kBFloat16);
        ASSERT_THAT(built, IsOk());
        model = *built;
      }
      auto from_model = dispatch::ModuleTree::FromModule(*model);
      auto from_config = ModuleTreeFor(*config, at::kBFloat16);
      ASSERT_THAT(from_model, IsOk());
      ASSERT_THAT(from_config, IsOk());
      EXPECT_EQ(from_model->ToJson(), from_config->ToJson()) << family << " tie=" << tie;
    }
  }
}

TEST(CausalLMTest, LogitsMatchTheReference) {
  for (const char* family : {"llama", "qwen2", "mistral"}) {
    SCOPED_TRACE(family);
    TempDir dir;
    MakeModelOptions o = Small(family);
    o.tie_word_embeddings = std::string(family) == "llama";
    if (std::string(family) == "mistral") o.sliding_window = 3;  // masks within 7 tokens
    ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
    Loaded m = Load(dir.path(), AllCpu());
    const std::vector<int64_t> ids = {5, 17, 299, 42, 42, 0, 7};
    at::Tensor logits = Logits(m, ids);
    ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
    at::Tensor expected = Reference{ckpt, m.config}.Logits(ids).to(at::kFloat);
    EXPECT_TRUE(at::allclose(logits, expected, /*rtol=*/1e-4, /*atol=*/1e-5))
        << "max difference " << (logits - expected).abs().max().item<float>();
  }
}

TEST(CausalLMTest, Gpt2LogitsMatchTheReference) {
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), Small("gpt2")), IsOk());
  Loaded m = Load(dir.path(), AllCpu());
  const std::vector<int64_t> ids = {256, 1, 2, 299, 17, 17};
  at::Tensor logits = Logits(m, ids);
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
  at::Tensor expected = Gpt2Reference{ckpt, m.config}.Logits(ids).to(at::kFloat);
  EXPECT_TRUE(at::allclose(logits, expected, /*rtol=*/1e-4, /*atol=*/1e-5))
      << "max difference " << (logits - expected).abs().max().item<float>();
  // And with the cache, token by token.
  KvCache cache;
  for (size_t t = 0; t < ids.size(); ++t) {
    at::Tensor step = Logits(m, {ids[t]}, &cache);
    EXPECT_TRUE(at::allclose(step[0], logits[t], 1e-5, 1e-6)) << "token " << t;
  }
}

// bfloat16 and float16 weights (a float32 checkpoint converted on load):
// the same logits as the double-precision reference up to 16-bit rounding,
// and the cache and packing still change nothing beyond it.
TEST(CausalLMTest, SixteenBitModelsFollowTheReference) {
  for (const char* family : {"llama", "gpt2"}) {
    TempDir dir;
    ASSERT_THAT(MakeModel(dir.path(), Small(family)), IsOk());
    ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
    const std::vector<int64_t> ids = {5, 17, 299, 42, 42, 0, 7};
    for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
      SCOPED_TRACE(std::string(family) + " " + c10::toString(dtype));
      Loaded m = Load(dir.path(), AllCpu(), dtype);
      at::Tensor expected = std::string(family) == "gpt2"
                                ? Gpt2Reference{ckpt, m.config}.Logits(ids).to(at::kFloat)
                                : Reference{ckpt, m.config}.Logits(ids).to(at::kFloat);
      at::Tensor logits = Logits(m, ids);
      ASSERT_EQ(logits.scalar_type(), at::kFloat);
      // Relative error of the whole logit matrix: bfloat16 keeps 8 bits of
      // mantissa (2^-8 ~ 0.4%), float16 11 bits; a few layers compound it.
      const double bound = dtype == at::kBFloat16 ? 2e-2 : 2.5e-3;  // ~3x the seen error
      const double error = ((logits - expected).norm() / expected.norm()).item<double>();
      EXPECT_LT(error, bound);
      EXPECT_GT(error, 0.0);  // the 16-bit path really ran in 16 bits
      KvCache cache;
      at::Tensor first = Logits(m, Slice(ids, 0, 5), &cache);
      at::Tensor next = Logits(m, Slice(ids, 5, 2), &cache);
      at::Tensor stepped = at::cat({first, next});
      EXPECT_LT(((stepped - logits).norm() / logits.norm()).item<double>(), bound / 4);
    }
  }
}

TEST(CausalLMTest, KvCacheGivesTheSameLogitsAsTheFullSequence) {
  for (const char* family : {"llama", "mistral"}) {
    SCOPED_TRACE(family);
    TempDir dir;
    MakeModelOptions o = Small(family);
    if (std::string(family) == "mistral") o.sliding_window = 3;  // the window slides over the cache
    ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
    Loaded m = Load(dir.path(), AllCpu());
    const std::vector<int64_t> ids = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4};
    at::Tensor full = Logits(m, ids);
    KvCache cache;
    at::Tensor prefill = Logits(m, Slice(ids, 0, 4), &cache);
    EXPECT_TRUE(at::allclose(prefill, full.narrow(0, 0, 4), 1e-5, 1e-6));
    // Token by token, past the cache's first capacity (16) so it grows.
    for (size_t t = 4; t < ids.size(); ++t) {
      at::Tensor step = Logits(m, {ids[t]}, &cache);
      EXPECT_TRUE(at::allclose(step[0], full[t], 1e-5, 1e-6)) << "token " << t;
    }
    EXPECT_EQ(cache.length, static_cast<int64_t>(ids.size()));
    EXPECT_GT(cache.bytes(), 0);
    cache.Clear();
    EXPECT_EQ(cache.length, 0);
    EXPECT_EQ(cache.bytes(), 0);
  }
}

// Prompts of different lengths prefilled in one packed step, then decoded
// together (one token each per step, one sequence joining late): every
// sequence's logits equal what it gets alone.
TEST(CausalLMTest, PackedSequencesEqualEachSequenceAlone) {
  for (const char* family : {"qwen2", "gpt2"}) {
    SCOPED_TRACE(family);
    TempDir dir;
    ASSERT_THAT(MakeModel(dir.path(), Small(family)), IsOk());
    Loaded m = Load(dir.path(), AllCpu());
    const std::vector<std::vector<int64_t>> seqs = {
        {10, 20, 30, 40, 50, 60}, {7, 250}, {1, 2, 3, 4, 5, 6, 7, 8, 9}};
    std::vector<at::Tensor> alone;
    for (const auto& seq : seqs) alone.push_back(Logits(m, seq));

    c10::InferenceMode inference;
    KvCache a, b, c;
    // Step 1: prefill a (4 tokens) and b (1 token); c has not arrived.
    std::vector<int64_t> packed = {10, 20, 30, 40, 7};
    auto step = m.model->Forward(at::tensor(packed, at::kLong), {{&a, 4}, {&b, 1}},
                                 Logits::kLastOfEach, m.dispatched.get());
    ASSERT_THAT(step, IsOk());
    ASSERT_EQ(step->sizes(), (std::vector<int64_t>{2, 300}));
    EXPECT_TRUE(at::allclose((*step)[0], alone[0][3], 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose((*step)[1], alone[1][0], 1e-5, 1e-6));
    // Step 2: a and b decode one token; c prefills 7 tokens; all logits.
    packed = {50, 250, 1, 2, 3, 4, 5, 6, 7};
    step = m.model->Forward(at::tensor(packed, at::kLong), {{&a, 1}, {&b, 1}, {&c, 7}},
                            Logits::kAll, m.dispatched.get());
    ASSERT_THAT(step, IsOk());
    ASSERT_EQ(step->size(0), 9);
    EXPECT_TRUE(at::allclose((*step)[0], alone[0][4], 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose((*step)[1], alone[1][1], 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose(step->narrow(0, 2, 7), alone[2].narrow(0, 0, 7), 1e-5, 1e-6));
    // Step 3: b has finished; a and c decode.
    step = m.model->Forward(at::tensor({60, 8}, at::kLong), {{&a, 1}, {&c, 1}}, Logits::kLastOfEach,
                            m.dispatched.get());
    ASSERT_THAT(step, IsOk());
    EXPECT_TRUE(at::allclose((*step)[0], alone[0][5], 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose((*step)[1], alone[2][7], 1e-5, 1e-6));
    EXPECT_EQ(a.length, 6);
    EXPECT_EQ(b.length, 2);
    EXPECT_EQ(c.length, 8);
  }
}

// GPT-2's attention through the step's decode plan (internal::StepDecodePlanScope,
// what a general step does on a CUDA device; asked for on the cpu here): a
// step of paged decodes around a prompt gives the unplanned step's logits bit
// for bit, and the plan ran in every layer.
TEST(CausalLMTest, Gpt2PlannedDecodeRowsGiveTheUnplannedLogits) {
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), Small("gpt2")), IsOk());
  Loaded m = Load(dir.path(), AllCpu());
  c10::InferenceMode inference;
  const int64_t layers = m.config.num_hidden_layers;
  const auto run = [&](bool planned, int64_t* planned_layers) {
    internal::PlanStepDecodesOnCpu(planned);
    const int64_t before = internal::PlannedDecodeAttentions();
    KvBlockStore store(16, 4, static_cast<size_t>(layers));
    std::vector<KvCache> caches(3);
    for (size_t i = 0; i < caches.size(); ++i) {
      caches[i].store = &store;
      caches[i].block_table = {static_cast<int32_t>(15 - i), static_cast<int32_t>(5 + i),
                               static_cast<int32_t>(i)};
    }
    std::vector<at::Tensor> out;
    const auto forward = [&](const std::vector<int64_t>& ids,
                             const std::vector<SequenceChunk>& chunks) {
      auto logits = m.model->Forward(at::tensor(ids, at::kLong), chunks, Logits::kLastOfEach,
                                     m.dispatched.get());
      EXPECT_THAT(logits, IsOk());
      if (logits.ok()) out.push_back(*logits);
    };
    forward({10, 20, 30, 40, 50, 7, 250}, {{&caches[0], 5}, {&caches[1], 2}});
    forward({60, 1, 2, 3, 4, 251}, {{&caches[0], 1}, {&caches[2], 4}, {&caches[1], 1}});
    forward({61, 5, 252}, {{&caches[0], 1}, {&caches[2], 1}, {&caches[1], 1}});
    *planned_layers = internal::PlannedDecodeAttentions() - before;
    internal::PlanStepDecodesOnCpu(false);
    return out;
  };
  int64_t plain_layers = 0, planned_layers = 0;
  const std::vector<at::Tensor> plain = run(false, &plain_layers);
  const std::vector<at::Tensor> planned = run(true, &planned_layers);
  EXPECT_EQ(plain_layers, 0);
  EXPECT_EQ(planned_layers, 2 * layers);  // the second and third steps
  ASSERT_EQ(plain.size(), 3u);
  ASSERT_EQ(planned.size(), 3u);
  for (size_t s = 0; s < plain.size(); ++s) {
    EXPECT_TRUE(at::equal(planned[s], plain[s])) << "step " << s;
  }
}

// A decoding row whose block table does not cover its next position is a
// clear error with the decode plan as without it (and the cache is not
// advanced).
TEST(CausalLMTest, ADecodeRowPastItsTableIsAClearErrorWithAndWithoutThePlan) {
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), Small("gpt2")), IsOk());
  Loaded m = Load(dir.path(), AllCpu());
  c10::InferenceMode inference;
  for (bool planned : {false, true}) {
    SCOPED_TRACE(planned ? "planned" : "unplanned");
    internal::PlanStepDecodesOnCpu(planned);
    KvBlockStore store(8, 4, static_cast<size_t>(m.config.num_hidden_layers));
    KvCache cache;
    cache.store = &store;
    cache.block_table = {3, 5};  // positions 0..7
    ASSERT_THAT(
        m.model->Forward(at::tensor(std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}, at::kLong),
                         {{&cache, 8}}, Logits::kLastOfEach, m.dispatched.get()),
        IsOk());
    // Position 8 needs a third block.
    const auto step = m.model->Forward(at::tensor(std::vector<int64_t>{9}, at::kLong),
                                       {{&cache, 1}}, Logits::kLastOfEach, m.dispatched.get());
    internal::PlanStepDecodesOnCpu(false);
    EXPECT_FALSE(step.ok());
    EXPECT_THAT(std::string(step.status().message()), ::testing::HasSubstr("table holds"));
    EXPECT_EQ(cache.length, 8);
  }
}

TEST(CausalLMTest, SplitOverCpuAndDiskGivesTheSameLogits) {
  TempDir dir;
  MakeModelOptions o = Small("llama");
  o.tie_word_embeddings = true;
  ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
  Loaded whole = Load(dir.path(), AllCpu());
  dispatch::DeviceMap split;
  split.Set("model.embed_tokens", Placement::Disk());  // tied to lm_head
  split.Set("model.layers.0", Placement::Disk());
  split.Set("model.layers.1", Placement::Cpu());
  split.Set("model.norm", Placement::Disk());
  split.Set("model.rotary_emb", Placement::Cpu());
  split.Set("lm_head", Placement::Disk());
  Loaded parted = Load(dir.path(), split);
  const std::vector<int64_t> ids = {1, 2, 3, 4, 5};
  for (int pass = 0; pass < 2; ++pass) {
    EXPECT_TRUE(at::equal(Logits(parted, ids), Logits(whole, ids)));
  }
  EXPECT_GT(parted.dispatched->stats().fetches, 0);
}

TEST(CausalLMTest, BadInputsAreClearErrors) {
  TempDir gpt2_dir;
  MakeModelOptions o = Small("gpt2");
  o.max_position_embeddings = 8;
  ASSERT_THAT(MakeModel(gpt2_dir.path(), o), IsOk());
  Loaded gpt2 = Load(gpt2_dir.path(), AllCpu());
  c10::InferenceMode inference;
  EXPECT_THAT(gpt2.model->Forward(at::ones({9}, at::kLong), {{nullptr, 9}}, Logits::kAll, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("position 8")));
  // Past the limit through the cache: nothing is appended.
  KvCache full;
  ASSERT_THAT(gpt2.model->Forward(at::ones({8}, at::kLong), {{&full, 8}}, Logits::kAll, nullptr),
              IsOk());
  EXPECT_THAT(gpt2.model->Forward(at::ones({1}, at::kLong), {{&full, 1}}, Logits::kAll, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("position 8")));
  EXPECT_EQ(full.length, 8);

  loader::ModelConfig falcon = gpt2.config;
  falcon.architectures = {"FalconForCausalLM"};
  EXPECT_THAT(BuildCausalLM(falcon, at::kFloat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("LlamaForCausalLM")));

  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), Small("llama")), IsOk());
  Loaded m = Load(dir.path(), AllCpu());
  auto forward = [&](const at::Tensor& ids, std::vector<SequenceChunk> chunks) {
    return m.model->Forward(ids, chunks, Logits::kAll, nullptr);
  };
  const at::Tensor two = at::tensor({1, 2}, at::kLong);
  EXPECT_THAT(forward(two.unsqueeze(0), {{nullptr, 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("one int64 row")));
  EXPECT_THAT(forward(two.to(at::kInt), {{nullptr, 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("one int64 row")));
  EXPECT_THAT(forward(two, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no sequences")));
  EXPECT_THAT(forward(two, {{nullptr, 3}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3 tokens in all")));
  EXPECT_THAT(forward(two, {{nullptr, 2}, {nullptr, 0}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sequence 1 has 0 tokens")));
  KvCache shared;
  EXPECT_THAT(forward(two, {{&shared, 1}, {&shared, 1}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("share one KV cache")));
  EXPECT_THAT(forward(at::tensor({1, 300}, at::kLong), {{nullptr, 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token id 300")));
  EXPECT_THAT(forward(at::tensor({-1, 3}, at::kLong), {{nullptr, 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token id -1")));
  KvCache foreign;
  foreign.length = 3;
  foreign.keys.resize(5);
  foreign.values.resize(5);
  EXPECT_THAT(forward(two, {{&foreign, 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has 5 layers")));
  KvCache negative;
  negative.length = -1;
  EXPECT_THAT(forward(two, {{&negative, 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has length -1")));
}

}  // namespace
}  // namespace accel::models
