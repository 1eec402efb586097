#include "server/server_metrics.h"

#include <string>
#include <vector>

namespace accel::server {
namespace {

// vLLM's buckets, with finer ones below 0.3 s for small models on a cpu.
std::vector<double> LatencyBuckets() {
  return {0.005, 0.01, 0.025, 0.05, 0.1,  0.3,  0.5,  0.8,   1.0,   1.5,   2.0,   2.5,    5.0,
          10.0,  15.0, 20.0,  30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}
std::vector<double> TimeToFirstTokenBuckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}
std::vector<double> InterTokenBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,  0.3,
          0.4,   0.5,    0.75,  1.0,  2.5,   5.0,  7.5,   10.0, 20.0, 40.0, 80.0};
}
// 1, 2, 5, 10, ... 50000 tokens.
std::vector<double> TokenBuckets() {
  std::vector<double> buckets;
  double scale = 1;
  for (int decade = 0; decade < 5; ++decade, scale *= 10) {
    for (double m : {1.0, 2.0, 5.0}) buckets.push_back(m * scale);
  }
  return buckets;
}

}  // namespace

ServerMetrics::ServerMetrics(MetricsRegistry* r)
    : request_success(r->AddCounterFamily("accel_request_success_total",
                                          "Requests that finished, by finish reason.",
                                          {"finished_reason"})),
      request_failure(r->AddCounterFamily(
          "accel_request_failure_total",
          "Requests that ended in an error, by reason (invalid, not_found, unauthenticated, "
          "overloaded, unavailable, cancelled, timeout, internal).",
          {"reason"})),
      e2e_latency(r->AddHistogram("accel_e2e_request_latency_seconds",
                                  "Time from accepting a request to its last token.",
                                  LatencyBuckets())),
      queue_time(r->AddHistogram("accel_request_queue_time_seconds",
                                 "Time a request waited before joining the running batch.",
                                 LatencyBuckets())),
      time_to_first_token(r->AddHistogram("accel_time_to_first_token_seconds",
                                          "Time from accepting a request to its first token.",
                                          TimeToFirstTokenBuckets())),
      inter_token_latency(r->AddHistogram("accel_inter_token_latency_seconds",
                                          "Time between consecutive tokens of a request.",
                                          InterTokenBuckets())),
      prompt_tokens(r->AddCounter("accel_prompt_tokens_total", "Prompt tokens prefilled.")),
      generation_tokens(r->AddCounter("accel_generation_tokens_total", "Tokens generated.")),
      request_prompt_tokens(r->AddHistogram("accel_request_prompt_tokens",
                                            "Prompt tokens per request.", TokenBuckets())),
      request_generation_tokens(r->AddHistogram("accel_request_generation_tokens",
                                                "Generated tokens per request.", TokenBuckets())),
      requests_running(r->AddGauge("accel_num_requests_running", "Requests in the running batch.")),
      requests_waiting(
          r->AddGauge("accel_num_requests_waiting", "Requests queued, waiting to join the batch.")),
      batch_size(r->AddGauge("accel_batch_size", "Sequences in the last decode step.")),
      iteration_tokens(r->AddHistogram("accel_iteration_tokens",
                                       "Tokens run through the model per step.", TokenBuckets())),
      step_duration(r->AddHistogram("accel_step_duration_seconds",
                                    "Duration of one forward step over the batch.",
                                    InterTokenBuckets())),
      kv_cache_bytes(r->AddGauge(
          "accel_kv_cache_bytes",
          "Bytes of KV-cache storage allocated (the block store, made as layers first write).")),
      kv_cache_usage(r->AddGauge("accel_kv_cache_usage_ratio",
                                 "KV-cache blocks held by requests over all blocks "
                                 "(--kv_cache_memory), 0 to 1 (vLLM's kv_cache_usage_perc).")),
      kv_cache_blocks(r->AddGauge("accel_kv_cache_blocks",
                                  "KV-cache blocks in the store (--kv_cache_memory over the bytes "
                                  "of one block in every layer).")),
      preemptions(r->AddCounter("accel_num_preemptions_total",
                                "Running requests preempted for lack of KV blocks (their blocks "
                                "freed, their tokens recomputed when they resume).")),
      overlapped_steps(r->AddCounter(
          "accel_pipeline_overlapped_steps_total",
          "Pipeline parallel: steps submitted while an earlier step was still in flight "
          "(--pipeline_batches_in_flight above 1; vLLM's virtual engines).")),
      prefix_cache_queries(r->AddCounter(
          "accel_prefix_cache_queries_total",
          "Prompt tokens looked up in the prefix cache (whole blocks) when requests joined.")),
      prefix_cache_hits(r->AddCounter("accel_prefix_cache_hits_total",
                                      "Prompt tokens found in the prefix cache (not recomputed).")),
      spec_decode_num_drafts(r->AddCounter(
          "accel_spec_decode_num_drafts_total",
          "Speculative decoding: drafts verified (one request's drafts in one step).")),
      spec_decode_num_draft_tokens(r->AddCounter("accel_spec_decode_num_draft_tokens_total",
                                                 "Speculative decoding: drafted tokens verified.")),
      spec_decode_num_accepted_tokens(
          r->AddCounter("accel_spec_decode_num_accepted_tokens_total",
                        "Speculative decoding: drafted tokens the target model accepted.")),
      spec_decode_num_accepted_tokens_per_pos(r->AddCounterFamily(
          "accel_spec_decode_num_accepted_tokens_per_pos_total",
          "Speculative decoding: drafted tokens accepted at each draft position (0: the first "
          "draft of a step).",
          {"position"})),
      weight_bytes(r->AddGaugeFamily("accel_weight_bytes",
                                     "Model weight bytes placed on each device (0, 1, cpu, disk).",
                                     {"device"})),
      offload_fetches(r->AddCounter("accel_offload_fetches_total",
                                    "Offloaded modules brought to the execution device.")),
      offload_prefetch_hits(
          r->AddCounter("accel_offload_prefetch_hits_total",
                        "Offloaded modules whose weights the reader thread had ready.")),
      offload_disk_read_bytes(
          r->AddCounter("accel_offload_disk_read_bytes_total",
                        "Bytes of offloaded weights read from disk into buffers.")),
      offload_disk_mapped_bytes(r->AddCounter(
          "accel_offload_disk_mapped_bytes_total",
          "Bytes of disk-offloaded weights used in place from their file's mapping (the page "
          "cache brings them in, reading from disk what it lacks).")),
      offload_disk_dropped_bytes(r->AddCounter(
          "accel_offload_disk_dropped_bytes_total",
          "Bytes of mapped disk weights dropped from the process behind their module to keep "
          "within the cpu memory budget.")),
      offload_device_copy_bytes(
          r->AddCounter("accel_offload_device_copy_bytes_total",
                        "Bytes of offloaded weights copied to the GPU on the copy stream.")),
      offload_expert_fetches(r->AddCounter(
          "accel_offload_expert_fetches_total",
          "Experts of mixture-of-experts layers read into the expert cache (from disk, or from "
          "RAM for a GPU).")),
      offload_expert_cache_hits(
          r->AddCounter("accel_offload_expert_cache_hits_total",
                        "Uses of offloaded experts served by the expert cache without a read.")),
      offload_expert_prefetch_hits(
          r->AddCounter("accel_offload_expert_prefetch_hits_total",
                        "Expert cache hits on experts the reader thread had read ahead of use.")),
      offload_read_bytes_per_token(r->AddGauge(
          "accel_offload_read_bytes_per_token",
          "Bytes of disk-offloaded weights brought in (read into buffers, or mapped in place) per "
          "token processed (prompt and generated), since the start.")),
      model_load_seconds(r->AddGauge("accel_model_load_seconds",
                                     "Seconds the model took to load (0 until loaded).")),
      ready(
          r->AddGauge("accel_ready", "1 when the model is loaded and the server admits requests.")),
      draining(r->AddGauge("accel_draining", "1 while the server drains before exiting.")),
      build_info(
          r->AddGaugeFamily("accel_build_info", "The accel version (always 1).", {"version"})),
      listener_up(r->AddGaugeFamily(
          "accel_listener_up",
          "1 while the port answers the liveness watchdog (grpc, http); 0 once it failed three "
          "probes in a row, when health accel.live turns NOT_SERVING.",
          {"listener"})) {}

void ServerMetrics::RequestFailed(absl::string_view reason) {
  request_failure.WithLabels({std::string(reason)}).Increment();
}

void MetricsStatLogger::RecordScheduler(const engine::SchedulerStats& stats) {
  m_.requests_waiting.Set(static_cast<double>(stats.waiting));
  m_.requests_running.Set(static_cast<double>(stats.running));
  m_.kv_cache_bytes.Set(static_cast<double>(stats.kv_cache_bytes));
  m_.kv_cache_blocks.Set(static_cast<double>(stats.kv_blocks_total));
  if (stats.kv_blocks_total > 0) {
    m_.kv_cache_usage.Set(static_cast<double>(stats.kv_blocks_used) /
                          static_cast<double>(stats.kv_blocks_total));
  }
}

void MetricsStatLogger::RecordCounters(const engine::EngineStats& delta) {
  m_.preemptions.Increment(static_cast<double>(delta.preemptions));
  m_.overlapped_steps.Increment(static_cast<double>(delta.overlapped_steps));
  m_.prefix_cache_queries.Increment(static_cast<double>(delta.prefix_query_tokens));
  m_.prefix_cache_hits.Increment(static_cast<double>(delta.prefix_hit_tokens));
  m_.prompt_tokens.Increment(static_cast<double>(delta.prompt_tokens));
  m_.spec_decode_num_drafts.Increment(static_cast<double>(delta.spec_num_drafts));
  m_.spec_decode_num_draft_tokens.Increment(static_cast<double>(delta.spec_num_draft_tokens));
  m_.spec_decode_num_accepted_tokens.Increment(static_cast<double>(delta.spec_num_accepted_tokens));
  for (size_t i = 0; i < delta.spec_accepted_per_position.size(); ++i) {
    const int64_t accepted = delta.spec_accepted_per_position[i];
    if (accepted > 0) {
      m_.spec_decode_num_accepted_tokens_per_pos.WithLabels({std::to_string(i)})
          .Increment(static_cast<double>(accepted));
    }
  }
}

void MetricsStatLogger::RecordIteration(const engine::IterationStats& stats) {
  m_.batch_size.Set(static_cast<double>(stats.batch_size));
  m_.iteration_tokens.Observe(static_cast<double>(stats.scheduled_tokens));
  m_.step_duration.Observe(stats.seconds);
  m_.generation_tokens.Increment(static_cast<double>(stats.generated_tokens));
  for (double seconds : stats.time_to_first_token) m_.time_to_first_token.Observe(seconds);
  for (double seconds : stats.inter_token_latency) m_.inter_token_latency.Observe(seconds);
}

void MetricsStatLogger::RecordScheduled(double queue_seconds, int64_t prompt_tokens) {
  m_.queue_time.Observe(queue_seconds);
  m_.request_prompt_tokens.Observe(static_cast<double>(prompt_tokens));
}

void MetricsStatLogger::RecordFinished(const engine::FinishedRequestStats& stats) {
  m_.request_success.WithLabels({stats.finish}).Increment();
  if (!stats.scheduled) return;
  m_.e2e_latency.Observe(stats.e2e_seconds);
  m_.request_generation_tokens.Observe(static_cast<double>(stats.generated_tokens));
}

void MetricsStatLogger::RecordFailed(absl::string_view reason) { m_.RequestFailed(reason); }

}  // namespace accel::server
