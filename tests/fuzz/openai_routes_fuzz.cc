// libFuzzer target for the parsers of the OpenAI port's other routes
// (scripts/fuzz.sh runs it): the Responses API (server/internal/
// openai_responses.h) and vLLM's /tokenize and /detokenize (openai_tokenize.h).
// The first byte picks the route; the rest is the body. Any input must parse
// or give InvalidArgument (400), and a parsed Responses request must build
// every answer the server could send for it, streamed tool calls included.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "server/internal/openai_responses.h"
#include "server/internal/openai_tokenize.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void CheckRefusal(const absl::Status& status) {
  Check(status.code() == absl::StatusCode::kInvalidArgument);
  Check(accel::server::internal::ErrorForStatus(status).http_status == 400);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace internal = accel::server::internal;
  if (size == 0) return 0;
  const int route = data[0] % 3;
  absl::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (route == 1) {
    absl::StatusOr<internal::TokenizeRequest> parsed = internal::ParseTokenizeRequest(body);
    if (!parsed.ok()) {
      CheckRefusal(parsed.status());
      return 0;
    }
    Check(parsed->input.prompt.has_value() != parsed->input.chat.has_value());
    return 0;
  }
  if (route == 2) {
    absl::StatusOr<internal::DetokenizeRequest> parsed =
        internal::ParseDetokenizeRequest(body, 1000);
    if (!parsed.ok()) {
      CheckRefusal(parsed.status());
      return 0;
    }
    for (int64_t id : parsed->tokens) Check(id >= 0 && id < 1000);
    return 0;
  }
  absl::StatusOr<internal::ResponsesRequest> parsed = internal::ParseResponsesRequest(body);
  if (!parsed.ok()) {
    CheckRefusal(parsed.status());
    return 0;
  }
  Check(parsed->chat.generation.chat.has_value());
  const absl::Status tools =
      internal::ApplyToolChoice(parsed->chat, accel::grammar::ToolCallFormat::kHermes);
  if (!tools.ok()) CheckRefusal(tools);
  for (bool stream : {false, true}) {
    internal::ResponsesWriter writer(*parsed, "m", 0, "resp_1");
    accel::engine::TokenChunk chunk;
    chunk.token_ids = {1};
    accel::engine::Completion completion;
    std::string out = stream ? writer.StreamStart() : "";
    for (const char* text : {"Hi <tool_call>{\"name\": \"f\", \"argu", "ments\": {\"a\": [1, \"}",
                             "\"]}}</tool_call>\xc3"}) {
      chunk.text = text;
      if (stream) {
        out += writer.StreamChunk(chunk);
      } else {
        writer.Add(chunk);
      }
    }
    out += stream ? writer.StreamEnd(completion) : writer.Final(completion);
    Check(!out.empty());
  }
  return 0;
}
