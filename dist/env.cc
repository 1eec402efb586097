#include "dist/env.h"

#include <cstdlib>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace accel::dist {

EnvLookup ProcessEnv() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

namespace {

// The first of `names` that is set, parsed as an integer; nullopt if none is.
absl::StatusOr<std::optional<int>> FirstInt(const EnvLookup& env,
                                            const std::vector<std::string>& names,
                                            std::string* which) {
  for (const std::string& name : names) {
    std::optional<std::string> v = env(name);
    if (!v) continue;
    int n = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*v), &n)) {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable ", name, "=\"", *v, "\" is not an integer"));
    }
    if (which != nullptr) *which = name;
    return std::optional<int>(n);
  }
  return std::optional<int>();
}

bool Truthy(const std::optional<std::string>& v) {
  if (!v) return false;
  const std::string s = absl::AsciiStrToLower(*v);
  return s == "1" || s == "true" || s == "yes";
}

}  // namespace

absl::StatusOr<ProcessEnvironment> DetectProcessEnvironment(const EnvLookup& env) {
  ProcessEnvironment out;
  std::string rank_var, size_var, local_var, local_size_var;
  // torchrun / accel-launch first, then MPI (Accelerate's tables), then SLURM.
  const std::vector<std::string> kRank = {"RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK",
                                          "MV2_COMM_WORLD_RANK", "SLURM_PROCID"};
  const std::vector<std::string> kSize = {"WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                          "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS"};
  const std::vector<std::string> kLocal = {"LOCAL_RANK", "MPI_LOCALRANKID",
                                           "OMPI_COMM_WORLD_LOCAL_RANK",
                                           "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"};
  const std::vector<std::string> kLocalSize = {
      "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
      "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"};
  std::optional<int> rank, size, local, local_size;
  {
    absl::StatusOr<std::optional<int>> v = FirstInt(env, kRank, &rank_var);
    if (!v.ok()) return v.status();
    rank = *v;
    v = FirstInt(env, kSize, &size_var);
    if (!v.ok()) return v.status();
    size = *v;
    v = FirstInt(env, kLocal, &local_var);
    if (!v.ok()) return v.status();
    local = *v;
    v = FirstInt(env, kLocalSize, &local_size_var);
    if (!v.ok()) return v.status();
    local_size = *v;
  }
  if (size) {
    if (*size < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable ", size_var, "=", *size, ": must be at least 1"));
    }
    out.world_size = *size;
  }
  if (rank) {
    if (*rank < 0 || *rank >= out.world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable ", rank_var, "=", *rank, " is outside [0, ",
                       out.world_size, ") (", size_var.empty() ? "WORLD_SIZE" : size_var, ")"));
    }
    out.rank = *rank;
  }
  out.local_world_size = local_size ? *local_size : out.world_size;
  if (out.local_world_size < 1 || out.local_world_size > out.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", local_size_var, "=",
                                                   out.local_world_size, " is outside [1, ",
                                                   out.world_size, "]"));
  }
  out.local_rank = local ? *local : out.rank % out.local_world_size;
  if (out.local_rank < 0 || out.local_rank >= out.local_world_size) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", local_var, "=",
                                                   out.local_rank, " is outside [0, ",
                                                   out.local_world_size, ")"));
  }
  if (rank_var == "RANK" || size_var == "WORLD_SIZE") {
    out.launcher = "torchrun";
  } else if (rank_var.rfind("SLURM", 0) == 0) {
    out.launcher = "slurm";
  } else if (!rank_var.empty() || !size_var.empty()) {
    out.launcher = "mpi";
  }

  std::optional<std::string> addr = env("MASTER_ADDR");
  if (addr && !addr->empty()) {
    out.master_addr = *addr;
  } else if (out.world_size > out.local_world_size) {
    return absl::InvalidArgumentError(
        "a multi-node run (WORLD_SIZE > LOCAL_WORLD_SIZE) needs MASTER_ADDR, the address of the "
        "machine of rank 0");
  }
  if (std::optional<std::string> port = env("MASTER_PORT")) {
    int p = 0;
    if (!absl::SimpleAtoi(*port, &p) || p < 1 || p > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable MASTER_PORT=\"", *port, "\" is not a port (1-65535)"));
    }
    out.master_port = p;
  }
  out.use_cpu = Truthy(env("ACCELERATE_USE_CPU")) || Truthy(env("ACCEL_USE_CPU"));
  if (std::optional<std::string> ifname = env("GLOO_SOCKET_IFNAME")) {
    out.gloo_socket_ifname = *ifname;
  }
  return out;
}

}  // namespace accel::dist
