// Writing safetensors files and sharded checkpoints, atomically.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <utility>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

#include "core/status.h"
#include "loader/internal/atomic_file.h"
#include "loader/internal/safetensors_format.h"
#include "loader/loader.h"

namespace accel::loader {
namespace {

constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kSingleName[] = "model.safetensors";

struct Planned {
  const TensorSpec* spec;
  TensorInfo info;
};

// Checks a spec and returns its header entry (offsets not yet assigned).
absl::StatusOr<TensorInfo> Describe(const TensorSpec& spec) {
  TensorInfo info;
  info.name = spec.name;
  auto dtype = SafetensorsDType(spec.dtype);
  if (!dtype.ok()) return Annotate(dtype.status(), absl::StrCat("tensor '", spec.name, "'"));
  info.dtype = *dtype;
  uint64_t nbytes = *internal::DTypeElementSize(info.dtype);
  for (int64_t d : spec.shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", spec.name, "': negative dimension ", d));
    }
    if (__builtin_mul_overflow(nbytes, static_cast<uint64_t>(d), &nbytes)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "': size overflows"));
    }
  }
  info.shape = spec.shape;
  info.data_end = nbytes;
  return info;
}

// Orders one file's tensors by element size (largest first), then name, as
// the safetensors reference writer does: with the header padded to 8 bytes,
// every tensor then starts at a multiple of its element size.
void LayOut(std::vector<Planned>& tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const Planned& a, const Planned& b) {
    int sa = *internal::DTypeElementSize(a.info.dtype);
    int sb = *internal::DTypeElementSize(b.info.dtype);
    if (sa != sb) return sa > sb;
    return a.info.name < b.info.name;
  });
  uint64_t offset = 0;
  for (Planned& t : tensors) {
    uint64_t n = t.info.data_end;  // Describe() left the byte count here.
    t.info.data_begin = offset;
    t.info.data_end = offset + n;
    offset += n;
  }
}

// Produces one tensor and writes it at its place in the data section, which
// starts at `data_start` in the file.
absl::Status WriteTensorData(internal::AtomicFile& file, uint64_t data_start,
                             const Planned& planned, const TensorProducer& produce) {
  const TensorSpec& spec = *planned.spec;
  absl::StatusOr<at::Tensor> produced = produce(spec);
  if (!produced.ok()) {
    return Annotate(produced.status(), absl::StrCat("producing tensor '", spec.name, "'"));
  }
  at::Tensor tensor = *std::move(produced);
  if (!tensor.defined()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "' is undefined"));
  }
  if (tensor.scalar_type() != spec.dtype || tensor.sizes() != c10::IntArrayRef(spec.shape)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", spec.name, "' was announced as ", c10::toString(spec.dtype), " [",
        absl::StrJoin(spec.shape, ", "), "] but is ", c10::toString(tensor.scalar_type()), " [",
        absl::StrJoin(tensor.sizes(), ", "), "]"));
  }
  ACCEL_RETURN_IF_ERROR(CallTorch([&] { tensor = tensor.to(at::kCPU).contiguous(); }));
  return file.WriteAt(
      data_start + planned.info.data_begin,
      absl::string_view(static_cast<const char*>(tensor.data_ptr()), planned.info.nbytes()));
}

// Writes one file under a temporary name and finishes it (not yet published).
// The layout is the reference writer's (LayOut), but tensors are produced in
// the order given and each is written at its place: a producer that makes
// several tensors together (a quantized layer's weight and its quant state)
// hands them over one after the other, where the file's order would scatter
// them. With `write_behind` > 0 the page cache keeps about that many bytes of
// the file (AtomicFile::WriteBehind), so a file larger than memory can be written.
absl::StatusOr<internal::AtomicFile> WriteFile(const std::string& path,
                                               std::vector<Planned> tensors,
                                               const std::map<std::string, std::string>& metadata,
                                               const TensorProducer& produce,
                                               int64_t write_behind) {
  std::vector<Planned> laid_out = tensors;
  LayOut(laid_out);
  std::vector<TensorInfo> infos;
  infos.reserve(laid_out.size());
  std::map<const TensorSpec*, const Planned*> placed;
  for (const Planned& t : laid_out) {
    infos.push_back(t.info);
    placed[t.spec] = &t;
  }
  ACCEL_ASSIGN_OR_RETURN(internal::AtomicFile file, internal::AtomicFile::Create(path));
  const std::string header = internal::SerializeHeader(infos, metadata);
  ACCEL_RETURN_IF_ERROR(file.Write(header));
  uint64_t since_write_behind = 0;
  for (const Planned& t : tensors) {
    const Planned& at = *placed.at(t.spec);
    ACCEL_RETURN_IF_ERROR(WriteTensorData(file, header.size(), at, produce));
    since_write_behind += at.info.nbytes();
    if (write_behind > 0 && since_write_behind >= static_cast<uint64_t>(write_behind) / 2) {
      file.WriteBehind();
      since_write_behind = 0;
    }
  }
  ACCEL_RETURN_IF_ERROR(file.Finish());
  return file;
}

absl::StatusOr<std::vector<Planned>> Plan(const std::vector<TensorSpec>& specs) {
  std::vector<Planned> planned;
  planned.reserve(specs.size());
  std::set<absl::string_view> names;
  for (const TensorSpec& spec : specs) {
    if (!names.insert(spec.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "' is given twice"));
    }
    ACCEL_ASSIGN_OR_RETURN(TensorInfo info, Describe(spec));
    planned.push_back({&spec, std::move(info)});
  }
  return planned;
}

std::vector<TensorSpec> SpecsOf(const std::vector<NamedTensor>& tensors) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    specs.push_back(
        {name, t.scalar_type(), std::vector<int64_t>(t.sizes().begin(), t.sizes().end())});
  }
  return specs;
}

TensorProducer ProducerOf(const std::vector<NamedTensor>& tensors) {
  auto by_name = std::make_shared<std::map<std::string, const at::Tensor*>>();
  for (const auto& [name, t] : tensors) by_name->emplace(name, &t);
  return [by_name](const TensorSpec& spec) -> absl::StatusOr<at::Tensor> {
    return *by_name->at(spec.name);
  };
}

bool IsShardFileName(const std::string& name) {
  return absl::StartsWith(name, "model-") && absl::EndsWith(name, ".safetensors") &&
         absl::StrContains(name, "-of-");
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  ACCEL_ASSIGN_OR_RETURN(internal::AtomicFile file, internal::AtomicFile::Create(path));
  ACCEL_RETURN_IF_ERROR(file.Write(contents));
  return file.Commit();
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  for (const auto& [name, t] : tensors) {
    if (!t.defined())
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' is undefined"));
  }
  std::vector<TensorSpec> specs = SpecsOf(tensors);
  ACCEL_ASSIGN_OR_RETURN(std::vector<Planned> planned, Plan(specs));
  ACCEL_ASSIGN_OR_RETURN(
      internal::AtomicFile file,
      WriteFile(path, std::move(planned), metadata, ProducerOf(tensors), /*write_behind=*/-1));
  return file.Publish();
}

absl::StatusOr<CheckpointWriteResult> WriteCheckpoint(const std::string& dir,
                                                      const std::vector<TensorSpec>& specs,
                                                      const TensorProducer& produce,
                                                      const CheckpointWriteOptions& options) {
  if (options.max_shard_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_shard_size must be positive, got ", options.max_shard_size));
  }
  ACCEL_ASSIGN_OR_RETURN(std::vector<Planned> planned, Plan(specs));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat("creating folder ", dir));

  // transformers' rule: fill a shard in order until the next tensor would
  // overflow it; a tensor larger than the limit sits alone.
  std::vector<std::vector<Planned>> shards;
  uint64_t shard_bytes = 0;
  uint64_t total = 0;
  const auto limit = static_cast<uint64_t>(options.max_shard_size);
  for (Planned& t : planned) {
    uint64_t n = t.info.nbytes();
    total += n;
    if (shards.empty() || (shard_bytes > 0 && shard_bytes + n > limit)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(std::move(t));
    shard_bytes += n;
  }
  if (shards.empty()) shards.emplace_back();

  CheckpointWriteResult result;
  result.total_bytes = total;
  std::vector<internal::AtomicFile> written;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  std::map<std::string, std::string> sorted_map;
  for (size_t i = 0; i < shards.size(); ++i) {
    std::string name = shards.size() == 1 ? std::string(kSingleName)
                                          : absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1,
                                                            shards.size());
    for (const Planned& t : shards[i]) sorted_map.emplace(t.info.name, name);
    ACCEL_ASSIGN_OR_RETURN(internal::AtomicFile file,
                           WriteFile(absl::StrCat(dir, "/", name), std::move(shards[i]),
                                     options.metadata, produce, options.write_behind_bytes));
    written.push_back(std::move(file));
    result.files.push_back(name);
  }
  for (internal::AtomicFile& file : written) ACCEL_RETURN_IF_ERROR(file.Publish());
  if (shards.size() > 1) {
    for (const auto& [tensor, file] : sorted_map) weight_map[tensor] = file;
    nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}},
                                    {"weight_map", weight_map}};
    ACCEL_RETURN_IF_ERROR(
        WriteFileAtomically(absl::StrCat(dir, "/", kIndexName), index.dump(2) + "\n"));
    result.files.emplace_back(kIndexName);
  }

  // The new checkpoint is complete; drop what an earlier save left that a
  // reader could mistake for part of it.
  std::set<std::string> keep(result.files.begin(), result.files.end());
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (keep.count(name)) continue;
    bool stale =
        IsShardFileName(name) || name == kIndexName || (shards.size() > 1 && name == kSingleName);
    if (stale) std::filesystem::remove(entry.path(), ec);
  }
  return result;
}

absl::StatusOr<CheckpointWriteResult> WriteCheckpoint(const std::string& dir,
                                                      const std::vector<NamedTensor>& tensors,
                                                      const CheckpointWriteOptions& options) {
  for (const auto& [name, t] : tensors) {
    if (!t.defined())
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' is undefined"));
  }
  return WriteCheckpoint(dir, SpecsOf(tensors), ProducerOf(tensors), options);
}

}  // namespace accel::loader
