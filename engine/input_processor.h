// engine/input_processor.h: a request as a wire adapter or tool made it,
// made ready to run (vLLM v1's Processor): the prompt text tokenized, a
// conversation rendered by the model's chat template and tokenized, the
// defaults applied, the model's stop tokens added, the deadline set, and
// every field checked once (ValidateGenerationRequest) against the served
// model's limits. Nothing after it checks a request again.
//
//   ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<InputProcessor> inputs,
//                          InputProcessor::Load(model_dir));   // tokenizer, chat template
//   inputs->Configure(options);                                 // once the model is known
//   ACCEL_RETURN_IF_ERROR(inputs->Process(request));
//
// Torch-free. Thread-safe after Configure (Process is const).
#ifndef ACCEL_ENGINE_INPUT_PROCESSOR_H_
#define ACCEL_ENGINE_INPUT_PROCESSOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "engine/request.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace accel::engine {

struct InputProcessorOptions {
  std::string served_model_name;  // a request naming another model is NotFound
  RequestLimits limits;           // has_text_streams is set from the tokenizer
  int64_t default_max_new_tokens = kDefaultMaxNewTokens;  // at most what the limits leave
  std::vector<int64_t> eos_token_ids;  // added to each request's stops unless ignore_eos
  absl::Duration request_timeout = absl::ZeroDuration();  // zero: none
};

class InputProcessor {
 public:
  // The tokenizer (tokenizer.json, optional) and chat template (optional) of
  // a model folder, read and checked now, so a bad one fails before minutes
  // of loading weights.
  static absl::StatusOr<std::unique_ptr<InputProcessor>> Load(const std::string& model_dir);

  void Configure(InputProcessorOptions options);

  // Completes and checks `request` in place. Errors name the field:
  // NotFound for another model name; InvalidArgument for a request without
  // a prompt, a conversation on a model without a chat template, a prompt
  // on a model without a tokenizer, and everything ValidateGenerationRequest
  // refuses.
  absl::Status Process(GenerationRequest& request) const;

  // POST /tokenize: the ids of `request`'s prompt, or of its conversation
  // rendered by the chat template, as Process would make them, but with the
  // caller's `add_special_tokens` and none of the generation checks. Errors
  // as Process's (NotFound for another model; InvalidArgument naming
  // messages / prompt).
  absl::StatusOr<std::vector<int64_t>> Tokenize(const GenerationRequest& request,
                                                bool add_special_tokens) const;

  // The tokenizer, if the model has one.
  const tokenizer::Tokenizer* tokenizer() const { return tokenizer_ ? &*tokenizer_ : nullptr; }
  bool has_chat_template() const { return chat_template_.has_value(); }
  // One token's text, as the OpenAI API's logprobs show it: the token
  // decoded alone (special tokens included; a piece of a UTF-8 character
  // decodes to U+FFFD). Empty without a tokenizer or for an unknown id.
  std::string TokenText(int64_t token_id) const;
  const InputProcessorOptions& options() const { return options_; }

 private:
  InputProcessor() = default;
  // The conversation as the chat template renders it (a clear error where
  // the model has no template).
  absl::StatusOr<std::string> RenderChat(const ChatInput& chat) const;
  std::optional<tokenizer::Tokenizer> tokenizer_;
  std::optional<tokenizer::ChatTemplate> chat_template_;
  std::vector<int64_t> end_of_turn_ids_;  // the template's turn ends, in the vocabulary
  InputProcessorOptions options_;
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_INPUT_PROCESSOR_H_
