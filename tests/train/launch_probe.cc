// A program for accel-launch's tests to launch:
//   launch_probe env OUTDIR [ARGS...]    writes OUTDIR/rank_<RANK>.txt (KEY=VALUE lines for the
//                                        launcher's variables, CPUS=<the CPUs it may run on,
//                                        comma-separated>, then ARG=<arg> per extra
//                                        argument), exits 0
//   launch_probe crash R CODE OUTDIR     writes OUTDIR/pid_<RANK>; rank R exits with CODE
//                                        after 0.2 s (CODE "sig:N": it kills itself with signal
//                                        N), the others sleep 60 s
//   launch_probe stubborn R CODE OUTDIR  as crash, but every rank ignores SIGTERM
//   launch_probe signal OUTDIR           writes OUTDIR/ready_<RANK>, then waits; SIGTERM,
//                                        SIGINT or SIGHUP makes it write OUTDIR/got_<RANK> (the
//                                        signal number) and exit 0
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sched.h>
#include <signal.h>
#include <string>
#include <unistd.h>

namespace {

std::string g_outdir;
std::string g_rank;

void OnSignal(int sig) {
  std::ofstream(g_outdir + "/got_" + g_rank) << sig << "\n";
  _exit(0);
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const std::string mode = argv[1];
  g_rank = Env("RANK");
  if (mode == "env") {
    const std::string path = std::string(argv[2]) + "/rank_" + g_rank + ".txt";
    {
      std::ofstream out(path + ".tmp");
      for (const char* k : {"RANK",
                            "LOCAL_RANK",
                            "WORLD_SIZE",
                            "LOCAL_WORLD_SIZE",
                            "GROUP_RANK",
                            "GROUP_WORLD_SIZE",
                            "ROLE_RANK",
                            "MASTER_ADDR",
                            "MASTER_PORT",
                            "TORCHELASTIC_RESTART_COUNT",
                            "ACCELERATE_MIXED_PRECISION",
                            "ACCELERATE_USE_CPU",
                            "ACCELERATE_DEBUG_MODE",
                            "CUDA_VISIBLE_DEVICES",
                            "OMP_NUM_THREADS",
                            "ACCEL_LAUNCHER",
                            "ACCEL_PROBE_MARK",
                            "ACCELERATE_CPU_AFFINITY",
                            "ACCELERATE_USE_FSDP",
                            "FSDP_SHARDING_STRATEGY",
                            "FSDP_TRANSFORMER_CLS_TO_WRAP"}) {
        out << k << "=" << Env(k) << "\n";
      }
      cpu_set_t cpus;
      CPU_ZERO(&cpus);
      std::string list;
      if (::sched_getaffinity(0, sizeof(cpus), &cpus) == 0) {
        for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
          if (CPU_ISSET(cpu, &cpus)) list += (list.empty() ? "" : ",") + std::to_string(cpu);
        }
      }
      out << "CPUS=" << list << "\n";
      for (int i = 3; i < argc; ++i) out << "ARG=" << argv[i] << "\n";
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
    return 0;
  }
  if ((mode == "crash" || mode == "stubborn") && argc >= 5) {
    if (mode == "stubborn") ::signal(SIGTERM, SIG_IGN);  // only SIGKILL stops it
    std::ofstream(std::string(argv[4]) + "/pid_" + g_rank) << ::getpid() << "\n";
    if (g_rank == argv[2]) {
      ::usleep(200 * 1000);
      if (std::strncmp(argv[3], "sig:", 4) == 0) {
        ::kill(::getpid(), std::atoi(argv[3] + 4));
        ::pause();
      }
      return std::atoi(argv[3]);
    }
    ::sleep(60);
    return 0;
  }
  if (mode == "signal") {
    g_outdir = argv[2];
    for (int sig : {SIGTERM, SIGINT, SIGHUP}) ::signal(sig, OnSignal);
    std::ofstream(g_outdir + "/ready_" + g_rank) << ::getpid() << "\n";
    ::sleep(60);
    return 3;
  }
  return 2;
}
