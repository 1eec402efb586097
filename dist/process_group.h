// dist/process_group.h: one c10d process group (gloo on CPU, NCCL on GPU)
// behind a small Status-returning interface. Every method is a collective:
// all ranks call it in the same order. A peer that dies or a timeout comes
// back as an error Status naming the operation, never a hang past `timeout`.
//
//   ACCEL_ASSIGN_OR_RETURN(auto group, ProcessGroup::Connect(env, {}));
//   ACCEL_RETURN_IF_ERROR(group->AllReduce(grads, ReduceOp::kSum));
#ifndef ACCEL_DIST_PROCESS_GROUP_H_
#define ACCEL_DIST_PROCESS_GROUP_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

#include "dist/env.h"

namespace accel::dist {

// gloo has no AVG in libtorch 1.13: a mean is a sum divided by size().
enum class ReduceOp { kSum, kMax, kMin };

struct ProcessGroupOptions {
  // "gloo", "nccl", or "auto" (nccl when the tensors will be on CUDA and
  // libtorch has NCCL, else gloo). Accelerate's InitProcessGroupKwargs.backend.
  std::string backend = "auto";
  bool use_cuda = false;
  // InitProcessGroupKwargs.timeout; unset: DefaultProcessGroupTimeout of the
  // backend chosen.
  std::optional<absl::Duration> timeout;
};

// Accelerate's InitProcessGroupKwargs default (and torch's): 600 s for nccl,
// 1800 s for any other backend.
absl::Duration DefaultProcessGroupTimeout(absl::string_view backend);

// An asynchronous collective in flight (the gradient all-reduce overlaps
// backward with these). Wait() returns its error, if any; the destructor
// waits too.
class PendingWork {
 public:
  virtual ~PendingWork() = default;
  virtual absl::Status Wait() = 0;
};

class ProcessGroup {
 public:
  // Rank 0 hosts the TCP store at master_addr:master_port; the others connect.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Connect(const ProcessEnvironment& env,
                                                               const ProcessGroupOptions& options);
  // A group of one: every collective is the identity (no sockets, no threads).
  static std::unique_ptr<ProcessGroup> Single();

  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& backend() const = 0;  // "gloo", "nccl" or "single"

  // In place on every tensor (same shapes and dtypes on every rank).
  // bfloat16 on gloo (which has no bfloat16 arithmetic in libtorch 1.13) is
  // all-gathered and reduced here in float, then rounded once.
  virtual absl::Status AllReduce(std::vector<at::Tensor>& tensors, ReduceOp op) = 0;
  // The same, returning at once; the results are in `tensors` after Wait(),
  // so `tensors` (the vector too) must outlive the returned work.
  virtual absl::StatusOr<std::unique_ptr<PendingWork>> AllReduceAsync(
      std::vector<at::Tensor>& tensors, ReduceOp op) = 0;
  // Every rank's tensor (equal shapes), concatenated along dim 0 in rank order.
  // A 0-d tensor counts as shape [1].
  virtual absl::StatusOr<at::Tensor> AllGather(const at::Tensor& tensor) = 0;
  // The all-gather of flat, equal-sized shards into one flat buffer: after
  // Wait(), `output` (contiguous, input.numel() * size() elements, the
  // input's dtype) holds rank r's `input` at [r * n, (r + 1) * n). Sharded
  // training gathers a unit's parameters with it. `output` shares storage
  // with the caller's tensor, which must stay allocated until Wait().
  virtual absl::StatusOr<std::unique_ptr<PendingWork>> AllGatherIntoAsync(const at::Tensor& input,
                                                                          at::Tensor output) = 0;
  // Reduce-scatter (sum) of a flat buffer: after Wait(), `output`
  // (input.numel() / size() elements, the input's dtype) holds the sum over
  // ranks of `input`'s r-th chunk, r = rank(). NCCL has it; gloo in libtorch
  // 1.13 does not, so there it is an all-reduce of `input` in place
  // (clobbering it) and a copy of this rank's chunk on Wait(): the same sums,
  // twice a ring reduce-scatter's bytes. The work keeps both tensors alive.
  virtual absl::StatusOr<std::unique_ptr<PendingWork>> ReduceScatterAsync(at::Tensor input,
                                                                          at::Tensor output) = 0;
  absl::Status ReduceScatter(const at::Tensor& input, const at::Tensor& output) {
    absl::StatusOr<std::unique_ptr<PendingWork>> work = ReduceScatterAsync(input, output);
    if (!work.ok()) return work.status();
    return (*work)->Wait();
  }
  // In place: afterwards every rank holds `src`'s values.
  virtual absl::Status Broadcast(at::Tensor& tensor, int src) = 0;
  virtual absl::Status Barrier() = 0;
  // Byte strings of any length: every rank's, in rank order.
  virtual absl::StatusOr<std::vector<std::string>> AllGatherBytes(absl::string_view bytes) = 0;
  // `src`'s bytes on every rank (the others' argument is ignored).
  virtual absl::StatusOr<std::string> BroadcastBytes(absl::string_view bytes, int src) = 0;

  // Point to point (not collectives: only the two ranks take part, and each
  // Send pairs with the Recv of the same shape and dtype, in order). The
  // stages of a pipeline-parallel model pass activations with them.
  absl::Status Send(const at::Tensor& tensor, int dst) {
    absl::StatusOr<std::unique_ptr<PendingWork>> work = SendAsync(tensor, dst);
    if (!work.ok()) return work.status();
    return (*work)->Wait();
  }
  // Fills `tensor` (contiguous, the sent shape and dtype) in place.
  absl::Status Recv(at::Tensor& tensor, int src) {
    absl::StatusOr<std::unique_ptr<PendingWork>> work = RecvAsync(tensor, src);
    if (!work.ok()) return work.status();
    return (*work)->Wait();
  }
  // The same, returning at once (torch's isend / irecv), so that a pipeline
  // stage computes its next micro-batch while this one travels: gloo moves
  // the bytes on its own threads once the peer has posted the matching
  // receive. Sends to one peer pair with its receives in the order both
  // were posted. The work keeps `tensor` alive; a received one holds the
  // values after Wait().
  virtual absl::StatusOr<std::unique_ptr<PendingWork>> SendAsync(const at::Tensor& tensor,
                                                                 int dst) = 0;
  virtual absl::StatusOr<std::unique_ptr<PendingWork>> RecvAsync(const at::Tensor& tensor,
                                                                 int src) = 0;

  // A group of `ranks` (of this group, ascending order not required: the
  // new group's rank r is ranks[r]), as torch.distributed.new_group makes
  // one. Every rank of this group calls it with the same list, in the same
  // order as its other NewGroup calls; a rank outside `ranks` gets null.
  // The new group shares this one's store, backend and timeout.
  // InvalidArgument for a rank outside this group or a repeated one.
  virtual absl::StatusOr<std::unique_ptr<ProcessGroup>> NewGroup(const std::vector<int>& ranks) = 0;
};

}  // namespace accel::dist

#endif  // ACCEL_DIST_PROCESS_GROUP_H_
