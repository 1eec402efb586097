// Quantized models end to end: the module tree the device map is planned on
// is exactly the quantized model's; loading quantizes each weight exactly as
// quant::Quantize4bit / QuantizeInt8 do; logits stay close to float32 (the
// figures are printed); a saved quantized model has transformers' layout and
// loads back to the same logits, also from disk offload; and each bad input
// names what is wrong.
#include "models/quantize.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dispatch/empty_weights.h"
#include "loader/loader.h"
#include "models/families.h"
#include "models/load_model.h"
#include "models/make_model.h"
#include "quant/cuda_matmul.h"
#include "tests/testing/scoped_env.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::models {
namespace {

using ::accel::test::FilesUnder;
using ::accel::test::IsOk;
using ::accel::test::ScopedEnv;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using Method = nn::LinearQuantization::Method;

ModelLoadOptions Options(const std::string& quantize, bool double_quant = false) {
  ModelLoadOptions options;
  options.device_map = "cpu";
  options.quantize = quantize;
  options.double_quant = double_quant;
  options.progress = Progress::Style::kSilent;
  return options;
}

at::Tensor Logits(LoadedModel& m, const std::vector<int64_t>& ids) {
  c10::InferenceMode inference;
  auto logits =
      m.model->Forward(at::tensor(ids, at::kLong), {{nullptr, static_cast<int64_t>(ids.size())}},
                       Logits::kAll, m.dispatched.get());
  EXPECT_THAT(logits, IsOk());
  return logits.ok() ? *logits : at::Tensor();
}

std::vector<int64_t> Prompt(int64_t n, int64_t vocab) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back((i * 37 + 11) % vocab);
  return ids;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class QuantizeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MakeModelOptions o;
    o.hidden_size = 128;
    o.intermediate_size = 352;  // in_features % 64 != 0 for down_proj: blocks cross rows
    o.num_layers = 2;
    o.vocab_size = 320;
    o.seed = 7;
    ASSERT_THAT(MakeModel(dir_.path(), o), IsOk());
  }
  TempDir dir_;
};

TEST_F(QuantizeTest, TheTreeTheMapIsPlannedOnIsTheQuantizedModelsOwn) {
  for (const char* family : {"llama", "gpt2"}) {
    MakeModelOptions o;
    o.family = family;
    ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config, MakeModelConfig(o));
    ACCEL_ASSERT_OK_AND_ASSIGN(dispatch::ModuleTree tree, ModuleTreeFor(config, at::kBFloat16));
    for (const char* method : {"int8", "nf4", "nf4+dq"}) {
      SCOPED_TRACE(std::string(family) + " " + method);
      quant::BnbQuantizationConfig bnb;
      bnb.load_in_8bit = std::string(method) == "int8";
      bnb.load_in_4bit = !bnb.load_in_8bit;
      bnb.bnb_4bit_use_double_quant = std::string(method) == "nf4+dq";
      bnb.bnb_4bit_quant_type = quant::QuantType4bit::kNf4;
      ACCEL_ASSERT_OK_AND_ASSIGN(QuantPlan plan, PlanQuantization(tree, bnb));
      EXPECT_EQ(plan.count("lm_head"), 0u);  // skipped by default (and tied in gpt2)
      ACCEL_ASSERT_OK_AND_ASSIGN(dispatch::ModuleTree quantized, QuantizeModuleTree(tree, plan));

      std::shared_ptr<CausalLM> model;
      {
        dispatch::EmptyWeightsGuard empty;
        ACCEL_ASSERT_OK_AND_ASSIGN(model, BuildCausalLM(config, at::kBFloat16));
      }
      ASSERT_THAT(QuantizeLinears(*model, plan), IsOk());
      ACCEL_ASSERT_OK_AND_ASSIGN(dispatch::ModuleTree built,
                                 dispatch::ModuleTree::FromModule(*model));
      // The same modules and tensors; tie groups compared as sets (declaration order differs
      // between a built model and ModuleTreeFor()).
      nlohmann::json built_json = nlohmann::json::parse(built.ToJson());
      nlohmann::json planned_json = nlohmann::json::parse(quantized.ToJson());
      built_json.erase("tied");
      planned_json.erase("tied");
      EXPECT_EQ(built_json, planned_json);
      EXPECT_EQ(built.TiedParameters(), quantized.TiedParameters());
    }
  }
}

TEST_F(QuantizeTest, PlansSkipTheHeadKeepInFp32ModulesAndTiedWeights) {
  MakeModelOptions o;
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config, MakeModelConfig(o));
  ACCEL_ASSERT_OK_AND_ASSIGN(dispatch::ModuleTree tree, ModuleTreeFor(config, at::kFloat));
  quant::BnbQuantizationConfig bnb;
  bnb.load_in_8bit = true;
  bnb.keep_in_fp32_modules = {"o_proj"};
  ACCEL_ASSERT_OK_AND_ASSIGN(QuantPlan plan, PlanQuantization(tree, bnb));
  EXPECT_EQ(plan.count("model.layers.0.self_attn.o_proj"), 0u);
  EXPECT_EQ(plan.count("model.layers.0.self_attn.q_proj"), 1u);
  EXPECT_EQ(plan.count("lm_head"), 0u);
  bnb.llm_int8_skip_modules = std::vector<std::string>{};  // an explicit empty list: the head too
  ACCEL_ASSERT_OK_AND_ASSIGN(plan, PlanQuantization(tree, bnb));
  EXPECT_EQ(plan.count("lm_head"), 1u);

  bnb.load_in_8bit = false;
  EXPECT_THAT(PlanQuantization(tree, bnb), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(QuantizeTest, LoadingQuantizesEachWeightExactlyAsTheQuantizers) {
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir_.path()));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor down, ckpt.Tensor("model.layers.1.mlp.down_proj.weight"));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor q_proj,
                             ckpt.Tensor("model.layers.0.self_attn.q_proj.weight"));

  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel nf4, LoadModel(dir_.path(), Options("nf4", true)));
  ACCEL_ASSERT_OK_AND_ASSIGN(quant::Quantized4bit want,
                             quant::Quantize4bit(down, quant::QuantType4bit::kNf4, 64, true));
  torch::nn::Module& module = nf4.dispatched->module();
  std::map<std::string, at::Tensor> tensors;
  for (const auto& p : module.named_parameters()) tensors[p.key()] = p.value();
  for (const auto& b : module.named_buffers()) tensors[b.key()] = b.value();
  const std::string prefix = "model.layers.1.mlp.down_proj.weight";
  EXPECT_TRUE(at::equal(tensors.at(prefix), want.packed));
  EXPECT_TRUE(at::equal(tensors.at(prefix + ".absmax"), want.absmax));
  EXPECT_TRUE(at::equal(tensors.at(prefix + ".nested_absmax"), want.nested_absmax));
  EXPECT_TRUE(at::equal(tensors.at(prefix + ".quant_map"), want.quant_map));
  EXPECT_TRUE(at::equal(tensors.at(prefix + ".nested_quant_map"), want.nested_quant_map));
  // Read as stored: no float32 copy of the absmaxes is kept.
  EXPECT_EQ(tensors.count("model.layers.1.mlp.down_proj.block_absmax"), 0u);
  EXPECT_EQ(nf4.quantization.size(), 14u);  // 7 linears a layer, lm_head kept

  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel int8, LoadModel(dir_.path(), Options("int8")));
  ACCEL_ASSERT_OK_AND_ASSIGN(quant::QuantizedInt8 want8, quant::QuantizeInt8(q_proj));
  std::map<std::string, at::Tensor> tensors8;
  for (const auto& p : int8.dispatched->module().named_parameters()) tensors8[p.key()] = p.value();
  for (const auto& b : int8.dispatched->module().named_buffers()) tensors8[b.key()] = b.value();
  EXPECT_TRUE(at::equal(tensors8.at("model.layers.0.self_attn.q_proj.weight"), want8.weight));
  EXPECT_TRUE(at::equal(tensors8.at("model.layers.0.self_attn.q_proj.SCB"), want8.scb));
  EXPECT_EQ(tensors8.at("lm_head.weight").scalar_type(), at::kFloat);
}

TEST_F(QuantizeTest, LogitsStayCloseToFloat32) {
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel full, LoadModel(dir_.path(), Options("none")));
  const std::vector<int64_t> ids = Prompt(48, full.config.vocab_size);
  const at::Tensor reference = Logits(full, ids);
  const double spread = (reference - reference.mean()).abs().mean().item<double>();
  struct Case {
    const char* method;
    bool double_quant;
    double max_mean_error;  // relative to the logits' mean distance from their mean
  };
  for (const Case& c : {Case{"int8", false, 0.05}, Case{"nf4", false, 0.35},
                        Case{"nf4", true, 0.35}, Case{"fp4", false, 0.5}}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel q,
                               LoadModel(dir_.path(), Options(c.method, c.double_quant)));
    const at::Tensor logits = Logits(q, ids);
    const at::Tensor diff = (logits - reference).abs();
    const double mean = diff.mean().item<double>() / spread;
    const double max = diff.max().item<double>() / spread;
    const double top1 =
        logits.argmax(-1).eq(reference.argmax(-1)).to(at::kFloat).mean().item<double>();
    std::printf("%-4s%s: mean |diff| %.4f, max %.4f (x the logits' spread %.4g), top-1 %.1f%%\n",
                c.method, c.double_quant ? "+dq" : "   ", mean, max, spread, 100 * top1);
    EXPECT_LT(mean, c.max_mean_error) << c.method;
    EXPECT_GT(mean, 0.0) << c.method << ": quantized logits equal float32's exactly";
    EXPECT_GE(top1, std::string(c.method) == "int8" ? 0.9 : 0.5) << c.method;
  }
}

TEST_F(QuantizeTest, ASavedModelHasTransformersLayoutAndLoadsBackToTheSameLogits) {
  for (const auto& [method, double_quant] :
       std::vector<std::pair<std::string, bool>>{{"nf4", true}, {"fp4", false}, {"int8", false}}) {
    SCOPED_TRACE(method);
    ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel q,
                               LoadModel(dir_.path(), Options(method, double_quant)));
    const std::vector<int64_t> ids = Prompt(9, q.config.vocab_size);
    const at::Tensor before = Logits(q, ids);
    TempDir out;
    ASSERT_THAT(SaveQuantizedModel(q, out.path()), IsOk());

    ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint saved, loader::Checkpoint::Open(out.path()));
    const std::string w = "model.layers.0.mlp.down_proj.weight";
    const int64_t n = 128 * 352;
    if (method == "int8") {
      EXPECT_EQ(saved.Find(w)->info.dtype, "I8");
      EXPECT_EQ(saved.Find("model.layers.0.mlp.down_proj.SCB")->info.dtype, "F32");
      EXPECT_EQ(saved.Find("model.layers.0.mlp.down_proj.weight_format")->info.shape,
                std::vector<int64_t>{});
    } else {
      EXPECT_EQ(saved.Find(w)->info.dtype, "U8");
      EXPECT_EQ(saved.Find(w)->info.shape, (std::vector<int64_t>{n / 2, 1}));
      EXPECT_EQ(saved.Find(w + ".absmax")->info.dtype, double_quant ? "U8" : "F32");
      EXPECT_EQ(saved.Find(w + ".quant_map")->info.shape, std::vector<int64_t>{16});
      EXPECT_EQ(saved.Find(w + ".nested_absmax") != nullptr, double_quant);
      EXPECT_EQ(saved.Find("model.layers.0.mlp.down_proj.block_absmax"), nullptr);  // never held
      const std::string blob = w + ".quant_state.bitsandbytes__" + method;
      ASSERT_NE(saved.Find(blob), nullptr);
      ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor bytes, saved.Tensor(blob));
      const nlohmann::json state = nlohmann::json::parse(
          std::string(static_cast<const char*>(bytes.data_ptr()), bytes.numel()));
      EXPECT_EQ(state["quant_type"], method);
      EXPECT_EQ(state["blocksize"], 64);
      EXPECT_EQ(state["dtype"], "float32");
      EXPECT_EQ(state["shape"], nlohmann::json::array({128, 352}));
    }
    EXPECT_EQ(saved.Find("lm_head.weight")->info.dtype, "F32");
    const nlohmann::json config = nlohmann::json::parse(ReadText(out.File("config.json")));
    EXPECT_EQ(config["quantization_config"]["quant_method"], "bitsandbytes");
    EXPECT_EQ(config["quantization_config"]["load_in_4bit"], method != "int8");

    // Loads as it is (no --quantize), on the cpu and from disk offload.
    ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel back, LoadModel(out.path(), Options("none")));
    EXPECT_TRUE(back.prequantized);
    EXPECT_EQ(back.quantization.size(), q.quantization.size());
    EXPECT_TRUE(at::equal(Logits(back, ids), before));
    ModelLoadOptions disk = Options("none");
    disk.device_map = "disk";
    TempDir offload;
    disk.offload_folder = offload.path();
    ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel from_disk, LoadModel(out.path(), disk));
    EXPECT_TRUE(at::equal(Logits(from_disk, ids), before));
    // The same method again is fine; another is an error.
    EXPECT_THAT(LoadModel(out.path(), Options(method == "int8" ? "int8" : method, double_quant)),
                IsOk());
    EXPECT_THAT(LoadModel(out.path(), Options(method == "int8" ? "nf4" : "int8")),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("quantized already")));
  }
}

TEST_F(QuantizeTest, QuantizingOnLoadAlsoWorksWithDiskOffload) {
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel cpu, LoadModel(dir_.path(), Options("nf4")));
  const std::vector<int64_t> ids = Prompt(5, cpu.config.vocab_size);
  ModelLoadOptions disk = Options("nf4");
  disk.device_map = "disk";
  // Quantized on loading, then written once (a real conversion): to the
  // offload folder given, else to one in the user's cache.
  TempDir offload, cache;
  ScopedEnv cache_dir("ACCEL_CACHE_DIR", cache.path());
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel cached, LoadModel(dir_.path(), disk));
  EXPECT_TRUE(at::equal(Logits(cached, ids), Logits(cpu, ids)));
  EXPECT_FALSE(FilesUnder(cache.path()).empty());
  disk.offload_folder = offload.path();
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel from_disk, LoadModel(dir_.path(), disk));
  EXPECT_TRUE(at::equal(Logits(from_disk, ids), Logits(cpu, ids)));
  EXPECT_FALSE(FilesUnder(offload.path()).empty());
}

TEST_F(QuantizeTest, BadOptionsAndBrokenCheckpointsNameTheProblem) {
  EXPECT_THAT(LoadModel(dir_.path(), Options("int4")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("quantize 'int4'")));
  EXPECT_THAT(LoadModel(dir_.path(), Options("int8", true)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("double_quant")));
  ModelLoadOptions bad_block = Options("nf4");
  bad_block.quant_blocksize = 48;
  EXPECT_THAT(LoadModel(dir_.path(), bad_block),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("quant_blocksize 48")));

  // A saved 4-bit model whose quant state blob is broken, or missing.
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel q, LoadModel(dir_.path(), Options("nf4")));
  TempDir out;
  ASSERT_THAT(SaveQuantizedModel(q, out.path()), IsOk());
  EXPECT_THAT(SaveQuantizedModel(q, dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("own folder")));
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint saved, loader::Checkpoint::Open(out.path()));
  const std::string blob = "model.layers.1.self_attn.k_proj.weight.quant_state.bitsandbytes__nf4";
  const auto rewrite = [&](const std::function<void(std::vector<loader::NamedTensor>&)>& edit) {
    std::vector<loader::NamedTensor> tensors;
    for (const auto& e : saved.tensors()) {
      tensors.emplace_back(e.info.name, saved.Tensor(e.info.name)->clone());
    }
    edit(tensors);
    ASSERT_THAT(loader::WriteSafetensors(out.File("model.safetensors"), tensors), IsOk());
  };
  rewrite([&](std::vector<loader::NamedTensor>& tensors) {
    for (auto& [name, t] : tensors) {
      if (name == blob) {
        const std::string json = R"({"quant_type": "nf4", "blocksize": "sixty-four"})";
        t = at::empty({static_cast<int64_t>(json.size())}, at::kByte);
        std::memcpy(t.data_ptr(), json.data(), json.size());
      }
    }
  });
  EXPECT_THAT(LoadModel(out.path(), Options("none")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(blob)));
  // Without its blob the layer is not known to be quantized: its packed
  // weight does not fit the float layer, and the error says which.
  rewrite([&](std::vector<loader::NamedTensor>& tensors) {
    tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                                 [&](const loader::NamedTensor& t) { return t.first == blob; }),
                  tensors.end());
  });
  EXPECT_THAT(LoadModel(out.path(), Options("none")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.layers.1.self_attn.k_proj.weight")));
}

// transformers keeps the layers a split device map puts on the cpu or the
// disk unquantized under llm_int8_enable_fp32_cpu_offload; a stored quantized
// layer is never dequantized here, so the flag is refused by name where it
// would change the model and honoured (a no-op) where it would not.
TEST_F(QuantizeTest, Fp32CpuOffloadIsRefusedWhereItWouldChangeTheModel) {
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel q, LoadModel(dir_.path(), Options("int8")));
  TempDir out;
  ASSERT_THAT(SaveQuantizedModel(q, out.path()), IsOk());
  nlohmann::json config = nlohmann::json::parse(ReadText(out.File("config.json")));
  config["quantization_config"]["llm_int8_enable_fp32_cpu_offload"] = true;
  std::ofstream(out.File("config.json")) << config.dump(2);
  // One device for everything: transformers excludes nothing either.
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel whole, LoadModel(out.path(), Options("none")));
  EXPECT_TRUE(whole.prequantized);
  // A map split over the cpu and the disk: the layers there would stay float.
  const std::string map = out.File("map.json");
  std::ofstream(map) << R"({"model.embed_tokens": "cpu", "model.layers.0": "cpu",
                           "model.layers.1": "disk", "model.norm": "cpu",
                           "model.rotary_emb": "cpu", "lm_head": "cpu"})";
  ModelLoadOptions split = Options("none");
  split.device_map = map;
  split.offload_folder = out.File("offload");
  EXPECT_THAT(LoadModel(out.path(), split),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("llm_int8_enable_fp32_cpu_offload"),
                             HasSubstr("model.layers."), HasSubstr("is stored quantized"))));
  config["quantization_config"]["llm_int8_enable_fp32_cpu_offload"] = false;
  std::ofstream(out.File("config.json")) << config.dump(2);
  EXPECT_THAT(LoadModel(out.path(), split), IsOk());
}

at::Tensor Bytes(const std::string& text) {
  at::Tensor t = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  std::memcpy(t.data_ptr(), text.data(), text.size());
  return t;
}

TEST_F(QuantizeTest, TheHookRefusesTensorsThatDoNotFitTheLayerByName) {
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel float_model, LoadModel(dir_.path(), Options("none")));
  EXPECT_THAT(SaveQuantizedModel(float_model, dir_.path() + "/out"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("without quantization")));
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint float_ckpt, loader::Checkpoint::Open(dir_.path()));
  EXPECT_THAT(PlanFromCheckpoint(float_ckpt, quant::BnbQuantizationConfig()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no quantized layer")));
  {
    TempDir bad;
    ASSERT_THAT(loader::WriteSafetensors(
                    bad.File("model.safetensors"),
                    {{"a.weight.quant_state.bitsandbytes__nf4", at::zeros({4}, at::kFloat)}}),
                IsOk());
    ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(bad.path()));
    EXPECT_THAT(PlanFromCheckpoint(ckpt, quant::BnbQuantizationConfig()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("uint8 JSON bytes")));
  }

  for (const char* method : {"nf4", "int8"}) {
    SCOPED_TRACE(method);
    const std::string layer = "model.layers.0.self_attn.q_proj";
    ACCEL_ASSERT_OK_AND_ASSIGN(loader::ModelConfig config,
                               loader::ReadModelConfig(dir_.path() + "/config.json"));
    ACCEL_ASSERT_OK_AND_ASSIGN(dispatch::ModuleTree tree, ModuleTreeFor(config, at::kFloat));
    QuantizeOptions asked;
    asked.method = method;
    ACCEL_ASSERT_OK_AND_ASSIGN(quant::BnbQuantizationConfig bnb, BnbConfigFor(asked));
    ACCEL_ASSERT_OK_AND_ASSIGN(QuantPlan plan, PlanQuantization(tree, bnb));
    std::shared_ptr<CausalLM> model;
    {
      dispatch::EmptyWeightsGuard empty;
      ACCEL_ASSERT_OK_AND_ASSIGN(model, BuildCausalLM(config, at::kFloat));
    }
    ASSERT_THAT(QuantizeLinears(*model, plan), IsOk());
    auto hook = MakeQuantizationHook(model, plan, at::kFloat);
    const auto refused = [&](const std::string& name, const at::Tensor& value,
                             const std::string& message) {
      EXPECT_TRUE(hook->Claims(name)) << name;
      EXPECT_THAT(hook->Convert(name, value),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           testing::AllOf(HasSubstr(name), HasSubstr(message))));
    };
    EXPECT_FALSE(hook->Claims("model.embed_tokens.weight"));
    EXPECT_FALSE(hook->Claims(layer + ".bias"));
    if (std::string(method) == "int8") {
      refused(layer + ".weight_format", at::zeros({2}, at::kFloat), "expected one integer");
      refused(layer + ".weight.absmax", at::zeros({4}, at::kFloat), "not a tensor of an 8-bit");
      refused(layer + ".weight", at::zeros({3, 3}, at::kFloat), "before quantizing");
      continue;
    }
    const std::string blob = layer + ".weight.quant_state.bitsandbytes__nf4";
    const std::string good = quant::QuantState4bitToJson(
        quant::QuantState4bit{quant::QuantType4bit::kNf4, 64, at::kFloat, {128, 128}});
    refused(layer + ".weight.quant_state.bitsandbytes__fp4", Bytes(good), "holds quant_type nf4");
    refused(blob, at::zeros({4}, at::kFloat), "uint8 JSON bytes");
    refused(blob,
            Bytes(quant::QuantState4bitToJson(
                quant::QuantState4bit{quant::QuantType4bit::kNf4, 64, at::kFloat, {10, 10}})),
            "does not fit a 128x128 layer");
    refused(blob,
            Bytes(quant::QuantState4bitToJson(
                quant::QuantState4bit{quant::QuantType4bit::kNf4, 128, at::kFloat, {128, 128}})),
            "built for nf4 blocksize 64");
    refused(layer + ".weight.quant_map", at::zeros({15}, at::kFloat), "16 float32 code values");
    refused(layer + ".weight.bogus", at::zeros({1}, at::kByte), "not a tensor of a 4-bit");
    // Nothing complete yet: Finish names the missing blob.
    EXPECT_THAT(hook->Finish(),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("bitsandbytes__nf4")));
    EXPECT_THAT(hook->Convert(blob, Bytes(good)), IsOk());
  }
}

TEST(QuantizableLinearTest, QuantizingALoadedLayerAndTheDeviceAgnosticPathAgree) {
  at::manual_seed(3);
  for (const auto& [method, type] : std::vector<std::pair<Method, quant::QuantType4bit>>{
           {Method::k4bit, quant::QuantType4bit::kNf4},
           {Method::k4bit, quant::QuantType4bit::kFp4},
           {Method::kInt8, quant::QuantType4bit::kNf4}}) {
    nn::Linear layer(96, 40, /*bias=*/true, at::kFloat);
    {
      at::NoGradGuard no_grad;
      layer.weight.normal_(0, 0.05);
      layer.bias.normal_(0, 0.05);
    }
    const at::Tensor x = at::randn({3, 96});
    const at::Tensor dense = at::linear(x, layer.weight, layer.bias);
    nn::LinearQuantization how;
    how.method = method;
    how.quant_type = type;
    how.double_quant = method == Method::k4bit;
    how.threshold = 0;
    ASSERT_THAT(layer.Quantize(how), IsOk());
    EXPECT_THAT(layer.Quantize(how),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("quantized already")));
    c10::InferenceMode inference;
    const at::Tensor kernel = layer.forward(x);
    const at::Tensor aten = layer.DequantizedForward(x);
    ASSERT_EQ(kernel.sizes(), dense.sizes());
    // The ATen path and the kernels dequantize alike; int8's kernel also
    // quantizes x, so it differs by that rounding.
    const double tolerance = method == Method::kInt8 ? 2e-2 : 1e-5;
    EXPECT_LT((kernel - aten).abs().max().item<double>(), tolerance) << how.ToString();
    // |y| is about 0.5 here; 4-bit keeps about 3 bits of each weight.
    EXPECT_LT((kernel - dense).abs().max().item<double>(), method == Method::kInt8 ? 0.05 : 0.3)
        << how.ToString();
    EXPECT_GT((kernel - dense).abs().max().item<double>(), 0.0) << how.ToString();
    // A prefill's many rows take the dense path; it agrees with the ATen one too.
    const at::Tensor many = at::randn({40, 96});
    EXPECT_LT((layer.forward(many) - layer.DequantizedForward(many)).abs().max().item<double>(),
              tolerance)
        << how.ToString();
  }
  // Built quantized: empty tensors of the stored layout, nothing to compute yet.
  nn::Linear4bit four(128, 16, false, at::kBFloat16, at::kBFloat16, quant::QuantType4bit::kNf4,
                      /*double_quant=*/true);
  EXPECT_EQ(four.weight.sizes(), (std::vector<int64_t>{128 * 16 / 2, 1}));
  EXPECT_EQ(four.weight_state->absmax.scalar_type(), at::kByte);
  nn::Linear8bitLt eight(128, 16, false, at::kBFloat16);
  EXPECT_EQ(eight.weight.scalar_type(), at::kChar);
  EXPECT_EQ(eight.scb.sizes(), (std::vector<int64_t>{16}));
  // A tied head cannot be quantized.
  nn::Linear tied(16, 8, false, at::kFloat, at::zeros({8, 16}));
  nn::LinearQuantization int8;
  int8.method = Method::kInt8;
  EXPECT_THAT(tied.Quantize(int8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shared")));
}

// On a CUDA device a quantized layer runs quant/cuda's kernels
// (quant/cuda_matmul.h) and agrees with the same layer on the cpu; skipped
// without the kernels, a CUDA libtorch or a device.
TEST(QuantizableLinearTest, OnCudaTheKernelsAgreeWithTheCpu) {
  if (!quant::CudaKernelsBuilt() || !at::hasCUDA() || at::getNumGPUs() == 0) {
    GTEST_SKIP() << "needs the quant CUDA kernels, a CUDA libtorch and a CUDA device";
  }
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(4);
  for (const auto& [method, type, double_quant] :
       std::vector<std::tuple<Method, quant::QuantType4bit, bool>>{
           {Method::k4bit, quant::QuantType4bit::kNf4, true},
           {Method::k4bit, quant::QuantType4bit::kFp4, false},
           {Method::kInt8, quant::QuantType4bit::kNf4, false}}) {
    nn::Linear layer(128, 48, /*bias=*/true, at::kBFloat16);
    {
      at::NoGradGuard no_grad;
      layer.weight.normal_(0, 0.05);
      layer.bias.normal_(0, 0.05);
    }
    nn::LinearQuantization how;
    how.method = method;
    how.quant_type = type;
    how.double_quant = double_quant;
    how.compute_dtype = at::kBFloat16;
    how.threshold = 6.0;
    ASSERT_THAT(layer.Quantize(how), IsOk());
    c10::InferenceMode inference;
    at::Tensor x = at::randn({1, 3, 128}).to(at::kBFloat16);
    x[0][0][7] = 9.0;  // an int8 outlier column
    const at::Tensor one = x.narrow(1, 0, 1);
    const at::Tensor cpu_many = layer.forward(x), cpu_one = layer.forward(one);
    std::vector<std::string> names;
    for (const auto& p : layer.named_parameters(true)) names.push_back(p.key());
    for (const auto& b : layer.named_buffers(true)) names.push_back(b.key());
    for (const std::string& name : names) {
      ASSERT_THAT(dispatch::SetModuleTensor(layer, name, cuda), IsOk()) << name;
    }
    ASSERT_TRUE(layer.weight.is_cuda());
    const at::Tensor cuda_many = layer.forward(x.to(cuda)), cuda_one = layer.forward(one.to(cuda));
    ASSERT_TRUE(cuda_many.is_cuda());
    // bfloat16 outputs of |y| < 2: a unit or two in the last place.
    EXPECT_LT((cuda_many.cpu().to(at::kFloat) - cpu_many.to(at::kFloat)).abs().max().item<double>(),
              0.02)
        << how.ToString();
    EXPECT_LT((cuda_one.cpu().to(at::kFloat) - cpu_one.to(at::kFloat)).abs().max().item<double>(),
              0.02)
        << how.ToString();
  }
}

TEST(QuantizedInt8Format, ATiledWeightFormatIsRefusedByName) {
  TempDir dir;
  MakeModelOptions o;
  o.hidden_size = 64;
  o.num_layers = 1;
  ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(LoadedModel q, LoadModel(dir.path(), Options("int8")));
  TempDir out;
  ASSERT_THAT(SaveQuantizedModel(q, out.path()), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint saved, loader::Checkpoint::Open(out.path()));
  std::vector<loader::NamedTensor> tensors;
  const std::string format = "model.layers.0.mlp.up_proj.weight_format";
  for (const auto& e : saved.tensors()) {
    at::Tensor t = saved.Tensor(e.info.name)->clone();
    if (e.info.name == format) t.fill_(2);
    tensors.emplace_back(e.info.name, t);
  }
  ASSERT_THAT(loader::WriteSafetensors(out.File("model.safetensors"), tensors), IsOk());
  EXPECT_THAT(LoadModel(out.path(), Options("none")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       testing::AllOf(HasSubstr(format), HasSubstr("weight format 2"))));
}

}  // namespace
}  // namespace accel::models
