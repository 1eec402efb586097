// The strict safetensors header check: every malformed input is a clear
// error naming the file (and the tensor where there is one), never a crash.
#include "loader/internal/safetensors_format.h"

#include <cstdint>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::loader::internal {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
constexpr absl::StatusCode kDataLoss = absl::StatusCode::kDataLoss;

std::string Le64(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A file: the length of `header`, `header`, then `data`.
std::string File(const std::string& header, const std::string& data) {
  return Le64(header.size()) + header + data;
}

absl::StatusOr<ParsedHeader> Parse(const std::string& bytes) {
  return ParseSafetensors(bytes, "w.safetensors");
}

TEST(SafetensorsFormatTest, ParsesValidHeaderInDataOrder) {
  std::string header = R"({"__metadata__":{"format":"pt"},)"
                       R"("b":{"dtype":"F16","shape":[3],"data_offsets":[8,14]},)"
                       R"("a":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]}})";
  ACCEL_ASSERT_OK_AND_ASSIGN(ParsedHeader parsed, Parse(File(header, std::string(14, 'x'))));
  ASSERT_EQ(parsed.tensors.size(), 2u);
  EXPECT_EQ(parsed.tensors[0].name, "a");
  EXPECT_EQ(parsed.tensors[0].dtype, "F32");
  EXPECT_EQ(parsed.tensors[0].shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(parsed.tensors[1].name, "b");
  EXPECT_EQ(parsed.tensors[1].nbytes(), 6u);
  EXPECT_EQ(parsed.metadata.at("format"), "pt");
  EXPECT_EQ(parsed.data_offset, 8 + header.size());
}

TEST(SafetensorsFormatTest, AcceptsSpacePaddingScalarsAndEmptyTensors) {
  std::string header = R"({"s":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
                       R"("e":{"dtype":"BF16","shape":[0,4],"data_offsets":[8,8]}})";
  header += "     ";
  ACCEL_ASSERT_OK_AND_ASSIGN(ParsedHeader parsed, Parse(File(header, std::string(8, '\0'))));
  ASSERT_EQ(parsed.tensors.size(), 2u);
  EXPECT_EQ(parsed.tensors[0].name, "s");
  EXPECT_EQ(parsed.tensors[0].numel(), 1);
  EXPECT_EQ(parsed.tensors[1].name, "e");
  EXPECT_EQ(parsed.tensors[1].numel(), 0);
}

TEST(SafetensorsFormatTest, AcceptsHeaderWithNoTensors) {
  EXPECT_THAT(Parse(File("{}", "")), IsOk());
}

TEST(SafetensorsFormatTest, EmptyFileIsDataLoss) {
  EXPECT_THAT(Parse(""),
              StatusIs(kDataLoss, AllOf(HasSubstr("w.safetensors"), HasSubstr("0 bytes"))));
}

TEST(SafetensorsFormatTest, FileShorterThanLengthFieldIsDataLoss) {
  EXPECT_THAT(Parse("\x05\0\0"), StatusIs(kDataLoss, HasSubstr("too short")));
}

TEST(SafetensorsFormatTest, HeaderLengthPastEndIsDataLoss) {
  EXPECT_THAT(Parse(Le64(1000) + "{}"), StatusIs(kDataLoss, AllOf(HasSubstr("header length 1000"),
                                                                  HasSubstr("past the end"))));
}

TEST(SafetensorsFormatTest, AbsurdHeaderLengthIsRejectedBeforeReading) {
  EXPECT_THAT(Parse(Le64(UINT64_MAX) + "{}"), StatusIs(kInvalid, HasSubstr("exceeds the limit")));
  EXPECT_THAT(Parse(Le64(kMaxHeaderBytes + 1) + "{}"),
              StatusIs(kInvalid, HasSubstr("exceeds the limit")));
}

TEST(SafetensorsFormatTest, HeaderNotStartingWithBraceIsInvalid) {
  EXPECT_THAT(Parse(File("[1,2]", "")), StatusIs(kInvalid, HasSubstr("does not start with '{'")));
  EXPECT_THAT(Parse(File("", "")), StatusIs(kInvalid, HasSubstr("does not start with '{'")));
}

TEST(SafetensorsFormatTest, BadJsonIsInvalid) {
  EXPECT_THAT(Parse(File(R"({"a": {"dtype": )", "")),
              StatusIs(kInvalid, HasSubstr("header: invalid JSON")));
  EXPECT_THAT(Parse(File(R"({} trailing)", "")),
              StatusIs(kInvalid, HasSubstr("header: invalid JSON")));
}

TEST(SafetensorsFormatTest, NulByteInHeaderIsInvalid) {
  EXPECT_THAT(Parse(File(std::string("{}\0junk", 7), "")), StatusIs(kInvalid, HasSubstr("NUL")));
}

TEST(SafetensorsFormatTest, InvalidUtf8IsInvalid) {
  EXPECT_THAT(Parse(File("{\"\xff\xfe\":1}", "")),
              StatusIs(kInvalid, HasSubstr("header: invalid JSON")));
}

TEST(SafetensorsFormatTest, DeeplyNestedJsonIsAnErrorNotACrash) {
  std::string deep = R"({"a":{"dtype":"F32","shape":)" + std::string(200000, '[') +
                     std::string(200000, ']') + R"(,"data_offsets":[0,0]}})";
  EXPECT_THAT(Parse(File(deep, "")),
              StatusIs(kInvalid, HasSubstr("header: nests deeper than 16 levels")));
  std::string in_string = R"({"__metadata__":{"k":")" + std::string(5000, '[') + R"("}})";
  EXPECT_THAT(Parse(File(in_string, "")), IsOk());
}

TEST(SafetensorsFormatTest, UnknownDtypeNamesTensorAndDtype) {
  EXPECT_THAT(
      Parse(
          File(R"({"w":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", std::string(16, 0))),
      StatusIs(kInvalid, AllOf(HasSubstr("tensor 'w'"), HasSubstr("unknown dtype 'F128'"))));
}

TEST(SafetensorsFormatTest, NegativeOrFractionalDimsAreInvalid) {
  EXPECT_THAT(Parse(File(R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", "")),
              StatusIs(kInvalid, AllOf(HasSubstr("tensor 'w'"), HasSubstr("-1"))));
  EXPECT_THAT(Parse(File(R"({"w":{"dtype":"U8","shape":[2.5],"data_offsets":[0,0]}})", "")),
              StatusIs(kInvalid, HasSubstr("not a non-negative integer")));
  EXPECT_THAT(Parse(File(R"({"w":{"dtype":"U8","shape":["2"],"data_offsets":[0,2]}})", "xx")),
              StatusIs(kInvalid, HasSubstr("not a non-negative integer")));
}

TEST(SafetensorsFormatTest, DimensionProductOverflowIsInvalid) {
  EXPECT_THAT(
      Parse(File(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})",
                 "")),
      StatusIs(kInvalid, AllOf(HasSubstr("tensor 'w'"), HasSubstr("overflows"))));
  EXPECT_THAT(
      Parse(
          File(R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", "")),
      StatusIs(kInvalid, HasSubstr("overflows")));
  EXPECT_THAT(
      Parse(
          File(R"({"w":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,0]}})", "")),
      StatusIs(kInvalid, HasSubstr("not a non-negative integer")));
}

// Found by tests/fuzz/safetensors_header_fuzz (UBSan in TensorInfo::numel()):
// 2^62 * 2 fits uint64 but not int64, and the trailing 0 made the byte count 0.
TEST(SafetensorsFormatTest, PartialProductOverflowingInt64IsInvalidEvenWithAZeroDim) {
  const std::string file =
      File(R"({"w":{"dtype":"U8","shape":[4611686018427387904,2,0],"data_offsets":[0,0]}})", "");
  EXPECT_THAT(Parse(file),
              StatusIs(kInvalid, AllOf(HasSubstr("tensor 'w'"), HasSubstr("overflows"))));
  // A 0 before the large dims keeps every partial product at 0: still valid.
  ACCEL_ASSERT_OK_AND_ASSIGN(
      ParsedHeader parsed,
      Parse(File(R"({"w":{"dtype":"U8","shape":[0,4611686018427387904,2],"data_offsets":[0,0]}})",
                 "")));
  EXPECT_EQ(parsed.tensors[0].numel(), 0);
}

TEST(SafetensorsFormatTest, ByteCountMustMatchShapeAndDtype) {
  EXPECT_THAT(
      Parse(File(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,10]}})", std::string(10, 0))),
      StatusIs(kInvalid,
               AllOf(HasSubstr("tensor 'w'"), HasSubstr("hold 10 bytes"), HasSubstr("need 12"))));
}

TEST(SafetensorsFormatTest, OffsetsEndingBeforeTheyBeginAreInvalid) {
  EXPECT_THAT(Parse(File(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", "xxxx")),
              StatusIs(kInvalid, HasSubstr("end before they begin")));
}

TEST(SafetensorsFormatTest, OverlappingTensorsAreInvalid) {
  std::string header = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})";
  EXPECT_THAT(Parse(File(header, std::string(6, 0))),
              StatusIs(kInvalid, AllOf(HasSubstr("tensor 'b'"), HasSubstr("overlaps"),
                                       HasSubstr("tensor 'a' ends at 4"))));
}

TEST(SafetensorsFormatTest, IdenticalRangesAreOverlaps) {
  std::string header = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  EXPECT_THAT(Parse(File(header, std::string(4, 0))), StatusIs(kInvalid, HasSubstr("overlaps")));
}

TEST(SafetensorsFormatTest, GapsAreInvalid) {
  std::string header = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                       R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})";
  EXPECT_THAT(Parse(File(header, std::string(6, 0))),
              StatusIs(kInvalid, AllOf(HasSubstr("tensor 'b'"), HasSubstr("gap"))));
  EXPECT_THAT(Parse(File(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", "xxx")),
              StatusIs(kInvalid, AllOf(HasSubstr("gap"), HasSubstr("starts at 0"))));
}

TEST(SafetensorsFormatTest, TensorPastEndOfDataIsDataLoss) {
  EXPECT_THAT(
      Parse(File(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(9, 0))),
      StatusIs(kDataLoss, AllOf(HasSubstr("tensor 'w'"), HasSubstr("truncated"))));
}

TEST(SafetensorsFormatTest, TrailingBytesNoTensorOwnsAreInvalid) {
  EXPECT_THAT(Parse(File(R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "xxxx")),
              StatusIs(kInvalid, HasSubstr("trailing bytes")));
}

TEST(SafetensorsFormatTest, DuplicateNamesAreInvalid) {
  std::string header = R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                       R"("w":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})";
  EXPECT_THAT(Parse(File(header, "xxxx")),
              StatusIs(kInvalid, HasSubstr("header: the key \"w\" appears twice in one object")));
  // A field given twice inside a tensor's entry, too: another reader could
  // take the first one.
  header = R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"dtype":"I8"}})";
  EXPECT_THAT(Parse(File(header, "xx")), StatusIs(kInvalid, HasSubstr("\"dtype\" appears twice")));
}

TEST(SafetensorsFormatTest, MalformedMetadataIsInvalid) {
  EXPECT_THAT(Parse(File(R"({"__metadata__":{"n":3}})", "")),
              StatusIs(kInvalid, AllOf(HasSubstr("__metadata__"), HasSubstr("'n'"))));
  EXPECT_THAT(Parse(File(R"({"__metadata__":"pt"})", "")),
              StatusIs(kInvalid, HasSubstr("__metadata__")));
}

TEST(SafetensorsFormatTest, MissingOrMalformedFieldsNameTheField) {
  EXPECT_THAT(Parse(File(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", "x")),
              StatusIs(kInvalid, AllOf(HasSubstr("tensor 'w'"), HasSubstr("\"dtype\""))));
  EXPECT_THAT(Parse(File(R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", "x")),
              StatusIs(kInvalid, HasSubstr("\"shape\"")));
  EXPECT_THAT(Parse(File(R"({"w":{"dtype":"U8","shape":[1]}})", "x")),
              StatusIs(kInvalid, HasSubstr("\"data_offsets\"")));
  EXPECT_THAT(Parse(File(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", "x")),
              StatusIs(kInvalid, HasSubstr("[begin, end]")));
  EXPECT_THAT(Parse(File(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,-1]}})", "x")),
              StatusIs(kInvalid, HasSubstr("non-negative")));
  EXPECT_THAT(Parse(File(R"({"w":[1,2]})", "")),
              StatusIs(kInvalid, HasSubstr("not a JSON object")));
  EXPECT_THAT(Parse(File(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", "x")),
              StatusIs(kInvalid, HasSubstr("not a string")));
}

TEST(SafetensorsFormatTest, SerializedHeaderIsByteExactWithTheReferenceWriter) {
  // What the safetensors reference writer produces for {"a": zeros(2)} with
  // metadata {"format": "pt"}: compact JSON, fields in this order, padded
  // with spaces to a multiple of 8.
  TensorInfo a{"a", "F32", {2}, 0, 8};
  std::string bytes = SerializeHeader({a}, {{"format", "pt"}});
  std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  json.append((8 - json.size() % 8) % 8, ' ');
  EXPECT_EQ(bytes, Le64(json.size()) + json);
  EXPECT_EQ(bytes.size() % 8, 0u);
  ACCEL_ASSERT_OK_AND_ASSIGN(ParsedHeader parsed, Parse(bytes + std::string(8, '\0')));
  EXPECT_EQ(parsed.tensors[0].name, "a");
}

TEST(SafetensorsFormatTest, KnowsEveryByteSizedDtypeOfTheFormat) {
  EXPECT_EQ(DTypeElementSize("BOOL"), 1);
  EXPECT_EQ(DTypeElementSize("F8_E4M3"), 1);
  EXPECT_EQ(DTypeElementSize("BF16"), 2);
  EXPECT_EQ(DTypeElementSize("U32"), 4);
  EXPECT_EQ(DTypeElementSize("F64"), 8);
  EXPECT_EQ(DTypeElementSize("f32"), std::nullopt);
}

}  // namespace
}  // namespace accel::loader::internal
