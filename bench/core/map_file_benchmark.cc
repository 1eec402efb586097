// accel-bench-map: what it costs to make a weights range resident through a
// mapping placed by mmap (page-aligned) and through MapFileHugeAligned
// (core/map_file.h: congruent to the file offset modulo 2 MiB, advised
// MADV_HUGEPAGE), against a plain pread() of the same bytes in the same run.
// Each repeat, for each method: the range dropped from the page cache
// (POSIX_FADV_DONTNEED), then MADV_POPULATE_READ, after MADV_WILLNEED on the
// whole range (as the expert cache read a unit before 2026-11-29), on none
// of it (as it reads a large one now), or on the huge pages the range only
// partly covers (cold: wall time, the thread's CPU time and the bytes its
// I/O accounting says it read, as a share of the range), then unmapped
// (MADV_DONTNEED) and populated again from the page cache (warm), then the
// share of the range mapped by PMD (FilePmdMapped: the huge pages at the
// range's ends are mapped whole, hence over 100%). The kernel reads at most
// one readahead window (the device's read_ahead_kb) of a MADV_WILLNEED range,
// in small folios. Then the rate of a pass reading every word of the range
// just populated (first pass), of a second pass, and of a pass after the warm
// populate, against the same pass
// over an anonymous buffer the process has used before (the baseline). A
// further row maps the range right after writing it (the same bytes, written
// back through the page cache and synced, as a checkpoint writer leaves a
// file it made: small folios, mapped 4 KiB at a time). A
// product reads an expert's weights right after the reader made them
// resident, and under a hypervisor that keeps its own page tables for the
// guest (2026-12-02's machine: the kernel's pvm_* functions) each 4 KiB page
// costs a fault on its first touch, which the first pass pays. The last
// two rows read the range into a buffer the process has not used yet (see
// ReadIntoNewBuffer): small pages against 2 MiB ones. Times: best
// of R; the shares: the mean of R (mmap places a file's mapping where it
// likes, now and then 2 MiB-aligned).
//
//   build/bin/accel-bench-map [--dir /work] [--file_mb 1024] [--range_mb 76] [--repeats 5]
//
// The file is written into --dir (which should be the disk the models live
// on, not a tmpfs), synced, and deleted at the end.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <random>
#include <string>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#include <vector>

#include "core/map_file.h"
#include "tests/testing/process_memory.h"

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "accel-bench-map: %s\n", message.c_str());
  std::exit(1);
}

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

double ThreadCpuSeconds() {
  rusage r{};
  getrusage(RUSAGE_THREAD, &r);
  return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

struct Figures {
  double cold = 1e9, cold_cpu = 1e9, warm = 1e9, pmd_share = 0, read_share = 0;
  double first_pass = 1e9, second_pass = 1e9;  // seconds, after the cold populate
  double warm_pass = 1e9;                      // ... after the warm one
};

// Reads every 8-byte word of [at, at + n), as a product reads its weights.
uint64_t SumWords(const char* at, size_t n) {
  const auto* words = reinterpret_cast<const uint64_t*>(at);
  uint64_t sum[4] = {0, 0, 0, 0};  // four chains: the pass is bound by memory, not the adds
  for (size_t i = 0; i + 4 <= n / 8; i += 4) {
    for (int k = 0; k < 4; ++k) sum[k] += words[i + k];
  }
  return sum[0] + sum[1] + sum[2] + sum[3];
}

// Where the passes' sums go, so that no pass is optimized out.
volatile uint64_t pass_sink = 0;

// Seconds of one SumWords pass.
double PassSeconds(const char* at, size_t n) {
  const auto start = Clock::now();
  pass_sink = pass_sink + SumWords(at, n);
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// What this thread has had read from storage (its I/O accounting).
double ThreadStorageBytes() {
  rusage r{};
  getrusage(RUSAGE_THREAD, &r);
  return 512.0 * static_cast<double>(r.ru_inblock);
}

// How the range is asked for before MADV_POPULATE_READ faults it in.
enum class Advice { kWholeRange, kNone, kEdges };

void Keep(Figures& best, const Figures& f) {
  best.cold = std::min(best.cold, f.cold);
  best.cold_cpu = std::min(best.cold_cpu, f.cold_cpu);
  best.warm = std::min(best.warm, f.warm);
  best.pmd_share += f.pmd_share;  // divided by the repeats at the end
  best.read_share += f.read_share;
  best.first_pass = std::min(best.first_pass, f.first_pass);
  best.second_pass = std::min(best.second_pass, f.second_pass);
  best.warm_pass = std::min(best.warm_pass, f.warm_pass);
}

// `rewrite`: instead of being dropped, the range is written again from it
// first (the writer's pages, not read from disk).
Figures Populate(int fd, size_t file_bytes, off_t offset, size_t range, bool huge, Advice advice,
                 const std::string* path = nullptr, const std::vector<char>* rewrite = nullptr) {
  void* addr = huge ? accel::MapFileHugeAligned(fd, 0, file_bytes, PROT_READ, MAP_SHARED)
                    : ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) Die("mapping the file failed");
  char* at = static_cast<char*>(addr) + offset;
  (void)::posix_fadvise(fd, offset, static_cast<off_t>(range), POSIX_FADV_DONTNEED);
  if (rewrite != nullptr) {
    const int out = ::open(path->c_str(), O_WRONLY | O_CLOEXEC);
    if (out < 0) Die("cannot write " + *path);
    for (size_t done = 0; done < range;) {
      const size_t piece = std::min(range - done, size_t{1} << 20);  // a writer's 1 MiB writes
      if (::pwrite(out, rewrite->data() + done, piece, offset + static_cast<off_t>(done)) !=
          static_cast<ssize_t>(piece)) {
        Die("rewriting " + *path + " failed");
      }
      done += piece;
    }
    ::fsync(out);
    ::close(out);
  }
  Figures f;
  const auto start = Clock::now();
  const double cpu = ThreadCpuSeconds();
  const double storage = ThreadStorageBytes();
  if (advice == Advice::kWholeRange) (void)::madvise(at, range, MADV_WILLNEED);
  if (advice == Advice::kEdges) {
    // The huge pages the range only partly covers: read now, in small
    // folios, so that the faults' huge folios stay inside the range.
    constexpr uintptr_t kHuge = uintptr_t{2} << 20;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(at);
    const uintptr_t end = begin + range;
    const uintptr_t head = std::min(end, (begin + kHuge - 1) / kHuge * kHuge);
    const uintptr_t tail = std::max(head, end / kHuge * kHuge);
    if (head > begin) (void)::madvise(at, head - begin, MADV_WILLNEED);
    if (end > tail) (void)::madvise(at + (tail - begin), end - tail, MADV_WILLNEED);
  }
  if (::madvise(at, range, MADV_POPULATE_READ) != 0) Die("MADV_POPULATE_READ failed");
  f.cold = Seconds(start);
  f.cold_cpu = ThreadCpuSeconds() - cpu;
  f.read_share = (ThreadStorageBytes() - storage) / static_cast<double>(range);
  f.pmd_share = static_cast<double>(accel::test::MappingHolding(addr).pmd_mapped) /
                static_cast<double>(range);
  f.first_pass = PassSeconds(at, range);
  f.second_pass = PassSeconds(at, range);
  (void)::madvise(at, range, MADV_DONTNEED);
  const auto again = Clock::now();
  (void)::madvise(at, range, MADV_POPULATE_READ);
  f.warm = Seconds(again);
  f.warm_pass = PassSeconds(at, range);
  ::munmap(addr, file_bytes);
  return f;
}

// A read into a buffer the process has not touched yet, as the expert
// cache's buffer pool makes one: small pages (what malloc gives), or 2 MiB
// ones (MapAnonymousHugeAligned, as BufferPool::Take makes them since
// 2026-12-02). cold: the range dropped from the
// page cache first (the disk read and the buffer's faults); warm: read again
// into a second new buffer from the page cache (the faults and the copy);
// then the passes over the cold buffer.
struct NewBuffer {
  double cold = 1e9, warm = 1e9, first_pass = 1e9, second_pass = 1e9, huge_share = 0;
};

// A new buffer of `range` bytes: MapAnonymousHugeAligned, or a plain
// anonymous mapping advised against huge pages (small pages on a
// THP-"always" kernel too). Unmapped by munmap(at, range).
char* MapBuffer(size_t range, bool huge) {
  void* at =
      huge ? accel::MapAnonymousHugeAligned(range)
           : ::mmap(nullptr, range, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED) Die("mapping a buffer failed");
  if (!huge) (void)::madvise(at, range, MADV_NOHUGEPAGE);
  return static_cast<char*>(at);
}

void PreadInto(int fd, off_t offset, size_t range, char* at) {
  for (size_t done = 0; done < range;) {
    const ssize_t got = ::pread(fd, at + done, range - done, offset + static_cast<off_t>(done));
    if (got <= 0) Die("pread failed");
    done += static_cast<size_t>(got);
  }
}

void ReadIntoNewBuffer(int fd, off_t offset, size_t range, bool huge, NewBuffer& best) {
  // One buffer at a time, so that the huge-page share read from smaps is
  // this buffer's alone.
  char* cold = MapBuffer(range, huge);
  (void)::posix_fadvise(fd, offset, static_cast<off_t>(range), POSIX_FADV_DONTNEED);
  auto start = Clock::now();
  PreadInto(fd, offset, range, cold);
  best.cold = std::min(best.cold, Seconds(start));
  best.first_pass = std::min(best.first_pass, PassSeconds(cold, range));
  best.second_pass = std::min(best.second_pass, PassSeconds(cold, range));
  best.huge_share +=
      static_cast<double>(accel::test::MappingHolding(cold).anon_huge) / static_cast<double>(range);
  ::munmap(cold, range);
  char* warm = MapBuffer(range, huge);
  start = Clock::now();
  PreadInto(fd, offset, range, warm);
  best.warm = std::min(best.warm, Seconds(start));
  ::munmap(warm, range);
}

double PreadCold(int fd, off_t offset, size_t range, std::vector<char>& buffer) {
  (void)::posix_fadvise(fd, offset, static_cast<off_t>(range), POSIX_FADV_DONTNEED);
  const auto start = Clock::now();
  for (size_t done = 0; done < range;) {
    const ssize_t got =
        ::pread(fd, buffer.data() + done, range - done, offset + static_cast<off_t>(done));
    if (got <= 0) Die("pread failed");
    done += static_cast<size_t>(got);
  }
  return Seconds(start);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/work";
  int64_t file_mb = 1024, range_mb = 76;
  int repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--dir") {
      dir = value;
    } else if (flag == "--file_mb") {
      file_mb = std::atoll(value.c_str());
    } else if (flag == "--range_mb") {
      range_mb = std::atoll(value.c_str());
    } else if (flag == "--repeats") {
      repeats = std::atoi(value.c_str());
    } else {
      Die("unknown flag " + flag + " (--dir DIR --file_mb N --range_mb N --repeats N)");
    }
  }
  if ((argc - 1) % 2 != 0) Die("every flag takes a value");
  if (file_mb < 2 * range_mb + 8 || range_mb <= 0 || repeats <= 0) {
    Die("--file_mb must be at least twice --range_mb plus 8, both and --repeats positive");
  }
  const std::string path = dir + "/accel-bench-map.bin";
  const size_t file_bytes = static_cast<size_t>(file_mb) << 20;
  const size_t range = static_cast<size_t>(range_mb) << 20;
  {
    const int out = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) Die("cannot write " + path);
    std::vector<char> chunk(size_t{16} << 20);
    std::mt19937_64 random(1);
    for (size_t done = 0; done < file_bytes; done += chunk.size()) {
      for (size_t i = 0; i + 8 <= chunk.size(); i += 8) {
        const uint64_t v = random();
        std::copy_n(reinterpret_cast<const char*>(&v), 8, chunk.data() + i);
      }
      if (::write(out, chunk.data(), chunk.size()) != static_cast<ssize_t>(chunk.size())) {
        ::close(out);
        ::unlink(path.c_str());
        Die("writing " + path + " failed");
      }
    }
    ::fsync(out);
    ::close(out);
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) Die("cannot open " + path);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  // An expert's place in a shard: not on a 2 MiB boundary.
  const off_t offset = (off_t{4} << 20) + off_t{12345} * 4096;
  std::vector<char> buffer(range);
  Figures small, huge, huge_unadvised, huge_edges, written;
  NewBuffer small_pages, huge_pages;
  double pread_best = 1e9, anonymous_pass = 1e9, anonymous_again = 1e9;
  for (int r = 0; r < repeats; ++r) {
    pread_best = std::min(pread_best, PreadCold(fd, offset, range, buffer));
    anonymous_pass = std::min(anonymous_pass, PassSeconds(buffer.data(), range));
    anonymous_again = std::min(anonymous_again, PassSeconds(buffer.data(), range));
    Keep(small, Populate(fd, file_bytes, offset, range, /*huge=*/false, Advice::kWholeRange));
    Keep(huge, Populate(fd, file_bytes, offset, range, /*huge=*/true, Advice::kWholeRange));
    Keep(huge_unadvised, Populate(fd, file_bytes, offset, range, /*huge=*/true, Advice::kNone));
    Keep(huge_edges, Populate(fd, file_bytes, offset, range, /*huge=*/true, Advice::kEdges));
    Keep(written,
         Populate(fd, file_bytes, offset, range, /*huge=*/true, Advice::kNone, &path, &buffer));
    ReadIntoNewBuffer(fd, offset, range, /*huge=*/false, small_pages);
    ReadIntoNewBuffer(fd, offset, range, /*huge=*/true, huge_pages);
  }
  ::close(fd);
  ::unlink(path.c_str());
  small.pmd_share /= repeats;
  huge.pmd_share /= repeats;
  huge_unadvised.pmd_share /= repeats;
  huge_edges.pmd_share /= repeats;
  written.pmd_share /= repeats;
  for (Figures* f : {&small, &huge, &huge_unadvised, &huge_edges, &written}) {
    f->read_share /= repeats;
  }
  const double mb = static_cast<double>(range_mb);
  std::printf("a %lld MiB range of a %lld MiB file in %s, best of %d:\n",
              static_cast<long long>(range_mb), static_cast<long long>(file_mb), dir.c_str(),
              repeats);
  const double gb = static_cast<double>(range) / 1e9;
  std::printf("  %-38s %9s %9s %10s %10s %10s %12s %12s %12s\n", "method", "cold ms", "cpu ms",
              "warm ms", "PMD", "read", "1st pass", "2nd pass", "warm pass");
  std::printf("  %-38s %9.1f %9s %10s %10s %10s %12s %12s %12s  (%.0f MiB/s)\n",
              "pread() (baseline)", 1e3 * pread_best, "-", "-", "-", "-", "-", "-", "-",
              mb / pread_best);
  std::printf("  %-38s %9s %9s %10s %10s %10s %7.1f GB/s %7.1f GB/s %12s\n",
              "the pread buffer (baseline)", "-", "-", "-", "-", "-", gb / anonymous_pass,
              gb / anonymous_again, "-");
  for (const auto& [name, f] :
       {std::pair<const char*, const Figures&>{"mmap, placed by the kernel", small},
        {"MapFileHugeAligned", huge},
        {"MapFileHugeAligned, no MADV_WILLNEED", huge_unadvised},
        {"MapFileHugeAligned, edges advised", huge_edges},
        {"MapFileHugeAligned, just written", written}}) {
    std::printf("  %-38s %9.1f %9.1f %10.2f %9.0f%% %9.0f%% %7.1f GB/s %7.1f GB/s %7.1f GB/s\n",
                name, 1e3 * f.cold, 1e3 * f.cold_cpu, 1e3 * f.warm, 100.0 * f.pmd_share,
                100.0 * f.read_share, gb / f.first_pass, gb / f.second_pass, gb / f.warm_pass);
  }
  for (const auto& [name, b] :
       {std::pair<const char*, NewBuffer&>{"pread() into a new buffer, 4 KiB pages", small_pages},
        {"pread() into a new buffer, 2 MiB pages", huge_pages}}) {
    std::printf("  %-38s %9.1f %9s %10.2f %9.0f%% %10s %7.1f GB/s %7.1f GB/s %12s\n", name,
                1e3 * b.cold, "-", 1e3 * b.warm, 100.0 * b.huge_share / repeats, "-",
                gb / b.first_pass, gb / b.second_pass, "-");
  }
  return 0;
}
