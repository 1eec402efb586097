#include "core/status.h"

#include <cerrno>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace accel {
namespace {

// c10::Error::what() carries a C++ backtrace after the message; keep the
// message a user can act on.
std::string FirstLine(const c10::Error& e) {
  std::string msg = e.msg();
  if (auto pos = msg.find('\n'); pos != std::string::npos) msg.resize(pos);
  return msg;
}

}  // namespace

absl::Status StatusFromCurrentException() {
  try {
    throw;
  } catch (const c10::OutOfMemoryError& e) {
    return absl::ResourceExhaustedError(FirstLine(e));
  } catch (const c10::NotImplementedError& e) {
    return absl::UnimplementedError(FirstLine(e));
  } catch (const c10::IndexError& e) {
    return absl::InvalidArgumentError(FirstLine(e));
  } catch (const c10::ValueError& e) {
    return absl::InvalidArgumentError(FirstLine(e));
  } catch (const c10::TypeError& e) {
    return absl::InvalidArgumentError(FirstLine(e));
  } catch (const c10::Error& e) {
    return absl::InternalError(FirstLine(e));
  } catch (const std::bad_alloc& e) {
    return absl::ResourceExhaustedError(absl::StrCat("out of memory: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  } catch (...) {
    return absl::InternalError("unknown exception");
  }
}

absl::Status ErrnoStatus(int err, absl::string_view context) {
  std::string message = absl::StrCat(context, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return absl::ResourceExhaustedError(message);
    case EISDIR:
    case ENOTDIR:
      return absl::InvalidArgumentError(message);
    default:
      return absl::UnknownError(message);
  }
}

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace accel
