// The engine loop against a fake engine core that makes tokens by rule and,
// on demand, fails a step, stalls a step, or has room for only a few
// sequences (the rest wait, or are preempted and resume): tokens reach the
// sinks in order, one request's failure ends only that request,
// cancellation and deadlines end requests whether waiting or running, the
// queue is bounded, and what the stat logger hears follows the core's stats.
#include "engine/engine_loop.h"

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace accel::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Sequence k's i-th token is 1000 * k' + i, where k' is the first prompt
// id: the tokens say whose they are and in which order they came. Holds at
// most `room` sequences at once; a sequence past that waits, and with
// `preempt_every` > 0 the newest running sequence is preempted every that
// many steps (its tokens go on where they were after it resumes).
class FakeEngineCore : public EngineCoreInterface {
 public:
  struct Control {
    absl::Mutex mu;
    int fail_next_steps ABSL_GUARDED_BY(mu) = 0;
    bool stall ABSL_GUARDED_BY(mu) = false;
    int stall_at_step ABSL_GUARDED_BY(mu) = -1;  // the step that stalls by itself
    // The first step that holds a sequence whose first prompt id is this
    // fails (once): the step the request joins in, however the threads run.
    int64_t fail_with_first_id ABSL_GUARDED_BY(mu) = -1;
    // Failures are UNAVAILABLE (a tensor-parallel group that broke), not
    // RESOURCE_EXHAUSTED.
    bool fail_unavailable ABSL_GUARDED_BY(mu) = false;
    int steps ABSL_GUARDED_BY(mu) = 0;
    // Steps the fake says are in flight (pipeline parallel); each Step
    // collects one.
    int64_t in_flight ABSL_GUARDED_BY(mu) = 0;
  };

  FakeEngineCore(std::shared_ptr<Control> control, int room, int preempt_every)
      : control_(std::move(control)), room_(room), preempt_every_(preempt_every) {}

  absl::StatusOr<uint64_t> Add(GenerationRequest request) override {
    if (request.prompt_ids.empty()) return absl::InvalidArgumentError("the prompt is empty");
    const uint64_t id = next_++;
    Seq seq;
    seq.base = request.prompt_ids[0] * 1000;
    seq.max_new = request.max_new_tokens;
    seqs_.emplace(id, seq);
    waiting_.push_back(id);
    return id;
  }

  absl::StatusOr<std::vector<TokenEvent>> Step() override {
    {
      absl::MutexLock lock(&control_->mu);
      if (control_->steps == control_->stall_at_step) control_->stall = true;
      control_->mu.Await(absl::Condition(
          +[](bool* stall) { return !*stall; }, &control_->stall));
      ++control_->steps;
      if (control_->in_flight > 0) --control_->in_flight;
      if (control_->fail_next_steps > 0) {
        --control_->fail_next_steps;
        return absl::ResourceExhaustedError("out of memory (the fake's)");
      }
      if (control_->fail_with_first_id >= 0) {
        for (const auto& [id, seq] : seqs_) {
          if (seq.base != control_->fail_with_first_id * 1000) continue;
          control_->fail_with_first_id = -1;
          if (control_->fail_unavailable) {
            return absl::UnavailableError("tensor parallel: a worker died (the fake's)");
          }
          return absl::ResourceExhaustedError("out of memory (the fake's)");
        }
      }
    }
    ++steps_;
    while (!waiting_.empty() && static_cast<int>(running_.size()) < room_) {
      running_.push_back(waiting_.front());
      waiting_.pop_front();
    }
    if (preempt_every_ > 0 && steps_ % preempt_every_ == 0 && running_.size() > 1) {
      waiting_.push_front(running_.back());
      running_.pop_back();
      ++preemptions_;
    }
    std::vector<TokenEvent> events;
    for (uint64_t id : running_) {
      Seq& seq = seqs_.at(id);
      TokenEvent event;
      event.sequence = id;
      event.token_id = seq.base + seq.generated;
      event.text = "t";
      ++seq.generated;
      if (seq.generated >= seq.max_new) event.finish = FinishReason::kLength;
      events.push_back(event);
    }
    for (const TokenEvent& e : events) {
      if (e.finish) Cancel(e.sequence);
    }
    return events;
  }

  bool Cancel(uint64_t id) override {
    running_.erase(std::remove(running_.begin(), running_.end(), id), running_.end());
    waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), id), waiting_.end());
    return seqs_.erase(id) > 0;
  }

  int64_t steps_in_flight() const override {
    absl::MutexLock lock(&control_->mu);
    return control_->in_flight;
  }

  EngineStats stats() const override {
    EngineStats s;
    s.running = static_cast<int64_t>(running_.size());
    s.waiting = static_cast<int64_t>(waiting_.size());
    s.kv_blocks_total = room_;
    s.kv_blocks_used = static_cast<int64_t>(running_.size());
    s.preemptions = preemptions_;
    s.steps = steps_;
    s.last_step_tokens = static_cast<int64_t>(running_.size());
    return s;
  }

 private:
  struct Seq {
    int64_t base = 0;
    int64_t max_new = 0;
    int64_t generated = 0;
  };
  std::shared_ptr<Control> control_;
  const int room_;
  const int preempt_every_;
  uint64_t next_ = 1;
  int64_t steps_ = 0;
  int64_t preemptions_ = 0;
  std::map<uint64_t, Seq> seqs_;
  std::deque<uint64_t> waiting_;
  std::vector<uint64_t> running_;
};

// What the loop reports, as a metrics exporter would see it.
class RecordingStatLogger : public StatLogger {
 public:
  void RecordScheduler(const SchedulerStats& stats) override {
    absl::MutexLock lock(&mu_);
    gauges_ = stats;
  }
  void RecordCounters(const EngineStats& delta) override {
    absl::MutexLock lock(&mu_);
    preemptions_ += delta.preemptions;
  }
  void RecordIteration(const IterationStats& stats) override {
    absl::MutexLock lock(&mu_);
    generated_ += stats.generated_tokens;
  }
  void RecordScheduled(double, int64_t) override {}
  void RecordFinished(const FinishedRequestStats& stats) override {
    absl::MutexLock lock(&mu_);
    ++finished_[stats.finish];
  }
  void RecordFailed(absl::string_view reason) override {
    absl::MutexLock lock(&mu_);
    ++failed_[std::string(reason)];
  }
  SchedulerStats gauges() {
    absl::MutexLock lock(&mu_);
    return gauges_;
  }
  int64_t preemptions() {
    absl::MutexLock lock(&mu_);
    return preemptions_;
  }
  int failed(const std::string& reason) {
    absl::MutexLock lock(&mu_);
    return failed_[reason];
  }

 private:
  absl::Mutex mu_;
  SchedulerStats gauges_ ABSL_GUARDED_BY(mu_);
  int64_t preemptions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t generated_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int> finished_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> failed_ ABSL_GUARDED_BY(mu_);
};

class RecordingSink : public RequestSink {
 public:
  void OnTokens(TokenChunk chunk) override {
    absl::MutexLock lock(&mu_);
    tokens_.insert(tokens_.end(), chunk.token_ids.begin(), chunk.token_ids.end());
  }
  void OnDone(const absl::Status& status, const Completion& completion) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    completion_ = completion;
    done_.Notify();
  }
  bool WaitDone(absl::Duration timeout = absl::Seconds(10)) {
    return done_.WaitForNotificationWithTimeout(timeout);
  }
  std::vector<int64_t> tokens() {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  absl::Status status() {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  Completion completion() {
    absl::MutexLock lock(&mu_);
    return completion_;
  }

 private:
  absl::Mutex mu_;
  std::vector<int64_t> tokens_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  Completion completion_ ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
};

GenerationRequest Request(int64_t first_id, int64_t max_new_tokens) {
  GenerationRequest r;
  r.prompt_ids = {first_id, 2, 3};
  r.max_new_tokens = max_new_tokens;
  return r;
}

std::vector<int64_t> Expected(int64_t first_id, int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(first_id * 1000 + i);
  return out;
}

struct Fixture {
  explicit Fixture(int room = 64, int preempt_every = 0, EngineLoopOptions options = {})
      : control(std::make_shared<FakeEngineCore::Control>()),
        scheduler(std::make_unique<FakeEngineCore>(control, room, preempt_every), options,
                  &logger) {}
  std::shared_ptr<FakeEngineCore::Control> control;
  RecordingStatLogger logger;
  EngineLoop scheduler;
};

TEST(EngineLoopTest, TokensReachEachSinkInOrderAndTheRequestEndsOk) {
  Fixture f;
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  for (int64_t k = 1; k <= 5; ++k) {
    sinks.push_back(std::make_shared<RecordingSink>());
    ASSERT_TRUE(f.scheduler.Submit(Request(k, 3 + k), sinks.back()).ok());
  }
  for (int64_t k = 1; k <= 5; ++k) {
    RecordingSink& sink = *sinks[static_cast<size_t>(k - 1)];
    ASSERT_TRUE(sink.WaitDone());
    EXPECT_TRUE(sink.status().ok()) << sink.status();
    EXPECT_EQ(sink.tokens(), Expected(k, 3 + k));
    EXPECT_EQ(sink.completion().finish, Finish::kLength);
    EXPECT_EQ(sink.completion().generated_tokens, 3 + k);
    EXPECT_EQ(sink.completion().prompt_tokens, 3);
  }
  EXPECT_TRUE(f.scheduler.WaitIdle(absl::Seconds(5)));
}

// Room for two: the others wait in the engine core, and with a preemption
// every third step the preempted one goes on where it was.
TEST(EngineLoopTest, OutOfBlocksRequestsWaitOrArePreemptedAndAllFinishWhole) {
  Fixture f(/*room=*/2, /*preempt_every=*/3);
  // The first step waits until all six are queued: on a loaded machine the
  // scheduler could otherwise finish each request alone before the next
  // arrives, and nothing would ever be preempted.
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->stall = true;
  }
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  for (int64_t k = 1; k <= 6; ++k) {
    sinks.push_back(std::make_shared<RecordingSink>());
    ASSERT_TRUE(f.scheduler.Submit(Request(k, 10), sinks.back()).ok());
  }
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->stall = false;
  }
  for (int64_t k = 1; k <= 6; ++k) {
    ASSERT_TRUE(sinks[static_cast<size_t>(k - 1)]->WaitDone());
    EXPECT_TRUE(sinks[static_cast<size_t>(k - 1)]->status().ok());
    EXPECT_EQ(sinks[static_cast<size_t>(k - 1)]->tokens(), Expected(k, 10)) << k;
  }
  EXPECT_TRUE(f.scheduler.WaitIdle(absl::Seconds(5)));
  const EngineLoop::Snapshot snapshot = f.scheduler.snapshot();
  EXPECT_GT(snapshot.engine.preemptions, 0);
  EXPECT_EQ(snapshot.running, 0);
  EXPECT_EQ(snapshot.waiting, 0);
  EXPECT_EQ(f.logger.preemptions(), snapshot.engine.preemptions);
  EXPECT_EQ(f.logger.gauges().kv_blocks_used, 0);
}

// While two run, the third waits in the engine core: the gauges say so.
TEST(EngineLoopTest, WaitingForBlocksIsCountedAsWaiting) {
  Fixture f(/*room=*/2);
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->stall = true;  // until all three are queued
    f.control->stall_at_step = 2;
  }
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  for (int64_t k = 1; k <= 3; ++k) {
    sinks.push_back(std::make_shared<RecordingSink>());
    ASSERT_TRUE(f.scheduler.Submit(Request(k, 400), sinks.back()).ok());
  }
  absl::SleepFor(absl::Milliseconds(20));
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->stall = false;
  }
  // Step 1 (counted 0) runs two and leaves one waiting; step 2 stalls.
  absl::Time until = absl::Now() + absl::Seconds(10);
  while (f.scheduler.snapshot().steps < 2 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  const EngineLoop::Snapshot snapshot = f.scheduler.snapshot();
  EXPECT_EQ(snapshot.running, 2);
  EXPECT_EQ(snapshot.waiting, 1);
  EXPECT_EQ(f.logger.gauges().waiting, 1);
  EXPECT_EQ(f.logger.gauges().kv_blocks_used, f.logger.gauges().kv_blocks_total);
  f.scheduler.CancelAll();
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->stall = false;
  }
  for (auto& sink : sinks) ASSERT_TRUE(sink->WaitDone());
  EXPECT_EQ(sinks[2]->completion().finish, Finish::kCancelled);
}

// A failed step ends the requests that joined in it; the one already
// running goes on and finishes whole.
TEST(EngineLoopTest, AFailedStepEndsOnlyTheRequestsThatJoinedInIt) {
  Fixture f;
  auto first = std::make_shared<RecordingSink>();
  ASSERT_TRUE(f.scheduler.Submit(Request(1, 50), first).ok());
  absl::Time until = absl::Now() + absl::Seconds(10);
  while (first->tokens().size() < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_GE(first->tokens().size(), 2u);
  // The step `second` joins in fails. (A stall-and-release here raced: on a
  // slow machine the stalled step could be one that `second` had not yet
  // joined, and then it blamed `first`.)
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->fail_with_first_id = 2;
  }
  auto second = std::make_shared<RecordingSink>();
  ASSERT_TRUE(f.scheduler.Submit(Request(2, 5), second).ok());
  ASSERT_TRUE(second->WaitDone());
  ASSERT_TRUE(first->WaitDone());
  EXPECT_TRUE(first->status().ok()) << first->status();
  EXPECT_EQ(first->tokens(), Expected(1, 50));
  EXPECT_EQ(second->status().code(), absl::StatusCode::kInternal) << second->status();
  EXPECT_THAT(second->status().message(), HasSubstr("out of memory (the fake's)"));
  EXPECT_TRUE(second->tokens().empty());
  EXPECT_EQ(f.logger.failed("internal"), 1);
}

// A step that fails UNAVAILABLE (a tensor-parallel group that broke: every
// later step fails too) ends every running request with UNAVAILABLE, not
// only the ones that joined in it, and not as INTERNAL.
TEST(EngineLoopTest, AnUnavailableStepEndsEveryRunningRequestUnavailable) {
  Fixture f;
  auto first = std::make_shared<RecordingSink>();
  // Long enough to be running still when the step fails.
  ASSERT_TRUE(f.scheduler.Submit(Request(1, 1000000), first).ok());
  absl::Time until = absl::Now() + absl::Seconds(10);
  while (first->tokens().size() < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_GE(first->tokens().size(), 2u);
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->fail_with_first_id = 2;
    f.control->fail_unavailable = true;
  }
  auto second = std::make_shared<RecordingSink>();
  ASSERT_TRUE(f.scheduler.Submit(Request(2, 5), second).ok());
  ASSERT_TRUE(second->WaitDone());
  ASSERT_TRUE(first->WaitDone());
  EXPECT_EQ(first->status().code(), absl::StatusCode::kUnavailable) << first->status();
  EXPECT_EQ(second->status().code(), absl::StatusCode::kUnavailable) << second->status();
  EXPECT_THAT(second->status().message(), HasSubstr("a worker died (the fake's)"));
  EXPECT_LT(first->tokens().size(), 1000000u);
}

TEST(EngineLoopTest, AStepThatFailsWithNobodyNewEndsEveryone) {
  Fixture f;
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->stall = true;  // until both are queued
    f.control->stall_at_step = 3;
  }
  auto a = std::make_shared<RecordingSink>(), b = std::make_shared<RecordingSink>();
  ASSERT_TRUE(f.scheduler.Submit(Request(1, 1000), a).ok());
  ASSERT_TRUE(f.scheduler.Submit(Request(2, 1000), b).ok());
  absl::SleepFor(absl::Milliseconds(20));
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->stall = false;
  }
  absl::Time until = absl::Now() + absl::Seconds(10);
  while (f.scheduler.snapshot().steps < 3 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->fail_next_steps = 1;
    f.control->stall = false;
  }
  ASSERT_TRUE(a->WaitDone());
  ASSERT_TRUE(b->WaitDone());
  EXPECT_EQ(a->status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(b->status().code(), absl::StatusCode::kInternal);
  // The scheduler still serves.
  auto c = std::make_shared<RecordingSink>();
  ASSERT_TRUE(f.scheduler.Submit(Request(3, 2), c).ok());
  ASSERT_TRUE(c->WaitDone());
  EXPECT_EQ(c->tokens(), Expected(3, 2));
}

// During a stalled step, a cancelled request and one past its deadline end
// as soon as the step returns; the queue holds max_queue and no more.
// Steps still in flight in the core (pipeline parallel) are collected even
// when every request of the loop has ended: the loop keeps stepping, so the
// blocks of requests cancelled while in flight come back.
TEST(EngineLoopTest, StepsInFlightAreCollectedAfterTheirRequestsWereCancelled) {
  Fixture f;
  auto sink = std::make_shared<RecordingSink>();
  absl::StatusOr<uint64_t> id = f.scheduler.Submit(Request(1, 100000), sink);
  ASSERT_TRUE(id.ok());
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (sink->tokens().empty() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  f.scheduler.Cancel(*id);
  ASSERT_TRUE(sink->WaitDone());
  EXPECT_EQ(sink->status().code(), absl::StatusCode::kCancelled);
  // No request left in the loop, but steps in flight in the core: the loop
  // steps on until there are none.
  absl::MutexLock lock(&f.control->mu);
  f.control->in_flight = 3;
  EXPECT_TRUE(f.control->mu.AwaitWithTimeout(
      absl::Condition(
          +[](int64_t* n) { return *n == 0; }, &f.control->in_flight),
      absl::Seconds(5)));
}

TEST(EngineLoopTest, CancelDeadlineAndAFullQueueWhileAStepStalls) {
  EngineLoopOptions options;
  options.max_batch_size = 1;
  options.max_queue = 2;
  Fixture f(/*room=*/64, /*preempt_every=*/0, options);
  auto running = std::make_shared<RecordingSink>();
  ASSERT_TRUE(f.scheduler.Submit(Request(1, 100000), running).ok());
  absl::Time until = absl::Now() + absl::Seconds(10);
  while (running->tokens().empty() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->stall = true;
  }
  auto cancelled = std::make_shared<RecordingSink>(), expiring = std::make_shared<RecordingSink>();
  absl::StatusOr<uint64_t> id = f.scheduler.Submit(Request(2, 5), cancelled);
  ASSERT_TRUE(id.ok());
  GenerationRequest soon = Request(3, 5);
  soon.deadline = absl::Now() + absl::Milliseconds(30);
  soon.deadline_reason = "the client's deadline";
  ASSERT_TRUE(f.scheduler.Submit(soon, expiring).ok());
  absl::StatusOr<uint64_t> over =
      f.scheduler.Submit(Request(4, 5), std::make_shared<RecordingSink>());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  f.scheduler.Cancel(*id);
  f.scheduler.Cancel(*id);  // twice is harmless
  absl::SleepFor(absl::Milliseconds(60));
  {
    absl::MutexLock lock(&f.control->mu);
    f.control->stall = false;
  }
  ASSERT_TRUE(cancelled->WaitDone());
  ASSERT_TRUE(expiring->WaitDone());
  EXPECT_EQ(cancelled->status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(expiring->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(expiring->status().message(), HasSubstr("the client's deadline"));
  EXPECT_TRUE(cancelled->tokens().empty());
  f.scheduler.StopAdmission();
  EXPECT_EQ(f.scheduler.Submit(Request(5, 1), std::make_shared<RecordingSink>()).status().code(),
            absl::StatusCode::kUnavailable);
  f.scheduler.CancelAll();
  ASSERT_TRUE(running->WaitDone());
  EXPECT_TRUE(running->status().ok());
  EXPECT_EQ(running->completion().finish, Finish::kCancelled);
  EXPECT_TRUE(f.scheduler.WaitIdle(absl::Seconds(5)));
}

}  // namespace
}  // namespace accel::engine
