// engine/sampler.h: choosing the next token from logits, as transformers'
// generate() does: the repetition penalty, then temperature, top-k, top-p
// and min-p, then a draw (or the argmax when temperature is 0).
//
//   ACCEL_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(params));
//   int64_t token = sampler.Next(logits_of_last_position, prompt_and_generated_ids);
#ifndef ACCEL_ENGINE_SAMPLER_H_
#define ACCEL_ENGINE_SAMPLER_H_

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "engine/request.h"  // SamplingParams

namespace accel::engine {

// Not thread-safe: one sequence, one sampler.
class Sampler {
 public:
  // ValidateSamplingParams' errors (engine/request.h).
  static absl::StatusOr<Sampler> Create(const SamplingParams& params);

  // `logits` [vocab] (any floating dtype); `previous` the ids seen so far
  // (prompt and generated) for the repetition penalty.
  int64_t Next(const at::Tensor& logits, absl::Span<const int64_t> previous);

  // The logits after the penalty, the temperature and the filters (filtered
  // tokens at -inf), in float64: what Next() draws from. Where dividing by a
  // tiny temperature would overflow, the largest is shifted to 0 first (no
  // probability changes). Public for tests and log-probs.
  at::Tensor Process(const at::Tensor& logits, absl::Span<const int64_t> previous) const;

  // Next() for several rows at once, row i with *samplers[i] (each
  // batch_samplable()): `logits` [rows, vocab] on any device, where the
  // temperature, the filters and the softmax run for all rows together, in
  // float64; each row's draw takes its sampler's next uniform, as Next()
  // does. On the cpu the tokens are Next()'s, bit for bit; on a CUDA device
  // the cumulative sums are added in another order, so a draw can differ
  // only where its uniform falls within rounding of a boundary between two
  // tokens. What a step of sampled rows on a GPU copies back is their token
  // ids, not [rows, vocab] floats to be processed a row at a time.
  static std::vector<int64_t> NextRows(const at::Tensor& logits,
                                       absl::Span<Sampler* const> samplers);
  // Sampled (temperature > 0) with no repetition penalty, which needs each
  // row's history: NextRows() takes it.
  bool batch_samplable() const { return !greedy() && params_.repetition_penalty == 1.0; }

  // Temperature 0: Next() is the argmax of Process().
  bool greedy() const { return params_.temperature == 0; }
  // Greedy with nothing that changes the logits first (no repetition
  // penalty): the token is the logits' own argmax, in any dtype, wherever
  // they are (float32 to float64 is exact and keeps the order).
  bool plain_greedy() const { return greedy() && params_.repetition_penalty == 1.0; }
  // A draw from `probs` [vocab] (float64, summing to 1) by the inverse CDF
  // with this sampler's own generator (what Next() does after Process()),
  // so a seed reproduces the tokens on any machine.
  int64_t Draw(const at::Tensor& probs);
  // A uniform draw in [0, 1) from the same generator.
  double Uniform();

  // The same parameters, another generator: seeded from this one's seed
  // (mixed with `stream`) when it has one, else at random.
  Sampler Fork(uint64_t stream) const;

 private:
  explicit Sampler(const SamplingParams& params);
  SamplingParams params_;
  std::mt19937_64 rng_;
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_SAMPLER_H_
