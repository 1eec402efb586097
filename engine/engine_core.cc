#include "engine/engine_core.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"

#include "core/status.h"

namespace accel::engine {
namespace {

SchedulerOptions MakeSchedulerOptions(const ModelRunnerInterface& runner,
                                      const EngineCoreOptions& options) {
  SchedulerOptions s;
  s.max_num_batched_tokens = options.max_num_batched_tokens;
  s.max_num_seqs = options.max_num_seqs;
  s.position_limit = runner.position_limit();
  s.lookahead_tokens = runner.lookahead_tokens();
  return s;
}

}  // namespace

EngineCore::EngineCore(std::unique_ptr<ModelRunnerInterface> runner, TextStreamFactory text_streams,
                       EngineCoreOptions options)
    : runner_(std::move(runner)),
      kv_(runner_->num_blocks(), runner_->block_size(),
          options.prefix_caching && runner_->supports_prefix_caching()),
      scheduler_(MakeSchedulerOptions(*runner_, options), &kv_),
      output_(std::move(text_streams)) {}

EngineCore::~EngineCore() = default;

absl::StatusOr<uint64_t> EngineCore::Add(GenerationRequest request) {
  const int64_t prompt = static_cast<int64_t>(request.prompt_ids.size());
  const int64_t limit = runner_->position_limit();
  const int64_t most = std::min(prompt + std::min(request.max_new_tokens, limit), limit);
  if (most > kv_capacity_tokens()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("prompt (", prompt, " tokens) + max_new_tokens (", request.max_new_tokens,
                     ") needs more KV cache than the server has in all (", kv_capacity_tokens(),
                     " tokens: --kv_cache_memory)"));
  }
  const uint64_t id = next_id_++;
  ACCEL_RETURN_IF_ERROR(runner_->AddRequest(id, request));
  scheduler_.Add(id, request);
  output_.Add(id, request);
  return id;
}

absl::StatusOr<std::vector<TokenEvent>> EngineCore::Step() {
  std::vector<TokenEvent> events;
  if (scheduler_.num_requests() == 0) return events;
  const SchedulerOutput scheduled = scheduler_.Schedule();
  if (scheduled.scheduled.empty() && scheduled.preempted.empty()) return events;
  ACCEL_ASSIGN_OR_RETURN(ModelRunnerOutput ran, runner_->Execute(scheduled));
  if (scheduled.scheduled.empty()) return events;
  ++counters_.steps;
  counters_.last_step_tokens = scheduled.total_tokens;
  counters_.prompt_tokens += scheduled.prompt_tokens;
  for (const SampledTokens& t : ran.sampled) {
    if (t.num_drafts == 0) continue;
    ++counters_.spec_num_drafts;
    counters_.spec_num_draft_tokens += t.num_drafts;
    counters_.spec_num_accepted_tokens += t.num_accepted_drafts;
    if (static_cast<int64_t>(counters_.spec_accepted_per_position.size()) < t.num_drafts) {
      counters_.spec_accepted_per_position.resize(static_cast<size_t>(t.num_drafts), 0);
    }
    for (int64_t i = 0; i < t.num_accepted_drafts; ++i) {
      ++counters_.spec_accepted_per_position[static_cast<size_t>(i)];
    }
  }
  std::vector<RequestUpdate> updates = scheduler_.UpdateFromOutput(scheduled, ran.sampled);
  for (auto& [id, drafts] : ran.drafts) scheduler_.SetDrafts(id, std::move(drafts));
  // Requests the scheduler finished (eos, length) are out of it already;
  // the output processor finishes stop strings.
  std::vector<uint64_t> finished;
  for (const RequestUpdate& update : updates) {
    if (update.finish) finished.push_back(update.id);
  }
  events = output_.Process(std::move(updates));
  counters_.generation_tokens += static_cast<int64_t>(events.size());
  for (const TokenEvent& event : events) {
    if (event.finish) finished.push_back(event.sequence);
  }
  for (uint64_t id : finished) Cancel(id);
  return events;
}

bool EngineCore::Cancel(uint64_t id) {
  const bool known = scheduler_.Finish(id);
  runner_->RemoveRequest(id);
  output_.Remove(id);
  return known;
}

EngineStats EngineCore::stats() const {
  EngineStats stats = counters_;
  stats.running = scheduler_.num_running();
  stats.waiting = scheduler_.num_waiting();
  stats.kv_blocks_total = kv_.num_blocks();
  stats.kv_blocks_used = kv_.used_blocks();
  stats.kv_block_size = kv_.block_size();
  stats.kv_cache_bytes = runner_->kv_cache_bytes();
  stats.preemptions = scheduler_.preemptions();
  stats.prefix_query_tokens = kv_.pool().prefix_query_tokens();
  stats.prefix_hit_tokens = kv_.pool().prefix_hit_tokens();
  return stats;
}

absl::StatusOr<std::vector<GenerationResult>> Generate(EngineCoreInterface& core,
                                                       std::vector<GenerationRequest> requests) {
  std::map<uint64_t, size_t> index;
  std::vector<GenerationResult> results(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    absl::StatusOr<uint64_t> id = core.Add(std::move(requests[i]));
    if (!id.ok()) {
      for (const auto& [added, unused] : index) core.Cancel(added);
      return absl::Status(id.status().code(),
                          absl::StrCat("request ", i, ": ", id.status().message()));
    }
    index[*id] = i;
  }
  size_t open = requests.size();
  while (open > 0) {
    absl::StatusOr<std::vector<TokenEvent>> events = core.Step();
    if (!events.ok()) {
      for (const auto& [id, unused] : index) core.Cancel(id);
      return events.status();
    }
    for (TokenEvent& event : *events) {
      auto found = index.find(event.sequence);
      if (found == index.end()) continue;  // someone else's request
      GenerationResult& result = results[found->second];
      result.token_ids.push_back(event.token_id);
      if (event.logprob) result.logprobs.push_back(*event.logprob);
      if (!event.prompt_logprobs.empty()) result.prompt_logprobs = std::move(event.prompt_logprobs);
      result.text += event.text;
      if (event.finish) {
        result.finish_reason = *event.finish;
        index.erase(found);
        --open;
      }
    }
  }
  return results;
}

}  // namespace accel::engine
