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
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include <arpa/inet.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <netinet/in.h>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/testing/command.h"

namespace accel::testing {

inline std::string BinDir() {
  const char* dir = std::getenv("ACCEL_BIN_DIR");
  return dir != nullptr ? dir : "build/bin";
}

// Runs a command; its exit status (0 on success).
inline int RunCommand(const std::string& command) { return std::system(command.c_str()); }

using ::accel::test::CommandOutput;
using ::accel::test::CommandResult;

// A model made by accel-make-model with `flags`, kept under the build
// folder (test-models/<name>.<accel-make-model's mtime>, so a rebuilt maker
// makes it anew) so the many test processes make it once: it is made in a
// private folder and renamed into place. Its folder's name is `name`.
inline std::string MadeModel(const std::string& name, const std::string& flags) {
  std::error_code stat_error;
  const auto maker_time =
      std::filesystem::last_write_time(BinDir() + "/accel-make-model", stat_error);
  const std::string parent = absl::StrCat(BinDir(), "/../test-models/",
                                          stat_error ? 0 : maker_time.time_since_epoch().count());
  std::filesystem::create_directories(parent, stat_error);
  std::string dir = parent + "/" + name;
  if (std::filesystem::exists(dir + "/config.json")) return dir;
  const std::string staging = absl::StrCat(dir, ".tmp-", getpid());
  const std::string command =
      absl::StrCat(BinDir(), "/accel-make-model ", staging, " ", flags, " > /dev/null");
  if (RunCommand(command) != 0) std::fprintf(stderr, "failed: %s\n", command.c_str());
  std::error_code error;
  std::filesystem::rename(staging, dir, error);  // another process may have won the race
  if (error) std::filesystem::remove_all(staging, error);
  return dir;
}

// A model slow enough (a few ms a step on a cpu) that a long request is
// still running while a test does something else.
inline const std::string& SlowModelDir() {
  static const std::string dir =
      MadeModel("serve-slow",
                "--family llama --num_layers 6 --hidden_size 384 --num_kv_heads 2"
                " --max_position_embeddings 4096 --seed 4");
  return dir;
}

// A small llama model with a tokenizer.json.
inline const std::string& TestModelDir() {
  static const std::string dir =
      MadeModel("serve-small",
                "--family llama --num_layers 2 --hidden_size 64 --num_kv_heads 2"
                " --max_position_embeddings 256 --seed 3");
  return dir;
}

// GET http://127.0.0.1:<port><path>: the whole response (status line,
// headers, body), or an error.
inline absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to port ", port));
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::InternalError("write failed");
  }
  std::string response;
  char buffer[8192];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0)
    response.append(buffer, static_cast<size_t>(n));
  close(fd);
  return response;
}

// The value of one series in a Prometheus text exposition, e.g.
// MetricValue(text, "accel_request_success_total{finished_reason=\"length\"}");
// nullopt when absent.
inline std::optional<double> MetricValue(const std::string& text, const std::string& series) {
  size_t at = 0;
  while ((at = text.find(series + " ", at)) != std::string::npos) {
    if (at == 0 || text[at - 1] == '\n') {
      const size_t start = at + series.size() + 1;
      const std::string value = text.substr(start, text.find('\n', start) - start);
      double parsed = 0;
      if (absl::SimpleAtod(value, &parsed)) return parsed;
      return std::nullopt;
    }
    at += series.size();
  }
  return std::nullopt;
}

class ServerProcess {
 public:
  // `max_open_files` > 0: the process's RLIMIT_NOFILE, soft and hard.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::string& model_dir, std::vector<std::string> extra_args,
      absl::Duration timeout = absl::Seconds(60), bool wait_ready = true, int max_open_files = 0) {
    // One intra-op thread unless a test asks for more: the test models are
    // tiny, and ctest runs tests side by side, where each server's OpenMP
    // workers spinning on every core slowed the others past their 300 ms
    // limits (ServeSchedulingTest.DeadlinesEndRequests, once in CI).
    std::vector<std::string> args = {BinDir() + "/accel-serve", "--host=127.0.0.1", "--port=0",
                                     "--metrics_port=0", "--threads=1"};
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
      argv.reserve(args.size() + 1);
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      if (max_open_files > 0) {
        const rlimit limit = {static_cast<rlim_t>(max_open_files),
                              static_cast<rlim_t>(max_open_files)};
        if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(126);
      }
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
    const size_t metrics_end = line.find_first_of(" \n", metrics + 9);
    const std::string metrics_address = line.substr(metrics + 9, metrics_end - metrics - 9);
    // " http=H:P" when --http_port is on.
    const size_t http = line.find(" http=");
    if (http != std::string::npos) {
      const std::string http_address = line.substr(http + 6, line.find('\n') - http - 6);
      if (!absl::SimpleAtoi(http_address.substr(http_address.rfind(':') + 1),
                            &server->http_port_)) {
        return absl::InternalError("cannot read the HTTP port from: " + line);
      }
    }
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

  // The /metrics text (body only), or an error.
  absl::StatusOr<std::string> Metrics() const {
    absl::StatusOr<std::string> response = HttpGet(metrics_port_, "/metrics");
    if (!response.ok()) return response.status();
    const size_t body = response->find("\r\n\r\n");
    if (body == std::string::npos) return absl::InternalError("no HTTP body");
    return response->substr(body + 4);
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", grpc_port_); }
  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  int http_port() const { return http_port_; }  // 0: --http_port was not given
  pid_t pid() const { return pid_; }
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

  // False when the time passes or the process exits first.
  bool WaitForHealth(const std::string& service, absl::Time until) {
    while (absl::Now() < until) {
      auto status = Health(service);
      if (status.ok() && *status == grpc::health::v1::HealthCheckResponse::SERVING) return true;
      if (exited_) return false;
      int status_code = 0;
      if (waitpid(pid_, &status_code, WNOHANG) == pid_) {
        exited_ = true;
        return false;
      }
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
  int http_port_ = 0;
};

// A series' value from the server's /metrics (0 when absent, -1 when the
// scrape failed).
inline double Metric(const ServerProcess& server, const std::string& series) {
  absl::StatusOr<std::string> text = server.Metrics();
  if (!text.ok()) return -1;
  return MetricValue(*text, series).value_or(0);
}

// Polls a metric until it equals `want` (the scheduler publishes between steps).
inline bool WaitForMetric(const ServerProcess& server, const std::string& series, double want,
                          absl::Duration timeout = absl::Seconds(20)) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    if (Metric(server, series) == want) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

}  // namespace accel::testing

#endif  // ACCEL_TESTS_SERVER_SERVER_PROCESS_H_
