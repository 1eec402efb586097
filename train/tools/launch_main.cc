// accel-launch [--num_processes N] [--num_machines M --machine_rank R
//     --main_process_ip IP --main_process_port P] [--config_file F]
//     [--cpu | --multi_gpu | --use_fsdp [--fsdp_* V...]] [--mixed_precision no|fp16|bf16]
//     [--num_cpu_threads_per_process T] [--monitor_interval S] [--gpu_ids IDS]
//     [--enable_cpu_affinity] [--debug] [--quiet] [--no_python] PROGRAM ARGS...
//
// Starts this machine's share of a distributed job with torchrun's
// environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, ...), forwards signals to every rank, and when one rank
// fails stops the others and exits with its code.
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <sched.h>
#include <string>
#include <sys/socket.h>
#include <unistd.h>
#include <vector>

#include <netinet/in.h>

#include "absl/strings/str_cat.h"

#include "train/internal/supervisor.h"
#include "train/launch_config.h"

extern char** environ;

namespace {

constexpr char kUsage[] =
    "usage: accel-launch [--num_processes N] [--num_machines M --machine_rank R\n"
    "         --main_process_ip IP --main_process_port P [--same_network]\n"
    "         [--rdzv_backend static]] [--config_file F]\n"
    "         [--cpu | --multi_gpu | --use_fsdp [--fsdp_sharding_strategy S ...]]\n"
    "         [--mixed_precision no|fp16|bf16] [--num_cpu_threads_per_process T]\n"
    "         [--monitor_interval S] [--gpu_ids IDS] [--enable_cpu_affinity] [--debug]\n"
    "         [--quiet] [--no_python] [--] PROGRAM ARGS...\n"
    "Starts num_processes / num_machines copies of PROGRAM (found in PATH) with torchrun's\n"
    "environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...).\n"
    "Flags are --name value or --name=value, hyphens or underscores; ARGS pass through.\n"
    "Flags left unset come from SLURM_NNODES / SLURM_NODEID (machines), then the config\n"
    "file (--config_file, $ACCEL_CONFIG_FILE, ${XDG_CACHE_HOME:-~/.cache}/accel/\n"
    "default_config.yaml; see accel-config), else the defaults:\n"
    "1 process, 1 machine, 127.0.0.1:29500. --main_process_port 0 picks a free port.\n"
    "--multi_gpu and --use_fsdp run every rank with ACCELERATE_USE_CPU=false; --use_fsdp\n"
    "exports Accelerate's FSDP_* variables (--fsdp_version, --fsdp_sharding_strategy,\n"
    "--fsdp_auto_wrap_policy, --fsdp_transformer_layer_cls_to_wrap, --fsdp_min_num_params,\n"
    "--fsdp_offload_params, ...). --enable_cpu_affinity pins each rank to its share of\n"
    "the CPUs. --debug: ACCELERATE_DEBUG_MODE, the ranks' collectives check that every\n"
    "rank passes the same shapes. --quiet: no notices of accel-launch's own when a rank\n"
    "fails. --no_python: PROGRAM runs as it is (always so).\n";

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

int Run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq != nullptr) env[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  absl::StatusOr<accel::train::LaunchPlan> plan = accel::train::ParseLaunchArgs(args, env);
  if (!plan.ok()) {
    std::fprintf(stderr, "accel-launch: %s\n%s", std::string(plan.status().message()).c_str(),
                 kUsage);
    return 1;
  }
  if (plan->main_process_port == 0) {
    plan->main_process_port = FreePort();
    if (plan->main_process_port == 0) {
      std::fprintf(stderr, "accel-launch: --main_process_port 0: no free port on 127.0.0.1\n");
      return 1;
    }
  }
  const int cores = accel::train::PhysicalCoreCount();
  std::vector<int> allowed_cpus;
  if (plan->enable_cpu_affinity) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
      for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
        if (CPU_ISSET(cpu, &set)) allowed_cpus.push_back(cpu);
      }
    }
  }
  std::vector<accel::train::internal::ChildSpec> children;
  for (int local = 0; local < plan->local_processes(); ++local) {
    accel::train::internal::ChildSpec child;
    child.argv = plan->command;
    child.program = plan->program_path;
    child.env_additions = accel::train::RankEnvironment(*plan, local, cores, env);
    child.label = absl::StrCat("rank ", child.env_additions["RANK"]);
    child.cpus = accel::train::CpuShare(allowed_cpus, local, plan->local_processes());
    children.push_back(std::move(child));
  }
  return accel::train::internal::Supervise(children, /*grace_seconds=*/5, plan->monitor_interval_s,
                                           plan->quiet);
}

}  // namespace

// As core/tool_main.h (which links libtorch): an escaping exception becomes a
// message and exit code 1, never a crash.
int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel-launch: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "accel-launch: unknown error\n");
  }
  return 1;
}
