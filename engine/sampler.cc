#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include "core/device_copy.h"

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
    // Stable: tied logits (common in bfloat16) in index order, as NextRows
    // sorts them.
    auto [sorted, order] = x.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
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

namespace {

// NextRows works on at most this many logits at a time (rows of the
// vocabulary): its float64 temporaries stay near 32 MB each however large the
// batch, memory a GPU's KV sizing does not count.
constexpr int64_t kNextRowsElements = int64_t{1} << 22;

// The per-row parameters NextRows sends to the logits' device in one copy.
enum Column { kTemperature, kKth, kHasK, kKeepBelow, kMinP, kUniform, kColumns };

}  // namespace

std::vector<int64_t> Sampler::NextRows(const at::Tensor& logits,
                                       absl::Span<Sampler* const> samplers) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const int64_t chunk = std::max<int64_t>(1, kNextRowsElements / std::max<int64_t>(vocab, 1));
  std::vector<int64_t> tokens;
  for (int64_t first = 0; first < rows; first += chunk) {
    const int64_t n = std::min(chunk, rows - first);
    // Each row's parameters and its uniform (drawn here, one per row, as
    // Next() draws it), host side, then on the device in one copy.
    at::Tensor params = at::empty({n, kColumns}, at::TensorOptions().dtype(at::kDouble));
    double* row_params = params.data_ptr<double>();
    bool any_k = false, any_p = false, any_min_p = false;
    int64_t max_k = 0;
    for (int64_t r = 0; r < n; ++r) {
      Sampler& s = *samplers[static_cast<size_t>(first + r)];
      const SamplingParams& p = s.params_;
      double* v = row_params + r * kColumns;
      const bool k = p.top_k > 0 && p.top_k < vocab;
      v[kTemperature] = p.temperature;
      v[kKth] = k ? static_cast<double>(p.top_k - 1) : 0.0;
      v[kHasK] = k ? 1.0 : 0.0;
      // Without top-p, nothing is at most 0 but what is already -inf.
      v[kKeepBelow] = p.top_p < 1.0 ? 1.0 - p.top_p : 0.0;
      v[kMinP] = p.min_p > 0 ? p.min_p : 0.0;
      v[kUniform] = s.Uniform();
      any_k |= k;
      if (k) max_k = std::max(max_k, p.top_k);
      any_p |= p.top_p < 1.0;
      any_min_p |= p.min_p > 0;
    }
    params = ToDeviceAsync(params, logits.device());
    const auto column = [&](Column c) { return params.select(1, c).unsqueeze(1); };
    // Process(), row by row the same float64 operations.
    at::Tensor x = logits.narrow(0, first, n).to(at::kDouble);
    const at::Tensor t = column(kTemperature);
    const at::Tensor top = x.amax(-1, /*keepdim=*/true);
    x = at::where(at::isfinite(top).logical_and(at::isfinite(top / t).logical_not()), x - top, x) /
        t;
    if (any_k) {
      // The largest k of any row: each row's k-th largest among them (topk,
      // as Process, not a sort of the whole vocabulary).
      const at::Tensor largest = std::get<0>(x.topk(max_k, -1));
      const at::Tensor value = largest.gather(1, column(kKth).to(at::kLong));
      const at::Tensor limit = at::where(column(kHasK) > 0, value, kMinusInf);
      x = x.masked_fill(x < limit, kMinusInf);
    }
    if (any_p) {
      auto [sorted, order] = x.sort(/*stable=*/true, -1, /*descending=*/false);
      at::Tensor remove = sorted.softmax(-1).cumsum(-1) <= column(kKeepBelow);
      remove.select(1, vocab - 1).fill_(false);
      x = x.masked_fill(at::zeros_like(remove).scatter(1, order, remove), kMinusInf);
    }
    if (any_min_p) {
      const at::Tensor probs = x.softmax(-1);
      x = x.masked_fill(probs < column(kMinP) * probs.amax(-1, /*keepdim=*/true), kMinusInf);
    }
    // Draw(), for every row: the first token whose cumulative probability
    // passes the row's uniform.
    const at::Tensor probs = x.softmax(-1);
    const at::Tensor passed =
        (probs.cumsum(-1) <= column(kUniform)).sum(-1).to(at::kCPU).contiguous();
    for (int64_t r = 0; r < n; ++r) {
      int64_t token = passed.data_ptr<int64_t>()[r];
      if (token >= vocab) {
        // Rounding left u above the row's total: its last possible token.
        const at::Tensor row = probs[r].to(at::kCPU).contiguous();
        const double* p = row.data_ptr<double>();
        token = 0;
        for (int64_t i = 0; i < vocab; ++i) {
          if (p[i] > 0) token = i;
        }
      }
      tokens.push_back(token);
    }
  }
  return tokens;
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
