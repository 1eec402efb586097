// tests/server/server_process.h: runs the real accel-serve binary on a
// loopback port for integration tests and benchmarks, and makes the small
// model it serves.
//
//   auto server = ServerProcess::Start(TestModelDir(), {"--max_queue=4"});
//   ASSERT_TRUE(server.ok()) << server.status();
//   auto stub = accel::v1::Generation::NewStub((*server)->Channel());
#ifndef ACCEL_TESTS_SERVER_SERVER_PROCESS_H_
#define ACCEL_TESTS_SERVER_SERVER_PROCESS_H_

#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <memory>
#include <optional>
#include <poll.h>
#include <signal.h>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "grpc/health/v1/health.grpc.pb.h"

namespace accel::testing {

inline std::string BinDir() {
  const char* dir = std::getenv("ACCEL_BIN_DIR");
  return dir != nullptr ? dir : "build/bin";
}

// Runs a command; its exit status (0 on success).
inline int RunCommand(const std::string& command) { return std::system(command.c_str()); }

// A small llama model with a tokenizer.json, made once per test binary.
inline const std::string& TestModelDir() {
  static const std::string* dir = [] {
    char pattern[] = "/tmp/accel-serve-test-XXXXXX";
    const char* made = mkdtemp(pattern);
    auto* path = new std::string(std::string(made != nullptr ? made : "/tmp") + "/model");
    const std::string command =
        absl::StrCat(BinDir(), "/accel-make-model ", *path,
                     " --family llama --num_layers 2 --hidden_size 64 --num_kv_heads 2"
                     " --max_position_embeddings 256 --seed 3 > /dev/null");
    if (RunCommand(command) != 0) std::fprintf(stderr, "failed: %s\n", command.c_str());
    return path;
  }();
  return *dir;
}

class ServerProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::string& model_dir, std::vector<std::string> extra_args,
      absl::Duration timeout = absl::Seconds(60), bool wait_ready = true) {
    std::vector<std::string> args = {BinDir() + "/accel-serve", "--host=127.0.0.1", "--port=0",
                                     "--metrics_port=0"};
    if (!model_dir.empty()) args.push_back("--model=" + model_dir);
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    std::unique_ptr<ServerProcess> server(new ServerProcess());
    char stderr_pattern[] = "/tmp/accel-serve-stderr-XXXXXX";
    const int stderr_fd = mkstemp(stderr_pattern);
    server->stderr_path_ = stderr_pattern;
    int out[2];
    if (stderr_fd < 0 || pipe(out) != 0) return absl::InternalError("pipe/mkstemp failed");
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(out[1], STDOUT_FILENO);
      dup2(stderr_fd, STDERR_FILENO);
      close(out[0]);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    close(stderr_fd);
    server->pid_ = pid;
    server->stdout_fd_ = out[0];
    // Read stdout until "accel-serve: listening grpc=H:P metrics=H:M".
    std::string line;
    const absl::Time end = absl::Now() + timeout;
    while (line.find('\n') == std::string::npos) {
      pollfd p = {out[0], POLLIN, 0};
      const int left = static_cast<int>(absl::ToInt64Milliseconds(end - absl::Now()));
      if (left <= 0 || poll(&p, 1, left) <= 0) {
        return absl::DeadlineExceededError("accel-serve did not announce its ports: " +
                                           server->Stderr());
      }
      char buffer[256];
      const ssize_t n = read(out[0], buffer, sizeof(buffer));
      if (n <= 0) return absl::InternalError("accel-serve exited early: " + server->Stderr());
      line.append(buffer, static_cast<size_t>(n));
    }
    const size_t grpc = line.find("grpc=");
    const size_t metrics = line.find(" metrics=");
    if (grpc == std::string::npos || metrics == std::string::npos) {
      return absl::InternalError("unexpected stdout line: " + line);
    }
    const std::string grpc_address = line.substr(grpc + 5, metrics - grpc - 5);
    const std::string metrics_address = line.substr(metrics + 9, line.find('\n') - metrics - 9);
    if (!absl::SimpleAtoi(grpc_address.substr(grpc_address.rfind(':') + 1), &server->grpc_port_) ||
        !absl::SimpleAtoi(metrics_address.substr(metrics_address.rfind(':') + 1),
                          &server->metrics_port_)) {
      return absl::InternalError("cannot read the ports from: " + line);
    }
    if (wait_ready && !server->WaitForHealth("accel.ready", end)) {
      return absl::DeadlineExceededError("accel-serve did not become ready: " + server->Stderr());
    }
    return server;
  }

  ~ServerProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (stdout_fd_ >= 0) close(stdout_fd_);
    std::error_code ignored;
    std::filesystem::remove(stderr_path_, ignored);
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", grpc_port_); }
  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  std::shared_ptr<grpc::Channel> Channel() const {
    return grpc::CreateChannel(address(), grpc::InsecureChannelCredentials());
  }

  // The health service's answer for `service`: SERVING, NOT_SERVING, or the
  // gRPC error (NOT_FOUND for an unknown name).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(
      const std::string& service) const {
    auto stub = grpc::health::v1::Health::NewStub(Channel());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    grpc::Status status = stub->Check(&context, request, &response);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    return response.status();
  }

  bool WaitForHealth(const std::string& service, absl::Time until) const {
    while (absl::Now() < until) {
      auto status = Health(service);
      if (status.ok() && *status == grpc::health::v1::HealthCheckResponse::SERVING) return true;
      if (exited_) return false;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  }

  void Signal(int signal) const { kill(pid_, signal); }

  // The exit code (or -signal), or nullopt if it still runs after `timeout`.
  std::optional<int> Wait(absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (true) {
      int status = 0;
      const pid_t done = waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
      if (absl::Now() >= end) return std::nullopt;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  std::string Stderr() const {
    std::string text;
    if (FILE* f = std::fopen(stderr_path_.c_str(), "r")) {
      char buffer[4096];
      size_t n;
      while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) text.append(buffer, n);
      std::fclose(f);
    }
    return text;
  }

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  bool exited_ = false;
  std::string stderr_path_;
  int grpc_port_ = 0;
  int metrics_port_ = -1;
};

}  // namespace accel::testing

#endif  // ACCEL_TESTS_SERVER_SERVER_PROCESS_H_
