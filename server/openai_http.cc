#include "server/openai_http.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

#include "engine/llm_engine.h"
#include "grammar/tool_calls.h"
#include "server/internal/http_transport.h"
#include "server/internal/openai_convert.h"
#include "server/internal/openai_responses.h"
#include "server/internal/openai_tokenize.h"
#include "server/internal/quote.h"
#include "server/server_metrics.h"
#include "server/serving.h"
#include "tokenizer/tokenizer.h"

namespace accel::server {
namespace {

using internal::HttpExchange;
using internal::OpenAiEndpoint;
using internal::OpenAiError;

constexpr char kJson[] = "application/json";
constexpr char kMetricsContentType[] = "text/plain; version=0.0.4; charset=utf-8";

bool SendError(HttpExchange& exchange, const OpenAiError& error) {
  std::vector<std::string> headers;
  if (error.http_status == 429 || error.http_status == 503) headers.emplace_back("Retry-After: 1");
  if (error.http_status == 401) headers.emplace_back("WWW-Authenticate: Bearer");
  return exchange.Respond(error.http_status, kJson, internal::ErrorBody(error), headers);
}

bool SendStatus(HttpExchange& exchange, const absl::Status& status) {
  return SendError(exchange, internal::ErrorForStatus(ForClient(status)));
}

// One generation's answer: the request, its writer, and the exchange. Its
// methods run on the connection's own sequence (HttpExchange::Post), one at
// a time, so the writer needs no lock; the engine's sink only posts to it.
class Answer {
 public:
  Answer(std::shared_ptr<HttpExchange> exchange, internal::OpenAiRequest request, std::string model,
         internal::TokenTextFn token_text)
      : exchange_(std::move(exchange)),
        request_(std::move(request)),
        writer_(request_, std::move(model), std::move(token_text),
                absl::ToUnixSeconds(absl::Now())) {}

  // The stream's head and first event (on the handler's turn, so before any
  // chunk the sink posts).
  void Start() {
    if (!request_.stream) return;
    exchange_->StartStream(200, "text/event-stream",
                           {"Cache-Control: no-cache", "X-Accel-Buffering: no"});
    exchange_->WriteChunk(writer_.StreamStart());
  }

  void Tokens(const engine::TokenChunk& chunk) {
    if (!request_.stream) {
      writer_.Add(chunk);
      return;
    }
    exchange_->WriteChunk(writer_.StreamChunk(chunk));
  }

  void Done(const absl::Status& status, const engine::Completion& completion) {
    if (!request_.stream) {
      if (status.ok()) {
        exchange_->Respond(200, kJson, writer_.Final(completion));
      } else {
        SendStatus(*exchange_, status);
      }
      return;
    }
    exchange_->WriteChunk(status.ok() ? writer_.StreamEnd(completion)
                                      : internal::OpenAiResponseWriter::StreamError(
                                            internal::ErrorForStatus(ForClient(status))));
    exchange_->EndStream();
  }

  HttpExchange& exchange() { return *exchange_; }

 private:
  const std::shared_ptr<HttpExchange> exchange_;
  const internal::OpenAiRequest request_;
  internal::OpenAiResponseWriter writer_;
};

// A /v1/responses answer: as Answer, with the Responses API's writer.
class ResponsesAnswer {
 public:
  ResponsesAnswer(std::shared_ptr<HttpExchange> exchange, internal::ResponsesRequest request,
                  std::string model)
      : exchange_(std::move(exchange)),
        request_(std::move(request)),
        writer_(request_, std::move(model), absl::ToUnixSeconds(absl::Now())) {}

  void Start() {
    if (!request_.chat.stream) return;
    exchange_->StartStream(200, "text/event-stream",
                           {"Cache-Control: no-cache", "X-Accel-Buffering: no"});
    exchange_->WriteChunk(writer_.StreamStart());
  }

  void Tokens(const engine::TokenChunk& chunk) {
    if (!request_.chat.stream) {
      writer_.Add(chunk);
      return;
    }
    exchange_->WriteChunk(writer_.StreamChunk(chunk));
  }

  void Done(const absl::Status& status, const engine::Completion& completion) {
    if (!request_.chat.stream) {
      if (status.ok()) {
        exchange_->Respond(200, kJson, writer_.Final(completion));
      } else {
        SendStatus(*exchange_, status);
      }
      return;
    }
    exchange_->WriteChunk(status.ok()
                              ? writer_.StreamEnd(completion)
                              : writer_.StreamError(internal::ErrorForStatus(ForClient(status))));
    exchange_->EndStream();
  }

  HttpExchange& exchange() { return *exchange_; }

 private:
  const std::shared_ptr<HttpExchange> exchange_;
  const internal::ResponsesRequest request_;
  internal::ResponsesWriter writer_;
};

// Called on the engine loop's thread, which must not block: each event goes
// to the connection's sequence, where the answer is framed and written.
template <typename Answer>
class HttpSink : public engine::RequestSink {
 public:
  explicit HttpSink(std::shared_ptr<Answer> answer) : answer_(std::move(answer)) {}
  void OnTokens(engine::TokenChunk chunk) override {
    std::shared_ptr<Answer> answer = answer_;
    answer->exchange().Post([answer, chunk = std::move(chunk)] { answer->Tokens(chunk); });
  }
  void OnDone(const absl::Status& status, const engine::Completion& completion) override {
    std::shared_ptr<Answer> answer = answer_;
    answer->exchange().Post([answer, status, completion] { answer->Done(status, completion); });
  }

 private:
  const std::shared_ptr<Answer> answer_;
};

OpenAiError RouteError(int status, const char* code, std::string message) {
  OpenAiError error;
  error.http_status = status;
  error.type = "invalid_request_error";
  error.code = code;
  error.message = std::move(message);
  return error;
}

// Whether the client is still connected: a client that leaves while its
// (large) body is read stops the parse.
std::function<absl::Status()> StillThere(HttpExchange& exchange) {
  return [&exchange] {
    return exchange.PeerClosed() ? absl::CancelledError("the client closed its connection")
                                 : absl::OkStatus();
  };
}

// After Submit: the refusal answered, or the answer started (the sink's first
// events wait for this turn of the connection to end, so the stream's head
// goes first) and the request cancelled when the client goes (the sink still
// hears OnDone (Cancelled); nobody reads its answer).
template <typename AnswerT>
void Started(HttpExchange& exchange, engine::LlmEngine* engine, const absl::StatusOr<uint64_t>& id,
             AnswerT& answer) {
  if (!id.ok()) {
    SendStatus(exchange, id.status());
    return;
  }
  answer.Start();
  const uint64_t request_id = *id;
  exchange.OnClientGone([engine, request_id] { engine->Cancel(request_id); });
}

}  // namespace

absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> OpenAiHttpServer::Start(
    const OpenAiHttpOptions& options, ServingState* state) {
  std::unique_ptr<OpenAiHttpServer> server(
      new OpenAiHttpServer(state, absl::ToUnixSeconds(absl::Now()), options.metrics_text));
  internal::HttpServerOptions http;
  http.host = options.host;
  http.port = options.port;
  http.request_timeout = options.request_timeout;
  http.max_body_bytes = options.max_body_bytes;
  http.max_connections = options.max_connections;
  http.tls_cert_pem = options.tls_cert_pem;
  http.tls_key_pem = options.tls_key_pem;
  if (options.tool_call_parser != "auto") {
    absl::StatusOr<grammar::ToolCallFormat> format =
        grammar::ToolCallFormatFromName(options.tool_call_parser);
    if (!format.ok()) return format.status();
  }
  server->tool_call_parser_ = options.tool_call_parser;
  server->cors_ = options.cors;
  OpenAiHttpServer* self = server.get();
  absl::StatusOr<std::unique_ptr<internal::HttpServer>> started = internal::HttpServer::Start(
      http, [self](std::shared_ptr<HttpExchange> exchange) { self->Handle(exchange); },
      [](int status, absl::string_view message) {
        OpenAiError error;
        error.http_status = status;
        error.type = status >= 500 ? "server_error" : "invalid_request_error";
        error.message = std::string(message);
        if (status == 413) error.code = "request_too_large";
        if (status == 408) error.code = "request_timeout";
        if (status == 503) error.code = "service_unavailable";
        return internal::ErrorBody(error);
      });
  if (!started.ok()) return started.status();
  server->http_ = *std::move(started);
  return server;
}

OpenAiHttpServer::OpenAiHttpServer(ServingState* state, int64_t created,
                                   std::function<std::string()> metrics)
    : state_(state), created_(created), metrics_text_(std::move(metrics)) {}

OpenAiHttpServer::~OpenAiHttpServer() { http_.reset(); }

int OpenAiHttpServer::port() const { return http_->port(); }

void OpenAiHttpServer::Stop(absl::Duration timeout) {
  http_->Stop();
  http_->WaitConnections(timeout);
}

bool OpenAiHttpServer::ApplyCors(HttpExchange& exchange) const {
  const internal::HttpRequest& request = exchange.request();
  const std::string* origin = request.Header("origin");
  if (cors_.allowed_origins.empty() || origin == nullptr) return false;
  const bool any = absl::c_linear_search(cors_.allowed_origins, "*");
  const bool allowed = any || absl::c_linear_search(cors_.allowed_origins, *origin);
  const std::string* preflight_method = request.Header("access-control-request-method");
  const bool preflight = request.method == "OPTIONS" && preflight_method != nullptr;
  if (!allowed) {
    // No CORS headers: the browser keeps the answer from the page.
    if (preflight) {
      exchange.Respond(400, "text/plain; charset=utf-8", "Disallowed CORS origin");
      return true;
    }
    return false;
  }
  std::vector<std::string> headers = {absl::StrCat("Access-Control-Allow-Origin: ", *origin),
                                      "Access-Control-Allow-Credentials: true", "Vary: Origin"};
  if (!preflight) {
    exchange.AddResponseHeaders(std::move(headers));
    return false;
  }
  // A preflight: the methods and headers allowed ("*" echoes what the
  // browser asks for: a wildcard does not count with credentials).
  const bool any_method = absl::c_linear_search(cors_.allowed_methods, "*");
  const std::string methods = any_method ? "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
                                         : absl::StrJoin(cors_.allowed_methods, ", ");
  if (!any_method && !absl::c_linear_search(cors_.allowed_methods, *preflight_method)) {
    exchange.Respond(400, "text/plain; charset=utf-8", "Disallowed CORS method");
    return true;
  }
  headers.push_back(absl::StrCat("Access-Control-Allow-Methods: ", methods));
  const std::string* asked_headers = request.Header("access-control-request-headers");
  if (absl::c_linear_search(cors_.allowed_headers, "*")) {
    if (asked_headers != nullptr) {
      headers.push_back(absl::StrCat("Access-Control-Allow-Headers: ", *asked_headers));
    }
  } else {
    headers.push_back(
        absl::StrCat("Access-Control-Allow-Headers: ", absl::StrJoin(cors_.allowed_headers, ", ")));
  }
  headers.push_back("Access-Control-Max-Age: 600");
  exchange.Respond(204, "text/plain; charset=utf-8", "", headers);
  return true;
}

void OpenAiHttpServer::Handle(const std::shared_ptr<HttpExchange>& exchange) {
  if (ApplyCors(*exchange)) return;
  const internal::HttpRequest& request = exchange->request();
  const std::string& path = request.path;
  const bool chat = path == "/v1/chat/completions";
  const bool completions = path == "/v1/completions";
  const bool responses = path == "/v1/responses";
  const bool tokenize = path == "/tokenize";
  const bool detokenize = path == "/detokenize";
  const bool models = path == "/v1/models" || absl::StartsWith(path, "/v1/models/");
  const bool metrics = path == "/metrics" && metrics_text_ != nullptr;
  const bool health = path == "/health";
  if (!chat && !completions && !responses && !tokenize && !detokenize && !models && !metrics &&
      !health) {
    // The path and method are quoted (cut, escaped): a 60 KB path is not
    // sent back whole.
    SendError(*exchange,
              RouteError(404, "unknown_url",
                         absl::StrCat("Invalid URL (", internal::Quote(request.method), " ",
                                      internal::Quote(path),
                                      "): this server serves /v1/chat/completions, "
                                      "/v1/completions, /v1/responses, /v1/models, /tokenize, "
                                      "/detokenize, /metrics and /health")));
    return;
  }
  const char* allowed = (models || metrics || health) ? "GET" : "POST";
  if (request.method != allowed) {
    exchange->Respond(405, kJson,
                      internal::ErrorBody(RouteError(
                          405, "method_not_allowed",
                          absl::StrCat(internal::Quote(request.method), " is not allowed on ",
                                       internal::Quote(path), "; use ", allowed))),
                      {absl::StrCat("Allow: ", allowed)});
    return;
  }
  if (metrics) {
    exchange->Respond(200, kMetricsContentType, metrics_text_());
    return;
  }
  if (health) {
    exchange->Respond(200, kJson, "{}");
    return;
  }
  const absl::Status auth = state_->AuthorizeBearer(request.Header("authorization"));
  if (!auth.ok()) {
    SendStatus(*exchange, auth);
    return;
  }
  if (models || tokenize || detokenize) {
    engine::LlmEngine* engine = state_->engine();
    if (engine == nullptr) {
      SendStatus(*exchange, absl::UnavailableError("the model is still loading"));
      return;
    }
    if (tokenize) {
      Tokenize(exchange, engine);
      return;
    }
    if (detokenize) {
      Detokenize(exchange, engine);
      return;
    }
    const std::string& name = engine->info().name;
    if (path == "/v1/models") {
      exchange->Respond(200, kJson, internal::ModelList(name, created_));
      return;
    }
    const std::string id = path.substr(std::string("/v1/models/").size());
    if (id != name) {
      SendStatus(*exchange, absl::NotFoundError(absl::StrCat("model ", internal::Quote(id),
                                                             " is not served here; this server "
                                                             "serves \"",
                                                             name, "\"")));
      return;
    }
    exchange->Respond(200, kJson, internal::ModelObject(name, created_));
    return;
  }
  if (responses) {
    Responses(exchange);
    return;
  }
  Generate(exchange, chat);
}

void OpenAiHttpServer::Tokenize(const std::shared_ptr<HttpExchange>& exchange,
                                engine::LlmEngine* engine) {
  absl::StatusOr<internal::TokenizeRequest> parsed =
      internal::ParseTokenizeRequest(exchange->request().body);
  if (!parsed.ok()) {
    SendStatus(*exchange, parsed.status());
    return;
  }
  absl::StatusOr<std::vector<int64_t>> tokens =
      engine->Tokenize(parsed->input, parsed->add_special_tokens);
  if (!tokens.ok()) {
    SendStatus(*exchange, tokens.status());
    return;
  }
  const engine::ModelInfo& info = engine->info();
  exchange->Respond(
      200, kJson,
      internal::TokenizeResponse(
          *tokens, info.max_total_tokens > 0 ? info.max_total_tokens : info.max_context));
}

void OpenAiHttpServer::Detokenize(const std::shared_ptr<HttpExchange>& exchange,
                                  engine::LlmEngine* engine) {
  const tokenizer::Tokenizer* tokenizer = engine->tokenizer();
  if (tokenizer == nullptr) {
    SendStatus(*exchange, absl::InvalidArgumentError("tokens: this model has no tokenizer.json"));
    return;
  }
  absl::StatusOr<internal::DetokenizeRequest> parsed =
      internal::ParseDetokenizeRequest(exchange->request().body, tokenizer->vocab_size());
  if (!parsed.ok()) {
    SendStatus(*exchange, parsed.status());
    return;
  }
  if (!parsed->model.empty() && parsed->model != engine->info().name) {
    SendStatus(*exchange,
               absl::NotFoundError(absl::StrCat("model ", internal::Quote(parsed->model),
                                                " is not served here; this server serves \"",
                                                engine->info().name, "\"")));
    return;
  }
  absl::StatusOr<std::string> text =
      tokenizer->Decode(parsed->tokens, /*skip_special_tokens=*/false);
  if (!text.ok()) {
    SendStatus(*exchange,
               absl::InvalidArgumentError(absl::StrCat("tokens: ", text.status().message())));
    return;
  }
  exchange->Respond(200, kJson, internal::DetokenizeResponse(*text));
}

grammar::ToolCallFormat OpenAiHttpServer::ToolFormat(engine::LlmEngine* engine) const {
  if (tool_call_parser_ != "auto") {
    return grammar::ToolCallFormatFromName(tool_call_parser_)
        .value_or(grammar::ToolCallFormat::kNone);
  }
  const tokenizer::Tokenizer* tok = engine->tokenizer();
  return grammar::ToolCallFormatFromVocabulary([tok](absl::string_view token) {
    return tok != nullptr && tok->TokenToId(token).has_value();
  });
}

void OpenAiHttpServer::Generate(const std::shared_ptr<HttpExchange>& exchange, bool chat) {
  // A client that leaves while its (large) body is read stops the parse.
  const std::function<absl::Status()> still_there = StillThere(*exchange);
  absl::StatusOr<internal::OpenAiRequest> parsed =
      internal::ParseOpenAiRequest(chat ? OpenAiEndpoint::kChat : OpenAiEndpoint::kCompletions,
                                   exchange->request().body, still_there);
  engine::LlmEngine* engine = EngineFor(*exchange, parsed.status(), still_there);
  if (engine == nullptr) return;
  // Tool calls: parsed out of the text, or forced by tool_choice.
  const grammar::ToolCallFormat tool_format = ToolFormat(engine);
  if (absl::Status applied = internal::ApplyToolChoice(*parsed, tool_format); !applied.ok()) {
    if (state_->metrics() != nullptr) state_->metrics()->RequestFailed("invalid");
    SendStatus(*exchange, applied);
    return;
  }
  const engine::GenerationRequest generation = parsed->generation;
  std::vector<engine::GenerationRequest> prompts = parsed->prompts;
  auto answer =
      std::make_shared<Answer>(exchange, *std::move(parsed), engine->info().name,
                               [engine](int64_t token) { return engine->TokenText(token); });
  // A list of prompts is one answer of prompts x n choices.
  absl::StatusOr<uint64_t> id =
      prompts.empty()
          ? engine->Submit(generation, std::make_shared<HttpSink<Answer>>(answer))
          : engine->SubmitBatch(std::move(prompts), std::make_shared<HttpSink<Answer>>(answer));
  Started(*exchange, engine, id, *answer);
}

engine::LlmEngine* OpenAiHttpServer::EngineFor(HttpExchange& exchange, const absl::Status& parsed,
                                               const std::function<absl::Status()>& still_there) {
  if (!parsed.ok()) {
    const bool gone = absl::IsCancelled(parsed);
    if (state_->metrics() != nullptr) {
      state_->metrics()->RequestFailed(gone ? "cancelled" : "invalid");
    }
    if (!gone) SendStatus(exchange, parsed);
    return nullptr;
  }
  absl::StatusOr<engine::LlmEngine*> ready = state_->ReadyEngine();
  if (!ready.ok()) {
    SendStatus(exchange, ready.status());
    return nullptr;
  }
  // Nobody to answer: nothing is queued.
  if (!still_there().ok()) {
    if (state_->metrics() != nullptr) state_->metrics()->RequestFailed("cancelled");
    return nullptr;
  }
  return *ready;
}

void OpenAiHttpServer::Responses(const std::shared_ptr<HttpExchange>& exchange) {
  const std::function<absl::Status()> still_there = StillThere(*exchange);
  absl::StatusOr<internal::ResponsesRequest> parsed =
      internal::ParseResponsesRequest(exchange->request().body, still_there);
  engine::LlmEngine* engine = EngineFor(*exchange, parsed.status(), still_there);
  if (engine == nullptr) return;
  if (absl::Status applied = internal::ApplyToolChoice(parsed->chat, ToolFormat(engine));
      !applied.ok()) {
    if (state_->metrics() != nullptr) state_->metrics()->RequestFailed("invalid");
    SendStatus(*exchange, applied);
    return;
  }
  const engine::GenerationRequest generation = parsed->chat.generation;
  auto answer =
      std::make_shared<ResponsesAnswer>(exchange, *std::move(parsed), engine->info().name);
  absl::StatusOr<uint64_t> id =
      engine->Submit(generation, std::make_shared<HttpSink<ResponsesAnswer>>(answer));
  Started(*exchange, engine, id, *answer);
}

}  // namespace accel::server
