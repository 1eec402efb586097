// dist/env.h: who this process is in a distributed run, read from the
// environment that torchrun, accel-launch, mpirun or SLURM set. Shared by the
// training library and tensor / pipeline parallel serving.
//
//   ACCEL_ASSIGN_OR_RETURN(ProcessEnvironment env, DetectProcessEnvironment(ProcessEnv()));
//   if (env.world_size > 1) ... connect a ProcessGroup (process_group.h)
#ifndef ACCEL_DIST_ENV_H_
#define ACCEL_DIST_ENV_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::dist {

// Reads one environment variable; nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
// The real environment (getenv).
EnvLookup ProcessEnv();

struct ProcessEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Who started us: "none", "torchrun" (accel-launch sets the same variables),
  // "mpi" (PMI_*, OMPI_COMM_WORLD_*, MV2_COMM_WORLD_*) or "slurm" (SLURM_PROCID...).
  std::string launcher = "none";
  bool use_cpu = false;  // ACCELERATE_USE_CPU / ACCEL_USE_CPU is true
  // GLOO_SOCKET_IFNAME, read here because libtorch's C++ side ignores it.
  std::string gloo_socket_ifname;
};

// Reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR /
// MASTER_PORT, falling back to the MPI and SLURM variables (Accelerate's
// tables; SLURM: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
// SLURM_NTASKS_PER_NODE). InvalidArgument naming the variable for a value
// that is not a number, a rank outside [0, world_size), or a multi-node run
// (world_size > local_world_size) without MASTER_ADDR.
absl::StatusOr<ProcessEnvironment> DetectProcessEnvironment(const EnvLookup& env);

}  // namespace accel::dist

#endif  // ACCEL_DIST_ENV_H_
