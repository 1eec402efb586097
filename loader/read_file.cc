// loader::ReadFile, kept apart from the torch-dependent loader sources so the
// config fuzz target (tests/fuzz/) can compile it.
#include "core/read_file.h"

#include <string>

#include "loader/loader.h"

namespace accel::loader {

// Never blocks on a FIFO or a device: refused by name (core/read_file.h).
absl::StatusOr<std::string> ReadFile(const std::string& path) { return ReadRegularFile(path); }

}  // namespace accel::loader
