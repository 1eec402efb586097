// engine/parallel_run.h: joining one model's run over several processes
// (--tensor_parallel_size / --pipeline_parallel_size), the same for every
// tool that runs the engine (accel-serve, accel-generate): what cannot split
// refused by name before a process starts, this machine's other ranks
// started, the group and the stages' tensor-parallel groups joined, and this
// rank's place put into the load options.
//
//   ACCEL_ASSIGN_OR_RETURN(dist::RankLayout layout,
//                          dist::ResolveRankLayout(options.parallel, dist::ProcessEnv()));
//   ParallelRun run;
//   if (layout.world_size > 1) {
//     ACCEL_RETURN_IF_ERROR(CheckParallelSplit(options));
//     ACCEL_RETURN_IF_ERROR(StartLocalRanks(layout, command_line, run));
//     ACCEL_RETURN_IF_ERROR(JoinParallelGroups(layout, options, run));
//     if (!layout.leader()) ... load options.load's slice and run the leader's steps ...
//   }
#ifndef ACCEL_ENGINE_PARALLEL_RUN_H_
#define ACCEL_ENGINE_PARALLEL_RUN_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"

#include "dist/launch.h"
#include "dist/process_group.h"
#include "engine/llm_engine.h"

namespace accel::engine {

// What a rank of a parallel run holds while it runs. Declare it before the
// engine, so that the engine (whose leader stops the workers) goes first.
struct ParallelRun {
  std::unique_ptr<dist::LocalWorkers> workers;  // the ranks this process started
  std::unique_ptr<dist::ProcessGroup> group;    // every rank
  std::unique_ptr<dist::ProcessGroup> stage_group;
};

// InvalidArgument (Unimplemented for a family not split yet) naming the
// field when the model in options.model_dir cannot split as asked.
absl::Status CheckParallelSplit(const EngineOptions& options);

// Rank 0 of a machine: starts its other ranks (this binary, `command_line`).
absl::Status StartLocalRanks(const dist::RankLayout& layout,
                             const std::vector<std::string>& command_line, ParallelRun& run);

// Joins the group (bounded by options.parallel_timeout) and the stages'
// groups, and puts this rank's place in options.load.tensor_parallel (the
// leader's with heartbeats every quarter of the timeout). Unavailable,
// naming the rank and the rendezvous, when the group cannot be joined.
absl::Status JoinParallelGroups(const dist::RankLayout& layout, EngineOptions& options,
                                ParallelRun& run);

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_PARALLEL_RUN_H_
