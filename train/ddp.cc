#include "train/ddp.h"

#include <chrono>
#include <mutex>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/status.h"

namespace accel::train {
namespace {

constexpr int64_t kFirstBucketBytes = int64_t{1} << 20;  // PyTorch DDP's first bucket

struct Param {
  std::string name;
  at::Tensor tensor;
  size_t bucket = 0;
  bool ready = false;
};

struct Bucket {
  std::vector<size_t> params;  // indices into params_
  size_t pending = 0;          // params not yet ready this iteration
  bool launched = false;
  std::vector<at::Tensor> buffers;  // one flat buffer; outlives its pending work
  std::unique_ptr<PendingWork> work;
  c10::ScalarType dtype = c10::ScalarType::Float;
};

class Synchronizer;

// Runs after AccumulateGrad wrote a parameter's .grad: the parameter is ready.
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(Synchronizer* owner, size_t index) : owner_(owner), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override;

 private:
  Synchronizer* owner_;
  size_t index_;
};

class Synchronizer : public GradientSynchronizer {
 public:
  Synchronizer(ProcessGroup& group, const DdpOptions& options) : group_(group), options_(options) {}

  ~Synchronizer() override {
    // Hooks hold a raw pointer to us: make them inert before we go.
    std::lock_guard<std::mutex> lock(mu_);
    dead_ = true;
    for (auto& bucket : buckets_) {
      if (bucket.work) (void)bucket.work->Wait();
    }
  }

  absl::Status Init(NamedTensors parameters, NamedTensors buffers) {
    // Every rank starts from rank 0's weights and buffers.
    {
      at::NoGradGuard no_grad;
      for (auto& [name, t] : parameters) {
        absl::Status s = group_.Broadcast(t, 0);
        if (!s.ok()) return Annotate(s, absl::StrCat("broadcasting parameter ", name));
      }
      for (auto& [name, t] : buffers) {
        absl::Status s = group_.Broadcast(t, 0);
        if (!s.ok()) return Annotate(s, absl::StrCat("broadcasting buffer ", name));
      }
    }
    buffers_ = std::move(buffers);
    for (auto& [name, t] : parameters) {
      if (!t.requires_grad()) continue;
      params_.push_back(Param{name, t});
    }
    // Buckets in reverse registration order (gradients arrive roughly in
    // that order during backward), one dtype per bucket.
    const auto cap = static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024);
    int64_t bytes = 0;
    for (size_t i = params_.size(); i-- > 0;) {
      const at::Tensor& t = params_[i].tensor;
      const int64_t size = t.numel() * static_cast<int64_t>(t.element_size());
      const int64_t limit = buckets_.size() <= 1 ? std::min(kFirstBucketBytes, cap) : cap;
      if (buckets_.empty() || buckets_.back().dtype != t.scalar_type() ||
          (bytes + size > limit && !buckets_.back().params.empty())) {
        buckets_.emplace_back();
        buckets_.back().dtype = t.scalar_type();
        bytes = 0;
      }
      buckets_.back().params.push_back(i);
      params_[i].bucket = buckets_.size() - 1;
      bytes += size;
    }
    for (auto& bucket : buckets_) bucket.pending = bucket.params.size();
    for (size_t i = 0; i < params_.size(); ++i) {
      absl::Status s = CallTorch([&] {
        std::shared_ptr<torch::autograd::Node> acc =
            torch::autograd::impl::grad_accumulator(params_[i].tensor);
        acc->add_post_hook(std::make_unique<ReadyHook>(this, i));
        // The variable holds its accumulator weakly; keep it (and our hook) alive.
        accumulators_.push_back(std::move(acc));
      });
      if (!s.ok()) return Annotate(s, absl::StrCat("hooking parameter ", params_[i].name));
    }
    return absl::OkStatus();
  }

  void set_require_sync(bool require_sync) override { require_sync_ = require_sync; }
  bool require_sync() const override { return require_sync_; }

  absl::Status PrepareForward() override {
    if (!options_.broadcast_buffers) return absl::OkStatus();
    at::NoGradGuard no_grad;
    for (auto& [name, t] : buffers_) {
      absl::Status s = group_.Broadcast(t, 0);
      if (!s.ok()) return Annotate(s, absl::StrCat("broadcasting buffer ", name));
    }
    return absl::OkStatus();
  }

  void OnReady(size_t index) {
    std::lock_guard<std::mutex> lock(mu_);
    if (dead_ || !require_sync_) return;
    Param& p = params_[index];
    if (p.ready) return;  // a parameter used twice gets one hook call per backward
    p.ready = true;
    Bucket& b = buckets_[p.bucket];
    if (--b.pending == 0) LaunchReadyLocked();
  }

  absl::Status Finish() override {
    if (!require_sync_) return absl::OkStatus();
    std::unique_lock<std::mutex> lock(mu_);
    if (!launch_error_.ok()) return Reset(launch_error_);
    // Parameters that got no gradient this backward.
    std::vector<std::string> unused;
    for (Param& p : params_) {
      if (p.ready) continue;
      if (!options_.find_unused_parameters) {
        unused.push_back(p.name);
        continue;
      }
      p.ready = true;  // its gradient counts as zeros (LaunchReadyLocked)
    }
    if (!unused.empty()) {
      return Reset(absl::FailedPreconditionError(absl::StrCat(
          "Expected to have finished reduction in the prior iteration before starting a new "
          "one: parameters that did not receive a gradient: ",
          absl::StrJoin(unused, ", "),
          ". Set DistributedDataParallelKwargs.find_unused_parameters if the model uses only part "
          "of its parameters in a forward")));
    }
    for (auto& b : buckets_) b.pending = 0;
    LaunchReadyLocked();
    if (!launch_error_.ok()) return Reset(launch_error_);
    const auto start = std::chrono::steady_clock::now();
    for (Bucket& b : buckets_) {
      absl::Status s = b.work->Wait();
      if (!s.ok()) return Reset(Annotate(s, "gradient all-reduce"));
    }
    wait_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    absl::Status copied = CallTorch([&] {
      at::NoGradGuard no_grad;
      const double world = group_.size();
      for (Bucket& b : buckets_) {
        at::Tensor flat = b.buffers[0];
        if (flat.scalar_type() != b.dtype) flat = flat.to(b.dtype);
        flat.div_(world);
        int64_t offset = 0;
        for (size_t i : b.params) {
          at::Tensor& t = params_[i].tensor;
          at::Tensor slice = flat.narrow(0, offset, t.numel()).view(t.sizes());
          offset += t.numel();
          at::Tensor& grad = t.mutable_grad();
          if (options_.gradient_as_bucket_view || !grad.defined()) {
            grad = slice;
          } else {
            grad.copy_(slice);
          }
        }
      }
    });
    return Reset(Annotate(copied, "writing the averaged gradients"));
  }

  int num_buckets() const override { return static_cast<int>(buckets_.size()); }
  std::vector<std::vector<std::string>> bucket_names() const override {
    std::vector<std::vector<std::string>> out;
    for (const Bucket& b : buckets_) {
      out.emplace_back();
      for (size_t i : b.params) out.back().push_back(params_[i].name);
    }
    return out;
  }
  double wait_seconds() const override { return wait_seconds_; }
  int64_t reduced_bytes() const override { return reduced_bytes_; }

 private:
  // Launches, in bucket order, every bucket whose parameters are all ready
  // (every rank issues the collectives in the same order, whatever order
  // its gradients arrived in).
  void LaunchReadyLocked() {
    while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
      Bucket& b = buckets_[next_bucket_];
      ++next_bucket_;
      absl::Status s = CallTorch([&] {
        at::NoGradGuard no_grad;
        std::vector<at::Tensor> parts;
        for (size_t i : b.params) {
          const at::Tensor& t = params_[i].tensor;
          const at::Tensor& g = t.grad();
          parts.push_back(g.defined() ? g.reshape({-1}) : at::zeros({t.numel()}, t.options()));
        }
        at::Tensor flat = parts.size() == 1 ? parts[0].clone() : at::cat(parts);
        if (options_.comm_hook == CommHook::kFp16) flat = flat.to(at::kHalf);
        if (options_.comm_hook == CommHook::kBf16) flat = flat.to(at::kBFloat16);
        b.buffers = {flat};
        reduced_bytes_ += flat.numel() * static_cast<int64_t>(flat.element_size());
      });
      if (s.ok()) {
        absl::StatusOr<std::unique_ptr<PendingWork>> work =
            group_.AllReduceAsync(b.buffers, ReduceOp::kSum);
        if (work.ok()) {
          b.work = *std::move(work);
        } else {
          s = work.status();
        }
      }
      if (!s.ok() && launch_error_.ok()) launch_error_ = Annotate(s, "gradient all-reduce");
      b.launched = true;
    }
  }

  // Clears the iteration's state and passes `status` through.
  absl::Status Reset(absl::Status status) {
    for (Bucket& b : buckets_) {
      if (b.work) (void)b.work->Wait();
      b.work.reset();
      b.launched = false;
      b.pending = b.params.size();
    }
    for (Param& p : params_) p.ready = false;
    next_bucket_ = 0;
    launch_error_ = absl::OkStatus();
    return status;
  }

  ProcessGroup& group_;
  DdpOptions options_;
  std::mutex mu_;
  bool dead_ = false;
  bool require_sync_ = true;
  std::vector<Param> params_;
  NamedTensors buffers_;
  std::vector<Bucket> buckets_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  size_t next_bucket_ = 0;
  absl::Status launch_error_;
  double wait_seconds_ = 0;
  int64_t reduced_bytes_ = 0;
};

torch::autograd::variable_list ReadyHook::operator()(const torch::autograd::variable_list& outputs,
                                                     const torch::autograd::variable_list&) {
  owner_->OnReady(index_);
  return outputs;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GradientSynchronizer>> GradientSynchronizer::Attach(
    NamedTensors parameters, NamedTensors buffers, ProcessGroup& group, const DdpOptions& options) {
  if (options.bucket_cap_mb <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket_cap_mb must be > 0, got ", options.bucket_cap_mb));
  }
  if (options.comm_hook == CommHook::kBf16 && group.backend() == "gloo") {
    // PyTorch's bf16_compress_hook is an NCCL feature: gloo in libtorch 1.13
    // has no bfloat16 reduction ("Invalid scalar type").
    return absl::InvalidArgumentError(
        "the bf16 compression hook needs NCCL; gloo cannot sum bfloat16 (use fp16 or none)");
  }
  auto sync = std::make_unique<Synchronizer>(group, options);
  ACCEL_RETURN_IF_ERROR(sync->Init(std::move(parameters), std::move(buffers)));
  return std::unique_ptr<GradientSynchronizer>(std::move(sync));
}

}  // namespace accel::train
