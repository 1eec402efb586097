#include "core/dtype.h"

#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "core/torch_compat.h"

namespace accel {
namespace {

struct NamedDType {
  absl::string_view name;
  c10::ScalarType dtype = c10::ScalarType::Float;
};

constexpr NamedDType kCanonical[] = {
    {"float32", c10::ScalarType::Float},     {"float16", c10::ScalarType::Half},
    {"bfloat16", c10::ScalarType::BFloat16}, {"float64", c10::ScalarType::Double},
    {"int64", c10::ScalarType::Long},        {"int32", c10::ScalarType::Int},
    {"int16", c10::ScalarType::Short},       {"int8", c10::ScalarType::Char},
    {"uint8", c10::ScalarType::Byte},        {"bool", c10::ScalarType::Bool},
};

constexpr NamedDType kAliases[] = {
    {"float", c10::ScalarType::Float},   {"half", c10::ScalarType::Half},
    {"double", c10::ScalarType::Double}, {"long", c10::ScalarType::Long},
    {"int", c10::ScalarType::Int},       {"short", c10::ScalarType::Short},
};

}  // namespace

absl::string_view DTypeName(c10::ScalarType dtype) {
  for (const auto& entry : kCanonical) {
    if (entry.dtype == dtype) return entry.name;
  }
  if (dtype == compat::Float8E5M2()) return "float8_e5m2";
  if (dtype == compat::Float8E4M3FN()) return "float8_e4m3fn";
  return c10::toString(dtype);
}

absl::StatusOr<c10::ScalarType> ParseDType(absl::string_view name) {
  absl::string_view bare = name;
  if (absl::StartsWith(bare, "torch.")) bare.remove_prefix(6);
  for (const auto& entry : kCanonical) {
    if (entry.name == bare) return entry.dtype;
  }
  for (const auto& entry : kAliases) {
    if (entry.name == bare) return entry.dtype;
  }
  if (bare == "float8_e5m2" && compat::Float8E5M2()) return *compat::Float8E5M2();
  if (bare == "float8_e4m3fn" && compat::Float8E4M3FN()) return *compat::Float8E4M3FN();
  std::string known;
  for (const auto& entry : kCanonical)
    absl::StrAppend(&known, known.empty() ? "" : ", ", entry.name);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "' (known: ", known, ")"));
}

}  // namespace accel
