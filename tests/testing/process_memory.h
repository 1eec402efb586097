// Where a process's resident bytes are, mapping by mapping, from
// /proc/<pid>/smaps: for tests that check what a process maps (a rank's
// slices of a checkpoint and nothing else) and for the benchmarks that
// break a process's resident bytes down (libraries, heap, the checkpoint).
#ifndef ACCEL_TESTS_TESTING_PROCESS_MEMORY_H_
#define ACCEL_TESTS_TESTING_PROCESS_MEMORY_H_

#include <cctype>
#include <cstdint>
#include <fcntl.h>
#include <fstream>
#include <sstream>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace accel::test {

// One mapping of /proc/<pid>/smaps and its resident bytes. `private_bytes`
// are the pages only this process maps (Private_Clean + Private_Dirty):
// what it costs the machine beyond what it shares (library text mapped by
// another process, a file page another rank maps too).
struct Mapping {
  uintptr_t begin = 0, end = 0;
  std::string perms, path;  // path: a file, "[heap]", "[stack]", "" (anonymous)
  int64_t rss = 0, pss = 0, private_bytes = 0, anonymous = 0, swap = 0;
  int64_t locked = 0;      // mlock()ed
  int64_t pmd_mapped = 0;  // FilePmdMapped: file pages mapped a huge page at a time
  int64_t anon_huge = 0;   // AnonHugePages: anonymous memory in transparent huge pages
  std::string vm_flags;    // "rd mr mw me ac sd hg ..." ("hg": MADV_HUGEPAGE)
};

// Every mapping of the process (`pid` "self" for this one); empty when
// smaps cannot be read.
inline std::vector<Mapping> ReadMappings(const std::string& pid = "self") {
  std::vector<Mapping> out;
  std::ifstream smaps("/proc/" + pid + "/smaps");
  for (std::string line; std::getline(smaps, line);) {
    if (line.empty()) continue;
    // A header line starts with the range "begin-end" in hex; a field line
    // with its name and a colon ("Rss:").
    const size_t dash = line.find('-');
    const size_t space = line.find(' ');
    if (dash != std::string::npos && space != std::string::npos && dash < space &&
        std::isxdigit(static_cast<unsigned char>(line[0])) && line.find(':') > space) {
      std::istringstream in(line);
      std::string range, offset, dev, inode;
      Mapping m;
      if (!(in >> range >> m.perms >> offset >> dev >> inode)) continue;
      m.begin = std::stoull(range.substr(0, dash), nullptr, 16);
      m.end = std::stoull(range.substr(dash + 1), nullptr, 16);
      std::getline(in >> std::ws, m.path);
      out.push_back(std::move(m));
      continue;
    }
    if (out.empty()) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string field = line.substr(0, colon);
    if (field == "VmFlags") {
      out.back().vm_flags = line.substr(colon + 1);
      continue;
    }
    int64_t kib = 0;
    try {
      kib = std::stoll(line.substr(colon + 1));
    } catch (...) {
      continue;  // VmFlags and the like
    }
    Mapping& m = out.back();
    if (field == "Rss") m.rss = kib * 1024;
    if (field == "Pss") m.pss = kib * 1024;
    if (field == "Private_Clean" || field == "Private_Dirty") m.private_bytes += kib * 1024;
    if (field == "Anonymous") m.anonymous = kib * 1024;
    if (field == "Swap") m.swap = kib * 1024;
    if (field == "Locked") m.locked = kib * 1024;
    if (field == "FilePmdMapped") m.pmd_mapped = kib * 1024;
    if (field == "AnonHugePages") m.anon_huge = kib * 1024;
  }
  return out;
}

// Virtual memory of this process (VmSize), in bytes: an allocation or a
// mapping shows here at once, even before its pages are touched.
inline int64_t VirtualBytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  int64_t kib = 0;
  while (status >> key) {
    if (key == "VmSize:") {
      status >> kib;
      break;
    }
  }
  return kib * 1024;
}

// The mapping of this process that holds `address`; empty (end 0) if none.
inline Mapping MappingHolding(const void* address) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  for (Mapping& m : ReadMappings()) {
    if (m.begin <= at && at < m.end) return m;
  }
  return {};
}

// Resident bytes of the mappings whose file is `prefix` or below it (a
// checkpoint's directory, canonical, with its trailing '/').
inline int64_t ResidentBytesOfFilesUnder(const std::vector<Mapping>& mappings,
                                         const std::string& prefix) {
  int64_t total = 0;
  for (const Mapping& m : mappings) {
    if (m.path.compare(0, prefix.size(), prefix) == 0) total += m.rss;
  }
  return total;
}

// Bytes of [address, address + n) that the page cache holds, in whole pages
// (mincore over a file mapping asks the page cache, whether or not the
// process maps the page; a range's edges can count a neighbour's bytes); -1
// if it cannot tell.
inline int64_t PageCachedBytes(const void* address, int64_t n) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(address) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(address) + static_cast<uintptr_t>(n);
  std::vector<unsigned char> in((end - begin + page - 1) / page);
  if (::mincore(reinterpret_cast<void*>(begin), end - begin, in.data()) != 0) return -1;
  int64_t cached = 0;
  for (unsigned char c : in) cached += (c & 1) ? static_cast<int64_t>(page) : 0;
  return cached;
}

// The same for the whole of the file at `path`; -1 if it cannot tell.
inline int64_t PageCachedBytesOfFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size == 0) {
    ::close(fd);
    return st.st_size == 0 ? 0 : -1;
  }
  const auto size = static_cast<size_t>(st.st_size);
  void* addr = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (addr == MAP_FAILED) return -1;
  const int64_t cached = PageCachedBytes(addr, static_cast<int64_t>(size));
  ::munmap(addr, size);
  return cached;
}

}  // namespace accel::test

#endif  // ACCEL_TESTS_TESTING_PROCESS_MEMORY_H_
