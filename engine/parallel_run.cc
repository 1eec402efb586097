#include "engine/parallel_run.h"

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "core/status.h"
#include "dist/env.h"
#include "loader/config.h"
#include "models/tensor_parallel.h"

namespace accel::engine {

absl::Status CheckParallelSplit(const EngineOptions& options) {
  ACCEL_ASSIGN_OR_RETURN(loader::ModelConfig config,
                         loader::ReadModelConfig(options.model_dir + "/config.json"));
  ACCEL_RETURN_IF_ERROR(models::CheckTensorParallel(config, options.parallel.tensor_parallel_size));
  return models::CheckPipelineParallel(config, options.parallel.pipeline_parallel_size);
}

absl::Status StartLocalRanks(const dist::RankLayout& layout,
                             const std::vector<std::string>& command_line, ParallelRun& run) {
  if (layout.to_start.empty()) return absl::OkStatus();
  ACCEL_ASSIGN_OR_RETURN(
      run.workers, dist::LocalWorkers::Start("/proc/self/exe", command_line, layout.to_start));
  return absl::OkStatus();
}

absl::Status JoinParallelGroups(const dist::RankLayout& layout, EngineOptions& options,
                                ParallelRun& run) {
  dist::ProcessEnvironment env;
  env.rank = layout.rank;
  env.world_size = layout.world_size;
  env.local_rank = layout.local_rank;
  env.local_world_size = layout.local_world_size;
  env.master_addr = layout.master_addr;
  env.master_port = layout.master_port;
  env.launcher = "torchrun";
  dist::ProcessGroupOptions group_options;
  group_options.timeout = options.parallel_timeout;
  absl::StatusOr<std::unique_ptr<dist::ProcessGroup>> connected =
      dist::ProcessGroup::Connect(env, group_options);
  if (!connected.ok()) {
    return Annotate(connected.status(), absl::StrCat("rank ", layout.rank, " of ",
                                                     layout.world_size, ": joining the group at ",
                                                     layout.master_addr, ":", layout.master_port));
  }
  run.group = *std::move(connected);
  // The stages' tensor-parallel groups (every rank makes them together).
  absl::StatusOr<models::TensorParallel> place = models::JoinParallelGroups(
      *run.group, options.parallel.tensor_parallel_size, &run.stage_group);
  if (!place.ok()) return Annotate(place.status(), absl::StrCat("rank ", layout.rank));
  place->pipeline_micro_batches = options.pipeline_micro_batches;
  if (layout.leader()) {
    // Idle workers hear from the leader well within the group's timeout.
    place->heartbeat_ms = absl::ToInt64Milliseconds(options.parallel_timeout) / 4;
  }
  options.load.tensor_parallel = *place;
  return absl::OkStatus();
}

}  // namespace accel::engine
