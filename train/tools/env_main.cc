// accel-env: what to paste into a bug report (Accelerate's `accelerate env`).
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <sys/utsname.h>
#include <thread>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "absl/strings/str_format.h"

#include "train/launch_config.h"

#ifndef ACCEL_VERSION
#define ACCEL_VERSION "unknown"
#endif
#ifndef ACCEL_TORCH_VERSION
#define ACCEL_TORCH_VERSION "unknown"
#endif

namespace {

std::string Run(const char* command) {
  std::string out;
  if (FILE* p = ::popen(command, "r")) {
    char buf[512];
    while (std::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
    ::pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

int Run(int argc, char** argv) {
  if (argc > 1) {
    std::cerr << "usage: accel-env (no arguments)\n";
    return std::string(argv[1]) == "--help" ? 0 : 1;
  }
  utsname u{};
  ::uname(&u);
  const double ram_gb = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                        static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1e9;
  std::string gpus = Run("command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null");
  if (gpus.empty()) gpus = "none";
  std::cout << "\nCopy-and-paste the text below in your GitHub issue\n\n";
  std::cout << "- `accel` version: " << ACCEL_VERSION << "\n";
  std::cout << "- Platform: " << u.sysname << " " << u.release << " " << u.machine << "\n";
  char self[4096] = {0};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::cout << "- `accel-env` location: "
            << (n > 0 ? std::string(self, static_cast<size_t>(n)) : "?") << "\n";
  std::cout << "- libtorch version: " << ACCEL_TORCH_VERSION << "\n";
  std::cout << "- CPU count: " << std::thread::hardware_concurrency()
            << " (physical cores: " << accel::train::PhysicalCoreCount() << ")\n";
  std::cout << absl::StrFormat("- System RAM: %.2f GB\n", ram_gb);
  std::cout << "- GPUs: " << gpus << "\n";
  const std::string path = accel::train::DefaultConfigPath();
  absl::StatusOr<accel::train::ClusterConfig> config = accel::train::ReadClusterConfig(path);
  std::cout << "- accel default config:";
  if (absl::IsNotFound(config.status())) {
    std::cout << " Not found\n";
    return 0;
  }
  if (!config.ok()) {  // worth reporting too: it is what accel-launch would refuse
    std::cout << " unreadable: " << config.status().message() << "\n";
    return 0;
  }
  std::cout << "\n";
  // The config as `key: value` lines, as `accelerate env` prints the dict:
  // text bare, everything else as JSON.
  const nlohmann::json fields = nlohmann::json::parse(accel::train::ClusterConfigToJson(*config));
  for (auto it = fields.begin(); it != fields.end(); ++it) {
    std::cout << "\t- " << it.key() << ": "
              << (it->is_string() ? it->get<std::string>() : it->dump()) << "\n";
  }
  return 0;
}

}  // namespace

// As core/tool_main.h (which links libtorch): an escaping exception becomes a
// message and exit code 1, never a crash.
int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel-env: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "accel-env: unknown error\n");
  }
  return 1;
}
