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

__attribute__((target("avx2,fma"))) void AxpyAvx2(float alpha, const float* x, float* y,
                                                  int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
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

struct Kernels {
  float (*dot)(const float*, const float*, int64_t) = DotPortable;
  void (*axpy)(float, const float*, float*, int64_t) = AxpyPortable;
  float (*exp_shift)(float*, int64_t, float) = ExpShiftPortable;
  bool avx2 = false;
};

Kernels PickKernels() {
  Kernels k;
#if defined(__x86_64__)
  if (CpuHasAvx2() && !force_portable.load()) {
    k.dot = DotAvx2;
    k.axpy = AxpyAvx2;
    k.exp_shift = ExpShiftAvx2;
    k.avx2 = true;
  }
#endif
  return k;
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
  const Kernels kernels = PickKernels();
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(static_cast<size_t>(group * d)), row(static_cast<size_t>(std::max(d, dv)));
    std::vector<float> acc(static_cast<size_t>(group * dv)), scores;
    for (int64_t item = begin; item < end; ++item) {
      const PagedQuery& query = queries[static_cast<size_t>(item / kv_heads)];
      const int64_t g = item % kv_heads, total = query.total;
      const int64_t first =
          window && total > *window ? total - *window : 0;  // keys before it are out of the window
      const T* qs = query.q.data_ptr<T>() + g * group * d;
      ToFloat(qs, q.data(), group * d, kernels.avx2);
      scores.assign(static_cast<size_t>(group * (total - first)), 0.0f);
      const int64_t n = total - first;
      for (int64_t j = first; j < total; ++j) {
        const int64_t block = query.table[static_cast<size_t>(j / block_size)];
        const T* k = keys + ((block * kv_heads + g) * block_size + j % block_size) * d;
        ToFloat(k, row.data(), d, kernels.avx2);
        for (int64_t h = 0; h < group; ++h) {
          float s = kernels.dot(q.data() + h * d, row.data(), d) * scale;
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
        const float sum = kernels.exp_shift(s, n, top);
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; ++j) s[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = first; j < total; ++j) {
        const int64_t block = query.table[static_cast<size_t>(j / block_size)];
        const T* v = values + ((block * kv_heads + g) * block_size + j % block_size) * dv;
        ToFloat(v, row.data(), dv, kernels.avx2);
        for (int64_t h = 0; h < group; ++h) {
          kernels.axpy(scores[static_cast<size_t>(h * n + (j - first))], row.data(),
                       acc.data() + h * dv, dv);
        }
      }
      T* o = result + (item / kv_heads) * heads * dv + g * group * dv;
      for (int64_t i = 0; i < group * dv; ++i) o[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
    }
  });
}

}  // namespace

bool UsePortablePagedAttention(bool portable) {
  force_portable.store(portable);
  return !portable && CpuHasAvx2();
}

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
