#include "core/threads.h"

#include <algorithm>
#include <cstdlib>
#include <sched.h>
#include <string>
#include <thread>

#include <ATen/Parallel.h>

#include "absl/strings/numbers.h"

namespace accel {
namespace {

int CpusOfThisProcess() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return count;
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

int IntraOpThreads(int requested) {
  if (requested > 0) return requested;
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env != nullptr) {
    int value = 0;
    if (absl::SimpleAtoi(env, &value) && value > 0) return value;
  }
  return CpusOfThisProcess();
}

int SetIntraOpThreads(int requested) {
  const int threads = IntraOpThreads(requested);
  at::set_num_threads(threads);
  return threads;
}

}  // namespace accel
