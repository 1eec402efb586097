// Test data and a plain reference for the paged decode attention kernels
// (models/cuda/attention_kernels.h), shared by the host emulation test
// (cuda_paged_decode_test.cc) and the device test
// (cuda_attention_kernels_test.cc). Torch-free.
//
// Each sequence's keys and values are made dense first ([kv_heads, total,
// dim], what the reference reads) and then scattered into shuffled blocks
// of a store that also holds blocks no table lists, filled with large
// values, so reading a wrong block shows. The reference computes in double
// from the stored (rounded) values: scores q.k * scale, the soft-cap, the
// softmax over the window, the weighted sum.
#ifndef ACCEL_TESTS_MODELS_PAGED_DECODE_REFERENCE_H_
#define ACCEL_TESTS_MODELS_PAGED_DECODE_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "models/cuda/internal/paged_decode.h"
#include "models/cuda/paged_decode_params.h"

namespace accel::models::testing {

using cuda::KvDType;

struct DecodeCase {
  std::string name;
  KvDType dtype = KvDType::kBFloat16;
  int32_t heads = 8, kv_heads = 2, head_dim = 64, value_dim = 64, block_size = 16;
  int32_t window = 0;
  float softcap = 0.0f;
  std::vector<int32_t> totals;  // per sequence: past + this token
  int32_t partition = 0;        // 0: ChoosePagedPartition (without the occupancy rule)
};

// gtest prints a case by its name (not its bytes, which hold pointers).
inline void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name; }

inline const char* KvDTypeName(KvDType dtype) {
  switch (dtype) {
    case KvDType::kFloat32:
      return "float32";
    case KvDType::kBFloat16:
      return "bfloat16";
    case KvDType::kFloat16:
      return "float16";
  }
  return "?";
}

// Storage <-> float through the kernels' own exact conversions (checked
// against known bit patterns in cuda_paged_decode_test.cc).
inline void StoreValue(KvDType dtype, std::vector<uint8_t>& bytes, size_t i, float v) {
  namespace in = cuda::internal;
  if (dtype == KvDType::kFloat32) {
    std::memcpy(&bytes[4 * i], &v, 4);
    return;
  }
  const uint16_t bits = dtype == KvDType::kBFloat16 ? in::FromFloat(in::BFloat16{}, v)
                                                    : in::FromFloat(in::Float16{}, v);
  std::memcpy(&bytes[2 * i], &bits, 2);
}

inline double LoadValue(KvDType dtype, const std::vector<uint8_t>& bytes, size_t i) {
  namespace in = cuda::internal;
  if (dtype == KvDType::kFloat32) {
    float v;
    std::memcpy(&v, &bytes[4 * i], 4);
    return v;
  }
  uint16_t bits;
  std::memcpy(&bits, &bytes[2 * i], 2);
  return dtype == KvDType::kBFloat16 ? in::ToFloat(in::BFloat16{}, bits)
                                     : in::ToFloat(in::Float16{}, bits);
}

struct DecodeProblem {
  DecodeCase c;
  int32_t seqs = 0, table_stride = 0, partition = 0, max_splits = 1;
  int64_t num_blocks = 0;
  float scale = 1.0f;
  std::vector<uint8_t> q, keys, values;  // storage bytes
  std::vector<int32_t> tables, totals;
  // Dense per sequence: [kv_heads, total, dim] as stored, in double.
  std::vector<std::vector<double>> dense_keys, dense_values;

  int32_t elem() const { return cuda::KvDTypeSize(c.dtype); }
  size_t out_elements() const {
    return static_cast<size_t>(seqs) * static_cast<size_t>(c.heads * c.value_dim);
  }

  // The kernel's parameters over the given buffers (host or device).
  cuda::PagedDecodeParams Params(const void* q_ptr, const void* key_ptr, const void* value_ptr,
                                 const int32_t* table_ptr, const int32_t* total_ptr, void* out_ptr,
                                 float* workspace) const {
    cuda::PagedDecodeParams p;
    p.q = q_ptr;
    p.key_blocks = key_ptr;
    p.value_blocks = value_ptr;
    p.block_tables = table_ptr;
    p.totals = total_ptr;
    p.out = out_ptr;
    p.workspace = workspace;
    p.num_blocks = num_blocks;
    p.seqs = seqs;
    p.heads = c.heads;
    p.kv_heads = c.kv_heads;
    p.block_size = c.block_size;
    p.head_dim = c.head_dim;
    p.value_dim = c.value_dim;
    p.table_stride = table_stride;
    p.window = c.window;
    p.partition = partition;
    p.max_splits = max_splits;
    p.scale = scale;
    p.softcap = c.softcap;
    return p;
  }
};

inline DecodeProblem MakeDecodeProblem(const DecodeCase& c, uint64_t seed) {
  DecodeProblem pr;
  pr.c = c;
  pr.seqs = static_cast<int32_t>(c.totals.size());
  pr.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t elem = static_cast<size_t>(cuda::KvDTypeSize(c.dtype));
  const int32_t max_total = *std::max_element(c.totals.begin(), c.totals.end());
  pr.partition = c.partition > 0
                     ? c.partition
                     : cuda::ChoosePagedPartition(pr.seqs, c.heads, c.kv_heads, c.head_dim,
                                                  c.value_dim, max_total, c.window, c.dtype, 0);
  for (int32_t total : c.totals) {
    pr.max_splits = std::max(pr.max_splits, cuda::PagedDecodeSplits(total, c.window, pr.partition));
  }
  // Blocks: every sequence's, plus three no table lists (the last one pads
  // the tables past each sequence's blocks).
  int32_t used = 0, widest = 0;
  for (int32_t total : c.totals) {
    const int32_t blocks = (total + c.block_size - 1) / c.block_size;
    used += blocks;
    widest = std::max(widest, blocks);
  }
  pr.num_blocks = used + 3;
  pr.table_stride = widest + 1;
  std::vector<int32_t> free_blocks(static_cast<size_t>(pr.num_blocks));
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
  const int32_t unused = free_blocks.back();
  const auto block_elems = [&](int32_t dim) {
    return static_cast<size_t>(pr.num_blocks) * static_cast<size_t>(c.kv_heads) *
           static_cast<size_t>(c.block_size) * static_cast<size_t>(dim);
  };
  pr.keys.assign(block_elems(c.head_dim) * elem, 0);
  pr.values.assign(block_elems(c.value_dim) * elem, 0);
  for (size_t i = 0; i < block_elems(c.head_dim); ++i) StoreValue(c.dtype, pr.keys, i, 1000.0f);
  for (size_t i = 0; i < block_elems(c.value_dim); ++i) {
    StoreValue(c.dtype, pr.values, i, 1000.0f);
  }
  pr.tables.assign(static_cast<size_t>(pr.seqs) * static_cast<size_t>(pr.table_stride), unused);
  pr.totals = c.totals;
  pr.q.assign(
      pr.out_elements() / static_cast<size_t>(c.value_dim) * static_cast<size_t>(c.head_dim) * elem,
      0);
  for (size_t i = 0; i < pr.q.size() / elem; ++i) StoreValue(c.dtype, pr.q, i, normal(rng));
  size_t next_free = 0;
  for (int32_t s = 0; s < pr.seqs; ++s) {
    const int32_t total = c.totals[static_cast<size_t>(s)];
    int32_t* table = &pr.tables[static_cast<size_t>(s) * static_cast<size_t>(pr.table_stride)];
    for (int32_t b = 0; b * c.block_size < total; ++b) table[b] = free_blocks[next_free++];
    for (int pass = 0; pass < 2; ++pass) {
      const int32_t dim = pass == 0 ? c.head_dim : c.value_dim;
      std::vector<uint8_t>& store = pass == 0 ? pr.keys : pr.values;
      std::vector<double> dense(static_cast<size_t>(c.kv_heads) * static_cast<size_t>(total) *
                                static_cast<size_t>(dim));
      for (int32_t g = 0; g < c.kv_heads; ++g) {
        for (int32_t j = 0; j < total; ++j) {
          const int32_t block = table[j / c.block_size];
          const size_t row = ((static_cast<size_t>(block) * static_cast<size_t>(c.kv_heads) +
                               static_cast<size_t>(g)) *
                                  static_cast<size_t>(c.block_size) +
                              static_cast<size_t>(j % c.block_size)) *
                             static_cast<size_t>(dim);
          for (int32_t e = 0; e < dim; ++e) {
            StoreValue(c.dtype, store, row + static_cast<size_t>(e), normal(rng));
            dense[(static_cast<size_t>(g) * static_cast<size_t>(total) + static_cast<size_t>(j)) *
                      static_cast<size_t>(dim) +
                  static_cast<size_t>(e)] = LoadValue(c.dtype, store, row + static_cast<size_t>(e));
          }
        }
      }
      (pass == 0 ? pr.dense_keys : pr.dense_values).push_back(std::move(dense));
    }
  }
  return pr;
}

// [seqs, heads, value_dim] in double.
inline std::vector<double> ReferenceDecode(const DecodeProblem& pr) {
  const DecodeCase& c = pr.c;
  const int32_t group = c.heads / c.kv_heads;
  std::vector<double> out(pr.out_elements());
  for (int32_t s = 0; s < pr.seqs; ++s) {
    const int32_t total = c.totals[static_cast<size_t>(s)];
    const int32_t first = c.window > 0 && total > c.window ? total - c.window : 0;
    const std::vector<double>& k = pr.dense_keys[static_cast<size_t>(s)];
    const std::vector<double>& v = pr.dense_values[static_cast<size_t>(s)];
    for (int32_t h = 0; h < c.heads; ++h) {
      const int32_t g = h / group;
      std::vector<double> scores;
      for (int32_t j = first; j < total; ++j) {
        double dot = 0;
        for (int32_t e = 0; e < c.head_dim; ++e) {
          const double qv = LoadValue(
              c.dtype, pr.q,
              (static_cast<size_t>(s) * static_cast<size_t>(c.heads) + static_cast<size_t>(h)) *
                      static_cast<size_t>(c.head_dim) +
                  static_cast<size_t>(e));
          dot += qv * static_cast<double>(pr.scale) *
                 k[(static_cast<size_t>(g) * static_cast<size_t>(total) + static_cast<size_t>(j)) *
                       static_cast<size_t>(c.head_dim) +
                   static_cast<size_t>(e)];
        }
        if (c.softcap > 0) dot = std::tanh(dot / c.softcap) * c.softcap;
        scores.push_back(dot);
      }
      const double top = *std::max_element(scores.begin(), scores.end());
      double sum = 0;
      for (double& x : scores) sum += (x = std::exp(x - top));
      for (int32_t e = 0; e < c.value_dim; ++e) {
        double acc = 0;
        for (int32_t j = first; j < total; ++j) {
          acc += scores[static_cast<size_t>(j - first)] / sum *
                 v[(static_cast<size_t>(g) * static_cast<size_t>(total) + static_cast<size_t>(j)) *
                       static_cast<size_t>(c.value_dim) +
                   static_cast<size_t>(e)];
        }
        out[(static_cast<size_t>(s) * static_cast<size_t>(c.heads) + static_cast<size_t>(h)) *
                static_cast<size_t>(c.value_dim) +
            static_cast<size_t>(e)] = acc;
      }
    }
  }
  return out;
}

// Differences from the reference beyond float32 sums and one rounding to
// the storage type; returns how many, describing the first few in `what`.
inline int64_t CompareDecode(const DecodeProblem& pr, const std::vector<uint8_t>& out,
                             std::string* what) {
  const std::vector<double> want = ReferenceDecode(pr);
  const double u_out = pr.c.dtype == KvDType::kBFloat16  ? std::ldexp(1.0, -8)
                       : pr.c.dtype == KvDType::kFloat16 ? std::ldexp(1.0, -10)
                                                         : 0.0;
  int64_t failures = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double got = LoadValue(pr.c.dtype, out, i);
    // Values are N(0, 1): float32 sums of the scores and the weighted sum
    // stay far inside 1e-4; a wrong block or split is off by O(1).
    const double bound = u_out * std::fabs(want[i]) + 1e-4;
    if (!(std::fabs(got - want[i]) <= bound) && ++failures <= 5) {
      const size_t per_seq = static_cast<size_t>(pr.c.heads * pr.c.value_dim);
      *what += "seq " + std::to_string(i / per_seq) + " head " +
               std::to_string(i % per_seq / static_cast<size_t>(pr.c.value_dim)) + " col " +
               std::to_string(i % static_cast<size_t>(pr.c.value_dim)) + ": got " +
               std::to_string(got) + ", want " + std::to_string(want[i]) + "\n";
    }
  }
  return failures;
}

}  // namespace accel::models::testing

#endif  // ACCEL_TESTS_MODELS_PAGED_DECODE_REFERENCE_H_
