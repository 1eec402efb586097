#include "tokenizer/internal/read_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace accel::tokenizer::internal {

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes,
                                          absl::string_view what) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) {
    const int err = errno;
    std::string message = absl::StrCat("opening ", path, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(message);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
    return absl::InvalidArgumentError(message);
  }
  const std::streamoff size = in.tellg();
  if (size < 0) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot tell its size"));
  if (static_cast<uint64_t>(size) > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", size, " bytes is larger than ",
                                                   max_bytes, ", too large for a ", what));
  }
  std::string data(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (!in.read(data.data(), size)) {
    return absl::DataLossError(absl::StrCat("reading ", path, ": ", std::strerror(errno)));
  }
  return data;
}

}  // namespace accel::tokenizer::internal
