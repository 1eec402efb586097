#include "core/placement.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel {
namespace {

using ::accel::test::StatusIs;
using ::testing::HasSubstr;

TEST(PlacementTest, ParsesEverySpelling) {
  EXPECT_EQ(*Placement::Parse("0"), Placement::Cuda(0));
  EXPECT_EQ(*Placement::Parse("3"), Placement::Cuda(3));
  EXPECT_EQ(*Placement::Parse("cuda:1"), Placement::Cuda(1));
  EXPECT_EQ(*Placement::Parse("cuda"), Placement::Cuda(0));
  EXPECT_EQ(*Placement::Parse(" CPU "), Placement::Cpu());
  EXPECT_EQ(*Placement::Parse("disk"), Placement::Disk());
}

TEST(PlacementTest, RejectsOthersNamingThem) {
  for (const char* bad : {"mps", "gpu", "-1", "cuda:-1", "cuda:x", "", "1.5"}) {
    EXPECT_THAT(Placement::Parse(bad),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown device")))
        << bad;
  }
}

TEST(PlacementTest, OrdersGpusThenCpuThenDisk) {
  EXPECT_LT(Placement::Cuda(0), Placement::Cuda(1));
  EXPECT_LT(Placement::Cuda(7), Placement::Cpu());
  EXPECT_LT(Placement::Cpu(), Placement::Disk());
  EXPECT_EQ(Placement::Cuda(2).ToString(), "2");
  EXPECT_EQ(Placement::Cuda(2).DeviceString(), "cuda:2");
  EXPECT_EQ(Placement::Disk().DeviceString(), "disk");
}

}  // namespace
}  // namespace accel
