#include "server/internal/connection_limits.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sys/resource.h>

#include "absl/strings/str_cat.h"

namespace accel::server::internal {

ConnectionLimits ConnectionLimitsFor(int64_t open_files, int grpc, int http) {
  ConnectionLimits limits;
  limits.open_files = open_files;
  const int64_t reserve = std::max<int64_t>(64, open_files / 8);
  const int64_t budget = std::max<int64_t>(open_files - reserve, 8);
  const auto as_int = [](int64_t v) { return static_cast<int>(std::min<int64_t>(v, 1 << 30)); };
  limits.grpc = grpc > 0 ? grpc : as_int(std::max<int64_t>(budget / 2, 1));
  limits.http = http > 0 ? http : as_int(std::clamp<int64_t>(budget * 3 / 8, 1, 512));
  limits.metrics_threads = as_int(std::clamp<int64_t>(budget / 16, 2, 128));
  return limits;
}

int64_t OpenFileLimit() {
  rlimit limit = {};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  if (limit.rlim_cur == RLIM_INFINITY) return int64_t{1} << 20;
  return static_cast<int64_t>(limit.rlim_cur);
}

std::string RaiseOpenFileLimit() {
  rlimit limit = {};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::StrCat("open files: getrlimit failed: ", std::strerror(errno));
  }
  const rlim_t before = limit.rlim_cur;
  rlim_t target = limit.rlim_max;
  if (target == RLIM_INFINITY) {
    // The kernel refuses more than fs.nr_open per process.
    int64_t nr_open = 1 << 20;
    std::ifstream("/proc/sys/fs/nr_open") >> nr_open;
    target = static_cast<rlim_t>(nr_open);
  }
  if (before != RLIM_INFINITY && before >= target) {
    return absl::StrCat("open files: ", before, " (the hard limit)");
  }
  limit.rlim_cur = target;
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::StrCat("open files: ", before, "; raising it to ", target,
                        " failed: ", std::strerror(errno));
  }
  return absl::StrCat("open files: ", before, " -> ", target, " (the hard limit)");
}

}  // namespace accel::server::internal
