// Checkpoint: single files, folders, sharded sets and the errors of broken ones.
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "loader/loader.h"
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

std::vector<NamedTensor> SomeTensors() {
  at::manual_seed(3);
  return {{"embed.weight", at::randn({16, 8})},
          {"layers.0.w", at::randn({8, 8})},
          {"layers.1.w", at::randn({8, 8})},
          {"norm.weight", at::randn({8}).to(at::kBFloat16)}};
}

// Writes SomeTensors() sharded into about three files.
void WriteSharded(const std::string& dir) {
  CheckpointWriteOptions options;
  options.max_shard_size = 300;
  ASSERT_THAT(WriteCheckpoint(dir, SomeTensors(), options), IsOk());
}

void ExpectAllTensors(const Checkpoint& ckpt) {
  for (const auto& [name, expected] : SomeTensors()) {
    SCOPED_TRACE(name);
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor got, ckpt.Tensor(name));
    EXPECT_TRUE(at::equal(got, expected));
  }
}

TEST(CheckpointTest, OpensASingleFileByPathOrFolder) {
  TempDir dir;
  ASSERT_THAT(WriteSafetensors(dir.File("model.safetensors"), SomeTensors(), {{"format", "pt"}}),
              IsOk());
  for (const std::string& path : {dir.File("model.safetensors"), dir.path(), dir.path() + "/"}) {
    SCOPED_TRACE(path);
    ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(path));
    EXPECT_EQ(ckpt.tensors().size(), 4u);
    EXPECT_EQ(ckpt.shard_paths().size(), 1u);
    EXPECT_EQ(ckpt.metadata().at("format"), "pt");
    EXPECT_EQ(ckpt.total_bytes(), (16 * 8 + 64 + 64) * 4 + 8 * 2u);
    ExpectAllTensors(ckpt);
  }
}

TEST(CheckpointTest, OpensAShardedSetByFolderOrIndex) {
  TempDir dir;
  WriteSharded(dir.path());
  for (const std::string& path : {dir.path(), dir.File("model.safetensors.index.json")}) {
    SCOPED_TRACE(path);
    ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(path));
    EXPECT_EQ(ckpt.shard_paths().size(), 3u);
    EXPECT_EQ(ckpt.tensors().size(), 4u);
    EXPECT_EQ(ckpt.metadata().at("total_size"), std::to_string(ckpt.total_bytes()));
    EXPECT_EQ(ckpt.metadata().at("format"), "pt");
    ExpectAllTensors(ckpt);
    const Checkpoint::Entry* entry = ckpt.Find("norm.weight");
    ASSERT_NE(entry, nullptr);
    EXPECT_THAT(ckpt.shard_paths()[entry->shard], HasSubstr("model-00003-of-00003.safetensors"));
  }
}

TEST(CheckpointTest, PrefersTheIndexOverAStraySingleFile) {
  TempDir dir;
  WriteSharded(dir.path());
  ASSERT_THAT(WriteSafetensors(dir.File("model.safetensors"), {{"other", at::ones({1})}}), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(dir.path()));
  EXPECT_EQ(ckpt.tensors().size(), 4u);
}

TEST(CheckpointTest, EmptyFolderIsNotFound) {
  TempDir dir;
  EXPECT_THAT(Checkpoint::Open(dir.path()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model.safetensors")));
}

TEST(CheckpointTest, MissingShardIsNotFoundNamingIt) {
  TempDir dir;
  WriteSharded(dir.path());
  std::filesystem::remove(dir.File("model-00002-of-00003.safetensors"));
  EXPECT_THAT(
      Checkpoint::Open(dir.path()),
      StatusIs(absl::StatusCode::kNotFound,
               AllOf(HasSubstr("model-00002-of-00003.safetensors"), HasSubstr("does not exist"))));
}

TEST(CheckpointTest, TensorMissingFromItsShardIsNotFoundNamingBoth) {
  TempDir dir;
  WriteSharded(dir.path());
  nlohmann::json index =
      nlohmann::json::parse(test::ReadAll(dir.File("model.safetensors.index.json")));
  index["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors";
  dir.Write("model.safetensors.index.json", index.dump());
  EXPECT_THAT(Checkpoint::Open(dir.path()),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("'ghost.weight'"), HasSubstr("model-00001-of-00003"))));
}

TEST(CheckpointTest, MalformedIndexesAreInvalid) {
  TempDir dir;
  WriteSharded(dir.path());
  const std::string index = dir.File("model.safetensors.index.json");
  dir.Write("model.safetensors.index.json", "{not json");
  EXPECT_THAT(Checkpoint::Open(dir.path()), StatusIs(absl::StatusCode::kInvalidArgument,
                                                     AllOf(HasSubstr(index), HasSubstr("JSON"))));
  dir.Write("model.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_THAT(Checkpoint::Open(dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight_map")));
  dir.Write("model.safetensors.index.json", R"({"weight_map": {"a": 3}})");
  EXPECT_THAT(Checkpoint::Open(dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'a'")));
  dir.Write("model.safetensors.index.json", R"({"weight_map": {"a": "../../etc/passwd"}})");
  EXPECT_THAT(Checkpoint::Open(dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a plain file name")));
}

TEST(CheckpointTest, CorruptShardNamesTheShard) {
  TempDir dir;
  WriteSharded(dir.path());
  dir.Write("model-00002-of-00003.safetensors", "garbage!garbage!");
  EXPECT_THAT(
      Checkpoint::Open(dir.path()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model-00002-of-00003.safetensors")));
}

TEST(CheckpointTest, ListsTensorsShardByShardInDataOrder) {
  TempDir dir;
  WriteSharded(dir.path());
  ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(dir.path()));
  std::vector<std::string> names;
  for (const auto& e : ckpt.tensors()) names.push_back(e.info.name);
  EXPECT_THAT(names, ElementsAre("embed.weight", "layers.0.w", "layers.1.w", "norm.weight"));
}

}  // namespace
}  // namespace accel::loader
