// The engine core over a fake model runner (torch-free): the step's parts
// meet as they should. The fake's tokens follow a rule (the next token is
// the last + 1), it proposes drafts that are right or wrong on demand, and
// it can fail a step; the core must stream one event per token (several a
// step with accepted drafts), count drafts and acceptances by position,
// retry a failed step with nothing advanced, cut a stop string inside a
// step's tokens, and free every block.
#include "engine/engine_core.h"

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::engine {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

// What the fake runner is told, for the test to look at.
struct RunnerLog {
  std::vector<SchedulerOutput> steps;
  int fail_next = 0;  // steps to fail
  // Drafts proposed after each step: `right` of them are what the rule
  // gives, then wrong ones, up to `drafts` in all.
  int64_t drafts = 0;
  int64_t right = 0;
};

class FakeRunner : public ModelRunnerInterface {
 public:
  explicit FakeRunner(std::shared_ptr<RunnerLog> log) : log_(std::move(log)) {}

  absl::Status AddRequest(uint64_t id, const GenerationRequest&) override {
    lengths_[id] = 0;
    return absl::OkStatus();
  }
  void RemoveRequest(uint64_t id) override { lengths_.erase(id); }

  absl::StatusOr<ModelRunnerOutput> Execute(const SchedulerOutput& out) override {
    for (uint64_t id : out.preempted) lengths_[id] = 0;
    if (log_->fail_next > 0) {
      --log_->fail_next;
      return absl::ResourceExhaustedError("out of memory (the fake's)");
    }
    log_->steps.push_back(out);
    ModelRunnerOutput result;
    for (const ScheduledRequest& s : out.scheduled) {
      int64_t& length = lengths_.at(s.id);
      // The cache holds what the scheduler says (a prefix hit starts it).
      if (length != s.num_computed_tokens) {
        EXPECT_EQ(length, 0) << "request " << s.id;
        length = s.num_computed_tokens;
      }
      length += s.num_tokens;
      if (!s.samples) continue;
      // The rule: each token is the one before + 1. Drafts are accepted
      // while they follow it; then the rule's token.
      std::vector<int64_t> ids(s.token_ids.begin(), s.token_ids.end());
      SampledTokens t;
      t.id = s.id;
      t.num_drafts = static_cast<int64_t>(s.draft_token_ids.size());
      for (int64_t draft : s.draft_token_ids) {
        if (draft != ids.back() + 1) break;
        ids.push_back(draft);
        t.token_ids.push_back(draft);
        ++t.num_accepted_drafts;
      }
      t.token_ids.push_back(ids.back() + 1);
      ids.push_back(ids.back() + 1);
      length -= t.num_drafts - t.num_accepted_drafts;
      std::vector<int64_t> drafts;
      for (int64_t i = 0; i < log_->drafts; ++i) {
        drafts.push_back(ids.back() + 1 + i + (i < log_->right ? 0 : 1000));
      }
      if (!drafts.empty()) result.drafts[s.id] = drafts;
      result.sampled.push_back(std::move(t));
    }
    return result;
  }

  int64_t num_blocks() const override { return 16; }
  int64_t block_size() const override { return 4; }
  bool supports_prefix_caching() const override { return true; }
  int64_t position_limit() const override { return 1000; }
  int64_t lookahead_tokens() const override { return 0; }
  int64_t kv_cache_bytes() const override { return 0; }

 private:
  std::shared_ptr<RunnerLog> log_;
  std::map<uint64_t, int64_t> lengths_;
};

// Token k reads as the letter 'a' + k % 26.
class LetterStream : public TextStream {
 public:
  std::string Next(int64_t id) override { return std::string(1, static_cast<char>('a' + id % 26)); }
  std::string Flush() override { return ""; }
};

GenerationRequest Request(std::vector<int64_t> prompt, int64_t max_new_tokens) {
  GenerationRequest r;
  r.prompt_ids = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  return r;
}

struct Core {
  explicit Core(int64_t drafts = 0, int64_t right = 0)
      : log(std::make_shared<RunnerLog>()),
        core(std::make_unique<FakeRunner>(log), [] { return std::make_unique<LetterStream>(); }) {
    log->drafts = drafts;
    log->right = right;
  }
  std::shared_ptr<RunnerLog> log;
  EngineCore core;
};

TEST(EngineCoreTest, WithoutDraftsAStepGivesOneTokenPerRequest) {
  Core c;
  auto results = Generate(c.core, {Request({1, 2, 3}, 4), Request({10}, 2)});
  ASSERT_THAT(results, IsOk());
  EXPECT_THAT((*results)[0].token_ids, ElementsAre(4, 5, 6, 7));
  EXPECT_EQ((*results)[0].text, "efgh");
  EXPECT_THAT((*results)[1].token_ids, ElementsAre(11, 12));
  EXPECT_EQ(c.log->steps.size(), 4u);
  const EngineStats stats = c.core.stats();
  EXPECT_EQ(stats.generation_tokens, 6);
  EXPECT_EQ(stats.prompt_tokens, 4);
  EXPECT_EQ(stats.spec_num_drafts, 0);
  EXPECT_EQ(stats.kv_blocks_used, 0);
}

// Drafts that are all right: each verification step gives k + 1 tokens, so
// 13 tokens take the prompt's step and 3 more (1 + 4 + 4 + 4 ... cut to 13).
TEST(EngineCoreTest, AcceptedDraftsGiveSeveralTokensAStepAndTheSameTokens) {
  Core c(/*drafts=*/3, /*right=*/3);
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t id, c.core.Add(Request({1, 2, 3}, 13)));
  std::vector<std::vector<int64_t>> per_step;
  while (c.core.num_requests() > 0) {
    auto events = c.core.Step();
    ASSERT_THAT(events, IsOk());
    per_step.emplace_back();
    for (const TokenEvent& e : *events) {
      EXPECT_EQ(e.sequence, id);
      per_step.back().push_back(e.token_id);
    }
  }
  ASSERT_EQ(per_step.size(), 4u);
  EXPECT_THAT(per_step[0], ElementsAre(4));
  EXPECT_THAT(per_step[1], ElementsAre(5, 6, 7, 8));
  EXPECT_THAT(per_step[2], ElementsAre(9, 10, 11, 12));
  // 13 - 9 = 4 tokens were left: the drafts are cut to 3 and all taken.
  EXPECT_THAT(per_step[3], ElementsAre(13, 14, 15, 16));
  const EngineStats stats = c.core.stats();
  EXPECT_EQ(stats.spec_num_drafts, 3);
  EXPECT_EQ(stats.spec_num_draft_tokens, 9);
  EXPECT_EQ(stats.spec_num_accepted_tokens, 9);
  EXPECT_THAT(stats.spec_accepted_per_position, ElementsAre(3, 3, 3));
  EXPECT_EQ(stats.generation_tokens, 13);
}

// One right draft of three: two tokens a step, and the per-position counts
// say where acceptance stopped.
TEST(EngineCoreTest, RejectedDraftsAreCountedByPosition) {
  Core c(/*drafts=*/3, /*right=*/1);
  auto results = Generate(c.core, {Request({1}, 7)});
  ASSERT_THAT(results, IsOk());
  EXPECT_THAT((*results)[0].token_ids, ElementsAre(2, 3, 4, 5, 6, 7, 8));
  const EngineStats stats = c.core.stats();
  EXPECT_EQ(stats.spec_num_drafts, 3);
  EXPECT_EQ(stats.spec_num_accepted_tokens, 3);
  EXPECT_THAT(stats.spec_accepted_per_position, ElementsAre(3, 0, 0));
}

TEST(EngineCoreTest, AFailedStepAdvancesNothingAndIsRetried) {
  Core c(/*drafts=*/2, /*right=*/2);
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t id, c.core.Add(Request({1, 2}, 6)));
  ASSERT_THAT(c.core.Step(), IsOk());
  c.log->fail_next = 2;
  EXPECT_THAT(c.core.Step(), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(c.core.Step(), StatusIs(absl::StatusCode::kResourceExhausted));
  std::vector<int64_t> tokens = {3};
  while (c.core.num_requests() > 0) {
    auto events = c.core.Step();
    ASSERT_THAT(events, IsOk());
    for (const TokenEvent& e : *events) {
      EXPECT_EQ(e.sequence, id);
      tokens.push_back(e.token_id);
    }
  }
  EXPECT_THAT(tokens, ElementsAre(3, 4, 5, 6, 7, 8));
  EXPECT_EQ(c.core.stats().kv_blocks_used, 0);
}

// A stop string completed by the second of a step's accepted tokens ends
// the request there: the tokens after it are not sent.
TEST(EngineCoreTest, AStopStringInsideAStepsTokensEndsTheRequestThere) {
  Core c(/*drafts=*/4, /*right=*/4);
  GenerationRequest r = Request({0}, 20);
  r.stop_strings = {"cd"};  // tokens 2 and 3
  auto results = Generate(c.core, {r});
  ASSERT_THAT(results, IsOk());
  EXPECT_THAT((*results)[0].token_ids, ElementsAre(1, 2, 3));
  EXPECT_EQ((*results)[0].text, "b");
  EXPECT_EQ((*results)[0].finish_reason, FinishReason::kStop);
  EXPECT_EQ(c.core.num_requests(), 0u);
  EXPECT_EQ(c.core.stats().kv_blocks_used, 0);
}

TEST(EngineCoreTest, CancelFreesTheBlocksAtOnceAndARequestThatCouldNeverFitIsRefused) {
  Core c;
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t a, c.core.Add(Request({1, 2, 3, 4, 5}, 30)));
  ASSERT_THAT(c.core.Step(), IsOk());
  EXPECT_EQ(c.core.stats().kv_blocks_used, 2);
  EXPECT_TRUE(c.core.Cancel(a));
  EXPECT_FALSE(c.core.Cancel(a));
  EXPECT_EQ(c.core.stats().kv_blocks_used, 0);
  EXPECT_EQ(c.core.num_requests(), 0u);
  // 16 blocks of 4: 64 tokens in all.
  EXPECT_THAT(c.core.Add(Request(std::vector<int64_t>(40, 1), 30)),
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::HasSubstr("64 tokens")));
}

// A runner that keeps two steps in flight (as a pipeline-parallel model
// does): Submit queues the step, Collect runs the fake's oldest one then
// (so a failed collect advances nothing). It checks that no request is in
// two steps in flight.
class InFlightRunner : public FakeRunner {
 public:
  explicit InFlightRunner(std::shared_ptr<RunnerLog> log) : FakeRunner(std::move(log)) {}
  int max_steps_in_flight() const override { return 2; }
  absl::StatusOr<uint64_t> Submit(const SchedulerOutput& out) override {
    for (const ScheduledRequest& s : out.scheduled) {
      EXPECT_EQ(in_flight_ids_.count(s.id), 0u) << "request " << s.id << " is in flight";
      in_flight_ids_.insert(s.id);
    }
    queue_.push_back(out);
    return next_++;
  }
  absl::StatusOr<ModelRunnerOutput> Collect(uint64_t) override {
    if (fail_collect) {
      fail_collect = false;
      return absl::UnavailableError("a stage went silent (the fake's)");
    }
    const SchedulerOutput out = std::move(queue_.front());
    queue_.erase(queue_.begin());
    for (const ScheduledRequest& s : out.scheduled) in_flight_ids_.erase(s.id);
    return Execute(out);
  }
  void AbandonSubmitted() override {
    queue_.clear();
    in_flight_ids_.clear();
  }
  bool fail_collect = false;

 private:
  std::vector<SchedulerOutput> queue_;
  std::set<uint64_t> in_flight_ids_;
  uint64_t next_ = 1;
};

// With two steps in flight the requests split into two disjoint batches
// that alternate, and every request gets the tokens of one step at a time.
TEST(EngineCoreTest, TwoStepsInFlightOverDisjointRequestsGiveTheSameTokens) {
  auto log = std::make_shared<RunnerLog>();
  EngineCore core(std::make_unique<InFlightRunner>(log),
                  [] { return std::make_unique<LetterStream>(); });
  std::vector<GenerationRequest> requests;
  for (int64_t i = 0; i < 4; ++i) requests.push_back(Request({10 * i, 10 * i + 1}, 5));
  auto results = Generate(core, requests);
  ASSERT_THAT(results, IsOk());
  for (int64_t i = 0; i < 4; ++i) {
    const int64_t n = 10 * i + 2;
    EXPECT_THAT((*results)[static_cast<size_t>(i)].token_ids,
                ElementsAre(n, n + 1, n + 2, n + 3, n + 4));
  }
  // Two of the four requests a step: 4 x 5 tokens in 10 steps, each
  // submitted behind another but the first.
  EXPECT_EQ(log->steps.size(), 10u);
  for (const SchedulerOutput& step : log->steps) EXPECT_EQ(step.scheduled.size(), 2u);
  EXPECT_EQ(core.stats().overlapped_steps, 9);
  EXPECT_EQ(core.stats().kv_blocks_used, 0);
  EXPECT_EQ(core.steps_in_flight(), 0);
}

// A request cancelled while its step is in flight keeps its blocks until
// that step is collected, and gives no more events; a failed collect
// abandons every step in flight (nothing advanced) and the next steps run.
TEST(EngineCoreTest, CancelWaitsForTheStepInFlightAndAFailedCollectAbandonsAll) {
  auto log = std::make_shared<RunnerLog>();
  auto owned = std::make_unique<InFlightRunner>(log);
  InFlightRunner* runner = owned.get();
  EngineCore core(std::move(owned), [] { return std::make_unique<LetterStream>(); });
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t a, core.Add(Request({1, 2, 3, 4, 5}, 5)));
  ACCEL_ASSERT_OK_AND_ASSIGN(uint64_t b, core.Add(Request({20}, 3)));
  ACCEL_ASSERT_OK_AND_ASSIGN(auto events, core.Step());  // a submitted
  EXPECT_THAT(events, ::testing::IsEmpty());
  EXPECT_EQ(core.steps_in_flight(), 1);
  ACCEL_ASSERT_OK_AND_ASSIGN(events, core.Step());  // b submitted, a collected
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].sequence, a);
  EXPECT_EQ(events[0].token_id, 6);
  EXPECT_EQ(core.steps_in_flight(), 1);
  EXPECT_EQ(core.stats().kv_blocks_used, 3);
  EXPECT_TRUE(core.Cancel(b));  // in flight: deferred
  EXPECT_EQ(core.stats().kv_blocks_used, 3);
  EXPECT_EQ(core.num_requests(), 2u);
  ACCEL_ASSERT_OK_AND_ASSIGN(events, core.Step());  // a submitted, b collected and dropped
  EXPECT_THAT(events, ::testing::IsEmpty());
  EXPECT_EQ(core.stats().kv_blocks_used, 2);
  EXPECT_EQ(core.num_requests(), 1u);
  EXPECT_FALSE(core.Cancel(b));
  ACCEL_ASSERT_OK_AND_ASSIGN(events, core.Step());  // a collected
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].token_id, 7);
  ACCEL_ASSERT_OK_AND_ASSIGN(events, core.Step());  // a submitted
  EXPECT_THAT(events, ::testing::IsEmpty());
  runner->fail_collect = true;
  EXPECT_THAT(core.Step(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(core.steps_in_flight(), 0);
  std::vector<int64_t> tokens;
  while (core.num_requests() > 0) {
    ACCEL_ASSERT_OK_AND_ASSIGN(events, core.Step());
    for (const TokenEvent& e : events) tokens.push_back(e.token_id);
  }
  EXPECT_THAT(tokens, ElementsAre(8, 9, 10));
  EXPECT_EQ(core.stats().kv_blocks_used, 0);
}

}  // namespace
}  // namespace accel::engine
