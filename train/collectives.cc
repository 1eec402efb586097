#include "train/collectives.h"

#include <string>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"

namespace accel::train {
namespace {

// Applies `fn` to every tensor of a map, annotating errors with the key.
template <typename Fn>
absl::StatusOr<TensorMap> EachNamed(const TensorMap& tensors, Fn&& fn) {
  TensorMap out;
  for (const auto& [name, tensor] : tensors) {
    absl::StatusOr<at::Tensor> t = fn(tensor);
    if (!t.ok()) return Annotate(t.status(), absl::StrCat("\"", name, "\""));
    out.emplace(name, *std::move(t));
  }
  return out;
}

// "[2, 3]" for a 1-d tensor of sizes.
std::string SizesOf(const at::Tensor& sizes) {
  std::vector<int64_t> v(sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + sizes.numel());
  return c10::str(c10::IntArrayRef(v));
}

}  // namespace

absl::StatusOr<at::Tensor> Gather(ProcessGroup& group, const at::Tensor& tensor) {
  if (!tensor.defined()) return absl::InvalidArgumentError("gather: undefined tensor");
  // Shapes must agree past dim 0 and dim 0 must be equal: check, so a
  // mismatch is an error on every rank instead of garbage or a hang in the
  // all-gather. First the number of dims and the dtype (fixed size), then
  // the sizes (whose length now agrees).
  ACCEL_ASSIGN_OR_RETURN(
      at::Tensor headers,
      group.AllGather(
          at::tensor({tensor.dim(), static_cast<int64_t>(tensor.scalar_type())}, at::kLong)));
  headers = headers.view({group.size(), 2});
  for (int r = 0; r < group.size(); ++r) {
    if (headers[r][0].item<int64_t>() != tensor.dim()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gather: rank ", r, " has a ", headers[r][0].item<int64_t>(),
                       "-d tensor, this rank (", group.rank(), ") a ", tensor.dim(), "-d one"));
    }
    if (headers[r][1].item<int64_t>() != static_cast<int64_t>(tensor.scalar_type())) {
      return absl::InvalidArgumentError(
          absl::StrCat("gather: rank ", r, " has a ",
                       c10::toString(static_cast<c10::ScalarType>(headers[r][1].item<int64_t>())),
                       " tensor, this rank (", group.rank(), ") a ",
                       c10::toString(tensor.scalar_type()), " one"));
    }
  }
  if (tensor.dim() > 0) {
    ACCEL_ASSIGN_OR_RETURN(at::Tensor shapes,
                           group.AllGather(at::tensor(tensor.sizes().vec(), at::kLong)));
    at::Tensor all = shapes.view({group.size(), tensor.dim()});
    for (int r = 0; r < group.size(); ++r) {
      if (!at::equal(all[r], at::tensor(tensor.sizes().vec(), at::kLong))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gather: the ranks' tensors differ in shape (", c10::str(tensor.sizes()), " on rank ",
            group.rank(), ", ", SizesOf(all[r]), " on rank ", r, "); pad_across_processes first"));
      }
    }
  }
  return group.AllGather(tensor);
}

absl::StatusOr<TensorList> Gather(ProcessGroup& group, const TensorList& tensors) {
  TensorList out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    absl::StatusOr<at::Tensor> t = Gather(group, tensors[i]);
    if (!t.ok()) return Annotate(t.status(), absl::StrCat("element ", i));
    out.push_back(*std::move(t));
  }
  return out;
}

absl::StatusOr<TensorMap> Gather(ProcessGroup& group, const TensorMap& tensors) {
  return EachNamed(tensors, [&](const at::Tensor& t) { return Gather(group, t); });
}

absl::StatusOr<at::Tensor> PadAcrossProcesses(ProcessGroup& group, const at::Tensor& tensor,
                                              const PadOptions& options) {
  if (!tensor.defined())
    return absl::InvalidArgumentError("pad_across_processes: undefined tensor");
  // Accelerate's rule: a dim the tensor does not have leaves it as it is
  // (a batch mixes tensors of different ranks); negative dims count from the end.
  if (options.dim >= tensor.dim() || options.dim < -tensor.dim()) return tensor;
  const int64_t dim = options.dim < 0 ? options.dim + tensor.dim() : options.dim;
  ACCEL_ASSIGN_OR_RETURN(at::Tensor sizes,
                         group.AllGather(at::tensor({tensor.size(dim)}, at::kLong)));
  const int64_t longest = sizes.max().item<int64_t>();
  const int64_t n = tensor.size(dim);
  if (longest == n) return tensor;
  std::vector<int64_t> shape = tensor.sizes().vec();
  shape[dim] = longest;
  at::Tensor out;
  ACCEL_RETURN_IF_ERROR(
      Annotate(CallTorch([&] {
                 out = at::full(shape, options.pad_index, tensor.options());
                 out.narrow(dim, options.pad_first ? longest - n : 0, n).copy_(tensor);
               }),
               "pad_across_processes"));
  return out;
}

absl::StatusOr<TensorMap> PadAcrossProcesses(ProcessGroup& group, const TensorMap& tensors,
                                             const PadOptions& options) {
  return EachNamed(tensors,
                   [&](const at::Tensor& t) { return PadAcrossProcesses(group, t, options); });
}

absl::StatusOr<at::Tensor> Reduce(ProcessGroup& group, const at::Tensor& tensor,
                                  Reduction reduction) {
  if (!tensor.defined()) return absl::InvalidArgumentError("reduce: undefined tensor");
  if (reduction == Reduction::kMean && !at::isFloatingType(tensor.scalar_type())) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce: a mean of ", c10::toString(tensor.scalar_type()),
                     " values would be truncated; cast to a floating dtype first"));
  }
  std::vector<at::Tensor> one = {tensor.clone()};
  ACCEL_RETURN_IF_ERROR(
      group.AllReduce(one, reduction == Reduction::kMax ? ReduceOp::kMax : ReduceOp::kSum));
  // gloo in libtorch 1.13 has no AVG: a sum over the ranks, then / size().
  if (reduction == Reduction::kMean) one[0].div_(group.size());
  return one[0];
}

absl::StatusOr<TensorMap> Reduce(ProcessGroup& group, const TensorMap& tensors,
                                 Reduction reduction) {
  return EachNamed(tensors, [&](const at::Tensor& t) { return Reduce(group, t, reduction); });
}

absl::StatusOr<at::Tensor> BroadcastFrom(ProcessGroup& group, const at::Tensor& tensor, int src) {
  if (!tensor.defined()) return absl::InvalidArgumentError("broadcast: undefined tensor");
  at::Tensor copy = tensor.clone();
  ACCEL_RETURN_IF_ERROR(group.Broadcast(copy, src));
  return copy;
}

absl::StatusOr<TensorMap> BroadcastFrom(ProcessGroup& group, const TensorMap& tensors, int src) {
  return EachNamed(tensors, [&](const at::Tensor& t) { return BroadcastFrom(group, t, src); });
}

absl::StatusOr<std::vector<std::string>> GatherObject(ProcessGroup& group,
                                                      absl::string_view bytes) {
  return group.AllGatherBytes(bytes);
}

}  // namespace accel::train
