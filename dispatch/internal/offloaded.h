// Where an offloaded tensor's data lives between forwards, and reading it.
// Shared by the dispatch core's module groups and its expert cache.
#ifndef ACCEL_DISPATCH_INTERNAL_OFFLOADED_H_
#define ACCEL_DISPATCH_INTERNAL_OFFLOADED_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "core/file_faults.h"
#include "core/map_file.h"

namespace accel::dispatch::internal {

// A whole file mapped read-only and shared (so the page cache's pages are
// used as they are, and a write to them is a fault, never a silent change),
// for disk entries used in place on a cpu execution device. Unmapped when the
// last owner goes. Thread-safe: its methods are advice on ranges.
// A weights file held open from load to exit: reads and mappings go through
// this descriptor, never the path again, so a file replaced (renamed over)
// or deleted while serving changes nothing, and one changed in place is
// recorded (core/file_faults.h). With `direct`, a second descriptor with
// O_DIRECT where the file system has it.
class OpenFile {
 public:
  static absl::StatusOr<std::shared_ptr<const OpenFile>> Open(const std::string& path, bool direct);
  ~OpenFile();
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;

  const std::string& path() const { return path_; }
  int fd() const { return fd_; }
  // -1 when not asked for, or the file system refuses O_DIRECT (tmpfs).
  int direct_fd() const { return direct_fd_; }

 private:
  OpenFile() = default;
  std::string path_;
  int fd_ = -1;
  int direct_fd_ = -1;
  WeightsFileWatch watch_;
};

class FileMapping {
 public:
  // The whole of `file`, read-only and shared; a SIGBUS on it (the file
  // truncated under us) is mended and recorded (core/file_faults.h).
  static absl::StatusOr<std::shared_ptr<FileMapping>> Open(const OpenFile& file);
  ~FileMapping();
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;

  uint64_t size() const { return size_; }
  const char* data() const { return static_cast<const char*>(addr_); }
  // Maps [offset, offset + n) into the process from the page cache, reading
  // what is not cached (MADV_POPULATE_READ; before Linux 5.14 a touch per
  // page). Returns when the range is resident.
  void Populate(uint64_t offset, uint64_t n) const;
  // Unmaps the whole pages inside [offset, offset + n) from the process
  // (MADV_DONTNEED): its resident memory falls, the page cache keeps them,
  // and a later use maps them again. Pages shared with a neighbour at the
  // edges stay.
  void Drop(uint64_t offset, uint64_t n) const;
  // Starts reading [offset, offset + n) into the page cache and returns
  // (MADV_WILLNEED), which a later Populate() then waits for; a range of
  // kWillNeedLimit or more is left to Populate() alone (core/map_file.h says
  // why; accel-bench-map, 76 MiB: 21-26 ms cold against 25-29 ms advised,
  // 0.04 ms against 0.66 mapped again from the page cache). Advice: nothing
  // fails.
  void WillNeed(uint64_t offset, uint64_t n) const;
  static constexpr uint64_t kWillNeedLimit = kAdviseWillNeedBelowBytes;
  // The whole pages of [offset, offset + n) leave the page cache
  // (POSIX_FADV_DONTNEED), except those a process maps (this one's included:
  // a range someone has mapped again keeps its pages). Advice.
  void DropFromPageCache(uint64_t offset, uint64_t n) const;
  // Drop(), then the whole pages of the range leave the page cache too
  // (POSIX_FADV_DONTNEED; pages another process maps stay): memory the
  // process gives back for good, where it holds more than memory can keep.
  void Evict(uint64_t offset, uint64_t n) const;
  // Bytes of whole pages in [offset, offset + n) that the page cache does
  // not hold now (mincore): what a Populate() would read from disk. Cheap
  // where the range is mapped (a walk of its page tables); where it is not,
  // the kernel looks each page up in the page cache (measured: 13% of the
  // expert reader's samples for 76 MiB experts), so count a read's bytes
  // with ThreadStorageReadBytes() instead.
  uint64_t Missing(uint64_t offset, uint64_t n) const;

 private:
  FileMapping(int fd, void* addr, uint64_t size) : fd_(fd), addr_(addr), size_(size) {}
  int fd_ = -1;  // -1 when dup() failed: Evict() then leaves the page cache alone
  void* addr_ = nullptr;
  uint64_t size_ = 0;
  MappedFileRegistration registration_;
};

// The bytes the calling thread has had read from storage so far (the
// kernel's per-task I/O accounting, counted as reads are submitted: page
// faults, readahead, read()); 0 where the kernel does not account them. The
// difference across a Populate() is what it read from disk, at the cost of
// one system call, not a page-cache lookup per page.
uint64_t ThreadStorageReadBytes();

struct Source {
  at::Tensor host;   // in RAM (a cpu entry when the execution device is a GPU)
  std::string path;  // or on disk: `nbytes` raw bytes at `offset`
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  // Set for a disk source used in place: the mapping of `path`.
  std::shared_ptr<const FileMapping> mapping;
  // A disk source's file, held open since the load: every read goes through it.
  std::shared_ptr<const OpenFile> file;
};

// The disk source `source` as a tensor viewing its mapping (no copy); it
// keeps the mapping alive. Null when the bytes are not aligned for the dtype.
at::Tensor MappedView(const Source& source);

struct Offloaded {
  std::string name;  // the model's tensor
  Source source;
};

// Reads `n` bytes at `offset` of `file` into `dst` with pread. With
// `drop_pages`, the file's pages of that range are dropped from the page
// cache afterwards (POSIX_FADV_DONTNEED). A read that fails (the file cut
// short under us) is recorded as a weights file fault (core/file_faults.h).
absl::Status ReadRange(const OpenFile& file, uint64_t offset, void* dst, uint64_t n,
                       bool drop_pages = false);

// A host buffer of at least `bytes` bytes (uint8, flat): a pooled one, or new
// (pinned when the caller copies to a GPU from it).
using BufferSource = std::function<at::Tensor(uint64_t bytes)>;

// Host buffers for disk reads, reused across reads: a fresh 64 MiB
// allocation costs more in page faults than reading it from the page cache.
// Unpinned buffers of kHugePageBufferBytes or more are anonymous memory in
// 2 MiB pages where the kernel has them. Thread-safe.
inline constexpr uint64_t kHugePageBufferBytes = uint64_t{2} << 20;
class BufferPool {
 public:
  // A free buffer of `bytes` to bytes + 1/8 (not a much larger one), else a
  // new one, pinned when asked.
  at::Tensor Take(uint64_t bytes, bool pinned);
  // Back to the pool, unless something still holds its storage (a value
  // someone kept must never be overwritten by a later read).
  void Give(at::Tensor buffer);

 private:
  std::mutex mu_;
  std::multimap<uint64_t, at::Tensor> free_;  // by bytes
};

// Tensors read from disk, and the host buffers their values view.
struct ReadTensors {
  std::vector<at::Tensor> values;   // in the order asked, shaped, typed
  std::vector<at::Tensor> buffers;  // uint8; give them back when the values are dropped
  uint64_t bytes_read = 0;          // from the files (alignment padding included)
};

// Reads the disk sources `tensors` (each names itself in errors as
// `names[i]`): sources that sit next to one another in one file (gaps under
// 1 MiB) are read in one request into one buffer, and each value is a view
// of it, so a unit of several tensors costs one large read and no copy.
// With `direct`, the requests bypass the page cache (O_DIRECT, each widened
// to 4 KiB boundaries into a 4 KiB-aligned buffer; large direct reads stream
// at the device's rate, where buffered ones of the same size went at about
// half of it on the build machine); where the file system refuses O_DIRECT,
// a buffered read whose pages are dropped after. Errors name the tensor:
// the errno status of open / read, DataLoss for a file that ends early.
absl::StatusOr<ReadTensors> ReadCoalesced(const std::vector<const Source*>& tensors,
                                          const std::vector<std::string>& names, bool direct,
                                          const BufferSource& buffer);

// A byte range of a mapped file that a group or an expert uses in place.
struct MappedSpan {
  const FileMapping* mapping;
  uint64_t offset, bytes;
};

// `spans` sorted by mapping and offset, with overlapping or adjacent ranges
// joined: one advice (or read) a range instead of one a tensor.
std::vector<MappedSpan> MergeSpans(std::vector<MappedSpan> spans);

}  // namespace accel::dispatch::internal

#endif  // ACCEL_DISPATCH_INTERNAL_OFFLOADED_H_
