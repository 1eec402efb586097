// The engine's reports as Prometheus metrics (MetricsStatLogger): gauges,
// counters that grow by the engine's deltas, speculative decoding under
// vLLM's names with acceptance per draft position, requests by finish and
// failure reason, and histograms observed once per event.
#include "server/server_metrics.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/metrics.h"

namespace accel::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(MetricsStatLoggerTest, TheEnginesReportsBecomeTheMetrics) {
  MetricsRegistry registry;
  ServerMetrics metrics(&registry);
  MetricsStatLogger logger(&metrics);

  engine::SchedulerStats gauges;
  gauges.running = 3;
  gauges.waiting = 2;
  gauges.kv_cache_bytes = 4096;
  gauges.kv_blocks_total = 8;
  gauges.kv_blocks_used = 2;
  logger.RecordScheduler(gauges);

  engine::EngineStats delta;
  delta.preemptions = 1;
  delta.prompt_tokens = 40;
  delta.prefix_query_tokens = 32;
  delta.prefix_hit_tokens = 16;
  delta.spec_num_drafts = 5;
  delta.spec_num_draft_tokens = 15;
  delta.spec_num_accepted_tokens = 9;
  delta.spec_accepted_per_position = {5, 3, 1};
  logger.RecordCounters(delta);
  delta.spec_accepted_per_position = {1, 0, 0};
  logger.RecordCounters(delta);

  engine::IterationStats step;
  step.batch_size = 3;
  step.scheduled_tokens = 12;
  step.generated_tokens = 7;
  step.seconds = 0.02;
  step.time_to_first_token = {0.5};
  step.inter_token_latency = {0.01, 0.02};
  logger.RecordIteration(step);
  logger.RecordScheduled(0.25, 10);
  engine::FinishedRequestStats finished;
  finished.finish = "eos";
  finished.scheduled = true;
  finished.e2e_seconds = 1.5;
  finished.generated_tokens = 7;
  logger.RecordFinished(finished);
  engine::FinishedRequestStats queued;
  queued.finish = "cancelled";
  logger.RecordFinished(queued);
  logger.RecordFailed("timeout");

  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("accel_num_requests_running 3\n"));
  EXPECT_THAT(text, HasSubstr("accel_num_requests_waiting 2\n"));
  EXPECT_THAT(text, HasSubstr("accel_kv_cache_usage_ratio 0.25\n"));
  EXPECT_THAT(text, HasSubstr("accel_kv_cache_blocks 8\n"));
  EXPECT_THAT(text, HasSubstr("accel_num_preemptions_total 2\n"));
  EXPECT_THAT(text, HasSubstr("accel_prompt_tokens_total 80\n"));
  EXPECT_THAT(text, HasSubstr("accel_prefix_cache_hits_total 32\n"));
  EXPECT_THAT(text, HasSubstr("accel_spec_decode_num_drafts_total 10\n"));
  EXPECT_THAT(text, HasSubstr("accel_spec_decode_num_draft_tokens_total 30\n"));
  EXPECT_THAT(text, HasSubstr("accel_spec_decode_num_accepted_tokens_total 18\n"));
  EXPECT_THAT(text,
              HasSubstr("accel_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 6\n"));
  EXPECT_THAT(text,
              HasSubstr("accel_spec_decode_num_accepted_tokens_per_pos_total{position=\"2\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("accel_generation_tokens_total 7\n"));
  EXPECT_THAT(text, HasSubstr("accel_batch_size 3\n"));
  EXPECT_THAT(text, HasSubstr("accel_inter_token_latency_seconds_count 2\n"));
  EXPECT_THAT(text, HasSubstr("accel_time_to_first_token_seconds_count 1\n"));
  EXPECT_THAT(text, HasSubstr("accel_request_queue_time_seconds_count 1\n"));
  EXPECT_THAT(text, HasSubstr("accel_request_success_total{finished_reason=\"eos\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("accel_request_success_total{finished_reason=\"cancelled\"} 1\n"));
  // The request cancelled while queued has no latency to count.
  EXPECT_THAT(text, HasSubstr("accel_e2e_request_latency_seconds_count 1\n"));
  EXPECT_THAT(text, HasSubstr("accel_request_failure_total{reason=\"timeout\"} 1\n"));
  EXPECT_THAT(text, Not(HasSubstr("position=\"3\"")));
}

}  // namespace
}  // namespace accel::server
