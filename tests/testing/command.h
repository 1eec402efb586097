// Runs a shell command and captures its stdout, for the tests that drive
// the project's command-line tools.
#ifndef ACCEL_TESTS_TESTING_COMMAND_H_
#define ACCEL_TESTS_TESTING_COMMAND_H_

#include <cstdio>
#include <string>
#include <sys/wait.h>

namespace accel::test {

// A command's stdout and its exit status (-1 when it could not run).
struct CommandResult {
  int exit_code = -1;
  std::string out;
};

inline CommandResult CommandOutput(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.out.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

}  // namespace accel::test

#endif  // ACCEL_TESTS_TESTING_COMMAND_H_
