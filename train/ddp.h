// train/ddp.h: distributed data parallel for the C++ frontend, which has no
// DDP module in libtorch 1.13. Parameters are grouped into buckets of about
// bucket_cap_mb (in reverse registration order, as PyTorch's DDP does, so
// the buckets fill in the order backward produces gradients); a hook after
// each parameter's gradient accumulation marks it ready, and a bucket whose
// parameters are all ready is all-reduced asynchronously while backward goes
// on. Finish() waits for the buckets and divides by the world size.
//
//   ACCEL_ASSIGN_OR_RETURN(auto ddp, GradientSynchronizer::Attach(params, buffers, *group, {}));
//   loss.backward();
//   ACCEL_RETURN_IF_ERROR(ddp->Finish());   // every rank now holds the mean gradient
#ifndef ACCEL_TRAIN_DDP_H_
#define ACCEL_TRAIN_DDP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "train/process_group.h"

namespace accel::train {

// DistributedDataParallelKwargs' comm hooks that a C++ program can have.
enum class CommHook { kNone, kFp16, kBf16 };

struct DdpOptions {
  double bucket_cap_mb = 25;  // first bucket: 1 MiB, as PyTorch's DDP
  bool find_unused_parameters = false;
  // The gradients become views into the flat bucket buffers (no copy back).
  bool gradient_as_bucket_view = false;
  // Gradients travel compressed (fp16 / bf16) and are decompressed on
  // arrival. gloo cannot sum bfloat16 in libtorch 1.13: there the bf16 words
  // travel through an all-gather and are summed in float (process_group.h).
  CommHook comm_hook = CommHook::kNone;
  // Buffers are broadcast from rank 0 before each forward (PrepareForward).
  bool broadcast_buffers = true;
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

class GradientSynchronizer {
 public:
  // Broadcasts parameters and buffers from rank 0 (every rank starts equal),
  // builds the buckets and installs the hooks. Parameters that do not require
  // grad are skipped. The tensors must outlive the synchronizer.
  static absl::StatusOr<std::unique_ptr<GradientSynchronizer>> Attach(NamedTensors parameters,
                                                                      NamedTensors buffers,
                                                                      ProcessGroup& group,
                                                                      const DdpOptions& options);
  virtual ~GradientSynchronizer() = default;

  // false: no_sync. Backward leaves gradients local (they accumulate), and
  // Finish() does nothing. The next backward with sync on all-reduces the
  // accumulated gradients.
  virtual void set_require_sync(bool require_sync) = 0;
  virtual bool require_sync() const = 0;

  // Before a forward: broadcasts buffers when broadcast_buffers.
  virtual absl::Status PrepareForward() = 0;
  // After backward: waits for every bucket, averages, and writes the result
  // into each parameter's grad. With find_unused_parameters, a parameter that
  // got no gradient counts as zero, and one that no rank used keeps its grad
  // as it was (undefined, so optimizers skip it), as PyTorch's DDP does;
  // without it, FailedPrecondition naming the parameters (PyTorch's
  // "Expected to have finished reduction" error).
  virtual absl::Status Finish() = 0;
  // Whether a backward with sync on has given one of its parameters a
  // gradient since the last Finish(): a backward through another model only
  // (a GAN's discriminator step, a teacher's loss) leaves this one's
  // reduction for the backward that reaches it.
  virtual bool received_gradients() const = 0;

  virtual int num_buckets() const = 0;
  // Parameter names per bucket, in the order buckets are reduced.
  virtual std::vector<std::vector<std::string>> bucket_names() const = 0;
  // Seconds Finish() spent waiting on communication, summed (the bench's
  // all-reduce share), and gradient bytes put on the wire (after any
  // compression), since Attach.
  virtual double wait_seconds() const = 0;
  // Bytes of the flat gradient buckets, held for the synchronizer's life.
  virtual int64_t bucket_bytes() const = 0;
  virtual int64_t reduced_bytes() const = 0;
};

}  // namespace accel::train

#endif  // ACCEL_TRAIN_DDP_H_
