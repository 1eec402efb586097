// core/bytes.h: byte sizes as users write them ("10GiB", "5GB") and as we print them.
#ifndef ACCEL_CORE_BYTES_H_
#define ACCEL_CORE_BYTES_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel {

// Parses a memory size the way Accelerate's convert_file_size_to_int does:
// "GiB"/"MiB"/"KiB" are binary and case-insensitive; "GB"/"MB"/"KB" are
// decimal, and when the last character is a lowercase 'b' the value is in
// bits and divided by 8 ("10Gb" -> 1.25e9 bytes), as upstream does. The
// number may have a fraction ("1.5GB"); the result is truncated. Unlike
// Accelerate, a string of plain digits is a byte count ("1000" -> 1000), as
// an integer is there, and "TiB" / "TB" are accepted (disk budgets are
// written "disk=1TB"). Other suffixes ("10G"), negative values and junk are
// InvalidArgument.
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text);

// "1.50 GiB", "12.0 MiB", "512 B": for messages and tables.
std::string FormatBytes(int64_t bytes);

}  // namespace accel

#endif  // ACCEL_CORE_BYTES_H_
