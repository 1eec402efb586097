// train/process_group.h: the training library's names for dist/'s process
// group (c10d: gloo on CPU, NCCL on GPU), which moved down so that tensor and
// pipeline parallel serving use the same one.
#ifndef ACCEL_TRAIN_PROCESS_GROUP_H_
#define ACCEL_TRAIN_PROCESS_GROUP_H_

#include "dist/process_group.h"
#include "train/env.h"

namespace accel::train {

using dist::DefaultProcessGroupTimeout;
using dist::PendingWork;
using dist::ProcessGroup;
using dist::ProcessGroupOptions;
using dist::ReduceOp;

}  // namespace accel::train

#endif  // ACCEL_TRAIN_PROCESS_GROUP_H_
