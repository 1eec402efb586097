#include "server/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace accel::server {
namespace {

// Misuse of the registry is a bug in our own code, met on the first run, and registration has no
// caller to hand a Status to: this is a failed CHECK, without glog (this library is torch-free).
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

// Prometheus reads values with Go's strconv.ParseFloat, which takes every form printed here.
std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  // Integers (counts, bytes) in full, "1000000" rather than "1e+06"; beyond 1e21 that would be a
  // long run of digits, so those and every fraction take the shortest form that round-trips.
  std::to_chars_result r = v == std::trunc(v) && std::fabs(v) < 1e21
                               ? std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed)
                               : std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

std::string JoinValues(const std::vector<double>& values) {
  return absl::StrJoin(values, ", ",
                       [](std::string* out, double v) { out->append(FormatValue(v)); });
}

// The text format escapes \ and newline everywhere, and " inside label values.
void AppendEscaped(absl::string_view s, bool in_quotes, std::string* out) {
  for (char c : s) {
    if (c == '\\') {
      out->append("\\\\");
    } else if (c == '\n') {
      out->append("\\n");
    } else if (c == '"' && in_quotes) {
      out->append("\\\"");
    } else {
      out->push_back(c);
    }
  }
}

// {a="x",b="y"}, with le="..." last when given; nothing when there is no label at all.
std::string Labels(const std::vector<std::string>& names, const LabelValues& values,
                   absl::string_view le = {}) {
  if (names.empty() && le.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, i > 0 ? "," : "", names[i], "=\"");
    AppendEscaped(values[i], /*in_quotes=*/true, &out);
    out.push_back('"');
  }
  if (!le.empty()) absl::StrAppend(&out, names.empty() ? "" : ",", "le=\"", le, "\"");
  out.push_back('}');
  return out;
}

void AppendSamples(const std::string& name, const std::vector<std::string>& label_names,
                   const LabelValues& values, const Counter& c, std::string* out) {
  absl::StrAppend(out, name, Labels(label_names, values), " ", FormatValue(c.value()), "\n");
}

void AppendSamples(const std::string& name, const std::vector<std::string>& label_names,
                   const LabelValues& values, const Gauge& g, std::string* out) {
  absl::StrAppend(out, name, Labels(label_names, values), " ", FormatValue(g.value()), "\n");
}

void AppendSamples(const std::string& name, const std::vector<std::string>& label_names,
                   const LabelValues& values, const Histogram& h, std::string* out) {
  Histogram::Snapshot s = h.snapshot();
  const std::vector<double>& bounds = h.bounds();
  for (size_t i = 0; i < s.cumulative_counts.size(); ++i) {
    std::string le = i < bounds.size() ? FormatValue(bounds[i]) : "+Inf";
    absl::StrAppend(out, name, "_bucket", Labels(label_names, values, le), " ",
                    s.cumulative_counts[i], "\n");
  }
  std::string labels = Labels(label_names, values);
  absl::StrAppend(out, name, "_sum", labels, " ", FormatValue(s.sum), "\n");
  absl::StrAppend(out, name, "_count", labels, " ", s.cumulative_counts.back(), "\n");
}

template <typename Metric>
constexpr const char* kTypeName = std::is_same_v<Metric, Counter> ? "counter"
                                  : std::is_same_v<Metric, Gauge> ? "gauge"
                                                                  : "histogram";

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

// std::atomic<double>::fetch_add is C++20.
void AtomicAdd(std::atomic<double>* a, double by) {
  double old = a->load(std::memory_order_relaxed);
  // On failure compare_exchange_weak reloads `old`, so each try adds to the latest value.
  while (!a->compare_exchange_weak(old, old + by, std::memory_order_relaxed)) {
  }
}

}  // namespace

void Counter::Increment(double by) {
  if (!(by >= 0)) {
    Die(absl::StrCat("Counter::Increment(", FormatValue(by), "): a counter never goes down"));
  }
  AtomicAdd(&value_, by);
}

void Gauge::Add(double by) { AtomicAdd(&value_, by); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(CheckedBounds("Histogram", std::move(bounds))), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  // The first bound >= v (le is inclusive). NaN is >= nothing, so it lands in +Inf.
  size_t i = std::partition_point(bounds_.begin(), bounds_.end(),
                                  [v](double bound) { return !(bound >= v); }) -
             bounds_.begin();
  absl::MutexLock lock(&mu_);
  ++counts_[i];
  sum_ += v;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  {
    absl::MutexLock lock(&mu_);
    s.cumulative_counts = counts_;
    s.sum = sum_;
  }
  std::partial_sum(s.cumulative_counts.begin(), s.cumulative_counts.end(),
                   s.cumulative_counts.begin());
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
Family<Metric>::Family(std::string name, std::string help, std::vector<std::string> label_names,
                       std::vector<double> buckets)
    : name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      buckets_(std::move(buckets)) {}

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
    if constexpr (std::is_same_v<Metric, Histogram>) {
      child = std::make_unique<Histogram>(buckets_);
    } else {
      child = std::make_unique<Metric>();
    }
  }
  return *child;
}

template <typename Metric>
void Family<Metric>::Render(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  if (children_.empty()) return;
  absl::StrAppend(out, "# HELP ", name_, help_.empty() ? "" : " ");
  AppendEscaped(help_, /*in_quotes=*/false, out);
  absl::StrAppend(out, "\n# TYPE ", name_, " ", kTypeName<Metric>, "\n");
  for (const auto& [values, child] : children_) {
    AppendSamples(name_, label_names_, values, *child, out);
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

}  // namespace metrics_internal

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
  // A histogram also writes name_bucket, name_sum and name_count; none may clash.
  std::vector<std::string> taken = {name};
  if (histogram) {
    for (const char* suffix : {"_bucket", "_sum", "_count"}) taken.push_back(name + suffix);
  }
  for (const std::string& t : taken) {
    if (names_.count(t) > 0) Die(absl::StrCat(name, ": the name ", t, " is already registered"));
  }
  names_.insert(taken.begin(), taken.end());
}

template <typename F>
F& MetricsRegistry::Add(std::string name, std::string help, std::vector<std::string> label_names,
                        std::vector<double> buckets) {
  constexpr bool kHistogram = std::is_same_v<F, HistogramFamily>;
  absl::MutexLock lock(&mu_);
  Reserve(name, label_names, kHistogram);
  if (kHistogram) buckets = CheckedBounds(name, std::move(buckets));
  auto family = std::make_unique<F>(std::move(name), std::move(help), std::move(label_names),
                                    std::move(buckets));
  F& result = *family;
  families_.push_back(std::move(family));
  return result;
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

CounterFamily& MetricsRegistry::AddCounterFamily(std::string name, std::string help,
                                                 std::vector<std::string> label_names) {
  return Add<CounterFamily>(std::move(name), std::move(help), std::move(label_names), {});
}

GaugeFamily& MetricsRegistry::AddGaugeFamily(std::string name, std::string help,
                                             std::vector<std::string> label_names) {
  return Add<GaugeFamily>(std::move(name), std::move(help), std::move(label_names), {});
}

HistogramFamily& MetricsRegistry::AddHistogramFamily(std::string name, std::string help,
                                                     std::vector<std::string> label_names,
                                                     std::vector<double> buckets) {
  return Add<HistogramFamily>(std::move(name), std::move(help), std::move(label_names),
                              std::move(buckets));
}

void MetricsRegistry::AddCollectHook(std::function<void()> hook) {
  absl::MutexLock lock(&mu_);
  hooks_.push_back(std::move(hook));
}

std::string MetricsRegistry::Render() const {
  absl::MutexLock render_lock(&render_mu_);
  std::vector<std::function<void()>> hooks;
  {
    absl::ReaderMutexLock lock(&mu_);
    hooks = hooks_;
  }
  for (const std::function<void()>& hook : hooks) hook();
  std::string out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& family : families_) family->Render(&out);
  return out;
}

}  // namespace accel::server
