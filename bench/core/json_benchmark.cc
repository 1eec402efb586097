// Parsing one JSON object of n keys (the outside test's hostile body, 100,000
// keys in 1.5 MB): accel::ParseOrderedJson and accel::ParseJson (core/json.h)
// against nlohmann's own parse of the same text into ordered_json (what the
// server used, a linear lookup per key) and into json (std::map), in the
// same run.
//
//   build/bin/accel-bench-json [max_keys]   (default 100000)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "core/json.h"

namespace {

std::string ObjectOfKeys(int n) {
  std::string text = "{";
  for (int i = 0; i < n; ++i) absl::StrAppend(&text, i ? "," : "", "\"k", i, "\":", i);
  return text + "}";
}

// Milliseconds of the fastest of `runs` calls of `parse`.
template <typename Parse>
double BestMs(int runs, Parse parse) {
  double best = 1e300;
  for (int r = 0; r < runs; ++r) {
    const auto start = std::chrono::steady_clock::now();
    const size_t size = parse();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (size == 0) std::abort();
    if (ms < best) best = ms;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int max_keys = argc > 1 ? std::atoi(argv[1]) : 100000;
  accel::JsonLimits limits;
  limits.max_keys = int64_t{1} << 30;
  std::printf("%8s %9s %16s %14s %18s %16s\n", "keys", "bytes", "accel ordered ms", "accel json ms",
              "nlohmann ordered ms", "nlohmann json ms");
  for (int n = 1000; n <= max_keys; n *= 10) {
    const std::string text = ObjectOfKeys(n);
    const int runs = n <= 10000 ? 5 : 1;
    const double ours_ordered =
        BestMs(runs, [&] { return accel::ParseOrderedJson(text, "bench", limits).value().size(); });
    const double ours_map =
        BestMs(runs, [&] { return accel::ParseJson(text, "bench", limits).value().size(); });
    const double theirs_ordered =
        BestMs(runs, [&] { return nlohmann::ordered_json::parse(text).size(); });
    const double theirs_map = BestMs(runs, [&] { return nlohmann::json::parse(text).size(); });
    std::printf("%8d %9zu %16.1f %14.1f %18.1f %16.1f\n", n, text.size(), ours_ordered, ours_map,
                theirs_ordered, theirs_map);
  }
  return 0;
}
