#include "engine/scheduler.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace accel::engine {

Scheduler::Scheduler(SchedulerOptions options, KvCacheManager* kv) : options_(options), kv_(kv) {}

void Scheduler::Add(uint64_t id, const GenerationRequest& request) {
  SchedulerRequest& r = requests_[id];
  r.id = id;
  r.token_ids = request.prompt_ids;
  r.num_prompt_tokens = static_cast<int64_t>(request.prompt_ids.size());
  r.max_new_tokens = request.max_new_tokens;
  r.min_tokens = request.min_tokens;
  r.prompt_logprobs = request.prompt_logprobs;
  r.stop_token_ids = request.stop_token_ids;
  waiting_.push_back(id);
}

bool Scheduler::Finish(uint64_t id) {
  auto found = requests_.find(id);
  if (found == requests_.end()) return false;
  kv_->Free(id);
  in_flight_.erase(id);
  running_.erase(std::remove(running_.begin(), running_.end(), id), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), id), waiting_.end());
  requests_.erase(found);
  return true;
}

const SchedulerRequest* Scheduler::request(uint64_t id) const {
  auto found = requests_.find(id);
  return found == requests_.end() ? nullptr : &found->second;
}

void Scheduler::SetDrafts(uint64_t id, std::vector<int64_t> drafts) {
  auto found = requests_.find(id);
  if (found == requests_.end()) return;
  SchedulerRequest& r = found->second;
  if (!r.running || r.num_pending_tokens() != 1) return;
  r.draft_token_ids = std::move(drafts);
}

void Scheduler::Preempt(uint64_t id) {
  SchedulerRequest& r = requests_.at(id);
  kv_->Free(id);
  r.num_computed_tokens = 0;
  r.draft_token_ids.clear();
  r.running = false;
  running_.erase(std::remove(running_.begin(), running_.end(), id), running_.end());
  waiting_.push_front(id);
  preempted_.push_back(id);
  ++preemptions_;
}

void Scheduler::MarkInFlight(const SchedulerOutput& output) {
  for (const ScheduledRequest& s : output.scheduled) in_flight_.insert(s.id);
}

SchedulerOutput Scheduler::Schedule(int max_requests) {
  SchedulerOutput out;
  preempted_.clear();
  const int64_t limit = options_.max_num_batched_tokens;
  // The token budget: every decoding request's one token first, so a long
  // prompt being read cannot slow them; drafts and prompt chunks share
  // what is left.
  int64_t budget = std::numeric_limits<int64_t>::max();
  int64_t reading = static_cast<int64_t>(waiting_.size());  // prompts waiting or being read
  int64_t decoding = 0;
  for (uint64_t id : running_) {
    if (in_flight(id)) continue;
    const int64_t left = requests_.at(id).num_pending_tokens();
    decoding += left == 1 ? 1 : 0;
    reading += left > 1 ? 1 : 0;
  }
  if (limit > 0) {
    budget = std::max<int64_t>(limit - decoding, 0);
    // A step with no decoding request always reads some prompt.
    if (decoding == 0) budget = std::max<int64_t>(budget, 1);
  }
  // When several prompts are to be read, one takes at most half of the
  // budget a step, so a short prompt arriving behind a long one starts
  // within a few steps instead of after the whole long prompt.
  const int64_t prefill_cap = reading > 1 && limit > 0 ? std::max<int64_t>(budget / 2, 1) : budget;
  const int64_t position_limit =
      options_.position_limit > 0 ? options_.position_limit : std::numeric_limits<int64_t>::max();

  struct Work {
    uint64_t id;
    int64_t tokens;
    int64_t drafts;
    bool prompt;
  };
  std::vector<Work> work;
  const auto full = [&] {
    return max_requests > 0 && static_cast<int64_t>(work.size()) >= max_requests;
  };
  // The most recently admitted request not in a step in flight: the one
  // preempted for blocks (there is one: the request asking is not).
  const auto victim_for = [&] {
    for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
      if (!in_flight(*it)) return *it;
    }
    return running_.back();
  };
  // Running requests, oldest first. One that cannot get a block preempts
  // the most recently admitted (possibly itself), which has not been
  // scheduled yet, so nothing in `work` loses its blocks.
  for (size_t i = 0; i < running_.size() && !full(); ++i) {
    const uint64_t id = running_[i];
    if (in_flight(id)) continue;
    SchedulerRequest& r = requests_.at(id);
    const int64_t left = r.num_pending_tokens();
    int64_t drafts = 0;
    if (left == 1 && !r.draft_token_ids.empty()) {
      // Verifying k drafts gives up to k + 1 tokens, at positions up to
      // num_computed + k.
      drafts = std::min<int64_t>({static_cast<int64_t>(r.draft_token_ids.size()),
                                  r.max_new_tokens - r.num_output_tokens() - 1,
                                  position_limit - 1 - r.num_computed_tokens, budget});
      drafts = std::max<int64_t>(drafts, 0);
    }
    const int64_t take = left == 1 ? 1 + drafts : std::min({left, budget, prefill_cap});
    if (take == 0) continue;
    const bool samples = left == 1 || take == left;
    const int64_t lookahead = samples ? options_.lookahead_tokens : 0;
    // Drafts and the draft model's lookahead are dropped before anyone is
    // preempted for them.
    bool reserved = kv_->AllocateSlots(id, r.num_computed_tokens + take + lookahead) ||
                    (lookahead > 0 && kv_->AllocateSlots(id, r.num_computed_tokens + take));
    int64_t tokens = take;
    if (!reserved && drafts > 0) {
      drafts = 0;
      tokens = 1;
    }
    bool preempted = false;
    while (!reserved && !(reserved = kv_->AllocateSlots(id, r.num_computed_tokens + tokens))) {
      const uint64_t victim = victim_for();
      Preempt(victim);
      if (victim == id) {
        preempted = true;
        break;
      }
    }
    if (preempted) break;
    budget -= left == 1 ? drafts : tokens;
    work.push_back({id, tokens, drafts, left > 1});
  }
  // Waiting requests join in order while their whole input fits the free
  // blocks (after reusing a cached prefix) and the budgets allow. One whose
  // prompt a running request is still reading waits for it (the n choices of
  // a request, or the same prompt twice): once that one's blocks are cached
  // it joins on them, so the prompt is prefilled once.
  const bool share_prompts = kv_->pool().prefix_caching();
  const auto reading_same_prompt = [&](const SchedulerRequest& r) {
    if (!share_prompts || r.prompt_logprobs || r.num_prompt_tokens < kv_->block_size() ||
        r.num_output_tokens() > 0) {
      return false;
    }
    for (uint64_t other_id : running_) {
      const SchedulerRequest& other = requests_.at(other_id);
      if (other.num_computed_tokens < other.num_prompt_tokens &&
          other.num_prompt_tokens == r.num_prompt_tokens &&
          std::equal(r.token_ids.begin(), r.token_ids.end(), other.token_ids.begin())) {
        return true;
      }
    }
    return false;
  };
  for (size_t next = 0; next < waiting_.size() && budget > 0 && !full() &&
                        (options_.max_num_seqs <= 0 ||
                         static_cast<int64_t>(running_.size()) < options_.max_num_seqs);) {
    const uint64_t id = waiting_[next];
    SchedulerRequest& r = requests_.at(id);
    if (reading_same_prompt(r)) {
      ++next;
      continue;
    }
    const int64_t input = static_cast<int64_t>(r.token_ids.size());
    const std::optional<int64_t> prefix =
        kv_->Admit(id, r.token_ids, std::min(budget, prefill_cap), !r.prompt_logprobs);
    if (!prefix.has_value()) break;
    r.num_computed_tokens = *prefix;
    r.running = true;
    const int64_t take = std::min({input - *prefix, budget, prefill_cap});
    // A prompt read whole this step is drafted for right after: the draft
    // model's lookahead, when blocks allow.
    if (take == input - *prefix && options_.lookahead_tokens > 0) {
      kv_->AllocateSlots(id, input + options_.lookahead_tokens);
    }
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(next));
    running_.push_back(id);
    budget -= take;
    work.push_back({id, take, 0, /*prompt=*/true});  // its input, or its recomputation
  }
  out.preempted = preempted_;
  for (const Work& w : work) {
    const SchedulerRequest& r = requests_.at(w.id);
    ScheduledRequest s;
    s.id = w.id;
    s.token_ids = r.token_ids;
    s.num_computed_tokens = r.num_computed_tokens;
    s.num_tokens = w.tokens;
    s.draft_token_ids.assign(r.draft_token_ids.begin(), r.draft_token_ids.begin() + w.drafts);
    s.samples =
        r.num_computed_tokens + w.tokens - w.drafts == static_cast<int64_t>(r.token_ids.size());
    s.block_table = kv_->block_table(w.id);
    out.total_tokens += w.tokens;
    if (w.prompt) out.prompt_tokens += w.tokens;
    out.scheduled.push_back(std::move(s));
  }
  return out;
}

std::vector<RequestUpdate> Scheduler::UpdateFromOutput(const SchedulerOutput& output,
                                                       absl::Span<const SampledTokens> sampled) {
  std::map<uint64_t, const SampledTokens*> by_id;
  for (const SampledTokens& s : sampled) by_id[s.id] = &s;
  const int64_t position_limit =
      options_.position_limit > 0 ? options_.position_limit : std::numeric_limits<int64_t>::max();
  std::vector<RequestUpdate> updates;
  std::vector<uint64_t> finished;
  for (const ScheduledRequest& s : output.scheduled) {
    in_flight_.erase(s.id);
    auto found = requests_.find(s.id);
    if (found == requests_.end()) continue;
    SchedulerRequest& r = found->second;
    const int64_t drafts = static_cast<int64_t>(s.draft_token_ids.size());
    r.draft_token_ids.clear();
    auto got = by_id.find(s.id);
    if (!s.samples || got == by_id.end()) {
      r.num_computed_tokens += s.num_tokens - drafts;
      kv_->CacheFullBlocks(s.id, r.token_ids, r.num_computed_tokens);
      continue;
    }
    const SampledTokens& t = *got->second;
    // The keys and values of the last token and the accepted drafts stay;
    // those of rejected drafts are past num_computed_tokens, overwritten
    // by the next step.
    r.num_computed_tokens += s.num_tokens - (drafts - t.num_accepted_drafts);
    RequestUpdate update;
    update.id = s.id;
    update.prompt_logprobs = t.prompt_logprobs;
    for (size_t i = 0; i < t.token_ids.size(); ++i) {
      const int64_t token = t.token_ids[i];
      r.token_ids.push_back(token);
      update.token_ids.push_back(token);
      update.logprobs.push_back(i < t.logprobs.size() ? t.logprobs[i] : std::nullopt);
      update.top_logprobs.push_back(i < t.top_logprobs.size() ? t.top_logprobs[i]
                                                              : std::vector<TokenLogprob>());
      if (r.num_output_tokens() > r.min_tokens &&
          std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) !=
              r.stop_token_ids.end()) {
        update.finish = FinishReason::kEos;
      } else if (r.num_output_tokens() >= r.max_new_tokens ||
                 static_cast<int64_t>(r.token_ids.size()) >= position_limit) {
        update.finish = FinishReason::kLength;
      }
      if (update.finish) break;
    }
    kv_->CacheFullBlocks(
        s.id, r.token_ids,
        std::min<int64_t>(r.num_computed_tokens, static_cast<int64_t>(r.token_ids.size())));
    if (update.finish) finished.push_back(s.id);
    updates.push_back(std::move(update));
  }
  for (uint64_t id : finished) Finish(id);
  return updates;
}

}  // namespace accel::engine
