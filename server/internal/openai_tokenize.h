// server/internal/openai_tokenize.h: vLLM's POST /tokenize and
// POST /detokenize on the OpenAI HTTP port, as wire rules with no server
// attached (tests/server/openai_tokenize_test.cc). Torch-free.
//
//   /tokenize   {model, prompt | messages [, tools, add_generation_prompt],
//                add_special_tokens} -> {count, max_model_len, tokens, token_strs: null}
//   /detokenize {model, tokens} -> {prompt}
//
// Errors are InvalidArgument naming the field ("tokens[2]: ..."), as
// openai_convert.h's.
#ifndef ACCEL_SERVER_INTERNAL_OPENAI_TOKENIZE_H_
#define ACCEL_SERVER_INTERNAL_OPENAI_TOKENIZE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "engine/request.h"

namespace accel::server::internal {

struct TokenizeRequest {
  // model, and prompt or chat (messages rendered with the chat template).
  engine::GenerationRequest input;
  // vLLM's defaults: true for a prompt, false for messages (the template
  // writes the special tokens itself).
  bool add_special_tokens = true;
};

// InvalidArgument naming the field: neither or both of prompt and messages,
// a prompt that is not a string, a wrong type.
absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body);
std::string TokenizeResponse(const std::vector<int64_t>& tokens, int64_t max_model_len);

struct DetokenizeRequest {
  std::string model;
  std::vector<int64_t> tokens;
};

// InvalidArgument naming the field: tokens missing, not an array, an entry
// not an integer, or outside [0, vocab_size) ("tokens[3]: ...").
absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(absl::string_view body,
                                                         int64_t vocab_size);
std::string DetokenizeResponse(const std::string& prompt);

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_OPENAI_TOKENIZE_H_
