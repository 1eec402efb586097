// SafetensorsFile on disk: zero-copy tensors over the mapping, every dtype,
// and the errors for files that are missing, empty or not files at all.
#include <cstring>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/torch_compat.h"
#include "loader/loader.h"
#include "tests/testing/process_memory.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::loader {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string Le64(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// One tensor of each dtype libtorch 1.13 has, with values that exercise the
// whole type (negative, fractional, extremes).
std::vector<NamedTensor> EveryDtype() {
  at::manual_seed(7);
  return {
      {"f64", at::randn({3, 2}, at::kDouble)},
      {"f32", at::randn({4, 5})},
      {"f16", at::randn({7}).to(at::kHalf)},
      {"bf16", at::randn({2, 3, 2}).to(at::kBFloat16)},
      {"i64", at::arange(-5, 5, at::kLong) * int64_t{1000000000000}},
      {"i32", at::arange(-6, 6, at::kInt) * 100000},
      {"i16", at::arange(-4, 4, at::kShort) * 1000},
      {"i8", at::arange(-128, 128, 17, at::kChar)},
      {"u8", at::arange(0, 256, 9, at::kByte)},
      {"bool", at::randn({9}) > 0},
      {"scalar", at::scalar_tensor(3.5)},
      {"empty", at::empty({0, 3})},
  };
}

TEST(SafetensorsFileTest, RoundTripsEveryDtypeBitExactly) {
  TempDir dir;
  std::vector<NamedTensor> tensors = EveryDtype();
  ASSERT_THAT(WriteSafetensors(dir.File("all.safetensors"), tensors, {{"format", "pt"}}), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file,
                             SafetensorsFile::Open(dir.File("all.safetensors")));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  ASSERT_EQ(file.tensors().size(), tensors.size());
  for (const auto& [name, expected] : tensors) {
    SCOPED_TRACE(name);
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor got, file.Tensor(name));
    EXPECT_EQ(got.scalar_type(), expected.scalar_type());
    EXPECT_EQ(got.sizes(), expected.sizes());
    EXPECT_TRUE(at::equal(got, expected));
  }
}

TEST(SafetensorsFileTest, SpellsDtypesAsTheFormatDoes) {
  TempDir dir;
  ASSERT_THAT(WriteSafetensors(dir.File("d.safetensors"), EveryDtype()), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file,
                             SafetensorsFile::Open(dir.File("d.safetensors")));
  EXPECT_EQ(file.Find("f64")->dtype, "F64");
  EXPECT_EQ(file.Find("bf16")->dtype, "BF16");
  EXPECT_EQ(file.Find("f16")->dtype, "F16");
  EXPECT_EQ(file.Find("i8")->dtype, "I8");
  EXPECT_EQ(file.Find("u8")->dtype, "U8");
  EXPECT_EQ(file.Find("bool")->dtype, "BOOL");
  EXPECT_EQ(file.Find("nope"), nullptr);
}

TEST(SafetensorsFileTest, TensorsAliasTheMappingAndOutliveTheFile) {
  TempDir dir;
  at::Tensor w = at::arange(1024, at::kFloat);
  ASSERT_THAT(WriteSafetensors(dir.File("w.safetensors"), {{"w", w}}), IsOk());
  at::Tensor a, b;
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file,
                               SafetensorsFile::Open(dir.File("w.safetensors")));
    ACCEL_ASSERT_OK_AND_ASSIGN(a, file.Tensor("w"));
    ACCEL_ASSERT_OK_AND_ASSIGN(b, file.Tensor("w"));
    // Zero-copy: both point at the same mapped bytes, the file's own.
    EXPECT_EQ(a.data_ptr(), b.data_ptr());
    EXPECT_EQ(static_cast<const void*>(file.Bytes(*file.Find("w")).data()), a.data_ptr());
  }
  EXPECT_TRUE(at::equal(a, w));  // The file object is gone; the mapping is not.
}

// A slice of a tensor mapped on its own: the same values, zero-copy, in a
// mapping of the file that spans only the slice's pages (so a fault on it
// cannot map its neighbours), valid after the file object is gone, and
// copy-on-write as the file's mapping is.
TEST(SafetensorsFileTest, MapAloneMapsOnlyTheSlicesPages) {
  TempDir dir;
  // 4 MiB of float32 rows of 64 KiB: rows 20-35 of 64 start mid-file.
  const at::Tensor w = at::arange(64 * 16384, at::kFloat).reshape({64, 16384});
  ASSERT_THAT(WriteSafetensors(dir.File("w.safetensors"), {{"w", w}}), IsOk());
  const std::string file_path = std::filesystem::canonical(dir.File("w.safetensors")).string();
  at::Tensor alone;
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file, SafetensorsFile::Open(file_path));
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor whole, file.Tensor("w"));
    const at::Tensor rows = whole.narrow(0, 20, 16);
    ACCEL_ASSERT_OK_AND_ASSIGN(alone, file.MapAlone(rows));
    EXPECT_NE(alone.data_ptr(), rows.data_ptr());
    // Neither a column slice (not contiguous) nor bytes of another mapping.
    EXPECT_THAT(file.MapAlone(whole.narrow(1, 0, 8)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(file_path), HasSubstr("not a contiguous"))));
    EXPECT_THAT(file.MapAlone(at::zeros({4})),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not in the file's")));
  }
  EXPECT_TRUE(at::equal(alone, w.narrow(0, 20, 16)));  // read after the file object is gone
  const auto at = reinterpret_cast<uintptr_t>(alone.data_ptr());
  bool found = false;
  for (const test::Mapping& m : test::ReadMappings()) {
    if (m.begin <= at && at < m.end) {
      found = true;
      EXPECT_EQ(m.path, file_path);
      // Its 1 MiB and at most the page it starts in beyond.
      EXPECT_LE(m.end - m.begin, alone.nbytes() + static_cast<size_t>(::sysconf(_SC_PAGESIZE)));
    }
  }
  EXPECT_TRUE(found);
  alone.fill_(1.0f);  // copy-on-write: the file keeps its bytes
  ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile again, SafetensorsFile::Open(file_path));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor reread, again.Tensor("w"));
  EXPECT_TRUE(at::equal(reread, w));
}

TEST(SafetensorsFileTest, WritingToATensorNeverChangesTheFile) {
  TempDir dir;
  ASSERT_THAT(WriteSafetensors(dir.File("w.safetensors"), {{"w", at::zeros({16})}}), IsOk());
  std::string before = test::ReadAll(dir.File("w.safetensors"));
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file,
                               SafetensorsFile::Open(dir.File("w.safetensors")));
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor t, file.Tensor("w"));
    t.fill_(42.0);
    EXPECT_EQ(t[3].item<float>(), 42.0f);
  }
  EXPECT_EQ(test::ReadAll(dir.File("w.safetensors")), before);
}

TEST(SafetensorsFileTest, PopulateLoadsTheSameTensors) {
  TempDir dir;
  ASSERT_THAT(WriteSafetensors(dir.File("w.safetensors"), EveryDtype()), IsOk());
  OpenOptions options;
  options.populate = true;
  ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file,
                             SafetensorsFile::Open(dir.File("w.safetensors"), options));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor t, file.Tensor("f32"));
  EXPECT_TRUE(at::equal(t, EveryDtype()[1].second));
}

TEST(SafetensorsFileTest, UnalignedDataIsCopiedToAnAlignedTensor) {
  // Another writer's layout: a 3-byte U8 tensor first leaves the F32 tensor
  // at an odd address.
  std::string header = R"({"u":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                       R"("f":{"dtype":"F32","shape":[2],"data_offsets":[3,11]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  float values[2] = {1.5f, -2.25f};
  std::string data = "abc" + std::string(reinterpret_cast<const char*>(values), 8);
  TempDir dir;
  std::string path = dir.Write("odd.safetensors", Le64(header.size()) + header + data);
  ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file, SafetensorsFile::Open(path));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor f, file.Tensor("f"));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data_ptr()) % alignof(float), 0u);
  EXPECT_EQ(f[0].item<float>(), 1.5f);
  EXPECT_EQ(f[1].item<float>(), -2.25f);
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor u, file.Tensor("u"));
  EXPECT_EQ(u[2].item<uint8_t>(), 'c');
}

TEST(SafetensorsFileTest, Float8NeedsALibtorchThatHasIt) {
  std::string header = R"({"e":{"dtype":"F8_E5M2","shape":[2],"data_offsets":[0,2]}})";
  TempDir dir;
  std::string path = dir.Write("f8.safetensors", Le64(header.size()) + header + "\x3c\xbc");
  ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file, SafetensorsFile::Open(path));
  EXPECT_EQ(file.Find("e")->dtype, "F8_E5M2");  // The header itself is fine.
  auto tensor = file.Tensor("e");
  if (compat::Float8E5M2()) {
    ASSERT_THAT(tensor, IsOk());
    EXPECT_EQ(tensor->to(at::kFloat)[0].item<float>(), 1.0f);  // 0x3c is 1.0 in E5M2.
    EXPECT_EQ(tensor->to(at::kFloat)[1].item<float>(), -1.0f);
  } else {
    EXPECT_THAT(tensor, StatusIs(absl::StatusCode::kUnimplemented,
                                 AllOf(HasSubstr("tensor 'e'"), HasSubstr("F8_E5M2"))));
  }
}

TEST(SafetensorsFileTest, MissingFileIsNotFoundWithThePath) {
  TempDir dir;
  EXPECT_THAT(SafetensorsFile::Open(dir.File("nope.safetensors")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope.safetensors")));
}

TEST(SafetensorsFileTest, DirectoryIsNotAFile) {
  TempDir dir;
  EXPECT_THAT(SafetensorsFile::Open(dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a regular file")));
}

TEST(SafetensorsFileTest, EmptyFileIsDataLoss) {
  TempDir dir;
  EXPECT_THAT(SafetensorsFile::Open(dir.Write("empty.safetensors", "")),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("empty.safetensors"), HasSubstr("0 bytes"))));
}

TEST(SafetensorsFileTest, TruncatedFileIsDataLoss) {
  TempDir dir;
  ASSERT_THAT(WriteSafetensors(dir.File("w.safetensors"), {{"w", at::ones({64})}}), IsOk());
  std::string bytes = test::ReadAll(dir.File("w.safetensors"));
  std::string path = dir.Write("cut.safetensors", bytes.substr(0, bytes.size() - 10));
  EXPECT_THAT(SafetensorsFile::Open(path),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("cut.safetensors"), HasSubstr("tensor 'w'"),
                             HasSubstr("truncated"))));
  std::string header_cut = dir.Write("cut2.safetensors", bytes.substr(0, 20));
  EXPECT_THAT(SafetensorsFile::Open(header_cut),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("past the end of the file")));
}

TEST(SafetensorsFileTest, UnknownTensorIsNotFound) {
  TempDir dir;
  ASSERT_THAT(WriteSafetensors(dir.File("w.safetensors"), {{"w", at::ones({2})}}), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file,
                             SafetensorsFile::Open(dir.File("w.safetensors")));
  EXPECT_THAT(file.Tensor("v"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("'v'")));
}

TEST(SafetensorsDTypeTest, MapsBothWays) {
  EXPECT_EQ(*SafetensorsDType(at::kBFloat16), "BF16");
  EXPECT_EQ(*TorchDType("BF16"), at::kBFloat16);
  EXPECT_EQ(*TorchDType("BOOL"), at::kBool);
  EXPECT_THAT(SafetensorsDType(at::kComplexFloat), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(TorchDType("X9"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("X9")));
}

}  // namespace
}  // namespace accel::loader
