// accel-launch, accel-config and accel-env as users run them: real
// processes (tests/train/launch_probe.cc is the launched program).
#include <chrono>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <signal.h>
#include <spawn.h>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "train/launch_config.h"

extern char** environ;

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

std::string Bin(const std::string& name) {
  const char* dir = std::getenv("ACCEL_BIN_DIR");
  return std::string(dir != nullptr ? dir : "build/bin") + "/" + name;
}

struct Result {
  int code = -1;
  std::string out;
  std::string err;
};

// Runs argv with HOME pointed at `home` (so no user config file is read),
// stdin from `input`; waits at most `timeout_s`.
Result RunTool(const std::vector<std::string>& args, const std::string& home,
               const std::string& input = "", int timeout_s = 60) {
  test::TempDir io;
  const std::string in = io.Write("stdin", input), out = io.File("stdout"), err = io.File("stderr");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, in.c_str(), O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    if (kv.rfind("HOME=", 0) == 0 || kv.rfind("ACCEL_CONFIG_FILE=", 0) == 0 ||
        kv.rfind("XDG_CACHE_HOME=", 0) == 0 || kv.rfind("OMP_NUM_THREADS=", 0) == 0) {
      continue;
    }
    env_strings.push_back(kv);
  }
  env_strings.push_back("HOME=" + home);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  Result r;
  if (posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data()) != 0) return r;
  posix_spawn_file_actions_destroy(&fa);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = test::ReadAll(out);
  r.err = test::ReadAll(err);
  return r;
}

std::map<std::string, std::string> ReadVars(const std::string& path) {
  std::map<std::string, std::string> vars;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    size_t eq = line.find('=');
    if (eq != std::string::npos) vars[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return vars;
}

TEST(AccelLaunch, SetsTorchrunEnvironmentForEveryRank) {
  for (int n : {2, 4}) {
    test::TempDir home, out;
    Result r = RunTool(
        {Bin("accel-launch"), "--num_processes", std::to_string(n), "--main-process-port=0",
         "--mixed_precision", "bf16", Bin("accel_launch_probe"), "env", out.path(), "--an-arg"},
        home.path());
    ASSERT_EQ(r.code, 0) << r.err;
    std::string port;
    for (int rank = 0; rank < n; ++rank) {
      auto vars = ReadVars(out.File("rank_" + std::to_string(rank) + ".txt"));
      EXPECT_EQ(vars["RANK"], std::to_string(rank));
      EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank));
      EXPECT_EQ(vars["WORLD_SIZE"], std::to_string(n));
      EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], std::to_string(n));
      EXPECT_EQ(vars["MASTER_ADDR"], "127.0.0.1");
      EXPECT_EQ(vars["TORCHELASTIC_RESTART_COUNT"], "0");
      EXPECT_EQ(vars["ACCELERATE_MIXED_PRECISION"], "bf16");
      EXPECT_EQ(vars["ACCEL_LAUNCHER"], "accel-launch");
      EXPECT_EQ(vars["ARG"], "--an-arg");  // the program's own flags pass through
      EXPECT_FALSE(vars["OMP_NUM_THREADS"].empty());
      EXPECT_NE(vars["MASTER_PORT"], "0");
      if (rank == 0) port = vars["MASTER_PORT"];
      EXPECT_EQ(vars["MASTER_PORT"], port);
    }
  }
}

TEST(AccelLaunch, SecondMachineGetsItsRanks) {
  test::TempDir home, out;
  Result r = RunTool({Bin("accel-launch"), "--num_processes", "4", "--num_machines", "2",
                      "--machine_rank", "1", "--main_process_ip", "10.1.2.3", "--main_process_port",
                      "29400", Bin("accel_launch_probe"), "env", out.path()},
                     home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  for (int rank : {2, 3}) {
    auto vars = ReadVars(out.File("rank_" + std::to_string(rank) + ".txt"));
    EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank - 2));
    EXPECT_EQ(vars["WORLD_SIZE"], "4");
    EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(vars["GROUP_RANK"], "1");
    EXPECT_EQ(vars["MASTER_ADDR"], "10.1.2.3");
    EXPECT_EQ(vars["MASTER_PORT"], "29400");
  }
  EXPECT_FALSE(std::filesystem::exists(out.File("rank_0.txt")));
}

TEST(AccelLaunch, ConfigFileUnderTheFlags) {
  test::TempDir home, out;
  const std::string config = home.Write("cfg.yaml",
                                        "# written by hand\n"
                                        "compute_environment: LOCAL_MACHINE\n"
                                        "distributed_type: MULTI_CPU\n"
                                        "num_processes: 3\n"
                                        "mixed_precision: 'bf16'\n"
                                        "main_process_port: 29411\n"
                                        "dynamo_config:\n"
                                        "  dynamo_backend: NO\n");
  Result r = RunTool(
      {Bin("accel-launch"), "--config_file", config, Bin("accel_launch_probe"), "env", out.path()},
      home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  auto vars = ReadVars(out.File("rank_2.txt"));
  EXPECT_EQ(vars["WORLD_SIZE"], "3");
  EXPECT_EQ(vars["ACCELERATE_MIXED_PRECISION"], "bf16");
  EXPECT_EQ(vars["MASTER_PORT"], "29411");
  test::TempDir out2;
  r = RunTool({Bin("accel-launch"), "--config_file", config, "--mixed_precision", "no",
               "--num_processes", "1", Bin("accel_launch_probe"), "env", out2.path()},
              home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  vars = ReadVars(out2.File("rank_0.txt"));
  EXPECT_EQ(vars["WORLD_SIZE"], "1");
  EXPECT_EQ(vars["ACCELERATE_MIXED_PRECISION"], "no");
  EXPECT_FALSE(std::filesystem::exists(out2.File("rank_1.txt")));
}

TEST(AccelLaunch, FailingRankStopsTheOthers) {
  test::TempDir home, out;
  const auto start = std::chrono::steady_clock::now();
  Result r = RunTool({Bin("accel-launch"), "--num_processes", "3", "--main_process_port", "0",
                      Bin("accel_launch_probe"), "crash", "1", "7", out.path()},
                     home.path());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.code, 7);
  EXPECT_THAT(r.err, HasSubstr("rank 1"));
  EXPECT_THAT(r.err, HasSubstr("exited with code 7"));
  // The sleeping ranks (60 s) were stopped, not waited for.
  EXPECT_LT(seconds, 30);
  for (int rank : {0, 2}) {
    std::ifstream in(out.File("pid_" + std::to_string(rank)));
    pid_t pid = 0;
    in >> pid;
    ASSERT_GT(pid, 0);
    EXPECT_NE(kill(pid, 0), 0) << "rank " << rank << " is still alive";
  }
}

TEST(AccelLaunch, ForwardsSigtermToEveryRank) {
  test::TempDir home, out;
  std::vector<std::string> args = {
      Bin("accel-launch"),       "--num_processes", "2",       "--main_process_port", "0",
      Bin("accel_launch_probe"), "signal",          out.path()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ), 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!(std::filesystem::exists(out.File("ready_0")) &&
           std::filesystem::exists(out.File("ready_1"))) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(std::filesystem::exists(out.File("got_0")));
  EXPECT_TRUE(std::filesystem::exists(out.File("got_1")));
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
}

TEST(AccelLaunch, BadInputIsRefusedBeforeAnythingStarts) {
  test::TempDir home, out;
  const std::string probe = Bin("accel_launch_probe");
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--bogus", probe}, "unknown flag --bogus"},
      {{"--num_processes", "0", probe}, "--num_processes"},
      {{"--num_processes", "two", probe}, "--num_processes"},
      {{"--num_processes", "3", "--num_machines", "2", "--main_process_ip", "1.2.3.4", probe},
       "not divisible"},
      {{"--num_processes", "4", "--num_machines", "2", "--machine_rank", "2", "--main_process_ip",
        "1.2.3.4", probe},
       "--machine_rank"},
      {{"--num_processes", "4", "--num_machines", "2", probe}, "--main_process_ip"},
      {{"--main_process_port", "70000", probe}, "--main_process_port"},
      {{"--mixed_precision", "fp8", probe}, "--mixed_precision"},
      {{"--num_processes", "2"}, "no PROGRAM"},
      {{"--config_file", home.File("missing.yaml"), probe}, "missing.yaml"},
      {{"--num_processes", "2", "--main_process_port", "0", "/nonexistent/program"},
       "cannot start"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {Bin("accel-launch")};
    args.insert(args.end(), c.args.begin(), c.args.end());
    Result r = RunTool(args, home.path());
    EXPECT_EQ(r.code, 1) << c.message;
    EXPECT_THAT(r.err, HasSubstr(c.message));
  }
}

TEST(ClusterConfig, UnknownKeysAreListedSorted) {
  EXPECT_THAT(
      ParseClusterConfig("invalid_key: 1\nnum_processes: 2\nanother_invalid_key: x\n", "cfg.yaml"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("cfg.yaml had unknown keys (['another_invalid_key', "
                         "'invalid_key'])")));
  EXPECT_THAT(ParseClusterConfig("{\"bad\": 1}", "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("['bad']")));
  EXPECT_THAT(ParseClusterConfig("num_processes: many\n", "c.yaml"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_processes")));
  EXPECT_THAT(ParseClusterConfig("  indented: 1\n", "c.yaml"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("c.yaml:1")));
  EXPECT_THAT(ParseClusterConfig("distributed_type: DEEPSPEED\n", "c.yaml"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("DEEPSPEED")));
}

TEST(ClusterConfig, YamlJsonAndLegacyFields) {
  auto yaml = ParseClusterConfig(
      "distributed_type: MULTI_CPU\nnum_processes: 4  # four\nfp16: true\nmain_process_ip: "
      "\"10.0.0.1\"\nmpirun_config:\n  mpirun_hostfile: /etc/hosts\n  mpirun_ccl: 1\n",
      "y");
  ASSERT_THAT(yaml, IsOk());
  EXPECT_EQ(yaml->num_processes, 4);
  EXPECT_EQ(yaml->mixed_precision, "fp16");
  EXPECT_EQ(yaml->main_process_ip, "10.0.0.1");
  EXPECT_EQ(yaml->other["mpirun_config"], "mpirun_hostfile: /etc/hosts\nmpirun_ccl: 1");
  auto json = ParseClusterConfig(ClusterConfigToJson(*yaml), "j");
  ASSERT_THAT(json, IsOk());
  EXPECT_EQ(json->num_processes, 4);
  EXPECT_EQ(json->distributed_type, "MULTI_CPU");
  EXPECT_EQ(json->mixed_precision, "fp16");
  // distributed_type NO means one process, whatever num_processes says.
  auto no = ParseClusterConfig("distributed_type: NO\nnum_processes: 8\n", "n");
  ASSERT_THAT(no, IsOk());
  EXPECT_EQ(no->num_processes, 1);
}

TEST(AccelConfig, DefaultWritesOnceAndParsesBack) {
  test::TempDir home;
  Result r = RunTool({Bin("accel-config"), "--default", "--mixed_precision", "bf16"}, home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string path = home.File(".cache/accel/default_config.yaml");
  auto config = ReadClusterConfig(path);
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->mixed_precision, "bf16");
  EXPECT_EQ(config->num_processes, 1);
  const std::string before = test::ReadAll(path);
  r = RunTool({Bin("accel-config"), "--default"}, home.path());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("already exists"));
  EXPECT_EQ(test::ReadAll(path), before);
  // accel-launch reads it from there, and accel-env shows it.
  r = RunTool({Bin("accel-env")}, home.path());
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("Copy-and-paste the text below in your GitHub issue"));
  EXPECT_THAT(r.out, HasSubstr("- libtorch version: "));
  EXPECT_THAT(r.out, HasSubstr("\t- mixed_precision: bf16"));
}

TEST(AccelConfig, InteractiveAnswers) {
  test::TempDir home;
  const std::string path = home.File("answers.yaml");
  // A wrong answer is asked again; an empty one takes the default.
  Result r = RunTool({Bin("accel-config"), "--config_file", path}, home.path(),
                     "multi-cpu\nlots\n4\n\nbf16\n");
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_THAT(r.out, HasSubstr("not a valid answer"));
  auto config = ReadClusterConfig(path);
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->distributed_type, "MULTI_CPU");
  EXPECT_EQ(config->num_processes, 4);
  EXPECT_EQ(config->num_machines, 1);
  EXPECT_EQ(config->mixed_precision, "bf16");
  r = RunTool({Bin("accel-env")}, home.path());
  EXPECT_THAT(r.out, HasSubstr("accel default config: Not found"));
}

}  // namespace
}  // namespace accel::train
