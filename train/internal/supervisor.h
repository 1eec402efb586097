// Starts the ranks of accel-launch and watches them: signals to the launcher
// reach every rank, and a rank that fails takes the others down.
#ifndef ACCEL_TRAIN_INTERNAL_SUPERVISOR_H_
#define ACCEL_TRAIN_INTERNAL_SUPERVISOR_H_

#include <map>
#include <string>
#include <vector>

namespace accel::train::internal {

struct ChildSpec {
  std::vector<std::string> argv;                     // as the program sees it
  std::string program;                               // the file to run; empty: argv[0] in PATH
  std::map<std::string, std::string> env_additions;  // over the launcher's environment
  std::string label;                                 // "rank 3", for messages
  std::vector<int> cpus;                             // pinned to these; empty: inherited
};

// Runs every child in its own process group and waits for all of them.
// SIGINT / SIGTERM / SIGHUP to the launcher are forwarded to every child.
// When a child exits non-zero or is killed, the others get SIGTERM, then
// SIGKILL after `grace_seconds`. Returns the launcher's exit code: 0 when
// every child exited 0, else the first failing child's code (128 + signal
// when it was killed), or 128 + the signal the launcher received. Messages
// go to stderr; with `quiet`, none about failing ranks (the ranks' own output
// stands alone; accel-launch --quiet). A child that cannot be started fails the launch (code 1)
// after stopping those already started. The children are checked every
// `poll_interval_s`; each dies with SIGTERM when the launcher itself dies.
int Supervise(const std::vector<ChildSpec>& children, int grace_seconds,
              double poll_interval_s = 0.1, bool quiet = false);

}  // namespace accel::train::internal

#endif  // ACCEL_TRAIN_INTERNAL_SUPERVISOR_H_
