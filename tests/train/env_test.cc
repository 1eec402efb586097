// Accelerate's names for the distributed and precision modes.
#include "train/env.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

TEST(Names, PrecisionAndDistributedType) {
  EXPECT_THAT(ParsePrecision("BF16"), IsOk());
  EXPECT_EQ(*ParsePrecision("fp16"), PrecisionType::kFp16);
  EXPECT_THAT(ParsePrecision("fp8"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fp8")));
  EXPECT_THAT(ParsePrecision("half"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"half\"")));
  for (PrecisionType p : {PrecisionType::kNo, PrecisionType::kFp16, PrecisionType::kBf16}) {
    EXPECT_EQ(*ParsePrecision(PrecisionName(p)), p);
  }
  for (DistributedType t :
       {DistributedType::kNo, DistributedType::kMultiCpu, DistributedType::kMultiGpu}) {
    EXPECT_EQ(*ParseDistributedType(DistributedTypeName(t)), t);
  }
  EXPECT_THAT(ParseDistributedType("DEEPSPEED"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"DEEPSPEED\"")));
  EXPECT_EQ(*ParseDistributedType("multi_cpu"), DistributedType::kMultiCpu);
  EXPECT_EQ(DistributedTypeName(DistributedType::kMultiGpu), "MULTI_GPU");
  EXPECT_EQ(PrecisionName(PrecisionType::kBf16), "bf16");
  EXPECT_THAT(ParsePrecision("fp8"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("use no, fp16 or bf16")));
}

}  // namespace
}  // namespace accel::train
