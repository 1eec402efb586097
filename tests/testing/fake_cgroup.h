// A folder laid out as a cgroup v2 mount whose own cgroup has a memory
// limit and nothing charged, made this process's cgroup root
// ($ACCEL_CGROUP_ROOT) while it lives: whatever this machine's cgroups are,
// memory probing (dispatch/internal/host_memory.h) reads it.
#ifndef ACCEL_TESTS_TESTING_FAKE_CGROUP_H_
#define ACCEL_TESTS_TESTING_FAKE_CGROUP_H_

#include <cstdint>
#include <string>

#include "tests/testing/scoped_env.h"
#include "tests/testing/temp_dir.h"

namespace accel::test {

class FakeMemoryCgroup {
 public:
  explicit FakeMemoryCgroup(int64_t limit_bytes)
      : env_("ACCEL_CGROUP_ROOT", Populated(root_, limit_bytes)) {}

 private:
  static const std::string& Populated(const TempDir& root, int64_t limit_bytes) {
    root.Write("memory.max", std::to_string(limit_bytes) + "\n");
    root.Write("memory.current", "0\n");
    root.Write("memory.stat", "active_file 0\ninactive_file 0\n");
    return root.path();
  }

  TempDir root_;
  ScopedEnv env_;
};

}  // namespace accel::test

#endif  // ACCEL_TESTS_TESTING_FAKE_CGROUP_H_
