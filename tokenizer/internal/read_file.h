// Whole small files (tokenizer.json, tokenizer_config.json, chat templates)
// read without libtorch (loader::ReadFile's ErrnoStatus lives in a
// torch-dependent source).
#ifndef ACCEL_TOKENIZER_INTERNAL_READ_FILE_H_
#define ACCEL_TOKENIZER_INTERNAL_READ_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::tokenizer::internal {

// NotFound for a missing file, PermissionDenied, InvalidArgument for a file
// over `max_bytes` ("too large for a `what`"), DataLoss for a failed read.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes,
                                          absl::string_view what);

}  // namespace accel::tokenizer::internal

#endif  // ACCEL_TOKENIZER_INTERNAL_READ_FILE_H_
