// accel-bench-load: how fast a checkpoint becomes tensors ready in memory,
// against a plain read() of the same bytes. Every figure is from the page
// cache: each file is read once before timing.
//
//   build/bin/accel-bench-load --model /models/llama-3-8b --repeats 5
//   build/bin/accel-bench-load --generate_gb 4     # writes, times, deletes a
//                                                  # Llama-shaped bf16 checkpoint
//
// Methods, interleaved in each repeat; the table shows the median of R:
//   raw read()       every shard file read() in 64 MiB chunks into one reused,
//                    pre-faulted buffer
//   populate         Checkpoint::Open(populate) (shown alone too), Tensor() for
//                    every tensor, one byte read per 4 KiB page
//   lazy mmap        the same without populate: pages fault in on the touch
//   copy (owned)     lazy open, then empty_like + copy_ of every tensor: the
//                    weights in fresh memory, as torch.load leaves them
// Page faults (minor + major, the whole process) are shown per method too.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <string>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "loader/loader.h"

namespace accel {
namespace {

constexpr size_t kChunk = size_t{64} << 20;  // read() chunk: 64 MiB
constexpr size_t kPage = 4096;

struct Flags {
  std::string model;  // empty: generate one
  double generate_gb = 1.0;
  double shard_gb = 2.0;
  int repeats = 5;
};

[[noreturn]] void Usage(const char* argv0, const std::string& error) {
  if (!error.empty()) std::fprintf(stderr, "%s: %s\n", argv0, error.c_str());
  std::fprintf(stderr,
               "usage: %s [--model DIR | --generate_gb N] [--shard_gb S] [--repeats R]\n"
               "  --model DIR        an existing checkpoint (file, index or folder)\n"
               "  --generate_gb N    without --model: write a bf16 Llama-shaped checkpoint of\n"
               "                     about N GB (default 1.0) under $TMPDIR, delete it at exit\n"
               "  --shard_gb S       max shard size of the generated checkpoint (default 2.0)\n"
               "  --repeats R        timed repeats per method, median shown (default 5)\n",
               argv0);
  std::exit(2);
}

Flags ParseFlags(int argc, char** argv) {
  // "--flag=value" is "--flag value".
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      args.push_back(arg.substr(0, eq));
      args.push_back(arg.substr(eq + 1));
    } else {
      args.push_back(arg);
    }
  }
  Flags flags;
  size_t i = 0;
  auto value = [&](const std::string& name) -> const std::string& {
    if (i + 1 >= args.size()) Usage(argv[0], absl::StrCat(name, " needs a value"));
    return args[++i];
  };
  auto number = [&](const std::string& name) {
    const std::string& text = value(name);
    char* end = nullptr;
    double v = std::strtod(text.c_str(), &end);
    if (end == text.c_str() || *end != '\0' || !(v > 0)) {
      Usage(argv[0], absl::StrCat(name, ": expected a positive number, got '", text, "'"));
    }
    return v;
  };
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--model") {
      flags.model = value(arg);
    } else if (arg == "--generate_gb") {
      flags.generate_gb = number(arg);
    } else if (arg == "--shard_gb") {
      flags.shard_gb = number(arg);
    } else if (arg == "--repeats") {
      double r = number(arg);
      if (r != static_cast<int>(r)) Usage(argv[0], "--repeats: expected a whole number");
      flags.repeats = static_cast<int>(r);
    } else if (arg == "--help" || arg == "-h") {
      Usage(argv[0], "");
    } else {
      Usage(argv[0], absl::StrCat("unknown argument '", arg, "'"));
    }
  }
  return flags;
}

[[noreturn]] void Die(const absl::Status& status, const char* what) {
  std::fprintf(stderr, "accel-bench-load: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Page faults of this process so far (minor + major).
double PageFaults() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_minflt + usage.ru_majflt);
}

// ---- The generated checkpoint ------------------------------------------------

// Removes the generated folder however Main() returns (exit() and signals
// skip it: Die() removes it itself).
struct TempDir {
  std::string path;
  ~TempDir() { Remove(); }
  void Remove() {
    if (path.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    if (ec) std::fprintf(stderr, "could not remove %s: %s\n", path.c_str(), ec.message().c_str());
    path.clear();
  }
};
TempDir* g_temp = nullptr;

void Fail(const absl::Status& status, const char* what) {
  if (g_temp) g_temp->Remove();
  Die(status, what);
}

// Llama-2-7B's layer shapes (bf16), layer after layer, until `bytes` is reached.
std::vector<loader::TensorSpec> LlamaSpecs(uint64_t bytes) {
  struct Shape {
    const char* name;
    int64_t rows, cols;
  };
  const Shape layer[] = {
      {"self_attn.q_proj", 4096, 4096}, {"self_attn.k_proj", 4096, 4096},
      {"self_attn.v_proj", 4096, 4096}, {"self_attn.o_proj", 4096, 4096},
      {"mlp.gate_proj", 11008, 4096},   {"mlp.up_proj", 11008, 4096},
      {"mlp.down_proj", 4096, 11008},
  };
  std::vector<loader::TensorSpec> specs;
  uint64_t total = 0;
  for (int l = 0; total < bytes; ++l) {
    for (const Shape& s : layer) {
      if (total >= bytes) break;
      specs.push_back({absl::StrCat("model.layers.", l, ".", s.name, ".weight"),
                       at::kBFloat16,
                       {s.rows, s.cols}});
      total += static_cast<uint64_t>(s.rows * s.cols * 2);
    }
  }
  return specs;
}

std::string Generate(const Flags& flags, TempDir& temp) {
  const char* tmpdir = std::getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(tmpdir && *tmpdir ? tmpdir : "/tmp", "/accel-bench-load.XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) Die(ErrnoStatus(errno, pattern), "creating a folder");
  temp.path = pattern;

  auto specs = LlamaSpecs(static_cast<uint64_t>(flags.generate_gb * 1e9));
  loader::CheckpointWriteOptions options;
  options.max_shard_size = static_cast<int64_t>(flags.shard_gb * 1e9);
  // Random bits as bf16 (some are NaN, which does not matter for loading).
  loader::TensorProducer produce =
      [](const loader::TensorSpec& spec) -> absl::StatusOr<at::Tensor> {
    at::Tensor t;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      t = at::randint(-32768, 32768, spec.shape, at::TensorOptions().dtype(at::kShort))
              .view(at::kBFloat16);
    }));
    return t;
  };
  auto start = std::chrono::steady_clock::now();
  auto written = loader::WriteCheckpoint(temp.path, specs, produce, options);
  if (!written.ok()) Fail(written.status(), "writing the checkpoint");
  std::printf("generated %zu tensors, %.2f GB in %zu file(s) under %s (%.1f s)\n", specs.size(),
              written->total_bytes / 1e9, written->files.size(), temp.path.c_str(), Seconds(start));
  return temp.path;
}

// ---- Measurements ------------------------------------------------------------

// read()s every file to its end into `buffer`; returns the bytes read.
uint64_t ReadAll(const std::vector<std::string>& paths, std::vector<char>& buffer) {
  uint64_t total = 0;
  for (const std::string& path : paths) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) Fail(ErrnoStatus(errno, absl::StrCat("opening ", path)), "raw read");
    for (;;) {
      ssize_t n = ::read(fd, buffer.data(), buffer.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) Fail(ErrnoStatus(errno, absl::StrCat("reading ", path)), "raw read");
      if (n == 0) break;
      total += static_cast<uint64_t>(n);
    }
    ::close(fd);
  }
  return total;
}

// Reads one byte of every 4 KiB page, so each page is really mapped.
uint64_t TouchPages(const at::Tensor& t) {
  const auto* p = static_cast<const volatile uint8_t*>(t.data_ptr());
  const size_t n = t.nbytes();
  uint64_t sum = 0;
  for (size_t i = 0; i < n; i += kPage) sum += p[i];
  if (n > 0) sum += p[n - 1];
  return sum;
}

volatile uint64_t g_sink = 0;  // where the touched bytes go

struct LoadTimes {
  double open = 0;         // Checkpoint::Open
  double open_faults = 0;  // page faults in Checkpoint::Open
  double total = 0;        // open + every Tensor() + the touch (or the copy)
};

LoadTimes LoadMapped(const std::string& dir, bool populate) {
  double faults = PageFaults();
  auto start = std::chrono::steady_clock::now();
  auto ckpt = loader::Checkpoint::Open(dir, {/*populate=*/populate});
  if (!ckpt.ok()) Fail(ckpt.status(), "opening the checkpoint");
  LoadTimes times;
  times.open = Seconds(start);
  times.open_faults = PageFaults() - faults;
  std::vector<at::Tensor> tensors;
  tensors.reserve(ckpt->tensors().size());
  for (const auto& entry : ckpt->tensors()) {
    auto t = ckpt->Tensor(entry.info.name);
    if (!t.ok()) Fail(t.status(), "Tensor()");
    g_sink = g_sink + TouchPages(*t);
    tensors.push_back(*std::move(t));
  }
  times.total = Seconds(start);
  return times;  // unmapping (in the destructors) is not timed
}

LoadTimes LoadCopied(const std::string& dir) {
  auto start = std::chrono::steady_clock::now();
  auto ckpt = loader::Checkpoint::Open(dir);
  if (!ckpt.ok()) Fail(ckpt.status(), "opening the checkpoint");
  LoadTimes times;
  times.open = Seconds(start);
  std::vector<at::Tensor> owned;
  owned.reserve(ckpt->tensors().size());
  for (const auto& entry : ckpt->tensors()) {
    auto t = ckpt->Tensor(entry.info.name);
    if (!t.ok()) Fail(t.status(), "Tensor()");
    at::Tensor copy = at::empty_like(*t);
    copy.copy_(*t);
    owned.push_back(std::move(copy));
  }
  times.total = Seconds(start);
  return times;
}

// ---- Machine -----------------------------------------------------------------

uint64_t MemInfoBytes(const char* field) {
  std::ifstream in("/proc/meminfo");
  const std::string want = absl::StrCat(field, ":");
  std::string key, rest;
  uint64_t kb = 0;
  while (in >> key >> kb) {
    std::getline(in, rest);
    if (key == want) return kb * 1024;
  }
  return 0;
}

// The fraction of the files' pages in the page cache (mincore).
double ResidentFraction(const std::vector<std::string>& paths) {
  uint64_t pages = 0, resident = 0;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  for (const std::string& path : paths) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size == 0) {
      ::close(fd);
      continue;
    }
    const size_t size = static_cast<size_t>(st.st_size);
    void* addr = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (addr == MAP_FAILED) continue;
    std::vector<unsigned char> vec((size + page - 1) / page);
    if (::mincore(addr, size, vec.data()) == 0) {
      pages += vec.size();
      for (unsigned char v : vec) resident += v & 1;
    }
    ::munmap(addr, size);
  }
  return pages ? static_cast<double>(resident) / static_cast<double>(pages) : 0;
}

// Seconds and page faults of one method, one entry per repeat.
struct Samples {
  std::vector<double> seconds, faults;
  void Add(double s, double f) {
    seconds.push_back(s);
    faults.push_back(f);
  }
};

int Main(int argc, char** argv) {
  Flags flags = ParseFlags(argc, argv);
  TempDir temp;
  g_temp = &temp;
  std::string dir = flags.model.empty() ? Generate(flags, temp) : flags.model;

  std::vector<std::string> paths;
  uint64_t tensor_bytes = 0;
  size_t num_tensors = 0;
  {
    auto ckpt = loader::Checkpoint::Open(dir);
    if (!ckpt.ok()) Fail(ckpt.status(), "opening the checkpoint");
    paths = ckpt->shard_paths();
    tensor_bytes = ckpt->total_bytes();
    num_tensors = ckpt->tensors().size();
  }
  uint64_t file_bytes = 0;
  for (const std::string& p : paths) file_bytes += std::filesystem::file_size(p);

  const uint64_t ram = MemInfoBytes("MemTotal");
  const uint64_t available = MemInfoBytes("MemAvailable");
  std::printf("machine: %u cores, torch intra-op threads %d, RAM %.1f GB (%.1f GB available)\n",
              std::thread::hardware_concurrency(), at::get_num_threads(), ram / 1e9,
              available / 1e9);
  std::printf("checkpoint: %s: %zu tensors, %.3f GB of tensor data, %zu shard file(s)\n",
              dir.c_str(), num_tensors, tensor_bytes / 1e9, paths.size());
  // The populate method also holds a private copy of every page (see below),
  // so it needs the page cache plus that much again.
  const bool fits = 2 * file_bytes < available;
  std::printf(
      "fits in RAM: %s (%.2f GB in the page cache + %.2f GB of populated copies, "
      "%.1f GB available)\n",
      fits ? "yes" : "NO: the figures below include disk reads", file_bytes / 1e9, file_bytes / 1e9,
      available / 1e9);

  // A reused buffer, faulted in before any timing.
  std::vector<char> buffer(kChunk);
  std::memset(buffer.data(), 1, buffer.size());
  auto warm = std::chrono::steady_clock::now();
  ReadAll(paths, buffer);
  std::printf("page cache warmed by reading every file once (%.2f s); resident: %.1f%%\n",
              Seconds(warm), 100 * ResidentFraction(paths));

  Samples raw, populate_open, populate_total, lazy_total, copy_total;
  for (int r = 0; r < flags.repeats; ++r) {
    double faults = PageFaults();
    auto start = std::chrono::steady_clock::now();
    uint64_t n = ReadAll(paths, buffer);
    raw.Add(Seconds(start), PageFaults() - faults);
    if (n != file_bytes) Fail(absl::DataLossError("a file changed size"), "raw read");

    faults = PageFaults();
    LoadTimes populate = LoadMapped(dir, /*populate=*/true);
    populate_total.Add(populate.total, PageFaults() - faults);
    populate_open.Add(populate.open, populate.open_faults);

    faults = PageFaults();
    LoadTimes lazy = LoadMapped(dir, /*populate=*/false);
    lazy_total.Add(lazy.total, PageFaults() - faults);

    faults = PageFaults();
    LoadTimes copy = LoadCopied(dir);
    copy_total.Add(copy.total, PageFaults() - faults);

    std::printf(
        "repeat %d/%d: raw %.3f s, populate %.3f s (open %.3f s), lazy %.3f s, "
        "copy %.3f s\n",
        r + 1, flags.repeats, raw.seconds.back(), populate.total, populate.open, lazy.total,
        copy.total);
  }
  std::printf("resident after the runs: %.1f%%\n", 100 * ResidentFraction(paths));

  struct Row {
    const char* method;
    const Samples* samples;
    uint64_t bytes;
  };
  const Row rows[] = {
      {"raw read() (64 MiB chunks)", &raw, file_bytes},
      {"accel open+populate (open only)", &populate_open, tensor_bytes},
      {"accel open+populate + Tensor + touch", &populate_total, tensor_bytes},
      {"accel lazy mmap + Tensor + touch", &lazy_total, tensor_bytes},
      {"accel lazy + copy into owned tensors", &copy_total, tensor_bytes},
  };
  const double raw_s = Median(raw.seconds);
  std::printf("\nmedian of %d repeats, from the page cache (GB = 1e9 bytes):\n", flags.repeats);
  std::printf("%-38s %9s %8s %11s %12s\n", "method", "seconds", "GB/s", "x raw read",
              "page faults");
  for (const Row& row : rows) {
    const double seconds = Median(row.samples->seconds);
    std::printf("%-38s %9.3f %8.2f %11.2f %12.0f\n", row.method, seconds, row.bytes / 1e9 / seconds,
                seconds / raw_s, Median(row.samples->faults));
  }
  std::printf("load/raw-read ratio: %.2f\n", Median(populate_total.seconds) / raw_s);
  return 0;
}

}  // namespace
}  // namespace accel

int main(int argc, char** argv) { return accel::Main(argc, argv); }
