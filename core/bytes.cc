#include "core/bytes.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace accel {
namespace {

absl::Status BadSize(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("invalid size '", text, "': ", why,
                   " (write e.g. 10GiB, 512MiB, 5GB, 100KB or a byte count)"));
}

// Python's float(): surrounding white space is allowed, the rest must be a
// finite decimal number.
absl::StatusOr<double> ParseNumber(absl::string_view full, absl::string_view number) {
  std::string trimmed(absl::StripAsciiWhitespace(number));
  if (trimmed.empty()) return BadSize(full, "no number");
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(trimmed.c_str(), &end);
  if (end != trimmed.c_str() + trimmed.size() || errno == ERANGE || !std::isfinite(v)) {
    return BadSize(full, "not a number");
  }
  // strtod accepts hex floats ("0x1p3"); Python's float() does not.
  if (absl::StrContains(absl::AsciiStrToLower(trimmed), "x")) {
    return BadSize(full, "not a number");
  }
  return v;
}

}  // namespace

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  absl::string_view stripped = absl::StripAsciiWhitespace(text);
  if (stripped.empty()) return BadSize(text, "empty");
  int64_t plain = 0;
  if (std::all_of(stripped.begin(), stripped.end(),
                  [](char c) { return absl::ascii_isdigit(c); })) {
    if (!absl::SimpleAtoi(stripped, &plain)) return BadSize(text, "too large");
    return plain;
  }
  struct Unit {
    absl::string_view suffix;
    double scale = 1;
    bool may_be_bits = false;
  };
  // Binary units before decimal ones ("GIB" also ends in "IB"), as Accelerate tries them.
  static constexpr Unit kUnits[] = {
      {"TIB", 1099511627776.0, false},
      {"GIB", 1073741824.0, false},
      {"MIB", 1048576.0, false},
      {"KIB", 1024.0, false},
      {"TB", 1e12, true},
      {"GB", 1e9, true},
      {"MB", 1e6, true},
      {"KB", 1e3, true},
  };
  std::string upper = absl::AsciiStrToUpper(text);
  for (const Unit& unit : kUnits) {
    if (!absl::EndsWith(upper, unit.suffix)) continue;
    auto number = ParseNumber(text, text.substr(0, text.size() - unit.suffix.size()));
    if (!number.ok()) return number.status();
    double value = std::trunc(*number * unit.scale);
    if (value < 0) return BadSize(text, "negative");
    if (value >= 9.2e18) return BadSize(text, "too large");
    auto bytes = static_cast<int64_t>(value);
    if (unit.may_be_bits && text.back() == 'b') bytes /= 8;  // Accelerate: lowercase b is bits.
    return bytes;
  }
  return BadSize(text, "unknown unit");
}

std::string FormatBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (std::abs(value) >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return absl::StrCat(bytes, " B");
  if (value < 10) return absl::StrFormat("%.2f %s", value, kUnits[unit]);
  if (value < 100) return absl::StrFormat("%.1f %s", value, kUnits[unit]);
  return absl::StrFormat("%.0f %s", value, kUnits[unit]);
}

}  // namespace accel
