// Structured output's cost in decoding: tokens/s of the engine with a
// json_schema against without, in one run, at batch 1 and 8, on a model with
// Llama 3's 128,256-token vocabulary (random weights, Llama 3's real
// tokenizer.json, so the grammar masks a real vocabulary). Unconstrained
// requests run to --tokens; constrained ones end where the JSON ends (a
// random model writes whatever the mask leaves it), so the figure compared is
// generated tokens per second of wall time. The schema is compiled and its
// masks cached by one untimed request first (steady-state serving); the
// first, cold request is reported on its own.
//
// Whole runs of a few seconds swing by more than the 10% at stake on a shared
// machine, so the two are also timed step by step (InterleavedSteps): two
// engine cores over the same weights, one with every row under the schema and
// one without, each kept at `batch` running rows (a finished request is
// replaced at once), their steps alternating (which goes first swaps each
// step), so that a change of the machine's load falls on both; the ratio is
// of the median step times, each step giving every running row one token.
//
//   build/bin/accel-bench-structured build/tok/llama3.tokenizer.json
//       [--hidden 512] [--layers 4] [--tokens 96] [--rounds 3] [--dir DIR]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

#include "bench/bench_util.h"
#include "bench/record_schema.h"
#include "engine/engine_core.h"
#include "engine/grammar_logits_processor.h"
#include "engine/llm_engine.h"
#include "engine/model_runner.h"
#include "engine/structured_output.h"
#include "models/load_model.h"
#include "models/make_model.h"
#include "tokenizer/tokenizer.h"

namespace {

using accel::engine::Completion;
using accel::engine::GenerationRequest;
using accel::engine::LlmEngine;
using accel::engine::RequestSink;
using accel::engine::TokenChunk;
using Clock = std::chrono::steady_clock;

class CountingSink : public RequestSink {
 public:
  void OnTokens(TokenChunk chunk) override {
    absl::MutexLock lock(&mu_);
    tokens_ += static_cast<int64_t>(chunk.token_ids.size());
  }
  void OnDone(const absl::Status& status, const Completion&) override {
    if (!status.ok()) std::fprintf(stderr, "request failed: %s\n", status.ToString().c_str());
    done_.Notify();
  }
  int64_t Wait() {
    done_.WaitForNotification();
    absl::MutexLock lock(&mu_);
    return tokens_;
  }

 private:
  absl::Mutex mu_;
  int64_t tokens_ = 0;
  absl::Notification done_;
};

// Generated tokens per second of `batch` requests run together.
double Run(LlmEngine& engine, int batch, int64_t tokens, bool constrained, int64_t* generated) {
  std::vector<std::shared_ptr<CountingSink>> sinks;
  const auto start = Clock::now();
  for (int i = 0; i < batch; ++i) {
    GenerationRequest r;
    r.prompt = "Write a JSON record of a person number " + std::to_string(i) + ":";
    r.max_new_tokens = tokens;
    r.sampling.temperature = 1.0;
    r.sampling.seed = 1000 + i;
    if (constrained) {
      accel::engine::StructuredOutputs s;
      s.json_schema = accel::bench::kRecordSchema;
      r.structured = s;
    } else {
      r.ignore_eos = true;
    }
    sinks.push_back(std::make_shared<CountingSink>());
    if (absl::Status s = engine.Submit(r, sinks.back()).status(); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      std::exit(1);
    }
  }
  int64_t total = 0;
  for (auto& sink : sinks) total += sink->Wait();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  *generated = total;
  return static_cast<double>(total) / seconds;
}

template <typename T>
T Check(absl::StatusOr<T> v) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s\n", v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}

struct StepTimes {
  double plain = 0;  // median seconds a step, no schema
  double json = 0;   // the same, every row under the schema
  int64_t steps = 0;
  int64_t json_requests = 0;  // constrained requests started (each ends where its JSON ends)
};

// Two engine cores over one model, `batch` rows each, stepped alternately for
// `steps` steps; see the file comment.
StepTimes InterleavedSteps(accel::models::LoadedModel& model,
                           const accel::tokenizer::Tokenizer& tokenizer, int batch, int64_t steps,
                           int64_t eos) {
  using accel::engine::EngineCore;
  using accel::engine::ModelRunner;
  using accel::engine::ModelRunnerOptions;
  auto compiler = std::make_shared<accel::engine::StructuredOutputCompiler>(tokenizer, 128256);
  accel::engine::StructuredOutputs schema;
  schema.json_schema = accel::bench::kRecordSchema;
  const auto compiled = Check(compiler->Compile(schema));
  ModelRunnerOptions constrained;
  constrained.logits_processors = [&](const GenerationRequest& r) {
    return accel::engine::MakeGrammarLogitsProcessor(compiled, r.stop_token_ids,
                                                     static_cast<int64_t>(r.prompt_ids.size()));
  };
  EngineCore plain(Check(ModelRunner::Create(model.model, model.dispatched.get(), {})), nullptr);
  EngineCore json(
      Check(ModelRunner::Create(model.model, model.dispatched.get(), std::move(constrained))),
      nullptr);
  StepTimes out;
  int64_t next = 0;
  auto fill = [&](EngineCore& core, bool constrained_rows) {
    while (core.num_requests() < static_cast<size_t>(batch)) {
      GenerationRequest r;
      const std::string prompt =
          "Write a JSON record of a person number " + std::to_string(next++) + ":";
      r.prompt_ids = Check(tokenizer.Encode(prompt, true));
      r.max_new_tokens = 200;
      r.sampling.temperature = 1.0;
      r.sampling.seed = 1000 + next;
      if (constrained_rows) {
        r.stop_token_ids = {eos};
        ++out.json_requests;
      }
      Check(core.Add(std::move(r)));
    }
  };
  fill(plain, false);
  fill(json, true);
  Check(plain.Step());  // the prompts
  Check(json.Step());
  std::vector<double> plain_steps;
  std::vector<double> json_steps;
  for (int64_t step = 0; step < steps; ++step) {
    auto time = [&](EngineCore& core, bool constrained_rows, std::vector<double>& into) {
      fill(core, constrained_rows);
      into.push_back(accel::bench::Seconds([&] { Check(core.Step()); }));
    };
    if (step % 2 == 0) {
      time(plain, false, plain_steps);
      time(json, true, json_steps);
    } else {
      time(json, true, json_steps);
      time(plain, false, plain_steps);
    }
  }
  out.plain = accel::bench::Median(plain_steps);
  out.json = accel::bench::Median(json_steps);
  out.steps = steps;
  return out;
}

std::string Arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == "--" + name) return argv[i + 1];
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]).rfind("--", 0) == 0) {
    std::fprintf(
        stderr,
        "usage: %s LLAMA3_TOKENIZER_JSON [--hidden N] [--layers N] [--tokens N] [--rounds N] "
        "[--dir DIR]\n",
        argv[0]);
    return 2;
  }
  const std::string tokenizer_json = argv[1];
  const int64_t hidden = std::stoll(Arg(argc, argv, "hidden", "512"));
  const int64_t layers = std::stoll(Arg(argc, argv, "layers", "4"));
  const int64_t tokens = std::stoll(Arg(argc, argv, "tokens", "96"));
  const int64_t rounds = std::max<int64_t>(1, std::stoll(Arg(argc, argv, "rounds", "3")));
  const std::string dir =
      Arg(argc, argv, "dir",
          (std::filesystem::temp_directory_path() / "accel-bench-structured").string());
  accel::models::MakeModelOptions o;
  o.vocab_size = 128256;
  o.hidden_size = hidden;
  o.num_layers = layers;
  o.num_heads = 8;
  o.num_kv_heads = 4;
  o.max_position_embeddings = 2048;
  if (auto made = accel::models::MakeModel(dir, o); !made.ok()) {
    std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
    return 1;
  }
  // Llama 3's real vocabulary in place of the one accel-make-model trained
  // (eos stays id 128255, one of Llama 3's reserved special tokens).
  std::filesystem::copy_file(tokenizer_json, dir + "/tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  accel::engine::EngineOptions e;
  e.model_dir = dir;
  e.load.device_map = "cpu";
  e.kv_cache_memory = "256MiB";
  auto engine = LlmEngine::Load(e, nullptr);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  int64_t n = 0;
  const auto cold_start = Clock::now();
  Run(**engine, 1, tokens, true, &n);
  const double cold = std::chrono::duration<double>(Clock::now() - cold_start).count();
  std::printf(
      "model: llama, hidden %lld, %lld layers, vocabulary 128256; up to %lld tokens a request\n",
      static_cast<long long>(hidden), static_cast<long long>(layers),
      static_cast<long long>(tokens));
  std::printf("first request with the schema (compile, cold masks): %.2f s for %lld tokens\n", cold,
              static_cast<long long>(n));
  // Rounds alternate the two, and each figure is the median over rounds:
  // the machine is shared, and a neighbour's build in one run would
  // otherwise decide the ratio.
  for (int batch : {1, 8}) {
    std::vector<double> plain;
    std::vector<double> json;
    int64_t plain_n = 0;
    int64_t json_n = 0;
    for (int64_t round = 0; round < rounds; ++round) {
      plain.push_back(Run(**engine, batch, tokens, false, &plain_n));
      json.push_back(Run(**engine, batch, tokens, true, &json_n));
    }
    std::string each;
    for (int64_t round = 0; round < rounds; ++round) {
      each += (round ? ", " : "") + std::to_string(json[round] / plain[round]).substr(0, 4);
    }
    const double base = accel::bench::Median(plain);
    const double with = accel::bench::Median(json);
    std::printf(
        "batch %d: without %.1f tok/s (%lld tokens), with json_schema %.1f tok/s (%lld tokens): "
        "%.2fx (medians of %lld rounds; each round's ratio: %s)\n",
        batch, base, static_cast<long long>(plain_n), with, static_cast<long long>(json_n),
        with / base, static_cast<long long>(rounds), each.c_str());
  }
  engine->reset();  // its weights and KV memory, before the step-by-step cores load their own

  accel::models::ModelLoadOptions load;
  load.device_map = "cpu";
  load.progress = accel::Progress::Style::kSilent;
  accel::models::LoadedModel model = Check(accel::models::LoadModel(dir, load));
  const accel::tokenizer::Tokenizer tokenizer =
      Check(accel::tokenizer::Tokenizer::FromFile(dir + "/tokenizer.json"));
  for (int batch : {1, 8}) {
    std::vector<double> ratios;
    StepTimes last;
    for (int64_t round = 0; round < rounds; ++round) {
      last = InterleavedSteps(model, tokenizer, batch, tokens, 128255);
      ratios.push_back(last.plain / last.json);
    }
    const auto [lo, hi] = std::minmax_element(ratios.begin(), ratios.end());
    std::printf(
        "batch %d, steps interleaved: median step without %.2f ms, with json_schema %.2f ms (last "
        "round, %lld steps, %lld constrained requests) = %.3fx (median of %lld rounds, "
        "%.3f-%.3f)\n",
        batch, 1e3 * last.plain, 1e3 * last.json, static_cast<long long>(last.steps),
        static_cast<long long>(last.json_requests), accel::bench::Median(ratios),
        static_cast<long long>(rounds), *lo, *hi);
  }
  return 0;
}
