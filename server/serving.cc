#include "server/serving.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"

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

absl::StatusOr<Engine*> ServingState::ReadyEngine() const {
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

void ServingState::SetReady(Engine* engine) {
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
  const std::string expected = "Bearer " + *auth_token_;
  if (!ConstantTimeEquals(*authorization, expected)) {
    if (metrics_ != nullptr) metrics_->RequestFailed("unauthenticated");
    return absl::UnauthenticatedError("the bearer token is not valid");
  }
  return absl::OkStatus();
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // absl's codes are gRPC's codes, number for number.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
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

absl::StatusOr<std::string> ReadFlagFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--", flag, ": cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace accel::server
