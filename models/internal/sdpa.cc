#include "models/internal/sdpa.h"

#include "core/torch_compat.h"

#if ACCEL_TORCH_HAS_SDPA && !defined(ACCEL_NO_SDPA)
#define ACCEL_SDPA 1
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#endif

namespace accel::models::internal {

bool SdpaBuilt() {
#ifdef ACCEL_SDPA
  return true;
#else
  return false;
#endif
}

std::optional<at::Tensor> SdpaAttention(const at::Tensor& q, const at::Tensor& keys,
                                        const at::Tensor& values, int64_t past,
                                        std::optional<int64_t> window, const ScoreRule& rule) {
#ifndef ACCEL_SDPA
  (void)q;
  (void)keys;
  (void)values;
  (void)past;
  (void)window;
  (void)rule;
  return std::nullopt;
#else
  if (!q.is_cuda() || rule.softcap) return std::nullopt;
  const int64_t heads = q.size(0), kv_heads = keys.size(0), n = q.size(1);
  const int64_t total = past + n;
  // The op's scale multiplies; a rule that divides passes the reciprocal
  // (as the cpu paged kernel does).
  const double scale = rule.divide ? 1.0 / rule.scale : rule.scale;
  const bool windowed = window && total > *window;
  std::optional<at::Tensor> mask;
  bool causal = false;
  if (n > 1 || windowed) {
    if (past == 0 && !windowed) {
      // The op's causal mask is aligned to the top left: right when the
      // queries are the whole sequence.
      causal = true;
    } else {
      const at::TensorOptions positions = q.options().dtype(at::kLong);
      const at::Tensor query_pos = at::arange(past, total, positions).unsqueeze(1);
      const at::Tensor key_pos = at::arange(0, total, positions).unsqueeze(0);
      at::Tensor allowed = key_pos <= query_pos;
      if (windowed) allowed = allowed.logical_and(query_pos - key_pos < *window);
      mask = allowed;  // true: attend
    }
  }
  const at::Tensor out = at::scaled_dot_product_attention(
      q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask, /*dropout_p=*/0.0, causal,
      scale, /*enable_gqa=*/heads != kv_heads);
  return out.squeeze(0);
#endif
}

}  // namespace accel::models::internal
