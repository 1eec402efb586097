// A torch.save file (pytorch_model.bin) as a set of tensors: the archive
// checked by internal/torch_archive.h, the pickle then read by libtorch's own
// unpickler (torch::jit::Unpickler), whose storages are views of the file's
// mapping (zero-copy, as safetensors). loader::Checkpoint opens these for
// .bin shards.
#ifndef ACCEL_LOADER_INTERNAL_TORCH_BIN_H_
#define ACCEL_LOADER_INTERNAL_TORCH_BIN_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "loader/tensor_info.h"

namespace accel::loader::internal {

class TorchBinFile {
 public:
  // Errors name the file: NotFound, InvalidArgument (not a torch.save
  // archive, a refused global or opcode, a view past its storage: see
  // ParseTorchArchive), DataLoss (a truncated file).
  static absl::StatusOr<TorchBinFile> Open(const std::string& path, bool populate = false);
  // The same over bytes in memory, kept valid by `keep_alive` while any
  // tensor made here lives (the fuzz target reads through this).
  static absl::StatusOr<TorchBinFile> FromBytes(absl::string_view bytes,
                                                std::shared_ptr<const void> keep_alive,
                                                const std::string& label);

  const std::string& path() const { return path_; }
  // In the state dict's order. dtype is the safetensors spelling;
  // [data_begin, data_end) is where the tensor's bytes lie in the file when
  // it is stored contiguously (FileOffset), else the span from its first
  // element of numel x element size bytes.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* Find(absl::string_view name) const;
  // Where the tensor's bytes start in the file, when they are stored as the
  // tensor is laid out (row-major, no gaps); nullopt for a strided view.
  std::optional<uint64_t> FileOffset(absl::string_view name) const;
  // A CPU tensor: a view of the mapping when contiguous and aligned, else a
  // contiguous copy. NotFound naming the tensor and file.
  absl::StatusOr<at::Tensor> Tensor(absl::string_view name) const;

 private:
  TorchBinFile() = default;
  std::string path_;
  std::shared_ptr<const void> keep_alive_;
  std::vector<TensorInfo> tensors_;
  std::vector<bool> contiguous_;
  std::vector<at::Tensor> values_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

}  // namespace accel::loader::internal

#endif  // ACCEL_LOADER_INTERNAL_TORCH_BIN_H_
