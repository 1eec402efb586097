#include "engine/penalty_logits_processor.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include "core/device_copy.h"

namespace accel::engine {
namespace {

class PenaltyLogitsProcessor : public LogitsProcessor {
 public:
  PenaltyLogitsProcessor(const SamplingParams& params, int64_t prompt_tokens)
      : presence_(params.presence_penalty),
        frequency_(params.frequency_penalty),
        prompt_tokens_(prompt_tokens) {
    for (const auto& [id, bias] : params.logit_bias) bias_[id] += bias;
  }

  void Apply(absl::Span<const int64_t> previous, at::Tensor& logits) override {
    std::map<int64_t, double> delta = bias_;
    const size_t start = static_cast<size_t>(
        std::min<int64_t>(prompt_tokens_, static_cast<int64_t>(previous.size())));
    if (presence_ != 0 || frequency_ != 0) {
      std::map<int64_t, int64_t> counts;
      for (size_t i = start; i < previous.size(); ++i) ++counts[previous[i]];
      for (const auto& [id, n] : counts) {
        delta[id] -= presence_ + frequency_ * static_cast<double>(n);
      }
    }
    const int64_t vocab = logits.size(0);
    if (logits.is_cpu() && logits.scalar_type() == at::kFloat && logits.is_contiguous()) {
      float* data = logits.data_ptr<float>();
      for (const auto& [id, d] : delta) {
        if (id >= 0 && id < vocab) data[id] += static_cast<float>(d);
      }
      return;
    }
    at::Tensor add = at::zeros({vocab}, at::TensorOptions().dtype(at::kFloat));
    float* a = add.data_ptr<float>();
    for (const auto& [id, d] : delta) {
      if (id >= 0 && id < vocab) a[id] = static_cast<float>(d);
    }
    logits.add_(ToDeviceAsync(add, logits.device()).to(logits.scalar_type()));
  }

 private:
  std::map<int64_t, double> bias_;
  double presence_;
  double frequency_;
  int64_t prompt_tokens_;
};

class MinTokensLogitsProcessor : public LogitsProcessor {
 public:
  MinTokensLogitsProcessor(std::vector<int64_t> stop_token_ids, int64_t min_tokens,
                           int64_t prompt_tokens)
      : stop_token_ids_(std::move(stop_token_ids)), until_(prompt_tokens + min_tokens) {}

  void Apply(absl::Span<const int64_t> previous, at::Tensor& logits) override {
    if (static_cast<int64_t>(previous.size()) >= until_) return;
    const int64_t vocab = logits.size(0);
    for (int64_t id : stop_token_ids_) {
      if (id >= 0 && id < vocab) logits[id].fill_(-std::numeric_limits<float>::infinity());
    }
  }

 private:
  std::vector<int64_t> stop_token_ids_;
  int64_t until_;  // the position (prompt + min_tokens) from which stops may be sampled
};

class ChainedLogitsProcessor : public LogitsProcessor {
 public:
  explicit ChainedLogitsProcessor(std::vector<std::unique_ptr<LogitsProcessor>> parts)
      : parts_(std::move(parts)) {}
  void Apply(absl::Span<const int64_t> previous, at::Tensor& logits) override {
    for (auto& part : parts_) part->Apply(previous, logits);
  }

 private:
  std::vector<std::unique_ptr<LogitsProcessor>> parts_;
};

}  // namespace

std::unique_ptr<LogitsProcessor> MakePenaltyLogitsProcessor(const SamplingParams& params,
                                                            int64_t prompt_tokens) {
  if (params.presence_penalty == 0 && params.frequency_penalty == 0 && params.logit_bias.empty()) {
    return nullptr;
  }
  return std::make_unique<PenaltyLogitsProcessor>(params, prompt_tokens);
}

std::unique_ptr<LogitsProcessor> MakeMinTokensLogitsProcessor(std::vector<int64_t> stop_token_ids,
                                                              int64_t min_tokens,
                                                              int64_t prompt_tokens) {
  if (min_tokens <= 0 || stop_token_ids.empty()) return nullptr;
  return std::make_unique<MinTokensLogitsProcessor>(std::move(stop_token_ids), min_tokens,
                                                    prompt_tokens);
}

std::unique_ptr<LogitsProcessor> ChainLogitsProcessors(
    std::vector<std::unique_ptr<LogitsProcessor>> parts) {
  parts.erase(std::remove(parts.begin(), parts.end(), nullptr), parts.end());
  if (parts.empty()) return nullptr;
  if (parts.size() == 1) return std::move(parts.front());
  return std::make_unique<ChainedLogitsProcessor>(std::move(parts));
}

}  // namespace accel::engine
