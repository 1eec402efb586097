#include "loader/internal/atomic_file.h"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include "absl/strings/str_cat.h"

#include "core/status.h"

namespace accel::loader::internal {
namespace {

std::string ParentOf(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

AtomicFile::AtomicFile(std::string path, std::string temp_path, int fd)
    : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {}

AtomicFile::AtomicFile(AtomicFile&& other) noexcept
    : path_(std::move(other.path_)),
      temp_path_(std::move(other.temp_path_)),
      fd_(std::exchange(other.fd_, -1)),
      published_(std::exchange(other.published_, true)),
      written_behind_(other.written_behind_) {}

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    Discard();
    path_ = std::move(other.path_);
    temp_path_ = std::move(other.temp_path_);
    fd_ = std::exchange(other.fd_, -1);
    published_ = std::exchange(other.published_, true);
    written_behind_ = other.written_behind_;
  }
  return *this;
}

AtomicFile::~AtomicFile() { Discard(); }

void AtomicFile::Discard() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!published_ && !temp_path_.empty()) ::unlink(temp_path_.c_str());
  published_ = true;
}

absl::StatusOr<AtomicFile> AtomicFile::Create(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  std::string temp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter++);
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("creating ", temp));
  return AtomicFile(path, std::move(temp), fd);
}

absl::Status AtomicFile::Write(absl::string_view bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": already finished"));
  while (!bytes.empty()) {
    ssize_t n = ::write(fd_, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("writing ", path_));
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status AtomicFile::WriteAt(uint64_t offset, absl::string_view bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": already finished"));
  while (!bytes.empty()) {
    ssize_t n = ::pwrite(fd_, bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("writing ", path_));
    }
    bytes.remove_prefix(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

void AtomicFile::WriteBehind() {
  if (fd_ < 0) return;
  written_behind_ = true;
  // Pages written back since the last call are clean now and go; the dirty
  // ones start their write-back and go next time. Both are advice: an error
  // leaves the pages cached, which costs memory, never data.
  (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
  (void)::sync_file_range(fd_, 0, 0, SYNC_FILE_RANGE_WRITE);
}

absl::Status AtomicFile::Finish() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": already finished"));
  int fd = std::exchange(fd_, -1);
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, absl::StrCat("syncing ", path_));
  }
  // All clean now: a file written behind (a large one) drops the rest of
  // its pages too. Its readers then fault it in whole huge folios where the
  // writer's were small ones; under a hypervisor that keeps its own page
  // tables, a product over 4 KiB-mapped pages ran at half the rate
  // (docs/BENCHMARKS.md, "A third machine").
  if (written_behind_) (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  if (::close(fd) != 0) return ErrnoStatus(errno, absl::StrCat("closing ", path_));
  return absl::OkStatus();
}

absl::Status AtomicFile::Publish() {
  if (fd_ >= 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": not finished"));
  if (published_) return absl::FailedPreconditionError(absl::StrCat(path_, ": already published"));
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("renaming ", temp_path_, " to ", path_));
  }
  published_ = true;
  return SyncParentDirectory(path_);
}

absl::Status AtomicFile::Commit() {
  ACCEL_RETURN_IF_ERROR(Finish());
  return Publish();
}

absl::Status SyncParentDirectory(const std::string& path) {
  std::string dir = ParentOf(path);
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening folder ", dir));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus(err, absl::StrCat("syncing folder ", dir));
  return absl::OkStatus();
}

}  // namespace accel::loader::internal
