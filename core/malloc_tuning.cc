#include "core/malloc_tuning.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

// A sanitizer's malloc replaces glibc's; mallopt would not reach it.
#if defined(__SANITIZE_ADDRESS__)
#define ACCEL_SANITIZER_MALLOC 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(memory_sanitizer)
#define ACCEL_SANITIZER_MALLOC 1
#endif
#endif

namespace accel {

bool KeepFreedMemoryForReuse() {
#if defined(__GLIBC__) && !defined(ACCEL_SANITIZER_MALLOC)
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr) return false;
  // mallopt returns 1 on success, 0 on error.
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(kHeapBlockMaxBytes)) == 1 &&
         mallopt(M_TRIM_THRESHOLD, static_cast<int>(kHeapTrimBytes)) == 1;
#else
  return false;
#endif
}

}  // namespace accel
