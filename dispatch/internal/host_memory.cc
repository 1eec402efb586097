#include "dispatch/internal/host_memory.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <sys/sysinfo.h>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace accel::dispatch::internal {
namespace {

// v1 reports "no limit" as a huge page-aligned number (2^63 rounded down).
constexpr int64_t kUnlimited = int64_t{1} << 60;

std::optional<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::optional<int64_t> ReadNumber(const std::string& path) {
  std::optional<std::string> text = ReadText(path);
  if (!text) return std::nullopt;
  int64_t v = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &v)) return std::nullopt;
  return v;
}

// "key value" lines of memory.stat.
std::optional<int64_t> StatField(const std::string& stat, absl::string_view key) {
  for (absl::string_view line : absl::StrSplit(stat, '\n')) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(line, ' ');
    int64_t v = 0;
    if (kv.first == key && absl::SimpleAtoi(kv.second, &v)) return v;
  }
  return std::nullopt;
}

bool Exists(const std::string& path) { return std::ifstream(path).good(); }

}  // namespace

int64_t CgroupMemory::available() const { return std::max<int64_t>(0, limit - (usage - file)); }

std::optional<CgroupMemory> ReadCgroupMemory(const std::string& proc_cgroup,
                                             const std::string& root) {
  std::optional<std::string> v2_path, v1_path;
  for (absl::string_view line : absl::StrSplit(proc_cgroup, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[0] == "0" && parts[1].empty()) v2_path = std::string(parts[2]);
    for (absl::string_view controller : absl::StrSplit(parts[1], ',')) {
      if (controller == "memory") v1_path = std::string(parts[2]);
    }
  }
  const auto folder = [&](const std::string& base, const std::string& path,
                          const char* probe) -> std::optional<std::string> {
    const std::string own = path == "/" ? base : base + path;
    if (Exists(own + "/" + probe)) return own;
    if (Exists(base + "/" + probe)) return base;  // a cgroup namespace's own mount
    return std::nullopt;
  };
  CgroupMemory out;
  if (v1_path) {
    std::optional<std::string> dir = folder(root + "/memory", *v1_path, "memory.limit_in_bytes");
    if (dir) {
      std::optional<int64_t> limit = ReadNumber(*dir + "/memory.limit_in_bytes");
      const std::string stat = ReadText(*dir + "/memory.stat").value_or("");
      // Ancestors' limits apply too (use_hierarchy): the kernel sums them up here.
      if (std::optional<int64_t> h = StatField(stat, "hierarchical_memory_limit")) {
        limit = limit ? std::min(*limit, *h) : *h;
      }
      if (!limit || *limit >= kUnlimited) return std::nullopt;
      out.path = *dir;
      out.limit = *limit;
      out.usage = ReadNumber(*dir + "/memory.usage_in_bytes").value_or(0);
      out.file = StatField(stat, "total_inactive_file").value_or(0) +
                 StatField(stat, "total_active_file").value_or(0);
      return out;
    }
  }
  if (v2_path) {
    std::optional<std::string> dir = folder(root, *v2_path, "memory.max");
    if (!dir) return std::nullopt;
    std::optional<int64_t> limit = ReadNumber(*dir + "/memory.max");  // "max" does not parse
    if (!limit || *limit >= kUnlimited) return std::nullopt;
    const std::string stat = ReadText(*dir + "/memory.stat").value_or("");
    out.path = *dir;
    out.limit = *limit;
    out.usage = ReadNumber(*dir + "/memory.current").value_or(0);
    out.file =
        StatField(stat, "inactive_file").value_or(0) + StatField(stat, "active_file").value_or(0);
    return out;
  }
  return std::nullopt;
}

std::optional<CgroupMemory> SelfCgroupMemory() {
  std::optional<std::string> text = ReadText("/proc/self/cgroup");
  if (!text) return std::nullopt;
  if (const char* root = std::getenv("ACCEL_CGROUP_ROOT"); root != nullptr && *root != '\0') {
    return ReadCgroupMemory(*text, root);
  }
  return ReadCgroupMemory(*text);
}

namespace {

std::optional<int64_t> MeminfoField(const std::string& meminfo, const std::string& field) {
  std::ifstream in(meminfo);
  std::string key;
  int64_t kib = -1;
  while (in >> key) {
    if (key == field) {
      in >> kib;
      break;
    }
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  if (kib < 0) return std::nullopt;
  return kib * 1024;
}

}  // namespace

std::optional<int64_t> FreeHostMemory() {
  struct sysinfo info {};
  if (::sysinfo(&info) != 0) return std::nullopt;
  return static_cast<int64_t>(info.freeram) * static_cast<int64_t>(info.mem_unit);
}

std::optional<int64_t> MemAvailable(const std::string& meminfo) {
  return MeminfoField(meminfo, "MemAvailable:");
}

std::optional<int64_t> MemTotal(const std::string& meminfo) {
  return MeminfoField(meminfo, "MemTotal:");
}

}  // namespace accel::dispatch::internal
