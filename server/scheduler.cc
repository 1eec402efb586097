#include "server/scheduler.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

#include "server/server_metrics.h"

namespace accel::server {

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

struct Scheduler::Pending {
  uint64_t id = 0;
  models::GenerationRequest request;
  std::shared_ptr<RequestSink> sink;
  absl::Time accepted;
};

struct Scheduler::Running {
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

Finish ToFinish(models::FinishReason reason) {
  switch (reason) {
    case models::FinishReason::kLength:
      return Finish::kLength;
    case models::FinishReason::kEos:
      return Finish::kEos;
    case models::FinishReason::kStop:
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

Scheduler::Scheduler(std::unique_ptr<models::TokenGenerator> generator, SchedulerOptions options,
                     ServerMetrics* metrics)
    : options_(options), metrics_(metrics), generator_(std::move(generator)) {
  {
    // The store's size is known before the first request: publish it.
    absl::MutexLock lock(&mu_);
    UpdateStatsLocked();
    PublishGaugesLocked();
  }
  thread_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    admitting_ = false;
  }
  thread_.join();
}

absl::StatusOr<uint64_t> Scheduler::Submit(models::GenerationRequest request,
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

void Scheduler::Cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  cancels_.push_back(id);
}

void Scheduler::StopAdmission() {
  absl::MutexLock lock(&mu_);
  admitting_ = false;
}

void Scheduler::CancelAll() {
  absl::MutexLock lock(&mu_);
  cancel_all_ = true;
}

bool Scheduler::WaitIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

Scheduler::Snapshot Scheduler::snapshot() const {
  absl::MutexLock lock(&mu_);
  Snapshot snapshot;
  snapshot.waiting = static_cast<int>(waiting_.size() + stats_.waiting);
  snapshot.running = static_cast<int>(stats_.running);
  snapshot.kv_cache_bytes = stats_.kv_cache_bytes;
  snapshot.steps = steps_;
  snapshot.generator = stats_;
  return snapshot;
}

void Scheduler::PublishGaugesLocked() {
  if (metrics_ == nullptr) return;
  metrics_->requests_waiting.Set(static_cast<double>(waiting_.size() + stats_.waiting));
  metrics_->requests_running.Set(static_cast<double>(stats_.running));
  metrics_->kv_cache_bytes.Set(static_cast<double>(stats_.kv_cache_bytes));
  metrics_->kv_cache_blocks.Set(static_cast<double>(stats_.kv_blocks_total));
  if (stats_.kv_blocks_total > 0) {
    metrics_->kv_cache_usage.Set(static_cast<double>(stats_.kv_blocks_used) /
                                 static_cast<double>(stats_.kv_blocks_total));
  }
}

void Scheduler::UpdateStatsLocked() {
  const models::GeneratorStats now = generator_->stats();
  if (metrics_ != nullptr) {
    metrics_->preemptions.Increment(static_cast<double>(now.preemptions - stats_.preemptions));
    metrics_->prefix_cache_queries.Increment(
        static_cast<double>(now.prefix_query_tokens - stats_.prefix_query_tokens));
    metrics_->prefix_cache_hits.Increment(
        static_cast<double>(now.prefix_hit_tokens - stats_.prefix_hit_tokens));
    metrics_->prompt_tokens.Increment(
        static_cast<double>(now.prompt_tokens - stats_.prompt_tokens));
  }
  stats_ = now;
}

void Scheduler::EndPending(Pending& pending, const absl::Status& status) {
  Completion completion;
  completion.finish = Finish::kCancelled;
  completion.prompt_tokens = static_cast<int64_t>(pending.request.prompt_ids.size());
  completion.total = absl::Now() - pending.accepted;
  completion.queue_time = completion.total;
  if (metrics_ != nullptr) {
    if (status.ok()) {
      metrics_->request_success.WithLabels({FinishName(Finish::kCancelled)}).Increment();
    } else {
      metrics_->RequestFailed(FailureReason(status));
    }
  }
  pending.sink->OnDone(status, completion);
  Ended();
}

void Scheduler::Ended() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

void Scheduler::EndRunning(uint64_t sequence, const absl::Status& status, Finish finish) {
  auto it = running_.find(sequence);
  if (it == running_.end()) return;
  std::unique_ptr<Running> r = std::move(it->second);
  running_.erase(it);
  generator_->Cancel(sequence);  // frees its blocks; no-op when the generator already dropped it
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
  if (metrics_ != nullptr) {
    if (status.ok()) {
      metrics_->request_success.WithLabels({FinishName(finish)}).Increment();
      metrics_->e2e_latency.Observe(absl::ToDoubleSeconds(completion.total));
      metrics_->request_generation_tokens.Observe(static_cast<double>(r->generated));
    } else {
      metrics_->RequestFailed(FailureReason(status));
    }
  }
  r->sink->OnDone(status, completion);
  Ended();
}

void Scheduler::Admit(std::vector<std::unique_ptr<Pending>> admitted) {
  for (std::unique_ptr<Pending>& p : admitted) {
    auto r = std::make_unique<Running>();
    r->id = p->id;
    r->sink = p->sink;
    r->deadline = p->request.deadline;
    r->deadline_reason = p->request.deadline_reason;
    r->accepted = p->accepted;
    r->scheduled = absl::Now();
    r->prompt_tokens = static_cast<int64_t>(p->request.prompt_ids.size());
    absl::StatusOr<uint64_t> sequence = generator_->Add(p->request);
    if (!sequence.ok()) {
      EndPending(*p, sequence.status());
      continue;
    }
    if (metrics_ != nullptr) {
      metrics_->queue_time.Observe(absl::ToDoubleSeconds(r->scheduled - r->accepted));
      metrics_->request_prompt_tokens.Observe(static_cast<double>(r->prompt_tokens));
    }
    running_.emplace(*sequence, std::move(r));
  }
}

void Scheduler::RunStep() {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<models::TokenEvent>> events = generator_->Step();
  const absl::Time end = absl::Now();
  if (!events.ok()) {
    // Nothing advanced. Blame the sequences that joined in this step (the
    // step with only running ones worked before), else those still reading
    // their prompt; if none, the model is failing for everyone.
    std::vector<uint64_t> blamed;
    for (const auto& [sequence, r] : running_) {
      if (r->joined_this_step) blamed.push_back(sequence);
    }
    if (blamed.empty()) {
      for (const auto& [sequence, r] : running_) {
        if (r->generated == 0) blamed.push_back(sequence);
      }
    }
    if (blamed.empty()) {
      for (const auto& [sequence, r] : running_) blamed.push_back(sequence);
    }
    const absl::Status failed = absl::InternalError(
        absl::StrCat("the model failed on this request: ", events.status().message()));
    // The operator's record of it: the whole error (a weights file that
    // failed is named here), once per failed step.
    std::fprintf(stderr, "accel: a step failed, ending %zu of %zu running requests: %s\n",
                 blamed.size(), running_.size(), events.status().ToString().c_str());
    std::fflush(stderr);
    for (uint64_t sequence : blamed) EndRunning(sequence, failed, Finish::kLength);
    return;
  }
  const models::GeneratorStats stats = generator_->stats();
  if (metrics_ != nullptr) {
    metrics_->batch_size.Set(static_cast<double>(stats.running));
    metrics_->iteration_tokens.Observe(static_cast<double>(stats.last_step_tokens));
    metrics_->step_duration.Observe(absl::ToDoubleSeconds(end - start));
    metrics_->generation_tokens.Increment(static_cast<double>(events->size()));
  }
  for (auto& [sequence, r] : running_) r->joined_this_step = false;
  for (models::TokenEvent& event : *events) {
    auto it = running_.find(event.sequence);
    if (it == running_.end()) continue;
    Running& r = *it->second;
    if (r.generated == 0) {
      r.first_token = end;
      if (metrics_ != nullptr) {
        metrics_->time_to_first_token.Observe(absl::ToDoubleSeconds(end - r.accepted));
      }
    } else if (metrics_ != nullptr) {
      metrics_->inter_token_latency.Observe(absl::ToDoubleSeconds(end - r.last_token));
    }
    r.last_token = end;
    ++r.generated;
    TokenChunk chunk;
    chunk.token_ids.push_back(event.token_id);
    if (event.logprob) chunk.logprobs.push_back(*event.logprob);
    if (!event.top_logprobs.empty()) chunk.top_logprobs.push_back(std::move(event.top_logprobs));
    chunk.text = std::move(event.text);
    r.sink->OnTokens(std::move(chunk));
    if (event.finish) EndRunning(event.sequence, absl::OkStatus(), ToFinish(*event.finish));
  }
}

void Scheduler::Loop() {
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
      // Hand requests to the generator in arrival order, up to the batch
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
    const bool step = !running_.empty();
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

}  // namespace accel::server
