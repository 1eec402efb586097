#include "train/collectives.h"

#include <cstring>
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

namespace {

// Objects on the wire: each field is a little-endian u64 length (or value)
// followed by its bytes. Every rank builds and reads it, so the layout only
// has to agree with itself.
void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutBytes(std::string* out, absl::string_view bytes) {
  PutU64(out, bytes.size());
  out->append(bytes.data(), bytes.size());
}

// Reads what PutU64 / PutBytes wrote; DataLoss on a short message.
class WireReader {
 public:
  WireReader(absl::string_view bytes, absl::string_view what) : bytes_(bytes), what_(what) {}
  bool done() const { return bytes_.empty(); }
  absl::StatusOr<uint64_t> U64() {
    if (bytes_.size() < 8) return Truncated();
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i)
      v |= static_cast<uint64_t>(static_cast<uint8_t>(bytes_[i])) << (8 * i);
    bytes_.remove_prefix(8);
    return v;
  }
  absl::StatusOr<absl::string_view> Bytes() {
    ACCEL_ASSIGN_OR_RETURN(uint64_t n, U64());
    if (bytes_.size() < n) return Truncated();
    absl::string_view out = bytes_.substr(0, n);
    bytes_.remove_prefix(n);
    return out;
  }

 private:
  absl::Status Truncated() const {
    return absl::DataLossError(absl::StrCat(what_, ": a truncated message"));
  }
  absl::string_view bytes_;
  absl::string_view what_;
};

std::string EncodeList(const std::vector<std::string>& items) {
  std::string out;
  PutU64(&out, items.size());
  for (const std::string& item : items) PutBytes(&out, item);
  return out;
}

absl::Status DecodeList(absl::string_view bytes, absl::string_view what,
                        std::vector<std::string>* out) {
  WireReader in(bytes, what);
  ACCEL_ASSIGN_OR_RETURN(uint64_t n, in.U64());
  for (uint64_t i = 0; i < n; ++i) {
    ACCEL_ASSIGN_OR_RETURN(absl::string_view item, in.Bytes());
    out->emplace_back(item);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> GatherObject(ProcessGroup& group,
                                                      const std::vector<std::string>& items) {
  ACCEL_ASSIGN_OR_RETURN(std::vector<std::string> all, group.AllGatherBytes(EncodeList(items)));
  std::vector<std::string> out;
  for (const std::string& rank_items : all) {
    ACCEL_RETURN_IF_ERROR(DecodeList(rank_items, "gather_object", &out));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> BroadcastObjectList(
    ProcessGroup& group, const std::vector<std::string>& objects, int src) {
  // Checked on every rank before any message, so all of them refuse together.
  if (src < 0 || src >= group.size()) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast_object_list: from_process ", src,
                                                   " is not a rank (0..", group.size() - 1, ")"));
  }
  ACCEL_ASSIGN_OR_RETURN(std::string bytes,
                         group.BroadcastBytes(group.rank() == src ? EncodeList(objects) : "", src));
  std::vector<std::string> out;
  ACCEL_RETURN_IF_ERROR(DecodeList(bytes, "broadcast_object_list", &out));
  return out;
}

absl::StatusOr<std::vector<TensorMap>> GatherTensorObjects(ProcessGroup& group,
                                                           const TensorMap& tensors) {
  std::string message;
  PutU64(&message, tensors.size());
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gather_object: \"", name, "\" is an undefined tensor"));
    }
    at::Tensor host;
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] { host = tensor.detach().cpu().contiguous(); }),
                                   absl::StrCat("gather_object: \"", name, "\"")));
    PutBytes(&message, name);
    PutU64(&message, static_cast<uint64_t>(host.scalar_type()));
    PutU64(&message, static_cast<uint64_t>(host.dim()));
    for (int64_t d : host.sizes()) PutU64(&message, static_cast<uint64_t>(d));
    PutBytes(&message, absl::string_view(static_cast<const char*>(host.data_ptr()), host.nbytes()));
  }
  ACCEL_ASSIGN_OR_RETURN(std::vector<std::string> all, group.AllGatherBytes(message));
  std::vector<TensorMap> out;
  for (const std::string& bytes : all) {
    WireReader in(bytes, "gather_object");
    TensorMap rank_tensors;
    ACCEL_ASSIGN_OR_RETURN(uint64_t n, in.U64());
    for (uint64_t i = 0; i < n; ++i) {
      ACCEL_ASSIGN_OR_RETURN(absl::string_view name, in.Bytes());
      ACCEL_ASSIGN_OR_RETURN(uint64_t dtype, in.U64());
      ACCEL_ASSIGN_OR_RETURN(uint64_t dims, in.U64());
      if (dtype >= static_cast<uint64_t>(c10::ScalarType::NumOptions) || dims > 64) {
        return absl::DataLossError(
            absl::StrCat("gather_object: a bad tensor header for \"", name, "\""));
      }
      std::vector<int64_t> shape;
      for (uint64_t d = 0; d < dims; ++d) {
        ACCEL_ASSIGN_OR_RETURN(uint64_t size, in.U64());
        shape.push_back(static_cast<int64_t>(size));
      }
      ACCEL_ASSIGN_OR_RETURN(absl::string_view data, in.Bytes());
      at::Tensor t;
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        t = at::empty(shape, at::TensorOptions().dtype(static_cast<c10::ScalarType>(dtype)));
      }));
      if (t.nbytes() != data.size()) {
        return absl::DataLossError(absl::StrCat("gather_object: \"", name, "\" has ", data.size(),
                                                " bytes, its shape needs ", t.nbytes()));
      }
      if (!data.empty()) std::memcpy(t.data_ptr(), data.data(), data.size());
      rank_tensors.emplace(std::string(name), std::move(t));
    }
    out.push_back(std::move(rank_tensors));
  }
  return out;
}

}  // namespace accel::train
