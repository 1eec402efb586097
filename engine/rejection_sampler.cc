#include "engine/rejection_sampler.h"

#include <algorithm>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

namespace accel::engine {

Verification VerifyDrafts(Sampler& sampler, const at::Tensor& logits,
                          absl::Span<const int64_t> previous, absl::Span<const int64_t> drafts,
                          const at::Tensor& draft_probs, LogitsProcessor* processor) {
  Verification out;
  std::vector<int64_t> seen(previous.begin(), previous.end());
  const int64_t k = static_cast<int64_t>(drafts.size());
  for (int64_t i = 0; i <= k; ++i) {
    at::Tensor row = logits[i];
    if (processor != nullptr) {
      row = row.to(at::kFloat).clone();
      processor->Apply(seen, row);
    }
    const at::Tensor processed = sampler.Process(row, seen);
    if (sampler.greedy()) {
      const int64_t token = processed.argmax().item<int64_t>();
      out.token_ids.push_back(token);
      if (i == k || token != drafts[static_cast<size_t>(i)]) break;
      ++out.accepted;
      seen.push_back(token);
      continue;
    }
    const at::Tensor p = processed.softmax(0);
    if (i == k) {
      out.token_ids.push_back(sampler.Draw(p));
      break;
    }
    const int64_t draft = drafts[static_cast<size_t>(i)];
    const int64_t vocab = p.size(0);
    // q: the draft's distribution, padded to the target's vocabulary.
    at::Tensor q;
    if (draft_probs.defined()) {
      q = at::zeros({vocab}, p.options());
      const int64_t n = std::min(vocab, draft_probs.size(1));
      q.narrow(0, 0, n).copy_(draft_probs[i].narrow(0, 0, n));
    }
    const double p_draft = draft >= 0 && draft < vocab ? p[draft].item<double>() : 0.0;
    const double q_draft = q.defined() ? q[draft].item<double>() : 1.0;
    // Accept with probability min(1, p / q); q_draft > 0 for a token the
    // draft drew.
    const double u = sampler.Uniform();
    if (q_draft > 0 && u * q_draft < p_draft) {
      out.token_ids.push_back(draft);
      ++out.accepted;
      seen.push_back(draft);
      continue;
    }
    at::Tensor residual;
    if (q.defined()) {
      residual = (p - q).clamp_min(0);
    } else {
      residual = p.clone();
      if (draft >= 0 && draft < vocab) residual[draft] = 0;
    }
    const double total = residual.sum().item<double>();
    // p == q leaves nothing (and then a rejection cannot happen, but
    // rounding can): fall back to p itself.
    out.token_ids.push_back(sampler.Draw(total > 0 ? residual / total : p));
    break;
  }
  return out;
}

}  // namespace accel::engine
