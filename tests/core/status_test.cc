#include "core/status.h"

#include <new>
#include <stdexcept>

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  ACCEL_ASSIGN_OR_RETURN(int h, Half(x));
  ACCEL_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

absl::Status Check(int x) {
  ACCEL_RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, PropagateTheFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_THAT(Quarter(6), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("odd")));
  EXPECT_THAT(Check(4), IsOk());
  EXPECT_THAT(Check(5), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CallTorchTest, TorchErrorsBecomeStatusesWithoutTheBacktrace) {
  absl::Status s = CallTorch([] { at::ones({2, 3}).matmul(at::ones({2, 3})); });
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal, HasSubstr("cannot be multiplied")));
  EXPECT_THAT(std::string(s.message()), Not(HasSubstr("\n")));
  EXPECT_THAT(CallTorch([] { at::ones({2}).index_select(0, at::tensor({5}, at::kLong)); }),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CallTorchTest, MapsOtherExceptions) {
  EXPECT_THAT(CallTorch([] { throw std::bad_alloc(); }),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(CallTorch([] { throw std::runtime_error("boom"); }),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("boom")));
  EXPECT_THAT(CallTorch([] {}), IsOk());
}

TEST(ErrnoStatusTest, MapsCommonErrors) {
  EXPECT_THAT(ErrnoStatus(ENOENT, "opening x"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("opening x: No such file")));
  EXPECT_THAT(ErrnoStatus(ENOSPC, "w"), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(ErrnoStatus(EACCES, "w"), StatusIs(absl::StatusCode::kPermissionDenied));
}

TEST(AnnotateTest, PrefixesContextAndKeepsTheCode) {
  EXPECT_THAT(Annotate(absl::NotFoundError("gone"), "loading w"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("loading w: gone")));
  EXPECT_THAT(Annotate(absl::OkStatus(), "x"), IsOk());
}

}  // namespace
}  // namespace accel
