#include "dist/process_group.h"

#include <chrono>
#include <cstring>
#include <map>
#include <type_traits>
#include <utility>

#include <ATen/Functions.h>
// libtorch's CMake config defines USE_C10D_NCCL where it has NCCL; nccl.h
// may still be out of reach (dist/CMakeLists.txt).
#if defined(USE_C10D_NCCL) && defined(ACCEL_DIST_NCCL_HEADERS)
#define ACCEL_DIST_NCCL 1
#endif
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#ifdef ACCEL_DIST_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef ACCEL_DIST_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "core/status.h"

namespace accel::dist {
namespace {

c10d::ReduceOp ToC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

// Waits for `work` at most `timeout` (gloo's own per-operation timeout
// usually fires first); its exception (a peer gone, a timeout) becomes a
// Status naming the operation.
absl::Status WaitFor(const c10::intrusive_ptr<c10d::Work>& work, absl::string_view op,
                     std::chrono::milliseconds timeout) {
  absl::Status status = CallTorch([&] { work->wait(timeout); });
  if (!status.ok()) return Annotate(status, absl::StrCat("collective ", op));
  return absl::OkStatus();
}

// Tensors of one dtype, flattened into one buffer for a single collective
// (gloo's allreduce takes one tensor per device, not a list of different ones).
struct FlatGroup {
  std::vector<size_t> members;
  at::Tensor flat;
  // The one member is contiguous and `flat` is a view of it: reduced in place.
  bool in_place = false;
  // gloo in libtorch 1.13 has no bfloat16 reduction: such a group travels as
  // its 16-bit words (labelled half: gloo copies them without looking)
  // through an all-gather, and Wait() reduces in float.
  bool gathered = false;
  std::vector<std::vector<at::Tensor>> gather_out;
};

std::vector<FlatGroup> Flatten(const std::vector<at::Tensor>& tensors) {
  std::map<c10::ScalarType, FlatGroup> by_dtype;
  for (size_t i = 0; i < tensors.size(); ++i) {
    by_dtype[tensors[i].scalar_type()].members.push_back(i);
  }
  std::vector<FlatGroup> groups;
  for (auto& [dtype, group] : by_dtype) {
    if (group.members.size() == 1 && tensors[group.members[0]].is_contiguous()) {
      group.flat = tensors[group.members[0]].view({-1});
      group.in_place = true;
    } else {
      std::vector<at::Tensor> parts;
      for (size_t i : group.members) parts.push_back(tensors[i].reshape({-1}));
      group.flat = parts.size() == 1 ? parts[0].contiguous().clone() : at::cat(parts);
    }
    groups.push_back(std::move(group));
  }
  return groups;
}

// The emulated bfloat16 reduction of a gathered group, into group.flat.
void ReduceGathered(FlatGroup& group, ReduceOp op) {
  at::Tensor all = at::stack(group.gather_out[0]).view(at::kBFloat16).to(at::kFloat);
  at::Tensor reduced;
  switch (op) {
    case ReduceOp::kSum:
      reduced = all.sum(0);
      break;
    case ReduceOp::kMax:
      reduced = std::get<0>(all.max(0));
      break;
    case ReduceOp::kMin:
      reduced = std::get<0>(all.min(0));
      break;
  }
  group.flat.copy_(reduced);
}

void Unflatten(const std::vector<FlatGroup>& groups, std::vector<at::Tensor>& tensors) {
  for (const FlatGroup& group : groups) {
    if (group.in_place) continue;
    int64_t offset = 0;
    for (size_t i : group.members) {
      const int64_t n = tensors[i].numel();
      tensors[i].copy_(group.flat.narrow(0, offset, n).view(tensors[i].sizes()));
      offset += n;
    }
  }
}

class C10dWork : public PendingWork {
 public:
  C10dWork(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::vector<FlatGroup> groups,
           std::vector<at::Tensor>* tensors, ReduceOp op, std::chrono::milliseconds timeout)
      : works_(std::move(works)),
        groups_(std::move(groups)),
        tensors_(tensors),
        op_(op),
        timeout_(timeout) {}
  ~C10dWork() override { (void)WaitOnce(); }

  absl::Status Wait() override { return WaitOnce(); }

 private:
  // Non-virtual, so the destructor can call it.
  absl::Status WaitOnce() {
    if (done_) return status_;
    done_ = true;
    for (auto& work : works_) {
      status_ = WaitFor(work, "all_reduce", timeout_);
      if (!status_.ok()) return status_;
    }
    status_ = Annotate(CallTorch([&] {
                         for (FlatGroup& g : groups_) {
                           if (g.gathered) ReduceGathered(g, op_);
                         }
                         Unflatten(groups_, *tensors_);
                       }),
                       "collective all_reduce");
    return status_;
  }

  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<FlatGroup> groups_;
  std::vector<at::Tensor>* tensors_;
  ReduceOp op_;
  std::chrono::milliseconds timeout_;
  bool done_ = false;
  absl::Status status_;
};

class DoneWork : public PendingWork {
 public:
  absl::Status Wait() override { return absl::OkStatus(); }
};

// One c10d operation whose result lands in place: waiting is all there is.
// Keeps the operation's tensors referenced until it completes.
class InPlaceWork : public PendingWork {
 public:
  InPlaceWork(c10::intrusive_ptr<c10d::Work> work, std::vector<at::Tensor> keep, std::string op,
              std::chrono::milliseconds timeout)
      : work_(std::move(work)), keep_(std::move(keep)), op_(std::move(op)), timeout_(timeout) {}
  ~InPlaceWork() override { (void)WaitOnce(); }
  absl::Status Wait() override { return WaitOnce(); }

 private:
  // Non-virtual, so the destructor can call it.
  absl::Status WaitOnce() {
    if (!done_) {
      done_ = true;
      status_ = WaitFor(work_, op_, timeout_);
    }
    return status_;
  }

  c10::intrusive_ptr<c10d::Work> work_;
  std::vector<at::Tensor> keep_;
  std::string op_;
  std::chrono::milliseconds timeout_;
  bool done_ = false;
  absl::Status status_;
};

// gloo's reduce-scatter: an all-reduce of the whole buffer, then this
// rank's chunk copied out.
class AllReduceThenSlice : public PendingWork {
 public:
  AllReduceThenSlice(at::Tensor input, at::Tensor output, int rank)
      : whole({std::move(input)}), output_(std::move(output)), rank_(rank) {}
  ~AllReduceThenSlice() override { (void)WaitOnce(); }
  absl::Status Wait() override { return WaitOnce(); }

  std::vector<at::Tensor> whole;  // AllReduceAsync keeps a pointer to it
  std::unique_ptr<PendingWork> all_reduce;

 private:
  // Non-virtual, so the destructor can call it.
  absl::Status WaitOnce() {
    if (done_) return status_;
    done_ = true;
    status_ = all_reduce ? all_reduce->Wait() : absl::OkStatus();
    if (status_.ok()) {
      status_ = Annotate(CallTorch([&] {
                           const int64_t n = output_.numel();
                           output_.view({-1}).copy_(whole[0].view({-1}).narrow(0, rank_ * n, n));
                         }),
                         "collective reduce_scatter");
    }
    return status_;
  }

  at::Tensor output_;
  int rank_;
  bool done_ = false;
  absl::Status status_;
};

absl::Status CheckShardShapes(const at::Tensor& whole, const at::Tensor& shard, int size,
                              absl::string_view op) {
  if (!whole.defined() || !shard.defined() || whole.scalar_type() != shard.scalar_type() ||
      !whole.is_contiguous() || !shard.is_contiguous() || whole.numel() != shard.numel() * size) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": the whole buffer must be contiguous, of the shard's dtype and ", size,
                     " times its elements (whole: ", whole.defined() ? whole.numel() : -1,
                     ", shard: ", shard.defined() ? shard.numel() : -1, ")"));
  }
  return absl::OkStatus();
}

// libtorch 1.x's ProcessGroupGloo / ProcessGroupNCCL are process groups;
// 2.x made them backends that a c10d::ProcessGroup dispatches to by the
// tensors' device (what Python's init_process_group builds). PG is a template
// parameter so that 2.x's names are looked up only where they exist.
template <typename Backend, typename PG = c10d::ProcessGroup>
c10::intrusive_ptr<PG> AsProcessGroup(c10::intrusive_ptr<Backend> backend,
                                      const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                      int size, bool nccl) {
  if constexpr (std::is_convertible_v<Backend*, PG*>) {
    return backend;
  } else {
    auto group = c10::make_intrusive<PG>(store, rank, size);
    const auto type = nccl ? PG::BackendType::NCCL : PG::BackendType::GLOO;
    group->setDefaultBackend(type);
    if (!nccl) group->setBackend(c10::DeviceType::CPU, type, backend);
    group->setBackend(c10::DeviceType::CUDA, type, backend);
    return group;
  }
}

#ifdef ACCEL_DIST_GLOO
using GlooOptions = c10::intrusive_ptr<c10d::ProcessGroupGloo::Options>;
#else
struct GlooOptions {};  // a libtorch without gloo's headers (dist/CMakeLists.txt)
#endif

// A c10d group: gloo, or NCCL where libtorch has it.
class C10dGroup : public ProcessGroup {
 public:
  C10dGroup(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::ProcessGroup> pg,
            int rank, int size, std::string backend, std::chrono::milliseconds timeout)
      : store_(std::move(store)),
        pg_(std::move(pg)),
        rank_(rank),
        size_(size),
        backend_(std::move(backend)),
        timeout_(timeout) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& backend() const override { return backend_; }

  absl::Status AllReduce(std::vector<at::Tensor>& tensors, ReduceOp op) override {
    ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<PendingWork> work, AllReduceAsync(tensors, op));
    return work->Wait();
  }

  absl::StatusOr<std::unique_ptr<PendingWork>> AllReduceAsync(std::vector<at::Tensor>& tensors,
                                                              ReduceOp op) override {
    if (tensors.empty()) return std::unique_ptr<PendingWork>(std::make_unique<DoneWork>());
    std::vector<FlatGroup> groups;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                     groups = Flatten(tensors);
                                     c10d::AllreduceOptions options;
                                     options.reduceOp = ToC10d(op);
                                     for (FlatGroup& g : groups) {
                                       if (backend_ == "gloo" &&
                                           g.flat.scalar_type() == at::kBFloat16) {
                                         g.gathered = true;
                                         std::vector<at::Tensor> words = {g.flat.view(at::kHalf)};
                                         g.gather_out.resize(1);
                                         for (int r = 0; r < size_; ++r) {
                                           g.gather_out[0].push_back(at::empty_like(words[0]));
                                         }
                                         works.push_back(pg_->allgather(g.gather_out, words));
                                         continue;
                                       }
                                       std::vector<at::Tensor> one = {g.flat};
                                       works.push_back(pg_->allreduce(one, options));
                                     }
                                   }),
                                   "collective all_reduce"));
    return std::unique_ptr<PendingWork>(
        std::make_unique<C10dWork>(std::move(works), std::move(groups), &tensors, op, timeout_));
  }

  absl::StatusOr<at::Tensor> AllGather(const at::Tensor& tensor) override {
    std::vector<std::vector<at::Tensor>> outputs(1);
    std::vector<at::Tensor> inputs;
    c10::intrusive_ptr<c10d::Work> work;
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                     at::Tensor in = tensor.dim() == 0 ? tensor.reshape({1})
                                                                       : tensor.contiguous();
                                     inputs = {AsWords(in)};
                                     for (int r = 0; r < size_; ++r) {
                                       outputs[0].push_back(at::empty_like(inputs[0]));
                                     }
                                     work = pg_->allgather(outputs, inputs);
                                   }),
                                   "collective all_gather"));
    ACCEL_RETURN_IF_ERROR(WaitFor(work, "all_gather", timeout_));
    at::Tensor out;
    ACCEL_RETURN_IF_ERROR(
        CallTorch([&] { out = at::cat(outputs[0], 0).view(tensor.scalar_type()); }));
    return out;
  }

  absl::StatusOr<std::unique_ptr<PendingWork>> AllGatherIntoAsync(const at::Tensor& input,
                                                                  at::Tensor output) override {
    ACCEL_RETURN_IF_ERROR(CheckShardShapes(output, input, size_, "all_gather_into"));
    c10::intrusive_ptr<c10d::Work> work;
    std::vector<at::Tensor> keep;
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                     const at::Tensor words_out = AsWords(output.view({-1}));
                                     std::vector<at::Tensor> inputs = {AsWords(input.view({-1}))};
                                     std::vector<std::vector<at::Tensor>> outputs(1);
                                     const int64_t n = input.numel();
                                     for (int r = 0; r < size_; ++r) {
                                       outputs[0].push_back(words_out.narrow(0, r * n, n));
                                     }
                                     work = pg_->allgather(outputs, inputs);
                                     keep = {input, output};
                                   }),
                                   "collective all_gather_into"));
    return std::unique_ptr<PendingWork>(
        std::make_unique<InPlaceWork>(work, std::move(keep), "all_gather_into", timeout_));
  }

  absl::StatusOr<std::unique_ptr<PendingWork>> ReduceScatterAsync(at::Tensor input,
                                                                  at::Tensor output) override {
    ACCEL_RETURN_IF_ERROR(CheckShardShapes(input, output, size_, "reduce_scatter"));
    if (backend_ == "nccl") {
      c10::intrusive_ptr<c10d::Work> work;
      ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                       std::vector<at::Tensor> outs = {output};
                                       std::vector<std::vector<at::Tensor>> ins(1);
                                       const int64_t n = output.numel();
                                       for (int r = 0; r < size_; ++r) {
                                         ins[0].push_back(input.view({-1}).narrow(0, r * n, n));
                                       }
                                       work = pg_->reduce_scatter(outs, ins);
                                     }),
                                     "collective reduce_scatter"));
      return std::unique_ptr<PendingWork>(std::make_unique<InPlaceWork>(
          work, std::vector<at::Tensor>{input, output}, "reduce_scatter", timeout_));
    }
    auto work = std::make_unique<AllReduceThenSlice>(input, output, rank_);
    ACCEL_ASSIGN_OR_RETURN(work->all_reduce, AllReduceAsync(work->whole, ReduceOp::kSum));
    return std::unique_ptr<PendingWork>(std::move(work));
  }

  absl::Status Broadcast(at::Tensor& tensor, int src) override {
    if (src < 0 || src >= size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("broadcast: source rank ", src, " is outside [0, ", size_, ")"));
    }
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor buffer;
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                     buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
                                     std::vector<at::Tensor> one = {AsWords(buffer)};
                                     c10d::BroadcastOptions options;
                                     options.rootRank = src;
                                     work = pg_->broadcast(one, options);
                                   }),
                                   "collective broadcast"));
    ACCEL_RETURN_IF_ERROR(WaitFor(work, "broadcast", timeout_));
    if (!buffer.is_same(tensor)) {
      ACCEL_RETURN_IF_ERROR(CallTorch([&] { tensor.copy_(buffer); }));
    }
    return absl::OkStatus();
  }

  absl::Status Barrier() override {
    // An all-reduce of one number: gloo's barrier, but with our error path.
    std::vector<at::Tensor> one = {at::zeros({1}, at::kInt)};
    return Annotate(AllReduce(one, ReduceOp::kSum), "barrier");
  }

  absl::StatusOr<std::vector<std::string>> AllGatherBytes(absl::string_view bytes) override {
    ACCEL_ASSIGN_OR_RETURN(at::Tensor lengths,
                           AllGather(at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong)));
    int64_t longest = 0;
    for (int r = 0; r < size_; ++r) longest = std::max(longest, lengths[r].item<int64_t>());
    at::Tensor mine = at::zeros({std::max<int64_t>(longest, 1)}, at::kByte);
    std::memcpy(mine.data_ptr<uint8_t>(), bytes.data(), bytes.size());
    ACCEL_ASSIGN_OR_RETURN(at::Tensor all, AllGather(mine));
    std::vector<std::string> out;
    const int64_t stride = mine.numel();
    for (int r = 0; r < size_; ++r) {
      const auto* p = all.data_ptr<uint8_t>() + r * stride;
      out.emplace_back(reinterpret_cast<const char*>(p),
                       static_cast<size_t>(lengths[r].item<int64_t>()));
    }
    return out;
  }

  absl::StatusOr<std::string> BroadcastBytes(absl::string_view bytes, int src) override {
    at::Tensor length = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
    ACCEL_RETURN_IF_ERROR(Broadcast(length, src));
    const int64_t n = length.item<int64_t>();
    at::Tensor data = at::zeros({std::max<int64_t>(n, 1)}, at::kByte);
    if (rank_ == src) std::memcpy(data.data_ptr<uint8_t>(), bytes.data(), bytes.size());
    ACCEL_RETURN_IF_ERROR(Broadcast(data, src));
    return std::string(reinterpret_cast<const char*>(data.data_ptr<uint8_t>()),
                       static_cast<size_t>(n));
  }

  absl::StatusOr<std::unique_ptr<PendingWork>> SendAsync(const at::Tensor& tensor,
                                                         int dst) override {
    if (dst < 0 || dst >= size_ || dst == rank_) {
      return absl::InvalidArgumentError(
          absl::StrCat("send: destination rank ", dst, " is not another rank of [0, ", size_, ")"));
    }
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor words;
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                     words = AsWords(tensor.contiguous());
                                     std::vector<at::Tensor> one = {words};
                                     work = pg_->send(one, dst, /*tag=*/0);
                                   }),
                                   absl::StrCat("send to rank ", dst)));
    return std::unique_ptr<PendingWork>(std::make_unique<InPlaceWork>(
        std::move(work), std::vector<at::Tensor>{words}, "send", timeout_));
  }

  absl::StatusOr<std::unique_ptr<PendingWork>> RecvAsync(const at::Tensor& tensor,
                                                         int src) override {
    if (src < 0 || src >= size_ || src == rank_) {
      return absl::InvalidArgumentError(
          absl::StrCat("recv: source rank ", src, " is not another rank of [0, ", size_, ")"));
    }
    if (!tensor.is_contiguous()) {
      return absl::InvalidArgumentError("recv: the tensor to fill must be contiguous");
    }
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor words;
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                     words = AsWords(tensor);
                                     std::vector<at::Tensor> one = {words};
                                     work = pg_->recv(one, src, /*tag=*/0);
                                   }),
                                   absl::StrCat("recv from rank ", src)));
    return std::unique_ptr<PendingWork>(std::make_unique<InPlaceWork>(
        std::move(work), std::vector<at::Tensor>{words}, "recv", timeout_));
  }

  absl::StatusOr<std::unique_ptr<ProcessGroup>> NewGroup(const std::vector<int>& ranks) override {
    std::vector<bool> seen(static_cast<size_t>(size_), false);
    int mine = -1;
    for (size_t i = 0; i < ranks.size(); ++i) {
      const int r = ranks[i];
      if (r < 0 || r >= size_ || seen[static_cast<size_t>(r)]) {
        return absl::InvalidArgumentError(
            absl::StrCat("new group: rank ", r, " is outside [0, ", size_, ") or listed twice"));
      }
      seen[static_cast<size_t>(r)] = true;
      if (r == rank_) mine = static_cast<int>(i);
    }
    // Every rank counts every group, so the members' store prefixes agree.
    const std::string prefix = absl::StrCat("group", groups_made_++, "/");
    if (mine < 0) return std::unique_ptr<ProcessGroup>();
    const int n = static_cast<int>(ranks.size());
    c10::intrusive_ptr<c10d::ProcessGroup> pg;
    ACCEL_RETURN_IF_ERROR(
        Annotate(CallTorch([&] {
                   auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
#ifdef ACCEL_DIST_NCCL
                   if (backend_ == "nccl") {
                     auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
                     nccl_options->timeout = timeout_;
                     pg = AsProcessGroup(
                         c10::make_intrusive<c10d::ProcessGroupNCCL>(store, mine, n, nccl_options),
                         store, mine, n, /*nccl=*/true);
                     return;
                   }
#endif
#ifdef ACCEL_DIST_GLOO
                   pg = AsProcessGroup(
                       c10::make_intrusive<c10d::ProcessGroupGloo>(store, mine, n, gloo_options_),
                       store, mine, n, /*nccl=*/false);
#endif
                 }),
                 absl::StrCat("making a group of ", n, " ranks")));
    auto group = std::make_unique<C10dGroup>(store_, std::move(pg), mine, n, backend_, timeout_);
    group->gloo_options_ = gloo_options_;
    return std::unique_ptr<ProcessGroup>(std::move(group));
  }

  void set_gloo_options(GlooOptions options) { gloo_options_ = std::move(options); }

 private:
  // gloo in libtorch 1.13 moves only float, double, half and
  // 8/32/64-bit integers; bfloat16 and bool travel relabelled as half and
  // uint8 (broadcast and all-gather copy bits without arithmetic, so exact). A view: writes reach
  // `tensor`.
  at::Tensor AsWords(const at::Tensor& tensor) const {
    if (backend_ != "gloo") return tensor;
    if (tensor.scalar_type() == at::kBFloat16) return tensor.view(at::kHalf);
    if (tensor.scalar_type() == at::kBool) return tensor.view(at::kByte);
    return tensor;
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int rank_;
  int size_;
  std::string backend_;
  std::chrono::milliseconds timeout_;
  // Gloo's options (its devices), reused by the groups NewGroup makes.
  GlooOptions gloo_options_;
  int groups_made_ = 0;
};

class SingleGroup : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& backend() const override { return backend_; }
  absl::Status AllReduce(std::vector<at::Tensor>&, ReduceOp) override { return absl::OkStatus(); }
  absl::StatusOr<std::unique_ptr<PendingWork>> AllReduceAsync(std::vector<at::Tensor>&,
                                                              ReduceOp) override {
    return std::unique_ptr<PendingWork>(std::make_unique<DoneWork>());
  }
  absl::StatusOr<at::Tensor> AllGather(const at::Tensor& tensor) override {
    return tensor.dim() == 0 ? tensor.reshape({1}) : tensor;
  }
  absl::StatusOr<std::unique_ptr<PendingWork>> AllGatherIntoAsync(const at::Tensor& input,
                                                                  at::Tensor output) override {
    ACCEL_RETURN_IF_ERROR(CheckShardShapes(output, input, 1, "all_gather_into"));
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      if (output.data_ptr() != input.data_ptr()) output.view({-1}).copy_(input.view({-1}));
    }));
    return std::unique_ptr<PendingWork>(std::make_unique<DoneWork>());
  }
  absl::StatusOr<std::unique_ptr<PendingWork>> ReduceScatterAsync(at::Tensor input,
                                                                  at::Tensor output) override {
    ACCEL_RETURN_IF_ERROR(CheckShardShapes(input, output, 1, "reduce_scatter"));
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      if (output.data_ptr() != input.data_ptr()) output.view({-1}).copy_(input.view({-1}));
    }));
    return std::unique_ptr<PendingWork>(std::make_unique<DoneWork>());
  }
  absl::Status Broadcast(at::Tensor&, int src) override {
    if (src != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("broadcast: source rank ", src, " is outside [0, 1)"));
    }
    return absl::OkStatus();
  }
  absl::Status Barrier() override { return absl::OkStatus(); }
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(absl::string_view bytes) override {
    return std::vector<std::string>{std::string(bytes)};
  }
  absl::StatusOr<std::string> BroadcastBytes(absl::string_view bytes, int) override {
    return std::string(bytes);
  }
  absl::StatusOr<std::unique_ptr<PendingWork>> SendAsync(const at::Tensor&, int dst) override {
    return absl::InvalidArgumentError(
        absl::StrCat("send: destination rank ", dst, " is not another rank of [0, 1)"));
  }
  absl::StatusOr<std::unique_ptr<PendingWork>> RecvAsync(const at::Tensor&, int src) override {
    return absl::InvalidArgumentError(
        absl::StrCat("recv: source rank ", src, " is not another rank of [0, 1)"));
  }
  absl::StatusOr<std::unique_ptr<ProcessGroup>> NewGroup(const std::vector<int>& ranks) override {
    if (ranks.size() != 1 || ranks[0] != 0) {
      return absl::InvalidArgumentError("new group: a group of one holds only rank 0");
    }
    return std::unique_ptr<ProcessGroup>(std::make_unique<SingleGroup>());
  }

 private:
  std::string backend_ = "single";
};

}  // namespace

// A master address only this host can reach: every rank is here (several
// accel-launch "machines" on one host, as the multi-node test runs them), so
// loopback serves, where the hostname's address may not be reachable at all.
namespace {
bool IsLoopback(absl::string_view addr) {
  return absl::StartsWith(addr, "127.") || addr == "localhost" || addr == "::1";
}
}  // namespace

absl::Duration DefaultProcessGroupTimeout(absl::string_view backend) {
  return backend == "nccl" ? absl::Seconds(600) : absl::Seconds(1800);
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Connect(
    const ProcessEnvironment& env, const ProcessGroupOptions& options) {
#ifdef ACCEL_DIST_NCCL
  constexpr bool kHaveNccl = true;
#else
  constexpr bool kHaveNccl = false;
#endif
#ifdef ACCEL_DIST_GLOO
  constexpr bool kHaveGloo = true;
#else
  constexpr bool kHaveGloo = false;
#endif
  if (!kHaveGloo && !kHaveNccl) {
    return absl::UnimplementedError(
        "process groups: accel was built against a libtorch without gloo's or NCCL's headers");
  }
  std::string backend = options.backend;
  if (backend == "auto") backend = options.use_cuda && kHaveNccl ? "nccl" : "gloo";
  if (backend == "nccl" && !kHaveNccl) {
    return absl::UnimplementedError(
        "process group backend \"nccl\": this libtorch was built without NCCL (CPU only); use "
        "gloo");
  }
  if (backend == "gloo" && !kHaveGloo) {
    return absl::UnimplementedError(
        "process group backend \"gloo\": this libtorch came without gloo's headers (a PyTorch "
        "pip wheel), so accel was built without it; use nccl");
  }
  if (backend != "gloo" && backend != "nccl") {
    return absl::InvalidArgumentError(absl::StrCat("process group backend \"", options.backend,
                                                   "\": expected gloo, nccl or auto"));
  }
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", env.rank, " of world size ", env.world_size));
  }
  const absl::Duration timeout_duration =
      options.timeout.value_or(DefaultProcessGroupTimeout(backend));
  if (timeout_duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("process group timeout must be positive, got ",
                                                   absl::FormatDuration(timeout_duration)));
  }
  const auto timeout = std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_duration));
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  GlooOptions gloo_options;
  absl::Status status = CallTorch([&] {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(env.master_port);
    store_options.isServer = env.rank == 0;
    store_options.numWorkers = static_cast<std::size_t>(env.world_size);
    store_options.waitWorkers = true;
    store_options.timeout = timeout;
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
#ifdef ACCEL_DIST_NCCL
    if (backend == "nccl") {
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      pg = AsProcessGroup(c10::make_intrusive<c10d::ProcessGroupNCCL>(store, env.rank,
                                                                      env.world_size, nccl_options),
                          store, env.rank, env.world_size, /*nccl=*/true);
      return;
    }
#endif
#ifdef ACCEL_DIST_GLOO
    gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
    // The device gloo binds its pair sockets to. GLOO_SOCKET_IFNAME is read
    // by Python's torch.distributed only, so a C++ program honours it itself.
    // A single-host run binds to loopback, which always exists and needs no
    // name resolution. Otherwise createDefaultDevice resolves this machine's
    // hostname; on Debian the hostname maps to 127.0.1.1 in /etc/hosts, so a
    // multi-host run on such a machine needs GLOO_SOCKET_IFNAME.
    if (!env.gloo_socket_ifname.empty()) {
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForInterface(env.gloo_socket_ifname));
    } else if (env.world_size == env.local_world_size || IsLoopback(env.master_addr)) {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    gloo_options->threads = 2;
    pg = AsProcessGroup(
        c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, gloo_options),
        store, env.rank, env.world_size, /*nccl=*/false);
#endif
  });
  if (!status.ok()) {
    return Annotate(status,
                    absl::StrCat("connecting rank ", env.rank, " of ", env.world_size, " to ",
                                 env.master_addr, ":", env.master_port, " (", backend, ")"));
  }
  auto group = std::make_unique<C10dGroup>(std::move(store), std::move(pg), env.rank,
                                           env.world_size, backend, timeout);
  group->set_gloo_options(std::move(gloo_options));
  return std::unique_ptr<ProcessGroup>(std::move(group));
}

std::unique_ptr<ProcessGroup> ProcessGroup::Single() { return std::make_unique<SingleGroup>(); }

}  // namespace accel::dist
