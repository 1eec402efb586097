#include "train/env.h"

#include <cstdlib>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace accel::train {

absl::string_view DistributedTypeName(DistributedType type) {
  switch (type) {
    case DistributedType::kNo:
      return "NO";
    case DistributedType::kMultiCpu:
      return "MULTI_CPU";
    case DistributedType::kMultiGpu:
      return "MULTI_GPU";
    case DistributedType::kFsdp:
      return "FSDP";
  }
  return "NO";
}

absl::StatusOr<DistributedType> ParseDistributedType(absl::string_view name) {
  const std::string upper = absl::AsciiStrToUpper(name);
  if (upper == "NO") return DistributedType::kNo;
  if (upper == "MULTI_CPU") return DistributedType::kMultiCpu;
  if (upper == "MULTI_GPU") return DistributedType::kMultiGpu;
  if (upper == "FSDP") return DistributedType::kFsdp;
  return absl::InvalidArgumentError(
      absl::StrCat("distributed_type \"", name, "\": expected NO, MULTI_CPU, MULTI_GPU or FSDP"));
}

absl::string_view PrecisionName(PrecisionType precision) {
  switch (precision) {
    case PrecisionType::kNo:
      return "no";
    case PrecisionType::kFp16:
      return "fp16";
    case PrecisionType::kBf16:
      return "bf16";
  }
  return "no";
}

absl::StatusOr<PrecisionType> ParsePrecision(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "no") return PrecisionType::kNo;
  if (lower == "fp16") return PrecisionType::kFp16;
  if (lower == "bf16") return PrecisionType::kBf16;
  if (lower == "fp8") {
    return absl::InvalidArgumentError(
        "mixed precision \"fp8\" needs Transformer Engine / torchao, which C++ programs do not "
        "have: use no, fp16 or bf16");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("mixed precision \"", name, "\": expected no, fp16 or bf16"));
}

}  // namespace accel::train
