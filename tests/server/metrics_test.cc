#include "server/metrics.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "tests/testing/temp_dir.h"

namespace accel::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(MetricsRegistryTest, RendersTheTextFormatByteForByte) {
  MetricsRegistry registry;
  Counter& requests = registry.AddCounter("accel_requests_total", "Requests received.");
  Gauge& running =
      registry.AddGauge("accel_num_requests_running", "Running now.\nA \\ and \"quotes\" in help.");
  CounterFamily& success = registry.AddCounterFamily(
      "accel_request_success_total", "Requests that finished.", {"model", "reason"});
  GaugeFamily& special = registry.AddGaugeFamily("accel_special", "Odd values.", {"case"});
  registry.AddCounterFamily("accel_unused_total", "No child yet: not rendered.", {"x"});
  Histogram& ttft = registry.AddHistogram("accel_time_to_first_token_seconds",
                                          "Time to first token.", {0.125, 0.5, 1});
  HistogramFamily& latency = registry.AddHistogramFamily("accel_e2e_request_latency_seconds",
                                                         "Latency.", {"model"}, {1, 2.5});

  requests.Increment();
  requests.Increment(2);
  running.Set(3);
  running.Add(-1.5);
  success.WithLabels({"llama", "stop"}).Increment(5);
  success.WithLabels({"gpt2", "length"}).Increment();
  success.WithLabels({"we\"ird\\name\nx", "stop"}).Increment();
  special.WithLabels({"inf"}).Set(kInf);
  special.WithLabels({"minus_inf"}).Set(-kInf);
  special.WithLabels({"nan"}).Set(std::nan(""));
  special.WithLabels({"big"}).Set(1e9);
  ttft.Observe(0.0625);
  ttft.Observe(0.5);
  ttft.Observe(3);
  latency.WithLabels({"llama"}).Observe(2);

  // prometheus-cpp's TextSerializer (1.0.1): NaN as "Nan", a histogram's
  // _count and _sum before its buckets; the HELP text escaped by us.
  EXPECT_EQ(registry.Render(),
            "# HELP accel_requests_total Requests received.\n"
            "# TYPE accel_requests_total counter\n"
            "accel_requests_total 3\n"
            "# HELP accel_num_requests_running Running now.\\nA \\\\ and \"quotes\" in help.\n"
            "# TYPE accel_num_requests_running gauge\n"
            "accel_num_requests_running 1.5\n"
            "# HELP accel_request_success_total Requests that finished.\n"
            "# TYPE accel_request_success_total counter\n"
            "accel_request_success_total{model=\"gpt2\",reason=\"length\"} 1\n"
            "accel_request_success_total{model=\"llama\",reason=\"stop\"} 5\n"
            "accel_request_success_total{model=\"we\\\"ird\\\\name\\nx\",reason=\"stop\"} 1\n"
            "# HELP accel_special Odd values.\n"
            "# TYPE accel_special gauge\n"
            "accel_special{case=\"big\"} 1000000000\n"
            "accel_special{case=\"inf\"} +Inf\n"
            "accel_special{case=\"minus_inf\"} -Inf\n"
            "accel_special{case=\"nan\"} Nan\n"
            "# HELP accel_time_to_first_token_seconds Time to first token.\n"
            "# TYPE accel_time_to_first_token_seconds histogram\n"
            "accel_time_to_first_token_seconds_count 3\n"
            "accel_time_to_first_token_seconds_sum 3.5625\n"
            "accel_time_to_first_token_seconds_bucket{le=\"0.125\"} 1\n"
            "accel_time_to_first_token_seconds_bucket{le=\"0.5\"} 2\n"
            "accel_time_to_first_token_seconds_bucket{le=\"1\"} 2\n"
            "accel_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"
            "# HELP accel_e2e_request_latency_seconds Latency.\n"
            "# TYPE accel_e2e_request_latency_seconds histogram\n"
            "accel_e2e_request_latency_seconds_count{model=\"llama\"} 1\n"
            "accel_e2e_request_latency_seconds_sum{model=\"llama\"} 2\n"
            "accel_e2e_request_latency_seconds_bucket{model=\"llama\",le=\"1\"} 0\n"
            "accel_e2e_request_latency_seconds_bucket{model=\"llama\",le=\"2.5\"} 1\n"
            "accel_e2e_request_latency_seconds_bucket{model=\"llama\",le=\"+Inf\"} 1\n");
}

TEST(MetricsRegistryTest, WithLabelsReturnsTheSameChild) {
  MetricsRegistry registry;
  CounterFamily& family = registry.AddCounterFamily("accel_x_total", "X.", {"a"});
  Counter& first = family.WithLabels({"1"});
  EXPECT_EQ(&first, &family.WithLabels({"1"}));
  EXPECT_NE(&first, &family.WithLabels({"2"}));
}

// Exact totals after 8 threads update at once; meanwhile a reader checks that every Render shows
// a histogram whose count, +Inf bucket and sum agree (each observation is 1).
TEST(MetricsRegistryTest, ConcurrentUpdatesAreExact) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 20000;
  constexpr int kTotal = kThreads * kPerThread;
  MetricsRegistry registry;
  Counter& counter = registry.AddCounter("accel_c_total", "C.");
  Gauge& gauge = registry.AddGauge("accel_g", "G.");
  CounterFamily& family = registry.AddCounterFamily("accel_f_total", "F.", {"parity"});
  Histogram& histogram = registry.AddHistogram("accel_h", "H.", {0.5, 1, 2});

  std::atomic<bool> done{false};
  std::atomic<int> inconsistent{0};
  std::thread reader([&] {
    while (!done.load()) {
      Histogram::Snapshot s = histogram.snapshot();
      if (s.sum != static_cast<double>(s.cumulative_counts.back())) ++inconsistent;
      std::string text = registry.Render();
      EXPECT_THAT(text, HasSubstr("accel_h_count"));
    }
  });
  std::vector<std::thread> writers;
  writers.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    writers.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        counter.Increment();
        gauge.Add(0.5);
        family.WithLabels({t % 2 == 0 ? "even" : "odd"}).Increment(2);
        histogram.Observe(1);
      }
    });
  }
  for (std::thread& w : writers) w.join();
  done = true;
  reader.join();

  EXPECT_EQ(counter.value(), kTotal);
  EXPECT_EQ(gauge.value(), kTotal * 0.5);
  EXPECT_EQ(family.WithLabels({"even"}).value(), kTotal);  // half the threads, 2 each
  EXPECT_EQ(family.WithLabels({"odd"}).value(), kTotal);   // half the threads, 2 each
  EXPECT_EQ(histogram.count(), uint64_t{kTotal});
  EXPECT_EQ(histogram.sum(), kTotal);
  EXPECT_THAT(histogram.bucket_counts(), ElementsAre(0, kTotal, kTotal, kTotal));
  EXPECT_EQ(inconsistent.load(), 0);
}

TEST(HistogramTest, BoundsAreInclusive) {
  MetricsRegistry registry;
  Histogram& h = registry.AddHistogram("accel_h", "H.", {1, 2});
  h.Observe(1);
  EXPECT_THAT(h.bucket_counts(), ElementsAre(1, 1, 1));
  h.Observe(2);
  EXPECT_THAT(h.bucket_counts(), ElementsAre(1, 2, 2));
  h.Observe(std::nextafter(2.0, 3.0));
  EXPECT_THAT(h.bucket_counts(), ElementsAre(1, 2, 3));
  h.Observe(-5);
  EXPECT_THAT(h.bucket_counts(), ElementsAre(2, 3, 4));
  EXPECT_EQ(h.count(), 4u);
  EXPECT_THAT(registry.Render(), HasSubstr("accel_h_bucket{le=\"1\"} 2\n"));
}

TEST(HistogramTest, NanGoesToInfOnlyAndTrailingInfBoundIsDropped) {
  MetricsRegistry registry;
  Histogram& h = registry.AddHistogram("accel_h", "H.", {1, kInf});
  EXPECT_THAT(h.bounds(), ElementsAre(1));
  h.Observe(std::nan(""));
  EXPECT_THAT(h.bucket_counts(), ElementsAre(0, 1));
  EXPECT_TRUE(std::isnan(h.sum()));
}

TEST(BucketsTest, ExponentialAndLinear) {
  EXPECT_THAT(ExponentialBuckets(1, 2, 5), ElementsAre(1, 2, 4, 8, 16));
  EXPECT_THAT(ExponentialBuckets(0.25, 4, 3), ElementsAre(0.25, 1, 4));
  EXPECT_THAT(LinearBuckets(0, 0.25, 4), ElementsAre(0, 0.25, 0.5, 0.75));
  EXPECT_THAT(LinearBuckets(-1, 1, 3), ElementsAre(-1, 0, 1));
  // start + i * width: the tenth bound is 0.1 * 10 == 1 exactly, not ten sums of 0.1.
  EXPECT_EQ(LinearBuckets(0, 0.1, 11).back(), 1.0);
}

// The value on the rendered line of a one-gauge registry.
std::string RenderedValue(double v) {
  MetricsRegistry registry;
  registry.AddGauge("accel_v", "V.").Set(v);
  std::string text = registry.Render();
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  return lines.back().substr(lines.back().rfind(' ') + 1);
}

// prometheus-cpp writes values with 16 significant digits: integers up to
// 2^53 (every count and byte total) exactly, fractions to one part in 10^15.
TEST(MetricsRegistryTest, NumbersKeepSixteenDigits) {
  EXPECT_EQ(RenderedValue(1e6), "1000000");
  EXPECT_EQ(RenderedValue(9007199254740992.0), "9007199254740992");
  EXPECT_EQ(RenderedValue(0.1), "0.1");
  EXPECT_EQ(RenderedValue(-0.25), "-0.25");
  EXPECT_EQ(RenderedValue(1e300), "1e+300");
  for (double v : {0.1, 1.0 / 3, 2.0 / 3, 1e-7, -2.5e-8, 123456.789, 9007199254740993.0,
                   18446744073709551616.0, 1e21, 1e300, 4.9e-324, 3.0e-5, 65535.99999999999}) {
    std::string text = RenderedValue(v);
    SCOPED_TRACE(text);
    EXPECT_NEAR(std::strtod(text.c_str(), nullptr), v, std::fabs(v) * 1e-15);
  }
}

TEST(MetricsRegistryTest, CollectHooksRunAtTheStartOfEachRender) {
  MetricsRegistry registry;
  Gauge& bytes = registry.AddGauge("accel_kv_cache_bytes", "Bytes.");
  int calls = 0;
  registry.AddCollectHook([&] { bytes.Set(++calls * 100); });
  EXPECT_THAT(registry.Render(), HasSubstr("accel_kv_cache_bytes 100\n"));
  EXPECT_THAT(registry.Render(), HasSubstr("accel_kv_cache_bytes 200\n"));
  EXPECT_EQ(calls, 2);
}

// A registry shaped like accel-serve's (server/server_metrics.cc) passes Prometheus' own linter.
TEST(MetricsRegistryTest, PassesPromtoolCheckMetrics) {
  std::string promtool;
  for (absl::string_view dir :
       absl::StrSplit(std::getenv("PATH") ? std::getenv("PATH") : "", ':')) {
    std::string candidate = absl::StrCat(dir, "/promtool");
    if (!dir.empty() && ::access(candidate.c_str(), X_OK) == 0) {
      promtool = candidate;
      break;
    }
  }
  ASSERT_FALSE(promtool.empty())
      << "promtool is not on PATH: run scripts/setup.sh (Debian package prometheus)";

  MetricsRegistry registry;
  registry
      .AddCounterFamily("accel_request_success_total", "Requests that finished.",
                        {"finished_reason"})
      .WithLabels({"stop"})
      .Increment(3);
  registry.AddCounterFamily("accel_request_failure_total", "Requests that failed.", {"reason"})
      .WithLabels({"a \"quoted\"\\reason\nwith a newline"})
      .Increment();
  Histogram& ttft = registry.AddHistogram("accel_time_to_first_token_seconds",
                                          "Time to first token.", ExponentialBuckets(0.001, 2, 16));
  ttft.Observe(0.02);
  ttft.Observe(100);
  registry
      .AddHistogramFamily("accel_request_prompt_tokens", "Prompt tokens per request.", {"model"},
                          LinearBuckets(1, 100, 5))
      .WithLabels({"llama"})
      .Observe(42);
  registry.AddCounter("accel_generation_tokens_total", "Tokens generated.").Increment(1e7);
  registry.AddGauge("accel_kv_cache_bytes", "KV-cache bytes.").Set(123456789);
  registry.AddGauge("accel_kv_cache_usage_ratio", "KV-cache use, 0 to 1.").Set(0.3);
  registry.AddGaugeFamily("accel_weight_bytes", "Weight bytes per device.", {"device"})
      .WithLabels({"cpu"})
      .Set(1.5e9);
  registry.AddGaugeFamily("accel_build_info", "The version.", {"version"})
      .WithLabels({"0.1.0"})
      .Set(1);

  test::TempDir dir;
  std::string metrics = dir.Write("metrics.txt", registry.Render());
  std::string output = dir.File("promtool.txt");
  int rc = std::system(
      absl::StrCat(promtool, " check metrics < ", metrics, " > ", output, " 2>&1").c_str());
  EXPECT_EQ(rc, 0) << "promtool says:\n"
                   << test::ReadAll(output) << "\nabout:\n"
                   << test::ReadAll(metrics);
}

class MetricsDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(MetricsDeathTest, MisuseAbortsWithAMessage) {
  EXPECT_DEATH(
      {
        MetricsRegistry r;
        r.AddCounter("accel_x_total", "X.");
        r.AddGauge("accel_x_total", "X again.");
      },
      "accel_x_total is already registered");
  EXPECT_DEATH(
      {
        MetricsRegistry r;
        r.AddHistogram("accel_h", "H.", {1});
        r.AddCounter("accel_h_count", "Clashes with the histogram's _count.");
      },
      "accel_h_count is already registered");
  EXPECT_DEATH(MetricsRegistry().AddCounter("1accel", "X."), "bad metric name \"1accel\"");
  EXPECT_DEATH(MetricsRegistry().AddCounter("accel-x", "X."), "bad metric name");
  EXPECT_DEATH(MetricsRegistry().AddCounterFamily("accel_x_total", "X.", {"__reserved"}),
               "bad label name \"__reserved\"");
  EXPECT_DEATH(MetricsRegistry().AddCounterFamily("accel_x_total", "X.", {"a:b"}),
               "bad label name");
  EXPECT_DEATH(MetricsRegistry().AddCounterFamily("accel_x_total", "X.", {"a", "a"}),
               "label \"a\" repeated");
  EXPECT_DEATH(MetricsRegistry().AddHistogramFamily("accel_h", "H.", {"le"}, {1}),
               "buckets own \"le\"");
  EXPECT_DEATH(MetricsRegistry().AddHistogram("accel_h", "H.", {1, 1}),
               "accel_h: histogram bounds must be finite and strictly increasing, got \\{1, 1\\}");
  EXPECT_DEATH(MetricsRegistry().AddHistogram("accel_h", "H.", {2, 1}), "strictly increasing");
  EXPECT_DEATH(MetricsRegistry().AddHistogram("accel_h", "H.", {std::nan("")}),
               "strictly increasing");
  EXPECT_DEATH(
      {
        MetricsRegistry r;
        r.AddCounterFamily("accel_fam_total", "F.", {"a", "b"}).WithLabels({"x"});
      },
      "accel_fam_total: WithLabels got 1 value\\(s\\) \\{x\\} for the label names \\{a, b\\}");
  EXPECT_DEATH(MetricsRegistry().AddCounter("accel_c_total", "C.").Increment(-1),
               "a counter never goes down");
  EXPECT_DEATH(ExponentialBuckets(0, 2, 3), "ExponentialBuckets");
  EXPECT_DEATH(LinearBuckets(0, 1, 0), "LinearBuckets");
}

}  // namespace
}  // namespace accel::server
