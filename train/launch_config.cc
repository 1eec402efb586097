#include "train/launch_config.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <set>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace accel::train {
namespace {

// Accelerate's ClusterConfig fields (commands/config/config_args.py) and the
// legacy fp16 flag. Anything else in a config file is an error.
const std::set<std::string>& KnownKeys() {
  static const auto* keys = new std::set<std::string>{"compute_environment",
                                                      "distributed_type",
                                                      "mixed_precision",
                                                      "use_cpu",
                                                      "debug",
                                                      "num_processes",
                                                      "machine_rank",
                                                      "num_machines",
                                                      "gpu_ids",
                                                      "main_process_ip",
                                                      "main_process_port",
                                                      "rdzv_backend",
                                                      "same_network",
                                                      "main_training_function",
                                                      "enable_cpu_affinity",
                                                      "fp8_config",
                                                      "deepspeed_config",
                                                      "fsdp_config",
                                                      "parallelism_config",
                                                      "megatron_lm_config",
                                                      "mpirun_config",
                                                      "dynamo_config",
                                                      "downcast_bf16",
                                                      "tpu_name",
                                                      "tpu_zone",
                                                      "tpu_use_cluster",
                                                      "tpu_use_sudo",
                                                      "command_file",
                                                      "commands",
                                                      "tpu_vm",
                                                      "tpu_env",
                                                      "ipex_config",
                                                      "mpirun_hostfile",
                                                      "fp16"};
  return *keys;
}

std::string Unquote(absl::string_view v) {
  v = absl::StripAsciiWhitespace(v);
  if (v.size() >= 2 &&
      ((v.front() == '"' && v.back() == '"') || (v.front() == '\'' && v.back() == '\''))) {
    v = v.substr(1, v.size() - 2);
  }
  return std::string(v);
}

absl::StatusOr<bool> Bool(const std::string& key, const std::string& v, absl::string_view source) {
  const std::string s = absl::AsciiStrToLower(v);
  if (s == "true" || s == "yes") return true;
  if (s == "false" || s == "no") return false;
  return absl::InvalidArgumentError(
      absl::StrCat(source, ": ", key, " is \"", v, "\", expected true or false"));
}

absl::StatusOr<int> Int(const std::string& key, const std::string& v, absl::string_view source) {
  int n = 0;
  if (!absl::SimpleAtoi(v, &n)) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": ", key, " is \"", v, "\", expected an integer"));
  }
  return n;
}

// Top-level scalars as strings; nested sections as their raw text.
absl::StatusOr<std::map<std::string, std::string>> ReadYaml(absl::string_view text,
                                                            absl::string_view source) {
  std::map<std::string, std::string> out;
  std::string section;
  int line_number = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_number;
    std::string line(absl::StripTrailingAsciiWhitespace(raw));
    absl::string_view trimmed = absl::StripLeadingAsciiWhitespace(line);
    if (trimmed.empty() || trimmed.front() == '#' || trimmed == "---") continue;
    const size_t indent = line.size() - trimmed.size();
    if (indent > 0 || trimmed.front() == '-') {
      if (section.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            source, ":", line_number, ": indented or list line outside a section: ", trimmed));
      }
      absl::StrAppend(&out[section], out[section].empty() ? "" : "\n", trimmed);
      continue;
    }
    const size_t colon = trimmed.find(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", line_number, ": expected `key: value`, got: ", trimmed));
    }
    std::string key(absl::StripAsciiWhitespace(trimmed.substr(0, colon)));
    absl::string_view value = trimmed.substr(colon + 1);
    // An inline comment after a bare value.
    if (size_t hash = value.find(" #");
        hash != absl::string_view::npos && !absl::StrContains(value.substr(0, hash), "\"")) {
      value = value.substr(0, hash);
    }
    std::string v = Unquote(value);
    if (v == "null" || v == "~") v.clear();
    out[key] = v;
    section = value.empty() || absl::StripAsciiWhitespace(value).empty() ? key : "";
  }
  return out;
}

absl::StatusOr<std::map<std::string, std::string>> ReadJson(absl::string_view text,
                                                            absl::string_view source) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  std::map<std::string, std::string> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it->is_string()) {
      out[it.key()] = it->get<std::string>();
    } else if (it->is_null()) {
      out[it.key()] = "";
    } else {
      out[it.key()] = it->dump();
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<ClusterConfig> ParseClusterConfig(absl::string_view text, absl::string_view source) {
  absl::string_view start = absl::StripLeadingAsciiWhitespace(text);
  absl::StatusOr<std::map<std::string, std::string>> fields =
      !start.empty() && start.front() == '{' ? ReadJson(text, source) : ReadYaml(text, source);
  if (!fields.ok()) return fields.status();
  std::vector<std::string> unknown;
  for (const auto& [key, value] : *fields) {
    if (KnownKeys().count(key) == 0) unknown.push_back(key);
  }
  if (!unknown.empty()) {
    std::sort(unknown.begin(), unknown.end());
    return absl::InvalidArgumentError(absl::StrCat(
        "The config file at ", source, " had unknown keys (['", absl::StrJoin(unknown, "', '"),
        "']), please try upgrading your `accel` version or fix (and potentially "
        "remove) these keys from your config file."));
  }
  ClusterConfig c;
  for (const auto& [key, v] : *fields) {
    if (key == "compute_environment") {
      c.compute_environment = v;
    } else if (key == "distributed_type") {
      c.distributed_type = absl::AsciiStrToUpper(v);
      if (c.distributed_type != "NO" && c.distributed_type != "MULTI_CPU" &&
          c.distributed_type != "MULTI_GPU") {
        return absl::InvalidArgumentError(absl::StrCat(
            source, ": distributed_type \"", v,
            "\" is not one accel runs (NO, MULTI_CPU, MULTI_GPU; DeepSpeed, FSDP, TPU are "
            "Python-only)"));
      }
    } else if (key == "mixed_precision") {
      c.mixed_precision = absl::AsciiStrToLower(v.empty() ? "no" : v);
    } else if (key == "fp16") {
      absl::StatusOr<bool> b = Bool(key, v, source);
      if (!b.ok()) return b.status();
      if (*b) c.mixed_precision = "fp16";
    } else if (key == "use_cpu") {
      absl::StatusOr<bool> b = Bool(key, v, source);
      if (!b.ok()) return b.status();
      c.use_cpu = *b;
    } else if (key == "debug") {
      absl::StatusOr<bool> b = Bool(key, v, source);
      if (!b.ok()) return b.status();
      c.debug = *b;
    } else if (key == "same_network") {
      absl::StatusOr<bool> b = Bool(key, v, source);
      if (!b.ok()) return b.status();
      c.same_network = *b;
    } else if (key == "enable_cpu_affinity") {
      absl::StatusOr<bool> b = Bool(key, v, source);
      if (!b.ok()) return b.status();
      c.enable_cpu_affinity = *b;
    } else if (key == "num_processes" || key == "num_machines" || key == "machine_rank" ||
               key == "main_process_port") {
      if (v.empty()) continue;
      absl::StatusOr<int> n = Int(key, v, source);
      if (!n.ok()) return n.status();
      if (key == "num_processes") c.num_processes = *n;
      if (key == "num_machines") c.num_machines = *n;
      if (key == "machine_rank") c.machine_rank = *n;
      if (key == "main_process_port") c.main_process_port = *n;
    } else if (key == "gpu_ids") {
      c.gpu_ids = v;
    } else if (key == "main_process_ip") {
      c.main_process_ip = v;
    } else if (key == "rdzv_backend") {
      c.rdzv_backend = v;
    } else if (key == "main_training_function") {
      c.main_training_function = v;
    } else {
      c.other[key] = v;
    }
  }
  if (c.distributed_type == "NO") c.num_processes = 1;
  return c;
}

absl::StatusOr<ClusterConfig> ReadClusterConfig(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("config file ", path, ": not found"));
  std::string text;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  std::fclose(f);
  return ParseClusterConfig(text, path);
}

std::string ClusterConfigToJson(const ClusterConfig& c) {
  nlohmann::ordered_json j;
  j["compute_environment"] = c.compute_environment;
  j["debug"] = c.debug;
  j["distributed_type"] = c.distributed_type;
  j["enable_cpu_affinity"] = c.enable_cpu_affinity;
  if (!c.main_process_ip.empty()) j["main_process_ip"] = c.main_process_ip;
  if (c.main_process_port) j["main_process_port"] = *c.main_process_port;
  j["machine_rank"] = c.machine_rank;
  j["mixed_precision"] = c.mixed_precision;
  j["num_machines"] = c.num_machines;
  j["num_processes"] = c.num_processes;
  j["use_cpu"] = c.use_cpu;
  return j.dump(2) + "\n";
}

absl::Status WriteClusterConfig(const ClusterConfig& config, const std::string& path,
                                bool overwrite) {
  if (!overwrite) {
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      std::fclose(f);
      return absl::AlreadyExistsError(
          absl::StrCat("config file ", path, " already exists; not overwriting it"));
    }
  }
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    std::string dir = path.substr(0, slash);
    size_t pos = 0;
    while ((pos = dir.find('/', pos + 1)) != std::string::npos) {
      (void)::mkdir(dir.substr(0, pos).c_str(), 0755);
    }
    (void)::mkdir(dir.c_str(), 0755);
  }
  // A temporary file beside it, synced, then renamed over: a reader sees the
  // old file or the new one, never half of one.
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const std::string text = ClusterConfigToJson(config);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  }
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                  ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = ok ? errno : err;
    ::unlink(tmp.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot write ", path, ": ", std::strerror(e)));
  }
  return absl::OkStatus();
}

std::string DefaultConfigPath() {
  if (const char* f = std::getenv("ACCEL_CONFIG_FILE"); f != nullptr && *f != '\0') return f;
  std::string cache;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    cache = x;
  } else {
    const char* home = std::getenv("HOME");
    cache = absl::StrCat(home != nullptr ? home : "", "/.cache");
  }
  return cache + "/accel/default_config.yaml";
}

absl::StatusOr<LaunchPlan> ParseLaunchArgs(const std::vector<std::string>& args,
                                           const std::map<std::string, std::string>& env) {
  std::map<std::string, std::string> flags;
  std::set<std::string> switches;
  size_t i = 0;
  static const std::set<std::string> kValued = {
      "config_file",     "num_processes",     "num_machines",    "machine_rank",
      "main_process_ip", "main_process_port", "mixed_precision", "num_cpu_threads_per_process"};
  static const std::set<std::string> kSwitches = {"cpu", "multi_gpu", "no_python", "quiet"};
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.rfind("--", 0) != 0) break;
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    name = absl::StrReplaceAll(name, {{"-", "_"}});
    if (kSwitches.count(name)) {
      if (has_value) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      }
      switches.insert(name);
      continue;
    }
    if (!kValued.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", a, " (see --help)"));
    }
    if (!has_value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      value = args[++i];
    }
    flags[name] = value;
  }
  LaunchPlan plan;
  plan.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  if (plan.command.empty()) {
    return absl::InvalidArgumentError(
        "no PROGRAM to launch (accel-launch [flags] PROGRAM ARGS...)");
  }

  // The config file underneath the flags.
  ClusterConfig config;
  std::string config_path;
  if (auto it = flags.find("config_file"); it != flags.end()) {
    config_path = it->second;
    absl::StatusOr<ClusterConfig> c = ReadClusterConfig(config_path);
    if (!c.ok()) return c.status();
    config = *c;
  } else {
    config_path = DefaultConfigPath();
    if (FILE* f = std::fopen(config_path.c_str(), "rb")) {
      std::fclose(f);
      absl::StatusOr<ClusterConfig> c = ReadClusterConfig(config_path);
      if (!c.ok()) return c.status();
      config = *c;
    }
  }
  plan.num_processes = config.num_processes;
  plan.num_machines = config.num_machines;
  plan.machine_rank = config.machine_rank;
  if (!config.main_process_ip.empty()) plan.main_process_ip = config.main_process_ip;
  if (config.main_process_port) plan.main_process_port = *config.main_process_port;
  plan.mixed_precision = config.mixed_precision;
  plan.use_cpu = config.use_cpu;
  // Under SLURM, one accel-launch per node.
  if (auto n = env.find("SLURM_NNODES"); n != env.end()) {
    int v = 0;
    if (absl::SimpleAtoi(n->second, &v) && v > 0) plan.num_machines = v;
  }
  if (auto r = env.find("SLURM_NODEID"); r != env.end()) {
    int v = 0;
    if (absl::SimpleAtoi(r->second, &v) && v >= 0) plan.machine_rank = v;
  }

  auto int_flag = [&](const std::string& name, int* out, int min, int max) -> absl::Status {
    auto it = flags.find(name);
    if (it == flags.end()) return absl::OkStatus();
    int v = 0;
    if (!absl::SimpleAtoi(it->second, &v) || v < min || v > max) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", name, " \"", it->second, "\": expected an integer in [", min, ", ", max, "]"));
    }
    *out = v;
    return absl::OkStatus();
  };
  if (absl::Status s = int_flag("num_processes", &plan.num_processes, 1, 1 << 20); !s.ok()) {
    return s;
  }
  if (absl::Status s = int_flag("num_machines", &plan.num_machines, 1, 1 << 16); !s.ok()) return s;
  if (absl::Status s = int_flag("machine_rank", &plan.machine_rank, 0, 1 << 16); !s.ok()) return s;
  if (absl::Status s = int_flag("main_process_port", &plan.main_process_port, 0, 65535); !s.ok()) {
    return s;
  }
  if (flags.count("num_cpu_threads_per_process")) {
    int t = 0;
    if (absl::Status s = int_flag("num_cpu_threads_per_process", &t, 1, 1 << 16); !s.ok()) {
      return s;
    }
    plan.threads_per_process = t;
  }
  if (auto it = flags.find("main_process_ip"); it != flags.end()) plan.main_process_ip = it->second;
  if (auto it = flags.find("mixed_precision"); it != flags.end()) {
    plan.mixed_precision = absl::AsciiStrToLower(it->second);
  }
  if (plan.mixed_precision != "no" && plan.mixed_precision != "fp16" &&
      plan.mixed_precision != "bf16") {
    return absl::InvalidArgumentError(absl::StrCat("--mixed_precision \"", plan.mixed_precision,
                                                   "\": expected no, fp16 or bf16"));
  }
  if (switches.count("cpu")) plan.use_cpu = true;
  if (plan.num_processes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_processes must be at least 1, got ", plan.num_processes));
  }
  if (plan.num_processes % plan.num_machines != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_processes ", plan.num_processes, " is not divisible by --num_machines ",
                     plan.num_machines, " (each machine runs the same number of processes)"));
  }
  if (plan.machine_rank >= plan.num_machines) {
    return absl::InvalidArgumentError(absl::StrCat("--machine_rank ", plan.machine_rank,
                                                   " is outside [0, ", plan.num_machines, ")"));
  }
  if (plan.num_machines > 1 && !flags.count("main_process_ip") && config.main_process_ip.empty()) {
    return absl::InvalidArgumentError(
        "--num_machines > 1 needs --main_process_ip, the address of machine 0");
  }
  return plan;
}

std::map<std::string, std::string> RankEnvironment(const LaunchPlan& plan, int local_rank,
                                                   int cpu_count,
                                                   const std::map<std::string, std::string>& env) {
  const int local = plan.local_processes();
  std::map<std::string, std::string> out;
  const int rank = plan.machine_rank * local + local_rank;
  out["RANK"] = absl::StrCat(rank);
  out["LOCAL_RANK"] = absl::StrCat(local_rank);
  out["WORLD_SIZE"] = absl::StrCat(plan.num_processes);
  out["LOCAL_WORLD_SIZE"] = absl::StrCat(local);
  out["GROUP_RANK"] = absl::StrCat(plan.machine_rank);
  out["ROLE_RANK"] = absl::StrCat(rank);
  out["GROUP_WORLD_SIZE"] = absl::StrCat(plan.num_machines);
  out["MASTER_ADDR"] = plan.main_process_ip;
  out["MASTER_PORT"] = absl::StrCat(plan.main_process_port);
  out["TORCHELASTIC_RESTART_COUNT"] = "0";
  out["ACCELERATE_MIXED_PRECISION"] = plan.mixed_precision;
  out["ACCELERATE_USE_CPU"] = plan.use_cpu ? "true" : "false";
  out["ACCEL_LAUNCHER"] = "accel-launch";
  if (plan.threads_per_process) {
    out["OMP_NUM_THREADS"] = absl::StrCat(*plan.threads_per_process);
  } else if (env.count("OMP_NUM_THREADS") == 0 && local > 1) {
    // The cores shared out among the local processes (Accelerate's --cpu rule).
    out["OMP_NUM_THREADS"] = absl::StrCat(std::max(1, cpu_count / local));
  }
  return out;
}

}  // namespace accel::train
