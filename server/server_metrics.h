// server/server_metrics.h: the metrics accel-serve exports, registered once
// on a MetricsRegistry. Names follow vLLM's where one fits, with the prefix
// accel_, base units in the name and _total on counters (docs/API.md lists
// them all).
#ifndef ACCEL_SERVER_SERVER_METRICS_H_
#define ACCEL_SERVER_SERVER_METRICS_H_

#include "absl/strings/string_view.h"

#include "engine/stat_logger.h"
#include "server/metrics.h"

namespace accel::server {

class ServerMetrics {
 public:
  explicit ServerMetrics(MetricsRegistry* registry);

  // A request that ended in an error, by reason: invalid, not_found,
  // unauthenticated, overloaded, unavailable, cancelled, timeout, internal.
  void RequestFailed(absl::string_view reason);

  CounterFamily& request_success;  // {finished_reason}
  CounterFamily& request_failure;  // {reason}
  Histogram& e2e_latency;
  Histogram& queue_time;
  Histogram& time_to_first_token;
  Histogram& inter_token_latency;
  Counter& prompt_tokens;
  Counter& generation_tokens;
  Histogram& request_prompt_tokens;
  Histogram& request_generation_tokens;
  Gauge& requests_running;
  Gauge& requests_waiting;
  Gauge& batch_size;
  Histogram& iteration_tokens;
  Histogram& step_duration;
  Gauge& kv_cache_bytes;
  Gauge& kv_cache_usage;
  Gauge& kv_cache_blocks;
  Counter& preemptions;
  Counter& overlapped_steps;
  Counter& prefix_cache_queries;
  Counter& prefix_cache_hits;
  // Speculative decoding, as vLLM names it.
  Counter& spec_decode_num_drafts;
  Counter& spec_decode_num_draft_tokens;
  Counter& spec_decode_num_accepted_tokens;
  CounterFamily& spec_decode_num_accepted_tokens_per_pos;  // {position}
  GaugeFamily& weight_bytes;                               // {device}
  Counter& offload_fetches;
  Counter& offload_prefetch_hits;
  Counter& offload_disk_read_bytes;
  Counter& offload_disk_mapped_bytes;
  Counter& offload_disk_dropped_bytes;
  Counter& offload_device_copy_bytes;
  Counter& offload_expert_fetches;
  Counter& offload_expert_cache_hits;
  Counter& offload_expert_prefetch_hits;
  Gauge& offload_read_bytes_per_token;
  Gauge& model_load_seconds;
  Gauge& ready;
  Gauge& draining;
  GaugeFamily& build_info;   // {version}
  GaugeFamily& listener_up;  // {listener}: grpc, http
};

// The engine's reports (engine/stat_logger.h) as these metrics.
class MetricsStatLogger : public engine::StatLogger {
 public:
  explicit MetricsStatLogger(ServerMetrics* metrics) : m_(*metrics) {}
  void RecordScheduler(const engine::SchedulerStats& stats) override;
  void RecordCounters(const engine::EngineStats& delta) override;
  void RecordIteration(const engine::IterationStats& stats) override;
  void RecordScheduled(double queue_seconds, int64_t prompt_tokens) override;
  void RecordFinished(const engine::FinishedRequestStats& stats) override;
  void RecordFailed(absl::string_view reason) override;

 private:
  ServerMetrics& m_;
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_SERVER_METRICS_H_
