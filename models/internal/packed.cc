#include "models/internal/packed.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorIndexing.h>
#include <ATen/TensorOperators.h>

#include "absl/strings/str_cat.h"

#include "core/device_copy.h"
#include "core/file_faults.h"
#include "models/internal/device_upload.h"
#include "models/internal/fused_ops.h"
#include "models/internal/sdpa.h"
#include "models/nn.h"

namespace accel::models::internal {
namespace {

// Writes this step's keys and values [kv_heads, n, head_dim] after the
// cache's `length` tokens in layer `layer`'s buffers (growing them by
// doubling) and returns views of everything so far, [kv_heads, length + n,
// head_dim]. `length` itself is advanced by Forward() once every layer ran.
std::pair<at::Tensor, at::Tensor> AppendToCache(KvCache* cache, size_t layer, const at::Tensor& k,
                                                const at::Tensor& v) {
  at::Tensor& key_buffer = cache->keys[layer];
  at::Tensor& value_buffer = cache->values[layer];
  const int64_t past = cache->length, n = k.size(1), needed = past + n;
  if (!key_buffer.defined() || key_buffer.size(1) < needed || key_buffer.device() != k.device() ||
      key_buffer.scalar_type() != k.scalar_type()) {
    const int64_t old = key_buffer.defined() ? key_buffer.size(1) : 0;
    const int64_t capacity = std::max<int64_t>({needed, 2 * old, 16});
    at::Tensor keys = at::empty({k.size(0), capacity, k.size(2)}, k.options());
    at::Tensor values = at::empty({v.size(0), capacity, v.size(2)}, v.options());
    if (past > 0) {
      keys.narrow(1, 0, past).copy_(key_buffer.narrow(1, 0, past));
      values.narrow(1, 0, past).copy_(value_buffer.narrow(1, 0, past));
    }
    key_buffer = keys;
    value_buffer = values;
  }
  key_buffer.narrow(1, past, n).copy_(k);
  value_buffer.narrow(1, past, n).copy_(v);
  return {key_buffer.narrow(1, 0, needed), value_buffer.narrow(1, 0, needed)};
}

}  // namespace

void WriteRowsIndexed(at::Tensor blocks, absl::Span<const int32_t> table, int64_t past,
                      const at::Tensor& rows) {
  const int64_t n = rows.size(1), block_size = blocks.size(2);
  std::vector<int64_t> where(static_cast<size_t>(2 * n));
  for (int64_t t = 0; t < n; ++t) {
    where[static_cast<size_t>(t)] = table[static_cast<size_t>((past + t) / block_size)];
    where[static_cast<size_t>(n + t)] = (past + t) % block_size;
  }
  const at::Tensor index = Int64sOn(where, blocks.device()).view({2, n});
  // [n, kv_heads, d] lands at blocks[block[t], :, slot[t]].
  blocks.index_put_({index[0], at::indexing::Slice(), index[1]}, rows.transpose(0, 1));
}

bool WriteStepBlocks(absl::Span<const SequenceChunk> chunks, size_t layer, const at::Tensor& k,
                     const at::Tensor& v) {
  KvBlockStore* store = nullptr;
  for (const SequenceChunk& chunk : chunks) {
    if (chunk.cache == nullptr || !chunk.cache->paged()) continue;
    if (store != nullptr && chunk.cache->store != store) return false;
    store = chunk.cache->store;
  }
  if (store == nullptr) return true;
  auto [key_blocks, value_blocks] = store->Layer(layer, k, v);
  const int64_t block_size = store->block_size();
  // [3, n]: each written token's block, its slot in the block, and its row of k.
  std::vector<int64_t> blocks, slots, tokens;
  int64_t offset = 0;
  for (const SequenceChunk& chunk : chunks) {
    if (chunk.cache != nullptr && chunk.cache->paged()) {
      const KvCache& cache = *chunk.cache;
      TORCH_CHECK(static_cast<int64_t>(cache.block_table.size()) * block_size >=
                      cache.length + chunk.tokens,
                  "paged KV cache: ", cache.length + chunk.tokens,
                  " positions but the block table holds ", cache.block_table.size(), " blocks of ",
                  block_size);
      for (int64_t t = 0; t < chunk.tokens; ++t) {
        const int64_t position = cache.length + t;
        blocks.push_back(cache.block_table[static_cast<size_t>(position / block_size)]);
        slots.push_back(position % block_size);
        tokens.push_back(offset + t);
      }
    }
    offset += chunk.tokens;
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<int64_t> packed;
  packed.reserve(static_cast<size_t>(3 * n));
  packed.insert(packed.end(), blocks.begin(), blocks.end());
  packed.insert(packed.end(), slots.begin(), slots.end());
  packed.insert(packed.end(), tokens.begin(), tokens.end());
  // Every layer of a step writes at the same places: the index goes to the
  // device once a step (LastUpload), as the decode kernels' tables do.
  thread_local LastUpload<int64_t> last_index;
  const at::Tensor index = last_index.To(packed, at::kLong, key_blocks.device()).view({3, n});
  const bool every_token = n == k.size(1);  // in order: the tokens are 0, 1, ...
  const at::Tensor keys = every_token ? k : k.index_select(1, index[2]);
  const at::Tensor values = every_token ? v : v.index_select(1, index[2]);
  // [n, kv_heads, d] lands at blocks[block[t], :, slot[t]].
  key_blocks.index_put_({index[0], at::indexing::Slice(), index[1]}, keys.transpose(0, 1));
  value_blocks.index_put_({index[0], at::indexing::Slice(), index[1]}, values.transpose(0, 1));
  return true;
}

namespace {

// On the cpu: rows [first, first + n) of `rows` [kv_heads, tokens, d] (d
// contiguous, the blocks' dtype) into blocks [num_blocks, kv_heads,
// block_size, d] at positions [past, past + n) through `table` (whose
// entries cover them: the caller checks), by memcpy: a copy op a run of
// positions cost a step of 128 decodes on 32 layers about 8000 dispatches
// a tensor. False where the layouts do not allow it (the caller copies with
// ops then).
bool CopyRowsIntoBlocks(const at::Tensor& rows, int64_t first, int64_t n, at::Tensor& blocks,
                        absl::Span<const int32_t> table, int64_t past) {
  if (!blocks.is_cpu() || !rows.is_cpu() || !blocks.is_contiguous() ||
      rows.scalar_type() != blocks.scalar_type() || rows.dim() != 3 || rows.stride(2) != 1 ||
      rows.size(0) != blocks.size(1) || rows.size(2) != blocks.size(3) || first < 0 ||
      first + n > rows.size(1)) {
    return false;
  }
  const int64_t kv_heads = rows.size(0), d = rows.size(2);
  const int64_t block_size = blocks.size(2);
  const int64_t element = static_cast<int64_t>(rows.element_size());
  const auto* src = static_cast<const uint8_t*>(rows.data_ptr());
  auto* dst = static_cast<uint8_t*>(blocks.data_ptr());
  // Every block first: nothing is written when one is refused.
  for (int64_t b = past / block_size; n > 0 && b <= (past + n - 1) / block_size; ++b) {
    const int64_t block = table[static_cast<size_t>(b)];
    TORCH_CHECK(block >= 0 && block < blocks.size(0), "paged KV cache: block ", block,
                " outside the store's ", blocks.size(0));
  }
  for (int64_t t = 0; t < n; ++t) {
    const int64_t position = past + t;
    const int64_t block = table[static_cast<size_t>(position / block_size)];
    const int64_t slot = position % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(dst + (((block * kv_heads + h) * block_size + slot) * d) * element,
                  src + (h * rows.stride(0) + (first + t) * rows.stride(1)) * element,
                  static_cast<size_t>(d * element));
    }
  }
  return true;
}

// Writes the chunk's keys and values, tokens [first, first + n) of the
// step's k and v [kv_heads, tokens, d], at positions [past, past + n) of a
// paged cache's blocks; returns the layer's blocks.
std::pair<at::Tensor, at::Tensor> WriteBlocks(KvCache* cache, size_t layer,
                                              const at::Tensor& step_k, const at::Tensor& step_v,
                                              int64_t first, int64_t n) {
  auto [key_blocks, value_blocks] = cache->store->Layer(layer, step_k, step_v);
  const int64_t block_size = cache->store->block_size(), past = cache->length;
  TORCH_CHECK(static_cast<int64_t>(cache->block_table.size()) * block_size >= past + n,
              "paged KV cache: ", past + n, " positions but the block table holds ",
              cache->block_table.size(), " blocks of ", block_size);
  if (CopyRowsIntoBlocks(step_k, first, n, key_blocks, cache->block_table, past) &&
      CopyRowsIntoBlocks(step_v, first, n, value_blocks, cache->block_table, past)) {
    return {key_blocks, value_blocks};
  }
  const at::Tensor k = step_k.narrow(1, first, n), v = step_v.narrow(1, first, n);
  if (!key_blocks.is_cpu() && n > 1) {
    // A run per block would be a copy kernel each (a 2048-token prompt: 256 a
    // layer); one indexed copy per tensor instead.
    WriteRowsIndexed(key_blocks, cache->block_table, past, k);
    WriteRowsIndexed(value_blocks, cache->block_table, past, v);
    return {key_blocks, value_blocks};
  }
  for (int64_t t = 0; t < n;) {
    const int64_t position = past + t, slot = position % block_size;
    const int64_t run = std::min(n - t, block_size - slot);
    const int64_t block = cache->block_table[static_cast<size_t>(position / block_size)];
    key_blocks[block].narrow(1, slot, run).copy_(k.narrow(1, t, run));
    value_blocks[block].narrow(1, slot, run).copy_(v.narrow(1, t, run));
    t += run;
  }
  return {key_blocks, value_blocks};
}

// A paged cache's first `total` positions as [kv_heads, total, d] (a copy).
at::Tensor GatherBlocks(const at::Tensor& blocks, const std::vector<int32_t>& table,
                        int64_t total) {
  const int64_t block_size = blocks.size(2);
  const int64_t used = (total + block_size - 1) / block_size;
  std::vector<int64_t> index(table.begin(), table.begin() + used);
  at::Tensor picked = blocks.index_select(0, Int64sOn(index, blocks.device()));
  return picked.permute({1, 0, 2, 3})
      .reshape({blocks.size(1), used * block_size, blocks.size(3)})
      .narrow(1, 0, total);
}

}  // namespace

namespace {

thread_local const StaticDecodeInputs* static_decode = nullptr;

}  // namespace

// A general step's one-token paged decodes (StepDecodePlanScope): planned at
// the step's first attention (no cache moves until every layer ran) and
// attended in each layer as one batch through their block tables, as the
// static decode step attends its rows, instead of a query, a table and a
// few views per row and layer.
struct StepDecodePlan {
  bool built = false;
  std::vector<char> planned;  // by chunk: whether it is one of the rows
  KvBlockStore* store = nullptr;
  at::Device device = at::kCPU;
  at::Tensor index;   // [rows] int64: the rows' places among the step's tokens
  at::Tensor tables;  // [rows, max_blocks] int32
  at::Tensor totals;  // [rows] int32: positions each row attends
  int64_t rows = 0;
  int64_t max_total = 0;
};

namespace {

thread_local StepDecodePlan* step_plan = nullptr;
std::atomic<bool> plan_on_cpu{false};
std::atomic<int64_t> planned_attentions{0};

// Fills `plan` from the step's chunks: those of one token on a paged cache
// of the first such chunk's store. None (rows 0) on the cpu unless
// PlanStepDecodesOnCpu asked for it.
void BuildStepDecodePlan(StepDecodePlan& plan, absl::Span<const SequenceChunk> chunks,
                         const at::Device& device) {
  plan.built = true;
  plan.planned.assign(chunks.size(), 0);
  if (device.is_cpu() && !plan_on_cpu.load()) return;
  std::vector<int64_t> index;
  std::vector<const KvCache*> caches;
  int64_t offset = 0, max_blocks = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const SequenceChunk& chunk = chunks[c];
    const KvCache* cache = chunk.cache;
    if (chunk.tokens == 1 && cache != nullptr && cache->paged() &&
        (plan.store == nullptr || cache->store == plan.store)) {
      plan.store = cache->store;
      plan.planned[c] = 1;
      index.push_back(offset);
      caches.push_back(cache);
      max_blocks = std::max(max_blocks, cache->length / cache->store->block_size() + 1);
    }
    offset += chunk.tokens;
  }
  plan.rows = static_cast<int64_t>(index.size());
  if (plan.rows == 0) return;
  plan.device = device;
  const int64_t block_size = plan.store->block_size();
  // One buffer of int32 for the tables and totals (entries past a row's
  // blocks are never read), sent without waiting (core/device_copy.h).
  at::Tensor host = HostStaging({plan.rows * max_blocks + plan.rows}, at::kInt, device).zero_();
  int32_t* tables = host.data_ptr<int32_t>();
  int32_t* totals = tables + plan.rows * max_blocks;
  for (int64_t r = 0; r < plan.rows; ++r) {
    const KvCache& cache = *caches[static_cast<size_t>(r)];
    const int64_t used = cache.length / block_size + 1;
    TORCH_CHECK(static_cast<int64_t>(cache.block_table.size()) >= used, "decode row ", r,
                " at position ", cache.length, " but its table holds ", cache.block_table.size(),
                " blocks");
    std::copy(cache.block_table.begin(), cache.block_table.begin() + used, tables + r * max_blocks);
    totals[r] = static_cast<int32_t>(cache.length + 1);
    plan.max_total = std::max(plan.max_total, cache.length + 1);
  }
  plan.index = Int64sOn(index, device);
  const at::Tensor narrow = SendToDevice(host, device);
  plan.tables = narrow.narrow(0, 0, plan.rows * max_blocks).view({plan.rows, max_blocks});
  plan.totals = narrow.narrow(0, plan.rows * max_blocks, plan.rows);
}

// The attention of one-token rows q [heads, rows, d] through block tables
// [rows, max_blocks] and totals [rows] (int32, on the blocks' device): the
// CUDA kernels with a plan fixed by max_total, or on the cpu the tables read
// back and each row attended by PagedDecodeAttention (the numbers the
// kernels read). [rows, heads * dv] in q's dtype.
at::Tensor AttendThroughTables(const at::Tensor& q, const at::Tensor& key_blocks,
                               const at::Tensor& value_blocks, const at::Tensor& block_tables,
                               const at::Tensor& block_totals, int64_t max_total,
                               std::optional<int64_t> window, const ScoreRule& rule) {
  const int64_t rows = q.size(1);
  if (key_blocks.is_cuda()) {
    return PagedDecodeAttentionCudaStatic(q.transpose(0, 1), key_blocks, value_blocks, block_tables,
                                          block_totals, max_total, window, rule)
        .to(q.scalar_type());
  }
  const at::Tensor tables = block_tables.to(at::kCPU).contiguous();
  const at::Tensor totals = block_totals.to(at::kCPU).contiguous();
  const int64_t stride = tables.size(1), block_size = key_blocks.size(2);
  std::vector<PagedRow> queries;
  queries.reserve(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t total = totals.data_ptr<int32_t>()[r];
    const int64_t used = (total + block_size - 1) / block_size;
    TORCH_CHECK(total >= 1 && used <= stride, "decode rows: row ", r, " attends ", total,
                " positions, its table holds ", stride, " blocks");
    const int32_t* row = tables.data_ptr<int32_t>() + r * stride;
    queries.push_back({r, absl::MakeConstSpan(row, static_cast<size_t>(used)), total});
  }
  return PagedDecodeAttentionRows(q, queries, key_blocks, value_blocks, window, rule)
      .to(q.scalar_type());
}

// AttendPacked under a StaticDecodeScope: q [heads, rows, d], k, v
// [kv_heads, rows, d], one row per chunk.
at::Tensor AttendStaticDecode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              absl::Span<const SequenceChunk> chunks, size_t layer,
                              std::optional<int64_t> window, const ScoreRule& rule,
                              const StaticDecodeInputs& inputs) {
  const int64_t rows = q.size(1);
  TORCH_CHECK(static_cast<int64_t>(chunks.size()) == rows && rows >= 1 &&
                  chunks[0].cache != nullptr && chunks[0].cache->paged(),
              "static decode step: ", chunks.size(), " chunks for ", rows,
              " rows, each one token on a paged cache");
  auto [key_blocks, value_blocks] = chunks[0].cache->store->Layer(layer, k, v);
  // [rows, kv_heads, d] lands at blocks[slot_blocks[r], :, slot_offsets[r]].
  const at::Tensor where_blocks = inputs.slot_blocks.to(key_blocks.device());
  const at::Tensor where_offsets = inputs.slot_offsets.to(key_blocks.device());
  key_blocks.index_put_({where_blocks, at::indexing::Slice(), where_offsets}, k.transpose(0, 1));
  value_blocks.index_put_({where_blocks, at::indexing::Slice(), where_offsets}, v.transpose(0, 1));
  return AttendThroughTables(q, key_blocks, value_blocks, inputs.block_tables, inputs.totals,
                             inputs.max_total, window, rule);
}

}  // namespace

std::optional<at::Tensor> AttendStaticDecodeRotating(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, const at::Tensor& cos,
                                                     const at::Tensor& sin,
                                                     absl::Span<const SequenceChunk> chunks,
                                                     size_t layer, std::optional<int64_t> window,
                                                     const ScoreRule& rule) {
  if (static_decode == nullptr || !q.is_cuda() || q.dim() != 4 || k.dim() != 4 || v.dim() != 4 ||
      chunks.empty() || static_cast<int64_t>(chunks.size()) != q.size(1) ||
      chunks[0].cache == nullptr || !chunks[0].cache->paged()) {
    return std::nullopt;
  }
  const StaticDecodeInputs& inputs = *static_decode;
  // The store's blocks for this layer, made like k and v [kv_heads, rows, d].
  auto [key_blocks, value_blocks] =
      chunks[0].cache->store->Layer(layer, k[0].transpose(0, 1), v[0].transpose(0, 1));
  if (!PagedCudaTakes(key_blocks, value_blocks, q.size(2))) return std::nullopt;
  const at::Tensor slot_blocks = inputs.slot_blocks.to(key_blocks.device());
  const at::Tensor slot_offsets = inputs.slot_offsets.to(key_blocks.device());
  std::optional<at::Tensor> rotated =
      FusedRotaryStore(q, k, v, cos, sin, slot_blocks, slot_offsets, key_blocks, value_blocks);
  if (!rotated) return std::nullopt;
  return PagedDecodeAttentionCudaStatic(*rotated, key_blocks, value_blocks, inputs.block_tables,
                                        inputs.totals, inputs.max_total, window, rule)
      .to(q.scalar_type());
}

StaticDecodeScope::StaticDecodeScope(const StaticDecodeInputs* inputs) : previous_(static_decode) {
  static_decode = inputs;
}

StaticDecodeScope::~StaticDecodeScope() { static_decode = previous_; }

StepDecodePlanScope::StepDecodePlanScope()
    : plan_(std::make_unique<StepDecodePlan>()), previous_(step_plan) {
  step_plan = plan_.get();
}

StepDecodePlanScope::~StepDecodePlanScope() { step_plan = previous_; }

void PlanStepDecodesOnCpu(bool on) { plan_on_cpu.store(on); }

int64_t PlannedDecodeAttentions() { return planned_attentions.load(); }

at::Tensor AttendPacked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        absl::Span<const SequenceChunk> chunks, size_t layer,
                        std::optional<int64_t> window, const ScoreRule& rule) {
  if (static_decode != nullptr) {
    return AttendStaticDecode(q, k, v, chunks, layer, window, rule, *static_decode);
  }
  const int64_t heads = q.size(0), kv_heads = k.size(0), d = q.size(2), dv = v.size(2);
  const int64_t group = heads / kv_heads;
  std::vector<at::Tensor> outs(chunks.size());
  // Paged decoding queries (rows of q), attended together in place below.
  std::vector<PagedRow> decodes;
  std::vector<size_t> decode_chunks;
  at::Tensor decode_keys, decode_values;
  // Off the cpu the step's paged keys and values are written at once (on
  // the cpu a copy per run of positions costs no launch and less than the
  // indexed copy's set-up).
  const bool written = !k.is_cpu() && WriteStepBlocks(chunks, layer, k, v);
  // The step's one-token decodes, planned once a step (StepDecodePlanScope),
  // where this layer's blocks are on the plan's device and the kernels take
  // them.
  StepDecodePlan* plan = step_plan;
  at::Tensor plan_keys, plan_values;
  if (plan != nullptr) {
    if (!plan->built) BuildStepDecodePlan(*plan, chunks, k.device());
    if (plan->rows == 0 || plan->planned.size() != chunks.size()) {
      plan = nullptr;
    } else {
      std::tie(plan_keys, plan_values) = plan->store->Layer(layer, k, v);
      if (plan_keys.device() != plan->device ||
          (plan_keys.is_cuda() && !PagedCudaTakes(plan_keys, plan_values, heads))) {
        plan = nullptr;
      }
    }
  }
  int64_t offset = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const SequenceChunk& chunk = chunks[c];
    const int64_t n = chunk.tokens;
    if (plan != nullptr && plan->planned[c] != 0) {
      // Attended with the plan's other rows below; its key and value
      // written with the step's unless the stores differ.
      if (!written) WriteBlocks(chunk.cache, layer, k, v, offset, n);
      offset += n;
      continue;
    }
    // The chunk's keys and values: views made only where they are used (a
    // step of 128 decodes on 32 layers made 16000 ops of them on the cpu).
    at::Tensor keys, values;
    int64_t past = 0;
    if (chunk.cache != nullptr && chunk.cache->paged()) {
      past = chunk.cache->length;
      auto [key_blocks, value_blocks] = written ? chunk.cache->store->Layer(layer, k, v)
                                                : WriteBlocks(chunk.cache, layer, k, v, offset, n);
      // Decoding positions (one token, or a token and the drafts after it,
      // every one of which gets logits) attend in place, each query over
      // the positions up to its own: the same computation as decoding them
      // one at a time, so verified drafts give the tokens decoding gives. On
      // the cpu, or through the CUDA kernels where they take these blocks.
      if ((n == 1 || n <= chunk.logit_tokens) &&
          (key_blocks.device().is_cpu() || PagedCudaTakes(key_blocks, value_blocks, heads))) {
        for (int64_t i = 0; i < n; ++i) {
          decodes.push_back({offset + i, chunk.cache->block_table, past + i + 1});
          decode_chunks.push_back(c);
        }
        TORCH_CHECK(!decode_keys.defined() || decode_keys.is_same(key_blocks),
                    "paged KV caches of one step must share one block store");
        decode_keys = key_blocks;
        decode_values = value_blocks;
        offset += n;
        continue;
      }
      // A prompt's first chunk off the cpu attends the keys and values it
      // just wrote, which it has: no gather (two kernels a chunk and layer).
      // On the cpu the gathered copy stays, whose layout the matmul path's
      // numbers were checked with.
      if (past > 0 || key_blocks.is_cpu()) {
        keys = GatherBlocks(key_blocks, chunk.cache->block_table, past + n);
        values = GatherBlocks(value_blocks, chunk.cache->block_table, past + n);
      } else {
        keys = k.narrow(1, offset, n);
        values = v.narrow(1, offset, n);
      }
    } else {
      keys = k.narrow(1, offset, n);
      values = v.narrow(1, offset, n);
      if (chunk.cache != nullptr) {
        past = chunk.cache->length;
        std::tie(keys, values) = AppendToCache(chunk.cache, layer, keys, values);
      }
    }
    const int64_t total = past + n;
    // On a CUDA device: libtorch's fused attention where it has it (2.5+).
    if (std::optional<at::Tensor> fused =
            SdpaAttention(q.narrow(1, offset, n), keys, values, past, window, rule)) {
      outs[c] = fused->transpose(0, 1).reshape({n, heads * dv});
      offset += n;
      continue;
    }
    at::Tensor queries = q.narrow(1, offset, n).reshape({kv_heads, group * n, d});
    at::Tensor scores = nn::MatMul(queries, keys.transpose(1, 2));
    scores = rule.divide ? scores / rule.scale : scores * rule.scale;
    if (rule.softcap) scores = at::tanh(scores / *rule.softcap) * *rule.softcap;
    scores = scores.view({kv_heads, group, n, total});
    // Query i (at position past + i) sees key j when j <= past + i and, with
    // a sliding window, past + i - j < window. A lone query without a window
    // sees everything.
    if (n > 1 || (window && total > *window)) {
      at::Tensor query_pos = at::arange(past, total, q.options().dtype(at::kLong)).unsqueeze(1);
      at::Tensor key_pos = at::arange(0, total, q.options().dtype(at::kLong)).unsqueeze(0);
      at::Tensor allowed = key_pos <= query_pos;
      if (window) allowed = allowed.logical_and(query_pos - key_pos < *window);
      scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity());
    }
    at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
    at::Tensor out = nn::MatMul(probs.view({kv_heads, group * n, total}), values);
    outs[c] = out.view({heads, n, dv}).transpose(0, 1).reshape({n, heads * dv});
    offset += n;
  }
  if (!decodes.empty()) {
    at::Tensor attended;
    if (decode_keys.is_cuda()) {
      std::vector<PagedQuery> queries;
      queries.reserve(decodes.size());
      for (const PagedRow& row : decodes) {
        queries.push_back({q.narrow(1, row.row, 1).select(1, 0), row.table, row.total});
      }
      attended = PagedDecodeAttentionCuda(queries, decode_keys, decode_values, window, rule);
    } else {
      attended = PagedDecodeAttentionRows(q, decodes, decode_keys, decode_values, window, rule);
    }
    attended = attended.to(q.scalar_type());
    // Every row a decode: the rows are the step's, in order.
    if (plan == nullptr && static_cast<int64_t>(decodes.size()) == offset) return attended;
    // A chunk's queries are consecutive rows.
    for (size_t i = 0; i < decodes.size();) {
      size_t end = i + 1;
      while (end < decodes.size() && decode_chunks[end] == decode_chunks[i]) ++end;
      outs[decode_chunks[i]] =
          attended.narrow(0, static_cast<int64_t>(i), static_cast<int64_t>(end - i));
      i = end;
    }
  }
  if (plan == nullptr) return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
  planned_attentions.fetch_add(1);
  at::Tensor planned =
      AttendThroughTables(q.index_select(1, plan->index), plan_keys, plan_values, plan->tables,
                          plan->totals, plan->max_total, window, rule);
  if (plan->rows == static_cast<int64_t>(chunks.size())) return planned;  // decodes only
  at::Tensor out = at::empty({offset, planned.size(1)}, planned.options());
  out.index_copy_(0, plan->index, planned);
  int64_t first = 0;  // chunk c's first row
  for (size_t c = 0; c < chunks.size(); first += chunks[c].tokens, ++c) {
    if (plan->planned[c] == 0) out.narrow(0, first, chunks[c].tokens).copy_(outs[c]);
  }
  return out;
}

absl::Status CheckWeightFiles() {
  if (std::optional<std::string> fault = ModelFileFault()) {
    return absl::DataLossError(absl::StrCat(
        *fault,
        "; the weights in memory can no longer be trusted, so every step fails until the "
        "process restarts"));
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> PreparePositions(const at::Tensor& input_ids,
                                            absl::Span<const SequenceChunk> chunks,
                                            const loader::ModelConfig& config, size_t layers) {
  if (input_ids.dim() != 1 || input_ids.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError("input_ids must be one int64 row of packed tokens");
  }
  if (chunks.empty()) return absl::InvalidArgumentError("no sequences in the batch");
  int64_t total = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const SequenceChunk& chunk = chunks[i];
    if (chunk.tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", i, " has ", chunk.tokens, " tokens; each needs at least 1"));
    }
    total += chunk.tokens;
    if (chunk.cache == nullptr) continue;
    for (size_t j = 0; j < i; ++j) {
      if (chunks[j].cache == chunk.cache) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequences ", j, " and ", i, " share one KV cache"));
      }
    }
    if (!chunk.cache->paged() && chunk.cache->length > 0 && chunk.cache->keys.size() != layers) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, "'s KV cache has ",
                                                     chunk.cache->keys.size(),
                                                     " layers but the model has ", layers));
    }
    if (chunk.cache->length < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", i, "'s KV cache has length ", chunk.cache->length));
    }
  }
  if (total != input_ids.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the sequences have ", total, " tokens in all but input_ids has ", input_ids.numel()));
  }
  at::Tensor positions = at::empty({1, total}, at::kLong);
  int64_t* out = positions.data_ptr<int64_t>();
  for (const SequenceChunk& chunk : chunks) {
    const int64_t first = chunk.cache != nullptr ? chunk.cache->length : 0;
    for (int64_t t = 0; t < chunk.tokens; ++t) *out++ = first + t;
  }
  int64_t low = 0, high = 0;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    low = input_ids.min().item<int64_t>();
    high = input_ids.max().item<int64_t>();
  }));
  if (low < 0 || high >= config.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("token id ", low < 0 ? low : high,
                                                   " is outside the vocabulary [0, ",
                                                   config.vocab_size, ")"));
  }
  for (const SequenceChunk& chunk : chunks) {
    if (chunk.cache != nullptr && !chunk.cache->paged() && chunk.cache->keys.size() != layers) {
      chunk.cache->keys.assign(layers, at::Tensor());
      chunk.cache->values.assign(layers, at::Tensor());
    }
  }
  return positions;
}

at::Tensor LastTokens(absl::Span<const SequenceChunk> chunks, const at::Device& device) {
  std::vector<int64_t> last;
  int64_t offset = 0;
  for (const SequenceChunk& chunk : chunks) {
    offset += chunk.tokens;
    const int64_t n = std::min(std::max<int64_t>(chunk.logit_tokens, 1), chunk.tokens);
    for (int64_t i = n; i > 0; --i) last.push_back(offset - i);
  }
  return Int64sOn(last, device);
}

void AdvanceCaches(const at::Tensor& input_ids, absl::Span<const SequenceChunk> chunks) {
  const at::Tensor ids = input_ids.to(at::kCPU).contiguous();
  const int64_t* data = ids.data_ptr<int64_t>();
  for (const SequenceChunk& chunk : chunks) {
    if (chunk.cache != nullptr) {
      chunk.cache->length += chunk.tokens;
      chunk.cache->token_ids.insert(chunk.cache->token_ids.end(), data, data + chunk.tokens);
    }
    data += chunk.tokens;
  }
}

}  // namespace accel::models::internal
