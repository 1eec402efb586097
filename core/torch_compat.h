// core/torch_compat.h: the one place that knows libtorch version differences.
//
// accel builds against Debian's libtorch 1.13 (CPU) and the libtorch of
// PyTorch 2.x with CUDA. Code elsewhere asks this header instead of testing
// TORCH_VERSION_* itself.
#ifndef ACCEL_CORE_TORCH_COMPAT_H_
#define ACCEL_CORE_TORCH_COMPAT_H_

#include <optional>

#include <c10/core/ScalarType.h>
#include <torch/version.h>

#define ACCEL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||        \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// at::scaled_dot_product_attention with `enable_gqa` (query heads sharing
// key/value heads without copies) is in libtorch 2.5+ (the op itself since
// 2.0, `scale` since 2.1). models/internal/sdpa.cc calls it under this test.
// (scripts/cuda_compile_check.sh sets it to compile that call against 2.x's
// declaration on a machine with libtorch 1.13.)
#ifndef ACCEL_TORCH_HAS_SDPA
#define ACCEL_TORCH_HAS_SDPA ACCEL_TORCH_AT_LEAST(2, 5)
#endif

namespace accel::compat {

// libtorch 1.13's CPU kernels lack float16 for matmul ("addmm_impl_cpu_"
// not implemented for 'Half'), layer_norm and a few others; 2.1 has them.
// Where this is false, accel::nn computes those ops in float32 and rounds
// the result back to float16.
inline constexpr bool kCpuHalfKernels = ACCEL_TORCH_AT_LEAST(2, 1);

// Whether this libtorch has scaled_dot_product_attention with enable_gqa.
inline constexpr bool kHasScaledDotProductAttention = ACCEL_TORCH_HAS_SDPA;

// The 8-bit float types arrived in libtorch 2.1; nullopt before that.
inline std::optional<c10::ScalarType> Float8E5M2() {
#if ACCEL_TORCH_AT_LEAST(2, 1)
  return c10::ScalarType::Float8_e5m2;
#else
  return std::nullopt;
#endif
}

inline std::optional<c10::ScalarType> Float8E4M3FN() {
#if ACCEL_TORCH_AT_LEAST(2, 1)
  return c10::ScalarType::Float8_e4m3fn;
#else
  return std::nullopt;
#endif
}

// Unsigned 16/32/64-bit integers arrived (as "shell" dtypes) in libtorch 2.3.
inline std::optional<c10::ScalarType> UInt16() {
#if ACCEL_TORCH_AT_LEAST(2, 3)
  return c10::ScalarType::UInt16;
#else
  return std::nullopt;
#endif
}

inline std::optional<c10::ScalarType> UInt32() {
#if ACCEL_TORCH_AT_LEAST(2, 3)
  return c10::ScalarType::UInt32;
#else
  return std::nullopt;
#endif
}

inline std::optional<c10::ScalarType> UInt64() {
#if ACCEL_TORCH_AT_LEAST(2, 3)
  return c10::ScalarType::UInt64;
#else
  return std::nullopt;
#endif
}

}  // namespace accel::compat

#endif  // ACCEL_CORE_TORCH_COMPAT_H_
