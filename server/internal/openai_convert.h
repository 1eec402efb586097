// server/internal/openai_convert.h: OpenAI's HTTP API (chat completions,
// completions, models) <-> the engine's terms, with no server attached, so
// every wire rule is unit-tested (tests/server/openai_convert_test.cc) and
// fuzzed (tests/fuzz/openai_request_fuzz.cc) on its own. Torch-free.
//
//   absl::StatusOr<OpenAiRequest> parsed = ParseOpenAiRequest(OpenAiEndpoint::kChat, body);
//   if (!parsed.ok()) return ErrorBody(ErrorForStatus(parsed.status()));
//   ... engine->Submit(parsed->generation, sink) ...
//   OpenAiResponseWriter writer(*parsed, info.name, token_text);
//   writer.Add(chunk); ...; std::string body = writer.Final(completion);   // unary
//   writer.StreamStart(); writer.StreamChunk(chunk); writer.StreamEnd(c);  // SSE events
//
// What OpenAI's fields mean here is in docs/API.md ("OpenAI-compatible HTTP
// API"). Errors are InvalidArgument whose message begins with the field
// ("max_tokens: ..."); ErrorForStatus turns any Status into OpenAI's error
// object and its HTTP status.
#ifndef ACCEL_SERVER_INTERNAL_OPENAI_CONVERT_H_
#define ACCEL_SERVER_INTERNAL_OPENAI_CONVERT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "engine/engine_loop.h"
#include "engine/request.h"
#include "grammar/tool_calls.h"

namespace accel::server::internal {

enum class OpenAiEndpoint { kChat, kCompletions };

// The most nesting a request body may have (messages with content parts and
// tool schemas need a few levels; the chat template recurses once per level).
inline constexpr int kMaxOpenAiJsonDepth = 64;
// The most object keys a request body may hold, all objects together (a
// hundred tools of fifty schema keys each is 5,000). Chat templates look
// keys up linearly, so this also bounds what rendering can cost.
inline constexpr int64_t kMaxOpenAiJsonKeys = 16384;

struct OpenAiRequest {
  OpenAiEndpoint endpoint = OpenAiEndpoint::kChat;
  engine::GenerationRequest generation;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Completions' echo: the prompt's text (and with logprobs its tokens'
  // logprobs, the first null) before the completion's; with max_tokens 0
  // (echo_only) the answer is the prompt alone, as lm-eval-harness's
  // loglikelihood asks (one token is generated and dropped).
  bool echo = false;
  bool echo_only = false;
  // Completions with a list of prompts (strings or token-id lists): one
  // request each (generation with that prompt), for LlmEngine::SubmitBatch;
  // empty for one prompt. Choice p * n + j is prompt p's choice j.
  std::vector<engine::GenerationRequest> prompts;
  // Chat: logprobs true; completions: logprobs is a number (the top count).
  bool logprobs = false;
  int64_t top_logprobs = 0;
  // Chat: tool_choice "auto" (the default), "none", "required", or
  // "function" (then tool_choice_function names it); the request's tools.
  std::string tool_choice = "auto";
  std::string tool_choice_function;
  std::string tools_json;
  // The syntax tool calls are parsed from (ApplyToolChoice sets it: none
  // without tools, for tool_choice "none" and for completions).
  grammar::ToolCallFormat tool_call_format = grammar::ToolCallFormat::kNone;
};

// Brings the server's tool-call parser (`format`: --tool_call_parser) to a
// chat request with tools: "auto" parses the calls the model writes out of
// its text; "required" and a named function also constrain decoding to the
// family's call syntax with arguments matching the parameters schema.
// InvalidArgument naming tool_choice when a call must be forced but the
// server has no parser, or the tools do not compile.
absl::Status ApplyToolChoice(OpenAiRequest& request, grammar::ToolCallFormat format);

// Parses a request body for `endpoint`. InvalidArgument naming the field for
// malformed JSON, a wrong type, an out-of-range value, or a field this
// server refuses (n > 1, non-zero penalties, logit_bias, a tool_choice other
// than auto/none, ...); InvalidArgument past kMaxOpenAiJsonDepth or
// kMaxOpenAiJsonKeys. Unknown fields are ignored, as OpenAI does. `check`
// (optional) is asked every few thousand JSON tokens whether to go on (the
// client still there); its non-OK status ends the parse and is returned.
absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(
    OpenAiEndpoint endpoint, absl::string_view body,
    const std::function<absl::Status()>& check = nullptr);

// OpenAI's error object and the HTTP status it goes with.
struct OpenAiError {
  int http_status = 500;
  std::string type;  // invalid_request_error, authentication_error, ...
  std::string message;
  std::string param;  // empty: null
  std::string code;   // empty: null
};

// InvalidArgument -> 400 (param: the field the message begins with),
// NotFound -> 404 model_not_found, Unauthenticated -> 401,
// ResourceExhausted -> 429, Unavailable -> 503, DeadlineExceeded -> 504,
// Cancelled -> 499 (the client went away; nobody reads it), else 500.
OpenAiError ErrorForStatus(const absl::Status& status);
// {"error": {"message", "type", "param", "code"}}.
std::string ErrorBody(const OpenAiError& error);

// "stop" (eos or a stop string), "length" (max_tokens, the context, or a
// server-side end such as a drain past its grace period).
const char* OpenAiFinishReason(engine::Finish finish);

// GET /v1/models: {"object": "list", "data": [{"id", "object": "model",
// "created", "owned_by": "accel"}]}; GET /v1/models/{id} is the one entry.
std::string ModelObject(const std::string& model, int64_t created);
std::string ModelList(const std::string& model, int64_t created);

// A token's text, for logprobs (its decoded bytes; a token that is part of a
// UTF-8 character decodes to U+FFFD, as HF's decode does).
using TokenTextFn = std::function<std::string(int64_t token_id)>;

// Builds one request's answer: the unary body, or the SSE events of a stream
// ("data: {json}\n\n" ... "data: [DONE]\n\n"). Not thread-safe.
class OpenAiResponseWriter {
 public:
  // `id` empty: a fresh random one ("chatcmpl-..." / "cmpl-...").
  OpenAiResponseWriter(const OpenAiRequest& request, std::string model, TokenTextFn token_text,
                       int64_t created, std::string id = "");
  ~OpenAiResponseWriter();
  OpenAiResponseWriter(const OpenAiResponseWriter&) = delete;
  OpenAiResponseWriter& operator=(const OpenAiResponseWriter&) = delete;

  const std::string& id() const { return id_; }

  // Unary: collects a chunk; Final returns the whole body.
  void Add(const engine::TokenChunk& chunk);
  std::string Final(const engine::Completion& completion) const;

  // Streaming. Chat: the first event carries {role: assistant, content: ""}.
  std::string StreamStart() const;
  // One event with the chunk's text and logprobs ("" when it has neither),
  // for the chunk's choice (index); with n > 1, a chunk that ends its
  // choice adds that choice's finish event.
  std::string StreamChunk(const engine::TokenChunk& chunk);
  // The event with finish_reason, the usage event when include_usage, and
  // "data: [DONE]".
  std::string StreamEnd(const engine::Completion& completion) const;
  // An error in the middle of a stream: an event {"error": {...}}, then
  // "data: [DONE]" (the openai clients raise the error).
  static std::string StreamError(const OpenAiError& error);

 private:
  struct State;  // the collected answer (nlohmann JSON, kept out of this header)
  State& Choice(int64_t index) const;
  // The prompt choice `index` answers (a list of prompts: choice p * n + j
  // is prompt p's).
  const engine::GenerationRequest& PromptOf(int64_t index) const;
  // A choice's last event, with its finish_reason.
  std::string FinishEvent(int64_t index, engine::Finish ended) const;

  const OpenAiRequest& request_;
  const std::string model_;
  const TokenTextFn token_text_;
  const int64_t created_;
  std::string id_;
  std::vector<std::unique_ptr<State>> states_;  // one per choice (n)
};

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_OPENAI_CONVERT_H_
