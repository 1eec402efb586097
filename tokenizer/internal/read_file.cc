#include "tokenizer/internal/read_file.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "core/read_file.h"

namespace accel::tokenizer::internal {

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes,
                                          absl::string_view what) {
  // Never blocks on a FIFO or a device: refused by name.
  absl::StatusOr<std::string> data = ReadRegularFile(path, max_bytes);
  if (absl::IsInvalidArgument(data.status()) &&
      absl::StrContains(data.status().message(), "over the bound")) {
    return absl::InvalidArgumentError(
        absl::StrCat(data.status().message(), ", too large for a ", what));
  }
  return data;
}

}  // namespace accel::tokenizer::internal
