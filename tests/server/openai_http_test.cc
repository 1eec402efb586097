// The OpenAI-compatible HTTP API of the real accel-serve binary: through the
// official `openai` npm client (pinned by tests/server/openai_client/
// package-lock.json, installed by scripts/openai_client.sh into
// build/npm-openai), and through raw sockets for what a client library
// would never send (malformed requests, slow clients, closed connections).
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <vector>

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <openssl/ssl.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "accel/v1/generation.grpc.pb.h"
#include "tests/server/generation_client.h"
#include "tests/server/server_process.h"
#include "tests/testing/temp_dir.h"

namespace accel::testing {
namespace {

using ::accel::test::TempDir;
using ::accel::v1::GenerateResponse;
using ::accel::v1::Generation;
using ::testing::HasSubstr;
using json = nlohmann::json;

constexpr char kToken[] = "sesame";

// A port nobody listens on now (the kernel's pick, released).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t length = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
  close(fd);
  return ntohs(addr.sin_port);
}

// accel-serve with --http_port on a free port (retried if another process
// took the port in between).
// wait_ready=false for a TLS server (the readiness probe speaks plain gRPC):
// WaitReady then.
std::unique_ptr<ServerProcess> StartHttp(const std::string& model, std::vector<std::string> args,
                                         bool wait_ready = true) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::vector<std::string> all = args;
    all.push_back(absl::StrCat("--http_port=", FreePort()));
    auto server = ServerProcess::Start(model, all, absl::Seconds(60), wait_ready);
    if (server.ok()) return *std::move(server);
    if (attempt == 2) ADD_FAILURE() << server.status();
  }
  return nullptr;
}

std::string ShellQuote(const std::string& text) {
  return absl::StrCat("'", absl::StrReplaceAll(text, {{"'", "'\\''"}}), "'");
}

// What `command` prints on stdout.
std::string Capture(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return "";
  std::string text;
  char buffer[4096];
  size_t read;
  while ((read = fread(buffer, 1, sizeof(buffer), pipe)) > 0) text.append(buffer, read);
  pclose(pipe);
  return text;
}

// Runs tests/server/openai_client/client.js: one call of the openai client
// at `base_url`; `env`: "NAME=value " words before the command.
json RunClientAt(const std::string& base_url, const std::string& key, const std::string& method,
                 const json& params = json::object(), const std::string& env = "") {
  const std::string npm = BinDir() + "/../npm-openai";
  if (!std::filesystem::exists(npm + "/node_modules/openai")) {
    ADD_FAILURE() << npm << " lacks the openai package: run scripts/openai_client.sh build";
    return json();
  }
  const std::string command =
      absl::StrCat(env, "node ", ACCEL_OPENAI_CLIENT_DIR, "/client.js ", npm, " ", base_url, " ",
                   ShellQuote(key), " ", method, " ", ShellQuote(params.dump()));
  const std::string text = Capture(command);
  json out = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (out.is_discarded()) ADD_FAILURE() << "client.js printed: " << text;
  return out;
}

json RunClient(int port, const std::string& key, const std::string& method,
               const json& params = json::object()) {
  return RunClientAt(absl::StrCat("http://127.0.0.1:", port, "/v1"), key, method, params);
}

// A connected socket to the server's HTTP port.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

// Reads until the server closes or `until` appears in what was read.
std::string ReadUntil(int fd, const std::string& until = "",
                      absl::Duration timeout = absl::Seconds(30)) {
  timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buffer[8192];
  while (until.empty() || out.find(until) == std::string::npos) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

// One request on a fresh connection (Connection: close); the whole response.
std::string Exchange(int port, const std::string& method, const std::string& path,
                     const std::string& body, const std::string& extra_headers = "") {
  const int fd = Connect(port);
  if (fd < 0) return "";
  SendAll(fd, absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n",
                           "Content-Type: application/json\r\nContent-Length: ", body.size(),
                           "\r\n", extra_headers, "\r\n", body));
  std::string response = ReadUntil(fd);
  close(fd);
  return response;
}

int StatusOf(const std::string& response) {
  if (response.size() < 12) return 0;
  return std::atoi(response.substr(9, 3).c_str());
}

json BodyOf(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  if (at == std::string::npos) return json();
  return json::parse(response.substr(at + 4), nullptr, false);
}

// OpenAI's error shape: {"error": {"message", "type", "param", "code"}}.
void ExpectOpenAiError(const std::string& response, int status, const std::string& type) {
  EXPECT_EQ(StatusOf(response), status) << response;
  const json body = BodyOf(response);
  ASSERT_TRUE(body.is_object()) << response;
  ASSERT_TRUE(body.contains("error")) << response;
  const json& error = body["error"];
  EXPECT_TRUE(error["message"].is_string());
  EXPECT_EQ(error["type"], type);
  EXPECT_TRUE(error.contains("param"));
  EXPECT_TRUE(error.contains("code"));
}

class OpenAiClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string token_file = BinDir() + "/../openai-http-test-token";
    FILE* f = std::fopen(token_file.c_str(), "w");
    std::fputs(kToken, f);
    std::fclose(f);
    server_ =
        StartHttp(TestModelDir(), {"--auth_token_file=" + token_file, "--tool_call_parser=hermes"})
            .release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }
  int port() const { return server_->http_port(); }
  static ServerProcess* server_;
};
ServerProcess* OpenAiClientTest::server_ = nullptr;

TEST_F(OpenAiClientTest, ModelsList) {
  const json out = RunClient(port(), kToken, "models.list");
  ASSERT_TRUE(out["ok"]) << out;
  ASSERT_EQ(out["result"].size(), 1u);
  const json& model = out["result"][0];
  EXPECT_EQ(model["id"], "serve-small");
  EXPECT_EQ(model["object"], "model");
  EXPECT_EQ(model["owned_by"], "accel");
  EXPECT_TRUE(model["created"].is_number_integer());
}

// Greedy /v1/completions equals accel.v1 Generate on the same prompt.
TEST_F(OpenAiClientTest, CompletionMatchesGrpcGenerate) {
  const json out = RunClient(port(), kToken, "completions.create",
                             {{"model", "serve-small"},
                              {"prompt", "hello world"},
                              {"max_tokens", 8},
                              {"temperature", 0},
                              {"ignore_eos", true}});
  ASSERT_TRUE(out["ok"]) << out;
  const json& result = out["result"];
  EXPECT_EQ(result["object"], "text_completion");
  EXPECT_TRUE(absl::StartsWith(result["id"].get<std::string>(), "cmpl-"));
  EXPECT_EQ(result["model"], "serve-small");
  ASSERT_EQ(result["choices"].size(), 1u);
  EXPECT_EQ(result["choices"][0]["index"], 0);
  EXPECT_EQ(result["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(result["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(result["usage"]["completion_tokens"], 8);
  EXPECT_EQ(result["usage"]["total_tokens"].get<int>(),
            result["usage"]["prompt_tokens"].get<int>() + 8);

  auto stub = Generation::NewStub(server_->Channel());
  accel::v1::GenerateRequest request = Greedy("hello world", 8);
  request.set_ignore_eos(true);
  GenerateResponse response;
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
  ASSERT_TRUE(stub->Generate(&context, request, &response).ok());
  EXPECT_EQ(result["choices"][0]["text"], response.text());
  EXPECT_EQ(result["usage"]["prompt_tokens"], response.usage().prompt_tokens());
}

TEST_F(OpenAiClientTest, StreamedCompletionJoinsToTheUnaryOne) {
  json params = {
      {"prompt", "once upon"}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}};
  const json unary = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(unary["ok"]) << unary;
  params["stream"] = true;
  params["stream_options"] = {{"include_usage", true}};
  const json streamed = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(streamed["ok"]) << streamed;
  const json& chunks = streamed["chunks"];
  ASSERT_GE(chunks.size(), 3u);
  std::string text;
  std::string finish;
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i]["object"], "text_completion");
    EXPECT_EQ(chunks[i]["id"], chunks[0]["id"]);
    EXPECT_TRUE(chunks[i]["usage"].is_null());
    ASSERT_EQ(chunks[i]["choices"].size(), 1u);
    text += chunks[i]["choices"][0]["text"].get<std::string>();
    if (!chunks[i]["choices"][0]["finish_reason"].is_null()) {
      finish = chunks[i]["choices"][0]["finish_reason"];
    }
  }
  EXPECT_EQ(text, unary["result"]["choices"][0]["text"]);
  EXPECT_EQ(finish, "length");
  const json& usage = chunks.back();  // include_usage: empty choices, the usage
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"], unary["result"]["usage"]);
}

TEST_F(OpenAiClientTest, CompletionLogprobs) {
  const json out = RunClient(port(), kToken, "completions.create",
                             {{"prompt", "hello"},
                              {"max_tokens", 4},
                              {"temperature", 0},
                              {"ignore_eos", true},
                              {"logprobs", 2}});
  ASSERT_TRUE(out["ok"]) << out;
  const json& logprobs = out["result"]["choices"][0]["logprobs"];
  ASSERT_EQ(logprobs["tokens"].size(), 4u);
  ASSERT_EQ(logprobs["token_logprobs"].size(), 4u);
  ASSERT_EQ(logprobs["top_logprobs"].size(), 4u);
  ASSERT_EQ(logprobs["text_offset"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_LE(logprobs["token_logprobs"][i].get<double>(), 0);
    EXPECT_GE(logprobs["top_logprobs"][i].size(), 1u);  // two ids may decode alike
    EXPECT_LE(logprobs["top_logprobs"][i].size(), 2u);
    // Greedy: the chosen token is the most likely one.
    double best = -1e9;
    for (const auto& [token, logprob] : logprobs["top_logprobs"][i].items()) {
      best = std::max(best, logprob.get<double>());
    }
    EXPECT_NEAR(best, logprobs["token_logprobs"][i].get<double>(), 1e-5);
  }
}

// n choices (issue 35): choice i of a seeded request is the single request
// seeded seed + i, each with its index; usage counts every choice's tokens;
// the stream's chunks, joined by index, are the unary choices, each with its
// finish_reason.
TEST_F(OpenAiClientTest, NChoicesAreSeededStreamsWithTheirIndex) {
  json params = {{"prompt", "once upon"}, {"max_tokens", 6}, {"temperature", 1}, {"seed", 77},
                 {"ignore_eos", true},    {"n", 3}};
  const json out = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(out["ok"]) << out;
  const json& choices = out["result"]["choices"];
  ASSERT_EQ(choices.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(choices[i]["index"], i);
    EXPECT_EQ(choices[i]["finish_reason"], "length");
    json one = params;
    one["n"] = 1;
    one["seed"] = 77 + i;
    const json alone = RunClient(port(), kToken, "completions.create", one);
    ASSERT_TRUE(alone["ok"]) << alone;
    EXPECT_EQ(choices[i]["text"], alone["result"]["choices"][0]["text"]) << "choice " << i;
  }
  EXPECT_EQ(out["result"]["usage"]["completion_tokens"], 18);

  params["stream"] = true;
  params["stream_options"] = {{"include_usage", true}};
  const json streamed = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(streamed["ok"]) << streamed;
  std::map<int, std::string> text;
  std::map<int, std::string> finish;
  for (const json& chunk : streamed["chunks"]) {
    for (const json& choice : chunk["choices"]) {
      const int index = choice["index"];
      text[index] += choice["text"].get<std::string>();
      if (!choice["finish_reason"].is_null()) {
        EXPECT_FALSE(finish.count(index)) << "choice " << index << " finished twice";
        finish[index] = choice["finish_reason"];
      }
    }
  }
  ASSERT_EQ(text.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(text[i], choices[i]["text"]) << "choice " << i;
    EXPECT_EQ(finish[i], "length");
  }
  EXPECT_EQ(streamed["chunks"].back()["usage"]["completion_tokens"], 18);

  // Greedy chat with n = 2: OpenAI allows it; the choices are equal.
  const json chat = RunClient(port(), kToken, "chat.completions.create",
                              {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                               {"max_tokens", 5},
                               {"temperature", 0},
                               {"n", 2}});
  ASSERT_TRUE(chat["ok"]) << chat;
  ASSERT_EQ(chat["result"]["choices"].size(), 2u);
  EXPECT_EQ(chat["result"]["choices"][1]["index"], 1);
  EXPECT_EQ(chat["result"]["choices"][0]["message"], chat["result"]["choices"][1]["message"]);
}

// vLLM's stop fields through the openai client (extra body fields):
// include_stop_str_in_output keeps the stop string; min_tokens holds it off;
// stop_token_ids end the text at the token.
TEST_F(OpenAiClientTest, StopFieldsAndMinTokens) {
  json params = {
      {"prompt", "once upon"}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}};
  const json plain = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(plain["ok"]) << plain;
  const std::string text = plain["result"]["choices"][0]["text"];
  ASSERT_GE(text.size(), 6u) << text;
  // Two characters from the middle as a stop string, where they first appear.
  const std::string stop = text.substr(text.size() / 2, 2);
  const size_t at = text.find(stop);
  params["stop"] = stop;
  json got = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(got["ok"]) << got;
  EXPECT_EQ(got["result"]["choices"][0]["text"], text.substr(0, at));
  EXPECT_EQ(got["result"]["choices"][0]["finish_reason"], "stop");
  params["include_stop_str_in_output"] = true;
  got = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(got["ok"]) << got;
  EXPECT_EQ(got["result"]["choices"][0]["text"], text.substr(0, at + stop.size()));
  // min_tokens past the stop string: it is not matched there.
  params["min_tokens"] = 12;
  got = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(got["ok"]) << got;
  EXPECT_EQ(got["result"]["usage"]["completion_tokens"], 12);
  EXPECT_EQ(got["result"]["choices"][0]["finish_reason"], "length");
}

// lm-eval-harness's loglikelihood call: token ids, max_tokens 0, echo,
// logprobs. The answer is the prompt alone: one entry per prompt token, the
// first null, no completion tokens. Checked across two paths of the engine:
// token 9's logprob after 5 6 7 8 read from the prefill's logits equals the
// logprob it has when generated after them (forced by logit_bias, which
// leaves the reported logprob the model's own).
TEST_F(OpenAiClientTest, EchoWithPromptLogprobsAsLmEvalHarnessAsks) {
  const json generated = RunClient(port(), kToken, "completions.create",
                                   {{"prompt", json::array({json::array({5, 6, 7, 8})})},
                                    {"max_tokens", 1},
                                    {"temperature", 0},
                                    {"ignore_eos", true},
                                    {"logit_bias", {{"9", 100}}},
                                    {"logprobs", 1}});
  ASSERT_TRUE(generated["ok"]) << generated;
  const json& first = generated["result"]["choices"][0]["logprobs"];
  const double logprob_of_9 = first["token_logprobs"][0];

  json params = {{"prompt", json::array({json::array({5, 6, 7, 8, 9})})},
                 {"max_tokens", 0},
                 {"echo", true},
                 {"logprobs", 1},
                 {"temperature", 0}};
  const json out = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(out["ok"]) << out;
  const json& choice = out["result"]["choices"][0];
  const json& logprobs = choice["logprobs"];
  ASSERT_EQ(logprobs["tokens"].size(), 5u) << out;
  ASSERT_EQ(logprobs["token_logprobs"].size(), 5u);
  ASSERT_EQ(logprobs["top_logprobs"].size(), 5u);
  ASSERT_EQ(logprobs["text_offset"].size(), 5u);
  EXPECT_TRUE(logprobs["token_logprobs"][0].is_null());
  EXPECT_TRUE(logprobs["top_logprobs"][0].is_null());
  std::string joined;
  for (size_t i = 0; i < 5; ++i) {
    if (i > 0) {
      EXPECT_LE(logprobs["token_logprobs"][i].get<double>(), 0) << i;
      EXPECT_GE(logprobs["top_logprobs"][i].size(), 1u) << i;
    }
    EXPECT_EQ(logprobs["text_offset"][i], joined.size()) << i;
    joined += logprobs["tokens"][i].get<std::string>();
  }
  EXPECT_EQ(logprobs["tokens"][4], first["tokens"][0]);
  EXPECT_NEAR(logprobs["token_logprobs"][4].get<double>(), logprob_of_9, 1e-4);
  EXPECT_EQ(choice["text"], joined);
  EXPECT_EQ(choice["finish_reason"], "length");
  EXPECT_EQ(out["result"]["usage"]["completion_tokens"], 0);
  EXPECT_EQ(out["result"]["usage"]["prompt_tokens"], 5);

  // echo with a generated token: the prompt's entries, then the token's.
  params["max_tokens"] = 1;
  params["ignore_eos"] = true;
  const json both = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(both["ok"]) << both;
  const json& all = both["result"]["choices"][0]["logprobs"];
  ASSERT_EQ(all["tokens"].size(), 6u) << both;
  EXPECT_EQ(all["text_offset"][5], joined.size());
  EXPECT_TRUE(absl::StartsWith(both["result"]["choices"][0]["text"].get<std::string>(), joined));
  EXPECT_EQ(both["result"]["usage"]["completion_tokens"], 1);

  // Streamed: the chunks join to the same text and entries, the prompt's
  // in the first chunk.
  params["max_tokens"] = 3;
  params["stream"] = true;
  const json streamed = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(streamed["ok"]) << streamed;
  params.erase("stream");
  const json unary = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(unary["ok"]) << unary;
  std::string text;
  json tokens = json::array();
  json token_logprobs = json::array();
  for (const json& chunk : streamed["chunks"]) {
    for (const json& choice : chunk["choices"]) {
      text += choice["text"].get<std::string>();
      if (choice["logprobs"].is_null()) continue;
      for (const json& t : choice["logprobs"]["tokens"]) tokens.push_back(t);
      for (const json& l : choice["logprobs"]["token_logprobs"]) token_logprobs.push_back(l);
    }
  }
  const json& whole = unary["result"]["choices"][0];
  EXPECT_TRUE(
      absl::StartsWith(streamed["chunks"][0]["choices"][0]["text"].get<std::string>(), joined))
      << streamed;
  EXPECT_EQ(text, whole["text"]);
  EXPECT_EQ(tokens, whole["logprobs"]["tokens"]);
  ASSERT_EQ(token_logprobs.size(), whole["logprobs"]["token_logprobs"].size());
  EXPECT_TRUE(token_logprobs[0].is_null());
  for (size_t i = 1; i < token_logprobs.size(); ++i) {
    EXPECT_NEAR(token_logprobs[i].get<double>(),
                whole["logprobs"]["token_logprobs"][i].get<double>(), 1e-4)
        << i;
  }
}

// A list of prompts: one choice per prompt x n, prompt p's choice j at index
// p * n + j, each what the prompt gives alone; usage counts every prompt and
// every choice.
TEST_F(OpenAiClientTest, AListOfPromptsGivesPromptsTimesNChoicesInOrder) {
  const std::vector<std::string> prompts = {"once upon", "hello there"};
  json params = {{"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true}};
  std::vector<json> alone;
  int64_t prompt_tokens = 0;
  for (const std::string& prompt : prompts) {
    json one = params;
    one["prompt"] = prompt;
    const json out = RunClient(port(), kToken, "completions.create", one);
    ASSERT_TRUE(out["ok"]) << out;
    alone.push_back(out["result"]["choices"][0]["text"]);
    prompt_tokens += out["result"]["usage"]["prompt_tokens"].get<int64_t>();
  }
  params["prompt"] = prompts;
  params["n"] = 2;
  const json out = RunClient(port(), kToken, "completions.create", params);
  ASSERT_TRUE(out["ok"]) << out;
  const json& choices = out["result"]["choices"];
  ASSERT_EQ(choices.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(choices[i]["index"], i);
    EXPECT_EQ(choices[i]["text"], alone[i / 2]) << "choice " << i;
  }
  EXPECT_EQ(out["result"]["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(out["result"]["usage"]["completion_tokens"], 20);
  // Token-id lists, with echo: each choice begins with its own prompt.
  const json ids = RunClient(
      port(), kToken, "completions.create",
      {{"prompt", {{5, 6, 7}, {8, 9}}}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}});
  ASSERT_TRUE(ids["ok"]) << ids;
  ASSERT_EQ(ids["result"]["choices"].size(), 2u);
  EXPECT_EQ(ids["result"]["choices"][0]["logprobs"]["tokens"].size(), 3u);
  EXPECT_EQ(ids["result"]["choices"][1]["logprobs"]["tokens"].size(), 2u);
  EXPECT_EQ(ids["result"]["usage"]["prompt_tokens"], 5);
}

TEST_F(OpenAiClientTest, BadChoiceAndStopFieldsAreBadRequestsNamingTheField) {
  const json chat_messages = {{{"role", "user"}, {"content", "hi"}}};
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"prompt", "x"}, {"n", 0}}, "n"},
      {{{"prompt", "x"}, {"n", 129}}, "n"},
      {{{"prompt", "x"}, {"n", 2}, {"best_of", 4}}, "best_of"},
      {{{"prompt", "x"}, {"max_tokens", 3}, {"min_tokens", 4}}, "min_tokens"},
      {{{"prompt", "x"}, {"stop_token_ids", {1, 1 << 30}}}, "stop_token_ids[1]"},
      {{{"messages", chat_messages}, {"echo", true}}, "echo"},
      {{{"prompt", "x"}, {"max_tokens", 0}}, "max_tokens"},  // 0 only with echo
      {{{"prompt", {"a", 5}}}, "prompt[1]"},
      {{{"prompt", {{1, 2}, json::array()}}}, "prompt[1]"},
  };
  for (const auto& [params, param] : cases) {
    const bool chat = params.contains("messages");
    const json out =
        RunClient(port(), kToken, chat ? "chat.completions.create" : "completions.create", params);
    ASSERT_FALSE(out["ok"]) << params;
    EXPECT_EQ(out["error"]["status"], 400) << params;
    EXPECT_TRUE(out["error"]["isBadRequest"]) << params;
    EXPECT_EQ(out["error"]["param"], param) << params << ": " << out;
  }
}

// Greedy chat through the openai client equals accel.v1 Chat (the same
// template rendering, the same end-of-turn stops) on the same messages.
TEST_F(OpenAiClientTest, ChatMatchesGrpcChat) {
  const json messages = {{{"role", "system"}, {"content", "be brief"}},
                         {{"role", "user"}, {"content", "hello there"}}};
  const json out = RunClient(port(), kToken, "chat.completions.create",
                             {{"model", "serve-small"},
                              {"messages", messages},
                              {"max_completion_tokens", 10},
                              {"temperature", 0}});
  ASSERT_TRUE(out["ok"]) << out;
  const json& result = out["result"];
  EXPECT_EQ(result["object"], "chat.completion");
  EXPECT_TRUE(absl::StartsWith(result["id"].get<std::string>(), "chatcmpl-"));
  ASSERT_EQ(result["choices"].size(), 1u);
  EXPECT_EQ(result["choices"][0]["message"]["role"], "assistant");
  const std::string finish = result["choices"][0]["finish_reason"];
  EXPECT_TRUE(finish == "stop" || finish == "length") << finish;

  auto stub = Generation::NewStub(server_->Channel());
  accel::v1::ChatRequest request;
  request.set_add_generation_prompt(true);
  request.set_max_new_tokens(10);
  for (const json& m : messages) {
    accel::v1::ChatMessage* message = request.add_messages();
    message->set_role(m["role"]);
    message->set_content(m["content"]);
  }
  GenerateResponse response;
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
  const grpc::Status status = stub->Chat(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(result["choices"][0]["message"]["content"], response.text());
  EXPECT_EQ(result["usage"]["prompt_tokens"], response.usage().prompt_tokens());
  EXPECT_EQ(result["usage"]["completion_tokens"], response.usage().generated_tokens());
}

TEST_F(OpenAiClientTest, ChatStreamAndLogprobs) {
  json params = {
      {"messages",
       {{{"role", "user"},
         {"content", {{{"type", "text"}, {"text", "hi "}}, {{"type", "text"}, {"text", "you"}}}}}}},
      {"max_tokens", 6},
      {"temperature", 0},
      {"ignore_eos", true},
      {"logprobs", true},
      {"top_logprobs", 2}};
  const json unary = RunClient(port(), kToken, "chat.completions.create", params);
  ASSERT_TRUE(unary["ok"]) << unary;
  const json& content = unary["result"]["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 6u);
  for (const json& entry : content) {
    EXPECT_TRUE(entry["token"].is_string());
    EXPECT_LE(entry["logprob"].get<double>(), 0);
    EXPECT_TRUE(entry["bytes"].is_array());
    EXPECT_GE(entry["top_logprobs"].size(), 1u);
    EXPECT_LE(entry["top_logprobs"].size(), 2u);
  }
  params["stream"] = true;
  params["stream_options"] = {{"include_usage", true}};
  const json streamed = RunClient(port(), kToken, "chat.completions.create", params);
  ASSERT_TRUE(streamed["ok"]) << streamed;
  const json& chunks = streamed["chunks"];
  ASSERT_GE(chunks.size(), 3u);
  EXPECT_EQ(chunks[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(chunks[0]["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  size_t logprob_entries = 0;
  std::string finish;
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    const json& choice = chunks[i]["choices"][0];
    if (choice["delta"].contains("content")) text += choice["delta"]["content"].get<std::string>();
    if (choice["logprobs"].is_object()) logprob_entries += choice["logprobs"]["content"].size();
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
  }
  EXPECT_EQ(text, unary["result"]["choices"][0]["message"]["content"]);
  EXPECT_EQ(logprob_entries, 6u);
  EXPECT_EQ(finish, "length");
  EXPECT_TRUE(chunks.back()["choices"].empty());
  EXPECT_EQ(chunks.back()["usage"]["completion_tokens"], 6);
}

// Structured output through the official client on a random-weight model:
// the mask alone makes its text parse and fit the schema (unary and
// streamed), choice lists hold, and an unsupported keyword is a 400 naming it.
TEST_F(OpenAiClientTest, StructuredOutputs) {
  const json schema = json::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 1, "maximum": 9},
      "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"], "additionalProperties": false})");
  const json params = {
      {"messages", json::array({{{"role", "user"}, {"content", "JSON please"}}})},
      {"max_tokens", 200},
      {"temperature", 1.0},
      {"seed", 5},
      {"response_format",
       {{"type", "json_schema"},
        {"json_schema", {{"name", "thing"}, {"strict", true}, {"schema", schema}}}}}};
  auto check = [](const std::string& content) {
    const json v = json::parse(content, nullptr, false);
    ASSERT_TRUE(v.is_object()) << content;
    EXPECT_TRUE(v["name"].is_string()) << content;
    ASSERT_TRUE(v["n"].is_number_integer()) << content;
    EXPECT_GE(v["n"].get<int>(), 1);
    EXPECT_LE(v["n"].get<int>(), 9);
    EXPECT_TRUE(v["ok"].is_boolean()) << content;
    EXPECT_EQ(v.size(), 3u) << content;
  };
  const json out = RunClient(port(), kToken, "chat.completions.create", params);
  ASSERT_TRUE(out["ok"].get<bool>()) << out.dump();
  EXPECT_EQ(out["result"]["choices"][0]["finish_reason"], "stop");
  check(out["result"]["choices"][0]["message"]["content"].get<std::string>());
  json streamed_params = params;
  streamed_params["stream"] = true;
  streamed_params["seed"] = 6;
  const json streamed = RunClient(port(), kToken, "chat.completions.create", streamed_params);
  ASSERT_TRUE(streamed["ok"].get<bool>()) << streamed.dump();
  std::string content;
  for (const json& chunk : streamed["chunks"]) {
    if (chunk["choices"].empty()) continue;
    const json& delta = chunk["choices"][0]["delta"];
    if (delta.contains("content") && delta["content"].is_string())
      content += delta["content"].get<std::string>();
  }
  check(content);

  const json choice =
      RunClient(port(), kToken, "completions.create",
                {{"prompt", "hello"}, {"max_tokens", 20}, {"guided_choice", {"yes", "no"}}});
  ASSERT_TRUE(choice["ok"].get<bool>()) << choice.dump();
  EXPECT_THAT(choice["result"]["choices"][0]["text"].get<std::string>(),
              ::testing::AnyOf("yes", "no"));

  json bad = params;
  bad["response_format"]["json_schema"]["schema"]["uniqueItems"] = true;
  const json refused = RunClient(port(), kToken, "chat.completions.create", bad);
  ASSERT_FALSE(refused["ok"].get<bool>());
  EXPECT_TRUE(refused["error"]["isBadRequest"].get<bool>());
  EXPECT_THAT(refused["error"]["message"].get<std::string>(), HasSubstr("uniqueItems"));
}

// tool_choice "required" (the server runs --tool_call_parser=hermes): the
// random model is held to a call of one of the tools, with arguments that
// fit its schema, returned as message.tool_calls (and delta.tool_calls).
TEST_F(OpenAiClientTest, ForcedToolCalls) {
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]},
      "days": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["city", "days"]}}}])");
  json params = {{"messages", json::array({{{"role", "user"}, {"content", "Weather?"}}})},
                 {"max_tokens", 200},
                 {"temperature", 1.0},
                 {"seed", 3},
                 {"tools", tools},
                 {"tool_choice", "required"}};
  const json out = RunClient(port(), kToken, "chat.completions.create", params);
  ASSERT_TRUE(out["ok"].get<bool>()) << out.dump();
  const json& choice = out["result"]["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls") << out.dump();
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u) << out.dump();
  const json& call = choice["message"]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["function"]["name"], "get_weather");
  const json args = json::parse(call["function"]["arguments"].get<std::string>());
  EXPECT_THAT(args["city"].get<std::string>(), ::testing::AnyOf("Oslo", "Rome"));
  EXPECT_GE(args["days"].get<int>(), 1);
  EXPECT_LE(args["days"].get<int>(), 3);

  params["stream"] = true;
  params["tool_choice"] = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  const json streamed = RunClient(port(), kToken, "chat.completions.create", params);
  ASSERT_TRUE(streamed["ok"].get<bool>()) << streamed.dump();
  int calls = 0;
  std::string finish;
  for (const json& chunk : streamed["chunks"]) {
    if (chunk["choices"].empty()) continue;
    const json& c = chunk["choices"][0];
    if (c["delta"].contains("tool_calls")) {
      // A call's first entry has its id and name; the rest, pieces of its arguments.
      for (const json& call : c["delta"]["tool_calls"]) {
        if (!call.contains("id")) continue;
        ++calls;
        EXPECT_EQ(call["function"]["name"], "get_weather");
      }
    }
    if (c["finish_reason"].is_string()) finish = c["finish_reason"];
  }
  EXPECT_EQ(calls, 1) << streamed.dump();
  EXPECT_EQ(finish, "tool_calls");
}

// The stream helper of the npm client (chat.completions.stream, the one
// runTools builds on) accumulates a streamed tool call: its first delta
// carries index, id, type, name and arguments "", the arguments follow in
// pieces as the model writes them, and the finish reason is tool_calls.
TEST_F(OpenAiClientTest, StreamedToolCallArgumentsComeInPieces) {
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]},
      "days": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["city", "days"]}}}])");
  const json params = {{"messages", json::array({{{"role", "user"}, {"content", "Weather?"}}})},
                       {"max_tokens", 200},
                       {"temperature", 1.0},
                       {"seed", 5},
                       {"tools", tools},
                       {"tool_choice", "required"}};
  const json out = RunClient(port(), kToken, "chat.completions.stream", params);
  ASSERT_TRUE(out["ok"].get<bool>()) << out.dump();
  std::string arguments;
  int argument_chunks = 0;
  bool first = true;
  std::string id;
  for (const json& chunk : out["chunks"]) {
    if (chunk["choices"].empty()) continue;
    const json& delta = chunk["choices"][0]["delta"];
    if (!delta.contains("tool_calls")) continue;
    for (const json& call : delta["tool_calls"]) {
      EXPECT_EQ(call["index"], 0);
      if (first) {
        first = false;
        EXPECT_EQ(call["type"], "function");
        EXPECT_EQ(call["function"]["name"], "get_weather");
        EXPECT_EQ(call["function"]["arguments"], "");
        id = call["id"];
        EXPECT_TRUE(absl::StartsWith(id, "call_")) << id;
        continue;
      }
      EXPECT_FALSE(call.contains("id")) << call.dump();
      ++argument_chunks;
      arguments += call["function"]["arguments"].get<std::string>();
    }
  }
  EXPECT_FALSE(first) << "no tool call streamed: " << out.dump();
  EXPECT_GT(argument_chunks, 2) << out.dump();  // in pieces, not one at the end
  const json args = json::parse(arguments);
  EXPECT_THAT(args["city"].get<std::string>(), ::testing::AnyOf("Oslo", "Rome"));
  // The helper's accumulation agrees.
  const json& final_choice = out["final"]["choices"][0];
  EXPECT_EQ(final_choice["finish_reason"], "tool_calls");
  ASSERT_EQ(final_choice["message"]["tool_calls"].size(), 1u) << out["final"].dump();
  const json& call = final_choice["message"]["tool_calls"][0];
  EXPECT_EQ(call["id"], id);
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(call["function"]["arguments"], arguments);
}

// POST /v1/responses through client.responses.create: the response object,
// the SDK's output_text, and the same text streamed as OpenAI's events.
TEST_F(OpenAiClientTest, ResponsesCreateAndStream) {
  json params = {{"model", "serve-small"},
                 {"input", "hello there"},
                 {"instructions", "be brief"},
                 {"max_output_tokens", 8},
                 {"temperature", 0}};
  const json unary = RunClient(port(), kToken, "responses.create", params);
  ASSERT_TRUE(unary["ok"].get<bool>()) << unary.dump();
  const json& response = unary["result"];
  EXPECT_TRUE(absl::StartsWith(response["id"].get<std::string>(), "resp_"));
  EXPECT_EQ(response["object"], "response");
  EXPECT_THAT(response["status"].get<std::string>(), ::testing::AnyOf("completed", "incomplete"));
  ASSERT_GE(response["output"].size(), 1u);
  EXPECT_EQ(response["output"][0]["type"], "message");
  const std::string text = response["output"][0]["content"][0]["text"];
  EXPECT_EQ(unary["output_text"], text);
  EXPECT_GT(response["usage"]["input_tokens"].get<int>(), 0);
  EXPECT_EQ(
      response["usage"]["total_tokens"].get<int>(),
      response["usage"]["input_tokens"].get<int>() + response["usage"]["output_tokens"].get<int>());
  EXPECT_LE(response["usage"]["output_tokens"].get<int>(), 8);

  // The same greedy text as chat completions of the same conversation.
  const json chat = RunClient(port(), kToken, "chat.completions.create",
                              {{"messages",
                                {{{"role", "system"}, {"content", "be brief"}},
                                 {{"role", "user"}, {"content", "hello there"}}}},
                               {"max_tokens", 8},
                               {"temperature", 0}});
  ASSERT_TRUE(chat["ok"].get<bool>()) << chat.dump();
  EXPECT_EQ(chat["result"]["choices"][0]["message"]["content"], text);

  params["stream"] = true;
  const json streamed = RunClient(port(), kToken, "responses.create", params);
  ASSERT_TRUE(streamed["ok"].get<bool>()) << streamed.dump();
  const json& events = streamed["chunks"];
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events[0]["type"], "response.created");
  EXPECT_EQ(events[1]["type"], "response.in_progress");
  std::string joined;
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i]["sequence_number"], static_cast<int>(i));
    if (events[i]["type"] == "response.output_text.delta") joined += events[i]["delta"];
  }
  EXPECT_EQ(joined, text);
  const std::string last = events.back()["type"];
  EXPECT_THAT(last, ::testing::AnyOf("response.completed", "response.incomplete"));
  EXPECT_EQ(events.back()["response"]["usage"], response["usage"]);

  // The SDK's stream helper assembles the same response.
  params.erase("stream");
  const json helper = RunClient(port(), kToken, "responses.stream", params);
  if (last == "response.completed") {
    ASSERT_TRUE(helper["ok"].get<bool>()) << helper.dump();
    EXPECT_EQ(helper["final"]["output"][0]["content"][0]["text"], text);
  }
}

// text.format json_schema: a random-weight model's output follows the schema.
TEST_F(OpenAiClientTest, ResponsesJsonSchema) {
  const json schema = json::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
      "maximum": 120}}, "required": ["name", "age"], "additionalProperties": false})");
  const json out = RunClient(
      port(), kToken, "responses.create",
      {{"input", "a person"},
       {"max_output_tokens", 120},
       {"temperature", 1.0},
       {"text",
        {{"format",
          {{"type", "json_schema"}, {"name", "person"}, {"schema", schema}, {"strict", true}}}}}});
  ASSERT_TRUE(out["ok"].get<bool>()) << out.dump();
  EXPECT_EQ(out["result"]["status"], "completed") << out.dump();
  const json person = json::parse(out["output_text"].get<std::string>(), nullptr, false);
  ASSERT_TRUE(person.is_object()) << out.dump();
  EXPECT_EQ(person.size(), 2u);
  EXPECT_TRUE(person["name"].is_string());
  // maxLength counts characters (code points), not UTF-8 bytes.
  int characters = 0;
  for (unsigned char c : person["name"].get<std::string>()) characters += (c & 0xc0) != 0x80;
  EXPECT_LE(characters, 8) << person.dump();
  EXPECT_GE(person["age"].get<int>(), 0);
  EXPECT_LE(person["age"].get<int>(), 120);

  // The SDK's stream helper (responses.stream) on the same request: its
  // finalResponse() needs response.completed, which a complete JSON text gets.
  const json helper = RunClient(
      port(), kToken, "responses.stream",
      {{"input", "a person"},
       {"max_output_tokens", 120},
       {"temperature", 1.0},
       {"text", {{"format", {{"type", "json_schema"}, {"name", "person"}, {"schema", schema}}}}}});
  ASSERT_TRUE(helper["ok"].get<bool>()) << helper.dump();
  EXPECT_EQ(helper["final"]["status"], "completed");
  const json streamed = json::parse(
      helper["final"]["output"][0]["content"][0]["text"].get<std::string>(), nullptr, false);
  ASSERT_TRUE(streamed.is_object()) << helper.dump();
  EXPECT_TRUE(streamed["name"].is_string());
  EXPECT_TRUE(streamed["age"].is_number_integer());
}

// Function tools: a forced call comes back as a function_call item (also
// streamed, its arguments in pieces), and its output goes back in input.
TEST_F(OpenAiClientTest, ResponsesFunctionTools) {
  const json tools = json::parse(R"([{"type": "function", "name": "get_weather",
      "description": "the weather", "parameters": {"type": "object", "properties":
      {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}}])");
  // Room to finish: a random model under the call's grammar may write a lot
  // of the whitespace JSON allows before it closes the call (100 tokens ran
  // out one run in three; the test model's context is 256 tokens).
  json params = {{"input", "Weather in Oslo?"},
                 {"max_output_tokens", 200},
                 {"temperature", 1.0},
                 {"tools", tools},
                 {"tool_choice", "required"}};
  const json out = RunClient(port(), kToken, "responses.create", params);
  ASSERT_TRUE(out["ok"].get<bool>()) << out.dump();
  json call;
  for (const json& item : out["result"]["output"]) {
    if (item["type"] == "function_call") call = item;
  }
  ASSERT_TRUE(call.is_object()) << out.dump();
  EXPECT_EQ(call["name"], "get_weather");
  EXPECT_TRUE(absl::StartsWith(call["call_id"].get<std::string>(), "call_"));
  EXPECT_THAT(json::parse(call["arguments"].get<std::string>())["city"].get<std::string>(),
              ::testing::AnyOf("Oslo", "Rome"));

  params["stream"] = true;
  const json streamed = RunClient(port(), kToken, "responses.create", params);
  ASSERT_TRUE(streamed["ok"].get<bool>()) << streamed.dump();
  int deltas = 0;
  std::string arguments;
  json done;
  for (const json& event : streamed["chunks"]) {
    if (event["type"] == "response.function_call_arguments.delta") {
      ++deltas;
      arguments += event["delta"];
    }
    if (event["type"] == "response.completed") done = event["response"];
  }
  EXPECT_GT(deltas, 1) << streamed.dump();
  ASSERT_TRUE(done.is_object()) << streamed.dump();
  EXPECT_EQ(done["output"].back()["type"], "function_call");
  EXPECT_EQ(done["output"].back()["arguments"], arguments);

  // The call and its output, sent back: a plain answer now.
  const json next = RunClient(
      port(), kToken, "responses.create",
      {{"input",
        {{{"role", "user"}, {"content", "Weather in Oslo?"}},
         {{"type", "function_call"},
          {"call_id", call["call_id"]},
          {"name", "get_weather"},
          {"arguments", call["arguments"]}},
         {{"type", "function_call_output"}, {"call_id", call["call_id"]}, {"output", "sunny"}}}},
       {"max_output_tokens", 4},
       {"tools", tools},
       {"tool_choice", "none"}});
  ASSERT_TRUE(next["ok"].get<bool>()) << next.dump();
  EXPECT_EQ(next["result"]["output"][0]["type"], "message");
}

TEST_F(OpenAiClientTest, ResponsesRefusesStateAsBadRequest) {
  for (const json& extra : {json{{"previous_response_id", "resp_123"}}, json{{"store", true}}}) {
    json params = {{"input", "hi"}, {"max_output_tokens", 2}};
    params.update(extra);
    const json out = RunClient(port(), kToken, "responses.create", params);
    ASSERT_FALSE(out["ok"].get<bool>()) << out.dump();
    EXPECT_TRUE(out["error"]["isBadRequest"].get<bool>()) << out.dump();
    EXPECT_EQ(out["error"]["param"], extra.begin().key()) << out.dump();
  }
  const json bad =
      RunClient(port(), kToken, "responses.create", {{"input", "hi"}, {"max_output_tokens", 0}});
  ASSERT_FALSE(bad["ok"].get<bool>());
  EXPECT_EQ(bad["error"]["param"], "max_output_tokens") << bad.dump();
}

// vLLM's /tokenize and /detokenize (bearer token as the API's other routes).
TEST_F(OpenAiClientTest, TokenizeAndDetokenize) {
  const std::string auth = absl::StrCat("Authorization: Bearer ", kToken, "\r\n");
  const std::string tokenized = Exchange(
      port(), "POST", "/tokenize",
      R"({"model": "serve-small", "prompt": "hello world", "add_special_tokens": false})", auth);
  ASSERT_EQ(StatusOf(tokenized), 200) << tokenized;
  const json body = BodyOf(tokenized);
  ASSERT_TRUE(body["tokens"].is_array()) << tokenized;
  EXPECT_EQ(body["count"], body["tokens"].size());
  EXPECT_GT(body["count"].get<int>(), 0);
  EXPECT_GT(body["max_model_len"].get<int>(), 0);
  // A round trip.
  const std::string detokenized =
      Exchange(port(), "POST", "/detokenize",
               json{{"model", "serve-small"}, {"tokens", body["tokens"]}}.dump(), auth);
  ASSERT_EQ(StatusOf(detokenized), 200) << detokenized;
  EXPECT_EQ(BodyOf(detokenized)["prompt"], "hello world");

  // Messages: the chat template's rendering, as many tokens as a chat
  // completion's prompt.
  const json messages = {{{"role", "user"}, {"content", "hello there"}}};
  const json chat_tokens =
      BodyOf(Exchange(port(), "POST", "/tokenize", json{{"messages", messages}}.dump(), auth));
  const json chat = RunClient(port(), kToken, "chat.completions.create",
                              {{"messages", messages}, {"max_tokens", 1}});
  ASSERT_TRUE(chat["ok"].get<bool>()) << chat.dump();
  EXPECT_EQ(chat_tokens["count"], chat["result"]["usage"]["prompt_tokens"]) << chat_tokens.dump();

  const std::string bad_id =
      Exchange(port(), "POST", "/detokenize", R"({"tokens": [1, 99999999]})", auth);
  ExpectOpenAiError(bad_id, 400, "invalid_request_error");
  EXPECT_EQ(BodyOf(bad_id)["error"]["param"], "tokens[1]") << bad_id;
  ExpectOpenAiError(
      Exchange(port(), "POST", "/tokenize", R"({"model": "other", "prompt": "x"})", auth), 404,
      "invalid_request_error");
  ExpectOpenAiError(
      Exchange(port(), "POST", "/detokenize", R"({"model": "other", "tokens": [1]})", auth), 404,
      "invalid_request_error");
  const std::string neither = Exchange(port(), "POST", "/tokenize", R"({"model": "x"})", auth);
  ExpectOpenAiError(neither, 400, "invalid_request_error");
  EXPECT_EQ(BodyOf(neither)["error"]["param"], "prompt");
  ExpectOpenAiError(Exchange(port(), "POST", "/tokenize", R"({"prompt": "x"})"), 401,
                    "invalid_request_error");
  // No --allowed_origins here: no CORS headers, whatever the Origin.
  const std::string models =
      Exchange(port(), "GET", "/v1/models", "", auth + "Origin: http://app.example\r\n");
  EXPECT_EQ(StatusOf(models), 200);
  EXPECT_THAT(models, ::testing::Not(HasSubstr("Access-Control-")));
}

// Tool calls on gRPC Chat and ChatStream: tool_choice forces a call (the
// server runs --tool_call_parser=hermes), which comes back parsed in
// tool_calls, not as text.
TEST_F(OpenAiClientTest, GrpcChatToolCalls) {
  auto stub = Generation::NewStub(server_->Channel());
  accel::v1::ChatRequest request;
  request.set_add_generation_prompt(true);
  request.set_max_new_tokens(100);
  request.mutable_sampling()->set_temperature(1.0);
  request.mutable_sampling()->set_seed(7);
  accel::v1::ChatMessage* message = request.add_messages();
  message->set_role("user");
  message->set_content("Weather?");
  request.add_tools_json(
      R"({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
          "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}}})");
  request.set_tool_choice("required");
  {
    GenerateResponse response;
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    const grpc::Status status = stub->Chat(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(response.tool_calls_size(), 1) << response.DebugString();
    EXPECT_EQ(response.tool_calls(0).name(), "get_weather");
    EXPECT_EQ(response.tool_calls(0).type(), "function");
    EXPECT_TRUE(absl::StartsWith(response.tool_calls(0).id(), "call_"));
    EXPECT_THAT(json::parse(response.tool_calls(0).arguments_json())["city"].get<std::string>(),
                ::testing::AnyOf("Oslo", "Rome"));
    EXPECT_EQ(response.text(), "");  // the call's text is not content
  }
  {
    // n = 2: each choice's call parsed on its own.
    request.set_n(2);
    GenerateResponse response;
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    const grpc::Status status = stub->Chat(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(response.choices_size(), 2);
    for (const accel::v1::Choice& choice : response.choices()) {
      ASSERT_EQ(choice.tool_calls_size(), 1) << choice.DebugString();
      EXPECT_EQ(choice.tool_calls(0).name(), "get_weather");
      EXPECT_TRUE(json::parse(choice.tool_calls(0).arguments_json()).contains("city"));
      EXPECT_EQ(choice.text(), "");
    }
    EXPECT_NE(response.choices(0).tool_calls(0).id(), response.choices(1).tool_calls(0).id());
    request.clear_n();
  }
  {
    request.set_tool_choice("");
    request.set_tool_choice_function("get_weather");
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    auto reader = stub->ChatStream(&context, request);
    GenerateResponse chunk;
    std::string text;
    std::vector<accel::v1::ToolCall> calls;
    while (reader->Read(&chunk)) {
      text += chunk.text();
      for (const auto& call : chunk.tool_calls()) calls.push_back(call);
    }
    const grpc::Status status = reader->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(calls.size(), 1u);
    EXPECT_EQ(calls[0].name(), "get_weather");
    EXPECT_TRUE(json::parse(calls[0].arguments_json()).contains("city"));
    EXPECT_EQ(text, "");
  }
  {
    // A stream of n = 2: each choice's one call, in its own messages.
    request.set_n(2);
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    auto reader = stub->ChatStream(&context, request);
    GenerateResponse chunk;
    std::map<int, std::vector<accel::v1::ToolCall>> calls;
    while (reader->Read(&chunk)) {
      for (const auto& call : chunk.tool_calls()) calls[chunk.index()].push_back(call);
      EXPECT_EQ(chunk.text(), "");
    }
    const grpc::Status status = reader->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(calls.size(), 2u);
    for (const auto& [index, made] : calls) {
      ASSERT_EQ(made.size(), 1u) << "choice " << index;
      EXPECT_EQ(made[0].name(), "get_weather");
      EXPECT_TRUE(json::parse(made[0].arguments_json()).contains("city"));
    }
    request.clear_n();
  }
  for (const auto& [choice, function, field] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"sometimes", "", "tool_choice"}, {"", "nope", "tool_choice_function"}}) {
    request.set_tool_choice(choice);
    request.set_tool_choice_function(function);
    GenerateResponse response;
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    const grpc::Status status = stub->Chat(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StartsWith(status.error_message(), field + ":")) << status.error_message();
  }
}

TEST_F(OpenAiClientTest, BadTemperatureIsABadRequestError) {
  const json out =
      RunClient(port(), kToken, "completions.create", {{"prompt", "hello"}, {"temperature", 7}});
  ASSERT_FALSE(out["ok"]) << out;
  EXPECT_EQ(out["error"]["class"], "BadRequestError");
  EXPECT_TRUE(out["error"]["isBadRequest"]);
  EXPECT_EQ(out["error"]["status"], 400);
  EXPECT_EQ(out["error"]["param"], "temperature");
  EXPECT_EQ(out["error"]["type"], "invalid_request_error");
}

TEST_F(OpenAiClientTest, UnknownModelIsNotFound) {
  const json out =
      RunClient(port(), kToken, "completions.create", {{"model", "gpt-4"}, {"prompt", "hello"}});
  ASSERT_FALSE(out["ok"]) << out;
  EXPECT_TRUE(out["error"]["isNotFound"]);
  EXPECT_EQ(out["error"]["code"], "model_not_found");
}

TEST_F(OpenAiClientTest, WrongKeyIsAnAuthenticationError) {
  const json out = RunClient(port(), "not-the-token", "models.list");
  ASSERT_FALSE(out["ok"]) << out;
  EXPECT_EQ(out["error"]["class"], "AuthenticationError");
  EXPECT_TRUE(out["error"]["isAuthentication"]);
  EXPECT_EQ(out["error"]["status"], 401);
  const std::string raw = Exchange(port(), "GET", "/v1/models", "");
  ExpectOpenAiError(raw, 401, "invalid_request_error");
  EXPECT_GE(Metric(*server_, "accel_request_failure_total{reason=\"unauthenticated\"}"), 2);
}

// Raw HTTP: what no client library sends.
class RawHttpTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = StartHttp(TestModelDir(), {"--http_request_timeout=1s",
                                         "--allowed_origins=http://app.example,http://b.example",
                                         "--allowed_methods=GET,POST"})
                  .release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }
  int port() const { return server_->http_port(); }
  static ServerProcess* server_;
};
ServerProcess* RawHttpTest::server_ = nullptr;

TEST_F(RawHttpTest, MalformedJson) {
  const std::string response = Exchange(port(), "POST", "/v1/completions", "{\"prompt\": ");
  ExpectOpenAiError(response, 400, "invalid_request_error");
  EXPECT_THAT(response, HasSubstr("the body: invalid JSON"));
  ExpectOpenAiError(Exchange(port(), "POST", "/v1/chat/completions", "[1, 2]"), 400,
                    "invalid_request_error");
  ExpectOpenAiError(Exchange(port(), "POST", "/v1/completions", std::string(100000, '[')), 400,
                    "invalid_request_error");
}

TEST_F(RawHttpTest, WrongTypesNameTheField) {
  const std::string response =
      Exchange(port(), "POST", "/v1/completions", R"({"prompt": "hi", "max_tokens": "ten"})");
  ExpectOpenAiError(response, 400, "invalid_request_error");
  EXPECT_EQ(BodyOf(response)["error"]["param"], "max_tokens");
  EXPECT_EQ(BodyOf(Exchange(port(), "POST", "/v1/chat/completions",
                            R"({"messages": "hello"})"))["error"]["param"],
            "messages");
  EXPECT_EQ(BodyOf(Exchange(port(), "POST", "/v1/completions",
                            R"({"prompt": "hi", "n": "2"})"))["error"]["param"],
            "n");
  EXPECT_EQ(BodyOf(Exchange(port(), "POST", "/v1/completions",
                            R"({"prompt": "hi", "presence_penalty": "high"})"))["error"]["param"],
            "presence_penalty");
  // The engine's own validation, in OpenAI's shape.
  ExpectOpenAiError(Exchange(port(), "POST", "/v1/completions", R"({"prompt": [999999]})"), 400,
                    "invalid_request_error");
}

TEST_F(RawHttpTest, OversizedBodyIs413) {
  const int fd = Connect(port());
  ASSERT_GE(fd, 0);
  SendAll(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n");
  const std::string response = ReadUntil(fd);
  close(fd);
  ExpectOpenAiError(response, 413, "invalid_request_error");
}

// CORS with --allowed_origins: an allowed origin's answers carry
// Access-Control-Allow-Origin and its preflight a 204 with the Allow-*
// headers; another origin gets no CORS headers.
TEST_F(RawHttpTest, Cors) {
  const std::string preflight =
      Exchange(port(), "OPTIONS", "/v1/chat/completions", "",
               "Origin: http://app.example\r\nAccess-Control-Request-Method: POST\r\n"
               "Access-Control-Request-Headers: authorization, content-type\r\n");
  EXPECT_EQ(StatusOf(preflight), 204) << preflight;
  EXPECT_THAT(preflight, HasSubstr("Access-Control-Allow-Origin: http://app.example\r\n"));
  EXPECT_THAT(preflight, HasSubstr("Access-Control-Allow-Methods: GET, POST\r\n"));
  EXPECT_THAT(preflight,
              HasSubstr("Access-Control-Allow-Headers: authorization, content-type\r\n"));
  // A method the flags leave out.
  const std::string put = Exchange(port(), "OPTIONS", "/v1/models", "",
                                   "Origin: http://app.example\r\n"
                                   "Access-Control-Request-Method: PUT\r\n");
  EXPECT_EQ(StatusOf(put), 400) << put;
  EXPECT_THAT(put, ::testing::Not(HasSubstr("Access-Control-Allow-Methods")));

  const std::string evil = Exchange(port(), "OPTIONS", "/v1/chat/completions", "",
                                    "Origin: http://evil.example\r\n"
                                    "Access-Control-Request-Method: POST\r\n");
  EXPECT_EQ(StatusOf(evil), 400) << evil;
  EXPECT_THAT(evil, ::testing::Not(HasSubstr("Access-Control-")));

  const std::string allowed =
      Exchange(port(), "GET", "/v1/models", "", "Origin: http://b.example\r\n");
  EXPECT_EQ(StatusOf(allowed), 200);
  EXPECT_THAT(allowed, HasSubstr("Access-Control-Allow-Origin: http://b.example\r\n"));
  // Errors and streams carry it too.
  const std::string error =
      Exchange(port(), "POST", "/v1/completions", "{", "Origin: http://app.example\r\n");
  EXPECT_EQ(StatusOf(error), 400);
  EXPECT_THAT(error, HasSubstr("Access-Control-Allow-Origin: http://app.example\r\n"));
  const std::string stream = Exchange(port(), "POST", "/v1/completions",
                                      R"({"prompt": "hi", "max_tokens": 2, "stream": true})",
                                      "Origin: http://app.example\r\n");
  EXPECT_EQ(StatusOf(stream), 200);
  EXPECT_THAT(stream, HasSubstr("Access-Control-Allow-Origin: http://app.example\r\n"));

  const std::string other =
      Exchange(port(), "GET", "/v1/models", "", "Origin: http://evil.example\r\n");
  EXPECT_EQ(StatusOf(other), 200);
  EXPECT_THAT(other, ::testing::Not(HasSubstr("Access-Control-")));
  // OPTIONS without an Origin is no preflight: the route's 405.
  EXPECT_EQ(StatusOf(Exchange(port(), "OPTIONS", "/v1/models", "")), 405);
}

TEST_F(RawHttpTest, UnknownRouteAndWrongMethod) {
  ExpectOpenAiError(Exchange(port(), "GET", "/v1/engines", ""), 404, "invalid_request_error");
  ExpectOpenAiError(Exchange(port(), "GET", "/", ""), 404, "invalid_request_error");
  const std::string wrong = Exchange(port(), "GET", "/v1/completions", "");
  ExpectOpenAiError(wrong, 405, "invalid_request_error");
  EXPECT_THAT(wrong, HasSubstr("Allow: POST"));
  ExpectOpenAiError(Exchange(port(), "POST", "/v1/models", "{}"), 405, "invalid_request_error");
  EXPECT_EQ(StatusOf(Exchange(port(), "GET", "/v1/models/serve-small", "")), 200);
  ExpectOpenAiError(Exchange(port(), "GET", "/v1/models/other", ""), 404, "invalid_request_error");
  ExpectOpenAiError(Exchange(port(), "GARBAGE", "nonsense", ""), 400, "invalid_request_error");
}

// A client that trickles its request head is answered 408 and closed after
// --http_request_timeout, and others are served meanwhile.
TEST_F(RawHttpTest, SlowClientTimesOutAndOthersAreServed) {
  std::vector<int> slow;
  for (int i = 0; i < 20; ++i) slow.push_back(Connect(port()));
  const absl::Time start = absl::Now();
  std::thread trickle([&] {
    const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n";
    for (size_t i = 0; i < head.size() && absl::Now() - start < absl::Seconds(3); ++i) {
      for (int fd : slow) SendAll(fd, head.substr(i, 1));
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  // Served while the slow ones trickle.
  const std::string fast = Exchange(port(), "GET", "/v1/models", "");
  EXPECT_EQ(StatusOf(fast), 200);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(900));
  const std::string answer = ReadUntil(slow[0], "", absl::Seconds(5));
  const absl::Duration took = absl::Now() - start;
  trickle.join();
  EXPECT_EQ(StatusOf(answer), 408) << answer;
  EXPECT_GE(took, absl::Milliseconds(900));
  EXPECT_LT(took, absl::Seconds(3));
  for (int fd : slow) close(fd);
  // A connection that sends nothing at all is closed too.
  const int idle = Connect(port());
  EXPECT_EQ(StatusOf(ReadUntil(idle, "", absl::Seconds(5))), 408);
  close(idle);
}

TEST_F(RawHttpTest, SseFramingAndKeepAlive) {
  const int fd = Connect(port());
  ASSERT_GE(fd, 0);
  const std::string body =
      R"({"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": true, "stream": true})";
  const std::string request =
      absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ", body.size(),
                   "\r\n\r\n", body);
  SendAll(fd, request);
  const std::string first = ReadUntil(fd, "0\r\n\r\n");
  EXPECT_THAT(first, HasSubstr("Content-Type: text/event-stream"));
  EXPECT_THAT(first, HasSubstr("data: [DONE]\n\n"));
  // The same connection serves the next request.
  SendAll(fd, "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string second = ReadUntil(fd, "\"owned_by\"");
  EXPECT_EQ(StatusOf(second), 200);
  close(fd);
}

// A client that closes its connection cancels its request, streamed or not.
TEST(OpenAiHttpCancelTest, ClosedConnectionCancelsTheRequest) {
  auto server = StartHttp(SlowModelDir(), {});
  ASSERT_NE(server, nullptr);
  for (bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "stream" : "unary");
    const json body = {{"prompt", "a long story"},
                       {"max_tokens", 3000},
                       {"ignore_eos", true},
                       {"temperature", 0},
                       {"stream", stream}};
    const int fd = Connect(server->http_port());
    ASSERT_GE(fd, 0);
    SendAll(fd, absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ",
                             body.dump().size(), "\r\n\r\n", body.dump()));
    if (stream) {
      const std::string some = ReadUntil(fd, "data: ", absl::Seconds(20));
      EXPECT_THAT(some, HasSubstr("data: "));
    }
    ASSERT_TRUE(WaitForMetric(*server, "accel_num_requests_running", 1));
    const double cancelled = Metric(*server, "accel_request_failure_total{reason=\"cancelled\"}");
    close(fd);
    const absl::Time closed = absl::Now();
    EXPECT_TRUE(WaitForMetric(*server, "accel_num_requests_running", 0, absl::Seconds(5)));
    EXPECT_LT(absl::Now() - closed, absl::Seconds(2));
    EXPECT_TRUE(
        WaitForMetric(*server, "accel_request_failure_total{reason=\"cancelled\"}", cancelled + 1));
  }
}

// SIGTERM: new requests get 503, a stream in flight runs to its end, exit 0.
TEST(OpenAiHttpDrainTest, DrainFinishesStreamsAndRefusesNewRequests) {
  auto server = StartHttp(SlowModelDir(), {"--shutdown_timeout=60s"});
  ASSERT_NE(server, nullptr);
  const json body = {{"prompt", "a story"},
                     {"max_tokens", 40},
                     {"ignore_eos", true},
                     {"temperature", 0},
                     {"stream", true}};
  const int fd = Connect(server->http_port());
  ASSERT_GE(fd, 0);
  SendAll(fd, absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ",
                           body.dump().size(), "\r\n\r\n", body.dump()));
  std::string stream = ReadUntil(fd, "data: ", absl::Seconds(20));
  const int other = Connect(server->http_port());  // connected before the drain
  server->Signal(SIGTERM);
  ASSERT_TRUE(WaitForMetric(*server, "accel_draining", 1, absl::Seconds(5)));
  const std::string refused_body = R"({"prompt": "hi"})";
  SendAll(other, absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ",
                              refused_body.size(), "\r\n\r\n", refused_body));
  const std::string refused = ReadUntil(other, "}}");
  close(other);
  ExpectOpenAiError(refused, 503, "server_error");
  EXPECT_THAT(refused, HasSubstr("Retry-After: 1"));
  stream += ReadUntil(fd, "0\r\n\r\n");
  close(fd);
  EXPECT_THAT(stream, HasSubstr("\"finish_reason\":\"length\""));
  EXPECT_THAT(stream, HasSubstr("data: [DONE]"));
  EXPECT_EQ(server->Wait(absl::Seconds(30)), 0);
}

// --http_port with --tls_cert is HTTPS (OpenAiHttpsTest); the certificate
// files are checked, and named, before any port opens.
TEST(OpenAiHttpStartTest, HttpPortWithTlsChecksTheCertificateFiles) {
  auto server = ServerProcess::Start(
      TestModelDir(),
      {"--http_port=1", "--tls_cert=/nonexistent.pem", "--tls_key=/nonexistent.key"},
      absl::Seconds(30), /*wait_ready=*/false);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("/nonexistent.pem"));
  EXPECT_THAT(std::string(server.status().message()), ::testing::Not(HasSubstr("--http_port")));
}

// A full queue: 429 with Retry-After (OpenAI's rate_limit_error), as the
// gRPC API answers RESOURCE_EXHAUSTED with retry-after-ms.
TEST(OpenAiHttpQueueTest, FullQueueIs429WithRetryAfter) {
  auto server = StartHttp(SlowModelDir(), {"--max_batch_size=1", "--max_queue=1"});
  ASSERT_NE(server, nullptr);
  auto stream_request = [](const std::string& prompt) {
    const std::string body = json({{"prompt", prompt},
                                   {"max_tokens", 4000},
                                   {"ignore_eos", true},
                                   {"temperature", 0},
                                   {"stream", true}})
                                 .dump();
    return absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ", body.size(),
                        "\r\n\r\n", body);
  };
  // One running, one waiting.
  const int running = Connect(server->http_port());
  ASSERT_GE(running, 0);
  SendAll(running, stream_request("first"));
  EXPECT_THAT(ReadUntil(running, "data: ", absl::Seconds(20)), HasSubstr("data: "));
  const int waiting = Connect(server->http_port());
  ASSERT_GE(waiting, 0);
  SendAll(waiting, stream_request("second"));
  ASSERT_TRUE(WaitForMetric(*server, "accel_num_requests_waiting", 1));

  const std::string refused = Exchange(server->http_port(), "POST", "/v1/completions",
                                       R"({"prompt": "third", "max_tokens": 4})");
  ExpectOpenAiError(refused, 429, "rate_limit_error");
  EXPECT_THAT(refused, HasSubstr("Retry-After: 1\r\n"));
  EXPECT_EQ(BodyOf(refused)["error"]["code"], "rate_limit_exceeded");
  EXPECT_THAT(refused, HasSubstr("--max_queue=1"));
  // The openai client sees a RateLimitError (client.js: maxRetries 0).
  const json out = RunClient(server->http_port(), "unused", "completions.create",
                             {{"prompt", "fourth"}, {"max_tokens", 4}});
  ASSERT_FALSE(out["ok"]) << out;
  EXPECT_EQ(out["error"]["class"], "RateLimitError");
  EXPECT_EQ(out["error"]["status"], 429);
  EXPECT_GE(Metric(*server, "accel_request_failure_total{reason=\"overloaded\"}"), 2);

  // Once both are cancelled (their connections closed) requests are taken again.
  close(running);
  close(waiting);
  EXPECT_TRUE(WaitForMetric(*server, "accel_num_requests_waiting", 0));
  EXPECT_TRUE(WaitForMetric(*server, "accel_num_requests_running", 0));
  EXPECT_EQ(StatusOf(Exchange(server->http_port(), "POST", "/v1/completions",
                              R"({"prompt": "fifth", "max_tokens": 2})")),
            200);
}

// HTTPS: --http_port with --tls_cert/--tls_key.

// A self-signed certificate for localhost and 127.0.0.1 in `dir`.
bool MakeCertificate(const TempDir& dir) {
  return RunCommand(
             "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
             "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
             dir.File("key.pem") + " -out " + dir.File("cert.pem") + " > /dev/null 2>&1") == 0;
}

std::vector<std::string> TlsFlags(const TempDir& dir) {
  return {"--tls_cert=" + dir.File("cert.pem"), "--tls_key=" + dir.File("key.pem")};
}

// A TLS client on the HTTP port (OpenSSL), verifying the server's
// certificate against `ca_file` as a client library would.
class TlsClient {
 public:
  static std::unique_ptr<TlsClient> Open(int port, const std::string& ca_file) {
    std::unique_ptr<TlsClient> client(new TlsClient());
    client->ctx_ = SSL_CTX_new(TLS_client_method());
    if (client->ctx_ == nullptr ||
        SSL_CTX_load_verify_locations(client->ctx_, ca_file.c_str(), nullptr) != 1) {
      return nullptr;
    }
    SSL_CTX_set_verify(client->ctx_, SSL_VERIFY_PEER, nullptr);
    client->fd_ = Connect(port);
    if (client->fd_ < 0) return nullptr;
    timeval tv = absl::ToTimeval(absl::Seconds(30));
    setsockopt(client->fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    client->ssl_ = SSL_new(client->ctx_);
    SSL_set_fd(client->ssl_, client->fd_);
    SSL_set_tlsext_host_name(client->ssl_, "localhost");
    SSL_set1_host(client->ssl_, "localhost");
    if (SSL_connect(client->ssl_) != 1) {
      ADD_FAILURE() << "TLS handshake failed";
      return nullptr;
    }
    return client;
  }
  ~TlsClient() {
    if (ssl_ != nullptr) SSL_free(ssl_);
    if (fd_ >= 0) close(fd_);
    if (ctx_ != nullptr) SSL_CTX_free(ctx_);
  }
  TlsClient(const TlsClient&) = delete;
  TlsClient& operator=(const TlsClient&) = delete;

  bool Send(const std::string& data) {
    return SSL_write(ssl_, data.data(), static_cast<int>(data.size())) ==
           static_cast<int>(data.size());
  }
  // Reads until the server closes or `until` appears.
  std::string ReadUntil(const std::string& until = "") {
    std::string out;
    char buffer[8192];
    while (until.empty() || out.find(until) == std::string::npos) {
      const int n = SSL_read(ssl_, buffer, sizeof(buffer));
      if (n <= 0) break;
      out.append(buffer, static_cast<size_t>(n));
    }
    return out;
  }
  // Sends close_notify; the TCP connection stays open.
  void CloseNotify() { SSL_shutdown(ssl_); }

 private:
  TlsClient() = default;
  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
  int fd_ = -1;
};

// GET /v1/models over TLS on a fresh connection: the status.
int HttpsModelsStatus(int port, const std::string& ca_file) {
  auto client = TlsClient::Open(port, ca_file);
  if (client == nullptr) return 0;
  client->Send("GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
  return StatusOf(client->ReadUntil());
}

std::string CompletionRequest(const json& body) {
  return absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: ",
                      body.dump().size(), "\r\n\r\n", body.dump());
}

class OpenAiHttpsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    if (!MakeCertificate(*dir_)) return;
    std::vector<std::string> flags = TlsFlags(*dir_);
    flags.push_back("--http_request_timeout=2s");
    server_ = StartHttp(TestModelDir(), flags, /*wait_ready=*/false).release();
    if (server_ != nullptr && !WaitForMetric(*server_, "accel_ready", 1, absl::Seconds(60))) {
      ADD_FAILURE() << "the TLS server did not become ready";
    }
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr) << "openssl req or accel-serve failed"; }
  int port() const { return server_->http_port(); }
  std::string cert() const { return dir_->File("cert.pem"); }
  std::string base_url() const { return absl::StrCat("https://127.0.0.1:", port(), "/v1"); }
  static TempDir* dir_;
  static ServerProcess* server_;
};
TempDir* OpenAiHttpsTest::dir_ = nullptr;
ServerProcess* OpenAiHttpsTest::server_ = nullptr;

// The official openai client over https with the certificate trusted
// (NODE_EXTRA_CA_CERTS): a chat completion, and a streamed completion equal
// to the unary one. Without the certificate trusted it refuses the server.
TEST_F(OpenAiHttpsTest, OpenAiClientOverHttps) {
  const std::string trust = absl::StrCat("NODE_EXTRA_CA_CERTS=", ShellQuote(cert()), " ");
  const json chat = RunClientAt(base_url(), "unused", "chat.completions.create",
                                {{"messages", {{{"role", "user"}, {"content", "hello over TLS"}}}},
                                 {"max_tokens", 6},
                                 {"temperature", 0},
                                 {"ignore_eos", true}},
                                trust);
  ASSERT_TRUE(chat["ok"]) << chat;
  EXPECT_EQ(chat["result"]["object"], "chat.completion");
  EXPECT_EQ(chat["result"]["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["result"]["usage"]["completion_tokens"], 6);

  json params = {
      {"prompt", "secure story"}, {"max_tokens", 10}, {"temperature", 0}, {"ignore_eos", true}};
  const json unary = RunClientAt(base_url(), "unused", "completions.create", params, trust);
  ASSERT_TRUE(unary["ok"]) << unary;
  params["stream"] = true;
  const json streamed = RunClientAt(base_url(), "unused", "completions.create", params, trust);
  ASSERT_TRUE(streamed["ok"]) << streamed;
  ASSERT_GE(streamed["chunks"].size(), 2u);
  std::string text;
  for (const json& chunk : streamed["chunks"]) {
    text += chunk["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, unary["result"]["choices"][0]["text"]);
  EXPECT_EQ(streamed["chunks"].back()["choices"][0]["finish_reason"], "length");

  const json untrusted =
      RunClientAt(base_url(), "unused", "models.list", json::object(), "NODE_EXTRA_CA_CERTS= ");
  ASSERT_FALSE(untrusted["ok"]) << untrusted;
  EXPECT_EQ(untrusted["error"]["class"], "APIConnectionError");
}

// Plain HTTP to the TLS port is answered 400 in plain text; bytes that are
// neither are dropped; the server goes on serving over TLS.
TEST_F(OpenAiHttpsTest, PlainHttpFailsCleanlyAndTheServerGoesOn) {
  const std::string plain = Exchange(port(), "GET", "/v1/models", "");
  ExpectOpenAiError(plain, 400, "invalid_request_error");
  EXPECT_THAT(plain, HasSubstr("https://"));
  const std::string posted =
      Exchange(port(), "POST", "/v1/completions", R"({"prompt": "hi", "max_tokens": 2})");
  EXPECT_EQ(StatusOf(posted), 400) << posted;
  const int garbage = Connect(port());
  ASSERT_GE(garbage, 0);
  SendAll(garbage, std::string("\x01\x02\x03\x04\x05 not TLS\r\n\r\n"));
  EXPECT_EQ(ReadUntil(garbage, "", absl::Seconds(5)), "");
  close(garbage);
  EXPECT_EQ(kill(server_->pid(), 0), 0);
  EXPECT_EQ(HttpsModelsStatus(port(), cert()), 200);
}

// A client that connects and never sends its ClientHello (or only part of
// it) is closed after --http_request_timeout (2s); others are served
// meanwhile.
TEST_F(OpenAiHttpsTest, SilentClientIsDroppedAndOthersAreServed) {
  std::vector<int> silent;
  for (int i = 0; i < 10; ++i) {
    silent.push_back(Connect(port()));
    ASSERT_GE(silent.back(), 0);
    if (i % 2 == 1) SendAll(silent.back(), std::string("\x16\x03\x01", 3));  // a record's start
  }
  const absl::Time start = absl::Now();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(HttpsModelsStatus(port(), cert()), 200);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1800));
  for (int fd : silent) {
    EXPECT_EQ(ReadUntil(fd, "", absl::Seconds(10)), "");  // closed, no answer
  }
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(1800));
  EXPECT_LT(took, absl::Seconds(5));
  for (int fd : silent) close(fd);
  EXPECT_EQ(HttpsModelsStatus(port(), cert()), 200);
}

// curl --cacert, when curl is installed.
TEST_F(OpenAiHttpsTest, Curl) {
  if (RunCommand("command -v curl > /dev/null 2>&1") != 0) GTEST_SKIP() << "curl is not installed";
  const std::string curl = absl::StrCat("curl -sS --max-time 60 --cacert ", ShellQuote(cert()),
                                        " -H 'Content-Type: application/json' ");
  const json chat = json::parse(
      Capture(absl::StrCat(curl, base_url(), "/chat/completions -d ",
                           ShellQuote(R"({"messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 4})"))),
      nullptr, false);
  ASSERT_TRUE(chat.is_object()) << chat;
  EXPECT_EQ(chat["object"], "chat.completion");
  const std::string streamed =
      Capture(absl::StrCat(curl, "-N ", base_url(), "/completions -d ",
                           ShellQuote(R"({"prompt": "hi", "max_tokens": 4, "stream": true})")));
  EXPECT_THAT(streamed, HasSubstr("data: [DONE]"));
  // Without the certificate trusted curl refuses the server.
  EXPECT_NE(
      RunCommand(absl::StrCat("curl -sS --max-time 30 ", base_url(), "/models > /dev/null 2>&1")),
      0);
}

// A client that closes its TLS connection cancels its request: a plain
// close (FIN, seen by poll) while streaming, a close_notify alone (the TCP
// connection stays open; SSL_peek sees it) while waiting for a unary answer.
TEST(OpenAiHttpsCancelTest, ClosedTlsConnectionCancelsTheRequest) {
  TempDir dir;
  ASSERT_TRUE(MakeCertificate(dir));
  auto server = StartHttp(SlowModelDir(), TlsFlags(dir), /*wait_ready=*/false);
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(WaitForMetric(*server, "accel_ready", 1, absl::Seconds(60)));
  for (bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "stream, close" : "unary, close_notify");
    auto client = TlsClient::Open(server->http_port(), dir.File("cert.pem"));
    ASSERT_NE(client, nullptr);
    ASSERT_TRUE(client->Send(CompletionRequest({{"prompt", "a long story"},
                                                {"max_tokens", 3000},
                                                {"ignore_eos", true},
                                                {"temperature", 0},
                                                {"stream", stream}})));
    if (stream) {
      EXPECT_THAT(client->ReadUntil("data: "), HasSubstr("data: "));
    }
    ASSERT_TRUE(WaitForMetric(*server, "accel_num_requests_running", 1));
    const double cancelled = Metric(*server, "accel_request_failure_total{reason=\"cancelled\"}");
    if (stream) {
      client.reset();
    } else {
      client->CloseNotify();
    }
    const absl::Time closed = absl::Now();
    EXPECT_TRUE(WaitForMetric(*server, "accel_num_requests_running", 0, absl::Seconds(5)));
    EXPECT_LT(absl::Now() - closed, absl::Seconds(2));
    EXPECT_TRUE(
        WaitForMetric(*server, "accel_request_failure_total{reason=\"cancelled\"}", cancelled + 1));
  }
}

}  // namespace
}  // namespace accel::testing
