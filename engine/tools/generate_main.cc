// accel-generate: load a model as accel-serve does (the same engine:
// engine/llm_engine.h) and generate from one prompt, streaming the text, then
// tokens/s on stderr (or one JSON line).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

#include "core/bytes.h"
#include "core/read_file.h"
#include "core/status.h"
#include "core/threads.h"
#include "core/tool_main.h"
#include "dist/env.h"
#include "dist/launch.h"
#include "dist/process_group.h"
#include "engine/engine_args.h"
#include "engine/llm_engine.h"
#include "engine/parallel_run.h"
#include "loader/config.h"
#include "models/load_model.h"
#include "models/tensor_parallel.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

ABSL_FLAG(std::string, prompt, "", "The prompt text (needs the model's tokenizer.json).");
ABSL_FLAG(std::string, input_ids, "", "The prompt as token ids, e.g. 1,2,3 (instead of --prompt).");
ABSL_FLAG(int64_t, max_new_tokens, -1,
          "Tokens to generate at most. Default: generation_config.json's, else 32.");
ABSL_FLAG(double, temperature, -1,
          "0: greedy. Default: generation_config.json's when it samples, else greedy.");
ABSL_FLAG(int64_t, top_k, -1, "Keep the k likeliest tokens (0: off). Default: generation_config.");
ABSL_FLAG(double, top_p, -1, "Nucleus sampling (1: off). Default: generation_config.");
ABSL_FLAG(double, min_p, -1, "Drop tokens below min_p x the top probability (0: off).");
ABSL_FLAG(double, repetition_penalty, -1, "Penalise seen tokens (1: off).");
ABSL_FLAG(int64_t, seed, -1, "Seed for sampling (-1: random). The same seed, the same text.");
ABSL_FLAG(std::vector<std::string>, stop, {}, "Stop strings, comma-separated.");
ABSL_FLAG(bool, ignore_eos, false, "Do not stop at the model's end-of-sequence tokens.");
ABSL_FLAG(bool, logprobs, false, "Report each generated token's log-probability (with --json).");
ABSL_FLAG(bool, add_special_tokens, true, "Let the tokenizer add its special tokens (BOS).");
ABSL_FLAG(bool, chat, false,
          "Send --prompt as the user's message through the model's chat template (and stop at its "
          "end-of-turn token).");
ABSL_FLAG(std::string, system, "", "With --chat (implied): a system message before --prompt.");
ABSL_FLAG(std::string, json_schema, "",
          "Structured output: a JSON Schema file the generated text must follow.");
ABSL_FLAG(std::string, regex, "", "Structured output: a regular expression the text must match.");
ABSL_FLAG(std::string, grammar, "",
          "Structured output: a GBNF grammar file (llama.cpp's syntax) the text must follow.");
ABSL_FLAG(bool, json, false,
          "Print one JSON line {token_ids, text, finish_reason[, logprobs]} instead of the text.");

namespace {

using accel::engine::FinishReason;
using accel::engine::GenerationRequest;
using Clock = std::chrono::steady_clock;

int Fail(const absl::Status& status) {
  std::cerr << "accel-generate: " << status.message() << "\n";
  return 1;
}

absl::StatusOr<std::vector<int64_t>> ParseIds(const std::string& text) {
  std::vector<int64_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int64_t id = 0;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--input_ids: '", std::string(part), "' is not a token id"));
    }
    ids.push_back(id);
  }
  return ids;
}

// Flags override generation_config.json, which overrides greedy decoding.
absl::StatusOr<GenerationRequest> MakeRequest(const accel::loader::GenerationConfig& g) {
  GenerationRequest r;
  r.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  if (r.max_new_tokens == 0) {
    return absl::InvalidArgumentError("--max_new_tokens must be at least 1, got 0");
  }
  if (r.max_new_tokens < 0) r.max_new_tokens = g.max_new_tokens.value_or(32);
  const bool samples = g.do_sample.value_or(false);
  r.sampling.temperature = samples ? g.temperature.value_or(1.0) : 0.0;
  if (samples) {
    r.sampling.top_k = g.top_k.value_or(0);
    r.sampling.top_p = g.top_p.value_or(1.0);
    r.sampling.min_p = g.min_p.value_or(0.0);
  }
  r.sampling.repetition_penalty = g.repetition_penalty.value_or(1.0);
  if (double t = absl::GetFlag(FLAGS_temperature); t != -1) r.sampling.temperature = t;
  if (int64_t k = absl::GetFlag(FLAGS_top_k); k != -1) r.sampling.top_k = k;
  if (double p = absl::GetFlag(FLAGS_top_p); p != -1) r.sampling.top_p = p;
  if (double p = absl::GetFlag(FLAGS_min_p); p != -1) r.sampling.min_p = p;
  if (double p = absl::GetFlag(FLAGS_repetition_penalty); p != -1) {
    r.sampling.repetition_penalty = p;
  }
  if (int64_t seed = absl::GetFlag(FLAGS_seed); seed >= 0) {
    r.sampling.seed = static_cast<uint64_t>(seed);
  }
  r.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);  // else the engine adds the model's eos
  r.stop_strings = absl::GetFlag(FLAGS_stop);
  r.logprobs = absl::GetFlag(FLAGS_logprobs);
  // Structured output: at most one of --json_schema FILE, --regex R, --grammar FILE.
  const std::string schema_file = absl::GetFlag(FLAGS_json_schema);
  const std::string regex = absl::GetFlag(FLAGS_regex);
  const std::string grammar_file = absl::GetFlag(FLAGS_grammar);
  if (static_cast<int>(!schema_file.empty()) + !regex.empty() + !grammar_file.empty() > 1) {
    return absl::InvalidArgumentError("give at most one of --json_schema, --regex and --grammar");
  }
  accel::engine::StructuredOutputs structured;
  if (!schema_file.empty()) {
    ACCEL_ASSIGN_OR_RETURN(structured.json_schema, accel::ReadRegularFile(schema_file, 16 << 20));
    structured.field = "--json_schema=" + schema_file;
    r.structured = structured;
  } else if (!grammar_file.empty()) {
    ACCEL_ASSIGN_OR_RETURN(structured.grammar, accel::ReadRegularFile(grammar_file, 16 << 20));
    structured.field = "--grammar=" + grammar_file;
    r.structured = structured;
  } else if (!regex.empty()) {
    structured.regex = regex;
    structured.field = "--regex";
    r.structured = structured;
  }
  return r;
}

// Collects the tokens on the engine's thread, printing the text as it comes.
class PrintingSink : public accel::engine::RequestSink {
 public:
  explicit PrintingSink(bool print) : print_(print) {}
  void OnTokens(accel::engine::TokenChunk chunk) override {
    absl::MutexLock lock(&mu_);
    if (token_ids_.empty()) first_token_ = Clock::now();
    token_ids_.insert(token_ids_.end(), chunk.token_ids.begin(), chunk.token_ids.end());
    logprobs_.insert(logprobs_.end(), chunk.logprobs.begin(), chunk.logprobs.end());
    text_ += chunk.text;
    if (print_) std::cout << chunk.text << std::flush;
  }
  void OnDone(const absl::Status& status, const accel::engine::Completion& completion) override {
    {
      absl::MutexLock lock(&mu_);
      status_ = status;
      completion_ = completion;
      end_ = Clock::now();
    }
    done_.Notify();
  }
  void Wait() { done_.WaitForNotification(); }

  absl::Mutex mu_;
  std::vector<int64_t> token_ids_ ABSL_GUARDED_BY(mu_);
  std::vector<float> logprobs_ ABSL_GUARDED_BY(mu_);
  std::string text_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  accel::engine::Completion completion_ ABSL_GUARDED_BY(mu_);
  Clock::time_point first_token_ ABSL_GUARDED_BY(mu_);
  Clock::time_point end_ ABSL_GUARDED_BY(mu_);

 private:
  const bool print_;
  absl::Notification done_;
};

FinishReason ToFinishReason(accel::engine::Finish finish) {
  switch (finish) {
    case accel::engine::Finish::kEos:
      return FinishReason::kEos;
    case accel::engine::Finish::kStop:
      return FinishReason::kStop;
    default:
      return FinishReason::kLength;
  }
}

// A rank of a parallel run (engine/parallel_run.h) other than the leader:
// loads its slice and runs the leader's steps until it stops them. The exit
// status: 0 when stopped by the leader, 4 when the group broke.
int RunWorkerRank(const accel::engine::EngineOptions& options,
                  const accel::dist::RankLayout& layout, accel::dist::ProcessGroup& group) {
  accel::SetIntraOpThreads(options.threads);  // as the leader's engine does
  accel::models::ModelLoadOptions load = options.load;
  load.progress = accel::Progress::Style::kSilent;
  absl::StatusOr<accel::models::LoadedModel> shard =
      accel::models::LoadModel(options.model_dir, load);
  if (!shard.ok()) return Fail(shard.status());
  const absl::Status ran =
      accel::models::RunTensorParallelWorker(*shard->model, shard->dispatched.get(), group);
  if (!ran.ok()) {
    std::cerr << "accel-generate: worker rank " << layout.rank << ": " << ran.message() << "\n";
    return 4;
  }
  return 0;
}

int Run(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "accel-generate [--model DIR] (--prompt TEXT [--chat] [--system TEXT] | --input_ids 1,2,3) "
      "[flags]\n"
      "Loads the model as accel-serve does (device map, offload, dtype) and generates.\n"
      "  accel-generate --model /tmp/tiny --prompt 'Once upon a time' --max_new_tokens 20\n"
      "  accel-generate --model DIR --input_ids 1,2,3 --temperature 0.8 --seed 1 --json");
  accel::engine::EngineArgs::RegisterFlags();
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 1) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("unexpected argument '", args[1], "' (see --help)")));
  }
  // The engine's and the load options, checked before anything is read.
  auto resolved = accel::engine::EngineArgs::FromFlags().Resolve();
  if (!resolved.ok()) return Fail(resolved.status());
  accel::engine::EngineOptions options = *std::move(resolved);
  const std::string dir = options.model_dir;
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  const std::string ids_text = absl::GetFlag(FLAGS_input_ids);
  if (prompt.empty() == ids_text.empty()) {
    return Fail(absl::InvalidArgumentError("give exactly one of --prompt TEXT or --input_ids"));
  }

  // One model over several processes (--tensor_parallel_size /
  // --pipeline_parallel_size), as accel-serve runs it: on one machine this
  // process is rank 0 and starts the others (this binary, these flags); each
  // loads its slice, rank 0's engine drives the steps. Declared before the
  // engine, so that the engine (whose leader stops the workers) goes first.
  absl::StatusOr<accel::dist::RankLayout> layout =
      accel::dist::ResolveRankLayout(options.parallel, accel::dist::ProcessEnv());
  if (!layout.ok()) return Fail(layout.status());
  accel::engine::ParallelRun parallel_run;
  if (layout->world_size > 1) {
    absl::Status joined = accel::engine::CheckParallelSplit(options);
    if (joined.ok()) {
      joined = accel::engine::StartLocalRanks(*layout, std::vector<std::string>(argv, argv + argc),
                                              parallel_run);
    }
    if (joined.ok()) joined = accel::engine::JoinParallelGroups(*layout, options, parallel_run);
    if (!joined.ok()) return Fail(joined);
    if (!layout->leader()) return RunWorkerRank(options, *layout, *parallel_run.group);
  }

  // The tokenizer first: a bad one fails before minutes of loading (the
  // engine reads it again).
  std::optional<accel::tokenizer::Tokenizer> tokenizer;
  const std::string tokenizer_path = dir + "/tokenizer.json";
  if (std::filesystem::exists(tokenizer_path)) {
    auto loaded = accel::tokenizer::Tokenizer::FromFile(tokenizer_path);
    if (!loaded.ok()) return Fail(loaded.status());
    tokenizer.emplace(*std::move(loaded));
  } else if (!prompt.empty()) {
    return Fail(absl::NotFoundError(
        absl::StrCat(tokenizer_path, " does not exist: --prompt needs it (or give --input_ids)")));
  }
  const bool chat = absl::GetFlag(FLAGS_chat) || !absl::GetFlag(FLAGS_system).empty();
  if (chat && prompt.empty()) {
    return Fail(
        absl::InvalidArgumentError("--chat and --system need --prompt (the user's message)"));
  }
  accel::loader::GenerationConfig generation_config;
  if (std::filesystem::exists(dir + "/generation_config.json")) {
    auto read = accel::loader::ReadGenerationConfig(dir + "/generation_config.json");
    if (!read.ok()) return Fail(read.status());
    generation_config = *std::move(read);
  }
  auto request = MakeRequest(generation_config);
  if (!request.ok()) return Fail(request.status());
  if (chat) {
    // Checked before the weights load; the engine renders it.
    auto chat_template = accel::tokenizer::ChatTemplate::FromModelDir(dir);
    if (!chat_template.ok()) return Fail(accel::Annotate(chat_template.status(), "--chat"));
    nlohmann::json messages = nlohmann::json::array();
    if (const std::string system = absl::GetFlag(FLAGS_system); !system.empty()) {
      messages.push_back({{"role", "system"}, {"content", system}});
    }
    messages.push_back({{"role", "user"}, {"content", prompt}});
    accel::engine::ChatInput input;
    input.messages_json = messages.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    request->chat = std::move(input);
  } else if (!prompt.empty()) {
    auto encoded = tokenizer->Encode(prompt, absl::GetFlag(FLAGS_add_special_tokens));
    if (!encoded.ok()) return Fail(accel::Annotate(encoded.status(), "--prompt"));
    request->prompt_ids = *std::move(encoded);
  } else {
    auto parsed = ParseIds(ids_text);
    if (!parsed.ok()) return Fail(parsed.status());
    request->prompt_ids = *std::move(parsed);
  }

  const auto load_start = Clock::now();
  auto engine = accel::engine::LlmEngine::Load(options, /*stats=*/nullptr);
  if (!engine.ok()) return Fail(engine.status());
  const double load_seconds = std::chrono::duration<double>(Clock::now() - load_start).count();
  if (const accel::engine::ModelInfo& info = (*engine)->info(); info.disk_weight_bytes > 0) {
    std::cerr << absl::StrFormat(
        "accel-generate: loaded in %.2f s; %s of weights on disk, read as used%s; in memory: %s "
        "of weights, %s expert cache, %s read-ahead, %s KV (budget %s)\n",
        load_seconds, accel::FormatBytes(info.disk_weight_bytes),
        info.direct_reads ? " (O_DIRECT)" : "", accel::FormatBytes(info.resident_weight_bytes),
        accel::FormatBytes(info.expert_cache_bytes), accel::FormatBytes(info.read_buffer_bytes),
        accel::FormatBytes(std::max<int64_t>(0, info.planned_kv_cache_bytes)),
        accel::FormatBytes(info.memory_budget_bytes));
  }

  // On a GPU, how --gpu_memory_utilization sized the KV cache (the device's
  // figures), on stderr: the device script records it.
  if (const accel::engine::ModelInfo& info = (*engine)->info();
      absl::StartsWith(info.kv_sizing, "--gpu_memory_utilization")) {
    std::cerr << "accel-generate: KV cache: " << info.kv_blocks << " blocks; " << info.kv_sizing
              << "\n";
  }

  if (const std::vector<int64_t>& buckets = (*engine)->info().cuda_graph_buckets;
      !buckets.empty()) {
    std::cerr << "accel-generate: decode steps of up to " << buckets.back()
              << " sequences replay CUDA graphs (" << buckets.size() << " batch buckets)\n";
  }

  // Generation ends at the model's context whatever --max_new_tokens says.
  const int64_t room =
      (*engine)->info().max_total_tokens - static_cast<int64_t>(request->prompt_ids.size());
  if (!request->prompt_ids.empty() && room >= 1) {
    request->max_new_tokens = std::min(request->max_new_tokens, room);
  }
  const bool json = absl::GetFlag(FLAGS_json);
  const bool logprobs = request->logprobs;
  auto sink = std::make_shared<PrintingSink>(/*print=*/!json);
  const auto start = Clock::now();
  auto submitted = (*engine)->Submit(*std::move(request), sink);
  if (!submitted.ok())
    return Fail(chat ? accel::Annotate(submitted.status(), "--chat") : submitted.status());
  sink->Wait();
  absl::MutexLock lock(&sink->mu_);
  if (!sink->status_.ok()) return Fail(sink->status_);
  const std::vector<int64_t>& token_ids = sink->token_ids_;
  const FinishReason finish = ToFinishReason(sink->completion_.finish);
  const double prefill = std::chrono::duration<double>(sink->first_token_ - start).count();
  const double decode = std::chrono::duration<double>(sink->end_ - sink->first_token_).count();
  const int64_t decoded = static_cast<int64_t>(token_ids.size()) - 1;
  if (json) {
    nlohmann::json out = {{"token_ids", token_ids},
                          {"text", sink->text_},
                          {"finish_reason", std::string(FinishReasonName(finish))}};
    if (logprobs) out["logprobs"] = sink->logprobs_;
    // Invalid UTF-8 cannot come out of the decoder; replace rather than throw regardless.
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::cout << "\n";
  }
  std::cerr << absl::StrFormat(
      "accel-generate: loaded in %.2f s; prompt %d tokens in %.3f s; %d tokens generated "
      "(finish: %s), %.2f tokens/s after the first\n",
      load_seconds, sink->completion_.prompt_tokens, prefill, token_ids.size(),
      FinishReasonName(finish),
      decoded > 0 && decode > 0 ? static_cast<double>(decoded) / decode : 0.0);
  const accel::engine::EngineStats engine_stats = (*engine)->loop().snapshot().engine;
  if (engine_stats.spec_num_draft_tokens > 0) {
    std::cerr << absl::StrFormat(
        "accel-generate: speculative decoding (%s): %d drafted tokens, %d accepted (%.1f%%), "
        "%.2f tokens a step\n",
        (*engine)->info().speculative_method, engine_stats.spec_num_draft_tokens,
        engine_stats.spec_num_accepted_tokens,
        100.0 * static_cast<double>(engine_stats.spec_num_accepted_tokens) /
            static_cast<double>(engine_stats.spec_num_draft_tokens),
        engine_stats.steps > 0
            ? static_cast<double>(token_ids.size()) / static_cast<double>(engine_stats.steps)
            : 0.0);
  }
  const accel::dispatch::OffloadStats stats = (*engine)->offload_stats();
  if (stats.fetches > 0 || stats.expert_fetches > 0 || stats.expert_cache_hits > 0) {
    const double tokens = static_cast<double>(std::max<size_t>(token_ids.size(), 1));
    std::cerr << absl::StrFormat(
        "accel-generate: offload: %d module fetches, %d experts read, %d expert cache hits "
        "(%d read ahead), %s read from disk and %s used in place from its mapping (%s a "
        "token), %s dropped behind to keep the cpu budget\n",
        stats.fetches, stats.expert_fetches, stats.expert_cache_hits, stats.expert_prefetch_hits,
        accel::FormatBytes(stats.bytes_read), accel::FormatBytes(stats.bytes_mapped),
        accel::FormatBytes(static_cast<int64_t>(
            static_cast<double>(stats.bytes_read + stats.bytes_mapped) / tokens)),
        accel::FormatBytes(stats.bytes_dropped));
    if (stats.expert_fetches > 0) {
      std::cerr << absl::StrFormat(
          "accel-generate: experts: %.2f s waited for by the forward, %.2f s spent reading "
          "(%.2f GB/s), %d guesses read, %d of them used, %s read again after the kernel "
          "reclaimed them, %d evicted ones dropped from the page cache to keep memory free\n",
          static_cast<double>(stats.expert_wait_us) / 1e6,
          static_cast<double>(stats.expert_read_us) / 1e6,
          stats.expert_read_us > 0 ? static_cast<double>(stats.expert_bytes_read) /
                                         static_cast<double>(stats.expert_read_us) / 1e3
                                   : 0.0,
          stats.expert_guess_reads, stats.expert_guess_hits,
          accel::FormatBytes(stats.expert_bytes_reread), stats.expert_units_uncached);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return accel::ToolMain("accel-generate", argc, argv, Run); }
