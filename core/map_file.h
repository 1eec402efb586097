// core/map_file.h: a file's bytes mapped where the kernel can map its page
// cache a huge page at a time. Torch-free.
//
// A model's weights are used in place from their files' mappings. The page
// cache holds a file in folios, huge ones (2 MiB) where the file system
// allows it (ext4 since Linux 6.16, XFS) and the mapping is advised
// MADV_HUGEPAGE; the process maps such a folio with one PMD entry only where
// its address and its file offset agree modulo 2 MiB, which mmap arranges
// only where the file system asks for it (ext4 and XFS do; overlayfs, a
// container's image layers, does not). An expert of Mixtral-8x7B
// is 76 MiB: 19,456 small pages to read in, insert, map, unmap and reclaim
// each time it is read or evicted, against 38 huge ones (accel-bench-map
// measures the difference).
#ifndef ACCEL_CORE_MAP_FILE_H_
#define ACCEL_CORE_MAP_FILE_H_

#include <cstddef>
#include <cstdint>

namespace accel {

// mmap(nullptr, size, prot, flags, fd, offset) (offset a multiple of the
// page size), placed at an address congruent to `offset` modulo 2 MiB and
// advised MADV_HUGEPAGE (advice: without transparent huge pages it maps
// small pages as before). Unmapped by munmap(addr, size) as any mapping.
// MAP_FAILED with errno set on failure.
void* MapFileHugeAligned(int fd, uint64_t offset, size_t size, int prot, int flags);

// Anonymous read-write memory of `size` bytes placed the same way (offset
// 0: at a 2 MiB boundary) and advised MADV_HUGEPAGE, so that the kernel can
// back each 2 MiB of it with one page: buffers the process fills and reads
// again (one fault a huge page where small ones take 512; under a
// hypervisor that keeps its own page tables a first touch of each small
// page costs a fault there too: accel-bench-map). Unmapped by
// munmap(addr, size). MAP_FAILED with errno set on failure.
void* MapAnonymousHugeAligned(size_t size);

// A range of such a mapping this large or larger is made resident by
// MADV_POPULATE_READ alone, without MADV_WILLNEED first: the kernel reads at
// most one readahead window (the device's read_ahead_kb) of an advised range,
// in small folios mapped page by page, where the faults read huge folios
// mapped whole (accel-bench-map). Below it the advice reads the whole range
// and keeps a fault's huge folio from reading past its ends.
inline constexpr uint64_t kAdviseWillNeedBelowBytes = uint64_t{16} << 20;

}  // namespace accel

#endif  // ACCEL_CORE_MAP_FILE_H_
