// server/serving.h: what every gRPC service of accel-serve shares: the
// lifecycle (loading -> ready -> draining), the engine once it is loaded,
// the optional bearer token, the metrics, and the absl -> gRPC status bridge.
#ifndef ACCEL_SERVER_SERVING_H_
#define ACCEL_SERVER_SERVING_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace accel::engine {
class LlmEngine;
}  // namespace accel::engine

namespace accel::server {

class ServerMetrics;

class ServingState {
 public:
  enum class Phase { kLoading, kReady, kDraining };

  // `auth_token` unset: no authentication. `metrics` may be null.
  ServingState(std::optional<std::string> auth_token, ServerMetrics* metrics);

  // The engine while ready; else Unavailable saying why ("the model is still
  // loading", "the server is draining").
  absl::StatusOr<engine::LlmEngine*> ReadyEngine() const;
  // The engine once loaded (still there while draining), or null.
  engine::LlmEngine* engine() const { return engine_.load(); }
  Phase phase() const { return phase_.load(); }
  void SetReady(engine::LlmEngine* engine);
  void SetDraining();

  // OK when no token is configured or the call carries the metadata
  // "authorization: Bearer <token>" (the scheme in any case, RFC 7235);
  // else Unauthenticated (and counted).
  // Every handler but the liveness probes calls it first, so it also notes
  // when the last call arrived (see last_call()).
  grpc::Status Authorize(const grpc::ServerContextBase& context) const;
  // The same check for HTTP: `authorization` is the Authorization header's
  // value (null when absent). OK or Unauthenticated (and counted).
  absl::Status AuthorizeBearer(const std::string* authorization) const;
  // When a handler last called Authorize; InfinitePast before any call. A
  // drain waits for a quiet moment before it stops gRPC (server/server.cc).
  absl::Time last_call() const { return absl::FromUnixNanos(last_call_ns_.load()); }

  ServerMetrics* metrics() const { return metrics_; }

 private:
  const std::optional<std::string> auth_token_;
  ServerMetrics* const metrics_;
  std::atomic<engine::LlmEngine*> engine_{nullptr};
  std::atomic<Phase> phase_{Phase::kLoading};
  mutable std::atomic<int64_t> last_call_ns_{0};
};

// The server's own folders (the model's, the offload folder): in every error
// a client is sent (ToGrpcStatus, the OpenAI API's errors) each is shown as
// its last component only, so no answer tells where the server keeps its
// files ("/srv/models/llama-3/tokenizer_config.json" -> "llama-3/...").
// Process-wide; Server::Start adds them.
void AddPrivatePath(const std::string& path);
// `status` with the private paths cut as above.
absl::Status ForClient(const absl::Status& status);

// Same code, same message (ForClient's). ResourceExhausted also gets the
// trailing metadata "retry-after-ms" through AddRetryHint.
grpc::Status ToGrpcStatus(const absl::Status& status);
// For a ResourceExhausted answer: how long a client should wait.
void AddRetryHint(grpc::ServerContextBase& context);

// The call's deadline, or InfiniteFuture when the client set none.
absl::Time CallDeadline(const grpc::ServerContextBase& context);

// True when the call's deadline has come (within a few milliseconds). gRPC
// reports a passed deadline as a cancellation (OnCancel); a handler that
// sees this leaves the request to the scheduler, which ends it for its
// deadline in the same step, so it is counted as a timeout, not as a
// client's cancel.
bool DeadlineReached(const grpc::ServerContextBase& context);

// OK while the client still waits for the call; DeadlineExceeded once its
// deadline passed, Cancelled once it cancelled (or its connection went).
// Asked while a request is read and before it is queued, so that no work
// outlives the client that asked for it (a large tools_json past a 3 s
// deadline kept a thread busy for 27 s).
absl::Status CallStillWanted(const grpc::ServerContextBase& context);

// The whole of a file a flag names (a TLS certificate, a token file); NotFound
// naming the flag and the path when it cannot be read.
absl::StatusOr<std::string> ReadFlagFile(const std::string& path, const char* flag);

}  // namespace accel::server

#endif  // ACCEL_SERVER_SERVING_H_
