// pytorch_model.bin end to end: files written by Python's own pickler in
// torch.save's layout (tests/loader/torch_save.py, from a safetensors file
// written here) and by libtorch's torch::pickle_save, read back through
// Checkpoint and compared with the same weights in safetensors, bit for bit;
// and a hostile file whose pickle would run a command in Python, refused by
// name without running it.
#include "loader/internal/torch_bin.h"

#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <sys/stat.h>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/str_cat.h"

#include "loader/loader.h"
#include "tests/testing/command.h"
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

// Several dtypes; lm_head.weight equals embed.weight (tied in a .bin).
std::vector<NamedTensor> Weights() {
  at::manual_seed(11);
  at::Tensor embed = at::randn({16, 8});
  return {{"embed.weight", embed},
          {"layers.0.w", at::randn({8, 8})},
          {"layers.1.w", at::randn({8, 8})},
          {"layers.1.proj", at::randn({6, 8})},
          {"norm.weight", at::randn({8}).to(at::kBFloat16)},
          {"norm.bias", at::randn({8}).to(at::kHalf)},
          {"positions", at::arange(10, at::kLong)},
          {"mask", at::arange(7, at::kInt).remainder(2).to(at::kByte)},
          {"lm_head.weight", embed.clone()}};
}

// torch_save.py IN OUT ARGS; the safetensors input is written first.
void TorchSave(const TempDir& dir, const std::string& out, const std::string& args) {
  const std::string in = dir.File("weights.safetensors");
  ASSERT_THAT(WriteSafetensors(in, Weights()), IsOk());
  const test::CommandResult r = test::CommandOutput(
      absl::StrCat("python3 ", ACCEL_TORCH_SAVE_PY, " ", in, " ", out, " ", args, " 2>&1"));
  ASSERT_EQ(r.exit_code, 0) << r.out;
}

void ExpectSameWeights(const Checkpoint& ckpt) {
  const std::vector<NamedTensor> expected = Weights();
  EXPECT_EQ(ckpt.tensors().size(), expected.size());
  for (const auto& [name, want] : expected) {
    SCOPED_TRACE(name);
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor got, ckpt.Tensor(name));
    EXPECT_EQ(got.scalar_type(), want.scalar_type());
    EXPECT_TRUE(got.is_contiguous());
    EXPECT_TRUE(at::equal(got, want));
    const Checkpoint::Entry* entry = ckpt.Find(name);
    ASSERT_NE(entry, nullptr);
    EXPECT_EQ(entry->info.nbytes(), want.nbytes());
  }
}

// Where FileOffset says a tensor's bytes are, they are.
void ExpectFileOffsetsHoldTheBytes(const Checkpoint& ckpt) {
  for (const Checkpoint::Entry& entry : ckpt.tensors()) {
    std::optional<uint64_t> offset = ckpt.FileOffset(entry);
    if (!offset) continue;
    SCOPED_TRACE(entry.info.name);
    const std::string file = test::ReadAll(ckpt.shard_paths()[entry.shard]);
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor t, ckpt.Tensor(entry.info.name));
    ASSERT_LE(*offset + entry.info.nbytes(), file.size());
    EXPECT_EQ(0, std::memcmp(file.data() + *offset, t.data_ptr(), entry.info.nbytes()));
  }
}

TEST(TorchBin, EqualsTheSameWeightsInSafetensors) {
  struct Case {
    const char* what;
    const char* args;
  };
  for (const Case& c : std::vector<Case>{
           {"a dict, as transformers saves a shard", ""},
           {"model.state_dict(): an OrderedDict with _metadata", "--ordered"},
           {"tied: a view of another tensor's storage",
            "--ordered --tie lm_head.weight=embed.weight"},
           {"the same tensor object twice", "--same lm_head.weight=embed.weight"},
           {"views at offsets of one storage", "--fuse layers.0.w,layers.1.w,layers.1.proj"},
           {"a strided (transposed) view", "--transpose layers.1.proj"},
           {"records at unaligned offsets", "--unaligned"},
           {"saved from a GPU", "--location cuda:0"},
       }) {
    SCOPED_TRACE(c.what);
    TempDir dir;
    const std::string bin = dir.File("pytorch_model.bin");
    TorchSave(dir, bin, c.args);
    std::filesystem::remove(dir.File("weights.safetensors"));
    for (const std::string& path : {bin, dir.path()}) {
      ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(path));
      EXPECT_EQ(ckpt.safetensors_shard(0), nullptr);
      ExpectSameWeights(ckpt);
      ExpectFileOffsetsHoldTheBytes(ckpt);
    }
  }
}

TEST(TorchBin, AStridedViewHasNoFileOffsetAndOthersDo) {
  TempDir dir;
  TorchSave(dir, dir.File("pytorch_model.bin"),
            "--transpose layers.1.proj --tie lm_head.weight=embed.weight");
  ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(dir.File("pytorch_model.bin")));
  EXPECT_EQ(ckpt.FileOffset(*ckpt.Find("layers.1.proj")), std::nullopt);
  EXPECT_NE(ckpt.FileOffset(*ckpt.Find("layers.0.w")), std::nullopt);
  // Tied: both names at the same bytes.
  EXPECT_EQ(ckpt.FileOffset(*ckpt.Find("lm_head.weight")),
            ckpt.FileOffset(*ckpt.Find("embed.weight")));
}

TEST(TorchBin, ReadsAShardedCheckpointByItsIndex) {
  TempDir dir;
  const std::string out = dir.File("model");
  TorchSave(dir, out, "--shards 3 --ordered");
  for (const std::string& path : {out, out + "/pytorch_model.bin.index.json"}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(path));
    std::set<std::string> shards;
    for (const std::string& shard : ckpt.shard_paths()) {
      shards.insert(std::filesystem::path(shard).filename());
    }
    EXPECT_THAT(shards,
                ElementsAre("pytorch_model-00001-of-00003.bin", "pytorch_model-00002-of-00003.bin",
                            "pytorch_model-00003-of-00003.bin"));
    ExpectSameWeights(ckpt);
  }
}

TEST(TorchBin, ReadsWhatLibtorchsPickleSaveWrites) {
  TempDir dir;
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, t] : Weights()) dict.insert(name, t);
  const std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(dict));
  dir.Write("pytorch_model.bin", absl::string_view(bytes.data(), bytes.size()));
  ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(dir.path()));
  ExpectSameWeights(ckpt);
  ExpectFileOffsetsHoldTheBytes(ckpt);
}

TEST(TorchBin, PrefersSafetensorsAsTransformersDoes) {
  TempDir dir;
  TorchSave(dir, dir.File("pytorch_model.bin"), "");
  ASSERT_THAT(WriteSafetensors(dir.File("model.safetensors"), Weights()), IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(Checkpoint ckpt, Checkpoint::Open(dir.path()));
  EXPECT_THAT(ckpt.shard_paths()[0], HasSubstr("model.safetensors"));
  EXPECT_NE(ckpt.safetensors_shard(0), nullptr);
}

// A pickle that runs `touch` when Python's pickle.load reads it: refused by
// the global's name, and nothing runs.
TEST(TorchBin, RefusesAPickleThatWouldRunACommand) {
  TempDir dir;
  const std::string witness = dir.File("pwned");
  TorchSave(dir, dir.File("pytorch_model.bin"), absl::StrCat("--evil ", witness));
  EXPECT_THAT(Checkpoint::Open(dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("pytorch_model.bin"), HasSubstr("'posix.system'"),
                             HasSubstr("is not allowed"))));
  EXPECT_FALSE(std::filesystem::exists(witness));
}

TEST(TorchBin, TruncatedOrDamagedFilesAreErrorsNamingTheFile) {
  TempDir dir;
  const std::string bin = dir.File("pytorch_model.bin");
  TorchSave(dir, bin, "");
  const std::string whole = test::ReadAll(bin);
  for (size_t n : {size_t{0}, size_t{3}, whole.size() / 2, whole.size() - 1}) {
    SCOPED_TRACE(n);
    dir.Write("pytorch_model.bin", whole.substr(0, n));
    absl::StatusOr<Checkpoint> opened = Checkpoint::Open(bin);
    ASSERT_FALSE(opened.ok());
    EXPECT_THAT(opened.status().message(), HasSubstr(bin));
  }
  // A flipped byte anywhere: an error or the same tensors, never a crash.
  for (size_t i = 0; i < whole.size(); i += 37) {
    std::string bad = whole;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    dir.Write("pytorch_model.bin", bad);
    (void)Checkpoint::Open(bin);
  }
}

TEST(TorchBin, RefusesAFifoByName) {
  TempDir dir;
  const std::string fifo = dir.File("pytorch_model.bin");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(Checkpoint::Open(dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a regular file")));
}

}  // namespace
}  // namespace accel::loader
