// tokenizer/chat_template.h: a model's chat template, rendered as
// transformers' apply_chat_template(tokenize=False) renders it.
//
//   ACCEL_ASSIGN_OR_RETURN(ChatTemplate chat, ChatTemplate::FromModelDir("/m"));
//   ACCEL_ASSIGN_OR_RETURN(std::string text,
//       chat.Render(R"([{"role": "user", "content": "Hi"}])", "", true));
//   ACCEL_ASSIGN_OR_RETURN(auto ids, tokenizer.Encode(text, /*add_special_tokens=*/false));
//
// The template writes the special tokens itself (bos_token and the like), so
// its text is encoded without the tokenizer's post-processor, as transformers
// does. Variables the template sees: messages, tools (none when there are
// none), documents (none), add_generation_prompt, and the special tokens of
// tokenizer_config.json (bos_token, eos_token, unk_token, pad_token, ...,
// additional_special_tokens); raise_exception, strftime_now and range are
// the interpreter's (jinja/jinja.h).
//
// Torch-free: target accel_tokenizer.
#ifndef ACCEL_TOKENIZER_CHAT_TEMPLATE_H_
#define ACCEL_TOKENIZER_CHAT_TEMPLATE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::tokenizer {

class Tokenizer;

class ChatTemplate {
 public:
  // The chat template of a model (or tokenizer) folder: chat_template.jinja
  // when present (it overrides tokenizer_config.json, as in transformers),
  // else tokenizer_config.json's "chat_template": a string, or a list of
  // {"name", "template"} of which "default" is used, or "tool_use" when the
  // request has tools and the list has it. Special tokens come from
  // tokenizer_config.json (a string, or an AddedToken object's "content").
  // NotFound naming the folder when it has no template; InvalidArgument
  // naming the file and field (or the template line) for a malformed one.
  static absl::StatusOr<ChatTemplate> FromModelDir(const std::string& dir);
  // One template from text with the given special tokens ("bos_token" ->
  // "<s>", ...); `source_name` stands for the file in messages.
  static absl::StatusOr<ChatTemplate> FromSource(absl::string_view source,
                                                 std::map<std::string, std::string> special_tokens,
                                                 absl::string_view source_name);

  // The text of a conversation: `messages_json` is a JSON array of message
  // objects ("role", "content", and whatever else the template reads, e.g.
  // "tool_calls"); `tools_json` a JSON array of tools, or empty for none.
  // InvalidArgument for malformed JSON (naming "messages" or "tools"), a
  // message without a string "role", or the template's own refusal
  // (raise_exception's message, e.g. roles that do not alternate).
  absl::StatusOr<std::string> Render(absl::string_view messages_json, absl::string_view tools_json,
                                     bool add_generation_prompt) const;

  // The tokens that end a turn in this template and so end generation:
  // eos_token, and the known end-of-turn tokens (<|eot_id|>, <|im_end|>,
  // <end_of_turn>, <|end|>, ...) that the template writes.
  const std::vector<std::string>& end_of_turn_tokens() const { return end_of_turn_; }
  // Those of them that `tokenizer` has, as ids: what a request adds to its stop ids.
  std::vector<int64_t> EndOfTurnIds(const Tokenizer& tokenizer) const;
  // Where the template came from, for messages ("DIR/chat_template.jinja").
  const std::string& source_name() const { return source_name_; }

  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ChatTemplate(const ChatTemplate&);
  ChatTemplate& operator=(const ChatTemplate&);
  ~ChatTemplate();

 private:
  struct Parsed;
  ChatTemplate() = default;
  std::string source_name_;
  // Named templates ("default" for a single one), parsed once.
  std::shared_ptr<const Parsed> parsed_;
  std::vector<std::string> end_of_turn_;
};

}  // namespace accel::tokenizer

#endif  // ACCEL_TOKENIZER_CHAT_TEMPLATE_H_
