// Data parallel in real processes: after backward and Finish, every rank's
// gradients equal the gradients of one model on the whole global batch.
#include "train/ddp.h"

#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "tests/testing/multiprocess.h"
#include "tests/testing/status_matchers.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::Each;
using ::testing::HasSubstr;

// Two layers and a branch that only some forwards use.
struct Net : torch::nn::Module {
  Net() {
    a = register_module("a", torch::nn::Linear(4, 8));
    b = register_module("b", torch::nn::Linear(8, 2));
    side = register_module("side", torch::nn::Linear(8, 2));
    register_buffer("steps", at::zeros({1}));
  }
  at::Tensor forward(const at::Tensor& x, bool use_side) {
    at::Tensor h = at::tanh(a->forward(x));
    return use_side ? b->forward(h) + side->forward(h) : b->forward(h);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, side{nullptr};
};

std::shared_ptr<Net> MakeNet(uint64_t seed) {
  at::manual_seed(seed);
  return std::make_shared<Net>();
}

at::Tensor Inputs(int64_t rows) {
  at::Tensor i = at::arange(rows * 4, at::kFloat).view({rows, 4});
  return at::sin(i * 0.37);
}

at::Tensor Loss(Net& net, const at::Tensor& x, bool use_side) {
  return net.forward(x, use_side).pow(2).mean();
}

NamedTensors Params(Net& net) {
  NamedTensors out;
  for (const auto& p : net.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}
NamedTensors Buffers(Net& net) {
  NamedTensors out;
  for (const auto& p : net.named_buffers()) out.emplace_back(p.key(), p.value());
  return out;
}

std::unique_ptr<ProcessGroup> Connect() {
  auto env = DetectProcessEnvironment(ProcessEnv());
  EXPECT_THAT(env, IsOk());
  auto group = ProcessGroup::Connect(*env, {});
  EXPECT_THAT(group, IsOk());
  return *std::move(group);
}

void ExpectGradsClose(Net& net, Net& ref, double tolerance) {
  auto mine = net.named_parameters();
  auto theirs = ref.named_parameters();
  for (const auto& p : mine) {
    const at::Tensor& g = p.value().grad();
    const at::Tensor& want = theirs[p.key()].grad();
    ASSERT_TRUE(g.defined()) << p.key();
    EXPECT_TRUE(at::allclose(g, want, tolerance, tolerance)) << p.key() << "\n"
                                                             << g << "\nvs\n"
                                                             << want;
  }
}

TEST(DdpWorker, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of Ddp.*";
  const std::string mode = std::getenv("DDP_MODE");
  auto group = Connect();
  const int p = group->size(), r = group->rank();
  const int64_t rows = 3;  // per rank and micro-batch
  // Rank 0's init wins: Attach broadcasts it.
  auto net = MakeNet(r == 0 ? 1 : 100 + static_cast<uint64_t>(r));
  net->named_buffers()["steps"].fill_(r == 0 ? 7 : -1);
  DdpOptions options;
  if (mode == "buckets") options.bucket_cap_mb = 0.0001;  // about 100 bytes: several buckets
  if (mode == "unused") options.find_unused_parameters = true;
  if (mode == "fp16") options.comm_hook = CommHook::kFp16;
  if (mode == "bf16") options.comm_hook = CommHook::kBf16;
  if (mode == "view") options.gradient_as_bucket_view = true;
  auto ddp = GradientSynchronizer::Attach(Params(*net), Buffers(*net), *group, options);
  if (mode == "bf16") {
    EXPECT_THAT(ddp, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NCCL")));
    return;
  }
  ASSERT_THAT(ddp, IsOk());
  EXPECT_EQ(net->named_buffers()["steps"].item<float>(), 7);
  if (mode == "buckets") {
    EXPECT_GT((*ddp)->num_buckets(), 2);
    // Reverse registration order: the last layer's parameters come first.
    EXPECT_EQ((*ddp)->bucket_names().front().front(), "side.bias");
  } else {
    EXPECT_EQ((*ddp)->num_buckets(), 1);
  }

  auto ref = MakeNet(1);
  const bool use_side = mode != "unused" && mode != "missing";
  const int micro = mode == "accumulate" ? 3 : 1;
  const int64_t global = rows * p;
  at::Tensor all = Inputs(global * micro);
  for (int m = 0; m < micro; ++m) {
    (*ddp)->set_require_sync(m == micro - 1);
    at::Tensor x = all.narrow(0, m * global + r * rows, rows);
    // The global mean loss, split: each rank's mean / P, summed by the all-reduce.
    Loss(*net, x, use_side).backward();
    absl::Status finished = (*ddp)->Finish();
    if (mode == "missing") {
      EXPECT_THAT(finished,
                  StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side.weight")));
      return;
    }
    ASSERT_THAT(finished, IsOk());
    Loss(*ref, all.narrow(0, m * global, global), use_side).backward();
  }
  const double tolerance = mode == "fp16" ? 2e-3 : 1e-6;
  if (mode == "unused") {
    // The unused branch gets zeros, like PyTorch's DDP with find_unused_parameters.
    EXPECT_TRUE(at::equal(net->side->weight.grad(), at::zeros_like(net->side->weight)));
    EXPECT_TRUE(at::allclose(net->b->weight.grad(), ref->b->weight.grad(), 1e-6, 1e-6));
  } else {
    ExpectGradsClose(*net, *ref, tolerance);
  }
  int64_t param_bytes = 0;
  for (const auto& p : net->parameters()) param_bytes += p.numel() * 4;
  // Bytes on the wire: every parameter once per sync (one sync when accumulating), half in fp16.
  const int64_t expected_bytes = mode == "fp16" ? param_bytes / 2 : param_bytes;
  EXPECT_EQ((*ddp)->reduced_bytes(), expected_bytes);
  // Buffers follow rank 0 before each forward.
  net->named_buffers()["steps"].fill_(r == 0 ? 9 : -5);
  ASSERT_THAT((*ddp)->PrepareForward(), IsOk());
  EXPECT_EQ(net->named_buffers()["steps"].item<float>(), 9);
}

void RunMode(int ranks, const std::string& mode) {
  EXPECT_THAT(test::RunRanks(ranks, "DdpWorker.Run", {{"DDP_MODE", mode}}), Each(0)) << mode;
}

TEST(Ddp, GradientsEqualOneProcessOnTheGlobalBatch) { RunMode(2, "plain"); }
TEST(Ddp, ThreeRanks) { RunMode(3, "plain"); }
TEST(Ddp, SeveralBuckets) { RunMode(2, "buckets"); }
TEST(Ddp, NoSyncAccumulatesThenSyncsTheSum) { RunMode(2, "accumulate"); }
TEST(Ddp, FindUnusedParameters) { RunMode(2, "unused"); }
TEST(Ddp, UnusedWithoutFindUnusedIsAnError) { RunMode(2, "missing"); }
TEST(Ddp, Fp16Compression) { RunMode(2, "fp16"); }
TEST(Ddp, Bf16CompressionNeedsNccl) { RunMode(2, "bf16"); }
TEST(Ddp, GradientAsBucketView) { RunMode(2, "view"); }

TEST(Ddp, BadOptions) {
  auto group = ProcessGroup::Single();
  DdpOptions options;
  options.bucket_cap_mb = 0;
  EXPECT_THAT(GradientSynchronizer::Attach({}, {}, *group, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bucket_cap_mb")));
}

}  // namespace
}  // namespace accel::train
