#include "train/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <regex>
#include <set>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

#include "core/status.h"
#include "loader/loader.h"

namespace accel::train {
namespace {

namespace fs = std::filesystem;

using GenericDict = c10::impl::GenericDict;

GenericDict NewDict() { return GenericDict(c10::StringType::get(), c10::AnyType::get()); }

absl::Status WritePickle(const GenericDict& dict, const std::string& path) {
  std::vector<char> bytes;
  ACCEL_RETURN_IF_ERROR(
      Annotate(CallTorch([&] { bytes = torch::pickle_save(c10::IValue(dict)); }), path));
  return loader::WriteFileAtomically(path, absl::string_view(bytes.data(), bytes.size()));
}

absl::StatusOr<GenericDict> ReadPickle(const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(std::string bytes, loader::ReadFile(path));
  c10::IValue value;
  absl::Status s =
      CallTorch([&] { value = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end())); });
  if (!s.ok()) {
    return absl::DataLossError(
        absl::StrCat(path, ": not a readable torch pickle (", s.message(), ")"));
  }
  if (!value.isGenericDict()) {
    return absl::DataLossError(absl::StrCat(path, ": expected a dict, found ", value.tagKind()));
  }
  return value.toGenericDict();
}

absl::StatusOr<c10::IValue> Field(const GenericDict& dict, const std::string& key,
                                  const std::string& path) {
  auto it = dict.find(key);
  if (it == dict.end()) {
    return absl::DataLossError(absl::StrCat(path, ": no \"", key, "\" entry"));
  }
  return it->value();
}

absl::StatusOr<double> DoubleField(const GenericDict& dict, const std::string& key,
                                   const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(c10::IValue v, Field(dict, key, path));
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  return absl::DataLossError(absl::StrCat(path, ": \"", key, "\" is not a number"));
}

absl::StatusOr<int64_t> IntField(const GenericDict& dict, const std::string& key,
                                 const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(c10::IValue v, Field(dict, key, path));
  if (v.isInt()) return v.toInt();
  return absl::DataLossError(absl::StrCat(path, ": \"", key, "\" is not an integer"));
}

absl::StatusOr<std::vector<double>> DoubleListField(const GenericDict& dict, const std::string& key,
                                                    const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(c10::IValue v, Field(dict, key, path));
  if (!v.isList()) return absl::DataLossError(absl::StrCat(path, ": \"", key, "\" is not a list"));
  std::vector<double> out;
  for (const c10::IValue& e : v.toListRef()) {
    if (!e.isDouble()) {
      return absl::DataLossError(absl::StrCat(path, ": \"", key, "\" holds a non-number"));
    }
    out.push_back(e.toDouble());
  }
  return out;
}

c10::List<double> DoubleList(const std::vector<double>& values) {
  c10::List<double> list;
  for (double v : values) list.push_back(v);
  return list;
}

// The number that ends a name, or -1 (Accelerate sorts checkpoints by it).
int64_t TrailingNumber(const std::string& name) {
  static const std::regex kDigits("(\\d+)$");
  std::smatch m;
  int64_t n = -1;
  if (std::regex_search(name, m, kDigits) && absl::SimpleAtoi(m.str(1), &n)) return n;
  return -1;
}

std::vector<fs::path> CheckpointEntries(const std::string& project_dir) {
  std::vector<fs::path> entries;
  std::error_code ec;
  const fs::path root = fs::path(project_dir) / "checkpoints";
  if (!fs::is_directory(root, ec)) return entries;
  for (const auto& e : fs::directory_iterator(root, ec)) entries.push_back(e.path());
  std::sort(entries.begin(), entries.end(), [](const fs::path& a, const fs::path& b) {
    return TrailingNumber(a.filename().string()) < TrailingNumber(b.filename().string());
  });
  return entries;
}

}  // namespace

absl::StatusOr<int64_t> ParseShardSize(absl::string_view text) {
  const std::string t = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  struct Unit {
    const char* suffix;
    int64_t factor;
  };
  // Longest suffixes first; huggingface_hub's decimal units, plus binary ones.
  static const Unit kUnits[] = {{"KIB", int64_t{1} << 10},
                                {"MIB", int64_t{1} << 20},
                                {"GIB", int64_t{1} << 30},
                                {"TIB", int64_t{1} << 40},
                                {"KB", 1'000},
                                {"MB", 1'000'000},
                                {"GB", 1'000'000'000},
                                {"TB", 1'000'000'000'000},
                                {"B", 1}};
  for (const Unit& u : kUnits) {
    absl::string_view number = t;
    if (!absl::ConsumeSuffix(&number, u.suffix)) continue;
    double value = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(number), &value) || !(value > 0)) break;
    return static_cast<int64_t>(value * static_cast<double>(u.factor));
  }
  int64_t bytes = 0;
  if (absl::SimpleAtoi(t, &bytes) && bytes > 0) return bytes;
  return absl::InvalidArgumentError(absl::StrCat(
      "max_shard_size \"", text, "\": expected a size such as 10GB, 500MB or a byte count"));
}

absl::Status SaveModel(const StateDict& state_dict, const std::string& dir,
                       const SaveModelOptions& options) {
  // Tensors sharing storage (tied weights) are kept once, under the first
  // name (Accelerate's clean_state_dict_for_safetensors).
  std::vector<loader::NamedTensor> tensors;
  std::set<std::pair<const void*, int64_t>> seen;
  for (const auto& [name, t] : state_dict) {
    if (!t.defined())
      return absl::InvalidArgumentError(absl::StrCat("\"", name, "\" is undefined"));
    const auto key = std::make_pair(t.storage().data(), t.storage_offset());
    if (t.storage().data() != nullptr && !seen.insert(key).second) continue;
    tensors.emplace_back(name, t.detach());
  }
  if (options.weights_name == "model") {
    loader::CheckpointWriteOptions write;
    write.max_shard_size = options.max_shard_size;
    return loader::WriteCheckpoint(dir, tensors, write).status();
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat("creating folder ", dir));
  return loader::WriteSafetensors(absl::StrCat(dir, "/", options.weights_name, ".safetensors"),
                                  tensors, {{"format", "pt"}});
}

absl::StatusOr<StateDict> LoadModelWeights(const std::string& dir, absl::string_view weights_name) {
  StateDict out;
  if (weights_name == "model") {
    ACCEL_ASSIGN_OR_RETURN(loader::Checkpoint checkpoint, loader::Checkpoint::Open(dir));
    for (const auto& entry : checkpoint.tensors()) {
      ACCEL_ASSIGN_OR_RETURN(at::Tensor t, checkpoint.Tensor(entry.info.name));
      out.emplace_back(entry.info.name, t.clone());
    }
    return out;
  }
  const std::string path = absl::StrCat(dir, "/", weights_name, ".safetensors");
  ACCEL_ASSIGN_OR_RETURN(loader::SafetensorsFile file, loader::SafetensorsFile::Open(path));
  for (const auto& info : file.tensors()) {
    ACCEL_ASSIGN_OR_RETURN(at::Tensor t, file.Tensor(info.name));
    out.emplace_back(info.name, t.clone());
  }
  return out;
}

absl::Status SaveOptimizer(torch::optim::Optimizer& optimizer, const std::string& path) {
  const std::string tmp = path + ".tmp";
  absl::Status s = CallTorch([&] {
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    archive.save_to(tmp);
  });
  if (!s.ok()) {
    std::error_code ec;
    fs::remove(tmp, ec);
    return Annotate(s, absl::StrCat("writing ", path));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat("renaming ", tmp, " to ", path));
  return absl::OkStatus();
}

absl::Status LoadOptimizer(torch::optim::Optimizer& optimizer, const std::string& path) {
  if (!fs::exists(path)) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  return Annotate(CallTorch([&] {
                    torch::serialize::InputArchive archive;
                    archive.load_from(path);
                    optimizer.load(archive);
                  }),
                  absl::StrCat("reading optimizer state ", path));
}

absl::Status SaveSchedulerState(const SchedulerState& state, const std::string& path) {
  GenericDict d = NewDict();
  d.insert("last_epoch", state.last_epoch);
  d.insert("_step_count", state.step_count);
  d.insert("base_lrs", DoubleList(state.base_lrs));
  d.insert("_last_lr", DoubleList(state.last_lrs));
  return WritePickle(d, path);
}

absl::StatusOr<SchedulerState> LoadSchedulerState(const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(GenericDict d, ReadPickle(path));
  SchedulerState s;
  ACCEL_ASSIGN_OR_RETURN(s.last_epoch, IntField(d, "last_epoch", path));
  ACCEL_ASSIGN_OR_RETURN(s.step_count, IntField(d, "_step_count", path));
  ACCEL_ASSIGN_OR_RETURN(s.base_lrs, DoubleListField(d, "base_lrs", path));
  ACCEL_ASSIGN_OR_RETURN(s.last_lrs, DoubleListField(d, "_last_lr", path));
  return s;
}

absl::Status SaveScalerState(const GradScalerState& state, const std::string& path) {
  GenericDict d = NewDict();
  d.insert("scale", state.scale);
  d.insert("growth_factor", state.growth_factor);
  d.insert("backoff_factor", state.backoff_factor);
  d.insert("growth_interval", state.growth_interval);
  d.insert("_growth_tracker", state.growth_tracker);
  return WritePickle(d, path);
}

absl::StatusOr<GradScalerState> LoadScalerState(const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(GenericDict d, ReadPickle(path));
  GradScalerState s;
  ACCEL_ASSIGN_OR_RETURN(s.scale, DoubleField(d, "scale", path));
  ACCEL_ASSIGN_OR_RETURN(s.growth_factor, DoubleField(d, "growth_factor", path));
  ACCEL_ASSIGN_OR_RETURN(s.backoff_factor, DoubleField(d, "backoff_factor", path));
  ACCEL_ASSIGN_OR_RETURN(s.growth_interval, IntField(d, "growth_interval", path));
  ACCEL_ASSIGN_OR_RETURN(s.growth_tracker, IntField(d, "_growth_tracker", path));
  return s;
}

RandomStates CaptureRandomStates(int64_t step) {
  RandomStates states;
  states.step = step;
  auto gen = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    states.cpu_state = gen.get_state();
  }
  if (at::globalContext().hasCUDA()) {
    const int n = at::detail::getCUDAHooks().getNumGPUs();
    for (int i = 0; i < n; ++i) {
      at::Generator g = at::detail::getCUDAHooks().getDefaultCUDAGenerator(i);
      std::lock_guard<std::mutex> lock(g.mutex());
      states.cuda_states.push_back(g.get_state());
    }
  }
  return states;
}

absl::Status RestoreRandomStates(const RandomStates& states) {
  return Annotate(CallTorch([&] {
                    auto gen = at::detail::getDefaultCPUGenerator();
                    std::lock_guard<std::mutex> lock(gen.mutex());
                    gen.set_state(states.cpu_state);
                  }),
                  "restoring the CPU random state");
}

absl::Status SaveRandomStates(const RandomStates& states, const std::string& path) {
  GenericDict d = NewDict();
  d.insert("step", states.step);
  d.insert("torch_manual_seed", states.cpu_state);
  c10::List<at::Tensor> cuda;
  for (const at::Tensor& t : states.cuda_states) cuda.push_back(t);
  d.insert("torch_cuda_manual_seed", cuda);
  return WritePickle(d, path);
}

absl::StatusOr<RandomStates> LoadRandomStates(const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(GenericDict d, ReadPickle(path));
  RandomStates s;
  ACCEL_ASSIGN_OR_RETURN(s.step, IntField(d, "step", path));
  ACCEL_ASSIGN_OR_RETURN(c10::IValue cpu, Field(d, "torch_manual_seed", path));
  if (!cpu.isTensor()) {
    return absl::DataLossError(absl::StrCat(path, ": \"torch_manual_seed\" is not a tensor"));
  }
  s.cpu_state = cpu.toTensor();
  auto cuda = d.find("torch_cuda_manual_seed");
  if (cuda != d.end() && cuda->value().isList()) {
    for (const c10::IValue& t : cuda->value().toListRef()) {
      if (t.isTensor()) s.cuda_states.push_back(t.toTensor());
    }
  }
  return s;
}

absl::Status SaveCustomState(const std::map<std::string, at::Tensor>& state,
                             const std::string& path) {
  GenericDict d = NewDict();
  for (const auto& [name, t] : state) d.insert(name, t);
  return WritePickle(d, path);
}

absl::StatusOr<std::map<std::string, at::Tensor>> LoadCustomState(const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(GenericDict d, ReadPickle(path));
  std::map<std::string, at::Tensor> out;
  for (const auto& entry : d) {
    if (!entry.key().isString() || !entry.value().isTensor()) {
      return absl::DataLossError(absl::StrCat(path, ": expected named tensors"));
    }
    out.emplace(entry.key().toStringRef(), entry.value().toTensor());
  }
  return out;
}

absl::StatusOr<std::string> NextCheckpointDir(const std::string& project_dir, int64_t iteration,
                                              std::optional<int64_t> total_limit, bool prune) {
  const fs::path root = fs::path(project_dir) / "checkpoints";
  if (prune && total_limit) {
    std::vector<fs::path> entries = CheckpointEntries(project_dir);
    const int64_t excess = static_cast<int64_t>(entries.size()) + 1 - *total_limit;
    for (int64_t i = 0; i < excess && i < static_cast<int64_t>(entries.size()); ++i) {
      std::error_code ec;
      fs::remove_all(entries[static_cast<size_t>(i)], ec);
      if (ec) return ErrnoStatus(ec.value(), absl::StrCat("removing ", entries[i].string()));
    }
  }
  const fs::path target = root / absl::StrCat("checkpoint_", iteration);
  if (fs::exists(target)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint folder ", target.string(),
        " already exists: set ProjectConfiguration.iteration past it, or load_state first"));
  }
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat("creating ", root.string()));
  return target.string();
}

absl::StatusOr<std::string> LatestCheckpointDir(const std::string& project_dir) {
  std::vector<fs::path> entries = CheckpointEntries(project_dir);
  if (entries.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no checkpoint in ", (fs::path(project_dir) / "checkpoints").string()));
  }
  return entries.back().string();
}

}  // namespace accel::train
