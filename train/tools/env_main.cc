// accel-env: what to paste into a bug report (Accelerate's `accelerate env`).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <sys/utsname.h>
#include <thread>
#include <unistd.h>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

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

}  // namespace

int main(int argc, char** argv) {
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
  std::cout << "- CPU count: " << std::thread::hardware_concurrency() << "\n";
  std::cout << absl::StrFormat("- System RAM: %.2f GB\n", ram_gb);
  std::cout << "- GPUs: " << gpus << "\n";
  const std::string path = accel::train::DefaultConfigPath();
  absl::StatusOr<accel::train::ClusterConfig> config = accel::train::ReadClusterConfig(path);
  std::cout << "- accel default config:";
  if (!config.ok()) {
    std::cout << " Not found\n";
    return 0;
  }
  std::cout << "\n";
  // The config as `key: value` lines (JSON keys and values, unquoted).
  for (absl::string_view line : absl::StrSplit(accel::train::ClusterConfigToJson(*config), '\n')) {
    if (line == "{" || line == "}" || line.empty()) continue;
    std::string l(absl::StripAsciiWhitespace(line));
    if (!l.empty() && l.back() == ',') l.pop_back();
    std::string out;
    for (char c : l) {
      if (c != '"') out += c;
    }
    std::cout << "\t- " << out << "\n";
  }
  return 0;
}
