// libFuzzer target for the OpenAI HTTP API's request parser
// (server/internal/openai_convert.h; scripts/fuzz.sh runs it). The first
// byte picks the endpoint; the rest is the body. Any input must parse or give
// InvalidArgument (400), and a parsed request must build every answer the
// server could send for it without failing.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "server/internal/openai_convert.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using accel::server::internal::OpenAiEndpoint;
  if (size == 0) return 0;
  const OpenAiEndpoint endpoint =
      (data[0] & 1) ? OpenAiEndpoint::kChat : OpenAiEndpoint::kCompletions;
  absl::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  absl::StatusOr<accel::server::internal::OpenAiRequest> parsed =
      accel::server::internal::ParseOpenAiRequest(endpoint, body);
  if (!parsed.ok()) {
    Check(parsed.status().code() == absl::StatusCode::kInvalidArgument);
    Check(accel::server::internal::ErrorForStatus(parsed.status()).http_status == 400);
    Check(!accel::server::internal::ErrorBody(
               accel::server::internal::ErrorForStatus(parsed.status()))
               .empty());
    return 0;
  }
  Check(parsed->generation.chat.has_value() == (endpoint == OpenAiEndpoint::kChat));
  Check(parsed->generation.top_logprobs >= 0 && parsed->generation.top_logprobs <= 20);
  accel::server::internal::OpenAiResponseWriter writer(
      *parsed, "m", [](int64_t id) { return std::string(1, static_cast<char>(id & 0xff)); }, 0,
      "id");
  accel::engine::TokenChunk chunk;
  chunk.token_ids = {1, 0xc3};
  chunk.logprobs = {-1.0f, -2.0f};
  chunk.top_logprobs = {{{1, -1.0f}}, {{0xc3, -2.0f}, {2, -3.0f}}};
  chunk.text = "a\xc3";
  writer.Add(chunk);
  accel::engine::Completion completion;
  Check(!writer.Final(completion).empty());
  Check(!writer.StreamStart().empty() || endpoint == OpenAiEndpoint::kCompletions);
  Check(!writer.StreamChunk(chunk).empty());
  Check(!writer.StreamEnd(completion).empty());
  return 0;
}
