// The scheduler alone, as pure policy: no model, no tensors. What a step
// holds (who runs, how many tokens, which are drafts), the token budget
// with decoding first and prompts in chunks, preemption of the newest when
// blocks run out, prefix hits, drafts cut to their limits and dropped
// before anyone is preempted for them, rejected drafts rolled back, stop
// tokens and length limits inside a step's several tokens, and a
// randomized run that must finish everything and leave every block free.
#include "engine/scheduler.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accel::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

GenerationRequest Request(std::vector<int64_t> prompt, int64_t max_new_tokens,
                          std::vector<int64_t> stops = {}) {
  GenerationRequest r;
  r.prompt_ids = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  r.stop_token_ids = std::move(stops);
  return r;
}

std::vector<int64_t> Range(int64_t first, int64_t n) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(first + i);
  return ids;
}

const ScheduledRequest* Find(const SchedulerOutput& out, uint64_t id) {
  for (const ScheduledRequest& s : out.scheduled) {
    if (s.id == id) return &s;
  }
  return nullptr;
}

// A model runner in a line: each request that samples gets `accept` of its
// drafts and then token 7 (or the whole of `tokens` when given).
std::vector<SampledTokens> RunnerStep(const SchedulerOutput& out, int64_t accept = 0,
                                      std::vector<int64_t> tokens = {}) {
  std::vector<SampledTokens> sampled;
  for (const ScheduledRequest& s : out.scheduled) {
    if (!s.samples) continue;
    SampledTokens t;
    t.id = s.id;
    t.num_drafts = static_cast<int64_t>(s.draft_token_ids.size());
    t.num_accepted_drafts = std::min(accept, t.num_drafts);
    if (!tokens.empty()) {
      t.token_ids = tokens;
    } else {
      t.token_ids.assign(s.draft_token_ids.begin(),
                         s.draft_token_ids.begin() + t.num_accepted_drafts);
      t.token_ids.push_back(7);
    }
    sampled.push_back(t);
  }
  return sampled;
}

TEST(SchedulerTest, AStepReadsWholePromptsThenDecodesOneTokenEach) {
  KvCacheManager kv(16, 4, true);
  Scheduler scheduler({}, &kv);
  scheduler.Add(1, Request(Range(10, 5), 3));
  scheduler.Add(2, Request(Range(20, 2), 3));
  SchedulerOutput first = scheduler.Schedule();
  ASSERT_EQ(first.scheduled.size(), 2u);
  EXPECT_EQ(first.scheduled[0].num_tokens, 5);
  EXPECT_EQ(first.scheduled[1].num_tokens, 2);
  EXPECT_TRUE(first.scheduled[0].samples);
  EXPECT_EQ(first.total_tokens, 7);
  EXPECT_EQ(first.prompt_tokens, 7);
  EXPECT_EQ(first.scheduled[0].block_table.size(), 2u);
  std::vector<RequestUpdate> updates = scheduler.UpdateFromOutput(first, RunnerStep(first));
  ASSERT_EQ(updates.size(), 2u);
  EXPECT_THAT(updates[0].token_ids, ElementsAre(7));
  EXPECT_FALSE(updates[0].finish.has_value());
  EXPECT_EQ(scheduler.request(1)->num_computed_tokens, 5);
  EXPECT_EQ(scheduler.request(1)->num_pending_tokens(), 1);
  SchedulerOutput second = scheduler.Schedule();
  ASSERT_EQ(second.scheduled.size(), 2u);
  EXPECT_EQ(second.scheduled[0].num_tokens, 1);
  EXPECT_EQ(second.scheduled[0].num_computed_tokens, 5);
  EXPECT_EQ(second.prompt_tokens, 0);
  scheduler.UpdateFromOutput(second, RunnerStep(second));
  // The third token is the last of max_new_tokens.
  SchedulerOutput third = scheduler.Schedule();
  std::vector<RequestUpdate> last = scheduler.UpdateFromOutput(third, RunnerStep(third));
  ASSERT_EQ(last.size(), 2u);
  EXPECT_EQ(last[0].finish, FinishReason::kLength);
  EXPECT_EQ(scheduler.num_requests(), 0u);
  EXPECT_EQ(kv.used_blocks(), 0);
}

// With a budget of 6: the decoding request's token first, then the long
// prompt's chunk from what is left (half of it while another prompt waits).
TEST(SchedulerTest, DecodingGoesFirstAndPromptsAreReadInChunksWithinTheBudget) {
  KvCacheManager kv(64, 4, false);
  SchedulerOptions options;
  options.max_num_batched_tokens = 6;
  Scheduler scheduler(options, &kv);
  scheduler.Add(1, Request(Range(1, 3), 50));
  SchedulerOutput out = scheduler.Schedule();
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  scheduler.Add(2, Request(Range(100, 40), 5));
  scheduler.Add(3, Request(Range(200, 4), 5));
  out = scheduler.Schedule();
  EXPECT_LE(out.total_tokens, 6);
  ASSERT_NE(Find(out, 1), nullptr);
  EXPECT_EQ(Find(out, 1)->num_tokens, 1);
  // 5 tokens left for prompts, two prompts to read: at most 2 (5 / 2) each.
  ASSERT_NE(Find(out, 2), nullptr);
  EXPECT_EQ(Find(out, 2)->num_tokens, 2);
  EXPECT_FALSE(Find(out, 2)->samples);
  ASSERT_NE(Find(out, 3), nullptr);
  EXPECT_EQ(Find(out, 3)->num_tokens, 2);
  EXPECT_EQ(out.prompt_tokens, 4);
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  EXPECT_EQ(scheduler.request(2)->num_computed_tokens, 2);
  // Every step keeps the decoding request going until the prompts are read.
  for (int step = 0; step < 60 && scheduler.request(2)->num_output_tokens() == 0; ++step) {
    out = scheduler.Schedule();
    EXPECT_LE(out.total_tokens, 6);
    ASSERT_NE(Find(out, 1), nullptr) << "the decoding request waited for a prompt";
    scheduler.UpdateFromOutput(out, RunnerStep(out));
  }
  EXPECT_EQ(scheduler.request(2)->num_computed_tokens, 40);
}

// Room for 3 blocks of 4: two requests of 5 tokens fit (2 blocks + 1), and
// when the first needs its third block the newest is preempted, goes back
// to the front of the queue and recomputes from 0.
TEST(SchedulerTest, TheNewestIsPreemptedWhenBlocksRunOut) {
  KvCacheManager kv(4, 4, false);
  Scheduler scheduler({}, &kv);
  scheduler.Add(1, Request(Range(1, 7), 20));
  scheduler.Add(2, Request(Range(50, 4), 20));
  SchedulerOutput out = scheduler.Schedule();
  ASSERT_EQ(out.scheduled.size(), 2u);
  EXPECT_EQ(kv.used_blocks(), 3);
  scheduler.UpdateFromOutput(out, RunnerStep(out));  // 8 and 5 tokens
  out = scheduler.Schedule();  // 1 writes position 7 (its 2nd block), 2 position 4: 4 blocks
  EXPECT_THAT(out.preempted, IsEmpty());
  scheduler.UpdateFromOutput(out, RunnerStep(out));  // 9 and 6 tokens
  out = scheduler.Schedule();                        // 1 needs a third block: 2 goes
  EXPECT_THAT(out.preempted, ElementsAre(2u));
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].id, 1u);
  EXPECT_EQ(scheduler.request(2)->num_computed_tokens, 0);
  EXPECT_FALSE(scheduler.request(2)->running);
  EXPECT_EQ(scheduler.preemptions(), 1);
  EXPECT_EQ(scheduler.num_waiting(), 1);
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  // Request 2 keeps its 6 tokens (prompt and generated) for when it resumes.
  EXPECT_EQ(scheduler.request(2)->token_ids.size(), 6u);
  scheduler.Finish(1);
  out = scheduler.Schedule();
  ASSERT_NE(Find(out, 2), nullptr);
  EXPECT_EQ(Find(out, 2)->num_tokens, 6);
  EXPECT_EQ(Find(out, 2)->num_computed_tokens, 0);
  EXPECT_EQ(out.prompt_tokens, 6);  // recomputation counts as prompt
}

TEST(SchedulerTest, AJoiningRequestStartsAfterItsCachedPrefix) {
  KvCacheManager kv(16, 4, true);
  Scheduler scheduler({}, &kv);
  scheduler.Add(1, Request(Range(1, 9), 1));
  SchedulerOutput out = scheduler.Schedule();
  scheduler.UpdateFromOutput(out,
                             RunnerStep(out));  // 9 computed, 2 full blocks cached; it finishes
  EXPECT_EQ(scheduler.num_requests(), 0u);
  std::vector<int64_t> prompt = Range(1, 8);
  prompt.push_back(99);
  prompt.push_back(98);
  scheduler.Add(2, Request(prompt, 4));
  out = scheduler.Schedule();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].num_computed_tokens, 8);
  EXPECT_EQ(out.scheduled[0].num_tokens, 2);
  EXPECT_EQ(kv.pool().prefix_hit_tokens(), 8);
}

// The n choices of a request are n requests of one prompt: the second
// waits while the first reads it, then joins on its cached blocks, so the
// prompt is computed once (and a request behind them is not held up).
TEST(SchedulerTest, ASecondRequestOfTheSamePromptJoinsOnTheFirstsBlocks) {
  KvCacheManager kv(16, 4, true);
  Scheduler scheduler({}, &kv);
  scheduler.Add(1, Request(Range(1, 10), 3));
  scheduler.Add(2, Request(Range(1, 10), 3));
  scheduler.Add(3, Request(Range(50, 3), 3));
  SchedulerOutput out = scheduler.Schedule();
  ASSERT_EQ(out.scheduled.size(), 2u);
  EXPECT_EQ(out.scheduled[0].id, 1u);
  EXPECT_EQ(out.scheduled[1].id, 3u);
  EXPECT_EQ(Find(out, 2), nullptr);
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  out = scheduler.Schedule();
  const ScheduledRequest* second = Find(out, 2);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->num_computed_tokens, 8);  // two full blocks of 4 cached
  EXPECT_EQ(second->num_tokens, 2);
  EXPECT_EQ(kv.pool().prefix_hit_tokens(), 8);

  // Without prefix caching nothing could be shared: both read at once.
  KvCacheManager plain(16, 4, false);
  Scheduler alone({}, &plain);
  alone.Add(1, Request(Range(1, 10), 3));
  alone.Add(2, Request(Range(1, 10), 3));
  EXPECT_EQ(alone.Schedule().scheduled.size(), 2u);
}

// min_tokens: a stop token does not end a request before it (the sampler
// masks stop tokens until then; the scheduler agrees).
TEST(SchedulerTest, AStopTokenEndsARequestOnlyAfterMinTokens) {
  KvCacheManager kv(16, 4, true);
  Scheduler scheduler({}, &kv);
  GenerationRequest r = Request(Range(1, 3), 10, {7});
  r.min_tokens = 2;
  scheduler.Add(1, r);
  SchedulerOutput out = scheduler.Schedule();
  std::vector<RequestUpdate> updates = scheduler.UpdateFromOutput(out, RunnerStep(out));
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_FALSE(updates[0].finish.has_value());  // token 1 of 2
  out = scheduler.Schedule();
  updates = scheduler.UpdateFromOutput(out, RunnerStep(out));
  EXPECT_FALSE(updates[0].finish.has_value());  // token 2 of 2
  out = scheduler.Schedule();
  updates = scheduler.UpdateFromOutput(out, RunnerStep(out));
  EXPECT_EQ(updates[0].finish, FinishReason::kEos);
}

// Three drafts verified with the last token: one accepted, then the
// target's own token. The rejected two leave num_computed_tokens.
TEST(SchedulerTest, DraftsAreVerifiedWithTheLastTokenAndRejectedOnesRollBack) {
  KvCacheManager kv(16, 4, false);
  Scheduler scheduler({}, &kv);
  scheduler.Add(1, Request(Range(1, 4), 20));
  SchedulerOutput out = scheduler.Schedule();
  scheduler.UpdateFromOutput(out, RunnerStep(out));  // 5 tokens, 4 computed
  scheduler.SetDrafts(1, {30, 31, 32});
  out = scheduler.Schedule();
  ASSERT_EQ(out.scheduled.size(), 1u);
  const ScheduledRequest& s = out.scheduled[0];
  EXPECT_EQ(s.num_tokens, 4);
  EXPECT_THAT(s.draft_token_ids, ElementsAre(30, 31, 32));
  EXPECT_TRUE(s.samples);
  EXPECT_EQ(s.num_computed_tokens, 4);
  EXPECT_EQ(out.prompt_tokens, 0);
  std::vector<RequestUpdate> updates =
      scheduler.UpdateFromOutput(out, RunnerStep(out, /*accept=*/1));
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_THAT(updates[0].token_ids, ElementsAre(30, 7));
  // The last token and the accepted draft are computed; 7 is not yet.
  EXPECT_EQ(scheduler.request(1)->num_computed_tokens, 6);
  EXPECT_EQ(scheduler.request(1)->token_ids.size(), 7u);
  EXPECT_THAT(scheduler.request(1)->draft_token_ids, IsEmpty());
  // All accepted: k + 1 tokens.
  scheduler.SetDrafts(1, {40, 41});
  out = scheduler.Schedule();
  updates = scheduler.UpdateFromOutput(out, RunnerStep(out, /*accept=*/2));
  EXPECT_THAT(updates[0].token_ids, ElementsAre(40, 41, 7));
  EXPECT_EQ(scheduler.request(1)->num_computed_tokens, 9);
}

TEST(SchedulerTest, DraftsAreCutToMaxNewTokensThePositionLimitAndTheBudget) {
  KvCacheManager kv(64, 4, false);
  SchedulerOptions options;
  options.position_limit = 12;
  options.max_num_batched_tokens = 4;
  Scheduler scheduler(options, &kv);
  scheduler.Add(1, Request(Range(1, 3), 5));
  SchedulerOutput out = scheduler.Schedule();
  scheduler.UpdateFromOutput(out, RunnerStep(out));  // 1 of 5 generated
  // The budget: 4 tokens, one the decoding token: 3 drafts.
  scheduler.SetDrafts(1, {1, 2, 3, 4, 5, 6});
  out = scheduler.Schedule();
  EXPECT_EQ(out.scheduled[0].draft_token_ids.size(), 3u);
  scheduler.UpdateFromOutput(out, RunnerStep(out, 0));  // 2 of 5
  // max_new_tokens: 3 left, so 2 drafts at most (2 + 1 tokens).
  scheduler.SetDrafts(1, {1, 2, 3, 4, 5, 6});
  out = scheduler.Schedule();
  EXPECT_EQ(out.scheduled[0].draft_token_ids.size(), 2u);
  std::vector<RequestUpdate> updates = scheduler.UpdateFromOutput(out, RunnerStep(out, 2));
  EXPECT_EQ(updates[0].token_ids.size(), 3u);
  EXPECT_EQ(updates[0].finish, FinishReason::kLength);

  // The position limit: 12 positions; a request at 10 tokens (9 computed)
  // verifies at most 2 drafts (positions 9, 10, 11).
  scheduler.Add(2, Request(Range(1, 9), 50));
  out = scheduler.Schedule();  // 4 of 9 (the budget)
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  out = scheduler.Schedule();
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  out = scheduler.Schedule();
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  ASSERT_EQ(scheduler.request(2)->token_ids.size(), 10u);
  scheduler.SetDrafts(2, {1, 2, 3});
  out = scheduler.Schedule();
  EXPECT_EQ(out.scheduled[0].draft_token_ids.size(), 2u);
  updates = scheduler.UpdateFromOutput(out, RunnerStep(out, 2));
  EXPECT_EQ(updates[0].token_ids.size(), 2u);  // the 12th position ends it
  EXPECT_EQ(updates[0].finish, FinishReason::kLength);
}

TEST(SchedulerTest, DraftsAreDroppedBeforeAnyoneIsPreemptedForTheirBlocks) {
  KvCacheManager kv(3, 4, false);
  Scheduler scheduler({}, &kv);
  scheduler.Add(1, Request(Range(1, 3), 20));
  scheduler.Add(2, Request(Range(10, 7), 20));
  SchedulerOutput out = scheduler.Schedule();  // 1 block + 2 blocks: all three
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  // Request 1 at 4 tokens (3 computed) with 4 drafts would need a second
  // block; none is free, so it decodes its one token instead.
  scheduler.SetDrafts(1, {5, 6, 7, 8});
  out = scheduler.Schedule();
  EXPECT_THAT(out.preempted, IsEmpty());
  ASSERT_NE(Find(out, 1), nullptr);
  EXPECT_EQ(Find(out, 1)->num_tokens, 1);
  EXPECT_THAT(Find(out, 1)->draft_token_ids, IsEmpty());
  EXPECT_NE(Find(out, 2), nullptr);
}

TEST(SchedulerTest, AStopTokenAmongAcceptedDraftsEndsTheRequestThere) {
  KvCacheManager kv(16, 4, false);
  Scheduler scheduler({}, &kv);
  scheduler.Add(1, Request(Range(1, 4), 20, /*stops=*/{2}));
  SchedulerOutput out = scheduler.Schedule();
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  scheduler.SetDrafts(1, {9, 2, 9});
  out = scheduler.Schedule();
  std::vector<RequestUpdate> updates = scheduler.UpdateFromOutput(out, RunnerStep(out, 3));
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_THAT(updates[0].token_ids, ElementsAre(9, 2));
  EXPECT_EQ(updates[0].finish, FinishReason::kEos);
  EXPECT_EQ(scheduler.num_requests(), 0u);
  EXPECT_EQ(kv.used_blocks(), 0);
}

TEST(SchedulerTest, DraftsAreOnlyForDecodingRequests) {
  KvCacheManager kv(16, 4, false);
  SchedulerOptions options;
  options.max_num_batched_tokens = 2;
  Scheduler scheduler(options, &kv);
  scheduler.Add(1, Request(Range(1, 6), 20));
  scheduler.SetDrafts(1, {1, 2});  // waiting: ignored
  SchedulerOutput out = scheduler.Schedule();
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  scheduler.SetDrafts(1, {1, 2});  // still reading its prompt: ignored
  EXPECT_THAT(scheduler.request(1)->draft_token_ids, IsEmpty());
  scheduler.SetDrafts(99, {1});  // unknown: nothing
}

// The draft model's lookahead is reserved when blocks allow, and dropped
// (not preempted for) when they do not.
TEST(SchedulerTest, TheDraftModelsLookaheadIsReservedWhenThereIsRoom) {
  KvCacheManager kv(5, 4, false);
  SchedulerOptions options;
  options.lookahead_tokens = 4;
  Scheduler scheduler(options, &kv);
  scheduler.Add(1, Request(Range(1, 4), 20));
  SchedulerOutput out = scheduler.Schedule();
  // 4 prompt tokens + 4 ahead: 2 blocks.
  EXPECT_EQ(out.scheduled[0].block_table.size(), 2u);
  scheduler.UpdateFromOutput(out, RunnerStep(out));
  scheduler.Add(2, Request(Range(10, 8), 20));
  // 1 takes a third block for its lookahead; 2 needs 2 blocks and 4 ahead:
  // only 2 are left.
  out = scheduler.Schedule();
  EXPECT_THAT(out.preempted, IsEmpty());
  ASSERT_NE(Find(out, 2), nullptr);
  EXPECT_EQ(Find(out, 2)->block_table.size(), 2u);
}

// Random arrivals, drafts, acceptances, stops and finishes under a small
// pool with chunking and prefix caching: every request finishes (or is
// finished), num_computed_tokens never passes the tokens, and at the end
// every block is free.
// Steps in flight (pipeline parallel): a step may be capped at some
// requests, so the requests split into batches; a request in a step not yet
// taken back is skipped by the next Schedule and never preempted (when
// blocks run out, the newest request NOT in flight goes, here the asker
// itself), and its state does not move until its step comes back.
TEST(SchedulerTest, RequestsInAStepInFlightAreSkippedAndNeverPreempted) {
  KvCacheManager kv(4, 4, false);
  Scheduler scheduler({}, &kv);
  scheduler.Add(1, Request(Range(1, 7), 20));
  scheduler.Add(2, Request(Range(50, 4), 20));
  const SchedulerOutput first = scheduler.Schedule(/*max_requests=*/1);
  ASSERT_EQ(first.scheduled.size(), 1u);
  EXPECT_EQ(first.scheduled[0].id, 1u);
  scheduler.MarkInFlight(first);
  EXPECT_TRUE(scheduler.in_flight(1));
  const SchedulerOutput second = scheduler.Schedule();  // 1 is in flight: 2 alone
  ASSERT_EQ(second.scheduled.size(), 1u);
  EXPECT_EQ(second.scheduled[0].id, 2u);
  scheduler.MarkInFlight(second);
  EXPECT_EQ(kv.used_blocks(), 3);
  const SchedulerOutput none = scheduler.Schedule();  // both in flight
  EXPECT_THAT(none.scheduled, IsEmpty());
  EXPECT_THAT(none.preempted, IsEmpty());
  scheduler.UpdateFromOutput(first, RunnerStep(first));
  EXPECT_FALSE(scheduler.in_flight(1));
  EXPECT_TRUE(scheduler.in_flight(2));
  // Request 1 decodes alone (2 stays in flight) until it needs a fourth
  // block and none is free: 2, the newest, is in flight, so 1 goes.
  SchedulerOutput out;
  for (int step = 0; step < 10; ++step) {
    out = scheduler.Schedule();
    if (!out.preempted.empty()) break;
    ASSERT_EQ(out.scheduled.size(), 1u);
    EXPECT_EQ(out.scheduled[0].id, 1u);
    scheduler.MarkInFlight(out);
    scheduler.UpdateFromOutput(out, RunnerStep(out));
  }
  EXPECT_THAT(out.preempted, ElementsAre(1u));
  EXPECT_THAT(out.scheduled, IsEmpty());
  EXPECT_TRUE(scheduler.request(2)->running);
  EXPECT_EQ(scheduler.request(2)->num_computed_tokens, 0);  // its step is not back
  EXPECT_EQ(scheduler.request(1)->token_ids.size(), 13u);   // 7 + 6 generated, kept
  // 2's step comes back: it decodes on; 1 waits for blocks.
  scheduler.UpdateFromOutput(second, RunnerStep(second));
  EXPECT_EQ(scheduler.request(2)->num_computed_tokens, 4);
  EXPECT_THAT(scheduler.request(2)->token_ids, ElementsAre(50, 51, 52, 53, 7));
  out = scheduler.Schedule();
  ASSERT_NE(Find(out, 2), nullptr);
  // Abandoned steps (an error): their requests can be scheduled again.
  scheduler.MarkInFlight(out);
  scheduler.ClearInFlight();
  EXPECT_FALSE(scheduler.in_flight(2));
}

// The cap splits the requests into batches of about 1 / M each.
TEST(SchedulerTest, AStepCappedAtSomeRequestsLeavesTheRestForTheNext) {
  KvCacheManager kv(16, 4, false);
  Scheduler scheduler({}, &kv);
  for (uint64_t id = 1; id <= 4; ++id) scheduler.Add(id, Request(Range(10 * id, 3), 5));
  const SchedulerOutput a = scheduler.Schedule(2);
  scheduler.MarkInFlight(a);
  const SchedulerOutput b = scheduler.Schedule(2);
  scheduler.MarkInFlight(b);
  std::set<uint64_t> ids_a, ids_b;
  for (const ScheduledRequest& s : a.scheduled) ids_a.insert(s.id);
  for (const ScheduledRequest& s : b.scheduled) ids_b.insert(s.id);
  EXPECT_THAT(ids_a, ElementsAre(1u, 2u));
  EXPECT_THAT(ids_b, ElementsAre(3u, 4u));
  scheduler.UpdateFromOutput(a, RunnerStep(a));
  const SchedulerOutput c = scheduler.Schedule(2);  // 3 and 4 are in flight
  ASSERT_EQ(c.scheduled.size(), 2u);
  EXPECT_EQ(c.scheduled[0].id, 1u);
  EXPECT_EQ(c.scheduled[1].id, 2u);
  EXPECT_EQ(c.scheduled[0].num_tokens, 1);  // decoding
}

TEST(SchedulerTest, ARandomizedRunFinishesEverythingAndLeavesEveryBlockFree) {
  std::mt19937 rng(5);
  KvCacheManager kv(12, 4, true);  // 48 tokens; a request takes at most 40
  SchedulerOptions options;
  options.max_num_batched_tokens = 10;
  options.position_limit = 64;
  Scheduler scheduler(options, &kv);
  uint64_t next = 1;
  std::set<uint64_t> live;
  for (int round = 0; round < 400 || !live.empty(); ++round) {
    ASSERT_LT(round, 20000) << "requests never finish";
    if (round < 400 && rng() % 2 == 0) {
      std::vector<int64_t> prompt = rng() % 2 == 0 ? Range(1, 8) : std::vector<int64_t>();
      const int64_t extra = 1 + static_cast<int64_t>(rng() % 12);
      for (int64_t i = 0; i < extra; ++i) prompt.push_back(static_cast<int64_t>(rng() % 20));
      scheduler.Add(next, Request(prompt, 1 + static_cast<int64_t>(rng() % 20), {19}));
      live.insert(next++);
    }
    if (!live.empty() && rng() % 17 == 0) {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      EXPECT_TRUE(scheduler.Finish(*it));
      live.erase(it);
    }
    for (uint64_t id : live) {
      if (rng() % 2 == 0) {
        std::vector<int64_t> drafts;
        for (uint32_t i = 0; i < rng() % 5; ++i) drafts.push_back(static_cast<int64_t>(rng() % 20));
        scheduler.SetDrafts(id, drafts);
      }
    }
    SchedulerOutput out = scheduler.Schedule();
    for (const ScheduledRequest& s : out.scheduled) {
      ASSERT_LE(
          s.num_computed_tokens + s.num_tokens - static_cast<int64_t>(s.draft_token_ids.size()),
          static_cast<int64_t>(s.token_ids.size()));
      ASSERT_GE(static_cast<int64_t>(s.block_table.size()) * 4,
                s.num_computed_tokens + s.num_tokens);
    }
    std::vector<SampledTokens> sampled;
    for (const ScheduledRequest& s : out.scheduled) {
      if (!s.samples) continue;
      SampledTokens t;
      t.id = s.id;
      t.num_drafts = static_cast<int64_t>(s.draft_token_ids.size());
      t.num_accepted_drafts = static_cast<int64_t>(rng() % (s.draft_token_ids.size() + 1));
      t.token_ids.assign(s.draft_token_ids.begin(),
                         s.draft_token_ids.begin() + t.num_accepted_drafts);
      t.token_ids.push_back(static_cast<int64_t>(rng() % 20));
      sampled.push_back(t);
    }
    for (const RequestUpdate& u : scheduler.UpdateFromOutput(out, sampled)) {
      if (u.finish) live.erase(u.id);
    }
    int64_t held = 0;
    for (uint64_t id : live) {
      const SchedulerRequest* r = scheduler.request(id);
      ASSERT_NE(r, nullptr);
      ASSERT_LE(r->num_computed_tokens, static_cast<int64_t>(r->token_ids.size()));
      held += r->running ? 1 : 0;
    }
    ASSERT_EQ(held, scheduler.num_running());
  }
  EXPECT_EQ(scheduler.num_requests(), 0u);
  EXPECT_EQ(kv.used_blocks(), 0);
  EXPECT_GT(scheduler.preemptions(), 0);
  EXPECT_GT(kv.pool().prefix_hit_tokens(), 0);
}

}  // namespace
}  // namespace accel::engine
