// server/metrics.h: accel-serve's metrics on prometheus-cpp (Debian's
// prometheus-cpp-dev 1.0.1, core): counters, gauges and histograms, with or
// without labels, kept in a prometheus::Registry and written in the text
// exposition format 0.0.4 by prometheus-cpp's TextSerializer. Torch-free and
// gRPC-free; no prometheus-cpp header here.
//
// The thin layer over prometheus-cpp is ours for three reasons: label values
// by position (WithLabels({"llama", "stop"})) rather than a map built on
// every update; collect hooks that refresh gauges from snapshots at scrape
// time (a prometheus::Collectable, so the pull Exposer of the metrics port
// runs them too); and misuse (a bad or duplicate name, a histogram's _sum
// clashing with another metric, bad buckets, a negative counter increment,
// the wrong number of label values) that stops the program with a message
// naming the metric, where prometheus-cpp throws or ignores it.
//
//   MetricsRegistry registry;  // at startup, before any thread uses it
//   CounterFamily& done = registry.AddCounterFamily(
//       "accel_request_success_total", "Requests that finished.", {"model", "finish_reason"});
//   Histogram& ttft = registry.AddHistogram("accel_time_to_first_token_seconds",
//                                           "Time to first token.",
//                                           ExponentialBuckets(0.01, 2, 12));
//   ...
//   done.WithLabels({"llama", "stop"}).Increment();  // from any thread
//   ttft.Observe(0.25);
//   std::string text = registry.Render();  // what GET /metrics serves
#ifndef ACCEL_SERVER_METRICS_H_
#define ACCEL_SERVER_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace prometheus {
class Collectable;
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace accel::server {

// Label values in the order of the family's label names.
using LabelValues = std::vector<std::string>;

// A value that only goes up. Thread-safe and lock-free.
class Counter {
 public:
  explicit Counter(prometheus::Counter& counter) : counter_(counter) {}
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // `by` must be >= 0 (stops the program otherwise: a counter that goes down
  // breaks rate(); prometheus-cpp would ignore it silently).
  void Increment(double by = 1.0);
  double value() const;

 private:
  prometheus::Counter& counter_;
};

// A value that goes up and down. Thread-safe and lock-free.
class Gauge {
 public:
  explicit Gauge(prometheus::Gauge& gauge) : gauge_(gauge) {}
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double v);
  void Add(double by);
  double value() const;

 private:
  prometheus::Gauge& gauge_;
};

// Observations counted in buckets with inclusive upper bounds (Prometheus'
// `le`), plus their sum. Thread-safe: prometheus-cpp's histogram takes a
// small lock, so a reader sees the buckets, the count and the sum of one and
// the same set of observations.
class Histogram {
 public:
  // One consistent reading. cumulative_counts[i] is the number of
  // observations <= bounds()[i]; the last entry, for +Inf, is the total.
  struct Snapshot {
    std::vector<uint64_t> cumulative_counts;
    double sum = 0.0;
  };

  Histogram(prometheus::Histogram& histogram, const std::vector<double>& bounds)
      : histogram_(histogram), bounds_(bounds) {}
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // NaN is counted in the +Inf bucket only and makes the sum NaN (as the Go
  // client does; prometheus-cpp alone would put it in the first bucket).
  void Observe(double v);

  Snapshot snapshot() const;
  const std::vector<double>& bounds() const { return bounds_; }
  uint64_t count() const { return snapshot().cumulative_counts.back(); }
  double sum() const { return snapshot().sum; }
  // Cumulative, one per bound and then +Inf: the _bucket lines.
  std::vector<uint64_t> bucket_counts() const { return snapshot().cumulative_counts; }

 private:
  prometheus::Histogram& histogram_;
  const std::vector<double>& bounds_;  // the family's, finite, increasing
};

// Bucket bounds: start, start*factor, ... (count of them; start > 0, factor > 1, count >= 1).
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// Bucket bounds: start, start+width, ... (count of them; width > 0, count >= 1).
std::vector<double> LinearBuckets(double start, double width, int count);

namespace metrics_internal {

template <typename Metric>
struct PrometheusOf;
template <>
struct PrometheusOf<Counter> {
  using type = prometheus::Counter;
};
template <>
struct PrometheusOf<Gauge> {
  using type = prometheus::Gauge;
};
template <>
struct PrometheusOf<Histogram> {
  using type = prometheus::Histogram;
};

// A metric name, its label names, and one child per distinct set of label
// values: prometheus-cpp's family, with our wrappers by value list.
// Thread-safe; children live as long as the registry. WithLabels on an
// existing child takes only a reader lock.
template <typename Metric>
class Family {
 public:
  using PrometheusFamily = prometheus::Family<typename PrometheusOf<Metric>::type>;

  // `family` (the registry's) outlives this.
  Family(std::string name, std::vector<std::string> label_names, std::vector<double> buckets,
         PrometheusFamily& family);
  Family(const Family&) = delete;
  Family& operator=(const Family&) = delete;

  // Stops the program, naming the family, when values.size() differs from
  // the number of label names.
  Metric& WithLabels(const LabelValues& values) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::string name_;
  const std::vector<std::string> label_names_;
  const std::vector<double> buckets_;  // histograms only
  PrometheusFamily& family_;
  mutable absl::Mutex mu_;
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

// The metrics of one process. Thread-safe: families may be added and
// rendered from any thread, though the server adds them all at startup.
// Every reference returned stays valid for the registry's life. Names follow
// Prometheus ([a-zA-Z_:][a-zA-Z0-9_:]*), label names too
// ([a-zA-Z_][a-zA-Z0-9_]*, not starting with "__", not repeated, and not "le"
// on a histogram); a name already taken, including a histogram's
// _bucket/_sum/_count, stops the program.
class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
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

  // `hook` runs at the start of every collection (Render, or a scrape of the
  // pull endpoint), to refresh metrics from a snapshot (the offload
  // counters). Hooks run in the order added, one collection at a time.
  void AddCollectHook(std::function<void()> hook) ABSL_LOCKS_EXCLUDED(mu_);

  // The text exposition format 0.0.4, written by prometheus-cpp's
  // TextSerializer: each family with # HELP and # TYPE (a family with no
  // child yet is left out), children sorted by label values, histograms as
  // cumulative _bucket{le="..."} lines ending with le="+Inf", then _sum and
  // _count.
  std::string Render() const;

  // What prometheus::Exposer (the pull endpoint) scrapes: the registry, its
  // collect hooks run first. Lives as long as the registry.
  std::shared_ptr<prometheus::Collectable> collectable() const;

 private:
  class Hooked;  // the Collectable: hooks, then the prometheus registry
  void Reserve(const std::string& name, const std::vector<std::string>& label_names, bool histogram)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  const std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<Hooked> hooked_;
  std::vector<std::unique_ptr<CounterFamily>> counters_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<GaugeFamily>> gauges_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<HistogramFamily>> histograms_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> names_ ABSL_GUARDED_BY(mu_);
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_METRICS_H_
