// libFuzzer target for the .bin (torch.save) reader (scripts/fuzz.sh runs
// it): accel's checks of the zip and the pickle (instrumented), then
// libtorch's own unpickler on what they let through (uninstrumented, linked
// from libtorch). An input that starts with "PK" is a whole file; any other
// is a data.pkl, put into an archive here with a record of the right size for
// each storage it names, so the fuzzer reaches the unpickler without having
// to build a zip. Any input must give an error status or tensors whose every
// element lies inside the bytes that hold them; anything else is a crash
// (__builtin_trap), as are the sanitizers' findings.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

#include "loader/internal/safetensors_format.h"
#include "loader/internal/torch_archive.h"
#include "loader/internal/torch_bin.h"

namespace {

using accel::loader::TensorInfo;
using accel::loader::internal::CheckedPickle;
using accel::loader::internal::CheckTorchPickle;
using accel::loader::internal::DTypeElementSize;
using accel::loader::internal::TorchBinFile;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void Le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

// A zip of stored records (no CRC: the reader does not check it).
std::string StoredZip(const std::vector<std::pair<std::string, std::string>>& records) {
  std::string out, directory;
  for (const auto& [name, data] : records) {
    const uint64_t offset = out.size();
    out += "PK\x03\x04";
    Le(out, 20, 2);  // version
    Le(out, 0, 2);   // flags
    Le(out, 0, 2);   // stored
    Le(out, 0, 4);   // time, date
    Le(out, 0, 4);   // crc
    Le(out, data.size(), 4);
    Le(out, data.size(), 4);
    Le(out, name.size(), 2);
    Le(out, 0, 2);
    out += name;
    out += data;
    directory += "PK\x01\x02";
    Le(directory, 20, 2);
    Le(directory, 20, 2);
    Le(directory, 0, 2);
    Le(directory, 0, 2);
    Le(directory, 0, 4);
    Le(directory, 0, 4);
    Le(directory, data.size(), 4);
    Le(directory, data.size(), 4);
    Le(directory, name.size(), 2);
    Le(directory, 0, 6);  // extra, comment, disk
    Le(directory, 0, 6);  // attributes
    Le(directory, offset, 4);
    directory += name;
  }
  const uint64_t start = out.size();
  out += directory;
  out += "PK\x05\x06";
  Le(out, 0, 4);
  Le(out, records.size(), 2);
  Le(out, records.size(), 2);
  Le(out, directory.size(), 4);
  Le(out, start, 4);
  Le(out, 0, 2);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto bytes = std::make_shared<std::string>(reinterpret_cast<const char*>(data), size);
  if (size < 2 || std::memcmp(data, "PK", 2) != 0) {
    absl::StatusOr<CheckedPickle> checked = CheckTorchPickle(*bytes, "fuzz");
    if (!checked.ok()) {
      Check(checked.status().code() == absl::StatusCode::kInvalidArgument);
      return 0;
    }
    std::vector<std::pair<std::string, std::string>> records = {{"a/data.pkl", *bytes}};
    uint64_t total = 0;
    for (const auto& [key, storage] : checked->storages) {
      const uint64_t n = static_cast<uint64_t>(storage.numel) *
                         static_cast<uint64_t>(*DTypeElementSize(storage.dtype));
      total += n;
      if (total > (uint64_t{1} << 20)) return 0;  // memory, not safety
      records.push_back({"a/data/" + key, std::string(n, '\x01')});
    }
    bytes = std::make_shared<std::string>(StoredZip(records));
  }
  const char* begin = bytes->data();
  const char* end = begin + bytes->size();
  absl::StatusOr<TorchBinFile> file = TorchBinFile::FromBytes(*bytes, bytes, "fuzz");
  if (!file.ok()) {
    Check(!file.status().message().empty());
    Check(file.status().code() != absl::StatusCode::kInternal);
    return 0;
  }
  for (const TensorInfo& info : file->tensors()) {
    const int element = *DTypeElementSize(info.dtype);
    Check(info.nbytes() == static_cast<uint64_t>(info.numel()) * static_cast<uint64_t>(element));
    if (std::optional<uint64_t> at = file->FileOffset(info.name)) {
      Check(*at <= bytes->size() && info.nbytes() <= bytes->size() - *at);
    }
    absl::StatusOr<at::Tensor> t = file->Tensor(info.name);
    Check(t.ok());
    Check(t->is_contiguous() && t->numel() == info.numel());
    const char* p = static_cast<const char*>(t->data_ptr());
    // A view of the file stays inside it; a copy is its own allocation.
    if (p >= begin && p < end) Check(info.nbytes() <= static_cast<size_t>(end - p));
    // Read every byte through instrumented code.
    unsigned sum = 0;
    for (uint64_t i = 0; i < info.nbytes(); ++i) sum += static_cast<unsigned char>(p[i]);
    (void)sum;
  }
  return 0;
}
