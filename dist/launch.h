// Where a process of a tensor / pipeline-parallel run stands in its group,
// and the workers it starts on its own machine (issue 36, item 3): shared by
// accel-serve and accel-generate (below engine/ and server/, so both reach
// it).
//
// On one machine `accel-serve --tensor_parallel_size N` is the leader (rank
// 0) and starts ranks 1..N-1 itself: the same binary and flags, with
// torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) set. Across machines each node runs one
// accel-serve with torchrun's flags (--nnodes, --node_rank, --master_addr,
// --master_port), which starts that node's ranks; or a launcher (accel-launch,
// torchrun, a LeaderWorkerSet pod per rank) sets the variables and every
// process is one rank. Rank 0 serves gRPC, HTTP and metrics; the others
// serve health only and run the steps rank 0 sends.
//
// Torch-free.
#ifndef ACCEL_DIST_LAUNCH_H_
#define ACCEL_DIST_LAUNCH_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <sys/types.h>
#include <vector>

#include "absl/status/statusor.h"

namespace accel::dist {

struct ParallelFlags {
  int tensor_parallel_size = 1;
  int pipeline_parallel_size = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;  // empty: 127.0.0.1 on one node
  int master_port = 29500;
};

struct RankLayout {
  int world_size = 1;
  int rank = 0;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // The ranks this process starts on its machine (its node's others), with
  // the variables each gets; empty when a launcher started every rank.
  std::vector<std::map<std::string, std::string>> to_start;

  bool leader() const { return rank == 0; }
};

// Reads one environment variable; nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// The layout from the flags, or from the environment when a launcher set
// WORLD_SIZE (then this process is RANK and starts nobody). InvalidArgument
// naming the flag: sizes below 1, --nnodes not dividing the ranks,
// --node_rank outside [0, nnodes), several nodes without --master_addr, a
// port outside [1, 65535], WORLD_SIZE that is not tensor x pipeline size;
absl::StatusOr<RankLayout> ResolveRankLayout(const ParallelFlags& flags, const EnvLookup& env);

// The ranks this process started, watched. Each dies with SIGKILL when this
// process dies (PR_SET_PDEATHSIG), and gets SIGTERM, then SIGKILL after a
// grace period, when this object goes.
class LocalWorkers {
 public:
  // Starts `program` with `argv` (argv[0] included) once per entry of
  // `environments`, each over this process's environment. The error names
  // the rank that could not start (the ones already started are stopped).
  static absl::StatusOr<std::unique_ptr<LocalWorkers>> Start(
      const std::string& program, const std::vector<std::string>& argv,
      const std::vector<std::map<std::string, std::string>>& environments);
  ~LocalWorkers();

  // nullopt while every worker runs; otherwise what happened to the first
  // that exited, was killed or was stopped (SIGSTOP), naming its rank and pid.
  std::optional<std::string> Failure();
  const std::vector<pid_t>& pids() const { return pids_; }

 private:
  LocalWorkers() = default;
  std::vector<pid_t> pids_;
  std::vector<std::string> labels_;
  std::vector<bool> reaped_;
  std::optional<std::string> failure_;
};

}  // namespace accel::dist

#endif  // ACCEL_DIST_LAUNCH_H_
