// Speculative decoding on the cpu: batch-1 greedy decode tokens/s with and
// without it, in one run, on the decode benchmark's two Llama shapes (about
// 1 GiB in float32, about 500 MB in bfloat16):
//   - prompt lookup on an extractive prompt (the answer repeats a span of the
//     prompt) and on a prompt where nothing repeats;
//   - a draft model of the same family about 10x smaller.
// Each figure is beside plain decoding of the same prompt measured in the
// same round; rounds alternate the cases, and medians are reported, with the
// acceptance rates and the tokens each step gave. The tokens are checked to
// be the same with and without speculation. Where nothing repeats, the two are
// also timed step by step, interleaved (see InterleavedSteps): on a shared
// machine whole runs swing more than the few percent that case is about.
//
// The models. Random weights neither copy their prompt nor agree with a
// smaller model of other random weights, and no trained model of these
// sizes is at hand offline; so the models are built to be predictable. A
// draft (hidden 384, 2 layers) has random layers, and its embedding and head
// are wired so that token t's most likely successor is pi(t) for a fixed
// random permutation pi (the head row of pi(t) is the embedding of t). The
// target has the decode benchmark's shape and random layers, with that
// embedding and head in the first 384 of its 1024 hidden dimensions (zero in
// the rest): its greedy text follows pi except where its 16-18 random layers
// tip the choice (`--embed_scale`, the embedding's scale against their
// outputs, sets how rarely). A second draft has noise added to its head
// (`--draft_noise`), so that it proposes the target's token less often: the
// two drafts show the speed at two acceptance rates. Every weight is read
// per token as in any model of these shapes, so the speeds are those of real
// models at these acceptance rates. The extractive prompt is a seed, the
// target's own continuation of it, and the seed again (the model answers by
// repeating what followed the seed); the prompt where nothing repeats is
// random ids, and pi's cycles are far longer than the text generated.
//
//   build/bin/accel-bench-spec [--tokens 96] [--rounds 3] [--k 4] [--embed_scale 64]
//       [--draft_noise 0.07] [--dtypes float32,bfloat16]
//       [--dir DIR]   (keeps the models there between runs)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/InferenceMode.h>

#include "bench/bench_util.h"
#include "core/bytes.h"
#include "core/dtype.h"
#include "core/malloc_tuning.h"
#include "core/threads.h"
#include "engine/engine_core.h"
#include "engine/model_runner.h"
#include "engine/ngram_proposer.h"
#include "loader/loader.h"
#include "models/load_model.h"
#include "models/make_model.h"

namespace {

using accel::engine::EngineCore;
using accel::engine::EngineStats;
using accel::engine::GenerationRequest;
using accel::engine::ModelRunner;
using accel::engine::ModelRunnerOptions;
using accel::engine::SpeculativeConfig;

constexpr int64_t kVocab = 32000;
constexpr int64_t kDraftHidden = 384;

[[noreturn]] void Die(const absl::Status& status) {
  std::fprintf(stderr, "accel-bench-spec: %s\n", status.ToString().c_str());
  std::exit(1);
}

template <typename T>
T Check(absl::StatusOr<T> v) {
  if (!v.ok()) Die(v.status());
  return *std::move(v);
}

// Rewrites `dir`'s checkpoint with `replaced` tensors in place of theirs.
void Rewrite(const std::string& dir, const std::map<std::string, at::Tensor>& replaced) {
  const accel::loader::Checkpoint ckpt = Check(accel::loader::Checkpoint::Open(dir));
  std::vector<accel::loader::TensorSpec> specs;
  for (const auto& entry : ckpt.tensors()) {
    const auto& info = entry.info;
    specs.push_back({info.name, Check(ckpt.Tensor(info.name)).scalar_type(), info.shape});
  }
  Check(accel::loader::WriteCheckpoint(
      dir, specs, [&](const accel::loader::TensorSpec& spec) -> absl::StatusOr<at::Tensor> {
        auto found = replaced.find(spec.name);
        if (found != replaced.end()) return found->second.to(spec.dtype).contiguous();
        return ckpt.Tensor(spec.name);
      }));
}

bool Made(const std::string& marker, const std::string& recipe) {
  if (!std::filesystem::exists(marker)) return false;
  std::ifstream in(marker);
  const std::string seen((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return seen == recipe;
}

accel::models::MakeModelOptions DraftShape(c10::ScalarType dtype) {
  accel::models::MakeModelOptions d;
  d.family = "llama";
  d.vocab_size = kVocab;
  d.hidden_size = kDraftHidden;
  d.intermediate_size = 1024;
  d.num_heads = 6;
  d.num_kv_heads = 2;
  d.num_layers = 2;
  d.max_position_embeddings = 2048;
  d.dtype = dtype;
  d.seed = 1;  // every draft starts from the same random weights
  return d;
}

// A draft's embedding (scaled) and its head wired to pi, with noise of
// standard deviation `noise` added to the head; returns the embedding
// (scaled) and the head (without noise) for the target.
std::pair<at::Tensor, at::Tensor> WireDraft(const std::string& dir, double embed_scale,
                                            double noise) {
  c10::InferenceMode inference;
  const accel::loader::Checkpoint draft = Check(accel::loader::Checkpoint::Open(dir));
  const at::Tensor embedding =
      Check(draft.Tensor("model.embed_tokens.weight")).to(at::kFloat).clone();
  // pi: a random permutation; the head row of pi(t) is t's embedding.
  std::vector<int64_t> pi(kVocab);
  std::iota(pi.begin(), pi.end(), 0);
  std::shuffle(pi.begin(), pi.end(), std::mt19937_64(7));
  std::vector<int64_t> from(kVocab);
  for (int64_t t = 0; t < kVocab; ++t) from[static_cast<size_t>(pi[static_cast<size_t>(t)])] = t;
  const at::Tensor head = embedding.index_select(0, at::tensor(from, at::kLong));
  const at::Tensor scaled = embedding * embed_scale;
  at::Tensor noisy = head.clone();
  if (noise > 0) {
    std::mt19937_64 gen(11);
    std::normal_distribution<float> normal(0.0f, static_cast<float>(noise));
    float* p = noisy.data_ptr<float>();
    for (int64_t i = 0; i < noisy.numel(); ++i) p[i] += normal(gen);
  }
  Rewrite(dir, {{"model.embed_tokens.weight", scaled}, {"lm_head.weight", noisy}});
  return {scaled, head};
}

// The target and the two drafts of one dtype (see the top of the file),
// made once into dir/target, dir/draft and dir/noisy-draft.
void MakeModels(const std::string& dir, c10::ScalarType dtype, int64_t target_bytes,
                double embed_scale, double draft_noise) {
  const std::string recipe = "embed_scale=" + std::to_string(embed_scale) + "\n";
  if (!Made(dir + "/models.txt", recipe)) {
    std::filesystem::remove_all(dir);
    Check(accel::models::MakeModel(dir + "/draft", DraftShape(dtype)));
    accel::models::MakeModelOptions t;
    t.family = "llama";
    t.vocab_size = kVocab;
    t.hidden_size = 1024;
    t.intermediate_size = 2816;  // as accel-bench-decode's
    t.num_heads = 16;
    t.num_kv_heads = 4;
    t.max_position_embeddings = 2048;
    t.dtype = dtype;
    t.target_bytes = target_bytes;
    Check(accel::models::MakeModel(dir + "/target", t));
    const auto [embedding, head] = WireDraft(dir + "/draft", embed_scale, 0);
    c10::InferenceMode inference;
    at::Tensor wide_embedding = at::zeros({kVocab, 1024}, at::kFloat);
    wide_embedding.narrow(1, 0, kDraftHidden).copy_(embedding);
    at::Tensor wide_head = at::zeros({kVocab, 1024}, at::kFloat);
    wide_head.narrow(1, 0, kDraftHidden).copy_(head);
    Rewrite(dir + "/target",
            {{"model.embed_tokens.weight", wide_embedding}, {"lm_head.weight", wide_head}});
    std::ofstream(dir + "/models.txt") << recipe;
  }
  const std::string noisy = recipe + "draft_noise=" + std::to_string(draft_noise) + "\n";
  if (!Made(dir + "/noisy.txt", noisy)) {
    std::filesystem::remove_all(dir + "/noisy-draft");
    Check(accel::models::MakeModel(dir + "/noisy-draft", DraftShape(dtype)));
    WireDraft(dir + "/noisy-draft", embed_scale, draft_noise);
    std::ofstream(dir + "/noisy.txt") << noisy;
  }
}

accel::models::LoadedModel Load(const std::string& dir) {
  accel::models::ModelLoadOptions options;
  options.device_map = "cpu";
  options.progress = accel::Progress::Style::kSilent;
  return Check(accel::models::LoadModel(dir, options));
}

double WeightBytes(const accel::models::LoadedModel& m) {
  double bytes = 0;
  for (const auto& t : m.model->named_parameters())
    bytes += static_cast<double>(t.value().nbytes());
  return bytes;
}

double CpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Run {
  double tokens_per_s = 0;
  double cpu_per_token = 0;  // process cpu seconds (every thread) a token
  std::vector<int64_t> tokens;
  EngineStats stats;
};

// Greedy decode of `prompt` for `tokens` tokens at batch 1; the speed counts
// the steps after the first (which reads the prompt).
Run Decode(accel::models::LoadedModel& target, accel::models::LoadedModel* draft,
           const SpeculativeConfig& spec, const std::vector<int64_t>& prompt, int64_t tokens) {
  ModelRunnerOptions options;
  options.speculative = spec;
  if (draft != nullptr) {
    options.draft_model = draft->model;
    options.draft_dispatched = draft->dispatched.get();
  }
  EngineCore core(Check(ModelRunner::Create(target.model, target.dispatched.get(), options)),
                  nullptr);
  GenerationRequest r;
  r.prompt_ids = prompt;
  r.max_new_tokens = tokens;  // no stop tokens: exactly this many
  Check(core.Add(r));
  Run run;
  auto take = [&] {
    for (const auto& e : Check(core.Step())) run.tokens.push_back(e.token_id);
  };
  take();  // the prompt
  const size_t first = run.tokens.size();
  const double cpu = CpuSeconds();
  const double seconds = accel::bench::Seconds([&] {
    while (core.num_requests() > 0) take();
  });
  run.tokens_per_s = static_cast<double>(run.tokens.size() - first) / seconds;
  run.cpu_per_token = (CpuSeconds() - cpu) / static_cast<double>(run.tokens.size() - first);
  run.stats = core.stats();
  return run;
}

// Where nothing repeats a speculative step is a plain step plus the search,
// so the two are measured step by step: two engines over the same weights
// decode the same prompt, their steps alternating (which goes first swaps
// each step), so that a change of the machine's load falls on both; the
// figures are the medians of the steps' times. Returns {plain, speculative}
// median seconds a step.
std::pair<double, double> InterleavedSteps(accel::models::LoadedModel& target,
                                           const SpeculativeConfig& spec,
                                           const std::vector<int64_t>& prompt, int64_t tokens) {
  ModelRunnerOptions speculative;
  speculative.speculative = spec;
  EngineCore plain(Check(ModelRunner::Create(target.model, target.dispatched.get(), {})), nullptr);
  EngineCore fast(Check(ModelRunner::Create(target.model, target.dispatched.get(), speculative)),
                  nullptr);
  GenerationRequest r;
  r.prompt_ids = prompt;
  r.max_new_tokens = tokens;
  Check(plain.Add(r));
  Check(fast.Add(r));
  Check(plain.Step());  // the prompts
  Check(fast.Step());
  std::vector<double> plain_steps, fast_steps;
  for (int step = 0; plain.num_requests() > 0 || fast.num_requests() > 0; ++step) {
    auto time = [](EngineCore& core, std::vector<double>& into) {
      if (core.num_requests() == 0) return;
      into.push_back(accel::bench::Seconds([&] { Check(core.Step()); }));
    };
    if (step % 2 == 0) {
      time(plain, plain_steps);
      time(fast, fast_steps);
    } else {
      time(fast, fast_steps);
      time(plain, plain_steps);
    }
  }
  return {accel::bench::Median(plain_steps), accel::bench::Median(fast_steps)};
}

double Acceptance(const EngineStats& s) {
  return s.spec_num_draft_tokens > 0 ? static_cast<double>(s.spec_num_accepted_tokens) /
                                           static_cast<double>(s.spec_num_draft_tokens)
                                     : 0.0;
}

// Tokens each step gave after the prompt's.
double PerStep(const Run& r) {
  return static_cast<double>(r.tokens.size() - 1) / static_cast<double>(r.stats.steps - 1);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 96;
  int rounds = 3;
  int64_t k = 4;
  double embed_scale = 64;
  double draft_noise = 0.07;
  std::string root;
  std::string dtypes = "float32,bfloat16";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--tokens") {
      tokens = std::atoll(argv[i + 1]);
    } else if (flag == "--rounds") {
      rounds = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--k") {
      k = std::atoll(argv[i + 1]);
    } else if (flag == "--embed_scale") {
      embed_scale = std::atof(argv[i + 1]);
    } else if (flag == "--draft_noise") {
      draft_noise = std::atof(argv[i + 1]);
    } else if (flag == "--dir") {
      root = argv[i + 1];
    } else if (flag == "--dtypes") {
      dtypes = argv[i + 1];
    } else {
      std::fprintf(stderr,
                   "usage: accel-bench-spec [--tokens N] [--rounds R] [--k K] [--embed_scale S] "
                   "[--draft_noise N] [--dtypes float32,bfloat16] [--dir DIR]\n");
      return 2;
    }
  }
  const bool own_root = root.empty();
  if (own_root) root = (std::filesystem::temp_directory_path() / "accel-bench-spec").string();
  std::filesystem::create_directories(root);
  accel::KeepFreedMemoryForReuse();
  const int threads = accel::SetIntraOpThreads(0);
  std::printf(
      "accel-bench-spec: %d threads, %lld tokens a run, k = %lld, embed scale %.1f, draft noise "
      "%.3f\n",
      threads, static_cast<long long>(tokens), static_cast<long long>(k), embed_scale, draft_noise);
  std::fflush(stdout);

  SpeculativeConfig lookup;
  lookup.method = SpeculativeConfig::Method::kNgram;
  lookup.num_speculative_tokens = k;
  lookup.prompt_lookup_min = 2;
  lookup.prompt_lookup_max = 4;
  SpeculativeConfig drafting;
  drafting.method = SpeculativeConfig::Method::kDraftModel;
  drafting.num_speculative_tokens = k;
  drafting.model = "draft";

  struct Case {
    const char* name;
    c10::ScalarType dtype;
    int64_t bytes;
  };
  for (const Case& c : {Case{"float32", c10::ScalarType::Float, int64_t{1} << 30},
                        Case{"bfloat16", c10::ScalarType::BFloat16, 500'000'000}}) {
    if (dtypes.find(c.name) == std::string::npos) continue;
    const std::string dir = root + "/" + c.name;
    MakeModels(dir, c.dtype, c.bytes, embed_scale, draft_noise);
    accel::models::LoadedModel target = Load(dir + "/target");
    accel::models::LoadedModel draft = Load(dir + "/draft");
    accel::models::LoadedModel noisy = Load(dir + "/noisy-draft");
    // The extractive prompt: a seed, the target's own continuation of it,
    // and the seed again. Nothing repeats in the other: distinct random ids.
    std::mt19937_64 rng(3);
    std::vector<int64_t> seed;
    for (int i = 0; i < 16; ++i) seed.push_back(static_cast<int64_t>(rng() % kVocab));
    const Run continuation = Decode(target, nullptr, {}, seed, tokens);
    std::vector<int64_t> extractive = seed;
    extractive.insert(extractive.end(), continuation.tokens.begin(), continuation.tokens.end());
    extractive.insert(extractive.end(), seed.begin(), seed.end());
    std::vector<int64_t> fresh;
    std::set<int64_t> used;
    while (fresh.size() < 48) {
      const int64_t id = static_cast<int64_t>(rng() % kVocab);
      if (used.insert(id).second) fresh.push_back(id);
    }
    struct Measure {
      const char* name;
      const std::vector<int64_t>* prompt;
      const SpeculativeConfig* spec;
      accel::models::LoadedModel* draft;
      std::vector<double> plain, fast, ratio, cpu_ratio;
      double acceptance = 0, per_step = 0;
      bool same = true;
    };
    std::vector<Measure> measures = {
        {"prompt lookup, extractive prompt", &extractive, &lookup, nullptr, {}, {}, {}, {}},
        {"prompt lookup, nothing repeats", &fresh, &lookup, nullptr, {}, {}, {}, {}},
        {"draft model", &fresh, &drafting, &draft, {}, {}, {}, {}},
        {"noisier draft model", &fresh, &drafting, &noisy, {}, {}, {}, {}},
    };
    for (int round = 0; round < rounds; ++round) {
      for (Measure& m : measures) {
        // Plain first in even rounds, speculative first in odd ones, so a
        // drift of the machine's load within a pair falls on both sides.
        Run plain, fast;
        if (round % 2 == 0) {
          plain = Decode(target, nullptr, {}, *m.prompt, tokens);
          fast = Decode(target, m.draft, *m.spec, *m.prompt, tokens);
        } else {
          fast = Decode(target, m.draft, *m.spec, *m.prompt, tokens);
          plain = Decode(target, nullptr, {}, *m.prompt, tokens);
        }
        m.cpu_ratio.push_back(plain.cpu_per_token / fast.cpu_per_token);
        m.plain.push_back(plain.tokens_per_s);
        m.fast.push_back(fast.tokens_per_s);
        m.ratio.push_back(fast.tokens_per_s / plain.tokens_per_s);
        m.acceptance = Acceptance(fast.stats);
        m.per_step = PerStep(fast);
        m.same = m.same && plain.tokens == fast.tokens;
      }
    }
    const double target_bytes = WeightBytes(target), draft_bytes = WeightBytes(draft);
    std::printf(
        "%s target: %d layers, %s of weights; draft: %d layers, %s (%.1fx smaller); "
        "median of %d rounds (the ratio is the median of each round's ratio)\n",
        c.name, static_cast<int>(target.config.num_hidden_layers),
        accel::FormatBytes(static_cast<int64_t>(target_bytes)).c_str(),
        static_cast<int>(draft.config.num_hidden_layers),
        accel::FormatBytes(static_cast<int64_t>(draft_bytes)).c_str(), target_bytes / draft_bytes,
        rounds);
    for (const Measure& m : measures) {
      std::printf(
          "  %-34s plain %6.2f tokens/s, speculative %6.2f tokens/s = %.2fx (%.2f-%.2f; cpu "
          "time a token %.2fx); %.0f%% of drafts accepted, %.2f tokens a step; same tokens: %s\n",
          m.name, accel::bench::Median(m.plain), accel::bench::Median(m.fast),
          accel::bench::Median(m.ratio), *std::min_element(m.ratio.begin(), m.ratio.end()),
          *std::max_element(m.ratio.begin(), m.ratio.end()), accel::bench::Median(m.cpu_ratio),
          100 * m.acceptance, m.per_step, m.same ? "yes" : "NO");
    }
    // Where nothing repeats, step by step (see InterleavedSteps).
    {
      std::vector<double> ratios;
      double plain_s = 0, fast_s = 0;
      for (int round = 0; round < rounds; ++round) {
        std::tie(plain_s, fast_s) = InterleavedSteps(target, lookup, fresh, tokens);
        ratios.push_back(plain_s / fast_s);
      }
      std::printf(
          "  prompt lookup, nothing repeats, steps interleaved: median step plain %.2f ms, "
          "speculative %.2f ms (last round) = %.3fx (median of %d rounds, %.3f-%.3f)\n",
          1e3 * plain_s, 1e3 * fast_s, accel::bench::Median(ratios), rounds,
          *std::min_element(ratios.begin(), ratios.end()),
          *std::max_element(ratios.begin(), ratios.end()));
    }
    // What prompt lookup adds to a step where nothing repeats: the search,
    // timed alone on the sequence of that case (its prompt and the tokens
    // generated), against a plain step.
    {
      std::vector<int64_t> sequence = fresh;
      const Run plain = Decode(target, nullptr, {}, fresh, tokens);
      sequence.insert(sequence.end(), plain.tokens.begin(), plain.tokens.end());
      accel::engine::NgramProposer proposer(lookup.prompt_lookup_min, lookup.prompt_lookup_max,
                                            lookup.num_speculative_tokens);
      const int calls = 2000;
      size_t found = 0;
      const double seconds = accel::bench::Seconds([&] {
        for (int i = 0; i < calls; ++i) found += proposer.Propose(sequence, k).size();
      });
      std::printf(
          "  prompt lookup's search on the %zu-token sequence where nothing repeats: %.1f us a "
          "step (%zu drafts found), %.4f%% of a plain step (%.1f ms)\n",
          sequence.size(), 1e6 * seconds / calls, found / calls,
          100 * (seconds / calls) * plain.tokens_per_s, 1e3 / plain.tokens_per_s);
    }
    std::fflush(stdout);
  }
  if (own_root) std::filesystem::remove_all(root);
  return 0;
}
