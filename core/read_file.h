// core/read_file.h: the whole of a small file (a config, a tokenizer), read
// without ever blocking on what is not a regular file: a FIFO (or a device)
// in a model folder would hold open() or read() until a writer came. Torch-free.
#ifndef ACCEL_CORE_READ_FILE_H_
#define ACCEL_CORE_READ_FILE_H_

#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/statusor.h"

namespace accel {

// NotFound (missing), PermissionDenied, InvalidArgument naming the path for
// anything but a regular file or one over `max_bytes`, DataLoss for a read
// that fails part way.
absl::StatusOr<std::string> ReadRegularFile(
    const std::string& path, uint64_t max_bytes = std::numeric_limits<uint64_t>::max());

}  // namespace accel

#endif  // ACCEL_CORE_READ_FILE_H_
