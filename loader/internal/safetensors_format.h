// The safetensors byte format, without torch: parsing and validating a
// header, and building one for writing. Parsers of untrusted bytes live here
// so the fuzz target (tests/fuzz/safetensors_header_fuzz.cc) reaches them cheaply.
//
// Layout: 8 bytes little-endian N, N bytes of JSON (UTF-8, may end in spaces),
// then the data section. The JSON maps tensor names to {"dtype", "shape",
// "data_offsets": [begin, end]} (offsets relative to the data section) and may
// hold "__metadata__": {string: string}.
#ifndef ACCEL_LOADER_INTERNAL_SAFETENSORS_FORMAT_H_
#define ACCEL_LOADER_INTERNAL_SAFETENSORS_FORMAT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "loader/tensor_info.h"

namespace accel::loader::internal {

// The reference implementation's bound on N (safetensors' MAX_HEADER_SIZE).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Element size in bytes of a safetensors dtype ("F32" -> 4), or nullopt when
// the name is not a dtype we know.
std::optional<int> DTypeElementSize(absl::string_view dtype);

struct ParsedHeader {
  std::vector<TensorInfo> tensors;  // in data order (by data_begin)
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // 8 + N: where the data section starts in the file
};

// Parses and strictly validates the header of a safetensors file whose whole
// contents are `file` (only the header is read; the data section is only
// measured). `label` names the file in errors. DataLoss for a truncated or
// inconsistent file, InvalidArgument for a header that is not valid.
absl::StatusOr<ParsedHeader> ParseSafetensors(absl::string_view file, absl::string_view label);

// The 8-byte length and the JSON header, padded with spaces so the data
// section starts at a multiple of 8. `tensors` must already carry their
// final data offsets.
std::string SerializeHeader(const std::vector<TensorInfo>& tensors,
                            const std::map<std::string, std::string>& metadata);

}  // namespace accel::loader::internal

#endif  // ACCEL_LOADER_INTERNAL_SAFETENSORS_FORMAT_H_
