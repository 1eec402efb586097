#include "models/internal/cpu_linear.h"

#include <algorithm>
#include <vector>

// Compiled with -fopenmp and without the shared PCH (accel_torch_parallel in
// models/CMakeLists.txt): at::parallel_for is serial otherwise.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>

#include "core/cpu_features.h"
#include "models/internal/gemv.h"

namespace accel::models::internal {
namespace {

// Weight bytes per thread below which a product is not split further: a split
// costs a few microseconds, and 256 KiB take about 25 us to stream.
constexpr int64_t kMinBytesPerTask = int64_t{256} << 10;

// Weight bytes of the column tile a thread takes through every chunk of rows
// before the next tile: it stays in the 2 MiB L2 next to a chunk of x (256 KiB
// at in = 4096). Against a whole pass over the weights per chunk, measured on
// float32 [4096, 4096] weights (docs/BENCHMARKS.md): 1.4x faster at 17 rows,
// 1.2x at 64, 1.1x at 256 (above one chunk the kernels are close to
// compute-bound); tiles of 256 KiB to 1 MiB measured the same.
constexpr int64_t kTileBytes = int64_t{512} << 10;

std::optional<GemvWeight> WeightType(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return GemvWeight::kFloat32;
    case at::kBFloat16:
      return GemvWeight::kBFloat16;
    case at::kHalf:
      return GemvWeight::kFloat16;
    default:
      return std::nullopt;
  }
}

bool DenseCpu(const at::Tensor& t) { return t.device().is_cpu() && t.layout() == at::kStrided; }

// What a product of ours needs of its operands: dense CPU tensors of one
// dtype our kernels read, a contiguous 2-D weight ([out, in], or [in, out]
// when `in_first`), x [..., in] with at least one row, bias [out] or
// undefined, and no autograd graph. The weight's type and the sizes, or
// nullopt.
struct Operands {
  GemvWeight type = GemvWeight::kFloat32;
  int64_t in = 0, out = 0, rows = 0;
};

std::optional<Operands> CheckOperands(const at::Tensor& x, const at::Tensor& weight,
                                      const at::Tensor& bias, bool in_first) {
  if (!x.defined() || !weight.defined() || !DenseCpu(x) || !DenseCpu(weight)) return std::nullopt;
  const std::optional<GemvWeight> type = WeightType(weight.scalar_type());
  if (!type || x.scalar_type() != weight.scalar_type()) return std::nullopt;
  if (weight.dim() != 2 || !weight.is_contiguous() || x.dim() < 1) return std::nullopt;
  const int64_t in = weight.size(in_first ? 0 : 1), out = weight.size(in_first ? 1 : 0);
  if (in == 0 || out == 0 || x.size(-1) != in) return std::nullopt;
  const int64_t rows = x.numel() / in;
  if (rows < 1) return std::nullopt;
  if (bias.defined() && (!DenseCpu(bias) || bias.scalar_type() != weight.scalar_type() ||
                         bias.dim() != 1 || bias.size(0) != out)) {
    return std::nullopt;
  }
  if (c10::GradMode::is_enabled() &&
      (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()))) {
    return std::nullopt;
  }
  return Operands{*type, in, out, rows};
}

std::optional<at::Tensor> Linear(const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& bias, bool bfloat16_any_rows) {
  const std::optional<Operands> operands = CheckOperands(x, weight, bias, /*in_first=*/false);
  if (!operands) return std::nullopt;
  const GemvWeight type = operands->type;
  const int64_t in = operands->in, out = operands->out, rows = operands->rows;
  // bfloat16 above one chunk goes to libtorch where it runs it with oneDNN
  // (AVX-512 bf16 / AMX on the build machine): measured on [4096, 4096]
  // weights, as fast as our chunks at 17 rows, 2x faster at 32, 2.8x at 64 and
  // 4.3x at 256 (docs/BENCHMARKS.md, GEMV section); on a cpu without oneDNN's
  // bfloat16 product libtorch's is a loop on one thread, so the chunks take
  // it. float32 and float16 take any number of rows: libtorch 1.13's float32
  // product was the reference BLAS sgemm (51-64x slower than ours at 17-256
  // rows) and it has no float16 one.
  if (type == GemvWeight::kBFloat16 && rows > kFastLinearChunkRows && !bfloat16_any_rows &&
      CpuFeaturesOfThisMachine().onednn_bf16_matmul) {
    return std::nullopt;
  }

  at::Tensor x32 = x.reshape({rows, in}).to(at::kFloat);
  if (in > 1 && x32.stride(1) != 1) x32 = x32.contiguous();
  at::Tensor b32;
  if (bias.defined()) b32 = bias.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, out}, x.options().dtype(at::kFloat));

  GemvArgs args;
  args.k = in;
  args.x_stride = x32.stride(0);
  args.w = weight.data_ptr();
  args.w_type = type;
  args.w_stride = in;
  args.bias = b32.defined() ? b32.data_ptr<float>() : nullptr;
  args.y_stride = out;
  const float* x_data = x32.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  const int64_t weight_row_bytes = in * GemvWeightBytes(type);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / weight_row_bytes);
  // Chunks of at most kFastLinearChunkRows rows, as even as possible (17 rows
  // are 9 + 8, not 16 + 1). One chunk: one kernel call per thread, as for
  // decode; more: each thread's columns in tiles, every chunk per tile.
  const int64_t chunks = (rows + kFastLinearChunkRows - 1) / kFastLinearChunkRows;
  const int64_t tile = chunks == 1 ? out : std::max<int64_t>(1, kTileBytes / weight_row_bytes);
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
    GemvArgs chunk = args;
    for (int64_t n = begin; n < end; n += tile) {
      const int64_t n_end = std::min(end, n + tile);
      for (int64_t c = 0, row = 0; c < chunks; ++c) {
        const int64_t end_row = rows * (c + 1) / chunks;
        chunk.m = end_row - row;
        chunk.x = x_data + row * args.x_stride;
        chunk.y = y_data + row * args.y_stride;
        Gemv(chunk, n, n_end);
        row = end_row;
      }
    }
  });

  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out;
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(shape);
}

}  // namespace

std::optional<at::Tensor> FastConv1D(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias) {
  const std::optional<Operands> operands = CheckOperands(x, weight, bias, /*in_first=*/true);
  if (!operands || operands->rows > kFastLinearChunkRows) return std::nullopt;
  const GemvWeight type = operands->type;
  const int64_t in = operands->in, out = operands->out, rows = operands->rows;
  at::Tensor x32 = x.reshape({rows, in}).to(at::kFloat).contiguous();
  at::Tensor b32;
  if (bias.defined()) b32 = bias.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, out}, x.options().dtype(at::kFloat));
  GemvArgs args;
  args.m = rows;
  args.k = in;
  args.x = x32.data_ptr<float>();
  args.x_stride = in;
  args.w = weight.data_ptr();
  args.w_type = type;
  args.w_stride = out;
  args.bias = b32.defined() ? b32.data_ptr<float>() : nullptr;
  args.y = y.data_ptr<float>();
  args.y_stride = out;
  // Threads take whole eights of columns (the kernels' vectors).
  const int64_t eights = (out + 7) / 8;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / (8 * in * GemvWeightBytes(type)));
  at::parallel_for(0, eights, grain, [&](int64_t begin, int64_t end) {
    GemvTransposed(args, begin * 8, std::min(out, end * 8));
  });
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out;
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(shape);
}

std::optional<at::Tensor> FastLinear(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias) {
  return Linear(x, weight, bias, /*bfloat16_any_rows=*/false);
}

std::optional<at::Tensor> FastLinearAnyRows(const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& bias) {
  return Linear(x, weight, bias, /*bfloat16_any_rows=*/true);
}

}  // namespace accel::models::internal
