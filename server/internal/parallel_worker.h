// A worker rank of a tensor-parallel accel-serve group (issue 36, item 3):
// gRPC health only, its slice of the model, and the steps rank 0 sends.
#ifndef ACCEL_SERVER_INTERNAL_PARALLEL_WORKER_H_
#define ACCEL_SERVER_INTERNAL_PARALLEL_WORKER_H_

#include <string>

#include "models/load_options.h"

namespace accel::dist {
class ProcessGroup;
}  // namespace accel::dist

namespace accel::server::internal {

// The exit status of a rank whose group broke (a peer died or went silent):
// a restart of the whole group mends it.
inline constexpr int kExitParallelFault = 4;

// Serves grpc.health.v1 on host:port ("" and "accel.live" SERVING from the
// start, "accel.ready" once the slice has loaded; the port is logged on
// stderr as "accel-serve: worker rank R: listening grpc=HOST:PORT"), loads
// its slice of `model_dir` with `load` and runs the leader's steps (sent
// over `group`, the whole group) until it stops them. The slice is
// load.tensor_parallel's when the caller placed the rank
// (models::JoinParallelGroups: pipeline stages), else rank group.rank() of
// group.size() tensor-parallel ranks. Returns the exit status: 0 when the leader
// stopped the group, 1 when the slice cannot load or the port cannot open,
// kExitParallelFault when the group broke.
int ServeWorkerRank(const std::string& model_dir, models::ModelLoadOptions load,
                    const std::string& host, int port, dist::ProcessGroup& group);

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_PARALLEL_WORKER_H_
