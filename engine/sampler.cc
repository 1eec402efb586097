#include "engine/sampler.h"

#include <cmath>
#include <limits>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

namespace accel::engine {
namespace {

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

}  // namespace

absl::StatusOr<Sampler> Sampler::Create(const SamplingParams& p) {
  if (absl::Status valid = ValidateSamplingParams(p); !valid.ok()) return valid;
  return Sampler(p);
}

Sampler::Sampler(const SamplingParams& params)
    : params_(params), rng_(params.seed.value_or(std::random_device{}())) {}

at::Tensor Sampler::Process(const at::Tensor& logits, absl::Span<const int64_t> previous) const {
  // float64 throughout: in float32 a temperature below about 1e-38 (its reciprocal, or the
  // temperature itself, is out of range) turned the logits into inf and NaN, and the draw then
  // fell through to the last token, often eos, at every step (issue 19). In double neither the
  // penalty (bounded in Create) nor the temperature overflows for any logit the model can give,
  // except as handled below. The vectors are vocabulary-sized: the cost is nothing beside a
  // forward pass.
  at::Tensor x = logits.to(at::kDouble).flatten().clone();
  const int64_t vocab = x.numel();
  // Repetition penalty (CTRL's): a seen token's logit is divided by the
  // penalty when positive, multiplied when negative.
  if (params_.repetition_penalty != 1.0 && !previous.empty()) {
    std::vector<int64_t> seen;
    for (int64_t id : previous) {
      if (id >= 0 && id < vocab) seen.push_back(id);
    }
    at::Tensor index = at::tensor(seen, at::kLong);
    at::Tensor picked = x.index_select(0, index);
    picked = at::where(picked < 0, picked * params_.repetition_penalty,
                       picked / params_.repetition_penalty);
    x.index_copy_(0, index, picked);
  }
  if (params_.temperature == 0) return x;  // greedy: only the argmax matters
  // A tiny positive temperature is accepted, not refused: its limit is greedy, and a client
  // sending 1e-40 means "as good as greedy"; a cut-off somewhere would be a cliff of our own.
  // Below about 1e-270 even double overflows (largest / temperature is inf, or -inf for every
  // token when all logits are negative, and the softmax of either is NaN). Shifting the largest
  // logit to 0 first changes no probability and leaves every other value below 0, so the
  // division can only send the others towards -inf (probability 0): exactly greedy, the limit.
  // Without overflow the logits are left unshifted, as transformers' warper leaves them.
  const double top = x.max().item<double>();
  if (std::isfinite(top) && !std::isfinite(top / params_.temperature)) x = x - top;
  x = x / params_.temperature;
  // Top-k keeps every token at least as large as the k-th (ties included).
  if (params_.top_k > 0 && params_.top_k < vocab) {
    const at::Tensor kth = std::get<0>(x.topk(params_.top_k)).min();
    x = x.masked_fill(x < kth, kMinusInf);
  }
  // Top-p drops the least likely tokens whose total probability is at most
  // 1 - top_p, always keeping the most likely one.
  if (params_.top_p < 1.0) {
    auto [sorted, order] = x.sort(/*dim=*/0, /*descending=*/false);
    at::Tensor cumulative = sorted.softmax(0).cumsum(0);
    at::Tensor remove = cumulative <= (1.0 - params_.top_p);
    remove[vocab - 1] = false;
    x = x.masked_fill(at::zeros_like(remove).scatter(0, order, remove), kMinusInf);
  }
  // Min-p drops tokens less likely than min_p times the most likely one.
  if (params_.min_p > 0) {
    at::Tensor probs = x.softmax(0);
    x = x.masked_fill(probs < params_.min_p * probs.max(), kMinusInf);
  }
  return x;
}

int64_t Sampler::Next(const at::Tensor& logits, absl::Span<const int64_t> previous) {
  at::Tensor x = Process(logits, previous);
  if (params_.temperature == 0) return x.argmax().item<int64_t>();
  return Draw(x.softmax(0));
}

double Sampler::Uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }

int64_t Sampler::Draw(const at::Tensor& probs) {
  const at::Tensor p64 = probs.to(at::kDouble).contiguous();
  const double* p = p64.data_ptr<double>();
  const int64_t vocab = p64.numel();
  // Inverse CDF with our own generator: reproducible across machines.
  const double u = Uniform();
  double cumulative = 0;
  int64_t last = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (p[i] <= 0) continue;
    last = i;
    cumulative += p[i];
    if (u < cumulative) return i;
  }
  return last;  // rounding left u above the total
}

Sampler Sampler::Fork(uint64_t stream) const {
  SamplingParams params = params_;
  if (params.seed) params.seed = *params.seed ^ (0x9e3779b97f4a7c15ULL * (stream + 1));
  return Sampler(params);
}

}  // namespace accel::engine
