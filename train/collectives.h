// train/collectives.h: Accelerate's operations (utils/operations.py) over a
// ProcessGroup: gather, pad_across_processes, reduce, broadcast,
// gather_object, split_between_processes. Each takes a tensor, a list of
// tensors or a map of named tensors (a batch), the nesting C++ callers use.
#ifndef ACCEL_TRAIN_COLLECTIVES_H_
#define ACCEL_TRAIN_COLLECTIVES_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "train/process_group.h"

namespace accel::train {

using TensorList = std::vector<at::Tensor>;
using TensorMap = std::map<std::string, at::Tensor>;

// All-gather, concatenated along dim 0 in rank order; shapes must agree past
// dim 0 and dim 0 must be equal (pad_across_processes first when it is not).
absl::StatusOr<at::Tensor> Gather(ProcessGroup& group, const at::Tensor& tensor);
absl::StatusOr<TensorList> Gather(ProcessGroup& group, const TensorList& tensors);
absl::StatusOr<TensorMap> Gather(ProcessGroup& group, const TensorMap& tensors);

// Pads `dim` of each tensor to the largest size on any rank with
// `pad_index`, at the end (or the start with pad_first).
struct PadOptions {
  int64_t dim = 0;
  double pad_index = 0;
  bool pad_first = false;
};
absl::StatusOr<at::Tensor> PadAcrossProcesses(ProcessGroup& group, const at::Tensor& tensor,
                                              const PadOptions& options = {});
absl::StatusOr<TensorMap> PadAcrossProcesses(ProcessGroup& group, const TensorMap& tensors,
                                             const PadOptions& options = {});

// "sum", "mean" (sum / size, in the tensor's dtype; integers are refused) or "max".
enum class Reduction { kSum, kMean, kMax };
absl::StatusOr<at::Tensor> Reduce(ProcessGroup& group, const at::Tensor& tensor,
                                  Reduction reduction);
absl::StatusOr<TensorMap> Reduce(ProcessGroup& group, const TensorMap& tensors,
                                 Reduction reduction);

// The tensors of `src` on every rank (shapes must agree).
absl::StatusOr<at::Tensor> BroadcastFrom(ProcessGroup& group, const at::Tensor& tensor,
                                         int src = 0);
absl::StatusOr<TensorMap> BroadcastFrom(ProcessGroup& group, const TensorMap& tensors, int src = 0);

// gather_object for byte strings: every rank's, in rank order.
absl::StatusOr<std::vector<std::string>> GatherObject(ProcessGroup& group, absl::string_view bytes);
// gather_object of a list: every rank's items, concatenated in rank order
// (Accelerate flattens the ranks' lists the same way).
absl::StatusOr<std::vector<std::string>> GatherObject(ProcessGroup& group,
                                                      const std::vector<std::string>& items);
// broadcast_object_list: `src`'s list (its length too) on every rank.
// InvalidArgument naming from_process when `src` is not a rank.
absl::StatusOr<std::vector<std::string>> BroadcastObjectList(
    ProcessGroup& group, const std::vector<std::string>& objects, int src = 0);
// gather_object for tensors: every rank's map, in rank order. The tensors
// travel as bytes (dtype, shape, data), so the ranks' shapes may differ in
// every dimension; they come back on the cpu, contiguous.
absl::StatusOr<std::vector<TensorMap>> GatherTensorObjects(ProcessGroup& group,
                                                           const TensorMap& tensors);

// split_between_processes: rank r's contiguous share of `items`; the first
// size() % P ranks get one more. With apply_padding every rank gets the same
// count, the short ones padded with the last item.
template <typename T>
std::vector<T> SplitBetweenProcesses(const std::vector<T>& items, int rank, int size,
                                     bool apply_padding = false) {
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t base = n / size;
  const int64_t extra = n % size;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  const int64_t count = base + (rank < extra ? 1 : 0);
  std::vector<T> out(items.begin() + begin, items.begin() + begin + count);
  if (apply_padding && !items.empty()) {
    const int64_t want = base + (extra > 0 ? 1 : 0);
    while (static_cast<int64_t>(out.size()) < want) out.push_back(items.back());
  }
  return out;
}

}  // namespace accel::train

#endif  // ACCEL_TRAIN_COLLECTIVES_H_
