// PagedDecodeAttentionCuda (paged_attention.h): the plan on the host, then
// models/cuda's kernels on libtorch's current stream. The kernels are called
// only where they are built and libtorch is a CUDA build
// (ACCEL_WITH_MODELS_CUDA, set by models/CMakeLists.txt); elsewhere the plan
// is all there is, and the call is refused.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "models/internal/cuda_dtype.h"
#include "models/internal/device_upload.h"
#include "models/internal/paged_attention.h"

#ifdef ACCEL_WITH_MODELS_CUDA
#include <cuda_runtime_api.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/cuda/attention_kernels.h"
#endif

namespace accel::models::internal {
namespace {

// The kernels' shapes from the blocks' and the window, scale and soft-cap
// as the cpu kernel applies them: a window as long as the longest context
// masks nothing; q times a float32 factor (the reciprocal of a divisor).
void SetShapeAndRule(const at::Tensor& key_blocks, const at::Tensor& value_blocks, int64_t seqs,
                     int64_t heads, int64_t table_stride, int64_t max_total,
                     std::optional<int64_t> window, const ScoreRule& rule,
                     cuda::PagedDecodeParams* p) {
  p->num_blocks = key_blocks.size(0);
  p->seqs = static_cast<int32_t>(seqs);
  p->heads = static_cast<int32_t>(heads);
  p->kv_heads = static_cast<int32_t>(key_blocks.size(1));
  p->block_size = static_cast<int32_t>(key_blocks.size(2));
  p->head_dim = static_cast<int32_t>(key_blocks.size(3));
  p->value_dim = static_cast<int32_t>(value_blocks.size(3));
  p->table_stride = static_cast<int32_t>(table_stride);
  p->window =
      window && *window < max_total ? static_cast<int32_t>(std::max<int64_t>(1, *window)) : 0;
  p->scale = static_cast<float>(rule.divide ? 1.0 / rule.scale : rule.scale);
  p->softcap = rule.softcap ? static_cast<float>(*rule.softcap) : 0.0f;
}

#ifdef ACCEL_WITH_MODELS_CUDA

int32_t SmCount(int device) {
  static int32_t counts[64] = {};
  if (device < 0 || device >= 64) return 0;
  if (counts[device] == 0) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    counts[device] = count;
  }
  return counts[device];
}

// The block tables and totals on the device: once a step (LastUpload).
at::Tensor DeviceTables(const std::vector<int32_t>& host, const at::Device& device) {
  thread_local LastUpload<int32_t> tables;
  return tables.To(host, at::kInt, device);
}

// The output rows of `p`'s step and the float workspace its split passes
// reduce through (none when it does not split), both in `p` from now on.
at::Tensor AllocateOutputs(cuda::PagedDecodeParams& p, const at::Tensor& key_blocks,
                           at::Tensor* workspace) {
  at::Tensor out =
      at::empty({p.seqs, static_cast<int64_t>(p.heads) * p.value_dim}, key_blocks.options());
  const int64_t workspace_floats =
      cuda::PagedDecodeWorkspaceFloats(p.seqs, p.heads, p.value_dim, p.max_splits);
  if (workspace_floats > 0) {
    *workspace = at::empty({workspace_floats}, key_blocks.options().dtype(at::kFloat));
  }
  p.out = out.data_ptr();
  p.workspace = workspace->defined() ? workspace->data_ptr<float>() : nullptr;
  return out;
}

#endif  // ACCEL_WITH_MODELS_CUDA

}  // namespace

bool PagedAttentionCudaBuilt() {
#ifdef ACCEL_WITH_MODELS_CUDA
  return true;
#else
  return false;
#endif
}

bool PagedCudaTakes(const at::Tensor& key_blocks, const at::Tensor& value_blocks, int64_t heads) {
  cuda::KvDType dtype;
  if (!PagedAttentionCudaBuilt() || !key_blocks.defined() || !value_blocks.defined() ||
      !key_blocks.is_cuda() || value_blocks.device() != key_blocks.device() ||
      key_blocks.dim() != 4 || value_blocks.dim() != 4 ||
      value_blocks.scalar_type() != key_blocks.scalar_type() ||
      !KvDTypeOf(key_blocks.scalar_type(), &dtype) || !key_blocks.is_contiguous() ||
      !value_blocks.is_contiguous()) {
    return false;
  }
  const int64_t kv_heads = key_blocks.size(1), d = key_blocks.size(3), dv = value_blocks.size(3);
  if (kv_heads < 1 || heads % kv_heads != 0 || heads > std::numeric_limits<int32_t>::max()) {
    return false;
  }
  if (d % 8 != 0 || dv % 8 != 0 || d < 8 || dv < 8 || d > cuda::kMaxHeadDim ||
      dv > cuda::kMaxHeadDim) {
    return false;
  }
  if (reinterpret_cast<uintptr_t>(key_blocks.data_ptr()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(value_blocks.data_ptr()) % 16 != 0) {
    return false;
  }
  const cuda::DecodeLayout smallest =
      cuda::MakeDecodeLayout(static_cast<int32_t>(heads), static_cast<int32_t>(kv_heads),
                             static_cast<int32_t>(d), static_cast<int32_t>(dv), cuda::kMinPartition,
                             cuda::KvDTypeSize(dtype), cuda::kDecodeThreads);
  return smallest.total_floats * static_cast<int64_t>(sizeof(float)) <= cuda::kDecodeSharedLimit;
}

PagedCudaPlan PlanPagedDecodeCuda(absl::Span<const PagedQuery> queries,
                                  const at::Tensor& key_blocks, const at::Tensor& value_blocks,
                                  std::optional<int64_t> window, const ScoreRule& rule,
                                  int32_t sm_count, int32_t partition) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(!queries.empty(), "paged attention (CUDA): no queries");
  TORCH_CHECK(key_blocks.dim() == 4 && value_blocks.dim() == 4 &&
                  value_blocks.size(0) == key_blocks.size(0) &&
                  value_blocks.size(1) == key_blocks.size(1) &&
                  value_blocks.size(2) == key_blocks.size(2),
              "paged attention (CUDA): the blocks must be [blocks, kv_heads, block_size, d]");
  PagedCudaPlan plan;
  TORCH_CHECK(value_blocks.scalar_type() == key_blocks.scalar_type() &&
                  KvDTypeOf(key_blocks.scalar_type(), &plan.dtype),
              "paged attention (CUDA): unsupported dtype ", key_blocks.scalar_type());
  const int64_t num_blocks = key_blocks.size(0), kv_heads = key_blocks.size(1);
  const int64_t block_size = key_blocks.size(2);
  const int64_t heads = queries[0].q.size(0);
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "paged attention (CUDA): ", heads,
              " heads over ", kv_heads, " kv heads");
  TORCH_CHECK(queries.size() <= 65535 && heads <= kInt32Max && block_size <= kInt32Max,
              "paged attention (CUDA): ", queries.size(), " queries of ", heads,
              " heads, blocks of ", block_size, ": out of the kernels' range");
  int64_t max_total = 0, stride = 1;
  for (const PagedQuery& query : queries) {
    TORCH_CHECK(
        query.q.dim() == 2 && query.q.size(0) == heads && query.q.size(1) == key_blocks.size(3),
        "paged attention (CUDA): a query is not [heads, head_dim]");
    TORCH_CHECK(query.total >= 1 && query.total <= kInt32Max &&
                    static_cast<int64_t>(query.table.size()) * block_size >= query.total,
                "paged attention (CUDA): ", query.total, " positions but the block table holds ",
                query.table.size(), " blocks");
    max_total = std::max(max_total, query.total);
    stride = std::max(stride, (query.total + block_size - 1) / block_size);
  }
  const size_t seqs = queries.size();
  plan.tables_and_totals.assign(seqs * static_cast<size_t>(stride) + seqs, 0);
  for (size_t s = 0; s < seqs; ++s) {
    const PagedQuery& query = queries[s];
    const int64_t used = (query.total + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = query.table[static_cast<size_t>(b)];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged attention (CUDA): block ", block,
                  " outside the store's ", num_blocks);
      plan.tables_and_totals[s * static_cast<size_t>(stride) + static_cast<size_t>(b)] = block;
    }
    plan.tables_and_totals[seqs * static_cast<size_t>(stride) + s] =
        static_cast<int32_t>(query.total);
  }
  cuda::PagedDecodeParams& p = plan.params;
  SetShapeAndRule(key_blocks, value_blocks, static_cast<int64_t>(seqs), heads, stride, max_total,
                  window, rule, &p);
  p.partition = partition > 0
                    ? partition
                    : cuda::ChoosePagedPartition(p.seqs, p.heads, p.kv_heads, p.head_dim,
                                                 p.value_dim, static_cast<int32_t>(max_total),
                                                 p.window, plan.dtype, sm_count);
  p.max_splits = 1;
  for (const PagedQuery& query : queries) {
    p.max_splits = std::max(p.max_splits, cuda::PagedDecodeSplits(static_cast<int32_t>(query.total),
                                                                  p.window, p.partition));
  }
  return plan;
}

at::Tensor PagedDecodeAttentionCuda(absl::Span<const PagedQuery> queries,
                                    const at::Tensor& key_blocks, const at::Tensor& value_blocks,
                                    std::optional<int64_t> window, const ScoreRule& rule,
                                    int32_t partition) {
#ifndef ACCEL_WITH_MODELS_CUDA
  (void)queries;
  (void)key_blocks;
  (void)value_blocks;
  (void)window;
  (void)rule;
  (void)partition;
  TORCH_CHECK(false,
              "paged attention (CUDA): the kernels are not in this build (models/cuda/ needs "
              "nvcc and a CUDA libtorch)");
  return at::Tensor();
#else
  TORCH_CHECK(key_blocks.is_cuda() && value_blocks.device() == key_blocks.device(),
              "paged attention (CUDA): the blocks must be on one CUDA device, got ",
              key_blocks.device().str(), " and ", value_blocks.device().str());
  TORCH_CHECK(key_blocks.is_contiguous() && value_blocks.is_contiguous(),
              "paged attention (CUDA): the blocks must be contiguous");
  const at::Device device = key_blocks.device();
  c10::cuda::CUDAGuard guard(device);
  PagedCudaPlan plan = PlanPagedDecodeCuda(queries, key_blocks, value_blocks, window, rule,
                                           SmCount(device.index()), partition);
  cuda::PagedDecodeParams& p = plan.params;
  std::vector<at::Tensor> rows;
  rows.reserve(queries.size());
  for (const PagedQuery& query : queries) rows.push_back(query.q.to(device));
  const at::Tensor q = at::stack(rows).to(key_blocks.scalar_type()).contiguous();
  const at::Tensor meta = DeviceTables(plan.tables_and_totals, device);
  at::Tensor workspace;
  const at::Tensor out = AllocateOutputs(p, key_blocks, &workspace);
  p.q = q.data_ptr();
  p.key_blocks = key_blocks.data_ptr();
  p.value_blocks = value_blocks.data_ptr();
  p.block_tables = meta.data_ptr<int32_t>();
  p.totals = p.block_tables + static_cast<int64_t>(p.seqs) * p.table_stride;
  const char* refused = cuda::CheckPagedDecodeParams(p, plan.dtype);
  TORCH_CHECK(refused == nullptr, "paged attention (CUDA): ", refused);
  const cudaError_t status = cuda::PagedDecodeAttention(
      p, plan.dtype, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(status == cudaSuccess, "paged attention (CUDA): ", cudaGetErrorName(status), " (",
              cudaGetErrorString(status), ")");
  return out;
#endif
}

PagedCudaPlan PlanPagedDecodeCudaStatic(const at::Tensor& q, const at::Tensor& key_blocks,
                                        const at::Tensor& value_blocks, int64_t table_stride,
                                        int64_t max_total, std::optional<int64_t> window,
                                        const ScoreRule& rule, int32_t sm_count) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(q.dim() == 3 && key_blocks.dim() == 4 && value_blocks.dim() == 4 &&
                  q.size(2) == key_blocks.size(3) && q.size(0) <= 65535 &&
                  table_stride * key_blocks.size(2) >= max_total && max_total >= 1 &&
                  max_total <= kInt32Max,
              "paged attention (CUDA, static): q [rows, heads, d] over blocks [blocks, kv_heads, "
              "block_size, d], tables of ",
              table_stride, " blocks for ", max_total, " positions");
  PagedCudaPlan plan;
  TORCH_CHECK(value_blocks.scalar_type() == key_blocks.scalar_type() &&
                  KvDTypeOf(key_blocks.scalar_type(), &plan.dtype),
              "paged attention (CUDA, static): unsupported dtype ", key_blocks.scalar_type());
  // As PlanPagedDecodeCuda, with max_total for the longest row; the most
  // splits any row up to max_total long can have (a row's splits past its
  // own are empty: the kernels skip them).
  cuda::PagedDecodeParams& p = plan.params;
  SetShapeAndRule(key_blocks, value_blocks, q.size(0), q.size(1), table_stride, max_total, window,
                  rule, &p);
  p.partition =
      cuda::ChoosePagedPartition(p.seqs, p.heads, p.kv_heads, p.head_dim, p.value_dim,
                                 static_cast<int32_t>(max_total), p.window, plan.dtype, sm_count);
  p.max_splits = cuda::PagedDecodeMaxSplits(static_cast<int32_t>(max_total), p.window, p.partition);
  return plan;
}

at::Tensor PagedDecodeAttentionCudaStatic(const at::Tensor& q, const at::Tensor& key_blocks,
                                          const at::Tensor& value_blocks,
                                          const at::Tensor& block_tables, const at::Tensor& totals,
                                          int64_t max_total, std::optional<int64_t> window,
                                          const ScoreRule& rule) {
#ifndef ACCEL_WITH_MODELS_CUDA
  (void)q;
  (void)key_blocks;
  (void)value_blocks;
  (void)block_tables;
  (void)totals;
  (void)max_total;
  (void)window;
  (void)rule;
  TORCH_CHECK(false,
              "paged attention (CUDA): the kernels are not in this build (models/cuda/ needs "
              "nvcc and a CUDA libtorch)");
  return at::Tensor();
#else
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(key_blocks.is_cuda() && value_blocks.device() == key_blocks.device() &&
                  q.device() == key_blocks.device() &&
                  block_tables.device() == key_blocks.device() &&
                  totals.device() == key_blocks.device(),
              "paged attention (CUDA, static): q, the blocks, tables and totals must be on one "
              "CUDA device");
  TORCH_CHECK(key_blocks.is_contiguous() && value_blocks.is_contiguous() && key_blocks.dim() == 4 &&
                  value_blocks.dim() == 4,
              "paged attention (CUDA, static): the blocks must be contiguous [blocks, kv_heads, "
              "block_size, d]");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == key_blocks.size(3) && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0) && totals.dim() == 1 &&
                  totals.size(0) == q.size(0) && block_tables.scalar_type() == at::kInt &&
                  totals.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  totals.is_contiguous(),
              "paged attention (CUDA, static): q [rows, heads, d], block_tables [rows, blocks] "
              "and totals [rows], int32 and contiguous");
  TORCH_CHECK(max_total >= 1 && max_total <= kInt32Max && q.size(0) <= 65535 &&
                  block_tables.size(1) * key_blocks.size(2) >= max_total,
              "paged attention (CUDA, static): ", max_total, " positions at most but tables of ",
              block_tables.size(1), " blocks of ", key_blocks.size(2));
  // What the eager path checks before it picks the kernels (alignment,
  // head sizes, shared memory): refused with an error here, never launched.
  TORCH_CHECK(PagedCudaTakes(key_blocks, value_blocks, q.size(1)),
              "paged attention (CUDA, static): the kernels do not take these blocks (dtype, "
              "head size, alignment or shared memory)");
  const at::Device device = key_blocks.device();
  c10::cuda::CUDAGuard guard(device);
  PagedCudaPlan plan = PlanPagedDecodeCudaStatic(q, key_blocks, value_blocks, block_tables.size(1),
                                                 max_total, window, rule, SmCount(device.index()));
  cuda::PagedDecodeParams& p = plan.params;
  const cuda::KvDType dtype = plan.dtype;
  const at::Tensor queries = q.to(key_blocks.scalar_type()).contiguous();
  at::Tensor workspace;
  const at::Tensor out = AllocateOutputs(p, key_blocks, &workspace);
  p.q = queries.data_ptr();
  p.key_blocks = key_blocks.data_ptr();
  p.value_blocks = value_blocks.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.totals = totals.data_ptr<int32_t>();
  const char* refused = cuda::CheckPagedDecodeParams(p, dtype);
  TORCH_CHECK(refused == nullptr, "paged attention (CUDA, static): ", refused);
  const cudaError_t status = cuda::PagedDecodeAttention(
      p, dtype, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(status == cudaSuccess, "paged attention (CUDA, static): ", cudaGetErrorName(status),
              " (", cudaGetErrorString(status), ")");
  return out;
#endif
}

}  // namespace accel::models::internal
