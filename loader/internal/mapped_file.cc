#include "loader/internal/mapped_file.h"

#include <cerrno>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"

#include "core/map_file.h"
#include "core/status.h"

namespace accel::loader::internal {

void PopulateMapping(const void* addr, size_t size) {
  // MAP_POPULATE would fault a private writable mapping in for writing,
  // copying the whole file; MADV_POPULATE_READ maps the page cache as is.
  // Kernels before 5.14 lack it: touch one byte per page instead.
  if (::madvise(const_cast<void*>(addr), size, MADV_POPULATE_READ) == 0) return;
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  volatile const unsigned char* bytes = static_cast<const unsigned char*>(addr);
  unsigned char sink = 0;
  for (size_t i = 0; i < size; i += page) sink = static_cast<unsigned char>(sink ^ bytes[i]);
  (void)sink;
}

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::Open(const std::string& path,
                                                                   bool populate) {
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, absl::StrCat("reading the size of ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", S_ISFIFO(st.st_mode) ? "a FIFO, " : "", "not a regular file"));
  }
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = path;
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* addr = MapFileHugeAligned(fd, 0, file->size_, PROT_READ | PROT_WRITE, MAP_PRIVATE);
    if (addr == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, absl::StrCat("mapping ", path));
    }
    file->addr_ = addr;
    file->registration_ = MappedFileRegistration(addr, file->size_, path);
    file->watch_ = WeightsFileWatch(fd, path);
    if (populate) PopulateMapping(addr, file->size_);
  }
  ::close(fd);  // The mapping keeps the file open.
  return std::shared_ptr<const MappedFile>(std::move(file));
}

MappedFile::~MappedFile() {
  if (addr_ != nullptr) ::munmap(addr_, size_);
}

}  // namespace accel::loader::internal
