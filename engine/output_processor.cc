#include "engine/output_processor.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/string_view.h"

#include "tokenizer/tokenizer.h"

namespace accel::engine {
namespace {

class TokenizerStream : public TextStream {
 public:
  explicit TokenizerStream(const tokenizer::Tokenizer& tokenizer)
      : decoder_(tokenizer, /*skip_special_tokens=*/true) {}
  // An id outside the tokenizer's vocabulary is not part of the stream.
  std::string Next(int64_t id) override {
    absl::StatusOr<std::string> piece = decoder_.Next(id);
    return piece.ok() ? *std::move(piece) : std::string();
  }
  std::string Flush() override { return decoder_.Flush(); }

 private:
  tokenizer::IncrementalDecoder decoder_;
};

}  // namespace

TextStreamFactory TokenizerTextStreams(const tokenizer::Tokenizer& tokenizer) {
  return [tokenizer] { return std::make_unique<TokenizerStream>(tokenizer); };
}

// One request's text: [0, emitted) has gone out in events, the rest is held
// back because it could be the start of a stop string.
struct OutputProcessor::Detokenizer {
  std::unique_ptr<TextStream> stream;
  std::vector<std::string> stop_strings;
  std::string text;
  size_t emitted = 0;
  size_t longest_stop = 0;
  bool include_stop = false;  // the text ends after the stop string, not before
  int64_t min_tokens = 0;     // stop strings are looked for from the token after these
  int64_t tokens = 0;         // generated so far

  // Whether stop strings are matched now (vLLM: once more than min_tokens
  // tokens were generated).
  bool matching() const { return tokens > min_tokens; }

  // Appends decoded text; returns what may go out now, and whether a stop
  // string ended the text (which is then cut before it).
  std::pair<std::string, bool> Take(const std::string& piece) {
    const size_t before = text.size();
    text += piece;
    // The earliest stop string that appears, searching only where the new
    // piece could have completed one.
    size_t cut = std::string::npos;
    size_t cut_end = std::string::npos;
    for (const std::string& stop : matching() ? stop_strings : std::vector<std::string>()) {
      const size_t from = before >= stop.size() ? before - stop.size() + 1 : 0;
      const size_t at = text.find(stop, from);
      if (at < cut) {
        cut = at;
        cut_end = at + stop.size();
      }
    }
    if (cut != std::string::npos) {
      if (include_stop) cut = cut_end;
      text.resize(cut);
      std::string out = cut > emitted ? text.substr(emitted) : std::string();
      emitted = text.size();
      return {std::move(out), true};
    }
    // Hold back the longest suffix that is a proper prefix of a stop string.
    // Stop strings are valid UTF-8, so such a suffix starts on a character.
    size_t hold = 0;
    for (size_t k = std::min(longest_stop - (longest_stop > 0 ? 1 : 0), text.size()); k > 0; --k) {
      const absl::string_view suffix = absl::string_view(text).substr(text.size() - k);
      bool prefix = false;
      for (const std::string& stop : stop_strings) {
        if (stop.size() > k && absl::string_view(stop).substr(0, k) == suffix) prefix = true;
      }
      if (prefix) {
        hold = k;
        break;
      }
    }
    const size_t end = std::max(emitted, text.size() - hold);
    std::string out = text.substr(emitted, end - emitted);
    emitted = end;
    return {std::move(out), false};
  }

  // The end: whatever the stream held (which can complete a stop string),
  // then everything held back.
  std::pair<std::string, bool> Finish() {
    std::string out;
    bool stopped = false;
    if (stream != nullptr) std::tie(out, stopped) = Take(stream->Flush());
    if (!stopped) {
      out += text.substr(emitted);
      emitted = text.size();
    }
    return {std::move(out), stopped};
  }
};

OutputProcessor::OutputProcessor(TextStreamFactory text_streams)
    : text_streams_(std::move(text_streams)) {}

OutputProcessor::~OutputProcessor() = default;

void OutputProcessor::Add(uint64_t id, const GenerationRequest& request) {
  auto d = std::make_unique<Detokenizer>();
  if (text_streams_) d->stream = text_streams_();
  d->stop_strings = request.stop_strings;
  d->include_stop = request.include_stop_str_in_output;
  d->min_tokens = request.min_tokens;
  for (const std::string& stop : d->stop_strings) {
    d->longest_stop = std::max(d->longest_stop, stop.size());
  }
  requests_[id] = std::move(d);
}

void OutputProcessor::Remove(uint64_t id) { requests_.erase(id); }

std::vector<TokenEvent> OutputProcessor::Process(std::vector<RequestUpdate> updates) {
  std::vector<TokenEvent> events;
  for (RequestUpdate& update : updates) {
    auto found = requests_.find(update.id);
    if (found == requests_.end()) continue;
    Detokenizer& d = *found->second;
    bool ended = false;
    for (size_t i = 0; i < update.token_ids.size() && !ended; ++i) {
      const bool last = i + 1 == update.token_ids.size();
      TokenEvent event;
      event.sequence = update.id;
      event.token_id = update.token_ids[i];
      if (i < update.logprobs.size()) event.logprob = update.logprobs[i];
      if (i < update.top_logprobs.size()) event.top_logprobs = std::move(update.top_logprobs[i]);
      if (i == 0) event.prompt_logprobs = std::move(update.prompt_logprobs);
      bool stopped = false;
      ++d.tokens;
      if (d.stream != nullptr)
        std::tie(event.text, stopped) = d.Take(d.stream->Next(event.token_id));
      if (stopped) {
        event.finish = FinishReason::kStop;
      } else if (last && update.finish) {
        event.finish = update.finish;
        auto [rest, flush_stopped] = d.Finish();
        if (flush_stopped) event.finish = FinishReason::kStop;
        event.text += rest;
      }
      ended = event.finish.has_value();
      events.push_back(std::move(event));
    }
    if (ended) requests_.erase(found);
  }
  return events;
}

}  // namespace accel::engine
