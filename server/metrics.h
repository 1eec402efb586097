// server/metrics.h: a small Prometheus metrics registry (counters, gauges, histograms, with or
// without labels) and its text exposition format 0.0.4. Torch-free and gRPC-free; prometheus-cpp
// is not packaged in Debian, and we need only this much of it.
//
//   MetricsRegistry registry;  // at startup, before any thread uses it
//   CounterFamily& done = registry.AddCounterFamily(
//       "accel_request_success_total", "Requests that finished.", {"model", "finish_reason"});
//   Histogram& ttft = registry.AddHistogram("accel_time_to_first_token_seconds",
//                                           "Time to first token.", ExponentialBuckets(0.01, 2,
//                                           12));
//   ...
//   done.WithLabels({"llama", "stop"}).Increment();  // from any thread
//   ttft.Observe(0.25);
//   std::string text = registry.Render();  // what GET /metrics serves
//
// Misuse (a bad or duplicate name, bad buckets, the wrong number of label values, a negative
// counter increment) is a programming error: it prints what went wrong (and the metric's name where
// it is known) to stderr and aborts, as a failed CHECK would.
#ifndef ACCEL_SERVER_METRICS_H_
#define ACCEL_SERVER_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace accel::server {

// Label values in the order of the family's label names.
using LabelValues = std::vector<std::string>;

// A value that only goes up. Thread-safe; Increment is a lock-free compare-and-swap.
class Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // `by` must be >= 0 (aborts otherwise: a counter that goes down breaks rate()).
  void Increment(double by = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down. Thread-safe and lock-free.
class Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double by);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted in buckets with inclusive upper bounds (Prometheus' `le`), plus their sum.
// Thread-safe. A small mutex rather than per-bucket atomics, so that a reader sees the buckets,
// the count and the sum of one and the same set of observations.
class Histogram {
 public:
  // One consistent reading. cumulative_counts[i] is the number of observations <= bounds()[i];
  // the last entry, for +Inf, is the total count.
  struct Snapshot {
    std::vector<uint64_t> cumulative_counts;
    double sum = 0.0;
  };

  // `bounds` must be finite and strictly increasing (aborts otherwise); a trailing +Inf is
  // dropped, since the +Inf bucket is always there.
  explicit Histogram(std::vector<double> bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // NaN goes to the +Inf bucket only (as the Go client does) and makes the sum NaN.
  void Observe(double v) ABSL_LOCKS_EXCLUDED(mu_);

  Snapshot snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::vector<double>& bounds() const { return bounds_; }
  uint64_t count() const { return snapshot().cumulative_counts.back(); }
  double sum() const { return snapshot().sum; }
  // Cumulative, one per bound and then +Inf: what Render prints as _bucket.
  std::vector<uint64_t> bucket_counts() const { return snapshot().cumulative_counts; }

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  // Per bucket, not cumulative (bounds_.size() + 1 entries, the last for +Inf).
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);
  double sum_ ABSL_GUARDED_BY(mu_) = 0.0;
};

// Bucket bounds: start, start*factor, ... (count of them; start > 0, factor > 1, count >= 1).
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// Bucket bounds: start, start+width, ... (count of them; width > 0, count >= 1).
std::vector<double> LinearBuckets(double start, double width, int count);

namespace metrics_internal {

// What the registry needs of every family.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  // Appends # HELP, # TYPE and one line per sample; nothing for a family with no children yet.
  virtual void Render(std::string* out) const = 0;
};

// A metric name, its label names, and one child metric per distinct set of label values.
// Thread-safe. Children live as long as the family; WithLabels on an existing child takes only a
// reader lock, so the hot path does not serialize threads.
template <typename Metric>
class Family : public FamilyBase {
 public:
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> buckets);
  Family(const Family&) = delete;
  Family& operator=(const Family&) = delete;

  // Aborts, naming the family, when values.size() differs from the number of label names.
  Metric& WithLabels(const LabelValues& values) ABSL_LOCKS_EXCLUDED(mu_);
  void Render(std::string* out) const override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
  const std::vector<double> buckets_;  // histograms only
  mutable absl::Mutex mu_;
  // A std::map so that Render lists children sorted by label values.
  std::map<LabelValues, std::unique_ptr<Metric>> children_ ABSL_GUARDED_BY(mu_);
};

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

}  // namespace metrics_internal

class CounterFamily final : public metrics_internal::Family<Counter> {
 public:
  using Family::Family;
};
class GaugeFamily final : public metrics_internal::Family<Gauge> {
 public:
  using Family::Family;
};
class HistogramFamily final : public metrics_internal::Family<Histogram> {
 public:
  using Family::Family;
};

// The set of metrics one process exports. Thread-safe: families may be added and rendered from
// any thread, though the server adds them all at startup. Every reference returned stays valid
// for the registry's life. Metric names follow Prometheus ([a-zA-Z_:][a-zA-Z0-9_:]*), label names
// too ([a-zA-Z_][a-zA-Z0-9_]*, not starting with "__", not repeated, and not "le" on a
// histogram); a name already taken, including a histogram's _bucket/_sum/_count, aborts.
class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  Counter& AddCounter(std::string name, std::string help) ABSL_LOCKS_EXCLUDED(mu_);
  Gauge& AddGauge(std::string name, std::string help) ABSL_LOCKS_EXCLUDED(mu_);
  Histogram& AddHistogram(std::string name, std::string help, std::vector<double> buckets)
      ABSL_LOCKS_EXCLUDED(mu_);
  CounterFamily& AddCounterFamily(std::string name, std::string help,
                                  std::vector<std::string> label_names) ABSL_LOCKS_EXCLUDED(mu_);
  GaugeFamily& AddGaugeFamily(std::string name, std::string help,
                              std::vector<std::string> label_names) ABSL_LOCKS_EXCLUDED(mu_);
  HistogramFamily& AddHistogramFamily(std::string name, std::string help,
                                      std::vector<std::string> label_names,
                                      std::vector<double> buckets) ABSL_LOCKS_EXCLUDED(mu_);

  // `hook` runs at the start of every Render, to refresh gauges from a snapshot (KV-cache bytes).
  // Hooks run in the order added, one Render at a time, with no registry lock held, so a hook may
  // update any metric.
  void AddCollectHook(std::function<void()> hook) ABSL_LOCKS_EXCLUDED(mu_);

  // The text exposition format 0.0.4: families in registration order, each with # HELP and
  // # TYPE, children sorted by label values; histograms as cumulative _bucket{le="..."} lines
  // ending with le="+Inf", then _sum and _count. Numbers parse back to the same double.
  std::string Render() const ABSL_LOCKS_EXCLUDED(render_mu_, mu_);

 private:
  // Checks the names (aborting on misuse) and takes them.
  void Reserve(const std::string& name, const std::vector<std::string>& label_names, bool histogram)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  template <typename F>
  F& Add(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> buckets) ABSL_LOCKS_EXCLUDED(mu_);

  // Held through a whole Render so that collect hooks never run concurrently.
  mutable absl::Mutex render_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<metrics_internal::FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> names_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_METRICS_H_
