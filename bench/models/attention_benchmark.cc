// Decode attention over the KV cache: the paged cache (keys and values in
// blocks scattered through a store, read in place by PagedDecodeAttention)
// against the contiguous per-sequence cache it replaced (AttendPacked's
// matmul path over [kv_heads, length, head_dim] buffers), one decode step
// of `batch` sequences of `context` tokens each. Both include writing the
// step's key and value. Prints microseconds per step and GB/s of keys and
// values read, next to a copy of the same bytes (the memory bound) measured
// in the same run. docs/BENCHMARKS.md.
//
//   build/bin/accel-bench-attention [--dtype bfloat16|float32] [--rounds 30]
//       [--contexts 512,2048,8192] [--batches 1,8,32]
//       [--heads 16] [--kv_heads 4] [--head_dim 64] [--block_size 16]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include "bench/bench_util.h"
#include "models/causal_lm.h"
#include "models/internal/packed.h"

namespace {

using accel::bench::Median;
using accel::bench::Seconds;
using accel::models::KvBlockStore;
using accel::models::KvCache;
using accel::models::SequenceChunk;
using accel::models::internal::AttendPacked;
using accel::models::internal::ScoreRule;

std::vector<int64_t> ParseList(const char* text) {
  std::vector<int64_t> out;
  for (const char* p = text; *p != '\0';) {
    out.push_back(std::strtoll(p, nullptr, 10));
    const char* comma = std::strchr(p, ',');
    if (comma == nullptr) break;
    p = comma + 1;
  }
  return out;
}

struct Options {
  at::ScalarType dtype = at::kBFloat16;
  int rounds = 30;
  std::vector<int64_t> contexts = {512, 2048, 8192};
  std::vector<int64_t> batches = {1, 8, 32};
  int64_t heads = 16, kv_heads = 4, head_dim = 64, block_size = 16;
};

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--dtype") {
      o.dtype = std::string(value) == "float32" ? at::kFloat : at::kBFloat16;
    } else if (flag == "--rounds") {
      o.rounds = std::atoi(value);
    } else if (flag == "--contexts") {
      o.contexts = ParseList(value);
    } else if (flag == "--batches") {
      o.batches = ParseList(value);
    } else if (flag == "--heads") {
      o.heads = std::atoll(value);
    } else if (flag == "--kv_heads") {
      o.kv_heads = std::atoll(value);
    } else if (flag == "--head_dim") {
      o.head_dim = std::atoll(value);
    } else if (flag == "--block_size") {
      o.block_size = std::atoll(value);
    } else {
      std::fprintf(stderr, "accel-bench-attention: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  c10::InferenceMode inference;
  const int64_t d = o.head_dim, kvh = o.kv_heads;
  const int64_t element = static_cast<int64_t>(c10::elementSize(o.dtype));
  ScoreRule rule;
  rule.scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::printf(
      "decode attention, %s, %lld heads over %lld kv heads of %lld, blocks of %lld, %d "
      "threads; median of %d steps\n",
      c10::toString(o.dtype), static_cast<long long>(o.heads), static_cast<long long>(kvh),
      static_cast<long long>(d), static_cast<long long>(o.block_size), at::get_num_threads(),
      o.rounds);
  std::printf("%8s %6s %12s %12s %12s %12s %12s %8s\n", "context", "batch", "KV MB", "copy GB/s",
              "contig us", "contig GB/s", "paged us", "paged/x");
  std::mt19937 rng(1);
  for (int64_t context : o.contexts) {
    for (int64_t batch : o.batches) {
      const int64_t total = context + 1;
      const double kv_bytes = 2.0 * static_cast<double>(batch * total * kvh * d * element);
      at::Tensor q = at::randn({o.heads, batch, d}).to(o.dtype);
      at::Tensor k = at::randn({kvh, batch, d}).to(o.dtype);
      at::Tensor v = at::randn({kvh, batch, d}).to(o.dtype);
      // Contiguous: each sequence's own buffers, `context` tokens in.
      std::vector<KvCache> contiguous(static_cast<size_t>(batch));
      for (KvCache& cache : contiguous) {
        cache.keys = {at::randn({kvh, total + 16, d}).to(o.dtype)};
        cache.values = {at::randn({kvh, total + 16, d}).to(o.dtype)};
        cache.length = context;
      }
      // Paged: the same lengths in blocks shuffled through one store.
      const int64_t per_sequence = (total + o.block_size - 1) / o.block_size;
      KvBlockStore store(batch * per_sequence, o.block_size, 1);
      auto [key_blocks, value_blocks] = store.Layer(0, k, v);
      key_blocks.normal_();
      value_blocks.normal_();
      std::vector<int32_t> ids(static_cast<size_t>(batch * per_sequence));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      std::vector<KvCache> paged(static_cast<size_t>(batch));
      for (int64_t s = 0; s < batch; ++s) {
        KvCache& cache = paged[static_cast<size_t>(s)];
        cache.store = &store;
        cache.block_table.assign(ids.begin() + s * per_sequence,
                                 ids.begin() + (s + 1) * per_sequence);
        cache.length = context;
      }
      std::vector<SequenceChunk> contiguous_chunks, paged_chunks;
      for (int64_t s = 0; s < batch; ++s) {
        contiguous_chunks.push_back({&contiguous[static_cast<size_t>(s)], 1});
        paged_chunks.push_back({&paged[static_cast<size_t>(s)], 1});
      }
      at::Tensor from = at::randn({static_cast<int64_t>(kv_bytes / 4)});
      at::Tensor to = at::empty_like(from);
      std::vector<double> copy, contig, page;
      for (int r = 0; r < o.rounds + 2; ++r) {
        const double c = Seconds([&] { to.copy_(from); });
        const double a =
            Seconds([&] { AttendPacked(q, k, v, contiguous_chunks, 0, std::nullopt, rule); });
        const double b =
            Seconds([&] { AttendPacked(q, k, v, paged_chunks, 0, std::nullopt, rule); });
        if (r < 2) continue;  // warm-up
        copy.push_back(c);
        contig.push_back(a);
        page.push_back(b);
      }
      const double copy_s = Median(copy), contig_s = Median(contig), paged_s = Median(page);
      // A copy reads and writes the bytes: count both, as STREAM does.
      std::printf("%8lld %6lld %12.1f %12.1f %12.1f %12.1f %12.1f %8.2f\n",
                  static_cast<long long>(context), static_cast<long long>(batch), kv_bytes / 1e6,
                  2 * kv_bytes / copy_s / 1e9, contig_s * 1e6, kv_bytes / contig_s / 1e9,
                  paged_s * 1e6, contig_s / paged_s);
    }
  }
  std::printf(
      "paged/x: the contiguous step's time over the paged one (above 1: paged is faster)\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
