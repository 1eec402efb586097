// The Accelerator: option checks, Accelerate's accumulation / stepping rules,
// save_state / load_state, and (in real processes over gloo) data-parallel
// equivalence with a single process on the same global batch.
#include "train/accelerator.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "tests/testing/file_size_limit.h"
#include "tests/testing/multiprocess.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "train/checkpoint.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::Each;
using ::testing::HasSubstr;

// An environment with only the given variables.
EnvLookup FakeEnv(std::map<std::string, std::string> vars = {}) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::unique_ptr<Accelerator> MakeAccelerator(AcceleratorOptions options = {},
                                             std::map<std::string, std::string> env = {}) {
  auto acc = Accelerator::Create(options, FakeEnv(std::move(env)));
  EXPECT_THAT(acc, IsOk());
  return acc.ok() ? *std::move(acc) : nullptr;
}

// Rows i of x are deterministic functions of i, y a fixed linear map plus a bend.
std::shared_ptr<TensorDataset> Regression(int64_t n) {
  at::Tensor i = at::arange(n, at::kFloat).unsqueeze(1);
  at::Tensor x = at::cat({at::sin(i), at::cos(i * 0.5), i / n, at::ones_like(i)}, 1);
  at::Tensor y =
      at::cat({x.sum(1, true) * 0.3, at::tanh(x.narrow(1, 0, 1)), x.narrow(1, 2, 1) * 2}, 1);
  auto ds = TensorDataset::Create({{"x", x}, {"y", y}, {"index", at::arange(n, at::kLong)}});
  EXPECT_THAT(ds, IsOk());
  return *ds;
}

// Rows [begin, end) of the dataset as one batch.
Batch Rows(const Dataset& ds, int64_t begin, int64_t end) {
  std::vector<Example> rows;
  for (int64_t i = begin; i < end; ++i) rows.push_back(*ds.Get(i));
  return *Collate(rows);
}

torch::nn::Linear MakeNet(uint64_t seed = 7) {
  at::manual_seed(seed);
  return torch::nn::Linear(4, 3);
}

at::Tensor Loss(torch::nn::Linear& net, const Batch& batch) {
  return (net->forward(batch.at("x")) - batch.at("y")).pow(2).mean();
}

std::unique_ptr<DataLoader> Loader(std::shared_ptr<TensorDataset> ds, int64_t batch_size,
                                   bool shuffle = false) {
  DataLoaderOptions options;
  options.batch_size = batch_size;
  options.shuffle = shuffle;
  options.seed = 11;
  auto loader = DataLoader::Create(std::move(ds), options);
  EXPECT_THAT(loader, IsOk());
  return *std::move(loader);
}

// ---- Options ----

TEST(AcceleratorOptions, RefusesWhatCxxCannotDo) {
  AcceleratorOptions dynamo;
  dynamo.dynamo_backend = "inductor";
  EXPECT_THAT(Accelerator::Create(dynamo, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dynamo_backend")));
  EXPECT_THAT(Accelerator::Create({}, FakeEnv({{"ACCELERATE_DYNAMO_BACKEND", "INDUCTOR"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dynamo_backend")));
  AcceleratorOptions ds;
  ds.use_deepspeed = true;
  EXPECT_THAT(Accelerator::Create(ds, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("use_deepspeed")));
  // FSDP is honoured (train/fsdp.h); what of it a C++ program cannot do is refused by name.
  auto fsdp = Accelerator::Create({}, FakeEnv({{"ACCELERATE_USE_FSDP", "true"}}));
  ASSERT_THAT(fsdp, IsOk());
  EXPECT_EQ((*fsdp)->distributed_type(), DistributedType::kFsdp);
  ASSERT_NE((*fsdp)->fsdp_plugin(), nullptr);
  EXPECT_THAT(Accelerator::Create({}, FakeEnv({{"ACCELERATE_USE_FSDP", "true"},
                                               {"FSDP_ACTIVATION_CHECKPOINTING", "true"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("activation_checkpointing")));
  EXPECT_THAT(Accelerator::Create({}, FakeEnv({{"ACCELERATE_USE_FSDP", "true"},
                                               {"FSDP_SHARDING_STRATEGY", "QUARTER_SHARD"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("FSDP_SHARDING_STRATEGY")));
  AcceleratorOptions stateful;
  stateful.dataloader_config.use_stateful_dataloader = true;
  EXPECT_THAT(Accelerator::Create(stateful, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("use_stateful_dataloader")));
  AcceleratorOptions hook;
  hook.ddp_kwargs = DistributedDataParallelKwargs{};
  hook.ddp_kwargs->comm_hook = "power_sgd";
  EXPECT_THAT(Accelerator::Create(hook, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("power_sgd")));
  AcceleratorOptions init;
  init.init_process_group_kwargs = InitProcessGroupKwargs{};
  init.init_process_group_kwargs->init_method = "tcp://10.0.0.1:23456";
  EXPECT_THAT(Accelerator::Create(init, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("init_method")));
}

// static_graph and check_reduction were accepted and ignored; true is now
// refused by name (false, their default, is what runs).
TEST(AcceleratorOptions, DdpStaticGraphAndCheckReductionAreRefused) {
  AcceleratorOptions static_graph;
  static_graph.ddp_kwargs = DistributedDataParallelKwargs{};
  static_graph.ddp_kwargs->static_graph = true;
  EXPECT_THAT(Accelerator::Create(static_graph, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("DistributedDataParallelKwargs.static_graph = true")));
  AcceleratorOptions check;
  check.ddp_kwargs = DistributedDataParallelKwargs{};
  check.ddp_kwargs->check_reduction = true;
  EXPECT_THAT(Accelerator::Create(check, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("DistributedDataParallelKwargs.check_reduction = true")));
  AcceleratorOptions defaults;
  defaults.ddp_kwargs = DistributedDataParallelKwargs{};
  EXPECT_THAT(Accelerator::Create(defaults, FakeEnv()), IsOk());
}

TEST(AcceleratorOptions, BadValuesNameTheOption) {
  AcceleratorOptions fp8;
  fp8.mixed_precision = "fp8";
  EXPECT_THAT(Accelerator::Create(fp8, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mixed_precision")));
  AcceleratorOptions both;
  both.gradient_accumulation_steps = 2;
  both.gradient_accumulation_plugin = GradientAccumulationPlugin{};
  EXPECT_THAT(Accelerator::Create(both, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("both set")));
  AcceleratorOptions zero;
  zero.gradient_accumulation_steps = 0;
  EXPECT_THAT(
      Accelerator::Create(zero, FakeEnv()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gradient_accumulation_steps")));
  EXPECT_THAT(Accelerator::Create({}, FakeEnv({{"ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "x"}})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")));
  AcceleratorOptions tracker;
  tracker.log_with = {"wandb"};
  EXPECT_THAT(Accelerator::Create(tracker, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("wandb")));
  AcceleratorOptions naming;
  naming.project_config.automatic_checkpoint_naming = true;
  EXPECT_THAT(Accelerator::Create(naming, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("project_dir")));
}

TEST(AcceleratorOptions, EnvironmentSuppliesDefaults) {
  auto acc = MakeAccelerator({}, {{"ACCELERATE_MIXED_PRECISION", "bf16"},
                                  {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3"}});
  ASSERT_NE(acc, nullptr);
  EXPECT_EQ(acc->mixed_precision(), PrecisionType::kBf16);
  EXPECT_EQ(acc->gradient_accumulation_steps(), 3);
  EXPECT_EQ(acc->num_processes(), 1);
  EXPECT_EQ(acc->distributed_type(), DistributedType::kNo);
  EXPECT_TRUE(acc->is_main_process());
  // The argument wins over the environment for precision.
  AcceleratorOptions options;
  options.mixed_precision = "no";
  auto acc2 = MakeAccelerator(options, {{"ACCELERATE_MIXED_PRECISION", "bf16"}});
  EXPECT_EQ(acc2->mixed_precision(), PrecisionType::kNo);
}

// ---- Gradient accumulation ----

// sync_gradients per batch for a loader of n batches with k accumulation steps.
std::vector<bool> SyncPattern(int64_t n, int64_t k) {
  AcceleratorOptions options;
  options.gradient_accumulation_steps = k;
  auto acc = MakeAccelerator(options);
  auto prepared = acc->PrepareDataLoader(*Loader(Regression(n), 1));
  EXPECT_THAT(prepared, IsOk());
  std::vector<bool> pattern;
  for (int epoch = 0; epoch < 2; ++epoch) {  // the counter restarts every epoch
    EXPECT_THAT((*prepared)->Start(), IsOk());
    while (true) {
      auto batch = (*prepared)->Next();
      EXPECT_THAT(batch, IsOk());
      if (!batch.ok() || !*batch) break;
      auto scope = acc->Accumulate({});
      EXPECT_THAT(scope, IsOk());
      pattern.push_back(acc->sync_gradients());
    }
  }
  return pattern;
}

TEST(AcceleratorAccumulate, SyncsEveryKStepsAndAtTheLastBatch) {
  // Reference §2.2 [derived]: N=5, k=2: F,T,F,T,T; N=7, k=3: F,F,T,F,F,T,T (twice: two epochs).
  EXPECT_EQ(SyncPattern(5, 2),
            std::vector<bool>({false, true, false, true, true, false, true, false, true, true}));
  EXPECT_EQ(SyncPattern(7, 3), std::vector<bool>({false, false, true, false, false, true, true,
                                                  false, false, true, false, false, true, true}));
}

// k micro-batches of b rows with accumulation == one step on the k*b rows.
TEST(AcceleratorAccumulate, EqualsOneStepOnTheWholeBatch) {
  constexpr int64_t kSteps = 4;
  auto ds = Regression(16);
  AcceleratorOptions options;
  options.gradient_accumulation_steps = kSteps;
  auto acc = MakeAccelerator(options);
  torch::nn::Linear net = MakeNet();
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
  auto model = acc->PrepareModel(net.ptr());
  auto opt = acc->PrepareOptimizer(sgd);
  ASSERT_THAT(model, IsOk());
  ASSERT_THAT(opt, IsOk());
  auto loader = acc->PrepareDataLoader(*Loader(ds, 4));
  ASSERT_THAT(loader, IsOk());
  ASSERT_THAT((*loader)->Start(), IsOk());
  int steps = 0;
  while (true) {
    auto batch = (*loader)->Next();
    ASSERT_THAT(batch, IsOk());
    if (!*batch) break;
    auto scope = acc->Accumulate({*model});
    ASSERT_THAT(scope, IsOk());
    ASSERT_THAT(acc->Backward(Loss(net, **batch)), IsOk());
    ASSERT_THAT((*opt)->Step(), IsOk());
    (*opt)->ZeroGrad();
    ++steps;
  }
  EXPECT_EQ(steps, 4);

  // The reference: one SGD step on all 16 rows.
  torch::nn::Linear ref = MakeNet();
  torch::optim::SGD ref_sgd(ref->parameters(), torch::optim::SGDOptions(0.1));
  Loss(ref, Rows(*ds, 0, 16)).backward();
  ref_sgd.step();
  EXPECT_TRUE(at::allclose(net->weight, ref->weight, 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(net->bias, ref->bias, 1e-6, 1e-6));
  EXPECT_FALSE(at::equal(ref->weight, MakeNet()->weight));  // the step did move the weights
}

// ---- Optimizer and scheduler stepping ----

TEST(AcceleratorScheduler, StepsWithTheOptimizerOnly) {
  // Upstream lambda_test, one process: LambdaLR(1 - n/10) at lr 1.0.
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;
  auto acc = MakeAccelerator(options);
  torch::nn::Linear net = MakeNet();
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(1.0));
  std::shared_ptr<LRScheduler> lambda =
      MakeLambdaLR(*sgd, [](int64_t n) { return 1.0 - static_cast<double>(n) / 10; });
  auto opt = acc->PrepareOptimizer(sgd);
  auto sched = acc->PrepareScheduler(lambda);
  ASSERT_THAT(opt, IsOk());
  ASSERT_THAT(sched, IsOk());
  auto lr = [&] { return lambda->last_lrs().at(0); };
  // A non-sync micro-step: neither the optimizer nor the scheduler move.
  ASSERT_THAT(acc->Accumulate({}), IsOk());
  EXPECT_FALSE(acc->sync_gradients());
  ASSERT_THAT((*sched)->Step(), IsOk());
  EXPECT_DOUBLE_EQ(lr(), 1.0);
  // The sync step: one tick (one process).
  ASSERT_THAT(acc->Accumulate({}), IsOk());
  EXPECT_TRUE(acc->sync_gradients());
  ASSERT_THAT((*sched)->Step(), IsOk());
  EXPECT_DOUBLE_EQ(lr(), 0.9);
}

TEST(AcceleratorScheduler, WithoutStepWithOptimizerEveryCallTicks) {
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;
  options.step_scheduler_with_optimizer = false;
  auto acc = MakeAccelerator(options);
  torch::nn::Linear net = MakeNet();
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(1.0));
  std::shared_ptr<LRScheduler> lambda =
      MakeLambdaLR(*sgd, [](int64_t n) { return 1.0 - static_cast<double>(n) / 10; });
  auto sched = acc->PrepareScheduler(lambda);
  ASSERT_THAT(acc->Accumulate({}), IsOk());
  ASSERT_THAT((*sched)->Step(), IsOk());
  ASSERT_THAT((*sched)->Step(), IsOk());
  EXPECT_DOUBLE_EQ(lambda->last_lrs().at(0), 0.8);
}

// fp16 on the CPU: the host GradScaler. An inf gradient skips the optimizer
// step and the scheduler with it, and backs the scale off.
TEST(AcceleratorFp16, OverflowSkipsOptimizerAndScheduler) {
  AcceleratorOptions options;
  options.mixed_precision = "fp16";
  options.grad_scaler_kwargs = GradScalerOptions{};
  options.grad_scaler_kwargs->init_scale = 1024;
  auto acc = MakeAccelerator(options);
  ASSERT_NE(acc->scaler(), nullptr);
  torch::nn::Linear net = MakeNet();
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(1.0));
  std::shared_ptr<LRScheduler> lambda =
      MakeLambdaLR(*sgd, [](int64_t n) { return 1.0 - static_cast<double>(n) / 10; });
  auto model = acc->PrepareModel(net.ptr());
  auto opt = acc->PrepareOptimizer(sgd);
  auto sched = acc->PrepareScheduler(lambda);
  ASSERT_THAT(opt, IsOk());
  auto ds = Regression(4);
  Batch batch = Rows(*ds, 0, 4);

  // Clean step: the gradient the optimizer sees is the unscaled one.
  at::Tensor before = net->weight.detach().clone();
  ASSERT_THAT(acc->Backward(Loss(net, batch)), IsOk());
  at::Tensor scaled_grad = net->weight.grad().clone();
  ASSERT_THAT((*opt)->Step(), IsOk());
  EXPECT_FALSE((*opt)->step_was_skipped());
  EXPECT_TRUE(at::allclose(net->weight, before - scaled_grad / 1024, 1e-5, 1e-6));
  ASSERT_THAT((*sched)->Step(), IsOk());
  EXPECT_DOUBLE_EQ(lambda->last_lrs().at(0), 0.9);
  (*opt)->ZeroGrad();

  // Overflow: an inf in the loss.
  at::Tensor weights = net->weight.detach().clone();
  ASSERT_THAT(acc->Backward(Loss(net, batch) * std::numeric_limits<float>::infinity()), IsOk());
  ASSERT_THAT((*opt)->Step(), IsOk());
  EXPECT_TRUE((*opt)->step_was_skipped());
  EXPECT_TRUE(at::equal(net->weight, weights));
  EXPECT_DOUBLE_EQ(acc->scaler()->scale(), 512);
  ASSERT_THAT((*sched)->Step(), IsOk());
  EXPECT_DOUBLE_EQ(lambda->last_lrs().at(0), 0.9);
}

TEST(AcceleratorClip, ClipGradNormMatchesTheNormByHand) {
  auto acc = MakeAccelerator();
  torch::nn::Linear net = MakeNet();
  auto ds = Regression(8);
  Loss(net, Rows(*ds, 0, 8)).backward();
  double by_hand = std::sqrt(net->weight.grad().pow(2).sum().item<double>() +
                             net->bias.grad().pow(2).sum().item<double>());
  at::Tensor grad = net->weight.grad().clone();
  auto norm = acc->ClipGradNorm(net->parameters(), by_hand / 2);
  ASSERT_THAT(norm, IsOk());
  EXPECT_NEAR(*norm, by_hand, 1e-5);
  EXPECT_TRUE(at::allclose(net->weight.grad(), grad * 0.5, 1e-4, 1e-6));
  ASSERT_THAT(acc->ClipGradValue(net->parameters(), 1e-4), IsOk());
  EXPECT_LE(net->weight.grad().abs().max().item<double>(), 1e-4 + 1e-9);
}

TEST(AcceleratorAutocast, Bf16ForwardRunsInBfloat16) {
  AcceleratorOptions options;
  options.mixed_precision = "bf16";
  auto acc = MakeAccelerator(options);
  torch::nn::Linear net = MakeNet();
  auto model = acc->PrepareModel(net.ptr());
  ASSERT_THAT(model, IsOk());
  at::Tensor x = at::ones({2, 4});
  {
    auto forward = acc->BeginForward(**model);
    ASSERT_THAT(forward, IsOk());
    EXPECT_EQ(net->forward(x).scalar_type(), at::kBFloat16);
    auto off = acc->Autocast(AutocastKwargs{false, std::nullopt});
    EXPECT_EQ(net->forward(x).scalar_type(), at::kFloat);
  }
  EXPECT_EQ(net->forward(x).scalar_type(), at::kFloat);
}

// ---- Checkpoints ----

// Trains `steps` batches of a shuffled loader with Adam and a linear
// schedule; with `save_at`, saves the state after that many steps.
struct Trainer {
  std::unique_ptr<Accelerator> acc;
  torch::nn::Linear net = nullptr;
  PreparedModel* model = nullptr;
  PreparedOptimizer* opt = nullptr;
  PreparedScheduler* sched = nullptr;
  std::unique_ptr<DataLoader> loader;
  DataLoader* current = nullptr;  // the loader of the pass in progress

  explicit Trainer(AcceleratorOptions options, uint64_t init_seed = 7) {
    SetSeed(3);
    acc = MakeAccelerator(options);
    net = MakeNet(init_seed);
    auto adam =
        std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.05));
    std::shared_ptr<LRScheduler> linear = MakeLinearWarmupLR(*adam, 2, 40);
    model = *acc->PrepareModel(net.ptr());
    opt = *acc->PrepareOptimizer(adam);
    sched = *acc->PrepareScheduler(linear);
    loader = *acc->PrepareDataLoader(*Loader(Regression(20), 3, /*shuffle=*/true));
  }

  // Runs batches until `count` more have been used (across epochs), with dropout-like noise
  // from the global RNG so the RNG state matters too. The pass in progress
  // goes on; `first` starts a pass of that loader instead.
  void Run(int count, DataLoader* first = nullptr) {
    if (first != nullptr || current == nullptr) {
      current = first != nullptr ? first : loader.get();
      ASSERT_THAT(current->Start(), IsOk());
    }
    while (count > 0) {
      auto batch = current->Next();
      ASSERT_THAT(batch, IsOk());
      if (!*batch) {
        current = loader.get();
        ASSERT_THAT(current->Start(), IsOk());
        continue;
      }
      auto scope = acc->Accumulate({model});
      ASSERT_THAT(scope, IsOk());
      at::Tensor noise = at::rand({1}) * 1e-3;
      ASSERT_THAT(acc->Backward(Loss(net, **batch) + noise.sum()), IsOk());
      ASSERT_THAT(opt->Step(), IsOk());
      ASSERT_THAT(sched->Step(), IsOk());
      opt->ZeroGrad();
      --count;
    }
  }
};

TEST(AcceleratorCheckpoint, ResumeIsBitForBit) {
  test::TempDir dir;
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;

  Trainer straight(options);
  straight.Run(11);  // 20 rows / 3 = 7 batches an epoch: this crosses into the second epoch

  Trainer first(options);
  first.Run(9);  // 7 of epoch 0, 2 of epoch 1
  auto saved = first.acc->SaveState(dir.File("ckpt"));
  ASSERT_THAT(saved, IsOk());
  for (const char* name :
       {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"}) {
    EXPECT_TRUE(std::filesystem::exists(dir.File("ckpt/") + name)) << name;
  }

  // A fresh process-like start from different weights, then load_state.
  Trainer resumed(options, /*init_seed=*/99);
  ASSERT_THAT(resumed.acc->LoadState(dir.File("ckpt")), IsOk());
  EXPECT_EQ(resumed.acc->accumulation_step(), first.acc->accumulation_step());
  resumed.loader->set_epoch(1);
  std::unique_ptr<DataLoader> skipping = resumed.acc->SkipFirstBatches(*resumed.loader, 2);
  resumed.Run(2, skipping.get());

  EXPECT_TRUE(at::equal(resumed.net->weight, straight.net->weight));
  EXPECT_TRUE(at::equal(resumed.net->bias, straight.net->bias));
  EXPECT_EQ(resumed.sched->scheduler().last_epoch(), straight.sched->scheduler().last_epoch());
}

// save_state records the prepared loader's epoch and position: after
// load_state, iterating the loader continues where the saved run was.
TEST(AcceleratorCheckpoint, LoadStateContinuesTheLoader) {
  test::TempDir dir;
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;

  Trainer straight(options);
  straight.Run(11);

  Trainer first(options);
  first.Run(9);  // the 2nd batch of epoch 1
  ASSERT_THAT(first.acc->SaveState(dir.File("ckpt")), IsOk());
  EXPECT_TRUE(std::filesystem::exists(dir.File("ckpt/dataloader_positions_0.pkl")));
  auto positions = LoadLoaderPositions(dir.File("ckpt/dataloader_positions_0.pkl"));
  ASSERT_THAT(positions, IsOk());
  ASSERT_EQ(positions->size(), 1u);
  EXPECT_EQ((*positions)[0].epoch, 1);
  EXPECT_EQ((*positions)[0].batches_yielded, 2);

  Trainer resumed(options, /*init_seed=*/99);
  ASSERT_THAT(resumed.acc->LoadState(dir.File("ckpt")), IsOk());
  EXPECT_EQ(resumed.loader->epoch(), 1);
  EXPECT_EQ(resumed.loader->position().batches_yielded, 2);
  resumed.Run(2);  // no set_epoch, no SkipFirstBatches
  EXPECT_TRUE(at::equal(resumed.net->weight, straight.net->weight));
  EXPECT_TRUE(at::equal(resumed.net->bias, straight.net->bias));

  // Into the next epochs too: 7 batches an epoch, so 5 more end epoch 1 and 3 start epoch 2.
  straight.Run(8);
  resumed.Run(8);
  EXPECT_TRUE(at::equal(resumed.net->weight, straight.net->weight));
  EXPECT_EQ(resumed.loader->position().epoch, 2);
}

TEST(AcceleratorCheckpoint, AutomaticNamingPrunesAndLoadsTheLatest) {
  test::TempDir dir;
  AcceleratorOptions options;
  options.project_config.project_dir = dir.path();
  options.project_config.automatic_checkpoint_naming = true;
  options.project_config.total_limit = 2;
  Trainer t(options);
  for (int i = 0; i < 4; ++i) {
    t.Run(1);
    auto saved = t.acc->SaveState();
    ASSERT_THAT(saved, IsOk());
    EXPECT_THAT(*saved, testing::EndsWith("checkpoint_" + std::to_string(i)));
  }
  EXPECT_FALSE(std::filesystem::exists(dir.File("checkpoints/checkpoint_1")));
  EXPECT_TRUE(std::filesystem::exists(dir.File("checkpoints/checkpoint_2")));
  EXPECT_TRUE(std::filesystem::exists(dir.File("checkpoints/checkpoint_3")));
  at::Tensor latest = t.net->weight.detach().clone();
  t.Run(2);
  ASSERT_THAT(t.acc->LoadState(), IsOk());
  EXPECT_TRUE(at::equal(t.net->weight, latest));
  // The next save continues the numbering instead of colliding with checkpoint_3.
  EXPECT_EQ(t.acc->project_configuration().iteration, 4);
  auto next = t.acc->SaveState();
  ASSERT_THAT(next, IsOk());
  EXPECT_THAT(*next, testing::EndsWith("checkpoint_4"));
}

// A registered object whose state can be made too big for the disk.
struct Blob : Checkpointable {
  at::Tensor value = at::zeros({2});
  std::map<std::string, at::Tensor> StateDict() const override { return {{"value", value}}; }
  absl::Status LoadStateDict(const std::map<std::string, at::Tensor>& s) override {
    value = s.at("value").clone();
    return absl::OkStatus();
  }
};

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// save_state writes a temporary folder and renames it when complete: a save
// that fails midway (a full disk) leaves the earlier checkpoints as they
// were, prunes nothing, and load_state picks the last complete one.
TEST(AcceleratorCheckpoint, AFailedSaveLeavesTheCompleteCheckpoints) {
  test::TempDir dir;
  AcceleratorOptions options;
  options.project_config.project_dir = dir.path();
  options.project_config.automatic_checkpoint_naming = true;
  options.project_config.total_limit = 2;
  Trainer t(options);
  auto blob = std::make_shared<Blob>();
  t.acc->RegisterForCheckpointing(blob);
  t.Run(1);
  ASSERT_THAT(t.acc->SaveState(), IsOk());
  t.Run(1);
  ASSERT_THAT(t.acc->SaveState(), IsOk());
  const at::Tensor saved_weight = t.net->weight.detach().clone();
  // A crashed save's leftovers and a folder of the user's: neither is a checkpoint.
  std::filesystem::create_directories(dir.File("checkpoints/checkpoint_7.tmp-1"));
  std::filesystem::create_directories(dir.File("checkpoints/notes"));

  t.Run(1);
  blob->value = at::zeros({1 << 20});  // 4 MiB, written after the model and optimizer
  absl::StatusOr<std::string> failed = absl::UnknownError("not run");
  {
    test::FileSizeLimit full_disk(1 << 20);
    ASSERT_TRUE(full_disk.ok());
    failed = t.acc->SaveState();
  }
  EXPECT_THAT(failed, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(
      Entries(dir.File("checkpoints")),
      ::testing::ElementsAre("checkpoint_0", "checkpoint_1", "checkpoint_7.tmp-1", "notes"));
  EXPECT_THAT(Entries(dir.File("checkpoints/checkpoint_0")),
              ::testing::Contains("model.safetensors"));

  blob->value = at::zeros({2});
  t.Run(1);
  ASSERT_THAT(t.acc->LoadState(), IsOk());
  EXPECT_TRUE(at::equal(t.net->weight, saved_weight));
  EXPECT_EQ(t.acc->project_configuration().iteration, 2);
  // The next save prunes checkpoint_0 once checkpoint_2 is in place, and
  // only checkpoint folders.
  auto next = t.acc->SaveState();
  ASSERT_THAT(next, IsOk());
  EXPECT_THAT(*next, ::testing::EndsWith("checkpoint_2"));
  EXPECT_THAT(
      Entries(dir.File("checkpoints")),
      ::testing::ElementsAre("checkpoint_1", "checkpoint_2", "checkpoint_7.tmp-1", "notes"));
  // An explicit folder that exists is updated, its other files kept.
  Trainer explicit_dir({});
  std::filesystem::create_directories(dir.File("mine"));
  dir.Write("mine/notes.txt", "keep");
  ASSERT_THAT(explicit_dir.acc->SaveState(dir.File("mine")), IsOk());
  EXPECT_THAT(Entries(dir.File("mine")), ::testing::Contains("notes.txt"));
  EXPECT_THAT(Entries(dir.File("mine")), ::testing::Contains("model.safetensors"));
  EXPECT_THAT(Entries(dir.path()),
              ::testing::Not(::testing::Contains(::testing::StartsWith("mine.tmp-"))));
}

TEST(AcceleratorCheckpoint, LoadErrorsNameTheProblem) {
  test::TempDir dir;
  Trainer t({});
  EXPECT_THAT(t.acc->LoadState(dir.File("missing")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
  EXPECT_THAT(t.acc->LoadState(), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("automatic_checkpoint_naming")));
  ASSERT_THAT(t.acc->SaveState(dir.File("a")), IsOk());
  // A registered object without its file.
  struct Counter : Checkpointable {
    at::Tensor value = at::zeros({1});
    std::map<std::string, at::Tensor> StateDict() const override { return {{"value", value}}; }
    absl::Status LoadStateDict(const std::map<std::string, at::Tensor>& s) override {
      value = s.at("value");
      return absl::OkStatus();
    }
  };
  t.acc->RegisterForCheckpointing(std::make_shared<Counter>());
  EXPECT_THAT(t.acc->LoadState(dir.File("a")),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("custom_checkpoint")));
  // A model of another shape.
  auto acc = MakeAccelerator();
  ASSERT_THAT(acc->PrepareModel(torch::nn::Linear(5, 3).ptr()), IsOk());
  EXPECT_THAT(acc->LoadState(dir.File("a")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight")));
  // Saved with one loader, loaded with two prepared.
  Trainer two({});
  ASSERT_THAT(two.acc->SaveState(dir.File("b")), IsOk());
  auto second = two.acc->PrepareDataLoader(*Loader(Regression(8), 2));
  ASSERT_THAT(second, IsOk());
  EXPECT_THAT(two.acc->LoadState(dir.File("b")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("dataloader_positions_0.pkl"), HasSubstr("1 data loader"),
                             HasSubstr("2 are prepared"))));
}

TEST(AcceleratorCheckpoint, CustomObjectsRoundTrip) {
  test::TempDir dir;
  struct Counter : Checkpointable {
    at::Tensor value = at::zeros({2});
    std::map<std::string, at::Tensor> StateDict() const override { return {{"value", value}}; }
    absl::Status LoadStateDict(const std::map<std::string, at::Tensor>& s) override {
      value = s.at("value").clone();
      return absl::OkStatus();
    }
  };
  auto counter = std::make_shared<Counter>();
  counter->value = at::tensor({3.5f, -1.0f});
  auto acc = MakeAccelerator();
  acc->RegisterForCheckpointing(counter);
  ASSERT_THAT(acc->SaveState(dir.File("c")), IsOk());
  counter->value.zero_();
  ASSERT_THAT(acc->LoadState(dir.File("c")), IsOk());
  EXPECT_TRUE(at::equal(counter->value, at::tensor({3.5f, -1.0f})));
}

TEST(AcceleratorSaveModel, ShardsAndReloads) {
  test::TempDir dir;
  auto acc = MakeAccelerator();
  torch::nn::Linear net = MakeNet();
  auto model = acc->PrepareModel(net.ptr());
  ASSERT_THAT(acc->SaveModel(**model, dir.File("m"), "40"), IsOk());  // 48 + 12 bytes: 2 shards
  EXPECT_TRUE(std::filesystem::exists(dir.File("m/model.safetensors.index.json")));
  auto back = LoadModelWeights(dir.File("m"));
  ASSERT_THAT(back, IsOk());
  ASSERT_EQ(back->size(), 2u);
  EXPECT_THAT(acc->SaveModel(**model, dir.File("m"), "ten gigs"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_shard_size")));
}

// ---- Trackers, batch size search ----

TEST(AcceleratorTrackers, LogsJsonLinesOnTheMainProcess) {
  test::TempDir dir;
  AcceleratorOptions options;
  options.log_with = {"jsonl"};
  options.project_config.project_dir = dir.path();
  auto acc = MakeAccelerator(options);
  ASSERT_THAT(acc->InitTrackers("run", {{"lr", "0.1"}}), IsOk());
  ASSERT_THAT(acc->Log({{"loss", 1.5}}, 3), IsOk());
  ASSERT_THAT(acc->EndTraining(), IsOk());
  std::string text = test::ReadAll(dir.File("run/metrics.jsonl"));
  EXPECT_THAT(text, HasSubstr("\"loss\""));
  EXPECT_THAT(text, HasSubstr("1.5"));
}

TEST(FindExecutableBatchSize, HalvesOnOutOfMemory) {
  std::vector<int64_t> tried;
  EXPECT_THAT(FindExecutableBatchSize(64,
                                      [&](int64_t bs) -> absl::Status {
                                        tried.push_back(bs);
                                        if (bs > 8) return absl::ResourceExhaustedError("oom");
                                        return absl::OkStatus();
                                      }),
              IsOk());
  EXPECT_EQ(tried, std::vector<int64_t>({64, 32, 16, 8}));
  tried.clear();
  EXPECT_THAT(FindExecutableBatchSize(4,
                                      [&](int64_t bs) -> absl::Status {
                                        tried.push_back(bs);
                                        if (bs > 1) throw std::bad_alloc();
                                        return absl::InternalError("a real bug");
                                      }),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("a real bug")));
  EXPECT_EQ(tried, std::vector<int64_t>({4, 2, 1}));
  EXPECT_THAT(
      FindExecutableBatchSize(2, [](int64_t) { return absl::ResourceExhaustedError("always"); }),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("no executable batch size")));
  EXPECT_THAT(FindExecutableBatchSize(0, [](int64_t) { return absl::OkStatus(); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("starting_batch_size")));
}

// ---- Several processes (real ranks over gloo) ----

// Each rank trains one step on its shard of a global batch; the result must
// equal one single-process step on the whole global batch.
TEST(AcceleratorDistributedWorker, DataParallelStep) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of AcceleratorDistributed.*";
  const int64_t k = std::stoi(std::getenv("ACCUM"));
  AcceleratorOptions options;
  options.gradient_accumulation_steps = k;
  options.ddp_kwargs = DistributedDataParallelKwargs{};
  options.ddp_kwargs->bucket_cap_mb = 0.00001;  // one bucket per tensor
  auto created = Accelerator::Create(options);
  ASSERT_THAT(created, IsOk());
  auto& acc = *created;
  const int64_t p = acc->num_processes();
  const int64_t b = 2;
  auto ds = Regression(p * b * k * 2);  // two optimizer steps
  // Rank 0's initial weights win (DDP broadcasts them).
  torch::nn::Linear net = MakeNet(acc->process_index() == 0 ? 7 : 1234);
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.2));
  std::shared_ptr<LRScheduler> lambda =
      MakeLambdaLR(*sgd, [](int64_t n) { return 1.0 - static_cast<double>(n) / 100; });
  auto model = acc->PrepareModel(net.ptr());
  ASSERT_THAT(model, IsOk());
  auto opt = acc->PrepareOptimizer(sgd);
  auto sched = acc->PrepareScheduler(lambda);
  auto loader = acc->PrepareDataLoader(*Loader(ds, b));
  ASSERT_THAT(loader, IsOk());
  ASSERT_THAT((*loader)->Start(), IsOk());
  std::vector<at::Tensor> seen;
  while (true) {
    auto batch = (*loader)->Next();
    ASSERT_THAT(batch, IsOk());
    if (!*batch) break;
    auto scope = acc->Accumulate({*model});
    ASSERT_THAT(scope, IsOk());
    ASSERT_THAT(acc->Backward(Loss(net, **batch)), IsOk());
    ASSERT_THAT((*opt)->Step(), IsOk());
    ASSERT_THAT((*sched)->Step(), IsOk());
    (*opt)->ZeroGrad();
    auto gathered = acc->GatherForMetrics((*batch)->at("index"));
    ASSERT_THAT(gathered, IsOk());
    seen.push_back(*gathered);
  }
  // gather_for_metrics returns exactly the dataset, in order.
  EXPECT_TRUE(at::equal(at::cat(seen), at::arange(ds->size(), at::kLong)));
  // The scheduler ticked num_processes times per optimizer step.
  EXPECT_NEAR(lambda->last_lrs().at(0), 0.2 * (1.0 - 2.0 * p / 100), 1e-12);

  // The single-process reference: two SGD steps of p*b*k rows each, at the
  // lrs the schedule gives (0.2, then 0.2 * (1 - p/100)).
  torch::nn::Linear ref = MakeNet(7);
  torch::optim::SGD ref_sgd(ref->parameters(), torch::optim::SGDOptions(0.2));
  const int64_t global = p * b * k;
  for (int64_t s = 0; s < 2; ++s) {
    static_cast<torch::optim::SGDOptions&>(ref_sgd.param_groups()[0].options())
        .lr(0.2 * (1.0 - static_cast<double>(s * p) / 100));
    ref_sgd.zero_grad();
    Loss(ref, Rows(*ds, s * global, (s + 1) * global)).backward();
    ref_sgd.step();
  }
  EXPECT_TRUE(at::allclose(net->weight, ref->weight, 1e-5, 1e-6)) << net->weight << "\nvs\n"
                                                                  << ref->weight;
  EXPECT_TRUE(at::allclose(net->bias, ref->bias, 1e-5, 1e-6));
  ASSERT_THAT(acc->WaitForEveryone(), IsOk());
}

// Two prepared models, a backward each (as a GAN's discriminator and
// generator steps): each backward all-reduces only the model it reached,
// and both end with the gradients of one process on the global batch.
// Accelerate's debug mode (ACCELERATE_DEBUG_MODE, accel-launch --debug):
// ranks passing different shapes get the same clear error from Gather, Reduce
// and Broadcast; alike shapes pass. Without it, a mismatch is not checked.
TEST(AcceleratorDistributedWorker, DebugModeChecksShapes) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of AcceleratorDistributed.*";
  auto created = Accelerator::Create({});
  ASSERT_THAT(created, IsOk());
  auto& acc = *created;
  ASSERT_TRUE(acc->debug());
  const int64_t r = acc->process_index();
  const at::Tensor alike = at::ones({2, 3});
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor gathered, acc->Gather(alike));
  EXPECT_EQ(gathered.size(0), 2 * acc->num_processes());
  EXPECT_THAT(acc->Reduce(alike, Reduction::kSum), IsOk());
  const at::Tensor differ = r == 0 ? at::ones({1, 5}) : at::ones({1, 2, 5});
  const std::string listing =
      "Cannot apply desired operation due to shape mismatches. All shapes across devices must be "
      "valid.\n\nOperation: `Accelerator::Gather`\nInput shapes:\n  - Process 0: [1, 5]\n  - "
      "Process 1: [1, 2, 5]";
  EXPECT_THAT(acc->Gather(differ),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(listing)));
  EXPECT_THAT(acc->Reduce(differ, Reduction::kSum),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("`Accelerator::Reduce`")));
  EXPECT_THAT(acc->Broadcast(differ),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("`Accelerator::Broadcast`")));
  EXPECT_THAT(
      acc->Gather(TensorMap{{"x", differ}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("  - Process 1: {'x': [1, 2, 5]}")));
  // The group still works after the refusals.
  EXPECT_THAT(acc->Reduce(alike, Reduction::kSum), IsOk());
}

TEST(AcceleratorDistributed, DebugModeChecksShapes) {
  EXPECT_THAT(test::RunRanks(2, "AcceleratorDistributedWorker.DebugModeChecksShapes",
                             {{"ACCELERATE_DEBUG_MODE", "true"}}),
              Each(0));
  EXPECT_FALSE((*Accelerator::Create({}, FakeEnv()))->debug());
  EXPECT_TRUE((*Accelerator::Create({}, FakeEnv({{"ACCELERATE_DEBUG_MODE", "1"}})))->debug());
}

TEST(AcceleratorDistributedWorker, TwoModelsTwoBackwards) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of AcceleratorDistributed.*";
  AcceleratorOptions options;
  options.ddp_kwargs = DistributedDataParallelKwargs{};
  auto created = Accelerator::Create(options);
  ASSERT_THAT(created, IsOk());
  auto& acc = *created;
  const int64_t p = acc->num_processes(), r = acc->process_index();
  auto ds = Regression(4 * p);
  torch::nn::Linear first = MakeNet(r == 0 ? 7 : 100 + static_cast<uint64_t>(r));
  torch::nn::Linear second = MakeNet(r == 0 ? 8 : 200 + static_cast<uint64_t>(r));
  ASSERT_THAT(acc->PrepareModel(first.ptr()), IsOk());
  ASSERT_THAT(acc->PrepareModel(second.ptr()), IsOk());
  const Batch mine = Rows(*ds, 4 * r, 4 * (r + 1));
  ASSERT_THAT(acc->Backward(Loss(first, mine)), IsOk());
  EXPECT_FALSE(second->weight.grad().defined());
  ASSERT_THAT(acc->Backward(Loss(second, mine)), IsOk());
  torch::nn::Linear first_ref = MakeNet(7);
  torch::nn::Linear second_ref = MakeNet(8);
  Loss(first_ref, Rows(*ds, 0, 4 * p)).backward();
  Loss(second_ref, Rows(*ds, 0, 4 * p)).backward();
  EXPECT_TRUE(at::allclose(first->weight.grad(), first_ref->weight.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(second->weight.grad(), second_ref->weight.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(second->bias.grad(), second_ref->bias.grad(), 1e-5, 1e-6));
  ASSERT_THAT(acc->WaitForEveryone(), IsOk());
}

TEST(AcceleratorDistributed, TwoModelsWithABackwardEachOnTwoRanks) {
  EXPECT_THAT(test::RunRanks(2, "AcceleratorDistributedWorker.TwoModelsTwoBackwards", {}), Each(0));
}

// The "index" column of every batch of one pass (or of the rest of the
// pass in progress when `start` is false).
std::vector<int64_t> Indices(DataLoader& loader, bool start = true) {
  std::vector<int64_t> out;
  if (start) {
    EXPECT_THAT(loader.Start(), IsOk());
  }
  while (true) {
    auto batch = loader.Next();
    EXPECT_THAT(batch, IsOk());
    if (!batch.ok() || !*batch) break;
    at::Tensor index = (**batch).at("index");
    out.insert(out.end(), index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
  }
  return out;
}

// Each rank saves its own position in the shuffled, sharded epoch, and
// load_state brings every rank back to it.
TEST(AcceleratorDistributedWorker, LoaderPositionRoundTrip) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of AcceleratorDistributed.*";
  const std::string dir = std::getenv("CKPT_DIR");
  auto created = Accelerator::Create({});
  ASSERT_THAT(created, IsOk());
  auto& acc = *created;
  // 22 rows in batches of 3: 8 batches, 4 per rank.
  auto prepared = acc->PrepareDataLoader(*Loader(Regression(22), 3, /*shuffle=*/true));
  ASSERT_THAT(prepared, IsOk());
  DataLoader& loader = **prepared;
  EXPECT_EQ(Indices(loader).size(), 12u);
  ASSERT_THAT(loader.Start(), IsOk());
  ASSERT_THAT(loader.Next(), IsOk());  // one batch into epoch 1
  ASSERT_THAT(acc->SaveState(dir + "/ckpt"), IsOk());
  const std::vector<int64_t> rest = Indices(loader, /*start=*/false);
  const std::vector<int64_t> next_epoch = Indices(loader);
  EXPECT_EQ(rest.size(), 9u);
  EXPECT_EQ(loader.epoch(), 3);

  ASSERT_THAT(acc->LoadState(dir + "/ckpt"), IsOk());
  EXPECT_EQ(loader.epoch(), 1);
  EXPECT_EQ(loader.position().batches_yielded, 1);
  EXPECT_EQ(Indices(loader), rest);
  EXPECT_EQ(Indices(loader), next_epoch);
  // The ranks continued different shards.
  auto all = acc->Gather(at::tensor(rest, at::kLong));
  ASSERT_THAT(all, IsOk());
  EXPECT_EQ(std::get<0>(at::_unique(*all)).numel(), 18);
  ASSERT_THAT(acc->WaitForEveryone(), IsOk());
}

TEST(AcceleratorDistributed, TwoRanksSaveAndRestoreTheirLoaderPositions) {
  test::TempDir dir;
  EXPECT_THAT(test::RunRanks(2, "AcceleratorDistributedWorker.LoaderPositionRoundTrip",
                             {{"CKPT_DIR", dir.path()}}),
              Each(0));
}

// use_seedable_sampler false on two ranks whose global RNGs differ: every
// pass draws from one generator, seeded by rank 0's global RNG and
// broadcast at each pass, so the ranks shard one permutation; save_state /
// load_state bring a pass in progress back with its order.
TEST(AcceleratorDistributedWorker, RandomSamplerIsSynchronised) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of AcceleratorDistributed.*";
  const std::string dir = std::getenv("CKPT_DIR");
  AcceleratorOptions options;
  options.dataloader_config.use_seedable_sampler = false;
  auto created = Accelerator::Create(options);
  ASSERT_THAT(created, IsOk());
  auto& acc = *created;
  const int rank = acc->process_index();
  SetSeed(100, /*device_specific=*/true, rank);
  DataLoaderOptions o;
  o.batch_size = 3;
  o.shuffle = true;  // no seed of its own
  auto base = DataLoader::Create(Regression(22), o);
  ASSERT_THAT(base, IsOk());
  // Rank 0's expectation, as torch 1.13 draws it: the generator's seed at
  // prepare, then per pass the DataLoader's base seed (global RNG), randperm,
  // and one more randperm when the sampler is exhausted.
  at::Tensor want = at::empty({2, 22}, at::kLong);
  if (rank == 0) {
    at::Tensor saved = at::detail::getDefaultCPUGenerator().get_state();
    auto draw = [](at::Generator* g) {
      at::Tensor t = at::empty({}, at::kLong);
      if (g != nullptr) {
        t.random_(*g);
      } else {
        t.random_();
      }
      return t.item<int64_t>();
    };
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(draw(nullptr));
    for (int e = 0; e < 2; ++e) {
      draw(nullptr);
      want[e].copy_(at::randperm(22, g, at::TensorOptions().dtype(at::kLong)));
      at::randperm(22, g, at::TensorOptions().dtype(at::kLong));
    }
    at::Generator global = at::detail::getDefaultCPUGenerator();
    global.set_state(saved);
  }
  auto sent = acc->Broadcast(want);
  ASSERT_THAT(sent, IsOk());
  want = *sent;
  auto prepared = acc->PrepareDataLoader(**base);
  ASSERT_THAT(prepared, IsOk());
  DataLoader& loader = **prepared;
  for (int e = 0; e < 2; ++e) {
    std::vector<int64_t> order(want[e].data_ptr<int64_t>(), want[e].data_ptr<int64_t>() + 22);
    auto shard = ShardBatches(MakeBatches(order, 3, false), 3, false, {2, rank, false, true});
    ASSERT_THAT(shard, IsOk());
    std::vector<int64_t> flat;
    for (const auto& b : *shard) flat.insert(flat.end(), b.begin(), b.end());
    EXPECT_EQ(Indices(loader), flat) << "epoch " << e;
  }
  // Resume in the middle of epoch 2.
  ASSERT_THAT(loader.Start(), IsOk());
  ASSERT_THAT(loader.Next(), IsOk());
  ASSERT_THAT(acc->SaveState(dir + "/ckpt"), IsOk());
  const std::vector<int64_t> rest = Indices(loader, /*start=*/false);
  const std::vector<int64_t> next_epoch = Indices(loader);
  at::rand({3});  // the global RNG moves on; load_state brings it back
  ASSERT_THAT(acc->LoadState(dir + "/ckpt"), IsOk());
  EXPECT_EQ(Indices(loader), rest);
  EXPECT_EQ(Indices(loader), next_epoch);
  ASSERT_THAT(acc->WaitForEveryone(), IsOk());
}

TEST(AcceleratorDistributed, TwoRanksShareTheRandomSamplersOrder) {
  test::TempDir dir;
  EXPECT_THAT(test::RunRanks(2, "AcceleratorDistributedWorker.RandomSamplerIsSynchronised",
                             {{"CKPT_DIR", dir.path()}}),
              Each(0));
}

TEST(AcceleratorOptions, DataSeedNeedsTheSeedableSampler) {
  AcceleratorOptions options;
  options.dataloader_config.use_seedable_sampler = false;
  options.dataloader_config.data_seed = 3;
  EXPECT_THAT(Accelerator::Create(options, FakeEnv()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data_seed")));
}

// A save_state that fails on one rank fails on every rank (no rank is left
// in a barrier), leaves no folder behind, and the next save works.
TEST(AcceleratorDistributedWorker, SaveStateFailsTogether) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of AcceleratorDistributed.*";
  const std::string dir = std::getenv("CKPT_DIR");
  AcceleratorOptions options;
  options.project_config.project_dir = dir;
  options.project_config.automatic_checkpoint_naming = true;
  auto created = Accelerator::Create(options);
  ASSERT_THAT(created, IsOk());
  auto& acc = *created;
  const int rank = acc->process_index();
  torch::nn::Linear net = MakeNet();
  ASSERT_THAT(acc->PrepareModel(net.ptr()), IsOk());
  auto blob = std::make_shared<Blob>();
  acc->RegisterForCheckpointing(blob);
  const std::string checkpoints = dir + "/checkpoints";
  auto clean = [&] {
    ASSERT_THAT(acc->WaitForEveryone(), IsOk());  // rank 0 has cleaned up
    EXPECT_TRUE(!std::filesystem::exists(checkpoints) || Entries(checkpoints).empty())
        << ::testing::PrintToString(Entries(checkpoints));
  };

  // The folder exists (rank 0 finds out).
  if (rank == 0) std::filesystem::create_directories(checkpoints + "/checkpoint_0");
  ASSERT_THAT(acc->WaitForEveryone(), IsOk());
  EXPECT_THAT(
      acc->SaveState(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr(rank == 0 ? "already exists" : "rank 0 failed: checkpoint folder")));
  ASSERT_THAT(acc->WaitForEveryone(), IsOk());
  if (rank == 0) std::filesystem::remove(checkpoints + "/checkpoint_0");
  clean();

  // Rank 0's disk is full while it writes the registered object.
  blob->value = at::zeros({1 << 20});
  {
    std::optional<test::FileSizeLimit> full_disk;
    if (rank == 0) full_disk.emplace(1 << 20);
    EXPECT_THAT(acc->SaveState(),
                StatusIs(absl::StatusCode::kResourceExhausted,
                         HasSubstr(rank == 0 ? "custom_checkpoint_0" : "rank 0 failed")));
  }
  blob->value = at::zeros({2});
  clean();

  // Rank 1's disk is full (its random states).
  {
    std::optional<test::FileSizeLimit> full_disk;
    if (rank == 1) full_disk.emplace(1000);
    EXPECT_THAT(acc->SaveState(),
                StatusIs(absl::StatusCode::kResourceExhausted,
                         HasSubstr(rank == 1 ? "random_states_1" : "rank 1 failed")));
  }
  clean();
  EXPECT_EQ(acc->project_configuration().iteration, 0);

  // Then a save works on both.
  auto saved = acc->SaveState();
  ASSERT_THAT(saved, IsOk());
  EXPECT_THAT(*saved, testing::EndsWith("checkpoint_0"));
  ASSERT_THAT(acc->WaitForEveryone(), IsOk());
  EXPECT_THAT(Entries(*saved),
              ::testing::IsSupersetOf({"model.safetensors", "custom_checkpoint_0.pkl",
                                       "random_states_0.pkl", "random_states_1.pkl"}));
  ASSERT_THAT(acc->LoadState(), IsOk());
}

TEST(AcceleratorDistributed, TwoRanksFailASaveTogether) {
  test::TempDir dir;
  EXPECT_THAT(test::RunRanks(2, "AcceleratorDistributedWorker.SaveStateFailsTogether",
                             {{"CKPT_DIR", dir.path()}}, /*timeout_s=*/60),
              Each(0));
}

// gather_for_metrics through real ranks: over a pass of a dataset that does
// not divide evenly, the gathered rows are exactly the dataset, in order,
// none twice, for every split_batches x dispatch_batches combination
// (upstream test_metrics: batch 16, lengths 82, 99 and 512).
TEST(AcceleratorDistributedWorker, GatherForMetricsIsTheDataset) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of AcceleratorDistributed.*";
  AcceleratorOptions options;
  options.dataloader_config.split_batches = std::string(std::getenv("SPLIT")) == "1";
  options.dataloader_config.dispatch_batches = std::string(std::getenv("DISPATCH")) == "1";
  auto created = Accelerator::Create(options);
  ASSERT_THAT(created, IsOk());
  auto& acc = *created;
  for (int64_t n : {99, 82, 512}) {
    SCOPED_TRACE(absl::StrCat("n = ", n));
    auto ds = Regression(n);
    auto loader = acc->PrepareDataLoader(*Loader(ds, 16));
    ASSERT_THAT(loader, IsOk());
    ASSERT_THAT((*loader)->Start(), IsOk());
    std::vector<at::Tensor> indices;
    std::vector<at::Tensor> xs;
    while (true) {
      auto batch = (*loader)->Next();
      ASSERT_THAT(batch, IsOk());
      if (!*batch) break;
      auto index = acc->GatherForMetrics((**batch).at("index"));
      ASSERT_THAT(index, IsOk());
      indices.push_back(*index);
      auto columns = acc->GatherForMetrics(TensorMap{{"x", (**batch).at("x")}});
      ASSERT_THAT(columns, IsOk());
      xs.push_back(columns->at("x"));
    }
    const at::Tensor all = at::cat(indices);
    EXPECT_TRUE(at::equal(all, at::arange(n, at::kLong))) << all;
    EXPECT_TRUE(at::equal(at::cat(xs), Rows(*ds, 0, n).at("x")));
  }
  ASSERT_THAT(acc->WaitForEveryone(), IsOk());
}

void GatherForMetricsOn(int ranks) {
  for (const char* split : {"0", "1"}) {
    for (const char* dispatch : {"0", "1"}) {
      EXPECT_THAT(test::RunRanks(ranks, "AcceleratorDistributedWorker.GatherForMetricsIsTheDataset",
                                 {{"SPLIT", split}, {"DISPATCH", dispatch}}),
                  Each(0))
          << "split_batches " << split << ", dispatch_batches " << dispatch;
    }
  }
}

TEST(AcceleratorDistributed, GatherForMetricsOnTwoRanks) { GatherForMetricsOn(2); }

TEST(AcceleratorDistributed, GatherForMetricsOnFourRanks) { GatherForMetricsOn(4); }

TEST(AcceleratorDistributed, TwoRanksEqualOneProcess) {
  EXPECT_THAT(test::RunRanks(2, "AcceleratorDistributedWorker.DataParallelStep", {{"ACCUM", "1"}}),
              Each(0));
}

TEST(AcceleratorDistributed, TwoRanksWithAccumulationEqualOneProcess) {
  EXPECT_THAT(test::RunRanks(2, "AcceleratorDistributedWorker.DataParallelStep", {{"ACCUM", "3"}}),
              Each(0));
}

TEST(AcceleratorDistributed, FourRanksWithAccumulationEqualOneProcess) {
  EXPECT_THAT(test::RunRanks(4, "AcceleratorDistributedWorker.DataParallelStep", {{"ACCUM", "2"}}),
              Each(0));
}

// ---- Device placement, set_seed(deterministic), objects and iterables ----

// A model whose weights are on the meta device: a move to the cpu fails
// (there is no data to copy), so whether prepare moved it is observable on
// a cpu-only libtorch.
struct MetaNetImpl : torch::nn::Module {
  MetaNetImpl() {
    weight = register_parameter("weight", at::empty({3, 4}, at::kMeta));
    bias = register_parameter("bias", at::empty({3}, at::kMeta));
  }
  at::Tensor weight, bias;
};
std::shared_ptr<torch::nn::Module> MetaNet() { return std::make_shared<MetaNetImpl>(); }

TEST(AcceleratorDevicePlacement, OnByDefaultOffOnRequest) {
  auto placing = MakeAccelerator();
  ASSERT_NE(placing, nullptr);
  // Placement on: the model is moved (here it cannot be, and says so).
  EXPECT_THAT(placing->PrepareModel(MetaNet()),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("moving the model")));
  // A model already on the device is left as it is (no copy).
  torch::nn::Linear net = MakeNet();
  const void* weight = net->weight.data_ptr();
  ASSERT_THAT(placing->PrepareModel(net.ptr()), IsOk());
  EXPECT_EQ(net->weight.data_ptr(), weight);
  // Off for this model only (prepare(..., device_placement=[False])).
  auto kept = placing->PrepareModel(MetaNet(), /*device_placement=*/false);
  ASSERT_THAT(kept, IsOk());
  EXPECT_TRUE((*kept)->module().parameters()[0].is_meta());

  // Off for the Accelerator: models stay; a per-call true still moves.
  AcceleratorOptions options;
  options.device_placement = false;
  auto leaving = MakeAccelerator(options);
  ASSERT_NE(leaving, nullptr);
  auto left = leaving->PrepareModel(MetaNet());
  ASSERT_THAT(left, IsOk());
  for (const at::Tensor& p : (*left)->module().parameters()) EXPECT_TRUE(p.is_meta());
  EXPECT_THAT(leaving->PrepareModel(MetaNet(), /*device_placement=*/true),
              StatusIs(absl::StatusCode::kUnimplemented));
  // Batches stay where the dataset made them (here, on the meta device).
  auto meta_rows = TensorDataset::Create({{"x", at::zeros({4, 2}, at::kMeta)}});
  ASSERT_THAT(meta_rows, IsOk());
  auto loader = leaving->PrepareDataLoader(*Loader(*meta_rows, 2));
  ASSERT_THAT(loader, IsOk());
  ASSERT_THAT((*loader)->Start(), IsOk());
  auto batch = (*loader)->Next();
  ASSERT_THAT(batch, IsOk());
  EXPECT_TRUE((**batch).at("x").is_meta());
  // With placement, the same batches are brought to the device (the cpu),
  // which meta tensors cannot be.
  auto placed = placing->PrepareDataLoader(*Loader(*meta_rows, 2));
  ASSERT_THAT(placed, IsOk());
  EXPECT_FALSE((*placed)->Start().ok());
}

TEST(SetSeed, DeterministicTurnsOnDeterministicAlgorithms) {
  auto& context = at::globalContext();
  const bool before = context.deterministicAlgorithms();
  context.setDeterministicAlgorithms(false, false);
  SetSeed(5);
  EXPECT_FALSE(context.deterministicAlgorithms());  // not asked: left as it was
  SetSeed(5, /*device_specific=*/true, /*process_index=*/2, /*deterministic=*/true);
  EXPECT_TRUE(context.deterministicAlgorithms());
  EXPECT_FALSE(context.deterministicAlgorithmsWarnOnly());
  EXPECT_EQ(LastSeed(), 7u);
  // The seed took: the same draws as a manual seed of 7.
  const at::Tensor drawn = at::rand({4});
  at::manual_seed(7);
  EXPECT_TRUE(at::equal(drawn, at::rand({4})));
  // A nondeterministic op (put_ without accumulate, on any device) now throws.
  at::Tensor target = at::zeros({3});
  EXPECT_ANY_THROW(target.put_(at::tensor({0, 0}, at::kLong), at::ones({2}), false));
  // deterministic=false does not turn it off (Accelerate leaves it too).
  SetSeed(5, false, 0, false);
  EXPECT_TRUE(context.deterministicAlgorithms());
  context.setDeterministicAlgorithms(before, false);
}

TEST(AcceleratorObjects, OneProcess) {
  auto acc = MakeAccelerator();
  ASSERT_NE(acc, nullptr);
  auto one = acc->GatherObject(absl::string_view("only"));
  ASSERT_THAT(one, IsOk());
  EXPECT_EQ(*one, std::vector<std::string>({"only"}));
  std::vector<std::string> list = {"a", "", std::string("\0b", 2)};
  auto flat = acc->GatherObject(list);
  ASSERT_THAT(flat, IsOk());
  EXPECT_EQ(*flat, list);
  ASSERT_THAT(acc->BroadcastObjectList(list), IsOk());
  EXPECT_EQ(list.size(), 3u);
  EXPECT_THAT(acc->BroadcastObjectList(list, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("from_process 1")));
  EXPECT_THAT(acc->GatherForMetrics(at::Tensor(), true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("undefined")));
}

// A stream of `n` rows {"x": [i, i, i, i] / n, "y": ..., "index": i}.
class RegressionStream : public IterableDataset {
 public:
  explicit RegressionStream(int64_t n) : rows_(Regression(n)), n_(n) {}
  absl::Status Reset(int64_t) override {
    position_ = 0;
    return absl::OkStatus();
  }
  absl::StatusOr<std::optional<Example>> Next() override {
    if (position_ >= n_) return std::optional<Example>();
    ACCEL_ASSIGN_OR_RETURN(Example e, rows_->Get(position_++));
    ++reads;
    return std::optional<Example>(std::move(e));
  }
  std::optional<int64_t> size() const override { return n_; }

  int64_t reads = 0;

 private:
  std::shared_ptr<TensorDataset> rows_;
  int64_t n_;
  int64_t position_ = 0;
};

TEST(AcceleratorCheckpoint, AnIterableLoaderResumesByReplayingItsEpoch) {
  test::TempDir dir;
  auto first = MakeAccelerator();
  ASSERT_NE(first, nullptr);
  DataLoaderOptions o;
  o.batch_size = 3;
  auto loader =
      first->PrepareDataLoader(**DataLoader::Create(std::make_shared<RegressionStream>(10), o));
  ASSERT_THAT(loader, IsOk());
  ASSERT_THAT((*loader)->Start(), IsOk());
  ASSERT_THAT((*loader)->Next(), IsOk());
  ASSERT_THAT((*loader)->Next(), IsOk());  // rows 0..5 handed out
  ASSERT_THAT(first->SaveState(dir.File("ckpt")), IsOk());

  auto second = MakeAccelerator();
  ASSERT_NE(second, nullptr);
  auto stream = std::make_shared<RegressionStream>(10);
  auto resumed = second->PrepareDataLoader(**DataLoader::Create(stream, o));
  ASSERT_THAT(resumed, IsOk());
  ASSERT_THAT(second->LoadState(dir.File("ckpt")), IsOk());
  EXPECT_EQ((*resumed)->size(), 2);  // 4 batches an epoch, 2 of them done
  ASSERT_THAT((*resumed)->Start(), IsOk());
  std::vector<at::Tensor> rest;
  while (true) {
    auto batch = (*resumed)->Next();
    ASSERT_THAT(batch, IsOk());
    if (!*batch) break;
    rest.push_back((**batch).at("index"));
  }
  EXPECT_TRUE(at::equal(at::cat(rest), at::arange(6, 10, at::kLong))) << at::cat(rest);
  EXPECT_EQ(stream->reads, 10);  // the skipped batches were read again, then dropped
  EXPECT_EQ((*resumed)->epoch(), 1);
}

TEST(AcceleratorDistributedWorker, ObjectsAndIterables) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of AcceleratorDistributed.*";
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 4;
  const std::string dispatch = std::getenv("DISPATCH");
  if (dispatch != "default") options.dataloader_config.dispatch_batches = dispatch == "1";
  options.dataloader_config.split_batches = std::string(std::getenv("SPLIT")) == "1";
  auto created = Accelerator::Create(options);
  ASSERT_THAT(created, IsOk());
  auto& acc = *created;
  const int rank = acc->process_index();
  const int size = acc->num_processes();

  // gather_object / broadcast_object_list.
  auto names = acc->GatherObject(absl::string_view(absl::StrCat("rank", rank)));
  ASSERT_THAT(names, IsOk());
  std::vector<std::string> want_names;
  for (int r = 0; r < size; ++r) want_names.push_back(absl::StrCat("rank", r));
  EXPECT_EQ(*names, want_names);
  std::vector<std::string> mine(static_cast<size_t>(rank + 1), std::to_string(rank));
  auto flat = acc->GatherObject(mine);
  ASSERT_THAT(flat, IsOk());
  std::vector<std::string> want_flat;
  for (int r = 0; r < size; ++r) want_flat.insert(want_flat.end(), r + 1, std::to_string(r));
  EXPECT_EQ(*flat, want_flat);
  std::vector<std::string> objects =
      rank == 1 ? std::vector<std::string>{"config", std::string("\0\1", 2), ""}
                : std::vector<std::string>{"stale"};
  ASSERT_THAT(acc->BroadcastObjectList(objects, /*from_process=*/1), IsOk());
  EXPECT_EQ(objects, std::vector<std::string>({"config", std::string("\0\1", 2), ""}));
  EXPECT_THAT(acc->BroadcastObjectList(objects, size),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("from_process")));
  // use_gather_object: the ranks' first dimensions differ, nothing is padded.
  at::Tensor rows = at::full({rank + 1, 2}, rank, at::kLong);
  auto gathered = acc->GatherForMetrics(rows, /*use_gather_object=*/true);
  ASSERT_THAT(gathered, IsOk());
  std::vector<at::Tensor> want_rows;
  for (int r = 0; r < size; ++r) want_rows.push_back(at::full({r + 1, 2}, r, at::kLong));
  EXPECT_TRUE(at::equal(*gathered, at::cat(want_rows)));
  EXPECT_THAT(acc->GatherForMetrics(at::zeros({2, rank + 1}), true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past dim 0")));

  // An iterable dataset through the prepared loader (Accelerate's test: 30
  // elements, batch 4; and 31 for a padded last group): gather_for_metrics
  // gives the stream, tensors and objects alike; accumulation syncs every 4
  // steps and at the last batch, which the loader knows one batch ahead.
  for (int64_t n : {30, 31, 8}) {
    SCOPED_TRACE(absl::StrCat("n = ", n));
    DataLoaderOptions o;
    o.batch_size = 4;
    auto stream = std::make_shared<RegressionStream>(n);
    auto base = DataLoader::Create(stream, o);
    ASSERT_THAT(base, IsOk());
    auto loader = acc->PrepareDataLoader(**base);
    ASSERT_THAT(loader, IsOk());
    const int64_t group = options.dataloader_config.split_batches ? 4 : 4 * size;
    const int64_t batches = (n + group - 1) / group;
    EXPECT_EQ((*loader)->size(), batches);
    ASSERT_THAT((*loader)->Start(), IsOk());
    std::vector<at::Tensor> indices, by_object, xs;
    std::vector<std::string> items;
    std::vector<bool> syncs;
    while (true) {
      auto batch = (*loader)->Next();
      ASSERT_THAT(batch, IsOk());
      if (!*batch) break;
      ASSERT_THAT(acc->Accumulate({}), IsOk());
      syncs.push_back(acc->sync_gradients());
      const at::Tensor index = (**batch).at("index");
      auto gathered_index = acc->GatherForMetrics(index);
      ASSERT_THAT(gathered_index, IsOk());
      indices.push_back(*gathered_index);
      auto as_object = acc->GatherForMetrics(index, /*use_gather_object=*/true);
      ASSERT_THAT(as_object, IsOk());
      by_object.push_back(*as_object);
      auto columns = acc->GatherForMetrics(TensorMap{{"x", (**batch).at("x")}}, true);
      ASSERT_THAT(columns, IsOk());
      xs.push_back(columns->at("x"));
      std::vector<std::string> labels;
      for (int64_t i = 0; i < index.numel(); ++i) {
        labels.push_back(std::to_string(index[i].item<int64_t>()));
      }
      auto gathered_labels = acc->GatherForMetrics(labels);
      ASSERT_THAT(gathered_labels, IsOk());
      items.insert(items.end(), gathered_labels->begin(), gathered_labels->end());
    }
    ASSERT_EQ(static_cast<int64_t>(syncs.size()), batches);
    for (int64_t i = 0; i < batches; ++i) {
      EXPECT_EQ(syncs[static_cast<size_t>(i)], (i + 1) % 4 == 0 || i + 1 == batches) << i;
    }
    const at::Tensor all = at::arange(n, at::kLong);
    EXPECT_TRUE(at::equal(at::cat(indices), all)) << at::cat(indices);
    EXPECT_TRUE(at::equal(at::cat(by_object), all)) << at::cat(by_object);
    EXPECT_TRUE(at::equal(at::cat(xs), Rows(*Regression(n), 0, n).at("x")));
    std::vector<std::string> want_items;
    for (int64_t i = 0; i < n; ++i) want_items.push_back(std::to_string(i));
    EXPECT_EQ(items, want_items);
    // Dispatching (the default for iterables): rank 0 alone reads the
    // stream; without it every rank reads all of it.
    EXPECT_EQ(stream->reads, dispatch == "0" || rank == 0 ? n : 0);
  }
  ASSERT_THAT(acc->WaitForEveryone(), IsOk());
}

TEST(AcceleratorDistributed, ObjectsAndIterablesOnTwoRanks) {
  for (const char* split : {"0", "1"}) {
    for (const char* dispatch : {"default", "0"}) {
      EXPECT_THAT(test::RunRanks(2, "AcceleratorDistributedWorker.ObjectsAndIterables",
                                 {{"SPLIT", split}, {"DISPATCH", dispatch}}),
                  Each(0))
          << "split_batches " << split << ", dispatch_batches " << dispatch;
    }
  }
}

TEST(AcceleratorDistributed, ObjectsAndIterablesOnThreeRanks) {
  EXPECT_THAT(test::RunRanks(3, "AcceleratorDistributedWorker.ObjectsAndIterables",
                             {{"SPLIT", "0"}, {"DISPATCH", "0"}}),
              Each(0));
}

}  // namespace
}  // namespace accel::train
