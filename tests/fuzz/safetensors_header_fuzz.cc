// libFuzzer target for the safetensors header parser (scripts/fuzz.sh runs
// it). Any input must give an error status or a header that exactly covers
// the data section; anything else is a crash (__builtin_trap), as are the
// sanitizers' findings.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "loader/internal/safetensors_format.h"

namespace {

using accel::loader::TensorInfo;
using accel::loader::internal::DTypeElementSize;
using accel::loader::internal::ParsedHeader;
using accel::loader::internal::ParseSafetensors;
using accel::loader::internal::SerializeHeader;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

bool SameTensor(const TensorInfo& a, const TensorInfo& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape &&
         a.data_begin == b.data_begin && a.data_end == b.data_end;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view file(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ParsedHeader> parsed = ParseSafetensors(file, "fuzz");
  if (!parsed.ok()) {
    // Every malformed input is one of the two documented errors.
    Check(parsed.status().code() == absl::StatusCode::kInvalidArgument ||
          parsed.status().code() == absl::StatusCode::kDataLoss);
    Check(!parsed.status().message().empty());
    return 0;
  }
  const ParsedHeader& header = *parsed;
  Check(header.data_offset >= 8 && header.data_offset <= size);
  const uint64_t data_size = size - header.data_offset;

  // Sorted by data_begin, contiguous from 0, ending at the end of the file.
  uint64_t cursor = 0;
  std::set<std::string> names;
  for (const TensorInfo& t : header.tensors) {
    Check(t.data_begin == cursor);
    Check(t.data_end >= t.data_begin);
    Check(names.insert(t.name).second);
    std::optional<int> element_size = DTypeElementSize(t.dtype);
    Check(element_size.has_value());
    for (int64_t d : t.shape) Check(d >= 0);
    // numel() is what the loader uses; UBSan reports it if it overflows.
    Check(t.nbytes() == static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(*element_size));
    cursor = t.data_end;
  }
  Check(cursor == data_size);

  // What we parsed serializes to a header that parses back to the same thing.
  std::string again = SerializeHeader(header.tensors, header.metadata);
  absl::string_view data_section = file.substr(header.data_offset);
  again.append(data_section.data(), data_section.size());
  absl::StatusOr<ParsedHeader> reparsed = ParseSafetensors(again, "fuzz-roundtrip");
  Check(reparsed.ok());
  Check(reparsed->metadata == header.metadata);
  Check(reparsed->tensors.size() == header.tensors.size());
  for (size_t i = 0; i < header.tensors.size(); ++i) {
    Check(SameTensor(reparsed->tensors[i], header.tensors[i]));
  }
  return 0;
}
