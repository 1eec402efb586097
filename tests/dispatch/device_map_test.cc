// Device-map planning against HuggingFace Accelerate's own test cases
// (U-numbers: tests/test_modeling_utils.py as the reference lists them) and
// the reference's derived cases (D-numbers), on the same test models.
#include "dispatch/device_map.h"

#include <map>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dispatch/internal/gpu_probe.h"
#include "tests/testing/status_matchers.h"

namespace accel::dispatch {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;
using ::testing::UnorderedElementsAre;

using StrMap = std::map<std::string, std::string>;

void Linear(ModuleTree& t, int parent, const std::string& name, int64_t in, int64_t out,
            bool bias = true) {
  int id = t.AddChild(parent, name, "Linear");
  t.AddParam(id, {"weight", {out, in}});
  if (bias) t.AddParam(id, {"bias", {out}});
}

void BatchNorm(ModuleTree& t, int parent, const std::string& name, int64_t n) {
  int id = t.AddChild(parent, name, "BatchNorm1d");
  t.AddParam(id, {"weight", {n}});
  t.AddParam(id, {"bias", {n}});
  t.AddBuffer(id, {"running_mean", {n}});
  t.AddBuffer(id, {"running_var", {n}});
  t.AddBuffer(id, {"num_batches_tracked", {}, c10::ScalarType::Long});
}

// linear1 L(3->4), batchnorm BN1d(4), linear2 L(4->5): 236 bytes in float32.
void AddModelForTest(ModuleTree& t, int node) {
  Linear(t, node, "linear1", 3, 4);
  BatchNorm(t, node, "batchnorm", 4);
  Linear(t, node, "linear2", 4, 5);
}

ModuleTree ModelForTest() {
  ModuleTree t("ModelForTest");
  AddModelForTest(t, 0);
  return t;
}

// The reference's ToyGPT: wte Embedding(1000, 64), 4 Blocks, ln_f, lm_head tied to wte.
ModuleTree ToyGpt() {
  ModuleTree t("ToyGPT");
  int wte = t.AddChild(0, "wte", "Embedding");
  t.AddParam(wte, {"weight", {1000, 64}});
  int h = t.AddChild(0, "h", "ModuleList");
  for (int i = 0; i < 4; ++i) {
    int block = t.AddChild(h, std::to_string(i), "Block");
    auto layer_norm = [&](const char* name) {
      int ln = t.AddChild(block, name, "LayerNorm");
      t.AddParam(ln, {"weight", {64}});
      t.AddParam(ln, {"bias", {64}});
    };
    layer_norm("ln_1");
    int attn = t.AddChild(block, "attn", "Attention");
    Linear(t, attn, "c_attn", 64, 192);
    Linear(t, attn, "c_proj", 64, 64);
    layer_norm("ln_2");
    int mlp = t.AddChild(block, "mlp", "MLP");
    Linear(t, mlp, "fc", 64, 256);
    Linear(t, mlp, "proj", 256, 64);
  }
  int ln_f = t.AddChild(0, "ln_f", "LayerNorm");
  t.AddParam(ln_f, {"weight", {64}});
  t.AddParam(ln_f, {"bias", {64}});
  Linear(t, 0, "lm_head", 64, 1000, /*bias=*/false);
  EXPECT_THAT(t.Tie({"wte.weight", "lm_head.weight"}), IsOk());
  return t;
}

MaxMemory Mem(std::vector<std::pair<std::string, double>> items) {
  MaxMemory mm;
  for (const auto& [device, bytes] : items) mm.emplace_back(*Placement::Parse(device), bytes);
  return mm;
}

StrMap AsMap(const DeviceMap& map) {
  StrMap out;
  for (const auto& [name, p] : map.entries()) out[name] = p.ToString();
  return out;
}

StrMap Infer(const ModuleTree& tree, const MaxMemory& mm, PlanOptions options = {},
             PlanReport* report = nullptr) {
  auto map = InferAutoDeviceMap(tree, mm, options, report);
  EXPECT_TRUE(map.ok()) << map.status();
  return map.ok() ? AsMap(*map) : StrMap{};
}

// ---- sizes (U1, U2, U4-U6) ----

TEST(DTypeByteSizeTest, MatchesAccelerate) {  // U1
  EXPECT_EQ(DTypeByteSize(c10::ScalarType::Bool), 0.125);
  EXPECT_EQ(DTypeByteSize(c10::ScalarType::Half), 2);
  EXPECT_EQ(DTypeByteSize(c10::ScalarType::BFloat16), 2);
  EXPECT_EQ(DTypeByteSize(c10::ScalarType::Float), 4);
  EXPECT_EQ(DTypeByteSize(c10::ScalarType::Double), 8);
  EXPECT_EQ(DTypeByteSize(c10::ScalarType::Char), 1);
}

TEST(ModuleTreeWalkTest, NamedTensorsParamsThenBuffers) {  // U2
  ModuleTree t = ModelForTest();
  std::vector<std::string> names;
  for (const auto& p : t.NamedParameters()) names.push_back(p.name);
  for (const auto& b : t.NamedBuffers()) names.push_back(b.name);
  EXPECT_THAT(names,
              ElementsAre("linear1.weight", "linear1.bias", "batchnorm.weight", "batchnorm.bias",
                          "linear2.weight", "linear2.bias", "batchnorm.running_mean",
                          "batchnorm.running_var", "batchnorm.num_batches_tracked"));
}

TEST(ComputeModuleSizesTest, ModelForTest) {  // U4
  ModuleSizes s = ComputeModuleSizes(ModelForTest());
  EXPECT_EQ(s.at(""), 236);
  EXPECT_EQ(s.at("linear1"), 64);
  EXPECT_EQ(s.at("linear1.weight"), 48);
  EXPECT_EQ(s.at("linear1.bias"), 16);
  EXPECT_EQ(s.at("linear2"), 100);
  EXPECT_EQ(s.at("linear2.weight"), 80);
  EXPECT_EQ(s.at("linear2.bias"), 20);
  EXPECT_EQ(s.at("batchnorm"), 72);
  EXPECT_EQ(s.at("batchnorm.running_var"), 16);
  EXPECT_EQ(s.at("batchnorm.num_batches_tracked"), 8);
  EXPECT_EQ(s.names().front(), "");
}

TEST(ComputeModuleSizesTest, HalfKeepsIntegerTensors) {  // U5
  SizeOptions half;
  half.dtype = c10::ScalarType::Half;
  ModuleSizes s = ComputeModuleSizes(ModelForTest(), half);
  EXPECT_EQ(s.at(""), 122);
  EXPECT_EQ(s.at("batchnorm"), 40);
  EXPECT_EQ(s.at("linear1"), 32);
  EXPECT_EQ(s.at("linear2"), 50);
  EXPECT_EQ(s.at("batchnorm.num_batches_tracked"), 8);
  // A dtype only ever shrinks floating tensors.
  SizeOptions wide;
  wide.dtype = c10::ScalarType::Double;
  EXPECT_EQ(ComputeModuleSizes(ModelForTest(), wide).at(""), 236);
}

TEST(ComputeModuleSizesTest, SpecialDtypesOverride) {
  SizeOptions options;
  options.dtype = c10::ScalarType::Half;
  options.special_bytes["linear2.weight"] = 4;
  options.special_bytes["linear1.weight"] = kInt4ByteSize;
  ModuleSizes s = ComputeModuleSizes(ModelForTest(), options);
  EXPECT_EQ(s.at("linear2.weight"), 80);
  EXPECT_EQ(s.at("linear1.weight"), 6);
}

TEST(ComputeModuleSizesTest, TotalBufferSize) {  // U6
  ModuleTree t = ModelForTest();
  t.AddBuffer(1, {"extra", {10, 10}});  // node 1 is linear1
  t.AddBuffer(0, {"root", {20, 10}});
  EXPECT_EQ(ComputeModuleSizes(t, {}, /*buffers_only=*/true).at(""), 1240);
  SizeOptions half;
  half.dtype = c10::ScalarType::Half;
  EXPECT_EQ(ComputeModuleSizes(t, half, /*buffers_only=*/true).at(""), 624);
}

TEST(ComputeModuleSizesTest, TiedAliasHasNoEntry) {
  ModuleTree t = ToyGpt();
  ModuleSizes s = ComputeModuleSizes(t);
  EXPECT_EQ(s.at(""), 1056256);
  EXPECT_EQ(s.at("lm_head"), 0);
  EXPECT_EQ(s.at("h.0"), 199936);
  SizeOptions half;
  half.dtype = c10::ScalarType::Half;
  EXPECT_EQ(ComputeModuleSizes(t, half).at(""), 528128);
}

TEST(GetMaxLayerSizeTest, LeavesOrNoSplitModules) {
  ModuleTree t = ToyGpt();
  ModuleSizes s = ComputeModuleSizes(t);
  LayerSize blocks = GetMaxLayerSize(t, s, {"Block"});
  EXPECT_EQ(blocks.bytes, 256000);  // wte is larger than a block
  EXPECT_THAT(blocks.names, ElementsAre("wte"));
  ModuleTree seq("Sequential");
  for (int i = 0; i < 3; ++i) Linear(seq, 0, std::to_string(i), 10, 10);
  LayerSize equal = GetMaxLayerSize(seq, ComputeModuleSizes(seq), {});
  EXPECT_EQ(equal.bytes, 440);
  EXPECT_THAT(equal.names, ElementsAre("0", "1", "2"));
}

TEST(LayerSizesOnTest, EveryLayerInsideTheEntriesOnOneDeviceLargestFirst) {
  ModuleTree t = ToyGpt();
  ModuleSizes s = ComputeModuleSizes(t);
  DeviceMap split;
  split.Set("wte", Placement::Cpu());
  split.Set("h.0", Placement::Cpu());
  split.Set("h.1", Placement::Cpu());
  split.Set("h.2", Placement::Disk());
  split.Set("h.3", Placement::Disk());
  split.Set("ln_f", Placement::Disk());
  split.Set("lm_head", Placement::Disk());
  // wte, the largest layer of all, is not on disk: it is not counted.
  EXPECT_THAT(LayerSizesOn(t, s, {"Block"}, split, Placement::Disk()),
              ElementsAre(s.at("h.2"), s.at("h.3"), s.at("ln_f"), s.at("lm_head")));
  EXPECT_THAT(LayerSizesOn(t, s, {"Block"}, split, Placement::Cpu()),
              ElementsAre(s.at("wte"), s.at("h.0"), s.at("h.1")));
  // A parent entry counts each of its layers, not itself; without no_split a
  // block's layers are its leaves.
  DeviceMap parent;
  parent.Set("wte", Placement::Cpu());
  parent.Set("h", Placement::Disk());
  std::vector<double> blocks = LayerSizesOn(t, s, {"Block"}, parent, Placement::Disk());
  EXPECT_THAT(blocks, ElementsAre(s.at("h.0"), s.at("h.1"), s.at("h.2"), s.at("h.3")));
  DeviceMap one;
  one.Set("h.3", Placement::Disk());
  EXPECT_THAT(LayerSizesOn(t, s, {}, one, Placement::Disk()),
              ElementsAre(s.at("h.3.mlp.fc"), s.at("h.3.mlp.proj"), s.at("h.3.attn.c_attn"),
                          s.at("h.3.attn.c_proj"), s.at("h.3.ln_1"), s.at("h.3.ln_2")));
  EXPECT_THAT(LayerSizesOn(t, s, {"Block"}, one, Placement::Cuda(0)), ElementsAre());
}

// ---- ties (U3) ----

TEST(TiedParametersTest, GroupsSortedAndOrderedByFirstAppearance) {
  ModuleTree t("Sequential");
  for (int i = 1; i <= 5; ++i) Linear(t, 0, "linear" + std::to_string(i), 4, 4);
  ASSERT_THAT(t.Tie({"linear4.weight", "linear1.weight"}), IsOk());
  ASSERT_THAT(t.Tie({"linear5.weight", "linear2.weight", "linear3.weight"}), IsOk());
  EXPECT_THAT(t.TiedParameters(),
              ElementsAre(ElementsAre("linear1.weight", "linear4.weight"),
                          ElementsAre("linear2.weight", "linear3.weight", "linear5.weight")));
  EXPECT_THAT(t.Tie({"linear1.bias", "nope.weight"}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(t.Tie({"linear1.bias", "linear2.weight"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tied twice")));
}

// ---- check and clean (U7, U8) ----

TEST(CheckDeviceMapTest, EveryStateDictTensorMustBeCovered) {  // U7
  ModuleTree t = ModelForTest();
  DeviceMap all;
  all.Set("", Placement::Cuda(0));
  EXPECT_THAT(CheckDeviceMap(t, all), IsOk());
  DeviceMap partial;
  partial.Set("linear1", Placement::Cuda(0));
  partial.Set("linear2", Placement::Cuda(1));
  EXPECT_THAT(CheckDeviceMap(t, partial),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("batchnorm.weight"), HasSubstr("batchnorm.running_mean"))));
  partial.Set("batchnorm", Placement::Cuda(1));
  EXPECT_THAT(CheckDeviceMap(t, partial), IsOk());
  partial.Set("invalid_module", Placement::Cpu());
  partial.Set("another_invalid", Placement::Cpu());
  std::vector<std::string> unknown;
  EXPECT_THAT(CheckDeviceMap(t, partial, &unknown), IsOk());
  EXPECT_THAT(unknown, ElementsAre("invalid_module", "another_invalid"));
}

DeviceMap MapOf(std::vector<std::pair<std::string, std::string>> items) {
  DeviceMap m;
  for (const auto& [k, v] : items) m.Set(k, *Placement::Parse(v));
  return m;
}

TEST(CleanDeviceMapTest, RegroupsLikeAccelerate) {  // U8
  EXPECT_EQ(AsMap(CleanDeviceMap(MapOf({{"a", "0"}, {"b", "0"}, {"c", "0"}}))),
            (StrMap{{"", "0"}}));
  EXPECT_EQ(AsMap(CleanDeviceMap(
                MapOf({{"a.x", "0"}, {"a.y", "0"}, {"b.x", "1"}, {"b.y", "1"}, {"c", "1"}}))),
            (StrMap{{"a", "0"}, {"b", "1"}, {"c", "1"}}));
  EXPECT_EQ(AsMap(CleanDeviceMap(MapOf({{"a.x", "0"},
                                        {"a.y", "0"},
                                        {"b.x.0", "1"},
                                        {"b.x.1", "1"},
                                        {"b.y.0", "2"},
                                        {"b.y.1", "2"},
                                        {"c", "2"}}))),
            (StrMap{{"a", "0"}, {"b.x", "1"}, {"b.y", "2"}, {"c", "2"}}));
  // One key is left alone; the order of first appearance is kept.
  DeviceMap cleaned = CleanDeviceMap(MapOf({{"z.a", "cpu"}, {"z.b", "cpu"}, {"y", "0"}}));
  EXPECT_THAT(cleaned.entries(),
              ElementsAre(Pair("z", Placement::Cpu()), Pair("y", Placement::Cuda(0))));
}

// ---- infer_auto_device_map (U9-U17, U20-U28) ----

TEST(InferAutoDeviceMapTest, U9TwoGpus) {
  PlanReport report;
  EXPECT_EQ(Infer(ModelForTest(), Mem({{"0", 200}, {"1", 200}}), {}, &report),
            (StrMap{{"linear1", "0"}, {"batchnorm", "1"}, {"linear2", "1"}}));
  EXPECT_THAT(report.min_required, IsEmpty());
}

TEST(InferAutoDeviceMapTest, U10SecondGpuHasNoReserve) {
  EXPECT_EQ(Infer(ModelForTest(), Mem({{"0", 200}, {"1", 172}, {"2", 200}})),
            (StrMap{{"linear1", "0"}, {"batchnorm", "1"}, {"linear2", "1"}}));
}

TEST(InferAutoDeviceMapTest, U11TiedWeightsStayTogether) {
  ModuleTree t("ModelForTest");
  int l1 = t.AddChild(0, "linear1", "Linear");
  t.AddParam(l1, {"weight", {5, 4}});
  t.AddParam(l1, {"bias", {4}});
  BatchNorm(t, 0, "batchnorm", 4);
  Linear(t, 0, "linear2", 4, 5);
  ASSERT_THAT(t.Tie({"linear1.weight", "linear2.weight"}), IsOk());
  EXPECT_EQ(Infer(t, Mem({{"0", 200}, {"1", 200}})), (StrMap{{"", "0"}}));
}

ModuleTree SequentialOfModelForTest() {
  ModuleTree t("Sequential");
  for (int i = 0; i < 3; ++i) AddModelForTest(t, t.AddChild(0, std::to_string(i), "ModelForTest"));
  return t;
}

TEST(InferAutoDeviceMapTest, U12SplitsNestedModules) {
  EXPECT_EQ(
      Infer(SequentialOfModelForTest(), Mem({{"0", 500}, {"1", 500}})),
      (StrMap{
          {"0", "0"}, {"1.linear1", "0"}, {"1.batchnorm", "0"}, {"1.linear2", "1"}, {"2", "1"}}));
}

TEST(InferAutoDeviceMapTest, U13NoSplitClass) {
  PlanOptions options;
  options.no_split = {"ModelForTest"};
  EXPECT_EQ(Infer(SequentialOfModelForTest(), Mem({{"0", 500}, {"1", 500}}), options),
            (StrMap{{"0", "0"}, {"1", "1"}, {"2", "1"}}));
}

ModuleTree ThreeLayers() {
  ModuleTree t("Sequential");
  for (const char* name : {"layer1", "layer2", "layer3"})
    AddModelForTest(t, t.AddChild(0, name, "ModelForTest"));
  return t;
}

TEST(InferAutoDeviceMapTest, U14TiedAcrossLayers) {
  ModuleTree t = ThreeLayers();
  ASSERT_THAT(t.Tie({"layer1.linear2.weight", "layer3.linear2.weight"}), IsOk());
  EXPECT_EQ(Infer(t, Mem({{"0", 400}, {"1", 500}})), (StrMap{{"layer1", "0"},
                                                             {"layer3.linear2", "0"},
                                                             {"layer2", "1"},
                                                             {"layer3.linear1", "1"},
                                                             {"layer3.batchnorm", "1"}}));
}

TEST(InferAutoDeviceMapTest, U15TiedToTwoLayers) {
  ModuleTree t = ThreeLayers();
  ASSERT_THAT(t.Tie({"layer1.linear2.weight", "layer2.linear2.weight", "layer3.linear2.weight"}),
              IsOk());
  EXPECT_EQ(Infer(t, Mem({{"0", 400}, {"1", 500}})), (StrMap{{"layer1", "0"},
                                                             {"layer2.linear2", "0"},
                                                             {"layer3.linear2", "0"},
                                                             {"layer2.linear1", "1"},
                                                             {"layer2.batchnorm", "1"},
                                                             {"layer3.linear1", "1"},
                                                             {"layer3.batchnorm", "1"}}));
}

TEST(InferAutoDeviceMapTest, U16TwoTieGroups) {
  ModuleTree t = ThreeLayers();
  ASSERT_THAT(t.Tie({"layer1.linear2.weight", "layer2.linear2.weight", "layer3.linear2.weight"}),
              IsOk());
  ASSERT_THAT(t.Tie({"layer1.linear1.weight", "layer2.linear1.weight"}), IsOk());
  EXPECT_EQ(Infer(t, Mem({{"0", 400}, {"1", 500}})), (StrMap{{"layer1", "0"},
                                                             {"layer2.linear1", "0"},
                                                             {"layer2.linear2", "0"},
                                                             {"layer3.linear2", "0"},
                                                             {"layer2.batchnorm", "1"},
                                                             {"layer3.linear1", "1"},
                                                             {"layer3.batchnorm", "1"}}));
}

TEST(InferAutoDeviceMapTest, U17WeightAndBiasTied) {
  ModuleTree t("Sequential");
  Linear(t, 0, "linear1", 4, 4);
  Linear(t, 0, "linear2", 6, 6);
  Linear(t, 0, "linear3", 4, 4);
  Linear(t, 0, "linear4", 6, 6);
  ASSERT_THAT(t.Tie({"linear1.weight", "linear3.weight"}), IsOk());
  ASSERT_THAT(t.Tie({"linear1.bias", "linear3.bias"}), IsOk());
  EXPECT_EQ(Infer(t, Mem({{"0", 250}, {"1", 400}})),
            (StrMap{{"linear1", "0"}, {"linear2", "1"}, {"linear3", "0"}, {"linear4", "1"}}));
}

TEST(InferAutoDeviceMapTest, U18TieIntoOwnSubmoduleDoesNotFail) {
  ModuleTree t("Model");
  int compute = t.AddChild(0, "compute", "SubLinear");
  t.AddParam(compute, {"weight", {8, 3}});
  t.AddParam(compute, {"bias", {8}});
  int sub = t.AddChild(compute, "weight_submodule", "Module");
  t.AddParam(sub, {"parameter", {8, 3}});
  ASSERT_THAT(t.Tie({"compute.weight", "compute.weight_submodule.parameter"}), IsOk());
  EXPECT_THAT(InferAutoDeviceMap(t, Mem({{"0", 4}, {"cpu", 96000}}), {}), IsOk());
}

// ModelForTest with buffers (10,2), (10,3), (10,3): modules 144 / 192 / 220 bytes.
ModuleTree WithBuffers(bool linear3) {
  ModuleTree t = ModelForTest();
  t.AddBuffer(1, {"buf", {10, 2}});
  t.AddBuffer(2, {"buf", {10, 3}});
  t.AddBuffer(3, {"buf", {10, 3}});
  if (linear3) {
    Linear(t, 0, "linear3", 4, 5);
    t.AddBuffer(4, {"buf", {10, 2}});
  }
  return t;
}

TEST(InferAutoDeviceMapTest, U20BufferWarning) {
  ModuleTree t = WithBuffers(false);
  ModuleSizes s = ComputeModuleSizes(t);
  EXPECT_EQ(s.at("linear1"), 144);
  EXPECT_EQ(s.at("batchnorm"), 192);
  EXPECT_EQ(s.at("linear2"), 220);
  PlanReport report;
  StrMap expected = {{"linear1", "0"}, {"batchnorm", "cpu"}, {"linear2", "cpu"}};
  EXPECT_EQ(Infer(t, Mem({{"0", 400}, {"cpu", 1e9}}), {}, &report), expected);
  EXPECT_THAT(report.warnings, ElementsAre(HasSubstr("offload_buffers")));
  PlanOptions offload;
  offload.offload_buffers = true;
  PlanReport quiet;
  EXPECT_EQ(Infer(t, Mem({{"0", 400}, {"cpu", 1e9}}), offload, &quiet), expected);
  EXPECT_THAT(quiet.warnings, IsEmpty());
}

TEST(InferAutoDeviceMapTest, U21U22BufferRoomOnSecondGpu) {
  ModuleTree t = WithBuffers(true);
  StrMap expected = {{"linear1", "0"}, {"batchnorm", "1"}, {"linear2", "cpu"}, {"linear3", "cpu"}};
  PlanReport roomy;
  EXPECT_EQ(Infer(t, Mem({{"0", 400}, {"1", 400}, {"cpu", 1e9}}), {}, &roomy), expected);
  EXPECT_THAT(roomy.warnings, IsEmpty());
  PlanReport tight;
  EXPECT_EQ(Infer(t, Mem({{"0", 400}, {"1", 200}, {"cpu", 1e9}}), {}, &tight), expected);
  EXPECT_THAT(tight.warnings, ElementsAre(HasSubstr("offload_buffers")));
  PlanOptions offload;
  offload.offload_buffers = true;
  PlanReport quiet;
  EXPECT_EQ(Infer(t, Mem({{"0", 400}, {"1", 200}, {"cpu", 1e9}}), offload, &quiet), expected);
  EXPECT_THAT(quiet.warnings, IsEmpty());
}

ModuleTree NestedSequential() {
  ModuleTree t("Sequential");
  int m = t.AddChild(0, "module", "Sequential");
  Linear(t, m, "linear1", 10, 4);
  Linear(t, m, "linear2", 4, 4);
  Linear(t, m, "linear3", 4, 8);
  return t;
}

TEST(InferAutoDeviceMapTest, U23NothingFitsWithoutFallback) {
  PlanReport report;
  EXPECT_EQ(Infer(NestedSequential(), Mem({{"0", 256}}), {}, &report), (StrMap{{"", "disk"}}));
  ASSERT_EQ(report.min_required.size(), 1u);
  EXPECT_EQ(report.min_required[0].first, Placement::Cuda(0));
  EXPECT_EQ(report.min_required[0].second, 336);
}

TEST(InferAutoDeviceMapTest, U24FallbackAllocation) {
  PlanOptions options;
  options.fallback_allocation = true;
  PlanReport report;
  EXPECT_EQ(
      Infer(NestedSequential(), Mem({{"0", 256}}), options, &report),
      (StrMap{{"module.linear1", "disk"}, {"module.linear2", "0"}, {"module.linear3", "disk"}}));
  EXPECT_THAT(report.min_required, IsEmpty());
}

TEST(InferAutoDeviceMapTest, U25FallbackFindsNothing) {
  ModuleTree t("Sequential");
  int m = t.AddChild(0, "module", "Sequential");
  for (int i = 0; i < 3; ++i) Linear(t, m, "l" + std::to_string(i), 10, 10);
  PlanOptions options;
  options.fallback_allocation = true;
  StrMap map = Infer(t, Mem({{"0", 30}}), options);
  for (const auto& [name, device] : map) EXPECT_NE(device, "0") << name;
}

TEST(InferAutoDeviceMapTest, U26FallbackPlacesSomething) {
  ModuleTree t("Sequential");
  for (int i = 1; i <= 3; ++i) {
    int m = t.AddChild(0, "module" + std::to_string(i), "Custom");
    int s1 = t.AddChild(m, "submodule1", "Linear");
    t.AddParam(s1, {"weight", {20, 20}});
    t.AddParam(s1, {"bias", {20}});
    Linear(t, m, "submodule2", 20, 20);
  }
  PlanOptions options;
  options.fallback_allocation = true;
  EXPECT_EQ(Infer(t, Mem({{"0", 5000}}), options), (StrMap{{"module1.submodule1", "0"},
                                                           {"module1.submodule2", "disk"},
                                                           {"module2", "disk"},
                                                           {"module3", "disk"}}));
}

TEST(InferAutoDeviceMapTest, U27FallbackWithTiedWeights) {
  ModuleTree t("TiedWeightsModel");
  Linear(t, 0, "linear1", 10, 10);
  Linear(t, 0, "linear2", 10, 10);
  ASSERT_THAT(t.Tie({"linear1.weight", "linear2.weight"}), IsOk());
  PlanOptions options;
  options.fallback_allocation = true;
  EXPECT_EQ(Infer(t, Mem({{"0", 600}}), options), (StrMap{{"", "0"}}));
}

TEST(InferAutoDeviceMapTest, U28FallbackWithBuffers) {
  ModuleTree t("Sequential");
  Linear(t, 0, "linear1", 10, 10);
  BatchNorm(t, 0, "batchnorm", 10);
  Linear(t, 0, "linear2", 10, 10);
  for (int node : {1, 2, 3}) t.AddBuffer(node, {"buf", {5}});
  PlanOptions options;
  options.fallback_allocation = true;
  PlanReport report;
  EXPECT_EQ(Infer(t, Mem({{"0", 678}}), options, &report),
            (StrMap{{"batchnorm", "0"}, {"linear1", "disk"}, {"linear2", "disk"}}));
  EXPECT_THAT(report.warnings, ::testing::Contains(HasSubstr("offload_buffers")));
}

// ---- balanced memory (U29, D7-D11) ----

TEST(GetBalancedMemoryTest, U29) {
  ModuleTree t = ModelForTest();
  auto balanced = [&](std::vector<std::pair<std::string, double>> items) {
    return GetBalancedMemory(t, Mem(items), {}, false, false);
  };
  EXPECT_EQ(balanced({{"0", 200}, {"1", 200}}), Mem({{"0", 200}, {"1", 200}}));
  EXPECT_EQ(balanced({{"0", 200}, {"2", 200}}), Mem({{"0", 200}, {"2", 200}}));
  EXPECT_EQ(balanced({{"0", 300}, {"1", 300}}), Mem({{"0", 215}, {"1", 300}}));
  EXPECT_EQ(balanced({{"0", 300}, {"1", 500}}), Mem({{"0", 215}, {"1", 500}}));
  EXPECT_EQ(balanced({{"0", 300}, {"cpu", 1000}}), Mem({{"0", 300}, {"cpu", 1000}}));
  EXPECT_EQ(balanced({{"0", 0}, {"1", 300}, {"2", 300}}), Mem({{"0", 0}, {"1", 215}, {"2", 300}}));
  EXPECT_EQ(balanced({{"0", 0}, {"cpu", 100}}), Mem({{"0", 0}, {"cpu", 100}}));
}

TEST(GetBalancedMemoryTest, D10LowZero) {
  EXPECT_EQ(
      GetBalancedMemory(ModelForTest(), Mem({{"0", 300}, {"1", 300}, {"2", 300}}), {}, true, false),
      Mem({{"0", 0}, {"1", 215}, {"2", 300}}));
}

TEST(GetBalancedMemoryTest, D11SingleProbedGpuKeepsNinetyPercent) {
  EXPECT_EQ(GetBalancedMemory(ModelForTest(), Mem({{"0", 1000}, {"cpu", 5000}}), {}, false, true),
            Mem({{"0", 900}, {"cpu", 5000}}));
}

TEST(GetBalancedMemoryTest, DiskEntryIsAcceptedAndLeftAlone) {
  // Accelerate raises here (torch.device("disk")); a disk budget is simply not a GPU.
  EXPECT_EQ(GetBalancedMemory(ModelForTest(), Mem({{"0", 300}, {"1", 300}, {"disk", 1e12}}), {},
                              false, false),
            Mem({{"0", 215}, {"1", 300}, {"disk", 1e12}}));
}

// ---- ToyGPT (D1-D9) ----

PlanOptions Blocks() {
  PlanOptions options;
  options.no_split = {"Block"};
  return options;
}

TEST(ToyGptTest, D1ReserveOnFirstGpu) {
  EXPECT_EQ(Infer(ToyGpt(), Mem({{"0", 600000}, {"1", 600000}, {"cpu", 1e7}}), Blocks()),
            (StrMap{{"wte", "0"},
                    {"lm_head", "0"},
                    {"h.0", "1"},
                    {"h.1", "1"},
                    {"h.2", "1"},
                    {"h.3", "cpu"},
                    {"ln_f", "cpu"}}));
}

TEST(ToyGptTest, D2WithoutNoSplit) {
  EXPECT_EQ(Infer(ToyGpt(), Mem({{"0", 600000}, {"1", 600000}, {"cpu", 1e7}})),
            (StrMap{{"wte", "0"},
                    {"lm_head", "0"},
                    {"h.0", "0"},
                    {"h.1.ln_1", "0"},
                    {"h.1.attn", "0"},
                    {"h.1.ln_2", "0"},
                    {"h.1.mlp", "1"},
                    {"h.2", "1"},
                    {"h.3", "1"},
                    {"ln_f", "1"}}));
}

TEST(ToyGptTest, D3SpillsToDisk) {
  EXPECT_EQ(Infer(ToyGpt(), Mem({{"0", 500000}, {"cpu", 400000}}), Blocks()),
            (StrMap{{"wte", "0"},
                    {"lm_head", "0"},
                    {"h.0", "cpu"},
                    {"h.1", "disk"},
                    {"h.2", "disk"},
                    {"h.3", "disk"},
                    {"ln_f", "disk"}}));
}

TEST(ToyGptTest, D4AllOnDisk) {
  PlanReport report;
  EXPECT_EQ(Infer(ToyGpt(), Mem({{"0", 300000}, {"cpu", 300000}}), Blocks(), &report),
            (StrMap{{"", "disk"}}));
  EXPECT_THAT(report.min_required,
              ElementsAre(Pair(Placement::Cuda(0), 455936), Pair(Placement::Cpu(), 455936)));
}

TEST(ToyGptTest, D5CpuOnly) {
  EXPECT_EQ(Infer(ToyGpt(), Mem({{"cpu", 600000}}), Blocks()),
            (StrMap{{"wte", "cpu"}, {"lm_head", "cpu"}, {"h", "disk"}, {"ln_f", "disk"}}));
}

TEST(ToyGptTest, D6HalfFitsOneGpu) {
  PlanOptions options = Blocks();
  options.sizes.dtype = c10::ScalarType::Half;
  EXPECT_EQ(Infer(ToyGpt(), *ParseMaxMemory("0=1MB,1=1MB"), options), (StrMap{{"", "0"}}));
}

TEST(ToyGptTest, D7BalancedLeavesRoomyBudgetsAlone) {
  auto map =
      PlanDeviceMap(ToyGpt(), "balanced", Mem({{"0", 6e5}, {"1", 6e5}, {"cpu", 1e7}}), Blocks());
  ASSERT_THAT(map, IsOk());
  EXPECT_EQ(AsMap(*map), (StrMap{{"wte", "0"},
                                 {"lm_head", "0"},
                                 {"h.0", "1"},
                                 {"h.1", "1"},
                                 {"h.2", "1"},
                                 {"h.3", "cpu"},
                                 {"ln_f", "cpu"}}));
}

TEST(ToyGptTest, D8BalancedLow0) {
  auto map = PlanDeviceMap(ToyGpt(), "balanced_low_0",
                           Mem({{"0", 6e5}, {"1", 6e5}, {"2", 6e5}, {"cpu", 1e7}}), Blocks());
  ASSERT_THAT(map, IsOk());
  EXPECT_EQ(AsMap(*map), (StrMap{{"wte", "1"},
                                 {"lm_head", "1"},
                                 {"h.0", "1"},
                                 {"h.1", "2"},
                                 {"h.2", "2"},
                                 {"h.3", "2"},
                                 {"ln_f", "cpu"}}));
}

TEST(ToyGptTest, D9BalancedThreeGpus) {
  auto map = PlanDeviceMap(ToyGpt(), "auto", Mem({{"0", 6e5}, {"1", 6e5}, {"2", 6e5}}), Blocks());
  ASSERT_THAT(map, IsOk());
  EXPECT_EQ(AsMap(*map), (StrMap{{"wte", "0"},
                                 {"lm_head", "0"},
                                 {"h.0", "1"},
                                 {"h.1", "1"},
                                 {"h.2", "1"},
                                 {"h.3", "2"},
                                 {"ln_f", "2"}}));
}

TEST(PlanDeviceMapTest, UnknownStrategyIsInvalid) {
  EXPECT_THAT(PlanDeviceMap(ToyGpt(), "greedy", Mem({{"0", 1e6}}), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'greedy'")));
}

TEST(PlanDeviceMapTest, EveryPlanPassesTheCheck) {
  for (const char* strategy : {"auto", "balanced", "balanced_low_0", "sequential"}) {
    for (double gpu : {1e5, 3e5, 6e5, 2e6}) {
      auto map = PlanDeviceMap(ToyGpt(), strategy, Mem({{"0", gpu}, {"1", gpu}, {"cpu", 4e5}}), {});
      ASSERT_THAT(map, IsOk());
      EXPECT_THAT(CheckDeviceMap(ToyGpt(), *map), IsOk())
          << strategy << " " << gpu << " " << map->ToJson();
    }
  }
}

TEST(PlanDeviceMapTest, SplitModulesKeepTheirBuffers) {
  // Accelerate drops a split module's direct buffers (its issue #3956); here they are placed.
  ModuleTree t("Model");
  int inner = t.AddChild(0, "inner", "Block");
  t.AddBuffer(inner, {"scale", {4}});
  Linear(t, inner, "a", 100, 100);
  Linear(t, inner, "b", 100, 100);
  auto map = InferAutoDeviceMap(t, Mem({{"0", 50000}, {"cpu", 1e9}}), {});
  ASSERT_THAT(map, IsOk());
  EXPECT_THAT(CheckDeviceMap(t, *map), IsOk()) << map->ToJson();
  EXPECT_TRUE(map->Lookup("inner.scale").has_value());
}

// ---- max_memory strings and JSON maps ----

TEST(ParseMaxMemoryTest, OrdersGpusThenCpuThenDisk) {
  auto mm = ParseMaxMemory("cpu=30GiB, disk=1TB, 1=10GiB, 0=10GB");
  ASSERT_THAT(mm, IsOk());
  EXPECT_THAT(*mm,
              ElementsAre(Pair(Placement::Cuda(0), 1e10), Pair(Placement::Cuda(1), 10737418240.0),
                          Pair(Placement::Cpu(), 32212254720.0), Pair(Placement::Disk(), 1e12)));
  EXPECT_THAT(ParseMaxMemory("cuda:3=1000"), IsOk());
}

TEST(ParseMaxMemoryTest, BadEntriesNameTheEntry) {
  EXPECT_THAT(ParseMaxMemory("0=10GiB,mps=1GB"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'mps=1GB'")));
  EXPECT_THAT(ParseMaxMemory("0=lots"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'0=lots'")));
  EXPECT_THAT(ParseMaxMemory("0"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("DEVICE=SIZE")));
  EXPECT_THAT(ParseMaxMemory("0=1GB,0=2GB"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("twice")));
  EXPECT_THAT(ParseMaxMemory(""), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(GpuProbeTest, VisibleDevicesFollowCudasRules) {
  using internal::ParseVisibleDevices;
  EXPECT_EQ(ParseVisibleDevices(nullptr), std::nullopt);
  EXPECT_EQ(ParseVisibleDevices("2,0"), (std::vector<int>{2, 0}));
  EXPECT_EQ(ParseVisibleDevices(" 1 , 3 "), (std::vector<int>{1, 3}));
  EXPECT_EQ(ParseVisibleDevices(""), std::vector<int>{});
  EXPECT_EQ(ParseVisibleDevices("-1"), std::vector<int>{});
  EXPECT_EQ(ParseVisibleDevices("0,x,1"), (std::vector<int>{0}));  // CUDA stops at an invalid entry
  EXPECT_EQ(ParseVisibleDevices("GPU-1234-abcd"), std::nullopt);
}

TEST(ProbeMaxMemoryTest, ReportsHostMemory) {
  auto mm = ProbeMaxMemory();
  ASSERT_THAT(mm, IsOk());
  ASSERT_FALSE(mm->empty());
  EXPECT_EQ(mm->back().first, Placement::Cpu());
  EXPECT_GT(mm->back().second, 1 << 20);
}

TEST(DeviceMapJsonTest, RoundTripsAndRejectsNonDevices) {
  DeviceMap m = MapOf({{"model.embed", "0"}, {"model.layers", "cpu"}, {"lm_head", "disk"}});
  EXPECT_EQ(m.ToJson(), R"({"model.embed":0,"model.layers":"cpu","lm_head":"disk"})");
  auto back = DeviceMap::FromJson(m.ToJson(), "map.json");
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(*back, m);
  EXPECT_EQ(back->Lookup("model.layers.3.mlp.weight"), Placement::Cpu());
  EXPECT_EQ(back->Lookup("other"), std::nullopt);
  EXPECT_THAT(
      DeviceMap::FromJson(R"({"a": "gpu"})", "map.json"),
      StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("map.json"), HasSubstr("'a'"))));
  EXPECT_THAT(DeviceMap::FromJson(R"({"a": -1})", "m"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DeviceMap::FromJson("[0]", "m"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DeviceMap::FromJson("{", "m"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("JSON")));
}

}  // namespace
}  // namespace accel::dispatch

// ---- expert-granular placement (PlanOptions::expert_lists) ---------------------

namespace accel::dispatch {
namespace {

// A mixture-of-experts toy: an embedding, 2 blocks of attention (4 KiB) and
// a sparse block of a router (256 B) and 4 experts (4 KiB each), a head.
ModuleTree ToyMoe() {
  ModuleTree t("ToyMoe");
  int embed = t.AddChild(0, "embed", "Embedding");
  t.AddParam(embed, {"weight", {64, 16}});  // 4 KiB
  int layers = t.AddChild(0, "layers", "ModuleList");
  for (int i = 0; i < 2; ++i) {
    int block = t.AddChild(layers, std::to_string(i), "Block");
    Linear(t, block, "attn", 32, 32, /*bias=*/false);  // 4 KiB
    int moe = t.AddChild(block, "moe", "SparseMoeBlock");
    Linear(t, moe, "gate", 16, 4, /*bias=*/false);  // 256 B
    int experts = t.AddChild(moe, "experts", "ModuleList");
    for (int e = 0; e < 4; ++e) Linear(t, experts, std::to_string(e), 32, 32, /*bias=*/false);
  }
  Linear(t, 0, "head", 16, 64, /*bias=*/false);  // 4 KiB
  return t;
}

PlanOptions MoeOptions() {
  PlanOptions o;
  o.no_split = {"Block"};
  o.expert_lists = {"layers.0.moe.experts", "layers.1.moe.experts"};
  return o;
}

TEST(ExpertPlacementTest, WithoutExpertListsThePlanIsAccelerates) {
  const ModuleTree t = ToyMoe();
  PlanOptions o = MoeOptions();
  o.expert_lists.clear();
  ACCEL_ASSERT_OK_AND_ASSIGN(MaxMemory mm, ParseMaxMemory("cpu=47000"));
  ACCEL_ASSERT_OK_AND_ASSIGN(DeviceMap map, PlanDeviceMap(t, "sequential", mm, o));
  // Blocks (20.25 KiB) are whole: with the next one reserved as the largest
  // layer, the first fits beside the embedding and the second does not.
  EXPECT_EQ(map.Lookup("layers.0.moe.experts.3"), Placement::Cpu());
  EXPECT_EQ(map.Lookup("layers.1.attn.weight"), Placement::Disk());
  EXPECT_EQ(map.Lookup("layers.1.moe.experts.0.weight"), Placement::Disk());
}

TEST(ExpertPlacementTest, ExpertsFillTheRoomTheRestLeavesAfterTheCache) {
  const ModuleTree t = ToyMoe();
  PlanOptions o = MoeOptions();
  o.expert_cache_bytes = 8192;  // two experts
  // Dense parts: 4 + 2 x (4 + 0.25) + 4 KiB = 16.5 KiB; with the 8 KiB cache,
  // 40000 bytes leave room for 3 experts (12 KiB) of the 8.
  ACCEL_ASSERT_OK_AND_ASSIGN(MaxMemory mm, ParseMaxMemory("cpu=40000"));
  PlanReport report;
  ACCEL_ASSERT_OK_AND_ASSIGN(DeviceMap map, PlanDeviceMap(t, "sequential", mm, o, false, &report));
  for (const char* dense : {"embed.weight", "layers.0.attn.weight", "layers.0.moe.gate.weight",
                            "layers.1.attn.weight", "layers.1.moe.gate.weight", "head.weight"}) {
    EXPECT_EQ(map.Lookup(dense), Placement::Cpu()) << dense;
  }
  std::vector<std::string> on_cpu, on_disk;
  for (int layer = 0; layer < 2; ++layer) {
    for (int e = 0; e < 4; ++e) {
      const std::string name =
          "layers." + std::to_string(layer) + ".moe.experts." + std::to_string(e) + ".weight";
      (map.Lookup(name) == Placement::Cpu() ? on_cpu : on_disk).push_back(name);
    }
  }
  EXPECT_THAT(on_cpu, ElementsAre("layers.0.moe.experts.0.weight", "layers.0.moe.experts.1.weight",
                                  "layers.0.moe.experts.2.weight"));
  EXPECT_EQ(on_disk.size(), 5u);
  EXPECT_EQ(report.expert_cache_bytes, 8192);
  // The cache is counted in what the cpu uses, and it stays within its budget.
  double cpu = 0;
  for (const auto& [p, bytes] : report.used) {
    if (p == Placement::Cpu()) cpu = bytes;
  }
  EXPECT_EQ(cpu, 16.5 * 1024 + 3 * 4096 + 8192);
  EXPECT_LE(cpu, 40000);
  // Every tensor is placed, and no key nests inside another.
  EXPECT_THAT(CheckDeviceMap(t, map), IsOk());
  for (const auto& [a, pa] : map.entries()) {
    for (const auto& [b, pb] : map.entries()) {
      EXPECT_FALSE(a != b && b.rfind(a + ".", 0) == 0) << a << " holds " << b;
    }
  }
}

TEST(ExpertPlacementTest, WhenEveryExpertFitsNoCacheIsKept) {
  const ModuleTree t = ToyMoe();
  PlanOptions o = MoeOptions();
  o.expert_cache_bytes = 8192;
  ACCEL_ASSERT_OK_AND_ASSIGN(MaxMemory mm, ParseMaxMemory("cpu=1MB"));
  PlanReport report;
  ACCEL_ASSERT_OK_AND_ASSIGN(DeviceMap map, PlanDeviceMap(t, "sequential", mm, o, false, &report));
  EXPECT_THAT(map.entries(), ElementsAre(Pair("", Placement::Cpu())));
  EXPECT_EQ(report.expert_cache_bytes, 0);
}

TEST(ExpertPlacementTest, AGpuTakesTheRestThenExpertsSpillToCpuAndDisk) {
  const ModuleTree t = ToyMoe();
  PlanOptions o = MoeOptions();
  o.expert_cache_bytes = 4096;
  // GPU 0: 16.5 KiB of dense parts + 4 KiB of cache + 1 expert; cpu: 4 experts; disk: the rest.
  ACCEL_ASSERT_OK_AND_ASSIGN(MaxMemory mm, ParseMaxMemory("0=26000,cpu=16384"));
  PlanReport report;
  ACCEL_ASSERT_OK_AND_ASSIGN(DeviceMap map, PlanDeviceMap(t, "sequential", mm, o, false, &report));
  EXPECT_EQ(map.Lookup("layers.1.attn.weight"), Placement::Cuda(0));
  EXPECT_EQ(map.Lookup("layers.0.moe.experts.0.weight"), Placement::Cuda(0));
  EXPECT_EQ(map.Lookup("layers.0.moe.experts.1.weight"), Placement::Cpu());
  EXPECT_EQ(map.Lookup("layers.1.moe.experts.0.weight"), Placement::Cpu());
  EXPECT_EQ(map.Lookup("layers.1.moe.experts.1.weight"), Placement::Disk());
  EXPECT_EQ(report.expert_cache_bytes, 4096);
}

TEST(ExpertPlacementTest, AnUnknownExpertListIsAnError) {
  PlanOptions o = MoeOptions();
  o.expert_lists = {"layers.7.moe.experts"};
  ACCEL_ASSERT_OK_AND_ASSIGN(MaxMemory mm, ParseMaxMemory("cpu=1MB"));
  EXPECT_THAT(PlanDeviceMap(ToyMoe(), "sequential", mm, o),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("layers.7.moe.experts")));
}

}  // namespace
}  // namespace accel::dispatch
