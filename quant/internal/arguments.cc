#include "quant/internal/arguments.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/dtype.h"
#include "core/status.h"

namespace accel::quant::internal {
namespace {

// float32, bfloat16 or float16: the dtypes x, bias and compute_dtype take.
bool IsComputeType(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

}  // namespace

absl::Status CheckOnDevice(const at::Tensor& t, absl::string_view name, const at::Device& device) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(name, " is undefined"));
  if (t.device() == device && t.layout() == at::kStrided) return absl::OkStatus();
  if (device.is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a dense cpu tensor, got one on ", t.device().str()));
  }
  return absl::InvalidArgumentError(absl::StrCat(name, " must be a dense tensor on ", device.str(),
                                                 " (x's device), got one on ", t.device().str()));
}

absl::Status CheckDType(const at::Tensor& t, absl::string_view name, at::ScalarType want) {
  if (t.scalar_type() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be ", DTypeName(want), ", got ", DTypeName(t.scalar_type())));
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckFloatDType(const at::Tensor& t, absl::string_view name) {
  if (!IsComputeType(t.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " must be float32, bfloat16 or float16, got ", DTypeName(t.scalar_type())));
  }
  return absl::OkStatus();
}

// What a kernel reads raw: on `device`, of `dtype`, contiguous.
absl::Status CheckKernelInput(const at::Tensor& t, absl::string_view name, at::ScalarType dtype,
                              const at::Device& device) {
  ACCEL_RETURN_IF_ERROR(CheckOnDevice(t, name, device));
  ACCEL_RETURN_IF_ERROR(CheckDType(t, name, dtype));
  if (!t.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be contiguous"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckInputShape(const at::Tensor& x, int64_t in) {
  ACCEL_RETURN_IF_ERROR(CheckFloatDType(x, "x"));
  if (x.dim() < 1 || x.size(-1) != in) {
    return absl::InvalidArgumentError(absl::StrCat("x must be [..., ", in, "] (in_features), got [",
                                                   absl::StrJoin(x.sizes(), ", "), "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckBias(const at::Tensor& bias, int64_t out, const at::Device& device) {
  if (!bias.defined()) return absl::OkStatus();
  ACCEL_RETURN_IF_ERROR(CheckOnDevice(bias, "bias", device));
  ACCEL_RETURN_IF_ERROR(CheckFloatDType(bias, "bias"));
  if (bias.dim() != 1 || bias.size(0) != out) {
    return absl::InvalidArgumentError(absl::StrCat("bias must be [", out, "] (out_features), got [",
                                                   absl::StrJoin(bias.sizes(), ", "), "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckWeight4bit(const Weight4bit& w, const at::Device& device) {
  if (w.out_features <= 0 || w.in_features <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("weight.out_features and weight.in_features ",
                                                   "must be positive, got ", w.out_features,
                                                   " and ", w.in_features));
  }
  if (w.blocksize <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight.blocksize must be positive, got ", w.blocksize));
  }
  const int64_t n = w.out_features * w.in_features;
  ACCEL_RETURN_IF_ERROR(CheckKernelInput(w.packed, "weight.packed", at::kByte, device));
  if (w.packed.numel() < (n + 1) / 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight.packed holds ", w.packed.numel(), " bytes, fewer than the ",
                     (n + 1) / 2, " of a [", w.out_features, ", ", w.in_features, "] weight"));
  }
  const bool nested = w.absmax.defined() && w.absmax.scalar_type() == at::kByte;
  ACCEL_RETURN_IF_ERROR(
      CheckKernelInput(w.absmax, "weight.absmax", nested ? at::kByte : at::kFloat, device));
  const int64_t blocks = (n + w.blocksize - 1) / w.blocksize;
  if (w.absmax.numel() != blocks) {
    return absl::InvalidArgumentError(absl::StrCat("weight.absmax holds ", w.absmax.numel(),
                                                   " values, not ceil(", n, " / ", w.blocksize,
                                                   ") = ", blocks));
  }
  if (nested) {
    ACCEL_RETURN_IF_ERROR(
        CheckKernelInput(w.nested_absmax, "weight.nested_absmax", at::kFloat, device));
    const int64_t nested_blocks = (blocks + 255) / 256;
    if (w.nested_absmax.numel() != nested_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("weight.nested_absmax holds ", w.nested_absmax.numel(), " values, not ceil(",
                       blocks, " / 256) = ", nested_blocks, " (uint8 absmax: double quant)"));
    }
    ACCEL_RETURN_IF_ERROR(
        CheckKernelInput(w.nested_code, "weight.nested_code", at::kFloat, device));
    if (w.nested_code.numel() != 256) {
      return absl::InvalidArgumentError(
          absl::StrCat("weight.nested_code must hold 256 values, got ", w.nested_code.numel()));
    }
  }
  ACCEL_RETURN_IF_ERROR(CheckKernelInput(w.code, "weight.code", at::kFloat, device));
  if (w.code.numel() != 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight.code must hold 16 values, got ", w.code.numel()));
  }
  return absl::OkStatus();
}

absl::Status CheckComputeDType(at::ScalarType dtype, absl::string_view name) {
  if (!IsComputeType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be float32, bfloat16 or float16, got ", DTypeName(dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckInt8Weight(const at::Tensor& cb, const at::Tensor& scb,
                             const at::Device& device) {
  ACCEL_RETURN_IF_ERROR(CheckOnDevice(cb, "cb", device));
  ACCEL_RETURN_IF_ERROR(CheckDType(cb, "cb", at::kChar));
  if (cb.dim() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("cb must be [out, in], got [", absl::StrJoin(cb.sizes(), ", "), "]"));
  }
  const int64_t out = cb.size(0), in = cb.size(1);
  if (in == 0) return absl::InvalidArgumentError("cb must have at least one column (in_features)");
  ACCEL_RETURN_IF_ERROR(CheckOnDevice(scb, "scb", device));
  ACCEL_RETURN_IF_ERROR(CheckDType(scb, "scb", at::kFloat));
  if (scb.dim() != 1 || scb.size(0) != out) {
    return absl::InvalidArgumentError(absl::StrCat("scb must be [", out, "] (cb's rows), got [",
                                                   absl::StrJoin(scb.sizes(), ", "), "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckThreshold(double threshold) {
  if (!(threshold >= 0.0) || std::isinf(threshold)) {
    return absl::InvalidArgumentError(
        absl::StrCat("threshold must be a finite number >= 0, got ", threshold));
  }
  return absl::OkStatus();
}

}  // namespace accel::quant::internal
