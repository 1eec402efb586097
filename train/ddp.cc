#include "train/ddp.h"

#include <algorithm>
#include <chrono>
#include <map>
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
  int64_t offset = 0;  // into the bucket's flat buffer, in elements
  bool ready = false;  // its gradient is final for this backward
  bool used = false;   // got a gradient since the last synchronization
};

struct Bucket {
  std::vector<size_t> params;  // indices into params_
  size_t pending = 0;          // params not yet ready this iteration
  c10::ScalarType dtype = c10::ScalarType::Float;
  // The bucket's gradients, flat, in the parameters' dtype. Lives as long as
  // the synchronizer, so with gradient_as_bucket_view each .grad is a view
  // of it and AccumulateGrad writes straight into it (no copy either way).
  at::Tensor flat;
  // What travels: `flat` itself, or its fp16/bf16 copy under a comm hook.
  // A vector because AllReduceAsync keeps a pointer to it until Wait.
  std::vector<at::Tensor> wire;
  std::unique_ptr<PendingWork> work;
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

// The slice of `flat` that holds a gradient shaped like `param`.
at::Tensor SliceOf(const at::Tensor& flat, const at::Tensor& param, int64_t offset) {
  return flat.narrow(0, offset, param.numel()).view(param.sizes());
}

// Whether `grad` already is that slice (a bucket view from an earlier step).
bool IsSlice(const at::Tensor& grad, const at::Tensor& slice) {
  return grad.defined() && grad.data_ptr() == slice.data_ptr() && grad.sizes() == slice.sizes() &&
         grad.strides() == slice.strides() && grad.scalar_type() == slice.scalar_type();
}

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
    for (const auto* list : {&parameters, &buffers}) {
      for (const auto& [name, t] : *list) {
        if (!t.defined()) {
          return absl::InvalidArgumentError(
              absl::StrCat(list == &parameters ? "parameter " : "buffer ", name, " is undefined"));
        }
      }
    }
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
      if (!t.is_leaf()) {
        // Only a leaf has an AccumulateGrad to hook, and a .grad to average.
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter ", name, " is not a leaf tensor (it was computed from others)"));
      }
      params_.push_back(Param{name, t});
    }
    // Buckets in reverse registration order (gradients arrive roughly in
    // that order during backward), one dtype per bucket; the first is capped
    // at 1 MiB so that communication starts early, as PyTorch's DDP does.
    // (The 1 MiB applies to each dtype's first bucket, as PyTorch's limits
    // are per dtype.)
    const auto cap = static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024);
    std::map<c10::ScalarType, int> buckets_of_dtype;
    int64_t bytes = 0;
    for (size_t i = params_.size(); i-- > 0;) {
      const at::Tensor& t = params_[i].tensor;
      const int64_t size = t.numel() * static_cast<int64_t>(t.element_size());
      const int64_t limit =
          buckets_of_dtype[t.scalar_type()] <= 1 ? std::min(kFirstBucketBytes, cap) : cap;
      if (buckets_.empty() || buckets_.back().dtype != t.scalar_type() ||
          (bytes + size > limit && !buckets_.back().params.empty())) {
        buckets_.emplace_back();
        buckets_.back().dtype = t.scalar_type();
        ++buckets_of_dtype[t.scalar_type()];
        bytes = 0;
      }
      buckets_.back().params.push_back(i);
      params_[i].bucket = buckets_.size() - 1;
      bytes += size;
    }
    absl::Status allocated = CallTorch([&] {
      for (auto& bucket : buckets_) {
        bucket.pending = bucket.params.size();
        int64_t numel = 0;
        for (size_t i : bucket.params) {
          params_[i].offset = numel;
          numel += params_[i].tensor.numel();
        }
        bucket.flat = at::zeros({numel}, params_[bucket.params[0]].tensor.options());
      }
    });
    if (!allocated.ok()) return Annotate(allocated, "allocating the gradient buckets");
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

  void set_require_sync(bool require_sync) override {
    std::lock_guard<std::mutex> lock(mu_);
    require_sync_ = require_sync;
  }
  bool require_sync() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return require_sync_;
  }
  bool received_gradients() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return std::any_of(params_.begin(), params_.end(), [](const Param& p) { return p.ready; });
  }

  absl::Status PrepareForward() override {
    if (!options_.broadcast_buffers) return absl::OkStatus();
    at::NoGradGuard no_grad;
    for (auto& [name, t] : buffers_) {
      absl::Status s = group_.Broadcast(t, 0);
      if (!s.ok()) return Annotate(s, absl::StrCat("broadcasting buffer ", name));
    }
    return absl::OkStatus();
  }

  // From the autograd thread that ran the parameter's AccumulateGrad.
  void OnReady(size_t index) {
    std::lock_guard<std::mutex> lock(mu_);
    if (dead_) return;
    Param& p = params_[index];
    p.used = true;  // no_sync micro-batches count towards find_unused_parameters
    if (!require_sync_ || p.ready) return;  // used twice: one call per backward
    p.ready = true;
    Bucket& b = buckets_[p.bucket];
    if (--b.pending == 0) LaunchReadyLocked();
  }

  absl::Status Finish() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!require_sync_) return absl::OkStatus();
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
    // Which parameters some rank used (PyTorch's local_used_map): one that
    // no rank used keeps its .grad untouched, as PyTorch's DDP leaves it, so
    // optimizers skip it. Issued after every bucket, in the same order on
    // every rank.
    at::Tensor used_anywhere;
    if (options_.find_unused_parameters) {
      std::vector<at::Tensor> used = {at::zeros({static_cast<int64_t>(params_.size())}, at::kInt)};
      for (size_t i = 0; i < params_.size(); ++i) {
        used[0][static_cast<int64_t>(i)] = params_[i].used ? 1 : 0;
      }
      absl::Status s = group_.AllReduce(used, ReduceOp::kMax);
      if (!s.ok()) return Reset(Annotate(s, "all-reducing the map of used parameters"));
      used_anywhere = used[0];
    }
    const auto start = std::chrono::steady_clock::now();
    for (Bucket& b : buckets_) {
      absl::Status s = b.work->Wait();
      if (!s.ok()) return Reset(Annotate(s, "gradient all-reduce"));
    }
    wait_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    absl::Status copied = CallTorch([&] {
      at::NoGradGuard no_grad;
      for (Bucket& b : buckets_) {
        if (!b.wire[0].is_same(b.flat)) b.flat.copy_(b.wire[0]);  // decompress
        for (size_t i : b.params) {
          Param& p = params_[i];
          if (used_anywhere.defined() && used_anywhere[static_cast<int64_t>(i)].item<int>() == 0) {
            continue;
          }
          at::Tensor slice = SliceOf(b.flat, p.tensor, p.offset);
          at::Tensor& grad = p.tensor.mutable_grad();
          if (IsSlice(grad, slice)) continue;
          if (options_.gradient_as_bucket_view) {
            grad = slice;
          } else if (grad.defined()) {
            grad.copy_(slice);
          } else {
            grad = slice.clone();
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
  int64_t bucket_bytes() const override {
    int64_t n = 0;
    for (const Bucket& b : buckets_) n += b.flat.nbytes();
    return n;
  }

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
        for (size_t i : b.params) {
          const Param& p = params_[i];
          at::Tensor slice = SliceOf(b.flat, p.tensor, p.offset);
          const at::Tensor& grad = p.tensor.grad();
          if (!grad.defined()) {
            slice.zero_();  // an unused parameter contributes zeros
          } else if (!IsSlice(grad, slice)) {
            slice.copy_(grad);
          }
        }
        // Divided before the sum, as PyTorch's reducer and its compression
        // hooks do: a loss-scaled fp16 sum of P ranks would overflow P times
        // sooner than the average that is wanted.
        b.flat.div_(static_cast<double>(group_.size()));
        at::Tensor wire = b.flat;
        if (options_.comm_hook == CommHook::kFp16) wire = b.flat.to(at::kHalf);
        if (options_.comm_hook == CommHook::kBf16) wire = b.flat.to(at::kBFloat16);
        b.wire = {wire};
        reduced_bytes_ += wire.numel() * static_cast<int64_t>(wire.element_size());
      });
      if (s.ok()) {
        absl::StatusOr<std::unique_ptr<PendingWork>> work =
            group_.AllReduceAsync(b.wire, ReduceOp::kSum);
        if (work.ok()) {
          b.work = *std::move(work);
        } else {
          s = work.status();
        }
      }
      if (!s.ok() && launch_error_.ok()) launch_error_ = Annotate(s, "gradient all-reduce");
    }
  }

  // Clears the iteration's state and passes `status` through.
  absl::Status Reset(absl::Status status) {
    for (Bucket& b : buckets_) {
      if (b.work) (void)b.work->Wait();
      b.work.reset();
      b.pending = b.params.size();
    }
    for (Param& p : params_) {
      p.ready = false;
      p.used = false;
    }
    next_bucket_ = 0;
    launch_error_ = absl::OkStatus();
    return status;
  }

  ProcessGroup& group_;
  DdpOptions options_;
  mutable std::mutex mu_;
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
  auto sync = std::make_unique<Synchronizer>(group, options);
  ACCEL_RETURN_IF_ERROR(sync->Init(std::move(parameters), std::move(buffers)));
  return std::unique_ptr<GradientSynchronizer>(std::move(sync));
}

}  // namespace accel::train
