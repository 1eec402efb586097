#include "dispatch/module_tree.h"

#include <string>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "tests/testing/status_matchers.h"

namespace accel::dispatch {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kTree[] = R"({
  "class": "ToyModel",
  "params": [{"name": "scale", "shape": [], "dtype": "float32"}],
  "buffers": [{"name": "mask", "shape": [4, 4], "dtype": "bool", "persistent": false}],
  "children": [
    {"name": "embed", "class": "Embedding", "params": [{"name": "weight", "shape": [10, 4], "dtype": "bfloat16"}]},
    {"name": "block", "class": "Block", "children": [
      {"name": "proj", "class": "Linear", "params": [{"name": "weight", "shape": [4, 4]}, {"name": "bias", "shape": [4]}]}
    ]},
    {"name": "head", "class": "Linear", "params": [{"name": "weight", "shape": [10, 4], "dtype": "bfloat16"}]}
  ],
  "tied": [["embed.weight", "head.weight"]]
})";

TEST(ModuleTreeTest, ReadsTheJsonForm) {
  auto tree = ModuleTree::FromJson(kTree, "tree.json");
  ASSERT_THAT(tree, IsOk());
  EXPECT_EQ(tree->node(0).class_name, "ToyModel");
  std::vector<std::string> params;
  for (const auto& p : tree->NamedParameters()) params.push_back(p.name);
  EXPECT_THAT(params, ElementsAre("scale", "embed.weight", "block.proj.weight", "block.proj.bias"));
  ASSERT_EQ(tree->NamedBuffers().size(), 1u);
  EXPECT_FALSE(tree->NamedBuffers()[0].decl->persistent);
  EXPECT_EQ(tree->NamedBuffers()[0].decl->dtype, c10::ScalarType::Bool);
  EXPECT_THAT(tree->TiedParameters(), ElementsAre(ElementsAre("embed.weight", "head.weight")));
  // Non-persistent buffers are not in the state dict; both tied names are.
  EXPECT_THAT(tree->StateDictKeys(), ElementsAre("scale", "embed.weight", "block.proj.weight",
                                                 "block.proj.bias", "head.weight"));
  EXPECT_EQ(*tree->FindModule("block.proj"), 3);
  EXPECT_THAT(tree->FindModule("block.nope"), StatusIs(absl::StatusCode::kNotFound));
}

TEST(ModuleTreeTest, JsonRoundTrips) {
  auto tree = ModuleTree::FromJson(kTree, "tree.json");
  ASSERT_THAT(tree, IsOk());
  auto again = ModuleTree::FromJson(tree->ToJson(), "again");
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->ToJson(), tree->ToJson());
}

TEST(ModuleTreeTest, BadJsonNamesThePath) {
  auto err = [](const char* text) { return ModuleTree::FromJson(text, "t.json"); };
  EXPECT_THAT(err("{"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("invalid JSON")));
  EXPECT_THAT(err("[]"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("module object")));
  EXPECT_THAT(err(R"({"children": [{"name": "a", "params": [{"name": "w", "shape": [-1]}]}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("t.json"), HasSubstr("a.params[0]"))));
  EXPECT_THAT(err(R"({"params": [{"name": "w", "shape": [1], "dtype": "float31"}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("float31")));
  EXPECT_THAT(err(R"({"children": [{"name": "a"}, {"name": "a"}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("defined twice")));
  EXPECT_THAT(err(R"({"children": [{"name": "a.b"}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("contains a '.'")));
  EXPECT_THAT(err(R"({"params": [{"name": "w", "shape": [1], "persistent": true}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("only for buffers")));
  EXPECT_THAT(
      err(R"({"params": [{"name": "w", "shape": [2]}, {"name": "v", "shape": [3]}], "tied": [["w", "v"]]})"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("tied[0]"), HasSubstr("differ"))));
  EXPECT_THAT(err(R"({"children": [{"name": "a", "tied": []}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("only allowed at the root")));
  std::string deep = std::string(1000, '[') + std::string(1000, ']');
  EXPECT_THAT(err(deep.c_str()), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("nests deeper than 256 levels")));
}

// A module holding the same tensor twice, as a tied embedding and head do.
struct TiedPair : torch::nn::Module {
  TiedPair() : torch::nn::Module("TiedPair") {
    at::Tensor shared = at::ones({6, 3});
    first = register_module("first", std::make_shared<Holder>(shared));
    second = register_module("second", std::make_shared<Holder>(shared));
  }
  struct Holder : torch::nn::Module {
    explicit Holder(const at::Tensor& w) : torch::nn::Module("Holder") {
      register_parameter("weight", w);
    }
  };
  std::shared_ptr<Holder> first, second;
};

TEST(ModuleTreeTest, FromLibtorchModules) {
  torch::nn::Sequential seq(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4),
                            torch::nn::Linear(4, 5));
  auto tree = ModuleTree::FromModule(*seq);
  ASSERT_THAT(tree, IsOk());
  EXPECT_EQ(tree->node(0).class_name, "Sequential");
  EXPECT_EQ(tree->node(1).class_name, "Linear");
  EXPECT_EQ(tree->node(2).class_name, "BatchNorm1d");
  std::vector<std::string> buffers;
  for (const auto& b : tree->NamedBuffers()) buffers.push_back(b.name);
  EXPECT_THAT(buffers, ElementsAre("1.running_mean", "1.running_var", "1.num_batches_tracked"));
  EXPECT_EQ(tree->NamedBuffers()[2].decl->dtype, c10::ScalarType::Long);
  EXPECT_THAT(tree->TiedParameters(), ::testing::IsEmpty());

  TiedPair pair;
  auto tied = ModuleTree::FromModule(pair);
  ASSERT_THAT(tied, IsOk());
  EXPECT_THAT(tied->TiedParameters(), ElementsAre(ElementsAre("first.weight", "second.weight")));
  EXPECT_EQ(tied->NamedParameters().size(), 1u);
}

}  // namespace
}  // namespace accel::dispatch
