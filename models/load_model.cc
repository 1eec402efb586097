#include "models/load_model.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <optional>
#include <utility>

#include <ATen/Context.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

#include "core/bytes.h"
#include "core/dtype.h"
#include "core/file_faults.h"
#include "core/placement.h"
#include "core/status.h"
#include "dispatch/empty_weights.h"
#include "dispatch/module_tree.h"
#include "loader/loader.h"
#include "models/families.h"
#include "models/quantize.h"
#include "models/tensor_parallel.h"

namespace accel::models {
namespace {

absl::StatusOr<at::ScalarType> ChooseDType(const ModelLoadOptions& options,
                                           const loader::ModelConfig& config) {
  std::string name = options.dtype;
  if (name.empty() || name == "auto")
    name = config.torch_dtype.empty() ? "float32" : config.torch_dtype;
  absl::StatusOr<at::ScalarType> dtype = ParseDType(name);
  if (!dtype.ok() || (*dtype != at::kFloat && *dtype != at::kBFloat16 && *dtype != at::kHalf)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype '", name, "'", options.dtype == "auto" ? " (config.json's torch_dtype)" : "",
        ": expected auto, float32, bfloat16 or float16"));
  }
  return *dtype;
}

bool IsStrategy(absl::string_view name) {
  return name == "auto" || name == "balanced" || name == "balanced_low_0" || name == "sequential";
}

absl::Status CheckGpus(const dispatch::DeviceMap& map) {
  for (const auto& [name, placement] : map.entries()) {
    if (placement.is_cuda() && !at::hasCUDA()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device_map puts '", name.empty() ? std::string("the whole model") : name, "' on ",
          placement.ToString(), " but this build of libtorch has no CUDA (or sees no GPU)"));
    }
  }
  return absl::OkStatus();
}

// The layers to quantize: as the checkpoint stores them, or as asked.
absl::StatusOr<QuantPlan> ChooseQuantization(const std::string& dir,
                                             const ModelLoadOptions& options,
                                             const loader::ModelConfig& config,
                                             at::ScalarType dtype, bool& prequantized,
                                             bool config_only) {
  QuantizeOptions asked;
  asked.method = options.quantize;
  asked.double_quant = options.double_quant;
  asked.blocksize = options.quant_blocksize;
  asked.int8_threshold = options.int8_threshold;
  asked.compute_dtype = dtype;
  if (options.quant_compute_dtype != "auto") {
    absl::StatusOr<at::ScalarType> compute = ParseDType(options.quant_compute_dtype);
    if (!compute.ok() ||
        !(*compute == at::kFloat || *compute == at::kBFloat16 || *compute == at::kHalf)) {
      return absl::InvalidArgumentError(
          absl::StrCat("quant_compute_dtype '", options.quant_compute_dtype,
                       "': expected auto, float32, bfloat16 or float16"));
    }
    asked.compute_dtype = *compute;
  }
  const TensorParallel& tp = options.tensor_parallel;
  ACCEL_ASSIGN_OR_RETURN(dispatch::ModuleTree tree, ModuleTreeFor(config, dtype, tp));
  QuantPlan plan;
  if (config_only && !std::filesystem::exists(dir + "/model.safetensors") &&
      !std::filesystem::exists(dir + "/model.safetensors.index.json")) {
    // No checkpoint to read the quantized layers from: as transformers
    // quantizes on loading.
    ACCEL_ASSIGN_OR_RETURN(std::optional<quant::BnbQuantizationConfig> stored,
                           ReadQuantizationConfig(dir + "/config.json"));
    prequantized = stored.has_value();
    if (stored) {
      ACCEL_ASSIGN_OR_RETURN(plan, PlanQuantization(tree, *stored));
    } else {
      ACCEL_ASSIGN_OR_RETURN(plan, PlanForModel(dir, tree, asked, &prequantized));
    }
  } else {
    ACCEL_ASSIGN_OR_RETURN(plan, PlanForModel(dir, tree, asked, &prequantized));
  }
  if (prequantized && tp.split()) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir,
        "/config.json: a pre-quantized checkpoint (quantization_config) cannot be split "
        "for tensor_parallel_size ",
        tp.size, " x pipeline_parallel_size ", tp.pipeline_size,
        ": its packed blocks do not split along heads; load the float checkpoint and quantize "
        "each rank's slice (--quantize)"));
  }
  return plan;
}

// Of the machine's (its memory cgroup's) memory, what a probed budget may
// plan in: the rest is the kernel's, other processes' and a margin against
// estimates that run short.
constexpr double kUsableShare = 0.85;
constexpr int64_t kMiB = int64_t{1} << 20;

// libtorch's own memory, threads' stacks, the allocator's kept blocks, and
// one step's activations (a 512-token prefill: hidden states, a layer's MLP
// intermediates, attention scores) in float32.
int64_t RuntimeReserve(const ResolvedConfig& r) {
  const loader::ModelConfig& c = r.config;
  const int64_t tokens = 512;
  const int64_t mlp = std::max(c.intermediate_size, r.expert_intermediate);
  const int64_t activations =
      tokens * 4 *
      (8 * c.hidden_size + 3 * mlp + c.num_attention_heads * tokens + c.vocab_size / 8);
  return 512 * kMiB + activations;
}

absl::StatusOr<bool> ParseTristate(const std::string& value, const char* option) {
  if (value == "true" || value == "on" || value == "1") return true;
  if (value == "false" || value == "off" || value == "0") return false;
  return absl::InvalidArgumentError(
      absl::StrCat(option, " '", value, "': expected auto, true or false"));
}

// Bytes planned on each placement ("cpu", "disk", "cuda:0"), from the map's
// keys and the size table.
std::map<std::string, double> BytesByPlacement(const dispatch::DeviceMap& map,
                                               const dispatch::ModuleSizes& table) {
  std::map<std::string, double> out;
  for (const auto& [name, p] : map.entries()) out[p.ToString()] += table.at(name);
  return out;
}

// The device map and the memory plan, for a strategy or a given map.
absl::Status ChooseDeviceMap(const ModelLoadOptions& options, LoadPlan& out) {
  const loader::ModelConfig& config = out.config;
  ACCEL_ASSIGN_OR_RETURN(dispatch::ModuleTree tree,
                         ModuleTreeFor(config, out.dtype, options.tensor_parallel));
  ACCEL_ASSIGN_OR_RETURN(ResolvedConfig resolved, ResolveConfig(config));
  dispatch::PlanOptions plan;
  plan.no_split = {resolved.family.block_class};
  plan.sizes.dtype = out.dtype;
  if (!out.quantization.empty()) {
    // Sized as stored: quantized weights at their packed bytes.
    ACCEL_ASSIGN_OR_RETURN(tree, QuantizeModuleTree(tree, out.quantization));
    AddQuantizedSizes(out.quantization, plan.sizes.special_bytes);
  }
  const dispatch::ModuleSizes table = dispatch::ComputeModuleSizes(tree, plan.sizes);
  const std::vector<std::string> lists = ExpertLists(resolved);
  double expert_bytes = 0;
  for (const std::string& list : lists) expert_bytes += table.at(list);
  MemoryPlan& memory = out.memory;
  memory.runtime_bytes = RuntimeReserve(resolved);

  const std::string& spec = options.device_map;
  if (!IsStrategy(spec)) {
    if (!options.max_memory.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("max_memory plans a device map; it cannot go with device_map '", spec, "'"));
    }
    ACCEL_ASSIGN_OR_RETURN(memory.expert_cache_bytes,
                           ExpertCacheBytes(options.expert_cache, resolved, tree, plan.sizes, {}));
    if (absl::StatusOr<Placement> one = Placement::Parse(spec); one.ok()) {
      out.device_map.Set("", *one);
    } else {
      if (!std::filesystem::exists(spec)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "device_map '", spec,
            "': expected auto, balanced, balanced_low_0, sequential, a device (cpu, 0, disk) or "
            "the path of a JSON device map"));
      }
      ACCEL_ASSIGN_OR_RETURN(std::string text, loader::ReadFile(spec));
      ACCEL_ASSIGN_OR_RETURN(out.device_map, dispatch::DeviceMap::FromJson(text, spec));
    }
  } else {
    dispatch::MaxMemory max_memory;
    const bool probed = options.max_memory.empty();
    if (probed) {
      ACCEL_ASSIGN_OR_RETURN(max_memory, dispatch::ProbeMaxMemory());
      if (!at::hasCUDA()) {  // GPUs NVML sees but this libtorch cannot use
        max_memory.erase(std::remove_if(max_memory.begin(), max_memory.end(),
                                        [](const auto& entry) { return entry.first.is_cuda(); }),
                         max_memory.end());
      }
    } else {
      absl::StatusOr<dispatch::MaxMemory> parsed = dispatch::ParseMaxMemory(options.max_memory);
      if (!parsed.ok()) return Annotate(parsed.status(), "max_memory");
      max_memory = *std::move(parsed);
    }
    double room = 0;  // every budget but the disk's
    for (const auto& [p, bytes] : max_memory) {
      if (!p.is_disk()) room += bytes;
    }
    const double total = table.total();
    if (probed) {
      // A probed budget is all the machine has: keep a share for others and
      // the reserves out of it; a given one is for weights, as Accelerate's.
      for (auto& [p, bytes] : max_memory) {
        if (!p.is_cpu()) continue;
        ACCEL_ASSIGN_OR_RETURN(int64_t machine, dispatch::TotalHostMemory());
        const double before = bytes;
        bytes = std::min(bytes, kUsableShare * static_cast<double>(machine));
        room -= before - bytes;
      }
      memory.fits = total + static_cast<double>(memory.runtime_bytes) <= room;
      if (!memory.fits || options.kv_cache_bytes >= 0) {
        memory.kv_cache_bytes = options.kv_cache_bytes;
        if (memory.kv_cache_bytes < 0) {
          double cpu = 0;
          for (const auto& [p, bytes] : max_memory) {
            if (p.is_cpu()) cpu = bytes;
          }
          memory.kv_cache_bytes =
              std::clamp(static_cast<int64_t>(cpu / 32), 256 * kMiB, 1024 * kMiB);
        }
      }
      // Disk modules other than experts are read ahead into buffers: the
      // running one and two more, each at most a block.
      if (!memory.fits && lists.empty()) {
        const double block =
            dispatch::GetMaxLayerSize(tree, table, {resolved.family.block_class}).bytes;
        memory.read_buffer_bytes = static_cast<int64_t>(3 * block);
      }
      for (auto& [p, bytes] : max_memory) {
        if (!p.is_cpu()) continue;
        bytes = std::max(0.0, bytes - static_cast<double>(memory.runtime_bytes) -
                                  static_cast<double>(std::max<int64_t>(0, memory.kv_cache_bytes)) -
                                  static_cast<double>(memory.read_buffer_bytes));
      }
    } else {
      memory.fits = total <= room;
    }
    for (const auto& [p, bytes] : max_memory) {
      if (p.is_cpu()) memory.budget_bytes = static_cast<int64_t>(bytes);
    }
    bool offload_experts = false;
    if (options.offload_experts == "auto") {
      offload_experts = !lists.empty() && !memory.fits;
    } else {
      ACCEL_ASSIGN_OR_RETURN(offload_experts,
                             ParseTristate(options.offload_experts, "offload_experts"));
    }
    bool on_gpu = false;
    for (const auto& [p, bytes] : max_memory) {
      if (p.is_cuda()) on_gpu = true;
    }
    if (options.execution_device != "auto" && options.execution_device != "cpu") on_gpu = true;
    if (offload_experts && options.expert_cache == "auto" && !on_gpu && !lists.empty()) {
      // Every byte the budget leaves beside the rest of the model: no expert
      // stays in RAM for good, the cache keeps those the routing uses.
      const double rest = total - expert_bytes;
      memory.expert_cache_bytes =
          static_cast<int64_t>(std::max(0.0, static_cast<double>(memory.budget_bytes) - rest));
    } else {
      ACCEL_ASSIGN_OR_RETURN(
          memory.expert_cache_bytes,
          ExpertCacheBytes(options.expert_cache, resolved, tree, plan.sizes, max_memory));
    }
    if (offload_experts) {
      plan.expert_lists = lists;
      plan.expert_cache_bytes = static_cast<double>(memory.expert_cache_bytes);
    }
    memory.offload_experts = offload_experts && !lists.empty();
    dispatch::PlanReport report;
    ACCEL_ASSIGN_OR_RETURN(out.device_map,
                           dispatch::PlanDeviceMap(tree, spec, max_memory, plan, probed, &report));
    if (memory.read_buffer_bytes > 0) {
      // The reader's window was reserved at three of the largest layer, which
      // can be one that stays in memory (Llama-3-70B's 1.96 GiB embedding,
      // about five of its decoder layers): three of the largest layers the plan put
      // on disk is what it holds. The difference goes back to the cpu budget
      // and the map is planned again; with more room, fewer layers go to disk,
      // so the window planned on can only shrink.
      const std::vector<double> on_disk =
          dispatch::LayerSizesOn(tree, table, plan.no_split, out.device_map, Placement::Disk());
      double window = 0;
      for (size_t k = 0; k < std::min<size_t>(3, on_disk.size()); ++k) window += on_disk[k];
      const double freed = static_cast<double>(memory.read_buffer_bytes) - window;
      if (freed > 0) {
        memory.read_buffer_bytes = static_cast<int64_t>(window);
        for (auto& [p, bytes] : max_memory) {
          if (!p.is_cpu()) continue;
          bytes += freed;
          memory.budget_bytes = static_cast<int64_t>(bytes);
        }
        report = {};
        ACCEL_ASSIGN_OR_RETURN(
            out.device_map, dispatch::PlanDeviceMap(tree, spec, max_memory, plan, probed, &report));
      }
    }
    if (offload_experts)
      memory.expert_cache_bytes = static_cast<int64_t>(report.expert_cache_bytes);
    // What the cpu budget leaves beside the modules planned there: the room
    // for disk weights mapped in place to stay between uses.
    for (const auto& [p, budget] : max_memory) {
      if (!p.is_cpu()) continue;
      double used = 0;
      for (const auto& [q, bytes] : report.used) {
        if (q.is_cpu()) used = bytes;
      }
      out.cpu_room = static_cast<int64_t>(std::max(0.0, budget - used));
    }
    if (probed && memory.fits && memory.kv_cache_bytes < 0 && !on_gpu) {
      // A model that fits maps its weights in place, and they become
      // resident as the forwards touch them; the KV cache gets what the cpu
      // budget leaves beside them. Unplanned, the engine took half the
      // memory free at its start, before the weights were resident
      // (Qwen3-30B-A3B NF4, 16.8 GiB of a 23.5 GiB machine: a KV cache of
      // about 11 GiB, which the weights could not stay beside once used).
      memory.kv_cache_bytes = std::max<int64_t>(out.cpu_room, 256 * kMiB);
    }
  }
  const std::map<std::string, double> placed = BytesByPlacement(out.device_map, table);
  if (auto it = placed.find("cpu"); it != placed.end()) {
    memory.resident_weight_bytes = static_cast<int64_t>(it->second);
  }
  if (auto it = placed.find("disk"); it != placed.end()) {
    memory.disk_weight_bytes = static_cast<int64_t>(it->second);
  }
  memory.direct_reads = options.direct_reads.value_or(false);
  return absl::OkStatus();
}

// The highest N of the tensors named `list`.N.* in `checkpoint`, or -1.
int64_t LastIndex(const loader::Checkpoint& checkpoint, const std::string& list) {
  const std::string start = list + ".";
  int64_t last = -1;
  for (const loader::Checkpoint::Entry& e : checkpoint.tensors()) {
    absl::string_view name = e.info.name;
    if (!absl::ConsumePrefix(&name, start)) continue;
    int64_t index = 0;
    if (absl::SimpleAtoi(name.substr(0, name.find('.')), &index)) last = std::max(last, index);
  }
  return last;
}

// The last layer config.json asks for must be in the checkpoint, checked
// from its headers (index, safetensors headers, .bin pickles) before
// anything in proportion to the layers is made: the skeleton costs memory and
// time per layer, so a config.json with num_hidden_layers 100000 took 2.6 GB
// and a minute before the load found the tensors missing. A checkpoint with
// more layers than the config is left to the warning about unused tensors.
absl::Status CheckLayersAgainstCheckpoint(const std::string& dir, const loader::ModelConfig& config,
                                          const loader::Checkpoint& checkpoint) {
  ACCEL_ASSIGN_OR_RETURN(Family family, FamilyOf(config));
  const std::string stack =
      std::string(family.model_type) == "gpt2" ? "transformer.h" : "model.layers";
  const int64_t layers = config.num_hidden_layers;
  const int64_t last = LastIndex(checkpoint, stack);
  if (layers > 0 && last < layers - 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, "/config.json: num_hidden_layers is ", layers, ", but the checkpoint holds ",
        last < 0 ? absl::StrCat("no layer (no ", stack, ".N tensors)")
                 : absl::StrCat("layers up to ", stack, ".", last, " only"),
        " (checked before building the model)"));
  }
  return absl::OkStatus();
}

// The same for the experts of the last sparse layer.
absl::Status CheckExpertsAgainstCheckpoint(const std::string& dir, const ResolvedConfig& r,
                                           const loader::Checkpoint& checkpoint) {
  const std::vector<std::string> lists = ExpertLists(r);
  if (lists.empty() || r.num_experts <= 0) return absl::OkStatus();
  const int64_t last = LastIndex(checkpoint, lists.back());
  if (last < r.num_experts - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/config.json: ", r.num_experts,
                     " experts in each sparse layer, but the checkpoint ", "holds ",
                     last < 0 ? absl::StrCat("none in ", lists.back())
                              : absl::StrCat("experts up to ", lists.back(), ".", last, " only"),
                     " (checked before building the model)"));
  }
  return absl::OkStatus();
}

// transformers' llm_int8_enable_fp32_cpu_offload: true keeps the modules a
// multi-entry device map puts on the cpu or the disk unquantized. A
// pre-quantized checkpoint stores them quantized (which ones are read from
// its tensors), and accel does not dequantize on loading: where the flag
// would change the model it is refused, naming the first such layer.
absl::Status CheckFp32CpuOffload(const std::string& dir, const dispatch::DeviceMap& map,
                                 const QuantPlan& quantization) {
  if (map.entries().size() <= 1) return absl::OkStatus();  // transformers' rule, too
  ACCEL_ASSIGN_OR_RETURN(std::optional<quant::BnbQuantizationConfig> stored,
                         ReadQuantizationConfig(dir + "/config.json"));
  if (!stored || !stored->llm_int8_enable_fp32_cpu_offload) return absl::OkStatus();
  for (const auto& [layer, q] : quantization) {
    if (!q.enabled()) continue;
    const std::optional<Placement> p = map.Lookup(layer);
    if (p && (p->is_cpu() || p->is_disk())) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir,
          "/config.json: quantization_config's llm_int8_enable_fp32_cpu_offload is true, so "
          "transformers would keep the layers the device map puts on the cpu or the disk "
          "unquantized, but '",
          layer, "' (on ", p->ToString(),
          ") is stored quantized and accel does not dequantize it: set the key to false "
          "(accel runs quantized layers on the cpu) or place the layers on a GPU"));
    }
  }
  return absl::OkStatus();
}

// The expert lists to fetch one by one: all, with offload_experts; else
// those the device map places inside of (a map planned that way).
std::vector<std::string> FetchedExpertLists(bool offload_experts, const ResolvedConfig& resolved,
                                            const dispatch::DeviceMap& map) {
  std::vector<std::string> lists = ExpertLists(resolved);
  if (offload_experts) return lists;
  std::vector<std::string> inside;
  for (const std::string& list : lists) {
    for (const auto& [name, p] : map.entries()) {
      if (absl::StartsWith(name, list + ".")) {
        inside.push_back(list);
        break;
      }
    }
  }
  return inside;
}

// Where converted disk weights go when no offload folder is given: a folder
// of the user's cache per model and conversion, so a second load of the same
// model finds the first one's and nothing lands beside the checkpoint.
std::string DefaultOffloadFolder(const std::string& dir, const LoadPlan& plan) {
  std::string base;
  if (const char* env = std::getenv("ACCEL_CACHE_DIR"); env != nullptr && *env != '\0') {
    base = env;
  } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    base = absl::StrCat(xdg, "/accel");
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    base = absl::StrCat(home, "/.cache/accel");
  } else {
    base = "/tmp/accel-cache";
  }
  std::error_code ec;
  const std::string absolute = std::filesystem::absolute(dir, ec).lexically_normal().string();
  std::string key = absl::StrCat(absolute, "|", DTypeName(plan.dtype));
  for (const auto& [name, how] : plan.quantization)
    absl::StrAppend(&key, "|", name, how.ToString());
  const std::string leaf = std::filesystem::path(absolute).filename().string();
  return absl::StrCat(base, "/offload/", leaf.empty() ? "model" : leaf, "-",
                      absl::Hex(std::hash<std::string>()(key), absl::kZeroPad16));
}

absl::StatusOr<std::optional<at::Device>> ChooseExecutionDevice(const std::string& spec) {
  if (spec.empty() || spec == "auto") return std::nullopt;
  absl::StatusOr<Placement> p = Placement::Parse(spec);
  if (!p.ok() || p->is_disk()) {
    return absl::InvalidArgumentError(
        absl::StrCat("execution_device '", spec, "': expected auto, cpu, or a GPU (0, cuda:1)"));
  }
  if (p->is_cpu()) return at::Device(at::kCPU);
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(p->index()));
}

// Warnings go to stderr at once, as transformers' logger.warning does (so accel-serve's log
// shows them), and stay in LoadedModel::warnings for callers and tests.
void Warn(LoadedModel& out, std::string message) {
  std::cerr << "accel: warning: " << message << "\n";
  out.warnings.push_back(std::move(message));
}

// An eos id outside [0, vocab_size) can never be generated, so it could never stop anything.
// transformers accepts such a config: GenerationConfig does not check eos against the
// vocabulary, and generate() only warns for a negative one ("Your generation will not stop
// until the maximum length is reached"). So accel accepts it too, warns naming the file and
// field, and drops the id, so that nothing downstream meets an id the model cannot produce.
// When generation_config.json's ids are all dropped, config.json's apply, as they do when
// that file names none (LoadedModel::eos_token_ids).
void DropEosOutsideVocabulary(LoadedModel& out, const std::string& file,
                              std::vector<int64_t>& ids) {
  const int64_t vocab = out.config.vocab_size;
  std::vector<int64_t> kept, dropped;
  for (int64_t id : ids) (id >= 0 && id < vocab ? kept : dropped).push_back(id);
  if (dropped.empty()) return;
  Warn(out, absl::StrCat(file, ": eos_token_id ", absl::StrJoin(dropped, ", "),
                         " outside the vocabulary [0, ", vocab,
                         ") of config.json's vocab_size can never be generated; dropped"));
  ids = std::move(kept);
}

// GPT-2 checkpoints store each layer's causal mask (h.N.attn.bias, h.N.attn.masked_bias).
// transformers' GPT2Attention holds them as buffers, so it never reports them as unused;
// accel computes its mask and has no such tensors, so they are not reported either.
bool IsGpt2MaskBuffer(const loader::ModelConfig& config, absl::string_view name) {
  return config.model_type == "gpt2" &&
         (absl::EndsWith(name, ".attn.bias") || absl::EndsWith(name, ".attn.masked_bias"));
}

// As transformers' "Some weights of the model checkpoint at X were not used when
// initializing Y": the load goes on (a checkpoint may hold more than a config asks for, e.g.
// a model cut to fewer layers on purpose), but a config whose num_hidden_layers, or another
// size, leaves tensors unused is most often a mistake, so they are named (the first few and
// a count: a cut model can leave thousands).
void WarnAboutUnusedTensors(LoadedModel& out, const std::string& dir) {
  constexpr size_t kNamed = 5;
  std::vector<std::string> unused;
  for (const std::string& name : out.dispatched->unexpected()) {
    if (!IsGpt2MaskBuffer(out.config, name)) unused.push_back(name);
  }
  if (unused.empty()) return;
  const std::string model_class =
      out.config.architectures.empty() ? out.config.model_type : out.config.architectures[0];
  std::string named = absl::StrJoin(
      unused.begin(), unused.begin() + static_cast<std::ptrdiff_t>(std::min(kNamed, unused.size())),
      ", ");
  if (unused.size() > kNamed) absl::StrAppend(&named, ", ... (", unused.size() - kNamed, " more)");
  Warn(out,
       absl::StrCat("Some weights of the model checkpoint at ", dir,
                    " were not used when initializing ", model_class, ": ", unused.size(),
                    " tensor", unused.size() == 1 ? "" : "s", " (", named,
                    "). Check config.json: its num_hidden_layers (", out.config.num_hidden_layers,
                    ") or another size may be smaller than the checkpoint's"));
}

}  // namespace

absl::StatusOr<int64_t> ExpertCacheBytes(const std::string& expert_cache,
                                         const ResolvedConfig& resolved,
                                         const dispatch::ModuleTree& tree,
                                         const dispatch::SizeOptions& sizes,
                                         const dispatch::MaxMemory& max_memory) {
  if (expert_cache != "auto") {
    absl::StatusOr<int64_t> bytes = ParseByteSize(expert_cache);
    if (!bytes.ok()) return Annotate(bytes.status(), "expert_cache");
    return *bytes;
  }
  const std::vector<std::string> lists = ExpertLists(resolved);
  if (lists.empty()) return 0;
  const dispatch::ModuleSizes table = dispatch::ComputeModuleSizes(tree, sizes);
  double bytes = 0;
  for (const std::string& list : lists)
    bytes += static_cast<double>(resolved.top_k) * table.at(list + ".0");
  for (const auto& [p, budget] : max_memory) {
    if (p.is_cuda() || p.is_cpu()) {  // the first of them runs the experts
      bytes = std::min(bytes, budget / 2);
      break;
    }
  }
  return static_cast<int64_t>(bytes);
}

absl::Status CheckTokenizer(const tokenizer::Tokenizer& tokenizer,
                            const loader::ModelConfig& config, const std::string& tokenizer_path) {
  if (tokenizer.vocab_size() > config.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(tokenizer_path, ": its ids reach ", tokenizer.vocab_size() - 1,
                     ", past config.json's vocab_size of ", config.vocab_size,
                     " (the model has no embedding for them): a tokenizer of another model?"));
  }
  // Every stage of the pipeline runs once (normalizer, pre-tokenizer regexes,
  // the model, the decoder), so what only fails when used fails now.
  constexpr absl::string_view kProbe = "Hello, world! 123 \u00e9t\u00e9\n\tdone.";
  absl::StatusOr<std::vector<int64_t>> ids = tokenizer.Encode(kProbe, /*add_special_tokens=*/true);
  if (!ids.ok()) return Annotate(ids.status(), absl::StrCat(tokenizer_path, ": encoding a probe"));
  absl::StatusOr<std::string> text = tokenizer.Decode(*ids, /*skip_special_tokens=*/true);
  if (!text.ok()) {
    return Annotate(text.status(), absl::StrCat(tokenizer_path, ": decoding a probe"));
  }
  return absl::OkStatus();
}

absl::Status CheckLoadOptions(const ModelLoadOptions& options) {
  if (!options.dtype.empty() && options.dtype != "auto") {
    loader::ModelConfig any;
    ACCEL_RETURN_IF_ERROR(ChooseDType(options, any).status());
  }
  const std::string& method = options.quantize;
  if (method != "none" && method != "int8" && method != "nf4" && method != "fp4") {
    return absl::InvalidArgumentError(
        absl::StrCat("quantize '", method, "': expected none, int8, nf4 or fp4"));
  }
  if (options.double_quant && method != "nf4" && method != "fp4") {
    return absl::InvalidArgumentError("double_quant applies to 4-bit quantization (nf4, fp4)");
  }
  QuantizeOptions asked;
  asked.method = method == "none" ? "nf4" : method;  // the numbers are checked whatever the method
  asked.double_quant = options.double_quant && method != "none";
  asked.blocksize = options.quant_blocksize;
  asked.int8_threshold = options.int8_threshold;
  if (options.quant_compute_dtype != "auto") {
    absl::StatusOr<at::ScalarType> compute = ParseDType(options.quant_compute_dtype);
    if (!compute.ok() ||
        !(*compute == at::kFloat || *compute == at::kBFloat16 || *compute == at::kHalf)) {
      return absl::InvalidArgumentError(
          absl::StrCat("quant_compute_dtype '", options.quant_compute_dtype,
                       "': expected auto, float32, bfloat16 or float16"));
    }
  }
  ACCEL_RETURN_IF_ERROR(BnbConfigFor(asked).status());
  const std::string& spec = options.device_map;
  if (IsStrategy(spec)) {
    if (!options.max_memory.empty()) {
      absl::StatusOr<dispatch::MaxMemory> parsed = dispatch::ParseMaxMemory(options.max_memory);
      if (!parsed.ok()) return Annotate(parsed.status(), "max_memory");
    }
  } else {
    if (!options.max_memory.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("max_memory plans a device map; it cannot go with device_map '", spec, "'"));
    }
    if (absl::StatusOr<Placement> one = Placement::Parse(spec); one.ok()) {
      dispatch::DeviceMap map;
      map.Set("", *one);
      ACCEL_RETURN_IF_ERROR(CheckGpus(map));
    } else if (!std::filesystem::exists(spec)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device_map '", spec,
          "': expected auto, balanced, balanced_low_0, sequential, a device (cpu, 0, disk) or "
          "the path of a JSON device map"));
    }
  }
  if (options.offload_experts != "auto") {
    ACCEL_RETURN_IF_ERROR(ParseTristate(options.offload_experts, "offload_experts").status());
  }
  if (options.expert_cache != "auto") {
    absl::StatusOr<int64_t> bytes = ParseByteSize(options.expert_cache);
    if (!bytes.ok()) return Annotate(bytes.status(), "expert_cache");
  }
  ACCEL_ASSIGN_OR_RETURN(std::optional<at::Device> execution,
                         ChooseExecutionDevice(options.execution_device));
  if (execution && execution->is_cuda() && !at::hasCUDA()) {
    return absl::InvalidArgumentError(
        absl::StrCat("execution_device '", options.execution_device,
                     "': this build of libtorch has no CUDA (or sees no GPU)"));
  }
  return absl::OkStatus();
}

std::vector<int64_t> LoadedModel::eos_token_ids() const {
  return generation_config.eos_token_ids.empty() ? config.eos_token_ids
                                                 : generation_config.eos_token_ids;
}

int64_t MemoryPlan::resident_bytes() const {
  // The expert cache is sized for every MoE model, but only experts fetched
  // one by one fill it: a model that fits maps its experts in place.
  return resident_weight_bytes + (offload_experts ? expert_cache_bytes : 0) + read_buffer_bytes +
         std::max<int64_t>(0, kv_cache_bytes) + runtime_bytes;
}

absl::StatusOr<LoadPlan> PlanLoad(const std::string& dir, const ModelLoadOptions& options,
                                  bool config_only) {
  LoadPlan out;
  ACCEL_ASSIGN_OR_RETURN(out.config, loader::ReadModelConfig(dir + "/config.json"));
  ACCEL_ASSIGN_OR_RETURN(out.dtype, ChooseDType(options, out.config));
  ACCEL_ASSIGN_OR_RETURN(ResolvedConfig resolved, ResolveConfig(out.config));
  ACCEL_RETURN_IF_ERROR(CheckTensorParallel(out.config, options.tensor_parallel.size));
  ACCEL_RETURN_IF_ERROR(CheckPipelineParallel(out.config, options.tensor_parallel.pipeline_size));
  if (!config_only) {
    // Headers only: nothing is read or allocated in proportion to the model.
    ACCEL_ASSIGN_OR_RETURN(loader::Checkpoint checkpoint, loader::Checkpoint::Open(dir));
    ACCEL_RETURN_IF_ERROR(CheckLayersAgainstCheckpoint(dir, out.config, checkpoint));
    ACCEL_RETURN_IF_ERROR(CheckExpertsAgainstCheckpoint(dir, resolved, checkpoint));
  }
  ACCEL_ASSIGN_OR_RETURN(out.quantization, ChooseQuantization(dir, options, out.config, out.dtype,
                                                              out.prequantized, config_only));
  ACCEL_RETURN_IF_ERROR(ChooseDeviceMap(options, out));
  out.expert_lists = FetchedExpertLists(out.memory.offload_experts, resolved, out.device_map);
  out.memory.offload_experts = !out.expert_lists.empty();
  return out;
}

absl::StatusOr<LoadedModel> LoadModel(const std::string& dir, const ModelLoadOptions& options) {
  LoadedModel out;
  out.dir = dir;
  ACCEL_ASSIGN_OR_RETURN(LoadPlan plan, PlanLoad(dir, options));
  out.config = plan.config;
  const std::string generation = dir + "/generation_config.json";
  if (std::filesystem::exists(generation)) {
    ACCEL_ASSIGN_OR_RETURN(out.generation_config, loader::ReadGenerationConfig(generation));
  }
  DropEosOutsideVocabulary(out, "config.json", out.config.eos_token_ids);
  DropEosOutsideVocabulary(out, "generation_config.json", out.generation_config.eos_token_ids);
  out.dtype = plan.dtype;
  out.quantization = plan.quantization;
  out.prequantized = plan.prequantized;
  out.device_map = plan.device_map;
  out.expert_lists = plan.expert_lists;
  out.expert_cache_bytes = plan.memory.expert_cache_bytes;
  out.memory = plan.memory;
  const TensorParallel& tp = options.tensor_parallel;
  ACCEL_ASSIGN_OR_RETURN(std::optional<at::Device> execution,
                         ChooseExecutionDevice(options.execution_device));
  ACCEL_RETURN_IF_ERROR(CheckGpus(out.device_map));
  if (out.prequantized) {
    ACCEL_RETURN_IF_ERROR(CheckFp32CpuOffload(dir, out.device_map, out.quantization));
  }
  {
    dispatch::EmptyWeightsGuard empty;
    ACCEL_ASSIGN_OR_RETURN(out.model, BuildCausalLM(out.config, out.dtype, tp));
  }
  dispatch::LoadOptions load;
  load.dtype = out.dtype;
  load.offload_folder =
      options.offload_folder.empty() ? DefaultOffloadFolder(dir, plan) : options.offload_folder;
  load.progress = options.progress;
  load.execution_device = execution;
  load.expert_lists = out.expert_lists;
  load.expert_cache_bytes = out.expert_cache_bytes;
  load.direct_reads = plan.memory.direct_reads;
  // Evicted experts' pages stay in the page cache as a second level, except
  // under a memory cgroup whose limit is below the machine's memory.
  load.keep_evicted_expert_pages = !dispatch::HostMemoryLimitedByCgroup();
  load.prefetch = options.prefetch;
  load.map_disk = options.map_disk;
  load.mapped_resident_bytes = plan.cpu_room;
  // A quantized layer's quant state (absmax, code maps, SCB) is held in
  // buffers, as bitsandbytes holds it, but it is weight data: it goes where
  // its weight goes, or every offloaded expert's absmax would stay in RAM
  // (2.5 GiB of Mixtral-8x7B's NF4 experts).
  load.offload_buffers_in_place = !out.quantization.empty();
  load.populate_resident = plan.memory.disk_weight_bytes > 0 && !plan.memory.direct_reads;
  if (plan.memory.disk_weight_bytes > 0 && !plan.memory.direct_reads &&
      !plan.memory.offload_experts) {
    // Layers on disk are read every token; what memory holds beside the plan
    // (less a tenth for the rest of the machine) keeps the first of them in
    // the page cache for good, instead of the last ones read, which LRU loses
    // before their next use.
    if (absl::StatusOr<int64_t> total = dispatch::TotalHostMemory(); total.ok()) {
      load.page_cache_keep_bytes =
          std::max<int64_t>(0, *total - *total / 10 - plan.memory.resident_bytes());
    }
  }
  std::unique_ptr<dispatch::LoadHook> hook, sharding;
  if (!out.quantization.empty()) {
    ACCEL_RETURN_IF_ERROR(QuantizeLinears(*out.model, out.quantization));
    hook = MakeQuantizationHook(out.model, out.quantization, out.dtype);
    load.hook = hook.get();
  }
  if (tp.split()) {
    // Each rank's slices (and its stage's layers) only; quantization (the inner hook) sees the
    // slice.
    ACCEL_ASSIGN_OR_RETURN(sharding, MakeShardingHook(out.config, tp, out.dtype, hook.get()));
    load.hook = sharding.get();
  }
  ACCEL_ASSIGN_OR_RETURN(out.dispatched,
                         dispatch::DispatchedModel::Load(out.model, dir, out.device_map, load));
  // A weights file that changed under the load (core/file_faults.h).
  if (std::optional<std::string> fault = ModelFileFault()) {
    return absl::DataLossError(absl::StrCat("loading ", dir, ": ", *fault));
  }
  WarnAboutUnusedTensors(out, dir);
  // On a CUDA device q/k/v and gate/up run as one product each.
  if (out.dispatched->main_device().is_cuda()) {
    ACCEL_RETURN_IF_ERROR(out.model->PackProjections(/*cuda_only=*/true));
  }
  // Rank 0 of a group drives the others (no group: a slice for inspection).
  if (tp.split() && tp.world_rank() == 0 && tp.step_group() != nullptr) {
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      out.model = std::make_shared<TensorParallelLeader>(
          out.model, out.dispatched.get(), tp.step_group(), absl::Milliseconds(tp.heartbeat_ms));
    }));
  }
  return out;
}

}  // namespace accel::models
