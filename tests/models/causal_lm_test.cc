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

Loaded Load(const std::string& dir, const dispatch::DeviceMap& map) {
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
  dispatch::LoadOptions options;
  options.progress = Progress::Style::kSilent;
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

at::Tensor Positions(int64_t batch, int64_t from, int64_t count) {
  return at::arange(from, from + count, at::kLong).unsqueeze(0).expand({batch, count}).contiguous();
}

at::Tensor Logits(Loaded& m, const at::Tensor& ids, const at::Tensor& positions,
                  KvCache* cache = nullptr) {
  c10::InferenceMode inference;
  auto logits = m.model->Forward(ids, positions, cache, m.dispatched.get());
  EXPECT_THAT(logits, IsOk());
  return *logits;
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
    at::Tensor logits = Logits(m, at::tensor(ids, at::kLong).unsqueeze(0), Positions(1, 0, 7));
    ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
    at::Tensor expected = Reference{ckpt, m.config}.Logits(ids).to(at::kFloat);
    EXPECT_TRUE(at::allclose(logits[0], expected, /*rtol=*/1e-4, /*atol=*/1e-5))
        << "max difference " << (logits[0] - expected).abs().max().item<float>();
  }
}

TEST(CausalLMTest, Gpt2LogitsMatchTheReference) {
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), Small("gpt2")), IsOk());
  Loaded m = Load(dir.path(), AllCpu());
  const std::vector<int64_t> ids = {256, 1, 2, 299, 17, 17};
  at::Tensor logits = Logits(m, at::tensor(ids, at::kLong).unsqueeze(0), Positions(1, 0, 6));
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
  at::Tensor expected = Gpt2Reference{ckpt, m.config}.Logits(ids).to(at::kFloat);
  EXPECT_TRUE(at::allclose(logits[0], expected, /*rtol=*/1e-4, /*atol=*/1e-5))
      << "max difference " << (logits[0] - expected).abs().max().item<float>();
  // And with the cache, token by token.
  KvCache cache;
  for (int64_t t = 0; t < 6; ++t) {
    at::Tensor step =
        Logits(m, at::tensor({ids[t]}, at::kLong).unsqueeze(0), Positions(1, t, 1), &cache);
    EXPECT_TRUE(at::allclose(step[0][0], logits[0][t], 1e-5, 1e-6)) << "token " << t;
  }
}

TEST(CausalLMTest, KvCacheGivesTheSameLogitsAsTheFullSequence) {
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), Small("llama")), IsOk());
  Loaded m = Load(dir.path(), AllCpu());
  at::Tensor ids = at::tensor({3, 1, 4, 1, 5, 9, 2}, at::kLong).unsqueeze(0);
  at::Tensor full = Logits(m, ids, Positions(1, 0, 7));
  KvCache cache;
  at::Tensor prefill = Logits(m, ids.narrow(1, 0, 4), Positions(1, 0, 4), &cache);
  EXPECT_TRUE(at::allclose(prefill, full.narrow(1, 0, 4), 1e-5, 1e-6));
  for (int64_t t = 4; t < 7; ++t) {
    at::Tensor step = Logits(m, ids.narrow(1, t, 1), Positions(1, t, 1), &cache);
    EXPECT_TRUE(at::allclose(step[0][0], full[0][t], 1e-5, 1e-6)) << "token " << t;
  }
  EXPECT_EQ(cache.seen(), 7);
}

TEST(CausalLMTest, ABatchEqualsEachSequenceAlone) {
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), Small("qwen2")), IsOk());
  Loaded m = Load(dir.path(), AllCpu());
  at::Tensor a = at::tensor({10, 20, 30, 40}, at::kLong), b = at::tensor({7, 7, 8, 250}, at::kLong);
  at::Tensor batch = Logits(m, at::stack({a, b}), Positions(2, 0, 4));
  EXPECT_TRUE(at::allclose(batch[0], Logits(m, a.unsqueeze(0), Positions(1, 0, 4))[0], 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(batch[1], Logits(m, b.unsqueeze(0), Positions(1, 0, 4))[0], 1e-5, 1e-6));
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
  at::Tensor ids = at::tensor({1, 2, 3, 4, 5}, at::kLong).unsqueeze(0);
  for (int pass = 0; pass < 2; ++pass) {
    EXPECT_TRUE(
        at::equal(Logits(parted, ids, Positions(1, 0, 5)), Logits(whole, ids, Positions(1, 0, 5))));
  }
  EXPECT_GT(parted.dispatched->stats().fetches, 0);
}

TEST(CausalLMTest, BadInputsAreClearErrors) {
  TempDir gpt2_dir;
  MakeModelOptions o = Small("gpt2");
  o.max_position_embeddings = 8;
  ASSERT_THAT(MakeModel(gpt2_dir.path(), o), IsOk());
  Loaded gpt2 = Load(gpt2_dir.path(), AllCpu());
  EXPECT_THAT(
      gpt2.model->Forward(at::ones({1, 9}, at::kLong), Positions(1, 0, 9), nullptr, nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("position 8")));
  loader::ModelConfig falcon = gpt2.config;
  falcon.architectures = {"FalconForCausalLM"};
  EXPECT_THAT(BuildCausalLM(falcon, at::kFloat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("LlamaForCausalLM")));
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), Small("llama")), IsOk());
  Loaded m = Load(dir.path(), AllCpu());
  EXPECT_THAT(m.model->Forward(at::tensor({1, 2}, at::kLong), at::tensor({0, 1}, at::kLong),
                               nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[batch, tokens]")));
}

}  // namespace
}  // namespace accel::models
