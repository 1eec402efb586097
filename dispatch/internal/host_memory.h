// What memory this process may use: the machine's MemAvailable, and the
// limit of the memory cgroup it runs in (v2, or v1 with its hierarchy), with
// the cgroup's page cache counted as room, since the kernel reclaims clean
// file pages before it runs out.
#ifndef ACCEL_DISPATCH_INTERNAL_HOST_MEMORY_H_
#define ACCEL_DISPATCH_INTERNAL_HOST_MEMORY_H_

#include <cstdint>
#include <optional>
#include <string>

namespace accel::dispatch::internal {

struct CgroupMemory {
  std::string path;           // the cgroup's folder that was read
  int64_t limit = 0;          // the smallest limit of it and its ancestors
  int64_t usage = 0;          // charged now, page cache included
  int64_t file = 0;           // of which page cache that can be reclaimed (active + inactive file)
  int64_t available() const;  // limit - (usage - file), at least 0
};

// The memory cgroup of the process whose /proc/<pid>/cgroup reads
// `proc_cgroup`, under the cgroup file systems mounted at `root`
// (/sys/fs/cgroup): v2 ("0::/path", memory.max / memory.current /
// memory.stat), else v1 ("N:memory:/path" under root/memory, its
// memory.limit_in_bytes and memory.stat's hierarchical_memory_limit).
// Inside a cgroup namespace the process's path reads "/" and the mount is its
// own cgroup: the root folder is tried when the path is not there. nullopt
// when no limit applies (none set, "max", or an unlimited v1 value).
std::optional<CgroupMemory> ReadCgroupMemory(const std::string& proc_cgroup,
                                             const std::string& root = "/sys/fs/cgroup");

// This process's: ReadCgroupMemory of /proc/self/cgroup, under
// $ACCEL_CGROUP_ROOT when it is set (a cgroup file system mounted elsewhere,
// or a folder that stands in for it: the tests' fake cgroups), else
// /sys/fs/cgroup.
std::optional<CgroupMemory> SelfCgroupMemory();

// The machine's free memory now (sysinfo's freeram: not the page cache),
// in bytes; nullopt if sysinfo fails. One system call, cheap enough to ask
// before every expert read.
std::optional<int64_t> FreeHostMemory();

// MemAvailable / MemTotal of /proc/meminfo (bytes), nullopt if unreadable.
std::optional<int64_t> MemAvailable(const std::string& meminfo = "/proc/meminfo");
std::optional<int64_t> MemTotal(const std::string& meminfo = "/proc/meminfo");

}  // namespace accel::dispatch::internal

#endif  // ACCEL_DISPATCH_INTERNAL_HOST_MEMORY_H_
