// accel-config: writes accel-launch's default_config.yaml (Accelerate's
// `accelerate config`): `--default` writes the minimal config for this
// machine's CUDA devices (as libtorch counts them; Accelerate's
// write_basic_config), otherwise the questions are asked on stdin. `--show`
// prints the current one.
//
//   accel-config --default [--config_file F] [--mixed_precision no|fp16|bf16]
//   accel-config [--config_file F]          (interactive)
//   accel-config --show [--config_file F]
#include <algorithm>
#include <cstdio>
#include <exception>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <torch/cuda.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "train/launch_config.h"

namespace {

using accel::train::ClusterConfig;

// Asks until the answer is valid; an empty answer takes the default. EOF on
// stdin: the default too (so a script can pipe fewer answers).
std::string Ask(const std::string& question, const std::string& fallback,
                const std::function<bool(const std::string&)>& valid) {
  while (true) {
    std::cout << question << " [" << fallback << "]: " << std::flush;
    std::string answer;
    if (!std::getline(std::cin, answer)) {
      std::cout << "\n";
      return fallback;
    }
    answer = std::string(absl::StripAsciiWhitespace(answer));
    if (answer.empty()) return fallback;
    if (valid(answer)) return answer;
    std::cout << "  \"" << answer << "\" is not a valid answer; try again\n";
  }
}

bool AnyText(const std::string& s) { return s.find_first_of(" \t") == std::string::npos; }
bool PositiveInt(const std::string& s) {
  int n = 0;
  return absl::SimpleAtoi(s, &n) && n >= 1;
}
bool Port(const std::string& s) {
  int n = 0;
  return absl::SimpleAtoi(s, &n) && n >= 1 && n <= 65535;
}
bool Precision(const std::string& s) {
  const std::string p = absl::AsciiStrToLower(s);
  return p == "no" || p == "fp16" || p == "bf16";
}
bool YesNo(const std::string& s) {
  const std::string a = absl::AsciiStrToLower(s);
  return a == "yes" || a == "no" || a == "y" || a == "n";
}
bool DistributedType(const std::string& s) {
  const std::string t = absl::AsciiStrToLower(s);
  return t == "no" || t == "multi-cpu" || t == "multi-gpu" || t == "multi_cpu" || t == "multi_gpu";
}

int Usage() {
  std::cerr << "usage: accel-config [--default | --show] [--config_file F] "
               "[--mixed_precision no|fp16|bf16]\n";
  return 1;
}

int Run(int argc, char** argv) {
  bool defaults = false, show = false;
  std::string path = accel::train::DefaultConfigPath();
  std::string precision = "no";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], value;
    bool has_value = false;
    if (const size_t eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      has_value = true;
    }
    if (a.rfind("--", 0) == 0) {  // --config-file is --config_file
      std::replace(a.begin() + 2, a.end(), '-', '_');
    }
    auto take_value = [&](const char* flag) {
      if (has_value) return true;
      if (i + 1 >= argc) {
        std::cerr << "accel-config: " << flag << " needs a value\n";
        return false;
      }
      value = argv[++i];
      return true;
    };
    if ((a == "--default" || a == "--show") && has_value) {
      std::cerr << "accel-config: " << a << " takes no value\n";
      return 1;
    }
    if (a == "--default") {
      defaults = true;
    } else if (a == "--show") {
      show = true;
    } else if (a == "--config_file") {
      if (!take_value("--config_file")) return Usage();
      if (value.empty()) {
        std::cerr << "accel-config: --config_file is empty\n";
        return 1;
      }
      path = value;
    } else if (a == "--mixed_precision") {
      if (!take_value("--mixed_precision")) return Usage();
      if (!Precision(value)) {
        std::cerr << "accel-config: --mixed_precision \"" << value
                  << "\": expected no, fp16 or bf16\n";
        return 1;
      }
      precision = value;
    } else if (a == "--help" || a == "-h") {
      Usage();
      return 0;
    } else {
      std::cerr << "accel-config: unknown argument " << argv[i] << "\n";
      return Usage();
    }
  }
  if (defaults && show) {
    std::cerr << "accel-config: --default and --show do not go together\n";
    return 1;
  }
  if (show) {
    absl::StatusOr<ClusterConfig> config = accel::train::ReadClusterConfig(path);
    if (!config.ok()) {
      std::cerr << "accel-config: " << config.status().message() << "\n";
      return 1;
    }
    std::cout << accel::train::ClusterConfigToJson(*config);
    return 0;
  }
  // The CUDA devices the ranks' libtorch will see (0 with a CPU-only libtorch).
  const int cuda_devices = static_cast<int>(torch::cuda::device_count());
  ClusterConfig config =
      accel::train::BasicClusterConfig(absl::AsciiStrToLower(precision), cuda_devices);
  if (!defaults) {
    config.num_processes = 1;
    config.distributed_type = "NO";
    if (cuda_devices > 0) std::cout << "accel-config: " << cuda_devices << " CUDA device(s)\n";
    std::cout << "accel-config: answers go to " << path << "\n";
    std::string type = absl::AsciiStrToUpper(
        Ask("Which kind of machine (no / multi-CPU / multi-GPU)?", "no", DistributedType));
    for (char& c : type) c = c == '-' ? '_' : c;
    config.distributed_type = type;
    if (type != "NO") {
      absl::SimpleAtoi(Ask("How many machines?", "1", PositiveInt), &config.num_machines);
      const int machines = config.num_machines;
      absl::SimpleAtoi(
          Ask(machines > 1 ? "How many processes in all (on every machine together)?"
                           : "How many processes?",
              absl::StrCat(machines *
                           (type == "MULTI_GPU" && cuda_devices > 0
                                ? static_cast<unsigned>(cuda_devices)
                                : std::max(2u, std::thread::hardware_concurrency() / 2))),
              [machines](const std::string& s) {
                int n = 0;
                return absl::SimpleAtoi(s, &n) && n >= 1 && n % machines == 0;
              }),
          &config.num_processes);
      if (machines > 1) {
        absl::SimpleAtoi(
            Ask(absl::StrCat("The rank of this machine (0 to ", machines - 1, ")?"), "0",
                [machines](const std::string& s) {
                  int n = 0;
                  return absl::SimpleAtoi(s, &n) && n >= 0 && n < machines;
                }),
            &config.machine_rank);
        config.main_process_ip = Ask("The IP address of machine 0?", "127.0.0.1", AnyText);
        int port = 29500;
        absl::SimpleAtoi(Ask("The port of machine 0?", "29500", Port), &port);
        config.main_process_port = port;
      }
      config.use_cpu = type == "MULTI_CPU";
    } else {
      // Accelerate asks the same; the CPU only when asked for.
      const std::string cpu_only = absl::AsciiStrToLower(
          Ask("Train on the CPU only, even where GPUs are present (yes / no)?", "no", YesNo));
      config.use_cpu = cpu_only == "yes" || cpu_only == "y";
    }
    config.mixed_precision = absl::AsciiStrToLower(
        Ask("Mixed precision (no / fp16 / bf16)?", config.mixed_precision, Precision));
  }
  absl::Status written = accel::train::WriteClusterConfig(config, path, /*overwrite=*/!defaults);
  if (!written.ok()) {
    std::cerr << "accel-config: " << written.message() << "\n";
    return 1;
  }
  std::cout << "accel-config: wrote " << path << "\n";
  return 0;
}

}  // namespace

// As core/tool_main.h (which links libtorch): an escaping exception becomes a
// message and exit code 1, never a crash.
int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel-config: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "accel-config: unknown error\n");
  }
  return 1;
}
