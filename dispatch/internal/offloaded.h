// Where an offloaded tensor's data lives between forwards, and reading it.
// Shared by the dispatch core's module groups and its expert cache.
#ifndef ACCEL_DISPATCH_INTERNAL_OFFLOADED_H_
#define ACCEL_DISPATCH_INTERNAL_OFFLOADED_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"

namespace accel::dispatch::internal {

struct Source {
  at::Tensor host;   // in RAM (a cpu entry when the execution device is a GPU)
  std::string path;  // or on disk: `nbytes` raw bytes at `offset`
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

struct Offloaded {
  std::string name;  // the model's tensor
  Source source;
};

// Reads `n` bytes at `offset` of `path` into `dst` with pread. With
// `drop_pages`, the file's pages of that range are dropped from the page
// cache afterwards (POSIX_FADV_DONTNEED), so a read-once-per-use weight does
// not also sit in the page cache beside the copy made of it.
absl::Status ReadRange(const std::string& path, uint64_t offset, void* dst, uint64_t n,
                       bool drop_pages = false);

}  // namespace accel::dispatch::internal

#endif  // ACCEL_DISPATCH_INTERNAL_OFFLOADED_H_
