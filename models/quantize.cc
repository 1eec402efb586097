#include "models/quantize.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <unistd.h>
#include <utility>

#include <ATen/Functions.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/dtype.h"
#include "core/json.h"
#include "core/status.h"

namespace accel::models {
namespace {

using Method = nn::LinearQuantization::Method;

constexpr char kBlobPrefix[] = ".weight.quant_state.bitsandbytes__";

bool IsLinearClass(const std::string& class_name) {
  return class_name == "Linear" || class_name == "Conv1D";
}

nn::LinearQuantization FromConfig(const quant::BnbQuantizationConfig& config) {
  nn::LinearQuantization how;
  how.method = config.load_in_8bit ? Method::kInt8 : Method::k4bit;
  how.threshold = config.llm_int8_threshold;
  how.quant_type = config.bnb_4bit_quant_type;
  how.double_quant = config.bnb_4bit_use_double_quant;
  how.compute_dtype = config.bnb_4bit_compute_dtype;
  how.blocksize = config.blocksize;
  return how;
}

// The module a quantized layer's checkpoint tensor belongs to, and the
// tensor's name below it ("weight.absmax"); nullopt for other names.
std::optional<std::pair<std::string, std::string>> SplitQuantTensor(absl::string_view name) {
  for (absl::string_view local : {".weight", ".SCB", ".weight_format"}) {
    if (absl::EndsWith(name, local)) {
      return std::make_pair(std::string(name.substr(0, name.size() - local.size())),
                            std::string(local.substr(1)));
    }
  }
  const size_t at = name.rfind(".weight.");
  if (at == absl::string_view::npos) return std::nullopt;
  return std::make_pair(std::string(name.substr(0, at)), std::string(name.substr(at + 1)));
}

// The model's modules by name, made once: a lookup by walking them is
// linear in the model, and a large model quantizes thousands of layers.
using ModuleIndex = std::map<std::string, std::shared_ptr<torch::nn::Module>>;

absl::StatusOr<ModuleIndex> IndexModules(torch::nn::Module& model) {
  ModuleIndex index;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      index.emplace(item.key(), item.value());
    }
  }));
  return index;
}

absl::StatusOr<std::shared_ptr<nn::QuantizableLinear>> FindLinear(const ModuleIndex& index,
                                                                  const std::string& name) {
  auto it = index.find(name);
  std::shared_ptr<torch::nn::Module> found = it == index.end() ? nullptr : it->second;
  if (found == nullptr) return absl::NotFoundError(absl::StrCat("no module '", name, "'"));
  auto linear = std::dynamic_pointer_cast<nn::QuantizableLinear>(found);
  if (linear == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("module '", name, "' is a ", found->name(), ", not a linear layer"));
  }
  return linear;
}

dispatch::TensorDecl Decl(std::string name, std::vector<int64_t> shape, at::ScalarType dtype,
                          bool persistent = true) {
  dispatch::TensorDecl d;
  d.name = std::move(name);
  d.shape = std::move(shape);
  d.dtype = dtype;
  d.persistent = persistent;
  return d;
}

// What QuantizableLinear::Quantize registers, as declarations.
absl::Status AddQuantizedLinear(dispatch::ModuleTree& out, int node,
                                const dispatch::ModuleTree::Node& from, const std::string& name,
                                const nn::LinearQuantization& how) {
  const dispatch::TensorDecl* weight = nullptr;
  for (const dispatch::TensorDecl& p : from.params) {
    if (p.name == "weight") weight = &p;
  }
  if (weight == nullptr || weight->shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("module '", name, "' has no 2-D weight to quantize"));
  }
  const bool transposed = from.class_name == "Conv1D";
  const int64_t out_features = transposed ? weight->shape[1] : weight->shape[0];
  const int64_t in_features = transposed ? weight->shape[0] : weight->shape[1];
  for (const dispatch::TensorDecl& p : from.params) {
    if (p.name != "weight") {
      out.AddParam(node, p);
    } else if (how.method == Method::kInt8) {
      out.AddParam(node, Decl("weight", {out_features, in_features}, at::kChar));
    } else {
      const quant::Layout4bit layout =
          quant::LayoutOf4bit(out_features * in_features, how.blocksize, how.double_quant);
      out.AddParam(node, Decl("weight", layout.packed_shape, at::kByte));
    }
  }
  for (const dispatch::TensorDecl& b : from.buffers) out.AddBuffer(node, b);
  if (how.method == Method::kInt8) {
    out.AddBuffer(node, Decl("SCB", {out_features}, at::kFloat));
    out.AddBuffer(node, Decl("weight_format", {}, at::kByte));
    return absl::OkStatus();
  }
  const quant::Layout4bit layout =
      quant::LayoutOf4bit(out_features * in_features, how.blocksize, how.double_quant);
  const int state = out.AddChild(node, "weight", "Params4bit");
  out.AddBuffer(state,
                Decl("absmax", {layout.absmax_len}, how.double_quant ? at::kByte : at::kFloat));
  out.AddBuffer(state, Decl("quant_map", {16}, at::kFloat));
  if (how.double_quant) {
    out.AddBuffer(state, Decl("nested_absmax", {layout.nested_absmax_len}, at::kFloat));
    out.AddBuffer(state, Decl("nested_quant_map", {256}, at::kFloat));
  }
  return absl::OkStatus();
}

absl::Status CopyTree(const dispatch::ModuleTree& from, int from_node, const std::string& name,
                      const QuantPlan& plan, dispatch::ModuleTree& out, int out_node,
                      std::set<std::string>& done) {
  const dispatch::ModuleTree::Node& node = from.node(from_node);
  auto planned = plan.find(name);
  if (planned != plan.end()) {
    if (!IsLinearClass(node.class_name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("module '", name, "' is a ", node.class_name,
                       ", not a linear layer: it cannot be quantized"));
    }
    ACCEL_RETURN_IF_ERROR(AddQuantizedLinear(out, out_node, node, name, planned->second));
    done.insert(name);
  } else {
    for (const dispatch::TensorDecl& p : node.params) out.AddParam(out_node, p);
    for (const dispatch::TensorDecl& b : node.buffers) out.AddBuffer(out_node, b);
  }
  for (const auto& [child_name, child] : node.children) {
    const std::string full = name.empty() ? child_name : absl::StrCat(name, ".", child_name);
    const int added = out.AddChild(out_node, child_name, from.node(child).class_name);
    ACCEL_RETURN_IF_ERROR(CopyTree(from, child, full, plan, out, added, done));
  }
  return absl::OkStatus();
}

// Loads a model whose planned layers were quantized on empty weights.
class QuantizationHook : public dispatch::LoadHook {
 public:
  QuantizationHook(std::shared_ptr<torch::nn::Module> model, QuantPlan plan, at::ScalarType dtype)
      : model_(std::move(model)), plan_(std::move(plan)), dtype_(dtype) {}

  bool Claims(absl::string_view name) const override {
    auto split = SplitQuantTensor(name);
    return split && plan_.count(split->first) > 0;
  }

  absl::StatusOr<std::vector<dispatch::HookTensor>> Convert(const std::string& name,
                                                            const at::Tensor& stored) override {
    auto [module, local] = *SplitQuantTensor(name);
    const nn::LinearQuantization& how = plan_.at(module);
    Layer& layer = layers_[module];
    if (layer.linear == nullptr) {
      if (!index_) {
        ACCEL_ASSIGN_OR_RETURN(ModuleIndex index, IndexModules(*model_));
        index_ = std::move(index);
      }
      ACCEL_ASSIGN_OR_RETURN(layer.linear, FindLinear(*index_, module));
      if (layer.linear->quantization().method != how.method) {
        return absl::InvalidArgumentError(
            absl::StrCat("module '", module, "' is not quantized as planned (",
                         layer.linear->quantization().ToString(), ")"));
      }
    }
    const auto label = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': ", what));
    };
    std::vector<dispatch::HookTensor> out;
    if (local == "weight" && c10::isFloatingType(stored.scalar_type())) {
      ACCEL_RETURN_IF_ERROR(QuantizeNow(name, module, stored, layer, out));
      return out;
    }
    if (how.method == Method::kInt8) {
      if (local == "weight_format") {
        if (stored.numel() != 1 || c10::isFloatingType(stored.scalar_type())) {
          return label("expected one integer (0: row-major)");
        }
        int64_t format = 0;
        ACCEL_RETURN_IF_ERROR(CallTorch([&] { format = stored.reshape({}).item<int64_t>(); }));
        if (format != 0) {
          return label(absl::StrCat("weight format ", format,
                                    " (a tiled GPU layout of bitsandbytes <= 0.44) is not "
                                    "supported; only 0 (row-major)"));
        }
        out.push_back({name, at::zeros({}, at::kByte)});
      } else if (local == "weight" || local == "SCB") {
        out.push_back({name, stored});
      } else {
        return label("not a tensor of an 8-bit layer");
      }
      return out;
    }
    // 4-bit, pre-quantized.
    if (absl::StartsWith(local, "weight.quant_state.bitsandbytes__")) {
      if (stored.scalar_type() != at::kByte || stored.dim() != 1) {
        return label("expected the quant state as uint8 JSON bytes");
      }
      const std::string json(static_cast<const char*>(stored.data_ptr()),
                             static_cast<size_t>(stored.numel()));
      ACCEL_ASSIGN_OR_RETURN(quant::QuantState4bit state,
                             quant::QuantState4bitFromJson(json, name));
      const std::string type = std::string(local.substr(local.rfind("__") + 2));
      if (type != quant::QuantType4bitName(state.quant_type)) {
        return label(absl::StrCat("named ", type, " but it holds quant_type ",
                                  quant::QuantType4bitName(state.quant_type)));
      }
      const nn::QuantizableLinear& linear = *layer.linear;
      int64_t numel = 1;
      for (int64_t d : state.shape) numel *= d;
      if (numel != linear.in_features() * linear.out_features()) {
        return label(absl::StrCat("shape [", absl::StrJoin(state.shape, ", "), "] does not fit a ",
                                  linear.out_features(), "x", linear.in_features(), " layer"));
      }
      if (state.blocksize != how.blocksize || state.double_quant != how.double_quant ||
          state.quant_type != how.quant_type) {
        return label(absl::StrCat("holds ", quant::QuantType4bitName(state.quant_type),
                                  " blocksize ", state.blocksize,
                                  state.double_quant ? " with" : " without",
                                  " double quant, but the layer was built for ", how.ToString(),
                                  " blocksize ", how.blocksize));
      }
      layer.state = state;
    } else if (local == "weight") {
      at::Tensor bytes = stored;
      if (stored.scalar_type() != at::kByte) {
        // A quant_storage other than uint8 (FSDP): the same bytes, viewed as another dtype.
        ACCEL_RETURN_IF_ERROR(CallTorch([&] {
          bytes = stored.contiguous().view(at::kByte).reshape({-1, 1});
        }));
      }
      if (how.double_quant) layer.parts[local] = bytes;
      out.push_back({name, bytes});
    } else if (local == "weight.absmax" || local == "weight.quant_map" ||
               local == "weight.nested_absmax" || local == "weight.nested_quant_map") {
      if (local == "weight.quant_map" &&
          (stored.scalar_type() != at::kFloat || stored.numel() != 16)) {
        return label("expected 16 float32 code values");
      }
      if (how.double_quant && local != "weight.quant_map") layer.parts[local] = stored;
      out.push_back({name, stored});
    } else {
      return label("not a tensor of a 4-bit layer");
    }
    if (how.double_quant && !layer.checked && layer.state && layer.parts.size() == 4) {
      quant::Quantized4bit q;
      q.packed = layer.parts["weight"];
      q.absmax = layer.parts["weight.absmax"];
      q.nested_absmax = layer.parts["weight.nested_absmax"];
      q.nested_quant_map = layer.parts["weight.nested_quant_map"];
      q.state = *layer.state;
      // The kernels read the nested state as stored: checked here (shapes,
      // dtypes, settings; any absmax code is a valid index into the nested
      // map, so no data is read: a mapped checkpoint stays unread until used),
      // so a damaged one fails the load naming the module.
      absl::Status fits = quant::CheckQuantized4bitLayout(q);
      if (!fits.ok()) return Annotate(fits, absl::StrCat("module '", module, "'"));
      layer.checked = true;
      layer.parts.clear();
    }
    if (layer.state) layer.linear->quant_state = *layer.state;
    return out;
  }

  absl::Status Finish() override {
    for (const auto& [module, how] : plan_) {
      if (how.method != Method::k4bit) continue;
      auto found = layers_.find(module);
      const std::string blob =
          absl::StrCat(module, kBlobPrefix, quant::QuantType4bitName(how.quant_type));
      if (found == layers_.end() || !found->second.state) {
        return absl::NotFoundError(
            absl::StrCat("the checkpoint lacks '", blob, "' (the quant state of a 4-bit layer)"));
      }
      if (how.double_quant && !found->second.checked) {
        return absl::NotFoundError(absl::StrCat(
            "the checkpoint lacks part of the double-quantized absmax of '", module,
            "' (weight, weight.absmax, weight.nested_absmax, weight.nested_quant_map)"));
      }
    }
    return absl::OkStatus();
  }

 private:
  struct Layer {
    std::shared_ptr<nn::QuantizableLinear> linear;
    std::optional<quant::QuantState4bit> state;
    // Double quant: what the nested state is checked against once all of it
    // has arrived (the packed weight, the absmax codes, the nested absmax
    // and map).
    std::map<std::string, at::Tensor> parts;
    bool checked = false;
  };

  // A float weight: converted to the model's dtype and quantized, as
  // transformers' quantizers do on loading.
  absl::Status QuantizeNow(const std::string& name, const std::string& module,
                           const at::Tensor& stored, Layer& layer,
                           std::vector<dispatch::HookTensor>& out) {
    const nn::LinearQuantization& how = plan_.at(module);
    const nn::QuantizableLinear& linear = *layer.linear;
    const std::vector<int64_t> want =
        linear.transposed() ? std::vector<int64_t>{linear.in_features(), linear.out_features()}
                            : std::vector<int64_t>{linear.out_features(), linear.in_features()};
    if (stored.sizes().vec() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "': the checkpoint holds shape [", absl::StrJoin(stored.sizes(), ", "),
          "] but the model expects [", absl::StrJoin(want, ", "), "] (before quantizing)"));
    }
    at::Tensor dense;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      dense = stored.to(dtype_);
      if (linear.transposed()) dense = dense.t();
      dense = dense.contiguous();
    }));
    const auto annotate = [&](const absl::Status& s) {
      return Annotate(s, absl::StrCat("quantizing tensor '", name, "'"));
    };
    if (how.method == Method::kInt8) {
      absl::StatusOr<quant::QuantizedInt8> q = quant::QuantizeInt8(dense);
      if (!q.ok()) return annotate(q.status());
      out.push_back({name, q->weight});
      out.push_back({module + ".SCB", q->scb});
      return absl::OkStatus();
    }
    absl::StatusOr<quant::Quantized4bit> q =
        quant::Quantize4bit(dense, how.quant_type, how.blocksize, how.double_quant);
    if (!q.ok()) return annotate(q.status());
    out.push_back({name, q->packed});
    out.push_back({name + ".absmax", q->absmax});
    out.push_back({name + ".quant_map", q->quant_map});
    if (how.double_quant) {
      out.push_back({name + ".nested_absmax", q->nested_absmax});
      out.push_back({name + ".nested_quant_map", q->nested_quant_map});
      layer.checked = true;
    }
    layer.state = q->state;
    layer.linear->quant_state = q->state;
    return absl::OkStatus();
  }

  std::shared_ptr<torch::nn::Module> model_;
  std::optional<ModuleIndex> index_;  // made on the first tensor
  QuantPlan plan_;
  at::ScalarType dtype_;
  std::map<std::string, Layer> layers_;
};

}  // namespace

namespace {

// Shard files opened for small reads, closed together.
struct ShardFiles {
  std::map<size_t, int> fds;
  ~ShardFiles() {
    for (const auto& [shard, fd] : fds) ::close(fd);
  }
};

// A small tensor's bytes (a quant state's JSON) by pread without read-ahead:
// through the checkpoint's mapping each would fault in a read-ahead window of
// megabytes, and a large model holds thousands of them across its shards.
absl::StatusOr<std::string> ReadSmallTensor(const loader::Checkpoint& checkpoint,
                                            const loader::Checkpoint::Entry& entry,
                                            ShardFiles& files) {
  const std::optional<uint64_t> offset = checkpoint.FileOffset(entry);
  if (!offset) {
    // A strided view in a .bin shard: copied by the checkpoint.
    ACCEL_ASSIGN_OR_RETURN(at::Tensor t, checkpoint.Tensor(entry.info.name));
    std::string out(entry.info.nbytes(), '\0');
    ACCEL_RETURN_IF_ERROR(
        CallTorch([&] { std::memcpy(out.data(), t.contiguous().data_ptr(), out.size()); }));
    return out;
  }
  const std::string& path = checkpoint.shard_paths()[entry.shard];
  auto [it, fresh] = files.fds.emplace(entry.shard, -1);
  if (fresh) {
    it->second = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (it->second < 0) {
      const int err = errno;
      files.fds.erase(it);
      return ErrnoStatus(err, absl::StrCat("opening ", path));
    }
    (void)::posix_fadvise(it->second, 0, 0, POSIX_FADV_RANDOM);
  }
  std::string out(entry.info.nbytes(), '\0');
  for (uint64_t done = 0; done < out.size();) {
    const ssize_t got = ::pread(it->second, out.data() + done, out.size() - done,
                                static_cast<off_t>(*offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return absl::DataLossError(
          absl::StrCat("tensor '", entry.info.name, "': reading ", path, " failed or ended early"));
    }
    done += static_cast<uint64_t>(got);
  }
  return out;
}

}  // namespace

absl::StatusOr<QuantPlan> PlanQuantization(const dispatch::ModuleTree& tree,
                                           const quant::BnbQuantizationConfig& config) {
  if (!config.enabled()) {
    return absl::InvalidArgumentError("the quantization config enables neither 8 nor 4 bits");
  }
  std::set<std::string> tied;
  for (const auto& group : tree.TiedParameters()) tied.insert(group.begin(), group.end());
  // The router of a mixture-of-experts block ("<...SparseMoeBlock>.gate")
  // stays as it is: transformers v5 makes routers TopKRouter modules holding
  // a bare Parameter, and its bitsandbytes replacement converts only modules
  // whose type is nn.Linear (integrations/bitsandbytes.py), so no router is
  // quantized. (v4.x routers were nn.Linear and were quantized; checkpoints
  // saved so load as they were saved, by PlanFromCheckpoint.) Qwen2-MoE's
  // shared_expert_gate is still an nn.Linear in v5 and is quantized.
  std::set<std::string> routers;
  for (const auto& [name, node] : tree.NamedModules()) {
    if (!absl::EndsWith(tree.node(node).class_name, "SparseMoeBlock")) continue;
    for (const auto& [child, id] : tree.node(node).children) {
      if (child == "gate") routers.insert(absl::StrCat(name, ".gate"));
    }
  }
  QuantPlan plan;
  for (const auto& [name, node] : tree.NamedModules()) {
    if (name.empty() || !IsLinearClass(tree.node(node).class_name)) continue;
    if (!config.Quantizes(name)) continue;  // the skip list and keep_in_fp32_modules
    if (tied.count(name + ".weight") || routers.count(name)) continue;
    plan[name] = FromConfig(config);
  }
  if (plan.empty()) {
    return absl::InvalidArgumentError(
        "no linear layer is left to quantize (every one is skipped, kept in float32 or tied)");
  }
  return plan;
}

absl::StatusOr<QuantPlan> PlanFromCheckpoint(const loader::Checkpoint& checkpoint,
                                             const quant::BnbQuantizationConfig& config) {
  ShardFiles files;
  QuantPlan plan;
  for (const loader::Checkpoint::Entry& entry : checkpoint.tensors()) {
    const std::string& name = entry.info.name;
    nn::LinearQuantization how = FromConfig(config);
    if (absl::EndsWith(name, ".SCB")) {
      how.method = Method::kInt8;
      plan[name.substr(0, name.size() - 4)] = how;
      continue;
    }
    const size_t at = name.find(kBlobPrefix);
    if (at == std::string::npos) continue;
    if (entry.info.dtype != "U8" || entry.info.shape.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': expected the quant state as uint8 JSON bytes"));
    }
    ACCEL_ASSIGN_OR_RETURN(std::string json, ReadSmallTensor(checkpoint, entry, files));
    ACCEL_ASSIGN_OR_RETURN(quant::QuantState4bit state, quant::QuantState4bitFromJson(json, name));
    how.method = Method::k4bit;
    how.quant_type = state.quant_type;
    how.blocksize = state.blocksize;
    how.double_quant = state.double_quant;
    plan[name.substr(0, at)] = how;
  }
  if (plan.empty()) {
    return absl::InvalidArgumentError(
        "config.json has a quantization_config, but the checkpoint holds no quantized layer "
        "(no '<layer>.SCB' or '<layer>.weight.quant_state.bitsandbytes__*' tensor)");
  }
  return plan;
}

absl::StatusOr<quant::BnbQuantizationConfig> BnbConfigFor(const QuantizeOptions& options) {
  const std::string& method = options.method;
  if (method != "int8" && method != "nf4" && method != "fp4") {
    return absl::InvalidArgumentError(
        absl::StrCat("quantize '", method, "': expected none, int8, nf4 or fp4"));
  }
  quant::BnbQuantizationConfig config;
  config.load_in_8bit = method == "int8";
  config.load_in_4bit = !config.load_in_8bit;
  if (config.load_in_4bit) {
    ACCEL_ASSIGN_OR_RETURN(config.bnb_4bit_quant_type, quant::ParseQuantType4bit(method));
  }
  if (options.double_quant && config.load_in_8bit) {
    return absl::InvalidArgumentError("double_quant applies to 4-bit quantization (nf4, fp4)");
  }
  config.bnb_4bit_use_double_quant = options.double_quant;
  if (!quant::IsValidBlocksize4bit(options.blocksize)) {
    return absl::InvalidArgumentError(
        absl::StrCat("quant_blocksize ", options.blocksize, ": expected 32, 64, 128, ..., 4096"));
  }
  config.blocksize = options.blocksize;
  if (!(options.int8_threshold >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("int8_threshold ", options.int8_threshold, ": expected 0 or more"));
  }
  config.llm_int8_threshold = options.int8_threshold;
  config.bnb_4bit_compute_dtype = options.compute_dtype;
  return config;
}

absl::StatusOr<QuantPlan> PlanForModel(const std::string& dir, const dispatch::ModuleTree& tree,
                                       const QuantizeOptions& options, bool* prequantized) {
  const std::string& method = options.method;
  if (method != "none" && method != "int8" && method != "nf4" && method != "fp4") {
    return absl::InvalidArgumentError(
        absl::StrCat("quantize '", method, "': expected none, int8, nf4 or fp4"));
  }
  if (options.double_quant && method != "nf4" && method != "fp4") {
    return absl::InvalidArgumentError("double_quant applies to 4-bit quantization (nf4, fp4)");
  }
  ACCEL_ASSIGN_OR_RETURN(std::optional<quant::BnbQuantizationConfig> stored,
                         ReadQuantizationConfig(dir + "/config.json"));
  if (prequantized != nullptr) *prequantized = stored.has_value();
  if (stored) {
    const std::string stored_method =
        stored->load_in_8bit ? "int8" : quant::QuantType4bitName(stored->bnb_4bit_quant_type);
    if (method != "none" && method != stored_method) {
      return absl::InvalidArgumentError(absl::StrCat(
          "quantize '", method, "': ", dir, " holds a model quantized already (", stored_method,
          ", config.json's quantization_config); leave quantize at none"));
    }
    ACCEL_ASSIGN_OR_RETURN(loader::Checkpoint checkpoint, loader::Checkpoint::Open(dir));
    return PlanFromCheckpoint(checkpoint, *stored);
  }
  if (method == "none") return QuantPlan();
  ACCEL_ASSIGN_OR_RETURN(quant::BnbQuantizationConfig config, BnbConfigFor(options));
  return PlanQuantization(tree, config);
}

absl::StatusOr<std::optional<quant::BnbQuantizationConfig>> ReadQuantizationConfig(
    const std::string& config_json_path) {
  ACCEL_ASSIGN_OR_RETURN(std::string text, loader::ReadFile(config_json_path));
  ACCEL_ASSIGN_OR_RETURN(const nlohmann::json json, ParseJson(text, config_json_path));
  if (!json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(config_json_path, ": not a JSON object"));
  }
  auto found = json.find("quantization_config");
  if (found == json.end() || found->is_null()) return std::nullopt;
  ACCEL_ASSIGN_OR_RETURN(
      quant::BnbQuantizationConfig config,
      quant::BnbConfigFromJson(found->dump(),
                               absl::StrCat(config_json_path, ": quantization_config")));
  return config;
}

absl::StatusOr<dispatch::ModuleTree> QuantizeModuleTree(const dispatch::ModuleTree& tree,
                                                        const QuantPlan& plan) {
  dispatch::ModuleTree out(tree.node(0).class_name);
  std::set<std::string> done;
  ACCEL_RETURN_IF_ERROR(CopyTree(tree, 0, "", plan, out, 0, done));
  for (const auto& [name, how] : plan) {
    if (!done.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("no linear layer '", name, "' to quantize"));
    }
  }
  for (const auto& group : tree.TiedParameters()) ACCEL_RETURN_IF_ERROR(out.Tie(group));
  return out;
}

void AddQuantizedSizes(const QuantPlan& plan, std::map<std::string, double>& special_bytes) {
  for (const auto& [name, how] : plan) {
    if (how.method == Method::kInt8) {
      special_bytes[name + ".SCB"] = 4;
      continue;
    }
    if (!how.double_quant) special_bytes[name + ".weight.absmax"] = 4;
    special_bytes[name + ".weight.quant_map"] = 4;
    if (how.double_quant) {
      special_bytes[name + ".weight.nested_absmax"] = 4;
      special_bytes[name + ".weight.nested_quant_map"] = 4;
    }
  }
}

absl::Status QuantizeLinears(torch::nn::Module& model, const QuantPlan& plan) {
  ACCEL_ASSIGN_OR_RETURN(const ModuleIndex index, IndexModules(model));
  for (const auto& [name, how] : plan) {
    ACCEL_ASSIGN_OR_RETURN(std::shared_ptr<nn::QuantizableLinear> linear, FindLinear(index, name));
    ACCEL_RETURN_IF_ERROR(
        Annotate(linear->Quantize(how), absl::StrCat("quantizing module '", name, "'")));
  }
  return absl::OkStatus();
}

std::unique_ptr<dispatch::LoadHook> MakeQuantizationHook(std::shared_ptr<torch::nn::Module> model,
                                                         const QuantPlan& plan,
                                                         at::ScalarType dtype) {
  return std::make_unique<QuantizationHook>(std::move(model), plan, dtype);
}

std::string QuantStateBlobName(const std::string& layer, quant::QuantType4bit type) {
  return absl::StrCat(layer, kBlobPrefix, quant::QuantType4bitName(type));
}

namespace {

// torch's state_dict order over `tree` (module by module, pre-order, each
// module's parameters then its persistent buffers, then its children; a tied
// parameter once, under its first name), with each 4-bit layer's quant state
// blob after its last quant buffer, where bitsandbytes' Linear4bit writes it
// (_save_to_state_dict: weight, bias, then the quant state's tensors and the
// blob). `blob_type(layer)` names a 4-bit layer's quant type, nullopt for
// other modules.
void VisitStateDict(
    const dispatch::ModuleTree& tree,
    const std::function<std::optional<quant::QuantType4bit>(const std::string&)>& blob_type,
    const std::function<void(const std::string& name, const dispatch::TensorDecl* decl)>& visit) {
  std::set<std::string> kept;
  for (const auto& p : tree.NamedParameters()) kept.insert(p.name);
  std::function<void(int, const std::string&)> walk = [&](int node, const std::string& prefix) {
    const auto full = [&](const std::string& local) {
      return prefix.empty() ? local : absl::StrCat(prefix, ".", local);
    };
    const dispatch::ModuleTree::Node& n = tree.node(node);
    for (const dispatch::TensorDecl& p : n.params) {
      if (kept.count(full(p.name))) visit(full(p.name), &p);
    }
    for (const dispatch::TensorDecl& b : n.buffers) {
      if (b.persistent) visit(full(b.name), &b);
    }
    for (const auto& [child, id] : n.children) walk(id, full(child));
    if (!prefix.empty()) {
      if (std::optional<quant::QuantType4bit> type = blob_type(prefix)) {
        visit(QuantStateBlobName(prefix, *type), nullptr);
      }
    }
  };
  walk(0, "");
}

}  // namespace

absl::StatusOr<std::vector<loader::TensorSpec>> QuantizedCheckpointSpecs(
    const dispatch::ModuleTree& tree, const QuantPlan& plan,
    const std::function<absl::StatusOr<int64_t>(const std::string& layer)>& blob_bytes) {
  ACCEL_ASSIGN_OR_RETURN(dispatch::ModuleTree quantized, QuantizeModuleTree(tree, plan));
  std::vector<loader::TensorSpec> specs;
  absl::Status failed;
  VisitStateDict(
      quantized,
      [&](const std::string& layer) -> std::optional<quant::QuantType4bit> {
        auto it = plan.find(layer);
        if (it == plan.end() || it->second.method != Method::k4bit) return std::nullopt;
        return it->second.quant_type;
      },
      [&](const std::string& name, const dispatch::TensorDecl* decl) {
        if (decl != nullptr) {
          specs.push_back({name, decl->dtype, decl->shape});
          return;
        }
        const std::string layer = name.substr(0, name.find(kBlobPrefix));
        absl::StatusOr<int64_t> bytes = blob_bytes(layer);
        if (!bytes.ok()) {
          if (failed.ok()) failed = bytes.status();
          return;
        }
        specs.push_back({name, at::kByte, {*bytes}});
      });
  if (!failed.ok()) return failed;
  return specs;
}

absl::StatusOr<std::string> QuantizedConfigJson(absl::string_view config_json,
                                                const nn::LinearQuantization& how,
                                                at::ScalarType dtype, absl::string_view label) {
  quant::BnbQuantizationConfig config;
  config.load_in_8bit = how.method == Method::kInt8;
  config.load_in_4bit = how.method == Method::k4bit;
  config.llm_int8_threshold = how.threshold;
  config.bnb_4bit_quant_type = how.quant_type;
  config.bnb_4bit_use_double_quant = how.double_quant;
  config.bnb_4bit_compute_dtype = how.compute_dtype;
  config.blocksize = how.blocksize;
  ACCEL_ASSIGN_OR_RETURN(nlohmann::ordered_json json, ParseOrderedJson(config_json, label));
  if (!json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": not a JSON object"));
  }
  ACCEL_ASSIGN_OR_RETURN(json["quantization_config"],
                         ParseOrderedJson(quant::BnbConfigToJson(config), "quantization_config"));
  json["torch_dtype"] = std::string(DTypeName(dtype));
  return json.dump(2) + "\n";
}

absl::StatusOr<std::vector<loader::NamedTensor>> QuantizedStateDict(
    torch::nn::Module& model, dispatch::DispatchedModel* dispatched) {
  ACCEL_ASSIGN_OR_RETURN(dispatch::ModuleTree tree, dispatch::ModuleTree::FromModule(model));
  std::map<std::string, at::Tensor> tensors;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    for (const auto& p : model.named_parameters(true)) tensors.emplace(p.key(), p.value());
    for (const auto& b : model.named_buffers(true)) tensors.emplace(b.key(), b.value());
  }));
  std::map<std::string, std::shared_ptr<nn::QuantizableLinear>> four_bit;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      auto linear = std::dynamic_pointer_cast<nn::QuantizableLinear>(item.value());
      if (linear && linear->quantization().method == Method::k4bit) four_bit[item.key()] = linear;
    }
  }));
  std::vector<std::pair<std::string, bool>> order;  // name, is a blob
  VisitStateDict(
      tree,
      [&](const std::string& layer) -> std::optional<quant::QuantType4bit> {
        auto it = four_bit.find(layer);
        if (it == four_bit.end()) return std::nullopt;
        return it->second->quant_state.quant_type;
      },
      [&](const std::string& name, const dispatch::TensorDecl* decl) {
        order.emplace_back(name, decl == nullptr);
      });
  std::vector<loader::NamedTensor> out;
  for (const auto& [name, blob] : order) {
    if (blob) {
      const std::string json = quant::QuantState4bitToJson(
          four_bit.at(name.substr(0, name.find(kBlobPrefix)))->quant_state);
      at::Tensor bytes = at::empty({static_cast<int64_t>(json.size())}, at::kByte);
      std::memcpy(bytes.data_ptr(), json.data(), json.size());
      out.emplace_back(name, bytes);
      continue;
    }
    at::Tensor value = tensors.at(name);
    if (value.is_meta()) {
      if (dispatched == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat("tensor '", name, "' is not loaded"));
      }
      const std::string module = name.substr(0, name.rfind('.'));
      ACCEL_ASSIGN_OR_RETURN(dispatch::DispatchedModel::Scope scope, dispatched->Enter(module));
      ACCEL_RETURN_IF_ERROR(CallTorch([&] { value = tensors.at(name).to(at::kCPU).clone(); }));
    } else {
      ACCEL_RETURN_IF_ERROR(CallTorch([&] { value = value.to(at::kCPU).contiguous(); }));
    }
    out.emplace_back(name, value);
  }
  return out;
}

absl::Status SaveQuantizedModel(LoadedModel& loaded, const std::string& out_dir,
                                int64_t max_shard_size) {
  if (loaded.quantization.empty()) {
    return absl::InvalidArgumentError("the model was loaded without quantization");
  }
  std::error_code ec;
  if (std::filesystem::exists(out_dir, ec) &&
      std::filesystem::equivalent(out_dir, loaded.dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("out '", out_dir, "' is the model's own folder; write somewhere else"));
  }
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat("creating ", out_dir));

  // config.json: the model's, with the quantization_config of the plan.
  ACCEL_ASSIGN_OR_RETURN(std::string config_text, loader::ReadFile(loaded.dir + "/config.json"));
  ACCEL_ASSIGN_OR_RETURN(
      std::string config_json,
      QuantizedConfigJson(config_text, loaded.quantization.begin()->second, loaded.dtype,
                          absl::StrCat(loaded.dir, "/config.json")));

  ACCEL_ASSIGN_OR_RETURN(std::vector<loader::NamedTensor> tensors,
                         QuantizedStateDict(*loaded.model, loaded.dispatched.get()));
  loader::CheckpointWriteOptions write;
  write.max_shard_size = max_shard_size;
  ACCEL_RETURN_IF_ERROR(loader::WriteCheckpoint(out_dir, tensors, write).status());
  for (const char* file : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "generation_config.json"}) {
    const std::string from = absl::StrCat(loaded.dir, "/", file);
    if (!std::filesystem::exists(from)) continue;
    ACCEL_ASSIGN_OR_RETURN(std::string text, loader::ReadFile(from));
    ACCEL_RETURN_IF_ERROR(loader::WriteFileAtomically(absl::StrCat(out_dir, "/", file), text));
  }
  // config.json last: a folder without it is not taken for a model.
  return loader::WriteFileAtomically(out_dir + "/config.json", config_json);
}

}  // namespace accel::models
