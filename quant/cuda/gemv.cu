// Gemv4bit and Gemv4bitRows (kernels.h). Two kernels:
// - the tensor-core kernel (internal/gemv_mma.h: its code is host + device
//   and emulated in tests/quant/cuda_gemv_emulation_test.cc), for 16-bit
//   activations, K a multiple of 256, blocks a multiple of 64, aligned
//   pointers, up to 8 activation rows: every weight is read once for all
//   rows, dequantized in registers through byte permutes, multiplied on
//   mma.m16n8k16 (up to 4 rows in its pipelined form: x by cp.async a round
//   ahead; 9 to 32 rows in its tiled form: each A fragment against up to
//   four B tiles read from x itself);
// - the idea of bnb's kgemm_4bit_inference_naive for everything else (one
//   activation row): a warp per output row, each lane reading 16-byte chunks
//   (32 weights) of the packed row, dequantizing them into the activation
//   type and accumulating x * w in float32, then a warp shuffle reduction;
//   any K, blocksize and alignment through its per-element variant.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "quant/cuda/internal/common.cuh"
#include "quant/cuda/internal/gemv.h"
#include "quant/cuda/internal/gemv_mma.h"
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

cudaError_t GemvOneRow(const void* x, const uint8_t* packed, const float* absmax, const float* code,
                       int64_t n_rows, int64_t k, int64_t blocksize, const void* bias, DType dtype,
                       void* y, cudaStream_t stream) {
  if (x == nullptr || packed == nullptr || absmax == nullptr || code == nullptr || y == nullptr ||
      n_rows < 0 || k < 0 || blocksize < 1 || !ValidDType(dtype)) {
    return cudaErrorInvalidValue;
  }
  if (n_rows == 0) return cudaSuccess;
  // One warp per row; a grid of more than 2^31-1 blocks is out of reach of
  // any weight that fits in memory.
  const int64_t blocks = (n_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const bool chunked =
      k % kChunk == 0 && blocksize % kChunk == 0 && AlignedTo(packed, 16) && AlignedTo(x, 16);
  return DispatchDType(dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* xt = static_cast<const T*>(x);
    const T* bt = static_cast<const T*>(bias);
    T* yt = static_cast<T*>(y);
    const dim3 grid(static_cast<unsigned>(blocks));
    if (chunked) {
      Gemv4bitChunkKernel<T>
          <<<grid, kThreads, 0, stream>>>(xt, packed, absmax, code, n_rows, k, blocksize, bt, yt);
    } else {
      Gemv4bitElementKernel<T>
          <<<grid, kThreads, 0, stream>>>(xt, packed, absmax, code, n_rows, k, blocksize, bt, yt);
    }
    return cudaGetLastError();
  });
}

namespace {

// The tensor-core kernel's Exec (gemv_mma.h).
struct MmaExec {
  __device__ __forceinline__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ void Sync() { __syncthreads(); }
  __device__ __forceinline__ void WarpSync() { __syncwarp(); }
  // cp.async (sm_80+): 8 bytes from global to shared memory, through L1
  // (x is read by every CTA), in the thread's current group.
  __device__ __forceinline__ void CopyAsync8(uint8_t* shared_dst, const void* global_src) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(global_src) : "memory");
  }
  __device__ __forceinline__ void CommitCopies() {
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  __device__ __forceinline__ void WaitCopiesButLast() {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
  }
  template <typename Tag>
  __device__ __forceinline__ void Mma(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                      uint32_t b0, uint32_t b1, float (&c)[4]) {
    if constexpr (std::is_same_v<Tag, MmaBFloat16>) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
};

template <typename Tag, int kMaxM>
__global__ void __launch_bounds__(kMmaThreads) Gemv4bitMmaKernel(const GemvMmaParams p) {
  extern __shared__ __align__(16) uint8_t shared[];
  MmaExec exec;
  Gemv4bitMmaCta<Tag, kMaxM>(p, static_cast<int64_t>(blockIdx.x), shared, exec);
}

// Three CTAs an SM (80 registers a thread, ptxas spilling 32 bytes of the
// next round's words; 96 without the bound, two CTAs an SM as the other
// kernel's 108): 24 warps an SM to hide the loads' latency behind.
template <typename Tag, int kMaxM>
__global__ void __launch_bounds__(kMmaThreads, 3)
    Gemv4bitMmaPipelinedKernel(const GemvMmaParams p) {
  extern __shared__ __align__(16) uint8_t shared[];
  MmaExec exec;
  Gemv4bitMmaPipelinedCta<Tag, kMaxM>(p, static_cast<int64_t>(blockIdx.x), shared, exec);
}

// Registers: up to 16 accumulators more than the first form a thread (four
// B tiles); two CTAs an SM.
template <typename Tag, int kTiles>
__global__ void __launch_bounds__(kMmaThreads, 2) Gemm4bitMmaTiledKernel(const GemvMmaParams p) {
  extern __shared__ __align__(16) uint8_t shared[];
  MmaExec exec;
  Gemm4bitMmaTiledCta<Tag, kTiles>(p, static_cast<int64_t>(blockIdx.x), shared, exec);
}

// The scaled form (gemv_mma.h): a grid of what the device holds at once at
// most, each CTA building its table once and taking tiles until done. Two
// CTAs an SM at 128 registers a thread (the table and sums are 36 KiB);
// kMinCtas 3 (GemvKernel::kMmaScaled3, by name: whether 24 warps an SM hide
// more of the loads' latency than 16) has ptxas fit 80 registers, spilling
// 84 bytes of a thread to local memory.
template <typename Tag, int kMinCtas>
__global__ void __launch_bounds__(kMmaThreads, kMinCtas)
    Gemv4bitScaledKernel(const GemvMmaParams p) {
  extern __shared__ __align__(16) uint8_t shared[];
  MmaExec exec;
  Gemv4bitScaledCta<Tag>(p, static_cast<int64_t>(blockIdx.x), static_cast<int64_t>(gridDim.x),
                         shared, exec);
}

// CTAs of `kernel` the current device holds at once (its SMs times the
// occupancy at `shared` bytes), asked once a device and kernel.
int64_t ResidentCtas(const void* kernel, size_t shared) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int64_t> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, kernel);
  if (auto it = known.find(key); it != known.end()) return it->second;
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kMmaThreads, shared) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return 0;  // ScaledCtas: a CTA a tile
  }
  return known[key] = static_cast<int64_t>(sms) * per_sm;
}

template <typename Tag, int kMinCtas>
cudaError_t LaunchScaled(const GemvMmaParams& p, cudaStream_t stream) {
  const auto kernel = Gemv4bitScaledKernel<Tag, kMinCtas>;
  const size_t shared = static_cast<size_t>(ScaledSharedBytes());
  const int64_t ctas =
      ScaledCtas(p.n_rows, ResidentCtas(reinterpret_cast<const void*>(kernel), shared));
  if (ctas > 0x7fffffff || p.m < 1 || p.m > kMmaMaxM) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned>(ctas), kMmaThreads, shared, stream>>>(p);
  return cudaGetLastError();
}

// A mixture of experts' routed rows (Gemv4bitExperts): grid.y is the slot,
// each CTA the one-row kernel's over its expert's weight.
template <typename Tag>
__global__ void __launch_bounds__(kMmaThreads)
    Gemv4bitExpertsMmaKernel(const GemvMmaParams p, const ExpertRows rows) {
  extern __shared__ __align__(16) uint8_t shared[];
  MmaExec exec;
  Gemv4bitExpertsMmaCta<Tag>(p, rows, static_cast<int64_t>(blockIdx.y),
                             static_cast<int64_t>(blockIdx.x), shared, exec);
}

template <typename Tag>
__global__ void __launch_bounds__(kMmaThreads, 2)
    Gemv4bitExpertsScaledKernel(const GemvMmaParams p, const ExpertRows rows) {
  extern __shared__ __align__(16) uint8_t shared[];
  MmaExec exec;
  Gemv4bitExpertsScaledCta<Tag>(p, rows, static_cast<int64_t>(blockIdx.y),
                                static_cast<int64_t>(blockIdx.x), static_cast<int64_t>(gridDim.x),
                                shared, exec);
}

// The scaled form: the CTAs the device holds at once shared among the slots
// (a slot's tiles split over fewer CTAs where there are many slots; which
// CTA takes a tile changes no bit of it).
template <typename Tag>
cudaError_t LaunchExperts(const GemvMmaParams& p, const ExpertRows& rows, int64_t slots,
                          bool scaled, cudaStream_t stream) {
  if (slots > 65535) return cudaErrorInvalidValue;
  if (scaled) {
    const auto kernel = Gemv4bitExpertsScaledKernel<Tag>;
    const size_t shared = static_cast<size_t>(ScaledSharedBytes());
    const int64_t resident = ResidentCtas(reinterpret_cast<const void*>(kernel), shared);
    const int64_t ctas =
        ScaledCtas(p.n_rows, resident > 0 ? std::max<int64_t>(1, resident / slots) : int64_t{0});
    if (ctas > 0x7fffffff) return cudaErrorInvalidValue;
    kernel<<<dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(slots)), kMmaThreads, shared,
             stream>>>(p, rows);
    return cudaGetLastError();
  }
  const int64_t tiles = (p.n_rows + kMmaRows - 1) / kMmaRows;
  if (tiles > 0x7fffffff) return cudaErrorInvalidValue;
  Gemv4bitExpertsMmaKernel<Tag>
      <<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(slots)), kMmaThreads,
         static_cast<size_t>(MmaSharedBytes(1)), stream>>>(p, rows);
  return cudaGetLastError();
}

// The tiled kernel, for up to kMmaTiledMaxM rows: ceil(m / 8) B tiles.
template <typename Tag>
cudaError_t LaunchMmaTiled(const GemvMmaParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.n_rows + kMmaRows - 1) / kMmaRows;
  if (blocks > 0x7fffffff || p.m < 1 || p.m > kMmaTiledMaxM) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  auto launch = [&](auto kernel, int tiles) {
    kernel<<<grid, kMmaThreads, static_cast<size_t>(MmaTiledSharedBytes(tiles)), stream>>>(p);
    return cudaGetLastError();
  };
  switch ((p.m + 7) / 8) {
    case 1:
      return launch(Gemm4bitMmaTiledKernel<Tag, 1>, 1);
    case 2:
      return launch(Gemm4bitMmaTiledKernel<Tag, 2>, 2);
    case 3:
      return launch(Gemm4bitMmaTiledKernel<Tag, 3>, 3);
    default:
      return launch(Gemm4bitMmaTiledKernel<Tag, 4>, 4);
  }
}

template <typename Tag, int kTiles>
__global__ void __launch_bounds__(kMmaThreads, 2) Gemm4bitMmaWideKernel(const GemvMmaParams p) {
  extern __shared__ __align__(16) uint8_t shared[];
  MmaExec exec;
  Gemm4bitMmaWideCta<Tag, kTiles>(p, static_cast<int64_t>(blockIdx.x),
                                  static_cast<int32_t>(blockIdx.y), shared, exec);
}

template <typename Tag>
__global__ void __launch_bounds__(256) ReduceWideSplitsKernel(const GemvMmaParams p) {
  ReduceWideSplits<Tag>(p, static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x);
}

// The wide kernel (p.splits and p.workspace set), then its reduce where K
// was split.
template <typename Tag>
cudaError_t LaunchMmaWide(const GemvMmaParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.n_rows + kWideRows - 1) / kWideRows;
  const int64_t outputs = static_cast<int64_t>(p.m) * p.n_rows;
  if (blocks > 0x7fffffff || p.m < 1 || p.m > kWideMaxM || p.splits < 1 || p.splits > 65535 ||
      (p.splits > 1 && p.workspace == nullptr) || (outputs + 255) / 256 > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(p.splits));
  auto launch = [&](auto kernel, int tiles) {
    kernel<<<grid, kMmaThreads, static_cast<size_t>(WideSharedBytes(tiles)), stream>>>(p);
    return cudaGetLastError();
  };
  cudaError_t status;
  switch ((p.m + 7) / 8) {
    case 1:
      status = launch(Gemm4bitMmaWideKernel<Tag, 1>, 1);
      break;
    case 2:
      status = launch(Gemm4bitMmaWideKernel<Tag, 2>, 2);
      break;
    case 3:
      status = launch(Gemm4bitMmaWideKernel<Tag, 3>, 3);
      break;
    default:
      status = launch(Gemm4bitMmaWideKernel<Tag, 4>, 4);
  }
  if (status != cudaSuccess || p.splits == 1) return status;
  ReduceWideSplitsKernel<Tag><<<static_cast<unsigned>((outputs + 255) / 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

// The parameters every form of the tensor-core kernel reads.
GemvMmaParams MmaParams(const void* x, int64_t m, const uint8_t* packed, const float* absmax,
                        const float* code, int64_t n_rows, int64_t k, int64_t blocksize,
                        const void* bias, void* y) {
  GemvMmaParams p;
  p.x = x;
  p.packed = packed;
  p.absmax = absmax;
  p.code = code;
  p.bias = bias;
  p.y = y;
  p.n_rows = n_rows;
  p.k = k;
  p.blocksize = blocksize;
  p.m = static_cast<int32_t>(m);
  return p;
}

// Two CTAs an SM for the current device (132 SMs on an H100 SXM / H200).
int64_t WideTargetCtas() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0) {
    (void)cudaGetLastError();
    return 264;
  }
  return 2 * static_cast<int64_t>(sms);
}

// The pipelined kernel, for up to kMmaPipelinedMaxM rows.
template <typename Tag>
cudaError_t LaunchMmaPipelined(const GemvMmaParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.n_rows + kMmaRows - 1) / kMmaRows;
  if (blocks > 0x7fffffff || p.m > kMmaPipelinedMaxM) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  auto launch = [&](auto kernel, int max_m) {
    kernel<<<grid, kMmaThreads, static_cast<size_t>(MmaPipelinedSharedBytes(max_m)), stream>>>(p);
    return cudaGetLastError();
  };
  if (p.m <= 1) return launch(Gemv4bitMmaPipelinedKernel<Tag, 1>, 1);
  if (p.m <= 2) return launch(Gemv4bitMmaPipelinedKernel<Tag, 2>, 2);
  return launch(Gemv4bitMmaPipelinedKernel<Tag, 4>, 4);
}

template <typename Tag>
cudaError_t LaunchMma(const GemvMmaParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.n_rows + kMmaRows - 1) / kMmaRows;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  auto launch = [&](auto kernel, int max_m) {
    kernel<<<grid, kMmaThreads, static_cast<size_t>(MmaSharedBytes(max_m)), stream>>>(p);
    return cudaGetLastError();
  };
  if (p.m <= 1) return launch(Gemv4bitMmaKernel<Tag, 1>, 1);
  if (p.m <= 2) return launch(Gemv4bitMmaKernel<Tag, 2>, 2);
  if (p.m <= 4) return launch(Gemv4bitMmaKernel<Tag, 4>, 4);
  return launch(Gemv4bitMmaKernel<Tag, 8>, 8);
}

}  // namespace

bool MmaApplies(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                const void* packed) {
  return dtype != DType::kFloat32 && MmaTakes(m, k, blocksize, x, packed);
}

bool ScaledApplies(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                   const void* packed) {
  return dtype != DType::kFloat32 && ScaledTakes(m, k, blocksize, x, packed);
}

namespace {
std::atomic<int> scaled_gemv{-1};  // -1: not yet read from the environment
}  // namespace

bool UseScaledGemv() {
  int on = scaled_gemv.load(std::memory_order_relaxed);
  if (on < 0) {
    const char* env = std::getenv("ACCEL_CUDA_4BIT_GEMV");
    on = env != nullptr && std::strcmp(env, "exact") == 0 ? 0 : 1;
    int unset = -1;
    scaled_gemv.compare_exchange_strong(unset, on);
    on = scaled_gemv.load(std::memory_order_relaxed);
  }
  return on == 1;
}

void SetScaledGemv(bool on) { scaled_gemv.store(on ? 1 : 0); }

bool MmaTiledApplies(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                     const void* packed) {
  return dtype != DType::kFloat32 && MmaTiledTakes(m, k, blocksize, x, packed);
}

cudaError_t Gemm4bitWide(const void* x, int64_t m, const uint8_t* packed, const float* absmax,
                         const float* code, int64_t n_rows, int64_t k, int64_t blocksize,
                         const void* bias, DType dtype, void* y, float* workspace,
                         int64_t workspace_bytes, cudaStream_t stream) {
  if (x == nullptr || packed == nullptr || absmax == nullptr || code == nullptr || y == nullptr ||
      n_rows < 0 || k < 0 || blocksize < 1 || m < 1 || m > kWideMaxM ||
      !MmaTiledApplies(m, k, blocksize, dtype, x, packed) ||
      workspace_bytes < Gemm4bitRowsWideWorkspace(m, n_rows, k)) {
    return cudaErrorInvalidValue;
  }
  if (n_rows == 0) return cudaSuccess;
  GemvMmaParams p = MmaParams(x, m, packed, absmax, code, n_rows, k, blocksize, bias, y);
  p.splits = WideSplits(n_rows, k, WideTargetCtas());
  p.workspace = workspace;
  return dtype == DType::kBFloat16 ? LaunchMmaWide<MmaBFloat16>(p, stream)
                                   : LaunchMmaWide<MmaFloat16>(p, stream);
}

cudaError_t Gemv4bitWith(GemvKernel kernel, const void* x, int64_t m, const uint8_t* packed,
                         const float* absmax, const float* code, int64_t n_rows, int64_t k,
                         int64_t blocksize, const void* bias, DType dtype, void* y,
                         cudaStream_t stream) {
  if (x == nullptr || packed == nullptr || absmax == nullptr || code == nullptr || y == nullptr ||
      n_rows < 0 || k < 0 || blocksize < 1 || m < 1 || m > kMmaTiledMaxM || !ValidDType(dtype)) {
    return cudaErrorInvalidValue;
  }
  if (n_rows == 0) return cudaSuccess;
  const bool mma = MmaApplies(m, k, blocksize, dtype, x, packed);
  const bool tiled = MmaTiledApplies(m, k, blocksize, dtype, x, packed);
  if ((kernel == GemvKernel::kMma || kernel == GemvKernel::kMmaPipelined) && !mma) {
    return cudaErrorInvalidValue;
  }
  const bool scaled = ScaledApplies(m, k, blocksize, dtype, x, packed);
  const bool scaled_by_name = kernel == GemvKernel::kMmaScaled || kernel == GemvKernel::kMmaScaled3;
  if (scaled_by_name && !scaled) return cudaErrorInvalidValue;
  // Up to 8 rows: the scaled form by default (the first form's byte permutes
  // keep the integer pipe at about half of HBM's rate; gemv_mma.h).
  if (scaled_by_name || (kernel == GemvKernel::kAuto && scaled && UseScaledGemv())) {
    const GemvMmaParams p = MmaParams(x, m, packed, absmax, code, n_rows, k, blocksize, bias, y);
    if (kernel == GemvKernel::kMmaScaled3) {
      return dtype == DType::kBFloat16 ? LaunchScaled<MmaBFloat16, 3>(p, stream)
                                       : LaunchScaled<MmaFloat16, 3>(p, stream);
    }
    return dtype == DType::kBFloat16 ? LaunchScaled<MmaBFloat16, 2>(p, stream)
                                     : LaunchScaled<MmaFloat16, 2>(p, stream);
  }
  if (kernel == GemvKernel::kMmaTiled && !tiled) return cudaErrorInvalidValue;
  if (kernel == GemvKernel::kMmaWide) {
    // Its workspace from the stream-ordered allocator (tests and benchmarks;
    // Gemm4bitRowsWide takes one from the caller).
    const int64_t bytes = Gemm4bitRowsWideWorkspace(m, n_rows, k);
    void* workspace = nullptr;
    if (bytes > 0) {
      const cudaError_t got = cudaMallocAsync(&workspace, static_cast<size_t>(bytes), stream);
      if (got != cudaSuccess) return got;
    }
    const cudaError_t status =
        Gemm4bitWide(x, m, packed, absmax, code, n_rows, k, blocksize, bias, dtype, y,
                     static_cast<float*>(workspace), bytes, stream);
    if (workspace != nullptr) (void)cudaFreeAsync(workspace, stream);
    return status;
  }
  if (kernel == GemvKernel::kMmaPipelined && m > kMmaPipelinedMaxM) return cudaErrorInvalidValue;
  // More than 8 rows: the tiled form (kAuto), each A fragment against up to
  // four B tiles.
  const bool use_tiled =
      kernel == GemvKernel::kMmaTiled || (kernel == GemvKernel::kAuto && !mma && tiled);
  if ((mma && kernel != GemvKernel::kChunk) || use_tiled) {
    const GemvMmaParams p = MmaParams(x, m, packed, absmax, code, n_rows, k, blocksize, bias, y);
    if (use_tiled) {
      return dtype == DType::kBFloat16 ? LaunchMmaTiled<MmaBFloat16>(p, stream)
                                       : LaunchMmaTiled<MmaFloat16>(p, stream);
    }
    // The first form unless the pipelined one is asked for by name: on an
    // H200 (2026-11-30, accel-bench-quant-cuda) the pipelined form was 1-5%
    // slower at every shape and row count it takes (14336 x 4096, one row:
    // 25.96 us against 25.23; four rows 27.18 against 26.61).
    if (kernel == GemvKernel::kMmaPipelined) {
      return dtype == DType::kBFloat16 ? LaunchMmaPipelined<MmaBFloat16>(p, stream)
                                       : LaunchMmaPipelined<MmaFloat16>(p, stream);
    }
    return dtype == DType::kBFloat16 ? LaunchMma<MmaBFloat16>(p, stream)
                                     : LaunchMma<MmaFloat16>(p, stream);
  }
  // One activation row at a time (each reads the weights again).
  const int64_t size = DTypeSize(dtype);
  for (int64_t r = 0; r < m; ++r) {
    const cudaError_t status =
        GemvOneRow(static_cast<const uint8_t*>(x) + r * k * size, packed, absmax, code, n_rows, k,
                   blocksize, bias, dtype, static_cast<uint8_t*>(y) + r * n_rows * size, stream);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace internal

cudaError_t Gemv4bit(const void* x, const uint8_t* packed, const float* absmax, const float* code,
                     int64_t n_rows, int64_t k, int64_t blocksize, const void* bias, DType dtype,
                     void* y, cudaStream_t stream) {
  return internal::Gemv4bitWith(internal::GemvKernel::kAuto, x, 1, packed, absmax, code, n_rows, k,
                                blocksize, bias, dtype, y, stream);
}

cudaError_t Gemv4bitRows(const void* x, int64_t m, const uint8_t* packed, const float* absmax,
                         const float* code, int64_t n_rows, int64_t k, int64_t blocksize,
                         const void* bias, DType dtype, void* y, cudaStream_t stream) {
  return internal::Gemv4bitWith(internal::GemvKernel::kAuto, x, m, packed, absmax, code, n_rows, k,
                                blocksize, bias, dtype, y, stream);
}

int64_t Gemm4bitRowsWideWorkspace(int64_t m, int64_t n_rows, int64_t k) {
  if (m < 1 || n_rows < 1 || k < internal::kMmaChunk) return 0;
  const int32_t splits = internal::WideSplits(n_rows, k, internal::WideTargetCtas());
  return splits > 1 ? static_cast<int64_t>(splits) * m * n_rows * 4 : 0;
}

bool Gemm4bitRowsWideTakes(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                           const void* packed) {
  static_assert(internal::kWideMaxM == internal::kMmaTiledMaxM, "the wide form takes the tiled's");
  return internal::MmaTiledApplies(m, k, blocksize, dtype, x, packed);
}

cudaError_t Gemm4bitRowsWide(const void* x, int64_t m, const uint8_t* packed, const float* absmax,
                             const float* code, int64_t n_rows, int64_t k, int64_t blocksize,
                             const void* bias, DType dtype, void* y, float* workspace,
                             int64_t workspace_bytes, cudaStream_t stream) {
  return internal::Gemm4bitWide(x, m, packed, absmax, code, n_rows, k, blocksize, bias, dtype, y,
                                workspace, workspace_bytes, stream);
}

bool Gemv4bitExpertsTakes(int64_t k, int64_t blocksize, DType dtype, const void* x,
                          const void* packed) {
  return internal::MmaApplies(1, k, blocksize, dtype, x, packed);
}

cudaError_t Gemv4bitExperts(const void* x, int64_t slots_per_x, const int64_t* expert_ids,
                            int64_t slots, const uint8_t* const* packed, const float* const* absmax,
                            const float* const* code, int64_t experts, int64_t n_rows, int64_t k,
                            int64_t blocksize, DType dtype, void* y, cudaStream_t stream) {
  if (x == nullptr || expert_ids == nullptr || packed == nullptr || absmax == nullptr ||
      code == nullptr || y == nullptr || slots_per_x < 1 || slots < 0 || experts < 1 ||
      n_rows < 0 || k < 0 || blocksize < 1 || !internal::ValidDType(dtype) ||
      !Gemv4bitExpertsTakes(k, blocksize, dtype, x, x)) {
    return cudaErrorInvalidValue;
  }
  if (slots == 0 || n_rows == 0) return cudaSuccess;
  // The form Gemv4bit runs for one row of these arguments: the scaled one
  // where it applies and is on, else the first.
  const bool scaled =
      internal::ScaledApplies(1, k, blocksize, dtype, x, x) && internal::UseScaledGemv();
  internal::GemvMmaParams p;
  p.x = x;
  p.y = y;
  p.n_rows = n_rows;
  p.k = k;
  p.blocksize = blocksize;
  p.m = 1;
  internal::ExpertRows rows;
  rows.expert_ids = expert_ids;
  rows.packed = packed;
  rows.absmax = absmax;
  rows.code = code;
  rows.experts = experts;
  rows.slots_per_x = slots_per_x;
  return dtype == DType::kBFloat16
             ? internal::LaunchExperts<internal::MmaBFloat16>(p, rows, slots, scaled, stream)
             : internal::LaunchExperts<internal::MmaFloat16>(p, rows, slots, scaled, stream);
}

bool Gemv4bitRowsFused(int64_t m, int64_t k, int64_t blocksize, DType dtype, const void* x,
                       const void* packed) {
  return m == 1 || internal::MmaApplies(m, k, blocksize, dtype, x, packed) ||
         internal::MmaTiledApplies(m, k, blocksize, dtype, x, packed);
}

}  // namespace accel::quant::cuda
