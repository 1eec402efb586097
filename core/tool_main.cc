#include "core/tool_main.h"

#include <cstdio>
#include <exception>

#include "core/malloc_tuning.h"

namespace accel {

int ToolMain(const char* tool, int argc, char** argv, int (*run)(int, char**)) {
  KeepFreedMemoryForReuse();
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", tool, e.what());
  } catch (...) {
    std::fprintf(stderr, "%s: unknown error\n", tool);
  }
  return 1;
}

}  // namespace accel
