#include "train/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <regex>
#include <set>
#include <tuple>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

// The checkpoint_<int> folders of project_dir/checkpoints, oldest first.
// Only those: a save in progress (checkpoint_N.tmp-PID) is not a checkpoint,
// and nothing else kept there is ever pruned.
std::vector<fs::path> CheckpointEntries(const std::string& project_dir) {
  std::vector<fs::path> entries;
  std::error_code ec;
  const fs::path root = fs::path(project_dir) / "checkpoints";
  if (!fs::is_directory(root, ec)) return entries;
  static const std::regex kCheckpoint("checkpoint_\\d+");
  for (const auto& e : fs::directory_iterator(root, ec)) {
    std::error_code dir_ec;
    if (std::regex_match(e.path().filename().string(), kCheckpoint) &&
        fs::is_directory(e.path(), dir_ec)) {
      entries.push_back(e.path());
    }
  }
  std::sort(entries.begin(), entries.end(), [](const fs::path& a, const fs::path& b) {
    return TrailingNumber(a.filename().string()) < TrailingNumber(b.filename().string());
  });
  return entries;
}

// One shard: the tensors of one file, in state-dict order.
using Shard = std::vector<loader::NamedTensor>;

// Two names for one tensor: same storage, offset, shape, strides and dtype.
struct AliasKey {
  const void* storage;
  int64_t offset;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::ScalarType dtype;
  bool operator<(const AliasKey& o) const {
    return std::tie(storage, offset, sizes, strides, dtype) <
           std::tie(o.storage, o.offset, o.sizes, o.strides, o.dtype);
  }
};

// huggingface_hub's split_state_dict_into_shards_factory, after Accelerate's
// clean_state_dict_for_safetensors: a name whose tensor is the very tensor of
// an earlier name (tied weights) is dropped, the first name kept. Then, in
// state-dict order, a tensor over the limit is appended as a shard of its own
// at once (the shard being filled stays open), and the shard being filled is
// closed when the next tensor would take it over the limit. A tensor that is
// a different view of an earlier tensor's storage joins that tensor's shard
// (Accelerate would drop it, losing its values; we write it as a copy).
absl::StatusOr<std::vector<Shard>> SplitIntoShards(const StateDict& state_dict,
                                                   int64_t max_shard_size) {
  std::set<AliasKey> aliases;
  std::map<const void*, std::string> first_of_storage;
  std::vector<std::pair<std::string, loader::NamedTensor>> joiners;  // (first name, tensor)
  std::vector<Shard> shards;
  Shard current;
  uint64_t current_size = 0;
  const auto limit = static_cast<uint64_t>(max_shard_size);
  for (const auto& [name, t] : state_dict) {
    if (!t.defined())
      return absl::InvalidArgumentError(absl::StrCat("\"", name, "\" is undefined"));
    const void* storage = t.storage().data();
    if (storage != nullptr) {
      AliasKey key{storage, t.storage_offset(), t.sizes().vec(), t.strides().vec(),
                   t.scalar_type()};
      if (!aliases.insert(std::move(key)).second) continue;
      auto [first, added] = first_of_storage.emplace(storage, name);
      if (!added) {
        joiners.push_back({first->second, {name, t.detach()}});
        continue;
      }
    }
    const uint64_t size = t.nbytes();
    if (size > limit) {
      shards.push_back({{name, t.detach()}});
      continue;
    }
    if (current_size + size > limit) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.emplace_back(name, t.detach());
    current_size += size;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));
  std::map<std::string, size_t> shard_of_name;
  for (size_t i = 0; i < shards.size(); ++i) {
    for (const auto& [n, unused] : shards[i]) shard_of_name[n] = i;
  }
  for (auto& [first, tensor] : joiners)
    shards[shard_of_name.at(first)].push_back(std::move(tensor));
  return shards;
}

std::string RegexQuote(absl::string_view text) {
  static const std::string kSpecial = R"(\^$.|?*+()[]{})";
  std::string out;
  for (char c : text) {
    if (kSpecial.find(c) != std::string::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
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
    const double bytes = value * static_cast<double>(u.factor);
    // 2^63 as a double: anything at or past it (inf included) has no int64_t.
    if (!(bytes < 9.2233720368547758e18) || bytes < 1) break;
    return static_cast<int64_t>(bytes);
  }
  int64_t bytes = 0;
  if (absl::SimpleAtoi(t, &bytes) && bytes > 0) return bytes;
  return absl::InvalidArgumentError(absl::StrCat(
      "max_shard_size \"", text, "\": expected a size such as 10GB, 500MB or a byte count"));
}

absl::Status SaveModel(const StateDict& state_dict, const std::string& dir,
                       const SaveModelOptions& options) {
  if (options.max_shard_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_shard_size must be positive, got ", options.max_shard_size));
  }
  if (options.weights_name.empty() || options.weights_name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("weights_name \"", options.weights_name,
                                                   "\" must be a plain, non-empty file stem"));
  }
  ACCEL_ASSIGN_OR_RETURN(std::vector<Shard> shards,
                         SplitIntoShards(state_dict, options.max_shard_size));
  const std::string& stem = options.weights_name;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat("creating folder ", dir));

  // Every shard goes to a hidden temporary name first and is renamed only
  // when all were written, so a failed save leaves the earlier files as they
  // were and nothing of its own behind.
  std::vector<std::string> names;
  std::vector<std::string> temps;
  auto remove_temps = [&] {
    for (const std::string& t : temps) fs::remove(t, ec);
  };
  uint64_t total_size = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    names.push_back(shards.size() == 1 ? absl::StrCat(stem, ".safetensors")
                                       : absl::StrFormat("%s-%05d-of-%05d.safetensors", stem, i + 1,
                                                         shards.size()));
    temps.push_back(absl::StrCat(dir, "/.", names.back(), ".partial"));
    for (const auto& [name, t] : shards[i]) total_size += t.nbytes();
    absl::Status s = loader::WriteSafetensors(temps.back(), shards[i], {{"format", "pt"}});
    if (!s.ok()) {
      remove_temps();
      return Annotate(s, absl::StrCat("saving the model to ", dir));
    }
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    fs::rename(temps[i], absl::StrCat(dir, "/", names[i]), ec);
    if (ec) {
      absl::Status s = ErrnoStatus(ec.value(), absl::StrCat("renaming ", temps[i]));
      remove_temps();
      return s;
    }
  }
  const std::string index_name = absl::StrCat(stem, ".safetensors.index.json");
  if (shards.size() > 1) {
    // huggingface_hub's index: json.dumps(indent=2, sort_keys=True) + "\n";
    // nlohmann::json keeps object keys sorted.
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      for (const auto& [name, t] : shards[i]) weight_map[name] = names[i];
    }
    nlohmann::json index = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
    ACCEL_RETURN_IF_ERROR(
        loader::WriteFileAtomically(absl::StrCat(dir, "/", index_name), index.dump(2) + "\n"));
  }

  // The new files are complete: remove what an earlier save with this stem
  // left that is not part of this one (Accelerate removes stale shards; the
  // stale index or single file would otherwise shadow or confuse a reader).
  const std::set<std::string> keep(names.begin(), names.end());
  const std::regex shard_name(absl::StrCat(RegexQuote(stem), "-\\d{5}-of-\\d{5}\\.safetensors"));
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (keep.count(name) || !entry.is_regular_file(ec)) continue;
    const bool stale = std::regex_match(name, shard_name) ||
                       (shards.size() == 1 && name == index_name) ||
                       (shards.size() > 1 && name == absl::StrCat(stem, ".safetensors"));
    if (!stale) continue;
    fs::remove(entry.path(), ec);
    if (ec) return ErrnoStatus(ec.value(), absl::StrCat("removing stale ", entry.path().string()));
  }
  return absl::OkStatus();
}

absl::StatusOr<StateDict> LoadModelWeights(const std::string& dir, absl::string_view weights_name) {
  const std::string index = absl::StrCat(dir, "/", weights_name, ".safetensors.index.json");
  const std::string single = absl::StrCat(dir, "/", weights_name, ".safetensors");
  std::error_code ec;
  ACCEL_ASSIGN_OR_RETURN(loader::Checkpoint checkpoint,
                         loader::Checkpoint::Open(fs::exists(index, ec) ? index : single));
  StateDict out;
  for (const auto& entry : checkpoint.tensors()) {
    ACCEL_ASSIGN_OR_RETURN(at::Tensor t, checkpoint.Tensor(entry.info.name));
    // A copy: the mapped tensor would keep the file open and its pages shared.
    out.emplace_back(entry.info.name, t.clone());
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
      // Context::defaultGenerator: the same call in libtorch 1.x and 2.x (the
      // CUDA hooks' getDefaultCUDAGenerator became getDefaultGenerator in 2.x).
      at::Generator g = at::globalContext().defaultGenerator(
          at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(i)));
      std::lock_guard<std::mutex> lock(g.mutex());
      states.cuda_states.push_back(g.get_state());
    }
  }
  return states;
}

absl::Status RestoreRandomStates(const RandomStates& states) {
  if (!states.cpu_state.defined()) {
    return absl::InvalidArgumentError("restoring the CPU random state: no state tensor");
  }
  ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                   auto gen = at::detail::getDefaultCPUGenerator();
                                   std::lock_guard<std::mutex> lock(gen.mutex());
                                   gen.set_state(states.cpu_state);
                                 }),
                                 "restoring the CPU random state"));
  // Like torch.cuda.set_rng_state_all: one state per device, in order. States
  // saved on more devices than this process sees (or on a CUDA machine, read
  // back without CUDA) are left unused.
  if (states.cuda_states.empty() || !at::globalContext().hasCUDA()) return absl::OkStatus();
  const int n = at::detail::getCUDAHooks().getNumGPUs();
  for (int i = 0; i < n && i < static_cast<int>(states.cuda_states.size()); ++i) {
    ACCEL_RETURN_IF_ERROR(Annotate(CallTorch([&] {
                                     at::Generator g = at::globalContext().defaultGenerator(
                                         at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(i)));
                                     std::lock_guard<std::mutex> lock(g.mutex());
                                     g.set_state(states.cuda_states[static_cast<size_t>(i)]);
                                   }),
                                   absl::StrCat("restoring the random state of CUDA device ", i)));
  }
  return absl::OkStatus();
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

absl::Status SaveLoaderPositions(const std::vector<SavedLoaderPosition>& positions,
                                 const std::string& path) {
  c10::List<int64_t> epochs;
  c10::List<int64_t> yielded;
  c10::List<bool> started;
  c10::List<at::Tensor> states;
  for (const SavedLoaderPosition& p : positions) {
    epochs.push_back(p.epoch);
    yielded.push_back(p.batches_yielded);
    started.push_back(p.pass_started);
    states.push_back(p.generator_state.defined() ? p.generator_state : at::empty({0}, at::kByte));
  }
  GenericDict d = NewDict();
  d.insert("epoch", epochs);
  d.insert("batches_yielded", yielded);
  d.insert("pass_started", started);
  d.insert("generator_state", states);
  return WritePickle(d, path);
}

absl::StatusOr<std::vector<SavedLoaderPosition>> LoadLoaderPositions(const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(GenericDict d, ReadPickle(path));
  ACCEL_ASSIGN_OR_RETURN(c10::IValue epochs, Field(d, "epoch", path));
  ACCEL_ASSIGN_OR_RETURN(c10::IValue yielded, Field(d, "batches_yielded", path));
  if (!epochs.isList() || !yielded.isList() ||
      epochs.toListRef().size() != yielded.toListRef().size()) {
    return absl::DataLossError(
        absl::StrCat(path, ": \"epoch\" and \"batches_yielded\" must be lists of one length"));
  }
  std::vector<SavedLoaderPosition> out;
  for (size_t i = 0; i < epochs.toListRef().size(); ++i) {
    const c10::IValue& e = epochs.toListRef()[i];
    const c10::IValue& y = yielded.toListRef()[i];
    if (!e.isInt() || !y.isInt() || e.toInt() < 0 || y.toInt() < 0) {
      return absl::DataLossError(
          absl::StrCat(path, ": loader ", i, "'s position is not two integers >= 0"));
    }
    SavedLoaderPosition position;
    position.epoch = e.toInt();
    position.batches_yielded = y.toInt();
    out.push_back(position);
  }
  // Optional: the generator of use_seedable_sampler false.
  auto started = d.find("pass_started");
  auto states = d.find("generator_state");
  if (started != d.end() && states != d.end()) {
    const c10::IValue& s = started->value();
    const c10::IValue& t = states->value();
    if (!s.isList() || !t.isList() || s.toListRef().size() != out.size() ||
        t.toListRef().size() != out.size()) {
      return absl::DataLossError(absl::StrCat(
          path, ": \"pass_started\" and \"generator_state\" must have one entry per loader"));
    }
    for (size_t i = 0; i < out.size(); ++i) {
      const c10::IValue& b = s.toListRef()[i];
      const c10::IValue& g = t.toListRef()[i];
      if (!b.isBool() || !g.isTensor() || g.toTensor().scalar_type() != at::kByte) {
        return absl::DataLossError(absl::StrCat(
            path, ": loader ", i, "'s generator entry is not a bool and a uint8 tensor"));
      }
      out[i].pass_started = b.toBool();
      if (g.toTensor().numel() > 0) out[i].generator_state = g.toTensor();
    }
  }
  return out;
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

absl::StatusOr<CheckpointPlan> PlanCheckpoint(const std::string& project_dir, int64_t iteration,
                                              std::optional<int64_t> total_limit) {
  const fs::path root = fs::path(project_dir) / "checkpoints";
  CheckpointPlan plan;
  plan.dir = (root / absl::StrCat("checkpoint_", iteration)).string();
  std::error_code ec;
  if (fs::exists(plan.dir, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint folder ", plan.dir,
        " already exists: set ProjectConfiguration.iteration past it, or load_state first"));
  }
  fs::create_directories(root, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat("creating ", root.string()));
  if (total_limit) {
    std::vector<fs::path> entries = CheckpointEntries(project_dir);
    const int64_t excess = static_cast<int64_t>(entries.size()) + 1 - *total_limit;
    for (int64_t i = 0; i < excess && i < static_cast<int64_t>(entries.size()); ++i) {
      plan.to_prune.push_back(entries[static_cast<size_t>(i)].string());
    }
  }
  return plan;
}

absl::Status RemoveCheckpoints(const std::vector<std::string>& dirs) {
  for (const std::string& dir : dirs) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec) return ErrnoStatus(ec.value(), absl::StrCat("removing ", dir));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LatestCheckpointDir(const std::string& project_dir) {
  std::vector<fs::path> entries = CheckpointEntries(project_dir);
  if (entries.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no checkpoint in ", (fs::path(project_dir) / "checkpoints").string()));
  }
  return entries.back().string();
}

absl::Status CommitCheckpointDir(const std::string& tmp, const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    fs::rename(tmp, dir, ec);
    if (!ec) return absl::OkStatus();
    std::error_code probe;
    if (!fs::exists(tmp, probe) && fs::is_directory(dir, probe)) return absl::OkStatus();
    return ErrnoStatus(ec.value(), absl::StrCat("renaming ", tmp, " to ", dir));
  }
  if (!fs::is_directory(dir, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(dir, " exists and is not a folder"));
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(tmp, ec)) files.push_back(e.path());
  if (ec) {
    std::error_code probe;
    if (!fs::exists(tmp, probe)) return absl::OkStatus();
    return ErrnoStatus(ec.value(), absl::StrCat("listing ", tmp));
  }
  for (const fs::path& file : files) {
    fs::rename(file, fs::path(dir) / file.filename(), ec);
    std::error_code probe;
    if (ec && fs::exists(file, probe)) {
      return ErrnoStatus(ec.value(), absl::StrCat("moving ", file.string(), " into ", dir));
    }
  }
  fs::remove_all(tmp, ec);
  return absl::OkStatus();
}

}  // namespace accel::train
