// accel-estimate-memory --model DIR: how much memory a model needs to load
// and to train, per dtype, like `accelerate estimate-memory`.
#include <algorithm>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "core/bytes.h"
#include "core/tool_main.h"
#include "dispatch/device_map.h"
#include "loader/config.h"
#include "models/causal_lm.h"
#include "models/families.h"
#include "models/load_model.h"
#include "models/load_options.h"
#include "models/quantize.h"
#include "models/tensor_parallel.h"

ABSL_FLAG(std::string, model, "", "A HuggingFace model folder (only config.json is read).");
ABSL_FLAG(bool, json, false, "Print one JSON object instead of a table.");
ABSL_FLAG(int, tensor_parallel_size, 1,
          "Split the model over this many ranks (Megatron-style, as accel-serve "
          "--tensor_parallel_size does): the sizes are then one rank's (rank 0, the largest), "
          "followed by each rank's KV cache per 1K tokens and bytes communicated per token.");
ABSL_FLAG(int, pipeline_parallel_size, 1,
          "Split the model's layers into this many stages (as accel-serve "
          "--pipeline_parallel_size does): the sizes are then the largest stage's, and the "
          "per-rank lines add what a stage sends the next per token.");

namespace {

int Fail(const absl::Status& status) {
  std::cerr << "accel-estimate-memory: " << status.message() << "\n";
  return 1;
}

std::string Size(double bytes) { return accel::FormatBytes(static_cast<int64_t>(bytes)); }

}  // namespace

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "accel-estimate-memory --model DIR [--json] [--tensor_parallel_size N] "
      "[--pipeline_parallel_size M]\n"
      "Per dtype (float32, float16/bfloat16, int8, int4 as Accelerate scales them; then\n"
      "bitsandbytes int8 and 4-bit as stored: linears quantized, the rest 16-bit): the largest\n"
      "layer, the total size,\n"
      "and the peak for training with Adam, as `accelerate estimate-memory` computes them.");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 1 || absl::GetFlag(FLAGS_model).empty()) {
    std::cerr << "accel-estimate-memory: expected --model DIR (see --help)\n";
    return 1;
  }
  const std::string dir = absl::GetFlag(FLAGS_model);
  auto config = accel::loader::ReadModelConfig(dir + "/config.json");
  if (!config.ok()) return Fail(config.status());
  const int tp = absl::GetFlag(FLAGS_tensor_parallel_size);
  if (absl::Status split = accel::models::CheckTensorParallel(*config, tp); !split.ok()) {
    return Fail(split);
  }
  const int pp = absl::GetFlag(FLAGS_pipeline_parallel_size);
  if (absl::Status split = accel::models::CheckPipelineParallel(*config, pp); !split.ok()) {
    return Fail(split);
  }
  // Accelerate builds the model in float32 and scales from there; with
  // tensor parallelism, rank 0's slice (its vocab slice is the longest);
  // with pipeline stages, the stage that holds the most.
  absl::StatusOr<accel::dispatch::ModuleTree> tree;
  int largest_stage = 0;
  for (int stage = 0; stage < pp; ++stage) {
    accel::models::TensorParallel place;
    place.size = tp;
    place.pipeline_rank = stage;
    place.pipeline_size = pp;
    auto candidate = accel::models::ModuleTreeFor(*config, c10::ScalarType::Float, place);
    if (!candidate.ok()) return Fail(candidate.status());
    if (!tree.ok() || accel::dispatch::ComputeModuleSizes(*candidate).total() >
                          accel::dispatch::ComputeModuleSizes(*tree).total()) {
      tree = *std::move(candidate);
      largest_stage = stage;
    }
  }
  auto family = accel::models::FamilyOf(*config);
  accel::dispatch::ModuleSizes sizes = accel::dispatch::ComputeModuleSizes(*tree);
  accel::dispatch::LayerSize largest =
      accel::dispatch::GetMaxLayerSize(*tree, sizes, {family->block_class});
  const double total = sizes.total();

  struct Row {
    const char* dtype;
    double divisor;
    bool trainable;
  };
  const Row rows[] = {
      {"float32", 1, true}, {"float16/bfloat16", 2, true}, {"int8", 4, false}, {"int4", 8, false}};
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  if (!absl::GetFlag(FLAGS_json)) {
    std::cout << absl::StrFormat(
        "Memory for %s (%s)%s, largest layer %s:\n", dir,
        config->architectures.empty() ? "" : config->architectures[0],
        absl::StrCat(
            tp > 1 ? absl::StrFormat(", each of %d tensor-parallel ranks", tp) : std::string(),
            pp > 1 ? absl::StrFormat(" of pipeline stage %d (the largest of %d)", largest_stage, pp)
                   : std::string()),
        largest.names.empty() ? "-" : largest.names[0]);
    std::cout << absl::StrFormat("%-18s %14s %14s %28s\n", "dtype", "largest layer", "total size",
                                 "training with Adam (peak)");
  }
  for (const Row& row : rows) {
    // accelerate's estimate_training_usage: float32 peaks at the optimizer
    // step (4x: weights, gradients, two Adam states); mixed precision keeps
    // float32 weights and Adam states beside half-precision gradients.
    double training = -1;
    if (row.divisor == 1) training = 4 * total;
    if (row.divisor == 2) training = std::max({total, total + std::floor(total / 2), 2 * total});
    const double layer = largest.bytes / row.divisor;
    const double size = total / row.divisor;
    if (absl::GetFlag(FLAGS_json)) {
      nlohmann::ordered_json r = {
          {"dtype", row.dtype}, {"largest_layer_bytes", layer}, {"total_bytes", size}};
      r["training_adam_peak_bytes"] =
          row.trainable ? nlohmann::ordered_json(training) : nlohmann::ordered_json();
      out.push_back(r);
    } else {
      std::cout << absl::StrFormat("%-18s %14s %14s %28s\n", row.dtype, Size(layer), Size(size),
                                   row.trainable ? Size(training) : "N/A");
    }
  }
  // bitsandbytes as transformers stores it: the linear layers quantized
  // (lm_head kept), everything else in 16 bits; sized from the same module
  // tree that accel-serve --quantize plans its device map on.
  struct Quantized {
    const char* dtype;
    bool int8;
    bool double_quant;
  };
  for (const Quantized& q :
       {Quantized{"bnb int8", true, false}, Quantized{"bnb nf4/fp4", false, false},
        Quantized{"bnb nf4/fp4 +dq", false, true}}) {
    accel::models::QuantizeOptions asked;
    asked.method = q.int8 ? "int8" : "nf4";  // nf4 and fp4 store the same bytes
    asked.double_quant = q.double_quant;
    auto bnb = accel::models::BnbConfigFor(asked);
    if (!bnb.ok()) return Fail(bnb.status());
    auto plan = accel::models::PlanQuantization(*tree, *bnb);
    if (!plan.ok()) return Fail(plan.status());
    auto quantized = accel::models::QuantizeModuleTree(*tree, *plan);
    if (!quantized.ok()) return Fail(quantized.status());
    accel::dispatch::SizeOptions options;
    options.dtype = c10::ScalarType::Half;
    accel::models::AddQuantizedSizes(*plan, options.special_bytes);
    accel::dispatch::ModuleSizes qsizes = accel::dispatch::ComputeModuleSizes(*quantized, options);
    const double layer =
        accel::dispatch::GetMaxLayerSize(*quantized, qsizes, {family->block_class}).bytes;
    const double size = qsizes.total();
    if (absl::GetFlag(FLAGS_json)) {
      out.push_back({{"dtype", q.dtype},
                     {"largest_layer_bytes", layer},
                     {"total_bytes", size},
                     {"training_adam_peak_bytes", nlohmann::ordered_json()}});
    } else {
      std::cout << absl::StrFormat("%-18s %14s %14s %28s\n", q.dtype, Size(layer), Size(size),
                                   "N/A");
    }
  }
  if (tp > 1 || pp > 1) {
    // Per rank: its KV heads' cache in its stage's layers, and what a token
    // costs in collectives and sends between stages.
    auto shape = accel::models::ShardShapeFor(*config, 0, tp);
    if (!shape.ok()) return Fail(shape.status());
    accel::models::TensorParallel place;
    place.size = tp;
    place.pipeline_size = pp;
    nlohmann::ordered_json parallel = {{"tensor_parallel_size", tp},
                                       {"pipeline_parallel_size", pp}};
    for (const auto& [name, dtype] :
         {std::pair<const char*, c10::ScalarType>{"float32", c10::ScalarType::Float},
          {"float16/bfloat16", c10::ScalarType::BFloat16}}) {
      // The largest stage's layers (the engine plans blocks by it).
      const double kv = static_cast<double>(
          accel::models::KvBlockStore::BytesPerBlock(*config, dtype, /*block_size=*/1024, place));
      const accel::models::TensorParallelTraffic traffic =
          accel::models::TensorParallelTrafficPerToken(*config, dtype, tp, pp);
      if (absl::GetFlag(FLAGS_json)) {
        parallel[name] = {{"kv_cache_bytes_per_1k_tokens_per_rank", kv},
                          {"all_reduces_per_token", traffic.all_reduces},
                          {"collective_payload_bytes_per_token_per_rank", traffic.payload_bytes},
                          {"ring_wire_bytes_per_token_per_rank", traffic.wire_bytes},
                          {"stage_send_bytes_per_token_per_rank", traffic.stage_send_bytes},
                          {"logits_bytes_per_sampled_token", traffic.logits_bytes}};
      } else {
        std::cout << absl::StrFormat(
            "%-18s KV cache per 1K tokens per rank %s (%d of %d KV heads); per token: %d "
            "all-reduces, %s handed to collectives, %s sent by a ring",
            name, Size(kv), shape->kv_heads, config->kv_heads(), traffic.all_reduces,
            Size(static_cast<double>(traffic.payload_bytes)), Size(traffic.wire_bytes));
        if (pp > 1) {
          std::cout << absl::StrFormat(
              ", %s sent to the next stage (and %s of logits per sampled token to the leader)",
              Size(static_cast<double>(traffic.stage_send_bytes)),
              Size(static_cast<double>(traffic.logits_bytes)));
        }
        std::cout << "\n";
      }
    }
    if (absl::GetFlag(FLAGS_json)) out.push_back(parallel);
  }
  if (tp == 1) {
    // What accel-generate / accel-serve would hold with no load flags on
    // this machine (its memory cgroup): the plan LoadModel makes, from the
    // checkpoint's headers (or config.json alone when there are no weights).
    const accel::models::ModelLoadOptions defaults;
    auto load = accel::models::PlanLoad(dir, defaults);
    if (!load.ok()) load = accel::models::PlanLoad(dir, defaults, /*config_only=*/true);
    if (!load.ok()) return Fail(load.status());
    const accel::models::MemoryPlan& m = load->memory;
    if (absl::GetFlag(FLAGS_json)) {
      out.push_back({{"memory_plan",
                      {{"dtype", std::string(c10::toString(load->dtype))},
                       {"budget_bytes", m.budget_bytes},
                       {"fits", m.fits},
                       {"offload_experts", m.offload_experts},
                       {"resident_weight_bytes", m.resident_weight_bytes},
                       {"disk_weight_bytes", m.disk_weight_bytes},
                       {"expert_cache_bytes", m.expert_cache_bytes},
                       {"read_buffer_bytes", m.read_buffer_bytes},
                       {"kv_cache_bytes", m.kv_cache_bytes},
                       {"runtime_bytes", m.runtime_bytes},
                       {"resident_bytes", m.resident_bytes()}}}});
    } else {
      std::cout << absl::StrFormat(
          "Loaded with no load flags here (%s, cpu budget %s): %s resident at most = %s of "
          "weights in memory + %s expert cache + %s read-ahead + %s KV + %s runtime; %s of "
          "weights on disk%s\n",
          c10::toString(load->dtype),
          Size(static_cast<double>(std::max<int64_t>(0, m.budget_bytes))),
          Size(static_cast<double>(m.resident_bytes())),
          Size(static_cast<double>(m.resident_weight_bytes)),
          // Sized for every MoE model, filled only where experts are read one
          // by one (MemoryPlan::resident_bytes counts it only then).
          Size(static_cast<double>(m.offload_experts ? m.expert_cache_bytes : 0)),
          Size(static_cast<double>(m.read_buffer_bytes)),
          Size(static_cast<double>(std::max<int64_t>(0, m.kv_cache_bytes))),
          Size(static_cast<double>(m.runtime_bytes)),
          Size(static_cast<double>(m.disk_weight_bytes)),
          m.offload_experts ? ", experts read one by one" : "");
    }
  }
  if (absl::GetFlag(FLAGS_json)) std::cout << out.dump() << "\n";
  return 0;
}

int main(int argc, char** argv) {
  return accel::ToolMain("accel-estimate-memory", argc, argv, Main);
}
