#include "loader/internal/torch_bin.h"

#include <cstring>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/status.h"
#include "loader/internal/mapped_file.h"
#include "loader/internal/safetensors_format.h"
#include "loader/internal/torch_archive.h"
#include "loader/loader.h"

namespace accel::loader::internal {
namespace {

// Keeps the file's bytes alive for as long as a storage points into them.
struct StorageContext {
  std::shared_ptr<const void> keep_alive;
};

void DeleteStorageContext(void* context) { delete static_cast<StorageContext*>(context); }

// libtorch's unpickler over the checked stream. It calls back for each
// storage's bytes (a view of the file, or a copy where the record's bytes
// are not aligned for the dtype) and for the one type tag the check lets
// through; any other name would be refused here too (the check never lets
// one through).
c10::IValue Unpickle(const ParsedTorchArchive& archive, absl::string_view file,
                     const std::shared_ptr<const void>& keep_alive) {
  const std::string& pickle = archive.pickle.canonical;
  size_t pos = 0;
  auto reader = [&](char* buf, size_t n) -> size_t {
    n = std::min(n, pickle.size() - pos);
    std::memcpy(buf, pickle.data() + pos, n);
    pos += n;
    return n;
  };
  auto type_resolver = [](const c10::QualifiedName& name) -> c10::StrongTypePtr {
    TORCH_CHECK(name.qualifiedName() == "Dict[str, Tensor]", "type '", name.qualifiedName(),
                "' is not allowed");
    return c10::StrongTypePtr(
        nullptr, c10::DictType::create(c10::StringType::get(), c10::TensorType::get()));
  };
  auto obj_loader = [](const at::StrongTypePtr& type,
                       const c10::IValue&) -> c10::intrusive_ptr<c10::ivalue::Object> {
    TORCH_CHECK(false, "objects are not allowed (", type.type_->str(), ")");
  };
  auto read_record = [&](const std::string& key) -> at::DataPtr {
    const ZipRecord& record = archive.records.at(key);
    const TorchStorageRef& storage = archive.pickle.storages.at(key);
    const auto element = static_cast<uintptr_t>(*DTypeElementSize(storage.dtype));
    const char* bytes = file.data() + record.offset;
    if (reinterpret_cast<uintptr_t>(bytes) % element != 0) {
      // Another writer's layout: copy, since vectorised kernels assume alignment.
      at::DataPtr copy = c10::GetCPUAllocator()->allocate(record.size);
      std::memcpy(copy.get(), bytes, record.size);
      return copy;
    }
    return at::DataPtr(const_cast<char*>(bytes), new StorageContext{keep_alive},
                       &DeleteStorageContext, at::Device(at::kCPU));
  };
  torch::jit::Unpickler unpickler(reader, type_resolver, obj_loader, read_record,
                                  at::Device(at::kCPU));
  return unpickler.parse_ivalue();
}

}  // namespace

absl::StatusOr<TorchBinFile> TorchBinFile::Open(const std::string& path, bool populate) {
  ACCEL_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> mapped,
                         MappedFile::Open(path, populate));
  const absl::string_view bytes = mapped->bytes();
  return FromBytes(bytes, std::move(mapped), path);
}

absl::StatusOr<TorchBinFile> TorchBinFile::FromBytes(absl::string_view bytes,
                                                     std::shared_ptr<const void> keep_alive,
                                                     const std::string& label) {
  ACCEL_ASSIGN_OR_RETURN(ParsedTorchArchive archive, ParseTorchArchive(bytes, label));
  TorchBinFile out;
  out.path_ = label;
  out.keep_alive_ = keep_alive;
  c10::IValue value;
  ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] { value = Unpickle(archive, bytes, keep_alive); }),
                                 absl::StrCat(label, ": libtorch's unpickler")));
  // What libtorch made must be what the check saw, tensor by tensor.
  const auto disagree = [&](absl::string_view what) {
    return absl::InternalError(absl::StrCat(
        label, ": libtorch's unpickler and accel's check of data.pkl disagree: ", what));
  };
  if (!value.isGenericDict()) return disagree("the value is not a dict");
  const c10::impl::GenericDict dict = value.toGenericDict();
  if (dict.size() != archive.pickle.tensors.size()) return disagree("the number of tensors");
  size_t i = 0;
  for (const auto& entry : dict) {
    const TorchTensorRef& ref = archive.pickle.tensors[i++];
    if (!entry.key().isString() || entry.key().toStringRef() != ref.name ||
        !entry.value().isTensor()) {
      return disagree(absl::StrCat("entry ", i - 1));
    }
    at::Tensor t = entry.value().toTensor();
    ACCEL_ASSIGN_OR_RETURN(std::string dtype, SafetensorsDType(t.scalar_type()));
    const ZipRecord& record = archive.records.at(ref.storage_key);
    const int64_t element = *DTypeElementSize(ref.dtype);
    if (dtype != ref.dtype || t.sizes().vec() != ref.shape || t.strides().vec() != ref.stride ||
        t.storage_offset() != ref.storage_offset) {
      return disagree(absl::StrCat("tensor '", ref.name, "'"));
    }
    t = t.detach();  // requires_grad as saved is of no use to a loader
    TensorInfo info;
    info.name = ref.name;
    info.dtype = ref.dtype;
    info.shape = ref.shape;
    info.data_begin = record.offset + static_cast<uint64_t>(ref.storage_offset * element);
    info.data_end = info.data_begin + static_cast<uint64_t>(ref.numel() * element);
    out.by_name_.emplace(ref.name, out.tensors_.size());
    out.tensors_.push_back(std::move(info));
    out.contiguous_.push_back(ref.contiguous());
    out.values_.push_back(std::move(t));
  }
  return out;
}

const TensorInfo* TorchBinFile::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::optional<uint64_t> TorchBinFile::FileOffset(absl::string_view name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end() || !contiguous_[it->second]) return std::nullopt;
  return tensors_[it->second].data_begin;
}

absl::StatusOr<at::Tensor> TorchBinFile::Tensor(absl::string_view name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
  }
  at::Tensor out;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] { out = values_[it->second].contiguous(); }));
  return out;
}

}  // namespace accel::loader::internal
