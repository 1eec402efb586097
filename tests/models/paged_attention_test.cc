// Decode attention over a paged KV cache against the contiguous cache's
// attention (the matmul path of AttendPacked, itself checked against
// transformers through the model tests): the same keys and values written
// into shuffled blocks give the same output, with grouped heads, a sliding
// window, a softcap, and in float32 and bfloat16.
#include "models/internal/paged_attention.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "models/causal_lm.h"
#include "models/internal/packed.h"

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
  // Both instruction paths: the plain loops, and AVX2 where the cpu has it.
  for (bool portable : {true, false}) {
    const bool avx2 = UsePortablePagedAttention(portable);
    at::Tensor got = PagedDecodeAttention(queries, key_blocks, value_blocks, c.window, rule);
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
}

}  // namespace
}  // namespace accel::models::internal
