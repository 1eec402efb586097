// accel-bench-quant: the quantized linear layers of quant/matmul.h on the
// decode path (a few rows of x), in GB/s of weight bytes read and ms per call,
// next to libtorch's dense products and the memory bandwidth, all measured in
// the same run. For each weight shape (Llama-7B's [4096, 4096] and
// [11008, 4096] by default) it builds, per format, a set of matrices of about
// --gb GB (several times the L3 cache, so every pass streams from memory):
//   nf4 fused GEMV     Linear4bitForward, x bfloat16, compute bfloat16, NF4
//                      blocksize 64 (packed + float32 absmax: 0.5625 B/param);
//                      above 16 rows it dequantizes and calls at::linear
//   nf4+dq fused GEMV  the same with double quant as stored (uint8 absmax
//                      codes, nested absmax: 0.5157 B/param), up to 16 rows
//   int8 thr 0         Int8LinearForward, x bfloat16, no decomposition
//   int8 thr 6         the same with threshold 6 and 4 input columns of x
//                      holding an outlier (LLM.int8's decomposition)
//   at::linear fp32 / bf16   libtorch 1.13 on dense weights of the same shape
//   memcpy, read       the NF4 set's bytes copied / summed, split over the
//                      same threads: the bandwidth the GEMV is bound by
// Each round times one pass of every method over its set (each matrix once,
// like the layers of a step). The machine is shared: a sample during which
// another process used the CPU (/proc/stat) is discarded, rounds go on until
// each method has --repeats clean samples (at most 5 x --repeats rounds), and
// the table shows the best clean pass (* = every sample disturbed).
// --isa runs the quant kernels at a lower level (avx2, scalar) than the best
// this CPU has, for comparison.
//
//   build-qb/bin/accel-bench-quant [--gb 1] [--repeats 5] [--threads 2]
//       [--rows 1,4,16] [--shapes 4096x4096,11008x4096] [--isa avx2]
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
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

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "bench/undisturbed.h"
#include "core/malloc_tuning.h"
#include "quant/bnb.h"
#include "quant/internal/kernels_cpu.h"
#include "quant/matmul.h"

namespace {

using accel::quant::Weight4bit;

struct Shape {
  int64_t n, k;
};

struct Flags {
  double gb = 1.0;
  int repeats = 5;
  int threads = 2;
  std::vector<int64_t> rows = {1, 4, 16};
  std::vector<Shape> shapes = {{4096, 4096}, {11008, 4096}};
  std::optional<accel::quant::internal::CpuIsa> isa;
};

[[noreturn]] void Usage(const char* argv0, const std::string& error) {
  if (!error.empty()) std::fprintf(stderr, "%s: %s\n", argv0, error.c_str());
  std::fprintf(stderr,
               "usage: %s [--gb G] [--repeats R] [--threads T] [--rows 1,4,16] [--shapes LIST]\n"
               "          [--isa LEVEL]\n"
               "  --gb G         weight set per format and shape, in GB (default 1)\n"
               "  --repeats R    passes per method, the best shown (default 5)\n"
               "  --threads T    intra-op threads for every method (default 2)\n"
               "  --rows LIST    rows of x (the batch), comma-separated (default 1,4,16)\n"
               "  --shapes LIST  weight shapes NxK (default 4096x4096,11008x4096)\n"
               "  --isa LEVEL    quant kernel level: scalar, avx2, avx512, avx512bf16\n"
               "                 (default: the best)\n",
               argv0);
  std::exit(2);
}

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") Usage(argv[0], "");
    std::string value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else {
      if (i + 1 >= argc) Usage(argv[0], absl::StrCat(arg, " needs a value"));
      value = argv[++i];
    }
    auto positive = [&]() {
      double v = 0;
      if (!absl::SimpleAtod(value, &v) || !(v > 0)) {
        Usage(argv[0], absl::StrCat(arg, ": expected a positive number, got '", value, "'"));
      }
      return v;
    };
    if (arg == "--gb") {
      flags.gb = positive();
    } else if (arg == "--repeats") {
      flags.repeats = static_cast<int>(positive());
    } else if (arg == "--threads") {
      flags.threads = static_cast<int>(positive());
    } else if (arg == "--rows") {
      flags.rows.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        int64_t r = 0;
        if (!absl::SimpleAtoi(part, &r) || r < 1) {
          Usage(argv[0], absl::StrCat("--rows: '", part, "' is not a positive integer"));
        }
        flags.rows.push_back(r);
      }
    } else if (arg == "--shapes") {
      flags.shapes.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        std::vector<absl::string_view> nk = absl::StrSplit(part, 'x');
        Shape shape{0, 0};
        if (nk.size() != 2 || !absl::SimpleAtoi(nk[0], &shape.n) ||
            !absl::SimpleAtoi(nk[1], &shape.k) || shape.n < 1 || shape.k < 1 ||
            shape.n * shape.k % 64 != 0) {
          Usage(argv[0], absl::StrCat("--shapes: '", part, "' is not NxK (N*K a multiple of 64)"));
        }
        flags.shapes.push_back(shape);
      }
    } else if (arg == "--isa") {
      using accel::quant::internal::CpuIsa;
      for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
        if (value == accel::quant::internal::CpuIsaName(isa)) flags.isa = isa;
      }
      if (!flags.isa) Usage(argv[0], absl::StrCat("--isa: unknown level '", value, "'"));
      if (!accel::quant::internal::CpuIsaSupported(*flags.isa)) {
        Usage(argv[0], absl::StrCat("--isa: this CPU cannot run ", value));
      }
    } else {
      Usage(argv[0], absl::StrCat("unknown argument '", arg, "'"));
    }
  }
  return flags;
}

volatile uint64_t g_sink = 0;

// A random NF4 weight in bnb's layout: random codes (each byte two nibbles)
// and positive absmaxes; the GEMV's speed does not depend on the values.
Weight4bit RandomNf4(const Shape& s, const at::Tensor& code) {
  Weight4bit w;
  w.out_features = s.n;
  w.in_features = s.k;
  w.blocksize = 64;
  w.packed = at::randint(0, 256, {s.n * s.k / 2, 1}, at::kByte);
  w.absmax = at::rand({s.n * s.k / 64}, at::kFloat) * 0.05 + 0.01;
  w.code = code;
  return w;
}

// The same with double quant as stored: uint8 absmax codes into bnb's
// dynamic map, a float32 absmax per 256 blocks and an offset.
Weight4bit RandomNf4DoubleQuant(const Shape& s, const at::Tensor& code) {
  Weight4bit w = RandomNf4(s, code);
  const int64_t blocks = w.absmax.numel();
  w.absmax = at::randint(128, 256, {blocks}, at::kByte);  // the map's positive half
  w.nested_absmax = at::rand({(blocks + 255) / 256}, at::kFloat) * 0.05 + 0.01;
  const std::array<float, 256>& map = accel::quant::DynamicMap();
  w.nested_code = at::from_blob(const_cast<float*>(map.data()), {256}, at::kFloat).clone();
  w.nested_offset = 0.03f;
  return w;
}

double WeightBytes(const Weight4bit& w) {
  double bytes = static_cast<double>(w.packed.nbytes() + w.absmax.nbytes());
  if (w.nested_absmax.defined()) bytes += static_cast<double>(w.nested_absmax.nbytes());
  return bytes;
}

// memcpy / an 8-byte-word sum over `tensors`, split over the intra-op threads.
void CopyAll(const std::vector<const at::Tensor*>& tensors, std::vector<char>& out) {
  for (const at::Tensor* t : tensors) {
    const char* src = static_cast<const char*>(t->data_ptr());
    at::parallel_for(0, static_cast<int64_t>(t->nbytes()), 1 << 20, [&](int64_t b, int64_t e) {
      std::memcpy(out.data() + b, src + b, static_cast<size_t>(e - b));
    });
  }
}

void ReadAll(const std::vector<const at::Tensor*>& tensors) {
  uint64_t total = 0;
  for (const at::Tensor* t : tensors) {
    const auto* words = static_cast<const uint64_t*>(t->data_ptr());
    std::vector<uint64_t> sums(static_cast<size_t>(at::get_num_threads()) + 1, 0);
    at::parallel_for(0, static_cast<int64_t>(t->nbytes() / 8), 1 << 16, [&](int64_t b, int64_t e) {
      uint64_t acc[4] = {0, 0, 0, 0};
      int64_t i = b;
      for (; i + 4 <= e; i += 4) {
        for (int j = 0; j < 4; ++j) acc[j] += words[i + j];
      }
      for (; i < e; ++i) acc[0] += words[i];
      sums[static_cast<size_t>(at::get_thread_num())] += acc[0] + acc[1] + acc[2] + acc[3];
    });
    for (uint64_t s : sums) total += s;
  }
  g_sink = g_sink + total;
}

template <typename T>
T Check(absl::StatusOr<T> value) {
  if (!value.ok()) {
    std::fprintf(stderr, "accel-bench-quant: %s\n", value.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(value);
}

struct Method {
  std::string name;
  int64_t rows;   // 0: a bandwidth baseline
  double bytes;   // weight bytes one pass reads
  int64_t calls;  // calls (matrices) per pass
  std::function<void()> pass;
  accel::bench::Samples samples = {};  // seconds per pass
};

void RunShape(const Flags& flags, const Shape& s, const at::Tensor& code) {
  const std::string shape = absl::StrCat(s.n, "x", s.k);
  const double params = static_cast<double>(s.n * s.k);
  auto count_for = [&](double bytes_per_param) {
    return std::max<int64_t>(1, static_cast<int64_t>(flags.gb * 1e9 / (params * bytes_per_param)));
  };

  // The sets: NF4, int8 (CB + SCB), dense float32 and bfloat16.
  std::vector<Weight4bit> nf4;
  for (int64_t i = 0, c = count_for(0.5625); i < c; ++i) nf4.push_back(RandomNf4(s, code));
  std::vector<Weight4bit> nf4_dq;
  for (int64_t i = 0, c = count_for(0.5157); i < c; ++i) {
    nf4_dq.push_back(RandomNf4DoubleQuant(s, code));
  }
  std::vector<at::Tensor> cb, scb;
  for (int64_t i = 0, c = count_for(1.0); i < c; ++i) {
    cb.push_back(at::randint(-127, 128, {s.n, s.k}, at::kChar));
    scb.push_back(at::rand({s.n}, at::kFloat) * 0.1 + 0.01);
  }
  std::vector<at::Tensor> f32, bf16;
  for (int64_t i = 0, c = count_for(4.0); i < c; ++i) f32.push_back(at::randn({s.n, s.k}) * 0.02);
  for (int64_t i = 0, c = count_for(2.0); i < c; ++i) {
    bf16.push_back((at::randn({s.n, s.k}) * 0.02).to(at::kBFloat16));
  }
  double nf4_bytes = 0, nf4_dq_bytes = 0, int8_bytes = 0;
  for (const Weight4bit& w : nf4_dq) nf4_dq_bytes += WeightBytes(w);
  std::vector<const at::Tensor*> nf4_tensors;
  for (const Weight4bit& w : nf4) {
    nf4_bytes += WeightBytes(w);
    nf4_tensors.push_back(&w.packed);
    nf4_tensors.push_back(&w.absmax);
  }
  for (size_t i = 0; i < cb.size(); ++i) {
    int8_bytes += static_cast<double>(cb[i].nbytes() + scb[i].nbytes());
  }
  const double f32_bytes = static_cast<double>(f32.size()) * params * 4;
  const double bf16_bytes = static_cast<double>(bf16.size()) * params * 2;
  std::printf(
      "built %s: %zu nf4 (%.2f GB), %zu nf4+dq (%.2f GB), %zu int8 (%.2f GB), %zu float32 (%.2f "
      "GB), %zu bfloat16 (%.2f GB)\n",
      shape.c_str(), nf4.size(), nf4_bytes / 1e9, nf4_dq.size(), nf4_dq_bytes / 1e9, cb.size(),
      int8_bytes / 1e9, f32.size(), f32_bytes / 1e9, bf16.size(), bf16_bytes / 1e9);
  std::fflush(stdout);

  std::vector<char> copy_out(nf4[0].packed.nbytes());
  std::vector<Method> methods;
  methods.push_back(
      {"memcpy (nf4 set's bytes)", 0, nf4_bytes, 0, [&] { CopyAll(nf4_tensors, copy_out); }});
  methods.push_back({"read (sum every word)", 0, nf4_bytes, 0, [&] { ReadAll(nf4_tensors); }});
  const int64_t nf4_count = static_cast<int64_t>(nf4.size());
  const int64_t int8_count = static_cast<int64_t>(cb.size());
  for (int64_t m : flags.rows) {
    const at::Tensor x = at::randn({m, s.k}).to(at::kBFloat16);
    // 4 input columns with an outlier in row 0 (|x| >= 6): a few outlier
    // dimensions, as LLM.int8 sees in large models.
    at::Tensor x_outliers = x.clone();
    for (int64_t col : {int64_t{7}, s.k / 3, s.k / 2, s.k - 5}) x_outliers[0][col] = 8.0;
    methods.push_back({m <= 16 ? "nf4 fused GEMV (bf16)" : "nf4 dequant + at::linear (bf16)", m,
                       nf4_bytes, nf4_count, [&nf4, x] {
                         for (const Weight4bit& w : nf4) {
                           g_sink = g_sink + static_cast<uint64_t>(
                                                 Check(accel::quant::Linear4bitForward(
                                                           x, w, at::Tensor(), at::kBFloat16))
                                                     .numel());
                         }
                       }});
    if (m <= 16) {
      methods.push_back({"nf4+dq fused GEMV (bf16)", m, nf4_dq_bytes,
                         static_cast<int64_t>(nf4_dq.size()), [&nf4_dq, x] {
                           for (const Weight4bit& w : nf4_dq) {
                             g_sink = g_sink + static_cast<uint64_t>(
                                                   Check(accel::quant::Linear4bitForward(
                                                             x, w, at::Tensor(), at::kBFloat16))
                                                       .numel());
                           }
                         }});
    }
    for (double threshold : {0.0, 6.0}) {
      const at::Tensor input = threshold > 0 ? x_outliers : x;
      methods.push_back({threshold > 0 ? "int8 thr 6 (4 outlier cols)" : "int8 thr 0", m,
                         int8_bytes, int8_count, [&cb, &scb, input, threshold] {
                           for (size_t i = 0; i < cb.size(); ++i) {
                             g_sink = g_sink +
                                      static_cast<uint64_t>(
                                          Check(accel::quant::Int8LinearForward(
                                                    input, cb[i], scb[i], at::Tensor(), threshold))
                                              .numel());
                           }
                         }});
    }
    const at::Tensor x32 = x.to(at::kFloat);
    methods.push_back(
        {"at::linear float32", m, f32_bytes, static_cast<int64_t>(f32.size()), [&f32, x32] {
           for (const at::Tensor& w : f32) {
             g_sink = g_sink + static_cast<uint64_t>(at::linear(x32, w).numel());
           }
         }});
    methods.push_back(
        {"at::linear bfloat16", m, bf16_bytes, static_cast<int64_t>(bf16.size()), [&bf16, x] {
           for (const at::Tensor& w : bf16) {
             g_sink = g_sink + static_cast<uint64_t>(at::linear(x, w).numel());
           }
         }});
  }

  // Rounds until every method has --repeats undisturbed samples (at most
  // 5 x --repeats rounds).
  for (int round = 0; round < 5 * flags.repeats; ++round) {
    int short_of = 0;
    for (Method& method : methods) {
      if (method.samples.clean >= flags.repeats) continue;
      accel::bench::Sample(method.pass, method.samples);
      if (method.samples.clean < flags.repeats) ++short_of;
    }
    if (short_of == 0) break;
  }
  for (Method& method : methods) {
    if (method.samples.clean == 0) method.samples.best = method.samples.best_any;
  }

  std::printf("\n%-10s %-4s %-32s %10s %8s %12s %8s\n", "shape", "m", "method", "ms / call", "GB/s",
              "vs bf16 call", "samples");
  for (const Method& method : methods) {
    double bf16_call = 0;
    for (const Method& other : methods) {
      if (other.rows == method.rows && other.name == "at::linear bfloat16") {
        bf16_call = other.samples.best / static_cast<double>(other.calls);
      }
    }
    const std::string m = method.rows == 0 ? "-" : std::to_string(method.rows);
    char per_call[32] = "-", relative[32] = "";
    if (method.calls > 0) {
      const double seconds = method.samples.best / static_cast<double>(method.calls);
      std::snprintf(per_call, sizeof(per_call), "%.3f", 1e3 * seconds);
      std::snprintf(relative, sizeof(relative), "%.2fx", bf16_call / seconds);
    }
    std::printf("%-10s %-4s %-32s %10s %8.2f %12s %5d/%-2d%s\n", shape.c_str(), m.c_str(),
                method.name.c_str(), per_call, method.bytes / 1e9 / method.samples.best, relative,
                method.samples.clean, method.samples.disturbed,
                method.samples.clean > 0 ? "" : " *");
  }
  std::printf("\n");
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  // As the tools run (core/tool_main.cc): freed buffers kept for reuse, not
  // faulted in again at every call.
  accel::KeepFreedMemoryForReuse();
  at::set_num_threads(flags.threads);
  if (flags.isa) accel::quant::internal::SetIsaOverrideForTesting(*flags.isa);
  c10::InferenceMode inference;
  std::printf(
      "machine: %u cores, quant kernels: %s, intra-op threads: %d, weight set %.2f GB per "
      "format and shape, best of %d undisturbed passes; GB = 1e9 bytes of weights read per\n"
      "second; samples = undisturbed/disturbed;\n"
      "'vs bf16 call' = at::linear bfloat16's time per call / this method's (higher: faster)\n",
      std::thread::hardware_concurrency(),
      std::string(accel::quant::internal::CpuIsaName(accel::quant::internal::ActiveIsa())).c_str(),
      at::get_num_threads(), flags.gb, flags.repeats);
  const auto& nf4 = accel::quant::CodeTable(accel::quant::QuantType4bit::kNf4);
  const at::Tensor code = at::from_blob(const_cast<float*>(nf4.data()), {16}, at::kFloat).clone();
  for (const Shape& s : flags.shapes) RunShape(flags, s, code);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
