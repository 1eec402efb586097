#include "models/internal/cpu_linear.h"

#include <algorithm>
#include <vector>

// Compiled with -fopenmp and without the shared PCH (accel_torch_parallel in
// models/CMakeLists.txt): at::parallel_for is serial otherwise.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>

#include "models/internal/gemv.h"

namespace accel::models::internal {
namespace {

// Weight bytes per thread below which a product is not split further: a split
// costs a few microseconds, and 256 KiB take about 25 us to stream.
constexpr int64_t kMinBytesPerTask = int64_t{256} << 10;

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

}  // namespace

std::optional<at::Tensor> FastLinear(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias) {
  if (!x.defined() || !weight.defined() || !DenseCpu(x) || !DenseCpu(weight)) return std::nullopt;
  const std::optional<GemvWeight> type = WeightType(weight.scalar_type());
  if (!type || x.scalar_type() != weight.scalar_type()) return std::nullopt;
  if (weight.dim() != 2 || !weight.is_contiguous() || x.dim() < 1) return std::nullopt;
  const int64_t out = weight.size(0), in = weight.size(1);
  if (in == 0 || out == 0 || x.size(-1) != in) return std::nullopt;
  const int64_t rows = x.numel() / in;
  if (rows < 1 || rows > kFastLinearMaxRows) return std::nullopt;
  if (bias.defined() && (!DenseCpu(bias) || bias.scalar_type() != weight.scalar_type() ||
                         bias.dim() != 1 || bias.size(0) != out)) {
    return std::nullopt;
  }
  if (c10::GradMode::is_enabled() &&
      (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()))) {
    return std::nullopt;
  }

  at::Tensor x32 = x.reshape({rows, in}).to(at::kFloat);
  if (in > 1 && x32.stride(1) != 1) x32 = x32.contiguous();
  at::Tensor b32;
  if (bias.defined()) b32 = bias.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, out}, x.options().dtype(at::kFloat));

  GemvArgs args;
  args.m = rows;
  args.k = in;
  args.x = x32.data_ptr<float>();
  args.x_stride = x32.stride(0);
  args.w = weight.data_ptr();
  args.w_type = *type;
  args.w_stride = in;
  args.bias = b32.defined() ? b32.data_ptr<float>() : nullptr;
  args.y = y.data_ptr<float>();
  args.y_stride = out;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / (in * GemvWeightBytes(*type)));
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) { Gemv(args, begin, end); });

  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out;
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(shape);
}

}  // namespace accel::models::internal
