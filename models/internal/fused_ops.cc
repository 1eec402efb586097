// FusedRmsNorm, FusedRotary, FusedSiluMul (fused_ops.h): the shape checks,
// then models/cuda's kernels on libtorch's current stream (so a CUDA graph
// capture records them). The kernels are called only where they are built
// and libtorch is a CUDA build (ACCEL_WITH_MODELS_CUDA, set by
// models/CMakeLists.txt); elsewhere every call returns nullopt.
#include "models/internal/fused_ops.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "models/cuda/decode_gemv.h"

#ifdef ACCEL_WITH_MODELS_CUDA
#include <cuda_runtime_api.h>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "models/cuda/fused_kernels.h"
#include "models/internal/cuda_dtype.h"
#endif

namespace accel::models::internal {
namespace {

std::atomic<bool> fused_enabled{true};
// ACCEL_CUDA_DECODE_GEMV=0 starts with it off (a device run that finds it
// wrong or slow measures the rest without a rebuild).
bool DecodeGemvDefault() {
  const char* env = std::getenv("ACCEL_CUDA_DECODE_GEMV");
  return env == nullptr || std::string(env) != "0";
}
std::atomic<bool> decode_gemv_enabled{DecodeGemvDefault()};
// The most rows it takes by default: 4. A warp reads every row of x for each
// row of W it takes, from L1 or shared memory; at 8 rows that is 8 times the
// weight's bytes, which at HBM's rate is about what an H100-class SM's L1
// delivers, so above 4 rows cuBLAS's tiles (x read once a tile) should win.
// An estimate: accel-bench-decode-gpu --gemv_rows 1,4,8 measures it.
std::atomic<int64_t> decode_gemv_rows{4};

#ifdef ACCEL_WITH_MODELS_CUDA
// Whether the kernels may run on these tensors: built, on, every tensor on
// one CUDA device and of one supported dtype, and none that autograd records
// (the kernels have no backward: training runs the eager formulas, as
// cpu_linear.cc's kernels leave it to libtorch).
bool Applies(std::initializer_list<const at::Tensor*> tensors, cuda::KvDType* dtype) {
  if (!fused_enabled.load(std::memory_order_relaxed)) return false;
  const at::Tensor& first = **tensors.begin();
  if (!first.defined() || !first.is_cuda() || !KvDTypeOf(first.scalar_type(), dtype)) return false;
  const bool recording = c10::GradMode::is_enabled();
  for (const at::Tensor* t : tensors) {
    if (!t->defined() || t->device() != first.device() || t->scalar_type() != first.scalar_type() ||
        t->numel() == 0 || (recording && t->requires_grad())) {
      return false;
    }
  }
  return true;
}

void Check(cudaError_t status, const char* what) {
  TORCH_CHECK(status == cudaSuccess, what, " (CUDA): ", cudaGetErrorName(status), " (",
              cudaGetErrorString(status), ")");
}

// `t` as rows of its last dimension, evenly spaced: the row stride, or -1.
int64_t RowStride(const at::Tensor& t) {
  if (t.dim() < 1 || t.stride(-1) != 1) return -1;
  if (t.dim() == 1) return t.size(0);
  int64_t stride = -1, expected = -1;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (stride < 0) {
      stride = t.stride(d);
    } else if (t.stride(d) != expected) {
      return -1;
    }
    expected = t.stride(d) * t.size(d);
  }
  return stride < 0 ? t.size(-1) : stride;
}
#endif

}  // namespace

cuda::RotaryStoreParams RotaryStoreParamsFor(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& cos,
                                             const at::Tensor& sin, const at::Tensor& slot_blocks,
                                             const at::Tensor& slot_offsets,
                                             const at::Tensor& q_out, const at::Tensor& key_blocks,
                                             const at::Tensor& value_blocks) {
  cuda::RotaryStoreParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_row_stride = q.stride(1);
  p.q_head_stride = q.stride(2);
  p.k_row_stride = k.stride(1);
  p.k_head_stride = k.stride(2);
  p.v_row_stride = v.stride(1);
  p.v_head_stride = v.stride(2);
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.cos_row_stride = cos.stride(1);
  p.sin_row_stride = sin.stride(1);
  p.slot_blocks = slot_blocks.data_ptr<int64_t>();
  p.slot_offsets = slot_offsets.data_ptr<int64_t>();
  p.q_out = q_out.data_ptr();
  p.key_blocks = key_blocks.data_ptr();
  p.value_blocks = value_blocks.data_ptr();
  p.rows = static_cast<int32_t>(q.size(1));
  p.heads = static_cast<int32_t>(q.size(2));
  p.kv_heads = static_cast<int32_t>(k.size(2));
  p.dim = static_cast<int32_t>(q.size(3));
  p.value_dim = static_cast<int32_t>(v.size(3));
  p.block_size = static_cast<int32_t>(key_blocks.size(2));
  return p;
}

bool ReleaseCachedCudaMemory() {
#ifdef ACCEL_WITH_MODELS_CUDA
  c10::cuda::CUDACachingAllocator::emptyCache();
  return true;
#else
  return false;
#endif
}

bool FusedCudaOpsBuilt() {
#ifdef ACCEL_WITH_MODELS_CUDA
  return true;
#else
  return false;
#endif
}

void SetFusedCudaOps(bool enabled) { fused_enabled.store(enabled); }

void SetCudaDecodeGemv(bool enabled) { decode_gemv_enabled.store(enabled); }

void SetCudaDecodeGemvRows(int64_t rows) {
  decode_gemv_rows.store(std::clamp<int64_t>(rows, 0, cuda::kDecodeGemvMaxRows));
}

bool DecodeGemvMayTake(const at::Tensor& x) {
  return FusedCudaOpsBuilt() && decode_gemv_enabled.load(std::memory_order_relaxed) &&
         x.defined() && x.is_cuda() && x.dim() >= 1 && x.size(-1) > 0 &&
         x.numel() / x.size(-1) <= decode_gemv_rows.load(std::memory_order_relaxed);
}

#ifdef ACCEL_WITH_MODELS_CUDA

namespace {

// FusedRmsNorm (residual undefined) and FusedAddRmsNorm: {the sum, undefined
// without a residual; the normed rows}.
std::optional<std::pair<at::Tensor, at::Tensor>> LaunchRmsNorm(const at::Tensor& x,
                                                               const at::Tensor& residual,
                                                               const at::Tensor& weight, double eps,
                                                               bool unit_offset) {
  cuda::KvDType dtype;
  const bool add = residual.defined();
  if (!(add ? Applies({&x, &residual, &weight}, &dtype) : Applies({&x, &weight}, &dtype)) ||
      x.dim() < 1 || !x.is_contiguous() || !weight.is_contiguous() || weight.dim() != 1 ||
      weight.size(0) != x.size(-1) ||
      (add && (!residual.is_contiguous() || residual.sizes() != x.sizes()))) {
    return std::nullopt;
  }
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor sum = add ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  cuda::RmsNormParams p;
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.out = out.data_ptr();
  p.dim = static_cast<int32_t>(x.size(-1));
  p.rows = x.numel() / x.size(-1);
  p.x_row_stride = p.out_row_stride = p.dim;
  p.eps = static_cast<float>(eps);
  p.unit_offset = unit_offset;
  if (add) {
    p.residual = residual.data_ptr();
    p.sum = sum.data_ptr();
    p.residual_row_stride = p.sum_row_stride = p.dim;
  }
  Check(cuda::RmsNorm(p, dtype, c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
        add ? "residual add and RMSNorm" : "RMSNorm");
  return std::make_pair(std::move(sum), std::move(out));
}

}  // namespace

std::optional<at::Tensor> FusedRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                       bool unit_offset) {
  std::optional<std::pair<at::Tensor, at::Tensor>> got =
      LaunchRmsNorm(x, at::Tensor(), weight, eps, unit_offset);
  if (!got) return std::nullopt;
  return std::move(got->second);
}

std::optional<std::pair<at::Tensor, at::Tensor>> FusedAddRmsNorm(const at::Tensor& x,
                                                                 const at::Tensor& residual,
                                                                 const at::Tensor& weight,
                                                                 double eps, bool unit_offset) {
  if (!residual.defined()) return std::nullopt;
  return LaunchRmsNorm(x, residual, weight, eps, unit_offset);
}

std::optional<at::Tensor> FusedRotary(const at::Tensor& x, const at::Tensor& cos,
                                      const at::Tensor& sin) {
  cuda::KvDType dtype;
  if (!Applies({&x, &cos, &sin}, &dtype) || x.dim() != 4 || cos.dim() != 3 ||
      cos.sizes() != sin.sizes() || x.size(3) % 2 != 0 || cos.size(2) != x.size(3) ||
      cos.size(1) != x.size(2) || (cos.size(0) != 1 && cos.size(0) != x.size(0)) ||
      x.stride(3) != 1 || cos.stride(2) != 1 || sin.stride(2) != 1) {
    return std::nullopt;
  }
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options());
  cuda::RotaryParams p;
  p.x = x.data_ptr();
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.out = out.data_ptr();
  p.batch = static_cast<int32_t>(x.size(0));
  p.heads = static_cast<int32_t>(x.size(1));
  p.tokens = static_cast<int32_t>(x.size(2));
  p.dim = static_cast<int32_t>(x.size(3));
  p.x_batch_stride = x.stride(0);
  p.x_head_stride = x.stride(1);
  p.x_token_stride = x.stride(2);
  // A batch of one cos / sin serves every batch row.
  p.cos_batch_stride = cos.size(0) == 1 ? 0 : cos.stride(0);
  p.sin_batch_stride = sin.size(0) == 1 ? 0 : sin.stride(0);
  p.cos_token_stride = cos.stride(1);
  p.sin_token_stride = sin.stride(1);
  Check(cuda::Rotary(p, dtype, c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
        "rotary embedding");
  return out;
}

std::optional<at::Tensor> FusedSiluMul(const at::Tensor& gate, const at::Tensor& up) {
  cuda::KvDType dtype;
  if (!Applies({&gate, &up}, &dtype) || gate.sizes() != up.sizes()) return std::nullopt;
  const int64_t gate_stride = RowStride(gate), up_stride = RowStride(up);
  if (gate_stride < gate.size(-1) || up_stride < up.size(-1)) return std::nullopt;
  c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  cuda::SiluMulParams p;
  p.gate = gate.data_ptr();
  p.up = up.data_ptr();
  p.out = out.data_ptr();
  p.dim = static_cast<int32_t>(gate.size(-1));
  p.rows = gate.numel() / gate.size(-1);
  p.gate_row_stride = gate_stride;
  p.up_row_stride = up_stride;
  Check(cuda::SiluMul(p, dtype, c10::cuda::getCurrentCUDAStream(gate.device().index()).stream()),
        "SiLU * up");
  return out;
}

std::optional<at::Tensor> FusedRotaryStore(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& cos,
                                           const at::Tensor& sin, const at::Tensor& slot_blocks,
                                           const at::Tensor& slot_offsets,
                                           const at::Tensor& key_blocks,
                                           const at::Tensor& value_blocks) {
  cuda::KvDType dtype;
  if (!Applies({&q, &k, &v, &cos, &sin, &key_blocks, &value_blocks}, &dtype) || q.dim() != 4 ||
      k.dim() != 4 || v.dim() != 4 || q.size(0) != 1 || k.size(0) != 1 || v.size(0) != 1 ||
      k.size(1) != q.size(1) || v.size(1) != q.size(1) || q.stride(3) != 1 || k.stride(3) != 1 ||
      v.stride(3) != 1 || k.size(3) != q.size(3) || q.size(3) % 2 != 0 || cos.dim() != 3 ||
      cos.sizes() != sin.sizes() || cos.size(0) != 1 || cos.size(1) != q.size(1) ||
      cos.size(2) != q.size(3) || cos.stride(2) != 1 || sin.stride(2) != 1 ||
      key_blocks.dim() != 4 || value_blocks.dim() != 4 || !key_blocks.is_contiguous() ||
      !value_blocks.is_contiguous() || key_blocks.size(1) != k.size(2) ||
      value_blocks.size(1) != v.size(2) || key_blocks.size(3) != k.size(3) ||
      value_blocks.size(3) != v.size(3) || value_blocks.size(2) != key_blocks.size(2) ||
      slot_blocks.scalar_type() != at::kLong || slot_offsets.scalar_type() != at::kLong ||
      slot_blocks.device() != q.device() || slot_offsets.device() != q.device() ||
      !slot_blocks.is_contiguous() || !slot_offsets.is_contiguous() ||
      slot_blocks.numel() != q.size(1) || slot_offsets.numel() != q.size(1)) {
    return std::nullopt;
  }
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t rows = q.size(1), heads = q.size(2), dim = q.size(3);
  at::Tensor out = at::empty({rows, heads, dim}, q.options());
  const cuda::RotaryStoreParams p = RotaryStoreParamsFor(
      q, k, v, cos, sin, slot_blocks, slot_offsets, out, key_blocks, value_blocks);
  Check(cuda::RotaryStore(p, dtype, c10::cuda::getCurrentCUDAStream(q.device().index()).stream()),
        "rotary embedding and KV write");
  return out;
}

namespace {

// FusedDecodeLinear (norm_weight undefined), FusedNormLinear and (with
// silu_mul: x's rows [gate | up]) FusedSiluMulLinear.
std::optional<std::pair<at::Tensor, at::Tensor>> LaunchDecodeGemv(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    bool unit_offset, const at::Tensor& weight, const at::Tensor& bias, bool silu_mul = false) {
  cuda::KvDType dtype;
  if (!DecodeGemvMayTake(x) || !Applies({&x, &weight}, &dtype) || weight.dim() != 2 ||
      x.size(-1) != (silu_mul ? 2 : 1) * weight.size(1) || !x.is_contiguous() ||
      !weight.is_contiguous()) {
    return std::nullopt;
  }
  const bool norm = norm_weight.defined(), add = residual.defined();
  if ((bias.defined() && (!Applies({&x, &bias}, &dtype) || !bias.is_contiguous() ||
                          bias.dim() != 1 || bias.size(0) != weight.size(0))) ||
      (norm && (!Applies({&x, &norm_weight}, &dtype) || !norm_weight.is_contiguous() ||
                norm_weight.dim() != 1 || norm_weight.size(0) != x.size(-1))) ||
      (add && (!norm || !Applies({&x, &residual}, &dtype) || !residual.is_contiguous() ||
               residual.sizes() != x.sizes()))) {
    return std::nullopt;
  }
  cuda::DecodeGemvParams p;
  p.rows = static_cast<int32_t>(x.numel() / x.size(-1));
  p.n = weight.size(0);
  p.k = static_cast<int32_t>(weight.size(1));
  p.x_row_stride = x.size(-1);
  p.silu_mul = silu_mul;
  p.out_row_stride = p.n;
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  if (norm) {
    p.norm.weight = norm_weight.data_ptr();
    p.norm.eps = static_cast<float>(eps);
    p.norm.unit_offset = unit_offset;
  }
  // Checked before anything is allocated: the outputs stand in as an
  // aligned word (as every allocation is aligned).
  alignas(16) int64_t probe[2] = {0, 0};
  p.out = probe;
  if (add) {
    p.norm.residual = residual.data_ptr();
    p.norm.sum = probe;
    p.norm.residual_row_stride = p.norm.sum_row_stride = p.k;
  }
  if (cuda::CheckDecodeGemvParams(p, dtype) != nullptr) return std::nullopt;
  c10::cuda::CUDAGuard guard(x.device());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = p.n;
  at::Tensor out = at::empty(shape, x.options());
  at::Tensor sum = add ? at::empty(x.sizes(), x.options()) : at::Tensor();
  p.out = out.data_ptr();
  if (add) p.norm.sum = sum.data_ptr();
  Check(cuda::DecodeGemv(p, dtype, c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
        norm ? "RMSNorm and decode GEMV" : "decode GEMV");
  return std::make_pair(std::move(sum), std::move(out));
}

}  // namespace

std::optional<at::Tensor> FusedDecodeLinear(const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& bias) {
  std::optional<std::pair<at::Tensor, at::Tensor>> got =
      LaunchDecodeGemv(x, at::Tensor(), at::Tensor(), 0.0, false, weight, bias);
  if (!got) return std::nullopt;
  return std::move(got->second);
}

std::optional<std::pair<at::Tensor, at::Tensor>> FusedNormLinear(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    bool unit_offset, const at::Tensor& weight, const at::Tensor& bias) {
  if (!norm_weight.defined()) return std::nullopt;
  return LaunchDecodeGemv(x, residual, norm_weight, eps, unit_offset, weight, bias);
}

std::optional<at::Tensor> FusedSiluMulLinear(const at::Tensor& gate_up, const at::Tensor& weight,
                                             const at::Tensor& bias) {
  std::optional<std::pair<at::Tensor, at::Tensor>> got =
      LaunchDecodeGemv(gate_up, at::Tensor(), at::Tensor(), 0.0, false, weight, bias, true);
  if (!got) return std::nullopt;
  return std::move(got->second);
}

#else  // the kernels are not in this build: the eager formulas run

std::optional<at::Tensor> FusedRmsNorm(const at::Tensor&, const at::Tensor&, double, bool) {
  return std::nullopt;
}
std::optional<std::pair<at::Tensor, at::Tensor>> FusedAddRmsNorm(const at::Tensor&,
                                                                 const at::Tensor&,
                                                                 const at::Tensor&, double, bool) {
  return std::nullopt;
}
std::optional<at::Tensor> FusedRotary(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  return std::nullopt;
}
std::optional<at::Tensor> FusedSiluMul(const at::Tensor&, const at::Tensor&) {
  return std::nullopt;
}
std::optional<at::Tensor> FusedRotaryStore(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&) {
  return std::nullopt;
}
std::optional<at::Tensor> FusedDecodeLinear(const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&) {
  return std::nullopt;
}
std::optional<std::pair<at::Tensor, at::Tensor>> FusedNormLinear(const at::Tensor&,
                                                                 const at::Tensor&,
                                                                 const at::Tensor&, double, bool,
                                                                 const at::Tensor&,
                                                                 const at::Tensor&) {
  return std::nullopt;
}
std::optional<at::Tensor> FusedSiluMulLinear(const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&) {
  return std::nullopt;
}

#endif  // ACCEL_WITH_MODELS_CUDA

}  // namespace accel::models::internal
