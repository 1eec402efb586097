// accel-bench-quant-cuda: the 4-bit GEMV of quant/cuda/kernels.h (NF4,
// blocksize 64) on Llama-7B-shaped (4096 x 4096, 11008 x 4096) and
// Llama-3-8B-shaped weights (1024 x 4096, 14336 x 4096, 4096 x 14336), in
// GB/s of the bytes it has to read (packed weights + float32 absmax): the
// warp-per-row kernel at one activation row and the tensor-core kernel at 1,
// 2, 4 and 8 rows (a decode step's batch: the weights are still read once),
// its pipelined form at 1, 2 and 4, its tiled and wide forms at 1, 8, 16, 24
// and 32 (a batch's decodes above 8: still one read of the weights; the
// wide form reads x once for 128 rows of W); then LLM.int8's product (Int8Matmul,
// int8 weights) through its GEMV at 1, 4 and 8 rows and its tiled kernel.
// "experts": a mixture's two top-k slots of one token in one launch
// (Gemv4bitExperts: two weight copies as two experts, their indices read on
// the device), against a copy of both experts' bytes.
// Baselines from the same run: a cudaMemcpy device-to-device of the same
// bytes, which moves them once (GB/s copied) and reads and writes them (2x
// that in traffic), and a copy of 1 GiB, far past the L2 cache, whose
// traffic is what the device's memory sustains. "of copy" / "of HBM" are the
// GEMV's GB/s over those traffic figures.
// Each weight exists in enough copies to hold 4x the GPU's L2 cache, and the
// timed calls cycle through them, so every call reads from device memory, as
// a decode step does (each layer's weights once). Each figure is the median
// of --rounds rounds of --iters calls timed with CUDA events.
//
//   build/bin/accel-bench-quant-cuda [--iters 200] [--rounds 5]
//       [--dtypes bfloat16,float16,float32] [--json FILE]
// With no CUDA device it says so and exits with status 1.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime_api.h>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "quant/cuda/internal/gemv.h"
#include "quant/cuda/kernels.h"

namespace {

using accel::quant::cuda::DType;

#define CHECK_CUDA(expr)                                                     \
  do {                                                                       \
    const cudaError_t check_status_ = (expr);                                \
    if (check_status_ != cudaSuccess) {                                      \
      std::fprintf(stderr, "accel-bench-quant-cuda: %s failed: %s\n", #expr, \
                   cudaGetErrorString(check_status_));                       \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

// NF4 (../shared/reference/bitsandbytes.md §1.1); the values do not change
// the speed, but they keep the sums finite.
constexpr uint32_t kNf4Bits[16] = {
    0xbf800000, 0xbf3239b1, 0xbf066b30, 0xbeca32a0, 0xbe91a24d, 0xbe3d353f, 0xbdba7871, 0x00000000,
    0x3da2faff, 0x3e24cae3, 0x3e7c04dd, 0x3ead033a, 0x3ee1a4b8, 0x3f1007ab, 0x3f3913b3, 0x3f800000};

constexpr int64_t kBlocksize = 64;

struct Options {
  int iters = 200;
  int rounds = 5;
  std::vector<DType> dtypes = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  std::string json;  // where to write the rows as JSON, if anywhere
};

[[noreturn]] void Usage(const char* argv0, const std::string& error) {
  if (!error.empty()) std::fprintf(stderr, "%s: %s\n", argv0, error.c_str());
  std::fprintf(stderr,
               "usage: %s [--iters N] [--rounds N] [--dtypes bfloat16,float16,float32] "
               "[--json FILE]\n",
               argv0);
  std::exit(2);
}

bool ParseDType(const std::string& name, DType* out) {
  for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    if (name == accel::quant::cuda::DTypeName(d)) {
      *out = d;
      return true;
    }
  }
  return false;
}

Options ParseOptions(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Usage(argv[0], "missing value after " + flag);
    const std::string value = argv[++i];
    if (flag == "--iters" || flag == "--rounds") {
      const int n = std::atoi(value.c_str());
      if (n < 1) Usage(argv[0], flag + " must be a positive integer, got '" + value + "'");
      (flag == "--iters" ? options.iters : options.rounds) = n;
    } else if (flag == "--json") {
      options.json = value;
    } else if (flag == "--dtypes") {
      options.dtypes.clear();
      size_t start = 0;
      while (start <= value.size()) {
        const size_t comma = std::min(value.find(',', start), value.size());
        DType d;
        if (!ParseDType(value.substr(start, comma - start), &d)) {
          Usage(argv[0], "unknown dtype in --dtypes '" + value + "'");
        }
        options.dtypes.push_back(d);
        start = comma + 1;
      }
    } else {
      Usage(argv[0], "unknown flag " + flag);
    }
  }
  return options;
}

// One weight's bytes in one allocation: packed codes, then the absmax at a
// 256-byte boundary (both as the kernel's fast path wants them).
struct WeightCopy {
  uint8_t* base = nullptr;
  const uint8_t* packed() const { return base; }
  const float* absmax(int64_t packed_bytes) const {
    return reinterpret_cast<const float*>(base + (packed_bytes + 255) / 256 * 256);
  }
};

template <typename T>
T* DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, bytes));
  return static_cast<T*>(p);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median seconds per call of `call(i)` over rounds of `iters` calls.
template <typename Call>
double TimePerCall(const Options& options, cudaStream_t stream, Call&& call) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> samples;
  int64_t calls = 0;
  for (int r = 0; r < options.rounds; ++r) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    for (int i = 0; i < options.iters; ++i) call(calls++);
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    samples.push_back(ms * 1e-3 / options.iters);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return Median(samples);
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = ParseOptions(argc, argv);
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::fprintf(stderr,
                 "accel-bench-quant-cuda: no CUDA device (cudaGetDeviceCount: %s, %d devices); "
                 "this benchmark needs a GPU\n",
                 status == cudaSuccess ? "ok" : cudaGetErrorString(status), devices);
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device 0: %s, sm_%d%d, %d SMs, L2 %.0f MiB, %.1f GiB\n", prop.name, prop.major,
              prop.minor, prop.multiProcessorCount, prop.l2CacheSize / 1048576.0,
              prop.totalGlobalMem / 1073741824.0);
  std::printf("Gemv4bit: NF4, blocksize %ld, no bias; %d rounds of %d calls, median\n",
              static_cast<long>(kBlocksize), options.rounds, options.iters);

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  std::vector<float> code(16);
  for (int i = 0; i < 16; ++i) std::memcpy(&code[static_cast<size_t>(i)], &kNf4Bits[i], 4);
  float* code_d = DeviceAlloc<float>(sizeof(float) * 16);
  CHECK_CUDA(cudaMemcpy(code_d, code.data(), sizeof(float) * 16, cudaMemcpyHostToDevice));

  // What the device's memory sustains: a 1 GiB copy.
  const size_t big = size_t{1} << 30;
  uint8_t* big_src = DeviceAlloc<uint8_t>(big);
  uint8_t* big_dst = DeviceAlloc<uint8_t>(big);
  CHECK_CUDA(cudaMemset(big_src, 1, big));
  Options big_options = options;
  big_options.iters = 10;
  auto big_copy = [&](int64_t) {
    CHECK_CUDA(cudaMemcpyAsync(big_dst, big_src, big, cudaMemcpyDeviceToDevice, stream));
  };
  big_copy(0);
  const double big_s = TimePerCall(big_options, stream, big_copy);
  const double hbm_traffic = 2.0 * static_cast<double>(big) / big_s / 1e9;
  CHECK_CUDA(cudaFree(big_src));
  CHECK_CUDA(cudaFree(big_dst));
  std::printf("device-to-device copy of 1 GiB: %.1f GB/s copied, %.1f GB/s of traffic (HBM)\n\n",
              hbm_traffic / 2, hbm_traffic);

  std::printf("%-9s %-11s %9s %6s %-8s %2s | %9s %9s | %9s %11s | %7s %6s\n", "dtype", "N x K",
              "bytes", "copies", "kernel", "m", "GEMV us", "GEMV GB/s", "copy us", "copy traffic",
              "of copy", "of HBM");
  struct Shape {
    const char* model;
    int64_t n_rows, k;
  };
  const Shape shapes[] = {{"llama-7b", 4096, 4096},
                          {"llama-7b", 11008, 4096},
                          {"llama3-8b", 1024, 4096},
                          {"llama3-8b", 14336, 4096},
                          {"llama3-8b", 4096, 14336}};
  std::string json = "{\"device\": \"" + std::string(prop.name) +
                     "\", \"hbm_copy_traffic_gbs\": " + std::to_string(hbm_traffic) +
                     ", \"rows\": [";
  bool first_row = true;
  std::mt19937 rng(1);
  for (const Shape& shape : shapes) {
    const int64_t n_rows = shape.n_rows, k = shape.k, n = n_rows * k;
    // One row of the table and of the JSON: a kernel's time for `bytes` of
    // weights against a device copy of the same bytes.
    auto report = [&](const char* dtype_name, const char* kernel, int64_t m, int64_t bytes,
                      int64_t copies, double gemv_s, double copy_s, double copy_traffic) {
      const double gemv_gbs = static_cast<double>(bytes) / gemv_s / 1e9;
      const std::string shape_name = std::to_string(n_rows) + "x" + std::to_string(k);
      std::printf("%-9s %-11s %6.2f MB %6ld %-8s %2ld | %9.2f %9.1f | %9.2f %11.1f | %7.2f %6.2f\n",
                  dtype_name, shape_name.c_str(), static_cast<double>(bytes) / 1e6,
                  static_cast<long>(copies), kernel, static_cast<long>(m), gemv_s * 1e6, gemv_gbs,
                  copy_s * 1e6, copy_traffic, gemv_gbs / copy_traffic, gemv_gbs / hbm_traffic);
      std::fflush(stdout);
      json += std::string(first_row ? "" : ",") + "\n  {\"model\": \"" + shape.model +
              "\", \"dtype\": \"" + dtype_name + "\", \"n\": " + std::to_string(n_rows) +
              ", \"k\": " + std::to_string(k) + ", \"kernel\": \"" + kernel +
              "\", \"m\": " + std::to_string(m) + ", \"bytes\": " + std::to_string(bytes) +
              ", \"us\": " + std::to_string(gemv_s * 1e6) +
              ", \"gbs\": " + std::to_string(gemv_gbs) +
              ", \"copy_traffic_gbs\": " + std::to_string(copy_traffic) +
              ", \"of_copy\": " + std::to_string(gemv_gbs / copy_traffic) +
              ", \"of_hbm\": " + std::to_string(gemv_gbs / hbm_traffic) + "}";
      first_row = false;
    };
    const int64_t packed_bytes = n / 2, nblocks = n / kBlocksize;
    const int64_t bytes = packed_bytes + nblocks * 4;
    const int64_t alloc_bytes = (packed_bytes + 255) / 256 * 256 + nblocks * 4;
    const int64_t copies =
        std::max<int64_t>(2, (4 * static_cast<int64_t>(prop.l2CacheSize) + bytes - 1) / bytes);

    // Random codes and absmax around 1, uploaded once and copied on the device.
    std::vector<uint8_t> host(static_cast<size_t>(alloc_bytes));
    for (int64_t i = 0; i < packed_bytes; ++i) host[static_cast<size_t>(i)] = rng() & 0xFF;
    std::uniform_real_distribution<float> scale(0.5f, 2.0f);
    float* absmax_host = reinterpret_cast<float*>(host.data() + (packed_bytes + 255) / 256 * 256);
    for (int64_t b = 0; b < nblocks; ++b) absmax_host[b] = scale(rng);
    std::vector<WeightCopy> weights(static_cast<size_t>(copies));
    std::vector<uint8_t*> copy_src(static_cast<size_t>(copies)),
        copy_dst(static_cast<size_t>(copies));
    for (int64_t c = 0; c < copies; ++c) {
      WeightCopy& w = weights[static_cast<size_t>(c)];
      w.base = DeviceAlloc<uint8_t>(static_cast<size_t>(alloc_bytes));
      CHECK_CUDA(cudaMemcpy(w.base, host.data(), static_cast<size_t>(alloc_bytes),
                            cudaMemcpyHostToDevice));
      // The copy baseline moves the same number of bytes between its own
      // buffers, also cycled, so it cannot live in L2 either.
      copy_src[static_cast<size_t>(c)] = w.base;
      copy_dst[static_cast<size_t>(c)] = DeviceAlloc<uint8_t>(static_cast<size_t>(bytes));
    }
    auto copy = [&](int64_t i) {
      CHECK_CUDA(cudaMemcpyAsync(copy_dst[static_cast<size_t>(i % copies)],
                                 copy_src[static_cast<size_t>(i % copies)],
                                 static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream));
    };
    for (int64_t c = 0; c < copies; ++c) copy(c);  // warm-up
    const double copy_s = TimePerCall(options, stream, copy);
    const double copy_traffic = 2.0 * static_cast<double>(bytes) / copy_s / 1e9;

    for (DType dtype : options.dtypes) {
      using accel::quant::cuda::internal::GemvKernel;
      const size_t size = static_cast<size_t>(accel::quant::cuda::DTypeSize(dtype));
      constexpr int64_t kMaxRows = 32;
      void* x = DeviceAlloc<void>(size * static_cast<size_t>(kMaxRows * k));
      void* y = DeviceAlloc<void>(size * static_cast<size_t>(kMaxRows * n_rows));
      // 0x3c: small positive numbers in every dtype (0x3c3c... as bfloat16,
      // float16 and float32 are all about 0.01 to 1.1).
      CHECK_CUDA(cudaMemset(x, 0x3c, size * static_cast<size_t>(kMaxRows * k)));
      struct Run {
        GemvKernel kernel;
        const char* name;
        int64_t m;
      };
      std::vector<Run> runs = {{GemvKernel::kChunk, "rowwise", 1}};
      if (dtype != DType::kFloat32) {
        for (int64_t m : {1, 2, 4, 8}) runs.push_back({GemvKernel::kMma, "mma", m});
        // Its scaled form (gemv_mma.h; what Gemv4bitRows runs up to 8 rows
        // unless ACCEL_CUDA_4BIT_GEMV=exact): beside the first form's rows.
        for (int64_t m : {1, 2, 4, 8}) runs.push_back({GemvKernel::kMmaScaled, "mma-scaled", m});
        // The same at three CTAs an SM (80 registers, spilling).
        for (int64_t m : {1, 4}) runs.push_back({GemvKernel::kMmaScaled3, "mma-scaled3", m});
        // Its pipelined form (gemv_mma.h; what Gemv4bitRows runs up to 4 rows).
        for (int64_t m : {1, 2, 4}) runs.push_back({GemvKernel::kMmaPipelined, "mma-pipe", m});
        // Its tiled form (what Gemv4bitRows runs for 9 to 32 rows; at 8 rows
        // beside the first form's).
        for (int64_t m : {1, 8, 16, 24, 32})
          runs.push_back({GemvKernel::kMmaTiled, "mma-tiled", m});
        // Its wide form (128 rows of W a CTA, K split where W has few rows:
        // what Linear4bit runs for 9 to 32 rows), its workspace made once.
        for (int64_t m : {1, 8, 16, 24, 32}) runs.push_back({GemvKernel::kMmaWide, "mma-wide", m});
      }
      const int64_t wide_bytes = accel::quant::cuda::Gemm4bitRowsWideWorkspace(kMaxRows, n_rows, k);
      float* wide_workspace =
          wide_bytes > 0 ? DeviceAlloc<float>(static_cast<size_t>(wide_bytes / 4)) : nullptr;
      for (const Run& run : runs) {
        auto gemv = [&](int64_t i) {
          const WeightCopy& w = weights[static_cast<size_t>(i % copies)];
          if (run.kernel == GemvKernel::kMmaWide) {
            CHECK_CUDA(accel::quant::cuda::Gemm4bitRowsWide(
                x, run.m, w.packed(), w.absmax(packed_bytes), code_d, n_rows, k, kBlocksize,
                nullptr, dtype, y, wide_workspace, wide_bytes, stream));
            return;
          }
          CHECK_CUDA(accel::quant::cuda::internal::Gemv4bitWith(
              run.kernel, x, run.m, w.packed(), w.absmax(packed_bytes), code_d, n_rows, k,
              kBlocksize, nullptr, dtype, y, stream));
        };
        for (int64_t c = 0; c < copies; ++c) gemv(c);  // warm-up: first launches, clocks up
        CHECK_CUDA(cudaStreamSynchronize(stream));
        const double gemv_s = TimePerCall(options, stream, gemv);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        report(accel::quant::cuda::DTypeName(dtype), run.name, run.m, bytes, copies, gemv_s, copy_s,
               copy_traffic);
      }
      // A mixture's two top-k slots of one token in one launch
      // (Gemv4bitExperts, what a decode step of Mixtral runs for gate, up
      // and down): two weight copies as two experts, their indices read on
      // the device, against a copy of both experts' bytes.
      if (dtype != DType::kFloat32) {
        std::vector<const uint8_t*> packed_of;
        std::vector<const float*> absmax_of, code_of;
        std::vector<int64_t> pairs;
        for (int64_t c = 0; c < copies; ++c) {
          const WeightCopy& w = weights[static_cast<size_t>(c)];
          packed_of.push_back(w.packed());
          absmax_of.push_back(w.absmax(packed_bytes));
          code_of.push_back(code_d);
          pairs.push_back(c);
          pairs.push_back((c + 1) % copies);
        }
        const auto upload = [&](const auto& host_vector) {
          using T = typename std::decay_t<decltype(host_vector)>::value_type;
          T* device = DeviceAlloc<T>(sizeof(T) * host_vector.size());
          CHECK_CUDA(cudaMemcpy(device, host_vector.data(), sizeof(T) * host_vector.size(),
                                cudaMemcpyHostToDevice));
          return device;
        };
        const uint8_t** packed_d = upload(packed_of);
        const float** absmax_d = upload(absmax_of);
        const float** code_table_d = upload(code_of);
        int64_t* pairs_d = upload(pairs);
        auto experts = [&](int64_t i) {
          CHECK_CUDA(accel::quant::cuda::Gemv4bitExperts(x, 2, pairs_d + 2 * (i % copies), 2,
                                                         packed_d, absmax_d, code_table_d, copies,
                                                         n_rows, k, kBlocksize, dtype, y, stream));
        };
        for (int64_t c = 0; c < copies; ++c) experts(c);  // warm-up
        CHECK_CUDA(cudaStreamSynchronize(stream));
        const double experts_s = TimePerCall(options, stream, experts);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        report(accel::quant::cuda::DTypeName(dtype), "experts", 2, 2 * bytes, copies, experts_s,
               2 * copy_s, copy_traffic);
        for (void* p : {static_cast<void*>(packed_d), static_cast<void*>(absmax_d),
                        static_cast<void*>(code_table_d), static_cast<void*>(pairs_d)}) {
          CHECK_CUDA(cudaFree(p));
        }
      }
      CHECK_CUDA(cudaFree(x));
      CHECK_CUDA(cudaFree(y));
      if (wide_workspace != nullptr) CHECK_CUDA(cudaFree(wide_workspace));
    }
    for (int64_t c = 0; c < copies; ++c) {
      CHECK_CUDA(cudaFree(weights[static_cast<size_t>(c)].base));
      CHECK_CUDA(cudaFree(copy_dst[static_cast<size_t>(c)]));
    }

    // LLM.int8's product (Int8Matmul) on the same shape: int8 weights, a
    // byte each, x as int8 codes, exact int32 out; through the GEMV it runs
    // for up to 8 rows and through the tiled kernel it ran before, against
    // a copy of the same bytes (cycled copies, as above).
    const int64_t int8_copies =
        std::max<int64_t>(2, (4 * static_cast<int64_t>(prop.l2CacheSize) + n - 1) / n);
    std::vector<int8_t> host8(static_cast<size_t>(n));
    for (int8_t& v : host8) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
    std::vector<int8_t*> weights8(static_cast<size_t>(int8_copies)),
        dst8(static_cast<size_t>(int8_copies));
    for (int64_t c = 0; c < int8_copies; ++c) {
      weights8[static_cast<size_t>(c)] = DeviceAlloc<int8_t>(static_cast<size_t>(n));
      dst8[static_cast<size_t>(c)] = DeviceAlloc<int8_t>(static_cast<size_t>(n));
      CHECK_CUDA(cudaMemcpy(weights8[static_cast<size_t>(c)], host8.data(), static_cast<size_t>(n),
                            cudaMemcpyHostToDevice));
    }
    auto copy8 = [&](int64_t i) {
      CHECK_CUDA(cudaMemcpyAsync(dst8[static_cast<size_t>(i % int8_copies)],
                                 weights8[static_cast<size_t>(i % int8_copies)],
                                 static_cast<size_t>(n), cudaMemcpyDeviceToDevice, stream));
    };
    for (int64_t c = 0; c < int8_copies; ++c) copy8(c);
    const double copy8_s = TimePerCall(options, stream, copy8);
    const double copy8_traffic = 2.0 * static_cast<double>(n) / copy8_s / 1e9;
    constexpr int64_t kInt8Rows = 8;
    int8_t* x8 = DeviceAlloc<int8_t>(static_cast<size_t>(kInt8Rows * k));
    CHECK_CUDA(cudaMemset(x8, 0x11, static_cast<size_t>(kInt8Rows * k)));
    int32_t* c8 = DeviceAlloc<int32_t>(sizeof(int32_t) * static_cast<size_t>(kInt8Rows * n_rows));
    struct Int8Run {
      bool gemv;
      const char* name;
      int64_t m;
    };
    for (const Int8Run& run : {Int8Run{true, "i8-gemv", 1}, Int8Run{true, "i8-gemv", 4},
                               Int8Run{true, "i8-gemv", 8}, Int8Run{false, "i8-tiled", 1}}) {
      auto product = [&](int64_t i) {
        int8_t* w = weights8[static_cast<size_t>(i % int8_copies)];
        CHECK_CUDA(run.gemv
                       ? accel::quant::cuda::internal::Int8Gemv(x8, w, run.m, n_rows, k, c8, stream)
                       : accel::quant::cuda::internal::Int8MatmulTiled(x8, w, run.m, n_rows, k, c8,
                                                                       stream));
      };
      for (int64_t c = 0; c < int8_copies; ++c) product(c);  // warm-up
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const double product_s = TimePerCall(options, stream, product);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      report("int8", run.name, run.m, n, int8_copies, product_s, copy8_s, copy8_traffic);
    }
    CHECK_CUDA(cudaFree(x8));
    CHECK_CUDA(cudaFree(c8));
    for (int64_t c = 0; c < int8_copies; ++c) {
      CHECK_CUDA(cudaFree(weights8[static_cast<size_t>(c)]));
      CHECK_CUDA(cudaFree(dst8[static_cast<size_t>(c)]));
    }
  }
  json += "\n]}\n";
  if (!options.json.empty()) {
    std::FILE* f = std::fopen(options.json.c_str(), "w");
    if (f == nullptr || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0) {
      std::fprintf(stderr, "accel-bench-quant-cuda: cannot write %s\n", options.json.c_str());
      return 1;
    }
  }
  CHECK_CUDA(cudaFree(code_d));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
