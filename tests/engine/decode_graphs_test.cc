// The batch-size buckets of padded decode steps against vLLM's list (1, 2,
// 4, then multiples of 8), and the bucket a batch is padded to.
#include "engine/decode_graphs.h"

#include <cstdint>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accel::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(DecodeBatchBucketsTest, VllmsListUpToTheLargestBatch) {
  EXPECT_THAT(DecodeBatchBuckets(1), ElementsAre(1));
  EXPECT_THAT(DecodeBatchBuckets(3), ElementsAre(1, 2, 4));
  EXPECT_THAT(DecodeBatchBuckets(8), ElementsAre(1, 2, 4, 8));
  EXPECT_THAT(DecodeBatchBuckets(9), ElementsAre(1, 2, 4, 8, 16));
  EXPECT_THAT(DecodeBatchBuckets(32), ElementsAre(1, 2, 4, 8, 16, 24, 32));
  EXPECT_THAT(DecodeBatchBuckets(0), IsEmpty());
  // Capped at 256 by default, and at a smaller largest when asked.
  const std::vector<int64_t> all = DecodeBatchBuckets(1000);
  ASSERT_EQ(all.size(), 3u + 32u);
  EXPECT_EQ(all.back(), 256);
  for (size_t i = 3; i < all.size(); ++i) EXPECT_EQ(all[i], 8 * static_cast<int64_t>(i - 2));
  EXPECT_THAT(DecodeBatchBuckets(1000, 20), ElementsAre(1, 2, 4, 8, 16, 24));
}

TEST(DecodeBatchBucketsTest, ABatchTakesTheSmallestBucketThatHoldsIt) {
  const std::vector<int64_t> buckets = DecodeBatchBuckets(32);
  // Written out: what each batch size pads to.
  const int64_t expected[33] = {0,  1,  2,  4,  4,  8,  8,  8,  8,  16, 16, 16, 16, 16, 16, 16, 16,
                                24, 24, 24, 24, 24, 24, 24, 24, 32, 32, 32, 32, 32, 32, 32, 32};
  for (int64_t batch = 1; batch <= 32; ++batch) {
    EXPECT_EQ(DecodeBucketFor(buckets, batch), expected[batch]) << batch;
  }
  EXPECT_EQ(DecodeBucketFor(buckets, 33), std::nullopt);  // above the largest: eager
  EXPECT_EQ(DecodeBucketFor(buckets, 0), std::nullopt);
  EXPECT_EQ(DecodeBucketFor({}, 1), std::nullopt);
}

}  // namespace
}  // namespace accel::engine
