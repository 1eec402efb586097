// quant/cuda/kernels.h: the CUDA kernels of the bitsandbytes formats (see
// quant/bnb.h and ../shared/reference/bitsandbytes.md), over raw device
// pointers and a stream, so they build with nvcc alone (no CUDA libtorch) and
// any caller can wrap them (quant/cuda_matmul.h does, over at::Tensor, for
// the quantized layers of accel::nn on a CUDA device). Every function checks
// its arguments first and returns cudaErrorInvalidValue for a null pointer, a
// negative size or a bad blocksize without touching the device; otherwise it
// enqueues its kernels on `stream` and returns the launch status
// (cudaGetLastError), so errors of the kernel itself surface at the next
// synchronizing call.
//
// Numerics are strict IEEE float32 (no --use_fast_math): dequantization and
// the int8 rescale are bit-exact with a plain CPU loop doing the same float32
// operations in the same order; the GEMV accumulates in float32 in its own
// order (within the float32 summation bound of such a loop; on the tensor
// cores, in theirs).
#ifndef ACCEL_QUANT_CUDA_KERNELS_H_
#define ACCEL_QUANT_CUDA_KERNELS_H_

#include <cstdint>
#include <cuda_runtime_api.h>

namespace accel::quant::cuda {

// Element types of activations and outputs. bfloat16 and float16 are their
// IEEE-style 16-bit patterns (at::BFloat16 / at::Half / __nv_bfloat16 /
// __half all have this layout); conversions from float32 round to nearest
// even.
enum class DType { kFloat32, kBFloat16, kFloat16 };
int DTypeSize(DType dtype);
const char* DTypeName(DType dtype);

// bnb's dequantize_4bit (reference §1.3-1.4): for j in [0, n),
//   nibble = (j even) ? packed[j/2] >> 4 : packed[j/2] & 0xF
//   out[j] = cast<out_dtype>(code[nibble] * absmax[j / blocksize])   (float32 multiply, RNE)
// `packed` holds (n+1)/2 bytes, `absmax` ceil(n/blocksize) floats, `code`
// the 16 floats of the table (NF4 / FP4 / the checkpoint's quant_map), all on
// the device. Any n >= 0 and blocksize >= 1 (a partial last block, odd n).
cudaError_t Dequantize4bit(const uint8_t* packed, const float* absmax, const float* code, int64_t n,
                           int64_t blocksize, DType out_dtype, void* out, cudaStream_t stream);

// The double-quant absmax (reference §2.2), bnb's nested blocksize 256:
//   out[b] = (nested_map[absmax_u8[b]] * nested_absmax[b / 256]) + offset
// both float32 operations rounded in that order (no fused multiply-add).
inline constexpr int64_t kNestedBlocksize = 256;
cudaError_t DequantizeAbsmaxDq(const uint8_t* absmax_u8, const float* nested_absmax,
                               const float* nested_map, float offset, int64_t nblocks, float* out,
                               cudaStream_t stream);

// The batch-1 decode product y = W x + bias for a 4-bit W [N, K] stored as
// Dequantize4bit stores it (flat row-major, n = N*K). x [K], bias [N] (or
// null) and y [N] are `dtype`. Each weight is dequantized exactly as
// Dequantize4bit does into `dtype` (code * absmax in float32, rounded), then
// multiplied by x and summed in float32; bias is added in float32 and the sum
// rounded to `dtype`: the numerics of quant::Linear4bitForward.
// With bfloat16 / float16 activations, K a multiple of 256, blocksize a
// multiple of 64 and `packed` and `x` 16-byte aligned (bnb's layout and
// cudaMalloc's pointers), the tensor-core kernel runs: products exact in
// float32, added by the tensor cores' float32 accumulation in their order.
// Where the blocksize is also a power of two (bitsandbytes' are), it runs in
// its scaled form unless $ACCEL_CUDA_4BIT_GEMV=exact: the weight of nibble c
// is code[c] rounded to `dtype`, each block's float32 sum multiplied by its
// absmax (a fused multiply-add into the row's sum), so a weight differs from
// Dequantize4bit's by at most a rounding of `dtype` on each side (2^-8 of it
// in bfloat16; bitsandbytes' own batch-1 kernel rounds code, absmax and each
// product to `dtype`), for reading at HBM's rate instead of the integer
// pipe's (quant/cuda/internal/gemv_mma.h says why).
// Every other case (float32 activations, any K and blocksize, blocks
// crossing rows included) takes a warp-per-row kernel with the same
// numerics and float32 FMAs (16-byte chunks where K % 32 == 0, blocksize %
// 32 == 0 and the pointers are aligned; per element, several times slower,
// otherwise).
cudaError_t Gemv4bit(const void* x, const uint8_t* packed, const float* absmax, const float* code,
                     int64_t n_rows, int64_t k, int64_t blocksize, const void* bias, DType dtype,
                     void* y, cudaStream_t stream);

// The same for m activation rows at once (1 <= m <= 32, decode steps of a
// batch): x [m, K] and y [m, N] row-major, `dtype`. Where
// Gemv4bitRowsFused() says so (the tensor-core kernel's conditions above,
// or m == 1) the weights are read once for all rows (above 8 rows by the
// tensor-core kernel's tiled form: each weight's fragment multiplied with
// up to four tiles of 8 rows); otherwise each row of x is a Gemv4bit call,
// reading them m times (callers then prefer Dequantize4bit and a GEMM).
cudaError_t Gemv4bitRows(const void* x, int64_t m, const uint8_t* packed, const float* absmax,
                         const float* code, int64_t n_rows, int64_t k, int64_t blocksize,
                         const void* bias, DType dtype, void* y, cudaStream_t stream);
bool Gemv4bitRowsFused(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                       const void* packed);

// The same product for up to 32 rows of x through the tensor-core kernel's
// wide form: a CTA takes 128 rows of W (Gemv4bitRows' forms take 16), so
// each chunk of x is read once for 128 rows of W instead of 16 (at 32 rows
// of x, the L2 cache's traffic of an 8B model's step: about 3.4 GB against
// 27). Where W has too few rows to fill the device, K is split over CTAs as
// well, their float32 sums [splits, m, n_rows] written to `workspace`, then
// added in split order, with the bias, and rounded once. Takes what the
// tiled form takes (Gemm4bitRowsWideTakes); `workspace` holds at least
// Gemm4bitRowsWideWorkspace(m, n_rows, k) bytes (4-byte aligned device
// memory; null where that is 0), which depends on the current device.
int64_t Gemm4bitRowsWideWorkspace(int64_t m, int64_t n_rows, int64_t k);
bool Gemm4bitRowsWideTakes(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                           const void* packed);
cudaError_t Gemm4bitRowsWide(const void* x, int64_t m, const uint8_t* packed, const float* absmax,
                             const float* code, int64_t n_rows, int64_t k, int64_t blocksize,
                             const void* bias, DType dtype, void* y, float* workspace,
                             int64_t workspace_bytes, cudaStream_t stream);

// A mixture of experts' routed rows, the routing left on the device (no
// host waits for it): for slot s in [0, slots),
//   e = expert_ids[s]                     (int64, device memory)
//   y[s] = W_e x[s / slots_per_x]          (no bias)
// where expert e's weight [n_rows, k] is packed[e], absmax[e] (float32) and
// code[e] (device arrays of `experts` device pointers; every expert one
// shape and blocksize). x [slots / slots_per_x rounded up, k] and y [slots,
// n_rows] are `dtype`, row-major. Each slot's row is what Gemv4bit gives for
// that expert and row, bit for bit (the same CTA code for one row: the
// scaled form where Gemv4bit runs it, else the first form). A slot whose
// index lies outside [0, experts) gets a row of zeros. Takes what
// Gemv4bitExpertsTakes says for x and for every expert's packed pointer
// (the tensor-core kernel's conditions: 16-bit activations, K a multiple of
// 256, blocksize a multiple of 64, 16-byte alignment); cudaErrorInvalidValue
// otherwise.
bool Gemv4bitExpertsTakes(int64_t k, int64_t blocksize, DType dtype, const void* x,
                          const void* packed);
cudaError_t Gemv4bitExperts(const void* x, int64_t slots_per_x, const int64_t* expert_ids,
                            int64_t slots, const uint8_t* const* packed, const float* const* absmax,
                            const float* const* code, int64_t experts, int64_t n_rows, int64_t k,
                            int64_t blocksize, DType dtype, void* y, cudaStream_t stream);

// LLM.int8 activation quantization per row (reference §3.2) of x [M, K]
// float16 (bit patterns). With threshold > 0: outlier_cols[k] = 1 where any
// |x[m, k]| >= threshold, else 0; row_scale[m] = max |x[m, k]| over the
// elements below the threshold (all elements when threshold <= 0); then
//   out[m, k] = outlier_cols[k] ? 0 : round_half_even(x[m, k] * (127 / row_scale[m]))
// with 127 / row_scale a float32 division and the product in float32. A row
// whose scale is 0 gets codes 0. outlier_cols [K] may be null only when
// threshold <= 0 (it is then zeroed if given).
cudaError_t Int8RowQuantize(const uint16_t* x_f16, int64_t m, int64_t k, float threshold,
                            int8_t* out, float* row_scale, uint8_t* outlier_cols,
                            cudaStream_t stream);

// c [M, N] = a [M, K] . b [N, K]^T in int32 (both operands row-major with K
// contiguous, as bnb's CA and CB are), exact while no sum leaves the int32
// range (always for K <= 131071); otherwise it wraps as int32 arithmetic
// does. Any K (K % 4 != 0 included) and any pointer alignment.
cudaError_t Int8Matmul(const int8_t* a, const int8_t* b, int64_t m, int64_t n, int64_t k,
                       int32_t* c, cudaStream_t stream);

// bnb's int8_mm_dequant in float32:
//   out[m, n] = cast<dtype>(float(c[m, n]) * (row_scale[m] * col_scale[n]) * (1/16129) + bias[n])
// each operation a float32 rounding in that order (1/16129 is the float32
// constant 1.0f / 16129.0f); bias is `dtype` [N] or null. bnb's CUDA kernel
// writes float16 first; we round once, into `dtype`.
cudaError_t Int8Dequant(const int32_t* c, const float* row_scale, const float* col_scale,
                        const void* bias, int64_t m, int64_t n, DType dtype, void* out,
                        cudaStream_t stream);

}  // namespace accel::quant::cuda

#endif  // ACCEL_QUANT_CUDA_KERNELS_H_
