#include "models/nn.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include "absl/strings/str_cat.h"

#include "core/cpu_features.h"
#include "core/status.h"
#include "core/torch_compat.h"
#include "models/internal/cpu_linear.h"
#include "models/internal/decoder_lm.h"
#include "models/internal/fused_ops.h"
#include "quant/cuda_matmul.h"
#include "quant/matmul.h"

namespace accel::nn {

namespace {

// float16 on a cpu without float16 kernels: compute in float32.
bool NeedsHalfUpcast(const at::Tensor& x) {
  return !compat::kCpuHalfKernels && x.scalar_type() == at::kHalf && x.device().is_cpu();
}

at::Tensor Float(const at::Tensor& t) { return t.defined() ? t.to(at::kFloat) : t; }

// A product of float16 values without float16 kernels, or of bfloat16 values
// where libtorch's bfloat16 product is a loop on one thread (no oneDNN for
// it on this cpu: core/cpu_features.h): in float32 (OpenBLAS), which holds
// either dtype's values exactly, the result rounded once to the dtype, as a
// product that sums in float32 rounds it.
bool NeedsFloatProduct(const at::Tensor& x) {
  return NeedsHalfUpcast(x) || (x.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
                                !CpuFeaturesOfThisMachine().onednn_bf16_matmul);
}

}  // namespace

std::string LinearQuantization::ToString() const {
  switch (method) {
    case Method::kNone:
      return "none";
    case Method::kInt8:
      return "int8";
    case Method::k4bit:
      return absl::StrCat(quant::QuantType4bitName(quant_type), double_quant ? "+dq" : "");
  }
  return "none";
}

namespace {

at::Tensor Empty(at::IntArrayRef shape, at::ScalarType dtype, bool meta) {
  return at::empty(shape, at::TensorOptions().device(meta ? at::kMeta : at::kCPU).dtype(dtype));
}

}  // namespace

absl::Status QuantizableLinear::Quantize(const LinearQuantization& how) {
  return Quantize(how, /*empty=*/weight.is_meta());
}

absl::Status QuantizableLinear::Quantize(const LinearQuantization& how, bool empty) {
  if (quantization_.enabled()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer is quantized already (", quantization_.ToString(), ")"));
  }
  if (!how.enabled()) return absl::OkStatus();
  if (shared_weight_) {
    return absl::InvalidArgumentError(
        "the weight is shared with another layer (a tied head): it cannot be quantized");
  }
  if (how.method == LinearQuantization::Method::k4bit &&
      !quant::IsValidBlocksize4bit(how.blocksize)) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocksize ", how.blocksize, ": expected a power of two from 32 to 4096"));
  }
  const bool meta = weight.is_meta();
  if (!empty && !weight.device().is_cpu()) {
    return absl::InvalidArgumentError("quantizing a loaded weight needs it on the cpu");
  }
  at::Tensor dense;  // [out, in]
  if (!empty) {
    ACCEL_RETURN_IF_ERROR(
        CallTorch([&] { dense = transposed_ ? weight.t().contiguous() : weight; }));
  }
  const at::ScalarType dtype = weight.scalar_type();
  at::Tensor new_weight;
  if (how.method == LinearQuantization::Method::kInt8) {
    at::Tensor new_scb;
    if (empty) {
      new_weight = Empty({out_, in_}, at::kChar, meta);
      new_scb = Empty({out_}, at::kFloat, meta);
    } else {
      ACCEL_ASSIGN_OR_RETURN(quant::QuantizedInt8 q, quant::QuantizeInt8(dense));
      new_weight = q.weight;
      new_scb = q.scb;
    }
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      scb = register_buffer("SCB", new_scb);
      weight_format = register_buffer("weight_format", at::zeros({}, at::kByte));
    }));
  } else {
    auto state = std::make_shared<Params4bit>();
    quant::QuantState4bit qs;
    qs.quant_type = how.quant_type;
    qs.blocksize = how.blocksize;
    qs.dtype = dtype;
    qs.shape = {out_, in_};
    qs.double_quant = how.double_quant;
    if (empty) {
      const quant::Layout4bit layout =
          quant::LayoutOf4bit(out_ * in_, how.blocksize, how.double_quant);
      new_weight = Empty(layout.packed_shape, at::kByte, meta);
      state->absmax = Empty({layout.absmax_len}, how.double_quant ? at::kByte : at::kFloat, meta);
      state->quant_map = Empty({16}, at::kFloat, meta);
      if (how.double_quant) {
        state->nested_absmax = Empty({layout.nested_absmax_len}, at::kFloat, meta);
        state->nested_quant_map = Empty({256}, at::kFloat, meta);
      }
    } else {
      ACCEL_ASSIGN_OR_RETURN(
          quant::Quantized4bit q,
          quant::Quantize4bit(dense, how.quant_type, how.blocksize, how.double_quant));
      new_weight = q.packed;
      state->absmax = q.absmax;
      state->quant_map = q.quant_map;
      state->nested_absmax = q.nested_absmax;
      state->nested_quant_map = q.nested_quant_map;
      qs = q.state;
    }
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      state->absmax = state->register_buffer("absmax", state->absmax);
      state->quant_map = state->register_buffer("quant_map", state->quant_map);
      if (how.double_quant) {
        state->nested_absmax = state->register_buffer("nested_absmax", state->nested_absmax);
        state->nested_quant_map =
            state->register_buffer("nested_quant_map", state->nested_quant_map);
      }
      weight_state = register_module("weight", state);
    }));
    quant_state = qs;
  }
  // The same name, now the quantized tensor (integer: no gradient).
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    new_weight.set_requires_grad(false);
    parameters_["weight"] = new_weight;
  }));
  weight = new_weight;
  quantization_ = how;
  return absl::OkStatus();
}

at::Tensor QuantizableLinear::DequantizedForward(const at::Tensor& x) {
  TORCH_CHECK(quantization_.enabled(), "DequantizedForward: ", name(), " is not quantized");
  at::Tensor w;
  at::ScalarType compute = x.scalar_type();
  if (quantization_.method == LinearQuantization::Method::kInt8) {
    // CB * SCB / 127 in float32 (bnb's int8_vectorwise_dequant constant).
    w = weight.to(at::kFloat) * scb.to(at::kFloat).unsqueeze(1) *
        static_cast<float>(7.874015718698502e-3);
  } else {
    compute = quantization_.compute_dtype;
    const at::Tensor bytes = weight.reshape({-1});
    const at::Tensor codes = at::stack({bytes.__rshift__(4), bytes.__and__(0xF)}, 1)
                                 .reshape({-1})
                                 .narrow(0, 0, out_ * in_)
                                 .to(at::kLong);
    at::Tensor absmax = weight_state->absmax.to(at::kFloat);
    if (quantization_.double_quant) {
      // bnb's dequantize_blockwise (one float32 multiply), then + offset:
      // two ops, two roundings, as quant::BlockAbsmax does on the cpu.
      const int64_t blocks = weight_state->absmax.numel();
      const at::Tensor scaled =
          weight_state->nested_quant_map.index_select(0, weight_state->absmax.to(at::kLong)) *
          weight_state->nested_absmax.repeat_interleave(quant::kNestedBlocksize)
              .narrow(0, 0, blocks);
      absmax = scaled + quant_state.nested_offset;
    }
    const at::Tensor scales =
        absmax.repeat_interleave(quant_state.blocksize).narrow(0, 0, out_ * in_);
    w = weight_state->quant_map.to(at::kFloat).index_select(0, codes) * scales;
    w = w.view({out_, in_});
  }
  w = w.to(compute);
  const at::Tensor b = bias.defined() ? bias.to(compute) : bias;
  at::Tensor y;
  if (NeedsFloatProduct(w)) {
    y = at::linear(Float(x.to(compute)), Float(w), Float(b)).to(compute);
  } else {
    y = at::linear(x.to(compute), w, b);
  }
  return y.to(x.scalar_type());
}

quant::Weight4bit QuantizableLinear::Weight4bitView() const {
  quant::Weight4bit w;
  w.packed = weight;
  w.absmax = weight_state->absmax;  // uint8 codes with double quant
  w.code = weight_state->quant_map;
  if (quantization_.double_quant) {
    w.nested_absmax = weight_state->nested_absmax;
    w.nested_code = weight_state->nested_quant_map;
    w.nested_offset = quant_state.nested_offset;
  }
  w.blocksize = quant_state.blocksize;
  w.out_features = out_;
  w.in_features = in_;
  return w;
}

at::Tensor QuantizableLinear::QuantizedForward(const at::Tensor& x) {
  // On a CUDA device, quant/cuda's kernels where this build has them; on
  // other devices (and CUDA without them), ATen ops alone.
  const bool cuda = x.is_cuda() && quant::CudaKernelsBuilt();
  if (!x.device().is_cpu() && !cuda) return DequantizedForward(x);
  absl::StatusOr<at::Tensor> y;
  if (quantization_.method == LinearQuantization::Method::kInt8) {
    y = cuda ? quant::Int8LinearForwardCuda(x, weight, scb, bias, quantization_.threshold)
             : quant::Int8LinearForward(x, weight, scb, bias, quantization_.threshold);
  } else {
    const quant::Weight4bit w = Weight4bitView();
    const at::ScalarType compute = quantization_.compute_dtype;
    if (!cuda && x.numel() / std::max<int64_t>(in_, 1) > models::internal::kFastLinearChunkRows &&
        compute != at::kBFloat16) {
      // Many rows (a prefill): the dense weight through our GEMV kernels, as
      // an unquantized layer runs (libtorch's float32 product on this BLAS is
      // far slower; bfloat16 goes to oneDNN inside Linear4bitForward).
      absl::StatusOr<at::Tensor> dense = quant::Dequantize4bitDense(w, compute);
      TORCH_CHECK(dense.ok(), "quantized ", name(), ": ", dense.status().message());
      const at::Tensor b = bias.defined() ? bias.to(compute) : bias;
      if (std::optional<at::Tensor> fast = models::internal::FastLinear(x.to(compute), *dense, b)) {
        return fast->to(x.scalar_type());
      }
    }
    y = cuda ? quant::Linear4bitForwardCuda(x, w, bias, compute)
             : quant::Linear4bitForward(x, w, bias, compute);
  }
  TORCH_CHECK(y.ok(), "quantized ", name(), ": ", y.status().message());
  return *std::move(y);
}

Linear::Linear(int64_t in, int64_t out, bool bias, at::ScalarType dtype,
               const at::Tensor& shared_weight)
    : QuantizableLinear("Linear", in, out, /*transposed=*/false) {
  shared_weight_ = shared_weight.defined();
  weight = shared_weight.defined() ? register_parameter("weight", shared_weight)
                                   : AddParameter("weight", {out, in}, dtype);
  if (bias) this->bias = AddParameter("bias", {out}, dtype);
}

Linear8bitLt::Linear8bitLt(int64_t in, int64_t out, bool bias, at::ScalarType dtype,
                           double threshold)
    : Linear(in, out, bias, dtype) {
  LinearQuantization how;
  how.method = LinearQuantization::Method::kInt8;
  how.threshold = threshold;
  const absl::Status status = Quantize(how, /*empty=*/true);
  TORCH_CHECK(status.ok(), "Linear8bitLt: ", status.message());
}

Linear4bit::Linear4bit(int64_t in, int64_t out, bool bias, at::ScalarType dtype,
                       at::ScalarType compute_dtype, quant::QuantType4bit quant_type,
                       bool double_quant, int64_t blocksize)
    : Linear(in, out, bias, dtype) {
  LinearQuantization how;
  how.method = LinearQuantization::Method::k4bit;
  how.quant_type = quant_type;
  how.double_quant = double_quant;
  how.blocksize = blocksize;
  how.compute_dtype = compute_dtype;
  const absl::Status status = Quantize(how, /*empty=*/true);
  TORCH_CHECK(status.ok(), "Linear4bit: ", status.message());
}

at::Tensor MatMul(const at::Tensor& a, const at::Tensor& b) {
  if (NeedsFloatProduct(a)) return at::matmul(Float(a), Float(b)).to(a.scalar_type());
  return at::matmul(a, b);
}

at::Tensor Silu(const at::Tensor& x) {
  if (NeedsHalfUpcast(x)) return at::silu(Float(x)).to(at::kHalf);
  return at::silu(x);
}

at::Tensor GeluNew(const at::Tensor& x) {
  if (NeedsHalfUpcast(x)) return GeluNew(Float(x)).to(at::kHalf);
  return 0.5 * x * (1.0 + at::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * at::pow(x, 3.0))));
}

at::Tensor Activation(const std::string& name, const at::Tensor& x) {
  if (name == "silu") return Silu(x);
  if (name == "gelu_new") return GeluNew(x);
  if (NeedsHalfUpcast(x)) return Activation(name, Float(x)).to(at::kHalf);
  // PytorchGELUTanh: torch's own kernel, whose last bits differ from GeluNew's formula.
  if (name == "gelu_pytorch_tanh") return at::gelu(x, "tanh");
  return at::gelu(x);
}

at::Tensor ActivationTimes(const std::string& name, const at::Tensor& gate, const at::Tensor& up) {
  // On a CUDA device SiLU and the product are one kernel (the same bits).
  if (name == "silu") {
    if (std::optional<at::Tensor> fused = models::internal::FusedSiluMul(gate, up)) return *fused;
  }
  return Activation(name, gate) * up;
}

void SetFusedCudaOps(bool enabled) { models::internal::SetFusedCudaOps(enabled); }

void SetCudaDecodeGemv(bool enabled) { models::internal::SetCudaDecodeGemv(enabled); }

void SetCudaDecodeGemvRows(int64_t rows) { models::internal::SetCudaDecodeGemvRows(rows); }

void SetCudaExpertRouting(bool enabled) { models::internal::RouteExpertsOnDevice(enabled); }

std::string ActivationClass(const std::string& name) {
  if (name == "silu") return "SiLU";
  if (name == "gelu_pytorch_tanh") return "PytorchGELUTanh";
  if (name == "gelu_new") return "NewGELUActivation";
  return "GELUActivation";
}

at::Tensor DenseLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  // On the cpu our GEMV kernels (models/internal/cpu_linear.h): a decode step
  // streams the weights at close to memory bandwidth, a prefill runs them over
  // chunks of rows (in bfloat16 only up to one chunk: oneDNN is faster above).
  if (std::optional<at::Tensor> y = models::internal::FastLinear(x, weight, bias)) return *y;
  // On a CUDA device a decode step's rows by one kernel of ours, where cuBLAS
  // launches a split-K GEMV and its reduce (models/cuda/decode_gemv.h).
  if (std::optional<at::Tensor> y = models::internal::FusedDecodeLinear(x, weight, bias)) {
    return *y;
  }
  if (NeedsFloatProduct(x)) {
    return at::linear(Float(x), Float(weight), Float(bias)).to(x.scalar_type());
  }
  return at::linear(x, weight, bias);
}

at::Tensor Linear::forward(const at::Tensor& x) {
  if (quantization().enabled()) return QuantizedForward(x);
  return DenseLinear(x, weight, bias);
}

Conv1D::Conv1D(int64_t in, int64_t out, at::ScalarType dtype)
    : QuantizableLinear("Conv1D", in, out, /*transposed=*/true) {
  weight = AddParameter("weight", {in, out}, dtype);
  bias = AddParameter("bias", {out}, dtype);
}

at::Tensor Conv1D::forward(const at::Tensor& x) {
  if (quantization().enabled()) return QuantizedForward(x);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = weight.size(1);
  if (NeedsFloatProduct(x)) {
    // Decode's few rows by our kernel over the [in, out] weight as it is;
    // more rows through a float32 copy of it, whose cost those rows share.
    if (std::optional<at::Tensor> y = models::internal::FastConv1D(x, weight, bias)) return *y;
    return at::addmm(Float(bias), Float(x).reshape({-1, x.size(-1)}), Float(weight))
        .to(x.scalar_type())
        .view(shape);
  }
  return at::addmm(bias, x.reshape({-1, x.size(-1)}), weight).view(shape);
}

Embedding::Embedding(int64_t count, int64_t dim, at::ScalarType dtype,
                     const std::string& class_name)
    : dispatch::Layer(class_name) {
  weight = AddParameter("weight", {count, dim}, dtype);
}

at::Tensor Embedding::forward(const at::Tensor& ids) { return at::embedding(weight, ids); }

ScaledEmbedding::ScaledEmbedding(const std::string& class_name, int64_t count, int64_t dim,
                                 at::ScalarType dtype, double scale)
    : Embedding(count, dim, dtype, class_name) {
  // Python's float scale, rounded once to the model dtype (as from_pretrained
  // builds the buffer under that default dtype).
  embed_scale = AddBuffer("embed_scale", at::scalar_tensor(scale, at::TensorOptions(dtype)),
                          /*persistent=*/false);
}

at::Tensor ScaledEmbedding::forward(const at::Tensor& ids) {
  return at::embedding(weight, ids) * embed_scale.to(weight.device(), weight.scalar_type());
}

RMSNorm::RMSNorm(const std::string& class_name, int64_t dim, double eps, at::ScalarType dtype,
                 bool unit_offset)
    : dispatch::Layer(class_name), eps_(eps), unit_offset_(unit_offset) {
  weight = AddParameter("weight", {dim}, dtype);
}

at::Tensor RMSNorm::forward(const at::Tensor& x) {
  // On a CUDA device one kernel for the eight below (models/cuda/fused_ops.h).
  if (std::optional<at::Tensor> fused =
          models::internal::FusedRmsNorm(x, weight, eps_, unit_offset_)) {
    return *fused;
  }
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean({-1}, /*keepdim=*/true) + eps_);
  // Gemma: (x * (1 + w)) in float32, one cast at the end (modeling_gemma2.py).
  if (unit_offset_) return (h * (1.0 + weight.to(at::kFloat))).to(x.scalar_type());
  return weight * h.to(x.scalar_type());
}

std::pair<at::Tensor, at::Tensor> RMSNorm::AddForward(const at::Tensor& x,
                                                      const at::Tensor& residual) {
  if (auto fused = models::internal::FusedAddRmsNorm(x, residual, weight, eps_, unit_offset_)) {
    return *std::move(fused);
  }
  at::Tensor sum = x + residual;
  at::Tensor normed = forward(sum);
  return {std::move(sum), std::move(normed)};
}

std::optional<std::pair<at::Tensor, at::Tensor>> RMSNorm::NormThenLinear(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& linear_weight,
    const at::Tensor& linear_bias) {
  return models::internal::FusedNormLinear(x, residual, weight, eps_, unit_offset_, linear_weight,
                                           linear_bias);
}

LayerNorm::LayerNorm(int64_t dim, double eps, at::ScalarType dtype)
    : dispatch::Layer("LayerNorm"), dim_(dim), eps_(eps) {
  weight = AddParameter("weight", {dim}, dtype);
  bias = AddParameter("bias", {dim}, dtype);
}

at::Tensor LayerNorm::forward(const at::Tensor& x) {
  if (NeedsHalfUpcast(x)) {
    return at::layer_norm(Float(x), {dim_}, Float(weight), Float(bias), eps_).to(at::kHalf);
  }
  return at::layer_norm(x, {dim_}, weight, bias, eps_);
}

at::Tensor RopeInverseFrequencies(int64_t dim, double theta,
                                  const std::optional<loader::RopeScaling>& scaling) {
  at::Tensor inv_freq = 1.0 / at::pow(theta, at::arange(0, dim, 2, at::kLong).to(at::kFloat) /
                                                 static_cast<double>(dim));
  if (!scaling || scaling->rope_type.empty() || scaling->rope_type == "default") return inv_freq;
  const double factor = scaling->numbers.count("factor") ? scaling->numbers.at("factor") : 1.0;
  if (scaling->rope_type == "linear") return inv_freq / factor;
  // llama3: long wavelengths are divided by `factor`, short ones kept, and
  // the band between them interpolated (transformers' _compute_llama3_parameters).
  const double low = scaling->numbers.at("low_freq_factor");
  const double high = scaling->numbers.at("high_freq_factor");
  const double old_context = scaling->numbers.at("original_max_position_embeddings");
  const double low_wavelen = old_context / low;
  const double high_wavelen = old_context / high;
  at::Tensor wavelen = 2 * M_PI / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / factor, inv_freq);
  at::Tensor smooth = (old_context / wavelen - low) / (high - low);
  at::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
  at::Tensor medium =
      at::logical_not(wavelen < high_wavelen).logical_and(at::logical_not(wavelen > low_wavelen));
  return at::where(medium, smoothed, scaled);
}

namespace {

bool IsLongRope(const std::optional<loader::RopeScaling>& scaling) {
  return scaling && (scaling->rope_type == "longrope" || scaling->rope_type == "su");
}

}  // namespace

absl::StatusOr<std::shared_ptr<RotaryEmbedding>> RotaryEmbedding::Create(
    const std::string& class_name, int64_t head_dim, double theta,
    const std::optional<loader::RopeScaling>& scaling) {
  RopeSettings settings;
  settings.dim = head_dim;
  settings.theta = theta;
  settings.scaling = scaling;
  return Create(class_name, settings);
}

absl::StatusOr<std::shared_ptr<RotaryEmbedding>> RotaryEmbedding::Create(
    const std::string& class_name, const RopeSettings& settings) {
  const int64_t head_dim = settings.dim;
  const double theta = settings.theta;
  const std::optional<loader::RopeScaling>& scaling = settings.scaling;
  if (head_dim <= 0 || head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotary embeddings need an even head size, got ", head_dim));
  }
  if (IsLongRope(scaling)) {
    // transformers' _compute_longrope_parameters (modeling_rope_utils.py,
    // v4.53.0): inv_freq = 1 / (factor_i * theta^(2i/dim)), short factors up
    // to the original context and long ones past it; cos and sin scaled by
    // sqrt(1 + ln(s) / ln(original)), s = max_position / original, unless
    // rope_scaling names an attention_factor.
    for (const char* key : {"short_factor", "long_factor"}) {
      auto it = scaling->lists.find(key);
      if (it == scaling->lists.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("config.json: rope_scaling 'longrope' needs the list '", key, "'"));
      }
      if (static_cast<int64_t>(it->second.size()) != head_dim / 2) {
        return absl::InvalidArgumentError(
            absl::StrCat("config.json: rope_scaling '", key, "' has ", it->second.size(),
                         " numbers; the rotary dimension ", head_dim, " needs ", head_dim / 2));
      }
    }
    const int64_t original =
        settings.original_max_position_embeddings.value_or(settings.max_position_embeddings);
    if (original <= 0) {
      return absl::InvalidArgumentError(
          "config.json: rope_scaling 'longrope' needs original_max_position_embeddings");
    }
    double attention = 1.0;
    if (auto it = scaling->numbers.find("attention_factor"); it != scaling->numbers.end()) {
      attention = it->second;
    } else {
      double factor = scaling->numbers.count("factor") ? scaling->numbers.at("factor") : 1.0;
      if (settings.original_max_position_embeddings) {
        factor = static_cast<double>(settings.max_position_embeddings) /
                 static_cast<double>(*settings.original_max_position_embeddings);
      }
      if (factor > 1.0) {
        attention = std::sqrt(1 + std::log(factor) / std::log(static_cast<double>(original)));
      }
    }
    at::Tensor shape =
        at::arange(0, head_dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(head_dim);
    const auto frequencies = [&](const char* key) {
      return 1.0 / (at::tensor(scaling->lists.at(key), at::kDouble).to(at::kFloat) *
                    at::pow(theta, shape));
    };
    std::shared_ptr<RotaryEmbedding> rope(
        new RotaryEmbedding(class_name, frequencies("short_factor")));
    rope->long_inv_freq_ = frequencies("long_factor");
    rope->long_after_ = original;
    rope->attention_scaling_ = attention;
    return rope;
  }
  if (scaling && !scaling->rope_type.empty() && scaling->rope_type != "default") {
    const std::string& type = scaling->rope_type;
    if (type != "linear" && type != "llama3") {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: rope_scaling type '", type,
                       "' is not supported (default, linear, llama3, longrope)"));
    }
    const char* needed_llama3[] = {"factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings"};
    for (const char* key : needed_llama3) {
      if ((type == "llama3" || std::string(key) == "factor") && !scaling->numbers.count(key)) {
        return absl::InvalidArgumentError(
            absl::StrCat("config.json: rope_scaling '", type, "' needs '", key, "'"));
      }
    }
  }
  return std::shared_ptr<RotaryEmbedding>(
      new RotaryEmbedding(class_name, RopeInverseFrequencies(head_dim, theta, scaling)));
}

RotaryEmbedding::RotaryEmbedding(const std::string& class_name, const at::Tensor& inv_freq)
    : dispatch::Layer(class_name) {
  this->inv_freq = AddBuffer("inv_freq", inv_freq, /*persistent=*/false);
}

std::pair<at::Tensor, at::Tensor> RotaryEmbedding::forward(const at::Tensor& positions,
                                                           at::ScalarType dtype,
                                                           bool long_factors) {
  const at::Tensor& frequencies =
      long_factors && long_inv_freq_.defined() ? long_inv_freq_ : inv_freq;
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * frequencies.to(positions.device());
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos(), sin = emb.sin();
  if (attention_scaling_ != 1.0) {
    cos = cos * attention_scaling_;
    sin = sin * attention_scaling_;
  }
  return {cos.to(dtype), sin.to(dtype)};
}

at::Tensor ApplyRotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t dim = cos.size(-1);
  if (dim < x.size(-1)) {
    // Phi-3's partial rotary: the first `dim` channels rotate, the rest pass.
    return at::cat(
        {ApplyRotary(x.narrow(-1, 0, dim), cos, sin), x.narrow(-1, dim, x.size(-1) - dim)}, -1);
  }
  // On a CUDA device one kernel for the five below (models/cuda/fused_ops.h).
  if (cos.dim() == 3) {
    if (std::optional<at::Tensor> fused = models::internal::FusedRotary(x, cos, sin)) {
      return *fused;
    }
  }
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

}  // namespace accel::nn
