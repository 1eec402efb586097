#include "models/default_model.h"

#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace accel::models {

std::string DefaultModelDir() {
  if (const char* env = std::getenv("ACCEL_DEFAULT_MODEL"); env != nullptr && *env != '\0') {
    return env;
  }
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) return "share/accel/default-model";
  return (exe.parent_path().parent_path() / "share/accel/default-model").string();
}

}  // namespace accel::models
