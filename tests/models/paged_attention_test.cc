// Decode attention over a paged KV cache against the contiguous cache's
// attention (the matmul path of AttendPacked, itself checked against
// transformers through the model tests): the same keys and values written
// into shuffled blocks give the same output, with grouped heads, a sliding
// window, a softcap, and in float32 and bfloat16.
#include "models/internal/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "models/causal_lm.h"
#include "models/internal/packed.h"
#include "tests/models/paged_decode_emulation.h"

namespace accel::models::internal {
namespace {

struct Case {
  at::ScalarType dtype;
  int64_t heads, kv_heads, d, block_size;
  std::optional<int64_t> window;
  std::optional<double> softcap;
  double tolerance;
};

class PagedAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(PagedAttentionTest, EqualsAttentionOverTheContiguousCache) {
  c10::InferenceMode inference;
  const Case c = GetParam();
  at::manual_seed(5);
  std::mt19937 rng(9);
  const std::vector<int64_t> lengths = {1, 7, 16, 33, 70};  // past + this token
  const int64_t num_blocks = 64;
  KvBlockStore store(num_blocks, c.block_size, 1);
  ScoreRule rule;
  rule.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  rule.softcap = c.softcap;
  std::vector<int32_t> free(num_blocks);
  std::iota(free.begin(), free.end(), 0);
  std::shuffle(free.begin(), free.end(), rng);  // blocks out of order, as after churn
  std::vector<PagedQuery> queries;
  std::vector<std::vector<int32_t>> tables;
  std::vector<at::Tensor> expected;
  at::Tensor key_blocks, value_blocks;
  for (int64_t total : lengths) {
    at::Tensor k = at::randn({c.kv_heads, total, c.d}).to(c.dtype);
    at::Tensor v = at::randn({c.kv_heads, total, c.d}).to(c.dtype);
    at::Tensor q = at::randn({c.heads, 1, c.d}).to(c.dtype);
    // The reference: the contiguous path, the whole past in one chunk then the query.
    KvCache contiguous;
    contiguous.keys.resize(1);
    contiguous.values.resize(1);
    if (total > 1) {
      AttendPacked(at::randn({c.heads, total - 1, c.d}).to(c.dtype), k.narrow(1, 0, total - 1),
                   v.narrow(1, 0, total - 1), {{&contiguous, total - 1}}, 0, c.window, rule);
      contiguous.length = total - 1;
    }
    expected.push_back(AttendPacked(q, k.narrow(1, total - 1, 1), v.narrow(1, total - 1, 1),
                                    {{&contiguous, 1}}, 0, c.window, rule));
    // The same keys and values in blocks.
    std::vector<int32_t> table;
    for (int64_t b = 0; b * c.block_size < total; ++b) {
      table.push_back(free.back());
      free.pop_back();
    }
    std::tie(key_blocks, value_blocks) = store.Layer(0, k, v);
    for (int64_t j = 0; j < total; ++j) {
      const int32_t block = table[static_cast<size_t>(j / c.block_size)];
      key_blocks[block].select(1, j % c.block_size).copy_(k.select(1, j));
      value_blocks[block].select(1, j % c.block_size).copy_(v.select(1, j));
    }
    tables.push_back(std::move(table));
    queries.push_back({q.select(1, 0), {}, total});
  }
  for (size_t i = 0; i < queries.size(); ++i) queries[i].table = tables[i];
  // The same queries as rows of one q [heads, tokens, d], in another order
  // and beside a row no query reads (PagedDecodeAttentionRows).
  std::vector<at::Tensor> packed_rows = {at::randn({c.heads, c.d}).to(c.dtype)};
  std::vector<PagedRow> rows(queries.size());
  for (size_t i = queries.size(); i-- > 0;) {
    rows[i] = {static_cast<int64_t>(packed_rows.size()), tables[i], queries[i].total};
    packed_rows.push_back(queries[i].q);
  }
  const at::Tensor packed_q = at::stack(packed_rows, 1);
  // Both instruction paths: the plain loops, and AVX2 where the cpu has it.
  for (bool portable : {true, false}) {
    const bool avx2 = UsePortablePagedAttention(portable);
    at::Tensor got = PagedDecodeAttention(queries, key_blocks, value_blocks, c.window, rule);
    EXPECT_TRUE(at::equal(
        PagedDecodeAttentionRows(packed_q, rows, key_blocks, value_blocks, c.window, rule), got));
    ASSERT_EQ(got.size(0), static_cast<int64_t>(lengths.size()));
    for (size_t i = 0; i < lengths.size(); ++i) {
      const at::Tensor want = expected[i].to(at::kFloat);
      const at::Tensor have = got[static_cast<int64_t>(i)].unsqueeze(0).to(at::kFloat);
      const double diff = (want - have).abs().max().item<double>();
      EXPECT_LE(diff, c.tolerance)
          << "sequence " << i << " of length " << lengths[i] << (avx2 ? " (avx2)" : " (portable)");
    }
  }
  UsePortablePagedAttention(false);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PagedAttentionTest,
    ::testing::Values(Case{at::kFloat, 4, 4, 16, 16, std::nullopt, std::nullopt, 1e-5},
                      Case{at::kFloat, 8, 2, 32, 4, std::nullopt, std::nullopt, 1e-5},  // GQA
                      Case{at::kFloat, 4, 2, 8, 5, int64_t{6}, std::nullopt, 1e-5},     // window
                      Case{at::kFloat, 4, 1, 16, 16, std::nullopt, 50.0, 1e-5},         // softcap
                      // bfloat16: the contiguous path rounds scores and probabilities
                      // to bfloat16, the paged one keeps float32.
                      Case{at::kBFloat16, 8, 2, 64, 16, std::nullopt, std::nullopt, 3e-2}));

// --- The CUDA path ---------------------------------------------------------------

// Random queries over shuffled blocks of one store, for the cpu kernel and
// the CUDA plan alike.
struct PagedInputs {
  at::Tensor key_blocks, value_blocks;
  std::vector<std::vector<int32_t>> tables;
  std::vector<PagedQuery> queries;
};

PagedInputs MakePagedInputs(at::ScalarType dtype, int64_t heads, int64_t kv_heads, int64_t d,
                            int64_t block_size, const std::vector<int64_t>& totals, uint32_t seed) {
  at::manual_seed(seed);
  std::mt19937 rng(seed);
  PagedInputs in;
  int64_t blocks = 2;  // two that no table lists
  for (int64_t total : totals) blocks += (total + block_size - 1) / block_size;
  in.key_blocks = at::randn({blocks, kv_heads, block_size, d}).to(dtype);
  in.value_blocks = at::randn({blocks, kv_heads, block_size, d}).to(dtype);
  std::vector<int32_t> free(static_cast<size_t>(blocks));
  std::iota(free.begin(), free.end(), 0);
  std::shuffle(free.begin(), free.end(), rng);
  for (int64_t total : totals) {
    std::vector<int32_t> table;
    for (int64_t b = 0; b * block_size < total; ++b) {
      table.push_back(free.back());
      free.pop_back();
    }
    in.tables.push_back(std::move(table));
    in.queries.push_back({at::randn({heads, d}).to(dtype), {}, total});
  }
  for (size_t i = 0; i < in.queries.size(); ++i) in.queries[i].table = in.tables[i];
  return in;
}

struct CudaCase {
  const char* name;
  at::ScalarType dtype;
  int64_t heads, kv_heads, d, block_size;
  std::vector<int64_t> totals;
  std::optional<int64_t> window;
  std::optional<double> softcap;
  bool divide;        // a rule that divides by sqrt(d) (GPT-2)
  int32_t partition;  // 0: the plan's, for a 132-SM device
};

// Where the kernels' float32 sums and the cpu kernel's differ by more than
// float32 rounding; bfloat16 and float16 outputs by one rounding at most.
double CudaTolerance(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? 1.6e-2 : dtype == at::kHalf ? 2e-3 : 2e-5;
}

const CudaCase kCudaCases[] = {
    {"Float32Gqa",
     at::kFloat,
     8,
     2,
     64,
     16,
     {1, 7, 16, 33, 70},
     std::nullopt,
     std::nullopt,
     false,
     0},
    {"BFloat16GqaSplits",
     at::kBFloat16,
     8,
     2,
     128,
     16,
     {1, 300, 700},
     std::nullopt,
     std::nullopt,
     false,
     0},
    {"Float16WindowSplits",
     at::kHalf,
     4,
     1,
     64,
     5,
     {3, 40, 400},
     int64_t{100},
     std::nullopt,
     false,
     32},
    {"BFloat16SoftcapDivide", at::kBFloat16, 4, 4, 96, 16, {20, 129}, std::nullopt, 2.0, true, 64},
};

ScoreRule RuleOf(const CudaCase& c) {
  ScoreRule rule;
  if (c.divide) {
    rule.scale = std::sqrt(static_cast<double>(c.d));
    rule.divide = true;
  } else {
    rule.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  }
  rule.softcap = c.softcap;
  return rule;
}

void ExpectClose(const at::Tensor& got, const at::Tensor& want, double tolerance,
                 const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double diff = (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>();
  EXPECT_LE(diff, tolerance) << what;
}

// A case's inputs (seeded), its score rule and the cpu kernel's output.
struct CaseData {
  PagedInputs in;
  ScoreRule rule;
  at::Tensor want;
};

CaseData MakeCase(const CudaCase& c, uint32_t seed) {
  CaseData data{MakePagedInputs(c.dtype, c.heads, c.kv_heads, c.d, c.block_size, c.totals, seed),
                RuleOf(c), at::Tensor()};
  data.want = PagedDecodeAttention(data.in.queries, data.in.key_blocks, data.in.value_blocks,
                                   c.window, data.rule);
  return data;
}

// A plan's parameters run through the kernels' code on the host
// (tests/models/paged_decode_emulation.h) over `in`'s blocks, q [rows, heads,
// d] and the int32 tables and totals; the output, NaN where nothing wrote.
at::Tensor EmulatePlan(PagedCudaPlan& plan, const at::Tensor& q, const PagedInputs& in,
                       const int32_t* tables, const int32_t* totals) {
  cuda::PagedDecodeParams& p = plan.params;
  at::Tensor out = at::full({p.seqs, static_cast<int64_t>(p.heads) * p.value_dim},
                            std::numeric_limits<double>::quiet_NaN(), in.key_blocks.scalar_type());
  std::vector<float> workspace(static_cast<size_t>(
      cuda::PagedDecodeWorkspaceFloats(p.seqs, p.heads, p.value_dim, p.max_splits)));
  p.q = q.data_ptr();
  p.key_blocks = in.key_blocks.data_ptr();
  p.value_blocks = in.value_blocks.data_ptr();
  p.block_tables = tables;
  p.totals = totals;
  p.out = out.data_ptr();
  p.workspace = workspace.empty() ? nullptr : workspace.data();
  const std::string error = models::testing::EmulatePagedDecode(p, plan.dtype);
  EXPECT_EQ(error, "");
  return out;
}

// A static decode step's inputs (CausalLM::ForwardStaticDecode's): q [rows,
// heads, d], each row's block table in tables [rows, stride] and its total
// in totals [rows] (int32), planned for four times the longest row's total,
// so most rows' later splits are empty.
struct StaticStep {
  at::Tensor q, tables, totals;
  int64_t max_total = 0;
};

StaticStep MakeStaticStep(const PagedInputs& in, int64_t block_size) {
  StaticStep step;
  const int64_t rows = static_cast<int64_t>(in.queries.size());
  int64_t longest = 0;
  for (const PagedQuery& query : in.queries) longest = std::max(longest, query.total);
  step.max_total = 4 * longest;
  step.tables = at::zeros({rows, (step.max_total + block_size - 1) / block_size}, at::kInt);
  step.totals = at::empty({rows}, at::kInt);
  std::vector<at::Tensor> q_rows;
  for (int64_t r = 0; r < rows; ++r) {
    const PagedQuery& query = in.queries[static_cast<size_t>(r)];
    for (size_t b = 0; b < query.table.size(); ++b) {
      step.tables[r][static_cast<int64_t>(b)] = query.table[b];
    }
    step.totals[r] = static_cast<int32_t>(query.total);
    q_rows.push_back(query.q);
  }
  step.q = at::stack(q_rows).contiguous();
  return step;
}

// The CUDA path's host plan run through the kernels' own code on the host
// (every CTA emulated: tests/models/paged_decode_emulation.h), against the
// cpu kernel: the packing of tables and totals, the scale of a dividing
// rule, the window, the split plan.
TEST(PagedAttentionCudaTest, ThePlanRunThroughTheKernelsCodeEqualsTheCpuKernel) {
  c10::InferenceMode inference;
  for (const CudaCase& c : kCudaCases) {
    SCOPED_TRACE(c.name);
    const CaseData data = MakeCase(c, 21);
    const PagedInputs& in = data.in;
    const ScoreRule& rule = data.rule;
    const at::Tensor& want = data.want;
    PagedCudaPlan plan = PlanPagedDecodeCuda(in.queries, in.key_blocks, in.value_blocks, c.window,
                                             rule, 132, c.partition);
    const cuda::PagedDecodeParams& p = plan.params;
    std::vector<at::Tensor> rows;
    for (const PagedQuery& query : in.queries) rows.push_back(query.q);
    const int32_t* tables = plan.tables_and_totals.data();
    const at::Tensor out = EmulatePlan(plan, at::stack(rows).contiguous(), in, tables,
                                       tables + static_cast<int64_t>(p.seqs) * p.table_stride);
    if (c.partition == 0 && c.totals.back() >= 300) {
      EXPECT_GT(p.max_splits, 1) << "one long sequence on 132 SMs is split";
    }
    ExpectClose(out, want, CudaTolerance(c.dtype),
                "partition " + std::to_string(p.partition) + ", " + std::to_string(p.max_splits) +
                    " splits");
  }
}

// The static step's plan (PagedDecodeAttentionCudaStatic's host half: fixed
// by a longest context four times the rows', every row's total read by the
// kernels) run through the kernels' code on the host, against the cpu kernel.
TEST(PagedAttentionCudaTest, TheStaticPlanRunThroughTheKernelsCodeEqualsTheCpuKernel) {
  c10::InferenceMode inference;
  for (const CudaCase& c : kCudaCases) {
    for (int32_t sm_count : {0, 132}) {
      SCOPED_TRACE(std::string(c.name) + ", " + std::to_string(sm_count) + " SMs");
      const CaseData data = MakeCase(c, 23);
      const PagedInputs& in = data.in;
      const ScoreRule& rule = data.rule;
      const at::Tensor& want = data.want;
      const StaticStep step = MakeStaticStep(in, c.block_size);
      PagedCudaPlan plan =
          PlanPagedDecodeCudaStatic(step.q, in.key_blocks, in.value_blocks, step.tables.size(1),
                                    step.max_total, c.window, rule, sm_count);
      const cuda::PagedDecodeParams& p = plan.params;
      const at::Tensor out = EmulatePlan(plan, step.q, in, step.tables.data_ptr<int32_t>(),
                                         step.totals.data_ptr<int32_t>());
      const int64_t max_total = step.max_total;
      ExpectClose(out, want, CudaTolerance(c.dtype),
                  "static, max_total " + std::to_string(max_total) + ", partition " +
                      std::to_string(p.partition) + ", " + std::to_string(p.max_splits) +
                      " splits");
    }
  }
}

TEST(PagedAttentionCudaTest, ThePlanRefusesWhatTheCpuKernelRefuses) {
  c10::InferenceMode inference;
  const at::Tensor blocks = at::zeros({4, 1, 2, 8});
  const std::vector<int32_t> short_table = {0};
  EXPECT_THROW(PlanPagedDecodeCuda({{at::zeros({1, 8}), short_table, 3}}, blocks, blocks,
                                   std::nullopt, {}, 0, 0),
               c10::Error);
  const std::vector<int32_t> outside = {0, 9};
  EXPECT_THROW(PlanPagedDecodeCuda({{at::zeros({1, 8}), outside, 3}}, blocks, blocks, std::nullopt,
                                   {}, 0, 0),
               c10::Error);
  const std::vector<int32_t> table = {0, 1};
  EXPECT_THROW(PlanPagedDecodeCuda({{at::zeros({3, 8}), table, 3}}, at::zeros({4, 2, 2, 8}),
                                   at::zeros({4, 2, 2, 8}), std::nullopt, {}, 0, 0),
               c10::Error);  // 3 heads over 2 kv heads
  EXPECT_THROW(PlanPagedDecodeCuda({{at::zeros({1, 8}, at::kDouble), table, 3}},
                                   at::zeros({4, 1, 2, 8}, at::kDouble),
                                   at::zeros({4, 1, 2, 8}, at::kDouble), std::nullopt, {}, 0, 0),
               c10::Error);  // float64
  // The cpu blocks are never the CUDA kernels'.
  EXPECT_FALSE(PagedCudaTakes(blocks, blocks, 1));
  if (!PagedAttentionCudaBuilt()) {
    try {
      PagedDecodeAttentionCuda({{at::zeros({1, 8}), table, 3}}, blocks, blocks, std::nullopt, {});
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("not in this build"), std::string::npos) << e.what();
    }
  }
}

// On a device: the kernels themselves against the cpu kernel on the same data.
TEST(PagedAttentionCudaTest, TheKernelsEqualTheCpuKernel) {
  if (!PagedAttentionCudaBuilt() || !at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA kernels in this build, or no CUDA device";
  }
  c10::InferenceMode inference;
  const at::Device gpu(at::kCUDA, 0);
  for (const CudaCase& c : kCudaCases) {
    SCOPED_TRACE(c.name);
    const CaseData data = MakeCase(c, 22);
    const PagedInputs& in = data.in;
    const ScoreRule& rule = data.rule;
    const at::Tensor& want = data.want;
    std::vector<PagedQuery> on_gpu = in.queries;
    for (PagedQuery& query : on_gpu) query.q = query.q.to(gpu);
    const at::Tensor keys = in.key_blocks.to(gpu), values = in.value_blocks.to(gpu);
    ASSERT_TRUE(PagedCudaTakes(keys, values, c.heads));
    for (int32_t partition : {c.partition, 16}) {
      const at::Tensor got =
          PagedDecodeAttentionCuda(on_gpu, keys, values, c.window, rule, partition).cpu();
      ExpectClose(got, want, CudaTolerance(c.dtype), "partition " + std::to_string(partition));
    }
  }
}

// On a device: the static decode step's attention (tables and totals read
// on the device, the plan fixed by a longest context above every row's)
// against the cpu kernel, on the same data.
TEST(PagedAttentionCudaTest, TheStaticStepsKernelsEqualTheCpuKernel) {
  if (!PagedAttentionCudaBuilt() || !at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA kernels in this build, or no CUDA device";
  }
  c10::InferenceMode inference;
  const at::Device gpu(at::kCUDA, 0);
  for (const CudaCase& c : kCudaCases) {
    SCOPED_TRACE(c.name);
    const CaseData data = MakeCase(c, 23);
    const PagedInputs& in = data.in;
    const ScoreRule& rule = data.rule;
    const at::Tensor& want = data.want;
    const StaticStep step = MakeStaticStep(in, c.block_size);
    const at::Tensor got =
        PagedDecodeAttentionCudaStatic(step.q.to(gpu), in.key_blocks.to(gpu),
                                       in.value_blocks.to(gpu), step.tables.to(gpu),
                                       step.totals.to(gpu), step.max_total, c.window, rule)
            .cpu();
    const int64_t max_total = step.max_total;
    ExpectClose(got, want, CudaTolerance(c.dtype),
                "static, max_total " + std::to_string(max_total));
  }
}

// The indexed write of a prompt's rows into blocks (AttendPacked's way off
// the cpu): every position lands in its block and slot, nothing else moves.
TEST(PagedAttentionCudaTest, IndexedRowsLandWhereTheTableSays) {
  c10::InferenceMode inference;
  at::manual_seed(4);
  const at::Tensor before = at::randn({9, 3, 4, 8});
  at::Tensor blocks = before.clone();
  const std::vector<int32_t> table = {7, 2, 5, 0};
  const int64_t past = 3, n = 10;  // positions 3..12: blocks 7 (slot 3), 2, 5, 0 (slot 0)
  const at::Tensor rows = at::randn({3, n, 8});
  WriteRowsIndexed(blocks, table, past, rows);
  at::Tensor want = before.clone();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t position = past + t;
    want[table[static_cast<size_t>(position / 4)]].select(1, position % 4).copy_(rows.select(1, t));
  }
  EXPECT_TRUE(at::equal(blocks, want));
}

// A step's writes at once (AttendPacked's way off the cpu): a prompt chunk
// across blocks, a chunk without a cache, a decoding chunk; every paged
// token lands at its cache's next positions, nothing else moves. Chunks on
// two stores are refused with nothing written.
TEST(PagedAttentionCudaTest, AStepsWritesLandWhereEachTableSays) {
  c10::InferenceMode inference;
  at::manual_seed(5);
  KvBlockStore store(9, 4, 2);
  KvCache prompt, decoding;
  prompt.store = decoding.store = &store;
  prompt.block_table = {7, 2, 5, 0};
  prompt.length = 3;  // positions 3..12
  decoding.block_table = {1, 8};
  decoding.length = 6;  // position 6: block 8, slot 2
  const std::vector<SequenceChunk> chunks = {{&prompt, 10, 1}, {nullptr, 2, 1}, {&decoding, 1, 1}};
  const at::Tensor k = at::randn({3, 13, 8}), v = at::randn({3, 13, 8});
  auto [key_blocks, value_blocks] = store.Layer(1, k, v);
  key_blocks.copy_(at::randn(key_blocks.sizes()));
  value_blocks.copy_(at::randn(value_blocks.sizes()));
  at::Tensor want_keys = key_blocks.clone(), want_values = value_blocks.clone();
  const auto expect_at = [&](const KvCache& cache, int64_t t, int64_t row) {
    const int64_t position = cache.length + t;
    const int64_t block = cache.block_table[static_cast<size_t>(position / 4)];
    want_keys[block].select(1, position % 4).copy_(k.select(1, row));
    want_values[block].select(1, position % 4).copy_(v.select(1, row));
  };
  for (int64_t t = 0; t < 10; ++t) expect_at(prompt, t, t);
  expect_at(decoding, 0, 12);
  ASSERT_TRUE(WriteStepBlocks(chunks, 1, k, v));
  EXPECT_TRUE(at::equal(key_blocks, want_keys));
  EXPECT_TRUE(at::equal(value_blocks, want_values));
  // The caches' lengths are the caller's to advance.
  EXPECT_EQ(prompt.length, 3);
  // The step's next layer writes at the same places (the index reused).
  auto [key_blocks0, value_blocks0] = store.Layer(0, k, v);
  key_blocks0.zero_();
  ASSERT_TRUE(WriteStepBlocks(chunks, 0, k, v));
  EXPECT_TRUE(at::equal(key_blocks0[8].select(1, 2), k.select(1, 12)));
  EXPECT_TRUE(at::equal(key_blocks0[0].select(1, 0), k.select(1, 9)));  // position 12
  // Two steps of the decoding sequence alone, one position apart: the same
  // shape of index, other places.
  for (int64_t length : {6, 7}) {
    decoding.length = length;
    const at::Tensor one = at::randn({3, 1, 8});
    ASSERT_TRUE(WriteStepBlocks({{&decoding, 1, 1}}, 1, one, one));
    EXPECT_TRUE(at::equal(key_blocks[8].select(1, length % 4), one.select(1, 0))) << length;
  }
  decoding.length = 6;

  KvBlockStore other(9, 4, 2);
  KvCache elsewhere;
  elsewhere.store = &other;
  elsewhere.block_table = {0};
  const at::Tensor before = key_blocks.clone();
  EXPECT_FALSE(WriteStepBlocks({{&prompt, 10, 1}, {&elsewhere, 1, 1}}, 1, k.narrow(1, 0, 11),
                               v.narrow(1, 0, 11)));
  EXPECT_TRUE(at::equal(key_blocks, before));
}

TEST(PagedAttentionErrorsTest, ATableTooShortOrABlockOutsideTheStoreIsRefused) {
  c10::InferenceMode inference;
  at::Tensor blocks = at::zeros({4, 1, 2, 8});
  const std::vector<int32_t> short_table = {0};
  EXPECT_THROW(
      PagedDecodeAttention({{at::zeros({1, 8}), short_table, 3}}, blocks, blocks, std::nullopt, {}),
      c10::Error);
  const std::vector<int32_t> outside = {0, 9};
  EXPECT_THROW(
      PagedDecodeAttention({{at::zeros({1, 8}), outside, 3}}, blocks, blocks, std::nullopt, {}),
      c10::Error);
  // The rows form: the same, and a row past q's tokens.
  const at::Tensor q = at::zeros({1, 2, 8});
  EXPECT_THROW(PagedDecodeAttentionRows(q, {{0, short_table, 3}}, blocks, blocks, std::nullopt, {}),
               c10::Error);
  EXPECT_THROW(PagedDecodeAttentionRows(q, {{1, outside, 3}}, blocks, blocks, std::nullopt, {}),
               c10::Error);
  const std::vector<int32_t> two = {0, 1};
  EXPECT_THROW(PagedDecodeAttentionRows(q, {{2, two, 3}}, blocks, blocks, std::nullopt, {}),
               c10::Error);
  EXPECT_EQ(PagedDecodeAttentionRows(q, {{1, two, 3}}, blocks, blocks, std::nullopt, {}).size(0),
            1);
}

// A sequence's key and value written on the cpu through a table naming a
// block outside the store: refused before anything is written (the write
// copies bytes straight into the blocks).
TEST(PagedAttentionErrorsTest, AWriteThroughABlockOutsideTheStoreIsRefused) {
  c10::InferenceMode inference;
  KvBlockStore store(4, 2, 1);
  KvCache cache;
  cache.store = &store;
  cache.block_table = {9};
  const at::Tensor q = at::ones({2, 1, 8}), k = at::ones({1, 1, 8}), v = at::ones({1, 1, 8});
  ScoreRule rule;
  EXPECT_THROW(AttendPacked(q, k, v, {{&cache, 1}}, 0, std::nullopt, rule), c10::Error);
  cache.block_table = {-1};
  EXPECT_THROW(AttendPacked(q, k, v, {{&cache, 1}}, 0, std::nullopt, rule), c10::Error);
  // Three tokens over a good block and a bad one: the good one untouched.
  cache.block_table = {1, 7};
  const at::Tensor three = at::full({1, 3, 8}, 5.0);
  EXPECT_THROW(
      AttendPacked(at::ones({2, 3, 8}), three, three, {{&cache, 3}}, 0, std::nullopt, rule),
      c10::Error);
  EXPECT_FALSE(at::equal(store.Layer(0, k, v).first[1][0][0], three[0][0]));
  // A block inside the store: written where its table says.
  cache.block_table = {3};
  (void)AttendPacked(q, k, v, {{&cache, 1}}, 0, std::nullopt, rule);
  const at::Tensor key_blocks = store.Layer(0, k, v).first;
  EXPECT_TRUE(at::equal(key_blocks[3][0][0], k[0][0]));
}

}  // namespace
}  // namespace accel::models::internal
