// Fully sharded data parallel in real processes over gloo: after N optimizer
// steps the weights equal data parallel's (each strategy, with gradient
// accumulation and clipping, with bf16 autocast, on 2 and 4 ranks); each
// rank holds about 1/P of DDP's parameter, gradient and optimizer bytes;
// save_state / load_state of sharded and full state resume bit for bit; a
// sharded save merges into one model. Each run is a worker test started by
// RunRanks with its configuration in the environment; rank 0 writes the
// final weights, every rank its memory figures, and the parent compares.
#include "train/fsdp.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

#include "dispatch/module_hooks.h"
#include "loader/loader.h"
#include "tests/testing/multiprocess.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "train/accelerator.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kIn = 5;
constexpr int64_t kHidden = 24;
constexpr int64_t kBlocks = 4;
constexpr int64_t kGlobalBatch = 8;

struct BlockImpl : torch::nn::Module {
  BlockImpl() : torch::nn::Module("Block") {
    fc1 = register_module("fc1", torch::nn::Linear(kHidden, kHidden + 3));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden + 3, kHidden));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc2->forward(at::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// A root (in, out) around a ModuleList of blocks, as a decoder is.
struct Net : torch::nn::Module {
  explicit Net(bool through_hooks = true) : torch::nn::Module("Net"), hooks(through_hooks) {
    in = register_module("in", torch::nn::Linear(kIn, kHidden));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < kBlocks; ++i) {
      auto b = std::make_shared<BlockImpl>();
      blocks->push_back(b);
      block_ptrs.push_back(b);
    }
    out = register_module("out", torch::nn::Linear(kHidden, 2));
    register_buffer("scale", at::full({1}, 0.5));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in->forward(x);
    for (size_t i = 0; i < block_ptrs.size(); ++i) {
      if (!hooks) {
        h = block_ptrs[i]->forward(h);
        continue;
      }
      auto r = dispatch::RunModule("blocks." + std::to_string(i),
                                   [&] { return block_ptrs[i]->forward(h); });
      if (!r.ok()) throw std::runtime_error(r.status().ToString());
      h = *r;
    }
    return out->forward(h) * named_buffers()["scale"];
  }
  bool hooks;
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<std::shared_ptr<BlockImpl>> block_ptrs;
};

std::string Env(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

// Micro-step k's global batch; rank r of P takes its rows.
std::pair<at::Tensor, at::Tensor> Batch(int64_t k, int rank, int world) {
  at::Tensor i = at::arange(kGlobalBatch * kIn, at::kFloat).view({kGlobalBatch, kIn});
  at::Tensor x = at::sin(i * 0.37 + static_cast<double>(k) * 1.3);
  at::Tensor y = at::cos(x.sum(1, true).repeat({1, 2}) * at::tensor({1.0, -0.5}));
  const int64_t rows = kGlobalBatch / world;
  return {x.narrow(0, rank * rows, rows), y.narrow(0, rank * rows, rows)};
}

void WriteText(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

int64_t OptimizerBytes(torch::optim::Optimizer& opt) {
  int64_t n = 0;
  for (const auto& [key, state] : opt.state()) {
    auto* adam = dynamic_cast<torch::optim::AdamWParamState*>(state.get());
    if (adam == nullptr) continue;
    n += static_cast<int64_t>(adam->exp_avg().nbytes() + adam->exp_avg_sq().nbytes());
    if (adam->max_exp_avg_sq().defined()) {
      n += static_cast<int64_t>(adam->max_exp_avg_sq().nbytes());
    }
  }
  return n;
}

// One run; its configuration comes from the environment:
//   FSDP_TEST_MODE   ddp, or a sharding strategy
//   FSDP_TEST_STEPS  micro-steps (default 6); FSDP_TEST_ACCUM accumulation steps
//   FSDP_TEST_CLIP   1: clip the gradient norm at 0.05 (FSDP_TEST_NORM_TYPE: 2, or inf),
//                    each step's returned norm written to <out>.norms<rank>
//   FSDP_TEST_BYPASS 1: the blocks run outside RunModule
//   FSDP_TEST_SAVE_AT micro-step after which to SaveState into FSDP_TEST_DIR/ckpt
//   FSDP_TEST_LOAD   1: LoadState from FSDP_TEST_DIR/ckpt first, and start there
//   FSDP_TEST_OUT    prefix of the files written
TEST(FsdpWorker, Train) {
  if (!test::IsWorker()) GTEST_SKIP() << "runs as a rank of the FsdpRuns tests";
  const std::string mode = Env("FSDP_TEST_MODE", "ddp");
  const int64_t steps = std::stoll(Env("FSDP_TEST_STEPS", "6"));
  const int64_t accum = std::stoll(Env("FSDP_TEST_ACCUM", "1"));
  const bool clip = Env("FSDP_TEST_CLIP") == "1";
  const double norm_type =
      Env("FSDP_TEST_NORM_TYPE") == "inf" ? INFINITY : std::stod(Env("FSDP_TEST_NORM_TYPE", "2"));
  const std::string out = Env("FSDP_TEST_OUT");
  const std::string dir = Env("FSDP_TEST_DIR");
  const int64_t save_at = std::stoll(Env("FSDP_TEST_SAVE_AT", "-1"));
  const bool load = Env("FSDP_TEST_LOAD") == "1";

  AcceleratorOptions options;
  options.gradient_accumulation_steps = accum;
  options.mixed_precision = Env("FSDP_TEST_PRECISION", "no");
  options.project_config.project_dir = dir;
  if (mode != "ddp") {
    FullyShardedDataParallelPlugin plugin;
    auto strategy = ParseShardingStrategy(mode);
    ASSERT_THAT(strategy, IsOk());
    plugin.sharding_strategy = *strategy;
    plugin.state_dict_type = Env("FSDP_TEST_STATE_DICT") == "SHARDED"
                                 ? StateDictType::kShardedStateDict
                                 : StateDictType::kFullStateDict;
    plugin.forward_prefetch = true;
    plugin.cpu_offload = Env("FSDP_TEST_OFFLOAD") == "1";
    if (Env("FSDP_TEST_PARAM_DTYPE") == "bf16") {
      plugin.mixed_precision_policy.param_dtype = at::kBFloat16;
      plugin.mixed_precision_policy.reduce_dtype = at::kBFloat16;
    }
    options.fsdp_plugin = plugin;
  }
  auto acc = Accelerator::Create(options);
  ASSERT_THAT(acc, IsOk());
  at::manual_seed(7);
  auto net = std::make_shared<Net>(Env("FSDP_TEST_BYPASS") != "1");
  std::vector<at::Tensor> params = net->parameters();
  auto adam = std::make_shared<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(0.05).weight_decay(0.1));
  auto model = (*acc)->PrepareModel(net);
  ASSERT_THAT(model, IsOk());
  auto opt = (*acc)->PrepareOptimizer(adam);
  ASSERT_THAT(opt, IsOk());
  if (Env("FSDP_TEST_PARAM_DTYPE") == "bf16") {
    // The module computes in bfloat16; the optimizer's pieces stay float32.
    EXPECT_EQ(net->in->weight.scalar_type(), at::kBFloat16);
    EXPECT_EQ((*model)->sharded()->pieces()[0].piece.scalar_type(), at::kFloat);
  }
  if (mode != "ddp") {
    ASSERT_NE((*model)->sharded(), nullptr);
    EXPECT_EQ((*acc)->distributed_type(), DistributedType::kFsdp);
  }
  int64_t first = 0;
  if (Env("FSDP_TEST_EXPECT_LOAD_ERROR") == "1") {
    EXPECT_THAT((*acc)->LoadState(dir + "/ckpt"),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("must be loaded by as many ranks as saved it")));
    return;
  }
  if (load) {
    ASSERT_THAT((*acc)->LoadState(dir + "/ckpt"), IsOk());
    first = save_at;
  }
  const int rank = (*acc)->process_index();
  const int world = (*acc)->num_processes();
  std::string norms;
  for (int64_t k = first; k < steps; ++k) {
    auto scope = (*acc)->Accumulate({*model});
    ASSERT_THAT(scope, IsOk());
    auto [x, y] = Batch(k, rank, world);
    at::Tensor loss;
    {
      auto forward = (*acc)->BeginForward(**model);
      ASSERT_THAT(forward, IsOk());
      loss = (net->forward(x) - y).pow(2).mean();
    }
    ASSERT_THAT((*acc)->Backward(loss), IsOk());
    if ((*acc)->sync_gradients() && clip) {
      auto norm = (*acc)->ClipGradNorm(params, 0.05, norm_type);
      ASSERT_THAT(norm, IsOk());
      absl::StrAppend(&norms, absl::StrFormat("%.17g ", *norm));
    }
    ASSERT_THAT((*opt)->Step(), IsOk());
    (*opt)->ZeroGrad();
    if (k + 1 == save_at && !load) {
      ASSERT_THAT((*acc)->SaveState(dir + "/ckpt"), IsOk());
      auto saved = (*acc)->GetStateDict(**model);
      ASSERT_THAT(saved, IsOk());
      if (rank == 0) {
        ASSERT_THAT(loader::WriteSafetensors(out + ".saved.safetensors", *saved), IsOk());
      }
    }
  }
  // Memory at rest: parameters, gradients (data parallel's buckets), optimizer state.
  int64_t param_bytes = 0;
  int64_t grad_bytes = 0;
  if (ShardedModel* s = (*model)->sharded()) {
    param_bytes = s->parameter_bytes();
    grad_bytes = s->gradient_bytes();
  } else {
    for (const at::Tensor& p : params) {
      param_bytes += static_cast<int64_t>(p.nbytes());
      if (p.grad().defined()) grad_bytes += static_cast<int64_t>(p.grad().nbytes());
    }
    if ((*model)->synchronizer() != nullptr) grad_bytes += (*model)->synchronizer()->bucket_bytes();
  }
  if (clip) WriteText(out + ".norms" + std::to_string(rank), norms);
  WriteText(out + ".mem" + std::to_string(rank),
            absl::StrCat(param_bytes, " ", grad_bytes, " ", OptimizerBytes((*opt)->optimizer())));
  auto state = (*acc)->GetStateDict(**model);
  ASSERT_THAT(state, IsOk());
  if (rank == 0) {
    ASSERT_THAT(loader::WriteSafetensors(out + ".safetensors", *state), IsOk());
  }
}

std::map<std::string, at::Tensor> Read(const std::string& path) {
  std::map<std::string, at::Tensor> out;
  auto file = loader::SafetensorsFile::Open(path);
  EXPECT_THAT(file, IsOk());
  if (!file.ok()) return out;
  for (const auto& info : file->tensors()) out[info.name] = file->Tensor(info.name)->clone();
  return out;
}

double MaxDifference(const std::map<std::string, at::Tensor>& a,
                     const std::map<std::string, at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    EXPECT_NE(it, b.end()) << name;
    if (it == b.end()) continue;
    EXPECT_EQ(t.sizes(), it->second.sizes()) << name;
    worst = std::max(worst,
                     (t.to(at::kDouble) - it->second.to(at::kDouble)).abs().max().item<double>());
  }
  return worst;
}

class FsdpRuns : public ::testing::Test {
 protected:
  // Runs one configuration on `ranks` processes; returns the output prefix.
  std::string Run(int ranks, std::map<std::string, std::string> env, const std::string& tag) {
    env["FSDP_TEST_OUT"] = dir_.File(tag);
    env["FSDP_TEST_DIR"] = dir_.path();
    EXPECT_THAT(test::RunRanks(ranks, "FsdpWorker.Train", env), Each(0)) << tag;
    return dir_.File(tag);
  }
  // The largest weight difference between data parallel and `strategy`,
  // both run on 2 ranks with `env`.
  double DifferenceFromDataParallel(std::map<std::string, std::string> env,
                                    const std::string& strategy, const std::string& tag) {
    env["FSDP_TEST_MODE"] = "ddp";
    auto reference = Read(Run(2, env, tag + "_ddp") + ".safetensors");
    env["FSDP_TEST_MODE"] = strategy;
    return MaxDifference(Read(Run(2, env, tag) + ".safetensors"), reference);
  }

  // The norms ClipGradNorm returned on rank `rank`, step by step.
  std::vector<double> Norms(const std::string& prefix, int rank) {
    std::vector<double> out;
    for (absl::string_view f : absl::StrSplit(
             test::ReadAll(prefix + ".norms" + std::to_string(rank)), ' ', absl::SkipEmpty())) {
      double v = 0;
      EXPECT_TRUE(absl::SimpleAtod(f, &v)) << f;
      out.push_back(v);
    }
    return out;
  }

  // Parameter, gradient and optimizer bytes rank `rank` held at the end.
  std::vector<double> Memory(const std::string& prefix, int rank) {
    std::vector<double> out;
    for (absl::string_view f :
         absl::StrSplit(test::ReadAll(prefix + ".mem" + std::to_string(rank)), ' ')) {
      double v = 0;
      EXPECT_TRUE(absl::SimpleAtod(f, &v)) << f;
      out.push_back(v);
    }
    out.resize(3);
    return out;
  }
  test::TempDir dir_;
};

TEST_F(FsdpRuns, EveryStrategyEqualsDataParallelOnTwoRanks) {
  const std::string ddp = Run(2, {{"FSDP_TEST_MODE", "ddp"}}, "ddp");
  auto reference = Read(ddp + ".safetensors");
  // The run must have moved the weights for the comparison to mean anything.
  at::manual_seed(7);
  Net fresh;
  std::map<std::string, at::Tensor> init;
  for (const auto& p : fresh.named_parameters()) init[p.key()] = p.value().detach();
  for (const auto& b : fresh.named_buffers()) init[b.key()] = b.value().detach();
  EXPECT_GT(MaxDifference(reference, init), 1e-2);
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
    const std::string run = Run(2, {{"FSDP_TEST_MODE", strategy}}, strategy);
    EXPECT_LE(MaxDifference(Read(run + ".safetensors"), reference), 1e-6) << strategy;
  }
}

// Clipping under every strategy returns data parallel's norm on every rank,
// step by step, and ends in its weights (NO_SHARD once summed every rank's
// whole gradient: sqrt(P) times the norm, so it clipped too hard).
TEST_F(FsdpRuns, AccumulationAndClippingEqualDataParallel) {
  for (int ranks : {2, 4}) {
    std::map<std::string, std::string> env = {
        {"FSDP_TEST_ACCUM", "2"}, {"FSDP_TEST_CLIP", "1"}, {"FSDP_TEST_STEPS", "8"}};
    env["FSDP_TEST_MODE"] = "ddp";
    const std::string ddp = Run(ranks, env, "ddp" + std::to_string(ranks));
    auto reference = Read(ddp + ".safetensors");
    const std::vector<double> reference_norms = Norms(ddp, 0);
    ASSERT_EQ(reference_norms.size(), 4u);
    // Every step clips (threshold 0.05), so a wrong norm changes the weights.
    EXPECT_THAT(reference_norms, Each(::testing::Gt(0.05)));
    for (const std::string strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
      // On one node HYBRID_SHARD is FULL_SHARD: once (on 2 ranks) is enough.
      if (ranks == 4 && strategy == "HYBRID_SHARD") continue;
      env["FSDP_TEST_MODE"] = strategy;
      const std::string run = Run(ranks, env, strategy + std::to_string(ranks));
      for (int rank = 0; rank < ranks; ++rank) {
        const std::vector<double> norms = Norms(run, rank);
        ASSERT_EQ(norms.size(), reference_norms.size()) << strategy << " rank " << rank;
        for (size_t i = 0; i < norms.size(); ++i) {
          EXPECT_NEAR(norms[i] / reference_norms[i], 1.0, 1e-6)
              << strategy << " on " << ranks << " ranks, rank " << rank << ", step " << i;
        }
      }
      EXPECT_LE(MaxDifference(Read(run + ".safetensors"), reference), 1e-5)
          << strategy << " on " << ranks;
    }
  }
}

// The infinity norm (a max over the ranks) likewise, under every strategy.
TEST_F(FsdpRuns, InfinityNormClippingEqualsDataParallel) {
  std::map<std::string, std::string> env = {
      {"FSDP_TEST_CLIP", "1"}, {"FSDP_TEST_STEPS", "3"}, {"FSDP_TEST_NORM_TYPE", "inf"}};
  env["FSDP_TEST_MODE"] = "ddp";
  const std::string ddp = Run(2, env, "ddp_inf");
  const std::vector<double> reference_norms = Norms(ddp, 0);
  ASSERT_EQ(reference_norms.size(), 3u);
  EXPECT_THAT(reference_norms, Each(::testing::Gt(0.05)));
  auto reference = Read(ddp + ".safetensors");
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
    env["FSDP_TEST_MODE"] = strategy;
    const std::string run = Run(2, env, std::string(strategy) + "_inf");
    for (int rank = 0; rank < 2; ++rank) {
      const std::vector<double> norms = Norms(run, rank);
      ASSERT_EQ(norms.size(), reference_norms.size()) << strategy;
      for (size_t i = 0; i < norms.size(); ++i) {
        EXPECT_NEAR(norms[i] / reference_norms[i], 1.0, 1e-6) << strategy << " step " << i;
      }
    }
    EXPECT_LE(MaxDifference(Read(run + ".safetensors"), reference), 1e-5) << strategy;
  }
}

TEST_F(FsdpRuns, Bf16AutocastEqualsDataParallel) {
  EXPECT_LE(DifferenceFromDataParallel({{"FSDP_TEST_PRECISION", "bf16"}}, "FULL_SHARD", "bf16"),
            1e-5);
}

// MixedPrecision(param_dtype=bf16, reduce_dtype=bf16): units compute in
// bfloat16 from float32 shards. Under autocast that is the arithmetic data
// parallel does (autocast rounds the same weights to bfloat16, and a cast's
// gradient is the rounded gradient), except that the gradients are reduced
// in bfloat16: close, not equal.
TEST_F(FsdpRuns, Bf16ParamDtypeFollowsDataParallel) {
  std::map<std::string, std::string> env = {{"FSDP_TEST_PRECISION", "bf16"}};
  env["FSDP_TEST_MODE"] = "ddp";
  auto reference = Read(Run(2, env, "ddp") + ".safetensors");
  env["FSDP_TEST_MODE"] = "FULL_SHARD";
  env["FSDP_TEST_PARAM_DTYPE"] = "bf16";
  auto run = Read(Run(2, env, "fsdp") + ".safetensors");
  const double difference = MaxDifference(run, reference);
  RecordProperty("max_difference", std::to_string(difference));
  std::printf("param_dtype bf16 vs autocast data parallel: max difference %.3g\n", difference);
  EXPECT_LE(difference, 2e-2);
  EXPECT_GT(difference, 0);  // bfloat16 compute is not float32 compute
  // The shards stay float32 masters: the saved model is float32.
  for (const auto& [name, t] : run) EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
}

// cpu_offload keeps shards, gradients and optimizer state on the cpu; on a
// cpu execution device that is where they are, and nothing changes.
TEST_F(FsdpRuns, CpuOffloadEqualsDataParallel) {
  EXPECT_LE(DifferenceFromDataParallel({{"FSDP_TEST_OFFLOAD", "1"}}, "FULL_SHARD", "offload"),
            1e-6);
}

TEST_F(FsdpRuns, UnitsRunOutsideTheHooksStayGatheredAndStayCorrect) {
  EXPECT_LE(DifferenceFromDataParallel({{"FSDP_TEST_BYPASS", "1"}}, "FULL_SHARD", "bypass"), 1e-6);
}

TEST_F(FsdpRuns, EachRankHoldsAboutOneOverPOfDataParallelsBytes) {
  for (int ranks : {2, 4}) {
    const std::string ddp = Run(ranks, {{"FSDP_TEST_MODE", "ddp"}}, "ddp" + std::to_string(ranks));
    const std::string full =
        Run(ranks, {{"FSDP_TEST_MODE", "FULL_SHARD"}}, "full" + std::to_string(ranks));
    const std::string none =
        Run(ranks, {{"FSDP_TEST_MODE", "NO_SHARD"}}, "none" + std::to_string(ranks));
    for (int r = 0; r < ranks; ++r) {
      const std::vector<double> d = Memory(ddp, r), f = Memory(full, r), n = Memory(none, r);
      const double total_ratio = (f[0] + f[1] + f[2]) / (d[0] + d[1] + d[2]);
      SCOPED_TRACE(absl::StrCat("rank ", r, " of ", ranks, ": data parallel ", d[0], " / ", d[1],
                                " / ", d[2], ", FULL_SHARD ", f[0], " / ", f[1], " / ", f[2]));
      // Parameters: 1/P of them (padding included) plus the root kept
      // gathered (in and out: 3.5% of this model).
      EXPECT_GE(f[0] / d[0], 1.0 / ranks);
      EXPECT_LT(f[0] / d[0], 1.0 / ranks + 0.05);
      // The optimizer steps exactly this rank's pieces.
      EXPECT_NEAR(f[2] / d[2], 1.0 / ranks, 0.01);
      // At rest no gradient is held; data parallel keeps its buckets.
      EXPECT_EQ(f[1], 0);
      EXPECT_EQ(d[1], d[0]);
      EXPECT_LT(total_ratio, 1.0 / ranks);
      // NO_SHARD holds the parameters and optimizer state data parallel does.
      EXPECT_EQ(n[0], d[0]);
      EXPECT_EQ(n[2], d[2]);
    }
  }
}

TEST_F(FsdpRuns, SaveStateAndLoadStateResumeBitForBit) {
  for (const char* type : {"SHARDED", "FULL"}) {
    std::map<std::string, std::string> env = {{"FSDP_TEST_MODE", "FULL_SHARD"},
                                              {"FSDP_TEST_STATE_DICT", type},
                                              {"FSDP_TEST_ACCUM", "2"},
                                              {"FSDP_TEST_STEPS", "8"},
                                              {"FSDP_TEST_SAVE_AT", "4"}};
    const std::string whole = Run(2, env, std::string("whole") + type);
    env["FSDP_TEST_LOAD"] = "1";
    const std::string resumed = Run(2, env, std::string("resumed") + type);
    EXPECT_EQ(MaxDifference(Read(whole + ".safetensors"), Read(resumed + ".safetensors")), 0)
        << type;
    if (std::string(type) == "SHARDED") {
      // The shards merge into the model as it was when saved.
      const std::string merged = dir_.File("merged");
      ASSERT_THAT(MergeShardedState(dir_.File("ckpt/pytorch_model_fsdp"), merged, 1 << 30), IsOk());
      EXPECT_EQ(
          MaxDifference(Read(merged + "/model.safetensors"), Read(whole + ".saved.safetensors")),
          0);
      // Another number of ranks cannot load the shards (nor the optimizer's).
      EXPECT_THAT(test::RunRanks(4, "FsdpWorker.Train",
                                 {{"FSDP_TEST_MODE", "FULL_SHARD"},
                                  {"FSDP_TEST_STATE_DICT", "SHARDED"},
                                  {"FSDP_TEST_SAVE_AT", "4"},
                                  {"FSDP_TEST_EXPECT_LOAD_ERROR", "1"},
                                  {"FSDP_TEST_OUT", dir_.File("four")},
                                  {"FSDP_TEST_DIR", dir_.path()}}),
                  Each(0));
    }
    std::filesystem::remove_all(dir_.File("ckpt"));
  }
}

// ---- One process ----

std::unique_ptr<ShardedModel> WrapAlone(const std::shared_ptr<Net>& net,
                                        const FullyShardedDataParallelPlugin& plugin) {
  static std::unique_ptr<ProcessGroup> group = ProcessGroup::Single();
  auto sharded = ShardedModel::Wrap(net, *group, plugin, c10::Device(c10::kCPU), 1);
  EXPECT_THAT(sharded, IsOk());
  return sharded.ok() ? *std::move(sharded) : nullptr;
}

TEST(FsdpUnits, AutoWrapPolicies) {
  FullyShardedDataParallelPlugin plugin;
  // Default: the modules a ModuleList holds.
  auto sharded = WrapAlone(std::make_shared<Net>(), plugin);
  ASSERT_NE(sharded, nullptr);
  EXPECT_THAT(sharded->unit_names(),
              ElementsAre("", "blocks.0", "blocks.1", "blocks.2", "blocks.3"));
  // By class name, as transformer_cls_names_to_wrap says it.
  plugin.transformer_cls_names_to_wrap = {"Linear"};
  sharded = WrapAlone(std::make_shared<Net>(), plugin);
  ASSERT_NE(sharded, nullptr);
  EXPECT_EQ(sharded->unit_names().size(), 1 + 2 + 2 * kBlocks);  // the root holds nothing
  EXPECT_EQ(sharded->unit_names()[1], "in");
  // Size-based: a block holds 2 * (24 * 27) + 27 + 24 = 1347 parameters.
  plugin.auto_wrap_policy = AutoWrapPolicy::kSizeBasedWrap;
  plugin.min_num_params = 1000;
  sharded = WrapAlone(std::make_shared<Net>(), plugin);
  ASSERT_NE(sharded, nullptr);
  EXPECT_THAT(sharded->unit_names(),
              ElementsAre("", "blocks.0", "blocks.1", "blocks.2", "blocks.3"));
  plugin.auto_wrap_policy = AutoWrapPolicy::kNoWrap;
  sharded = WrapAlone(std::make_shared<Net>(), plugin);
  ASSERT_NE(sharded, nullptr);
  EXPECT_THAT(sharded->unit_names(), ElementsAre(""));
}

TEST(FsdpUnits, UnknownClassToWrapIsRefusedByName) {
  FullyShardedDataParallelPlugin plugin;
  plugin.transformer_cls_names_to_wrap = {"LlamaDecoderLayer"};
  static std::unique_ptr<ProcessGroup> group = ProcessGroup::Single();
  EXPECT_THAT(
      ShardedModel::Wrap(std::make_shared<Net>(), *group, plugin, c10::Device(c10::kCPU), 1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("LlamaDecoderLayer")));
  plugin = {};
  plugin.activation_checkpointing = true;
  EXPECT_THAT(
      ShardedModel::Wrap(std::make_shared<Net>(), *group, plugin, c10::Device(c10::kCPU), 1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("activation_checkpointing")));
  plugin = {};
  plugin.sharding_strategy = ShardingStrategy::kHybridShard;
  EXPECT_THAT(
      ShardedModel::Wrap(std::make_shared<Net>(), *group, plugin, c10::Device(c10::kCPU), 2),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("HYBRID_SHARD")));
}

TEST(FsdpUnits, PiecesCoverEveryParameterAndTheForwardIsUnchanged) {
  at::manual_seed(3);
  auto net = std::make_shared<Net>();
  at::Tensor x = at::randn({3, kIn});
  at::Tensor before = net->forward(x).detach().clone();
  std::map<std::string, at::Tensor> weights;
  for (const auto& p : net->named_parameters()) weights[p.key()] = p.value().detach().clone();
  auto sharded = WrapAlone(net, {});
  ASSERT_NE(sharded, nullptr);
  EXPECT_EQ(sharded->pieces().size(), weights.size());
  for (const ParameterPiece& p : sharded->pieces()) {
    EXPECT_TRUE(at::equal(p.piece, weights.at(p.name).reshape({-1}))) << p.name;
  }
  dispatch::ScopedModuleHooks hooks(sharded.get());
  EXPECT_TRUE(at::equal(net->forward(x), before));
}

TEST(FsdpPlugin, FromEnvReadsAccelerateVariables) {
  std::map<std::string, std::string> vars = {
      {"FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"},
      {"FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"},
      {"FSDP_MIN_NUM_PARAMS", "2000"},
      {"FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer, MixtralDecoderLayer"},
      {"FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"},
      {"FSDP_BACKWARD_PREFETCH", "BACKWARD_POST"},
      {"FSDP_OFFLOAD_PARAMS", "true"},
      {"FSDP_FORWARD_PREFETCH", "false"},
      {"FSDP_SYNC_MODULE_STATES", "true"},
  };
  EnvLookup env = [&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  auto plugin = FullyShardedDataParallelPlugin::FromEnv(env);
  ASSERT_THAT(plugin, IsOk());
  EXPECT_EQ(plugin->sharding_strategy, ShardingStrategy::kShardGradOp);
  EXPECT_EQ(plugin->auto_wrap_policy, AutoWrapPolicy::kSizeBasedWrap);
  EXPECT_EQ(plugin->min_num_params, 2000);
  EXPECT_THAT(plugin->transformer_cls_names_to_wrap,
              ElementsAre("LlamaDecoderLayer", "MixtralDecoderLayer"));
  EXPECT_EQ(plugin->state_dict_type, StateDictType::kShardedStateDict);
  EXPECT_EQ(plugin->backward_prefetch, BackwardPrefetch::kBackwardPost);
  EXPECT_TRUE(plugin->cpu_offload);
  // Accelerate's older numeric spelling.
  vars = {{"FSDP_SHARDING_STRATEGY", "3"}};
  EXPECT_EQ(FullyShardedDataParallelPlugin::FromEnv(env)->sharding_strategy,
            ShardingStrategy::kNoShard);
  for (const auto& [name, value] : std::vector<std::pair<std::string, std::string>>{
           {"FSDP_SHARDING_STRATEGY", "HALF_SHARD"},
           {"FSDP_STATE_DICT_TYPE", "LOCAL_STATE_DICT"},
           {"FSDP_BACKWARD_PREFETCH", "EARLY"},
           {"FSDP_OFFLOAD_PARAMS", "maybe"},
           {"FSDP_MIN_NUM_PARAMS", "lots"},
           {"FSDP_VERSION", "2"},
           {"FSDP_RESHARD_AFTER_FORWARD", "false"},
           {"FSDP_IGNORED_MODULES", "lm_head"}}) {
    vars = {{name, value}};
    EXPECT_THAT(FullyShardedDataParallelPlugin::FromEnv(env),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(name)))
        << name;
  }
}

TEST(FsdpAccelerator, Fp16AndActivationCheckpointingAreRefused) {
  AcceleratorOptions options;
  options.fsdp_plugin = FullyShardedDataParallelPlugin{};
  options.mixed_precision = "fp16";
  EXPECT_THAT(Accelerator::Create(options, [](const std::string&) { return std::nullopt; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fp16")));
  options.mixed_precision = "no";
  options.fsdp_plugin->activation_checkpointing = true;
  EXPECT_THAT(Accelerator::Create(options, [](const std::string&) { return std::nullopt; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("activation_checkpointing")));
}

TEST(FsdpMerge, BadFoldersAreRefusedByName) {
  test::TempDir dir;
  EXPECT_THAT(MergeShardedState(dir.File("missing"), dir.File("out"), 1 << 30),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
  std::filesystem::create_directories(dir.File("shards"));
  EXPECT_THAT(MergeShardedState(dir.File("shards"), dir.File("out"), 1 << 30),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("rank")));
  // A rank file without its metadata.
  ASSERT_THAT(
      loader::WriteSafetensors(dir.File("shards/rank0-of-2.safetensors"), {{"w", at::zeros({2})}}),
      IsOk());
  EXPECT_THAT(MergeShardedState(dir.File("shards"), dir.File("out"), 1 << 30),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("accel_fsdp")));
  // A shape that is not a list of integers.
  ASSERT_THAT(
      loader::WriteSafetensors(
          dir.File("shards/rank0-of-2.safetensors"), {{"w", at::zeros({2})}},
          {{"accel_fsdp",
            R"({"world_size": 1, "rank": 0, "pieces": {"w": {"shape": ["4"], "offset": 0}}})"}}),
      IsOk());
  EXPECT_THAT(MergeShardedState(dir.File("shards"), dir.File("out"), 1 << 30),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shape of integers")));
  // Rank 1 of 2 missing.
  ASSERT_THAT(
      loader::WriteSafetensors(
          dir.File("shards/rank0-of-2.safetensors"), {{"w", at::zeros({2})}},
          {{"accel_fsdp",
            R"({"world_size": 2, "rank": 0, "pieces": {"w": {"shape": [4], "offset": 0}}})"}}),
      IsOk());
  EXPECT_THAT(MergeShardedState(dir.File("shards"), dir.File("out"), 1 << 30),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rank 1")));
  // Pieces that leave a gap.
  ASSERT_THAT(
      loader::WriteSafetensors(
          dir.File("shards/rank1-of-2.safetensors"), {{"w", at::zeros({1})}},
          {{"accel_fsdp",
            R"({"world_size": 2, "rank": 1, "pieces": {"w": {"shape": [4], "offset": 2}}})"}}),
      IsOk());
  EXPECT_THAT(MergeShardedState(dir.File("shards"), dir.File("out"), 1 << 30),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("cover 3 of its 4")));
}

}  // namespace
}  // namespace accel::train
