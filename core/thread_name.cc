#include "core/thread_name.h"

#include <cstdio>
#include <pthread.h>

namespace accel {

void NameThisThread(const char* name) {
  char truncated[16] = {};  // the kernel's TASK_COMM_LEN, its terminator included
  std::snprintf(truncated, sizeof(truncated), "%s", name);
  (void)pthread_setname_np(pthread_self(), truncated);
}

}  // namespace accel
