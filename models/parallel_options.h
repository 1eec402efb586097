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

  // Pipeline parallel: this process runs stage `pipeline_rank` of
  // `pipeline_size`, consecutive layers (PipelineLayers); the first stage
  // embeds, the last one holds the final norm and lm_head. With more than
  // one stage, `group` is the stage's tensor-parallel group (its `size`
  // ranks; may be null for size 1) and `world` all size x pipeline_size
  // ranks, world rank = pipeline_rank * size + rank; the leader is world
  // rank 0 and broadcasts each step on `world`, stages pass activations
  // along it by send / recv.
  int pipeline_rank = 0;
  int pipeline_size = 1;
  dist::ProcessGroup* world = nullptr;
  // Micro-batches a pipeline-parallel step is split into, so that the
  // stages overlap (PipelineMicroBatches: never more than the step's
  // sequences); 0: pipeline_size, 1: the whole step at once. Every rank
  // must hold the same value (accel-serve passes its flags to every rank).
  int pipeline_micro_batches = 0;

  // The group the leader's step messages go over: `world` with stages,
  // else `group`.
  dist::ProcessGroup* step_group() const { return pipeline_size > 1 ? world : group; }
  // Whether this process is one of several ranks (tensor or pipeline).
  bool split() const { return size > 1 || pipeline_size > 1; }
  int world_rank() const { return pipeline_rank * size + rank; }
};

}  // namespace accel::models

#endif  // ACCEL_MODELS_PARALLEL_OPTIONS_H_
