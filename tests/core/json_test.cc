#include "core/json.h"

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "tests/testing/status_matchers.h"

namespace accel {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// Documents nlohmann's own parser is the reference for.
const char* const kDocuments[] = {
    "null",
    "true",
    "-12",
    "18446744073709551615",
    "1.5e300",
    R"("a\u00e9\ud83d\ude00")",
    "[]",
    "{}",
    R"({"b": 1, "a": [1, 2, {"c": null}], "z": {"y": {"x": "w"}}})",
    R"([[1], [2, [3, [4]]], {"k": [true, false]}])",
    R"({"dup": 1, "other": 2, "dup": 3})",
};

TEST(ParseJson, EqualsNlohmannsParser) {
  for (const char* text : kDocuments) {
    SCOPED_TRACE(text);
    ACCEL_ASSERT_OK_AND_ASSIGN(nlohmann::json parsed, ParseJson(text, "doc"));
    EXPECT_EQ(parsed, nlohmann::json::parse(text));
    ACCEL_ASSERT_OK_AND_ASSIGN(nlohmann::ordered_json ordered, ParseOrderedJson(text, "doc"));
    EXPECT_EQ(ordered, nlohmann::ordered_json::parse(text));
    // The same key order too (== on ordered_json compares as a sequence).
    EXPECT_EQ(ordered.dump(), nlohmann::ordered_json::parse(text).dump());
  }
}

TEST(ParseJson, OrderedKeepsTheTextsOrderAndTheFirstPositionOfADuplicate) {
  // Past kIndexFrom keys, so the hash index is in use.
  std::string text = "{";
  for (int i = 40; i > 0; --i) absl::StrAppend(&text, "\"k", i, "\": ", i, ", ");
  text += "\"k7\": \"last\"}";
  ACCEL_ASSERT_OK_AND_ASSIGN(nlohmann::ordered_json ordered, ParseOrderedJson(text, "doc"));
  EXPECT_EQ(ordered.dump(), nlohmann::ordered_json::parse(text).dump());
  EXPECT_EQ(ordered.begin().key(), "k40");
  EXPECT_EQ(ordered["k7"], "last");
  EXPECT_EQ(ordered.size(), 40u);
}

// 200,000 keys in one object: nlohmann::ordered_json::parse looks each new
// key up linearly (about 2 * 10^10 string comparisons here, minutes), the
// bounded parser in linear time; the test's timeout would catch a quadratic
// one. bench/core/json_bench.cc measures both.
TEST(ParseJson, ManyKeysInOneOrderedObject) {
  constexpr int kKeys = 200000;
  std::string text = "{";
  for (int i = 0; i < kKeys; ++i) absl::StrAppend(&text, i ? "," : "", "\"", i, "\":", i);
  text += "}";
  ACCEL_ASSERT_OK_AND_ASSIGN(nlohmann::ordered_json ordered, ParseOrderedJson(text, "doc"));
  ASSERT_EQ(ordered.size(), static_cast<size_t>(kKeys));
  int expected = 0;
  for (const auto& [key, value] : ordered.items()) {
    ASSERT_EQ(key, std::to_string(expected));
    ASSERT_EQ(value, expected);
    ++expected;
  }
  ACCEL_ASSERT_OK_AND_ASSIGN(nlohmann::json sorted, ParseJson(text, "doc"));
  EXPECT_EQ(sorted.size(), static_cast<size_t>(kKeys));
  EXPECT_EQ(sorted["123456"], 123456);
}

TEST(ParseJson, KeysAreCountedOverTheWholeText) {
  JsonLimits limits;
  limits.max_keys = 4;
  EXPECT_THAT(ParseJson(R"([{"a": 1, "b": 2}, {"c": 3, "d": 4}])", "body", limits), IsOk());
  EXPECT_THAT(ParseJson(R"([{"a": 1, "b": 2}, {"c": 3, "d": 4, "e": 5}])", "body", limits),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("body: "), HasSubstr("more than 4 object keys"))));
  EXPECT_THAT(ParseOrderedJson(R"({"a": {"b": {"c": {"d": {"e": 1}}}}})", "body", limits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than 4")));
}

TEST(ParseJson, AKeyTotalSpansSeveralTexts) {
  int64_t total = 0;
  JsonLimits limits;
  limits.max_keys = 5;
  limits.key_total = &total;
  EXPECT_THAT(ParseJson(R"({"a": 1, "b": 2})", "tools[0]", limits), IsOk());
  EXPECT_EQ(total, 2);
  EXPECT_THAT(ParseOrderedJson(R"({"c": {"d": 1}})", "tools[1]", limits), IsOk());
  EXPECT_EQ(total, 4);
  EXPECT_THAT(ParseJson(R"({"e": 1, "f": 2})", "tools[2]", limits),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tools[2]: has more than 5 object keys (with the fields before")));
}

TEST(ParseJson, DepthIsBounded) {
  JsonLimits limits;
  limits.max_depth = 3;
  EXPECT_THAT(ParseJson("[[[1]]]", "doc", limits), IsOk());
  EXPECT_THAT(ParseJson(R"({"a": [{"b": 1}]})", "doc", limits), IsOk());
  EXPECT_THAT(
      ParseJson("[[[[1]]]]", "doc", limits),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("doc: nests deeper than 3 levels")));
  EXPECT_THAT(ParseOrderedJson(R"({"a": {"b": {"c": {}}}})", "doc", limits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("deeper than 3")));
  // A million levels: refused at the limit, long before anything recurses.
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  EXPECT_THAT(ParseJson(deep, "doc"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("deeper than 64")));
  EXPECT_THAT(ParseOrderedJson(std::string(1000000, '{'), "doc"),
              StatusIs(absl::StatusCode::kInvalidArgument, Not(HasSubstr("{{{{"))));
}

TEST(ParseJson, DuplicateKeysRefusedWhenAsked) {
  JsonLimits limits;
  limits.refuse_duplicate_keys = true;
  const std::string text = R"({"a": 1, "b": {"a": 2}, "a": 3})";
  EXPECT_THAT(ParseJson(text, "header", limits),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("header: the key \"a\" appears twice in one object")));
  EXPECT_THAT(ParseOrderedJson(text, "header", limits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"a\" appears twice")));
  // The same key in different objects is no duplicate.
  EXPECT_THAT(ParseJson(R"({"a": 1, "b": {"a": 2}})", "header", limits), IsOk());
  // Without the flag the last wins, as nlohmann and Python do.
  ACCEL_ASSERT_OK_AND_ASSIGN(nlohmann::json last, ParseJson(text, "header"));
  EXPECT_EQ(last["a"], 3);
  // A long duplicate key is shown cut.
  const std::string long_key(1000, 'k');
  EXPECT_THAT(
      ParseJson(absl::StrCat("{\"", long_key, "\": 1, \"", long_key, "\": 2}"), "h", limits),
      StatusIs(absl::StatusCode::kInvalidArgument, Not(HasSubstr(long_key))));
}

TEST(ParseJson, CheckStopsTheParseWithItsStatus) {
  std::string text = "[";
  for (int i = 0; i < 100000; ++i) absl::StrAppend(&text, i ? "," : "", i);
  text += "]";
  int calls = 0;
  JsonLimits limits;
  limits.check = [&calls] {
    ++calls;
    return absl::OkStatus();
  };
  ASSERT_THAT(ParseJson(text, "doc", limits), IsOk());
  // One token for the array, 100,000 numbers.
  EXPECT_EQ(calls, 100001 / kJsonCheckInterval);

  calls = 0;
  limits.check = [&calls] {
    return ++calls == 3 ? absl::CancelledError("the client went away") : absl::OkStatus();
  };
  EXPECT_THAT(ParseOrderedJson(text, "doc", limits),
              StatusIs(absl::StatusCode::kCancelled, "the client went away"));
  EXPECT_EQ(calls, 3);
}

TEST(ParseJson, InvalidJsonNamesWhatAndDoesNotEchoTheText) {
  EXPECT_THAT(ParseJson(R"({"a": tru_secret_bytes})", "config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("config.json: invalid JSON ("), HasSubstr("line 1"),
                             Not(HasSubstr("secret")), Not(HasSubstr("json.exception")))));
  EXPECT_THAT(ParseJson("", "empty"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty: invalid JSON")));
  EXPECT_THAT(ParseJson("[1] 2", "trailing"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trailing: invalid JSON")));
  // Invalid UTF-8 in a string.
  EXPECT_THAT(ParseOrderedJson("[\"\xff\"]", "utf8"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("utf8: invalid JSON")));
}

}  // namespace
}  // namespace accel
