#include "engine/internal/draft_proposer.h"

#include <algorithm>
#include <limits>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include "core/status.h"

namespace accel::engine::internal {

DraftProposer::DraftProposer(std::shared_ptr<models::CausalLM> model,
                             dispatch::DispatchedModel* dispatched, int64_t num_blocks,
                             int64_t block_size, int64_t k)
    : model_(std::move(model)),
      dispatched_(dispatched),
      store_(std::make_unique<models::KvBlockStore>(
          num_blocks, block_size, static_cast<size_t>(model_->config().num_hidden_layers))),
      block_size_(block_size),
      k_(k),
      position_limit_(model_->config().max_position_embeddings > 0
                          ? model_->config().max_position_embeddings
                          : std::numeric_limits<int64_t>::max()) {}

void DraftProposer::Add(uint64_t id, const Sampler& sampler) {
  auto state = std::make_unique<State>(sampler.Fork(/*stream=*/1));
  state->cache.store = store_.get();
  states_[id] = std::move(state);
}

void DraftProposer::Remove(uint64_t id) { states_.erase(id); }

void DraftProposer::Reset(uint64_t id, int64_t prefix) {
  auto found = states_.find(id);
  if (found == states_.end()) return;
  State& s = *found->second;
  s.cache.Clear();
  s.cache.store = store_.get();
  s.written = prefix;
}

int64_t DraftProposer::kv_cache_bytes() const { return store_->bytes(); }

absl::StatusOr<std::map<uint64_t, DraftProposer::Proposal>> DraftProposer::Run(
    absl::Span<const Job> jobs) {
  std::map<uint64_t, Proposal> proposals;
  struct Work {
    State* state;
    const Job* job;
    int64_t drafts;  // to draw
    std::vector<int64_t> seen;
    std::vector<at::Tensor> probs;
  };
  std::vector<Work> work;
  std::vector<std::pair<State*, int64_t>> saved;  // written, to undo a failed run
  std::vector<int64_t> packed;
  std::vector<models::SequenceChunk> chunks;
  for (const Job& job : jobs) {
    auto found = states_.find(job.id);
    if (found == states_.end()) continue;
    State& s = *found->second;
    const int64_t capacity = std::min<int64_t>(
        static_cast<int64_t>(job.block_table.size()) * block_size_, position_limit_);
    const int64_t valid = std::min(s.written, job.computed);
    // Drafting writes the new token's position and k - 1 after it.
    int64_t drafts = std::min({job.max_drafts, k_, capacity - job.computed});
    if (static_cast<int64_t>(job.ids.size()) <= job.computed) drafts = 0;
    const int64_t end = drafts > 0 ? job.computed + 1 : std::min(job.computed, capacity);
    if (end <= valid) continue;
    saved.emplace_back(&s, s.written);
    s.cache.length = valid;
    if (static_cast<int64_t>(s.cache.token_ids.size()) > valid) {
      s.cache.token_ids.resize(static_cast<size_t>(valid));
    }
    s.cache.block_table.assign(job.block_table.begin(), job.block_table.end());
    packed.insert(packed.end(), job.ids.begin() + valid, job.ids.begin() + end);
    chunks.push_back({&s.cache, end - valid});
    Work w{&s, &job, drafts, {}, {}};
    w.seen.assign(job.ids.begin(), job.ids.begin() + end);
    work.push_back(std::move(w));
  }
  if (work.empty()) return proposals;
  absl::Status status = [&]() -> absl::Status {
    std::vector<size_t> rows(work.size());  // work index of each logits row
    for (size_t i = 0; i < work.size(); ++i) rows[i] = i;
    for (int64_t round = 0; !rows.empty(); ++round) {
      at::Tensor input;
      ACCEL_RETURN_IF_ERROR(CallTorch([&] { input = at::tensor(packed, at::kLong); }));
      ACCEL_ASSIGN_OR_RETURN(
          at::Tensor logits,
          model_->Forward(input, chunks, models::Logits::kLastOfEach, dispatched_));
      std::vector<size_t> next;
      packed.clear();
      chunks.clear();
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        for (size_t r = 0; r < rows.size(); ++r) {
          Work& w = work[rows[r]];
          if (w.drafts <= round) continue;
          Sampler& sampler = w.state->sampler;
          const at::Tensor processed = sampler.Process(logits[static_cast<int64_t>(r)], w.seen);
          int64_t token = 0;
          if (sampler.greedy()) {
            token = processed.argmax().item<int64_t>();
          } else {
            const at::Tensor p = processed.softmax(0);
            token = sampler.Draw(p);
            w.probs.push_back(p);
          }
          w.seen.push_back(token);
          proposals[w.job->id].tokens.push_back(token);
          if (w.drafts > round + 1) {
            next.push_back(rows[r]);
            packed.push_back(token);
            chunks.push_back({&w.state->cache, 1});
          }
        }
      }));
      rows = std::move(next);
    }
    return CallTorch([&] {
      for (Work& w : work) {
        if (!w.probs.empty()) proposals[w.job->id].probs = at::stack(w.probs);
      }
    });
  }();
  if (!status.ok()) {
    // Each cache's length is set from `written` and the target's by the
    // next run; what this one wrote is overwritten then.
    for (const auto& [state, written] : saved) state->written = written;
    return status;
  }
  for (Work& w : work) w.state->written = w.state->cache.length;
  return proposals;
}

}  // namespace accel::engine::internal
