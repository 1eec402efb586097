// models/internal/fused_ops.h: at::Tensor wrappers of models/cuda/fused_ops.h's
// kernels (RMSNorm, the rotary embedding, SiLU(gate) * up as one launch each),
// for nn::RMSNorm, nn::ApplyRotary and the gated MLPs on a CUDA device. Each
// returns nullopt where the kernels do not apply (a cpu tensor, a build
// without them, dtypes that differ, a layout they do not take, or
// SetFusedCudaOps(false)), and the caller runs the eager formulas, which the
// kernels equal (models/cuda/fused_ops.h says to which bits).
#ifndef ACCEL_MODELS_INTERNAL_FUSED_OPS_H_
#define ACCEL_MODELS_INTERNAL_FUSED_OPS_H_

#include <optional>
#include <utility>

#include <ATen/core/Tensor.h>

#include "models/cuda/fused_ops.h"

namespace accel::models::internal {

// x [..., dim] contiguous; weight [dim] of x's dtype.
std::optional<at::Tensor> FusedRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                       bool unit_offset);
// RMSNorm of x + residual (both [..., dim] contiguous, one shape and dtype)
// and that sum, as {sum, normed}: the residual add and the next norm in one
// launch (vLLM's fused_add_rms_norm), each bit for bit the eager add and
// FusedRmsNorm of it.
std::optional<std::pair<at::Tensor, at::Tensor>> FusedAddRmsNorm(const at::Tensor& x,
                                                                 const at::Tensor& residual,
                                                                 const at::Tensor& weight,
                                                                 double eps, bool unit_offset);
// x [batch, heads, tokens, dim] (any strides, the last dimension
// contiguous); cos and sin [batch or 1, tokens, dim] of x's dtype. The
// result is contiguous.
std::optional<at::Tensor> FusedRotary(const at::Tensor& x, const at::Tensor& cos,
                                      const at::Tensor& sin);
// gate and up of one shape [..., dim], rows of each evenly spaced (a narrow
// of a fused gate_up projection qualifies). The result is contiguous.
std::optional<at::Tensor> FusedSiluMul(const at::Tensor& gate, const at::Tensor& up);

// A static decode step's rotary embedding and KV write as one kernel
// (cuda::RotaryStoreParams): q, k and v [1, rows, heads | kv_heads, d] (any
// strides, the last dimension contiguous), cos and sin [1, rows, d] (the
// whole head rotates), slot_blocks and slot_offsets [rows] int64 on the
// device, the layer's key and value blocks contiguous [blocks, kv_heads,
// block_size, d]. Writes the rotated k and v at each row's slot and returns
// the rotated q as [rows, heads, d], contiguous; nullopt (nothing written)
// where it does not apply.
std::optional<at::Tensor> FusedRotaryStore(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& cos,
                                           const at::Tensor& sin, const at::Tensor& slot_blocks,
                                           const at::Tensor& slot_offsets,
                                           const at::Tensor& key_blocks,
                                           const at::Tensor& value_blocks);

// A decode step's linear layer as one kernel (cuda::DecodeGemv): x
// [..., k] contiguous with at most SetCudaDecodeGemvRows rows, weight
// [n, k] contiguous, bias [n] or undefined, all of one dtype on one device;
// y [..., n]. nullopt where it does not apply (and with
// SetCudaDecodeGemv(false)): the caller runs the product as before.
std::optional<at::Tensor> FusedDecodeLinear(const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& bias);
// Whether those kernels may take x at all (built, on, a CUDA tensor of at
// most SetCudaDecodeGemvRows rows): a cheap test before a caller prepares
// the other operands.
bool DecodeGemvMayTake(const at::Tensor& x);
// The norm before that product in the same kernel: {the sum x + residual
// (undefined without a residual), y = RMSNorm(that) W^T (+ bias)}, the sum
// bit for bit FusedAddRmsNorm's and y FusedDecodeLinear's of its norm.
// norm_weight [k]; residual undefined or shaped as x.
std::optional<std::pair<at::Tensor, at::Tensor>> FusedNormLinear(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    bool unit_offset, const at::Tensor& weight, const at::Tensor& bias);
// SiLU(gate) * up of gate_up's rows ([..., 2k]: gate | up, contiguous, as
// SiluMul computes it) and the linear layer of it in one kernel: a gated
// MLP's down projection with its activation inside; y [..., n], bit for bit
// FusedDecodeLinear of FusedSiluMul's output.
std::optional<at::Tensor> FusedSiluMulLinear(const at::Tensor& gate_up, const at::Tensor& weight,
                                             const at::Tensor& bias);
// A process-wide switch for the three above (on by default), for measuring
// cuBLAS and the separate norm against them (accel-bench-decode-gpu
// --compare_decode_gemv).
void SetCudaDecodeGemv(bool enabled);
// The most rows of x they take (4 by default, at most
// cuda::kDecodeGemvMaxRows; more go to cuBLAS and the separate kernels).
void SetCudaDecodeGemvRows(int64_t rows);

// The kernel's parameters for those tensors (FusedRotaryStore's layout:
// q_out [rows, heads, d]); no checks, no launch: what FusedRotaryStore passes,
// and what the host emulation test runs the kernel's code on.
cuda::RotaryStoreParams RotaryStoreParamsFor(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& cos,
                                             const at::Tensor& sin, const at::Tensor& slot_blocks,
                                             const at::Tensor& slot_offsets,
                                             const at::Tensor& q_out, const at::Tensor& key_blocks,
                                             const at::Tensor& value_blocks);

// Gives the CUDA caching allocator's unused blocks back to the driver
// (emptyCache): after weights were replaced at load time (packed
// projections), so that their old blocks neither stay counted as in use by
// --gpu_memory_utilization's probe nor keep memory a later allocation of
// another size needs. False (nothing done) in a build without the kernels.
bool ReleaseCachedCudaMemory();

// Whether this build has the kernels (models/cuda/ built and libtorch a CUDA
// build), and a process-wide switch (on by default) for measuring without
// them (accel-bench-decode-gpu --compare_unfused).
bool FusedCudaOpsBuilt();
void SetFusedCudaOps(bool enabled);

}  // namespace accel::models::internal

#endif  // ACCEL_MODELS_INTERNAL_FUSED_OPS_H_
