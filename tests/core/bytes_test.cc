// ParseByteSize against Accelerate's convert_file_size_to_int cases
// (upstream tests and derived values from ../shared/reference).
#include "core/bytes.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel {
namespace {

using ::accel::test::StatusIs;
using ::testing::HasSubstr;

TEST(ParseByteSizeTest, MatchesAccelerate) {
  struct Case {
    const char* text;
    int64_t bytes;
  };
  const Case cases[] = {
      {"0MB", 0},
      {"100MB", 100000000},
      {"2GiB", 2147483648},
      {"512KiB", 524288},
      {"1.5GB", 1500000000},
      {"100KB", 100000},
      {"10GiB", 10737418240},
      {"10GB", 10000000000},
      {"10Gb", 1250000000},  // a lowercase final b means bits
      {"10gb", 1250000000},
      {"1.5GiB", 1610612736},
      {"512MiB", 536870912},
      {"30GIB", 32212254720},
      {"10 GB", 10000000000},
      {"500", 500},            // plain digits are bytes (as an int is upstream)
      {"1TB", 1000000000000},  // ours: Accelerate stops at GB
      {"2TiB", 2199023255552},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<int64_t> got = ParseByteSize(c.text);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, c.bytes);
  }
}

TEST(ParseByteSizeTest, RejectsWhatAccelerateRejects) {
  for (const char* text : {"5MBB", "5k0MB", "-1GB", "10G", "10PB", "10T", "", "GB", "nanGB",
                           "infGiB", "0x10MB", "1e400GB"}) {
    SCOPED_TRACE(text);
    EXPECT_THAT(ParseByteSize(text),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("invalid size")));
  }
}

TEST(FormatBytesTest, PicksAReadableUnit) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(int64_t{3} << 30), "3.00 GiB");
  EXPECT_EQ(FormatBytes(int64_t{100} << 20), "100 MiB");
}

}  // namespace
}  // namespace accel
