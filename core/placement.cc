#include "core/placement.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace accel {

absl::StatusOr<Placement> Placement::Parse(absl::string_view text) {
  std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  if (lower == "cpu") return Cpu();
  if (lower == "disk") return Disk();
  if (lower == "cuda") return Cuda(0);
  absl::string_view digits = lower;
  if (absl::StartsWith(digits, "cuda:")) digits.remove_prefix(5);
  int index = 0;
  if (!digits.empty() && absl::ascii_isdigit(static_cast<unsigned char>(digits[0])) &&
      absl::SimpleAtoi(digits, &index) && index >= 0) {
    return Cuda(index);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown device '", text, "' (expected a GPU index such as 0 or cuda:0, 'cpu' or 'disk')"));
}

std::string Placement::ToString() const {
  switch (kind_) {
    case Kind::kCuda:
      return absl::StrCat(index_);
    case Kind::kCpu:
      return "cpu";
    case Kind::kDisk:
      return "disk";
  }
  return "?";
}

std::string Placement::DeviceString() const {
  return is_cuda() ? absl::StrCat("cuda:", index_) : ToString();
}

}  // namespace accel
