// core/status.h: error handling shared by every component.
//
// Functions that can fail and cross a component boundary return absl::Status
// or absl::StatusOr<T>. libtorch throws; CallTorch() is the one bridge that
// turns its exceptions into a Status, so exceptions never leave a .cc file.
//
//   ACCEL_ASSIGN_OR_RETURN(auto file, loader::SafetensorsFile::Open(path));
//   ACCEL_RETURN_IF_ERROR(CallTorch([&] { out = weight.to(at::kFloat); }));
#ifndef ACCEL_CORE_STATUS_H_
#define ACCEL_CORE_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

// NOLINTBEGIN(bugprone-macro-parentheses): `lhs` is a declaration.
#define ACCEL_RETURN_IF_ERROR(expr)                                 \
  do {                                                              \
    if (absl::Status accel_status_ = (expr); !accel_status_.ok()) { \
      return accel_status_;                                         \
    }                                                               \
  } while (false)

#define ACCEL_CONCAT_INNER_(a, b) a##b
#define ACCEL_CONCAT_(a, b) ACCEL_CONCAT_INNER_(a, b)
// ACCEL_ASSIGN_OR_RETURN(auto x, FunctionReturningStatusOr());
#define ACCEL_ASSIGN_OR_RETURN(lhs, rexpr) \
  ACCEL_ASSIGN_OR_RETURN_IMPL_(ACCEL_CONCAT_(accel_statusor_, __LINE__), lhs, rexpr)
#define ACCEL_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)
// NOLINTEND(bugprone-macro-parentheses)

namespace accel {

// Maps the exception being handled to a Status: c10::OutOfMemoryError ->
// ResourceExhausted, c10::NotImplementedError -> Unimplemented,
// c10::IndexError / ValueError / TypeError -> InvalidArgument, any other
// c10::Error -> Internal (we validate inputs before calling torch, so a
// failed TORCH_CHECK is our bug), std::bad_alloc -> ResourceExhausted,
// anything else -> Internal. Call only inside a catch block.
absl::Status StatusFromCurrentException();

// Runs `fn`; an exception it throws comes back as a Status (see above).
template <typename Fn>
absl::Status CallTorch(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
    return absl::OkStatus();
  } catch (...) {
    return StatusFromCurrentException();
  }
}

// A Status for a failed system call: `context` (say, "opening /m/x.bin"),
// then strerror(err). ENOENT -> NotFound, EACCES/EPERM -> PermissionDenied,
// ENOSPC/EDQUOT/EFBIG -> ResourceExhausted, EISDIR/ENOTDIR -> InvalidArgument,
// anything else -> Unknown.
absl::Status ErrnoStatus(int err, absl::string_view context);

// Returns `status` with "context: " put before its message; OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace accel

#endif  // ACCEL_CORE_STATUS_H_
