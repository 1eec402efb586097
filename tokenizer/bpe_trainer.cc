#include "tokenizer/bpe_trainer.h"

#include <map>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace accel::tokenizer {
namespace {

std::string Utf8(uint32_t code_point) {
  std::string out;
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xC0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  }
  return out;
}

// GPT-2's order: bytes that are printable as themselves, then the rest
// (mapped to 256, 257, ...).
std::vector<int> ByteOrder() {
  std::vector<int> order;
  for (int b = '!'; b <= '~'; ++b) order.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) order.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) order.push_back(b);
  std::set<int> printable(order.begin(), order.end());
  for (int b = 0; b < 256; ++b) {
    if (!printable.count(b)) order.push_back(b);
  }
  return order;
}

using Word = std::vector<std::string>;

}  // namespace

const std::vector<std::string>& ByteToSymbol() {
  static const std::vector<std::string> kTable = [] {
    std::vector<std::string> table(256);
    std::vector<int> order = ByteOrder();
    int extra = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      int b = order[i];
      bool printable = i < 188;  // 94 + 12 + 82 printable bytes come first.
      table[b] = Utf8(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++));
    }
    return table;
  }();
  return kTable;
}

std::vector<std::string> ByteAlphabet() {
  std::vector<std::string> alphabet;
  for (int b : ByteOrder()) alphabet.push_back(ByteToSymbol()[b]);
  return alphabet;
}

std::vector<std::pair<std::string, std::string>> TrainMerges(absl::string_view text,
                                                             int max_merges) {
  // Split into words and count them.
  std::map<std::string, int64_t> word_counts;
  size_t i = 0;
  while (i < text.size()) {
    size_t start = i;
    auto is_word = [&](size_t k) {
      return absl::ascii_isalnum(static_cast<unsigned char>(text[k]));
    };
    if (text[i] == ' ' && i + 1 < text.size() && is_word(i + 1)) ++i;
    if (is_word(i)) {
      while (i < text.size() && is_word(i)) ++i;
    } else {
      while (i < text.size() && !is_word(i) &&
             !(text[i] == ' ' && i + 1 < text.size() && is_word(i + 1)))
        ++i;
      if (i == start) ++i;
    }
    word_counts[std::string(text.substr(start, i - start))]++;
  }
  std::vector<std::pair<Word, int64_t>> words;
  for (const auto& [word, count] : word_counts) {
    Word symbols;
    for (unsigned char c : word) symbols.push_back(ByteToSymbol()[c]);
    words.emplace_back(std::move(symbols), count);
  }

  std::vector<std::pair<std::string, std::string>> merges;
  while (static_cast<int>(merges.size()) < max_merges) {
    std::map<std::pair<std::string, std::string>, int64_t> pair_counts;
    for (const auto& [symbols, count] : words) {
      for (size_t k = 0; k + 1 < symbols.size(); ++k)
        pair_counts[{symbols[k], symbols[k + 1]}] += count;
    }
    const std::pair<std::string, std::string>* best = nullptr;
    int64_t best_count = 1;  // A pair seen once is not worth a token.
    for (const auto& [pair, count] : pair_counts) {
      if (count > best_count) {
        best = &pair;
        best_count = count;
      }
    }
    if (best == nullptr) break;
    auto merged = *best;
    merges.push_back(merged);
    for (auto& [symbols, count] : words) {
      Word next;
      for (size_t k = 0; k < symbols.size(); ++k) {
        if (k + 1 < symbols.size() && symbols[k] == merged.first &&
            symbols[k + 1] == merged.second) {
          next.push_back(merged.first + merged.second);
          ++k;
        } else {
          next.push_back(symbols[k]);
        }
      }
      symbols = std::move(next);
    }
  }
  return merges;
}

const char kPlainChatTemplate[] =
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|' + message['role'] + '|>\\n' }}\n"
    "    {%- if message['content'] is string %}{{- message['content'] }}{%- endif %}\n"
    "    {{- eos_token + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|assistant|>\\n' }}\n"
    "{%- endif %}\n";

std::string TokenizerConfigJson(absl::string_view bos_token, absl::string_view eos_token) {
  nlohmann::ordered_json config;
  config["bos_token"] = std::string(bos_token);
  config["eos_token"] = std::string(eos_token);
  config["tokenizer_class"] = "PreTrainedTokenizerFast";
  config["chat_template"] = kPlainChatTemplate;
  return config.dump(2) + "\n";
}

std::string ByteLevelTokenizerJson(const std::vector<std::pair<std::string, std::string>>& merges,
                                   const std::vector<SpecialToken>& specials) {
  using Json = nlohmann::ordered_json;
  Json vocab = Json::object();
  int64_t id = 0;
  for (const std::string& symbol : ByteAlphabet()) vocab[symbol] = id++;
  Json merge_list = Json::array();
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = id++;
    merge_list.push_back(absl::StrCat(a, " ", b));
  }
  // The special tokens are in the model's vocabulary too: HF gives an added
  // token that the vocabulary lacks the next free id, not the one in the file.
  for (const SpecialToken& s : specials) vocab[s.content] = s.id;
  Json added = Json::array();
  for (const SpecialToken& s : specials) {
    added.push_back({{"id", s.id},
                     {"content", s.content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  Json byte_level = {{"type", "ByteLevel"},
                     {"add_prefix_space", false},
                     {"trim_offsets", true},
                     {"use_regex", true}};
  Json tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", byte_level},
      {"post_processor", byte_level},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
  return tokenizer.dump(2) + "\n";
}

absl::string_view SampleEnglishText() {
  return "The weights of a large language model are stored in files that are read once when the "
         "server starts. Each layer of the model is placed on a device: a GPU when there is room, "
         "the main memory of the machine when there is not, and the disk when even that is full. "
         "When a request arrives, the server turns its text into tokens, runs every layer in "
         "order, "
         "and samples the next token from the probabilities the last layer gives. The new token is "
         "sent back to the client at once, and the loop goes on until the answer is complete, the "
         "client goes away, or the time for the request runs out. A good server keeps many "
         "requests "
         "in one batch, so that the weights it reads from memory serve all of them at the same "
         "time. "
         "The same code that places the layers on devices also helps to train a model: it can "
         "split "
         "a model that is too big for one device, and it can save the state of training to disk "
         "and "
         "read it back later. Tests check that the numbers are right, and benchmarks measure how "
         "fast the work is done on the machine at hand. There is no magic in it: there is a file, "
         "a "
         "map of where each part goes, and a loop that moves the parts to where they are needed.";
}

}  // namespace accel::tokenizer
