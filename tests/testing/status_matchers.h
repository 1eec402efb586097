// gMock matchers for absl::Status / StatusOr (abseil 20220623 has none).
//
//   EXPECT_THAT(Parse(x), IsOk());
//   EXPECT_THAT(Parse(y), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype")));
#ifndef ACCEL_TESTS_TESTING_STATUS_MATCHERS_H_
#define ACCEL_TESTS_TESTING_STATUS_MATCHERS_H_

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace accel::test {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status: " << s;
  return s.ok();
}

MATCHER_P(StatusIs, code, "has code " + absl::StatusCodeToString(code)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status: " << s;
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher,
           "has code " + absl::StatusCodeToString(code) + " and a message that " +
               ::testing::DescribeMatcher<std::string>(message_matcher)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status: " << s;
  return s.code() == code && ::testing::Matches(message_matcher)(std::string(s.message()));
}

// A StatusOr that is OK and whose value equals `expected`.
MATCHER_P(IsOkAndHolds, expected, "is OK and holds " + ::testing::PrintToString(expected)) {
  if (!arg.ok()) {
    *result_listener << "status: " << arg.status();
    return false;
  }
  *result_listener << "holds " << ::testing::PrintToString(*arg);
  return *arg == expected;
}

}  // namespace accel::test

// ASSERT that a StatusOr is OK and move its value into `lhs`.
#define ACCEL_ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  ACCEL_ASSERT_OK_AND_ASSIGN_IMPL_(ACCEL_TEST_CONCAT_(statusor_, __LINE__), lhs, rexpr)
#define ACCEL_TEST_CONCAT_INNER_(a, b) a##b
#define ACCEL_TEST_CONCAT_(a, b) ACCEL_TEST_CONCAT_INNER_(a, b)
#define ACCEL_ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                     \
  ASSERT_TRUE(statusor.ok()) << statusor.status();             \
  lhs = std::move(statusor).value()

#endif  // ACCEL_TESTS_TESTING_STATUS_MATCHERS_H_
