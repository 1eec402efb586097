// core/dtype.h: dtype names in torch spelling ("float32", "bfloat16", ...),
// as users write them on command lines and in JSON.
#ifndef ACCEL_CORE_DTYPE_H_
#define ACCEL_CORE_DTYPE_H_

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel {

// "float32" for kFloat, "bfloat16" for kBFloat16, ... (torch's str(dtype)
// without "torch.").
absl::string_view DTypeName(c10::ScalarType dtype);

// Accepts the canonical names and torch's aliases ("float", "half", "double",
// "long", "int", "short"), with or without a "torch." prefix.
// InvalidArgument names the text and lists the accepted names.
absl::StatusOr<c10::ScalarType> ParseDType(absl::string_view name);

}  // namespace accel

#endif  // ACCEL_CORE_DTYPE_H_
