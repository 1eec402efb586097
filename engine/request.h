// engine/request.h: the one generation request type, from every wire adapter
// (accel.v1, KServe v2, the OpenAI HTTP API) and tool through the engine to
// the model runner, and what a step gives back for it. Torch-free, so the
// server's adapters and the engine's pure parts (scheduler, output
// processor) hold it without libtorch.
//
// The input processor (engine/input_processor.h) fills the gaps of a request
// as an adapter made it (tokenizes `prompt`, renders `chat`, applies the
// defaults and adds the stop tokens) and checks it once with
// ValidateGenerationRequest() before it is queued; nothing after it checks
// again (one set of rules, one set of messages).
#ifndef ACCEL_ENGINE_REQUEST_H_
#define ACCEL_ENGINE_REQUEST_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace accel::engine {

// One set of defaults: greedy unless a temperature is given, as
// transformers' generate() (do_sample=False) and proto3's zero both mean.
struct SamplingParams {
  double temperature = 0.0;         // 0: greedy
  int64_t top_k = 0;                // 0: off
  double top_p = 1.0;               // 1: off
  double min_p = 0.0;               // 0: off
  double repetition_penalty = 1.0;  // 1: off
  std::optional<uint64_t> seed;     // the same seed and inputs give the same tokens
  // OpenAI's: each generated token's logit minus presence_penalty once it
  // has appeared and frequency_penalty times its count, both in [-2, 2]
  // (0: off); logit_bias adds a value in [-100, 100] to a token's logit.
  // Applied before the repetition penalty and temperature
  // (engine/penalty_logits_processor.h).
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  std::vector<std::pair<int64_t, double>> logit_bias;
};

// The accepted repetition penalties (see ValidateSamplingParams).
inline constexpr double kMinRepetitionPenalty = 1e-30;
inline constexpr double kMaxRepetitionPenalty = 1e30;

// InvalidArgument naming the parameter and the accepted range: temperature
// < 0 or not finite, top_k < 0, top_p outside (0, 1], min_p outside [0, 1],
// repetition_penalty outside [1e-30, 1e30]. Any positive temperature is
// accepted: a tiny one (even below float32's range) gives the greedy token,
// its limit.
absl::Status ValidateSamplingParams(const SamplingParams& params);

// max_new_tokens when a request leaves it 0 and nobody set another default.
inline constexpr int64_t kDefaultMaxNewTokens = 16;

// A conversation, for the model's chat template (tokenizer/chat_template.h)
// to render into the prompt. JSON text, since templates read any field a
// message has: messages is an array of objects with "role" and "content"
// and optionally "name", "tool_calls", "tool_call_id", ...; tools an array
// of tool (function) definitions, or empty.
struct ChatInput {
  std::string messages_json;
  std::string tools_json;
  bool add_generation_prompt = true;
};

// The most choices one request may ask for (OpenAI's bound on n).
inline constexpr int64_t kMaxChoices = 128;

// The most tokens top_logprobs may ask for (OpenAI's bound).
inline constexpr int64_t kMaxTopLogprobs = 20;

// Structured output: the text generated must be a sentence of one grammar
// (grammar/): exactly one of these is set. `field` names where it came from
// in the client's request, for messages ("response_format.json_schema",
// "guided_regex", "--json_schema").
struct StructuredOutputs {
  std::string json_schema;   // a JSON Schema, as text
  bool json_object = false;  // any JSON object
  std::string regex;
  std::vector<std::string> choice;
  std::string grammar;  // GBNF (llama.cpp's grammar syntax)
  std::string field = "structured_outputs";
};

struct GenerationRequest {
  std::string model;                  // the model asked for; empty: the served one
  std::optional<std::string> prompt;  // text, tokenized into prompt_ids by the engine, or
  std::optional<ChatInput> chat;      // a conversation the engine renders and tokenizes, or
  std::vector<int64_t> prompt_ids;    // ids
  SamplingParams sampling;
  int64_t max_new_tokens = 0;  // 0: the default (or, with the next, the context)
  // With max_new_tokens 0: run to the end of the context (what is left of
  // max_total_tokens after the prompt), as OpenAI's chat completions do.
  bool max_new_tokens_to_context = false;
  std::vector<int64_t> stop_token_ids;    // the engine adds the model's eos unless ignore_eos
  std::vector<std::string> stop_strings;  // need text streams (a tokenizer)
  bool ignore_eos = false;
  // Stop tokens (stop_token_ids and eos) are masked out of sampling and stop
  // strings are not matched until this many tokens were generated (vLLM's
  // min_tokens); at most max_new_tokens.
  int64_t min_tokens = 0;
  // A stop string that ends the text stays in it (vLLM's
  // include_stop_str_in_output); by default the text ends before it.
  bool include_stop_str_in_output = false;
  // Choices generated for the prompt, each its own sampler stream (choice i
  // of a seeded request draws from seed + i, as vLLM seeds them), in
  // [1, kMaxChoices]. LlmEngine::Submit runs them as n sequences that share
  // the prompt's KV blocks: the prompt is prefilled once (the scheduler
  // holds a sequence back while another with the same prompt reads it, then
  // it joins on the cached blocks).
  int64_t n = 1;
  bool logprobs = false;  // report each generated token's log-probability
  // With logprobs: also the this many most likely tokens at each step, in
  // [0, kMaxTopLogprobs].
  int64_t top_logprobs = 0;
  // Each prompt token's log-probability (and top_logprobs alternatives),
  // from the prefill's logits: what OpenAI's legacy completions give with
  // echo and logprobs (lm-eval-harness's loglikelihood). Such a request
  // reads its whole prompt itself (no cached prefix: every position's logits
  // are needed).
  bool prompt_logprobs = false;
  // Past it the request ends with DeadlineExceeded; `deadline_reason` says
  // whose deadline it was ("the client's deadline", "--request_timeout=30s").
  absl::Time deadline = absl::InfiniteFuture();
  std::string deadline_reason;
  // Grammar-constrained decoding (engine/structured_output.h); none when unset.
  std::optional<StructuredOutputs> structured;
};

// What a model allows a request.
struct RequestLimits {
  int64_t vocab_size = 0;
  int64_t max_input_tokens = 0;                         // prompt tokens; 0: unchecked
  int64_t max_total_tokens = 0;                         // prompt + max_new_tokens; 0: unchecked
  std::string input_limit_name = "--max_input_tokens";  // where max_input_tokens comes from
  std::string total_limit_name = "--max_total_tokens";  // where max_total_tokens comes from
  bool has_text_streams = false;                        // stop strings can be matched
};

// The rules every request meets before it runs, on prompt_ids (the prompt
// text must be tokenized first). InvalidArgument naming the field: an empty
// prompt, an id outside the vocabulary, a prompt over max_input_tokens,
// prompt + max_new_tokens over max_total_tokens, max_new_tokens < 0, bad
// sampling values, top_logprobs outside [0, 20] or without logprobs, an empty
// stop string, or stop strings without text, n outside [1, kMaxChoices],
// min_tokens < 0 or over max_new_tokens (when that is set), a stop token id
// outside the vocabulary.
absl::Status ValidateGenerationRequest(const GenerationRequest& request,
                                       const RequestLimits& limits);

enum class FinishReason {
  kLength,  // max_new_tokens, or the model's position limit
  kEos,     // a stop token id was generated (it is the last of token_ids)
  kStop,    // a stop string appeared in the text (which ends before it)
};
// "length", "eos", "stop".
absl::string_view FinishReasonName(FinishReason reason);

struct TokenLogprob {
  int64_t token_id = 0;
  float logprob = 0;
};

// One prompt token's log-probability given the tokens before it (none for
// the first), and the request's top_logprobs most likely tokens there.
struct PromptLogprob {
  int64_t token_id = 0;
  std::optional<float> logprob;
  std::vector<TokenLogprob> top_logprobs;
};

// One generated token of one sequence (a step may give a sequence several:
// speculative decoding accepts drafted tokens).
struct TokenEvent {
  uint64_t sequence = 0;
  int64_t token_id = 0;
  // log p(token) under the model's own distribution (log-softmax of the raw
  // logits, before sampling's processing); set when the request asked.
  std::optional<float> logprob;
  // The request's top_logprobs most likely tokens, most likely first.
  std::vector<TokenLogprob> top_logprobs;
  std::string text;  // text that became final with this token (may be empty)
  std::optional<FinishReason> finish;
  // With prompt_logprobs, on the request's first token: one per prompt token.
  std::vector<PromptLogprob> prompt_logprobs;
};

}  // namespace accel::engine

#endif  // ACCEL_ENGINE_REQUEST_H_
