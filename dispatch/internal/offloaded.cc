#include "dispatch/internal/offloaded.h"

#include <cerrno>
#include <fcntl.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"

namespace accel::dispatch::internal {

absl::Status ReadRange(const std::string& path, uint64_t offset, void* dst, uint64_t n,
                       bool drop_pages) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  auto* out = static_cast<char*>(dst);
  const uint64_t first = offset, total = n;
  absl::Status status;
  while (n > 0) {
    ssize_t got = ::pread(fd, out, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      status = ErrnoStatus(errno, absl::StrCat("reading ", path));
      break;
    }
    if (got == 0) {
      status = absl::DataLossError(absl::StrCat(path, " ends before byte ", offset + n));
      break;
    }
    out += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<uint64_t>(got);
  }
  // Advice only: a failure changes nothing that was read.
  if (drop_pages && status.ok()) {
    (void)::posix_fadvise(fd, static_cast<off_t>(first), static_cast<off_t>(total),
                          POSIX_FADV_DONTNEED);
  }
  ::close(fd);
  return status;
}

}  // namespace accel::dispatch::internal
