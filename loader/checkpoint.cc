// Checkpoint: one safetensors (or torch.save) file or a sharded set with its index.
#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <sys/stat.h>
#include <utility>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "core/json.h"
#include "core/status.h"
#include "loader/internal/torch_bin.h"
#include "loader/loader.h"

namespace accel::loader {
namespace {

using Json = nlohmann::json;

constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kSingleName[] = "model.safetensors";
constexpr char kBinIndexName[] = "pytorch_model.bin.index.json";
constexpr char kBinSingleName[] = "pytorch_model.bin";

// A torch.save file, by its name (as transformers tells them apart).
bool IsTorchBin(absl::string_view path) {
  return absl::EndsWith(path, ".bin") || absl::EndsWith(path, ".pt") ||
         absl::EndsWith(path, ".pth");
}

bool IsDirectory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string DirName(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// A shard name from an index must be a plain file name in the index's folder.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const Entry& e : entries_) total += e.info.nbytes();
  return total;
}

const Checkpoint::Entry* Checkpoint::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

absl::StatusOr<at::Tensor> Checkpoint::Tensor(absl::string_view name) const {
  const Entry* entry = Find(name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat("checkpoint has no tensor '", name, "'"));
  }
  if (bin_shards_[entry->shard] != nullptr) return bin_shards_[entry->shard]->Tensor(name);
  return shards_[entry->shard]->Tensor(name);
}

std::optional<uint64_t> Checkpoint::FileOffset(const Entry& entry) const {
  if (bin_shards_[entry.shard] != nullptr) {
    return bin_shards_[entry.shard]->FileOffset(entry.info.name);
  }
  return shards_[entry.shard]->data_offset() + entry.info.data_begin;
}

const SafetensorsFile* Checkpoint::safetensors_shard(size_t i) const {
  return shards_[i] ? &*shards_[i] : nullptr;
}

absl::Status Checkpoint::AddShard(const std::string& shard_path, OpenOptions options,
                                  const std::set<std::string>* wanted) {
  const size_t index = shard_paths_.size();
  std::vector<TensorInfo> infos;
  if (IsTorchBin(shard_path)) {
    ACCEL_ASSIGN_OR_RETURN(internal::TorchBinFile file,
                           internal::TorchBinFile::Open(shard_path, options.populate));
    infos = file.tensors();
    // Data order, as for safetensors: reading in it reads the file forward.
    std::stable_sort(infos.begin(), infos.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return a.data_begin < b.data_begin;
    });
    shards_.emplace_back(std::nullopt);
    bin_shards_.push_back(std::make_shared<const internal::TorchBinFile>(std::move(file)));
  } else {
    ACCEL_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(shard_path, options));
    infos = file.tensors();
    for (const auto& [key, value] : file.metadata()) metadata_.emplace(key, value);
    shards_.emplace_back(std::move(file));
    bin_shards_.emplace_back();
  }
  shard_paths_.push_back(shard_path);
  for (TensorInfo& info : infos) {
    if (wanted != nullptr && wanted->count(info.name) == 0) continue;
    by_name_.emplace(info.name, entries_.size());
    entries_.push_back({std::move(info), index});
  }
  return absl::OkStatus();
}

absl::StatusOr<Checkpoint> Checkpoint::Open(const std::string& path, OpenOptions options) {
  std::string index_path;
  std::string single_path;
  if (IsDirectory(path)) {
    std::string dir = absl::EndsWith(path, "/") ? path.substr(0, path.size() - 1) : path;
    // transformers' order: safetensors first, then torch.save's files.
    for (const char* name : {kIndexName, kSingleName, kBinIndexName, kBinSingleName}) {
      const std::string candidate = absl::StrCat(dir, "/", name);
      if (!Exists(candidate)) continue;
      (absl::EndsWith(name, ".json") ? index_path : single_path) = candidate;
      break;
    }
    if (index_path.empty() && single_path.empty()) {
      return absl::NotFoundError(absl::StrCat(path, ": no ", kIndexName, ", ", kSingleName, ", ",
                                              kBinIndexName, " or ", kBinSingleName,
                                              " in this folder"));
    }
  } else if (absl::EndsWith(path, ".json")) {
    index_path = path;
  } else {
    single_path = path;
  }

  Checkpoint ckpt;
  if (!single_path.empty()) {
    ACCEL_RETURN_IF_ERROR(ckpt.AddShard(single_path, options, nullptr));
    return ckpt;
  }
  ACCEL_ASSIGN_OR_RETURN(std::string text, ReadFile(index_path));
  ACCEL_ASSIGN_OR_RETURN(Json index, ParseJson(text, index_path));
  if (!index.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": not a JSON object"));
  }
  auto weight_map = index.find("weight_map");
  if (weight_map == index.end() || !weight_map->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": missing \"weight_map\" object (tensor name -> shard file)"));
  }

  // Shards in order of first appearance among the sorted names, as the
  // index lists them; each opened once.
  const std::string dir = DirName(index_path);
  std::map<std::string, size_t> shard_of_file;
  std::vector<std::vector<std::string>> names_in_shard;
  for (const auto& [name, file] : weight_map->items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": weight_map entry '", name, "' is not a file name string"));
    }
    std::string shard = file.get<std::string>();
    if (!IsPlainFileName(shard)) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map entry '", name,
                                                     "' names shard '", shard,
                                                     "', which is not a plain file name"));
    }
    auto [it, added] = shard_of_file.emplace(shard, names_in_shard.size());
    if (added) names_in_shard.emplace_back();
    names_in_shard[it->second].push_back(name);
  }
  std::vector<std::string> files(shard_of_file.size());
  for (const auto& [file, i] : shard_of_file) files[i] = file;

  for (size_t i = 0; i < files.size(); ++i) {
    std::string shard_path = absl::StrCat(dir, "/", files[i]);
    if (!Exists(shard_path)) {
      return absl::NotFoundError(absl::StrCat(
          index_path, ": shard ", files[i], " (holding '", names_in_shard[i].front(), "' and ",
          names_in_shard[i].size() - 1, " other tensors) does not exist in ", dir));
    }
    std::set<std::string> wanted(names_in_shard[i].begin(), names_in_shard[i].end());
    const size_t before = ckpt.entries_.size();
    ACCEL_RETURN_IF_ERROR(ckpt.AddShard(shard_path, options, &wanted));
    if (ckpt.entries_.size() - before != wanted.size()) {
      for (const std::string& name : names_in_shard[i]) {
        if (ckpt.by_name_.count(name) == 0) {
          return absl::NotFoundError(absl::StrCat(index_path, ": tensor '", name,
                                                  "' is assigned to shard ", files[i],
                                                  ", which does not hold it"));
        }
      }
    }
  }
  if (auto meta = index.find("metadata"); meta != index.end() && meta->is_object()) {
    for (const auto& [key, value] : meta->items()) {
      ckpt.metadata_.emplace(key, value.is_string() ? value.get<std::string>() : value.dump());
    }
  }
  return ckpt;
}

}  // namespace accel::loader
