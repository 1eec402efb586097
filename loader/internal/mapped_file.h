// A whole file mapped into memory, private and copy-on-write: an in-place op
// on a tensor over it never reaches the file. Torch-free.
#ifndef ACCEL_LOADER_INTERNAL_MAPPED_FILE_H_
#define ACCEL_LOADER_INTERNAL_MAPPED_FILE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "core/file_faults.h"

namespace accel::loader::internal {

class MappedFile {
 public:
  // Opens without blocking (a FIFO or a device in a model folder is refused
  // by name rather than waited on), refuses anything but a regular file
  // (InvalidArgument), and maps it. `populate` reads every page now.
  static absl::StatusOr<std::shared_ptr<const MappedFile>> Open(const std::string& path,
                                                                bool populate);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const char* data() const { return static_cast<const char*>(addr_); }
  size_t size() const { return size_; }
  absl::string_view bytes() const { return {data(), size_}; }

 private:
  MappedFile() = default;
  std::string path_;
  void* addr_ = nullptr;
  size_t size_ = 0;
  MappedFileRegistration registration_;  // a SIGBUS on it is mended and recorded
  WeightsFileWatch watch_;               // a change in place is recorded
};

// Reads every page of [addr, addr + size) in, read-only (no copy-on-write).
void PopulateMapping(const void* addr, size_t size);

}  // namespace accel::loader::internal

#endif  // ACCEL_LOADER_INTERNAL_MAPPED_FILE_H_
