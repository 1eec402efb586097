// Checkpoint: one safetensors file or a sharded set with its index.
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
#include "loader/loader.h"

namespace accel::loader {
namespace {

using Json = nlohmann::json;

constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kSingleName[] = "model.safetensors";

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
  return shards_[entry->shard].Tensor(name);
}

absl::StatusOr<Checkpoint> Checkpoint::Open(const std::string& path, OpenOptions options) {
  std::string index_path;
  std::string single_path;
  if (IsDirectory(path)) {
    std::string dir = absl::EndsWith(path, "/") ? path.substr(0, path.size() - 1) : path;
    if (Exists(absl::StrCat(dir, "/", kIndexName))) {
      index_path = absl::StrCat(dir, "/", kIndexName);
    } else if (Exists(absl::StrCat(dir, "/", kSingleName))) {
      single_path = absl::StrCat(dir, "/", kSingleName);
    } else {
      return absl::NotFoundError(
          absl::StrCat(path, ": no ", kIndexName, " or ", kSingleName, " in this folder"));
    }
  } else if (absl::EndsWith(path, ".json")) {
    index_path = path;
  } else {
    single_path = path;
  }

  Checkpoint ckpt;
  if (!single_path.empty()) {
    ACCEL_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(single_path, options));
    ckpt.shard_paths_.push_back(single_path);
    ckpt.metadata_ = file.metadata();
    for (const TensorInfo& info : file.tensors()) {
      ckpt.by_name_.emplace(info.name, ckpt.entries_.size());
      ckpt.entries_.push_back({info, 0});
    }
    ckpt.shards_.push_back(std::move(file));
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
    ACCEL_ASSIGN_OR_RETURN(SafetensorsFile shard, SafetensorsFile::Open(shard_path, options));
    std::set<std::string> wanted(names_in_shard[i].begin(), names_in_shard[i].end());
    for (const std::string& name : names_in_shard[i]) {
      if (shard.Find(name) == nullptr) {
        return absl::NotFoundError(absl::StrCat(index_path, ": tensor '", name,
                                                "' is assigned to shard ", files[i],
                                                ", which does not hold it"));
      }
    }
    for (const TensorInfo& info : shard.tensors()) {
      if (wanted.count(info.name) == 0) continue;
      ckpt.by_name_.emplace(info.name, ckpt.entries_.size());
      ckpt.entries_.push_back({info, i});
    }
    for (const auto& [key, value] : shard.metadata()) ckpt.metadata_.emplace(key, value);
    ckpt.shard_paths_.push_back(std::move(shard_path));
    ckpt.shards_.push_back(std::move(shard));
  }
  if (auto meta = index.find("metadata"); meta != index.end() && meta->is_object()) {
    for (const auto& [key, value] : meta->items()) {
      ckpt.metadata_.emplace(key, value.is_string() ? value.get<std::string>() : value.dump());
    }
  }
  return ckpt;
}

}  // namespace accel::loader
