// A file written under a temporary name and renamed into place, so a reader
// (or a crash) never sees it half-written and an earlier file at the same
// path survives any failure.
#ifndef ACCEL_LOADER_INTERNAL_ATOMIC_FILE_H_
#define ACCEL_LOADER_INTERNAL_ATOMIC_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::loader::internal {

// Not thread-safe. Destroying an AtomicFile that was not published removes
// its temporary file.
class AtomicFile {
 public:
  // Creates "<path>.tmp.<pid>.<n>" beside `path` (the folder must exist).
  static absl::StatusOr<AtomicFile> Create(const std::string& path);

  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  // Appends all of `bytes` (retrying short writes).
  absl::Status Write(absl::string_view bytes);
  // Writes all of `bytes` at `offset` (pwrite; the append position is left
  // as it was), so a file's parts can be written in any order.
  absl::Status WriteAt(uint64_t offset, absl::string_view bytes);
  // Starts writing back what has been written so far and drops from the page
  // cache what an earlier call started (and is clean by now), so writing a
  // file much larger than memory keeps about two calls' worth of it cached.
  void WriteBehind();
  // Flushes to disk and closes; the file still has its temporary name. A
  // file written behind leaves none of its pages in the page cache.
  absl::Status Finish();
  // Renames the finished file to its final path and syncs the folder.
  absl::Status Publish();
  // Finish() then Publish().
  absl::Status Commit();

  const std::string& path() const { return path_; }

 private:
  AtomicFile(std::string path, std::string temp_path, int fd);
  void Discard();

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  bool published_ = false;
  bool written_behind_ = false;
};

// fsyncs the folder that holds `path`, so a rename into it is durable.
absl::Status SyncParentDirectory(const std::string& path);

}  // namespace accel::loader::internal

#endif  // ACCEL_LOADER_INTERNAL_ATOMIC_FILE_H_
