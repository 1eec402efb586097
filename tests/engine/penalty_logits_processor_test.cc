// OpenAI's logit_bias and presence / frequency penalties against the formula
// written out here: logit + bias - presence * [count > 0] - frequency * count,
// counting only the generated ids (not the prompt).
#include "engine/penalty_logits_processor.h"

#include <map>
#include <vector>

#include <ATen/Functions.h>
#include <gtest/gtest.h>

namespace accel::engine {
namespace {

TEST(PenaltyLogitsProcessorTest, MatchesOpenAisFormula) {
  SamplingParams p;
  p.presence_penalty = 0.5;
  p.frequency_penalty = 0.25;
  p.logit_bias = {{1, 3.0}, {4, -100.0}, {1, 1.0}};
  auto processor = MakePenaltyLogitsProcessor(p, /*prompt_tokens=*/3);
  ASSERT_NE(processor, nullptr);
  const std::vector<int64_t> previous = {2, 2, 2, 3, 3, 0, 3};  // prompt 2 2 2; generated 3 3 0 3
  at::Tensor logits = at::arange(6, at::kFloat);
  processor->Apply(previous, logits);
  std::map<int64_t, int> counts = {{3, 3}, {0, 1}};
  for (int64_t id = 0; id < 6; ++id) {
    double want = static_cast<double>(id);
    if (id == 1) want += 4.0;
    if (id == 4) want -= 100.0;
    if (counts.count(id)) want -= 0.5 + 0.25 * counts[id];
    EXPECT_FLOAT_EQ(logits[id].item<float>(), static_cast<float>(want)) << id;
  }
  // A non-contiguous, non-float32 row goes through the tensor path.
  at::Tensor half = at::arange(6, at::kDouble);
  processor->Apply(previous, half);
  EXPECT_DOUBLE_EQ(half[3].item<double>(), 3.0 - 0.5 - 0.75);
}

TEST(PenaltyLogitsProcessorTest, NothingAskedIsNoProcessor) {
  EXPECT_EQ(MakePenaltyLogitsProcessor(SamplingParams(), 0), nullptr);
  std::vector<std::unique_ptr<LogitsProcessor>> none;
  none.push_back(nullptr);
  EXPECT_EQ(ChainLogitsProcessors(std::move(none)), nullptr);
}

TEST(PenaltyLogitsProcessorTest, RangesAreChecked) {
  SamplingParams p;
  p.presence_penalty = 2.5;
  EXPECT_FALSE(ValidateSamplingParams(p).ok());
  p.presence_penalty = 0;
  p.logit_bias = {{0, 101}};
  EXPECT_EQ(ValidateSamplingParams(p).message(), "logit_bias[0] must be in [-100, 100], got 101");
}

}  // namespace
}  // namespace accel::engine
