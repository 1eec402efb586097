#include "train/internal/supervisor.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

extern char** environ;

namespace accel::train::internal {
namespace {

std::atomic<int> g_signal{0};

void OnSignal(int sig) { g_signal.store(sig); }

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

}  // namespace

int Supervise(const std::vector<ChildSpec>& specs, int grace_seconds) {
  struct sigaction action {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &action, nullptr);

  std::vector<Child> children(specs.size());
  bool start_failed = false;
  for (size_t i = 0; i < specs.size(); ++i) {
    std::map<std::string, std::string> vars;
    for (char** e = environ; *e != nullptr; ++e) {
      const char* eq = std::strchr(*e, '=');
      if (eq != nullptr) vars[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
    }
    for (const auto& [k, v] : specs[i].env_additions) vars[k] = v;
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = specs[i].argv;
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setpgroup(&attr, 0);  // its own group: signals reach its children too
    sigset_t defaults;
    sigemptyset(&defaults);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&defaults, sig);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF);
    pid_t pid = -1;
    const int rc = ::posix_spawnp(&pid, argv[0], nullptr, &attr, argv.data(), envp.data());
    posix_spawnattr_destroy(&attr);
    if (rc != 0) {
      std::fprintf(stderr, "accel-launch: cannot start %s (%s): %s\n", specs[i].label.c_str(),
                   specs[i].argv[0].c_str(), std::strerror(rc));
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
      if (r == 0) {
        any = true;
        continue;
      }
      c.running = false;
      c.code = WIFEXITED(status)     ? WEXITSTATUS(status)
               : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                     : 1;
      if (c.code != 0 && !stopping) {
        if (WIFSIGNALED(status)) {
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
      std::fprintf(stderr, "accel-launch: ranks still running %d s after SIGTERM; killing them\n",
                   grace_seconds);
      SignalAll(children, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (result == 0 && received != 0) result = 128 + received;
  return result;
}

}  // namespace accel::train::internal
