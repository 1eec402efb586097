// core/thread_name.h: names for the threads accel starts, so that top -H,
// perf and /proc/<pid>/task/*/comm tell the layer reader from the compute.
#ifndef ACCEL_CORE_THREAD_NAME_H_
#define ACCEL_CORE_THREAD_NAME_H_

namespace accel {

// Names the calling thread; Linux keeps the first 15 characters. Call it
// first in a thread's body. A failure is ignored: it is only a name.
void NameThisThread(const char* name);

}  // namespace accel

#endif  // ACCEL_CORE_THREAD_NAME_H_
