#include "models/internal/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace accel::models::internal {
namespace {

// Compiled for the widest vector unit the cpu has (ifunc at load time):
// these two loops are where decode attention spends its time.
__attribute__((target_clones("avx512f", "avx2", "default"))) float Dot(const float* a,
                                                                       const float* b, int64_t n) {
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void Axpy(float alpha, const float* x,
                                                                       float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <typename T>
void ToFloat(const T* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

template <typename T>
void Run(absl::Span<const PagedQuery> queries, const at::Tensor& key_blocks,
         const at::Tensor& value_blocks, std::optional<int64_t> window, const ScoreRule& rule,
         at::Tensor& out) {
  const int64_t kv_heads = key_blocks.size(1), block_size = key_blocks.size(2);
  const int64_t d = key_blocks.size(3), dv = value_blocks.size(3);
  const int64_t heads = queries[0].q.size(0), group = heads / kv_heads;
  const T* keys = key_blocks.data_ptr<T>();
  const T* values = value_blocks.data_ptr<T>();
  T* result = out.data_ptr<T>();
  const float scale = static_cast<float>(rule.divide ? 1.0 / rule.scale : rule.scale);
  const int64_t items = static_cast<int64_t>(queries.size()) * kv_heads;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(static_cast<size_t>(group * d)), row(static_cast<size_t>(std::max(d, dv)));
    std::vector<float> acc(static_cast<size_t>(group * dv)), scores;
    for (int64_t item = begin; item < end; ++item) {
      const PagedQuery& query = queries[static_cast<size_t>(item / kv_heads)];
      const int64_t g = item % kv_heads, total = query.total;
      const int64_t first =
          window && total > *window ? total - *window : 0;  // keys before it are out of the window
      const T* qs = query.q.data_ptr<T>() + g * group * d;
      ToFloat(qs, q.data(), group * d);
      scores.assign(static_cast<size_t>(group * (total - first)), 0.0f);
      const int64_t n = total - first;
      for (int64_t j = first; j < total; ++j) {
        const int64_t block = query.table[static_cast<size_t>(j / block_size)];
        const T* k = keys + ((block * kv_heads + g) * block_size + j % block_size) * d;
        ToFloat(k, row.data(), d);
        for (int64_t h = 0; h < group; ++h) {
          float s = Dot(q.data() + h * d, row.data(), d) * scale;
          if (rule.softcap) {
            const float cap = static_cast<float>(*rule.softcap);
            s = std::tanh(s / cap) * cap;
          }
          scores[static_cast<size_t>(h * n + (j - first))] = s;
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * n;
        const float top = *std::max_element(s, s + n);
        float sum = 0;
        for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - top));
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; ++j) s[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = first; j < total; ++j) {
        const int64_t block = query.table[static_cast<size_t>(j / block_size)];
        const T* v = values + ((block * kv_heads + g) * block_size + j % block_size) * dv;
        ToFloat(v, row.data(), dv);
        for (int64_t h = 0; h < group; ++h) {
          Axpy(scores[static_cast<size_t>(h * n + (j - first))], row.data(), acc.data() + h * dv,
               dv);
        }
      }
      T* o = result + (item / kv_heads) * heads * dv + g * group * dv;
      for (int64_t i = 0; i < group * dv; ++i) o[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
    }
  });
}

}  // namespace

at::Tensor PagedDecodeAttention(absl::Span<const PagedQuery> queries, const at::Tensor& key_blocks,
                                const at::Tensor& value_blocks, std::optional<int64_t> window,
                                const ScoreRule& rule) {
  TORCH_CHECK(!queries.empty(), "paged attention: no queries");
  TORCH_CHECK(key_blocks.device().is_cpu() && key_blocks.is_contiguous() &&
                  value_blocks.is_contiguous() && key_blocks.dim() == 4,
              "paged attention: the blocks must be contiguous cpu tensors [blocks, kv_heads, "
              "block_size, d]");
  const int64_t heads = queries[0].q.size(0), kv_heads = key_blocks.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "paged attention: ", heads, " heads over ", kv_heads,
              " kv heads");
  std::vector<PagedQuery> contiguous(queries.begin(), queries.end());
  for (PagedQuery& query : contiguous) {
    TORCH_CHECK(
        query.q.dim() == 2 && query.q.size(0) == heads && query.q.size(1) == key_blocks.size(3),
        "paged attention: a query is not [heads, head_dim]");
    TORCH_CHECK(query.total >= 1 &&
                    static_cast<int64_t>(query.table.size()) * key_blocks.size(2) >= query.total,
                "paged attention: ", query.total, " positions but the block table holds ",
                query.table.size(), " blocks");
    for (int32_t block : query.table) {
      TORCH_CHECK(block >= 0 && block < key_blocks.size(0), "paged attention: block ", block,
                  " outside the store's ", key_blocks.size(0));
    }
    query.q = query.q.to(key_blocks.scalar_type()).contiguous();
  }
  at::Tensor out = at::empty({static_cast<int64_t>(queries.size()), heads * value_blocks.size(3)},
                             key_blocks.options());
  switch (key_blocks.scalar_type()) {
    case at::kFloat:
      Run<float>(contiguous, key_blocks, value_blocks, window, rule, out);
      break;
    case at::kBFloat16:
      Run<c10::BFloat16>(contiguous, key_blocks, value_blocks, window, rule, out);
      break;
    case at::kHalf:
      Run<c10::Half>(contiguous, key_blocks, value_blocks, window, rule, out);
      break;
    default:
      TORCH_CHECK(false, "paged attention: unsupported dtype ", key_blocks.scalar_type());
  }
  return out;
}

}  // namespace accel::models::internal
