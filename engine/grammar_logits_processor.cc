#include "engine/grammar_logits_processor.h"

#include <algorithm>
#include <limits>
#include <utility>

#include <ATen/Functions.h>

#include "core/device_copy.h"

namespace accel::engine {
namespace {

class GrammarLogitsProcessor : public LogitsProcessor {
 public:
  GrammarLogitsProcessor(std::shared_ptr<grammar::CompiledGrammar> compiled,
                         std::vector<int64_t> stop_token_ids, int64_t prompt_tokens)
      : matcher_(std::move(compiled), stop_token_ids),
        stop_token_ids_(std::move(stop_token_ids)),
        prompt_tokens_(prompt_tokens),
        mask_(static_cast<size_t>(matcher_.mask_words())) {}

  void Apply(absl::Span<const int64_t> previous, at::Tensor& logits) override {
    const bool in_grammar = Follow(previous);
    int64_t allowed = 0;
    if (in_grammar) {
      allowed = matcher_.FillNextTokenBitmask(mask_.data());
    } else {
      // A token the grammar refused is before this position (a draft being
      // verified past a rejected one: this row is discarded): end it.
      std::fill(mask_.begin(), mask_.end(), 0);
      for (int64_t s : stop_token_ids_) {
        if (s >= 0 && s < static_cast<int64_t>(mask_.size()) * 64) {
          mask_[s >> 6] |= uint64_t{1} << (s & 63);
          ++allowed;
        }
      }
    }
    // Nothing allowed (the grammar is done and the request ignores eos):
    // leave the logits alone rather than make every token impossible.
    if (allowed == 0) return;
    const int64_t vocab = logits.size(0);
    const int64_t covered = std::min<int64_t>(vocab, static_cast<int64_t>(mask_.size()) * 64);
    constexpr float kBanned = -std::numeric_limits<float>::infinity();
    if (logits.is_cpu() && logits.scalar_type() == at::kFloat && logits.is_contiguous()) {
      // Word by word: a grammar's mask is mostly whole words of zeros
      // (outside a string) or of ones (inside one).
      float* data = logits.data_ptr<float>();
      for (int64_t w = 0; w * 64 < covered; ++w) {
        const uint64_t bits = mask_[w];
        const int64_t begin = w * 64;
        const int64_t end = std::min<int64_t>(begin + 64, covered);
        if (bits == ~uint64_t{0} && end - begin == 64) continue;
        if (bits == 0) {
          std::fill(data + begin, data + end, kBanned);
          continue;
        }
        for (int64_t i = begin; i < end; ++i) {
          if (!(bits >> (i - begin) & 1)) data[i] = kBanned;
        }
      }
      std::fill(data + covered, data + vocab, kBanned);
      return;
    }
    at::Tensor keep = at::zeros({vocab}, at::TensorOptions().dtype(at::kBool));
    bool* k = keep.data_ptr<bool>();
    for (int64_t i = 0; i < covered; ++i) k[i] = mask_[i >> 6] >> (i & 63) & 1;
    logits.masked_fill_(ToDeviceAsync(keep, logits.device()).logical_not(), kBanned);
  }

 private:
  // Brings the matcher to the generated ids of `previous`; false when one of
  // them is not allowed (the matcher then stands before it).
  bool Follow(absl::Span<const int64_t> previous) {
    const size_t start = static_cast<size_t>(
        std::min<int64_t>(prompt_tokens_, static_cast<int64_t>(previous.size())));
    const absl::Span<const int64_t> generated = previous.subspan(start);
    size_t common = 0;
    while (common < accepted_.size() && common < generated.size() &&
           accepted_[common] == generated[common]) {
      ++common;
    }
    matcher_.Rollback(static_cast<int64_t>(accepted_.size() - common));
    accepted_.resize(common);
    for (size_t i = common; i < generated.size(); ++i) {
      if (!matcher_.AcceptToken(generated[i])) return false;
      accepted_.push_back(generated[i]);
    }
    return true;
  }

  grammar::GrammarMatcher matcher_;
  std::vector<int64_t> stop_token_ids_;
  int64_t prompt_tokens_;
  std::vector<int64_t> accepted_;  // the generated ids the matcher has taken
  std::vector<uint64_t> mask_;
};

}  // namespace

std::unique_ptr<LogitsProcessor> MakeGrammarLogitsProcessor(
    std::shared_ptr<grammar::CompiledGrammar> compiled, std::vector<int64_t> stop_token_ids,
    int64_t prompt_tokens) {
  return std::make_unique<GrammarLogitsProcessor>(std::move(compiled), std::move(stop_token_ids),
                                                  prompt_tokens);
}

}  // namespace accel::engine
