// Helpers the benchmarks share: timing, medians, a checkpoint's files, and
// dropping them from the page cache so the next read goes to disk.
#ifndef ACCEL_BENCH_BENCH_UTIL_H_
#define ACCEL_BENCH_BENCH_UTIL_H_

#include <algorithm>
#include <chrono>
#include <fcntl.h>
#include <filesystem>
#include <functional>
#include <string>
#include <unistd.h>
#include <vector>

namespace accel::bench {

inline double Seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The .safetensors files of `dir`, sorted.
inline std::vector<std::string> SafetensorsFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Drops the files' pages from the page cache: the next read goes to disk.
inline void DropPageCache(const std::vector<std::string>& files) {
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    (void)::fdatasync(fd);
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

}  // namespace accel::bench

#endif  // ACCEL_BENCH_BENCH_UTIL_H_
