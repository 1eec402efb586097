// Structured output through the whole engine on random-weight models: a
// random model writes garbage unless the mask holds it, so every output must
// finish at eos and parse and validate. Batched requests with different
// grammars, sampled and greedy, with prompt lookup drafting, and a KV cache
// small enough to preempt; a grammar that does not compile is refused at
// Submit, naming the field and the keyword.
#include "engine/structured_output.h"

#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <re2/re2.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

#include "engine/llm_engine.h"
#include "models/make_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tokenizer/tokenizer.h"

namespace accel::engine {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::HasSubstr;
using Json = nlohmann::json;

class Sink : public RequestSink {
 public:
  void OnTokens(TokenChunk chunk) override {
    absl::MutexLock lock(&mu_);
    tokens_.insert(tokens_.end(), chunk.token_ids.begin(), chunk.token_ids.end());
  }
  void OnDone(const absl::Status& status, const Completion& completion) override {
    {
      absl::MutexLock lock(&mu_);
      status_ = status;
      finish_ = completion.finish;
    }
    done_.Notify();
  }
  // The tokens, once done (eos included when it ended there).
  std::vector<int64_t> Wait(Finish* finish) {
    EXPECT_TRUE(done_.WaitForNotificationWithTimeout(absl::Seconds(120)));
    absl::MutexLock lock(&mu_);
    EXPECT_THAT(status_, IsOk());
    *finish = finish_;
    return tokens_;
  }

 private:
  absl::Mutex mu_;
  std::vector<int64_t> tokens_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  Finish finish_ ABSL_GUARDED_BY(mu_) = Finish::kLength;
  absl::Notification done_;
};

const char* kPersonSchema = R"({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
  "required": ["name", "age", "role"], "additionalProperties": false})";

class StructuredOutputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    models::MakeModelOptions o;
    o.hidden_size = 32;
    o.num_layers = 2;
    o.vocab_size = 400;
    o.max_position_embeddings = 1024;
    ASSERT_THAT(models::MakeModel(dir_.path() + "/m", o), IsOk());
    auto tok = tokenizer::Tokenizer::FromFile(dir_.path() + "/m/tokenizer.json");
    ASSERT_THAT(tok, IsOk());
    tokenizer_ = *std::move(tok);
  }

  std::unique_ptr<LlmEngine> Load(const std::string& speculative = "",
                                  const std::string& kv = "4MiB") {
    EngineOptions e;
    e.model_dir = dir_.path() + "/m";
    e.load.device_map = "cpu";
    e.kv_cache_memory = kv;
    e.max_num_batched_tokens = 64;
    if (!speculative.empty()) {
      auto spec = ParseSpeculativeConfig(speculative);
      EXPECT_THAT(spec, IsOk());
      e.speculative = *spec;
    }
    auto engine = LlmEngine::Load(e, nullptr);
    EXPECT_THAT(engine, IsOk());
    return engine.ok() ? *std::move(engine) : nullptr;
  }

  GenerationRequest Request(StructuredOutputs s, uint64_t seed, double temperature = 1.0) {
    GenerationRequest r;
    r.prompt = "Describe a person as JSON:";
    r.max_new_tokens = 600;
    r.sampling.temperature = temperature;
    r.sampling.seed = seed;
    r.structured = std::move(s);
    return r;
  }

  // The text of a finished request (without the eos it ended on).
  std::string Text(std::vector<int64_t> ids, Finish finish) {
    EXPECT_EQ(finish, Finish::kEos) << "the grammar must end the output; it ended by "
                                    << FinishName(finish) << " after " << ids.size() << " tokens";
    if (finish == Finish::kEos && !ids.empty()) ids.pop_back();
    auto text = tokenizer_->Decode(ids, /*skip_special_tokens=*/false);
    EXPECT_THAT(text, IsOk());
    return text.ok() ? *text : "";
  }

  TempDir dir_;
  std::optional<tokenizer::Tokenizer> tokenizer_;
};

void CheckPerson(const std::string& text) {
  Json v;
  ASSERT_NO_THROW(v = Json::parse(text)) << text;
  ASSERT_TRUE(v.is_object()) << text;
  ASSERT_TRUE(v.contains("name") && v["name"].is_string()) << text;
  EXPECT_LE(v["name"].get<std::string>().size(), 8u * 4) << text;
  ASSERT_TRUE(v.contains("age") && v["age"].is_number_integer()) << text;
  EXPECT_GE(v["age"].get<int64_t>(), 0);
  EXPECT_LE(v["age"].get<int64_t>(), 120);
  ASSERT_TRUE(v.contains("role")) << text;
  EXPECT_THAT(v["role"].get<std::string>(), ::testing::AnyOf("admin", "user", "guest"));
  for (const auto& [k, value] : v.items()) {
    EXPECT_THAT(k, ::testing::AnyOf("name", "age", "role", "tags")) << text;
  }
  if (v.contains("tags")) {
    ASSERT_TRUE(v["tags"].is_array());
    EXPECT_LE(v["tags"].size(), 3u);
    for (const auto& t : v["tags"]) EXPECT_TRUE(t.is_boolean());
  }
}

TEST_F(StructuredOutputTest, BatchedGrammarsOnARandomModelAllValidate) {
  auto engine = Load();
  ASSERT_NE(engine, nullptr);
  struct Job {
    StructuredOutputs structured;
    std::shared_ptr<Sink> sink = std::make_shared<Sink>();
  };
  std::vector<Job> jobs;
  for (int i = 0; i < 4; ++i) {
    StructuredOutputs s;
    s.json_schema = kPersonSchema;
    jobs.push_back({s});
  }
  StructuredOutputs regex;
  regex.regex = "(cat|dog)-[0-9]{2,4}";
  jobs.push_back({regex});
  StructuredOutputs choice;
  choice.choice = {"yes", "no", "maybe not"};
  jobs.push_back({choice});
  StructuredOutputs gbnf;
  gbnf.grammar = "root ::= \"(\" [a-c]{1,5} (\",\" [a-c]{1,5}){0,4} \")\"";
  jobs.push_back({gbnf});
  StructuredOutputs object;
  object.json_object = true;
  jobs.push_back({object});
  for (size_t i = 0; i < jobs.size(); ++i) {
    // Half greedy, half sampled.
    ASSERT_THAT(
        engine->Submit(Request(jobs[i].structured, 100 + i, i % 2 ? 1.0 : 0.0), jobs[i].sink),
        IsOk());
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    Finish finish;
    std::vector<int64_t> ids = jobs[i].sink->Wait(&finish);
    const std::string text = Text(ids, finish);
    SCOPED_TRACE(text);
    if (i < 4) {
      CheckPerson(text);
    } else if (i == 4) {
      EXPECT_TRUE(RE2::FullMatch(text, "(cat|dog)-[0-9]{2,4}"));
    } else if (i == 5) {
      EXPECT_THAT(text, ::testing::AnyOf("yes", "no", "maybe not"));
    } else if (i == 6) {
      EXPECT_TRUE(RE2::FullMatch(text, "\\([a-c]{1,5}(,[a-c]{1,5}){0,4}\\)"));
    } else {
      Json v;
      ASSERT_NO_THROW(v = Json::parse(text));
      EXPECT_TRUE(v.is_object());
    }
  }
}

TEST_F(StructuredOutputTest, WithPromptLookupAndPreemption) {
  // Prompt lookup drafts (drafts the grammar refuses are rejected) and a KV
  // cache of 32 blocks for eight requests (some are preempted and resumed).
  auto engine = Load(R"({"method": "ngram", "num_speculative_tokens": 4})", "256KiB");
  ASSERT_NE(engine, nullptr);
  std::vector<std::shared_ptr<Sink>> sinks;
  for (int i = 0; i < 8; ++i) {
    StructuredOutputs s;
    s.json_schema = kPersonSchema;
    GenerationRequest r = Request(s, 7 + i, i % 2 ? 0.8 : 0.0);
    r.max_new_tokens = 400;
    r.prompt = R"(Example: {"name": "ab", "age": 12, "role": "user"} and another one:)";
    sinks.push_back(std::make_shared<Sink>());
    ASSERT_THAT(engine->Submit(r, sinks.back()), IsOk());
  }
  for (auto& sink : sinks) {
    Finish finish;
    std::vector<int64_t> ids = sink->Wait(&finish);
    CheckPerson(Text(ids, finish));
  }
}

TEST_F(StructuredOutputTest, BadGrammarsAreRefusedAtSubmit) {
  auto engine = Load();
  ASSERT_NE(engine, nullptr);
  StructuredOutputs s;
  s.json_schema = R"({"type": "array", "uniqueItems": true})";
  s.field = "response_format.json_schema.schema";
  EXPECT_THAT(engine->Submit(Request(s, 1), std::make_shared<Sink>()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("response_format.json_schema.schema: json_schema: keyword "
                                 "'uniqueItems'")));
  StructuredOutputs two;
  two.regex = "a";
  two.choice = {"b"};
  two.field = "guided_regex";
  EXPECT_THAT(engine->Submit(Request(two, 1), std::make_shared<Sink>()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exactly one of")));
  StructuredOutputs yes_no;
  yes_no.choice = {"yes", "no"};
  GenerationRequest endless = Request(yes_no, 1);
  endless.ignore_eos = true;
  EXPECT_THAT(engine->Submit(endless, std::make_shared<Sink>()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs a stop token")));
  StructuredOutputs gbnf;
  gbnf.grammar = "root ::= missing";
  EXPECT_THAT(engine->Submit(Request(gbnf, 1), std::make_shared<Sink>()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'missing'")));
}

}  // namespace
}  // namespace accel::engine
