// core/tool_main.h: the one main() shape of every accel command-line tool.
//
//   int Run(int argc, char** argv);   // the tool; returns its exit code
//   int main(int argc, char** argv) { return accel::ToolMain("accel-inspect", argc, argv, Run); }
#ifndef ACCEL_CORE_TOOL_MAIN_H_
#define ACCEL_CORE_TOOL_MAIN_H_

namespace accel {

// Runs `run` with glibc's malloc set to keep freed memory for reuse
// (core/malloc_tuning.h); an exception that escapes it (out of memory, a bug) becomes a
// message on stderr naming the tool, and exit code 1, never a crash.
int ToolMain(const char* tool, int argc, char** argv, int (*run)(int, char**));

}  // namespace accel

#endif  // ACCEL_CORE_TOOL_MAIN_H_
