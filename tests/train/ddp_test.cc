// Data parallel in real processes: after backward and Finish, every rank's
// gradients equal the gradients of one model on the whole global batch.
#include "train/ddp.h"

#include <algorithm>
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
using ::testing::AllOf;
using ::testing::Each;
using ::testing::HasSubstr;
using ::testing::Not;

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

// `scale`: both sides are divided by it first (a loss-scaled run).
void ExpectGradsClose(Net& net, Net& ref, double tolerance, double scale = 1) {
  auto mine = net.named_parameters();
  auto theirs = ref.named_parameters();
  for (const auto& p : mine) {
    const at::Tensor& g = p.value().grad();
    ASSERT_TRUE(g.defined()) << p.key();
    at::Tensor got = g / scale;
    at::Tensor want = theirs[p.key()].grad() / scale;
    EXPECT_TRUE(at::allclose(got, want, tolerance, tolerance)) << p.key() << "\n"
                                                               << got << "\nvs\n"
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
  if (mode == "unused" || mode == "partial") options.find_unused_parameters = true;
  if (mode == "fp16" || mode == "fp16_scaled") options.comm_hook = CommHook::kFp16;
  if (mode == "bf16") options.comm_hook = CommHook::kBf16;
  if (mode == "view") options.gradient_as_bucket_view = true;
  auto ddp = GradientSynchronizer::Attach(Params(*net), Buffers(*net), *group, options);
  ASSERT_THAT(ddp, IsOk());
  EXPECT_EQ(net->named_buffers()["steps"].item<float>(), 7);
  if (mode == "buckets") {
    EXPECT_GT((*ddp)->num_buckets(), 2);
    // Reverse registration order: the last layer's parameters come first.
    EXPECT_EQ((*ddp)->bucket_names().front().front(), "side.bias");
  } else {
    EXPECT_EQ((*ddp)->num_buckets(), 1);
    EXPECT_EQ((*ddp)->bucket_names().front(),
              std::vector<std::string>(
                  {"side.bias", "side.weight", "b.bias", "b.weight", "a.bias", "a.weight"}));
  }

  auto ref = MakeNet(1);
  // Whether rank k's forward takes the side branch: no rank ("unused",
  // "missing"), rank 0 only ("partial"), every rank otherwise.
  auto uses_side = [&](int k) {
    if (mode == "unused" || mode == "missing") return false;
    return mode != "partial" || k == 0;
  };
  const int micro = mode == "accumulate" ? 3 : 1;
  const int steps = mode == "view" ? 2 : 1;  // the second reuses the bucket views
  const int64_t global = rows * p;
  at::Tensor all = Inputs(global * micro * steps);
  // "fp16_scaled": the loss is scaled (as fp16 loss scaling does) so that the
  // largest averaged gradient is 45000: it fits in float16 (65504), the sum
  // over two ranks would not. The same on every rank (the reference's init).
  double scale = 1;
  if (mode == "fp16_scaled") {
    auto probe = MakeNet(1);
    at::Tensor loss = at::zeros({});
    for (int k = 0; k < p; ++k) loss = loss + Loss(*probe, all.narrow(0, k * rows, rows), true) / p;
    loss.backward();
    double largest = 0;
    for (const auto& t : probe->parameters()) {
      largest = std::max(largest, t.grad().abs().max().item<double>());
    }
    scale = 45000 / largest;
  }
  for (int step = 0; step < steps; ++step) {
    if (step > 0) {
      // zero_grad without set_to_none: the views stay views.
      for (auto& t : net->parameters()) t.mutable_grad().zero_();
      for (auto& t : ref->parameters()) t.mutable_grad().zero_();
    }
    for (int m = 0; m < micro; ++m) {
      (*ddp)->set_require_sync(m == micro - 1);
      EXPECT_EQ((*ddp)->require_sync(), m == micro - 1);
      const int64_t first = (step * micro + m) * global;
      // The global mean loss, split: each rank's mean / P, summed by the all-reduce.
      (Loss(*net, all.narrow(0, first + r * rows, rows), uses_side(r)) * scale).backward();
      absl::Status finished = (*ddp)->Finish();
      if (mode == "missing") {
        EXPECT_THAT(finished, StatusIs(absl::StatusCode::kFailedPrecondition,
                                       AllOf(HasSubstr("side.weight"), HasSubstr("side.bias"),
                                             Not(HasSubstr("a.weight")))));
        return;
      }
      ASSERT_THAT(finished, IsOk());
      // The reference: one model, every rank's rows, each as its rank's forward.
      at::Tensor loss = at::zeros({});
      for (int k = 0; k < p; ++k) {
        loss = loss + Loss(*ref, all.narrow(0, first + k * rows, rows), uses_side(k)) / p;
      }
      loss = loss * scale;
      loss.backward();
    }
  }
  const bool fp16 = mode == "fp16" || mode == "fp16_scaled";
  const double tolerance = fp16 ? 2e-3 : mode == "bf16" ? 1e-2 : 1e-6;
  if (mode == "unused") {
    // No rank used the branch: its gradients stay undefined, as PyTorch's DDP
    // leaves them, so an optimizer skips them.
    EXPECT_FALSE(net->side->weight.grad().defined());
    EXPECT_FALSE(net->side->bias.grad().defined());
    EXPECT_TRUE(at::allclose(net->b->weight.grad(), ref->b->weight.grad(), 1e-6, 1e-6));
    EXPECT_TRUE(at::allclose(net->a->weight.grad(), ref->a->weight.grad(), 1e-6, 1e-6));
  } else {
    // "partial": ranks that skipped the branch still hold rank 0's share.
    ExpectGradsClose(*net, *ref, tolerance, scale);
  }
  if (mode == "view") {
    // Every gradient is a view of the one bucket: no copies.
    const at::Tensor& first = net->a->weight.grad();
    for (const auto& t : net->parameters()) {
      EXPECT_TRUE(t.grad().is_alias_of(first));
    }
  }
  int64_t param_bytes = 0;
  for (const auto& t : net->parameters()) param_bytes += t.numel() * 4;
  // Bytes on the wire: every parameter once per sync (one sync when
  // accumulating), unused ones as zeros, half of that under a 16-bit hook.
  const bool half = fp16 || mode == "bf16";
  EXPECT_EQ((*ddp)->reduced_bytes(), steps * (half ? param_bytes / 2 : param_bytes));
  EXPECT_GE((*ddp)->wait_seconds(), 0);
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
TEST(Ddp, FindUnusedParametersNoRankUsed) { RunMode(2, "unused"); }
TEST(Ddp, FindUnusedParametersOneRankUsed) { RunMode(3, "partial"); }
TEST(Ddp, UnusedWithoutFindUnusedIsAnError) { RunMode(2, "missing"); }
TEST(Ddp, Fp16Compression) { RunMode(2, "fp16"); }
TEST(Ddp, Bf16Compression) { RunMode(2, "bf16"); }
// Divided before the fp16 sum, as PyTorch's hook does: a sum that overflows
// float16 where the average does not still arrives finite and right.
TEST(Ddp, Fp16CompressionDividesBeforeTheSum) { RunMode(2, "fp16_scaled"); }
TEST(Ddp, GradientAsBucketView) { RunMode(2, "view"); }

TEST(Ddp, BadOptions) {
  auto group = ProcessGroup::Single();
  DdpOptions options;
  options.bucket_cap_mb = 0;
  EXPECT_THAT(GradientSynchronizer::Attach({}, {}, *group, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bucket_cap_mb")));
  at::Tensor leaf = at::ones({2}).requires_grad_();
  EXPECT_THAT(GradientSynchronizer::Attach({{"twice", leaf * 2}}, {}, *group, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("twice"), HasSubstr("not a leaf"))));
  EXPECT_THAT(
      GradientSynchronizer::Attach({{"w", leaf}}, {{"running_mean", at::Tensor()}}, *group, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("buffer running_mean is undefined")));
  EXPECT_THAT(GradientSynchronizer::Attach({{"ghost", at::Tensor()}}, {}, *group, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("parameter ghost")));
}

// PyTorch's bucketing: reverse registration order, the first bucket capped at
// 1 MiB, then bucket_cap_mb; one dtype per bucket; frozen parameters skipped.
TEST(Ddp, BucketLayoutInOneProcess) {
  auto group = ProcessGroup::Single();
  const int64_t half_mib = 128 * 1024;  // floats
  NamedTensors params;
  for (int i = 0; i < 5; ++i) {
    params.emplace_back("p" + std::to_string(i), at::ones({half_mib}).requires_grad_());
  }
  params.emplace_back("frozen", at::ones({4}));
  params.emplace_back("d", at::ones({2}, at::kDouble).requires_grad_());
  params.emplace_back("e", at::ones({2}, at::kDouble).requires_grad_());
  DdpOptions options;
  options.bucket_cap_mb = 1.5;
  auto ddp = GradientSynchronizer::Attach(params, {}, *group, options);
  ASSERT_THAT(ddp, IsOk());
  using Names = std::vector<std::vector<std::string>>;
  // The doubles first (registered last); the floats' first bucket holds 1 MiB
  // (p4, p3), the next 1.5 MiB (p2, p1, p0).
  EXPECT_EQ((*ddp)->bucket_names(), Names({{"e", "d"}, {"p4", "p3"}, {"p2", "p1", "p0"}}));

  // One process: Finish leaves each gradient as backward made it.
  at::Tensor loss = at::zeros({});
  for (int i = 0; i < 5; ++i) loss = loss + params[i].second.sum() * (i + 1);
  loss = loss + (params[6].second * params[7].second).sum().to(at::kFloat);
  loss.backward();
  ASSERT_THAT((*ddp)->Finish(), IsOk());
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(at::equal(params[i].second.grad(), at::full({half_mib}, i + 1.0f)));
  }
  EXPECT_FALSE(params[5].second.grad().defined());
  EXPECT_TRUE(at::equal(params[6].second.grad(), at::ones({2}, at::kDouble)));
  EXPECT_EQ((*ddp)->reduced_bytes(), 5 * half_mib * 4 + 2 * 2 * 8);

  // no_sync: nothing happens, and Finish is a no-op however far backward got.
  (*ddp)->set_require_sync(false);
  (params[0].second.sum() * 2).backward();
  ASSERT_THAT((*ddp)->Finish(), IsOk());
  EXPECT_TRUE(at::equal(params[0].second.grad(), at::full({half_mib}, 3.0f)));
  EXPECT_EQ((*ddp)->reduced_bytes(), 5 * half_mib * 4 + 2 * 2 * 8);
}

}  // namespace
}  // namespace accel::train
