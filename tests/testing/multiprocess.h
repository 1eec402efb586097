// Runs a test's worker in N real processes (ranks of one distributed job).
//
// The test binary re-executes itself (/proc/self/exe) with a gtest filter
// that selects a worker test and the torchrun variables set; the worker test
// skips itself unless ACCEL_TEST_WORKER is set:
//
//   TEST(AllReduceWorker, Run) {
//     if (!accel::test::IsWorker()) GTEST_SKIP() << "runs as a rank of AllReduce.TwoRanks";
//     ... collective code; ASSERT/EXPECT failures make the rank exit non-zero
//   }
//   TEST(AllReduce, TwoRanks) {
//     EXPECT_THAT(accel::test::RunRanks(2, "AllReduceWorker.Run"), Each(0));
//   }
#ifndef ACCEL_TESTS_TESTING_MULTIPROCESS_H_
#define ACCEL_TESTS_TESTING_MULTIPROCESS_H_

#include <chrono>
#include <cstdlib>
#include <map>
#include <signal.h>
#include <spawn.h>
#include <string>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <netinet/in.h>

extern char** environ;

namespace accel::test {

inline bool IsWorker() { return std::getenv("ACCEL_TEST_WORKER") != nullptr; }

// A TCP port that was free a moment ago (bind to port 0, read it, close).
inline int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

// Starts `world_size` copies of this binary running `gtest_filter` with
// RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
// and ACCEL_TEST_WORKER=1, plus `extra_env`, and returns their exit codes
// (128 + signal when killed). Every rank is killed after `timeout_s`.
inline std::vector<int> RunRanks(int world_size, const std::string& gtest_filter,
                                 const std::map<std::string, std::string>& extra_env = {},
                                 int timeout_s = 120) {
  const int port = FreePort();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world_size; ++rank) {
    std::map<std::string, std::string> vars;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv(*e);
      size_t eq = kv.find('=');
      if (eq != std::string::npos) vars[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    vars["RANK"] = std::to_string(rank);
    vars["LOCAL_RANK"] = std::to_string(rank);
    vars["WORLD_SIZE"] = std::to_string(world_size);
    vars["LOCAL_WORLD_SIZE"] = std::to_string(world_size);
    vars["MASTER_ADDR"] = "127.0.0.1";
    vars["MASTER_PORT"] = std::to_string(port);
    vars["ACCEL_TEST_WORKER"] = "1";
    vars["OMP_NUM_THREADS"] = "1";
    for (const auto& [k, v] : extra_env) vars[k] = v;
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    std::string filter = "--gtest_filter=" + gtest_filter;
    std::vector<char*> argv = {exe.data(), filter.data(), nullptr};
    pid_t pid = -1;
    if (::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data()) != 0) {
      pid = -1;
    }
    pids.push_back(pid);
  }
  std::vector<int> codes(world_size, -1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int remaining = 0;
  for (pid_t p : pids) remaining += p > 0 ? 1 : 0;
  while (remaining > 0) {
    for (int r = 0; r < world_size; ++r) {
      if (pids[r] <= 0 || codes[r] != -1) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        --remaining;
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world_size; ++r) {
        if (pids[r] > 0 && codes[r] == -1) ::kill(pids[r], SIGKILL);
      }
    }
    if (remaining > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return codes;
}

}  // namespace accel::test

#endif  // ACCEL_TESTS_TESTING_MULTIPROCESS_H_
