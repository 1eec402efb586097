// accel-bench-gemv: the cpu linear layers, y = x W^T for m rows of x (a decode
// step: a few; a prefill: many), in GB/s of weights. For each weight dtype it
// builds a set of Llama-7B-shaped matrices (k = 4096, n = 4096 or 11008) of
// about --gb GB, far more than the caches hold, and times one pass over the
// set (each matrix once, like the layers of a step) for:
//   accel FastLinear   models/internal/cpu_linear.h (what nn::Linear runs);
//                      where it declines (bfloat16 above kFastLinearChunkRows
//                      rows), FastLinearAnyRows: what it would run there
//   at::linear         libtorch's own CPU product (the baseline); float16 has
//                      no CPU matmul in libtorch 1.13, so there the baseline is
//                      nn::Linear's former fallback: at::linear on float32
//                      copies, rounded back
// With --layout conv1d the matrices are stored [k, n], GPT-2's Conv1D layout
// (y = x W), and the methods are accel FastConv1D (what nn::Conv1D runs for
// up to kFastLinearChunkRows rows) against libtorch's matmul, on float32
// copies where nn::Conv1D made them (float16; bfloat16 without oneDNN's
// product).
// And, in the same run, the memory bandwidth over the same bytes: a read that
// sums every weight byte, the same read as 8 streams per thread, and a memcpy
// of them, split over the same threads.
// All sets are built first (about 6 x --gb GB of memory); each round times
// one pass of every method in turn. The machine is shared: a sample during
// which another process used the CPU (/proc/stat) is discarded, rounds go on
// until each method has --repeats clean samples, and the table shows the
// best clean pass. GB/s is weight bytes over time whatever m is (above
// kFastLinearChunkRows rows the work grows with m, not the bytes).
//
//   build-gemv/bin/accel-bench-gemv [--gb 1] [--repeats 5] [--threads 2] [--rows 1,8]
//       [--dtypes float32,bfloat16,float16] [--shapes 4096x4096,11008x4096]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "bench/undisturbed.h"
#include "core/cpu_features.h"
#include "models/internal/cpu_linear.h"
#include "models/internal/gemv.h"

namespace {

using accel::models::internal::FastConv1D;
using accel::models::internal::FastLinear;
using accel::models::internal::FastLinearAnyRows;

struct Shape {
  int64_t n, k;
};

struct Flags {
  double gb = 1.0;
  int repeats = 5;
  int threads = 2;
  std::vector<int64_t> rows = {1, 8};
  std::vector<at::ScalarType> dtypes = {at::kFloat, at::kBFloat16, at::kHalf};
  std::vector<Shape> shapes = {{4096, 4096}, {11008, 4096}};
  bool conv1d = false;  // --layout conv1d: weights [k, n]
};

[[noreturn]] void Usage(const char* argv0, const std::string& error) {
  if (!error.empty()) std::fprintf(stderr, "%s: %s\n", argv0, error.c_str());
  std::fprintf(
      stderr,
      "usage: %s [--gb G] [--repeats R] [--threads T] [--rows 1,8] [--dtypes LIST]\n"
      "          [--shapes LIST] [--layout linear|conv1d]\n"
      "  --gb G         weight set per dtype and shape, in GB (default 1)\n"
      "  --repeats R    undisturbed passes per method, the best shown (default 5)\n"
      "  --threads T    intra-op threads for every method (default 2)\n"
      "  --rows LIST    rows of x (batch, or prompt tokens), comma-separated (default 1,8)\n"
      "  --dtypes LIST  weight dtypes (default float32,bfloat16,float16)\n"
      "  --shapes LIST  weight shapes NxK (default 4096x4096,11008x4096)\n"
      "  --layout L     linear: W [n, k], y = x W^T (default); conv1d: W [k, n], y = x W\n",
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
        int64_t r = 0;
        if (!absl::SimpleAtoi(part, &r) || r < 1) {
          Usage(argv[0], absl::StrCat("--rows: '", part, "' is not a positive integer"));
        }
        flags.rows.push_back(r);
      }
    } else if (arg == "--dtypes") {
      flags.dtypes.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        if (part == "float32") {
          flags.dtypes.push_back(at::kFloat);
        } else if (part == "bfloat16") {
          flags.dtypes.push_back(at::kBFloat16);
        } else if (part == "float16") {
          flags.dtypes.push_back(at::kHalf);
        } else {
          Usage(argv[0], absl::StrCat("--dtypes: unknown dtype '", part, "'"));
        }
      }
    } else if (arg == "--shapes") {
      flags.shapes.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        std::vector<absl::string_view> nk = absl::StrSplit(part, 'x');
        Shape shape{0, 0};
        if (nk.size() != 2 || !absl::SimpleAtoi(nk[0], &shape.n) ||
            !absl::SimpleAtoi(nk[1], &shape.k) || shape.n < 1 || shape.k < 1) {
          Usage(argv[0], absl::StrCat("--shapes: '", part, "' is not NxK"));
        }
        flags.shapes.push_back(shape);
      }
    } else if (arg == "--layout") {
      if (value != "linear" && value != "conv1d") {
        Usage(argv[0], absl::StrCat("--layout: expected linear or conv1d, got '", value, "'"));
      }
      flags.conv1d = value == "conv1d";
    } else if (arg == "--help" || arg == "-h") {
      Usage(argv[0], "");
    } else {
      Usage(argv[0], absl::StrCat("unknown argument '", arg, "'"));
    }
  }
  return flags;
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

// The same sum with each thread's part read as 8 interleaved streams, as the
// kernel reads 8 weight rows at once at m = 1: one sequential stream per core
// does not reach the memory's bandwidth here.
void ReadAllStreams(const std::vector<at::Tensor>& weights) {
  constexpr int64_t kStreams = 8;
  uint64_t total = 0;
  for (const at::Tensor& w : weights) {
    const auto* words = static_cast<const uint64_t*>(w.data_ptr());
    const int64_t count = static_cast<int64_t>(w.nbytes() / 8);
    std::vector<uint64_t> sums(static_cast<size_t>(at::get_num_threads()) + 1, 0);
    at::parallel_for(0, count, 1 << 16, [&](int64_t begin, int64_t end) {
      const int64_t part = (end - begin) / kStreams;
      uint64_t acc[kStreams] = {};
      for (int64_t i = 0; i < part; ++i) {
        for (int64_t s = 0; s < kStreams; ++s) acc[s] += words[begin + s * part + i];
      }
      uint64_t sum = 0;
      for (int64_t i = begin + kStreams * part; i < end; ++i) sum += words[i];
      for (uint64_t a : acc) sum += a;
      sums[static_cast<size_t>(at::get_thread_num())] += sum;
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

// One weight set: a dtype and a shape, about --gb GB of matrices.
struct Set {
  std::string dtype, shape;
  std::vector<at::Tensor> weights;
  double bytes = 0;
  bool torch_native = true;  // libtorch has this product on the cpu (1.13: not for float16)
};

struct Method {
  const Set* set;
  std::string name;
  int64_t rows;  // 0: a bandwidth baseline
  std::function<void()> pass;
  accel::bench::Samples samples = {};  // seconds per pass
};

std::string Name(at::ScalarType t) {
  return t == at::kFloat ? "float32" : t == at::kBFloat16 ? "bfloat16" : "float16";
}

at::Tensor TorchLinear(const Set& set, const at::Tensor& x, const at::Tensor& w) {
  if (set.torch_native) return at::linear(x, w);
  return at::linear(x.to(at::kFloat), w.to(at::kFloat)).to(x.scalar_type());
}

// What nn::Conv1D ran before FastConv1D (and runs above its rows): libtorch's
// product, on float32 copies rounded back where libtorch lacks it.
at::Tensor TorchConv1D(const at::Tensor& x, const at::Tensor& w) {
  const bool native =
      x.scalar_type() == at::kFloat ||
      (x.scalar_type() == at::kBFloat16 && accel::CpuFeaturesOfThisMachine().onednn_bf16_matmul);
  if (native) return at::matmul(x, w);
  return at::matmul(x.to(at::kFloat), w.to(at::kFloat)).to(x.scalar_type());
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

  // Every set is built first and every method timed once per repeat, so a
  // noisy neighbour slows one sample of each method, not all of one method.
  std::vector<std::unique_ptr<Set>> sets;
  std::vector<Method> methods;
  std::vector<char> copy_out;
  for (at::ScalarType dtype : flags.dtypes) {
    for (const Shape& shape : flags.shapes) {
      auto set = std::make_unique<Set>();
      set->dtype = Name(dtype);
      set->shape = absl::StrCat(shape.n, "x", shape.k);
      const double matrix_bytes =
          static_cast<double>(shape.n * shape.k) * static_cast<double>(c10::elementSize(dtype));
      const int64_t count =
          std::max<int64_t>(1, static_cast<int64_t>(flags.gb * 1e9 / matrix_bytes));
      for (int64_t i = 0; i < count; ++i) {
        set->weights.push_back((at::randn(flags.conv1d ? at::IntArrayRef{shape.k, shape.n}
                                                       : at::IntArrayRef{shape.n, shape.k}) *
                                0.02)
                                   .to(dtype));
      }
      set->bytes = matrix_bytes * static_cast<double>(count);
      copy_out.resize(std::max(copy_out.size(), static_cast<size_t>(matrix_bytes)), 1);
      try {
        if (!flags.conv1d) at::linear(at::randn({1, shape.k}).to(dtype), set->weights[0]);
      } catch (const c10::Error&) {
        set->torch_native = false;
      }
      const Set& s = *set;
      methods.push_back({&s, "read (sum every word)", 0, [&s] { ReadAll(s.weights); }});
      methods.push_back({&s, "memcpy", 0, [&s, &copy_out] { CopyAll(s.weights, copy_out); }});
      methods.push_back({&s, "read, 8 streams per thread", 0, [&s] { ReadAllStreams(s.weights); }});
      for (int64_t m : flags.rows) {
        at::Tensor x = at::randn({m, shape.k}).to(dtype);
        if (flags.conv1d) {
          if (!FastConv1D(x, s.weights[0], at::Tensor()).has_value()) {
            std::printf("%s %s m=%ld: FastConv1D declines (more rows than a decode chunk)\n",
                        s.dtype.c_str(), s.shape.c_str(), static_cast<long>(m));
            continue;
          }
          at::Tensor ours = FastConv1D(x, s.weights[0], at::Tensor())->to(at::kFloat);
          at::Tensor theirs = TorchConv1D(x, s.weights[0]).to(at::kFloat);
          const double diff = (ours - theirs).abs().max().item<double>();
          const double scale = theirs.abs().max().item<double>();
          if (!(diff <= 0.02 * scale)) {
            std::fprintf(stderr, "%s %s m=%ld: FastConv1D and libtorch differ by %g (scale %g)\n",
                         s.dtype.c_str(), s.shape.c_str(), static_cast<long>(m), diff, scale);
            return 1;
          }
          methods.push_back({&s, "accel FastConv1D", m, [&s, x] {
                               for (const at::Tensor& w : s.weights) {
                                 g_sink = g_sink + static_cast<uint64_t>(
                                                       FastConv1D(x, w, at::Tensor())->numel());
                               }
                             }});
          methods.push_back({&s, "at::matmul (as nn::Conv1D did)", m, [&s, x] {
                               for (const at::Tensor& w : s.weights) {
                                 g_sink = g_sink + static_cast<uint64_t>(TorchConv1D(x, w).numel());
                               }
                             }});
          continue;
        }
        const bool takes = FastLinear(x, s.weights[0], at::Tensor()).has_value();
        auto ours_fn = [takes](const at::Tensor& input, const at::Tensor& w) {
          return takes ? *FastLinear(input, w, at::Tensor())
                       : *FastLinearAnyRows(input, w, at::Tensor());
        };
        // One check that both agree before timing them.
        at::Tensor ours = ours_fn(x, s.weights[0]).to(at::kFloat);
        at::Tensor theirs = TorchLinear(s, x, s.weights[0]).to(at::kFloat);
        const double diff = (ours - theirs).abs().max().item<double>();
        const double scale = theirs.abs().max().item<double>();
        if (!(diff <= 0.02 * scale)) {
          std::fprintf(stderr, "%s %s m=%ld: FastLinear and libtorch differ by %g (scale %g)\n",
                       s.dtype.c_str(), s.shape.c_str(), static_cast<long>(m), diff, scale);
          return 1;
        }
        methods.push_back(
            {&s, takes ? "accel FastLinear" : "FastLinearAnyRows (declined)", m, [&s, x, ours_fn] {
               for (const at::Tensor& w : s.weights) {
                 g_sink = g_sink + static_cast<uint64_t>(ours_fn(x, w).numel());
               }
             }});
        methods.push_back(
            {&s, s.torch_native ? "at::linear" : "at::linear on float32 copies", m, [&s, x] {
               for (const at::Tensor& w : s.weights) {
                 g_sink = g_sink + static_cast<uint64_t>(TorchLinear(s, x, w).numel());
               }
             }});
      }
      std::printf("built %s %s: %zu matrices, %.2f GB\n", s.dtype.c_str(), s.shape.c_str(),
                  s.weights.size(), s.bytes / 1e9);
      sets.push_back(std::move(set));
    }
  }
  std::fflush(stdout);

  // Rounds until every method has --repeats undisturbed samples (at most
  // 5 x --repeats rounds).
  for (int round = 0; round < 5 * flags.repeats; ++round) {
    int short_of = 0;
    const auto start = std::chrono::steady_clock::now();
    for (Method& method : methods) {
      if (method.samples.clean >= flags.repeats) continue;
      accel::bench::Sample(method.pass, method.samples);
      if (method.samples.clean < flags.repeats) ++short_of;
    }
    std::printf("round %d: %.1f s, %d methods short of %d undisturbed samples\n", round + 1,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                short_of, flags.repeats);
    std::fflush(stdout);
    if (short_of == 0) break;
  }

  std::printf(
      "\nbest undisturbed pass (* = every sample disturbed: best of all); GB = 1e9 bytes of\n"
      "weights per second; 'of read', 'of 8x' = GB/s over the plain and the 8-stream read's;\n"
      "samples = undisturbed/disturbed\n");
  std::printf("%-9s %-10s %-4s %-28s %10s %7s %8s %8s %8s\n", "dtype", "shape", "m", "method",
              "ms / call", "GB/s", "of read", "of 8x", "samples");
  auto best = [](const Method& m) {
    return m.samples.clean > 0 ? m.samples.best : m.samples.best_any;
  };
  for (const Method& method : methods) {
    const Set& s = *method.set;
    double read_s = 0, streams_s = 0;
    for (const Method& other : methods) {
      if (other.set != method.set) continue;
      if (other.name.rfind("read (", 0) == 0) read_s = best(other);
      if (other.name.rfind("read, 8", 0) == 0) streams_s = best(other);
    }
    const std::string m = method.rows == 0 ? "-" : std::to_string(method.rows);
    const double seconds = best(method);
    std::printf("%-9s %-10s %-4s %-28s %10.3f %7.2f %8.2f %8.2f %5d/%-2d%s\n", s.dtype.c_str(),
                s.shape.c_str(), m.c_str(), method.name.c_str(),
                1e3 * seconds / static_cast<double>(s.weights.size()), s.bytes / 1e9 / seconds,
                read_s / seconds, streams_s / seconds, method.samples.clean,
                method.samples.disturbed, method.samples.clean > 0 ? "" : " *");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
