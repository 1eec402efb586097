// Dequantize4bit and DequantizeAbsmaxDq (kernels.h): one float32 multiply
// (and, for the nested absmax, one add) per element, rounded to the output
// type; memory-bound, so each thread moves 8 elements with vector stores
// where the pointers allow.
#include "quant/cuda/internal/common.cuh"
#include "quant/cuda/kernels.h"

namespace accel::quant::cuda {

int DTypeSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "unknown";
}

namespace internal {
namespace {

constexpr int kThreads = 256;
constexpr int kValuesPerThread = 8;  // 4 packed bytes

// Writes 8 values of T at `out` (16-byte aligned) with 16-byte stores.
template <typename T>
__device__ __forceinline__ void Store8(T* out, const T (&values)[kValuesPerThread]) {
  constexpr int kStores = kValuesPerThread * sizeof(T) / 16;
  const uint4* src = reinterpret_cast<const uint4*>(values);
#pragma unroll
  for (int s = 0; s < kStores; ++s) reinterpret_cast<uint4*>(out)[s] = src[s];
}

// `vector_ok`: packed is 4-byte aligned and out 16-byte aligned, so a thread
// whose 8 values are all in range loads one word and stores 16-byte vectors;
// others (the tail, or misaligned pointers) go element by element.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    Dequantize4bitKernel(const uint8_t* __restrict__ packed, const float* __restrict__ absmax,
                         const float* __restrict__ code, int64_t n, int64_t blocksize,
                         bool vector_ok, T* __restrict__ out) {
  __shared__ float lut[16];
  if (threadIdx.x < 16) lut[threadIdx.x] = code[threadIdx.x];
  __syncthreads();

  const int64_t chunks = (n + kValuesPerThread - 1) / kValuesPerThread;
  for (int64_t c = GlobalThread(); c < chunks; c += GridThreads()) {
    const int64_t j0 = c * kValuesPerThread;
    // The block of j0 and where the next one starts: later elements of the
    // chunk step forward without another 64-bit division.
    int64_t block = j0 / blocksize;
    int64_t next_block_start = (block + 1) * blocksize;
    float scale = __ldg(absmax + block);
    if (vector_ok && j0 + kValuesPerThread <= n) {
      const uint32_t word = __ldg(reinterpret_cast<const uint32_t*>(packed) + c);
      alignas(16) T values[kValuesPerThread];
#pragma unroll
      for (int e = 0; e < kValuesPerThread; ++e) {
        const int64_t j = j0 + e;
        while (j >= next_block_start) {
          ++block;
          next_block_start += blocksize;
          scale = __ldg(absmax + block);
        }
        // Byte e/2 of the word is packed[j/2] (little-endian); even j is its high nibble.
        const uint32_t byte = (word >> (8 * (e / 2))) & 0xFF;
        const uint32_t nibble = (e % 2 == 0) ? (byte >> 4) : (byte & 0xF);
        values[e] = FromFloat<T>(__fmul_rn(lut[nibble], scale));
      }
      Store8(out + j0, values);
    } else {
      for (int64_t j = j0; j < j0 + kValuesPerThread && j < n; ++j) {
        while (j >= next_block_start) {
          ++block;
          next_block_start += blocksize;
          scale = __ldg(absmax + block);
        }
        const uint32_t byte = __ldg(packed + j / 2);
        const uint32_t nibble = (j % 2 == 0) ? (byte >> 4) : (byte & 0xF);
        out[j] = FromFloat<T>(__fmul_rn(lut[nibble], scale));
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    DequantizeAbsmaxDqKernel(const uint8_t* __restrict__ absmax_u8,
                             const float* __restrict__ nested_absmax,
                             const float* __restrict__ nested_map, float offset, int64_t nblocks,
                             float* __restrict__ out) {
  for (int64_t b = GlobalThread(); b < nblocks; b += GridThreads()) {
    const float scaled =
        __fmul_rn(__ldg(nested_map + absmax_u8[b]), __ldg(nested_absmax + b / kNestedBlocksize));
    out[b] = __fadd_rn(scaled, offset);
  }
}

}  // namespace
}  // namespace internal

cudaError_t Dequantize4bit(const uint8_t* packed, const float* absmax, const float* code, int64_t n,
                           int64_t blocksize, DType out_dtype, void* out, cudaStream_t stream) {
  if (packed == nullptr || absmax == nullptr || code == nullptr || out == nullptr || n < 0 ||
      blocksize < 1 || !internal::ValidDType(out_dtype)) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  const bool vector_ok = internal::AlignedTo(packed, 4) && internal::AlignedTo(out, 16);
  const int64_t chunks = (n + internal::kValuesPerThread - 1) / internal::kValuesPerThread;
  const unsigned grid = internal::GridFor(chunks, internal::kThreads);
  return internal::DispatchDType(out_dtype, [&](auto zero) {
    using T = decltype(zero);
    internal::Dequantize4bitKernel<T><<<grid, internal::kThreads, 0, stream>>>(
        packed, absmax, code, n, blocksize, vector_ok, static_cast<T*>(out));
    return cudaGetLastError();
  });
}

cudaError_t DequantizeAbsmaxDq(const uint8_t* absmax_u8, const float* nested_absmax,
                               const float* nested_map, float offset, int64_t nblocks, float* out,
                               cudaStream_t stream) {
  if (absmax_u8 == nullptr || nested_absmax == nullptr || nested_map == nullptr || out == nullptr ||
      nblocks < 0) {
    return cudaErrorInvalidValue;
  }
  if (nblocks == 0) return cudaSuccess;
  internal::DequantizeAbsmaxDqKernel<<<internal::GridFor(nblocks, internal::kThreads),
                                       internal::kThreads, 0, stream>>>(
      absmax_u8, nested_absmax, nested_map, offset, nblocks, out);
  return cudaGetLastError();
}

}  // namespace accel::quant::cuda
