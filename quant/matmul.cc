#include "quant/matmul.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

// Compiled with -fopenmp (accel_torch_parallel in quant/CMakeLists.txt), so
// the epilogue of the int8 product runs on the intra-op threads.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/status.h"
#include "quant/internal/arguments.h"
#include "quant/internal/kernels_cpu.h"

namespace accel::quant {
namespace {

using internal::DenseType;

// Up to this many rows (x's elements / in) Linear4bitForward runs the fused
// dequantize-GEMV; above, the weight is dequantized a slab at a time and
// multiplied by libtorch, whose products reuse each weight for many rows.
constexpr int64_t kFusedMaxRows = 16;

// The dequantized weight's slab above kFusedMaxRows (LinearBySlabs): in the
// L3 cache, and below the heap's mmap threshold (core/malloc_tuning.h), so
// the buffer is reused. 32 rows of 14336 x 4096 / 4096 x 14336, two threads:
// slabs of 1 MiB 18.5 / 24.3 ms, 4 MiB 15.2 / 21.5, 8 MiB 13.1 / 16.1, 16 MiB
// 13.4 / 14.6 (bfloat16 weights: 12.1 / 12.2).
constexpr int64_t kSlabBytes = int64_t{8} << 20;

// bnb's int8_vectorwise_dequant multiplies by this float32 constant (1/127).
constexpr float kInv127 = static_cast<float>(7.874015718698502e-3);

std::optional<DenseType> DenseTypeOf(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return DenseType::kFloat32;
    case at::kBFloat16:
      return DenseType::kBFloat16;
    case at::kHalf:
      return DenseType::kFloat16;
    default:
      return std::nullopt;
  }
}

const at::Device kCpu(at::kCPU);

// x [..., in] of a compute dtype on the cpu.
absl::Status CheckInput(const at::Tensor& x, int64_t in) {
  ACCEL_RETURN_IF_ERROR(internal::CheckOnDevice(x, "x", kCpu));
  return internal::CheckInputShape(x, in);
}

internal::Packed4bit PackedOf(const Weight4bit& w) {
  internal::Packed4bit p;
  p.packed = w.packed.data_ptr<uint8_t>();
  if (w.absmax.scalar_type() == at::kByte) {
    p.absmax_codes = w.absmax.data_ptr<uint8_t>();
    p.nested_absmax = w.nested_absmax.data_ptr<float>();
    p.nested_code = w.nested_code.data_ptr<float>();
    p.nested_offset = w.nested_offset;
  } else {
    p.absmax = w.absmax.data_ptr<float>();
  }
  p.code = w.code.data_ptr<float>();
  p.blocksize = w.blocksize;
  p.numel = w.out_features * w.in_features;
  return p;
}

std::vector<int64_t> OutputShape(const at::Tensor& x, int64_t out) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out;
  return shape;
}

at::Tensor DequantizeUnchecked(const Weight4bit& w, at::ScalarType dtype) {
  at::Tensor out = at::empty({w.out_features, w.in_features}, at::TensorOptions().dtype(dtype));
  internal::Dequantize4bit(internal::ActiveIsa(), PackedOf(w), *DenseTypeOf(dtype), out.data_ptr());
  return out;
}

// x [rows, in] (any strides) into out[i * in + k] as float32, rounded to
// `round`; the output's values rounded to `round`, then stored in x's dtype.
// No libtorch op for a contiguous x: at a decode step's layer sizes (a few
// thousand values) each .to() cost more in dispatch and allocation than the
// conversion (measured: ~20-50 us a call on a 1024 x 1024 int8 layer whose
// product takes ~55 us).
void ReadRows(const at::Tensor& x, int64_t rows, int64_t in, DenseType round, float* out) {
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  internal::LoadRounded(internal::ActiveIsa(), xc.data_ptr(), *DenseTypeOf(x.scalar_type()),
                        rows * in, round, out);
}

void WriteValues(const float* y, int64_t n, DenseType round, const at::Tensor& out) {
  internal::StoreRounded(internal::ActiveIsa(), y, n, round, *DenseTypeOf(out.scalar_type()),
                         out.data_ptr());
}

// Above kFusedMaxRows: y = x W^T + b with W dequantized to `compute` a slab
// of kSlabBytes at a time into one buffer, each slab multiplied by libtorch,
// so the dequantized weight never leaves the cache. Dequantized whole, it
// was an allocation of the weight's size in 16 bits on every call (117 MB
// for Mixtral's w1: fresh pages faulted in one by one), written to memory and
// read back: 32 rows of 14336 x 4096 took 44.6 ms, against 12.1 ms for the
// same product on a bfloat16 weight. The slabs split W's rows, never a sum.
at::Tensor LinearBySlabs(const at::Tensor& x2, const Weight4bit& w, const at::Tensor& bias,
                         at::ScalarType compute) {
  // libtorch 1.13 has no float16 product on the cpu, and its bfloat16 one is
  // a loop on one thread where oneDNN does not take it (core/cpu_features.h;
  // taken as so below the AVX-512 kernel level too, so that tests run both
  // paths on such a machine): the values, held in float32, multiplied in
  // float32 (OpenBLAS), the result rounded once to the compute dtype.
  const bool upcast = compute == at::kHalf || (compute == at::kBFloat16 &&
                                               (!CpuFeaturesOfThisMachine().onednn_bf16_matmul ||
                                                internal::ActiveIsa() < internal::CpuIsa::kAvx512));
  const at::ScalarType product = upcast ? at::kFloat : compute;
  const at::Tensor xm = upcast ? x2.to(compute).to(at::kFloat) : x2.to(compute);
  at::Tensor bm;
  if (bias.defined()) bm = upcast ? bias.to(compute).to(at::kFloat) : bias.to(compute);
  const int64_t in = w.in_features, out = w.out_features;
  const int64_t element = compute == at::kFloat || upcast ? 4 : 2;
  // Whole multiples of 16 rows, so each slab starts on a decode group.
  const int64_t slab = std::min(
      out, std::max<int64_t>(16, kSlabBytes / std::max<int64_t>(1, in * element) / 16 * 16));
  const at::Tensor buffer = at::empty({slab, in}, at::TensorOptions().dtype(product));
  const internal::Packed4bit packed = PackedOf(w);
  const DenseType dense = *DenseTypeOf(compute);
  at::Tensor y = at::empty({xm.size(0), out}, xm.options().dtype(product));
  for (int64_t n0 = 0; n0 < out; n0 += slab) {
    const int64_t n = std::min(slab, out - n0);
    const at::Tensor ws = buffer.narrow(0, 0, n);
    if (upcast) {
      internal::Dequantize4bitRangeAsFloat(internal::ActiveIsa(), packed, dense, n0 * in,
                                           (n0 + n) * in, ws.data_ptr<float>());
    } else {
      internal::Dequantize4bitRange(internal::ActiveIsa(), packed, dense, n0 * in, (n0 + n) * in,
                                    ws.data_ptr());
    }
    y.narrow(1, n0, n).copy_(at::linear(xm, ws, bm.defined() ? bm.narrow(0, n0, n) : at::Tensor()));
  }
  return upcast ? y.to(compute) : y;
}

}  // namespace

absl::StatusOr<at::Tensor> Dequantize4bitDense(const Weight4bit& weight, at::ScalarType dtype) {
  ACCEL_RETURN_IF_ERROR(internal::CheckWeight4bit(weight, kCpu));
  ACCEL_RETURN_IF_ERROR(internal::CheckComputeDType(dtype, "dtype"));
  at::Tensor out;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] { out = DequantizeUnchecked(weight, dtype); }));
  return out;
}

absl::StatusOr<at::Tensor> Linear4bitForward(const at::Tensor& x, const Weight4bit& weight,
                                             const at::Tensor& bias, at::ScalarType compute_dtype) {
  ACCEL_RETURN_IF_ERROR(internal::CheckWeight4bit(weight, kCpu));
  ACCEL_RETURN_IF_ERROR(internal::CheckComputeDType(compute_dtype, "compute_dtype"));
  const std::optional<DenseType> compute = DenseTypeOf(compute_dtype);
  const int64_t in = weight.in_features, out = weight.out_features;
  ACCEL_RETURN_IF_ERROR(CheckInput(x, in));
  ACCEL_RETURN_IF_ERROR(internal::CheckBias(bias, out, kCpu));

  // Like bnb's Linear4bit.forward: x and bias are cast to the compute dtype,
  // the product comes out in the compute dtype (float32 sums of values of
  // that dtype, rounded once), then in x's dtype.
  at::Tensor y;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    const int64_t rows = x.numel() / in;
    const std::vector<int64_t> shape = OutputShape(x, out);
    if (rows == 0) {
      y = at::empty(shape, x.options());
      return;
    }
    if (rows <= kFusedMaxRows) {
      std::vector<float> x32(static_cast<size_t>(rows * in)), y32(static_cast<size_t>(rows * out));
      std::vector<float> b32;
      ReadRows(x, rows, in, *compute, x32.data());
      if (bias.defined()) {
        b32.resize(static_cast<size_t>(out));
        ReadRows(bias, 1, out, *compute, b32.data());
      }
      internal::Gemv4bitArgs args;
      args.m = rows;
      args.in = in;
      args.out = out;
      args.x = x32.data();
      args.x_stride = in;
      args.w = PackedOf(weight);
      args.round = *compute;
      args.bias = bias.defined() ? b32.data() : nullptr;
      args.y = y32.data();
      args.y_stride = out;
      internal::Gemv4bit(internal::ActiveIsa(), args);
      y = at::empty(shape, x.options());
      WriteValues(y32.data(), rows * out, *compute, y);
      return;
    }
    y = LinearBySlabs(x.reshape({rows, in}), weight, bias, compute_dtype)
            .to(x.scalar_type())
            .view(shape);
  }));
  return y;
}

absl::StatusOr<at::Tensor> Int8MatmulInt32(const at::Tensor& a, const at::Tensor& b) {
  ACCEL_RETURN_IF_ERROR(internal::CheckOnDevice(a, "a", kCpu));
  ACCEL_RETURN_IF_ERROR(internal::CheckDType(a, "a", at::kChar));
  ACCEL_RETURN_IF_ERROR(internal::CheckOnDevice(b, "b", kCpu));
  ACCEL_RETURN_IF_ERROR(internal::CheckDType(b, "b", at::kChar));
  if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a [M, K] and b [N, K] must be 2-D with the same K, got [", absl::StrJoin(a.sizes(), ", "),
        "] and [", absl::StrJoin(b.sizes(), ", "), "]"));
  }
  at::Tensor c;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    const at::Tensor ac = a.contiguous(), bc = b.contiguous();
    const at::Tensor c_t = at::empty({b.size(0), a.size(0)}, a.options().dtype(at::kInt));
    internal::Int8Matmul(internal::ActiveIsa(), ac.data_ptr<int8_t>(), bc.data_ptr<int8_t>(),
                         a.size(0), b.size(0), a.size(1), c_t.data_ptr<int32_t>());
    c = c_t.t().contiguous();
  }));
  return c;
}

absl::StatusOr<at::Tensor> Int8LinearForward(const at::Tensor& x, const at::Tensor& cb,
                                             const at::Tensor& scb, const at::Tensor& bias,
                                             double threshold) {
  ACCEL_RETURN_IF_ERROR(internal::CheckInt8Weight(cb, scb, kCpu));
  const int64_t out = cb.size(0), in = cb.size(1);
  ACCEL_RETURN_IF_ERROR(CheckInput(x, in));
  ACCEL_RETURN_IF_ERROR(internal::CheckBias(bias, out, kCpu));
  ACCEL_RETURN_IF_ERROR(internal::CheckThreshold(threshold));

  at::Tensor y;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    const int64_t rows = x.numel() / in;
    const std::vector<int64_t> shape = OutputShape(x, out);
    if (rows == 0 || out == 0) {
      y = at::empty(shape, x.options());
      return;
    }
    // A: x rounded to float16 (bnb's MatMul8bitLt casts it), held as float32.
    std::vector<float> a32(static_cast<size_t>(rows * in));
    const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
    ReadRows(xc, rows, in, DenseType::kFloat16, a32.data());
    const float* a = a32.data();
    // Outlier columns, SCA and CA (internal::QuantizeInt8Rows): bnb's
    // int8_vectorwise_quant, the threshold compared in float32 as CUDA's
    // kInt8VectorQuant does.
    std::vector<uint8_t> outlier_col(static_cast<size_t>(in));
    std::vector<float> sca(static_cast<size_t>(rows));
    std::vector<int8_t> ca(static_cast<size_t>(rows * in));
    internal::QuantizeInt8Rows(internal::ActiveIsa(), a, rows, in, static_cast<float>(threshold),
                               outlier_col.data(), sca.data(), ca.data());
    const int8_t* ca_data = ca.data();
    std::vector<int64_t> cols;
    for (int64_t k = 0; k < in; ++k) {
      if (outlier_col[static_cast<size_t>(k)]) cols.push_back(k);
    }

    // The int8 product, and CB's outlier columns picked up on the way.
    const int64_t nout = static_cast<int64_t>(cols.size());
    std::vector<int32_t> c(static_cast<size_t>(out * rows));  // transposed: c[n * rows + m]
    const at::Tensor cb_c = cb.contiguous();
    std::vector<int8_t> cb_cols(static_cast<size_t>(out * nout));
    const internal::Int8Gather gather{cols.data(), nout, cb_cols.data()};
    internal::Int8Matmul(internal::ActiveIsa(), ca_data, cb_c.data_ptr<int8_t>(), rows, out, in,
                         c.data(), nout > 0 ? &gather : nullptr);

    // The outlier part, bnb's int8_mixed_scaled_mm: x's own values in the
    // outlier columns times the int8 weight dequantized to x's dtype,
    // round(CB * SCB * (1/127 in float32)).
    std::vector<float> sub_a(static_cast<size_t>(rows * nout));
    std::vector<float> sub_b(static_cast<size_t>(nout * out));  // transposed: [nout, out]
    if (nout > 0) {
      // Just those values, not all of x converted.
      const auto* base = static_cast<const char*>(xc.data_ptr());
      const int64_t size = static_cast<int64_t>(xc.element_size());
      for (int64_t m = 0; m < rows; ++m) {
        for (int64_t j = 0; j < nout; ++j) {
          internal::LoadRounded(internal::ActiveIsa(), base + (m * in + cols[j]) * size,
                                *DenseTypeOf(x.scalar_type()), 1, DenseType::kFloat32,
                                &sub_a[static_cast<size_t>(m * nout + j)]);
        }
      }
    }

    // out = float32(C) * (SCA * SCB) * (1/16129) + bias, then + the outlier
    // dot (summed in float32 first), rounded to x's dtype once. bnb rounds
    // the int8 part to x's dtype before its addmm; one rounding is closer to
    // the exact result and identical for float32 x.
    const at::Tensor scb_c = scb.contiguous();
    const float* scb_data = scb_c.data_ptr<float>();
    std::vector<float> b32;
    if (bias.defined()) {
      b32.resize(static_cast<size_t>(out));
      ReadRows(bias, 1, out, DenseType::kFloat32, b32.data());
    }
    const float* bias_data = bias.defined() ? b32.data() : nullptr;
    std::vector<float> y32(static_cast<size_t>(rows * out));
    float* sub_b_data = sub_b.data();
    const at::ScalarType x_type = x.scalar_type();
    // About 4096 multiply-adds a task: an output costs `rows` rescales, and
    // with outlier columns `nout` weight dequantizations and rows x nout
    // products more (serial at one row, it cost as much as the product).
    const int64_t per_output = rows + nout * (rows + 1);
    internal::Int8RescaleArgs rescale;
    rescale.c = c.data();
    rescale.rows = rows;
    rescale.out = out;
    rescale.sca = sca.data();
    rescale.scb = scb_data;
    rescale.bias = bias_data;
    rescale.nout = nout;
    rescale.outlier_x = sub_a.data();
    rescale.outlier_w = sub_b.data();
    rescale.y = y32.data();
    at::parallel_for(
        0, out, std::max<int64_t>(1, 4096 / per_output), [&](int64_t begin, int64_t end) {
          for (int64_t j = 0; j < nout; ++j) {
            float* bj = sub_b_data + j * out;
            for (int64_t n = begin; n < end; ++n) {
              const float v = static_cast<float>(cb_cols[n * nout + j]) * scb_data[n] * kInv127;
              bj[n] = x_type == at::kFloat      ? v
                      : x_type == at::kBFloat16 ? static_cast<float>(c10::BFloat16(v))
                                                : static_cast<float>(c10::Half(v));
            }
          }
          internal::Int8Rescale(internal::ActiveIsa(), rescale, begin, end);
        });
    y = at::empty(shape, x.options());
    WriteValues(y32.data(), rows * out, DenseType::kFloat32, y);
  }));
  return y;
}

}  // namespace accel::quant
