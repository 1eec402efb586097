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
      max_in_flight_(static_cast<size_t>(std::max(runner_->max_steps_in_flight(), 1))),
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
  if (max_in_flight_ > 1) return StepWithBatchQueue();
  std::vector<TokenEvent> events;
  if (scheduler_.num_requests() == 0) return events;
  const SchedulerOutput scheduled = scheduler_.Schedule();
  if (scheduled.scheduled.empty() && scheduled.preempted.empty()) return events;
  ACCEL_ASSIGN_OR_RETURN(ModelRunnerOutput ran, runner_->Execute(scheduled));
  if (scheduled.scheduled.empty()) return events;
  return TakeBack(scheduled, std::move(ran));
}

absl::StatusOr<std::vector<TokenEvent>> EngineCore::StepWithBatchQueue() {
  std::vector<TokenEvent> events;
  if (in_flight_.size() < max_in_flight_ && scheduler_.num_requests() > 0) {
    // Each step takes its share of the requests, so that the queue's steps
    // are batches of about equal size (disjoint: in-flight ones are skipped).
    const size_t share = (scheduler_.num_requests() + max_in_flight_ - 1) / max_in_flight_;
    SchedulerOutput scheduled = scheduler_.Schedule(static_cast<int>(share));
    if (!scheduled.scheduled.empty()) {
      absl::StatusOr<uint64_t> ticket = runner_->Submit(scheduled);
      if (!ticket.ok()) {
        AbandonSteps();
        return ticket.status();
      }
      scheduler_.MarkInFlight(scheduled);
      if (!in_flight_.empty()) ++counters_.overlapped_steps;
      in_flight_.push_back({std::move(scheduled), *ticket});
      if (in_flight_.size() < max_in_flight_) return events;  // fill the queue first
    } else if (!scheduled.preempted.empty()) {
      // Only preemptions: the runner drops their caches (no forward pass).
      absl::StatusOr<ModelRunnerOutput> dropped = runner_->Execute(scheduled);
      if (!dropped.ok()) {
        AbandonSteps();
        return dropped.status();
      }
    }
  }
  if (in_flight_.empty()) return events;
  SubmittedStep oldest = std::move(in_flight_.front());
  in_flight_.pop_front();
  absl::StatusOr<ModelRunnerOutput> ran = runner_->Collect(oldest.ticket);
  if (!ran.ok()) {
    AbandonSteps();
    return ran.status();
  }
  events = TakeBack(oldest.output, *std::move(ran));
  if (!cancel_after_step_.empty()) {
    // Requests cancelled while this step ran give no events; they go now.
    events.erase(std::remove_if(
                     events.begin(), events.end(),
                     [&](const TokenEvent& e) { return cancel_after_step_.count(e.sequence) > 0; }),
                 events.end());
    RunDeferredCancels();
  }
  return events;
}

void EngineCore::AbandonSteps() {
  runner_->AbandonSubmitted();
  scheduler_.ClearInFlight();
  in_flight_.clear();
  RunDeferredCancels();
}

void EngineCore::RunDeferredCancels() {
  std::vector<uint64_t> ids;
  for (uint64_t id : cancel_after_step_) {
    if (!scheduler_.in_flight(id)) ids.push_back(id);
  }
  for (uint64_t id : ids) {
    cancel_after_step_.erase(id);
    Cancel(id);
  }
}

std::vector<TokenEvent> EngineCore::TakeBack(const SchedulerOutput& scheduled,
                                             ModelRunnerOutput ran) {
  std::vector<TokenEvent> events;
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
  if (scheduler_.in_flight(id)) {
    // Its step is writing its blocks: it goes when that step is collected.
    cancel_after_step_.insert(id);
    return true;
  }
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
