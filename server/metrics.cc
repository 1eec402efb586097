#include "server/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <utility>

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace accel::server {
namespace {

// Misuse of the registry is a bug in our own code, met on the first run, and
// registration has no caller to hand a Status to: this is a failed CHECK,
// without glog (this library is torch-free).
[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "accel metrics: %s\n", message.c_str());
  std::abort();
}

bool IsMetricName(absl::string_view s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
              (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

// Label names are metric names without ':'; "__" is reserved for Prometheus' own labels.
bool IsLabelName(absl::string_view s) {
  return IsMetricName(s) && !absl::StrContains(s, ':') && !absl::StartsWith(s, "__");
}

// For messages only.
std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

std::string JoinValues(const std::vector<double>& values) {
  return absl::StrJoin(values, ", ",
                       [](std::string* out, double v) { out->append(FormatValue(v)); });
}

// Drops a trailing +Inf (that bucket is always there) and checks the rest.
std::vector<double> CheckedBounds(absl::string_view metric, std::vector<double> bounds) {
  if (!bounds.empty() && bounds.back() == std::numeric_limits<double>::infinity()) {
    bounds.pop_back();
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i - 1] < bounds[i]))) {
      Die(absl::StrCat(metric, ": histogram bounds must be finite and strictly increasing, got {",
                       JoinValues(bounds), "}"));
    }
  }
  return bounds;
}

// HELP text as the text format wants it: prometheus-cpp 1.0.1 writes it
// verbatim, so a newline in it would end the line early.
std::string EscapedHelp(absl::string_view help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// The label values of a collected sample, for sorting.
std::vector<std::string> ValuesOf(const prometheus::ClientMetric& metric) {
  std::vector<std::string> values;
  values.reserve(metric.label.size());
  for (const prometheus::ClientMetric::Label& label : metric.label) values.push_back(label.value);
  return values;
}

}  // namespace

void Counter::Increment(double by) {
  if (!(by >= 0)) {
    Die(absl::StrCat("Counter::Increment(", FormatValue(by), "): a counter never goes down"));
  }
  counter_.Increment(by);
}

double Counter::value() const { return counter_.Value(); }

void Gauge::Set(double v) { gauge_.Set(v); }
void Gauge::Add(double by) { gauge_.Increment(by); }
double Gauge::value() const { return gauge_.Value(); }

void Histogram::Observe(double v) {
  if (std::isnan(v)) {
    // prometheus-cpp finds a NaN's bucket by lower_bound, which puts it in the
    // first bucket; the Go client counts it under +Inf only.
    std::vector<double> increments(bounds_.size() + 1, 0.0);
    increments.back() = 1.0;
    histogram_.ObserveMultiple(increments, v);
    return;
  }
  histogram_.Observe(v);
}

Histogram::Snapshot Histogram::snapshot() const {
  const prometheus::ClientMetric collected = histogram_.Collect();
  Snapshot s;
  s.sum = collected.histogram.sample_sum;
  for (const prometheus::ClientMetric::Bucket& bucket : collected.histogram.bucket) {
    s.cumulative_counts.push_back(bucket.cumulative_count);
  }
  return s;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  if (!(start > 0) || !(factor > 1) || count < 1) {
    Die(absl::StrCat("ExponentialBuckets(", FormatValue(start), ", ", FormatValue(factor), ", ",
                     count, "): want start > 0, factor > 1, count >= 1"));
  }
  std::vector<double> bounds;
  bounds.reserve(count);
  for (int i = 0; i < count; ++i, start *= factor) bounds.push_back(start);
  return bounds;
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  if (!std::isfinite(start) || !(width > 0) || count < 1) {
    Die(absl::StrCat("LinearBuckets(", FormatValue(start), ", ", FormatValue(width), ", ", count,
                     "): want a finite start, width > 0, count >= 1"));
  }
  std::vector<double> bounds;
  bounds.reserve(count);
  // start + i * width rather than repeated addition, which drifts (0.1 + 0.1 + 0.1 != 0.3).
  for (int i = 0; i < count; ++i) bounds.push_back(start + i * width);
  return bounds;
}

namespace metrics_internal {

template <typename Metric>
Family<Metric>::Family(std::string name, std::vector<std::string> label_names,
                       std::vector<double> buckets, PrometheusFamily& family)
    : name_(std::move(name)),
      label_names_(std::move(label_names)),
      buckets_(std::move(buckets)),
      family_(family) {}

template <typename Metric>
Metric& Family<Metric>::WithLabels(const LabelValues& values) {
  if (values.size() != label_names_.size()) {
    Die(absl::StrCat(name_, ": WithLabels got ", values.size(), " value(s) {",
                     absl::StrJoin(values, ", "), "} for the label names {",
                     absl::StrJoin(label_names_, ", "), "}"));
  }
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = children_.find(values);
    if (it != children_.end()) return *it->second;
  }
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Metric>& child = children_[values];
  if (child == nullptr) {  // another thread may have made it between the two locks
    std::map<std::string, std::string> labels;
    for (size_t i = 0; i < values.size(); ++i) labels.emplace(label_names_[i], values[i]);
    if constexpr (std::is_same_v<Metric, Histogram>) {
      child = std::make_unique<Histogram>(
          family_.Add(labels, prometheus::Histogram::BucketBoundaries(buckets_)), buckets_);
    } else {
      child = std::make_unique<Metric>(family_.Add(labels));
    }
  }
  return *child;
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

}  // namespace metrics_internal

// The registry as prometheus::Exposer and Render collect it: the hooks
// first, one collection at a time; then the families in the order they were
// added (prometheus-cpp groups them by type), each family's samples sorted
// by label values (it keeps them in a hash map), and families with no
// sample yet left out.
class MetricsRegistry::Hooked : public prometheus::Collectable {
 public:
  explicit Hooked(std::shared_ptr<prometheus::Registry> registry)
      : registry_(std::move(registry)) {}

  void AddHook(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    hooks_.push_back(std::move(hook));
  }
  void AddName(const std::string& name) {
    absl::MutexLock lock(&mu_);
    order_.emplace(name, order_.size());
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    absl::MutexLock collect_lock(&collect_mu_);
    std::vector<std::function<void()>> hooks;
    std::map<std::string, size_t> order;
    {
      absl::MutexLock lock(&mu_);
      hooks = hooks_;
      order = order_;
    }
    for (const std::function<void()>& hook : hooks) hook();
    std::vector<prometheus::MetricFamily> families = registry_->Collect();
    families.erase(std::remove_if(families.begin(), families.end(),
                                  [](const prometheus::MetricFamily& family) {
                                    return family.metric.empty();
                                  }),
                   families.end());
    const auto position = [&order](const prometheus::MetricFamily& family) {
      auto it = order.find(family.name);
      return it == order.end() ? order.size() : it->second;
    };
    std::stable_sort(
        families.begin(), families.end(),
        [&position](const prometheus::MetricFamily& a, const prometheus::MetricFamily& b) {
          return position(a) < position(b);
        });
    for (prometheus::MetricFamily& family : families) {
      std::stable_sort(family.metric.begin(), family.metric.end(),
                       [](const prometheus::ClientMetric& a, const prometheus::ClientMetric& b) {
                         return ValuesOf(a) < ValuesOf(b);
                       });
    }
    return families;
  }

 private:
  const std::shared_ptr<prometheus::Registry> registry_;
  // Held through a whole collection, so that hooks never run concurrently.
  mutable absl::Mutex collect_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, size_t> order_ ABSL_GUARDED_BY(mu_);
};

MetricsRegistry::MetricsRegistry()
    : registry_(
          std::make_shared<prometheus::Registry>(prometheus::Registry::InsertBehavior::Throw)),
      hooked_(std::make_shared<Hooked>(registry_)) {}

MetricsRegistry::~MetricsRegistry() = default;

void MetricsRegistry::Reserve(const std::string& name, const std::vector<std::string>& label_names,
                              bool histogram) {
  if (!IsMetricName(name)) {
    Die(absl::StrCat("bad metric name \"", name, "\": want [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  std::set<std::string> seen;
  for (const std::string& label : label_names) {
    if (!IsLabelName(label)) {
      Die(absl::StrCat(name, ": bad label name \"", label,
                       "\": want [a-zA-Z_][a-zA-Z0-9_]*, not starting with __"));
    }
    if (histogram && label == "le") Die(absl::StrCat(name, ": a histogram's buckets own \"le\""));
    if (!seen.insert(label).second) Die(absl::StrCat(name, ": label \"", label, "\" repeated"));
  }
  // A histogram also writes name_bucket, name_sum and name_count; none may
  // clash (prometheus-cpp checks only the family names).
  std::vector<std::string> taken = {name};
  if (histogram) {
    for (const char* suffix : {"_bucket", "_sum", "_count"}) taken.push_back(name + suffix);
  }
  for (const std::string& t : taken) {
    if (names_.count(t) > 0) Die(absl::StrCat(name, ": the name ", t, " is already registered"));
  }
  names_.insert(taken.begin(), taken.end());
  hooked_->AddName(name);
}

CounterFamily& MetricsRegistry::AddCounterFamily(std::string name, std::string help,
                                                 std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  Reserve(name, label_names, false);
  auto& family = prometheus::BuildCounter().Name(name).Help(EscapedHelp(help)).Register(*registry_);
  counters_.push_back(std::make_unique<CounterFamily>(std::move(name), std::move(label_names),
                                                      std::vector<double>{}, family));
  return *counters_.back();
}

GaugeFamily& MetricsRegistry::AddGaugeFamily(std::string name, std::string help,
                                             std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  Reserve(name, label_names, false);
  auto& family = prometheus::BuildGauge().Name(name).Help(EscapedHelp(help)).Register(*registry_);
  gauges_.push_back(std::make_unique<GaugeFamily>(std::move(name), std::move(label_names),
                                                  std::vector<double>{}, family));
  return *gauges_.back();
}

HistogramFamily& MetricsRegistry::AddHistogramFamily(std::string name, std::string help,
                                                     std::vector<std::string> label_names,
                                                     std::vector<double> buckets) {
  absl::MutexLock lock(&mu_);
  Reserve(name, label_names, true);
  buckets = CheckedBounds(name, std::move(buckets));
  auto& family =
      prometheus::BuildHistogram().Name(name).Help(EscapedHelp(help)).Register(*registry_);
  histograms_.push_back(std::make_unique<HistogramFamily>(std::move(name), std::move(label_names),
                                                          std::move(buckets), family));
  return *histograms_.back();
}

Counter& MetricsRegistry::AddCounter(std::string name, std::string help) {
  return AddCounterFamily(std::move(name), std::move(help), {}).WithLabels({});
}

Gauge& MetricsRegistry::AddGauge(std::string name, std::string help) {
  return AddGaugeFamily(std::move(name), std::move(help), {}).WithLabels({});
}

Histogram& MetricsRegistry::AddHistogram(std::string name, std::string help,
                                         std::vector<double> buckets) {
  return AddHistogramFamily(std::move(name), std::move(help), {}, std::move(buckets))
      .WithLabels({});
}

void MetricsRegistry::AddCollectHook(std::function<void()> hook) {
  hooked_->AddHook(std::move(hook));
}

std::string MetricsRegistry::Render() const {
  return prometheus::TextSerializer().Serialize(hooked_->Collect());
}

std::shared_ptr<prometheus::Collectable> MetricsRegistry::collectable() const { return hooked_; }

}  // namespace accel::server
