// accel-merge-weights CHECKPOINT OUTPUT_DIR [--max_shard_size 10GB] [--remove_checkpoint_dir]
//
// Accelerate's `accelerate merge-weights`: the rank files of an FSDP
// SHARDED_STATE_DICT save (a save_state folder holding pytorch_model_fsdp*/,
// or one such folder) become one model in OUTPUT_DIR: model.safetensors, or
// shards plus model.safetensors.index.json past --max_shard_size. Copy the
// model's config.json and tokenizer files beside it to load it with
// accel-generate / accel-serve.
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "core/tool_main.h"
#include "train/checkpoint.h"
#include "train/fsdp.h"

namespace {

constexpr char kUsage[] =
    "usage: accel-merge-weights CHECKPOINT OUTPUT_DIR [--max_shard_size 10GB] "
    "[--remove_checkpoint_dir]\n"
    "  CHECKPOINT: a save_state folder of an FSDP run with state_dict_type SHARDED_STATE_DICT\n"
    "  (holding pytorch_model_fsdp/), or that pytorch_model_fsdp folder itself.\n";

int Fail(const std::string& message) {
  std::cerr << "accel-merge-weights: " << message << "\n";
  return 1;
}

int Run(int argc, char** argv) {
  std::vector<std::string> positional;
  std::string max_shard_size = "10GB";
  bool remove = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (arg == "--remove_checkpoint_dir") {
      remove = true;
    } else if (arg == "--max_shard_size") {
      if (i + 1 >= argc) return Fail("--max_shard_size needs a value (e.g. 5GB)");
      max_shard_size = argv[++i];
    } else if (arg.rfind("--max_shard_size=", 0) == 0) {
      max_shard_size = arg.substr(17);
    } else if (arg.rfind("--", 0) == 0) {
      return Fail(absl::StrCat("unknown flag ", arg, "\n", kUsage));
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2)
    return Fail(absl::StrCat("expected CHECKPOINT and OUTPUT_DIR\n", kUsage));
  absl::StatusOr<int64_t> limit = accel::train::ParseShardSize(max_shard_size);
  if (!limit.ok()) return Fail(absl::StrCat("--max_shard_size: ", limit.status().message()));
  std::string shards = positional[0];
  if (std::filesystem::is_directory(shards + "/pytorch_model_fsdp")) {
    shards += "/pytorch_model_fsdp";
  }
  absl::Status merged = accel::train::MergeShardedState(shards, positional[1], *limit);
  if (!merged.ok()) return Fail(std::string(merged.message()));
  if (remove) {
    std::error_code ec;
    std::filesystem::remove_all(positional[0], ec);
    if (ec) return Fail(absl::StrCat("removing ", positional[0], ": ", ec.message()));
  }
  std::cout << "merged " << shards << " into " << positional[1] << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return accel::ToolMain("accel-merge-weights", argc, argv, Run); }
