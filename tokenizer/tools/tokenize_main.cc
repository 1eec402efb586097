// accel-tokenize: what the model will read. Prints a text's token ids, or a
// conversation rendered by the model's chat template (as transformers'
// apply_chat_template(tokenize=False) shows it) and its token ids.
//
//   accel-tokenize --model DIR --text "Hello"
//   accel-tokenize --model DIR --chat messages.json --add_generation_prompt [--tools tools.json]
//   ... --json   -> {"text": ..., "ids": [...]}
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/status.h"
#include "core/tool_main.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/internal/read_file.h"
#include "tokenizer/tokenizer.h"

ABSL_FLAG(std::string, model, "",
          "Model or tokenizer folder (tokenizer.json, tokenizer_config.json).");
ABSL_FLAG(std::string, text, "", "Text to tokenize, with the tokenizer's special tokens (BOS...).");
ABSL_FLAG(std::string, chat, "",
          "A JSON file of messages ([{\"role\": ..., \"content\": ...}, ...]) to render with the "
          "model's chat template.");
ABSL_FLAG(bool, add_generation_prompt, false,
          "With --chat: end with the template's prompt for the assistant's turn.");
ABSL_FLAG(std::string, tools, "", "With --chat: a JSON file of tool definitions for the template.");
ABSL_FLAG(bool, json, false, "Print {\"text\": ..., \"ids\": [...]} instead of plain text.");

namespace accel::tokenizer {
namespace {

constexpr uint64_t kMaxInputBytes = uint64_t{64} << 20;

struct Tokenized {
  std::string text;
  std::vector<int64_t> ids;
};

absl::StatusOr<Tokenized> Tokenize() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  const std::string text = absl::GetFlag(FLAGS_text);
  const std::string chat_file = absl::GetFlag(FLAGS_chat);
  if (dir.empty()) return absl::InvalidArgumentError("--model is required");
  if (text.empty() == chat_file.empty()) {
    return absl::InvalidArgumentError("give one of --text and --chat");
  }
  if (chat_file.empty() && !absl::GetFlag(FLAGS_tools).empty()) {
    return absl::InvalidArgumentError("--tools needs --chat");
  }
  ACCEL_ASSIGN_OR_RETURN(Tokenizer tokenizer, Tokenizer::FromFile(dir + "/tokenizer.json"));
  Tokenized out;
  if (!text.empty()) {
    out.text = text;
    ACCEL_ASSIGN_OR_RETURN(out.ids, tokenizer.Encode(text, /*add_special_tokens=*/true));
    return out;
  }
  ACCEL_ASSIGN_OR_RETURN(ChatTemplate chat, ChatTemplate::FromModelDir(dir));
  ACCEL_ASSIGN_OR_RETURN(std::string messages,
                         internal::ReadWholeFile(chat_file, kMaxInputBytes, "--chat file"));
  std::string tools;
  if (const std::string tools_file = absl::GetFlag(FLAGS_tools); !tools_file.empty()) {
    ACCEL_ASSIGN_OR_RETURN(tools,
                           internal::ReadWholeFile(tools_file, kMaxInputBytes, "--tools file"));
  }
  absl::StatusOr<std::string> rendered =
      chat.Render(messages, tools, absl::GetFlag(FLAGS_add_generation_prompt));
  if (!rendered.ok()) {
    return absl::Status(rendered.status().code(),
                        absl::StrCat("--chat ", chat_file, ": ", rendered.status().message()));
  }
  out.text = *std::move(rendered);
  // The template wrote the special tokens itself.
  ACCEL_ASSIGN_OR_RETURN(out.ids, tokenizer.Encode(out.text, /*add_special_tokens=*/false));
  return out;
}

int Run(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "accel-tokenize --model DIR (--text T | --chat MESSAGES.json [--add_generation_prompt] "
      "[--tools TOOLS.json]) [--json]\nPrints the text the model reads and its token ids.");
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() > 1) {
    std::fprintf(stderr, "accel-tokenize: unexpected argument '%s'\n", args[1]);
    return 2;
  }
  absl::StatusOr<Tokenized> result = Tokenize();
  if (!result.ok()) {
    std::fprintf(stderr, "accel-tokenize: %s\n", std::string(result.status().message()).c_str());
    return absl::IsInvalidArgument(result.status()) ? 2 : 1;
  }
  if (absl::GetFlag(FLAGS_json)) {
    const nlohmann::json out = {{"text", result->text}, {"ids", result->ids}};
    std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("%s\n", result->text.c_str());
    std::printf("ids (%zu): [%s]\n", result->ids.size(), absl::StrJoin(result->ids, ", ").c_str());
  }
  return 0;
}

}  // namespace
}  // namespace accel::tokenizer

int main(int argc, char** argv) {
  return accel::ToolMain("accel-tokenize", argc, argv, accel::tokenizer::Run);
}
