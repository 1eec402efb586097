// loader/loader.h: checkpoints on disk. Reads safetensors files (memory
// mapped, zero-copy), sharded checkpoints with their index, and writes both
// atomically. Configs live in loader/config.h.
//
//   ACCEL_ASSIGN_OR_RETURN(auto ckpt, loader::Checkpoint::Open("/models/llama"));
//   for (const auto& entry : ckpt.tensors()) {
//     ACCEL_ASSIGN_OR_RETURN(at::Tensor t, ckpt.Tensor(entry.info.name));
//   }
//
// Tensors returned here alias the file's mapping and keep it alive: they
// stay valid after the SafetensorsFile or Checkpoint is destroyed. The
// mapping is private copy-on-write, so writing to such a tensor never
// changes the file. Nothing here knows about devices: tensors are CPU tensors.
#ifndef ACCEL_LOADER_LOADER_H_
#define ACCEL_LOADER_LOADER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "loader/tensor_info.h"

namespace accel::loader {

// The safetensors spelling of a torch dtype ("F32" for float32), or
// InvalidArgument for one the format cannot hold.
absl::StatusOr<std::string> SafetensorsDType(c10::ScalarType dtype);
// The torch dtype of a safetensors dtype. Unimplemented when this libtorch
// has no such dtype (F8_* before libtorch 2.1, U16/U32/U64 before 2.3).
absl::StatusOr<c10::ScalarType> TorchDType(absl::string_view safetensors_dtype);

struct OpenOptions {
  // Read every page now (read-only, no copy) rather than on first touch: for
  // loading all of a file; leave off to read only some tensors.
  bool populate = false;
};

// One .safetensors file, mapped read-only. Thread-safe: every method is const.
class SafetensorsFile {
 public:
  // NotFound if the file does not exist; InvalidArgument or DataLoss (with the
  // path and the tensor) if its header fails the strict check: length bound,
  // valid JSON, known dtypes, non-negative dims without overflow, byte length
  // = numel x element size, offsets in range with no gaps, overlaps or
  // duplicate names.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path, OpenOptions options = {});

  const std::string& path() const { return path_; }
  uint64_t file_size() const;
  // Where the data section starts in the file (8 + header length): a
  // tensor's bytes are at data_offset() + data_begin.
  uint64_t data_offset() const { return data_offset_; }
  // In data order (by offset).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // nullptr when the file has no tensor of that name.
  const TensorInfo* Find(absl::string_view name) const;

  // A CPU tensor over the mapped bytes (no copy). The one exception: data
  // whose address is not a multiple of its element size is copied, so every
  // tensor handed out is aligned. NotFound for an unknown name; Unimplemented
  // for a dtype this libtorch lacks (message names the tensor).
  absl::StatusOr<at::Tensor> Tensor(absl::string_view name) const;
  // The tensor's bytes in the mapping, for callers that do their own conversion.
  absl::string_view Bytes(const TensorInfo& info) const;
  // The same bytes as `part` (a contiguous CPU view into this file's
  // mapping: a slice of a tensor), zero-copy, from a mapping of their own
  // that spans only their pages. A page fault maps the page cache's whole
  // folio around the page (1 MiB on Linux 6.18 / ext4), but never past the
  // mapping, so a process that uses a slice of a tensor keeps only that
  // slice resident, not its neighbours. InvalidArgument (naming the file)
  // when `part` is not such a view.
  absl::StatusOr<at::Tensor> MapAlone(const at::Tensor& part) const;

 private:
  struct Mapping;
  SafetensorsFile() = default;

  std::string path_;
  std::shared_ptr<const Mapping> mapping_;
  uint64_t data_offset_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
};

namespace internal {
class TorchBinFile;
}

// A model's weights: one safetensors file, or shards listed by a
// model.safetensors.index.json; or the same as torch.save writes them
// (pytorch_model.bin, shards listed by pytorch_model.bin.index.json), read
// through libtorch's own unpickler after a check that allows only tensors
// (a global that could run code is refused by name; see
// loader/internal/torch_archive.h). Thread-safe: every method is const.
class Checkpoint {
 public:
  struct Entry {
    TensorInfo info;
    size_t shard = 0;  // index into shard_paths()
  };

  // `path` is a .safetensors file, a .bin (.pt, .pth) file of torch.save, an
  // index .json file, or a directory holding, in transformers' order of
  // preference, model.safetensors.index.json, model.safetensors,
  // pytorch_model.bin.index.json or pytorch_model.bin. NotFound
  // when none is there or the index names a missing shard; NotFound when a
  // shard lacks a tensor the index assigns to it; InvalidArgument for a
  // malformed index (not JSON, no weight_map, a shard name with a path in it).
  // Tensors a shard holds but the index does not name are ignored, as
  // transformers does. Shards named *.bin, *.pt or *.pth are torch.save files.
  static absl::StatusOr<Checkpoint> Open(const std::string& path, OpenOptions options = {});

  // Shard by shard in index order, each in data order. For a .bin shard,
  // info's offsets are positions in the file (see FileOffset).
  const std::vector<Entry>& tensors() const { return entries_; }
  const std::vector<std::string>& shard_paths() const { return shard_paths_; }
  // The shards' __metadata__ (the first shard wins on a clash), then the
  // index's own "metadata" object, values as JSON text unless strings.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const Entry* Find(absl::string_view name) const;
  uint64_t total_bytes() const;

  absl::StatusOr<at::Tensor> Tensor(absl::string_view name) const;
  // Where `entry`'s bytes start in its shard file (shard_paths()[entry.shard])
  // when they are stored as the tensor is laid out, row-major without gaps:
  // always in a safetensors file; a .bin file may hold a strided view
  // (nullopt), which Tensor() copies.
  std::optional<uint64_t> FileOffset(const Entry& entry) const;
  // Shard i when it is a safetensors file, else nullptr.
  const SafetensorsFile* safetensors_shard(size_t i) const;

 private:
  Checkpoint() = default;
  // Opens shard `shard_path` (safetensors or torch.save, by its name) and
  // adds its tensors (those in `wanted`, when given).
  absl::Status AddShard(const std::string& shard_path, OpenOptions options,
                        const std::set<std::string>* wanted);

  std::vector<std::string> shard_paths_;
  // Per shard, one of the two.
  std::vector<std::optional<SafetensorsFile>> shards_;
  std::vector<std::shared_ptr<const internal::TorchBinFile>> bin_shards_;
  std::vector<Entry> entries_;
  std::map<std::string, size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
};

// ---- Writing ---------------------------------------------------------------

using NamedTensor = std::pair<std::string, at::Tensor>;

// Writes one safetensors file atomically: a temporary file in the same
// folder, flushed and synced, then renamed over `path`. On any error the
// temporary file is removed and an existing file at `path` is untouched.
// Tensors may live on any device and be non-contiguous. InvalidArgument for a
// duplicate name or a dtype safetensors cannot hold; the errno text with the
// path for I/O failures (a full disk: ResourceExhausted).
absl::Status WriteSafetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// What a tensor will be, known before its data exists.
struct TensorSpec {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
};

// Makes the data of one tensor when the writer reaches it. It must return a
// tensor of the spec's dtype and shape (checked).
using TensorProducer = std::function<absl::StatusOr<at::Tensor>(const TensorSpec&)>;

struct CheckpointWriteOptions {
  // Shards hold at most this many bytes of tensor data, except that a tensor
  // larger than this gets a shard of its own (transformers' rule).
  int64_t max_shard_size = 5'000'000'000;
  // Stored in every shard's __metadata__.
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  // When positive, about this many bytes of each file being written stay in
  // the page cache: the rest is written back and dropped as the writer goes
  // (a checkpoint larger than memory is written without pushing everything
  // else out of it). -1: the kernel decides.
  int64_t write_behind_bytes = -1;
};

struct CheckpointWriteResult {
  std::vector<std::string> files;  // shard file names, then the index if any
  uint64_t total_bytes = 0;
};

// Writes a checkpoint into directory `dir` (created if missing) the way
// transformers' save_pretrained lays it out: model.safetensors when it fits
// one shard, else model-0000i-of-0000n.safetensors plus
// model.safetensors.index.json. Tensors are assigned to shards in `specs`
// order; `produce` is called once per tensor, one at a time, so a checkpoint
// far larger than memory can be written. Every file is written to a
// temporary name first; the index is renamed last, then shards or an index
// left over from an earlier, different save are removed, so a reader sees
// the old checkpoint or the new one, never a mix. Within a file the tensors
// are laid out as the reference writer lays them out (by element size, then
// name), but produced in `specs` order, each written at its place.
absl::StatusOr<CheckpointWriteResult> WriteCheckpoint(const std::string& dir,
                                                      const std::vector<TensorSpec>& specs,
                                                      const TensorProducer& produce,
                                                      const CheckpointWriteOptions& options = {});

// The same for tensors already in memory.
absl::StatusOr<CheckpointWriteResult> WriteCheckpoint(const std::string& dir,
                                                      const std::vector<NamedTensor>& tensors,
                                                      const CheckpointWriteOptions& options = {});

// The whole of a (small) file: an index, a config. NotFound if missing.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Writes `contents` to `path` atomically (temporary file, sync, rename).
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

}  // namespace accel::loader

#endif  // ACCEL_LOADER_LOADER_H_
