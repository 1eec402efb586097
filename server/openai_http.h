// server/openai_http.h: accel-serve's OpenAI-compatible HTTP API on its own
// port (--http_port): POST /v1/chat/completions, POST /v1/completions (both
// unary or streamed as server-sent events), GET /v1/models and
// GET /v1/models/{id}. The same engine, queue, bearer token, lifecycle and
// metrics as the gRPC services; docs/API.md describes the fields.
//
// The transport is Boost.Beast (internal/http_transport.h). A handler
// parses the body (stopping if the client leaves meanwhile), submits the
// request to the engine and returns; the engine's sink hands each chunk to
// the connection's own sequence, where it is framed (SSE events or the unary
// body) and written. A client that closes its connection cancels its
// request at once (Engine::Cancel), as a failed write does.
//
// Also: POST /v1/responses (the Responses API, stateless:
// internal/openai_responses.h), POST /tokenize and POST /detokenize (vLLM's:
// internal/openai_tokenize.h), and CORS when --allowed_origins is set.
//
// Also served, without the bearer token, as vLLM does: GET /metrics (the
// Prometheus text of the metrics port) and GET /health (200 while the
// process serves HTTP).
//
// Torch-free header: server/ headers include no libtorch.
#ifndef ACCEL_SERVER_OPENAI_HTTP_H_
#define ACCEL_SERVER_OPENAI_HTTP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace accel::server {

class ServingState;
}  // namespace accel::server
namespace accel::engine {
class LlmEngine;
}  // namespace accel::engine
namespace accel::grammar {
enum class ToolCallFormat;
}  // namespace accel::grammar
namespace accel::server {
namespace internal {
class HttpServer;
class HttpExchange;
}  // namespace internal

// CORS (vLLM's --allowed-origins / --allowed-methods / --allowed-headers):
// a request whose Origin is allowed gets Access-Control-Allow-Origin (and
// -Credentials) on its answer, and its OPTIONS preflight a 204 with the
// Allow-Methods / Allow-Headers; another origin gets no CORS headers (its
// preflight a 400), so the browser keeps the answer from its page.
struct CorsOptions {
  std::vector<std::string> allowed_origins;  // "*" allows any; empty: no CORS at all
  std::vector<std::string> allowed_methods = {"*"};
  std::vector<std::string> allowed_headers = {"*"};
};

struct OpenAiHttpOptions {
  std::string host = "0.0.0.0";
  int port = 0;  // 0: a free one
  // A request's head and body must arrive within this of its first byte.
  absl::Duration request_timeout = absl::Seconds(10);
  size_t max_body_bytes = 4 << 20;
  // Past it a new connection takes the place of the one that has waited
  // longest for its request, or is answered 503 (internal/http_transport.h).
  int max_connections = 512;
  // The Prometheus text for GET /metrics; unset: no /metrics here.
  std::function<std::string()> metrics_text;
  // PEM text of the certificate chain and its key: HTTPS (TLS 1.2+) on the
  // port. Both empty: plain HTTP.
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // --tool_call_parser: hermes | llama3_json | mistral | none | auto.
  std::string tool_call_parser = "auto";
  CorsOptions cors;
};

class OpenAiHttpServer {
 public:
  // Listens; `state` (not owned) must outlive the server. InvalidArgument /
  // Unavailable as internal::HttpServer::Start.
  static absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> Start(const OpenAiHttpOptions& options,
                                                                 ServingState* state);
  ~OpenAiHttpServer();
  OpenAiHttpServer(const OpenAiHttpServer&) = delete;
  OpenAiHttpServer& operator=(const OpenAiHttpServer&) = delete;

  int port() const;
  // Stops accepting and closes idle connections, then waits up to `timeout`
  // for the answers in progress (their requests ended first: Server::Drain
  // stops the scheduler before this).
  void Stop(absl::Duration timeout);

 private:
  OpenAiHttpServer(ServingState* state, int64_t created, std::function<std::string()> metrics);
  void Handle(const std::shared_ptr<internal::HttpExchange>& exchange);
  void Generate(const std::shared_ptr<internal::HttpExchange>& exchange, bool chat);
  void Responses(const std::shared_ptr<internal::HttpExchange>& exchange);
  // After a request is parsed: a parse error, a server not ready, or a
  // client already gone is answered (and counted) here, and null returned;
  // otherwise the engine to run the request on.
  engine::LlmEngine* EngineFor(internal::HttpExchange& exchange, const absl::Status& parsed,
                               const std::function<absl::Status()>& still_there);
  void Tokenize(const std::shared_ptr<internal::HttpExchange>& exchange, engine::LlmEngine* engine);
  void Detokenize(const std::shared_ptr<internal::HttpExchange>& exchange,
                  engine::LlmEngine* engine);
  // The tool-call syntax of `engine`'s model (--tool_call_parser, or auto).
  grammar::ToolCallFormat ToolFormat(engine::LlmEngine* engine) const;
  // CORS: the headers for the request's origin (none when it is not
  // allowed); true when the request was a preflight and has been answered.
  bool ApplyCors(internal::HttpExchange& exchange) const;

  ServingState* const state_;
  const int64_t created_;  // the models' "created"
  const std::function<std::string()> metrics_text_;
  std::string tool_call_parser_ = "auto";
  CorsOptions cors_;
  std::unique_ptr<internal::HttpServer> http_;
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_OPENAI_HTTP_H_
