#include "core/threads.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
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

void RunWithIntraOpThreadsAsleep(const std::function<void()>& blocking) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region()) {
    blocking();
    return;
  }
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  // One index a thread: the caller (thread 0 of the team) takes the chunk
  // holding 0 and runs `blocking`; the others wait on `done`, asleep.
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t /*end*/) {
    if (begin == 0) {
      struct Finish {  // also when `blocking` throws
        std::mutex& mu;
        std::condition_variable& cv;
        bool& done;
        ~Finish() {
          {
            const std::lock_guard<std::mutex> lock(mu);
            done = true;
          }
          cv.notify_all();
        }
      } finish{mu, cv, done};
      blocking();
      return;
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  });
}

}  // namespace accel
