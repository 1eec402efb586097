// engine/logits_processor.h: a per-request hook in the sampling path, where
// structured output (a grammar's allowed tokens) and bans plug in. The
// model runner makes one per request (ModelRunnerOptions::logits_processors)
// and applies it to the raw logits of every position the request samples
// from, before the repetition penalty, temperature and filters; with
// speculative decoding that is each verified position, with the drafts
// before it in `previous`, so a processor that decides by the ids so far
// constrains drafts and plain decoding alike.
#ifndef ACCEL_ENGINE_LOGITS_PROCESSOR_H_
#define ACCEL_ENGINE_LOGITS_PROCESSOR_H_

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/types/span.h"

namespace accel::engine {

class LogitsProcessor {
 public:
  virtual ~LogitsProcessor() = default;
  // `logits` [vocab] (float32, the request's own copy: change it in place,
  // e.g. -inf for a banned token); `previous` the ids before this position
  // (prompt, generated, and drafts ahead of it).
  virtual void Apply(absl::Span<const int64_t> previous, at::Tensor& logits) = 0;
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_LOGITS_PROCESSOR_H_
