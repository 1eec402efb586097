// models/parallel_options.h: which slice of a model a process holds when the
// model is split over the ranks of a process group (tensor parallel:
// models/tensor_parallel.h). Torch-free, so option structs of every layer
// can carry it.
#ifndef ACCEL_MODELS_PARALLEL_OPTIONS_H_
#define ACCEL_MODELS_PARALLEL_OPTIONS_H_

#include <cstdint>

namespace accel::dist {
class ProcessGroup;
}  // namespace accel::dist

namespace accel::models {

// The slice of a model this process holds; size 1: the whole model.
struct TensorParallel {
  int rank = 0;
  int size = 1;
  // The ranks' group (not owned; outlives the model). Null only for a model
  // that never runs a step across ranks (a module tree, a memory estimate).
  dist::ProcessGroup* group = nullptr;
  // LoadModel's leader (rank 0) tells idle workers it is alive this often
  // (TensorParallelLeader); 0: never.
  int64_t heartbeat_ms = 0;
};

}  // namespace accel::models

#endif  // ACCEL_MODELS_PARALLEL_OPTIONS_H_
