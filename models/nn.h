// models/nn.h: accel's layers. Each is a dispatch::Layer whose tensors come
// from dispatch::NewParameter(), so a model built under an EmptyWeightsGuard
// costs no memory, and whose tensor names are transformers' ("weight",
// "bias"), so HuggingFace checkpoints load as they are. Forward passes follow
// transformers' arithmetic (RMSNorm in float32, rotate-half rotary).
//
// Not thread-safe to mutate; forward() may run on one thread at a time.
#ifndef ACCEL_MODELS_NN_H_
#define ACCEL_MODELS_NN_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "dispatch/layer.h"
#include "loader/config.h"
#include "quant/bnb.h"
#include "quant/matmul.h"

namespace accel::nn {

// How a linear layer stores its weight: as it is, or quantized the way
// bitsandbytes' Linear8bitLt (LLM.int8) and Linear4bit (NF4 / FP4) do.
struct LinearQuantization {
  enum class Method { kNone, kInt8, k4bit };
  Method method = Method::kNone;
  double threshold = 6.0;  // int8: llm_int8_threshold (0: no outlier decomposition)
  quant::QuantType4bit quant_type = quant::QuantType4bit::kNf4;  // 4-bit
  int64_t blocksize = quant::kDefaultBlocksize4bit;
  bool double_quant = false;
  at::ScalarType compute_dtype = at::kFloat;  // 4-bit: what the product runs in

  bool enabled() const { return method != Method::kNone; }
  // "int8", "nf4", "fp4" (+ "+dq") or "none".
  std::string ToString() const;
};

// The 4-bit quant state tensors, which transformers' checkpoints name
// "<linear>.weight.absmax" and so on: the child module "weight" of a 4-bit
// layer (bnb's Params4bit keeps them on the weight itself).
class Params4bit : public dispatch::Layer {
 public:
  Params4bit() : dispatch::Layer("Params4bit") {}
  at::Tensor absmax;            // float32 [nblocks]; uint8 with double quant
  at::Tensor quant_map;         // float32 [16]
  at::Tensor nested_absmax;     // float32 [ceil(nblocks / 256)] (double quant)
  at::Tensor nested_quant_map;  // float32 [256] (double quant)
};

// What Linear and Conv1D share: y = x W^T + b with W [out, in] as it is, or
// quantized (Quantize()). Quantized, the layer holds what a bitsandbytes
// checkpoint of transformers holds for it:
//   int8:  weight int8 [out, in], SCB float32 [out], weight_format uint8 [] (0)
//   4-bit: weight uint8 [(n+1)/2, 1] (packed), weight.absmax, weight.quant_map,
//          weight.nested_absmax, weight.nested_quant_map (child "weight"),
//          and quant_state (the metadata the checkpoint's JSON blob
//          carries). Double quant is computed from as stored: the cpu kernels
//          dequantize each block's absmax as they reach it.
class QuantizableLinear : public dispatch::Layer {
 public:
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  const LinearQuantization& quantization() const { return quantization_; }
  // The float weight's layout: [out, in], or [in, out] for Conv1D.
  bool transposed() const { return transposed_; }

  // Replaces the float weight by the tensors of `how`. On meta (empty)
  // weights they are meta, for loading (see models/quantize.h); on real ones
  // the weight is quantized now. InvalidArgument for a layer quantized
  // already, a weight shared with another layer, or a bad blocksize.
  absl::Status Quantize(const LinearQuantization& how);

  // A quantized layer's product with ATen ops alone, on any device: the
  // weight dequantized (bnb's formula) to the compute dtype (4-bit) or to
  // x's dtype (int8: no outlier decomposition, bnb's MatMul8bitFp), then
  // at::linear. forward() runs it on devices other than the cpu and CUDA,
  // and on CUDA in a build without quant/cuda's kernels (otherwise a CUDA x
  // goes to quant/cuda_matmul.h's kernels, as a cpu x to quant/matmul.h's).
  at::Tensor DequantizedForward(const at::Tensor& x);

  // A 4-bit layer's tensors as quant/matmul.h's kernels take them (views of
  // this layer's own; nothing copied).
  quant::Weight4bit Weight4bitView() const;

  at::Tensor weight;
  at::Tensor bias;                           // undefined without bias
  at::Tensor scb;                            // int8
  at::Tensor weight_format;                  // int8
  std::shared_ptr<Params4bit> weight_state;  // 4-bit
  quant::QuantState4bit quant_state;         // 4-bit

 protected:
  QuantizableLinear(const std::string& class_name, int64_t in, int64_t out, bool transposed)
      : dispatch::Layer(class_name), in_(in), out_(out), transposed_(transposed) {}
  // With `empty`, the quantized tensors are left empty (meta when the
  // weight is meta), to be loaded; otherwise the weight is quantized.
  absl::Status Quantize(const LinearQuantization& how, bool empty);
  // y for a quantized weight (throws c10::Error on an inconsistent state).
  at::Tensor QuantizedForward(const at::Tensor& x);

 private:
  int64_t in_;
  int64_t out_;
  bool transposed_;
  bool shared_weight_ = false;
  LinearQuantization quantization_;

  friend class Linear;
  friend class Linear8bitLt;
  friend class Linear4bit;
};

// y = x W^T + b, W [out, in] (transformers' nn.Linear). With `shared_weight`
// the layer holds that tensor instead of a new one (a head tied to an embedding).
class Linear : public QuantizableLinear {
 public:
  Linear(int64_t in, int64_t out, bool bias, at::ScalarType dtype,
         const at::Tensor& shared_weight = {});
  at::Tensor forward(const at::Tensor& x);
};

// y = x W^T + b for an unquantized W [out, in] (b may be undefined), as
// Linear::forward computes it: our GEMV kernels on the cpu where they apply,
// float16 through float32 on the cpu, else at::linear.
at::Tensor DenseLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// bitsandbytes' layers: a Linear quantized from the start (its tensors are
// empty until loaded, or meta under an EmptyWeightsGuard).
class Linear8bitLt : public Linear {
 public:
  Linear8bitLt(int64_t in, int64_t out, bool bias, at::ScalarType dtype, double threshold = 6.0);
};
class Linear4bit : public Linear {
 public:
  Linear4bit(int64_t in, int64_t out, bool bias, at::ScalarType dtype,
             at::ScalarType compute_dtype = at::kFloat,
             quant::QuantType4bit quant_type = quant::QuantType4bit::kNf4,
             bool double_quant = false, int64_t blocksize = quant::kDefaultBlocksize4bit);
};

// GPT-2's Conv1D: y = x W + b, W [in, out]. Quantized, W is stored [out, in]
// as transformers stores it (transposed before quantizing).
class Conv1D : public QuantizableLinear {
 public:
  Conv1D(int64_t in, int64_t out, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
};

class Embedding : public dispatch::Layer {
 public:
  Embedding(int64_t count, int64_t dim, at::ScalarType dtype,
            const std::string& class_name = "Embedding");
  at::Tensor forward(const at::Tensor& ids);
  at::Tensor weight;
};

// x / sqrt(mean(x^2) + eps) * w, normalised in float32 and cast back before
// the weight (transformers' LlamaRMSNorm). `class_name` is the family's
// ("LlamaRMSNorm", "Qwen2RMSNorm", ...). With `unit_offset` the weight is
// applied as (1 + w), in float32 before the one cast back (Gemma2RMSNorm,
// Gemma3RMSNorm, whose checkpoints store w around 0).
class RMSNorm : public dispatch::Layer {
 public:
  RMSNorm(const std::string& class_name, int64_t dim, double eps, at::ScalarType dtype,
          bool unit_offset = false);
  at::Tensor forward(const at::Tensor& x);
  // {x + residual, forward(x + residual)}: on a CUDA device one kernel for
  // the add and the norm (internal::FusedAddRmsNorm), the same bits.
  std::pair<at::Tensor, at::Tensor> AddForward(const at::Tensor& x, const at::Tensor& residual);
  // {x + residual (undefined without a residual), the linear layer
  // (linear_weight, linear_bias) applied to forward(x + residual)}, as one
  // kernel on a CUDA device for a decode step's few rows
  // (internal::FusedNormLinear); nullopt where that does not apply, and the
  // caller runs the norm and the product.
  std::optional<std::pair<at::Tensor, at::Tensor>> NormThenLinear(const at::Tensor& x,
                                                                  const at::Tensor& residual,
                                                                  const at::Tensor& linear_weight,
                                                                  const at::Tensor& linear_bias);
  at::Tensor weight;

 private:
  double eps_;
  bool unit_offset_;
};

// An embedding whose output is multiplied by `scale` rounded to the
// weight's dtype, held in a buffer "embed_scale" that is not persistent
// (Gemma3TextScaledWordEmbedding: sqrt(hidden)).
class ScaledEmbedding : public Embedding {
 public:
  ScaledEmbedding(const std::string& class_name, int64_t count, int64_t dim, at::ScalarType dtype,
                  double scale);
  at::Tensor forward(const at::Tensor& ids);
  at::Tensor embed_scale;
};

class LayerNorm : public dispatch::Layer {
 public:
  LayerNorm(int64_t dim, double eps, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  at::Tensor bias;

 private:
  int64_t dim_;
  double eps_;
};

// The rotary inverse frequencies of transformers' rope init functions:
// default, "linear" and "llama3" scaling (modeling_rope_utils.py).
// InvalidArgument-free: unknown scaling types are rejected by
// RotaryEmbedding's factory. `dim` is the rotated part of a head.
at::Tensor RopeInverseFrequencies(int64_t dim, double theta,
                                  const std::optional<loader::RopeScaling>& scaling);

// What a rotary embedding is made from (a config's RoPE fields).
struct RopeSettings {
  int64_t dim = 0;  // rotated channels of a head: head_dim x partial_rotary_factor
  double theta = 10000.0;
  std::optional<loader::RopeScaling> scaling;
  // LongRoPE (Phi-3): the context the model was pretrained with (Phi3Config's
  // original_max_position_embeddings) and the one it is extended to.
  int64_t max_position_embeddings = 0;
  std::optional<int64_t> original_max_position_embeddings;
};

// cos / sin tables for positions; inv_freq is a buffer that is not persistent.
class RotaryEmbedding : public dispatch::Layer {
 public:
  // InvalidArgument (through Create) for a rope type other than default,
  // linear, llama3 or longrope ("su" is its old name), or missing scaling
  // numbers, or LongRoPE factor lists whose length is not dim / 2.
  static absl::StatusOr<std::shared_ptr<RotaryEmbedding>> Create(const std::string& class_name,
                                                                 const RopeSettings& settings);
  static absl::StatusOr<std::shared_ptr<RotaryEmbedding>> Create(
      const std::string& class_name, int64_t head_dim, double theta,
      const std::optional<loader::RopeScaling>& scaling);
  // positions [B, T] (int64) -> cos, sin [B, T, dim] in `dtype`, computed in
  // float32 and multiplied by the attention scaling before the cast. With
  // `long_factors`, LongRoPE's long frequencies (transformers switches to
  // them when a forward's last position + 1 passes the original context).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& positions, at::ScalarType dtype,
                                            bool long_factors = false);
  // LongRoPE: the original context (0 for every other kind).
  int64_t long_after() const { return long_after_; }
  at::Tensor inv_freq;

 private:
  RotaryEmbedding(const std::string& class_name, const at::Tensor& inv_freq);
  at::Tensor long_inv_freq_;  // LongRoPE only
  int64_t long_after_ = 0;
  double attention_scaling_ = 1.0;
};

// at::matmul, except that float16 on a cpu whose libtorch lacks its kernels
// (see compat::kCpuHalfKernels) runs in float32 and is rounded back.
at::Tensor MatMul(const at::Tensor& a, const at::Tensor& b);
// x * sigmoid(x), with the same float16 fallback.
at::Tensor Silu(const at::Tensor& x);
// transformers' NewGELUActivation ("gelu_new", GPT-2): the tanh
// approximation, with the same float16 fallback.
at::Tensor GeluNew(const at::Tensor& x);
// transformers' ACT2FN by name: "silu", "gelu_pytorch_tanh" (torch's gelu
// with approximate="tanh"), "gelu" (erf), "gelu_new". Callers validate the name.
at::Tensor Activation(const std::string& name, const at::Tensor& x);
// Activation(name, gate) * up: the gated MLPs' product (one kernel for SiLU
// on a CUDA device).
at::Tensor ActivationTimes(const std::string& name, const at::Tensor& gate, const at::Tensor& up);
// The class transformers' ACT2FN gives a name ("SiLU", "PytorchGELUTanh", ...).
std::string ActivationClass(const std::string& name);

// x * cos + rotate_half(x) * sin, x [B, heads, T, head_dim], cos/sin [B, T,
// dim]: the first `dim` channels of each head rotate, the rest pass (Phi-3's
// partial rotary; dim == head_dim elsewhere).
at::Tensor ApplyRotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Whether RMSNorm, the rotary embedding and SiLU(gate) * up run as one CUDA
// kernel each on a CUDA device (models/cuda/fused_ops.h; on by default,
// process-wide); off to measure what they save (accel-bench-decode-gpu).
void SetFusedCudaOps(bool enabled);
// Whether a decode step's dense products (at most 8 rows) run as our one
// kernel on a CUDA device, with the norm before them inside it where the
// decoder has one (models/cuda/decode_gemv.h; on by default, process-wide);
// off for cuBLAS and separate norms (accel-bench-decode-gpu
// --compare_decode_gemv; ACCEL_CUDA_DECODE_GEMV=0 in the environment starts
// it off).
void SetCudaDecodeGemv(bool enabled);
// The most rows that kernel takes (4 by default, up to 8).
void SetCudaDecodeGemvRows(int64_t rows);
// Whether a mixture-of-experts block's few decode rows route on a CUDA
// device, each top-k slot's expert index read there by the 4-bit experts
// kernel so the host never waits for the routing (models/internal/
// decoder_lm.h: kDeviceRoutedMaxSlots; on by default, process-wide); off for
// the host's grouping by expert (accel-bench-decode-gpu
// --compare_host_routing; ACCEL_CUDA_EXPERT_ROUTING=0 in the environment
// starts it off).
void SetCudaExpertRouting(bool enabled);

}  // namespace accel::nn

#endif  // ACCEL_MODELS_NN_H_
