// models/causal_lm.h: a language model of a supported family, built from its
// config on accel::nn layers, with the module structure and tensor names of
// transformers (so models::ModuleTreeFor() describes it exactly and HF
// checkpoints load into it through dispatch::DispatchedModel).
//
//   ACCEL_ASSIGN_OR_RETURN(auto model, BuildCausalLM(config, at::kBFloat16));  // empty weights
//   ACCEL_ASSIGN_OR_RETURN(auto dispatched, dispatch::DispatchedModel::Load(model, dir, map, {}));
//   KvCache cache;
//   ACCEL_ASSIGN_OR_RETURN(at::Tensor logits, model->Forward(ids, positions, &cache,
//   dispatched.get()));
#ifndef ACCEL_MODELS_CAUSAL_LM_H_
#define ACCEL_MODELS_CAUSAL_LM_H_

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

#include "dispatch/dispatch.h"
#include "dispatch/layer.h"
#include "loader/config.h"

namespace accel::models {

// Keys and values of every layer for the tokens seen so far, each
// [batch, kv_heads, seen, head_dim] on its layer's device. Empty at first.
struct KvCache {
  std::vector<at::Tensor> keys;
  std::vector<at::Tensor> values;
  int64_t seen() const { return keys.empty() || !keys[0].defined() ? 0 : keys[0].size(2); }
};

class CausalLM : public dispatch::Layer {
 public:
  using dispatch::Layer::Layer;
  // input_ids and positions [batch, tokens] (int64): logits [batch, tokens,
  // vocab] in float32, on the device of the inputs. Attention is causal over
  // the cache and these tokens. With `dispatched`, each block runs inside its
  // execution scope (offloaded weights brought in, inputs moved to its device).
  virtual absl::StatusOr<at::Tensor> Forward(const at::Tensor& input_ids,
                                             const at::Tensor& positions, KvCache* cache,
                                             dispatch::DispatchedModel* dispatched) = 0;
};

// A model of the config's family with uninitialised weights (meta weights
// under a dispatch::EmptyWeightsGuard). InvalidArgument for an unknown
// architecture (listing the supported ones) or an invalid config.
absl::StatusOr<std::shared_ptr<CausalLM>> BuildCausalLM(const loader::ModelConfig& config,
                                                        at::ScalarType dtype);

}  // namespace accel::models

#endif  // ACCEL_MODELS_CAUSAL_LM_H_
