#include "dispatch/internal/offloaded.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <numeric>
#include <string>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>
#include <vector>

#include <ATen/Functions.h>

#include "absl/strings/str_cat.h"

#include "core/map_file.h"
#include "core/status.h"

namespace accel::dispatch::internal {
namespace {

constexpr uint64_t kAlign = 4096;                // O_DIRECT: offsets, lengths and memory
constexpr uint64_t kMaxGap = uint64_t{1} << 20;  // read through gaps smaller than this

// Reads [offset, offset + n) of an open file into dst; DataLoss if it ends first.
absl::Status PreadAll(int fd, const std::string& path, uint64_t offset, char* dst, uint64_t n,
                      uint64_t needed) {
  uint64_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, dst + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return ErrnoStatus(errno, absl::StrCat("reading ", path));
    if (got == 0) break;
    done += static_cast<uint64_t>(got);
  }
  if (done < needed) {
    return absl::DataLossError(absl::StrCat(path, " ends before byte ", offset + needed));
  }
  return absl::OkStatus();
}

uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const OpenFile>> OpenFile::Open(const std::string& path,
                                                               bool direct) {
  std::shared_ptr<OpenFile> file(new OpenFile());
  file->path_ = path;
  // O_NONBLOCK: a FIFO would hold open() until a writer came.
  file->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (file->fd_ < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  struct stat st {};
  if (::fstat(file->fd_, &st) != 0) return ErrnoStatus(errno, absl::StrCat("examining ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  // Blocking again: reads of a regular file never wait on O_NONBLOCK anyway,
  // but the flag should say what is meant.
  (void)::fcntl(file->fd_, F_SETFL, ::fcntl(file->fd_, F_GETFL) & ~O_NONBLOCK);
  if (direct) file->direct_fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  file->watch_ = WeightsFileWatch(file->fd_, path);
  return std::shared_ptr<const OpenFile>(std::move(file));
}

OpenFile::~OpenFile() {
  if (fd_ >= 0) ::close(fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
}

absl::StatusOr<std::shared_ptr<FileMapping>> FileMapping::Open(const OpenFile& file) {
  struct stat st {};
  if (::fstat(file.fd(), &st) != 0) {
    return ErrnoStatus(errno, absl::StrCat("reading the size of ", file.path()));
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  void* addr = nullptr;
  if (size > 0) {
    addr = MapFileHugeAligned(file.fd(), 0, size, PROT_READ, MAP_SHARED);
    if (addr == MAP_FAILED) return ErrnoStatus(errno, absl::StrCat("mapping ", file.path()));
  }
  // The mapping's own descriptor of the same open file (never the path
  // again): Evict() advises the page cache through it.
  const int fd = ::fcntl(file.fd(), F_DUPFD_CLOEXEC, 0);
  std::shared_ptr<FileMapping> mapping(new FileMapping(fd, addr, size));
  mapping->registration_ = MappedFileRegistration(addr, size, file.path());
  return mapping;
}

FileMapping::~FileMapping() {
  if (addr_ != nullptr) ::munmap(addr_, size_);
  if (fd_ >= 0) ::close(fd_);
}

void FileMapping::Populate(uint64_t offset, uint64_t n) const {
  if (n == 0 || offset >= size_) return;
  n = std::min(n, size_ - offset);
  const uint64_t page = PageSize();
  const uint64_t begin = offset / page * page;
  char* start = static_cast<char*>(addr_) + begin;
  const uint64_t length = offset + n - begin;
#ifdef MADV_POPULATE_READ
  if (::madvise(start, length, MADV_POPULATE_READ) == 0) return;
#endif
  volatile const char* bytes = start;
  char sink = 0;
  for (uint64_t i = 0; i < length; i += page) sink = static_cast<char>(sink ^ bytes[i]);
  (void)sink;
}

namespace {

// The whole pages inside [offset, offset + n) of a file of `size` bytes, as
// [begin, end); false when there are none (advice on a partly used page
// would touch a neighbour's bytes).
bool WholePages(uint64_t offset, uint64_t n, uint64_t size, uint64_t& begin, uint64_t& end) {
  if (n == 0 || offset >= size) return false;
  n = std::min(n, size - offset);
  const uint64_t page = PageSize();
  begin = (offset + page - 1) / page * page;
  end = (offset + n) / page * page;
  return end > begin;
}

}  // namespace

void FileMapping::Drop(uint64_t offset, uint64_t n) const {
  uint64_t begin = 0, end = 0;
  if (!WholePages(offset, n, size_, begin, end)) return;
  // Advice on a read-only shared mapping: nothing is lost, the pages come
  // back from the page cache (or the file) on the next touch.
  (void)::madvise(static_cast<char*>(addr_) + begin, end - begin, MADV_DONTNEED);
}

void FileMapping::WillNeed(uint64_t offset, uint64_t n) const {
  if (n == 0 || n >= kWillNeedLimit || offset >= size_) return;
  n = std::min(n, size_ - offset);
  const uint64_t page = PageSize();
  const uint64_t begin = offset / page * page;
  (void)::madvise(static_cast<char*>(addr_) + begin, offset + n - begin, MADV_WILLNEED);
}

void FileMapping::Evict(uint64_t offset, uint64_t n) const {
  Drop(offset, n);
  DropFromPageCache(offset, n);
}

void FileMapping::DropFromPageCache(uint64_t offset, uint64_t n) const {
  uint64_t begin = 0, end = 0;
  if (!WholePages(offset, n, size_, begin, end)) return;
  if (fd_ < 0) return;  // advice: the pages stay cached, which costs memory, not data
  (void)::posix_fadvise(fd_, static_cast<off_t>(begin), static_cast<off_t>(end - begin),
                        POSIX_FADV_DONTNEED);
}

uint64_t FileMapping::Missing(uint64_t offset, uint64_t n) const {
  if (n == 0 || offset >= size_) return 0;
  n = std::min(n, size_ - offset);
  const uint64_t page = PageSize();
  const uint64_t begin = offset / page * page;
  const uint64_t length = offset + n - begin;
  std::vector<unsigned char> resident((length + page - 1) / page);
  if (::mincore(static_cast<char*>(addr_) + begin, length, resident.data()) != 0) return n;
  uint64_t missing = 0;
  for (unsigned char r : resident) {
    if ((r & 1) == 0) missing += page;
  }
  return std::min(missing, n);
}

uint64_t ThreadStorageReadBytes() {
  struct rusage usage {};
  if (::getrusage(RUSAGE_THREAD, &usage) != 0) return 0;
  // ru_inblock is the task's read_bytes in 512-byte units.
  return static_cast<uint64_t>(usage.ru_inblock) * 512;
}

at::Tensor MappedView(const Source& source) {
  if (!source.mapping || source.offset + source.nbytes > source.mapping->size()) return {};
  const char* data = source.mapping->data() + source.offset;
  if (reinterpret_cast<uintptr_t>(data) % c10::elementSize(source.dtype) != 0) return {};
  std::shared_ptr<const FileMapping> keep = source.mapping;
  return at::from_blob(
      const_cast<char*>(data), source.shape, [keep](void*) mutable { keep.reset(); },
      at::TensorOptions(source.dtype));
}

namespace {

// Anonymous memory in 2 MiB pages where the kernel has them
// (MapAnonymousHugeAligned: transparent huge pages in "madvise" mode need the
// advice, and at::empty's 64-byte alignment leaves a buffer's ends in small
// pages); undefined if it cannot be mapped. A 76 MiB buffer of small pages
// cost 294-506 ms to fill and a first pass of 0.3-0.5 GB/s on a
// paravirtualized guest, one of 2 MiB pages 21-31 ms and 25 GB/s
// (docs/BENCHMARKS.md).
at::Tensor HugePageBuffer(uint64_t bytes) {
  void* data = MapAnonymousHugeAligned(bytes);
  if (data == MAP_FAILED) return {};
  return at::from_blob(
      data, {static_cast<int64_t>(bytes)}, [bytes](void* p) { ::munmap(p, bytes); },
      at::TensorOptions(at::kByte));
}

}  // namespace

at::Tensor BufferPool::Take(uint64_t bytes, bool pinned) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.lower_bound(bytes);
    if (it != free_.end() && it->first <= bytes + bytes / 8) {
      at::Tensor buffer = std::move(it->second);
      free_.erase(it);
      return buffer;
    }
  }
  if (!pinned && bytes >= kHugePageBufferBytes) {
    if (at::Tensor buffer = HugePageBuffer(bytes); buffer.defined()) return buffer;
  }
  return at::empty({static_cast<int64_t>(bytes)},
                   at::TensorOptions(at::kByte).pinned_memory(pinned));
}

void BufferPool::Give(at::Tensor buffer) {
  if (!buffer.defined() || buffer.storage().use_count() != 1) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_.emplace(buffer.nbytes(), std::move(buffer));
}

absl::Status ReadRange(const OpenFile& file, uint64_t offset, void* dst, uint64_t n,
                       bool drop_pages) {
  absl::Status status = PreadAll(file.fd(), file.path(), offset, static_cast<char*>(dst), n, n);
  if (!status.ok()) {
    RecordModelFileFault(status.ToString());
    return status;
  }
  // Advice only: a failure changes nothing that was read.
  if (drop_pages) {
    (void)::posix_fadvise(file.fd(), static_cast<off_t>(offset), static_cast<off_t>(n),
                          POSIX_FADV_DONTNEED);
  }
  return status;
}

absl::StatusOr<ReadTensors> ReadCoalesced(const std::vector<const Source*>& tensors,
                                          const std::vector<std::string>& names, bool direct,
                                          const BufferSource& buffer) {
  ReadTensors out;
  out.values.resize(tensors.size());
  // Runs of tensors adjacent in one file, in file order.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (tensors[a]->path != tensors[b]->path) return tensors[a]->path < tensors[b]->path;
    return tensors[a]->offset < tensors[b]->offset;
  });
  size_t i = 0;
  while (i < order.size()) {
    size_t j = i + 1;
    uint64_t end = tensors[order[i]]->offset + tensors[order[i]]->nbytes;
    while (j < order.size() && tensors[order[j]]->path == tensors[order[i]]->path &&
           tensors[order[j]]->offset <= end + kMaxGap) {
      end = std::max(end, tensors[order[j]]->offset + tensors[order[j]]->nbytes);
      ++j;
    }
    const Source& first = *tensors[order[i]];
    const std::string& label = names[order[i]];
    const uint64_t start = direct ? first.offset / kAlign * kAlign : first.offset;
    const uint64_t length = direct ? (end - start + kAlign - 1) / kAlign * kAlign : end - start;
    at::Tensor storage;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { storage = buffer(length + kAlign); }));
    // The run starts at the buffer's first 4 KiB boundary.
    const auto address = reinterpret_cast<uintptr_t>(storage.data_ptr());
    const uint64_t pad = direct ? (kAlign - address % kAlign) % kAlign : 0;
    char* dst = static_cast<char*>(storage.data_ptr()) + pad;

    // Through the descriptors held since the load, never the path again.
    if (first.file == nullptr) {
      return absl::InternalError(
          absl::StrCat("tensor '", label, "': ", first.path, " is not open"));
    }
    int fd = direct ? first.file->direct_fd() : -1;
    const bool drop_after = direct && fd < 0;  // no O_DIRECT here (tmpfs): drop the pages after
    if (fd < 0) fd = first.file->fd();
    absl::Status read = PreadAll(fd, first.path, start, dst, length, end - start);
    if (drop_after && read.ok()) {
      (void)::posix_fadvise(fd, static_cast<off_t>(start), static_cast<off_t>(length),
                            POSIX_FADV_DONTNEED);
    }
    if (!read.ok()) {
      RecordModelFileFault(absl::StrCat("tensor '", label, "': ", read.ToString()));
      // Name the first tensor the short read cut into.
      std::string cut = label;
      if (absl::IsDataLoss(read)) {
        for (size_t k = i; k < j; ++k) {
          cut = names[order[k]];
          struct stat st = {};
          if (::fstat(first.file->fd(), &st) == 0 &&
              tensors[order[k]]->offset + tensors[order[k]]->nbytes >
                  static_cast<uint64_t>(st.st_size)) {
            break;
          }
        }
      }
      return Annotate(read, absl::StrCat("tensor '", cut, "'"));
    }
    out.bytes_read += length;
    for (size_t k = i; k < j; ++k) {
      const size_t index = order[k];
      const Source& s = *tensors[index];
      const uint64_t at = pad + (s.offset - start);
      const int64_t element = static_cast<int64_t>(c10::elementSize(s.dtype));
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        at::Tensor bytes =
            storage.narrow(0, static_cast<int64_t>(at), static_cast<int64_t>(s.nbytes));
        if (at % static_cast<uint64_t>(element) == 0) {
          out.values[index] = bytes.view(s.dtype).view(s.shape);
        } else {
          // Data not aligned to its element size (possible in files from
          // other writers): a copy into an aligned tensor.
          at::Tensor aligned = at::empty(s.shape, at::TensorOptions(s.dtype));
          std::memcpy(aligned.data_ptr(), bytes.data_ptr(), s.nbytes);
          out.values[index] = aligned;
        }
      }));
    }
    out.buffers.push_back(std::move(storage));
    i = j;
  }
  return out;
}

std::vector<MappedSpan> MergeSpans(std::vector<MappedSpan> spans) {
  std::sort(spans.begin(), spans.end(), [](const MappedSpan& a, const MappedSpan& b) {
    return a.mapping != b.mapping ? a.mapping < b.mapping : a.offset < b.offset;
  });
  std::vector<MappedSpan> merged;
  for (const MappedSpan& sp : spans) {
    if (!merged.empty() && merged.back().mapping == sp.mapping &&
        merged.back().offset + merged.back().bytes >= sp.offset) {
      MappedSpan& last = merged.back();
      last.bytes = std::max(last.offset + last.bytes, sp.offset + sp.bytes) - last.offset;
    } else {
      merged.push_back(sp);
    }
  }
  return merged;
}

}  // namespace accel::dispatch::internal
