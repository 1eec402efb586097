// accel-test [--num_processes N] [--config_file F]: a short distributed
// sanity run (Accelerate's `accelerate test`). It launches itself through
// accel-launch and checks, on every rank: the process state, collectives,
// split_between_processes, that a prepared loader's gathered batches are the
// dataset (in order, and as a set when shuffled), and that a data-parallel
// training step equals one process on the global batch.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "train/accelerator.h"

namespace {

using accel::train::Accelerator;

#define CHECK_OR_RETURN(cond, what)                                                \
  do {                                                                             \
    if (!(cond)) return absl::InternalError(absl::StrCat("check failed: ", what)); \
  } while (0)

absl::Status Worker() {
  ACCEL_ASSIGN_OR_RETURN(auto acc, Accelerator::Create({}));
  const int p = acc->num_processes(), r = acc->process_index();
  acc->Print(absl::StrCat("accel-test: ", p, " processes, distributed type ",
                          accel::train::DistributedTypeName(acc->distributed_type())));
  // State.
  CHECK_OR_RETURN(acc->is_main_process() == (r == 0), "is_main_process");
  CHECK_OR_RETURN(acc->is_last_process() == (r == p - 1), "is_last_process");
  // Collectives (test_ops.py's values).
  at::Tensor mine = at::arange(p, at::kFloat) + 1 + p * r;
  ACCEL_ASSIGN_OR_RETURN(at::Tensor gathered, acc->Gather(mine));
  CHECK_OR_RETURN(at::equal(gathered, at::arange(1, p * p + 1, at::kFloat)), "gather");
  ACCEL_ASSIGN_OR_RETURN(at::Tensor sent, acc->Broadcast(mine));
  CHECK_OR_RETURN(at::equal(sent, at::arange(1, p + 1, at::kFloat)), "broadcast");
  ACCEL_ASSIGN_OR_RETURN(at::Tensor mean, acc->Reduce(mine, accel::train::Reduction::kMean));
  CHECK_OR_RETURN(at::allclose(mean, at::arange(p, at::kFloat) + 1 + p * (p - 1) / 2.0), "reduce");
  // split_between_processes covers every item once.
  std::vector<int> items(10);
  for (int i = 0; i < 10; ++i) items[i] = i;
  std::vector<int> share = acc->SplitBetweenProcesses(items);
  ACCEL_ASSIGN_OR_RETURN(
      at::Tensor count,
      acc->Reduce(at::tensor({static_cast<float>(share.size())}), accel::train::Reduction::kSum));
  CHECK_OR_RETURN(count.item<float>() == 10, "split_between_processes");
  // The dataloader: gathered batches are arange(32 * P), and a shuffle of it.
  for (bool shuffle : {false, true}) {
    ACCEL_ASSIGN_OR_RETURN(
        auto ds, accel::train::TensorDataset::Create({{"x", at::arange(32 * p, at::kLong)}}));
    accel::train::DataLoaderOptions o;
    o.batch_size = 4;
    o.shuffle = shuffle;
    ACCEL_ASSIGN_OR_RETURN(auto base, accel::train::DataLoader::Create(ds, o));
    ACCEL_ASSIGN_OR_RETURN(auto loader, acc->PrepareDataLoader(*base));
    ACCEL_RETURN_IF_ERROR(loader->Start());
    std::vector<at::Tensor> seen;
    while (true) {
      ACCEL_ASSIGN_OR_RETURN(auto batch, loader->Next());
      if (!batch) break;
      ACCEL_ASSIGN_OR_RETURN(at::Tensor all, acc->GatherForMetrics(batch->at("x")));
      seen.push_back(all);
    }
    at::Tensor got = at::cat(seen);
    if (shuffle) got = std::get<0>(got.sort());
    CHECK_OR_RETURN(at::equal(got, at::arange(32 * p, at::kLong)),
                    shuffle ? "shuffled dataloader" : "dataloader");
  }
  // Training: one data-parallel step equals one process on the global batch.
  at::manual_seed(r == 0 ? 3 : 99);
  torch::nn::Linear net(3, 2);
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.5));
  ACCEL_ASSIGN_OR_RETURN(auto* model, acc->PrepareModel(net.ptr()));
  ACCEL_ASSIGN_OR_RETURN(auto* opt, acc->PrepareOptimizer(sgd));
  at::Tensor x = at::sin(at::arange(6 * p, at::kFloat)).view({2 * p, 3});
  ACCEL_RETURN_IF_ERROR(acc->Backward(net->forward(x.narrow(0, 2 * r, 2)).pow(2).mean()));
  ACCEL_RETURN_IF_ERROR(opt->Step());
  (void)model;
  at::manual_seed(3);
  torch::nn::Linear ref(3, 2);
  torch::optim::SGD ref_sgd(ref->parameters(), torch::optim::SGDOptions(0.5));
  ref->forward(x).pow(2).mean().backward();
  ref_sgd.step();
  CHECK_OR_RETURN(at::allclose(net->weight, ref->weight, 1e-5, 1e-6), "training equivalence");
  return acc->WaitForEveryone();
}

}  // namespace

int main(int argc, char** argv) {
  if (std::getenv("ACCEL_TEST_RANK_OF") != nullptr) {
    absl::Status status = Worker();
    if (!status.ok()) {
      std::cerr << "accel-test: rank " << (std::getenv("RANK") ? std::getenv("RANK") : "?") << ": "
                << status.message() << "\n";
      return 1;
    }
    return 0;
  }
  std::string processes = "2", config;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--num_processes" || a == "--num-processes") && i + 1 < argc) {
      processes = argv[++i];
    } else if ((a == "--config_file" || a == "--config-file") && i + 1 < argc) {
      config = argv[++i];
    } else {
      std::cerr << "usage: accel-test [--num_processes N] [--config_file F]\n";
      return a == "--help" ? 0 : 1;
    }
  }
  char self[4096] = {0};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 1;
  const std::string exe(self, static_cast<size_t>(n));
  const std::string launcher = (std::filesystem::path(exe).parent_path() / "accel-launch").string();
  std::string cmd = absl::StrCat("ACCEL_TEST_RANK_OF=1 '", launcher, "' --num_processes ",
                                 processes, " --main_process_port 0");
  if (!config.empty()) absl::StrAppend(&cmd, " --config_file '", config, "'");
  absl::StrAppend(&cmd, " '", exe, "'");
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    std::cerr << "accel-test: the distributed run failed (see above)\n";
    return 1;
  }
  std::cout << "Test is a success! You are ready for your distributed training!\n";
  return 0;
}
