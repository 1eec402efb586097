// The file format of torch.save (since PyTorch 1.6) without torch: a zip
// archive holding `<archive>/data.pkl` (a protocol-2 pickle) and each
// storage's raw bytes in `<archive>/data/<key>`. This is what the hub ships
// as pytorch_model.bin. Parsers of untrusted bytes live here, torch-free, so
// the fuzz target (tests/fuzz/torch_bin_fuzz.cc) reaches them cheaply.
//
// Nothing here runs a pickle. CheckTorchPickle walks the opcodes with a
// model of the unpickler's stack and memo (what pickletools does), allowing
// only what a state dict of tensors needs, and writes the same pickle again
// in the subset that libtorch's own unpickler (torch::jit::Unpickler) reads
// safely. That unpickler then builds the tensors (loader/internal/
// torch_bin.h): in libtorch 1.13 it trusts its input (a short stack, an odd
// SETITEMS, a memo index of 2^32 or a tensor view past its storage are
// undefined behaviour or an allocation of any size there), and it cannot read
// what Python writes for an OrderedDict (a state dict saved whole), which it
// turns into None. So the checked stream it gets has:
//   - only the globals collections.OrderedDict, torch._utils.
//     _rebuild_tensor_v2, torch.jit._pickle.restore_type_tag (libtorch's own
//     pickler tags a Dict[str, Tensor]) and torch.<Type>Storage for the
//     dtypes safetensors has; anything else (a class, a function, os.system)
//     is refused by its name;
//   - OrderedDict() made as an empty dict, and the attributes Python saves
//     with an OrderedDict (BUILD: a state dict's _metadata) dropped;
//   - LONG1 always 8 bytes (libtorch reads no other length);
//   - every tensor's view (offset, sizes, strides) inside its storage, and
//     every storage inside the bytes of its record.
#ifndef ACCEL_LOADER_INTERNAL_TORCH_ARCHIVE_H_
#define ACCEL_LOADER_INTERNAL_TORCH_ARCHIVE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::loader::internal {

// A data.pkl larger than this is refused (a state dict's pickle is about
// 100 bytes a tensor).
inline constexpr uint64_t kMaxTorchPickleBytes = 256ull << 20;

// A storage as a pickle's persistent id names it.
struct TorchStorageRef {
  std::string key;    // the record's name under data/
  std::string dtype;  // safetensors spelling: "F32", "BF16", ...
  int64_t numel = 0;  // elements
};

// One tensor of the state dict: a view of a storage.
struct TorchTensorRef {
  std::string name;
  std::string storage_key;
  std::string dtype;           // the storage's
  int64_t storage_offset = 0;  // in elements
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;  // in elements
  bool requires_grad = false;

  int64_t numel() const;
  // Row-major with no gaps (what safetensors stores), so its bytes are one
  // range of the storage.
  bool contiguous() const;
};

struct CheckedPickle {
  std::string canonical;                            // for libtorch's unpickler
  std::map<std::string, TorchStorageRef> storages;  // by key
  std::vector<TorchTensorRef> tensors;              // in the dict's order
};

// Checks a torch.save pickle whose value is a dict (or OrderedDict) of
// string -> tensor and writes its canonical form (above). `label` names the
// file in errors: InvalidArgument naming the opcode, global, key or tensor
// that is not allowed or not consistent (a key seen with two dtypes, a view
// past its storage, a name that is not UTF-8 or appears twice).
absl::StatusOr<CheckedPickle> CheckTorchPickle(absl::string_view pickle, absl::string_view label);

// A stored (uncompressed, unencrypted) record of the archive.
struct ZipRecord {
  uint64_t offset = 0;  // of its first byte in the file
  uint64_t size = 0;
};

struct ParsedTorchArchive {
  std::string archive;  // the folder every record sits in ("pytorch_model")
  CheckedPickle pickle;
  // The record of each storage the pickle names, by key; each holds at least
  // numel x element size bytes, inside the file.
  std::map<std::string, ZipRecord> records;
};

// Parses the zip directory of a torch.save file whose whole contents are
// `file` (through minizip), reads and checks data.pkl, and finds the record
// of every storage. `label` names the file in errors. InvalidArgument for a
// file that is not such an archive (a legacy pre-1.6 torch.save file is named
// as such), a compressed or encrypted storage record (its bytes could not be
// used in place), a big-endian archive; DataLoss for a record past the end of
// the file or shorter than its storage, or a missing record.
absl::StatusOr<ParsedTorchArchive> ParseTorchArchive(absl::string_view file,
                                                     absl::string_view label);

// True when `bytes` starts as a torch.save file written before PyTorch 1.6
// (a bare pickle rather than a zip archive).
bool IsLegacyTorchSave(absl::string_view bytes);

}  // namespace accel::loader::internal

#endif  // ACCEL_LOADER_INTERNAL_TORCH_ARCHIVE_H_
