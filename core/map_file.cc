#include "core/map_file.h"

#include <cerrno>
#include <sys/mman.h>
#include <unistd.h>

namespace accel {

void* MapFileHugeAligned(int fd, uint64_t offset, size_t size, int prot, int flags) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t mapped = (size + page - 1) / page * page;
  // A reservation a huge page larger, then the file over the part of it
  // that starts at the right place; the reservation's ends given back.
  const uintptr_t reserved = mapped + kHuge;
  void* reserve =
      ::mmap(nullptr, reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserve == MAP_FAILED) {
    return ::mmap(nullptr, size, prot, flags, fd, static_cast<off_t>(offset));
  }
  // The first address from the reservation's start on congruent to `offset`.
  char* const base = static_cast<char*>(reserve);
  const uintptr_t lead = (offset - reinterpret_cast<uintptr_t>(base)) & (kHuge - 1);
  char* const start = base + lead;
  void* addr = ::mmap(start, size, prot, flags | MAP_FIXED, fd, static_cast<off_t>(offset));
  if (addr == MAP_FAILED) {
    const int error = errno;
    ::munmap(reserve, reserved);
    errno = error;
    return MAP_FAILED;
  }
  if (lead > 0) ::munmap(base, lead);
  ::munmap(start + mapped, kHuge - lead);  // lead < kHuge: never empty
#ifdef MADV_HUGEPAGE
  (void)::madvise(addr, size, MADV_HUGEPAGE);
#endif
  return addr;
}

void* MapAnonymousHugeAligned(size_t size) {
  // An anonymous mapping at offset 0 is placed as a file's would be.
  return MapFileHugeAligned(-1, 0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS);
}

}  // namespace accel
