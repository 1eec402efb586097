// core/threads.h: how many intra-op threads the tools and the server run with.
//
// libtorch 1.13's own default counts physical cores through cpuinfo, which
// reads 1 on virtual machines whose vCPUs it takes for siblings of one core:
// there decode, which is bound by memory reads that a second thread nearly
// doubles, ran on half the machine (measured: 0.999 CPUs utilized on 2).
#ifndef ACCEL_CORE_THREADS_H_
#define ACCEL_CORE_THREADS_H_

namespace accel {

// `requested` when > 0; else OMP_NUM_THREADS when it holds a positive
// number; else one per CPU this process may run on (its affinity mask).
int IntraOpThreads(int requested);

// at::set_num_threads(IntraOpThreads(requested)); returns that number.
int SetIntraOpThreads(int requested);

}  // namespace accel

#endif  // ACCEL_CORE_THREADS_H_
