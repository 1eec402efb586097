#include "core/dtype.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel {
namespace {

using ::accel::test::StatusIs;
using ::testing::HasSubstr;

TEST(DTypeTest, ParsesTorchSpellingsAndAliases) {
  EXPECT_EQ(*ParseDType("float32"), c10::ScalarType::Float);
  EXPECT_EQ(*ParseDType("torch.bfloat16"), c10::ScalarType::BFloat16);
  EXPECT_EQ(*ParseDType("half"), c10::ScalarType::Half);
  EXPECT_EQ(*ParseDType("long"), c10::ScalarType::Long);
  EXPECT_EQ(*ParseDType("bool"), c10::ScalarType::Bool);
}

TEST(DTypeTest, NamesRoundTrip) {
  for (auto t : {c10::ScalarType::Float, c10::ScalarType::Half, c10::ScalarType::BFloat16,
                 c10::ScalarType::Double, c10::ScalarType::Long, c10::ScalarType::Int,
                 c10::ScalarType::Short, c10::ScalarType::Char, c10::ScalarType::Byte,
                 c10::ScalarType::Bool}) {
    EXPECT_EQ(*ParseDType(DTypeName(t)), t) << DTypeName(t);
  }
  EXPECT_EQ(DTypeName(c10::ScalarType::BFloat16), "bfloat16");
}

TEST(DTypeTest, UnknownNameListsTheKnownOnes) {
  EXPECT_THAT(ParseDType("float31"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("'float31'"), HasSubstr("bfloat16"))));
}

}  // namespace
}  // namespace accel
