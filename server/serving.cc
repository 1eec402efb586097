#include "server/serving.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#include "server/server_metrics.h"

namespace accel::server {
namespace {

// Compares without an early exit, so the time taken says nothing about
// how much of a guessed token was right.
bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

}  // namespace

ServingState::ServingState(std::optional<std::string> auth_token, ServerMetrics* metrics)
    : auth_token_(std::move(auth_token)), metrics_(metrics) {}

absl::StatusOr<engine::LlmEngine*> ServingState::ReadyEngine() const {
  switch (phase_.load()) {
    case Phase::kLoading:
      return absl::UnavailableError("the model is still loading; retry when the server is ready");
    case Phase::kDraining:
      return absl::UnavailableError("the server is draining before it exits; use another replica");
    case Phase::kReady:
      break;
  }
  return engine_.load();
}

void ServingState::SetReady(engine::LlmEngine* engine) {
  engine_.store(engine);
  phase_.store(Phase::kReady);
}

void ServingState::SetDraining() { phase_.store(Phase::kDraining); }

grpc::Status ServingState::Authorize(const grpc::ServerContextBase& context) const {
  last_call_ns_.store(absl::ToUnixNanos(absl::Now()));
  if (!auth_token_) return grpc::Status::OK;
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    if (metrics_ != nullptr) metrics_->RequestFailed("unauthenticated");
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "this server needs the metadata \"authorization: Bearer <token>\"");
  }
  const std::string value(it->second.data(), it->second.size());
  const absl::Status checked = AuthorizeBearer(&value);
  if (!checked.ok()) return ToGrpcStatus(checked);
  return grpc::Status::OK;
}

absl::Status ServingState::AuthorizeBearer(const std::string* authorization) const {
  last_call_ns_.store(absl::ToUnixNanos(absl::Now()));
  if (!auth_token_) return absl::OkStatus();
  if (authorization == nullptr) {
    if (metrics_ != nullptr) metrics_->RequestFailed("unauthenticated");
    return absl::UnauthenticatedError(
        "this server needs the header \"Authorization: Bearer <token>\"");
  }
  // RFC 7235: "Bearer", in any case, then one or more spaces, then the
  // token (RFC 6750's credentials).
  const absl::string_view value(*authorization);
  const size_t space = value.find(' ');
  const absl::string_view scheme = value.substr(0, space);
  absl::string_view token =
      space == absl::string_view::npos ? absl::string_view() : value.substr(space);
  while (!token.empty() && token.front() == ' ') token.remove_prefix(1);
  if (!absl::EqualsIgnoreCase(scheme, "bearer") ||
      !ConstantTimeEquals(std::string(token), *auth_token_)) {
    if (metrics_ != nullptr) metrics_->RequestFailed("unauthenticated");
    return absl::UnauthenticatedError("the bearer token is not valid");
  }
  return absl::OkStatus();
}

namespace {

absl::Mutex private_paths_mu(absl::kConstInit);
std::vector<std::string>* private_paths ABSL_GUARDED_BY(private_paths_mu) = nullptr;

}  // namespace

void AddPrivatePath(const std::string& path) {
  std::vector<std::string> forms;
  std::error_code error;
  for (std::filesystem::path form :
       {std::filesystem::path(path), std::filesystem::absolute(path, error),
        std::filesystem::weakly_canonical(path, error)}) {
    std::string text = form.lexically_normal().string();
    while (text.size() > 1 && text.back() == '/') text.pop_back();
    // Relative and root forms say nothing, and would match everywhere.
    if (text.size() > 1 && text.front() == '/') forms.push_back(text);
  }
  absl::MutexLock lock(&private_paths_mu);
  if (private_paths == nullptr) private_paths = new std::vector<std::string>();
  for (std::string& form : forms) private_paths->push_back(std::move(form));
  // Longest first, so that a folder inside another is replaced whole.
  std::sort(private_paths->begin(), private_paths->end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
}

absl::Status ForClient(const absl::Status& status) {
  if (status.ok()) return status;
  std::string message(status.message());
  {
    absl::MutexLock lock(&private_paths_mu);
    if (private_paths == nullptr) return status;
    for (const std::string& path : *private_paths) {
      const std::string shown = std::filesystem::path(path).filename().string();
      size_t at = 0;
      while ((at = message.find(path, at)) != std::string::npos) {
        message.replace(at, path.size(), shown);
        at += shown.size();
      }
    }
  }
  return absl::Status(status.code(), message);
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // absl's codes are gRPC's codes, number for number.
  const absl::Status shown = ForClient(status);
  return grpc::Status(static_cast<grpc::StatusCode>(shown.code()), std::string(shown.message()));
}

void AddRetryHint(grpc::ServerContextBase& context) {
  context.AddTrailingMetadata("retry-after-ms", "1000");
}

absl::Time CallDeadline(const grpc::ServerContextBase& context) {
  const std::chrono::system_clock::time_point deadline = context.deadline();
  // No deadline reads as the far future (gpr_inf_future); anything past a
  // century is the same thing.
  if (deadline >= std::chrono::system_clock::now() + std::chrono::hours(24 * 365 * 100)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

bool DeadlineReached(const grpc::ServerContextBase& context) {
  // gRPC's timer and absl's clock may disagree by a little; a cancel this
  // close to the deadline is the deadline's.
  return CallDeadline(context) <= absl::Now() + absl::Milliseconds(100);
}

absl::Status CallStillWanted(const grpc::ServerContextBase& context) {
  if (CallDeadline(context) <= absl::Now()) {
    return absl::DeadlineExceededError("the call's deadline passed before its request was queued");
  }
  if (context.IsCancelled()) {
    return absl::CancelledError("the client cancelled the call before its request was queued");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFlagFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--", flag, ": cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace accel::server
