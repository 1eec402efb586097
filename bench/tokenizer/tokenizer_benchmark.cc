// Tokenizer speed: encode and decode MB/s of a 4 MB mixed text (English
// prose, code, numbers, accented Latin, CJK, emoji) in 4 KB requests, for
// real tokenizer.json files, next to a baseline from the same run: the
// straightforward regex split of the same text (RE2::Consume piece by piece
// with a GPT-2-style pattern), which is what a pre-tokenizer does before BPE.
//
//   bash scripts/tokenizer_references.sh build     # writes the tokenizer.json files
//   build/bin/accel-bench-tokenizer [build/tokenizer-refs/llama3.tokenizer.json ...]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <re2/re2.h>

#include "tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

double Best(int repeats, const std::function<void()>& fn) {
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

// Deterministic mixed text cut into requests of about 4 KB (on line ends,
// so no request splits a character).
std::vector<std::string> Requests(size_t total_bytes) {
  const std::vector<std::string> lines = {
      "The quick brown fox jumps over the lazy dog, and then it's gone again.\n",
      "    for (int i = 0; i < n; ++i) { total += values[i] * 2; }  // sum\n",
      "Prices rose 3.25% in 2024; 1,234,567 units shipped by 11:45pm.\n",
      "Café, naïve, façade, Ångström: déjà vu über alles.\n",
      "東京は日本の首都です。北京是中国的首都。\n",
      "Emoji 🙂👍🏽 and 👨‍👩‍👧 in a sentence, with URLs like "
      "https://example.com/a?b=c.\n",
      "We'll see: they're sure I've done what you'd said he'd do.\n",
      "\n\n   \t indented after blank lines\n"};
  std::mt19937 rng(1);
  std::vector<std::string> out(1);
  size_t bytes = 0;
  while (bytes < total_bytes) {
    const std::string& line = lines[rng() % lines.size()];
    if (out.back().size() + line.size() > 4096) out.emplace_back();
    out.back() += line;
    bytes += line.size();
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> paths(argv + 1, argv + argc);
  if (paths.empty()) {
    for (const char* name : {"llama3", "llama2", "qwen3", "gpt2"}) {
      paths.push_back(std::string("build/tokenizer-refs/") + name + ".tokenizer.json");
    }
  }
  const std::vector<std::string> requests = Requests(4 << 20);
  size_t bytes = 0;
  for (const std::string& r : requests) bytes += r.size();
  const double mb = static_cast<double>(bytes) / 1e6;

  // Baseline: a plain regex split (GPT-2's pattern without its lookahead).
  const RE2 split(R"(('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+))");
  size_t pieces = 0;
  const double regex_s = Best(3, [&] {
    pieces = 0;
    for (const std::string& r : requests) {
      re2::StringPiece input(r);
      re2::StringPiece piece;
      while (!input.empty() && RE2::Consume(&input, split, &piece)) ++pieces;
      if (!input.empty()) std::abort();
    }
  });
  std::printf("%.1f MB in %zu requests; baseline RE2 split alone: %.1f MB/s (%zu pieces)\n", mb,
              requests.size(), mb / regex_s, pieces);

  for (const std::string& path : paths) {
    auto tokenizer = accel::tokenizer::Tokenizer::FromFile(path);
    if (!tokenizer.ok()) {
      std::fprintf(stderr, "%s\n", tokenizer.status().ToString().c_str());
      return 1;
    }
    std::vector<std::vector<int64_t>> ids(requests.size());
    size_t tokens = 0;
    const double encode_s = Best(3, [&] {
      tokens = 0;
      for (size_t i = 0; i < requests.size(); ++i) {
        ids[i] = *tokenizer->Encode(requests[i], /*add_special_tokens=*/false);
        tokens += ids[i].size();
      }
    });
    const double decode_s = Best(3, [&] {
      for (const auto& request : ids) {
        if (!tokenizer->Decode(request, /*skip_special_tokens=*/false).ok()) std::abort();
      }
    });
    std::printf(
        "%s: encode %.1f MB/s (%.2fx the regex split's time), decode %.1f MB/s; %zu tokens\n",
        path.c_str(), mb / encode_s, encode_s / regex_s, mb / decode_s, tokens);
  }
  return 0;
}
