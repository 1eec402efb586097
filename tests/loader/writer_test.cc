// Writing: layout, sharding, atomicity and the errors that must leave
// nothing half-written.
#include <filesystem>
#include <set>
#include <signal.h>
#include <string>
#include <sys/resource.h>
#include <sys/statfs.h>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "loader/loader.h"
#include "tests/testing/file_size_limit.h"
#include "tests/testing/process_memory.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::loader {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

std::set<std::string> FilesIn(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) names.insert(e.path().filename());
  return names;
}

TEST(WriterTest, EveryTensorStartsAlignedForItsDtype) {
  TempDir dir;
  std::vector<NamedTensor> tensors = {{"a_u8", at::ones({3}, at::kByte)},
                                      {"b_f16", at::ones({5}, at::kHalf)},
                                      {"c_f64", at::ones({1}, at::kDouble)},
                                      {"d_f32", at::ones({3})}};
  ASSERT_THAT(WriteSafetensors(dir.File("w.safetensors"), tensors), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file,
                             SafetensorsFile::Open(dir.File("w.safetensors")));
  std::vector<std::string> order;
  for (const TensorInfo& t : file.tensors()) {
    order.push_back(t.name);
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor x, file.Tensor(t.name));
    // Zero-copy and aligned: the pointer is into the mapping and a multiple of the element size.
    EXPECT_EQ(x.data_ptr(), static_cast<const void*>(file.Bytes(t).data()));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(x.data_ptr()) % x.element_size(), 0u) << t.name;
  }
  EXPECT_THAT(order, ElementsAre("c_f64", "d_f32", "b_f16", "a_u8"));
}

TEST(WriterTest, WritesNonContiguousTensorsByValue) {
  TempDir dir;
  at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  at::Tensor transposed = base.t();
  ASSERT_FALSE(transposed.is_contiguous());
  ASSERT_THAT(WriteSafetensors(dir.File("t.safetensors"), {{"t", transposed}}), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(SafetensorsFile file,
                             SafetensorsFile::Open(dir.File("t.safetensors")));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor got, file.Tensor("t"));
  EXPECT_TRUE(at::equal(got, transposed));
}

TEST(WriterTest, ShardsInOrderWithTheIndexTransformersWrites) {
  TempDir dir;
  CheckpointWriteOptions options;
  options.max_shard_size = 100;
  std::vector<NamedTensor> tensors = {{"z", at::ones({10})},    // 40 bytes
                                      {"y", at::ones({10})},    // 40: 80 in shard 1
                                      {"big", at::ones({50})},  // 200 > max: alone
                                      {"x", at::ones({5})}};    // 20: new shard
  ACCEL_ASSERT_OK_AND_ASSIGN(CheckpointWriteResult result,
                             WriteCheckpoint(dir.path(), tensors, options));
  EXPECT_THAT(result.files,
              ElementsAre("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                          "model-00003-of-00003.safetensors", "model.safetensors.index.json"));
  EXPECT_EQ(result.total_bytes, 300u);
  nlohmann::json index =
      nlohmann::json::parse(test::ReadAll(dir.File("model.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"], 300);
  EXPECT_EQ(index["weight_map"]["z"], "model-00001-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["y"], "model-00001-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["big"], "model-00002-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["x"], "model-00003-of-00003.safetensors");
  EXPECT_THAT(
      FilesIn(dir.path()),
      UnorderedElementsAre("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                           "model-00003-of-00003.safetensors", "model.safetensors.index.json"));
}

TEST(WriterTest, OneShardIsAPlainModelSafetensors) {
  TempDir dir;
  ACCEL_ASSERT_OK_AND_ASSIGN(CheckpointWriteResult result,
                             WriteCheckpoint(dir.path() + "/new/sub", {{"w", at::ones({4})}}));
  EXPECT_THAT(result.files, ElementsAre("model.safetensors"));
  EXPECT_THAT(FilesIn(dir.path() + "/new/sub"), ElementsAre("model.safetensors"));
}

TEST(WriterTest, ResavingRemovesWhatTheEarlierSaveLeft) {
  TempDir dir;
  CheckpointWriteOptions small;
  small.max_shard_size = 50;
  std::vector<NamedTensor> tensors = {
      {"a", at::ones({10})}, {"b", at::ones({10})}, {"c", at::ones({10})}};
  ASSERT_THAT(WriteCheckpoint(dir.path(), tensors, small), IsOk());
  EXPECT_EQ(FilesIn(dir.path()).size(), 4u);  // 3 shards + index
  dir.Write("notes.txt", "mine");

  CheckpointWriteOptions medium;
  medium.max_shard_size = 80;
  ASSERT_THAT(WriteCheckpoint(dir.path(), tensors, medium), IsOk());
  EXPECT_THAT(
      FilesIn(dir.path()),
      UnorderedElementsAre("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json", "notes.txt"));

  ASSERT_THAT(WriteCheckpoint(dir.path(), tensors), IsOk());
  EXPECT_THAT(FilesIn(dir.path()), UnorderedElementsAre("model.safetensors", "notes.txt"));
  ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(dir.path()));
  EXPECT_EQ(ckpt.tensors().size(), 3u);
}

TEST(WriterTest, StreamsTensorsFromAProducerOneAtATime) {
  TempDir dir;
  std::vector<TensorSpec> specs = {{"a", at::kFloat, {4}}, {"b", at::kBFloat16, {2, 2}}};
  std::vector<std::string> produced;
  auto produce = [&](const TensorSpec& spec) -> absl::StatusOr<at::Tensor> {
    produced.push_back(spec.name);
    return at::full(spec.shape, static_cast<double>(produced.size()),
                    at::TensorOptions().dtype(spec.dtype));
  };
  ASSERT_THAT(WriteCheckpoint(dir.path(), specs, produce), IsOk());
  EXPECT_THAT(produced, ElementsAre("a", "b"));
  ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(dir.path()));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor b, ckpt.Tensor("b"));
  EXPECT_EQ(b.scalar_type(), at::kBFloat16);
  EXPECT_EQ(b[1][1].item<float>(), 2.0f);
}

// A large file is written behind (written back and dropped as the writer
// goes) and, once synced, leaves none of its pages cached: its readers then
// read it in whole huge folios rather than map the writer's small ones.
TEST(WriterTest, AShardWrittenBehindLeavesNothingInThePageCache) {
  TempDir dir;
  struct statfs fs {};
  ASSERT_EQ(::statfs(dir.path().c_str(), &fs), 0);
  if (fs.f_type == TMPFS_MAGIC) GTEST_SKIP() << "tmpfs keeps its pages: nothing to drop";
  std::vector<TensorSpec> specs;
  specs.reserve(8);
  for (int i = 0; i < 8; ++i) specs.push_back({absl::StrCat("t", i), at::kFloat, {1 << 18}});
  auto produce = [](const TensorSpec& spec) -> absl::StatusOr<at::Tensor> {
    return at::full(spec.shape, 1.5, at::TensorOptions().dtype(spec.dtype));
  };
  CheckpointWriteOptions behind;
  behind.write_behind_bytes = int64_t{2} << 20;  // 8 MiB written, 2 MiB at a time
  ASSERT_THAT(WriteCheckpoint(dir.path(), specs, produce, behind), IsOk());
  const std::string shard = dir.path() + "/model.safetensors";
  EXPECT_EQ(test::PageCachedBytesOfFile(shard), 0);
  // Read back whole and equal.
  ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(dir.path()));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor t7, ckpt.Tensor("t7"));
  EXPECT_TRUE(at::equal(t7, at::full({1 << 18}, 1.5)));
  // Without write-behind (a small file, the kernel's choice) the pages stay.
  TempDir kept;
  ASSERT_THAT(WriteCheckpoint(kept.path(), specs, produce), IsOk());
  EXPECT_GT(test::PageCachedBytesOfFile(kept.path() + "/model.safetensors"), 0);
}

TEST(WriterTest, ProducerReturningTheWrongShapeFailsAndLeavesNothing) {
  TempDir dir;
  ASSERT_THAT(WriteCheckpoint(dir.path(), {{"a", at::zeros({4})}}), IsOk());
  std::string before = test::ReadAll(dir.File("model.safetensors"));
  std::vector<TensorSpec> specs = {{"a", at::kFloat, {4}}};
  auto wrong = [](const TensorSpec&) -> absl::StatusOr<at::Tensor> { return at::ones({5}); };
  EXPECT_THAT(WriteCheckpoint(dir.path(), specs, wrong),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor 'a'"), HasSubstr("[4]"), HasSubstr("[5]"))));
  EXPECT_THAT(FilesIn(dir.path()), ElementsAre("model.safetensors"));
  EXPECT_EQ(test::ReadAll(dir.File("model.safetensors")), before);
}

TEST(WriterTest, ProducerErrorIsPassedOnWithTheTensorName) {
  TempDir dir;
  std::vector<TensorSpec> specs = {{"a", at::kFloat, {4}}};
  auto failing = [](const TensorSpec&) -> absl::StatusOr<at::Tensor> {
    return absl::UnavailableError("source went away");
  };
  EXPECT_THAT(WriteCheckpoint(dir.path(), specs, failing),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("'a'"), HasSubstr("source went away"))));
  EXPECT_TRUE(FilesIn(dir.path()).empty());
}

TEST(WriterTest, DuplicateNamesAndBadDtypesAreInvalid) {
  TempDir dir;
  EXPECT_THAT(
      WriteSafetensors(dir.File("w.safetensors"), {{"a", at::ones({1})}, {"a", at::ones({1})}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'a' is given twice")));
  EXPECT_THAT(
      WriteSafetensors(dir.File("w.safetensors"), {{"c", at::ones({1}, at::kComplexFloat)}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'c'")));
  EXPECT_THAT(WriteSafetensors(dir.File("w.safetensors"), {{"u", at::Tensor()}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'u' is undefined")));
  EXPECT_TRUE(FilesIn(dir.path()).empty());
}

TEST(WriterTest, NonPositiveShardSizeIsInvalid) {
  TempDir dir;
  CheckpointWriteOptions options;
  options.max_shard_size = 0;
  EXPECT_THAT(WriteCheckpoint(dir.path(), {{"a", at::ones({1})}}, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_shard_size")));
}

TEST(WriterTest, UnwritableFolderIsAClearError) {
  TempDir dir;
  dir.Write("file", "x");
  EXPECT_THAT(WriteSafetensors(dir.File("no/such/dir/w.safetensors"), {{"a", at::ones({1})}}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no/such/dir")));
  EXPECT_THAT(WriteCheckpoint(dir.File("file/sub"), {{"a", at::ones({1})}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("file/sub")));
}

// A full disk, simulated with a file-size limit: the write fails with
// ResourceExhausted, the earlier checkpoint survives, no temporary is left.
TEST(WriterTest, FullDiskKeepsTheEarlierFileAndLeavesNoTemporary) {
  TempDir dir;
  ASSERT_THAT(WriteCheckpoint(dir.path(), {{"w", at::zeros({16})}}), IsOk());
  std::string before = test::ReadAll(dir.File("model.safetensors"));

  absl::StatusOr<CheckpointWriteResult> result = absl::UnknownError("not run");
  {
    test::FileSizeLimit full_disk(4096);
    ASSERT_TRUE(full_disk.ok());
    result = WriteCheckpoint(dir.path(), {{"w", at::ones({100000})}});
  }

  EXPECT_THAT(result,
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("model.safetensors")));
  EXPECT_THAT(FilesIn(dir.path()), ElementsAre("model.safetensors"));
  EXPECT_EQ(test::ReadAll(dir.File("model.safetensors")), before);
}

TEST(WriteFileAtomicallyTest, ReplacesWholeFiles) {
  TempDir dir;
  ASSERT_THAT(WriteFileAtomically(dir.File("a.json"), "first"), IsOk());
  ASSERT_THAT(WriteFileAtomically(dir.File("a.json"), "second"), IsOk());
  EXPECT_EQ(test::ReadAll(dir.File("a.json")), "second");
  EXPECT_THAT(FilesIn(dir.path()), ElementsAre("a.json"));
}

}  // namespace
}  // namespace accel::loader
