// Whole training programs through accel-launch, as users run them:
// accel-test on 2 and 4 processes, and accel-train-lm (examples/) resumed
// from a checkpoint ending bit for bit where an uninterrupted run ends.
#include <cstdlib>
#include <filesystem>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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
