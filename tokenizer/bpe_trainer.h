// Byte-level BPE (GPT-2's scheme): the byte <-> unicode alphabet, a small
// deterministic merge trainer, and tokenizer.json in HuggingFace's format.
#ifndef ACCEL_TOKENIZER_BPE_TRAINER_H_
#define ACCEL_TOKENIZER_BPE_TRAINER_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace accel::tokenizer {

// GPT-2's bytes_to_unicode(): the printable symbol (UTF-8) that stands for
// each byte value in a byte-level vocabulary.
const std::vector<std::string>& ByteToSymbol();

// The 256 byte symbols in GPT-2's id order (printable bytes first).
std::vector<std::string> ByteAlphabet();

// Learns up to `max_merges` merges from `text`: words are a run of letters
// or digits with the space before it, or a run of other characters; pairs
// are counted within words; the most frequent pair wins, ties broken by the
// pair's text, so the result is deterministic.
std::vector<std::pair<std::string, std::string>> TrainMerges(absl::string_view text,
                                                             int max_merges);

struct SpecialToken {
  std::string content;
  int64_t id;
};

// tokenizer.json for a byte-level BPE with the byte alphabet as ids
// 0..255, then one token per merge, plus the special tokens (in the
// vocabulary at their ids, and as special added tokens).
std::string ByteLevelTokenizerJson(const std::vector<std::pair<std::string, std::string>>& merges,
                                   const std::vector<SpecialToken>& specials);

// A chat template for models that were not tuned for chat (Zephyr's shape:
// "<|role|>\n" + content + eos per message, then "<|assistant|>\n" for the
// generation prompt), so every model accel-make-model writes can be served
// through Chat and /v1/chat/completions.
extern const char kPlainChatTemplate[];

// tokenizer_config.json for such a tokenizer: its bos and eos tokens and
// kPlainChatTemplate.
std::string TokenizerConfigJson(absl::string_view bos_token, absl::string_view eos_token);

// A few paragraphs of plain English to learn merges from.
absl::string_view SampleEnglishText();

}  // namespace accel::tokenizer

#endif  // ACCEL_TOKENIZER_BPE_TRAINER_H_
