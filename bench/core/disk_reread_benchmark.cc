// accel-bench-disk: the disk's rate for bytes read the first time in a while
// against the same bytes read again, as the dispatch reader reads a layer or
// an expert (MADV_POPULATE_READ of `--chunk_mb` at a time through a shared
// mapping advised for huge pages, after MADV_WILLNEED only for a chunk under
// accel::kAdviseWillNeedBelowBytes), the guest's page cache dropped before each
// pass. On a virtual disk whose host caches what was read lately, the second
// pass reads the host's cache: the gap between the two is how far a probe of
// "the disk" taken on ranges read before can overstate it.
//
//   build/bin/accel-bench-disk [--chunk_mb 440] [--passes 2] [--every_gb N] [--touch] FILE...
//
// --every_gb N also prints the rate of each N GiB of a pass in turn: whether
// the disk holds its rate over a long read or gives a burst, then less.
// --touch also times the CPU reading each chunk's pages once they are read
// (twice: the first touch, then again), and a new anonymous buffer's first
// write against its second: on a VM that hands freed memory back to its
// host, the first touch of a page is the host supplying it again.
//
// Give files no one has read lately (shards of a model at rest) for the
// first pass to be the disk's own rate.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

#include "bench/bench_util.h"
#include "core/map_file.h"

namespace {

constexpr char kUsage[] = "(--chunk_mb N --passes N --every_gb N --touch FILE...)";

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "accel-bench-disk: %s\n", message.c_str());
  std::exit(1);
}

struct File {
  int fd = -1;
  uint64_t size = 0;
  char* map = nullptr;
};

// One pass over every file, `chunk` at a time, from a page cache without
// them: its bytes per second, and that of each `span` bytes of it in turn
// (a virtual disk that allows a burst, then throttles, reads fast in the first
// spans and slower in the later ones).
struct PassRates {
  double whole = 0;
  std::vector<double> spans;
  // --touch: the CPU's first read of each chunk's pages once they are read
  // and mapped, and a second read of the same pages, in bytes per second.
  double first_touch = 0, touched_again = 0;
};

// Reads every byte of [p, p + n) as the products read weights; returns a
// value that depends on all of them, so that the reads are not elided.
uint64_t ReadAll(const char* p, uint64_t n) {
  uint64_t acc = 0;
  for (uint64_t i = 0; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    acc ^= word;
  }
  return acc;
}

PassRates Pass(const std::vector<std::string>& paths, const std::vector<File>& files,
               uint64_t chunk, uint64_t span, bool touch) {
  accel::bench::DropPageCache(paths);
  PassRates rates;
  uint64_t bytes = 0, span_bytes = 0;
  auto span_start = std::chrono::steady_clock::now();
  double touch_seconds[2] = {0, 0};
  double touch_in_span = 0;
  auto end_span = [&] {
    const auto now = std::chrono::steady_clock::now();
    rates.spans.push_back(
        static_cast<double>(span_bytes) /
        (std::chrono::duration<double>(now - span_start).count() - touch_in_span));
    span_start = now;
    span_bytes = 0;
    touch_in_span = 0;
  };
  volatile uint64_t sink = 0;  // the touches' reads are kept: their result is stored
  const double seconds = accel::bench::Seconds([&] {
    for (const File& f : files) {
      for (uint64_t at = 0; at < f.size; at += chunk) {
        const uint64_t n = std::min(chunk, f.size - at);
        if (n < accel::kAdviseWillNeedBelowBytes) (void)::madvise(f.map + at, n, MADV_WILLNEED);
        if (::madvise(f.map + at, n, MADV_POPULATE_READ) != 0) Die("MADV_POPULATE_READ failed");
        if (touch) {
          for (double& t : touch_seconds) {
            const double dt = accel::bench::Seconds([&] { sink = sink ^ ReadAll(f.map + at, n); });
            t += dt;
            touch_in_span += dt;
          }
        }
        (void)::madvise(f.map + at, n, MADV_DONTNEED);  // unmapped as the reader lets a layer go
        bytes += n;
        span_bytes += n;
        if (span > 0 && span_bytes >= span) end_span();
      }
    }
  });
  if (span > 0 && span_bytes > 0) end_span();
  // The pass's rate is the disk's: the time spent touching is left out.
  rates.whole = static_cast<double>(bytes) / (seconds - touch_seconds[0] - touch_seconds[1]);
  if (touch) {
    rates.first_touch = static_cast<double>(bytes) / touch_seconds[0];
    rates.touched_again = static_cast<double>(bytes) / touch_seconds[1];
  }
  return rates;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t chunk_mb = 440;
  int passes = 2;
  uint64_t every_gb = 0;
  bool touch = false;
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--chunk_mb" || flag == "--passes" || flag == "--every_gb") {
      if (i + 1 >= argc) Die(flag + " needs a value");
      const int64_t v = std::strtoll(argv[++i], nullptr, 10);
      if (v <= 0) Die(flag + " must be positive");
      if (flag == "--chunk_mb") {
        chunk_mb = static_cast<uint64_t>(v);
      } else if (flag == "--every_gb") {
        every_gb = static_cast<uint64_t>(v);
      } else {
        passes = static_cast<int>(v);
      }
    } else if (flag == "--touch") {
      touch = true;
    } else if (!flag.empty() && flag[0] == '-') {
      Die("unknown flag " + flag + " " + kUsage);
    } else {
      paths.push_back(flag);
    }
  }
  if (paths.empty()) Die(std::string("give the files to read ") + kUsage);
  std::vector<File> files;
  uint64_t total = 0;
  for (const std::string& p : paths) {
    File f;
    f.fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.fd < 0) Die("cannot open " + p);
    struct stat st {};
    if (::fstat(f.fd, &st) != 0 || st.st_size == 0) Die("cannot read the size of " + p);
    f.size = static_cast<uint64_t>(st.st_size);
    void* map = accel::MapFileHugeAligned(f.fd, 0, f.size, PROT_READ, MAP_SHARED);
    if (map == MAP_FAILED) Die("cannot map " + p);
    f.map = static_cast<char*>(map);
    total += f.size;
    files.push_back(f);
  }
  std::printf("accel-bench-disk: %zu file(s), %.2f GiB, %llu MiB at a time\n", files.size(),
              static_cast<double>(total) / (1 << 30), static_cast<unsigned long long>(chunk_mb));
  double first = 0;
  for (int p = 0; p < passes; ++p) {
    const PassRates rates = Pass(paths, files, chunk_mb << 20, every_gb << 30, touch);
    const double rate = rates.whole;
    if (p == 0) first = rate;
    std::printf("pass %d: %.2f GB/s (%.2fx the first)", p + 1, rate / 1e9, rate / first);
    if (!rates.spans.empty()) {
      std::printf("; each %llu GiB in turn:", static_cast<unsigned long long>(every_gb));
      for (double r : rates.spans) std::printf(" %.2f", r / 1e9);
    }
    if (touch) {
      std::printf("; the CPU's first read of the pages just read %.2f GB/s, again %.2f GB/s",
                  rates.first_touch / 1e9, rates.touched_again / 1e9);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  if (touch) {
    // The same two reads of memory no file is behind: an anonymous buffer of
    // one chunk, new, written once and then again (on a VM whose freed memory
    // goes back to its host, a page's first touch asks the host for it).
    const uint64_t n = chunk_mb << 20;
    void* anon = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (anon == MAP_FAILED) Die("cannot map an anonymous buffer");
    (void)::madvise(anon, n, MADV_HUGEPAGE);
    const double first = accel::bench::Seconds([&] { std::memset(anon, 1, n); });
    const double again = accel::bench::Seconds([&] { std::memset(anon, 2, n); });
    std::printf("a new anonymous buffer of %llu MiB: first write %.2f GB/s, again %.2f GB/s\n",
                static_cast<unsigned long long>(chunk_mb), static_cast<double>(n) / first / 1e9,
                static_cast<double>(n) / again / 1e9);
    ::munmap(anon, n);
  }
  accel::bench::DropPageCache(paths);
  for (const File& f : files) {
    ::munmap(f.map, f.size);
    ::close(f.fd);
  }
  return 0;
}
