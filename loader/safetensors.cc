// SafetensorsFile: a memory-mapped safetensors file and zero-copy tensors over it.
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>

#include "absl/strings/str_cat.h"

#include "core/file_faults.h"
#include "core/map_file.h"
#include "core/status.h"
#include "core/torch_compat.h"
#include "loader/internal/safetensors_format.h"
#include "loader/loader.h"

namespace accel::loader {

// The mapping of one file. Tensors handed out hold a shared_ptr to it, so it
// lives as long as the last of them.
struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  size_t size = 0;
  // A SIGBUS on it (the file truncated under us) is mended and recorded, and
  // a change in place is recorded (core/file_faults.h).
  MappedFileRegistration registration;
  WeightsFileWatch watch;
  int fd = -1;  // the file itself, for MapAlone (not reopened by path)

  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (addr != nullptr) ::munmap(addr, size);
    if (fd >= 0) ::close(fd);
  }
};

namespace {

// Pages of a file mapped on their own for MapAlone. It keeps the file's
// whole mapping alive too: its watch on the file stays.
struct PartMapping {
  void* addr = nullptr;
  size_t size = 0;
  MappedFileRegistration registration;
  std::shared_ptr<const void> whole;

  PartMapping() = default;
  PartMapping(const PartMapping&) = delete;
  PartMapping& operator=(const PartMapping&) = delete;
  ~PartMapping() {
    if (addr != nullptr) ::munmap(addr, size);
  }
};

// Reads every page in, read-only. MAP_POPULATE would fault a private writable
// mapping in for writing, copying the whole file (2x a plain read, measured
// by bench/loader/load_benchmark.cc); MADV_POPULATE_READ maps the page cache as is.
// Kernels before 5.14 lack it: touch one byte per page instead.
void Populate(void* addr, size_t size) {
  if (::madvise(addr, size, MADV_POPULATE_READ) == 0) return;
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  volatile const unsigned char* bytes = static_cast<const unsigned char*>(addr);
  unsigned char sink = 0;
  for (size_t i = 0; i < size; i += static_cast<size_t>(page))
    sink = static_cast<unsigned char>(sink ^ bytes[i]);
  (void)sink;
}

}  // namespace

absl::StatusOr<std::string> SafetensorsDType(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Bool:
      return std::string("BOOL");
    case c10::ScalarType::Byte:
      return std::string("U8");
    case c10::ScalarType::Char:
      return std::string("I8");
    case c10::ScalarType::Short:
      return std::string("I16");
    case c10::ScalarType::Half:
      return std::string("F16");
    case c10::ScalarType::BFloat16:
      return std::string("BF16");
    case c10::ScalarType::Int:
      return std::string("I32");
    case c10::ScalarType::Float:
      return std::string("F32");
    case c10::ScalarType::Double:
      return std::string("F64");
    case c10::ScalarType::Long:
      return std::string("I64");
    default:
      break;
  }
  if (dtype == compat::Float8E5M2()) return std::string("F8_E5M2");
  if (dtype == compat::Float8E4M3FN()) return std::string("F8_E4M3");
  if (dtype == compat::UInt16()) return std::string("U16");
  if (dtype == compat::UInt32()) return std::string("U32");
  if (dtype == compat::UInt64()) return std::string("U64");
  return absl::InvalidArgumentError(
      absl::StrCat("dtype ", c10::toString(dtype), " has no safetensors equivalent"));
}

absl::StatusOr<c10::ScalarType> TorchDType(absl::string_view dtype) {
  struct Entry {
    absl::string_view name;
    std::optional<c10::ScalarType> dtype;
  };
  const Entry entries[] = {
      {"BOOL", c10::ScalarType::Bool},   {"U8", c10::ScalarType::Byte},
      {"I8", c10::ScalarType::Char},     {"I16", c10::ScalarType::Short},
      {"F16", c10::ScalarType::Half},    {"BF16", c10::ScalarType::BFloat16},
      {"I32", c10::ScalarType::Int},     {"F32", c10::ScalarType::Float},
      {"F64", c10::ScalarType::Double},  {"I64", c10::ScalarType::Long},
      {"F8_E5M2", compat::Float8E5M2()}, {"F8_E4M3", compat::Float8E4M3FN()},
      {"U16", compat::UInt16()},         {"U32", compat::UInt32()},
      {"U64", compat::UInt64()},
  };
  for (const Entry& e : entries) {
    if (e.name != dtype) continue;
    if (!e.dtype) {
      return absl::UnimplementedError(absl::StrCat("dtype ", dtype, " needs a newer libtorch than ",
                                                   TORCH_VERSION,
                                                   " (F8_*: 2.1, U16/U32/U64: 2.3)"));
    }
    return *e.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown safetensors dtype '", dtype, "'"));
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path,
                                                      OpenOptions options) {
  // O_NONBLOCK: a FIFO would hold open() until a writer came; refused below.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, absl::StrCat("reading the size of ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", S_ISFIFO(st.st_mode) ? "a FIFO, " : "", "not a regular file"));
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<size_t>(st.st_size);
  if (mapping->size > 0) {
    // Private and writable: copy-on-write, so in-place ops on a returned tensor
    // work and never reach the file.
    void* addr = MapFileHugeAligned(fd, 0, mapping->size, PROT_READ | PROT_WRITE, MAP_PRIVATE);
    if (addr == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return ErrnoStatus(err, absl::StrCat("mapping ", path));
    }
    mapping->addr = addr;
    mapping->registration = MappedFileRegistration(addr, mapping->size, path);
    mapping->watch = WeightsFileWatch(fd, path);
    if (options.populate) Populate(addr, mapping->size);
    mapping->fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);  // -1: MapAlone refuses
  }
  ::close(fd);

  absl::string_view bytes(static_cast<const char*>(mapping->addr), mapping->size);
  ACCEL_ASSIGN_OR_RETURN(internal::ParsedHeader header, internal::ParseSafetensors(bytes, path));
  SafetensorsFile file;
  file.path_ = path;
  file.mapping_ = std::move(mapping);
  file.data_offset_ = header.data_offset;
  file.tensors_ = std::move(header.tensors);
  file.metadata_ = std::move(header.metadata);
  for (size_t i = 0; i < file.tensors_.size(); ++i) file.by_name_.emplace(file.tensors_[i].name, i);
  return file;
}

uint64_t SafetensorsFile::file_size() const { return mapping_ ? mapping_->size : 0; }

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

absl::string_view SafetensorsFile::Bytes(const TensorInfo& info) const {
  const char* base = static_cast<const char*>(mapping_->addr);
  return {base + data_offset_ + info.data_begin, info.nbytes()};
}

absl::StatusOr<at::Tensor> SafetensorsFile::Tensor(absl::string_view name) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
  }
  auto dtype = TorchDType(info->dtype);
  if (!dtype.ok()) return Annotate(dtype.status(), absl::StrCat(path_, ": tensor '", name, "'"));
  absl::string_view bytes = Bytes(*info);
  const auto options = at::TensorOptions().dtype(*dtype).device(at::kCPU);
  at::Tensor tensor;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    const size_t element_size = c10::elementSize(*dtype);
    auto address = reinterpret_cast<uintptr_t>(bytes.data());
    if (bytes.empty() || address % element_size != 0) {
      // Another writer's layout can leave data unaligned for its type; torch's
      // vectorized kernels assume alignment, so such tensors get a copy.
      tensor = at::empty(info->shape, options);
      if (!bytes.empty()) std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
      return;
    }
    std::shared_ptr<const Mapping> keep_alive = mapping_;
    tensor = at::from_blob(
        const_cast<char*>(bytes.data()), info->shape,
        [keep_alive](void*) mutable { keep_alive.reset(); }, options);
  }));
  return tensor;
}

absl::StatusOr<at::Tensor> SafetensorsFile::MapAlone(const at::Tensor& part) const {
  const auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": cannot map a tensor on its own: ", why));
  };
  if (mapping_ == nullptr || mapping_->addr == nullptr || mapping_->fd < 0) {
    return refuse("the file is not mapped");
  }
  if (!part.defined() || !part.device().is_cpu() || !part.is_contiguous()) {
    return refuse("not a contiguous CPU tensor");
  }
  const auto base = reinterpret_cast<uintptr_t>(mapping_->addr);
  const auto begin = reinterpret_cast<uintptr_t>(part.data_ptr());
  const size_t nbytes = part.nbytes();
  if (begin < base || begin + nbytes > base + mapping_->size) {
    return refuse("its bytes are not in the file's mapping");
  }
  if (nbytes == 0) return part;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t offset = begin - base, first = offset / page * page;
  auto mapped = std::make_shared<PartMapping>();
  mapped->size = static_cast<size_t>(offset + nbytes - first);
  // Private and writable as the whole file's mapping is (copy-on-write).
  void* addr =
      MapFileHugeAligned(mapping_->fd, first, mapped->size, PROT_READ | PROT_WRITE, MAP_PRIVATE);
  if (addr == MAP_FAILED) return ErrnoStatus(errno, absl::StrCat("mapping part of ", path_));
  mapped->addr = addr;
  mapped->registration = MappedFileRegistration(addr, mapped->size, path_);
  mapped->whole = mapping_;
  at::Tensor out;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    out = at::from_blob(
        static_cast<char*>(addr) + (offset - first), part.sizes(), part.strides(),
        [mapped](void*) mutable { mapped.reset(); }, part.options());
  }));
  return out;
}

}  // namespace accel::loader
