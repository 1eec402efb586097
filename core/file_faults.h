// core/file_faults.h: faults in the files a model's weights come from.
//
// Weights are used in place from their files' mappings (zero copy). A file
// truncated or rewritten in place under a mapping (cp over the model, a
// half-synced volume) turns a read of a page past its new end into SIGBUS,
// which kills a process silently, losing every request in flight. With the
// handler installed (accel-serve installs it at start), a SIGBUS on a
// registered mapping maps a zero page over the faulting page, so the
// instruction and the step complete, and records the file; a read of a
// weights file that fails is recorded the same way. A recorded fault is
// sticky: the mapped bytes can no longer be trusted, so every forward pass
// refuses from then on (models check ModelFileFault()), no answer computed
// from them is sent, and the server turns not-ready and exits non-zero for
// a restart. A SIGBUS elsewhere keeps its default action. Torch-free.
#ifndef ACCEL_CORE_FILE_FAULTS_H_
#define ACCEL_CORE_FILE_FAULTS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace accel {

// [addr, addr + size) maps `path`, a weights file, for as long as the
// registration lives. Movable; thread-safe.
class MappedFileRegistration {
 public:
  MappedFileRegistration() = default;
  MappedFileRegistration(const void* addr, size_t size, const std::string& path);
  ~MappedFileRegistration();
  MappedFileRegistration(MappedFileRegistration&& other) noexcept;
  MappedFileRegistration& operator=(MappedFileRegistration&& other) noexcept;
  MappedFileRegistration(const MappedFileRegistration&) = delete;
  MappedFileRegistration& operator=(const MappedFileRegistration&) = delete;

 private:
  int slot_ = -1;
};

// An open weights file (`fd`, named `path`) watched for changes made in
// place while it is in use, for as long as the watch lives: a file rewritten
// without being truncated changes the bytes under a mapping (and under later
// reads) without any fault, mixing old and new weights silently. Replacing a
// file (a rename over it) or deleting it changes nothing for the process,
// which holds the old one, and is not a fault. Movable; thread-safe.
class WeightsFileWatch {
 public:
  WeightsFileWatch() = default;
  WeightsFileWatch(int fd, const std::string& path);
  ~WeightsFileWatch();
  WeightsFileWatch(WeightsFileWatch&& other) noexcept;
  WeightsFileWatch& operator=(WeightsFileWatch&& other) noexcept;
  WeightsFileWatch(const WeightsFileWatch&) = delete;
  WeightsFileWatch& operator=(const WeightsFileWatch&) = delete;

 private:
  uint64_t id_ = 0;
};

// Installs the SIGBUS handler above, process-wide (idempotent).
void InstallMappedFileFaultHandler();

// Starts a thread that watches the folders of the watched weights files
// (inotify) and records a fault when a file this process holds is modified in
// place (a write or a truncation of the same inode): best effort, since a
// step that reads the bytes between the change and its event is not failed.
// Process-wide, idempotent; without it, watches cost a set entry each.
void StartWeightsFileWatcher();

// Records a fault in a weights file (`description` names it); the first one
// is kept. Async-signal-safe.
void RecordModelFileFault(absl::string_view description);

// The first recorded fault's description; nullopt while there is none.
std::optional<std::string> ModelFileFault();

// How many SIGBUS faults the handler has mended with a zero page.
int64_t MappedFileFaultCount();

// Forgets recorded faults (tests only: a real fault leaves zero pages behind).
void ResetModelFileFaultForTesting();

}  // namespace accel

#endif  // ACCEL_CORE_FILE_FAULTS_H_
