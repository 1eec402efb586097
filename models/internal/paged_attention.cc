#include "models/internal/paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace accel::models::internal {
namespace {

// The three loops decode attention spends its time in, portable and AVX2.
// A float reduction does not vectorise by itself (the compiler keeps the
// order of the additions), so the AVX2 versions are written out.
float DotPortable(const float* a, const float* b, int64_t n) {
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void AxpyPortable(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// s[i] = exp(s[i] - top); returns the sum.
float ExpShiftPortable(float* s, int64_t n, float top) {
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - top));
  return sum;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) float HorizontalSum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

__attribute__((target("avx2,fma"))) float DotAvx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  float sum = HorizontalSum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// exp(x) for x <= 0 (Cephes' expf as avx_mathfun writes it: 2^n times a
// degree-5 polynomial on the remainder; about 1 ulp). Inputs below -87.3
// give 0, as expf does after rounding.
__attribute__((target("avx2,fma"))) __m256 Exp(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.3365f);
  const __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(n));
  return _mm256_andnot_ps(underflow, y);
}

__attribute__((target("avx2,fma"))) float ExpShiftAvx2(float* s, int64_t n, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = HorizontalSum(acc);
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - top));
  return sum;
}

// bfloat16 is float32's upper half: widen and shift.
__attribute__((target("avx2"))) void BFloat16ToFloatAvx2(const c10::BFloat16* in, float* out,
                                                         int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(wide));
  }
  for (; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

bool CpuHasAvx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
bool CpuHasAvx2() { return false; }
#endif

std::atomic<bool> force_portable{false};

// The AVX2 loops, unless the cpu lacks them or a test asked for the portable ones.
bool UseAvx2() { return CpuHasAvx2() && !force_portable.load(); }

// s[i] = exp(s[i] - top); returns the sum.
float ExpShift(float* s, int64_t n, float top, bool avx2) {
#if defined(__x86_64__)
  if (avx2) return ExpShiftAvx2(s, n, top);
#endif
  return ExpShiftPortable(s, n, top);
}

template <typename T>
void ToFloat(const T* in, float* out, int64_t n, bool avx2) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (avx2) {
      BFloat16ToFloatAvx2(in, out, n);
      return;
    }
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
  }
}

// One (sequence, kv head) of decode attention: the `group` query heads that
// share kv head g, against the keys and values in the sequence's blocks.
template <typename T>
struct Item {
  const float* q = nullptr;  // [group, d], scaled
  const T* keys = nullptr;   // the store's key blocks
  const T* values = nullptr;
  absl::Span<const int32_t> table;
  int64_t first = 0, total = 0;  // positions [first, total) are attended
  int64_t block_size = 0, kv_heads = 0, g = 0, group = 0, d = 0, dv = 0;
  std::optional<double> softcap;
  float* scores = nullptr;  // [group, total - first]
  float* rows = nullptr;    // [block_size, max(d, dv)]: one block's rows in float32
  float* acc = nullptr;     // [group, dv]
};

// A block's `rows` rows of kv head g, from `pos` on, as float32 (a pointer
// into the store itself when it holds float32).
template <typename T>
const float* BlockRows(const Item<T>& it, const T* base, int64_t width, int64_t pos, int64_t rows,
                       bool avx2) {
  const int64_t block = it.table[static_cast<size_t>(pos / it.block_size)];
  const T* src =
      base + ((block * it.kv_heads + it.g) * it.block_size + pos % it.block_size) * width;
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    ToFloat(src, it.rows, rows * width, avx2);
    return it.rows;
  }
}

template <typename T>
void Softmax(const Item<T>& it, bool avx2) {
  const int64_t n = it.total - it.first;
  for (int64_t h = 0; h < it.group; ++h) {
    float* s = it.scores + h * n;
    if (it.softcap) {
      const float cap = static_cast<float>(*it.softcap);
      for (int64_t j = 0; j < n; ++j) s[j] = std::tanh(s[j] / cap) * cap;
    }
    const float top = *std::max_element(s, s + n);
    const float inv = 1.0f / ExpShift(s, n, top, avx2);
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
}

template <typename T>
void AttendPortable(const Item<T>& it) {
  const int64_t n = it.total - it.first;
  for (int64_t pos = it.first; pos < it.total;) {
    const int64_t rows = std::min(it.block_size - pos % it.block_size, it.total - pos);
    const float* k = BlockRows(it, it.keys, it.d, pos, rows, false);
    for (int64_t h = 0; h < it.group; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        it.scores[h * n + pos - it.first + r] = DotPortable(it.q + h * it.d, k + r * it.d, it.d);
      }
    }
    pos += rows;
  }
  Softmax(it, false);
  std::fill(it.acc, it.acc + it.group * it.dv, 0.0f);
  for (int64_t pos = it.first; pos < it.total;) {
    const int64_t rows = std::min(it.block_size - pos % it.block_size, it.total - pos);
    const float* v = BlockRows(it, it.values, it.dv, pos, rows, false);
    for (int64_t h = 0; h < it.group; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        AxpyPortable(it.scores[h * n + pos - it.first + r], v + r * it.dv, it.acc + h * it.dv,
                     it.dv);
      }
    }
    pos += rows;
  }
}

#if defined(__x86_64__)
// Eight keys' scores at once: eight accumulators over d, reduced together
// (one horizontal-add tree instead of eight horizontal sums). d % 8 == 0.
__attribute__((target("avx2,fma"))) inline __m256 EightDots(const float* q, const float* k,
                                                            int64_t d) {
  // Named accumulators: an array of them is kept on the stack at -O2.
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 x = _mm256_loadu_ps(q + c);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + c), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + d + c), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * d + c), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * d + c), a3);
    a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * d + c), a4);
    a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * d + c), a5);
    a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * d + c), a6);
    a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * d + c), a7);
  }
  const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// acc[0, 32) += sum over r of p[r] * v[r * stride + (0, 32)]: four
// independent accumulator chains, so the FMAs overlap instead of waiting on
// each other.
__attribute__((target("avx2,fma"))) inline void WeightedRows32(const float* p, const float* v,
                                                               int64_t rows, int64_t stride,
                                                               float* acc) {
  __m256 s0 = _mm256_loadu_ps(acc), s1 = _mm256_loadu_ps(acc + 8);
  __m256 s2 = _mm256_loadu_ps(acc + 16), s3 = _mm256_loadu_ps(acc + 24);
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 w = _mm256_set1_ps(p[r]);
    const float* row = v + r * stride;
    s0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), s0);
    s1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8), s1);
    s2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 16), s2);
    s3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 24), s3);
  }
  _mm256_storeu_ps(acc, s0);
  _mm256_storeu_ps(acc + 8, s1);
  _mm256_storeu_ps(acc + 16, s2);
  _mm256_storeu_ps(acc + 24, s3);
}

// The blocks are scattered, so the hardware prefetcher loses the stream at
// each block boundary: ask for the next block's rows while this one runs.
template <typename T>
__attribute__((target("avx2,fma"))) void PrefetchBlock(const Item<T>& it, const T* base,
                                                       int64_t width, int64_t pos) {
  if (pos >= it.total) return;
  const int64_t block = it.table[static_cast<size_t>(pos / it.block_size)];
  const char* p =
      reinterpret_cast<const char*>(base + ((block * it.kv_heads + it.g) * it.block_size) * width);
  const int64_t bytes = it.block_size * width * static_cast<int64_t>(sizeof(T));
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T0);
}

template <typename T>
__attribute__((target("avx2,fma"))) void AttendAvx2(const Item<T>& it) {
  const int64_t n = it.total - it.first;
  const bool eights = it.d % 8 == 0;
  for (int64_t pos = it.first; pos < it.total;) {
    const int64_t rows = std::min(it.block_size - pos % it.block_size, it.total - pos);
    PrefetchBlock(it, it.keys, it.d, pos + rows);
    const float* k = BlockRows(it, it.keys, it.d, pos, rows, true);
    for (int64_t h = 0; h < it.group; ++h) {
      float* out = it.scores + h * n + pos - it.first;
      const float* q = it.q + h * it.d;
      int64_t r = 0;
      if (eights) {
        for (; r + 8 <= rows; r += 8) _mm256_storeu_ps(out + r, EightDots(q, k + r * it.d, it.d));
      }
      for (; r < rows; ++r) out[r] = DotAvx2(q, k + r * it.d, it.d);
    }
    pos += rows;
  }
  Softmax(it, true);
  std::fill(it.acc, it.acc + it.group * it.dv, 0.0f);
  for (int64_t pos = it.first; pos < it.total;) {
    const int64_t rows = std::min(it.block_size - pos % it.block_size, it.total - pos);
    PrefetchBlock(it, it.values, it.dv, pos + rows);
    const float* v = BlockRows(it, it.values, it.dv, pos, rows, true);
    for (int64_t h = 0; h < it.group; ++h) {
      const float* p = it.scores + h * n + pos - it.first;
      float* acc = it.acc + h * it.dv;
      int64_t c = 0;
      for (; c + 32 <= it.dv; c += 32) WeightedRows32(p, v + c, rows, it.dv, acc + c);
      for (; c + 8 <= it.dv; c += 8) {
        __m256 sum = _mm256_loadu_ps(acc + c);
        for (int64_t r = 0; r < rows; ++r) {
          sum = _mm256_fmadd_ps(_mm256_set1_ps(p[r]), _mm256_loadu_ps(v + r * it.dv + c), sum);
        }
        _mm256_storeu_ps(acc + c, sum);
      }
      for (; c < it.dv; ++c) {
        for (int64_t r = 0; r < rows; ++r) acc[c] += p[r] * v[r * it.dv + c];
      }
    }
    pos += rows;
  }
}
#endif

// A query as Run reads it: [heads, d] contiguous in the blocks' dtype.
struct QueryRow {
  const void* q = nullptr;
  absl::Span<const int32_t> table;
  int64_t total = 0;
};

template <typename T>
void Run(absl::Span<const QueryRow> queries, int64_t heads, const at::Tensor& key_blocks,
         const at::Tensor& value_blocks, std::optional<int64_t> window, const ScoreRule& rule,
         at::Tensor& out) {
  const int64_t kv_heads = key_blocks.size(1), block_size = key_blocks.size(2);
  const int64_t d = key_blocks.size(3), dv = value_blocks.size(3);
  const int64_t group = heads / kv_heads;
  T* result = out.data_ptr<T>();
  const float scale = static_cast<float>(rule.divide ? 1.0 / rule.scale : rule.scale);
  const int64_t items = static_cast<int64_t>(queries.size()) * kv_heads;
  const bool avx2 = UseAvx2();
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(static_cast<size_t>(group * d));
    std::vector<float> rows(static_cast<size_t>(block_size * std::max(d, dv)));
    std::vector<float> acc(static_cast<size_t>(group * dv)), scores;
    for (int64_t index = begin; index < end; ++index) {
      const QueryRow& query = queries[static_cast<size_t>(index / kv_heads)];
      Item<T> it;
      it.g = index % kv_heads;
      it.total = query.total;
      // Keys before `first` are out of the window.
      it.first = window && query.total > *window ? query.total - *window : 0;
      ToFloat(static_cast<const T*>(query.q) + it.g * group * d, q.data(), group * d, avx2);
      for (float& x : q) x *= scale;
      scores.resize(static_cast<size_t>(group * (it.total - it.first)));
      it.q = q.data();
      it.keys = key_blocks.data_ptr<T>();
      it.values = value_blocks.data_ptr<T>();
      it.table = query.table;
      it.block_size = block_size;
      it.kv_heads = kv_heads;
      it.group = group;
      it.d = d;
      it.dv = dv;
      it.softcap = rule.softcap;
      it.scores = scores.data();
      it.rows = rows.data();
      it.acc = acc.data();
#if defined(__x86_64__)
      if (avx2) {
        AttendAvx2(it);
      } else {
        AttendPortable(it);
      }
#else
      AttendPortable(it);
#endif
      T* o = result + (index / kv_heads) * heads * dv + it.g * group * dv;
      for (int64_t i = 0; i < group * dv; ++i) o[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
    }
  });
}

}  // namespace

bool UsePortablePagedAttention(bool portable) {
  force_portable.store(portable);
  return !portable && CpuHasAvx2();
}

namespace {

void CheckBlocks(const at::Tensor& key_blocks, const at::Tensor& value_blocks, int64_t heads) {
  TORCH_CHECK(key_blocks.device().is_cpu() && key_blocks.is_contiguous() &&
                  value_blocks.is_contiguous() && key_blocks.dim() == 4,
              "paged attention: the blocks must be contiguous cpu tensors [blocks, kv_heads, "
              "block_size, d]");
  const int64_t kv_heads = key_blocks.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "paged attention: ", heads, " heads over ", kv_heads,
              " kv heads");
}

void CheckTable(absl::Span<const int32_t> table, int64_t total, const at::Tensor& key_blocks) {
  TORCH_CHECK(total >= 1 && static_cast<int64_t>(table.size()) * key_blocks.size(2) >= total,
              "paged attention: ", total, " positions but the block table holds ", table.size(),
              " blocks");
  for (int32_t block : table) {
    TORCH_CHECK(block >= 0 && block < key_blocks.size(0), "paged attention: block ", block,
                " outside the store's ", key_blocks.size(0));
  }
}

at::Tensor RunQueries(absl::Span<const QueryRow> queries, int64_t heads,
                      const at::Tensor& key_blocks, const at::Tensor& value_blocks,
                      std::optional<int64_t> window, const ScoreRule& rule) {
  at::Tensor out = at::empty({static_cast<int64_t>(queries.size()), heads * value_blocks.size(3)},
                             key_blocks.options());
  switch (key_blocks.scalar_type()) {
    case at::kFloat:
      Run<float>(queries, heads, key_blocks, value_blocks, window, rule, out);
      break;
    case at::kBFloat16:
      Run<c10::BFloat16>(queries, heads, key_blocks, value_blocks, window, rule, out);
      break;
    case at::kHalf:
      Run<c10::Half>(queries, heads, key_blocks, value_blocks, window, rule, out);
      break;
    default:
      TORCH_CHECK(false, "paged attention: unsupported dtype ", key_blocks.scalar_type());
  }
  return out;
}

}  // namespace

at::Tensor PagedDecodeAttention(absl::Span<const PagedQuery> queries, const at::Tensor& key_blocks,
                                const at::Tensor& value_blocks, std::optional<int64_t> window,
                                const ScoreRule& rule) {
  TORCH_CHECK(!queries.empty(), "paged attention: no queries");
  const int64_t heads = queries[0].q.size(0);
  CheckBlocks(key_blocks, value_blocks, heads);
  std::vector<at::Tensor> contiguous;
  std::vector<QueryRow> rows;
  contiguous.reserve(queries.size());
  rows.reserve(queries.size());
  for (const PagedQuery& query : queries) {
    TORCH_CHECK(
        query.q.dim() == 2 && query.q.size(0) == heads && query.q.size(1) == key_blocks.size(3),
        "paged attention: a query is not [heads, head_dim]");
    CheckTable(query.table, query.total, key_blocks);
    contiguous.push_back(query.q.to(key_blocks.scalar_type()).contiguous());
    rows.push_back({contiguous.back().data_ptr(), query.table, query.total});
  }
  return RunQueries(rows, heads, key_blocks, value_blocks, window, rule);
}

at::Tensor PagedDecodeAttentionRows(const at::Tensor& q, absl::Span<const PagedRow> rows,
                                    const at::Tensor& key_blocks, const at::Tensor& value_blocks,
                                    std::optional<int64_t> window, const ScoreRule& rule) {
  TORCH_CHECK(!rows.empty(), "paged attention: no queries");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == key_blocks.size(3),
              "paged attention: q is not [heads, tokens, head_dim]");
  const int64_t heads = q.size(0), tokens = q.size(1), d = q.size(2);
  CheckBlocks(key_blocks, value_blocks, heads);
  // [tokens, heads, d] in the blocks' dtype: one copy for every row.
  const at::Tensor by_token = q.to(key_blocks.scalar_type()).transpose(0, 1).contiguous();
  const auto* base = static_cast<const uint8_t*>(by_token.data_ptr());
  const int64_t row_bytes = heads * d * static_cast<int64_t>(by_token.element_size());
  std::vector<QueryRow> queries;
  queries.reserve(rows.size());
  for (const PagedRow& row : rows) {
    TORCH_CHECK(row.row >= 0 && row.row < tokens, "paged attention: query row ", row.row,
                " outside q's ", tokens);
    CheckTable(row.table, row.total, key_blocks);
    queries.push_back({base + row.row * row_bytes, row.table, row.total});
  }
  return RunQueries(queries, heads, key_blocks, value_blocks, window, rule);
}

}  // namespace accel::models::internal
