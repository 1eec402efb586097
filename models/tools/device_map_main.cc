// accel-device-map: where each module of a model would go, for any
// max_memory, without reading a single weight.
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

#include "core/bytes.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/tool_main.h"
#include "dispatch/device_map.h"
#include "loader/config.h"
#include "loader/loader.h"
#include "models/families.h"
#include "models/load_model.h"
#include "models/load_options.h"
#include "models/quantize.h"

ABSL_FLAG(std::string, model, "", "A HuggingFace model folder (only config.json is read).");
ABSL_FLAG(std::string, tree, "",
          "A module tree as JSON (see docs/ARCHITECTURE.md), instead of --model.");
ABSL_FLAG(std::string, no_split, "",
          "Module classes never split across devices, comma-separated. Default with --model: "
          "the family's decoder block.");
ABSL_FLAG(std::string, strategy, "",
          "auto | balanced | balanced_low_0 | sequential; empty: --device_map's (the load "
          "flags' name for it).");
ABSL_FLAG(bool, offload_buffers, false, "Offload the buffers of offloaded modules with them.");
ABSL_FLAG(bool, verbose, false, "Print a per-device summary on stderr.");

namespace {

using accel::dispatch::ModuleTree;

int Fail(const absl::Status& status) {
  std::cerr << "accel-device-map: " << status.message() << "\n";
  return 1;
}

int Run() {
  // The load flags every tool shares (models/load_options.h): --device_map
  // (the strategy planned here), --max_memory, --dtype, --quantize, ...
  const accel::models::ModelLoadOptions load = accel::models::LoadOptionsFromFlags();
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  const std::string tree_path = absl::GetFlag(FLAGS_tree);
  if (model_dir.empty() == tree_path.empty()) {
    return Fail(absl::InvalidArgumentError("give exactly one of --model DIR or --tree FILE.json"));
  }
  accel::dispatch::PlanOptions options;
  std::optional<ModuleTree> tree;
  // auto: the config's torch_dtype with --model, the tree's own dtypes with --tree.
  std::string dtype_name = load.dtype == "auto" ? "" : load.dtype;
  if (!model_dir.empty()) {
    auto config = accel::loader::ReadModelConfig(model_dir + "/config.json");
    if (!config.ok()) return Fail(config.status());
    auto made = accel::models::ModuleTreeFor(*config, c10::ScalarType::Float);
    if (!made.ok()) return Fail(made.status());
    tree = *std::move(made);
    auto family = accel::models::FamilyOf(*config);
    options.no_split = {family->block_class};
    if (dtype_name.empty() && !config->torch_dtype.empty()) dtype_name = config->torch_dtype;
  } else {
    auto text = accel::loader::ReadFile(tree_path);
    if (!text.ok()) return Fail(text.status());
    auto parsed = ModuleTree::FromJson(*text, tree_path);
    if (!parsed.ok()) return Fail(parsed.status());
    tree = *std::move(parsed);
  }
  if (std::string no_split = absl::GetFlag(FLAGS_no_split); !no_split.empty()) {
    options.no_split = absl::StrSplit(no_split, ',', absl::SkipWhitespace());
  }
  if (!dtype_name.empty()) {
    auto dtype = accel::ParseDType(dtype_name);
    if (!dtype.ok()) return Fail(accel::Annotate(dtype.status(), "--dtype"));
    options.sizes.dtype = *dtype;
  }
  options.offload_buffers = absl::GetFlag(FLAGS_offload_buffers);

  // Quantized sizes, from the code accel-serve --quantize loads with.
  std::optional<accel::models::QuantPlan> plan;
  accel::models::QuantizeOptions quantize;
  quantize.method = load.quantize;
  quantize.double_quant = load.double_quant;
  quantize.blocksize = load.quant_blocksize;
  quantize.int8_threshold = load.int8_threshold;
  if (!model_dir.empty()) {
    auto made = accel::models::PlanForModel(model_dir, *tree, quantize, nullptr);
    if (!made.ok()) return Fail(accel::Annotate(made.status(), "--quantize"));
    if (!made->empty()) plan = *std::move(made);
  } else if (quantize.method != "none") {
    auto config = accel::models::BnbConfigFor(quantize);
    if (!config.ok()) return Fail(accel::Annotate(config.status(), "--quantize"));
    auto made = accel::models::PlanQuantization(*tree, *config);
    if (!made.ok()) return Fail(accel::Annotate(made.status(), "--quantize"));
    plan = *std::move(made);
  }
  if (plan) {
    auto quantized = accel::models::QuantizeModuleTree(*tree, *plan);
    if (!quantized.ok()) return Fail(quantized.status());
    tree = *std::move(quantized);
    accel::models::AddQuantizedSizes(*plan, options.sizes.special_bytes);
  }

  bool probed = false;
  absl::StatusOr<accel::dispatch::MaxMemory> mm;
  if (const std::string& spec = load.max_memory; !spec.empty()) {
    mm = accel::dispatch::ParseMaxMemory(spec);
    if (!mm.ok()) return Fail(accel::Annotate(mm.status(), "--max_memory"));
  } else {
    mm = accel::dispatch::ProbeMaxMemory();
    if (!mm.ok()) return Fail(mm.status());
    probed = true;
  }
  const std::string& offload_experts = load.offload_experts;
  if (offload_experts != "auto" && offload_experts != "true" && offload_experts != "false") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--offload_experts '", offload_experts, "': expected auto, true or false")));
  }
  // The plan printed is the one asked for: auto (loading's default, which
  // turns experts on only when the model does not fit) prints Accelerate's
  // whole-block plan here, as false does; true plans the experts one by one.
  if (offload_experts == "true") {
    if (model_dir.empty()) {
      return Fail(
          absl::InvalidArgumentError("--offload_experts needs --model (its config names "
                                     "the experts)"));
    }
    auto config = accel::loader::ReadModelConfig(model_dir + "/config.json");
    if (!config.ok()) return Fail(config.status());
    auto resolved = accel::models::ResolveConfig(*config);
    if (!resolved.ok()) return Fail(resolved.status());
    options.expert_lists = accel::models::ExpertLists(*resolved);
    if (options.expert_lists.empty()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "--offload_experts: ",
          config->architectures.empty() ? config->model_type : config->architectures[0],
          " has no mixture-of-experts layers")));
    }
    auto cache =
        accel::models::ExpertCacheBytes(load.expert_cache, *resolved, *tree, options.sizes, *mm);
    if (!cache.ok()) return Fail(accel::Annotate(cache.status(), "--expert_cache"));
    options.expert_cache_bytes = static_cast<double>(*cache);
  }
  accel::dispatch::PlanReport report;
  std::string strategy = absl::GetFlag(FLAGS_strategy);
  if (strategy.empty()) strategy = load.device_map;
  auto map = accel::dispatch::PlanDeviceMap(*tree, strategy, *mm, options, probed, &report);
  if (!map.ok()) return Fail(accel::Annotate(map.status(), "--device_map (--strategy)"));
  std::cout << map->ToJson() << "\n";

  if (absl::GetFlag(FLAGS_verbose)) {
    accel::dispatch::ModuleSizes sizes = accel::dispatch::ComputeModuleSizes(*tree, options.sizes);
    std::cerr << absl::StrFormat("model: %s in %s\n",
                                 accel::FormatBytes(static_cast<int64_t>(sizes.total())),
                                 tree->node(0).class_name);
    std::map<accel::Placement, std::pair<double, int>> per_device;
    for (const auto& [name, p] : map->entries()) {
      per_device[p].first += sizes.at(name);
      per_device[p].second += 1;
    }
    for (const auto& [p, total] : per_device) {
      std::string budget = "unlimited";
      for (const auto& [q, bytes] : *mm) {
        if (q == p) budget = accel::FormatBytes(static_cast<int64_t>(bytes));
      }
      std::cerr << absl::StrFormat("  %-6s %10s in %4d entries (budget %s)\n", p.ToString(),
                                   accel::FormatBytes(static_cast<int64_t>(total.first)),
                                   total.second, budget);
    }
    if (report.expert_cache_bytes > 0) {
      std::cerr << absl::StrFormat(
          "  expert cache: %s kept on the execution device\n",
          accel::FormatBytes(static_cast<int64_t>(report.expert_cache_bytes)));
    }
    for (const std::string& w : report.warnings) std::cerr << "note: " << w << "\n";
  }
  return 0;
}

}  // namespace

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "accel-device-map (--model DIR | --tree FILE.json) [--max_memory 0=10GiB,cpu=30GiB]\n"
      "  [--no_split A,B] [--dtype bfloat16] [--strategy auto] [--offload_buffers] [--verbose]\n"
      "  [--offload_experts true [--expert_cache 2GiB]]\n"
      "Prints the device map as one JSON object: {\"module.name\": 0 | \"cpu\" | \"disk\"}.");
  accel::models::RegisterLoadFlags();
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 1) {
    std::cerr << "accel-device-map: unexpected argument '" << args[1] << "' (see --help)\n";
    return 1;
  }
  return Run();
}

int main(int argc, char** argv) { return accel::ToolMain("accel-device-map", argc, argv, Main); }
