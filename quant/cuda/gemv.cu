// Gemv4bit (kernels.h): the batch-1 decode product over a 4-bit weight, the
// idea of bnb's kgemm_4bit_inference_naive: a warp per output row, each lane
// reading 16-byte chunks (32 weights) of the packed row, dequantizing them
// into the activation type and accumulating x * w in float32, then a warp
// shuffle reduction. The packed weights are read once and never written out,
// so the kernel is bound by the bytes of packed + absmax.
#include "quant/cuda/internal/common.cuh"
#include "quant/cuda/kernels.h"

namespace accel::quant::cuda {
namespace internal {
namespace {

constexpr int kWarpsPerBlock = 4;  // rows per block
constexpr int kThreads = kWarpsPerBlock * 32;
constexpr int kChunk = 32;  // weights per 16-byte load

// The weight as the activation type sees it: code * absmax in float32,
// rounded to T (what Dequantize4bit writes), back in float32 for the FMA.
template <typename T>
__device__ __forceinline__ float Weight(float code_value, float scale) {
  return ToFloat(FromFloat<T>(__fmul_rn(code_value, scale)));
}

template <typename T>
__device__ __forceinline__ float WarpSumAndBias(float acc, const T* bias, int64_t row) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (bias != nullptr) acc = __fadd_rn(acc, ToFloat(bias[row]));
  return acc;
}

// 32 consecutive activations from a 16-byte aligned x + k0, as floats.
template <typename T>
__device__ __forceinline__ void LoadX(const T* __restrict__ x, float (&out)[kChunk]) {
  constexpr int kPerVector = 16 / sizeof(T);
  const uint4* src = reinterpret_cast<const uint4*>(x);
#pragma unroll
  for (int v = 0; v < kChunk / kPerVector; ++v) {
    const uint4 raw = __ldg(src + v);
    alignas(16) T values[kPerVector];
    *reinterpret_cast<uint4*>(values) = raw;
#pragma unroll
    for (int e = 0; e < kPerVector; ++e) out[v * kPerVector + e] = ToFloat(values[e]);
  }
}

// Fast path: K % 32 == 0 and blocksize % 32 == 0, so a chunk starts at a
// 32-aligned flat index, is 16 aligned bytes of `packed` and lies in one
// block; `packed` and `x` are 16-byte aligned. A lane issues the loads of
// kUnroll chunks (weights and their absmax) before using any: a K = 4096 row
// is 4 chunks a lane, so the whole row is one round trip to memory.
constexpr int kUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    Gemv4bitChunkKernel(const T* __restrict__ x, const uint8_t* __restrict__ packed,
                        const float* __restrict__ absmax, const float* __restrict__ code,
                        int64_t n_rows, int64_t k, int64_t blocksize, const T* __restrict__ bias,
                        T* __restrict__ y) {
  __shared__ float lut[16];
  if (threadIdx.x < 16) lut[threadIdx.x] = code[threadIdx.x];
  __syncthreads();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= n_rows) return;
  const int lane = threadIdx.x % 32;

  const int64_t row_start = row * k;  // flat index of W[row, 0]
  const int64_t chunks = k / kChunk;
  const uint4* weights = reinterpret_cast<const uint4*>(packed + row_start / 2);
  float acc = 0.0f;
  for (int64_t c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    uint4 w[kUnroll];
    float scale[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + 32 * u;
      if (c < chunks) {
        // Streaming loads: the weights are read once, x and absmax stay cached.
        w[u] = __ldcs(weights + c);
        scale[u] = __ldg(absmax + (row_start + c * kChunk) / blocksize);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + 32 * u;
      if (c >= chunks) break;
      float xs[kChunk];
      LoadX(x + c * kChunk, xs);
      const uint32_t words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          // Byte 4i+b of the chunk holds elements 2(4i+b) (high nibble) and the next one.
          const uint32_t byte = (words[i] >> (8 * b)) & 0xFF;
          const int e = 2 * (4 * i + b);
          acc = __fmaf_rn(xs[e], Weight<T>(lut[byte >> 4], scale[u]), acc);
          acc = __fmaf_rn(xs[e + 1], Weight<T>(lut[byte & 0xF], scale[u]), acc);
        }
      }
    }
  }
  acc = WarpSumAndBias(acc, bias, row);
  if (lane == 0) y[row] = FromFloat<T>(acc);
}

// Any K, blocksize and alignment: lane-strided elements, each finding its
// nibble and block from the flat index (blocks may cross rows, rows may
// start at a low nibble when K is odd).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    Gemv4bitElementKernel(const T* __restrict__ x, const uint8_t* __restrict__ packed,
                          const float* __restrict__ absmax, const float* __restrict__ code,
                          int64_t n_rows, int64_t k, int64_t blocksize, const T* __restrict__ bias,
                          T* __restrict__ y) {
  __shared__ float lut[16];
  if (threadIdx.x < 16) lut[threadIdx.x] = code[threadIdx.x];
  __syncthreads();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= n_rows) return;
  const int lane = threadIdx.x % 32;

  const int64_t row_start = row * k;
  float acc = 0.0f;
  for (int64_t i = lane; i < k; i += 32) {
    const int64_t j = row_start + i;
    const uint32_t byte = __ldg(packed + j / 2);
    const uint32_t nibble = (j % 2 == 0) ? (byte >> 4) : (byte & 0xF);
    const float scale = __ldg(absmax + j / blocksize);
    acc = __fmaf_rn(ToFloat(x[i]), Weight<T>(lut[nibble], scale), acc);
  }
  acc = WarpSumAndBias(acc, bias, row);
  if (lane == 0) y[row] = FromFloat<T>(acc);
}

}  // namespace
}  // namespace internal

cudaError_t Gemv4bit(const void* x, const uint8_t* packed, const float* absmax, const float* code,
                     int64_t n_rows, int64_t k, int64_t blocksize, const void* bias, DType dtype,
                     void* y, cudaStream_t stream) {
  if (x == nullptr || packed == nullptr || absmax == nullptr || code == nullptr || y == nullptr ||
      n_rows < 0 || k < 0 || blocksize < 1 || !internal::ValidDType(dtype)) {
    return cudaErrorInvalidValue;
  }
  if (n_rows == 0) return cudaSuccess;
  // One warp per row; a grid of more than 2^31-1 blocks is out of reach of
  // any weight that fits in memory.
  const int64_t blocks = (n_rows + internal::kWarpsPerBlock - 1) / internal::kWarpsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const bool chunked = k % internal::kChunk == 0 && blocksize % internal::kChunk == 0 &&
                       internal::AlignedTo(packed, 16) && internal::AlignedTo(x, 16);
  return internal::DispatchDType(dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* xt = static_cast<const T*>(x);
    const T* bt = static_cast<const T*>(bias);
    T* yt = static_cast<T*>(y);
    const dim3 grid(static_cast<unsigned>(blocks));
    if (chunked) {
      internal::Gemv4bitChunkKernel<T><<<grid, internal::kThreads, 0, stream>>>(
          xt, packed, absmax, code, n_rows, k, blocksize, bt, yt);
    } else {
      internal::Gemv4bitElementKernel<T><<<grid, internal::kThreads, 0, stream>>>(
          xt, packed, absmax, code, n_rows, k, blocksize, bt, yt);
    }
    return cudaGetLastError();
  });
}

}  // namespace accel::quant::cuda
