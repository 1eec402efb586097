#include "engine/input_processor.h"

#include <algorithm>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "core/quote.h"
#include "core/status.h"

namespace accel::engine {
absl::StatusOr<std::unique_ptr<InputProcessor>> InputProcessor::Load(const std::string& model_dir) {
  std::unique_ptr<InputProcessor> inputs(new InputProcessor());
  const std::string tokenizer_path = model_dir + "/tokenizer.json";
  if (!std::filesystem::exists(tokenizer_path)) return inputs;
  ACCEL_ASSIGN_OR_RETURN(tokenizer::Tokenizer tokenizer,
                         tokenizer::Tokenizer::FromFile(tokenizer_path));
  inputs->tokenizer_.emplace(std::move(tokenizer));
  // The chat template too: a broken one is named now, not at the first chat.
  absl::StatusOr<tokenizer::ChatTemplate> chat = tokenizer::ChatTemplate::FromModelDir(model_dir);
  if (chat.ok()) {
    inputs->end_of_turn_ids_ = chat->EndOfTurnIds(*inputs->tokenizer_);
    inputs->chat_template_.emplace(*std::move(chat));
  } else if (!absl::IsNotFound(chat.status())) {
    return chat.status();
  }
  return inputs;
}

void InputProcessor::Configure(InputProcessorOptions options) {
  options_ = std::move(options);
  options_.limits.has_text_streams = tokenizer_.has_value();
}

std::string InputProcessor::TokenText(int64_t token_id) const {
  if (!tokenizer_) return "";
  const int64_t ids[] = {token_id};
  absl::StatusOr<std::string> text = tokenizer_->Decode(ids, /*skip_special_tokens=*/false);
  return text.ok() ? *std::move(text) : std::string();
}

absl::StatusOr<std::vector<int64_t>> InputProcessor::Tokenize(const GenerationRequest& request,
                                                              bool add_special_tokens) const {
  if (!request.model.empty() && request.model != options_.served_model_name) {
    return absl::NotFoundError(absl::StrCat("model ", Quote(request.model),
                                            " is not served here; this server serves \"",
                                            options_.served_model_name, "\""));
  }
  if (!tokenizer_) {
    return absl::InvalidArgumentError(request.chat.has_value()
                                          ? "messages: this model has no tokenizer.json"
                                          : "prompt: this model has no tokenizer.json");
  }
  if (request.chat.has_value()) {
    ACCEL_ASSIGN_OR_RETURN(const std::string text, RenderChat(*request.chat));
    return tokenizer_->Encode(text, add_special_tokens);
  }
  if (!request.prompt.has_value()) return absl::InvalidArgumentError("prompt: required");
  return tokenizer_->Encode(*request.prompt, add_special_tokens);
}

absl::StatusOr<std::string> InputProcessor::RenderChat(const ChatInput& chat) const {
  if (!chat_template_) {
    // Not the folder's path: errors reach clients (no server paths in them).
    return absl::InvalidArgumentError(
        "messages: this model has no chat template (its folder has no chat_template.jinja "
        "and no chat_template in tokenizer_config.json); send a prompt instead");
  }
  return chat_template_->Render(chat.messages_json, chat.tools_json, chat.add_generation_prompt);
}

absl::Status InputProcessor::Process(GenerationRequest& request) const {
  if (!request.model.empty() && request.model != options_.served_model_name) {
    return absl::NotFoundError(absl::StrCat("model ", Quote(request.model),
                                            " is not served here; this server serves \"",
                                            options_.served_model_name, "\""));
  }
  if (request.chat.has_value()) {
    ACCEL_ASSIGN_OR_RETURN(const std::string text, RenderChat(*request.chat));
    if (text.empty())
      return absl::InvalidArgumentError("messages: the chat template rendered nothing");
    // The template wrote the special tokens itself (transformers encodes
    // apply_chat_template's text without them too).
    ACCEL_ASSIGN_OR_RETURN(request.prompt_ids,
                           tokenizer_->Encode(text, /*add_special_tokens=*/false));
    if (!request.ignore_eos) {
      request.stop_token_ids.insert(request.stop_token_ids.end(), end_of_turn_ids_.begin(),
                                    end_of_turn_ids_.end());
    }
  } else if (request.prompt.has_value()) {
    if (request.prompt->empty()) return absl::InvalidArgumentError("prompt is empty");
    if (!tokenizer_) {
      return absl::InvalidArgumentError(
          "prompt: this model has no tokenizer.json; send input_ids instead");
    }
    ACCEL_ASSIGN_OR_RETURN(request.prompt_ids,
                           tokenizer_->Encode(*request.prompt, /*add_special_tokens=*/true));
  } else if (request.prompt_ids.empty()) {
    return absl::InvalidArgumentError("the request has neither a prompt nor input_ids");
  }
  const RequestLimits& limits = options_.limits;
  ACCEL_RETURN_IF_ERROR(ValidateGenerationRequest(request, limits));
  if (request.max_new_tokens == 0 && request.max_new_tokens_to_context &&
      limits.max_total_tokens > 0) {
    request.max_new_tokens = std::max<int64_t>(
        1, limits.max_total_tokens - static_cast<int64_t>(request.prompt_ids.size()));
  }
  if (request.max_new_tokens == 0) {
    request.max_new_tokens = options_.default_max_new_tokens;
    if (limits.max_total_tokens > 0) {
      const int64_t room =
          limits.max_total_tokens - static_cast<int64_t>(request.prompt_ids.size());
      request.max_new_tokens = std::min(request.max_new_tokens, room);
    }
  }
  // A min_tokens beyond a defaulted max_new_tokens (the client set none)
  // means "as many as allowed".
  request.min_tokens = std::min(request.min_tokens, request.max_new_tokens);
  if (!request.ignore_eos) {
    request.stop_token_ids.insert(request.stop_token_ids.end(), options_.eos_token_ids.begin(),
                                  options_.eos_token_ids.end());
  }
  if (request.deadline != absl::InfiniteFuture() && request.deadline_reason.empty()) {
    request.deadline_reason = "the client's deadline";
  }
  if (options_.request_timeout > absl::ZeroDuration()) {
    const absl::Time limit = absl::Now() + options_.request_timeout;
    if (limit < request.deadline) {
      request.deadline = limit;
      request.deadline_reason =
          absl::StrCat("--request_timeout=", absl::FormatDuration(options_.request_timeout));
    }
  }
  return absl::OkStatus();
}

}  // namespace accel::engine
