// core/malloc_tuning.h: glibc malloc settings for a process that allocates
// and frees the same tensor buffers at every step.
//
// By default glibc gives freed memory back to the kernel: a block above the
// mmap threshold (128 KiB at first) is unmapped when freed, and the top of
// the heap is trimmed once more than twice that is free. A decode step
// allocates and frees the same activations, logits and scratch at every
// token, so each step faulted in freshly zeroed pages: page faults were 5%
// of a bfloat16 -> NF4 decode's samples on the main thread, and the second
// thread waited on them (docs/BENCHMARKS.md, issue 21).
#ifndef ACCEL_CORE_MALLOC_TUNING_H_
#define ACCEL_CORE_MALLOC_TUNING_H_

#include <cstddef>

namespace accel {

// Blocks up to this size come from the heap, and are reused once freed.
inline constexpr size_t kHeapBlockMaxBytes = size_t{32} << 20;
// Free memory at the top of the heap kept for reuse before trimming.
inline constexpr size_t kHeapTrimBytes = size_t{256} << 20;

// Sets both (mallopt) unless GLIBC_TUNABLES already sets a glibc.malloc
// option, which then stands. Returns whether it changed them: false too
// where malloc is not glibc's (another libc, a sanitizer's).
bool KeepFreedMemoryForReuse();

}  // namespace accel

#endif  // ACCEL_CORE_MALLOC_TUNING_H_
