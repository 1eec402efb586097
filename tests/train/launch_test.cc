// accel-launch, accel-config and accel-env as users run them: real
// processes (tests/train/launch_probe.cc is the launched program), plus the
// config parser and the launch plan as functions.
#include <chrono>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

#include "tests/testing/multiprocess.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "train/launch_config.h"

extern char** environ;

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;

using Env = std::map<std::string, std::string>;

std::string Bin(const std::string& name) {
  const char* dir = std::getenv("ACCEL_BIN_DIR");
  return std::string(dir != nullptr ? dir : "build/bin") + "/" + name;
}

// This process's environment without what would let the machine's own setup
// leak in (a user config, SLURM, OMP_NUM_THREADS), HOME set to `home`, plus
// `extra`.
std::vector<std::string> ToolEnvironment(const std::string& home, const Env& extra) {
  std::vector<std::string> out;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv(*e);
    const std::string key = kv.substr(0, kv.find('='));
    if (key == "HOME" || key == "ACCEL_CONFIG_FILE" || key == "XDG_CACHE_HOME" ||
        key == "OMP_NUM_THREADS" || key.rfind("SLURM_", 0) == 0 || extra.count(key)) {
      continue;
    }
    out.push_back(kv);
  }
  out.push_back("HOME=" + home);
  for (const auto& [k, v] : extra) out.push_back(k + "=" + v);
  return out;
}

pid_t Spawn(const std::vector<std::string>& args, const std::vector<std::string>& env,
            const posix_spawn_file_actions_t* files) {
  std::vector<std::string> a = args, e = env;
  std::vector<char*> argv, envp;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  for (auto& s : e) envp.push_back(s.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], files, nullptr, argv.data(), envp.data()) != 0) return -1;
  return pid;
}

// Waits at most `timeout_s`, then kills; the exit code, 128 + signal if killed.
int Wait(pid_t pid, int timeout_s) {
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
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

struct Result {
  int code = -1;
  std::string out;
  std::string err;
};

// Runs args with stdin from `input`; waits at most `timeout_s`.
Result RunTool(const std::vector<std::string>& args, const std::string& home,
               const std::string& input = "", const Env& extra = {}, int timeout_s = 60) {
  test::TempDir io;
  const std::string in = io.Write("stdin", input), out = io.File("stdout"), err = io.File("stderr");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, in.c_str(), O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const pid_t pid = Spawn(args, ToolEnvironment(home, extra), &fa);
  posix_spawn_file_actions_destroy(&fa);
  Result r;
  if (pid < 0) return r;
  r.code = Wait(pid, timeout_s);
  r.out = test::ReadAll(out);
  r.err = test::ReadAll(err);
  return r;
}

Result Launch(const std::vector<std::string>& flags_and_program, const std::string& home,
              const Env& extra = {}) {
  std::vector<std::string> args = {Bin("accel-launch")};
  args.insert(args.end(), flags_and_program.begin(), flags_and_program.end());
  return RunTool(args, home, "", extra);
}

std::map<std::string, std::string> ReadVars(const std::string& path) {
  std::map<std::string, std::string> vars;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos && line.rfind("ARG=", 0) != 0) {
      vars[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }
  return vars;
}

std::vector<std::string> ReadArgs(const std::string& path) {
  std::vector<std::string> args;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("ARG=", 0) == 0) args.push_back(line.substr(4));
  }
  return args;
}

std::string RankFile(const test::TempDir& out, int rank) {
  return out.File("rank_" + std::to_string(rank) + ".txt");
}

// ---------------------------------------------------------------------------
// accel-launch, end to end.

TEST(AccelLaunch, SetsTorchrunEnvironmentForEveryRank) {
  for (int n : {2, 4}) {
    test::TempDir home, out;
    Result r =
        Launch({"--num_processes", std::to_string(n), "--main-process-port=0", "--mixed_precision",
                "bf16", "--monitor_interval", "0.05", Bin("accel_launch_probe"), "env", out.path(),
                "--an-arg", "--num_processes", "9", "--", "last"},
               home.path());
    ASSERT_EQ(r.code, 0) << r.err;
    std::string port;
    for (int rank = 0; rank < n; ++rank) {
      auto vars = ReadVars(RankFile(out, rank));
      EXPECT_EQ(vars["RANK"], std::to_string(rank));
      EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank));
      EXPECT_EQ(vars["WORLD_SIZE"], std::to_string(n));
      EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], std::to_string(n));
      EXPECT_EQ(vars["GROUP_RANK"], "0");
      EXPECT_EQ(vars["GROUP_WORLD_SIZE"], "1");
      EXPECT_EQ(vars["ROLE_RANK"], std::to_string(rank));
      EXPECT_EQ(vars["MASTER_ADDR"], "127.0.0.1");
      EXPECT_EQ(vars["TORCHELASTIC_RESTART_COUNT"], "0");
      EXPECT_EQ(vars["ACCELERATE_MIXED_PRECISION"], "bf16");
      EXPECT_EQ(vars["ACCELERATE_USE_CPU"], "false");
      EXPECT_EQ(vars["ACCEL_LAUNCHER"], "accel-launch");
      // Neither the flag nor an inherited value, and not --cpu: Accelerate's 1.
      EXPECT_EQ(vars["OMP_NUM_THREADS"], "1");
      // The program's own arguments pass through untouched, flags included.
      EXPECT_THAT(ReadArgs(RankFile(out, rank)),
                  ElementsAre("--an-arg", "--num_processes", "9", "--", "last"));
      // Port 0: one free port, the same for every rank.
      EXPECT_NE(vars["MASTER_PORT"], "0");
      if (rank == 0) port = vars["MASTER_PORT"];
      EXPECT_EQ(vars["MASTER_PORT"], port);
    }
    EXPECT_FALSE(std::filesystem::exists(RankFile(out, n)));
  }
}

TEST(AccelLaunch, DefaultsToOneProcessAndPort29500) {
  test::TempDir home, out;
  // `--` ends the flags, PROGRAM is found in PATH.
  Result r = Launch({"--", "accel_launch_probe", "env", out.path()}, home.path(),
                    {{"PATH", std::filesystem::path(Bin("x")).parent_path().string() + ":/bin"}});
  ASSERT_EQ(r.code, 0) << r.err;
  auto vars = ReadVars(RankFile(out, 0));
  EXPECT_EQ(vars["WORLD_SIZE"], "1");
  EXPECT_EQ(vars["MASTER_ADDR"], "127.0.0.1");
  EXPECT_EQ(vars["MASTER_PORT"], "29500");
  EXPECT_EQ(vars["ACCELERATE_MIXED_PRECISION"], "no");
  EXPECT_FALSE(std::filesystem::exists(RankFile(out, 1)));
}

TEST(AccelLaunch, ThreadsPerProcessFromFlagThenEnvironment) {
  test::TempDir home, out, out2;
  Result r =
      Launch({"--num_processes", "2", "--main_process_port", "0", "--cpu",
              "--num_cpu_threads_per_process=3", Bin("accel_launch_probe"), "env", out.path()},
             home.path(), {{"OMP_NUM_THREADS", "5"}});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(ReadVars(RankFile(out, 1))["OMP_NUM_THREADS"], "3");
  EXPECT_EQ(ReadVars(RankFile(out, 1))["ACCELERATE_USE_CPU"], "true");
  r = Launch({"--num_processes", "2", "--main_process_port", "0", "--cpu",
              Bin("accel_launch_probe"), "env", out2.path()},
             home.path(), {{"OMP_NUM_THREADS", "5"}});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(ReadVars(RankFile(out2, 0))["OMP_NUM_THREADS"], "5");
}

TEST(AccelLaunch, SecondMachineGetsItsRanks) {
  test::TempDir home, out;
  Result r = Launch(
      {"--num_processes", "4", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip",
       "10.1.2.3", "--main_process_port", "29400", Bin("accel_launch_probe"), "env", out.path()},
      home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  for (int rank : {2, 3}) {
    auto vars = ReadVars(RankFile(out, rank));
    EXPECT_EQ(vars["RANK"], std::to_string(rank));
    EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank - 2));
    EXPECT_EQ(vars["WORLD_SIZE"], "4");
    EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(vars["GROUP_RANK"], "1");
    EXPECT_EQ(vars["GROUP_WORLD_SIZE"], "2");
    EXPECT_EQ(vars["MASTER_ADDR"], "10.1.2.3");
    EXPECT_EQ(vars["MASTER_PORT"], "29400");
  }
  EXPECT_FALSE(std::filesystem::exists(RankFile(out, 0)));
  EXPECT_FALSE(std::filesystem::exists(RankFile(out, 1)));
}

TEST(AccelLaunch, SlurmNodeDefaultsUnderTheFlags) {
  test::TempDir home, out, out2;
  const Env slurm = {{"SLURM_NNODES", "2"}, {"SLURM_NODEID", "1"}};
  Result r = Launch({"--num_processes", "4", "--main_process_ip", "10.0.0.9",
                     Bin("accel_launch_probe"), "env", out.path()},
                    home.path(), slurm);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(ReadVars(RankFile(out, 3))["LOCAL_RANK"], "1");
  EXPECT_EQ(ReadVars(RankFile(out, 3))["GROUP_RANK"], "1");
  EXPECT_FALSE(std::filesystem::exists(RankFile(out, 0)));
  // The flags win.
  r = Launch({"--num_processes", "2", "--num_machines", "1", "--machine_rank", "0",
              "--main_process_port", "0", Bin("accel_launch_probe"), "env", out2.path()},
             home.path(), slurm);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(ReadVars(RankFile(out2, 1))["LOCAL_WORLD_SIZE"], "2");
  r = Launch({"--num_processes", "2", Bin("accel_launch_probe"), "env", out2.path()}, home.path(),
             {{"SLURM_NODEID", "first"}});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("$SLURM_NODEID \"first\""));
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
                                        "use_cpu: true\n"
                                        "debug: true\n"
                                        "gpu_ids: 0,2\n"
                                        "dynamo_config:\n"
                                        "  dynamo_backend: NO\n");
  Result r =
      Launch({"--config_file", config, Bin("accel_launch_probe"), "env", out.path()}, home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  auto vars = ReadVars(RankFile(out, 2));
  EXPECT_EQ(vars["WORLD_SIZE"], "3");
  EXPECT_EQ(vars["ACCELERATE_MIXED_PRECISION"], "bf16");
  EXPECT_EQ(vars["ACCELERATE_USE_CPU"], "true");
  EXPECT_EQ(vars["ACCELERATE_DEBUG_MODE"], "true");
  EXPECT_EQ(vars["CUDA_VISIBLE_DEVICES"], "0,2");
  EXPECT_EQ(vars["MASTER_PORT"], "29411");
  test::TempDir out2;
  r = Launch({"--config-file=" + config, "--mixed_precision", "no", "--num_processes", "1",
              "--main_process_port", "29412", Bin("accel_launch_probe"), "env", out2.path()},
             home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  vars = ReadVars(RankFile(out2, 0));
  EXPECT_EQ(vars["WORLD_SIZE"], "1");
  EXPECT_EQ(vars["ACCELERATE_MIXED_PRECISION"], "no");
  EXPECT_EQ(vars["MASTER_PORT"], "29412");
  EXPECT_FALSE(std::filesystem::exists(RankFile(out2, 1)));
}

TEST(AccelLaunch, FindsTheDefaultConfigFile) {
  const std::string yaml = "distributed_type: MULTI_CPU\nnum_processes: 2\nmain_process_port: 0\n";
  {  // ${XDG_CACHE_HOME}/accel/default_config.yaml
    test::TempDir home, cache, out;
    std::filesystem::create_directories(cache.File("accel"));
    cache.Write("accel/default_config.yaml", yaml);
    Result r = Launch({Bin("accel_launch_probe"), "env", out.path()}, home.path(),
                      {{"XDG_CACHE_HOME", cache.path()}});
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(ReadVars(RankFile(out, 1))["WORLD_SIZE"], "2");
  }
  {  // ~/.cache/accel/default_config.yaml
    test::TempDir home, out;
    std::filesystem::create_directories(home.File(".cache/accel"));
    home.Write(".cache/accel/default_config.yaml", yaml);
    Result r = Launch({Bin("accel_launch_probe"), "env", out.path()}, home.path());
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(ReadVars(RankFile(out, 1))["WORLD_SIZE"], "2");
  }
  {  // $ACCEL_CONFIG_FILE wins over the cache
    test::TempDir home, out;
    std::filesystem::create_directories(home.File(".cache/accel"));
    home.Write(".cache/accel/default_config.yaml", yaml);
    const std::string three =
        home.Write("three.json",
                   "{\"distributed_type\": \"MULTI_CPU\", \"num_processes\": 3, "
                   "\"main_process_port\": 0}");
    Result r = Launch({Bin("accel_launch_probe"), "env", out.path()}, home.path(),
                      {{"ACCEL_CONFIG_FILE", three}});
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(ReadVars(RankFile(out, 2))["WORLD_SIZE"], "3");
  }
}

TEST(AccelLaunch, FailingRankStopsTheOthers) {
  struct Case {
    std::string code;   // what rank 1 does
    int launcher_code;  // accel-launch's exit code
    std::string message;
  };
  for (const Case& c :
       {Case{"7", 7, "rank 1 (pid "}, Case{"sig:9", 128 + 9, "killed by signal 9"}}) {
    test::TempDir home, out;
    Result r = Launch({"--num_processes", "3", "--main_process_port", "0",
                       Bin("accel_launch_probe"), "crash", "1", c.code, out.path()},
                      home.path());
    EXPECT_EQ(r.code, c.launcher_code) << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message));
    EXPECT_THAT(r.err, HasSubstr("rank 1"));
    if (c.code == "7") {
      EXPECT_THAT(r.err, HasSubstr("exited with code 7"));
    }
    // The sleeping ranks (60 s) were stopped, not waited for (RunTool gives
    // up after 60 s, so a code above means the launcher returned itself).
    for (int rank : {0, 2}) {
      std::ifstream in(out.File("pid_" + std::to_string(rank)));
      pid_t pid = 0;
      in >> pid;
      ASSERT_GT(pid, 0);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (kill(pid, 0) == 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      EXPECT_NE(kill(pid, 0), 0) << "rank " << rank << " is still alive";
    }
  }
}

TEST(AccelLaunch, RanksIgnoringSigtermAreKilledAfterTheGrace) {
  test::TempDir home, out;
  Result r = Launch({"--num_processes", "2", "--main_process_port", "0", Bin("accel_launch_probe"),
                     "stubborn", "0", "4", out.path()},
                    home.path());
  EXPECT_EQ(r.code, 4) << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 0 (pid "));
  EXPECT_THAT(r.err, HasSubstr("still running 5 s after SIGTERM; killing them"));
  std::ifstream in(out.File("pid_1"));
  pid_t pid = 0;
  in >> pid;
  ASSERT_GT(pid, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (kill(pid, 0) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(kill(pid, 0), 0) << "rank 1 is still alive";
}

TEST(AccelLaunch, ForwardsSignalsToEveryRank) {
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    test::TempDir home, out;
    const pid_t pid = Spawn({Bin("accel-launch"), "--num_processes", "3", "--main_process_port",
                             "0", Bin("accel_launch_probe"), "signal", out.path()},
                            ToolEnvironment(home.path(), {}), nullptr);
    ASSERT_GT(pid, 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    auto all_ready = [&] {
      for (int rank = 0; rank < 3; ++rank) {
        if (!std::filesystem::exists(out.File("ready_" + std::to_string(rank)))) return false;
      }
      return true;
    };
    while (!all_ready() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ASSERT_TRUE(all_ready());
    ASSERT_EQ(kill(pid, sig), 0);
    EXPECT_EQ(Wait(pid, 30), 128 + sig);
    for (int rank = 0; rank < 3; ++rank) {
      EXPECT_EQ(test::ReadAll(out.File("got_" + std::to_string(rank))), std::to_string(sig) + "\n")
          << "rank " << rank << ", signal " << sig;
    }
  }
}

TEST(AccelLaunch, BadInputIsRefusedBeforeAnythingStarts) {
  test::TempDir home, out;
  const std::string probe = Bin("accel_launch_probe");
  const std::string bad_port = home.Write("port.yaml", "main_process_port: 70000\n");
  const std::string ask_n = home.Write("ask.yaml",
                                       "distributed_type: MULTI_CPU\n"
                                       "num_processes: -1\n");
  const std::string unknown = home.Write("unknown.yaml", "num_processes: 2\nbogus_key: 1\n");
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--bogus", probe}, "unknown flag --bogus"},
      {{"--num_processes", "0", probe}, "--num_processes \"0\""},
      {{"--num_processes", "two", probe}, "--num_processes \"two\""},
      {{"--num_processes", "-3", probe}, "--num_processes \"-3\""},
      {{"--num_processes"}, "--num_processes needs a value"},
      {{"--cpu=yes", probe}, "--cpu takes no value"},
      {{"--num_machines", "0", probe}, "--num_machines \"0\""},
      {{"--num_processes", "3", "--num_machines", "2", "--main_process_ip", "1.2.3.4", probe},
       "--num_processes 3 is not divisible by --num_machines 2"},
      {{"--num_processes", "4", "--num_machines", "2", "--machine_rank", "2", "--main_process_ip",
        "1.2.3.4", probe},
       "--machine_rank 2 is outside [0, 2)"},
      {{"--machine_rank", "-1", probe}, "--machine_rank \"-1\""},
      {{"--num_processes", "4", "--num_machines", "2", probe}, "needs --main_process_ip"},
      {{"--num_processes", "4", "--num_machines", "2", "--main_process_ip", "1.2.3.4",
        "--main_process_port", "0", probe},
       "one machine only"},
      {{"--main_process_port", "70000", probe}, "--main_process_port \"70000\""},
      {{"--main_process_port", "-1", probe}, "--main_process_port \"-1\""},
      {{"--mixed_precision", "fp8", probe}, "--mixed_precision \"fp8\""},
      {{"--num_cpu_threads_per_process", "0", probe}, "--num_cpu_threads_per_process \"0\""},
      {{"--monitor_interval", "-1", probe}, "--monitor_interval \"-1\""},
      {{"--num_processes", "2"}, "no PROGRAM"},
      {{"--"}, "no PROGRAM"},
      {{"--config_file", home.File("missing.yaml"), probe}, "missing.yaml: not found"},
      {{"--config_file", bad_port, probe}, "port.yaml: main_process_port is 70000"},
      {{"--config_file", ask_n, probe}, "pass --num_processes"},
      {{"--config_file", unknown, probe}, "had unknown keys (['bogus_key'])"},
      {{"--num_processes", "2", "/nonexistent/program"},
       "PROGRAM /nonexistent/program is not an executable file"},
      {{"--num_processes", "2", "no-such-program-accel"},
       "PROGRAM no-such-program-accel not found in PATH"},
      {{"--num_processes", "2", home.path()}, "is not an executable file"},  // a directory
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = c.args;
    if (args.back() == probe) {  // it would leave a file in `out` if it ran
      args.push_back("env");
      args.push_back(out.path());
    }
    Result r = Launch(args, home.path());
    EXPECT_EQ(r.code, 1) << c.message << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message));
    EXPECT_THAT(r.err, HasSubstr("usage: accel-launch")) << c.message;
  }
  EXPECT_TRUE(std::filesystem::is_empty(out.path()));
}

// ---------------------------------------------------------------------------
// The launch plan and each rank's environment, as functions.

TEST(LaunchPlan, FlagSpellingsAndPassThrough) {
  test::TempDir home;
  const Env env = {{"HOME", home.path()}, {"PATH", "/usr/bin:/bin"}};
  ACCEL_ASSERT_OK_AND_ASSIGN(
      LaunchPlan plan,
      ParseLaunchArgs({"--num-processes=4", "--num_machines", "2", "--machine-rank", "1",
                       "--main_process_ip=10.0.0.1", "--monitor-interval", "0.5", "--gpu_ids", "1",
                       "--quiet", "sh", "-c", "--num_processes=8"},
                      env));
  EXPECT_EQ(plan.num_processes, 4);
  EXPECT_EQ(plan.num_machines, 2);
  EXPECT_EQ(plan.machine_rank, 1);
  EXPECT_EQ(plan.local_processes(), 2);
  EXPECT_EQ(plan.main_process_ip, "10.0.0.1");
  EXPECT_EQ(plan.main_process_port, 29500);
  EXPECT_DOUBLE_EQ(plan.monitor_interval_s, 0.5);
  EXPECT_TRUE(plan.quiet);
  EXPECT_THAT(plan.command, ElementsAre("sh", "-c", "--num_processes=8"));
  EXPECT_TRUE(plan.program_path == "/usr/bin/sh" || plan.program_path == "/bin/sh")
      << plan.program_path;
}

TEST(LaunchPlan, RankEnvironmentFollowsTorchrunAndAccelerate) {
  LaunchPlan plan;
  plan.num_processes = 8;
  plan.num_machines = 2;
  plan.machine_rank = 1;
  plan.main_process_ip = "10.0.0.1";
  plan.main_process_port = 1234;
  plan.mixed_precision = "fp16";
  plan.gpu_ids = "2,3";
  plan.enable_cpu_affinity = true;
  auto e = RankEnvironment(plan, /*local_rank=*/3, /*physical_cores=*/16, {});
  EXPECT_EQ(e["RANK"], "7");  // 1 * 4 + 3
  EXPECT_EQ(e["LOCAL_RANK"], "3");
  EXPECT_EQ(e["WORLD_SIZE"], "8");
  EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "4");
  EXPECT_EQ(e["GROUP_RANK"], "1");
  EXPECT_EQ(e["GROUP_WORLD_SIZE"], "2");
  EXPECT_EQ(e["ROLE_RANK"], "7");
  EXPECT_EQ(e["MASTER_ADDR"], "10.0.0.1");
  EXPECT_EQ(e["MASTER_PORT"], "1234");
  EXPECT_EQ(e["TORCHELASTIC_RESTART_COUNT"], "0");
  EXPECT_EQ(e["ACCELERATE_MIXED_PRECISION"], "fp16");
  EXPECT_EQ(e["ACCELERATE_USE_CPU"], "false");
  EXPECT_EQ(e["ACCELERATE_CPU_AFFINITY"], "1");
  EXPECT_EQ(e["CUDA_VISIBLE_DEVICES"], "2,3");
  EXPECT_EQ(e.count("ACCELERATE_DEBUG_MODE"), 0u);
  EXPECT_EQ(e["ACCEL_LAUNCHER"], "accel-launch");

  // OMP_NUM_THREADS, Accelerate's order: the flag, the inherited value, with
  // --cpu the physical cores shared out (at least 1), else 1.
  EXPECT_EQ(e["OMP_NUM_THREADS"], "1");
  plan.use_cpu = true;
  EXPECT_EQ(RankEnvironment(plan, 0, 16, {})["OMP_NUM_THREADS"], "4");  // 16 / 4 local
  EXPECT_EQ(RankEnvironment(plan, 0, 18, {})["OMP_NUM_THREADS"], "4");  // floor(18 / 4)
  EXPECT_EQ(RankEnvironment(plan, 0, 2, {})["OMP_NUM_THREADS"], "1");   // never 0
  EXPECT_EQ(RankEnvironment(plan, 0, 16, {{"OMP_NUM_THREADS", "6"}})["OMP_NUM_THREADS"], "6");
  plan.threads_per_process = 3;
  EXPECT_EQ(RankEnvironment(plan, 0, 16, {{"OMP_NUM_THREADS", "6"}})["OMP_NUM_THREADS"], "3");
  EXPECT_EQ(RankEnvironment(plan, 0, 16, {})["ACCELERATE_USE_CPU"], "true");
}

TEST(LaunchPlan, FindProgramLikeExecvp) {
  test::TempDir dir;
  const std::string tool = dir.Write("tool", "#!/bin/sh\n");
  dir.Write("plain", "not executable");
  ASSERT_EQ(chmod(tool.c_str(), 0755), 0);
  EXPECT_EQ(FindProgram("tool", "/nonexistent:" + dir.path()).value_or(""), tool);
  EXPECT_THAT(FindProgram("plain", dir.path()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("plain not found in PATH")));
  EXPECT_EQ(FindProgram(tool, "").value_or(""), tool);
  EXPECT_THAT(FindProgram(dir.File("plain"), ""),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("is not an executable file")));
  EXPECT_GE(PhysicalCoreCount(), 1);
}

// ---------------------------------------------------------------------------
// Config files.

TEST(ClusterConfig, UnknownKeysAreListedSorted) {
  // Accelerate's tests/test_configs/invalid_keys.yaml.
  EXPECT_THAT(
      ParseClusterConfig("compute_environment: LOCAL_MACHINE\n"
                         "deepspeed_config: {}\n"
                         "distributed_type: 'NO'\n"
                         "downcast_bf16: 'no'\n"
                         "fsdp_config: {}\n"
                         "machine_rank: 0\n"
                         "main_process_ip: null\n"
                         "main_process_port: null\n"
                         "main_training_function: main\n"
                         "mixed_precision: 'no'\n"
                         "num_machines: 1\n"
                         "num_processes: 1\n"
                         "use_cpu: false\n"
                         "invalid_key: \"invalid_value\"\n"
                         "another_invalid_key: \"another_invalid_value\"",
                         "invalid_keys.yaml"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("The config file at invalid_keys.yaml had unknown keys "
                         "(['another_invalid_key', 'invalid_key']), please try upgrading")));
  EXPECT_THAT(ParseClusterConfig("{\"bad\": 1, \"Also\": 2}", "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(['Also', 'bad'])")));
}

TEST(ClusterConfig, AccelerateSampleFiles) {
  // tests/test_configs/0_28_0_mpi.yaml from Accelerate: it asks for mpirun
  // (and IPEX), which accel-launch cannot do.
  const std::string mpi_yaml =
      "compute_environment: LOCAL_MACHINE\n"
      "debug: false\n"
      "distributed_type: MULTI_CPU\n"
      "downcast_bf16: 'no'\n"
      "ipex_config:\n"
      "  ipex: true\n"
      "machine_rank: 0\n"
      "main_process_ip: 127.0.0.1\n"
      "main_process_port: 29500\n"
      "main_training_function: main\n"
      "mixed_precision: 'no'\n"
      "mpirun_config:\n"
      "  mpirun_ccl: '1'\n"
      "  mpirun_hostfile: /home/user/hostfile\n"
      "num_machines: 4\n"
      "num_processes: 16\n"
      "rdzv_backend: static\n"
      "same_network: true\n"
      "tpu_env: []\n"
      "tpu_use_cluster: false\n"
      "tpu_use_sudo: false\n"
      "use_cpu: true\n";
  EXPECT_THAT(ParseClusterConfig(mpi_yaml, "0_28_0_mpi.yaml"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("0_28_0_mpi.yaml: mpirun_config.mpirun_hostfile: accel-launch "
                                 "does not start ranks through mpirun")));
  // The same file as `accelerate config` writes it without mpirun and IPEX.
  std::string plain = absl::StrReplaceAll(
      mpi_yaml,
      {{"  ipex: true\n", "  ipex: false\n"},
       {"mpirun_config:\n  mpirun_ccl: '1'\n  mpirun_hostfile: /home/user/hostfile\n", ""}});
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig mpi, ParseClusterConfig(plain, "0_28_0_cpu.yaml"));
  EXPECT_EQ(mpi.distributed_type, "MULTI_CPU");
  EXPECT_EQ(mpi.num_processes, 16);
  EXPECT_EQ(mpi.num_machines, 4);
  EXPECT_TRUE(mpi.use_cpu);
  EXPECT_EQ(mpi.main_process_ip, "127.0.0.1");
  EXPECT_EQ(mpi.main_process_port, 29500);
  EXPECT_EQ(mpi.mixed_precision, "no");
  EXPECT_EQ(mpi.other.count("mpirun_config"), 0u);
  EXPECT_EQ(mpi.other["ipex_config"], R"({"ipex":false})");
  EXPECT_EQ(mpi.other["tpu_env"], "[]");
  EXPECT_EQ(mpi.other["downcast_bf16"], "\"no\"");

  // tests/test_configs/0_12_0.yaml: nulls are the defaults, NO is one process.
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig old,
                             ParseClusterConfig("compute_environment: LOCAL_MACHINE\n"
                                                "deepspeed_config: {}\n"
                                                "distributed_type: 'NO'\n"
                                                "downcast_bf16: 'no'\n"
                                                "fsdp_config: {}\n"
                                                "machine_rank: 0\n"
                                                "main_process_ip: null\n"
                                                "main_process_port: null\n"
                                                "main_training_function: main\n"
                                                "mixed_precision: 'no'\n"
                                                "num_machines: 1\n"
                                                "num_processes: 1\n"
                                                "use_cpu: false",
                                                "0_12_0.yaml"));
  EXPECT_EQ(old.distributed_type, "NO");
  EXPECT_EQ(old.num_processes, 1);
  EXPECT_EQ(old.main_process_ip, "");
  EXPECT_FALSE(old.main_process_port.has_value());
  EXPECT_EQ(old.other["deepspeed_config"], "{}");

  // latest_fsdp.yaml: FSDP, its settings kept for the launcher's FSDP_* variables.
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ClusterConfig fsdp,
      ParseClusterConfig("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n",
                         "latest_fsdp.yaml"));
  EXPECT_EQ(fsdp.distributed_type, "FSDP");
  EXPECT_EQ(fsdp.other["fsdp_config"], R"({"fsdp_version":2})");
}

// What accel-launch cannot honour is refused naming the key, never kept and
// ignored; the defaults Accelerate writes for the same keys are accepted.
TEST(ClusterConfig, RefusesWhatLaunchCannotHonour) {
  struct Case {
    std::string yaml;
    std::string message;
  };
  const std::vector<Case> refused = {
      {"distributed_type: MULTI_GPU\n"
       "dynamo_config:\n"
       "  dynamo_backend: INDUCTOR\n"
       "  dynamo_mode: default\n",
       "c.yaml: dynamo_config.dynamo_backend: \"INDUCTOR\""},
      {"distributed_type: MULTI_GPU\n"
       "deepspeed_config:\n"
       "  gradient_accumulation_steps: 1\n"
       "  zero_stage: 2\n",
       "c.yaml: deepspeed_config: DeepSpeed"},
      {"fsdp_config:\n"
       "  fsdp_sharding_strategy: FULL_SHARD\n",
       "c.yaml: fsdp_config: set, but distributed_type is not FSDP"},
      {"distributed_type: FSDP\n"
       "fsdp_config:\n"
       "  fsdp_offload_params: {device: cpu}\n",
       "c.yaml: fsdp_config.fsdp_offload_params is {\"device\":\"cpu\"}, expected a value"},
      {"parallelism_config:\n"
       "  parallelism_config_tp_size: 2\n",
       "c.yaml: parallelism_config: N-D parallelism"},
      {"fp8_config:\n"
       "  backend: TE\n",
       "c.yaml: fp8_config: fp8 training"},
      {"compute_environment: AMAZON_SAGEMAKER\n",
       "c.yaml: compute_environment: AMAZON_SAGEMAKER: accel-launch starts processes on this "
       "machine"},
      {"compute_environment: MY_CLUSTER\n",
       "c.yaml: compute_environment: \"MY_CLUSTER\": expected LOCAL_MACHINE"},
      {"rdzv_backend: c10d\n", "c.yaml: rdzv_backend \"c10d\": accel-launch has no elastic"},
      {"rdzv_backend: etcd\n", "c.yaml: rdzv_backend \"etcd\": accel-launch has no elastic"},
      {"rdzv_backend: carrier-pigeon\n",
       "c.yaml: rdzv_backend \"carrier-pigeon\": expected static"},
      {"megatron_lm_config:\n"
       "  megatron_lm_tp_degree: 2\n",
       "c.yaml: megatron_lm_config: Megatron-LM"},
      {"distributed_type: MULTI_CPU\n"
       "mpirun_config:\n"
       "  mpirun_hostfile: /etc/hosts.mpi\n",
       "c.yaml: mpirun_config.mpirun_hostfile"},
      {"downcast_bf16: 'yes'\n", "c.yaml: downcast_bf16: \"yes\": downcasting"},
      {"downcast_bf16: true\n", "c.yaml: downcast_bf16: true"},
      {"ipex_config:\n"
       "  ipex: true\n",
       "c.yaml: ipex_config.ipex"},
      {"distributed_type: DEEPSPEED\n", "c.yaml: distributed_type \"DEEPSPEED\""},
      {"distributed_type: XLA\n", "c.yaml: distributed_type \"XLA\""},
      {"distributed_type: MULTI_NPU\n", "c.yaml: distributed_type \"MULTI_NPU\""},
      {"{\"fsdp_config\": {\"fsdp_version\": 2}}", "c.yaml: fsdp_config"},
      {"dynamo_config: fast\n", "c.yaml: dynamo_config is \"fast\", expected a mapping"},
  };
  for (const Case& c : refused) {
    EXPECT_THAT(ParseClusterConfig(c.yaml, "c.yaml"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.yaml;
  }
  // The values Accelerate writes when those features are off.
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig defaults,
                             ParseClusterConfig("compute_environment: LOCAL_MACHINE\n"
                                                "debug: false\n"
                                                "deepspeed_config: {}\n"
                                                "distributed_type: MULTI_GPU\n"
                                                "downcast_bf16: 'no'\n"
                                                "dynamo_config:\n"
                                                "  dynamo_backend: 'NO'\n"
                                                "enable_cpu_affinity: false\n"
                                                "fp8_config: {}\n"
                                                "fsdp_config: {}\n"
                                                "gpu_ids: all\n"
                                                "ipex_config:\n"
                                                "  ipex: false\n"
                                                "machine_rank: 0\n"
                                                "main_training_function: main\n"
                                                "megatron_lm_config: {}\n"
                                                "mixed_precision: bf16\n"
                                                "mpirun_config: {}\n"
                                                "num_machines: 1\n"
                                                "num_processes: 2\n"
                                                "parallelism_config: {}\n"
                                                "rdzv_backend: static\n"
                                                "same_network: true\n"
                                                "tpu_env: []\n"
                                                "tpu_use_cluster: false\n"
                                                "tpu_use_sudo: false\n"
                                                "use_cpu: false\n",
                                                "default_config.yaml"));
  EXPECT_EQ(defaults.num_processes, 2);
  EXPECT_EQ(defaults.mixed_precision, "bf16");
  // Empty sections, and mpirun settings without a hostfile (no mpirun).
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig nulls, ParseClusterConfig("deepspeed_config:\n"
                                                                     "fsdp_config: ~\n"
                                                                     "downcast_bf16: false\n"
                                                                     "dynamo_config: {}\n"
                                                                     "mpirun_config:\n"
                                                                     "  mpirun_ccl: 1\n",
                                                                     "n.yaml"));
  EXPECT_EQ(nulls.other["deepspeed_config"], "null");
}

TEST(ClusterConfig, LegacyFieldsAndDefaults) {
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig fp16,
                             ParseClusterConfig("distributed_type: MULTI_CPU\nfp16: true\n", "a"));
  EXPECT_EQ(fp16.mixed_precision, "fp16");
  EXPECT_EQ(fp16.other.count("fp16"), 0u);
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig fp32, ParseClusterConfig("fp16: false\n", "b"));
  EXPECT_EQ(fp32.mixed_precision, "no");
  // dynamo_backend moves into dynamo_config ({} for NO), as Accelerate's
  // loader does; a real backend is refused under the name the file used.
  EXPECT_THAT(ParseClusterConfig("dynamo_backend: INDUCTOR\n", "c"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("c: dynamo_backend: \"INDUCTOR\": torch.compile")));
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig no_dynamo,
                             ParseClusterConfig("dynamo_backend: 'NO'\n", "d"));
  EXPECT_EQ(no_dynamo.other["dynamo_config"], "{}");
  // An empty file is every default.
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig empty, ParseClusterConfig("# nothing\n", "e"));
  EXPECT_EQ(empty.distributed_type, "NO");
  EXPECT_EQ(empty.num_processes, 1);
  EXPECT_EQ(empty.mixed_precision, "no");
  EXPECT_EQ(empty.compute_environment, "LOCAL_MACHINE");
  // distributed_type NO means one process, whatever num_processes says.
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig no,
                             ParseClusterConfig("distributed_type: NO\nnum_processes: 8\n", "n"));
  EXPECT_EQ(no.num_processes, 1);
}

TEST(ClusterConfig, ReadsYamlAsAccelerateWritesIt) {
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ClusterConfig c,
      ParseClusterConfig("---\r\n"
                         "# a comment\r\n"
                         "distributed_type: multi_cpu   # lower case is fine\r\n"
                         "\"num_processes\": '4'\n"
                         "main_process_ip: \"10.0.0.1\"  # quoted, then a comment\n"
                         "main_training_function: 'it''s # not a comment'\n"
                         "gpu_ids: 0\n"
                         "same_network: false\n"
                         "commands:\n"
                         "- echo one\n"
                         "- 'echo # two'\n"
                         "tpu_vm: [a, 'b, c', 3]\n"
                         "ipex_config: {ipex: false, name: x}\n"
                         "tpu_env:\n"
                         "    zero_stage: 2\n"
                         "    offload:\n"
                         "      device: cpu\n"
                         "    list:\n"
                         "      - 1.5\n"
                         "      - ~\n"
                         "megatron_lm_config:\n"
                         "tpu_name: ~\n"
                         "...\n",
                         "sub.yaml"));
  EXPECT_EQ(c.distributed_type, "MULTI_CPU");
  EXPECT_EQ(c.num_processes, 4);
  EXPECT_EQ(c.main_process_ip, "10.0.0.1");
  EXPECT_EQ(c.main_training_function, "it's # not a comment");
  EXPECT_EQ(c.gpu_ids, "0");
  EXPECT_FALSE(c.same_network);
  EXPECT_EQ(c.other["commands"], R"(["echo one","echo # two"])");
  EXPECT_EQ(c.other["tpu_vm"], R"(["a","b, c",3])");
  EXPECT_EQ(c.other["ipex_config"], R"({"ipex":false,"name":"x"})");
  EXPECT_EQ(c.other["tpu_env"], R"({"list":[1.5,null],"offload":{"device":"cpu"},"zero_stage":2})");
  EXPECT_EQ(c.other["megatron_lm_config"], "null");
  EXPECT_EQ(c.other["tpu_name"], "null");
}

// What the old hand-written subset refused: anchors and aliases (with merge
// keys), flow collections nested or over several lines, block scalars, tags,
// every quoting form.
TEST(ClusterConfig, ReadsAnyValidYaml) {
  // Anchors and aliases: the address written once, used twice.
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ClusterConfig anchored,
      ParseClusterConfig("main_process_ip: &head 10.0.0.1\n"
                         "tpu_name: *head\n"
                         "ipex_config: &off {ipex: false}\n"
                         "mpirun_config:\n"
                         "  <<: *off\n"
                         "  mpirun_ccl: 2\n"
                         "dynamo_config:\n"
                         "  <<: [{dynamo_backend: 'NO', dynamo_mode: a}, {dynamo_mode: b}]\n"
                         "  dynamo_use_fullgraph: false\n",
                         "anchors.yaml"));
  EXPECT_EQ(anchored.main_process_ip, "10.0.0.1");
  EXPECT_EQ(anchored.other["tpu_name"], "\"10.0.0.1\"");
  EXPECT_EQ(anchored.other["mpirun_config"], R"({"ipex":false,"mpirun_ccl":2})");
  // The first merged mapping wins, keys of the mapping itself win over both.
  EXPECT_EQ(anchored.other["dynamo_config"],
            R"({"dynamo_backend":"NO","dynamo_mode":"a","dynamo_use_fullgraph":false})");

  // Flow style, nested and over several lines; a whole file in flow style.
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig flow,
                             ParseClusterConfig("{distributed_type: MULTI_CPU, num_processes: 3,\n"
                                                " tpu_env: [a, [b, {c: 1}],\n"
                                                "   d], use_cpu: true}\n",
                                                "flow.yaml"));
  EXPECT_EQ(flow.distributed_type, "MULTI_CPU");
  EXPECT_EQ(flow.num_processes, 3);
  EXPECT_TRUE(flow.use_cpu);
  EXPECT_EQ(flow.other["tpu_env"], R"(["a",["b",{"c":1}],"d"])");

  // Quoting: a quoted value is text whatever it looks like; escapes in
  // double quotes, '' in single quotes, block scalars, explicit tags.
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig quoted,
                             ParseClusterConfig("main_training_function: \"caf\\u00e9\\tmain\"\n"
                                                "gpu_ids: '0,1'\n"
                                                "rdzv_backend: !!str static\n"
                                                "mixed_precision: 'no'\n"
                                                "tpu_zone: 'it''s'\n"
                                                "tpu_name: \"null\"\n"
                                                "command_file: |\n"
                                                "  line one\n"
                                                "  line two\n"
                                                "tpu_vm: >-\n"
                                                "  folded\n"
                                                "  text\n"
                                                "num_machines: !!int \"2\"\n",
                                                "quoted.yaml"));
  EXPECT_EQ(quoted.main_training_function, "caf\xc3\xa9\tmain");
  EXPECT_EQ(quoted.gpu_ids, "0,1");
  EXPECT_EQ(quoted.rdzv_backend, "static");
  EXPECT_EQ(quoted.mixed_precision, "no");
  EXPECT_EQ(quoted.other["tpu_zone"], "\"it's\"");
  EXPECT_EQ(quoted.other["tpu_name"], "\"null\"");
  EXPECT_EQ(quoted.other["command_file"], "\"line one\\nline two\\n\"");
  EXPECT_EQ(quoted.other["tpu_vm"], "\"folded text\"");
  EXPECT_EQ(quoted.num_machines, 2);
}

TEST(ClusterConfig, MalformedYamlNamesTheFileAndLine) {
  struct Case {
    std::string text;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"num_processes: 2\ntpu_vm: [a,\n  b\n", "c.yaml:4:1: invalid YAML: end of sequence flow"},
      {"num_processes: 2\nmain_process_ip: *nowhere\n", "c.yaml:2:18: invalid YAML: the "},
      {"debug: false\nnum_processes: 2\n  indented: 1\n", "c.yaml:3:"},
      {"num_processes: 2\nnum_processes: 3\n", "c.yaml:2:1: duplicate key num_processes"},
      {"debug: false\n---\nuse_cpu: true\n", "c.yaml:2:1: text after the end of the first YAML"},
      // yaml-cpp 0.7 alone loops (and allocates) forever on these.
      {"{\"num_processes\": 2},\n", "c.yaml:1:21: text after the end of the first YAML"},
      {"\"num_processes\",", "c.yaml:1:16: text after the end of the first YAML"},
      {"- 1\n- 2\n", "c.yaml:1:1: the top level is a list, not a mapping"},
      {"just words\n", "c.yaml:1:1: the top level is the value \"just words\""},
      {"[a, b]: 1\n", "c.yaml:1:1: a key must be text"},
      {"debug: false\ngpu_ids: !!python/tuple [1]\n", "c.yaml:2:10: tag"},
      {"num_machines: !!int two\n", "c.yaml:1:15: tag tag:yaml.org,2002:int on \"two\""},
      {"mpirun_config:\n  <<: 3\n", "c.yaml:2:3: `<<` merges a mapping"},
      {"tpu_env:\n  " + std::string(129, 'k') + ": 1\n", "c.yaml:2:3: a key of 129 bytes"},
      // Values of the wrong type or range name the key.
      {"num_processes: many\n", "c.yaml: num_processes is \"many\", expected an integer"},
      {"num_processes: 0\n", "c.yaml: num_processes is 0"},
      {"num_machines: 0\n", "c.yaml: num_machines is 0, expected [1, 65536]"},
      {"main_process_port: 65536\n", "c.yaml: main_process_port is 65536, expected [0, 65535]"},
      {"use_cpu: maybe\n", "c.yaml: use_cpu is \"maybe\", expected true or false"},
      {"mixed_precision: fp8\n", "c.yaml: mixed_precision \"fp8\": expected no, fp16 or bf16"},
      {"main_process_ip: [1]\n", "c.yaml: main_process_ip is [1], expected text"},
      {"num_machines: 2\nmachine_rank: 2\n",
       "c.yaml: machine_rank 2 is outside [0, num_machines 2)"},
      {"{\"num_processes\": 2", "c.yaml:1:1: invalid YAML: end of map flow not found"},
      {"{\"num_processes\": 2} trailing", "c.yaml:1:"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(ParseClusterConfig(c.text, "c.yaml"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.text;
  }
  // Aliases that would expand past any config file's size (a "billion
  // laughs") and an alias inside its own anchor are refused, not expanded.
  std::string laughs = "tpu_env: &l0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i <= 6; ++i) {
    laughs += absl::StrCat("l", i, ": &l", i, " [");
    for (int j = 0; j < 10; ++j) laughs += absl::StrCat(j ? ", " : "", "*l", i - 1);
    laughs += "]\n";
  }
  EXPECT_THAT(ParseClusterConfig(laughs, "laughs.yaml"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("laughs.yaml:")));
  EXPECT_THAT(ParseClusterConfig("tpu_env: &a [x, *a]\n", "loop.yaml"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("loop.yaml:1:")));
  // A file names itself in the error.
  test::TempDir dir;
  const std::string path = dir.Write("broken.yaml", "num_processes: 2\nuse_cpu: [true\n");
  EXPECT_THAT(ReadClusterConfig(path), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr(path + ":3:1: invalid YAML: ")));
}

// Bytes that are not UTF-8 read as U+FFFD, so that the JSON accel-config
// writes of a config reads back to the same config (launch_config_fuzz).
TEST(ClusterConfig, InvalidUtf8ReadsBackTheSame) {
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig c,
                             ParseClusterConfig("main_training_function: ma\xffin\n"
                                                "tpu_env: {\"k\\x1a\xfe\": [\"v\xc3\"]}\n",
                                                "utf8.yaml"));
  EXPECT_EQ(c.main_training_function, "ma\xef\xbf\xbdin");
  const std::string json = ClusterConfigToJson(c);
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig back, ParseClusterConfig(json, "utf8.json"));
  EXPECT_EQ(ClusterConfigToJson(back), json);
  EXPECT_EQ(back.other, c.other);
}

TEST(ClusterConfig, WritesAndReadsBack) {
  ClusterConfig c;
  c.distributed_type = "MULTI_CPU";
  c.num_processes = 8;
  c.num_machines = 2;
  c.machine_rank = 1;
  c.main_process_ip = "10.0.0.1";
  c.main_process_port = 29555;
  c.mixed_precision = "bf16";
  c.use_cpu = true;
  c.gpu_ids = "0,1";
  c.same_network = false;
  c.rdzv_backend = "static";
  c.other["mpirun_config"] = R"({"mpirun_ccl":"4"})";
  test::TempDir dir;
  const std::string path = dir.File("sub/dir/c.yaml");  // folders are made
  ASSERT_THAT(WriteClusterConfig(c, path, /*overwrite=*/false), IsOk());
  const std::string text = test::ReadAll(path);
  EXPECT_EQ(text.front(), '{');
  // Sorted keys, as Accelerate's to_json_file(sort_keys=True).
  EXPECT_LT(text.find("\"compute_environment\""), text.find("\"debug\""));
  EXPECT_LT(text.find("\"mpirun_config\""), text.find("\"num_machines\""));
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig back, ReadClusterConfig(path));
  EXPECT_EQ(back.distributed_type, "MULTI_CPU");
  EXPECT_EQ(back.num_processes, 8);
  EXPECT_EQ(back.num_machines, 2);
  EXPECT_EQ(back.machine_rank, 1);
  EXPECT_EQ(back.main_process_ip, "10.0.0.1");
  EXPECT_EQ(back.main_process_port, 29555);
  EXPECT_EQ(back.mixed_precision, "bf16");
  EXPECT_TRUE(back.use_cpu);
  EXPECT_EQ(back.gpu_ids, "0,1");
  EXPECT_FALSE(back.same_network);
  EXPECT_EQ(back.rdzv_backend, "static");
  EXPECT_EQ(back.other, c.other);
  EXPECT_EQ(ClusterConfigToJson(back), text);
  // No temporary file left beside it.
  EXPECT_THAT(std::distance(std::filesystem::directory_iterator(dir.File("sub/dir")),
                            std::filesystem::directory_iterator()),
              1);
  c.num_processes = 2;
  EXPECT_THAT(WriteClusterConfig(c, path, /*overwrite=*/false),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("already exists")));
  EXPECT_EQ(test::ReadAll(path), text);
  ASSERT_THAT(WriteClusterConfig(c, path, /*overwrite=*/true), IsOk());
  EXPECT_EQ(ReadClusterConfig(path)->num_processes, 2);
  EXPECT_THAT(ReadClusterConfig(dir.File("none.yaml")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("none.yaml")));
}

// ---------------------------------------------------------------------------
// Every launch flag and config key of issue 22: honoured, or refused by name.

// Parses `args` (then PROGRAM `true`) with a config file holding `yaml`, if
// any, in a home of its own that is removed after (the plan keeps no path
// into it).
absl::StatusOr<LaunchPlan> Plan(std::vector<std::string> args, const std::string& yaml = "") {
  test::TempDir home;
  if (!yaml.empty()) {
    args.insert(args.begin(), {"--config_file", home.Write("plan.yaml", yaml)});
  }
  args.push_back("true");
  return ParseLaunchArgs(args, {{"HOME", home.path()}, {"PATH", "/usr/bin:/bin"}});
}

// --multi_gpu: distributed over the GPUs (Accelerate's torchrun path, which
// sets no use_cpu): every rank gets ACCELERATE_USE_CPU=false. Without CUDA in
// the ranks' libtorch they run on the CPU over gloo, as Accelerate's do.
TEST(LaunchPlan, MultiGpuFlag) {
  ACCEL_ASSERT_OK_AND_ASSIGN(LaunchPlan plan,
                             Plan({"--multi_gpu", "--num_processes", "2"}, "use_cpu: true\n"));
  EXPECT_FALSE(plan.use_cpu);
  EXPECT_EQ(plan.num_processes, 2);
  EXPECT_EQ(RankEnvironment(plan, 1, 4, {})["ACCELERATE_USE_CPU"], "false");
  // The config's distributed_type MULTI_GPU means the same.
  ACCEL_ASSERT_OK_AND_ASSIGN(
      plan, Plan({}, "distributed_type: MULTI_GPU\nnum_processes: 2\nuse_cpu: true\n"));
  EXPECT_FALSE(plan.use_cpu);
  // ... unless --cpu says otherwise.
  ACCEL_ASSERT_OK_AND_ASSIGN(
      plan, Plan({"--cpu"}, "distributed_type: MULTI_GPU\nnum_processes: 2\nuse_cpu: false\n"));
  EXPECT_TRUE(plan.use_cpu);
  EXPECT_THAT(Plan({"--multi_gpu", "--num_processes", "1"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--multi_gpu needs at least 2 processes")));
  EXPECT_THAT(Plan({"--multi_gpu", "--cpu", "--num_processes", "2"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("use one of --cpu, --multi_gpu, --use_fsdp")));
  EXPECT_THAT(
      Plan({"--multi_gpu", "--num_processes", "2", "--gpu_ids", "1"}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--gpu_ids \"1\": less than two")));
  EXPECT_THAT(Plan({"--multi_gpu", "--num_processes", "2", "--gpu_ids", "0,1"}), IsOk());
}

// --no_python: PROGRAM runs as it is, which is how accel-launch runs every
// program; Accelerate's meaning (do not put `python` in front) holds.
TEST(AccelLaunch, NoPythonRunsTheProgramAsItIs) {
  test::TempDir home, out;
  Result r = Launch({"--no_python", "--num_processes", "2", "--main_process_port", "0",
                     Bin("accel_launch_probe"), "env", out.path(), "--no_python"},
                    home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  for (int rank : {0, 1}) {
    EXPECT_EQ(ReadVars(RankFile(out, rank))["RANK"], std::to_string(rank));
    // After PROGRAM, the same spelling is the program's own argument.
    EXPECT_THAT(ReadArgs(RankFile(out, rank)), ElementsAre("--no_python"));
  }
}

// --quiet: a failing rank's exit code still comes back, without accel-launch's
// own notices (FailingRankStopsTheOthers shows them without it).
TEST(AccelLaunch, QuietLeavesFailuresToTheRanks) {
  test::TempDir home, out;
  Result r = Launch({"--quiet", "--num_processes", "2", "--main_process_port", "0",
                     Bin("accel_launch_probe"), "crash", "1", "7", out.path()},
                    home.path());
  EXPECT_EQ(r.code, 7);
  EXPECT_THAT(r.err, Not(HasSubstr("accel-launch")));
}

// --debug (and debug: true): ACCELERATE_DEBUG_MODE=true for every rank, where
// the Accelerator's collectives then check the ranks' shapes first
// (AcceleratorDistributed.DebugModeChecksShapes in accelerator_test).
TEST(LaunchPlan, DebugModeReachesEveryRank) {
  ACCEL_ASSERT_OK_AND_ASSIGN(LaunchPlan plan, Plan({"--debug", "--num_processes", "2"}));
  EXPECT_TRUE(plan.debug);
  EXPECT_EQ(RankEnvironment(plan, 1, 4, {})["ACCELERATE_DEBUG_MODE"], "true");
  ACCEL_ASSERT_OK_AND_ASSIGN(plan, Plan({}, "debug: true\n"));
  EXPECT_EQ(RankEnvironment(plan, 0, 4, {})["ACCELERATE_DEBUG_MODE"], "true");
  ACCEL_ASSERT_OK_AND_ASSIGN(plan, Plan({}, "debug: false\n"));
  EXPECT_EQ(RankEnvironment(plan, 0, 4, {}).count("ACCELERATE_DEBUG_MODE"), 0u);
  EXPECT_THAT(Plan({"--debug=1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--debug takes no value")));
}

TEST(LaunchPlan, CpuShareSplitsTheCpus) {
  const std::vector<int> cpus = {0, 1, 2, 3, 4, 5, 6};
  EXPECT_THAT(CpuShare(cpus, 0, 2), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(CpuShare(cpus, 1, 2), ElementsAre(4, 5, 6));
  EXPECT_THAT(CpuShare(cpus, 2, 3), ElementsAre(5, 6));
  EXPECT_THAT(CpuShare({4, 9}, 0, 1), ElementsAre(4, 9));
  EXPECT_THAT(CpuShare({4, 9}, 2, 3), ElementsAre(4));  // fewer CPUs than ranks
  EXPECT_THAT(CpuShare({}, 0, 2), ElementsAre());
  EXPECT_THAT(CpuShare(cpus, 2, 2), ElementsAre());
}

// --enable_cpu_affinity (and the key): each rank runs on its own share of the
// launcher's CPUs, and ACCELERATE_CPU_AFFINITY=1 says so.
TEST(AccelLaunch, CpuAffinityPinsEachRank) {
  cpu_set_t mine;
  ASSERT_EQ(sched_getaffinity(0, sizeof(mine), &mine), 0);
  std::vector<int> allowed;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &mine)) allowed.push_back(cpu);
  }
  test::TempDir home, out;
  const std::string config = home.Write("c.yaml", "enable_cpu_affinity: true\n");
  Result r = Launch({"--config_file", config, "--num_processes", "2", "--main_process_port", "0",
                     Bin("accel_launch_probe"), "env", out.path()},
                    home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  for (int rank : {0, 1}) {
    auto vars = ReadVars(RankFile(out, rank));
    EXPECT_EQ(vars["ACCELERATE_CPU_AFFINITY"], "1");
    std::vector<std::string> expected;
    for (int cpu : CpuShare(allowed, rank, 2)) expected.push_back(std::to_string(cpu));
    EXPECT_EQ(vars["CPUS"], absl::StrJoin(expected, ",")) << "rank " << rank;
  }
  if (allowed.size() >= 2) {
    EXPECT_NE(ReadVars(RankFile(out, 0))["CPUS"], ReadVars(RankFile(out, 1))["CPUS"]);
  }
  // Without it, every rank may run anywhere the launcher may.
  test::TempDir out2;
  r = Launch({"--num_processes", "2", "--main_process_port", "0", Bin("accel_launch_probe"), "env",
              out2.path()},
             home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> all;
  for (int cpu : allowed) all.push_back(std::to_string(cpu));
  EXPECT_EQ(ReadVars(RankFile(out2, 1))["CPUS"], absl::StrJoin(all, ","));
  EXPECT_EQ(ReadVars(RankFile(out2, 1))["ACCELERATE_CPU_AFFINITY"], "");
}

// compute_environment: LOCAL_MACHINE is what accel-launch does; SageMaker is
// refused by name (RefusesWhatLaunchCannotHonour has the config side).
TEST(LaunchPlan, ComputeEnvironmentLocalMachineOnly) {
  EXPECT_THAT(Plan({}, "compute_environment: LOCAL_MACHINE\n"), IsOk());
  EXPECT_THAT(Plan({}, "compute_environment: AMAZON_SAGEMAKER\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("compute_environment: AMAZON_SAGEMAKER")));
}

// rdzv_backend: static (machine 0 hosts the rendezvous) is honoured, the
// elastic backends refused, from the flag as from the key.
TEST(LaunchPlan, RendezvousIsStatic) {
  ACCEL_ASSERT_OK_AND_ASSIGN(
      LaunchPlan plan, Plan({"--rdzv_backend", "static", "--num_processes", "4", "--num_machines",
                             "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1"},
                            "rdzv_backend: static\n"));
  EXPECT_EQ(RankEnvironment(plan, 1, 4, {})["MASTER_ADDR"], "10.0.0.1");
  EXPECT_THAT(Plan({"--rdzv_backend", "c10d"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--rdzv_backend \"c10d\": accel-launch has no elastic")));
  EXPECT_THAT(Plan({}, "rdzv_backend: etcd-v2\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rdzv_backend \"etcd-v2\"")));
}

// same_network: with a static rendezvous both values mean machine 0's
// address and port; the key and the --same_network switch are honoured so.
TEST(LaunchPlan, SameNetworkEitherWay) {
  const std::vector<std::string> two = {
      "--num_processes",   "4",        "--num_machines",      "2",    "--machine_rank", "1",
      "--main_process_ip", "10.0.0.9", "--main_process_port", "29600"};
  std::vector<std::map<std::string, std::string>> envs;
  for (const std::string yaml : {"same_network: true\n", "same_network: false\n"}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(LaunchPlan plan, Plan(two, yaml));
    envs.push_back(RankEnvironment(plan, 0, 4, {}));
  }
  std::vector<std::string> with_switch = two;
  with_switch.push_back("--same_network");
  ACCEL_ASSERT_OK_AND_ASSIGN(LaunchPlan plan, Plan(with_switch));
  envs.push_back(RankEnvironment(plan, 0, 4, {}));
  for (const auto& env : envs) {
    EXPECT_EQ(env.at("MASTER_ADDR"), "10.0.0.9");
    EXPECT_EQ(env.at("MASTER_PORT"), "29600");
    EXPECT_EQ(env.at("RANK"), "2");
    EXPECT_EQ(env, envs[0]);
  }
  EXPECT_THAT(Plan({}, "same_network: sometimes\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("same_network")));
}

// parallelism_config and fp8_config: refused by name unless empty
// (RefusesWhatLaunchCannotHonour has the refusals of the keys themselves).
TEST(LaunchPlan, ParallelismAndFp8SectionsOnlyEmpty) {
  EXPECT_THAT(Plan({}, "parallelism_config: {}\nfp8_config: ~\n"), IsOk());
  EXPECT_THAT(Plan({}, "parallelism_config:\n  parallelism_config_cp_size: 2\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("parallelism_config")));
  EXPECT_THAT(Plan({}, "fp8_config:\n  backend: MSAMP\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fp8_config")));
}

// distributed_type FSDP with fsdp_config, or --use_fsdp with --fsdp_* flags:
// Accelerate's variables, names and spellings, for the ranks' Accelerator.
TEST(LaunchPlan, FsdpExportsAccelerateVariables) {
  // tests/test_configs/latest_fsdp.yaml-style file, as `accelerate config` writes it.
  const std::string yaml =
      "compute_environment: LOCAL_MACHINE\n"
      "distributed_type: FSDP\n"
      "num_processes: 2\n"
      "use_cpu: true\n"
      "fsdp_config:\n"
      "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
      "  fsdp_backward_prefetch: BACKWARD_PRE\n"
      "  fsdp_cpu_ram_efficient_loading: true\n"
      "  fsdp_forward_prefetch: false\n"
      "  fsdp_offload_params: false\n"
      "  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
      "  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
      "  fsdp_sync_module_states: true\n"
      "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
      "  fsdp_use_orig_params: True\n"
      "  fsdp_version: 2\n"
      "  reshard_after_forward: false\n";
  ACCEL_ASSERT_OK_AND_ASSIGN(LaunchPlan plan, Plan({}, yaml));
  EXPECT_TRUE(plan.use_fsdp);
  auto env = RankEnvironment(plan, 1, 4, {});
  const std::map<std::string, std::string> expected = {
      {"ACCELERATE_USE_FSDP", "true"},
      {"FSDP_VERSION", "2"},
      {"FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"},
      {"FSDP_RESHARD_AFTER_FORWARD", "false"},  // the key without its fsdp_ prefix
      {"FSDP_OFFLOAD_PARAMS", "false"},
      {"FSDP_MIN_NUM_PARAMS", "100000000"},
      {"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"},
      {"FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer"},
      {"FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE"},
      {"FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"},
      {"FSDP_FORWARD_PREFETCH", "false"},
      {"FSDP_USE_ORIG_PARAMS", "true"},  // lower-cased
      {"FSDP_CPU_RAM_EFFICIENT_LOADING", "true"},
      {"FSDP_SYNC_MODULE_STATES", "true"},
      {"FSDP_ACTIVATION_CHECKPOINTING", "false"},
  };
  for (const auto& [name, value] : expected) EXPECT_EQ(env[name], value) << name;
  EXPECT_EQ(env["ACCELERATE_USE_CPU"], "false");

  // A key no variable carries is refused by name, not passed on and ignored.
  EXPECT_THAT(Plan({}, yaml + "  fsdp_new_knob: 3\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fsdp_new_knob")));

  // Flags over the file; Accelerate's defaults when neither says.
  ACCEL_ASSERT_OK_AND_ASSIGN(
      plan, Plan({"--fsdp_sharding_strategy", "NO_SHARD", "--fsdp-offload-params=True"}, yaml));
  env = RankEnvironment(plan, 0, 4, {});
  EXPECT_EQ(env["FSDP_SHARDING_STRATEGY"], "NO_SHARD");
  EXPECT_EQ(env["FSDP_OFFLOAD_PARAMS"], "true");
  ACCEL_ASSERT_OK_AND_ASSIGN(plan, Plan({"--use_fsdp", "--num_processes", "2"}));
  env = RankEnvironment(plan, 0, 4, {});
  EXPECT_EQ(env["FSDP_VERSION"], "1");
  EXPECT_EQ(env["FSDP_SHARDING_STRATEGY"], "FULL_SHARD");
  EXPECT_EQ(env["FSDP_USE_ORIG_PARAMS"], "true");
  EXPECT_EQ(env.count("FSDP_AUTO_WRAP_POLICY"), 0u);
  EXPECT_EQ(env.count("FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP"), 0u);

  // Not FSDP: no FSDP variables, and FSDP settings are refused, not ignored.
  ACCEL_ASSERT_OK_AND_ASSIGN(plan, Plan({"--num_processes", "2"}));
  EXPECT_EQ(RankEnvironment(plan, 0, 4, {}).count("ACCELERATE_USE_FSDP"), 0u);
  EXPECT_THAT(Plan({"--fsdp_sharding_strategy", "FULL_SHARD"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--fsdp_sharding_strategy without --use_fsdp")));
  EXPECT_THAT(Plan({"--use_fsdp", "--fsdp_sync_module_states", "false"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("fsdp_cpu_ram_efficient_loading true needs "
                                 "fsdp_sync_module_states true")));
  EXPECT_THAT(Plan({"--use_fsdp", "--multi_gpu", "--num_processes", "2"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("use one of")));
}

TEST(AccelLaunch, FsdpConfigReachesEveryRank) {
  test::TempDir home, out;
  const std::string config = home.Write("fsdp.yaml",
                                        "distributed_type: FSDP\n"
                                        "num_processes: 2\n"
                                        "fsdp_config:\n"
                                        "  fsdp_sharding_strategy: HYBRID_SHARD\n"
                                        "  fsdp_transformer_layer_cls_to_wrap: [Block, Embed]\n");
  Result r = Launch({"--config_file", config, "--main_process_port", "0", Bin("accel_launch_probe"),
                     "env", out.path()},
                    home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  for (int rank : {0, 1}) {
    auto vars = ReadVars(RankFile(out, rank));
    EXPECT_EQ(vars["ACCELERATE_USE_FSDP"], "true");
    EXPECT_EQ(vars["FSDP_SHARDING_STRATEGY"], "HYBRID_SHARD");
    EXPECT_EQ(vars["FSDP_TRANSFORMER_CLS_TO_WRAP"], "Block,Embed");
    EXPECT_EQ(vars["ACCELERATE_USE_CPU"], "false");
  }
}

// ---------------------------------------------------------------------------
// Two machines, one job: two accel-launch invocations, as two hosts (or two
// SLURM nodes) run them, here both on 127.0.0.1.

TEST(AccelLaunch, TwoMachinesFormOneJob) {
  test::TempDir home, out, io;
  // Machine 0 hosts the rendezvous on this port; both machines must know it
  // beforehand, so --main_process_port 0 cannot serve.
  const std::string port = std::to_string(test::FreePort());
  std::vector<pid_t> machines;
  for (int machine : {0, 1}) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    const std::string log = io.File("machine" + std::to_string(machine) + ".log");
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    // accel-test's ranks check the process state (4 processes, this rank),
    // all_reduce / gather / broadcast across both machines, the prepared
    // loader's shards and a data-parallel step against one process.
    machines.push_back(
        Spawn({Bin("accel-launch"), "--num_processes", "4", "--num_machines", "2", "--machine_rank",
               std::to_string(machine), "--main_process_ip", "127.0.0.1", "--main_process_port",
               port, "--monitor_interval", "0.05", Bin("accel-test")},
              ToolEnvironment(home.path(), {{"ACCEL_TEST_RANK_OF", "1"}}), &fa));
    posix_spawn_file_actions_destroy(&fa);
    ASSERT_GT(machines.back(), 0);
  }
  for (int machine : {0, 1}) {
    EXPECT_EQ(Wait(machines[static_cast<size_t>(machine)], 240), 0)
        << test::ReadAll(io.File("machine" + std::to_string(machine) + ".log"));
  }
  EXPECT_THAT(test::ReadAll(io.File("machine0.log")),
              HasSubstr("accel-test: 4 processes, distributed type MULTI_CPU"));

  // The ranks each machine started: 0-1 on machine 0, 2-3 on machine 1,
  // every one seeing the whole job.
  std::vector<pid_t> probes;
  for (int machine : {0, 1}) {
    probes.push_back(
        Spawn({Bin("accel-launch"), "--num_processes", "4", "--num_machines", "2", "--machine_rank",
               std::to_string(machine), "--main_process_ip", "127.0.0.1", "--main_process_port",
               port, Bin("accel_launch_probe"), "env", out.path()},
              ToolEnvironment(home.path(), {}), nullptr));
  }
  for (pid_t pid : probes) EXPECT_EQ(Wait(pid, 60), 0);
  for (int rank = 0; rank < 4; ++rank) {
    auto vars = ReadVars(RankFile(out, rank));
    EXPECT_EQ(vars["WORLD_SIZE"], "4");
    EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank % 2));
    EXPECT_EQ(vars["GROUP_RANK"], std::to_string(rank / 2));
    EXPECT_EQ(vars["GROUP_WORLD_SIZE"], "2");
    EXPECT_EQ(vars["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(vars["MASTER_PORT"], port);
  }
}

TEST(ClusterConfig, BasicConfigFollowsTheCudaDevices) {
  // Accelerate's write_basic_config: one process per device, MULTI_GPU past one.
  ClusterConfig none = BasicClusterConfig("bf16", 0);
  EXPECT_EQ(none.distributed_type, "NO");
  EXPECT_EQ(none.num_processes, 1);
  EXPECT_FALSE(none.use_cpu);  // a CPU-only host: the CPU anyway, but not forced
  EXPECT_EQ(none.mixed_precision, "bf16");
  EXPECT_EQ(none.compute_environment, "LOCAL_MACHINE");
  ClusterConfig one = BasicClusterConfig("no", 1);
  EXPECT_EQ(one.distributed_type, "NO");
  EXPECT_EQ(one.num_processes, 1);
  EXPECT_FALSE(one.use_cpu);
  ClusterConfig eight = BasicClusterConfig("no", 8);
  EXPECT_EQ(eight.distributed_type, "MULTI_GPU");
  EXPECT_EQ(eight.num_processes, 8);
  EXPECT_FALSE(eight.use_cpu);
  // What it writes reads back the same, and accel-launch starts 8 GPU ranks.
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig back,
                             ParseClusterConfig(ClusterConfigToJson(eight), "basic.yaml"));
  EXPECT_EQ(ClusterConfigToJson(back), ClusterConfigToJson(eight));
  ACCEL_ASSERT_OK_AND_ASSIGN(LaunchPlan plan, Plan({}, ClusterConfigToJson(eight)));
  EXPECT_EQ(plan.num_processes, 8);
  EXPECT_EQ(RankEnvironment(plan, 0, 4, {})["ACCELERATE_USE_CPU"], "false");
}

// ---------------------------------------------------------------------------
// accel-config and accel-env.

TEST(AccelConfig, DefaultWritesOnceAndParsesBack) {
  test::TempDir home;
  Result r = RunTool({Bin("accel-config"), "--default", "--mixed_precision", "bf16"}, home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string path = home.File(".cache/accel/default_config.yaml");
  EXPECT_THAT(r.out, HasSubstr(path));
  const std::string before = test::ReadAll(path);
  EXPECT_EQ(before.front(), '{');  // JSON syntax in the .yaml path, as Accelerate
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig config, ReadClusterConfig(path));
  EXPECT_EQ(config.mixed_precision, "bf16");
  EXPECT_EQ(config.num_processes, 1);
  EXPECT_EQ(config.distributed_type, "NO");  // this machine's libtorch has no CUDA
  EXPECT_FALSE(config.use_cpu);  // the quicktour on a GPU machine must not train on the CPU
  EXPECT_FALSE(config.debug);
  EXPECT_FALSE(config.enable_cpu_affinity);
  r = RunTool({Bin("accel-config"), "--default"}, home.path());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr(path + " already exists"));
  EXPECT_EQ(test::ReadAll(path), before);
  // --show prints it; accel-launch reads it from there; accel-env shows it.
  r = RunTool({Bin("accel-config"), "--show"}, home.path());
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, before);
  test::TempDir out;
  r = Launch({Bin("accel_launch_probe"), "env", out.path()}, home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(ReadVars(RankFile(out, 0))["ACCELERATE_MIXED_PRECISION"], "bf16");
  r = RunTool({Bin("accel-env")}, home.path());
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("- accel default config:\n\t- compute_environment: "
                               "LOCAL_MACHINE\n\t- debug: false\n"));
  EXPECT_THAT(r.out, HasSubstr("\t- mixed_precision: bf16\n"));
  EXPECT_THAT(r.out, HasSubstr("\t- num_processes: 1\n"));
  // Elsewhere with --config_file=.
  const std::string other = home.File("mine.yaml");
  r = RunTool({Bin("accel-config"), "--default", "--config-file=" + other}, home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(ReadClusterConfig(other), IsOk());
}

TEST(AccelConfig, BadArgumentsAreRefused) {
  test::TempDir home;
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--bogus"}, "unknown argument --bogus"},
      {{"--default", "--mixed_precision", "fp8"}, "--mixed_precision \"fp8\""},
      {{"--default", "--mixed_precision"}, "--mixed_precision needs a value"},
      {{"--default", "--show"}, "do not go together"},
      {{"--default=1"}, "--default takes no value"},
      {{"--show", "--config_file", home.File("none.yaml")}, "none.yaml: not found"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {Bin("accel-config")};
    args.insert(args.end(), c.args.begin(), c.args.end());
    Result r = RunTool(args, home.path());
    EXPECT_EQ(r.code, 1) << c.message;
    EXPECT_THAT(r.err, HasSubstr(c.message));
  }
  EXPECT_FALSE(std::filesystem::exists(home.File(".cache")));
}

TEST(AccelConfig, InteractiveAnswers) {
  test::TempDir home;
  const std::string path = home.File("answers.yaml");
  // A wrong answer is asked again; an empty one takes the default.
  Result r = RunTool({Bin("accel-config"), "--config_file", path}, home.path(),
                     "multi-cpu\n\nlots\n4\nbf16\n");
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_THAT(r.out, HasSubstr("\"lots\" is not a valid answer"));
  ACCEL_ASSERT_OK_AND_ASSIGN(ClusterConfig config, ReadClusterConfig(path));
  EXPECT_EQ(config.distributed_type, "MULTI_CPU");
  EXPECT_TRUE(config.use_cpu);
  EXPECT_EQ(config.num_processes, 4);
  EXPECT_EQ(config.num_machines, 1);
  EXPECT_EQ(config.mixed_precision, "bf16");

  // Two machines: processes must divide, the rank must be in range; the
  // address and port are asked.
  r = RunTool({Bin("accel-config"), "--config_file", path}, home.path(),
              "MULTI_GPU\n2\n3\n6\n2\n1\n10.0.0.7\n99999\n29600\n\n");
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_THAT(r.out, HasSubstr("\"3\" is not a valid answer"));
  EXPECT_THAT(r.out, HasSubstr("\"2\" is not a valid answer"));
  EXPECT_THAT(r.out, HasSubstr("\"99999\" is not a valid answer"));
  ACCEL_ASSERT_OK_AND_ASSIGN(config, ReadClusterConfig(path));
  EXPECT_EQ(config.distributed_type, "MULTI_GPU");
  EXPECT_FALSE(config.use_cpu);
  EXPECT_EQ(config.num_processes, 6);
  EXPECT_EQ(config.num_machines, 2);
  EXPECT_EQ(config.machine_rank, 1);
  EXPECT_EQ(config.main_process_ip, "10.0.0.7");
  EXPECT_EQ(config.main_process_port, 29600);
  EXPECT_EQ(config.mixed_precision, "no");

  // Nothing on stdin: every default (one process, no mixed precision, not
  // the CPU only).
  r = RunTool({Bin("accel-config"), "--config_file", path}, home.path(), "");
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  ACCEL_ASSERT_OK_AND_ASSIGN(config, ReadClusterConfig(path));
  EXPECT_EQ(config.distributed_type, "NO");
  EXPECT_EQ(config.num_processes, 1);
  EXPECT_FALSE(config.use_cpu);

  // No distributed training, the CPU only when asked for.
  r = RunTool({Bin("accel-config"), "--config_file", path}, home.path(), "no\nperhaps\nyes\n\n");
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_THAT(r.out, HasSubstr("Train on the CPU only"));
  EXPECT_THAT(r.out, HasSubstr("\"perhaps\" is not a valid answer"));
  ACCEL_ASSERT_OK_AND_ASSIGN(config, ReadClusterConfig(path));
  EXPECT_EQ(config.distributed_type, "NO");
  EXPECT_TRUE(config.use_cpu);
}

TEST(AccelEnv, PrintsTheBullets) {
  test::TempDir home;
  Result r = RunTool({Bin("accel-env")}, home.path());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("Copy-and-paste the text below in your GitHub issue\n\n"));
  std::vector<std::string> bullets;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("- ", 0) == 0) bullets.push_back(line);
  }
  ASSERT_EQ(bullets.size(), 8u) << r.out;
  EXPECT_THAT(bullets[0], MatchesRegex("- `accel` version: [0-9]+\\.[0-9]+\\.[0-9]+.*"));
  EXPECT_THAT(bullets[1], MatchesRegex("- Platform: Linux .+"));
  EXPECT_THAT(bullets[2], HasSubstr("- `accel-env` location: "));
  EXPECT_THAT(bullets[3], MatchesRegex("- libtorch version: [0-9]+\\.[0-9]+.*"));
  EXPECT_THAT(bullets[4],
              MatchesRegex("- CPU count: [1-9][0-9]* \\(physical cores: [1-9][0-9]*\\)"));
  EXPECT_THAT(bullets[5], MatchesRegex("- System RAM: [0-9]+\\.[0-9][0-9] GB"));
  EXPECT_THAT(bullets[6], MatchesRegex("- GPUs: .+"));
  EXPECT_EQ(bullets[7], "- accel default config: Not found");
  // An unreadable config is reported, not taken for a missing one.
  std::filesystem::create_directories(home.File(".cache/accel"));
  home.Write(".cache/accel/default_config.yaml", "num_processes: [\n");
  r = RunTool({Bin("accel-env")}, home.path());
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("- accel default config: unreadable: "));
  EXPECT_EQ(RunTool({Bin("accel-env"), "--bogus"}, home.path()).code, 1);
}

}  // namespace
}  // namespace accel::train
