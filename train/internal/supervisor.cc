#include "train/internal/supervisor.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace accel::train::internal {
namespace {

std::atomic<int> g_signal{0};

void OnSignal(int sig) { g_signal.store(sig); }

constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP};

struct Child {
  pid_t pid = -1;
  bool running = false;
  int code = 0;
};

void SignalAll(const std::vector<Child>& children, int sig) {
  for (const Child& c : children) {
    if (c.running) ::kill(-c.pid, sig);  // the child's whole process group
  }
}

// Everything execve needs, built before fork: the child only calls
// async-signal-safe functions.
struct Exec {
  std::vector<std::string> strings;  // argv then envp, owned
  std::vector<char*> argv;
  std::vector<char*> envp;
  std::string program;
  cpu_set_t cpus;  // valid when pin_cpus
  bool pin_cpus = false;
};

Exec Prepare(const ChildSpec& spec) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq != nullptr) vars[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  for (const auto& [k, v] : spec.env_additions) vars[k] = v;
  Exec x;
  x.strings = spec.argv;
  for (const auto& [k, v] : vars) x.strings.push_back(absl::StrCat(k, "=", v));
  for (size_t i = 0; i < x.strings.size(); ++i) {
    (i < spec.argv.size() ? x.argv : x.envp).push_back(x.strings[i].data());
  }
  x.argv.push_back(nullptr);
  x.envp.push_back(nullptr);
  x.program = spec.program;
  CPU_ZERO(&x.cpus);
  for (int cpu : spec.cpus) {
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &x.cpus);
  }
  x.pin_cpus = CPU_COUNT(&x.cpus) > 0;
  return x;
}

// Starts `x` in its own process group. Returns the pid, or -errno when the
// program could not be executed (reported through a close-on-exec pipe).
pid_t Start(Exec& x) {
  int report[2];
  if (::pipe2(report, O_CLOEXEC) != 0) return -errno;
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    ::close(report[0]);
    ::close(report[1]);
    return -err;
  }
  if (pid == 0) {
    ::close(report[0]);
    ::setpgid(0, 0);  // its own group: signals reach the rank's children too
    // A launcher killed outright (SIGKILL, OOM) must not leave ranks behind.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(128 + SIGTERM);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (int sig : kForwarded) ::sigaction(sig, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    // Pinned before exec, so the program and every thread it starts stay
    // on the rank's CPUs; a failure is reported as a failed start.
    if (x.pin_cpus && ::sched_setaffinity(0, sizeof(x.cpus), &x.cpus) != 0) {
      const int err = errno;
      (void)!::write(report[1], &err, sizeof(err));
      ::_exit(127);
    }
    if (x.program.empty()) {
      ::execvpe(x.argv[0], x.argv.data(), x.envp.data());
    } else {
      ::execve(x.program.c_str(), x.argv.data(), x.envp.data());
    }
    const int err = errno;
    (void)!::write(report[1], &err, sizeof(err));
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here, so a signal sent right away finds the group
  ::close(report[1]);
  int err = 0;
  ssize_t n;
  do {
    n = ::read(report[0], &err, sizeof(err));
  } while (n < 0 && errno == EINTR);
  ::close(report[0]);
  if (n == static_cast<ssize_t>(sizeof(err))) {
    ::waitpid(pid, nullptr, 0);
    return -err;
  }
  return pid;
}

}  // namespace

int Supervise(const std::vector<ChildSpec>& specs, int grace_seconds, double poll_interval_s,
              bool quiet) {
  struct sigaction action {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  for (int sig : kForwarded) ::sigaction(sig, &action, nullptr);
  const auto poll = std::chrono::microseconds(
      std::max<int64_t>(1000, static_cast<int64_t>(poll_interval_s * 1e6)));

  std::vector<Child> children(specs.size());
  bool start_failed = false;
  for (size_t i = 0; i < specs.size() && g_signal.load() == 0; ++i) {
    Exec x = Prepare(specs[i]);
    const pid_t pid = Start(x);
    if (pid < 0) {
      std::fprintf(stderr, "accel-launch: cannot start %s (%s): %s\n", specs[i].label.c_str(),
                   specs[i].argv[0].c_str(), std::strerror(static_cast<int>(-pid)));
      start_failed = true;
      break;
    }
    children[i].pid = pid;
    children[i].running = true;
  }

  int result = start_failed ? 1 : 0;
  bool stopping = start_failed;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(grace_seconds);
  if (stopping) SignalAll(children, SIGTERM);
  int received = 0;
  bool killed = false;
  while (true) {
    bool any = false;
    for (size_t i = 0; i < children.size(); ++i) {
      Child& c = children[i];
      if (!c.running) continue;
      int status = 0;
      const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) {
        any = true;
        continue;
      }
      c.running = false;
      if (r < 0) continue;  // not ours any more (cannot happen); nothing to report
      c.code = WIFEXITED(status)     ? WEXITSTATUS(status)
               : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                     : 1;
      if (c.code != 0 && !stopping) {
        if (quiet) {
          // The rank's own output stands alone.
        } else if (WIFSIGNALED(status)) {
          std::fprintf(stderr,
                       "accel-launch: %s (pid %d) was killed by signal %d (%s); stopping "
                       "the other ranks\n",
                       specs[i].label.c_str(), c.pid, WTERMSIG(status),
                       strsignal(WTERMSIG(status)));
        } else {
          std::fprintf(stderr,
                       "accel-launch: %s (pid %d) exited with code %d; stopping the "
                       "other ranks\n",
                       specs[i].label.c_str(), c.pid, c.code);
        }
        result = c.code;
        stopping = true;
        deadline = std::chrono::steady_clock::now() + std::chrono::seconds(grace_seconds);
        SignalAll(children, SIGTERM);
      }
    }
    if (!any) break;
    if (const int sig = g_signal.exchange(0); sig != 0) {
      received = sig;
      SignalAll(children, sig);
      if (!stopping) {
        stopping = true;
        deadline = std::chrono::steady_clock::now() + std::chrono::seconds(grace_seconds);
      }
    }
    if (stopping && !killed && std::chrono::steady_clock::now() > deadline) {
      if (!quiet)
        std::fprintf(stderr, "accel-launch: ranks still running %d s after SIGTERM; killing them\n",
                     grace_seconds);
      SignalAll(children, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(poll);
  }
  if (const int sig = g_signal.exchange(0); sig != 0 && received == 0) received = sig;
  if (result == 0 && received != 0) result = 128 + received;
  return result;
}

}  // namespace accel::train::internal
