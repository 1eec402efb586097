// server/internal/openai_responses.h: OpenAI's Responses API (POST
// /v1/responses), stateless, as wire rules with no server attached
// (tests/server/openai_responses_test.cc). Torch-free.
//
// A request is translated to the chat completion it means (input items ->
// messages, instructions -> a system message, text.format ->
// response_format, function tools -> chat tools) and parsed by
// openai_convert.h's rules, so every sampling and grammar field behaves as
// on /v1/chat/completions; errors name the Responses field
// ("max_output_tokens: ...", "input[2].content[0].type: ..."). The answer is
// a response object, or its stream of typed SSE events (response.created
// ... response.output_text.delta ... response.completed), each with its
// sequence_number.
//
//   ACCEL_ASSIGN_OR_RETURN(ResponsesRequest r, ParseResponsesRequest(body));
//   ApplyToolChoice(r.chat, format); ... engine->Submit(r.chat.generation, sink) ...
//   ResponsesWriter writer(r, model, created);
//   writer.Add(chunk); ... body = writer.Final(completion);                 // unary
//   writer.StreamStart(); writer.StreamChunk(chunk); writer.StreamEnd(c);  // SSE
#ifndef ACCEL_SERVER_INTERNAL_OPENAI_RESPONSES_H_
#define ACCEL_SERVER_INTERNAL_OPENAI_RESPONSES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "engine/engine_loop.h"
#include "server/internal/openai_convert.h"

namespace accel::server::internal {

struct ResponsesRequest {
  OpenAiRequest chat;  // the chat completion the request means
  // Echoed in the response object, as OpenAI does: the request's own JSON
  // text of these fields ("null" when absent).
  std::string instructions_json = "null";
  std::string max_output_tokens_json = "null";
  std::string text_json = "{\"format\":{\"type\":\"text\"}}";
  std::string tools_json = "[]";
  std::string tool_choice_json = "\"auto\"";
  std::string metadata_json = "{}";
  double temperature = 1.0;
  double top_p = 1.0;
};

// InvalidArgument naming the field: malformed JSON, wrong types, an input
// item of an unsupported type, a tool other than a function, and
// previous_response_id or store: true (this server keeps no responses).
absl::StatusOr<ResponsesRequest> ParseResponsesRequest(
    absl::string_view body, const std::function<absl::Status()>& check = nullptr);

// Builds one request's answer. Not thread-safe.
class ResponsesWriter {
 public:
  // `id` empty: a fresh random one ("resp_...").
  ResponsesWriter(const ResponsesRequest& request, std::string model, int64_t created_at,
                  std::string id = "");
  ~ResponsesWriter();
  ResponsesWriter(const ResponsesWriter&) = delete;
  ResponsesWriter& operator=(const ResponsesWriter&) = delete;

  const std::string& id() const { return id_; }

  // Unary: collects a chunk; Final returns the response object.
  void Add(const engine::TokenChunk& chunk);
  std::string Final(const engine::Completion& completion);

  // Streaming: response.created and response.in_progress; then the output
  // items' events as text comes; then the items' .done events and
  // response.completed (response.incomplete when max_output_tokens ended it).
  std::string StreamStart();
  std::string StreamChunk(const engine::TokenChunk& chunk);
  std::string StreamEnd(const engine::Completion& completion);
  // An error in the middle of a stream: an "error" event (the openai
  // clients raise it).
  std::string StreamError(const OpenAiError& error);

 private:
  struct State;  // nlohmann JSON, kept out of this header

  const ResponsesRequest& request_;
  const std::string model_;
  const int64_t created_at_;
  std::string id_;
  std::unique_ptr<State> state_;
};

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_OPENAI_RESPONSES_H_
