// models/sampling.h: choosing the next token from logits, as transformers'
// generate() does: the repetition penalty, then temperature, top-k, top-p
// and min-p, then a draw (or the argmax when temperature is 0).
//
//   ACCEL_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(params));
//   int64_t token = sampler.Next(logits_of_last_position, prompt_and_generated_ids);
#ifndef ACCEL_MODELS_SAMPLING_H_
#define ACCEL_MODELS_SAMPLING_H_

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

#include "models/generation_request.h"  // SamplingParams

namespace accel::models {

// The accepted repetition penalties (see Sampler::Create).
inline constexpr double kMinRepetitionPenalty = 1e-30;
inline constexpr double kMaxRepetitionPenalty = 1e30;

// Not thread-safe: one sequence, one sampler.
class Sampler {
 public:
  // InvalidArgument naming the parameter and the accepted range: temperature
  // < 0 or not finite, top_k < 0, top_p outside (0, 1], min_p outside [0, 1],
  // repetition_penalty outside [1e-30, 1e30]. Any positive temperature is
  // accepted: a tiny one (even below float32's range) gives the greedy token,
  // its limit.
  static absl::StatusOr<Sampler> Create(const SamplingParams& params);

  // `logits` [vocab] (any floating dtype); `previous` the ids seen so far
  // (prompt and generated) for the repetition penalty.
  int64_t Next(const at::Tensor& logits, const std::vector<int64_t>& previous);

  // The logits after the penalty, the temperature and the filters (filtered
  // tokens at -inf), in float64: what Next() draws from. Where dividing by a
  // tiny temperature would overflow, the largest is shifted to 0 first (no
  // probability changes). Public for tests and log-probs.
  at::Tensor Process(const at::Tensor& logits, const std::vector<int64_t>& previous) const;

 private:
  explicit Sampler(const SamplingParams& params);
  SamplingParams params_;
  std::mt19937_64 rng_;
};

}  // namespace accel::models

#endif  // ACCEL_MODELS_SAMPLING_H_
