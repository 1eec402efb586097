// Whole training programs through accel-launch, as users run them:
// accel-test on 2 and 4 processes, and accel-train-lm (examples/) resumed
// from a checkpoint ending bit for bit where an uninterrupted run ends.
#include <cstdlib>
#include <filesystem>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "tests/testing/temp_dir.h"

namespace {

using ::testing::HasSubstr;

std::string Bin(const std::string& name) {
  const char* dir = std::getenv("ACCEL_BIN_DIR");
  return std::string(dir != nullptr ? dir : "build/bin") + "/" + name;
}

// Runs a shell command, returns its exit code; output goes to `log`.
int Shell(const std::string& command, const std::string& log) {
  const int rc = std::system((command + " >" + log + " 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

TEST(AccelTest, SucceedsOnTwoAndFourProcesses) {
  accel::test::TempDir dir;
  for (int n : {2, 4}) {
    const std::string log = dir.File("log" + std::to_string(n));
    EXPECT_EQ(Shell(Bin("accel-test") + " --num_processes " + std::to_string(n), log), 0)
        << accel::test::ReadAll(log);
    EXPECT_THAT(accel::test::ReadAll(log),
                HasSubstr("Test is a success! You are ready for your distributed training!"));
  }
}

// A small English text for the tokenizer and the model.
std::string Corpus() {
  const char* sentences[] = {
      "The quick brown fox jumps over the lazy dog.",
      "A journey of a thousand miles begins with a single step.",
      "All that glitters is not gold, and not all who wander are lost.",
      "The early bird catches the worm, but the second mouse gets the cheese.",
      "Knowledge speaks, but wisdom listens to the rain on the roof.",
  };
  std::string text;
  for (int i = 0; i < 120; ++i) {
    text += sentences[(i * 7) % 5];
    text += (i % 3 == 2) ? "\n" : " ";
  }
  return text;
}

TEST(TrainLm, ResumedRunEndsBitForBitWhereTheUninterruptedOneEnds) {
  accel::test::TempDir dir;
  const std::string text = dir.Write("corpus.txt", Corpus());
  const std::string common =
      " --text " + text +
      " --vocab_size 300 --hidden_size 32 --num_layers 1 --num_heads 2 --seq_len 16"
      " --batch_size 4 --grad_accum 2 --max_steps 6 --save_every 3 --log_every 3 --lr 0.01"
      " --warmup 2";
  const std::string launch =
      Bin("accel-launch") + " --num_processes 2 --main_process_port 0 " + Bin("accel-train-lm");
  // Uninterrupted.
  ASSERT_EQ(
      Shell(launch + common + " --out " + dir.File("straight") + " --project_dir " + dir.File("p1"),
            dir.File("log1")),
      0)
      << accel::test::ReadAll(dir.File("log1"));
  // Interrupted after step 4 (the last checkpoint is step 3's), then resumed.
  ASSERT_EQ(Shell(launch + common + " --stop_after 4 --out " + dir.File("resumed") +
                      " --project_dir " + dir.File("p2"),
                  dir.File("log2")),
            0)
      << accel::test::ReadAll(dir.File("log2"));
  EXPECT_FALSE(std::filesystem::exists(dir.File("resumed/model.safetensors")));
  ASSERT_EQ(Shell(launch + common + " --resume --out " + dir.File("resumed") + " --project_dir " +
                      dir.File("p2"),
                  dir.File("log3")),
            0)
      << accel::test::ReadAll(dir.File("log3"));
  EXPECT_THAT(accel::test::ReadAll(dir.File("log3")), HasSubstr("resumed at optimizer step 3"));
  const std::string a = accel::test::ReadAll(dir.File("straight/model.safetensors"));
  const std::string b = accel::test::ReadAll(dir.File("resumed/model.safetensors"));
  ASSERT_FALSE(a.empty());
  EXPECT_TRUE(a == b) << "the resumed model differs from the uninterrupted one";
  // The folder is a HuggingFace model: config, generation config, tokenizer.
  for (const char* f : {"config.json", "generation_config.json", "tokenizer.json"}) {
    EXPECT_TRUE(std::filesystem::exists(dir.File(std::string("resumed/") + f))) << f;
  }
  EXPECT_THAT(accel::test::ReadAll(dir.File("log1")), HasSubstr("\"heldout_perplexity\""));
}

// The JSON figure `key` of accel-train-lm's last line in `log`.
double Figure(const std::string& log, const std::string& key) {
  const std::string text = accel::test::ReadAll(log);
  const size_t at = text.rfind("\"" + key + "\": ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size() + 4));
}

// FSDP through accel-launch --use_fsdp: the run learns what data parallel
// learns; its sharded checkpoint merges (accel-merge-weights) into exactly
// the model the run saved whole, which accel-generate then runs.
TEST(TrainLm, FsdpRunMatchesDataParallelAndItsShardsMergeIntoTheModel) {
  accel::test::TempDir dir;
  const std::string text = dir.Write("corpus.txt", Corpus());
  const std::string common =
      " --text " + text +
      " --vocab_size 300 --hidden_size 32 --num_layers 2 --num_heads 2 --seq_len 16"
      " --batch_size 4 --grad_accum 2 --max_steps 4 --save_every 4 --log_every 2 --lr 0.01"
      " --warmup 2";
  const std::string launch = Bin("accel-launch") + " --num_processes 2 --main_process_port 0 ";
  ASSERT_EQ(Shell(launch + Bin("accel-train-lm") + common + " --out " + dir.File("ddp"),
                  dir.File("ddp.log")),
            0)
      << accel::test::ReadAll(dir.File("ddp.log"));
  ASSERT_EQ(Shell(launch + "--use_fsdp --fsdp_state_dict_type SHARDED_STATE_DICT " +
                      Bin("accel-train-lm") + common + " --out " + dir.File("fsdp"),
                  dir.File("fsdp.log")),
            0)
      << accel::test::ReadAll(dir.File("fsdp.log"));
  const double ddp_loss = Figure(dir.File("ddp.log"), "heldout_loss");
  const double fsdp_loss = Figure(dir.File("fsdp.log"), "heldout_loss");
  ASSERT_GT(ddp_loss, 0);
  EXPECT_NEAR(fsdp_loss, ddp_loss, 1e-4);
  // Each rank wrote its shards (and its optimizer state).
  const std::string checkpoint = dir.File("fsdp/run/checkpoints/checkpoint_0");
  for (const char* f :
       {"pytorch_model_fsdp/rank0-of-2.safetensors", "pytorch_model_fsdp/rank1-of-2.safetensors",
        "optimizer.rank0-of-2.bin", "optimizer.rank1-of-2.bin"}) {
    EXPECT_TRUE(std::filesystem::exists(checkpoint + "/" + f)) << f;
  }
  ASSERT_EQ(Shell(Bin("accel-merge-weights") + " " + checkpoint + " " + dir.File("merged"),
                  dir.File("merge.log")),
            0)
      << accel::test::ReadAll(dir.File("merge.log"));
  EXPECT_TRUE(accel::test::ReadAll(dir.File("merged/model.safetensors")) ==
              accel::test::ReadAll(dir.File("fsdp/model.safetensors")))
      << "the merged shards differ from the model the run saved";
  for (const char* f :
       {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}) {
    std::filesystem::copy_file(dir.File(std::string("fsdp/") + f),
                               dir.File(std::string("merged/") + f));
  }
  const std::string generate =
      Bin("accel-generate") + " --prompt 'The quick' --max_new_tokens 8 --model ";
  ASSERT_EQ(Shell(generate + dir.File("merged"), dir.File("gen_merged")), 0)
      << accel::test::ReadAll(dir.File("gen_merged"));
  ASSERT_EQ(Shell(generate + dir.File("fsdp"), dir.File("gen_fsdp")), 0);
  // The generated text: the lines that are not progress or timing.
  auto generated = [](const std::string& log) {
    std::string text;
    for (absl::string_view line : absl::StrSplit(accel::test::ReadAll(log), '\n')) {
      if (!absl::StartsWith(line, "loading") && !absl::StartsWith(line, "accel-generate:")) {
        absl::StrAppend(&text, line, "\n");
      }
    }
    return text;
  };
  EXPECT_FALSE(generated(dir.File("gen_fsdp")).empty());
  EXPECT_EQ(generated(dir.File("gen_merged")), generated(dir.File("gen_fsdp")));
  // Bad input names what is wrong.
  EXPECT_EQ(Shell(Bin("accel-merge-weights") + " " + dir.File("ddp") + " " + dir.File("m2"),
                  dir.File("merge2.log")),
            1);
  EXPECT_THAT(accel::test::ReadAll(dir.File("merge2.log")), HasSubstr("rank<r>-of-<P>"));
}

TEST(TrainLm, BadFlagsAreRefused) {
  accel::test::TempDir dir;
  EXPECT_EQ(Shell(Bin("accel-train-lm") + " --out " + dir.path(), dir.File("l1")), 1);
  EXPECT_THAT(accel::test::ReadAll(dir.File("l1")), HasSubstr("--text is required"));
  EXPECT_EQ(
      Shell(Bin("accel-train-lm") + " --text " + dir.File("missing.txt") + " --out " + dir.path(),
            dir.File("l2")),
      1);
  EXPECT_THAT(accel::test::ReadAll(dir.File("l2")), HasSubstr("missing.txt"));
  const std::string tiny = dir.Write("tiny.txt", "hi");
  EXPECT_EQ(Shell(Bin("accel-train-lm") + " --text " + tiny + " --out " + dir.File("o") +
                      " --vocab_size 260 --hidden_size 16 --num_layers 1 --num_heads 2",
                  dir.File("l3")),
            1);
  EXPECT_THAT(accel::test::ReadAll(dir.File("l3")), HasSubstr("too few"));
}

}  // namespace
