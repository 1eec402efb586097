// Structured output's cost per decode step on a real vocabulary: the time to
// compute a grammar's token mask at each step of a JSON document (the
// document's own tokens, so every step is a step a model would take), cold
// (a new schema: every state's mask walked over the vocabulary trie) and
// warm (a second request with the same schema: the masks cached), next to a
// baseline measured in the same run: what an unconstrained sampler does per
// step anyway (one argmax over the vocabulary's logits). Also the time to
// index the vocabulary and to compile a 50-property schema, and the mask per
// step of a regex of 100 nested loops.
//
//   build/bin/accel-bench-grammar build/tok/llama3.tokenizer.json [--json]
//
// (scripts/tokenizer_references.sh writes that tokenizer.json: Llama 3's
// 128,256-token vocabulary.)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/record_schema.h"
#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;
using accel::grammar::CompiledGrammar;
using accel::grammar::GrammarMatcher;
using Json = nlohmann::ordered_json;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// 50 properties of every kind, and a document that fits them.
void FiftyProperties(Json* schema, Json* document) {
  Json properties = Json::object();
  Json required = Json::array();
  Json doc = Json::object();
  for (int i = 0; i < 50; ++i) {
    const std::string name = "field_" + std::to_string(i);
    switch (i % 5) {
      case 0:
        properties[name] = {{"type", "string"}, {"description", "free text"}};
        doc[name] = "The quick brown fox number " + std::to_string(i) + " jumps over the dog.";
        break;
      case 1:
        properties[name] = {{"type", "integer"}, {"minimum", 0}, {"maximum", 100000}};
        doc[name] = i * 997 % 100000;
        break;
      case 2:
        properties[name] = {{"enum", {"red", "green", "blue"}}};
        doc[name] = "green";
        break;
      case 3:
        properties[name] = {{"type", "array"}, {"items", {{"type", "number"}}}, {"maxItems", 8}};
        doc[name] = {1.5, 2.25, -3.0};
        break;
      default:
        properties[name] = {{"type", "boolean"}};
        doc[name] = i % 2 == 0;
    }
    if (i % 3 != 2) required.push_back(name);
  }
  *schema = {{"type", "object"},
             {"properties", properties},
             {"required", required},
             {"additionalProperties", false}};
  *document = doc;
}

struct StepTimes {
  double mean_us = 0;
  double median_us = 0;
  double p99_us = 0;
  double max_us = 0;
};

StepTimes Summarize(std::vector<double> us) {
  StepTimes t;
  if (us.empty()) return t;
  for (double u : us) t.mean_us += u;
  t.mean_us /= static_cast<double>(us.size());
  std::sort(us.begin(), us.end());
  t.median_us = us[us.size() / 2];
  t.p99_us = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  t.max_us = us.back();
  return t;
}

// Mask time per step along `ids` (each must be allowed), and the end check.
StepTimes Walk(const std::shared_ptr<CompiledGrammar>& compiled, const std::vector<int64_t>& ids,
               int64_t eos, bool* ok) {
  GrammarMatcher matcher(compiled, {eos});
  std::vector<uint64_t> mask(matcher.mask_words());
  std::vector<double> us;
  *ok = true;
  for (int64_t id : ids) {
    const auto start = Clock::now();
    matcher.FillNextTokenBitmask(mask.data());
    us.push_back(Since(start) * 1e6);
    if (!(mask[id >> 6] >> (id & 63) & 1) || !matcher.AcceptToken(id)) {
      std::fprintf(stderr, "token %lld refused\n", static_cast<long long>(id));
      *ok = false;
      break;
    }
  }
  matcher.FillNextTokenBitmask(mask.data());
  *ok = *ok && (mask[eos >> 6] >> (eos & 63) & 1);
  return Summarize(us);
}

// What a batch of sampled requests asks of the grammar: `rows` walks of
// `steps` tokens, each drawn uniformly from its mask (as a random model
// would), on a grammar compiled fresh, so every state a walk meets first
// is a new one. Mask time per step; `*total_ms` all of it.
StepTimes SampledWalks(const std::shared_ptr<CompiledGrammar>& compiled, int rows, int steps,
                       int64_t eos, double* total_ms) {
  std::vector<double> us;
  std::mt19937 rng(7);
  std::vector<GrammarMatcher> matchers(rows, GrammarMatcher(compiled, {eos}));
  std::vector<uint64_t> mask(matchers[0].mask_words());
  std::vector<int64_t> allowed;
  for (int step = 0; step < steps; ++step) {
    // Row by row within a step, as the engine's sampler does.
    for (GrammarMatcher& m : matchers) {
      if (m.IsTerminated()) continue;
      const auto start = Clock::now();
      m.FillNextTokenBitmask(mask.data());
      us.push_back(Since(start) * 1e6);
      allowed.clear();
      for (size_t w = 0; w < mask.size(); ++w) {
        for (uint64_t bits = mask[w]; bits != 0; bits &= bits - 1) {
          allowed.push_back(static_cast<int64_t>(w * 64 + __builtin_ctzll(bits)));
        }
      }
      m.AcceptToken(allowed[rng() % allowed.size()]);
    }
  }
  *total_ms = 0;
  for (double u : us) *total_ms += u / 1000;
  return Summarize(us);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON [--json]\n", argv[0]);
    return 2;
  }
  const bool json_out = argc > 2 && std::string(argv[2]) == "--json";
  auto tok = accel::tokenizer::Tokenizer::FromFile(argv[1]);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", std::string(tok.status().message()).c_str());
    return 1;
  }
  // The vocabulary as bytes, indexed once per model.
  auto start = Clock::now();
  std::vector<std::string> bytes(tok->vocab_size());
  std::vector<bool> special(tok->vocab_size());
  for (int64_t id = 0; id < tok->vocab_size(); ++id) {
    bytes[id] = tok->TokenBytes(id).value_or("");
    special[id] = tok->IsSpecial(id);
  }
  const double bytes_s = Since(start);
  start = Clock::now();
  auto vocab = accel::grammar::TokenVocabulary::Create(bytes, special);
  const double index_s = Since(start);
  const int64_t eos = tok->vocab_size() - 1;  // any special id serves as the stop token here

  Json schema;
  Json document;
  FiftyProperties(&schema, &document);
  const std::string schema_text = schema.dump();
  start = Clock::now();
  auto gbnf = accel::grammar::JsonSchemaToGbnf(schema_text);
  auto grammar = gbnf.ok() ? accel::grammar::ParseGbnf(*gbnf) : gbnf.status();
  const double compile_s = Since(start);
  if (!grammar.ok()) {
    std::fprintf(stderr, "%s\n", std::string(grammar.status().message()).c_str());
    return 1;
  }
  start = Clock::now();
  (void)accel::grammar::CompileJsonSchema(schema_text);  // fills the cache
  start = Clock::now();
  (void)accel::grammar::CompileJsonSchema(schema_text);
  const double cached_s = Since(start);

  auto ids = tok->Encode(document.dump(-1, ' ', false), false);
  if (!ids.ok()) return 1;
  auto compiled = CompiledGrammar::Create(*grammar, vocab);
  bool ok_cold = false;
  bool ok_warm = false;
  const StepTimes cold = Walk(compiled, *ids, eos, &ok_cold);
  const StepTimes warm = Walk(compiled, *ids, eos, &ok_warm);
  auto any_json = CompiledGrammar::Create(accel::grammar::JsonObjectGrammar(), vocab);
  bool ok_object = false;
  const StepTimes object_cold = Walk(any_json, *ids, eos, &ok_object);

  // accel-bench-structured's schema, 8 sampled rows of 64 steps, cold.
  auto record = accel::grammar::CompileJsonSchema(accel::bench::kRecordSchema);
  if (!record.ok()) return 1;
  double sampled_ms = 0;
  const StepTimes sampled =
      SampledWalks(CompiledGrammar::Create(*record, vocab), 8, 64, eos, &sampled_ms);
  // The 50 properties with typed additional properties beside them (their
  // key a string outside the declared names).
  Json open_schema = schema;
  open_schema["additionalProperties"] = {{"type", "integer"}};
  start = Clock::now();
  auto open_gbnf = accel::grammar::JsonSchemaToGbnf(open_schema.dump());
  auto open_grammar = open_gbnf.ok() ? accel::grammar::ParseGbnf(*open_gbnf) : open_gbnf.status();
  const double open_compile_s = Since(start);
  if (!open_grammar.ok()) return 1;

  // A regex of 100 nested loops, ((x)+)+...: the language is x+, one parse
  // stack a level; 64 steps of the token "x".
  std::string nested;
  for (int i = 0; i < 100; ++i) nested += "(";
  nested += "x";
  for (int i = 0; i < 100; ++i) nested += ")+";
  auto nested_grammar = accel::grammar::CompileRegex(nested);
  if (!nested_grammar.ok()) return 1;
  int64_t x_id = -1;
  for (int64_t id = 0; id < vocab->size() && x_id < 0; ++id) {
    if (bytes[id] == "x" && !special[id]) x_id = id;
  }
  if (x_id < 0) return 1;
  bool ok_nested = false;
  const StepTimes nested_steps = Walk(CompiledGrammar::Create(*nested_grammar, vocab),
                                      std::vector<int64_t>(64, x_id), eos, &ok_nested);

  // Baseline: one argmax over float logits of the vocabulary's size.
  std::vector<float> logits(vocab->size());
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (float& l : logits) l = normal(rng);
  std::vector<double> argmax_us;
  int64_t sink = 0;
  for (int r = 0; r < 200; ++r) {
    logits[r] += 1e-3f;
    const auto s = Clock::now();
    sink += std::max_element(logits.begin(), logits.end()) - logits.begin();
    argmax_us.push_back(Since(s) * 1e6);
  }
  const StepTimes argmax = Summarize(argmax_us);

  if (json_out) {
    Json out = {
        {"vocab_size", vocab->size()},
        {"trie_nodes", vocab->num_trie_nodes()},
        {"token_bytes_s", bytes_s},
        {"vocab_index_s", index_s},
        {"schema_compile_50_properties_s", compile_s},
        {"schema_compile_cached_s", cached_s},
        {"document_tokens", ids->size()},
        {"mask_us_cold",
         {{"mean", cold.mean_us}, {"median", cold.median_us}, {"p99", cold.p99_us}}},
        {"mask_us_warm",
         {{"mean", warm.mean_us}, {"median", warm.median_us}, {"p99", warm.p99_us}}},
        {"mask_us_json_object", {{"mean", object_cold.mean_us}, {"median", object_cold.median_us}}},
        {"mask_us_sampled_8x64_cold",
         {{"mean", sampled.mean_us},
          {"median", sampled.median_us},
          {"p99", sampled.p99_us},
          {"total_ms", sampled_ms}}},
        {"schema_compile_50_properties_open_s", open_compile_s},
        {"mask_us_nested_loops_100",
         {{"mean", nested_steps.mean_us}, {"max", nested_steps.max_us}, {"accepted", ok_nested}}},
        {"baseline_argmax_us", argmax.median_us},
        {"accepted", ok_cold && ok_warm && ok_object},
        {"sink", sink % 2}};
    std::printf("%s\n", out.dump(2).c_str());
    return ok_cold && ok_warm && ok_object && ok_nested ? 0 : 1;
  }
  std::printf("vocabulary: %lld tokens, %lld trie nodes; token bytes %.3f s, trie %.3f s\n",
              static_cast<long long>(vocab->size()),
              static_cast<long long>(vocab->num_trie_nodes()), bytes_s, index_s);
  std::printf("50-property schema: compiled in %.2f ms (cached: %.1f us)\n", compile_s * 1e3,
              cached_s * 1e6);
  std::printf("document: %zu tokens (every one allowed by the mask: %s)\n", ids->size(),
              ok_cold && ok_warm && ok_object ? "yes" : "NO");
  std::printf(
      "mask per step, json_schema, new schema : mean %8.1f us  median %7.1f us  p99 %8.1f us  max "
      "%8.1f us\n",
      cold.mean_us, cold.median_us, cold.p99_us, cold.max_us);
  std::printf(
      "mask per step, json_schema, cached     : mean %8.1f us  median %7.1f us  p99 %8.1f us\n",
      warm.mean_us, warm.median_us, warm.p99_us);
  std::printf(
      "mask per step, json_object, new        : mean %8.1f us  median %7.1f us  p99 %8.1f us\n",
      object_cold.mean_us, object_cold.median_us, object_cold.p99_us);
  std::printf(
      "mask per step, 8 sampled rows x 64, new: mean %8.1f us  median %7.1f us  p99 %8.1f us  max "
      "%8.1f us; all %.0f ms\n",
      sampled.mean_us, sampled.median_us, sampled.p99_us, sampled.max_us, sampled_ms);
  std::printf("50 properties + typed additionalProperties: compiled in %.2f ms\n",
              open_compile_s * 1e3);
  std::printf("mask per step, regex of 100 nested (x)+: mean %8.1f us  max %8.1f us; 64 x's %s\n",
              nested_steps.mean_us, nested_steps.max_us, ok_nested ? "accepted" : "REFUSED");
  std::printf("baseline: argmax over %lld logits      : median %7.1f us (sink %lld)\n",
              static_cast<long long>(vocab->size()), argmax.median_us,
              static_cast<long long>(sink % 2));
  return ok_cold && ok_warm && ok_object && ok_nested ? 0 : 1;
}
