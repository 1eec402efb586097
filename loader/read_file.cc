// loader::ReadFile, kept apart from the torch-dependent loader sources so the
// config fuzz target (tests/fuzz/) can compile it.
#include <cerrno>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "loader/loader.h"

namespace accel::loader {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return ErrnoStatus(errno, absl::StrCat("reading ", path));
  return buffer.str();
}

}  // namespace accel::loader
