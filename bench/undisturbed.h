// bench/undisturbed.h: timing on shared machines. A sample during which other
// processes used the CPU is "disturbed" (on 2 shared cores one busy neighbour
// delays half of every parallel region by a scheduler time slice); a
// benchmark keeps its best undisturbed time and counts both kinds.
// Used by accel-bench-gemv and accel-bench-quant.
#ifndef ACCEL_BENCH_UNDISTURBED_H_
#define ACCEL_BENCH_UNDISTURBED_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>

namespace accel::bench {

// CPU time in clock ticks of the whole machine (steal included) and of this
// process, from /proc.
struct CpuTicks {
  uint64_t machine = 0, self = 0;
};

inline CpuTicks ReadCpuTicks() {
  CpuTicks ticks;
  std::ifstream stat("/proc/stat");
  std::string cpu;
  uint64_t v[8] = {};  // user nice system idle iowait irq softirq steal
  stat >> cpu;
  for (uint64_t& x : v) stat >> x;
  ticks.machine = v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
  std::ifstream self("/proc/self/stat");
  std::string line;
  std::getline(self, line);
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos) return ticks;
  std::istringstream fields(line.substr(paren + 2));  // from field 3 (state) on
  std::string field;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15)
      ticks.self += std::strtoull(field.c_str(), nullptr, 10);  // utime, stime
  }
  return ticks;
}

struct Samples {
  double best = 1e30;      // seconds, undisturbed samples
  double best_any = 1e30;  // the same over every sample
  int clean = 0, disturbed = 0;
};

// Runs `fn` once and adds the sample to `s`: clean when other processes used
// at most 2% of the machine's CPU time meanwhile (plus one tick of slack).
inline void Sample(const std::function<void()>& fn, Samples& s) {
  static const double ticks_per_s = static_cast<double>(::sysconf(_SC_CLK_TCK));
  static const double cpus = static_cast<double>(std::thread::hardware_concurrency());
  const CpuTicks before = ReadCpuTicks();
  const auto start = std::chrono::steady_clock::now();
  fn();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const CpuTicks after = ReadCpuTicks();
  const double others = static_cast<double>(after.machine - before.machine) -
                        static_cast<double>(after.self - before.self);
  s.best_any = std::min(s.best_any, seconds);
  if (others <= 1 + 0.02 * seconds * ticks_per_s * cpus) {
    s.best = std::min(s.best, seconds);
    ++s.clean;
  } else {
    ++s.disturbed;
  }
}

}  // namespace accel::bench

#endif  // ACCEL_BENCH_UNDISTURBED_H_
