// accel-serve end to end: the real binary on a loopback port, driven by a
// real gRPC client (the generated C++ stubs).
#include <atomic>
#include <cctype>
#include <csignal>
#include <cstdio>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <sys/types.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/client_context.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <re2/re2.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "accel/v1/generation.grpc.pb.h"
#include "server/proto/reflection_client.grpc.pb.h"
#include "tests/server/generation_client.h"
#include "tests/server/server_process.h"
#include "tests/testing/temp_dir.h"

namespace accel::testing {
namespace {

using ::accel::test::TempDir;
using ::accel::v1::GenerateRequest;
using ::accel::v1::GenerateResponse;
using ::accel::v1::Generation;
using ::testing::HasSubstr;
using ::testing::Not;
using HealthStatus = ::grpc::health::v1::HealthCheckResponse;

std::unique_ptr<ServerProcess> StartOrDie(const std::string& model,
                                          std::vector<std::string> args = {}) {
  auto server = ServerProcess::Start(model, std::move(args));
  if (!server.ok()) {
    ADD_FAILURE() << server.status();
    return nullptr;
  }
  return *std::move(server);
}

struct GenerateCli {
  std::vector<int64_t> token_ids;
  std::string text;
};

// The reference: accel-generate, in-process generation without the server.
GenerateCli RunGenerateTool(const std::string& model, const std::string& prompt, int n,
                            const std::string& flags = "") {
  const std::string command = absl::StrCat(
      BinDir(), "/accel-generate --model ", model, " --prompt '", prompt, "' --max_new_tokens ", n,
      " --temperature 0 --ignore_eos --json ", flags, " 2>/dev/null");
  GenerateCli out;
  const std::string text = CommandOutput(command).out;
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return out;
  out.token_ids = json["token_ids"].get<std::vector<int64_t>>();
  out.text = json["text"].get<std::string>();
  return out;
}

class ServeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = StartOrDie(TestModelDir()).release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = Generation::NewStub(server_->Channel());
  }
  static ServerProcess* server_;
  std::unique_ptr<Generation::Stub> stub_;
};
ServerProcess* ServeTest::server_ = nullptr;

TEST_F(ServeTest, GreedyGenerateMatchesAccelGenerate) {
  const std::string prompt = "The quick brown fox";
  GenerateResponse response;
  grpc::Status status = Call(*stub_, Greedy(prompt, 12), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const GenerateCli reference = RunGenerateTool(TestModelDir(), prompt, 12);
  ASSERT_EQ(reference.token_ids.size(), 12u);
  EXPECT_EQ(std::vector<int64_t>(response.token_ids().begin(), response.token_ids().end()),
            reference.token_ids);
  EXPECT_EQ(response.text(), reference.text);
  EXPECT_EQ(response.finish_reason(), accel::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(response.usage().generated_tokens(), 12);
  EXPECT_GT(response.usage().prompt_tokens(), 0);
  EXPECT_GT(response.timing().total_seconds(), 0);
  EXPECT_LE(response.timing().time_to_first_token_seconds(), response.timing().total_seconds());
}

TEST_F(ServeTest, StreamChunksAddUpToTheUnaryAnswer) {
  GenerateRequest request = Greedy("Once upon a time", 20);
  request.set_return_logprobs(true);
  GenerateResponse unary;
  ASSERT_TRUE(Call(*stub_, request, &unary).ok());

  grpc::ClientContext context;
  auto reader = stub_->GenerateStream(&context, request);
  GenerateResponse chunk;
  std::vector<int64_t> ids;
  std::string text;
  int finished_chunks = 0;
  int chunks = 0;
  while (reader->Read(&chunk)) {
    ++chunks;
    EXPECT_EQ(chunk.finish_reason() != accel::v1::FINISH_REASON_UNSPECIFIED, chunk.has_usage());
    if (chunk.finish_reason() != accel::v1::FINISH_REASON_UNSPECIFIED) ++finished_chunks;
    EXPECT_EQ(chunk.logprobs_size(), chunk.token_ids_size());
    for (float logprob : chunk.logprobs()) EXPECT_LE(logprob, 0.0f);
    ids.insert(ids.end(), chunk.token_ids().begin(), chunk.token_ids().end());
    text += chunk.text();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_GT(chunks, 1);
  EXPECT_EQ(finished_chunks, 1);
  EXPECT_EQ(ids, std::vector<int64_t>(unary.token_ids().begin(), unary.token_ids().end()));
  EXPECT_EQ(text, unary.text());
}

// n on gRPC: n sampled choices of one prompt, choice i exactly the request
// alone seeded seed + i; the top-level fields are choice 0's and usage sums
// the choices. Streamed, each message holds one choice's tokens (its index),
// each choice ends with its finish_reason, and the chunks of each index join
// to that choice.
TEST_F(ServeTest, NChoicesOnGrpcAreSeededAndStreamedByIndex) {
  GenerateRequest request = Greedy("Once upon a time", 10);
  request.mutable_sampling()->set_temperature(1.0);
  request.mutable_sampling()->set_seed(11);
  request.set_ignore_eos(true);
  request.set_n(3);
  GenerateResponse several;
  ASSERT_TRUE(Call(*stub_, request, &several).ok());
  ASSERT_EQ(several.choices_size(), 3);
  std::set<std::vector<int64_t>> distinct;
  int64_t generated = 0;
  for (int i = 0; i < 3; ++i) {
    const accel::v1::Choice& choice = several.choices(i);
    EXPECT_EQ(choice.index(), i);
    EXPECT_EQ(choice.finish_reason(), accel::v1::FINISH_REASON_LENGTH);
    GenerateRequest alone = request;
    alone.clear_n();
    alone.mutable_sampling()->set_seed(11 + i);
    GenerateResponse one;
    ASSERT_TRUE(Call(*stub_, alone, &one).ok());
    const std::vector<int64_t> ids(choice.token_ids().begin(), choice.token_ids().end());
    EXPECT_EQ(ids, std::vector<int64_t>(one.token_ids().begin(), one.token_ids().end()))
        << "choice " << i;
    EXPECT_EQ(choice.text(), one.text());
    EXPECT_EQ(one.choices_size(), 0);  // n = 1 answers as before
    distinct.insert(ids);
    generated += choice.token_ids_size();
  }
  EXPECT_EQ(distinct.size(), 3u);  // three streams, not one answer thrice
  EXPECT_EQ(several.text(), several.choices(0).text());
  EXPECT_EQ(several.token_ids_size(), several.choices(0).token_ids_size());
  EXPECT_EQ(several.usage().generated_tokens(), generated);

  grpc::ClientContext context;
  auto reader = stub_->GenerateStream(&context, request);
  GenerateResponse chunk;
  std::map<int, std::vector<int64_t>> ids;
  std::map<int, int> ends;
  bool usage_last = false;
  while (reader->Read(&chunk)) {
    ASSERT_FALSE(usage_last) << "a message after the usage";
    ids[chunk.index()].insert(ids[chunk.index()].end(), chunk.token_ids().begin(),
                              chunk.token_ids().end());
    if (chunk.finish_reason() != accel::v1::FINISH_REASON_UNSPECIFIED) ++ends[chunk.index()];
    if (chunk.has_usage()) {
      usage_last = true;
      EXPECT_EQ(chunk.token_ids_size(), 0);
      EXPECT_EQ(chunk.usage().generated_tokens(), generated);
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(usage_last);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ends[i], 1) << "choice " << i;
    EXPECT_EQ(ids[i], std::vector<int64_t>(several.choices(i).token_ids().begin(),
                                           several.choices(i).token_ids().end()))
        << "choice " << i;
  }
}

TEST_F(ServeTest, InputIdsAndStopTokenIds) {
  GenerateResponse first;
  ASSERT_TRUE(Call(*stub_, Greedy("Hello there", 8), &first).ok());
  ASSERT_EQ(first.token_ids_size(), 8);
  // The same prompt as ids, stopping at the third generated token.
  GenerateRequest request;
  for (int64_t id : std::vector<int64_t>{1, 2, 3}) request.mutable_input_ids()->add_ids(id);
  request.set_max_new_tokens(8);
  request.set_ignore_eos(true);
  GenerateResponse by_ids;
  ASSERT_TRUE(Call(*stub_, request, &by_ids).ok());
  ASSERT_EQ(by_ids.token_ids_size(), 8);
  request.add_stop_token_ids(by_ids.token_ids(2));
  GenerateResponse stopped;
  ASSERT_TRUE(Call(*stub_, request, &stopped).ok());
  EXPECT_EQ(stopped.finish_reason(), accel::v1::FINISH_REASON_EOS);
  // Stops at the first occurrence of that id, which is at most the third.
  EXPECT_LE(stopped.token_ids_size(), 3);
  EXPECT_EQ(stopped.token_ids(stopped.token_ids_size() - 1), by_ids.token_ids(2));
}

// min_tokens on gRPC: the stop token cannot end the text before that many
// tokens (it is masked out of sampling until then).
TEST_F(ServeTest, MinTokensHoldsOffStopTokenIds) {
  GenerateRequest request;
  for (int64_t id : std::vector<int64_t>{1, 2, 3}) request.mutable_input_ids()->add_ids(id);
  request.set_max_new_tokens(8);
  request.set_ignore_eos(true);
  GenerateResponse plain;
  ASSERT_TRUE(Call(*stub_, request, &plain).ok());
  ASSERT_EQ(plain.token_ids_size(), 8);
  request.add_stop_token_ids(plain.token_ids(0));
  request.set_min_tokens(4);
  GenerateResponse held;
  ASSERT_TRUE(Call(*stub_, request, &held).ok());
  ASSERT_GE(held.token_ids_size(), 5);
  for (int i = 0; i < 4; ++i) EXPECT_NE(held.token_ids(i), plain.token_ids(0)) << "token " << i;
  request.set_min_tokens(9);  // over max_new_tokens
  GenerateResponse refused;
  const grpc::Status status = Call(*stub_, request, &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("min_tokens"));
}

TEST_F(ServeTest, ConcurrentRequestsAreBatchedAndAllSucceed) {
  const double steps_before = Metric(*server_, "accel_step_duration_seconds_count");
  const double tokens_before = Metric(*server_, "accel_generation_tokens_total");
  constexpr int kClients = 12;
  constexpr int kTokens = 24;
  std::vector<GenerateResponse> responses(kClients);
  std::vector<grpc::Status> statuses(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      GenerateRequest request = Greedy(absl::StrCat("Request number ", i, " says"), kTokens);
      statuses[i] = Call(*stub_, request, &responses[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].error_message();
    EXPECT_EQ(responses[i].token_ids_size(), kTokens);
  }
  const double steps = Metric(*server_, "accel_step_duration_seconds_count") - steps_before;
  const double tokens = Metric(*server_, "accel_generation_tokens_total") - tokens_before;
  EXPECT_EQ(tokens, kClients * kTokens);
  // One request at a time would take one step per token; batching takes fewer.
  EXPECT_LT(steps, tokens * 0.75) << steps << " steps for " << tokens << " tokens";
}

TEST_F(ServeTest, BadRequestsAreInvalidArgumentOrNotFound) {
  struct Case {
    const char* name;
    GenerateRequest request;
    grpc::StatusCode code;
    const char* message;
  };
  std::vector<Case> cases;
  cases.push_back({"empty prompt", Greedy("", 4), grpc::INVALID_ARGUMENT, "prompt is empty"});
  GenerateRequest none;
  cases.push_back({"no input", none, grpc::INVALID_ARGUMENT, "neither a prompt nor input_ids"});
  GenerateRequest hot = Greedy("hi", 4);
  hot.mutable_sampling()->set_temperature(-1);
  cases.push_back({"temperature", hot, grpc::INVALID_ARGUMENT, "temperature"});
  GenerateRequest top_p = Greedy("hi", 4);
  top_p.mutable_sampling()->set_top_p(1.5);
  cases.push_back({"top_p", top_p, grpc::INVALID_ARGUMENT, "top_p"});
  GenerateRequest min_p = Greedy("hi", 4);
  min_p.mutable_sampling()->set_min_p(-0.5);
  cases.push_back({"min_p", min_p, grpc::INVALID_ARGUMENT, "min_p"});
  GenerateRequest top_k = Greedy("hi", 4);
  top_k.mutable_sampling()->set_top_k(-3);
  cases.push_back({"top_k", top_k, grpc::INVALID_ARGUMENT, "top_k"});
  GenerateRequest too_long = Greedy("hi", 100000);
  cases.push_back({"max_new_tokens", too_long, grpc::INVALID_ARGUMENT, "--max_total_tokens"});
  GenerateRequest negative = Greedy("hi", -2);
  cases.push_back({"negative max_new_tokens", negative, grpc::INVALID_ARGUMENT, "max_new_tokens"});
  GenerateRequest ids;
  ids.mutable_input_ids()->add_ids(1 << 30);
  cases.push_back({"id outside vocab", ids, grpc::INVALID_ARGUMENT, "outside the vocabulary"});
  GenerateRequest stop = Greedy("hi", 4);
  stop.add_stop("");
  cases.push_back({"empty stop", stop, grpc::INVALID_ARGUMENT, "stop[0] is empty"});
  GenerateRequest many = Greedy("hi", 4);
  many.set_n(129);
  cases.push_back({"n", many, grpc::INVALID_ARGUMENT, "n: must be in [1, 128]"});
  GenerateRequest other = Greedy("hi", 4);
  other.set_model("gpt-17");
  cases.push_back({"unknown model", other, grpc::NOT_FOUND, "gpt-17"});
  for (const Case& c : cases) {
    GenerateResponse response;
    grpc::Status status = Call(*stub_, c.request, &response);
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.message)) << c.name;
    // The streaming RPC validates the same way.
    grpc::ClientContext context;
    auto reader = stub_->GenerateStream(&context, c.request);
    while (reader->Read(&response)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), c.code) << c.name << " (stream)";
  }
  // The server is still fine.
  GenerateResponse response;
  EXPECT_TRUE(Call(*stub_, Greedy("still here", 3), &response).ok());
  EXPECT_GE(Metric(*server_, "accel_request_failure_total{reason=\"invalid\"}"), 20);
  EXPECT_GE(Metric(*server_, "accel_request_failure_total{reason=\"not_found\"}"), 2);
}

// GenerateRequest.structured_output on gRPC: the random model's text follows
// a regex, a choice list and a JSON Schema (sampled, so only the mask holds
// it); a schema the server cannot honour is INVALID_ARGUMENT naming it.
TEST_F(ServeTest, StructuredOutputOnGrpc) {
  GenerateRequest regex = Greedy("Codes:", 40);
  regex.set_ignore_eos(false);  // the grammar ends the text with eos
  regex.mutable_sampling()->set_temperature(1.0);
  regex.mutable_sampling()->set_seed(4);
  regex.mutable_structured_output()->set_regex("[A-F]{2}-[0-9]{1,3}");
  GenerateResponse response;
  grpc::Status status = Call(*stub_, regex, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.finish_reason(), accel::v1::FINISH_REASON_EOS);
  EXPECT_TRUE(RE2::FullMatch(response.text(), "[A-F]{2}-[0-9]{1,3}")) << response.text();

  GenerateRequest choice = regex;
  choice.mutable_structured_output()->mutable_choice()->add_choices("left");
  choice.mutable_structured_output()->mutable_choice()->add_choices("right");
  ASSERT_TRUE(Call(*stub_, choice, &response).ok());
  EXPECT_THAT(response.text(), ::testing::AnyOf("left", "right"));

  GenerateRequest schema = regex;
  schema.mutable_structured_output()->set_json_schema(
      R"({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"]})");
  schema.set_max_new_tokens(60);
  ASSERT_TRUE(Call(*stub_, schema, &response).ok());
  const nlohmann::json v = nlohmann::json::parse(response.text(), nullptr, false);
  ASSERT_TRUE(v.is_object()) << response.text();
  EXPECT_TRUE(v["n"].is_number_integer()) << response.text();

  GenerateRequest endless = regex;
  endless.set_ignore_eos(true);
  status = Call(*stub_, endless, &response);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("structured output needs a stop token"));

  GenerateRequest bad = regex;
  bad.mutable_structured_output()->set_json_schema(R"({"type": "array", "uniqueItems": true})");
  status = Call(*stub_, bad, &response);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("structured_output.json_schema: json_schema: keyword 'uniqueItems'"));
}

TEST_F(ServeTest, ModelInfoDescribesTheModel) {
  grpc::ClientContext context;
  accel::v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.name(), "serve-small");  // the folder's name
  EXPECT_EQ(info.architecture(), "LlamaForCausalLM");
  EXPECT_EQ(info.model_type(), "llama");
  EXPECT_EQ(info.dtype(), "float32");
  EXPECT_EQ(info.quantization(), "none");
  EXPECT_EQ(info.max_context(), 256);
  EXPECT_EQ(info.max_total_tokens(), 256);
  EXPECT_EQ(info.max_input_tokens(), 255);
  EXPECT_GT(info.parameters(), 0);
  ASSERT_GT(info.device_map_size(), 0);
  EXPECT_EQ(info.device_map(0).device(), "cpu");
  // float32: four bytes a parameter, all on the cpu.
  EXPECT_EQ(info.bytes_per_device().at("cpu"), 4 * info.parameters());
  // Named explicitly, the model is found.
  GenerateRequest named = Greedy("hi", 2);
  named.set_model("serve-small");
  GenerateResponse response;
  EXPECT_TRUE(Call(*stub_, named, &response).ok());
}

// The reference ids of a conversation: accel-tokenize, the template
// rendered and tokenized outside the server.
std::vector<int64_t> RenderedChatIds(const std::string& model, const std::string& messages_json) {
  TempDir dir;
  dir.Write("messages.json", messages_json);
  const std::string text =
      CommandOutput(absl::StrCat(BinDir(), "/accel-tokenize --model ", model, " --chat ",
                                 dir.File("messages.json"),
                                 " --add_generation_prompt --json 2>/dev/null"))
          .out;
  const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return json.is_discarded() ? std::vector<int64_t>() : json["ids"].get<std::vector<int64_t>>();
}

accel::v1::ChatRequest GreedyChat(const std::string& system, const std::string& user, int n) {
  accel::v1::ChatRequest request;
  if (!system.empty()) {
    accel::v1::ChatMessage* m = request.add_messages();
    m->set_role("system");
    m->set_content(system);
  }
  accel::v1::ChatMessage* m = request.add_messages();
  m->set_role("user");
  m->set_content(user);
  request.set_add_generation_prompt(true);
  request.set_max_new_tokens(n);
  request.set_ignore_eos(true);
  return request;
}

TEST_F(ServeTest, GreedyChatEqualsGenerateOnTheRenderedTemplatesIds) {
  const accel::v1::ChatRequest chat = GreedyChat("Be brief.", "What is a fox? 🦊", 12);
  GenerateResponse answer;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub_->Chat(&context, chat, &answer);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  const std::vector<int64_t> ids =
      RenderedChatIds(TestModelDir(), R"([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "What is a fox? 🦊"}])");
  ASSERT_FALSE(ids.empty());
  GenerateRequest generate;
  generate.mutable_input_ids()->mutable_ids()->Add(ids.begin(), ids.end());
  generate.set_max_new_tokens(12);
  generate.set_ignore_eos(true);
  GenerateResponse reference;
  ASSERT_TRUE(Call(*stub_, generate, &reference).ok());
  EXPECT_EQ(std::vector<int64_t>(answer.token_ids().begin(), answer.token_ids().end()),
            std::vector<int64_t>(reference.token_ids().begin(), reference.token_ids().end()));
  EXPECT_EQ(answer.text(), reference.text());
  EXPECT_EQ(answer.usage().prompt_tokens(), static_cast<int64_t>(ids.size()));
  EXPECT_EQ(answer.token_ids_size(), 12);

  // accel-generate --chat --system renders the same conversation in-process.
  const GenerateCli cli =
      RunGenerateTool(TestModelDir(), "What is a fox? 🦊", 12, "--chat --system 'Be brief.'");
  EXPECT_EQ(cli.token_ids,
            std::vector<int64_t>(answer.token_ids().begin(), answer.token_ids().end()));

  // ChatStream's chunks add up to the same answer.
  grpc::ClientContext context;
  auto reader = stub_->ChatStream(&context, chat);
  GenerateResponse chunk;
  std::vector<int64_t> streamed;
  std::string text;
  while (reader->Read(&chunk)) {
    streamed.insert(streamed.end(), chunk.token_ids().begin(), chunk.token_ids().end());
    text += chunk.text();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(streamed, std::vector<int64_t>(answer.token_ids().begin(), answer.token_ids().end()));
  EXPECT_EQ(text, answer.text());
}

TEST_F(ServeTest, ChatStopsAtTheEndOfTurnAndAccelClientChats) {
  // Without ignore_eos the template's turn end (here the model's eos) stops
  // generation: the answer is the ignore_eos answer cut after that token.
  accel::v1::ChatRequest chat = GreedyChat("", "Tell me a story.", 40);
  GenerateResponse full;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Chat(&context, chat, &full).ok());
  }
  chat.set_ignore_eos(false);
  GenerateResponse stopped;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Chat(&context, chat, &stopped).ok());
  }
  grpc::ClientContext info_context;
  accel::v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModelInfo(&info_context, {}, &info).ok());
  EXPECT_TRUE(info.has_chat_template());
  std::vector<int64_t> expected;
  for (int64_t id : full.token_ids()) {
    expected.push_back(id);
    if (id == info.eos_token_ids(0)) break;
  }
  EXPECT_EQ(std::vector<int64_t>(stopped.token_ids().begin(), stopped.token_ids().end()), expected);

  // accel-client chat sends the same conversation.
  const std::string client = absl::StrCat(BinDir(), "/accel-client --address ", server_->address());
  for (const char* mode : {"", " --stream"}) {
    const CommandResult run = CommandOutput(
        (client + " chat --prompt 'Tell me a story.' --max_new_tokens 40" + mode + " 2>/dev/null"));
    EXPECT_EQ(run.exit_code, 0);
    const std::string& out = run.out;
    EXPECT_EQ(out, stopped.text() + "\n") << mode;
  }
  EXPECT_NE(RunCommand(client + " chat > /dev/null 2>&1"), 0);  // no messages
}

TEST_F(ServeTest, BadChatRequestsAreInvalidArgumentsNamingTheField) {
  struct Case {
    accel::v1::ChatRequest request;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({accel::v1::ChatRequest(), "messages is empty"});
  {
    accel::v1::ChatRequest r = GreedyChat("", "hi", 2);
    r.mutable_messages(0)->clear_role();
    cases.push_back({r, "messages[0].role is empty"});
  }
  {
    accel::v1::ChatRequest r = GreedyChat("", "hi", 2);
    accel::v1::ToolCall* call = r.mutable_messages(0)->add_tool_calls();
    call->set_name("f");
    call->set_arguments_json("{not json");
    cases.push_back({r, "messages[0].tool_calls[0].arguments_json: invalid JSON"});
  }
  {
    accel::v1::ChatRequest r = GreedyChat("", "hi", 2);
    r.add_tools_json("[1]");
    cases.push_back({r, "tools_json[0]: expected an object"});
  }
  {
    accel::v1::ChatRequest r = GreedyChat("", "hi", 2);
    r.set_model("other");
    cases.push_back({r, "is not served here"});
  }
  for (const Case& c : cases) {
    grpc::ClientContext context;
    GenerateResponse response;
    const grpc::Status status = stub_->Chat(&context, c.request, &response);
    EXPECT_NE(status.error_code(), grpc::OK) << c.message;
    EXPECT_THAT(status.error_message(), HasSubstr(c.message));
  }
}

TEST(ServeChatTemplateTest, TheTemplatesRefusalAndAMissingTemplateAreNamed) {
  TempDir dir;
  const std::string model = dir.path() + "/strict";
  ASSERT_EQ(RunCommand("cp -r " + TestModelDir() + " " + model), 0);
  {
    std::ofstream config(model + "/chat_template.jinja");
    config << "{% for m in messages %}{% if m.role != 'user' %}"
              "{{ raise_exception('only user messages, please') }}{% endif %}"
              "{{ m.content }}{% endfor %}";
  }
  const std::string bare = dir.path() + "/bare";
  ASSERT_EQ(RunCommand("cp -r " + TestModelDir() + " " + bare + " && rm " + bare +
                       "/tokenizer_config.json"),
            0);
  auto strict = StartOrDie(model);
  ASSERT_NE(strict, nullptr);
  auto stub = Generation::NewStub(strict->Channel());
  GenerateResponse response;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub->Chat(&context, GreedyChat("sys", "hi", 2), &response);
    EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("only user messages, please"));
    EXPECT_THAT(status.error_message(), HasSubstr("chat_template.jinja"));
  }
  {
    grpc::ClientContext context;
    EXPECT_TRUE(stub->Chat(&context, GreedyChat("", "hi", 2), &response).ok());
  }
  auto plain = StartOrDie(bare);
  ASSERT_NE(plain, nullptr);
  stub = Generation::NewStub(plain->Channel());
  grpc::ClientContext context;
  const grpc::Status status = stub->Chat(&context, GreedyChat("", "hi", 2), &response);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("messages: this model has no chat template"));
  grpc::ClientContext info_context;
  accel::v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&info_context, {}, &info).ok());
  EXPECT_FALSE(info.has_chat_template());
}

TEST_F(ServeTest, QuantizedServingMatchesAccelGenerateQuantized) {
  grpc::ClientContext context;
  accel::v1::ModelInfo full;
  ASSERT_TRUE(stub_->GetModelInfo(&context, {}, &full).ok());
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--quantize=nf4", "--double_quant"},
        std::vector<std::string>{"--quantize=int8"}}) {
    SCOPED_TRACE(flags[0]);
    auto server = StartOrDie(TestModelDir(), flags);
    ASSERT_NE(server, nullptr);
    auto stub = Generation::NewStub(server->Channel());
    grpc::ClientContext info_context;
    accel::v1::ModelInfo info;
    ASSERT_TRUE(stub->GetModelInfo(&info_context, {}, &info).ok());
    EXPECT_EQ(info.quantization(), flags.size() == 2 ? "nf4+dq" : "int8");
    EXPECT_EQ(info.parameters(), full.parameters());  // packed 4-bit weights counted whole
    EXPECT_LT(info.bytes_per_device().at("cpu"), full.bytes_per_device().at("cpu"));

    const std::string prompt = "The quick brown fox";
    GenerateResponse response;
    grpc::Status status = Call(*stub, Greedy(prompt, 8), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const GenerateCli reference =
        RunGenerateTool(TestModelDir(), prompt, 8, absl::StrJoin(flags, " "));
    ASSERT_EQ(reference.token_ids.size(), 8u);
    EXPECT_EQ(std::vector<int64_t>(response.token_ids().begin(), response.token_ids().end()),
              reference.token_ids);
  }
}

TEST_F(ServeTest, HealthServesLiveAndReadyNames) {
  for (const char* name :
       {"", "accel.live", "accel.ready", "accel.v1.Generation", "inference.GRPCInferenceService"}) {
    auto status = server_->Health(name);
    ASSERT_TRUE(status.ok()) << name << ": " << status.status();
    EXPECT_EQ(*status, HealthStatus::SERVING) << name;
  }
  EXPECT_EQ(server_->Health("no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ServeTest, MetricsPassPromtoolAndCountRequests) {
  GenerateResponse response;
  const double before = Metric(*server_, "accel_request_success_total{finished_reason=\"length\"}");
  ASSERT_TRUE(Call(*stub_, Greedy("count me", 5), &response).ok());
  absl::StatusOr<std::string> text = server_->Metrics();
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(MetricValue(*text, "accel_request_success_total{finished_reason=\"length\"}"),
            before + 1);
  EXPECT_EQ(MetricValue(*text, "accel_ready"), 1);
  EXPECT_GT(MetricValue(*text, "accel_weight_bytes{device=\"cpu\"}").value_or(0), 0);
  EXPECT_GT(MetricValue(*text, "accel_model_load_seconds").value_or(0), 0);
  EXPECT_EQ(MetricValue(*text, "accel_num_requests_running"), 0);
  EXPECT_EQ(MetricValue(*text, "accel_kv_cache_usage_ratio"), 0);  // every block free again
  for (const char* family :
       {"accel_time_to_first_token_seconds_bucket", "accel_inter_token_latency_seconds_count",
        "accel_e2e_request_latency_seconds_sum", "accel_request_queue_time_seconds_count",
        "accel_prompt_tokens_total", "accel_num_requests_waiting", "accel_batch_size",
        "accel_kv_cache_usage_ratio", "accel_offload_disk_read_bytes_total",
        "accel_offload_disk_mapped_bytes_total", "accel_offload_prefetch_hits_total",
        "accel_offload_device_copy_bytes_total", "accel_build_info"}) {
    EXPECT_THAT(*text, HasSubstr(family));
  }
  TempDir dir;
  const std::string path = dir.path() + "/metrics.txt";
  std::ofstream(path) << *text;
  const int rc = RunCommand("promtool check metrics < " + path + " > " + path + ".out 2>&1");
  std::ifstream lint(path + ".out");
  const std::string problems((std::istreambuf_iterator<char>(lint)), {});
  EXPECT_EQ(rc, 0) << "promtool check metrics (scripts/setup.sh installs prometheus): " << problems;
}

TEST_F(ServeTest, AccelClientGeneratesAndProbesHealth) {
  GenerateResponse response;
  ASSERT_TRUE(Call(*stub_, Greedy("A client says", 6), &response).ok());
  const std::string client = absl::StrCat(BinDir(), "/accel-client --address ", server_->address());
  // --max_new_tokens 6 without ignore_eos: the same answer unless eos came first.
  for (const char* mode : {"", " --stream"}) {
    const CommandResult run = CommandOutput(
        (client + " generate --prompt 'A client says' --max_new_tokens 6" + mode + " 2>/dev/null"));
    EXPECT_EQ(run.exit_code, 0);
    const std::string& out = run.out;
    if (response.finish_reason() == accel::v1::FINISH_REASON_LENGTH) {
      EXPECT_EQ(out, response.text() + "\n") << mode;
    }
  }
  EXPECT_EQ(RunCommand(client + " health > /dev/null"), 0);
  EXPECT_EQ(RunCommand(client + " health --service accel.live > /dev/null"), 0);
  EXPECT_NE(RunCommand(client + " health --service no.such > /dev/null 2>&1"), 0);
  EXPECT_NE(RunCommand(client + " generate --prompt '' > /dev/null 2>&1"), 0);
}

// Lists the services through server reflection; the gRPC status on failure.
absl::StatusOr<std::vector<std::string>> ReflectedServices(const ServerProcess& server) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(server.Channel());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto stream = stub->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("*");
  stream->Write(request);
  request.set_file_containing_symbol("accel.v1.Generation");
  stream->Write(request);
  stream->WritesDone();
  std::vector<std::string> names;
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  while (stream->Read(&response)) {
    for (const auto& service : response.list_services_response().service()) {
      names.push_back(service.name());
    }
    if (response.has_file_descriptor_response()) {
      names.push_back(
          absl::StrCat("files:", response.file_descriptor_response().file_descriptor_proto_size()));
    }
  }
  grpc::Status status = stream->Finish();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  return names;
}

TEST_F(ServeTest, ReflectionListsTheServices) {
  absl::StatusOr<std::vector<std::string>> names = ReflectedServices(*server_);
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, ::testing::IsSupersetOf(
                          {"accel.v1.Generation", "inference.GRPCInferenceService", "files:1"}));
}

TEST(ServeReflectionTest, ReflectionCanBeTurnedOff) {
  auto server = StartOrDie(TestModelDir(), {"--grpc_reflection=false"});
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(ReflectedServices(*server).status().code(), absl::StatusCode::kUnimplemented);
}

// Most of the model on disk (--max_memory leaves the cpu room for the
// embedding only): the answers are those of the model in RAM, and the
// offload counters show the layers coming in from disk, prefetched.
TEST(ServeOffloadTest, DiskOffloadAnswersAsTheModelInRamAndIsCounted) {
  auto server = StartOrDie(TestModelDir(), {"--max_memory=cpu=400KiB,disk=1GiB"});
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  const std::string prompt = "Offloaded weights";
  const GenerateCli reference = RunGenerateTool(TestModelDir(), prompt, 10);
  ASSERT_EQ(reference.token_ids.size(), 10u);
  for (int round = 0; round < 2; ++round) {
    GenerateResponse response;
    grpc::Status status = Call(*stub, Greedy(prompt, 10), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(std::vector<int64_t>(response.token_ids().begin(), response.token_ids().end()),
              reference.token_ids)
        << "round " << round;
  }
  absl::StatusOr<std::string> text = server->Metrics();
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_GT(MetricValue(*text, "accel_weight_bytes{device=\"disk\"}").value_or(0), 0);
  const double fetches = MetricValue(*text, "accel_offload_fetches_total").value_or(0);
  // Every step of both requests brings in each disk module: 11 steps a request at least.
  EXPECT_GE(fetches, 2 * 11);
  // On the cpu, disk weights are used in place from the checkpoint's mapping.
  EXPECT_GT(MetricValue(*text, "accel_offload_disk_mapped_bytes_total").value_or(0), 0);
  EXPECT_EQ(MetricValue(*text, "accel_offload_disk_read_bytes_total").value_or(-1), 0);
  // The 400 KiB budget has no room to keep them mapped: they are dropped behind.
  EXPECT_GT(MetricValue(*text, "accel_offload_disk_dropped_bytes_total").value_or(0), 0);
  EXPECT_GT(MetricValue(*text, "accel_offload_read_bytes_per_token").value_or(0), 0);
  const double hits = MetricValue(*text, "accel_offload_prefetch_hits_total").value_or(-1);
  EXPECT_GT(hits, 0);
  EXPECT_LE(hits, fetches);
  // The main device is the cpu: nothing crosses to a GPU.
  EXPECT_EQ(MetricValue(*text, "accel_offload_device_copy_bytes_total"), 0);
}

// Speculative decoding: accel-serve and accel-generate take the same
// --speculative_config; greedy answers are those of plain decoding, with
// prompt lookup and with a draft model, and the drafts are counted under
// vLLM's names.
TEST(ServeSpeculativeTest, DraftsGiveThePlainAnswersAndAreCounted) {
  const std::string prompt = "the cat and the dog and the cat";
  const GenerateCli reference = RunGenerateTool(TestModelDir(), prompt, 24);
  ASSERT_EQ(reference.token_ids.size(), 24u);
  const std::string lookup =
      R"(--speculative_config={"method": "ngram", "num_speculative_tokens": 3,)"
      R"( "prompt_lookup_min": 1, "prompt_lookup_max": 2})";
  const std::string draft = absl::StrCat(R"(--speculative_config={"model": ")", TestModelDir(),
                                         R"(", "num_speculative_tokens": 2})");
  for (const std::string& flag : {lookup, draft}) {
    EXPECT_EQ(RunGenerateTool(TestModelDir(), prompt, 24, "'" + flag + "'").token_ids,
              reference.token_ids)
        << flag;
    auto server = StartOrDie(TestModelDir(), {flag});
    ASSERT_NE(server, nullptr);
    auto stub = Generation::NewStub(server->Channel());
    GenerateResponse response;
    grpc::Status status = Call(*stub, Greedy(prompt, 24), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(std::vector<int64_t>(response.token_ids().begin(), response.token_ids().end()),
              reference.token_ids)
        << flag;
    absl::StatusOr<std::string> text = server->Metrics();
    ASSERT_TRUE(text.ok()) << text.status();
    const double drafted =
        MetricValue(*text, "accel_spec_decode_num_draft_tokens_total").value_or(-1);
    const double accepted =
        MetricValue(*text, "accel_spec_decode_num_accepted_tokens_total").value_or(-1);
    EXPECT_GT(drafted, 0) << flag;
    EXPECT_GE(accepted, 0) << flag;
    EXPECT_LE(accepted, drafted) << flag;
    EXPECT_GT(MetricValue(*text, "accel_spec_decode_num_drafts_total").value_or(-1), 0) << flag;
  }
}

// A small Mixtral: 8 experts of which each token uses 2.
const std::string& MixtralModelDir() {
  static const std::string dir =
      MadeModel("serve-mixtral",
                "--family mixtral --num_layers 2 --hidden_size 64 --num_kv_heads 2"
                " --num_experts 8 --num_experts_per_tok 2 --max_position_embeddings 256 --seed 5");
  return dir;
}

// Experts on disk, brought in one by one as the router picks them: the
// answers of the model held in RAM, and the expert counters move.
TEST(ServeOffloadTest, OffloadedExpertsAnswerAsTheModelInRamAndAreCounted) {
  const std::string prompt = "Experts on disk";
  const GenerateCli reference = RunGenerateTool(MixtralModelDir(), prompt, 10, "--device_map cpu");
  ASSERT_EQ(reference.token_ids.size(), 10u);
  // Under a memory cgroup whose limit binds (a fake one, through
  // $ACCEL_CGROUP_ROOT, which the server inherits), evicted experts leave the
  // page cache too, so the tiny cache's misses read the disk again and the
  // read counters move. (Without one they stay in the page cache, and a
  // checkpoint this small is read whole by the kernel's read-ahead at load.)
  TempDir cgroup;
  cgroup.Write("memory.max", "1073741824\n");
  cgroup.Write("memory.current", "0\n");
  cgroup.Write("memory.stat", "active_file 0\ninactive_file 0\n");
  ASSERT_EQ(::setenv("ACCEL_CGROUP_ROOT", cgroup.path().c_str(), 1), 0);
  auto server =
      StartOrDie(MixtralModelDir(), {"--offload_experts=true", "--max_memory=cpu=1MiB,disk=1GiB"});
  ::unsetenv("ACCEL_CGROUP_ROOT");
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  for (int round = 0; round < 2; ++round) {
    GenerateResponse response;
    grpc::Status status = Call(*stub, Greedy(prompt, 10), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(std::vector<int64_t>(response.token_ids().begin(), response.token_ids().end()),
              reference.token_ids)
        << "round " << round;
  }
  absl::StatusOr<std::string> text = server->Metrics();
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_GT(MetricValue(*text, "accel_weight_bytes{device=\"disk\"}").value_or(0), 0);
  // The dense parts stay in RAM: no module is fetched, only experts.
  EXPECT_EQ(MetricValue(*text, "accel_offload_fetches_total").value_or(-1), 0);
  const double fetches = MetricValue(*text, "accel_offload_expert_fetches_total").value_or(0);
  const double hits = MetricValue(*text, "accel_offload_expert_cache_hits_total").value_or(-1);
  EXPECT_GT(fetches, 0);
  EXPECT_GE(hits, 0);
  // 2 requests of 10 tokens, 2 sparse layers, top 2: at least 80 uses of an expert.
  EXPECT_GE(fetches + hits, 80);
  EXPECT_LE(MetricValue(*text, "accel_offload_expert_prefetch_hits_total").value_or(-1), hits);
  EXPECT_GT(MetricValue(*text, "accel_offload_read_bytes_per_token").value_or(0), 0);
  EXPECT_GT(MetricValue(*text, "accel_offload_disk_read_bytes_total").value_or(0), 0);
}

TEST(ServeLimitsTest, PromptOverMaxInputTokensIsRefused) {
  auto server = StartOrDie(TestModelDir(), {"--max_input_tokens=4", "--max_total_tokens=64"});
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  GenerateRequest request;
  for (int64_t id : std::vector<int64_t>{5, 6, 7, 8, 9}) request.mutable_input_ids()->add_ids(id);
  GenerateResponse response;
  grpc::Status status = Call(*stub, request, &response);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("--max_input_tokens"));
  request.mutable_input_ids()->mutable_ids()->RemoveLast();
  request.set_max_new_tokens(61);
  status = Call(*stub, request, &response);
  EXPECT_THAT(status.error_message(), HasSubstr("--max_total_tokens"));
  request.set_max_new_tokens(60);
  EXPECT_TRUE(Call(*stub, request, &response).ok());
}

TEST(ServeSchedulingTest, CancellingAStreamFreesItsSequence) {
  auto server = StartOrDie(SlowModelDir());
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  grpc::ClientContext context;
  auto reader = stub->GenerateStream(&context, Greedy("a long story", 4000));
  GenerateResponse chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  ASSERT_TRUE(reader->Read(&chunk));
  EXPECT_EQ(Metric(*server, "accel_num_requests_running"), 1);
  EXPECT_GT(Metric(*server, "accel_kv_cache_bytes"), 0);
  const double usage = Metric(*server, "accel_kv_cache_usage_ratio");
  EXPECT_GT(usage, 0);
  EXPECT_LE(usage, 1);
  context.TryCancel();
  while (reader->Read(&chunk)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::CANCELLED);
  EXPECT_TRUE(WaitForMetric(*server, "accel_num_requests_running", 0));
  EXPECT_GT(Metric(*server, "accel_kv_cache_blocks"), 0);
  EXPECT_TRUE(WaitForMetric(*server, "accel_kv_cache_usage_ratio", 0));
  EXPECT_TRUE(WaitForMetric(*server, "accel_request_failure_total{reason=\"cancelled\"}", 1));
}

TEST(ServeSchedulingTest, DeadlinesEndRequests) {
  auto server = StartOrDie(SlowModelDir(), {"--request_timeout=300ms"});
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  // The server's own limit.
  GenerateResponse response;
  grpc::Status status = Call(*stub, Greedy("a long story", 4000), &response);
  EXPECT_EQ(status.error_code(), grpc::DEADLINE_EXCEEDED);
  EXPECT_THAT(status.error_message(), HasSubstr("--request_timeout=300ms"));
  // The client's deadline, shorter than the server's.
  status = Call(*stub, Greedy("a long story", 4000), &response, absl::Milliseconds(100));
  EXPECT_EQ(status.error_code(), grpc::DEADLINE_EXCEEDED);
  EXPECT_TRUE(WaitForMetric(*server, "accel_num_requests_running", 0));
  EXPECT_TRUE(WaitForMetric(*server, "accel_kv_cache_usage_ratio", 0));
  // Both are timeouts (docs/API.md), the client's deadline too, though gRPC
  // tells the server of it as a cancellation.
  EXPECT_EQ(Metric(*server, "accel_request_failure_total{reason=\"timeout\"}"), 2);
  EXPECT_EQ(Metric(*server, "accel_request_failure_total{reason=\"cancelled\"}"), 0);
  // Short requests still work.
  EXPECT_TRUE(Call(*stub, Greedy("short", 2), &response).ok());
}

// A KV budget far below what the requests need together: they all finish,
// some preempted and recomputed, with the tokens each makes alone; a shared
// prompt prefix is found in the cache; a request larger than the whole
// budget is refused at once; and every block is free again at the end.
TEST(ServeSchedulingTest, RequestsUnderASmallKvBudgetAllFinishAsTheyWouldAlone) {
  // serve-small: 2 layers, 2 kv heads of 16 in float32, 512 bytes a token:
  // 64 KiB hold 128 tokens, the store's whole room.
  auto server = StartOrDie(TestModelDir(), {"--kv_cache_memory=64KiB", "--kv_block_size=4"});
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  EXPECT_EQ(Metric(*server, "accel_kv_cache_blocks"), 32);
  constexpr int kClients = 8;
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < kClients; ++i) {
    requests.push_back(Greedy(absl::StrCat("shared system prompt, then request ", i), 40));
  }
  std::vector<std::vector<int64_t>> alone(kClients);
  for (int i = 0; i < kClients; ++i) {
    GenerateResponse response;
    ASSERT_TRUE(Call(*stub, requests[static_cast<size_t>(i)], &response).ok());
    alone[static_cast<size_t>(i)].assign(response.token_ids().begin(), response.token_ids().end());
  }
  EXPECT_GT(Metric(*server, "accel_prefix_cache_hits_total"), 0);
  std::vector<std::vector<int64_t>> together(kClients);
  std::vector<grpc::Status> statuses(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      GenerateResponse response;
      statuses[static_cast<size_t>(i)] = Call(*stub, requests[static_cast<size_t>(i)], &response);
      together[static_cast<size_t>(i)].assign(response.token_ids().begin(),
                                              response.token_ids().end());
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_TRUE(statuses[static_cast<size_t>(i)].ok())
        << i << ": " << statuses[static_cast<size_t>(i)].error_message();
    EXPECT_EQ(together[static_cast<size_t>(i)], alone[static_cast<size_t>(i)]) << i;
  }
  EXPECT_GT(Metric(*server, "accel_num_preemptions_total"), 0);
  EXPECT_TRUE(WaitForMetric(*server, "accel_kv_cache_usage_ratio", 0));
  // Over the whole store: refused, naming the budget.
  GenerateResponse response;
  grpc::Status too_big = Call(*stub, Greedy("hi", 200), &response);
  EXPECT_EQ(too_big.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(too_big.error_message(), HasSubstr("--kv_cache_memory"));
}

TEST(ServeSchedulingTest, FullQueueIsResourceExhaustedWithARetryHint) {
  auto server = StartOrDie(SlowModelDir(), {"--max_batch_size=1", "--max_queue=1"});
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  // One running, one waiting.
  grpc::ClientContext running_context;
  auto running = stub->GenerateStream(&running_context, Greedy("first", 4000));
  GenerateResponse chunk;
  ASSERT_TRUE(running->Read(&chunk));
  grpc::ClientContext waiting_context;
  auto waiting = stub->GenerateStream(&waiting_context, Greedy("second", 4000));
  ASSERT_TRUE(WaitForMetric(*server, "accel_num_requests_waiting", 1));
  grpc::ClientContext context;
  GenerateResponse response;
  grpc::Status status = stub->Generate(&context, Greedy("third", 4), &response);
  EXPECT_EQ(status.error_code(), grpc::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--max_queue=1"));
  const auto& trailers = context.GetServerTrailingMetadata();
  EXPECT_NE(trailers.find("retry-after-ms"), trailers.end());
  EXPECT_GE(Metric(*server, "accel_request_failure_total{reason=\"overloaded\"}"), 1);
  running_context.TryCancel();
  waiting_context.TryCancel();
  while (running->Read(&chunk)) {
  }
  while (waiting->Read(&chunk)) {
  }
  running->Finish();
  waiting->Finish();
  // Once the server has seen both cancellations it takes requests again.
  EXPECT_TRUE(WaitForMetric(*server, "accel_num_requests_waiting", 0));
  EXPECT_TRUE(WaitForMetric(*server, "accel_num_requests_running", 0));
  grpc::ClientContext again;
  status = stub->Generate(&again, Greedy("fourth", 2), &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST(ServeLifecycleTest, SigtermDrainsInFlightRequestsAndExitsZero) {
  auto server = StartOrDie(SlowModelDir(), {"--shutdown_timeout=60s"});
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  grpc::ClientContext context;
  auto stream = stub->GenerateStream(&context, Greedy("in flight", 60));
  GenerateResponse chunk;
  ASSERT_TRUE(stream->Read(&chunk));
  int64_t tokens = chunk.token_ids_size();
  server->Signal(SIGTERM);
  // Ready turns NOT_SERVING; live stays SERVING; new requests are refused.
  const absl::Time end = absl::Now() + absl::Seconds(10);
  absl::StatusOr<HealthStatus::ServingStatus> ready = server->Health("accel.ready");
  while (absl::Now() < end && ready.ok() && *ready == HealthStatus::SERVING) {
    absl::SleepFor(absl::Milliseconds(10));
    ready = server->Health("accel.ready");
  }
  ASSERT_TRUE(ready.ok()) << ready.status() << "\n" << server->Stderr();
  EXPECT_EQ(*ready, HealthStatus::NOT_SERVING);
  EXPECT_EQ(*server->Health(""), HealthStatus::SERVING);
  GenerateResponse refused;
  grpc::Status status = Call(*stub, Greedy("too late", 2), &refused);
  EXPECT_EQ(status.error_code(), grpc::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("draining"));
  // The request in flight runs to its end.
  accel::v1::FinishReason finish = accel::v1::FINISH_REASON_UNSPECIFIED;
  while (stream->Read(&chunk)) {
    tokens += chunk.token_ids_size();
    if (chunk.finish_reason() != accel::v1::FINISH_REASON_UNSPECIFIED)
      finish = chunk.finish_reason();
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(tokens, 60);
  EXPECT_EQ(finish, accel::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(server->Wait(absl::Seconds(30)), 0) << server->Stderr();
}

TEST(ServeLifecycleTest, DrainPastItsGracePeriodEndsRequestsAsCancelled) {
  auto server = StartOrDie(SlowModelDir(), {"--shutdown_timeout=200ms"});
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  grpc::ClientContext context;
  auto stream = stub->GenerateStream(&context, Greedy("never ends", 4000));
  GenerateResponse chunk;
  ASSERT_TRUE(stream->Read(&chunk));
  server->Signal(SIGINT);
  accel::v1::FinishReason finish = accel::v1::FINISH_REASON_UNSPECIFIED;
  int64_t generated = 0;
  while (stream->Read(&chunk)) {
    if (chunk.finish_reason() != accel::v1::FINISH_REASON_UNSPECIFIED) {
      finish = chunk.finish_reason();
      generated = chunk.usage().generated_tokens();
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(finish, accel::v1::FINISH_REASON_CANCELLED);
  EXPECT_GT(generated, 0);
  EXPECT_LT(generated, 4000);
  EXPECT_EQ(server->Wait(absl::Seconds(30)), 0) << server->Stderr();
  EXPECT_THAT(server->Stderr(), HasSubstr("--shutdown_timeout"));
}

TEST(ServeAuthTest, BearerTokenIsRequiredExceptForHealth) {
  TempDir dir;
  const std::string token_file = dir.path() + "/token";
  std::ofstream(token_file) << "s3cret-token\n";
  auto server = StartOrDie(TestModelDir(), {"--auth_token_file=" + token_file});
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  GenerateResponse response;
  {
    grpc::ClientContext context;
    grpc::Status status = stub->Generate(&context, Greedy("hi", 2), &response);
    EXPECT_EQ(status.error_code(), grpc::UNAUTHENTICATED);
    EXPECT_THAT(status.error_message(), HasSubstr("authorization: Bearer"));
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer wrong-token!");
    EXPECT_EQ(stub->Generate(&context, Greedy("hi", 2), &response).error_code(),
              grpc::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer s3cret-token");
    EXPECT_TRUE(stub->Generate(&context, Greedy("hi", 2), &response).ok());
  }
  {
    grpc::ClientContext context;
    accel::v1::ModelInfo info;
    EXPECT_EQ(stub->GetModelInfo(&context, {}, &info).error_code(), grpc::UNAUTHENTICATED);
  }
  // Kubernetes probes carry no token.
  EXPECT_EQ(*server->Health("accel.ready"), HealthStatus::SERVING);
  EXPECT_EQ(Metric(*server, "accel_request_failure_total{reason=\"unauthenticated\"}"), 3);
}

TEST(ServeTlsTest, ServesOverTls) {
  TempDir dir;
  const std::string cert = dir.path() + "/cert.pem";
  const std::string key = dir.path() + "/key.pem";
  ASSERT_EQ(RunCommand("openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
                       "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
                       key + " -out " + cert + " > /dev/null 2>&1"),
            0);
  auto server = ServerProcess::Start(TestModelDir(), {"--tls_cert=" + cert, "--tls_key=" + key},
                                     absl::Seconds(60), /*wait_ready=*/false);
  ASSERT_TRUE(server.ok()) << server.status();
  std::ifstream in(cert);
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs.assign(std::istreambuf_iterator<char>(in), {});
  auto stub =
      Generation::NewStub(grpc::CreateChannel((*server)->address(), grpc::SslCredentials(ssl)));
  GenerateResponse response;
  grpc::Status status = grpc::Status::CANCELLED;
  // Ready is not probed over plain text here: retry until the model loaded.
  for (int i = 0; i < 200; ++i) {
    status = Call(*stub, Greedy("secure", 2), &response, absl::Seconds(5));
    if (status.error_code() != grpc::UNAVAILABLE) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.token_ids_size(), 2);
  // A plain-text client gets nowhere.
  auto plain = Generation::NewStub((*server)->Channel());
  EXPECT_FALSE(Call(*plain, Greedy("plain", 2), &response, absl::Seconds(2)).ok());
}

TEST(ServeNoTokenizerTest, TextNeedsATokenizerButIdsWork) {
  TempDir dir;
  const std::string model = dir.path() + "/no-tokenizer";
  ASSERT_EQ(
      RunCommand("cp -r " + TestModelDir() + " " + model + " && rm " + model + "/tokenizer.json"),
      0);
  auto server = StartOrDie(model);
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  GenerateResponse response;
  grpc::Status status = Call(*stub, Greedy("words", 2), &response);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("no tokenizer.json"));
  GenerateRequest ids;
  ids.mutable_input_ids()->add_ids(5);
  ids.set_max_new_tokens(3);
  ids.set_ignore_eos(true);
  status = Call(*stub, ids, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.token_ids_size(), 3);
  EXPECT_EQ(response.text(), "");
  ids.add_stop("x");
  status = Call(*stub, ids, &response);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("stop: this model has no tokenizer.json"));
}

// Parameters in the folder's *.safetensors (each tensor stored once: a tied
// lm_head is not written), read from the files' own headers.
int64_t CheckpointParameters(const std::string& dir) {
  int64_t total = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    uint64_t header_size = 0;
    in.read(reinterpret_cast<char*>(&header_size), sizeof header_size);  // little-endian host
    std::string header(header_size, '\0');
    in.read(header.data(), static_cast<std::streamsize>(header_size));
    const nlohmann::json tensors = nlohmann::json::parse(header);
    for (auto it = tensors.begin(); it != tensors.end(); ++it) {
      // Not parameters: the header's metadata, and rotary's inv_freq buffer.
      if (it.key() == "__metadata__" || absl::EndsWith(it.key(), "inv_freq")) continue;
      int64_t n = 1;
      for (const auto& d : it.value().at("shape")) n *= d.get<int64_t>();
      total += n;
    }
  }
  return total;
}

TEST(ServeDefaultModelTest, ServesTheEmbeddedModelWithoutModelFlag) {
  auto server = StartOrDie("");
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(server->Channel());
  grpc::ClientContext context;
  accel::v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.name(), "default-model");
  // Its lm_head is the embedding: one tensor, counted once.
  EXPECT_EQ(info.parameters(), CheckpointParameters(ACCEL_DEMO_MODEL_DIR));
  EXPECT_EQ(info.bytes_per_device().at("cpu"), 4 * info.parameters());
  GenerateResponse response;
  ASSERT_TRUE(Call(*stub, Greedy("The meaning of life is", 16), &response).ok());
  EXPECT_EQ(response.token_ids_size(), 16);
  // The embedded model is the trained demo model (models/demo), not random
  // weights: its text is words and spaces.
  const std::string& text = response.text();
  int letters_or_spaces = 0;
  for (unsigned char c : text) letters_or_spaces += (std::isalpha(c) || std::isspace(c)) ? 1 : 0;
  EXPECT_GT(text.size(), 16u) << text;
  EXPECT_GT(letters_or_spaces, static_cast<int>(text.size() * 8 / 10)) << text;
}

// A bad load option is refused before accel-serve opens a port: the message
// names it and no "listening" line is printed.
TEST(ServeFlagsBeforePortsTest, BadLoadOptionsFailBeforeAnyPortOpens) {
  for (const std::string flag : {"--dtype=bogus", "--device_map=moon", "--quantize=int4",
                                 "--quant_blocksize=3 --quantize=nf4", "--max_memory=gpu=1GB"}) {
    const CommandResult run =
        CommandOutput(absl::StrCat(BinDir(), "/accel-serve --model ", TestModelDir(),
                                   " --port 0 --metrics_port 0 ", flag, " 2>&1"));
    EXPECT_EQ(run.exit_code, 1) << flag;
    EXPECT_THAT(run.out, HasSubstr(flag.substr(0, flag.find('=')))) << run.out;
    EXPECT_THAT(run.out, Not(HasSubstr("listening"))) << run.out;
  }
}

struct BadFlags {
  std::vector<std::string> args;
  const char* message;
};

class ServeFlagsTest : public ::testing::TestWithParam<BadFlags> {};

TEST_P(ServeFlagsTest, BadFlagsExitOneWithAMessage) {
  auto server = ServerProcess::Start(TestModelDir(), GetParam().args, absl::Seconds(30));
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Flags, ServeFlagsTest,
    ::testing::Values(
        BadFlags{{"--max_batch_size=0"}, "--max_batch_size must be at least 1"},
        BadFlags{{"--model=/nonexistent/model"}, "/nonexistent/model/config.json"},
        BadFlags{{"--tls_cert=/tmp/x.pem"}, "--tls_cert and --tls_key"},
        BadFlags{{"--auth_token_file=/nonexistent"}, "--auth_token_file"},
        BadFlags{{"--dtype=float8"}, "float8"}, BadFlags{{"--device_map=cuda:3"}, "no CUDA"},
        BadFlags{{"--max_queue=0"}, "--max_queue must be at least 1"},
        BadFlags{{"stray"}, "unexpected argument"},
        BadFlags{{"--port=70000"}, "--port must be in [0, 65535]"},
        BadFlags{{"--metrics_port=-2"}, "--metrics_port must be -1 (off)"},
        BadFlags{{"--request_timeout=-1s"}, "--request_timeout must not be negative"},
        BadFlags{{"--shutdown_timeout=-1s"}, "--shutdown_timeout must not be negative"},
        BadFlags{{"--max_total_tokens=1"}, "leaves no room for a prompt"},
        BadFlags{{"--quantize=int4"}, "quantize 'int4'"},
        BadFlags{{"--double_quant"}, "double_quant applies to 4-bit"},
        BadFlags{{"--max_connection_age=-1s"}, "--max_connection_age must not be negative"},
        BadFlags{{"--kv_cache_memory=lots"}, "--kv_cache_memory=lots: give bytes"},
        BadFlags{{"--kv_cache_memory=1.5"}, "a fraction must be in (0, 1]"},
        BadFlags{{"--kv_cache_memory=100"}, "holds no KV block"},
        BadFlags{{"--kv_block_size=0"}, "--kv_block_size must be at least 1"},
        BadFlags{{"--max_num_batched_tokens=-1"}, "--max_num_batched_tokens must be 0 or more"},
        BadFlags{{R"(--speculative_config={"method": "eagle", "num_speculative_tokens": 2})"},
                 R"(--speculative_config: "method" must be "ngram" or "draft_model")"},
        BadFlags{{R"(--speculative_config={"method": "ngram"})"},
                 R"("num_speculative_tokens" is needed)"},
        BadFlags{{R"(--speculative_config={"model": "/nonexistent", "num_speculative_tokens": 2})"},
                 "/nonexistent/config.json"},
        BadFlags{{"--speculative_config={"}, "--speculative_config: invalid JSON"},
        // A file that is no certificate is named, not taken for a busy port.
        BadFlags{{"--tls_cert=/proc/self/cmdline", "--tls_key=/proc/self/cmdline"},
                 "--tls_cert: /proc/self/cmdline holds no valid PEM certificate"}),
    [](const ::testing::TestParamInfo<BadFlags>& info) {
      return absl::StrCat("case", info.index);
    });

}  // namespace
}  // namespace accel::testing
