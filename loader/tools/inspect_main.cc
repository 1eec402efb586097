// accel-inspect PATH [--json]: what a checkpoint holds, without loading it.
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

#include "core/bytes.h"
#include "core/tool_main.h"
#include "loader/loader.h"

ABSL_FLAG(bool, json, false, "Print one JSON object instead of a table.");

namespace {

std::string BaseName(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

int Run(const std::string& path) {
  auto opened = accel::loader::Checkpoint::Open(path);
  if (!opened.ok()) {
    std::cerr << "accel-inspect: " << opened.status().message() << "\n";
    return 1;
  }
  const accel::loader::Checkpoint& ckpt = *opened;
  struct Total {
    int64_t tensors = 0;
    uint64_t bytes = 0;
  };
  std::map<std::string, Total> by_dtype;
  for (const auto& e : ckpt.tensors()) {
    by_dtype[e.info.dtype].tensors++;
    by_dtype[e.info.dtype].bytes += e.info.nbytes();
  }

  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::ordered_json out;
    out["tensors"] = nlohmann::ordered_json::array();
    for (const auto& e : ckpt.tensors()) {
      out["tensors"].push_back({{"name", e.info.name},
                                {"dtype", e.info.dtype},
                                {"shape", e.info.shape},
                                {"bytes", e.info.nbytes()},
                                {"file", BaseName(ckpt.shard_paths()[e.shard])}});
    }
    out["metadata"] = ckpt.metadata();
    out["total_bytes"] = ckpt.total_bytes();
    nlohmann::ordered_json totals = nlohmann::ordered_json::object();
    for (const auto& [dtype, t] : by_dtype)
      totals[dtype] = {{"tensors", t.tensors}, {"bytes", t.bytes}};
    out["totals_by_dtype"] = totals;
    std::cout << out.dump() << "\n";
    return 0;
  }

  size_t name_width = 4;
  for (const auto& e : ckpt.tensors()) name_width = std::max(name_width, e.info.name.size());
  std::cout << absl::StrFormat("%s: %d tensors in %d file(s), %s\n", path, ckpt.tensors().size(),
                               ckpt.shard_paths().size(),
                               accel::FormatBytes(static_cast<int64_t>(ckpt.total_bytes())));
  std::cout << absl::StrFormat("%-*s  %-7s  %-20s  %12s  %s\n", name_width, "name", "dtype",
                               "shape", "bytes", "file");
  for (const auto& e : ckpt.tensors()) {
    std::cout << absl::StrFormat("%-*s  %-7s  %-20s  %12d  %s\n", name_width, e.info.name,
                                 e.info.dtype,
                                 absl::StrCat("[", absl::StrJoin(e.info.shape, ", "), "]"),
                                 e.info.nbytes(), BaseName(ckpt.shard_paths()[e.shard]));
  }
  std::cout << "\ntotals by dtype:\n";
  for (const auto& [dtype, t] : by_dtype) {
    std::cout << absl::StrFormat("  %-7s  %6d tensors  %14d bytes  (%s)\n", dtype, t.tensors,
                                 t.bytes, accel::FormatBytes(static_cast<int64_t>(t.bytes)));
  }
  std::cout << absl::StrFormat("  %-7s  %6d tensors  %14d bytes  (%s)\n", "all",
                               ckpt.tensors().size(), ckpt.total_bytes(),
                               accel::FormatBytes(static_cast<int64_t>(ckpt.total_bytes())));
  std::cout << "\nmetadata:" << (ckpt.metadata().empty() ? " (none)" : "") << "\n";
  for (const auto& [key, value] : ckpt.metadata())
    std::cout << "  " << key << ": " << value << "\n";
  return 0;
}

}  // namespace

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "accel-inspect PATH [--json]\n"
      "Lists the tensors of a .safetensors file, a model.safetensors.index.json, or a model\n"
      "folder: name, dtype, shape, bytes and shard file; totals per dtype; the metadata.");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::cerr << "accel-inspect: expected exactly one PATH (see --help)\n";
    return 1;
  }
  return Run(args[1]);
}

int main(int argc, char** argv) { return accel::ToolMain("accel-inspect", argc, argv, Main); }
