// Attention of a chunk of queries over its sequence's keys and values through
// libtorch's scaled_dot_product_attention (flash / memory-efficient / cuDNN
// kernels on a CUDA device), where this libtorch has it (2.5+:
// core/torch_compat.h) and the build has not turned it off
// (ACCEL_WITH_SDPA=OFF defines ACCEL_NO_SDPA). AttendPacked uses it for
// prefill chunks (and contiguous caches) on a CUDA device; the cpu keeps
// its own path, whose numbers the model tests pin down.
#ifndef ACCEL_MODELS_INTERNAL_SDPA_H_
#define ACCEL_MODELS_INTERNAL_SDPA_H_

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

#include "models/internal/paged_attention.h"  // ScoreRule

namespace accel::models::internal {

// Whether SdpaAttention can run at all in this build.
bool SdpaBuilt();

// q [heads, n, d] at positions [past, past + n); keys and values
// [kv_heads, past + n, d] (heads a multiple of kv_heads). Query i sees key j
// when j <= past + i and, with a window, past + i - j < window. Returns
// [heads, n, dv] in q's dtype, or nullopt where it does not apply: not built,
// q not on a CUDA device, or a soft-cap (which the op cannot apply between
// the product and the softmax).
std::optional<at::Tensor> SdpaAttention(const at::Tensor& q, const at::Tensor& keys,
                                        const at::Tensor& values, int64_t past,
                                        std::optional<int64_t> window, const ScoreRule& rule);

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_SDPA_H_
