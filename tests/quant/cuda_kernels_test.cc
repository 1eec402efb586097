// The CUDA kernels of quant/cuda/kernels.h against plain loops on the host
// written from ../shared/reference/bitsandbytes.md: dequantization, the
// nested absmax, the int8 row quantization, the int8 product and its
// rescale bit for bit (the same float32 operations in the same order, with
// our own round-to-nearest-even conversions); the 4-bit GEMV within the
// float32 summation bound of its K terms, and bit for bit where every sum is
// exact. Without a CUDA device (cudaGetDeviceCount fails or finds none)
// every test that needs one is skipped; the argument checks run anyway.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cuda_runtime_api.h>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "quant/cuda/internal/gemv.h"
#include "quant/cuda/kernels.h"

namespace accel::quant::cuda {
namespace {

// --- Host references -------------------------------------------------------

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint32_t Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// Reference §1.1, as float32 bit patterns.
constexpr uint32_t kNf4Bits[16] = {
    0xbf800000, 0xbf3239b1, 0xbf066b30, 0xbeca32a0, 0xbe91a24d, 0xbe3d353f, 0xbdba7871, 0x00000000,
    0x3da2faff, 0x3e24cae3, 0x3e7c04dd, 0x3ead033a, 0x3ee1a4b8, 0x3f1007ab, 0x3f3913b3, 0x3f800000};
constexpr uint32_t kFp4Bits[16] = {
    0x00000000, 0x3baaaaab, 0x3f2aaaab, 0x3f800000, 0x3eaaaaab, 0x3f000000, 0x3e2aaaab, 0x3e800000,
    0x80000000, 0xbbaaaaab, 0xbf2aaaab, 0xbf800000, 0xbeaaaaab, 0xbf000000, 0xbe2aaaab, 0xbe800000};

std::vector<float> Table(const uint32_t* bits) {
  std::vector<float> table(16);
  for (int i = 0; i < 16; ++i) table[i] = FromBits(bits[i]);
  return table;
}

// float32 -> bfloat16, round to nearest even (NaN stays NaN).
uint16_t ToBFloat16(float f) {
  const uint32_t x = Bits(f);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);
  return static_cast<uint16_t>((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

// float32 -> IEEE binary16, round to nearest even, subnormals and overflow
// to infinity included.
uint16_t ToHalf(float f) {
  const uint32_t x = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7fffffff;
  if (ax > 0x7f800000) return sign | 0x7e00;
  if (ax >= 0x477ff000) return sign | 0x7c00;  // >= 65520 rounds to infinity
  if (ax < 0x38800000) {                       // below 2^-14: a multiple of 2^-24
    // Scaling by 2^24 is exact here; nearbyint rounds half to even.
    return sign | static_cast<uint16_t>(std::nearbyint(FromBits(ax) * 16777216.0f));
  }
  uint32_t h = ((((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7fffff) >> 13));
  const uint32_t rest = ax & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // a carry moves into the exponent
  return sign | static_cast<uint16_t>(h);
}

double DecodeHalf(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -24);
  } else if (exponent == 0x1f) {
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN()
                         : std::numeric_limits<double>::infinity();
  } else {
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return (bits >> 15) ? -magnitude : magnitude;
}

double DecodeBFloat16(uint16_t bits) {
  return static_cast<double>(FromBits(static_cast<uint32_t>(bits) << 16));
}

// Arrays of a DType as bytes: what the kernels read and write.
class Values {
 public:
  Values(DType dtype, size_t count)
      : dtype_(dtype), bytes_(count * static_cast<size_t>(DTypeSize(dtype))) {}
  DType dtype() const { return dtype_; }
  size_t size() const { return bytes_.size() / static_cast<size_t>(DTypeSize(dtype_)); }
  std::vector<uint8_t>& bytes() { return bytes_; }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

  // Stores `v` rounded to nearest even.
  void Set(size_t i, float v) {
    if (dtype_ == DType::kFloat32) {
      std::memcpy(&bytes_[4 * i], &v, 4);
      return;
    }
    const uint16_t bits = dtype_ == DType::kBFloat16 ? ToBFloat16(v) : ToHalf(v);
    std::memcpy(&bytes_[2 * i], &bits, 2);
  }
  double Get(size_t i) const {
    if (dtype_ == DType::kFloat32) {
      float v;
      std::memcpy(&v, &bytes_[4 * i], 4);
      return v;
    }
    uint16_t bits;
    std::memcpy(&bits, &bytes_[2 * i], 2);
    return dtype_ == DType::kBFloat16 ? DecodeBFloat16(bits) : DecodeHalf(bits);
  }
  // The bit pattern, for exact comparisons (a NaN or -0.0 is not lost).
  uint32_t Pattern(size_t i) const {
    uint32_t bits = 0;
    std::memcpy(&bits, &bytes_[static_cast<size_t>(DTypeSize(dtype_)) * i],
                static_cast<size_t>(DTypeSize(dtype_)));
    return bits;
  }

 private:
  DType dtype_;
  std::vector<uint8_t> bytes_;
};

constexpr DType kDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// Reference §1.4.
Values ReferenceDequantize(const std::vector<uint8_t>& packed, const std::vector<float>& absmax,
                           const std::vector<float>& code, int64_t n, int64_t blocksize,
                           DType dtype) {
  Values out(dtype, static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t byte = packed[static_cast<size_t>(j / 2)];
    const int nibble = j % 2 == 0 ? byte >> 4 : byte & 0xF;
    const float v = code[nibble] * absmax[static_cast<size_t>(j / blocksize)];
    out.Set(static_cast<size_t>(j), v);
  }
  return out;
}

std::vector<uint8_t> RandomBytes(size_t count, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> out(count);
  for (auto& b : out) b = static_cast<uint8_t>(byte(rng));
  return out;
}

std::vector<float> RandomFloats(size_t count, float lo, float hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(count);
  for (auto& v : out) v = dist(rng);
  return out;
}

// Block scales over 2^-12 .. 2^17, so products reach float16's subnormals
// and overflow float16; every 13th block is 0.
std::vector<float> RandomAbsmax(size_t count, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> exponent(-12.0f, 17.0f);
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = i % 13 == 5 ? 0.0f : std::exp2(exponent(rng));
  return out;
}

// --- Device plumbing -------------------------------------------------------

bool HasDevice() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear it
    return false;
  }
  return count > 0;
}

#define ASSERT_CUDA_OK(expr)                                                    \
  do {                                                                          \
    const cudaError_t accel_status_ = (expr);                                   \
    ASSERT_EQ(accel_status_, cudaSuccess) << cudaGetErrorString(accel_status_); \
  } while (0)

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HasDevice()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount)";
    ASSERT_CUDA_OK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Device memory of `bytes` (at least 1), freed at the end of the test;
  // cudaMalloc's pointers are 256-byte aligned.
  uint8_t* Alloc(size_t bytes) {
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, std::max<size_t>(bytes, 1));
    EXPECT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
    allocations_.push_back(p);
    return static_cast<uint8_t*>(p);
  }
  // A copy of `host` at `offset` bytes into a fresh allocation (an offset
  // makes a misaligned pointer).
  template <typename T>
  T* Upload(const std::vector<T>& host, size_t offset = 0) {
    uint8_t* base = Alloc(host.size() * sizeof(T) + offset);
    const cudaError_t status =
        cudaMemcpy(base + offset, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    EXPECT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
    return reinterpret_cast<T*>(base + offset);
  }
  // Waits for the stream, then copies `count` elements back.
  template <typename T>
  std::vector<T> Download(const void* device, size_t count) {
    std::vector<T> host(count);
    cudaError_t status = cudaStreamSynchronize(stream_);
    EXPECT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
    status = cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost);
    EXPECT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
    return host;
  }
  void DownloadInto(const void* device, Values& out) {
    out.bytes() = Download<uint8_t>(device, out.bytes().size());
  }

  cudaStream_t stream_ = nullptr;

 private:
  std::vector<void*> allocations_;
};

// --- Dequantize4bit --------------------------------------------------------

TEST_F(CudaKernelsTest, Dequantize4bitWorkedExample) {
  // Reference §1.2: bytes 0xC0, 0x7C with absmax 2 are 0.8814197, -2, 0, 0.8814197.
  const std::vector<float> nf4 = Table(kNf4Bits);
  const uint8_t* packed = Upload(std::vector<uint8_t>{0xC0, 0x7C});
  const float* absmax = Upload(std::vector<float>{2.0f});
  const float* code = Upload(nf4);
  float* out = reinterpret_cast<float*>(Alloc(4 * sizeof(float)));
  ASSERT_CUDA_OK(Dequantize4bit(packed, absmax, code, 4, 64, DType::kFloat32, out, stream_));
  const std::vector<float> got = Download<float>(out, 4);
  EXPECT_EQ(got[0], 2.0f * nf4[12]);
  EXPECT_NEAR(got[0], 0.8814197, 1e-7);
  EXPECT_EQ(got[1], -2.0f);
  EXPECT_EQ(got[2], 0.0f);
  EXPECT_EQ(got[3], got[0]);
}

struct DequantCase {
  int64_t n;
  int64_t blocksize;
  size_t packed_offset;  // bytes: a misaligned packed pointer
  size_t out_offset;     // elements: a misaligned output
};

TEST_F(CudaKernelsTest, Dequantize4bitIsBitExact) {
  const DequantCase cases[] = {
      {64 * 4096, 64, 0, 0},                     // whole vectors
      {1001, 64, 0, 0},                          // odd n, a partial last block
      {12345, 32, 0, 0},     {777, 4096, 0, 0},  // one partial block
      {1, 64, 0, 0},         {999, 3, 0, 0},     // several blocks inside one thread's 8 values
      {64, 1, 0, 0},         {4099, 64, 1, 1},   // misaligned: element by element
      {4096, 128, 2, 0},     {4096, 64, 0, 3},
  };
  std::mt19937_64 rng(1);
  for (const auto& table : {kNf4Bits, kFp4Bits}) {
    const std::vector<float> code = Table(table);
    const float* code_d = Upload(code);
    for (const DequantCase& c : cases) {
      const int64_t nblocks = (c.n + c.blocksize - 1) / c.blocksize;
      const std::vector<uint8_t> packed = RandomBytes(static_cast<size_t>((c.n + 1) / 2), rng);
      const std::vector<float> absmax = RandomAbsmax(static_cast<size_t>(nblocks), rng);
      const uint8_t* packed_d = Upload(packed, c.packed_offset);
      const float* absmax_d = Upload(absmax);
      for (DType dtype : kDTypes) {
        SCOPED_TRACE(std::string(DTypeName(dtype)) + " n=" + std::to_string(c.n) + " blocksize=" +
                     std::to_string(c.blocksize) + " offsets=" + std::to_string(c.packed_offset) +
                     "," + std::to_string(c.out_offset) + (table == kNf4Bits ? " nf4" : " fp4"));
        const size_t size = static_cast<size_t>(DTypeSize(dtype));
        uint8_t* out_base = Alloc((static_cast<size_t>(c.n) + c.out_offset) * size);
        uint8_t* out = out_base + c.out_offset * size;
        ASSERT_CUDA_OK(
            Dequantize4bit(packed_d, absmax_d, code_d, c.n, c.blocksize, dtype, out, stream_));
        Values got(dtype, static_cast<size_t>(c.n));
        DownloadInto(out, got);
        const Values want = ReferenceDequantize(packed, absmax, code, c.n, c.blocksize, dtype);
        int64_t mismatches = 0;
        for (size_t j = 0; j < got.size(); ++j) {
          if (got.Pattern(j) != want.Pattern(j) && ++mismatches <= 5) {
            ADD_FAILURE() << "element " << j << ": got " << got.Get(j) << " (0x" << std::hex
                          << got.Pattern(j) << "), want " << want.Get(j) << " (0x"
                          << want.Pattern(j) << ")" << std::dec;
          }
        }
        EXPECT_EQ(mismatches, 0);
      }
    }
  }
}

TEST_F(CudaKernelsTest, Dequantize4bitOfNothingWritesNothing) {
  const float* code = Upload(Table(kNf4Bits));
  const std::vector<float> sentinel = {7.0f};
  float* out = Upload(sentinel);
  const uint8_t* packed = Upload(std::vector<uint8_t>{0});
  const float* absmax = Upload(std::vector<float>{1.0f});
  ASSERT_CUDA_OK(Dequantize4bit(packed, absmax, code, 0, 64, DType::kFloat32, out, stream_));
  EXPECT_EQ(Download<float>(out, 1), sentinel);
}

// --- DequantizeAbsmaxDq ----------------------------------------------------

TEST_F(CudaKernelsTest, DequantizeAbsmaxDqIsBitExact) {
  std::mt19937_64 rng(2);
  const std::vector<float> map = RandomFloats(256, -1.0f, 1.0f, rng);
  const float* map_d = Upload(map);
  for (int64_t nblocks : {int64_t{1}, int64_t{255}, int64_t{257}, int64_t{1000}, int64_t{262144}}) {
    SCOPED_TRACE("nblocks=" + std::to_string(nblocks));
    const std::vector<uint8_t> codes = RandomBytes(static_cast<size_t>(nblocks), rng);
    const std::vector<float> nested = RandomFloats(
        static_cast<size_t>((nblocks + kNestedBlocksize - 1) / kNestedBlocksize), 0.01f, 3.0f, rng);
    const float offset = RandomFloats(1, 0.01f, 0.5f, rng)[0];
    const uint8_t* codes_d = Upload(codes);
    const float* nested_d = Upload(nested);
    float* out = reinterpret_cast<float*>(Alloc(static_cast<size_t>(nblocks) * sizeof(float)));
    ASSERT_CUDA_OK(DequantizeAbsmaxDq(codes_d, nested_d, map_d, offset, nblocks, out, stream_));
    const std::vector<float> got = Download<float>(out, static_cast<size_t>(nblocks));
    int64_t mismatches = 0;
    for (int64_t b = 0; b < nblocks; ++b) {
      // Two roundings, in this order (reference §2.2).
      const float scaled =
          map[codes[static_cast<size_t>(b)]] * nested[static_cast<size_t>(b / kNestedBlocksize)];
      const float want = scaled + offset;
      if (Bits(got[static_cast<size_t>(b)]) != Bits(want) && ++mismatches <= 5) {
        ADD_FAILURE() << "block " << b << ": got " << got[static_cast<size_t>(b)] << ", want "
                      << want;
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
}

// --- Gemv4bit --------------------------------------------------------------

struct GemvCase {
  int64_t n_rows, k, blocksize;
  bool bias;
  size_t x_offset;  // elements: a misaligned x takes the element path
};

const GemvCase kGemvCases[] = {
    {4096, 4096, 64, true, 0}, {11008, 4096, 64, false, 0},  // Llama-7B's q_proj, gate_proj
    {64, 96, 64, true, 0},                                // K % 32 == 0 with blocks crossing rows
    {37, 200, 64, true, 0},                               // K % 32 != 0: the element path
    {5, 77, 32, false, 0},                                // odd K: rows start at a low nibble
    {3, 4096, 4096, true, 0},  {256, 4096, 64, true, 1},  // misaligned x
    {2, 0, 64, true, 0},                                  // empty rows: y = bias
    {24, 11008, 128, true, 0},  // down_proj's K: 344 chunks, a lane loops past kUnroll
};

struct GemvInputs {
  std::vector<uint8_t> packed;
  std::vector<float> absmax;
  Values x, bias;
  GemvInputs(DType dtype, int64_t k, int64_t n_rows)
      : x(dtype, static_cast<size_t>(k)), bias(dtype, static_cast<size_t>(n_rows)) {}
};

class CudaGemvTest : public CudaKernelsTest {
 protected:
  // Runs the kernel on `in` and returns y [n_rows].
  Values Run(const GemvInputs& in, const std::vector<float>& code, const GemvCase& c, DType dtype) {
    const size_t size = static_cast<size_t>(DTypeSize(dtype));
    const uint8_t* x = Upload(in.x.bytes(), c.x_offset * size);
    const uint8_t* bias = c.bias ? Upload(in.bias.bytes()) : nullptr;
    uint8_t* y = Alloc(static_cast<size_t>(c.n_rows) * size);
    const cudaError_t status = Gemv4bit(x, Upload(in.packed), Upload(in.absmax), Upload(code),
                                        c.n_rows, c.k, c.blocksize, bias, dtype, y, stream_);
    EXPECT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
    Values out(dtype, static_cast<size_t>(c.n_rows));
    DownloadInto(y, out);
    return out;
  }
};

// `v` rounded to nearest even into dtype, as a double.
double Rounded(DType dtype, float v) {
  switch (dtype) {
    case DType::kFloat32:
      return v;
    case DType::kBFloat16:
      return DecodeBFloat16(ToBFloat16(v));
    case DType::kFloat16:
      return DecodeHalf(ToHalf(v));
  }
  return std::numeric_limits<double>::quiet_NaN();
}

// Whether the product of m rows runs in the tensor-core kernel's scaled
// form (internal/gemv_mma.h; x at `x_offset` elements past an aligned
// address): its weights are the code rounded to dtype times the absmax.
bool ScaledRuns(int64_t m, int64_t k, int64_t blocksize, DType dtype, size_t x_offset,
                internal::GemvKernel kernel) {
  alignas(16) static const uint8_t aligned[64] = {};
  const void* x = aligned + x_offset * static_cast<size_t>(DTypeSize(dtype));
  return kernel == internal::GemvKernel::kMmaScaled ||
         kernel == internal::GemvKernel::kMmaScaled3 ||
         (kernel == internal::GemvKernel::kAuto && internal::UseScaledGemv() &&
          internal::ScaledApplies(m, k, blocksize, dtype, x, static_cast<const void*>(aligned)));
}

// Weight j as the product sees it: dequantized into dtype (reference §1.4),
// or, in the scaled form, the code rounded to dtype times the absmax.
double ReferenceWeight(const std::vector<uint8_t>& packed, const std::vector<float>& absmax,
                       const std::vector<float>& code, int64_t blocksize, int64_t j, DType dtype,
                       bool scaled) {
  const uint8_t byte = packed[static_cast<size_t>(j / 2)];
  const int nibble = j % 2 == 0 ? byte >> 4 : byte & 0xF;
  const float a = absmax[static_cast<size_t>(j / blocksize)];
  return scaled ? Rounded(dtype, code[static_cast<size_t>(nibble)]) * static_cast<double>(a)
                : Rounded(dtype, code[static_cast<size_t>(nibble)] * a);
}

// Row r of the weight as the product sees it (flat index r * K + i).
void ReferenceRow(const GemvInputs& in, const std::vector<float>& code, const GemvCase& c,
                  int64_t r, DType dtype, std::vector<double>& w, bool scaled = false) {
  w.resize(static_cast<size_t>(c.k));
  for (int64_t i = 0; i < c.k; ++i) {
    w[static_cast<size_t>(i)] =
        ReferenceWeight(in.packed, in.absmax, code, c.blocksize, r * c.k + i, dtype, scaled);
  }
}

std::vector<double> Decoded(const Values& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = v.Get(i);
  return out;
}

TEST_F(CudaGemvTest, WithinTheFloat32SummationBound) {
  std::mt19937_64 rng(3);
  const std::vector<float> code = Table(kNf4Bits);
  for (const GemvCase& c : kGemvCases) {
    const int64_t n = c.n_rows * c.k;
    for (DType dtype : kDTypes) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " " + std::to_string(c.n_rows) + "x" +
                   std::to_string(c.k) + " blocksize=" + std::to_string(c.blocksize));
      GemvInputs in(dtype, c.k, c.n_rows);
      in.packed = RandomBytes(static_cast<size_t>((n + 1) / 2), rng);
      in.absmax =
          RandomFloats(static_cast<size_t>((n + c.blocksize - 1) / c.blocksize), 0.5f, 2.0f, rng);
      const std::vector<float> x = RandomFloats(static_cast<size_t>(c.k), -1.0f, 1.0f, rng);
      const std::vector<float> bias = RandomFloats(static_cast<size_t>(c.n_rows), -1, 1, rng);
      for (size_t i = 0; i < x.size(); ++i) in.x.Set(i, x[i]);
      for (size_t i = 0; i < bias.size(); ++i) in.bias.Set(i, bias[i]);
      const Values y = Run(in, code, c, dtype);
      const bool scaled =
          ScaledRuns(1, c.k, c.blocksize, dtype, c.x_offset, internal::GemvKernel::kAuto);

      // |y - exact| <= gamma(K + 1) * (sum |x w| + |b|) for the float32 sums
      // in any order (the scaled form: a rounding more a block of 64), plus
      // half an ulp of dtype for the final rounding.
      const double u = std::ldexp(1.0, -24);
      const double terms = static_cast<double>(c.k + 1 + (scaled ? c.k / 64 + 1 : 0));
      const double gamma = terms * u / (1 - terms * u);
      const double u_out = dtype == DType::kBFloat16  ? std::ldexp(1.0, -8)
                           : dtype == DType::kFloat16 ? std::ldexp(1.0, -11)
                                                      : 0.0;
      const std::vector<double> xd = Decoded(in.x);
      std::vector<double> w;
      int64_t failures = 0;
      for (int64_t r = 0; r < c.n_rows; ++r) {
        ReferenceRow(in, code, c, r, dtype, w, scaled);
        double exact = c.bias ? in.bias.Get(static_cast<size_t>(r)) : 0.0;
        double magnitude = std::fabs(exact);
        for (int64_t i = 0; i < c.k; ++i) {
          const double p = xd[static_cast<size_t>(i)] * w[static_cast<size_t>(i)];
          exact += p;
          magnitude += std::fabs(p);
        }
        const double bound = gamma * magnitude + u_out * (std::fabs(exact) + gamma * magnitude) +
                             std::ldexp(1.0, -30);
        const double got = y.Get(static_cast<size_t>(r));
        if (!(std::fabs(got - exact) <= bound) && ++failures <= 5) {
          ADD_FAILURE() << "row " << r << ": got " << got << ", exact " << exact << ", bound "
                        << bound;
        }
      }
      EXPECT_EQ(failures, 0);
    }
  }
}

TEST_F(CudaGemvTest, BitExactWhenEverySumIsExact) {
  // Codes (i - 8) / 8, scales 2^-1..2^2, integer x and bias: every weight is
  // exact in bfloat16 and float16, every product a multiple of 1/16 below
  // 2^5 and every partial sum below 2^17, so float32 sums exactly in any
  // order and y is the exact sum rounded once to dtype.
  std::vector<float> code(16);
  for (int i = 0; i < 16; ++i) code[static_cast<size_t>(i)] = static_cast<float>(i - 8) / 8.0f;
  std::mt19937_64 rng(4);
  std::uniform_int_distribution<int> small(-8, 8), exponent(-1, 2), bias_value(-16, 16);
  for (const GemvCase& c : kGemvCases) {
    const int64_t n = c.n_rows * c.k;
    for (DType dtype : kDTypes) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " " + std::to_string(c.n_rows) + "x" +
                   std::to_string(c.k) + " blocksize=" + std::to_string(c.blocksize));
      GemvInputs in(dtype, c.k, c.n_rows);
      in.packed = RandomBytes(static_cast<size_t>((n + 1) / 2), rng);
      in.absmax.resize(static_cast<size_t>((n + c.blocksize - 1) / c.blocksize));
      for (auto& a : in.absmax) a = std::ldexp(1.0f, exponent(rng));
      for (size_t i = 0; i < in.x.size(); ++i) in.x.Set(i, static_cast<float>(small(rng)));
      for (size_t i = 0; i < in.bias.size(); ++i) {
        in.bias.Set(i, static_cast<float>(bias_value(rng)));
      }
      const Values y = Run(in, code, c, dtype);
      const std::vector<double> xd = Decoded(in.x);
      std::vector<double> w;
      int64_t failures = 0;
      for (int64_t r = 0; r < c.n_rows; ++r) {
        ReferenceRow(in, code, c, r, dtype, w);
        double exact = c.bias ? in.bias.Get(static_cast<size_t>(r)) : 0.0;
        for (int64_t i = 0; i < c.k; ++i)
          exact += xd[static_cast<size_t>(i)] * w[static_cast<size_t>(i)];
        Values want(dtype, 1);
        want.Set(0, static_cast<float>(exact));
        if (y.Pattern(static_cast<size_t>(r)) != want.Pattern(0) && ++failures <= 5) {
          ADD_FAILURE() << "row " << r << ": got " << y.Get(static_cast<size_t>(r)) << ", want "
                        << want.Get(0);
        }
      }
      EXPECT_EQ(failures, 0);
    }
  }
}

TEST_F(CudaGemvTest, WeightsAreRoundedToTheActivationTypeFirst) {
  // Even elements decode to 1 + 2^-12, odd ones to 1; x is +1 on even and -1
  // on odd elements. Rounded to bfloat16 or float16 first (as Dequantize4bit
  // does), both weights are 1 and y is 0; in float32, y = K/2 * 2^-12.
  std::vector<float> code(16, 0.0f);
  code[0] = 1.0f;
  code[1] = 1.0f + std::ldexp(1.0f, -12);
  for (const int64_t k : {int64_t{4096}, int64_t{1000}}) {  // the chunk path, the element path
    const GemvCase c = {2, k, 64, false, 0};
    for (DType dtype : kDTypes) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " K=" + std::to_string(k));
      GemvInputs in(dtype, c.k, c.n_rows);
      in.packed.assign(static_cast<size_t>(c.n_rows * c.k / 2), 0x10);
      in.absmax.assign(static_cast<size_t>((c.n_rows * c.k + 63) / 64), 1.0f);
      for (size_t i = 0; i < in.x.size(); ++i) in.x.Set(i, i % 2 == 0 ? 1.0f : -1.0f);
      const Values y = Run(in, code, c, dtype);
      const double want = dtype == DType::kFloat32 ? static_cast<double>(k / 2) / 4096.0 : 0.0;
      EXPECT_EQ(y.Get(0), want);
      EXPECT_EQ(y.Get(1), want);
    }
  }
}

// Several activation rows at once (Gemv4bitRows), and each GEMV kernel on
// its own (the tensor-core one and the warp-per-row one, internal/gemv.h):
// every row of y within the float32 summation bound of its reference.
struct RowsCase {
  int64_t n_rows, k, blocksize, m;
  bool bias;
};

class CudaGemvRowsTest : public CudaKernelsTest {
 protected:
  // y [m, n_rows] through `kernel`; x [m, k] random in [-1, 1], NF4 weights.
  void Check(const RowsCase& c, DType dtype, internal::GemvKernel kernel) {
    SCOPED_TRACE(std::string(DTypeName(dtype)) + " " + std::to_string(c.n_rows) + "x" +
                 std::to_string(c.k) + " blocksize=" + std::to_string(c.blocksize) + " m=" +
                 std::to_string(c.m) + " kernel=" + std::to_string(static_cast<int>(kernel)));
    std::mt19937_64 rng(5);
    const std::vector<float> code = Table(kNf4Bits);
    const int64_t n = c.n_rows * c.k;
    const std::vector<uint8_t> packed = RandomBytes(static_cast<size_t>(n / 2), rng);
    const std::vector<float> absmax =
        RandomFloats(static_cast<size_t>((n + c.blocksize - 1) / c.blocksize), 0.5f, 2.0f, rng);
    Values x(dtype, static_cast<size_t>(c.m * c.k)), bias(dtype, static_cast<size_t>(c.n_rows));
    const std::vector<float> xs = RandomFloats(x.size(), -1.0f, 1.0f, rng);
    const std::vector<float> bs = RandomFloats(bias.size(), -1.0f, 1.0f, rng);
    for (size_t i = 0; i < xs.size(); ++i) x.Set(i, xs[i]);
    for (size_t i = 0; i < bs.size(); ++i) bias.Set(i, bs[i]);
    const size_t size = static_cast<size_t>(DTypeSize(dtype));
    uint8_t* y = Alloc(static_cast<size_t>(c.m * c.n_rows) * size);
    const cudaError_t status = internal::Gemv4bitWith(
        kernel, Upload(x.bytes()), c.m, Upload(packed), Upload(absmax), Upload(code), c.n_rows, c.k,
        c.blocksize, c.bias ? Upload(bias.bytes()) : nullptr, dtype, y, stream_);
    ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
    Values got(dtype, static_cast<size_t>(c.m * c.n_rows));
    DownloadInto(y, got);
    const bool scaled = ScaledRuns(c.m, c.k, c.blocksize, dtype, 0, kernel);
    const double u = std::ldexp(1.0, -24);
    const double terms = static_cast<double>(c.k + 1 + (scaled ? c.k / 64 + 1 : 0));
    const double gamma = terms * u / (1 - terms * u);
    const double u_out = dtype == DType::kBFloat16  ? std::ldexp(1.0, -8)
                         : dtype == DType::kFloat16 ? std::ldexp(1.0, -11)
                                                    : 0.0;
    int64_t failures = 0;
    for (int64_t r = 0; r < c.n_rows; ++r) {
      std::vector<double> w(static_cast<size_t>(c.k));
      for (int64_t i = 0; i < c.k; ++i) {
        w[static_cast<size_t>(i)] =
            ReferenceWeight(packed, absmax, code, c.blocksize, r * c.k + i, dtype, scaled);
      }
      for (int64_t m = 0; m < c.m; ++m) {
        double exact = c.bias ? bias.Get(static_cast<size_t>(r)) : 0.0;
        double magnitude = std::fabs(exact);
        for (int64_t i = 0; i < c.k; ++i) {
          const double p = x.Get(static_cast<size_t>(m * c.k + i)) * w[static_cast<size_t>(i)];
          exact += p;
          magnitude += std::fabs(p);
        }
        const double bound = gamma * magnitude + u_out * (std::fabs(exact) + gamma * magnitude) +
                             std::ldexp(1.0, -30);
        const double have = got.Get(static_cast<size_t>(m * c.n_rows + r));
        if (!(std::fabs(have - exact) <= bound) && ++failures <= 5) {
          ADD_FAILURE() << "x row " << m << ", row " << r << ": got " << have << ", exact " << exact
                        << ", bound " << bound;
        }
      }
    }
    EXPECT_EQ(failures, 0);
  }
};

TEST_F(CudaGemvRowsTest, TensorCoreKernelWithinTheBound) {
  const RowsCase cases[] = {
      {4096, 4096, 64, 1, true},   {11008, 4096, 64, 1, false}, {4096, 11008, 64, 1, true},
      {37, 512, 128, 3, false},    {16, 256, 256, 8, true},     {50, 2304, 64, 2, true},
      {14336, 4096, 64, 8, false}, {4096, 14336, 64, 4, true},
  };
  for (const RowsCase& c : cases) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      ASSERT_TRUE(internal::MmaApplies(c.m, c.k, c.blocksize, dtype,
                                       reinterpret_cast<const void*>(256),
                                       reinterpret_cast<const void*>(256)));
      Check(c, dtype, internal::GemvKernel::kMma);
      // Its pipelined form (by name only).
      if (c.m <= 4) Check(c, dtype, internal::GemvKernel::kMmaPipelined);
      // Its scaled form (kAuto's up to 8 rows), by name and through kAuto.
      Check(c, dtype, internal::GemvKernel::kMmaScaled);
      Check(c, dtype, internal::GemvKernel::kMmaScaled3);
      Check(c, dtype, internal::GemvKernel::kAuto);
    }
  }
  // The pipelined form takes up to 4 rows only.
  alignas(16) static uint8_t buffer[64];
  EXPECT_EQ(internal::Gemv4bitWith(internal::GemvKernel::kMmaPipelined, buffer, 5, buffer,
                                   reinterpret_cast<const float*>(buffer),
                                   reinterpret_cast<const float*>(buffer), 1, 256, 64, nullptr,
                                   DType::kBFloat16, buffer, stream_),
            cudaErrorInvalidValue);
}

// The tensor-core kernel's tiled form (kAuto's above 8 rows): a tile partly
// used and whole ones, up to 32 rows, an 8B model's K among them (fewer
// rows of W: the reference runs on the host); at 8 rows and fewer by name.
TEST_F(CudaGemvRowsTest, TiledTensorCoreKernelWithinTheBound) {
  const RowsCase cases[] = {
      {2048, 4096, 64, 32, false}, {512, 14336, 64, 17, true}, {1024, 4096, 64, 24, true},
      {37, 512, 128, 9, false},    {16, 256, 256, 32, true},   {50, 2304, 64, 16, true},
      {1024, 4096, 64, 8, false},  {4096, 4096, 64, 1, true},
  };
  for (const RowsCase& c : cases) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      ASSERT_TRUE(internal::MmaTiledApplies(c.m, c.k, c.blocksize, dtype,
                                            reinterpret_cast<const void*>(256),
                                            reinterpret_cast<const void*>(256)));
      Check(c, dtype, internal::GemvKernel::kMmaTiled);
      if (c.m > 8) Check(c, dtype, internal::GemvKernel::kAuto);
      // The wide form: 128 rows of W a CTA, K split where W has few rows.
      Check(c, dtype, internal::GemvKernel::kMmaWide);
    }
  }
  alignas(16) static uint8_t buffer[16];
  EXPECT_TRUE(Gemv4bitRowsFused(32, 4096, 64, DType::kBFloat16, buffer, buffer));
  EXPECT_TRUE(Gemv4bitRowsFused(9, 256, 64, DType::kFloat16, buffer, buffer));
  EXPECT_FALSE(Gemv4bitRowsFused(33, 4096, 64, DType::kBFloat16, buffer, buffer));
  EXPECT_FALSE(Gemv4bitRowsFused(16, 4096, 64, DType::kFloat32, buffer, buffer));
}

TEST_F(CudaGemvRowsTest, RowsWhereTheTensorCoresCannotGoOneByOne) {
  // float32 activations, K % 256 != 0, blocks of 32: the warp-per-row
  // kernel, a row of x at a time, and Gemv4bitRowsFused says so.
  const RowsCase cases[] = {{64, 4096, 64, 3, true},
                            {37, 320, 64, 2, false},
                            {24, 512, 32, 4, true},
                            {24, 512, 32, 12, false}};
  for (const RowsCase& c : cases) {
    for (DType dtype : kDTypes) {
      Check(c, dtype, internal::GemvKernel::kAuto);
      Check(c, dtype, internal::GemvKernel::kChunk);
    }
  }
  alignas(16) static uint8_t buffer[16];
  EXPECT_FALSE(Gemv4bitRowsFused(3, 4096, 64, DType::kFloat32, buffer, buffer));
  EXPECT_FALSE(Gemv4bitRowsFused(2, 320, 64, DType::kBFloat16, buffer, buffer));
  EXPECT_TRUE(Gemv4bitRowsFused(8, 4096, 64, DType::kBFloat16, buffer, buffer));
  EXPECT_TRUE(Gemv4bitRowsFused(1, 320, 32, DType::kFloat32, buffer, buffer));  // one row: always
  EXPECT_EQ(internal::Gemv4bitWith(internal::GemvKernel::kMma, buffer, 1, buffer,
                                   reinterpret_cast<const float*>(buffer),
                                   reinterpret_cast<const float*>(buffer), 1, 320, 64, nullptr,
                                   DType::kBFloat16, buffer, stream_),
            cudaErrorInvalidValue);
}

TEST_F(CudaGemvRowsTest, WarpPerRowKernelStillRightOnTensorCoreShapes) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    Check({4096, 4096, 64, 1, true}, dtype, internal::GemvKernel::kChunk);
  }
}

// The wide form's arguments, refused before anything runs (no device
// needed): more than 32 rows, K not whole chunks, too small a workspace
// where K is split (W of 1024 rows fills no device: its sums need one).
// A mixture of experts' routed rows: each slot's row is Gemv4bit's for its
// expert and x row, bit for bit, in the scaled form (kAuto's) and the first
// (ACCEL_CUDA_4BIT_GEMV=exact's); an index outside the experts gives zeros.
// Mixtral's expert shapes (gate / up [14336, 4096], down [4096, 14336]),
// three experts, slots as a decode step of two tokens at top 2 makes them.
TEST_F(CudaKernelsTest, Gemv4bitExpertsGivesEachSlotItsExpertsRowBitForBit) {
  struct Shape {
    int64_t n_rows, k, slots_per_x;
  };
  for (const Shape& shape : {Shape{14336, 4096, 2}, Shape{4096, 14336, 1}}) {
    for (bool scaled : {true, false}) {
      for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        SCOPED_TRACE(std::string(DTypeName(dtype)) + " " + std::to_string(shape.n_rows) + "x" +
                     std::to_string(shape.k) + (scaled ? " scaled" : " first form"));
        internal::SetScaledGemv(scaled);
        std::mt19937_64 rng(31);
        const int64_t n = shape.n_rows * shape.k, experts = 3;
        const std::vector<float> code = Table(kNf4Bits);
        std::vector<const uint8_t*> packed;
        std::vector<const float*> absmax, codes;
        for (int64_t e = 0; e < experts; ++e) {
          packed.push_back(Upload(RandomBytes(static_cast<size_t>(n / 2), rng)));
          absmax.push_back(Upload(RandomFloats(static_cast<size_t>(n / 64), 0.5f, 2.0f, rng)));
          codes.push_back(Upload(code));
        }
        const std::vector<int64_t> ids = {2, 0, 1, 2, 3, -1};
        const int64_t slots = static_cast<int64_t>(ids.size());
        const int64_t x_rows = (slots + shape.slots_per_x - 1) / shape.slots_per_x;
        Values x(dtype, static_cast<size_t>(x_rows * shape.k));
        const std::vector<float> xs = RandomFloats(x.size(), -1.0f, 1.0f, rng);
        for (size_t i = 0; i < xs.size(); ++i) x.Set(i, xs[i]);
        const uint8_t* x_device = Upload(x.bytes());
        const size_t size = static_cast<size_t>(DTypeSize(dtype));
        uint8_t* y = Alloc(static_cast<size_t>(slots * shape.n_rows) * size);
        ASSERT_CUDA_OK(Gemv4bitExperts(x_device, shape.slots_per_x, Upload(ids), slots,
                                       Upload(packed), Upload(absmax), Upload(codes), experts,
                                       shape.n_rows, shape.k, 64, dtype, y, stream_));
        const std::vector<uint8_t> got =
            Download<uint8_t>(y, static_cast<size_t>(slots * shape.n_rows) * size);
        uint8_t* one = Alloc(static_cast<size_t>(shape.n_rows) * size);
        for (int64_t s = 0; s < slots; ++s) {
          SCOPED_TRACE("slot " + std::to_string(s));
          const int64_t e = ids[static_cast<size_t>(s)];
          std::vector<uint8_t> want(static_cast<size_t>(shape.n_rows) * size, 0);
          if (e >= 0 && e < experts) {
            ASSERT_CUDA_OK(Gemv4bit(x_device + (s / shape.slots_per_x) * shape.k * size,
                                    packed[static_cast<size_t>(e)], absmax[static_cast<size_t>(e)],
                                    codes[static_cast<size_t>(e)], shape.n_rows, shape.k, 64,
                                    nullptr, dtype, one, stream_));
            want = Download<uint8_t>(one, want.size());
          }
          const auto first = got.begin() + s * shape.n_rows * static_cast<int64_t>(size);
          EXPECT_TRUE(std::equal(want.begin(), want.end(), first));
        }
      }
    }
  }
  internal::SetScaledGemv(true);
  // What the kernel cannot take is refused before the device is touched.
  alignas(16) static uint8_t buffer[64];
  const auto* table = reinterpret_cast<const float* const*>(buffer);
  EXPECT_EQ(Gemv4bitExperts(buffer, 1, reinterpret_cast<const int64_t*>(buffer), 1,
                            reinterpret_cast<const uint8_t* const*>(buffer), table, table, 1, 16,
                            4000, 64, DType::kBFloat16, buffer, stream_),
            cudaErrorInvalidValue);  // K not a multiple of 256
  EXPECT_EQ(Gemv4bitExperts(buffer, 1, reinterpret_cast<const int64_t*>(buffer), 1,
                            reinterpret_cast<const uint8_t* const*>(buffer), table, table, 1, 16,
                            4096, 64, DType::kFloat32, buffer, stream_),
            cudaErrorInvalidValue);  // float32 activations
  EXPECT_EQ(Gemv4bitExperts(buffer, 0, reinterpret_cast<const int64_t*>(buffer), 1,
                            reinterpret_cast<const uint8_t* const*>(buffer), table, table, 1, 16,
                            4096, 64, DType::kBFloat16, buffer, stream_),
            cudaErrorInvalidValue);  // no slots per row of x
}

TEST(CudaGemvArgumentsTest, TheWideFormRefusesWhatItCannotTake) {
  alignas(16) static uint8_t buffer[64];
  const float* f = reinterpret_cast<const float*>(buffer);
  EXPECT_TRUE(Gemm4bitRowsWideTakes(32, 4096, 64, DType::kBFloat16, buffer, buffer));
  EXPECT_FALSE(Gemm4bitRowsWideTakes(33, 4096, 64, DType::kBFloat16, buffer, buffer));
  EXPECT_FALSE(Gemm4bitRowsWideTakes(16, 4096 + 64, 64, DType::kBFloat16, buffer, buffer));
  EXPECT_FALSE(Gemm4bitRowsWideTakes(16, 4096, 64, DType::kFloat32, buffer, buffer));
  EXPECT_GT(Gemm4bitRowsWideWorkspace(16, 1024, 4096), 0);
  EXPECT_EQ(Gemm4bitRowsWideWorkspace(16, 1024, 4096) % (16 * 1024 * 4), 0);
  EXPECT_EQ(Gemm4bitRowsWide(buffer, 16, buffer, f, f, 1024, 4096, 64, nullptr, DType::kBFloat16,
                             buffer, nullptr, 0, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(Gemm4bitRowsWide(buffer, 33, buffer, f, f, 1024, 4096, 64, nullptr, DType::kBFloat16,
                             buffer, nullptr, 1 << 30, nullptr),
            cudaErrorInvalidValue);
}

TEST(CudaGemvArgumentsTest, RowsOutOfRangeAreRefused) {
  alignas(16) static uint8_t buffer[64];
  const float* f = reinterpret_cast<const float*>(buffer);
  EXPECT_EQ(
      Gemv4bitRows(buffer, 0, buffer, f, f, 4, 256, 64, nullptr, DType::kBFloat16, buffer, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(Gemv4bitRows(buffer, 33, buffer, f, f, 4, 256, 64, nullptr, DType::kBFloat16, buffer,
                         nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(Gemv4bitRows(nullptr, 1, buffer, f, f, 4, 256, 64, nullptr, DType::kBFloat16, buffer,
                         nullptr),
            cudaErrorInvalidValue);
}

// --- Int8RowQuantize -------------------------------------------------------

struct RowQuantCase {
  int64_t m, k;
  float threshold;
};

TEST_F(CudaKernelsTest, Int8RowQuantizeMatchesTheReference) {
  const RowQuantCase cases[] = {
      {1, 4096, 6.0f}, {7, 1000, 6.0f}, {16, 4096, 0.0f}, {5, 333, 6.0f}, {3, 1, 2.0f},
  };
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (const RowQuantCase& c : cases) {
    SCOPED_TRACE(std::to_string(c.m) + "x" + std::to_string(c.k) +
                 " threshold=" + std::to_string(c.threshold));
    const size_t total = static_cast<size_t>(c.m * c.k);
    std::vector<uint16_t> x(total);
    for (auto& v : x) v = ToHalf(normal(rng));
    if (c.k > 10) {
      // Outliers, the threshold itself (an outlier: >=) and the float16 just
      // below it (not one).
      x[3] = ToHalf(-9.5f);
      x[7] = ToHalf(6.0f);
      x[static_cast<size_t>(c.k - 1)] = ToHalf(5.99609375f);
    }
    if (c.k > 10 && c.m > 2) {
      // A row of zeros, and a row whose scale is 127/64, so 127 / scale = 64
      // and x = (2i + 1) / 128 lands on a tie: half to even, not away.
      for (int64_t i = 0; i < c.k; ++i) {
        x[static_cast<size_t>(c.k + i)] = 0;
        x[static_cast<size_t>(2 * c.k + i)] =
            ToHalf(static_cast<float>(2 * (i % 200) + 1 - 200) / 128.0f);
      }
      x[static_cast<size_t>(2 * c.k)] = ToHalf(127.0f / 64.0f);
    }
    // Reference §3.2 on the host.
    std::vector<uint8_t> want_cols(static_cast<size_t>(c.k), 0);
    const bool decompose = c.threshold > 0.0f;
    for (size_t i = 0; i < total; ++i) {
      if (decompose && std::fabs(DecodeHalf(x[i])) >= c.threshold) {
        want_cols[i % static_cast<size_t>(c.k)] = 1;
      }
    }
    std::vector<float> want_scale(static_cast<size_t>(c.m));
    std::vector<int8_t> want_codes(total);
    for (int64_t r = 0; r < c.m; ++r) {
      float amax = 0.0f;
      for (int64_t i = 0; i < c.k; ++i) {
        const float a =
            std::fabs(static_cast<float>(DecodeHalf(x[static_cast<size_t>(r * c.k + i)])));
        if (!decompose || a < c.threshold) amax = std::max(amax, a);
      }
      want_scale[static_cast<size_t>(r)] = amax;
      const float scale = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t i = 0; i < c.k; ++i) {
        const size_t at = static_cast<size_t>(r * c.k + i);
        const float a = static_cast<float>(DecodeHalf(x[at]));
        want_codes[at] =
            want_cols[static_cast<size_t>(i)] ? 0 : static_cast<int8_t>(std::nearbyint(a * scale));
      }
    }
    if (c.k > 10 && decompose) {
      ASSERT_EQ(want_cols[3], 1);
      ASSERT_EQ(want_cols[7], 1);
      ASSERT_EQ(want_cols[static_cast<size_t>(c.k - 1)], 0);
    }

    const uint16_t* x_d = Upload(x);
    int8_t* codes_d = reinterpret_cast<int8_t*>(Alloc(total));
    float* scale_d = reinterpret_cast<float*>(Alloc(static_cast<size_t>(c.m) * sizeof(float)));
    uint8_t* cols_d = Upload(std::vector<uint8_t>(static_cast<size_t>(c.k), 0xAB));
    ASSERT_CUDA_OK(Int8RowQuantize(x_d, c.m, c.k, c.threshold, codes_d, scale_d, cols_d, stream_));
    EXPECT_EQ(Download<uint8_t>(cols_d, static_cast<size_t>(c.k)), want_cols);
    const std::vector<float> got_scale = Download<float>(scale_d, static_cast<size_t>(c.m));
    EXPECT_EQ(got_scale, want_scale);
    const std::vector<int8_t> got_codes = Download<int8_t>(codes_d, total);
    int64_t mismatches = 0;
    for (size_t i = 0; i < total; ++i) {
      if (got_codes[i] != want_codes[i] && ++mismatches <= 5) {
        ADD_FAILURE() << "element " << i << " (x " << DecodeHalf(x[i]) << "): got "
                      << int{got_codes[i]} << ", want " << int{want_codes[i]};
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
}

// --- Int8Matmul ------------------------------------------------------------

struct MatmulCase {
  int64_t m, n, k;
  size_t offset;  // bytes: misaligned operands load byte by byte
};

TEST_F(CudaKernelsTest, Int8MatmulIsExact) {
  const MatmulCase cases[] = {
      {1, 4096, 4096, 0},
      {17, 300, 4096, 0},
      {65, 129, 1001, 0},  // K % 4 != 0
      {128, 64, 64, 0},
      {33, 70, 512, 1},
      {2, 3, 0, 0},  // K = 0: zeros
      // Decode rows (up to 8): the GEMV where K is whole 16-byte chunks.
      {3, 1000, 4096, 0},
      {8, 257, 11008, 0},  // 688 chunks: three passes of 8 loads a lane
      {5, 64, 48, 0},      // fewer chunks than lanes
      {1, 100, 512, 1},    // misaligned: the tiled kernel
      {2, 9, 40, 0},       // K % 16 != 0: likewise
  };
  // Int8Matmul, then each kernel where it applies: the same exact c.
  using Entry = cudaError_t (*)(const int8_t*, const int8_t*, int64_t, int64_t, int64_t, int32_t*,
                                cudaStream_t);
  const Entry entries[] = {&Int8Matmul, &internal::Int8MatmulTiled, &internal::Int8Gemv};
  std::mt19937_64 rng(6);
  for (const MatmulCase& c : cases) {
    for (size_t e = 0; e < std::size(entries); ++e) {
      const Entry entry = entries[e];
      SCOPED_TRACE(std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k) +
                   " offset=" + std::to_string(c.offset) + " entry " + std::to_string(e));
      std::vector<int8_t> a(static_cast<size_t>(c.m * c.k)), b(static_cast<size_t>(c.n * c.k));
      for (auto* v : {&a, &b}) {
        for (int8_t& e : *v) e = static_cast<int8_t>(static_cast<int>(rng() % 256) - 128);
      }
      const int8_t* a_d = Upload(a, c.offset);
      const int8_t* b_d = Upload(b, c.offset);
      if (entry == &internal::Int8Gemv && !internal::Int8GemvApplies(c.m, c.k, a_d, b_d)) continue;
      int32_t* c_d = reinterpret_cast<int32_t*>(Alloc(static_cast<size_t>(c.m * c.n) * 4));
      ASSERT_CUDA_OK(entry(a_d, b_d, c.m, c.n, c.k, c_d, stream_));
      const std::vector<int32_t> got = Download<int32_t>(c_d, static_cast<size_t>(c.m * c.n));
      int64_t mismatches = 0;
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < c.n; ++j) {
          int64_t want = 0;
          for (int64_t l = 0; l < c.k; ++l) {
            want +=
                int64_t{a[static_cast<size_t>(i * c.k + l)]} * b[static_cast<size_t>(j * c.k + l)];
          }
          const int32_t g = got[static_cast<size_t>(i * c.n + j)];
          if (g != want && ++mismatches <= 5) {
            ADD_FAILURE() << "C[" << i << "," << j << "]: got " << g << ", want " << want;
          }
        }
      }
      EXPECT_EQ(mismatches, 0);
    }
  }
  // Which kernel takes what.
  alignas(16) static int8_t buffer[32];
  EXPECT_TRUE(internal::Int8GemvApplies(8, 4096, buffer, buffer));
  EXPECT_FALSE(internal::Int8GemvApplies(9, 4096, buffer, buffer));
  EXPECT_FALSE(internal::Int8GemvApplies(1, 4104, buffer, buffer));
  EXPECT_FALSE(internal::Int8GemvApplies(1, 4096, buffer + 4, buffer));
  EXPECT_EQ(
      internal::Int8Gemv(buffer, buffer, 9, 4, 16, reinterpret_cast<int32_t*>(buffer), stream_),
      cudaErrorInvalidValue);
}

TEST_F(CudaKernelsTest, Int8MatmulAtTheExtremes) {
  // -128 * -128 summed 4096 times: 2^26, far past float32's exact integers
  // (bnb's float fallback would round it) but inside int32.
  const int64_t m = 2, n = 3, k = 4096;
  const std::vector<int8_t> a(static_cast<size_t>(m * k), -128),
      b(static_cast<size_t>(n * k), -128);
  int32_t* c_d = reinterpret_cast<int32_t*>(Alloc(static_cast<size_t>(m * n) * 4));
  ASSERT_CUDA_OK(Int8Matmul(Upload(a), Upload(b), m, n, k, c_d, stream_));
  EXPECT_EQ(Download<int32_t>(c_d, static_cast<size_t>(m * n)),
            std::vector<int32_t>(static_cast<size_t>(m * n), 4096 * 16384));
}

// --- Int8Dequant -----------------------------------------------------------

TEST_F(CudaKernelsTest, Int8DequantIsBitExact) {
  struct Case {
    int64_t m, n;
    bool bias;
  };
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int32_t> acc(-(1 << 26), 1 << 26);
  for (const Case& c : {Case{1, 4096, true}, Case{33, 257, false}, Case{5, 1000, true}}) {
    const size_t total = static_cast<size_t>(c.m * c.n);
    std::vector<int32_t> cm(total);
    for (auto& v : cm) v = acc(rng);
    const std::vector<float> sca = RandomFloats(static_cast<size_t>(c.m), 0.01f, 10.0f, rng);
    const std::vector<float> scb = RandomFloats(static_cast<size_t>(c.n), 0.001f, 2.0f, rng);
    const std::vector<float> bias_f = RandomFloats(static_cast<size_t>(c.n), -4.0f, 4.0f, rng);
    for (DType dtype : kDTypes) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " " + std::to_string(c.m) + "x" +
                   std::to_string(c.n) + (c.bias ? " bias" : ""));
      Values bias(dtype, static_cast<size_t>(c.n));
      for (size_t i = 0; i < bias_f.size(); ++i) bias.Set(i, bias_f[i]);
      uint8_t* out = Alloc(total * static_cast<size_t>(DTypeSize(dtype)));
      ASSERT_CUDA_OK(Int8Dequant(Upload(cm), Upload(sca), Upload(scb),
                                 c.bias ? Upload(bias.bytes()) : nullptr, c.m, c.n, dtype, out,
                                 stream_));
      Values got(dtype, total);
      DownloadInto(out, got);
      const float inv = 1.0f / 16129.0f;
      ASSERT_EQ(Bits(inv), 0x38820610u);
      int64_t mismatches = 0;
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < c.n; ++j) {
          const size_t at = static_cast<size_t>(i * c.n + j);
          // One float32 rounding per operation, in the documented order.
          const float both = sca[static_cast<size_t>(i)] * scb[static_cast<size_t>(j)];
          const float scaled = static_cast<float>(cm[at]) * both;
          float v = scaled * inv;
          if (c.bias) v = v + static_cast<float>(bias.Get(static_cast<size_t>(j)));
          Values want(dtype, 1);
          want.Set(0, v);
          if (got.Pattern(at) != want.Pattern(0) && ++mismatches <= 5) {
            ADD_FAILURE() << "out[" << i << "," << j << "]: got " << got.Get(at) << ", want "
                          << want.Get(0);
          }
        }
      }
      EXPECT_EQ(mismatches, 0);
    }
  }
}

// --- Argument checks (no device needed: nothing is launched) ---------------

TEST(CudaKernelsArgumentsTest, RejectsBadArgumentsBeforeTouchingTheDevice) {
  // Fake, never dereferenced: every call below fails its checks first.
  auto* p = reinterpret_cast<uint8_t*>(uintptr_t{256});
  auto* f = reinterpret_cast<float*>(uintptr_t{256});
  const cudaStream_t s = nullptr;
  EXPECT_EQ(Dequantize4bit(nullptr, f, f, 10, 64, DType::kFloat32, p, s), cudaErrorInvalidValue);
  EXPECT_EQ(Dequantize4bit(p, f, f, 10, 0, DType::kFloat32, p, s), cudaErrorInvalidValue);
  EXPECT_EQ(Dequantize4bit(p, f, f, -1, 64, DType::kFloat32, p, s), cudaErrorInvalidValue);
  EXPECT_EQ(Dequantize4bit(p, f, f, 10, 64, static_cast<DType>(7), p, s), cudaErrorInvalidValue);
  EXPECT_EQ(DequantizeAbsmaxDq(p, f, nullptr, 0.0f, 10, f, s), cudaErrorInvalidValue);
  EXPECT_EQ(DequantizeAbsmaxDq(p, f, f, 0.0f, -3, f, s), cudaErrorInvalidValue);
  EXPECT_EQ(Gemv4bit(p, p, f, f, 4, 64, 0, nullptr, DType::kBFloat16, p, s), cudaErrorInvalidValue);
  EXPECT_EQ(Gemv4bit(p, p, f, f, 4, -64, 64, nullptr, DType::kBFloat16, p, s),
            cudaErrorInvalidValue);
  EXPECT_EQ(Gemv4bit(p, p, f, f, 4, 64, 64, nullptr, DType::kBFloat16, nullptr, s),
            cudaErrorInvalidValue);
  auto* h = reinterpret_cast<uint16_t*>(p);
  auto* q = reinterpret_cast<int8_t*>(p);
  // Outlier decomposition needs somewhere to put the outlier columns.
  EXPECT_EQ(Int8RowQuantize(h, 4, 64, 6.0f, q, f, nullptr, s), cudaErrorInvalidValue);
  EXPECT_EQ(Int8RowQuantize(h, -4, 64, 0.0f, q, f, nullptr, s), cudaErrorInvalidValue);
  auto* c = reinterpret_cast<int32_t*>(p);
  EXPECT_EQ(Int8Matmul(q, nullptr, 4, 4, 4, c, s), cudaErrorInvalidValue);
  EXPECT_EQ(Int8Matmul(q, q, 4, -4, 4, c, s), cudaErrorInvalidValue);
  EXPECT_EQ(Int8Dequant(c, f, nullptr, nullptr, 4, 4, DType::kFloat16, p, s),
            cudaErrorInvalidValue);
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2);
}

TEST(CudaKernelsReferenceTest, HostRoundingHelpersRoundToNearestEven) {
  // The test's own conversions, against values worked out by hand.
  EXPECT_EQ(ToHalf(1.0f), 0x3c00);
  EXPECT_EQ(ToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(ToHalf(65519.996f), 0x7bff);
  EXPECT_EQ(ToHalf(65520.0f), 0x7c00);                      // the tie goes to even: infinity
  EXPECT_EQ(ToHalf(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(ToHalf(std::ldexp(1.0f, -25)), 0x0000);         // half of it: a tie to even 0
  EXPECT_EQ(ToHalf(std::ldexp(3.0f, -25)), 0x0002);         // 1.5 ulp: tie to even 2
  EXPECT_EQ(ToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(ToHalf(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // tie to even (up)
  EXPECT_EQ(ToHalf(-2.0f), 0xc000);
  EXPECT_EQ(ToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(ToBFloat16(FromBits(0x3f808000)), 0x3f80);  // tie to even
  EXPECT_EQ(ToBFloat16(FromBits(0x3f818000)), 0x3f82);  // tie to even (up)
  EXPECT_EQ(ToBFloat16(FromBits(0x3f808001)), 0x3f81);
  for (uint32_t bits = 0; bits < 0x7c00; bits += 7) {  // every finite half survives a round trip
    EXPECT_EQ(ToHalf(static_cast<float>(DecodeHalf(static_cast<uint16_t>(bits)))), bits);
  }
}

}  // namespace
}  // namespace accel::quant::cuda
