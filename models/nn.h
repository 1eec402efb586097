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

#include "absl/status/statusor.h"

#include "dispatch/layer.h"
#include "loader/config.h"

namespace accel::nn {

// y = x W^T + b, W [out, in] (transformers' nn.Linear). With `shared_weight`
// the layer holds that tensor instead of a new one (a head tied to an embedding).
class Linear : public dispatch::Layer {
 public:
  Linear(int64_t in, int64_t out, bool bias, at::ScalarType dtype,
         const at::Tensor& shared_weight = {});
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  at::Tensor bias;  // undefined without bias
};

// GPT-2's Conv1D: y = x W + b, W [in, out].
class Conv1D : public dispatch::Layer {
 public:
  Conv1D(int64_t in, int64_t out, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  at::Tensor bias;
};

class Embedding : public dispatch::Layer {
 public:
  Embedding(int64_t count, int64_t dim, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& ids);
  at::Tensor weight;
};

// x / sqrt(mean(x^2) + eps) * w, normalised in float32 and cast back before
// the weight (transformers' LlamaRMSNorm). `class_name` is the family's
// ("LlamaRMSNorm", "Qwen2RMSNorm", ...).
class RMSNorm : public dispatch::Layer {
 public:
  RMSNorm(const std::string& class_name, int64_t dim, double eps, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
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
// default, "linear" and "llama3" scaling. InvalidArgument-free: unknown
// scaling types are rejected by RotaryEmbedding's factory.
at::Tensor RopeInverseFrequencies(int64_t head_dim, double theta,
                                  const std::optional<loader::RopeScaling>& scaling);

// cos / sin tables for positions; inv_freq is a buffer that is not persistent.
class RotaryEmbedding : public dispatch::Layer {
 public:
  // InvalidArgument (through Create) for a rope type other than default,
  // linear or llama3, or missing scaling numbers.
  static absl::StatusOr<std::shared_ptr<RotaryEmbedding>> Create(
      const std::string& class_name, int64_t head_dim, double theta,
      const std::optional<loader::RopeScaling>& scaling);
  // positions [B, T] (int64) -> cos, sin [B, T, head_dim] in `dtype`.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& positions, at::ScalarType dtype);
  at::Tensor inv_freq;

 private:
  RotaryEmbedding(const std::string& class_name, const at::Tensor& inv_freq);
};

// at::matmul, except that float16 on a cpu whose libtorch lacks its kernels
// (see compat::kCpuHalfKernels) runs in float32 and is rounded back.
at::Tensor MatMul(const at::Tensor& a, const at::Tensor& b);
// x * sigmoid(x), with the same float16 fallback.
at::Tensor Silu(const at::Tensor& x);
// transformers' NewGELUActivation ("gelu_new", GPT-2): the tanh
// approximation, with the same float16 fallback.
at::Tensor GeluNew(const at::Tensor& x);

// x * cos + rotate_half(x) * sin, x [B, heads, T, head_dim], cos/sin [B, T, head_dim].
at::Tensor ApplyRotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace accel::nn

#endif  // ACCEL_MODELS_NN_H_
