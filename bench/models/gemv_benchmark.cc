// accel-bench-gemv: the decode path's linear layers, y = x W^T for a few rows
// of x, in GB/s of weights streamed. For each weight dtype it builds a set of
// Llama-7B-shaped matrices (k = 4096, n = 4096 or 11008) of about --gb GB, far
// more than the caches hold, and times one pass over the set (each matrix
// once, like the layers of a decode step) for:
//   accel FastLinear   models/internal/cpu_linear.h (what nn::Linear runs)
//   at::linear         libtorch's own CPU product (the baseline); float16 has
//                      no CPU matmul in libtorch 1.13, so there the baseline is
//                      nn::Linear's former fallback: at::linear on float32
//                      copies, rounded back
// and, in the same run, the memory bandwidth over the same bytes: a read that
// sums every weight byte and a memcpy of them, split over the same threads.
// Every figure is the best of --repeats passes, measured interleaved.
//
//   build-gemv/bin/accel-bench-gemv [--gb 1] [--repeats 5] [--threads 2] [--rows 1,8]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "models/internal/cpu_linear.h"
#include "models/internal/gemv.h"

namespace {

using accel::models::internal::FastLinear;

struct Flags {
  double gb = 1.0;
  int repeats = 5;
  int threads = 2;
  std::vector<int64_t> rows = {1, 8};
};

[[noreturn]] void Usage(const char* argv0, const std::string& error) {
  if (!error.empty()) std::fprintf(stderr, "%s: %s\n", argv0, error.c_str());
  std::fprintf(stderr,
               "usage: %s [--gb G] [--repeats R] [--threads T] [--rows 1,8]\n"
               "  --gb G        weight set per dtype and shape, in GB (default 1)\n"
               "  --repeats R   passes per method, the best shown (default 5)\n"
               "  --threads T   intra-op threads for every method (default 2)\n"
               "  --rows LIST   rows of x (batch), comma-separated, each 1..16 (default 1,8)\n",
               argv0);
  std::exit(2);
}

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (arg != "--help" && arg != "-h") {
      if (i + 1 >= argc) Usage(argv[0], absl::StrCat(arg, " needs a value"));
      value = argv[++i];
    }
    auto number = [&]() {
      char* end = nullptr;
      const double v = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(v > 0)) {
        Usage(argv[0], absl::StrCat(arg, ": expected a positive number, got '", value, "'"));
      }
      return v;
    };
    if (arg == "--gb") {
      flags.gb = number();
    } else if (arg == "--repeats") {
      flags.repeats = static_cast<int>(number());
    } else if (arg == "--threads") {
      flags.threads = static_cast<int>(number());
    } else if (arg == "--rows") {
      flags.rows.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        const int64_t r = std::atoll(std::string(part).c_str());
        if (r < 1 || r > accel::models::internal::kFastLinearMaxRows) {
          Usage(argv[0], absl::StrCat("--rows: ", part, " is not in 1..16"));
        }
        flags.rows.push_back(r);
      }
    } else if (arg == "--help" || arg == "-h") {
      Usage(argv[0], "");
    } else {
      Usage(argv[0], absl::StrCat("unknown argument '", arg, "'"));
    }
  }
  return flags;
}

double Seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

volatile uint64_t g_sink = 0;

// Sums every 8-byte word of the tensors, split over the intra-op threads as
// FastLinear splits its columns: the plain read the kernels are bound by.
void ReadAll(const std::vector<at::Tensor>& weights) {
  uint64_t total = 0;
  for (const at::Tensor& w : weights) {
    const auto* words = static_cast<const uint64_t*>(w.data_ptr());
    const int64_t count = static_cast<int64_t>(w.nbytes() / 8);
    std::vector<uint64_t> sums(static_cast<size_t>(at::get_num_threads()) + 1, 0);
    at::parallel_for(0, count, 1 << 16, [&](int64_t begin, int64_t end) {
      uint64_t a = 0, b = 0, c = 0, d = 0;
      int64_t i = begin;
      for (; i + 4 <= end; i += 4) {
        a += words[i];
        b += words[i + 1];
        c += words[i + 2];
        d += words[i + 3];
      }
      for (; i < end; ++i) a += words[i];
      sums[static_cast<size_t>(at::get_thread_num())] += a + b + c + d;
    });
    for (uint64_t s : sums) total += s;
  }
  g_sink = g_sink + total;
}

// memcpy of every tensor into `out` (as large as the biggest), split likewise.
void CopyAll(const std::vector<at::Tensor>& weights, std::vector<char>& out) {
  for (const at::Tensor& w : weights) {
    const char* src = static_cast<const char*>(w.data_ptr());
    at::parallel_for(0, static_cast<int64_t>(w.nbytes()), 1 << 20, [&](int64_t begin, int64_t end) {
      std::memcpy(out.data() + begin, src + begin, static_cast<size_t>(end - begin));
    });
  }
}

struct Shape {
  int64_t n, k;
};

struct Row {
  std::string dtype, shape, method;
  int64_t rows;
  double bytes, seconds;  // one pass over the set
  int64_t calls;          // matrices in the set
};

std::string Name(at::ScalarType t) {
  return t == at::kFloat ? "float32" : t == at::kBFloat16 ? "bfloat16" : "float16";
}

int Main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  at::set_num_threads(flags.threads);
  c10::InferenceMode inference;
  std::printf(
      "machine: %u cores, gemv kernels: %s, intra-op threads: %d, weight set %.2f GB per "
      "dtype and shape, best of %d\n",
      std::thread::hardware_concurrency(),
      std::string(accel::models::internal::GemvIsaName(accel::models::internal::BestGemvIsa()))
          .c_str(),
      at::get_num_threads(), flags.gb, flags.repeats);

  const Shape shapes[] = {{4096, 4096}, {11008, 4096}};
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  std::vector<Row> rows;
  std::vector<char> copy_out;
  for (at::ScalarType dtype : dtypes) {
    for (const Shape& shape : shapes) {
      const double matrix_bytes =
          static_cast<double>(shape.n * shape.k) * static_cast<double>(c10::elementSize(dtype));
      const int64_t count =
          std::max<int64_t>(1, static_cast<int64_t>(flags.gb * 1e9 / matrix_bytes));
      std::vector<at::Tensor> weights;
      for (int64_t i = 0; i < count; ++i) {
        weights.push_back((at::randn({shape.n, shape.k}) * 0.02).to(dtype));
      }
      copy_out.resize(static_cast<size_t>(matrix_bytes));
      std::memset(copy_out.data(), 1, copy_out.size());
      const double bytes = matrix_bytes * static_cast<double>(count);
      const std::string dname = Name(dtype);
      const std::string sname = absl::StrCat(shape.n, "x", shape.k);

      // Does libtorch have this product on the cpu? (1.13: not for float16.)
      bool torch_native = true;
      try {
        at::linear(at::randn({1, shape.k}).to(dtype), weights[0]);
      } catch (const c10::Error&) {
        torch_native = false;
      }
      auto torch_linear = [&](const at::Tensor& x, const at::Tensor& w) {
        if (torch_native) return at::linear(x, w);
        return at::linear(x.to(at::kFloat), w.to(at::kFloat)).to(x.scalar_type());
      };
      const std::string torch_name = torch_native ? "at::linear" : "at::linear on float32 copies";

      double best_read = 1e30, best_copy = 1e30;
      for (int64_t m : flags.rows) {
        at::Tensor x = at::randn({m, shape.k}).to(dtype);
        // One check that both agree before timing them.
        {
          at::Tensor ours = FastLinear(x, weights[0], at::Tensor()).value().to(at::kFloat);
          at::Tensor theirs = torch_linear(x, weights[0]).to(at::kFloat);
          const double diff = (ours - theirs).abs().max().item<double>();
          const double scale = theirs.abs().max().item<double>();
          if (!(diff <= 0.02 * scale)) {
            std::fprintf(stderr, "%s %s m=%ld: FastLinear and %s differ by %g (scale %g)\n",
                         dname.c_str(), sname.c_str(), static_cast<long>(m), torch_name.c_str(),
                         diff, scale);
            return 1;
          }
        }
        double best_ours = 1e30, best_torch = 1e30;
        for (int r = 0; r < flags.repeats; ++r) {
          best_read = std::min(best_read, Seconds([&] { ReadAll(weights); }));
          best_copy = std::min(best_copy, Seconds([&] { CopyAll(weights, copy_out); }));
          best_ours = std::min(
              best_ours, Seconds([&] {
                for (const at::Tensor& w : weights) {
                  g_sink = g_sink + static_cast<uint64_t>(FastLinear(x, w, at::Tensor())->numel());
                }
              }));
          best_torch = std::min(best_torch, Seconds([&] {
                                  for (const at::Tensor& w : weights) {
                                    g_sink =
                                        g_sink + static_cast<uint64_t>(torch_linear(x, w).numel());
                                  }
                                }));
        }
        rows.push_back({dname, sname, "accel FastLinear", m, bytes, best_ours, count});
        rows.push_back({dname, sname, torch_name, m, bytes, best_torch, count});
      }
      rows.push_back({dname, sname, "read (sum every word)", 0, bytes, best_read, count});
      rows.push_back({dname, sname, "memcpy", 0, bytes, best_copy, count});
      std::printf("done: %s %s (%ld matrices, %.2f GB)\n", dname.c_str(), sname.c_str(),
                  static_cast<long>(count), bytes / 1e9);
      std::fflush(stdout);
    }
  }

  std::printf("\n%-9s %-10s %-4s %-30s %11s %8s %8s\n", "dtype", "shape", "m", "method",
              "ms / call", "GB/s", "of read");
  for (const Row& row : rows) {
    double read_s = 0;
    for (const Row& other : rows) {
      if (other.dtype == row.dtype && other.shape == row.shape && other.rows == 0 &&
          other.method.rfind("read", 0) == 0) {
        read_s = other.seconds;
      }
    }
    const std::string m = row.rows == 0 ? "-" : std::to_string(row.rows);
    std::printf("%-9s %-10s %-4s %-30s %11.3f %8.2f %8.2f\n", row.dtype.c_str(), row.shape.c_str(),
                m.c_str(), row.method.c_str(), 1e3 * row.seconds / static_cast<double>(row.calls),
                row.bytes / 1e9 / row.seconds, read_s / row.seconds);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
