#include "server/openai_http.h"

#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

#include "server/engine.h"
#include "server/internal/http_server.h"
#include "server/internal/openai_convert.h"
#include "server/internal/quote.h"
#include "server/server_metrics.h"
#include "server/serving.h"

namespace accel::server {
namespace {

using internal::HttpExchange;
using internal::OpenAiEndpoint;
using internal::OpenAiError;

constexpr char kJson[] = "application/json";
// How often a handler waiting for tokens looks whether its client left.
constexpr absl::Duration kClosedCheck = absl::Milliseconds(50);

bool SendError(HttpExchange& exchange, const OpenAiError& error) {
  std::vector<std::string> headers;
  if (error.http_status == 429 || error.http_status == 503) headers.emplace_back("Retry-After: 1");
  if (error.http_status == 401) headers.emplace_back("WWW-Authenticate: Bearer");
  return exchange.Respond(error.http_status, kJson, internal::ErrorBody(error), headers);
}

bool SendStatus(HttpExchange& exchange, const absl::Status& status) {
  return SendError(exchange, internal::ErrorForStatus(status));
}

// What the scheduler hands a waiting handler: chunks, then the end.
class WaitingSink : public RequestSink {
 public:
  void OnTokens(TokenChunk chunk) override {
    absl::MutexLock lock(&mu_);
    chunks_.push_back(std::move(chunk));
  }
  void OnDone(const absl::Status& status, const Completion& completion) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    completion_ = completion;
    done_ = true;
  }

  // Waits up to `timeout` for news; moves the chunks so far into `chunks`.
  // True once the request ended (then `status` and `completion` are set).
  bool Wait(absl::Duration timeout, std::vector<TokenChunk>& chunks, absl::Status& status,
            Completion& completion) {
    absl::MutexLock lock(&mu_);
    auto news = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ || !chunks_.empty(); };
    mu_.AwaitWithTimeout(absl::Condition(&news), timeout);
    chunks.clear();
    for (TokenChunk& chunk : chunks_) chunks.push_back(std::move(chunk));
    chunks_.clear();
    if (done_) {
      status = status_;
      completion = completion_;
    }
    return done_;
  }

 private:
  absl::Mutex mu_;
  std::deque<TokenChunk> chunks_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  Completion completion_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> OpenAiHttpServer::Start(
    const OpenAiHttpOptions& options, ServingState* state) {
  std::unique_ptr<OpenAiHttpServer> server(
      new OpenAiHttpServer(state, absl::ToUnixSeconds(absl::Now())));
  internal::HttpServerOptions http;
  http.host = options.host;
  http.port = options.port;
  http.request_timeout = options.request_timeout;
  http.max_body_bytes = options.max_body_bytes;
  http.max_connections = options.max_connections;
  http.tls_cert_pem = options.tls_cert_pem;
  http.tls_key_pem = options.tls_key_pem;
  OpenAiHttpServer* self = server.get();
  absl::StatusOr<std::unique_ptr<internal::HttpServer>> started = internal::HttpServer::Start(
      http, [self](HttpExchange& exchange) { self->Handle(exchange); },
      [](int status, absl::string_view message) {
        OpenAiError error;
        error.http_status = status;
        error.type = status >= 500 ? "server_error" : "invalid_request_error";
        error.message = std::string(message);
        if (status == 413) error.code = "request_too_large";
        if (status == 408) error.code = "request_timeout";
        return internal::ErrorBody(error);
      });
  if (!started.ok()) return started.status();
  server->http_ = *std::move(started);
  return server;
}

OpenAiHttpServer::OpenAiHttpServer(ServingState* state, int64_t created)
    : state_(state), created_(created) {}

OpenAiHttpServer::~OpenAiHttpServer() { http_.reset(); }

int OpenAiHttpServer::port() const { return http_->port(); }

void OpenAiHttpServer::Stop(absl::Duration timeout) {
  http_->Stop();
  http_->WaitConnections(timeout);
}

void OpenAiHttpServer::Handle(HttpExchange& exchange) {
  const internal::HttpRequest& request = exchange.request();
  const std::string& path = request.path;
  const bool chat = path == "/v1/chat/completions";
  const bool completions = path == "/v1/completions";
  const bool models = path == "/v1/models" || absl::StartsWith(path, "/v1/models/");
  if (!chat && !completions && !models) {
    OpenAiError error;
    error.http_status = 404;
    error.type = "invalid_request_error";
    error.code = "unknown_url";
    error.message = absl::StrCat("Invalid URL (", request.method, " ", internal::Quote(path),
                                 "): this server serves /v1/chat/completions, /v1/completions "
                                 "and /v1/models");
    SendError(exchange, error);
    return;
  }
  const char* allowed = models ? "GET" : "POST";
  if (request.method != allowed) {
    OpenAiError error;
    error.http_status = 405;
    error.type = "invalid_request_error";
    error.code = "method_not_allowed";
    error.message = absl::StrCat(request.method, " is not allowed on ", path, "; use ", allowed);
    exchange.Respond(405, kJson, internal::ErrorBody(error), {absl::StrCat("Allow: ", allowed)});
    return;
  }
  const absl::Status auth = state_->AuthorizeBearer(request.Header("authorization"));
  if (!auth.ok()) {
    SendStatus(exchange, auth);
    return;
  }
  if (models) {
    Engine* engine = state_->engine();
    if (engine == nullptr) {
      SendStatus(exchange, absl::UnavailableError("the model is still loading"));
      return;
    }
    const std::string& name = engine->info().name;
    if (path == "/v1/models") {
      exchange.Respond(200, kJson, internal::ModelList(name, created_));
      return;
    }
    const std::string id = path.substr(std::string("/v1/models/").size());
    if (id != name) {
      SendStatus(exchange, absl::NotFoundError(absl::StrCat("model ", internal::Quote(id),
                                                            " is not served here; this server "
                                                            "serves \"",
                                                            name, "\"")));
      return;
    }
    exchange.Respond(200, kJson, internal::ModelObject(name, created_));
    return;
  }
  Generate(exchange, chat);
}

void OpenAiHttpServer::Generate(HttpExchange& exchange, bool chat) {
  absl::StatusOr<internal::OpenAiRequest> parsed = internal::ParseOpenAiRequest(
      chat ? OpenAiEndpoint::kChat : OpenAiEndpoint::kCompletions, exchange.request().body);
  if (!parsed.ok()) {
    if (state_->metrics() != nullptr) state_->metrics()->RequestFailed("invalid");
    SendStatus(exchange, parsed.status());
    return;
  }
  absl::StatusOr<Engine*> ready = state_->ReadyEngine();
  if (!ready.ok()) {
    SendStatus(exchange, ready.status());
    return;
  }
  Engine* engine = *ready;
  auto sink = std::make_shared<WaitingSink>();
  absl::StatusOr<uint64_t> id = engine->Submit(parsed->generation, sink);
  if (!id.ok()) {
    SendStatus(exchange, id.status());
    return;
  }
  internal::OpenAiResponseWriter writer(
      *parsed, engine->info().name, [engine](int64_t token) { return engine->TokenText(token); },
      absl::ToUnixSeconds(absl::Now()));
  const bool stream = parsed->stream;
  bool client_gone = false;
  if (stream) {
    client_gone = !exchange.StartStream(200, "text/event-stream",
                                        {"Cache-Control: no-cache", "X-Accel-Buffering: no"}) ||
                  !exchange.WriteChunk(writer.StreamStart());
  }
  std::vector<TokenChunk> chunks;
  absl::Status status;
  Completion completion;
  while (true) {
    const bool done = sink->Wait(kClosedCheck, chunks, status, completion);
    if (!client_gone) {
      std::string events;
      for (const TokenChunk& chunk : chunks) {
        if (stream) {
          events += writer.StreamChunk(chunk);
        } else {
          writer.Add(chunk);
        }
      }
      if (stream && !events.empty() && !exchange.WriteChunk(events)) client_gone = true;
      if (!done && exchange.PeerClosed()) client_gone = true;
      if (client_gone) engine->Cancel(*id);  // the sink still hears OnDone (Cancelled)
    }
    if (done) break;
  }
  if (client_gone) return;  // nobody to answer; the connection closes
  if (!stream) {
    if (status.ok()) {
      exchange.Respond(200, kJson, writer.Final(completion));
    } else {
      SendStatus(exchange, status);
    }
    return;
  }
  if (status.ok()) {
    exchange.WriteChunk(writer.StreamEnd(completion));
  } else {
    exchange.WriteChunk(
        internal::OpenAiResponseWriter::StreamError(internal::ErrorForStatus(status)));
  }
  exchange.EndStream();
}

}  // namespace accel::server
