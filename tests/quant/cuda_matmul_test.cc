// quant/cuda_matmul.h against the cpu forward paths of quant/matmul.h (which
// tests/quant/matmul_test.cc checks against plain references): 4-bit NF4 and
// FP4, with and without double quant, one row (the fused GEMV) and several
// (dequantize, then at::linear), with and without bias, every compute dtype
// and mixed x / compute dtypes; LLM.int8 with threshold 0, a threshold no
// value reaches (bit for bit: the same float32 operations in the same
// order) and outlier columns (the outlier product summed in another order).
// Tests that run kernels are skipped where this build has no CUDA kernels,
// libtorch has no CUDA or there is no device; the argument checks run
// everywhere (a cpu tensor is refused before anything touches a device).
#include "quant/cuda_matmul.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "quant/bnb.h"
#include "quant/internal/slabs.h"
#include "quant/matmul.h"
#include "tests/testing/status_matchers.h"

namespace accel::quant {
namespace {

using test::StatusIs;
using ::testing::HasSubstr;

// Empty when the kernels can run here; otherwise why not.
std::string NoDevice() {
  if (!CudaKernelsBuilt())
    return "this build does not call the quant CUDA kernels (no nvcc or a CPU libtorch)";
  if (!at::hasCUDA()) return "libtorch has no CUDA, or there is no CUDA device";
  if (at::getNumGPUs() == 0) return "no CUDA device";
  return "";
}

#define SKIP_WITHOUT_DEVICE()                    \
  do {                                           \
    const std::string reason = NoDevice();       \
    if (!reason.empty()) GTEST_SKIP() << reason; \
  } while (false)

at::Tensor Random(at::IntArrayRef shape, double scale = 1.0) {
  return at::randn(shape, at::TensorOptions().dtype(at::kFloat)) * scale;
}

// A weight quantized by quant::Quantize4bit, as the layers hold it.
Weight4bit Quantized(const at::Tensor& w, QuantType4bit type, int64_t blocksize,
                     bool double_quant) {
  absl::StatusOr<Quantized4bit> q = Quantize4bit(w, type, blocksize, double_quant);
  EXPECT_TRUE(q.ok()) << q.status();
  Weight4bit weight;
  weight.packed = q->packed;
  weight.absmax = q->absmax;
  weight.code = q->quant_map;
  if (double_quant) {
    weight.nested_absmax = q->nested_absmax;
    weight.nested_code = q->nested_quant_map;
    weight.nested_offset = q->state.nested_offset;
  }
  weight.blocksize = blocksize;
  weight.out_features = w.size(0);
  weight.in_features = w.size(1);
  return weight;
}

at::Tensor OnDevice(const at::Tensor& t, const at::Device& device) {
  return t.defined() ? t.to(device) : t;
}

Weight4bit OnDevice(Weight4bit w, const at::Device& device) {
  w.packed = OnDevice(w.packed, device);
  w.absmax = OnDevice(w.absmax, device);
  w.code = OnDevice(w.code, device);
  w.nested_absmax = OnDevice(w.nested_absmax, device);
  w.nested_code = OnDevice(w.nested_code, device);
  return w;
}

// max |a - b| <= tolerance * max(1, max |b|), both read as float32 on the cpu.
void ExpectClose(const at::Tensor& got, const at::Tensor& want, double tolerance) {
  ASSERT_EQ(got.sizes(), want.sizes());
  ASSERT_EQ(got.scalar_type(), want.scalar_type());
  const at::Tensor g = got.to(at::kCPU).to(at::kFloat), w = want.to(at::kFloat);
  const double scale = std::max(1.0, w.abs().max().item<double>());
  const double error = (g - w).abs().max().item<double>();
  EXPECT_LE(error, tolerance * scale) << "max |error| " << error << " at scale " << scale;
}

// About two units in the last place of `dtype` (the two sides sum in
// different orders and may round the other way), and cuBLAS' reduced-
// precision reductions for the 16-bit products of several rows.
double Tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return 1.0 / 64;
    case at::kHalf:
      return 4e-3;
    default:
      return 1e-4;
  }
}

TEST(CudaMatmulTest, Linear4bitMatchesTheCpuPath) {
  SKIP_WITHOUT_DEVICE();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(1);
  // 256 x 512: the GEMV's fast path (K and blocksize multiples of 32); 33 x
  // 100 with blocksize 64: blocks across rows, its per-element path.
  for (const auto& [out, in, blocksize] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{256, 512, 64}, {33, 100, 64}}) {
    const at::Tensor w = Random({out, in}, 0.05);
    for (QuantType4bit type : {QuantType4bit::kNf4, QuantType4bit::kFp4}) {
      for (bool double_quant : {false, true}) {
        const Weight4bit cpu_w = Quantized(w, type, blocksize, double_quant);
        const Weight4bit cuda_w = OnDevice(cpu_w, cuda);
        for (int64_t rows : {1, 5}) {
          for (at::ScalarType compute : {at::kFloat, at::kBFloat16, at::kHalf}) {
            for (at::ScalarType x_type : {at::kFloat, at::kBFloat16}) {
              for (bool with_bias : {false, true}) {
                SCOPED_TRACE(testing::Message()
                             << out << "x" << in << " " << QuantType4bitName(type)
                             << (double_quant ? "+dq " : " ") << rows << " rows, compute "
                             << compute << ", x " << x_type << (with_bias ? ", bias" : ""));
                const at::Tensor x = Random({rows, in}).to(x_type);
                const at::Tensor bias = with_bias ? Random({out}, 0.1).to(x_type) : at::Tensor();
                ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor want,
                                           Linear4bitForward(x, cpu_w, bias, compute));
                ACCEL_ASSERT_OK_AND_ASSIGN(
                    at::Tensor got,
                    Linear4bitForwardCuda(x.to(cuda), cuda_w, OnDevice(bias, cuda), compute));
                EXPECT_TRUE(got.is_cuda());
                ExpectClose(got, want, std::max(Tolerance(compute), Tolerance(x_type)));
              }
            }
          }
        }
      }
    }
  }
}

TEST(CudaMatmulTest, Linear4bitShapes) {
  SKIP_WITHOUT_DEVICE();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(2);
  const at::Tensor w = Random({40, 128}, 0.05);
  const Weight4bit cpu_w = Quantized(w, QuantType4bit::kNf4, 64, true);
  const Weight4bit cuda_w = OnDevice(cpu_w, cuda);
  // [batch, seq, in], a [1, 1, in] decode step and a strided (transposed) x.
  for (const at::Tensor& x : {Random({2, 3, 128}), Random({1, 1, 128}), Random({128, 4}).t()}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor want, Linear4bitForward(x, cpu_w, {}, at::kFloat));
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor got,
                               Linear4bitForwardCuda(x.to(cuda), cuda_w, {}, at::kFloat));
    ExpectClose(got, want, Tolerance(at::kFloat));
  }
  ACCEL_ASSERT_OK_AND_ASSIGN(
      at::Tensor empty, Linear4bitForwardCuda(at::zeros({0, 128}, at::TensorOptions().device(cuda)),
                                              cuda_w, {}, at::kFloat));
  EXPECT_EQ(empty.sizes(), (std::vector<int64_t>{0, 40}));
}

// More rows than the fused GEMV takes: the weight dequantized a slab at a
// time (a quarter of the device's L2 cache, at least 256 rows), each slab's
// product written into its columns of y. 2999 rows of 8200 (slabs of a
// multiple of 8 rows, the last one partial, blocks across rows) are several
// slabs on any device; batch sizes around the fused GEMV's limit and a
// prefill's.
TEST(CudaMatmulTest, Linear4bitManyRowsMatchesTheCpuPathOverSlabs) {
  SKIP_WITHOUT_DEVICE();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(9);
  const int64_t out = 2999, in = 8200;
  const at::Tensor w = Random({out, in}, 0.05);
  for (bool double_quant : {false, true}) {
    const Weight4bit cpu_w = Quantized(w, QuantType4bit::kNf4, 64, double_quant);
    const Weight4bit cuda_w = OnDevice(cpu_w, cuda);
    for (int64_t rows : {8, 9, 32, 200, 300}) {  // 300: past kSlabRows, the whole weight
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE(testing::Message() << rows << " rows" << (double_quant ? ", dq" : "")
                                        << (with_bias ? ", bias" : ""));
        const at::Tensor x = Random({rows, in}).to(at::kBFloat16);
        const at::Tensor bias = with_bias ? Random({out}, 0.1).to(at::kBFloat16) : at::Tensor();
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor want,
                                   Linear4bitForward(x, cpu_w, bias, at::kBFloat16));
        ACCEL_ASSERT_OK_AND_ASSIGN(
            at::Tensor got,
            Linear4bitForwardCuda(x.to(cuda), cuda_w, OnDevice(bias, cuda), at::kBFloat16));
        ExpectClose(got, want, Tolerance(at::kBFloat16));
        // Every slab's columns written (a skipped slab would leave empty
        // memory, which a max-error check can miss where it holds zeros).
        const at::Tensor diff = (got.to(at::kCPU).to(at::kFloat) - want.to(at::kFloat)).abs();
        EXPECT_LE(diff.amax(0).max().item<double>(),
                  Tolerance(at::kBFloat16) * std::max(1.0, want.abs().max().item<double>()));
      }
    }
  }
}

// A batch's rows where the tensor-core kernel takes the weight (K a multiple
// of 256, blocks of 64, 16-bit activations): up to 32 rows in one pass of its
// tiled form, up to 128 in passes of 32 (each reading the weight once; the
// last pass shorter, 8 rows and fewer through its first form), past that the
// slabs. Every row against the cpu path, every column written.
TEST(CudaMatmulTest, Linear4bitBatchRowsMatchTheCpuPathThroughTheFusedPasses) {
  SKIP_WITHOUT_DEVICE();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(11);
  const int64_t out = 1000, in = 4096;
  const at::Tensor w = Random({out, in}, 0.05);
  for (bool double_quant : {false, true}) {
    const Weight4bit cpu_w = Quantized(w, QuantType4bit::kNf4, 64, double_quant);
    const Weight4bit cuda_w = OnDevice(cpu_w, cuda);
    for (int64_t rows : {9, 32, 33, 40, 100, 128, 129}) {
      for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
        SCOPED_TRACE(testing::Message()
                     << rows << " rows" << (double_quant ? ", dq " : " ") << dtype);
        const at::Tensor x = Random({rows, in}).to(dtype);
        const at::Tensor bias = rows % 2 == 0 ? Random({out}, 0.1).to(dtype) : at::Tensor();
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor want, Linear4bitForward(x, cpu_w, bias, dtype));
        ACCEL_ASSERT_OK_AND_ASSIGN(
            at::Tensor got, Linear4bitForwardCuda(x.to(cuda), cuda_w, OnDevice(bias, cuda), dtype));
        ExpectClose(got, want, Tolerance(dtype));
        const at::Tensor diff = (got.to(at::kCPU).to(at::kFloat) - want.to(at::kFloat)).abs();
        EXPECT_LE(diff.amax(1).max().item<double>(),
                  Tolerance(dtype) * std::max(1.0, want.abs().max().item<double>()));
      }
    }
  }
}

// The slab arithmetic itself (no device): slabs start on a block and on 16
// packed bytes, hold at least 256 rows and aim at the byte size asked for.
TEST(CudaMatmulTest, DequantSlabRows) {
  // Llama-8B's down_proj as bfloat16, 12.5 MiB slabs: 4096 * 2 bytes a row.
  EXPECT_EQ(internal::DequantSlabRows(4096, 14336, 64, 2, 12800 << 10), 457);
  EXPECT_EQ(internal::DequantSlabRows(14336, 4096, 64, 2, 12800 << 10), 1600);
  // A small weight: one slab, the whole of it.
  EXPECT_EQ(internal::DequantSlabRows(40, 128, 64, 2, 12800 << 10), 40);
  // Never under 256 rows, however small the cache.
  EXPECT_EQ(internal::DequantSlabRows(100000, 4096, 64, 2, 1 << 20), 256);
  for (int64_t in : {100, 8200, 4097, 333}) {
    for (int64_t blocksize : {64, 128, 4096}) {
      SCOPED_TRACE(testing::Message() << "in " << in << ", blocksize " << blocksize);
      const int64_t rows = internal::DequantSlabRows(1 << 20, in, blocksize, 2, 8 << 20);
      EXPECT_EQ(rows * in % blocksize, 0);
      EXPECT_EQ(rows * in % 32, 0);  // 16 packed bytes
      EXPECT_GE(rows, internal::kMinSlabRows);
      // Within one step of such rows of the target (the step: rows whose
      // values are a whole number of blocks and of 32).
      const int64_t values = std::lcm(blocksize, int64_t{32});
      const int64_t step = values / std::gcd(in, values);
      EXPECT_EQ(rows % step, 0);
      EXPECT_LT(rows - step, std::max<int64_t>((8 << 20) / (in * 2), internal::kMinSlabRows));
    }
  }
  EXPECT_EQ(internal::DequantSlabRows(0, 4096, 64, 2, 8 << 20), 0);
}

// Rows quantized the way Int8Params does, so SCB and CB are consistent.
std::pair<at::Tensor, at::Tensor> QuantizeRows(const at::Tensor& w) {
  absl::StatusOr<QuantizedInt8> q = QuantizeInt8(w);
  EXPECT_TRUE(q.ok()) << q.status();
  return {q->weight, q->scb};
}

TEST(CudaMatmulTest, Int8WithoutOutliersIsBitExact) {
  SKIP_WITHOUT_DEVICE();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(3);
  for (int64_t in : {64, 100, 4096}) {
    auto [cb, scb] = QuantizeRows(Random({33, in}, 0.05));
    const at::Tensor cb_d = cb.to(cuda), scb_d = scb.to(cuda);
    for (int64_t rows : {1, 3, 17}) {
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        for (bool with_bias : {false, true}) {
          at::Tensor x = Random({rows, in}, 4.0);
          x[0][3] = 9.5;  // large, but threshold 0 takes no outliers
          x = x.to(dtype);
          const at::Tensor bias = with_bias ? Random({33}).to(dtype) : at::Tensor();
          for (double threshold : {0.0, 100.0}) {  // 100: nothing reaches it
            SCOPED_TRACE(testing::Message()
                         << rows << "x" << in << " " << dtype << (with_bias ? " with bias" : "")
                         << " threshold " << threshold);
            ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor want,
                                       Int8LinearForward(x, cb, scb, bias, threshold));
            ACCEL_ASSERT_OK_AND_ASSIGN(
                at::Tensor got,
                Int8LinearForwardCuda(x.to(cuda), cb_d, scb_d, OnDevice(bias, cuda), threshold));
            ASSERT_TRUE(got.is_cuda());
            EXPECT_TRUE(at::equal(got.to(at::kCPU), want))
                << "max |error| "
                << (got.to(at::kCPU).to(at::kFloat) - want.to(at::kFloat))
                       .abs()
                       .max()
                       .item<double>();
          }
        }
      }
    }
  }
}

TEST(CudaMatmulTest, Int8OutlierColumns) {
  SKIP_WITHOUT_DEVICE();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(4);
  const int64_t in = 96, out = 21;
  auto [cb, scb] = QuantizeRows(Random({out, in}, 0.05));
  const at::Tensor cb_d = cb.to(cuda), scb_d = scb.to(cuda);
  for (int64_t rows : {1, 4}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      SCOPED_TRACE(testing::Message() << rows << " rows " << dtype);
      at::Tensor x = Random({rows, in}, 3.0);
      x[0][5] = 8.5;           // outlier column 5
      x[rows - 1][17] = -6.0;  // exactly the threshold: an outlier (>=)
      x[0][40] = 5.99;         // below it
      x = x.to(dtype);
      const at::Tensor bias = Random({out}).to(dtype);
      ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor want, Int8LinearForward(x, cb, scb, bias, 6.0));
      ACCEL_ASSERT_OK_AND_ASSIGN(
          at::Tensor got, Int8LinearForwardCuda(x.to(cuda), cb_d, scb_d, bias.to(cuda), 6.0));
      ExpectClose(got, want, Tolerance(dtype));
      // The decomposition matters: without it the answer is different.
      ACCEL_ASSERT_OK_AND_ASSIGN(
          at::Tensor plain, Int8LinearForwardCuda(x.to(cuda), cb_d, scb_d, bias.to(cuda), 0.0));
      EXPECT_FALSE(at::equal(plain, got));
    }
  }
  // A row of zeros and a row all outliers (SCA 0: no int8 codes), [3, 2, in].
  at::Tensor x = Random({3, 2, in}, 2.0);
  x[0][0].zero_();
  x[1][1].fill_(7.0);
  const at::Tensor bias = Random({out});
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor want, Int8LinearForward(x, cb, scb, bias, 6.0));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor got,
                             Int8LinearForwardCuda(x.to(cuda), cb_d, scb_d, bias.to(cuda), 6.0));
  EXPECT_EQ(got.sizes(), (std::vector<int64_t>{3, 2, out}));
  ExpectClose(got, want, Tolerance(at::kFloat));
  ACCEL_ASSERT_OK_AND_ASSIGN(
      at::Tensor empty, Int8LinearForwardCuda(at::zeros({0, in}, at::TensorOptions().device(cuda)),
                                              cb_d, scb_d, bias.to(cuda), 6.0));
  EXPECT_EQ(empty.sizes(), (std::vector<int64_t>{0, out}));
}

// Arguments on the wrong device, refused before any kernel: these run
// without a device too.
TEST(CudaMatmulTest, CpuTensorsAreRefused) {
  at::manual_seed(5);
  const Weight4bit w = Quantized(Random({4, 64}), QuantType4bit::kNf4, 64, false);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(Linear4bitForwardCuda(Random({2, 64}), w, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("x must be a dense tensor on a CUDA device")));
  EXPECT_THAT(Linear4bitForwardCuda(at::Tensor(), w, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("x is undefined")));
  EXPECT_THAT(Linear4bitForwardCuda(at::empty({2, 64}, at::TensorOptions().device(at::kMeta)), w,
                                    {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("got one on meta")));
  auto [cb, scb] = QuantizeRows(Random({4, 64}, 0.05));
  EXPECT_THAT(Int8LinearForwardCuda(Random({2, 64}), cb, scb, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("x must be a dense tensor on a CUDA device")));
}

TEST(CudaMatmulTest, ArgumentErrorsNameTheArgument) {
  SKIP_WITHOUT_DEVICE();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(6);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const Weight4bit cpu_w = Quantized(Random({4, 64}), QuantType4bit::kNf4, 64, true);
  const Weight4bit w = OnDevice(cpu_w, cuda);
  const at::Tensor x = Random({2, 64}).to(cuda);
  auto with = [&](auto change) {
    Weight4bit bad = w;
    change(bad);
    return Linear4bitForwardCuda(x, bad, {}, at::kFloat);
  };
  // A weight tensor left on the cpu, each named.
  EXPECT_THAT(with([&](Weight4bit& b) { b.packed = cpu_w.packed; }),
              StatusIs(kInvalid, HasSubstr("weight.packed must be a dense tensor on cuda:0")));
  EXPECT_THAT(with([&](Weight4bit& b) { b.absmax = cpu_w.absmax; }),
              StatusIs(kInvalid, HasSubstr("weight.absmax must be a dense tensor on cuda:0")));
  EXPECT_THAT(with([&](Weight4bit& b) { b.code = cpu_w.code; }),
              StatusIs(kInvalid, HasSubstr("weight.code must be")));
  EXPECT_THAT(with([&](Weight4bit& b) { b.nested_absmax = cpu_w.nested_absmax; }),
              StatusIs(kInvalid, HasSubstr("weight.nested_absmax must be")));
  EXPECT_THAT(with([&](Weight4bit& b) { b.nested_code = cpu_w.nested_code; }),
              StatusIs(kInvalid, HasSubstr("weight.nested_code must be")));
  // Shapes and dtypes, as the cpu path checks them.
  EXPECT_THAT(with([&](Weight4bit& b) { b.blocksize = 0; }),
              StatusIs(kInvalid, HasSubstr("weight.blocksize")));
  EXPECT_THAT(with([&](Weight4bit& b) { b.packed = b.packed.narrow(0, 0, 10); }),
              StatusIs(kInvalid, HasSubstr("weight.packed holds 10 bytes")));
  EXPECT_THAT(with([&](Weight4bit& b) { b.code = b.code.narrow(0, 0, 15); }),
              StatusIs(kInvalid, HasSubstr("16 values")));
  EXPECT_THAT(with([&](Weight4bit& b) { b.nested_code = b.nested_code.to(at::kHalf); }),
              StatusIs(kInvalid, HasSubstr("weight.nested_code must be float32")));
  EXPECT_THAT(Linear4bitForwardCuda(x, w, {}, at::kDouble),
              StatusIs(kInvalid, HasSubstr("compute_dtype")));
  EXPECT_THAT(Linear4bitForwardCuda(Random({2, 63}).to(cuda), w, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("x must be [..., 64]")));
  EXPECT_THAT(Linear4bitForwardCuda(x.to(at::kDouble), w, {}, at::kFloat),
              StatusIs(kInvalid, HasSubstr("x must be float32")));
  EXPECT_THAT(Linear4bitForwardCuda(x, w, at::zeros({4}), at::kFloat),
              StatusIs(kInvalid, HasSubstr("bias must be a dense tensor on cuda:0")));
  EXPECT_THAT(Linear4bitForwardCuda(x, w, at::zeros({5}, x.options()), at::kFloat),
              StatusIs(kInvalid, HasSubstr("bias must be [4]")));

  auto [cb, scb] = QuantizeRows(Random({4, 64}, 0.05));
  const at::Tensor cb_d = cb.to(cuda), scb_d = scb.to(cuda);
  EXPECT_THAT(Int8LinearForwardCuda(x, cb, scb_d, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("cb must be a dense tensor on cuda:0")));
  EXPECT_THAT(Int8LinearForwardCuda(x, cb_d, scb, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("scb must be a dense tensor on cuda:0")));
  EXPECT_THAT(Int8LinearForwardCuda(x, cb_d.to(at::kFloat), scb_d, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("cb must be int8")));
  EXPECT_THAT(Int8LinearForwardCuda(x, cb_d.flatten(), scb_d, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("cb must be [out, in]")));
  EXPECT_THAT(Int8LinearForwardCuda(x, cb_d, scb_d.narrow(0, 0, 3), {}, 6.0),
              StatusIs(kInvalid, HasSubstr("scb must be [4]")));
  EXPECT_THAT(Int8LinearForwardCuda(Random({2, 65}).to(cuda), cb_d, scb_d, {}, 6.0),
              StatusIs(kInvalid, HasSubstr("x must be [..., 64]")));
  EXPECT_THAT(Int8LinearForwardCuda(x, cb_d, scb_d, at::zeros({4}), 6.0),
              StatusIs(kInvalid, HasSubstr("bias must be a dense tensor on cuda:0")));
  EXPECT_THAT(Int8LinearForwardCuda(x, cb_d, scb_d, {}, -1.0),
              StatusIs(kInvalid, HasSubstr("threshold")));
}

}  // namespace
}  // namespace accel::quant
