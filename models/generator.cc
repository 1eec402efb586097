#include "models/generator.h"

#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/InferenceMode.h>

#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "models/tokenizer.h"

namespace accel::models {

absl::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStop:
      return "stop";
  }
  return "length";
}

namespace {

class TokenizerStream : public TextStream {
 public:
  explicit TokenizerStream(const Tokenizer& tokenizer)
      : decoder_(tokenizer, /*skip_special_tokens=*/true) {}
  // An id outside the tokenizer's vocabulary is not part of the stream.
  std::string Next(int64_t id) override {
    absl::StatusOr<std::string> piece = decoder_.Next(id);
    return piece.ok() ? *std::move(piece) : std::string();
  }
  std::string Flush() override { return decoder_.Flush(); }

 private:
  IncrementalDecoder decoder_;
};

}  // namespace

TextStreamFactory TokenizerTextStreams(const Tokenizer& tokenizer) {
  return [tokenizer] { return std::make_unique<TokenizerStream>(tokenizer); };
}

struct Generator::Sequence {
  Sequence(GenerationRequest r, const Sampler& s) : request(std::move(r)), sampler(s) {}

  GenerationRequest request;
  Sampler sampler;
  std::unique_ptr<TextStream> text_stream;
  KvCache cache;
  std::vector<int64_t> ids;  // prompt, then generated
  int64_t generated = 0;
  bool prefilled = false;
  // Text decoded so far; [0, emitted) has gone out in events, the rest is
  // held back because it could be the start of a stop string.
  std::string text;
  size_t emitted = 0;
  size_t longest_stop = 0;

  // Appends decoded text; returns what may go out now, and whether a stop
  // string ended the text (which is then cut before it).
  std::pair<std::string, bool> Take(const std::string& piece) {
    const size_t before = text.size();
    text += piece;
    // The earliest stop string that appears, searching only where the new
    // piece could have completed one.
    size_t cut = std::string::npos;
    for (const std::string& stop : request.stop_strings) {
      const size_t from = before >= stop.size() ? before - stop.size() + 1 : 0;
      cut = std::min(cut, text.find(stop, from));
    }
    if (cut != std::string::npos) {
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
      for (const std::string& stop : request.stop_strings) {
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
    if (text_stream != nullptr) std::tie(out, stopped) = Take(text_stream->Flush());
    if (!stopped) {
      out += text.substr(emitted);
      emitted = text.size();
    }
    return {std::move(out), stopped};
  }
};

Generator::Generator(std::shared_ptr<CausalLM> model, dispatch::DispatchedModel* dispatched,
                     TextStreamFactory text_streams)
    : model_(std::move(model)),
      dispatched_(dispatched),
      text_streams_(std::move(text_streams)),
      position_limit_(model_->config().max_position_embeddings > 0
                          ? model_->config().max_position_embeddings
                          : std::numeric_limits<int64_t>::max()) {}

Generator::~Generator() = default;

absl::StatusOr<uint64_t> Generator::Add(GenerationRequest request) {
  RequestLimits limits;
  limits.vocab_size = model_->config().vocab_size;
  limits.max_input_tokens = position_limit_ - 1;  // room for one generated token
  limits.input_limit_name = absl::StrCat("the model takes at most ", position_limit_, " positions");
  limits.has_text_streams = static_cast<bool>(text_streams_);
  ACCEL_RETURN_IF_ERROR(ValidateGenerationRequest(request, limits));
  if (request.max_new_tokens == 0) request.max_new_tokens = kDefaultMaxNewTokens;
  ACCEL_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(request.sampling));
  auto sequence = std::make_unique<Sequence>(std::move(request), sampler);
  if (text_streams_) sequence->text_stream = text_streams_();
  sequence->ids = sequence->request.prompt_ids;
  for (const std::string& stop : sequence->request.stop_strings) {
    sequence->longest_stop = std::max(sequence->longest_stop, stop.size());
  }
  const uint64_t id = next_id_++;
  sequences_.emplace(id, std::move(sequence));
  return id;
}

absl::StatusOr<std::vector<TokenEvent>> Generator::Step() {
  std::vector<TokenEvent> events;
  if (sequences_.empty()) return events;
  c10::InferenceMode inference;
  std::vector<int64_t> packed;
  std::vector<SequenceChunk> chunks;
  std::vector<Sequence*> order;
  std::vector<uint64_t> ids;
  for (auto& [id, seq] : sequences_) {
    ids.push_back(id);
    if (seq->prefilled) {
      packed.push_back(seq->ids.back());
      chunks.push_back({&seq->cache, 1});
    } else {
      packed.insert(packed.end(), seq->ids.begin(), seq->ids.end());
      chunks.push_back({&seq->cache, static_cast<int64_t>(seq->ids.size())});
    }
    order.push_back(seq.get());
  }
  at::Tensor input_ids;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] { input_ids = at::tensor(packed, at::kLong); }));
  ACCEL_ASSIGN_OR_RETURN(at::Tensor logits,
                         model_->Forward(input_ids, chunks, Logits::kLastOfEach, dispatched_));
  // Sample every sequence first: text decoding below cannot fail halfway
  // through the batch and leave some sequences advanced.
  std::vector<int64_t> tokens(order.size());
  std::vector<std::optional<float>> logprobs(order.size());
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    for (size_t i = 0; i < order.size(); ++i) {
      const at::Tensor row = logits[static_cast<int64_t>(i)];
      tokens[i] = order[i]->sampler.Next(row, order[i]->ids);
      if (order[i]->request.logprobs) {
        logprobs[i] = at::log_softmax(row, -1)[tokens[i]].item<float>();
      }
    }
  }));
  for (size_t i = 0; i < order.size(); ++i) {
    Sequence& seq = *order[i];
    seq.prefilled = true;
    seq.ids.push_back(tokens[i]);
    ++seq.generated;
    TokenEvent event;
    event.sequence = ids[i];
    event.token_id = tokens[i];
    event.logprob = logprobs[i];
    bool stopped = false;
    if (seq.text_stream != nullptr) {
      std::tie(event.text, stopped) = seq.Take(seq.text_stream->Next(tokens[i]));
    }
    const auto& stops = seq.request.stop_token_ids;
    if (stopped) {
      event.finish = FinishReason::kStop;
    } else if (std::find(stops.begin(), stops.end(), tokens[i]) != stops.end()) {
      event.finish = FinishReason::kEos;
    } else if (seq.generated >= seq.request.max_new_tokens ||
               static_cast<int64_t>(seq.ids.size()) >= position_limit_) {
      event.finish = FinishReason::kLength;
    }
    if (event.finish && !stopped) {
      auto [rest, flush_stopped] = seq.Finish();
      if (flush_stopped) event.finish = FinishReason::kStop;
      event.text += rest;
    }
    events.push_back(std::move(event));
  }
  for (const TokenEvent& event : events) {
    if (event.finish) sequences_.erase(event.sequence);
  }
  return events;
}

bool Generator::Cancel(uint64_t sequence) { return sequences_.erase(sequence) > 0; }

int64_t Generator::kv_cache_bytes() const {
  int64_t total = 0;
  for (const auto& [id, seq] : sequences_) total += seq->cache.bytes();
  return total;
}

absl::StatusOr<std::vector<GenerationResult>> Generate(Generator& generator,
                                                       std::vector<GenerationRequest> requests) {
  std::map<uint64_t, size_t> index;
  std::vector<GenerationResult> results(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    absl::StatusOr<uint64_t> id = generator.Add(std::move(requests[i]));
    if (!id.ok()) {
      for (const auto& [added, unused] : index) generator.Cancel(added);
      return Annotate(id.status(), absl::StrCat("request ", i));
    }
    index[*id] = i;
  }
  size_t open = requests.size();
  while (open > 0) {
    absl::StatusOr<std::vector<TokenEvent>> events = generator.Step();
    if (!events.ok()) {
      for (const auto& [id, unused] : index) generator.Cancel(id);
      return events.status();
    }
    for (TokenEvent& event : *events) {
      auto found = index.find(event.sequence);
      if (found == index.end()) continue;  // someone else's request
      GenerationResult& result = results[found->second];
      result.token_ids.push_back(event.token_id);
      if (event.logprob) result.logprobs.push_back(*event.logprob);
      result.text += event.text;
      if (event.finish) {
        result.finish_reason = *event.finish;
        index.erase(found);
        --open;
      }
    }
  }
  return results;
}

}  // namespace accel::models
