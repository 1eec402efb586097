// The LLM.int8 kernels (kernels.h): row-wise activation quantization with
// outlier columns, the exact int8 x int8 -> int32 product (a tiled __dp4a
// kernel: no cuBLASLt, so it builds and runs without it) and the float32
// rescale. Each follows ../shared/reference/bitsandbytes.md §3.2-3.3. Up to 8
// rows of a (decode) the product runs as a GEMV instead (internal/gemv.h).
#include "quant/cuda/internal/common.cuh"
#include "quant/cuda/internal/gemv.h"
#include "quant/cuda/kernels.h"

namespace accel::quant::cuda {
namespace internal {
namespace {

constexpr int kThreads = 256;

// 1/127^2 in float32 (0x38820610): the same float as bnb's CUDA literal
// 6.200012e-05f (not its default backend's mistyped 6.200124e-05).
constexpr float kInv16129 = 1.0f / 16129.0f;

__device__ __forceinline__ float HalfBitsToFloat(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// outlier_cols (zeroed first) gets 1 in every column holding an element
// with |x| >= threshold; several threads may store the same 1.
__global__ void __launch_bounds__(kThreads)
    OutlierColumnsKernel(const uint16_t* __restrict__ x, int64_t total, int64_t k, float threshold,
                         uint8_t* __restrict__ outlier_cols) {
  for (int64_t i = GlobalThread(); i < total; i += GridThreads()) {
    if (fabsf(HalfBitsToFloat(x[i])) >= threshold) outlier_cols[i % k] = 1;
  }
}

__device__ float BlockMax(float v) {
  __shared__ float partial[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float result = partial[0];
  for (int w = 1; w < kThreads / 32; ++w) result = fmaxf(result, partial[w]);
  return result;
}

// One block per row: the scale over the non-outlier elements, then the codes.
__global__ void __launch_bounds__(kThreads)
    RowQuantizeKernel(const uint16_t* __restrict__ x, int64_t k, float threshold,
                      const uint8_t* __restrict__ outlier_cols, int8_t* __restrict__ out,
                      float* __restrict__ row_scale) {
  const int64_t row = blockIdx.x;
  const uint16_t* xr = x + row * k;
  int8_t* outr = out + row * k;
  const bool decompose = threshold > 0.0f;

  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < k; i += kThreads) {
    const float a = fabsf(HalfBitsToFloat(xr[i]));
    if (!decompose || a < threshold) amax = fmaxf(amax, a);
  }
  amax = BlockMax(amax);
  if (threadIdx.x == 0) row_scale[row] = amax;
  // A zero scale (a row of zeros, or of outliers only) gives codes 0, not 127/0.
  const float scale = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  for (int64_t i = threadIdx.x; i < k; i += kThreads) {
    int code = 0;
    if (!decompose || outlier_cols[i] == 0) {
      code = __float2int_rn(__fmul_rn(HalfBitsToFloat(xr[i]), scale));
    }
    outr[i] = static_cast<int8_t>(code);
  }
}

// C tile 64 x 64 per block of 16 x 16 threads, each thread a 4 x 4 patch
// (rows ty + 16i, columns tx + 16j, so shared-memory reads do not conflict);
// K in steps of 64 bytes = 16 packed words. The +1 column pads rows onto
// distinct banks.
constexpr int kTile = 64;
constexpr int kTileWords = 16;
constexpr int kSide = 16;

// Four int8 of row `p` at columns kk..kk+3 as one word, zeros past K.
__device__ __forceinline__ int LoadWord(const int8_t* __restrict__ p, int64_t kk, int64_t k,
                                        bool word_loads) {
  if (word_loads && kk + 4 <= k) return __ldg(reinterpret_cast<const int*>(p + kk));
  uint32_t word = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    if (kk + b < k) word |= static_cast<uint32_t>(static_cast<uint8_t>(p[kk + b])) << (8 * b);
  }
  return static_cast<int>(word);
}

__global__ void __launch_bounds__(kSide* kSide)
    Int8MatmulKernel(const int8_t* __restrict__ a, const int8_t* __restrict__ b, int64_t m,
                     int64_t n, int64_t k, bool word_loads, int32_t* __restrict__ c) {
  __shared__ int as[kTile][kTileWords + 1];
  __shared__ int bs[kTile][kTileWords + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int tid = ty * kSide + tx;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTile;

  int acc[4][4] = {};
  for (int64_t k0 = 0; k0 < k; k0 += 4 * kTileWords) {
#pragma unroll
    for (int r = 0; r < kTile * kTileWords / (kSide * kSide); ++r) {
      const int idx = tid + r * kSide * kSide;
      const int tile_row = idx / kTileWords, word = idx % kTileWords;
      const int64_t kk = k0 + 4 * word;
      const int64_t ma = m0 + tile_row, nb = n0 + tile_row;
      as[tile_row][word] = (ma < m && kk < k) ? LoadWord(a + ma * k, kk, k, word_loads) : 0;
      bs[tile_row][word] = (nb < n && kk < k) ? LoadWord(b + nb * k, kk, k, word_loads) : 0;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kTileWords; ++w) {
      int av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[ty + kSide * i][w];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = bs[tx + kSide * j][w];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = __dp4a(av[i], bv[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t row = m0 + ty + kSide * i, col = n0 + tx + kSide * j;
      if (row < m && col < n) c[row * n + col] = acc[i][j];
    }
  }
}

// Up to kGemvMaxRows rows of a (a decode step's batch): a warp per row of b
// (a column of c), each lane reading 16-byte chunks of it (four __dp4a
// words) with kGemvAhead loads issued before any is used (a K = 4096 row is
// one round trip), its rows of a from the cache; the lanes' sums added by
// shuffles. Integer sums are exact in any order, so c is the tiled
// kernel's to the bit. That kernel spends a 64 x 64 tile on each row of a
// decode step and 64 CTAs on a 4096-column weight (half an H200's SMs): the
// weight was read far below the memory's rate (issue 37, item 3).
constexpr int kGemvWarps = 8;
constexpr int kGemvAhead = 8;
constexpr int kGemvMaxRows = 8;

__device__ __forceinline__ int Dot16(const uint4& w, const uint4& x, int acc) {
  acc = __dp4a(static_cast<int>(w.x), static_cast<int>(x.x), acc);
  acc = __dp4a(static_cast<int>(w.y), static_cast<int>(x.y), acc);
  acc = __dp4a(static_cast<int>(w.z), static_cast<int>(x.z), acc);
  return __dp4a(static_cast<int>(w.w), static_cast<int>(x.w), acc);
}

template <int kMaxRows>
__global__ void __launch_bounds__(kGemvWarps * 32)
    Int8GemvKernel(const int8_t* __restrict__ a, const int8_t* __restrict__ b, int m, int64_t n,
                   int64_t k, int32_t* __restrict__ c) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  if (col >= n) return;  // the whole warp
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t chunks = k / 16;
  const uint4* row = reinterpret_cast<const uint4*>(b + col * k);
  int acc[kMaxRows] = {};
  for (int64_t first = lane; first < chunks; first += 32 * kGemvAhead) {
    uint4 w[kGemvAhead];
#pragma unroll
    for (int u = 0; u < kGemvAhead; ++u) {
      const int64_t chunk = first + 32 * u;
      // Streaming: each weight is read once.
      w[u] = chunk < chunks ? __ldcs(row + chunk) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kGemvAhead; ++u) {
      const int64_t chunk = first + 32 * u;
      if (chunk >= chunks) break;
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r >= m) break;
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(a + r * k) + chunk);
        acc[r] = Dot16(w[u], x, acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < m) c[r * n + col] = acc[r];
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    Int8DequantKernel(const int32_t* __restrict__ c, const float* __restrict__ row_scale,
                      const float* __restrict__ col_scale, const T* __restrict__ bias, int64_t m,
                      int64_t n, T* __restrict__ out) {
  const int64_t total = m * n;
  for (int64_t i = GlobalThread(); i < total; i += GridThreads()) {
    const int64_t row = i / n, col = i % n;
    const float both = __fmul_rn(__ldg(row_scale + row), __ldg(col_scale + col));
    float v = __fmul_rn(__fmul_rn(__int2float_rn(c[i]), both), kInv16129);
    if (bias != nullptr) v = __fadd_rn(v, ToFloat(bias[col]));
    out[i] = FromFloat<T>(v);
  }
}

}  // namespace
}  // namespace internal

cudaError_t Int8RowQuantize(const uint16_t* x_f16, int64_t m, int64_t k, float threshold,
                            int8_t* out, float* row_scale, uint8_t* outlier_cols,
                            cudaStream_t stream) {
  const bool decompose = threshold > 0.0f;
  if (x_f16 == nullptr || out == nullptr || row_scale == nullptr || m < 0 || k < 0 ||
      (decompose && outlier_cols == nullptr) || m > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (outlier_cols != nullptr && k > 0) {
    const cudaError_t status = cudaMemsetAsync(outlier_cols, 0, static_cast<size_t>(k), stream);
    if (status != cudaSuccess) return status;
  }
  if (m == 0) return cudaSuccess;
  if (decompose && k > 0) {
    const int64_t total = m * k;
    internal::OutlierColumnsKernel<<<internal::GridFor(total, internal::kThreads),
                                     internal::kThreads, 0, stream>>>(x_f16, total, k, threshold,
                                                                      outlier_cols);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  internal::RowQuantizeKernel<<<static_cast<unsigned>(m), internal::kThreads, 0, stream>>>(
      x_f16, k, threshold, outlier_cols, out, row_scale);
  return cudaGetLastError();
}

namespace internal {

bool Int8GemvApplies(int64_t m, int64_t k, const void* a, const void* b) {
  return m >= 1 && m <= kGemvMaxRows && k % 16 == 0 && AlignedTo(a, 16) && AlignedTo(b, 16);
}

cudaError_t Int8Gemv(const int8_t* a, const int8_t* b, int64_t m, int64_t n, int64_t k, int32_t* c,
                     cudaStream_t stream) {
  if (a == nullptr || b == nullptr || c == nullptr || n < 0 || k < 0 ||
      !Int8GemvApplies(m, k, a, b)) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = (n + kGemvWarps - 1) / kGemvWarps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(blocks));
  auto launch = [&](auto kernel) {
    kernel<<<grid, kGemvWarps * 32, 0, stream>>>(a, b, static_cast<int>(m), n, k, c);
    return cudaGetLastError();
  };
  if (m <= 1) return launch(Int8GemvKernel<1>);
  if (m <= 2) return launch(Int8GemvKernel<2>);
  if (m <= 4) return launch(Int8GemvKernel<4>);
  return launch(Int8GemvKernel<8>);
}

cudaError_t Int8MatmulTiled(const int8_t* a, const int8_t* b, int64_t m, int64_t n, int64_t k,
                            int32_t* c, cudaStream_t stream) {
  if (a == nullptr || b == nullptr || c == nullptr || m < 0 || n < 0 || k < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t grid_x = (n + internal::kTile - 1) / internal::kTile;
  const int64_t grid_y = (m + internal::kTile - 1) / internal::kTile;
  if (grid_x > 0x7fffffff || grid_y > 65535) return cudaErrorInvalidValue;
  if (m == 0 || n == 0) return cudaSuccess;
  const bool word_loads = k % 4 == 0 && internal::AlignedTo(a, 4) && internal::AlignedTo(b, 4);
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  const dim3 block(internal::kSide, internal::kSide);
  internal::Int8MatmulKernel<<<grid, block, 0, stream>>>(a, b, m, n, k, word_loads, c);
  return cudaGetLastError();
}

}  // namespace internal

cudaError_t Int8Matmul(const int8_t* a, const int8_t* b, int64_t m, int64_t n, int64_t k,
                       int32_t* c, cudaStream_t stream) {
  if (a == nullptr || b == nullptr || c == nullptr || m < 0 || n < 0 || k < 0) {
    return cudaErrorInvalidValue;
  }
  // A decode step's rows (K in 16-byte chunks, aligned operands): the GEMV.
  if (internal::Int8GemvApplies(m, k, a, b)) return internal::Int8Gemv(a, b, m, n, k, c, stream);
  return internal::Int8MatmulTiled(a, b, m, n, k, c, stream);
}

cudaError_t Int8Dequant(const int32_t* c, const float* row_scale, const float* col_scale,
                        const void* bias, int64_t m, int64_t n, DType dtype, void* out,
                        cudaStream_t stream) {
  if (c == nullptr || row_scale == nullptr || col_scale == nullptr || out == nullptr || m < 0 ||
      n < 0 || !internal::ValidDType(dtype)) {
    return cudaErrorInvalidValue;
  }
  if (m == 0 || n == 0) return cudaSuccess;
  const unsigned grid = internal::GridFor(m * n, internal::kThreads);
  return internal::DispatchDType(dtype, [&](auto zero) {
    using T = decltype(zero);
    internal::Int8DequantKernel<T><<<grid, internal::kThreads, 0, stream>>>(
        c, row_scale, col_scale, static_cast<const T*>(bias), m, n, static_cast<T*>(out));
    return cudaGetLastError();
  });
}

}  // namespace accel::quant::cuda
