#include "dist/launch.h"

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

extern char** environ;

namespace accel::dist {
namespace {

absl::StatusOr<std::optional<int>> IntVariable(const EnvLookup& env, const std::string& name) {
  std::optional<std::string> value = env(name);
  if (!value) return std::optional<int>();
  int n = 0;
  if (!absl::SimpleAtoi(*value, &n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name, "=\"", *value, "\" is not an integer"));
  }
  return std::optional<int>(n);
}

}  // namespace

absl::StatusOr<RankLayout> ResolveRankLayout(const ParallelFlags& flags, const EnvLookup& env) {
  if (flags.tensor_parallel_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tensor_parallel_size must be at least 1, got ", flags.tensor_parallel_size));
  }
  if (flags.pipeline_parallel_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--pipeline_parallel_size must be at least 1, got ", flags.pipeline_parallel_size));
  }
  if (flags.master_port < 1 || flags.master_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--master_port must be in [1, 65535], got ", flags.master_port));
  }
  RankLayout layout;
  layout.world_size = flags.tensor_parallel_size * flags.pipeline_parallel_size;
  layout.master_port = flags.master_port;
  if (!flags.master_addr.empty()) layout.master_addr = flags.master_addr;

  // Started by a launcher (or by our own leader): the environment says who we are.
  absl::StatusOr<std::optional<int>> world = IntVariable(env, "WORLD_SIZE");
  if (!world.ok()) return world.status();
  if (world->has_value()) {
    if (**world != layout.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable WORLD_SIZE=", **world,
                                                     " but --tensor_parallel_size x "
                                                     "--pipeline_parallel_size is ",
                                                     layout.world_size));
    }
    for (const auto& [name, field] : std::vector<std::pair<std::string, int*>>{
             {"RANK", &layout.rank},
             {"LOCAL_RANK", &layout.local_rank},
             {"LOCAL_WORLD_SIZE", &layout.local_world_size}}) {
      absl::StatusOr<std::optional<int>> v = IntVariable(env, name);
      if (!v.ok()) return v.status();
      if (v->has_value()) *field = **v;
    }
    if (!env("LOCAL_WORLD_SIZE")) layout.local_world_size = layout.world_size;
    if (!env("LOCAL_RANK")) layout.local_rank = layout.rank % layout.local_world_size;
    if (layout.rank < 0 || layout.rank >= layout.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable RANK=", layout.rank,
                                                     " is outside [0, ", layout.world_size, ")"));
    }
    if (std::optional<std::string> addr = env("MASTER_ADDR"); addr && !addr->empty()) {
      layout.master_addr = *addr;
    } else if (layout.world_size > layout.local_world_size) {
      return absl::InvalidArgumentError(
          "a multi-node group (WORLD_SIZE > LOCAL_WORLD_SIZE) needs MASTER_ADDR");
    }
    if (std::optional<std::string> port = env("MASTER_PORT")) {
      int p = 0;
      if (!absl::SimpleAtoi(*port, &p) || p < 1 || p > 65535) {
        return absl::InvalidArgumentError(absl::StrCat("environment variable MASTER_PORT=\"", *port,
                                                       "\" is not a port (1-65535)"));
      }
      layout.master_port = p;
    }
    return layout;
  }

  // torchrun's flags: this process is its node's local rank 0 and starts the rest.
  if (flags.nnodes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes must be at least 1, got ", flags.nnodes));
  }
  if (layout.world_size % flags.nnodes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes ", flags.nnodes, " does not divide the ", layout.world_size,
                     " ranks (--tensor_parallel_size x --pipeline_parallel_size)"));
  }
  if (flags.node_rank < 0 || flags.node_rank >= flags.nnodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--node_rank ", flags.node_rank, " is outside [0, ", flags.nnodes, ")"));
  }
  if (flags.nnodes > 1 && flags.master_addr.empty()) {
    return absl::InvalidArgumentError(
        "--nnodes above 1 needs --master_addr (the address of node 0, whose first rank leads)");
  }
  layout.local_world_size = layout.world_size / flags.nnodes;
  layout.rank = flags.node_rank * layout.local_world_size;
  layout.local_rank = 0;
  for (int local = 1; local < layout.local_world_size; ++local) {
    layout.to_start.push_back({{"RANK", std::to_string(layout.rank + local)},
                               {"LOCAL_RANK", std::to_string(local)},
                               {"WORLD_SIZE", std::to_string(layout.world_size)},
                               {"LOCAL_WORLD_SIZE", std::to_string(layout.local_world_size)},
                               {"MASTER_ADDR", layout.master_addr},
                               {"MASTER_PORT", std::to_string(layout.master_port)}});
  }
  return layout;
}

absl::StatusOr<std::unique_ptr<LocalWorkers>> LocalWorkers::Start(
    const std::string& program, const std::vector<std::string>& argv,
    const std::vector<std::map<std::string, std::string>>& environments) {
  std::unique_ptr<LocalWorkers> workers(new LocalWorkers());
  const pid_t parent = ::getpid();
  for (const std::map<std::string, std::string>& additions : environments) {
    std::map<std::string, std::string> vars;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv(*e);
      const size_t eq = kv.find('=');
      if (eq != std::string::npos) vars[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    for (const auto& [k, v] : additions) vars[k] = v;
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp, args;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_copy = argv;
    for (std::string& s : argv_copy) args.push_back(s.data());
    args.push_back(nullptr);
    const auto rank = additions.find("RANK");
    const std::string label =
        absl::StrCat("worker rank ", rank != additions.end() ? rank->second : "?");
    const pid_t pid = ::fork();
    if (pid < 0) {
      return absl::InternalError(
          absl::StrCat("starting ", label, ": fork: ", std::strerror(errno)));
    }
    if (pid == 0) {
      // The worker goes when the leader goes, however it goes.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      // The leader blocks SIGTERM / SIGINT to wait for them; a worker takes defaults.
      sigset_t none;
      sigemptyset(&none);
      ::pthread_sigmask(SIG_SETMASK, &none, nullptr);
      ::execve(program.c_str(), args.data(), envp.data());
      ::_exit(127);
    }
    workers->pids_.push_back(pid);
    workers->labels_.push_back(absl::StrCat(label, " (pid ", pid, ")"));
    workers->reaped_.push_back(false);
  }
  return workers;
}

std::optional<std::string> LocalWorkers::Failure() {
  if (failure_) return failure_;
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (reaped_[i]) continue;
    int status = 0;
    const pid_t got = ::waitpid(pids_[i], &status, WNOHANG | WUNTRACED);
    if (got != pids_[i]) continue;
    if (WIFSTOPPED(status)) {
      failure_ = absl::StrCat(labels_[i], " was stopped (signal ", WSTOPSIG(status), ")");
    } else {
      reaped_[i] = true;
      failure_ = WIFSIGNALED(status)
                     ? absl::StrCat(labels_[i], " was killed by signal ", WTERMSIG(status))
                     : absl::StrCat(labels_[i], " exited with status ", WEXITSTATUS(status));
    }
    return failure_;
  }
  return std::nullopt;
}

LocalWorkers::~LocalWorkers() {
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (!reaped_[i]) {
      ::kill(pids_[i], SIGTERM);
      ::kill(pids_[i], SIGCONT);  // a stopped worker must run to take SIGTERM
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (size_t i = 0; i < pids_.size(); ++i) {
    while (!reaped_[i]) {
      int status = 0;
      const pid_t got = ::waitpid(pids_[i], &status, WNOHANG);
      if (got == pids_[i] || got < 0) {
        reaped_[i] = true;
      } else if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pids_[i], SIGKILL);
        ::waitpid(pids_[i], &status, 0);
        reaped_[i] = true;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
}

}  // namespace accel::dist
