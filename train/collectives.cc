#include "train/collectives.h"

#include <utility>

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

}  // namespace

absl::StatusOr<at::Tensor> Gather(ProcessGroup& group, const at::Tensor& tensor) {
  if (!tensor.defined()) return absl::InvalidArgumentError("gather: undefined tensor");
  // Shapes must agree past dim 0 and dim 0 must be equal: check, so a
  // mismatch is an error here instead of garbage from the all-gather.
  const int64_t dims = std::max<int64_t>(tensor.dim(), 1);
  at::Tensor shape = at::zeros({dims + 1}, at::kLong);
  shape[0] = tensor.dim();
  for (int64_t d = 0; d < tensor.dim(); ++d) shape[d + 1] = tensor.size(d);
  ACCEL_ASSIGN_OR_RETURN(at::Tensor shapes, group.AllGather(shape));
  at::Tensor all = shapes.view({group.size(), dims + 1});
  if (!at::equal(all, shape.unsqueeze(0).expand_as(all))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gather: the ranks' tensors differ in shape (", c10::str(tensor.sizes()),
        " here); pad_across_processes first"));
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
  if (!tensor.defined()) return absl::InvalidArgumentError("pad_across_processes: undefined");
  if (options.dim < 0 || options.dim >= tensor.dim()) {
    return absl::InvalidArgumentError(absl::StrCat("pad_across_processes: dim ", options.dim,
                                                   " of a ", tensor.dim(), "-d tensor"));
  }
  ACCEL_ASSIGN_OR_RETURN(at::Tensor sizes,
                         group.AllGather(at::tensor({tensor.size(options.dim)}, at::kLong)));
  const int64_t longest = sizes.max().item<int64_t>();
  if (longest == tensor.size(options.dim)) return tensor;
  std::vector<int64_t> shape = tensor.sizes().vec();
  shape[options.dim] = longest;
  at::Tensor out = at::full(shape, options.pad_index, tensor.options());
  const int64_t n = tensor.size(options.dim);
  out.narrow(options.dim, options.pad_first ? longest - n : 0, n).copy_(tensor);
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
    return absl::InvalidArgumentError(absl::StrCat(
        "reduce: a mean of ", c10::toString(tensor.scalar_type()),
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
  return EachNamed(tensors,
                   [&](const at::Tensor& t) { return Reduce(group, t, reduction); });
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
