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
#include "tokenizer/tokenizer.h"

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

struct Generator::Sequence {
  Sequence(GenerationRequest r, const Sampler& s) : request(std::move(r)), sampler(s) {}

  GenerationRequest request;
  Sampler sampler;
  std::unique_ptr<TextStream> text_stream;
  KvCache cache;
  // The blocks holding its tokens (the accounting, kept here because a
  // LongRoPE recompute replaces `cache` with a contiguous one).
  std::vector<int32_t> blocks;
  int64_t sealed_blocks = 0;  // blocks keyed for the prefix cache
  uint64_t sealed_key = 0;    // the last keyed block's key
  std::vector<int64_t> ids;   // prompt, then generated
  int64_t generated = 0;
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
                     TextStreamFactory text_streams, GeneratorOptions options)
    : model_(std::move(model)),
      dispatched_(dispatched),
      text_streams_(std::move(text_streams)),
      position_limit_(model_->config().max_position_embeddings > 0
                          ? model_->config().max_position_embeddings
                          : std::numeric_limits<int64_t>::max()),
      options_(options) {
  options_.block_size = std::max<int64_t>(options_.block_size, 1);
  // LongRoPE: a position's keys depend on the sequence's length (the short
  // factors until it passes the original context, then the long ones for
  // the whole sequence), so equal tokens need not have equal keys and blocks
  // cannot be shared between sequences.
  const std::optional<loader::RopeScaling>& rope = model_->config().rope_scaling;
  if (rope && rope->rope_type == "longrope") options_.prefix_caching = false;
  int64_t blocks = options_.kv_cache_blocks;
  if (blocks <= 0) {
    const int64_t per_block =
        KvBlockStore::BytesPerBlock(model_->config(), model_->dtype(), options_.block_size);
    const int64_t limit = std::min<int64_t>(position_limit_, 8192);
    blocks = (4 * limit + options_.block_size - 1) / options_.block_size;
    if (per_block > 0) blocks = std::min<int64_t>(blocks, (int64_t{1} << 30) / per_block);
    blocks = std::max<int64_t>(blocks, 1);
  }
  store_ = std::make_unique<KvBlockStore>(blocks, options_.block_size,
                                          static_cast<size_t>(model_->config().num_hidden_layers));
  blocks_ = std::make_unique<KvBlockManager>(blocks, options_.block_size, options_.prefix_caching);
}

Generator::~Generator() = default;

int64_t Generator::kv_capacity_tokens() const {
  return blocks_->num_blocks() * blocks_->block_size();
}

absl::StatusOr<uint64_t> Generator::Add(GenerationRequest request) {
  RequestLimits limits;
  limits.vocab_size = model_->config().vocab_size;
  limits.max_input_tokens = position_limit_ - 1;  // room for one generated token
  limits.input_limit_name = absl::StrCat("the model takes at most ", position_limit_, " positions");
  limits.has_text_streams = static_cast<bool>(text_streams_);
  ACCEL_RETURN_IF_ERROR(ValidateGenerationRequest(request, limits));
  if (request.max_new_tokens == 0) request.max_new_tokens = kDefaultMaxNewTokens;
  const int64_t prompt = static_cast<int64_t>(request.prompt_ids.size());
  const int64_t most =
      std::min(prompt + std::min(request.max_new_tokens, position_limit_), position_limit_);
  if (most > kv_capacity_tokens()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("prompt (", prompt, " tokens) + max_new_tokens (", request.max_new_tokens,
                     ") needs more KV cache than the server has in all (", kv_capacity_tokens(),
                     " tokens: --kv_cache_memory)"));
  }
  ACCEL_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(request.sampling));
  auto sequence = std::make_unique<Sequence>(std::move(request), sampler);
  if (text_streams_) sequence->text_stream = text_streams_();
  sequence->ids = sequence->request.prompt_ids;
  sequence->cache.store = store_.get();
  for (const std::string& stop : sequence->request.stop_strings) {
    sequence->longest_stop = std::max(sequence->longest_stop, stop.size());
  }
  const uint64_t id = next_id_++;
  sequences_.emplace(id, std::move(sequence));
  waiting_.push_back(id);
  return id;
}

bool Generator::Reserve(Sequence& seq, int64_t tokens) {
  const int64_t needed =
      blocks_->BlocksFor(seq.cache.length + tokens) - static_cast<int64_t>(seq.blocks.size());
  if (needed <= 0) return true;
  if (blocks_->free_blocks() < needed) return false;
  for (int64_t i = 0; i < needed; ++i) seq.blocks.push_back(*blocks_->Allocate());
  return true;
}

void Generator::ReleaseBlocks(Sequence& seq) {
  for (int32_t block : seq.blocks) blocks_->Release(block);
  seq.blocks.clear();
  seq.cache.Clear();
  seq.cache.store = store_.get();
  seq.sealed_blocks = 0;
  seq.sealed_key = 0;
}

void Generator::Preempt(uint64_t id) {
  ReleaseBlocks(*sequences_.at(id));
  admitted_.erase(std::remove(admitted_.begin(), admitted_.end(), id), admitted_.end());
  waiting_.push_front(id);
  ++counters_.preemptions;
}

void Generator::Seal(Sequence& seq) {
  if (!seq.cache.paged()) return;  // a contiguous (recomputed) cache has no blocks to share
  const int64_t block_size = blocks_->block_size();
  while ((seq.sealed_blocks + 1) * block_size <= seq.cache.length &&
         seq.sealed_blocks < static_cast<int64_t>(seq.blocks.size())) {
    const absl::Span<const int64_t> ids =
        absl::MakeConstSpan(seq.ids).subspan(seq.sealed_blocks * block_size, block_size);
    seq.sealed_key = KvBlockManager::ChainKey(seq.sealed_key, ids);
    blocks_->Seal(seq.blocks[seq.sealed_blocks], seq.sealed_key, ids);
    ++seq.sealed_blocks;
  }
}

absl::StatusOr<std::vector<TokenEvent>> Generator::Step() {
  std::vector<TokenEvent> events;
  if (sequences_.empty()) return events;
  c10::InferenceMode inference;
  struct Work {
    uint64_t id;
    Sequence* seq;
    int64_t tokens;
  };
  std::vector<Work> work;
  const auto pending = [](const Sequence& seq) {
    return static_cast<int64_t>(seq.ids.size()) - seq.cache.length;
  };
  // The token budget: every decoding sequence's one token first, so a long
  // prompt being read cannot slow them; prompt chunks share what is left.
  int64_t prompt_budget = std::numeric_limits<int64_t>::max();
  int64_t reading = static_cast<int64_t>(waiting_.size());  // prompts waiting or being read
  int64_t decoding = 0;
  for (uint64_t id : admitted_) {
    const int64_t left = pending(*sequences_.at(id));
    decoding += left == 1 ? 1 : 0;
    reading += left > 1 ? 1 : 0;
  }
  if (options_.max_num_batched_tokens > 0) {
    prompt_budget = std::max<int64_t>(options_.max_num_batched_tokens - decoding, 0);
    // A step with no decoding sequence always reads some prompt.
    if (decoding == 0) prompt_budget = std::max<int64_t>(prompt_budget, 1);
  }
  // When several prompts are to be read, one takes at most half of the
  // prompt budget a step (vLLM's long_prefill_token_threshold), so a short
  // prompt arriving behind a long one starts within a few steps instead of
  // after the whole long prompt.
  const int64_t prefill_cap = reading > 1 && options_.max_num_batched_tokens > 0
                                  ? std::max<int64_t>(prompt_budget / 2, 1)
                                  : prompt_budget;
  // Running sequences, oldest first. One that cannot get a block preempts
  // the most recently admitted (possibly itself), which has not been
  // scheduled yet, so nothing in `work` loses its blocks.
  for (size_t i = 0; i < admitted_.size(); ++i) {
    const uint64_t id = admitted_[i];
    Sequence& seq = *sequences_.at(id);
    const int64_t left = pending(seq);
    const int64_t take = left == 1 ? 1 : std::min({left, prompt_budget, prefill_cap});
    if (take == 0) continue;
    bool preempted = false;
    while (!Reserve(seq, take)) {
      const uint64_t victim = admitted_.back();
      Preempt(victim);
      if (victim == id) {
        preempted = true;
        break;
      }
    }
    if (preempted) break;
    if (left > 1) prompt_budget -= take;
    work.push_back({id, &seq, take});
  }
  // Waiting sequences join in order while their whole input fits the free
  // blocks (after reusing a cached prefix) and the budgets allow.
  while (!waiting_.empty() && prompt_budget > 0 &&
         (options_.max_num_seqs <= 0 ||
          static_cast<int64_t>(admitted_.size()) < options_.max_num_seqs)) {
    const uint64_t id = waiting_.front();
    Sequence& seq = *sequences_.at(id);
    const int64_t input = static_cast<int64_t>(seq.ids.size());
    if (blocks_->BlocksFor(input) > blocks_->free_blocks() + blocks_->cached_blocks()) break;
    KvBlockManager::Prefix prefix = blocks_->MatchPrefix(seq.ids, input - 1);
    if (blocks_->BlocksFor(input) - static_cast<int64_t>(prefix.blocks.size()) >
        blocks_->free_blocks()) {
      for (int32_t block : prefix.blocks) blocks_->Release(block);
      break;
    }
    seq.blocks = std::move(prefix.blocks);
    seq.cache.length = prefix.tokens;
    seq.cache.token_ids.assign(seq.ids.begin(), seq.ids.begin() + prefix.tokens);
    seq.sealed_blocks = static_cast<int64_t>(seq.blocks.size());
    seq.sealed_key = prefix.key;
    const int64_t take = std::min({input - prefix.tokens, prompt_budget, prefill_cap});
    Reserve(seq, take);  // fits: checked above
    waiting_.pop_front();
    admitted_.push_back(id);
    prompt_budget -= take;
    work.push_back({id, &seq, take});
  }
  if (work.empty()) return events;

  std::vector<int64_t> packed;
  std::vector<SequenceChunk> chunks;
  std::vector<int64_t> lengths;  // before the step, to undo a failed one
  int64_t prompt_tokens = 0;
  for (const Work& w : work) {
    Sequence& seq = *w.seq;
    if (seq.cache.paged()) seq.cache.block_table = seq.blocks;
    const auto first = seq.ids.begin() + seq.cache.length;
    packed.insert(packed.end(), first, first + w.tokens);
    chunks.push_back({&seq.cache, w.tokens});
    lengths.push_back(seq.cache.length);
    if (pending(seq) > 1) prompt_tokens += w.tokens;
  }
  at::Tensor input_ids;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] { input_ids = at::tensor(packed, at::kLong); }));
  ACCEL_ASSIGN_OR_RETURN(at::Tensor logits,
                         model_->Forward(input_ids, chunks, Logits::kLastOfEach, dispatched_));
  // Sample every sequence that read its whole input first: text decoding
  // below cannot fail halfway through the batch and leave some sequences
  // advanced. If sampling fails, the caches go back to where they were.
  std::vector<int64_t> tokens(work.size(), -1);
  std::vector<std::optional<float>> logprobs(work.size());
  std::vector<std::vector<TokenLogprob>> top_logprobs(work.size());
  const absl::Status sampled = CallTorch([&] {
    for (size_t i = 0; i < work.size(); ++i) {
      Sequence& seq = *work[i].seq;
      if (pending(seq) != 0) continue;  // a prompt chunk: no token yet
      const at::Tensor row = logits[static_cast<int64_t>(i)];
      tokens[i] = seq.sampler.Next(row, seq.ids);
      if (!seq.request.logprobs) continue;
      const at::Tensor log_probs = at::log_softmax(row.to(at::kFloat), -1);
      logprobs[i] = log_probs[tokens[i]].item<float>();
      if (seq.request.top_logprobs > 0) {
        const auto [values, ids] =
            at::topk(log_probs, std::min(seq.request.top_logprobs, log_probs.size(0)));
        for (int64_t k = 0; k < values.size(0); ++k) {
          top_logprobs[i].push_back({ids[k].item<int64_t>(), values[k].item<float>()});
        }
      }
    }
  });
  if (!sampled.ok()) {
    for (size_t i = 0; i < work.size(); ++i) {
      KvCache& cache = work[i].seq->cache;
      cache.length = lengths[i];
      if (static_cast<int64_t>(cache.token_ids.size()) > lengths[i]) {
        cache.token_ids.resize(static_cast<size_t>(lengths[i]));
      }
    }
    return sampled;
  }
  ++counters_.steps;
  counters_.last_step_tokens = static_cast<int64_t>(packed.size());
  counters_.prompt_tokens += prompt_tokens;
  for (size_t i = 0; i < work.size(); ++i) {
    Sequence& seq = *work[i].seq;
    Seal(seq);
    if (tokens[i] < 0) continue;
    ++counters_.generation_tokens;
    seq.ids.push_back(tokens[i]);
    ++seq.generated;
    TokenEvent event;
    event.sequence = work[i].id;
    event.token_id = tokens[i];
    event.logprob = logprobs[i];
    event.top_logprobs = std::move(top_logprobs[i]);
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
    if (event.finish) Cancel(event.sequence);
  }
  return events;
}

bool Generator::Cancel(uint64_t sequence) {
  auto found = sequences_.find(sequence);
  if (found == sequences_.end()) return false;
  ReleaseBlocks(*found->second);
  admitted_.erase(std::remove(admitted_.begin(), admitted_.end(), sequence), admitted_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), sequence), waiting_.end());
  sequences_.erase(found);
  return true;
}

GeneratorStats Generator::stats() const {
  GeneratorStats stats = counters_;
  stats.running = static_cast<int64_t>(admitted_.size());
  stats.waiting = static_cast<int64_t>(waiting_.size());
  stats.kv_blocks_total = blocks_->num_blocks();
  stats.kv_blocks_used = blocks_->used_blocks();
  stats.kv_block_size = blocks_->block_size();
  // The store, and contiguous caches that LongRoPE recomputes made.
  stats.kv_cache_bytes = store_->bytes();
  for (const auto& [id, seq] : sequences_) stats.kv_cache_bytes += seq->cache.bytes();
  stats.prefix_query_tokens = blocks_->prefix_query_tokens();
  stats.prefix_hit_tokens = blocks_->prefix_hit_tokens();
  return stats;
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
