#include "engine/engine_loop.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"

#include "core/thread_name.h"

namespace accel::engine {

const char* FinishName(Finish finish) {
  switch (finish) {
    case Finish::kLength:
      return "length";
    case Finish::kEos:
      return "eos";
    case Finish::kStop:
      return "stop";
    case Finish::kCancelled:
      return "cancelled";
  }
  return "length";
}

struct EngineLoop::Pending {
  uint64_t id = 0;
  GenerationRequest request;
  std::shared_ptr<RequestSink> sink;
  absl::Time accepted;
};

struct EngineLoop::Running {
  uint64_t id = 0;  // the scheduler's id (Submit's answer)
  std::shared_ptr<RequestSink> sink;
  absl::Time deadline;
  std::string deadline_reason;
  absl::Time accepted;
  absl::Time scheduled;
  absl::Time first_token;
  absl::Time last_token;
  int64_t prompt_tokens = 0;
  int64_t generated = 0;
  bool joined_this_step = true;
};

namespace {

Finish ToFinish(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return Finish::kLength;
    case FinishReason::kEos:
      return Finish::kEos;
    case FinishReason::kStop:
      return Finish::kStop;
  }
  return Finish::kLength;
}

// The metrics label of a failed request.
const char* FailureReason(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kCancelled:
      return "cancelled";
    case absl::StatusCode::kDeadlineExceeded:
      return "timeout";
    case absl::StatusCode::kInvalidArgument:
      return "invalid";
    case absl::StatusCode::kUnavailable:
      return "unavailable";
    default:
      return "internal";
  }
}

}  // namespace

EngineLoop::EngineLoop(std::unique_ptr<EngineCoreInterface> core, EngineLoopOptions options,
                       StatLogger* stats)
    : options_(options), logger_(stats), core_(std::move(core)) {
  {
    // The store's size is known before the first request: publish it.
    absl::MutexLock lock(&mu_);
    UpdateStatsLocked();
    PublishGaugesLocked();
  }
  thread_ = std::thread([this] {
    NameThisThread("accel-engine");
    Loop();
  });
}

EngineLoop::~EngineLoop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    admitting_ = false;
  }
  thread_.join();
}

absl::StatusOr<uint64_t> EngineLoop::Submit(GenerationRequest request,
                                            std::shared_ptr<RequestSink> sink) {
  auto pending = std::make_unique<Pending>();
  pending->request = std::move(request);
  pending->sink = std::move(sink);
  pending->accepted = absl::Now();
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!admitting_) {
      return absl::UnavailableError("the server is shutting down and admits no new requests");
    }
    if (static_cast<int>(waiting_.size()) >= options_.max_queue) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the queue is full (", waiting_.size(),
                       " requests waiting, --max_queue=", options_.max_queue, "); retry later"));
    }
    id = next_id_++;
    pending->id = id;
    waiting_.push_back(std::move(pending));
    ++in_flight_;
    PublishGaugesLocked();
  }
  return id;
}

void EngineLoop::Cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  cancels_.push_back(id);
}

void EngineLoop::StopAdmission() {
  absl::MutexLock lock(&mu_);
  admitting_ = false;
}

void EngineLoop::CancelAll() {
  absl::MutexLock lock(&mu_);
  cancel_all_ = true;
}

bool EngineLoop::WaitIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

EngineLoop::Snapshot EngineLoop::snapshot() const {
  absl::MutexLock lock(&mu_);
  Snapshot snapshot;
  snapshot.waiting = static_cast<int>(waiting_.size() + stats_.waiting);
  snapshot.running = static_cast<int>(stats_.running);
  snapshot.kv_cache_bytes = stats_.kv_cache_bytes;
  snapshot.steps = steps_;
  snapshot.engine = stats_;
  return snapshot;
}

void EngineLoop::PublishGaugesLocked() {
  if (logger_ == nullptr) return;
  SchedulerStats gauges;
  gauges.waiting = static_cast<int64_t>(waiting_.size()) + stats_.waiting;
  gauges.running = stats_.running;
  gauges.kv_cache_bytes = stats_.kv_cache_bytes;
  gauges.kv_blocks_total = stats_.kv_blocks_total;
  gauges.kv_blocks_used = stats_.kv_blocks_used;
  logger_->RecordScheduler(gauges);
}

void EngineLoop::UpdateStatsLocked() {
  const EngineStats now = core_->stats();
  if (logger_ != nullptr) logger_->RecordCounters(CountersSince(now, stats_));
  stats_ = now;
}

void EngineLoop::EndPending(Pending& pending, const absl::Status& status) {
  Completion completion;
  completion.finish = Finish::kCancelled;
  completion.prompt_tokens = static_cast<int64_t>(pending.request.prompt_ids.size());
  completion.total = absl::Now() - pending.accepted;
  completion.queue_time = completion.total;
  if (logger_ != nullptr) {
    if (status.ok()) {
      FinishedRequestStats finished;
      finished.finish = FinishName(Finish::kCancelled);
      logger_->RecordFinished(finished);
    } else {
      logger_->RecordFailed(FailureReason(status));
    }
  }
  pending.sink->OnDone(status, completion);
  Ended();
}

void EngineLoop::Ended() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

void EngineLoop::EndRunning(uint64_t sequence, const absl::Status& status, Finish finish) {
  auto it = running_.find(sequence);
  if (it == running_.end()) return;
  std::unique_ptr<Running> r = std::move(it->second);
  running_.erase(it);
  core_->Cancel(sequence);  // frees its blocks; no-op when the core already dropped it
  // Published before the client hears back, so what it scrapes next agrees.
  {
    absl::MutexLock lock(&mu_);
    running_count_ = static_cast<int>(running_.size());
    UpdateStatsLocked();
    PublishGaugesLocked();
  }
  const absl::Time now = absl::Now();
  Completion completion;
  completion.finish = finish;
  completion.prompt_tokens = r->prompt_tokens;
  completion.generated_tokens = r->generated;
  completion.queue_time = r->scheduled - r->accepted;
  completion.time_to_first_token =
      r->generated > 0 ? r->first_token - r->accepted : absl::ZeroDuration();
  completion.total = now - r->accepted;
  if (logger_ != nullptr) {
    if (status.ok()) {
      FinishedRequestStats finished;
      finished.finish = FinishName(finish);
      finished.scheduled = true;
      finished.e2e_seconds = absl::ToDoubleSeconds(completion.total);
      finished.generated_tokens = r->generated;
      logger_->RecordFinished(finished);
    } else {
      logger_->RecordFailed(FailureReason(status));
    }
  }
  r->sink->OnDone(status, completion);
  Ended();
}

void EngineLoop::Admit(std::vector<std::unique_ptr<Pending>> admitted) {
  for (std::unique_ptr<Pending>& p : admitted) {
    auto r = std::make_unique<Running>();
    r->id = p->id;
    r->sink = p->sink;
    r->deadline = p->request.deadline;
    r->deadline_reason = p->request.deadline_reason;
    r->accepted = p->accepted;
    r->scheduled = absl::Now();
    r->prompt_tokens = static_cast<int64_t>(p->request.prompt_ids.size());
    absl::StatusOr<uint64_t> sequence = core_->Add(p->request);
    if (!sequence.ok()) {
      EndPending(*p, sequence.status());
      continue;
    }
    if (logger_ != nullptr) {
      logger_->RecordScheduled(absl::ToDoubleSeconds(r->scheduled - r->accepted), r->prompt_tokens);
    }
    running_.emplace(*sequence, std::move(r));
  }
}

void EngineLoop::RunStep() {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<TokenEvent>> events = core_->Step();
  const absl::Time end = absl::Now();
  if (!events.ok()) {
    // Nothing advanced. Blame the sequences that joined in this step (the
    // step with only running ones worked before), else those still reading
    // their prompt; if none, the model is failing for everyone.
    // Unavailable (a tensor-parallel group that broke): everyone, at once.
    const bool broken = absl::IsUnavailable(events.status());
    std::vector<uint64_t> blamed;
    for (const auto& [sequence, r] : running_) {
      if (r->joined_this_step || broken) blamed.push_back(sequence);
    }
    if (blamed.empty()) {
      for (const auto& [sequence, r] : running_) {
        if (r->generated == 0) blamed.push_back(sequence);
      }
    }
    if (blamed.empty()) {
      for (const auto& [sequence, r] : running_) blamed.push_back(sequence);
    }
    // A tensor-parallel group that broke (a worker died or stopped
    // answering) fails every step from now on: UNAVAILABLE, the server's
    // state rather than the request's, for a client to retry elsewhere.
    const absl::Status failed =
        broken ? absl::UnavailableError(
                     absl::StrCat("the server cannot run the model: ", events.status().message()))
               : absl::InternalError(
                     absl::StrCat("the model failed on this request: ", events.status().message()));
    // The operator's record of it: the whole error (a weights file that
    // failed is named here), once per failed step.
    std::fprintf(stderr, "accel: a step failed, ending %zu of %zu running requests: %s\n",
                 blamed.size(), running_.size(), events.status().ToString().c_str());
    std::fflush(stderr);
    for (uint64_t sequence : blamed) EndRunning(sequence, failed, Finish::kLength);
    return;
  }
  const EngineStats stats = core_->stats();
  // A step's tokens, one chunk a request (speculative decoding gives a
  // request several tokens a step).
  std::vector<uint64_t> order;
  std::map<uint64_t, TokenChunk> chunks;
  std::map<uint64_t, Finish> finished;
  for (TokenEvent& event : *events) {
    if (running_.find(event.sequence) == running_.end()) continue;
    auto [it, fresh] = chunks.try_emplace(event.sequence);
    if (fresh) order.push_back(event.sequence);
    TokenChunk& chunk = it->second;
    chunk.token_ids.push_back(event.token_id);
    if (event.logprob) chunk.logprobs.push_back(*event.logprob);
    if (!event.top_logprobs.empty()) chunk.top_logprobs.push_back(std::move(event.top_logprobs));
    chunk.text += event.text;
    if (!event.prompt_logprobs.empty()) chunk.prompt_logprobs = std::move(event.prompt_logprobs);
    if (event.finish) finished[event.sequence] = ToFinish(*event.finish);
  }
  IterationStats iteration;
  iteration.batch_size = stats.running;
  iteration.scheduled_tokens = stats.last_step_tokens;
  iteration.generated_tokens = static_cast<int64_t>(events->size());
  iteration.seconds = absl::ToDoubleSeconds(end - start);
  for (uint64_t sequence : order) {
    Running& r = *running_.at(sequence);
    if (r.generated == 0) {
      r.first_token = end;
      iteration.time_to_first_token.push_back(absl::ToDoubleSeconds(end - r.accepted));
    } else {
      iteration.inter_token_latency.push_back(absl::ToDoubleSeconds(end - r.last_token));
    }
  }
  if (logger_ != nullptr) logger_->RecordIteration(iteration);
  for (auto& [sequence, r] : running_) r->joined_this_step = false;
  for (uint64_t sequence : order) {
    Running& r = *running_.at(sequence);
    TokenChunk& chunk = chunks.at(sequence);
    r.last_token = end;
    r.generated += static_cast<int64_t>(chunk.token_ids.size());
    r.sink->OnTokens(std::move(chunk));
    auto done = finished.find(sequence);
    if (done != finished.end()) EndRunning(sequence, absl::OkStatus(), done->second);
  }
}

void EngineLoop::Loop() {
  while (true) {
    std::vector<std::unique_ptr<Pending>> admitted;
    std::vector<std::unique_ptr<Pending>> ended;  // cancelled or expired while waiting
    std::vector<uint64_t> cancels;
    bool cancel_all = false;
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stopping_ || cancel_all_ || !cancels_.empty() || !waiting_.empty() ||
               running_count_ > 0;
      };
      // The timeout lets queued requests' deadlines pass while nothing runs.
      mu_.AwaitWithTimeout(absl::Condition(&has_work), absl::Milliseconds(100));
      stopping = stopping_;
      cancel_all = cancel_all_ || stopping_;
      cancel_all_ = false;
      cancels.swap(cancels_);
      const absl::Time now = absl::Now();
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        const bool cancelled =
            std::find(cancels.begin(), cancels.end(), (*it)->id) != cancels.end();
        if (cancel_all || cancelled || (*it)->request.deadline <= now) {
          ended.push_back(std::move(*it));
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
      // Hand requests to the engine core in arrival order, up to the batch
      // size; it admits them into steps as KV memory allows.
      while (!waiting_.empty() &&
             static_cast<int>(running_.size() + admitted.size()) < options_.max_batch_size) {
        admitted.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
      }
      // Admitted requests count as running from here: their first tokens can
      // reach a client before this step ends, and a scrape after that must
      // not still see them waiting.
      if (!admitted.empty() || !ended.empty()) {
        running_count_ = static_cast<int>(running_.size() + admitted.size());
        PublishGaugesLocked();
      }
    }
    const absl::Time now = absl::Now();
    for (std::unique_ptr<Pending>& p : ended) {
      const bool cancelled = std::find(cancels.begin(), cancels.end(), p->id) != cancels.end();
      if (stopping) {
        EndPending(*p, absl::UnavailableError("the server stopped before running this request"));
      } else if (cancelled) {
        EndPending(*p, absl::CancelledError("the client cancelled the request"));
      } else if (cancel_all) {
        EndPending(*p, absl::OkStatus());
      } else {
        EndPending(*p, absl::DeadlineExceededError(absl::StrCat("the request passed ",
                                                                p->request.deadline_reason,
                                                                " while waiting in the queue")));
      }
    }
    // Cancellations and deadlines of running requests, before the next step.
    std::vector<uint64_t> to_end;
    for (const auto& [sequence, r] : running_) to_end.push_back(sequence);
    for (uint64_t sequence : to_end) {
      const Running& r = *running_.at(sequence);
      if (stopping) {
        EndRunning(sequence, absl::UnavailableError("the server stopped"), Finish::kCancelled);
      } else if (cancel_all) {
        EndRunning(sequence, absl::OkStatus(), Finish::kCancelled);
      } else if (std::find(cancels.begin(), cancels.end(), r.id) != cancels.end()) {
        EndRunning(sequence, absl::CancelledError("the client cancelled the request"),
                   Finish::kCancelled);
      } else if (r.deadline <= now) {
        EndRunning(
            sequence,
            absl::DeadlineExceededError(absl::StrCat("the request passed ", r.deadline_reason,
                                                     " after ", r.generated, " generated tokens")),
            Finish::kCancelled);
      }
    }
    if (stopping) {
      absl::MutexLock lock(&mu_);
      running_count_ = 0;
      return;
    }
    Admit(std::move(admitted));
    // Steps still in flight (pipeline parallel) are collected even when
    // their requests were all cancelled, so that their blocks come back.
    const bool step = !running_.empty() || core_->steps_in_flight() > 0;
    if (step) RunStep();
    {
      absl::MutexLock lock(&mu_);
      running_count_ = static_cast<int>(running_.size());
      UpdateStatsLocked();
      if (step) ++steps_;
      PublishGaugesLocked();
    }
  }
}

}  // namespace accel::engine

namespace accel::engine {

EngineStats CountersSince(const EngineStats& now, const EngineStats& before) {
  EngineStats delta;
  delta.preemptions = now.preemptions - before.preemptions;
  delta.prefix_query_tokens = now.prefix_query_tokens - before.prefix_query_tokens;
  delta.prefix_hit_tokens = now.prefix_hit_tokens - before.prefix_hit_tokens;
  delta.prompt_tokens = now.prompt_tokens - before.prompt_tokens;
  delta.generation_tokens = now.generation_tokens - before.generation_tokens;
  delta.steps = now.steps - before.steps;
  delta.overlapped_steps = now.overlapped_steps - before.overlapped_steps;
  delta.spec_num_drafts = now.spec_num_drafts - before.spec_num_drafts;
  delta.spec_num_draft_tokens = now.spec_num_draft_tokens - before.spec_num_draft_tokens;
  delta.spec_num_accepted_tokens = now.spec_num_accepted_tokens - before.spec_num_accepted_tokens;
  delta.spec_accepted_per_position = now.spec_accepted_per_position;
  for (size_t i = 0;
       i < before.spec_accepted_per_position.size() && i < delta.spec_accepted_per_position.size();
       ++i) {
    delta.spec_accepted_per_position[i] -= before.spec_accepted_per_position[i];
  }
  return delta;
}

}  // namespace accel::engine
