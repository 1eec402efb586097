#include "server/internal/openai_convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

#include "tests/testing/status_matchers.h"

namespace accel::server::internal {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::ordered_json;

OpenAiRequest ParseOk(OpenAiEndpoint endpoint, const std::string& body) {
  absl::StatusOr<OpenAiRequest> parsed = ParseOpenAiRequest(endpoint, body);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  return parsed.ok() ? *parsed : OpenAiRequest();
}

OpenAiError ParseError(OpenAiEndpoint endpoint, const std::string& body) {
  absl::StatusOr<OpenAiRequest> parsed = ParseOpenAiRequest(endpoint, body);
  EXPECT_FALSE(parsed.ok()) << body;
  return ErrorForStatus(parsed.status());
}

TEST(OpenAiConvertTest, ChatMessagesAndSampling) {
  const OpenAiRequest r = ParseOk(OpenAiEndpoint::kChat, R"({
    "model": "m", "messages": [
      {"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": null, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": "{\"zeta\": 1, \"alpha\": [2]}"}}]}],
    "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
    "stop": "END", "n": 1, "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto", "user": "u", "unknown_field": {"x": 1},
    "logprobs": true, "top_logprobs": 3, "stream": true,
    "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(r.generation.chat.has_value());
  const json messages = json::parse(r.generation.chat->messages_json);
  ASSERT_EQ(messages.size(), 3u);
  EXPECT_EQ(messages[1]["content"], "ab");
  // null stays null (templates test `content is none`); the arguments'
  // JSON text becomes an object in its own key order, as templates read it.
  EXPECT_TRUE(messages[2]["content"].is_null());
  EXPECT_EQ(messages[2]["tool_calls"][0]["function"]["arguments"].dump(),
            R"({"zeta":1,"alpha":[2]})");
  EXPECT_EQ(json::parse(r.generation.chat->tools_json)[0]["function"]["name"], "f");
  EXPECT_TRUE(r.generation.chat->add_generation_prompt);
  EXPECT_EQ(r.generation.model, "m");
  EXPECT_EQ(r.generation.max_new_tokens, 7);
  EXPECT_DOUBLE_EQ(r.generation.sampling.temperature, 0.5);
  EXPECT_DOUBLE_EQ(r.generation.sampling.top_p, 0.9);
  EXPECT_EQ(r.generation.sampling.seed, 3u);
  EXPECT_EQ(r.generation.stop_strings, std::vector<std::string>{"END"});
  EXPECT_TRUE(r.generation.logprobs);
  EXPECT_EQ(r.generation.top_logprobs, 3);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

TEST(OpenAiConvertTest, DefaultsFollowOpenAi) {
  const OpenAiRequest r = ParseOk(OpenAiEndpoint::kCompletions, R"({"prompt": "hi"})");
  EXPECT_EQ(r.generation.prompt, "hi");
  EXPECT_DOUBLE_EQ(r.generation.sampling.temperature, 1.0);  // OpenAI's default
  EXPECT_EQ(r.generation.max_new_tokens, 0);                 // the server's default
  EXPECT_FALSE(r.generation.max_new_tokens_to_context);
  EXPECT_FALSE(r.stream);
  // Chat without max_tokens: to the end of the context, as OpenAI.
  EXPECT_TRUE(ParseOk(OpenAiEndpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}]})")
                  .generation.max_new_tokens_to_context);
  EXPECT_FALSE(r.generation.logprobs);
}

TEST(OpenAiConvertTest, CompletionPromptForms) {
  EXPECT_EQ(ParseOk(OpenAiEndpoint::kCompletions, R"({"prompt": ["one"]})").generation.prompt,
            "one");
  EXPECT_EQ(ParseOk(OpenAiEndpoint::kCompletions, R"({"prompt": [1, 2, 3]})").generation.prompt_ids,
            (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(ParseOk(OpenAiEndpoint::kCompletions, R"({"prompt": [[4, 5]]})").generation.prompt_ids,
            (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(ParseError(OpenAiEndpoint::kCompletions, R"({"prompt": ["a", [1]]})").param,
            "prompt[1]");
  EXPECT_EQ(ParseError(OpenAiEndpoint::kCompletions, R"({"prompt": [1, "x"]})").param, "prompt[1]");
  const OpenAiRequest r = ParseOk(OpenAiEndpoint::kCompletions,
                                  R"({"prompt": "x", "logprobs": 5, "stop": ["a", "b"]})");
  EXPECT_TRUE(r.generation.logprobs);
  EXPECT_EQ(r.generation.top_logprobs, 5);
  EXPECT_EQ(r.generation.stop_strings.size(), 2u);
}

TEST(OpenAiConvertTest, ErrorsNameTheField) {
  struct Case {
    OpenAiEndpoint endpoint;
    const char* body;
    const char* param;
  };
  const OpenAiEndpoint chat = OpenAiEndpoint::kChat;
  const OpenAiEndpoint text = OpenAiEndpoint::kCompletions;
  const Case cases[] = {
      {text, R"({"prompt": "x", "max_tokens": "ten"})", "max_tokens"},
      {text, R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},
      {text, R"({"prompt": "x", "temperature": 2.5})", "temperature"},
      {text, R"({"prompt": "x", "top_p": 0})", "top_p"},
      {text, R"({"prompt": "x", "n": "2"})", "n"},
      {text, R"({"prompt": "x", "n": 2, "best_of": 3})", "best_of"},
      {text, R"({"prompt": "x", "min_tokens": 1.5})", "min_tokens"},
      {text, R"({"prompt": "x", "stop_token_ids": 5})", "stop_token_ids"},
      {text, R"({"prompt": "x", "stop_token_ids": [1, "2"]})", "stop_token_ids[1]"},
      {text, R"({"prompt": "x", "include_stop_str_in_output": 1})", "include_stop_str_in_output"},
      {chat, R"({"messages": [{"role": "user", "content": "x"}], "echo": true})", "echo"},
      {text, R"({"prompt": "x", "logprobs": 6})", "logprobs"},
      {text, R"({"prompt": "x", "frequency_penalty": "1"})", "frequency_penalty"},
      {text, R"({"prompt": "x", "logit_bias": {"a": 1}})", "logit_bias"},
      {text, R"({"prompt": "x", "stop": 3})", "stop"},
      {text, R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},
      {text, R"({"prompt": "x", "stream": "yes"})", "stream"},
      {text, R"({"model": 3, "prompt": "x"})", "model"},
      {text, R"({})", "prompt"},
      {chat, R"({"messages": []})", "messages"},
      {chat, R"({"messages": [{"content": "x"}]})", "messages[0].role"},
      {chat, R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content"},
      {chat, R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
       "messages[0].content[0].type"},
      {chat, R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21,
                 "logprobs": true})",
       "top_logprobs"},
      {chat, R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})",
       "top_logprobs"},
      {chat, R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})",
       "tool_choice"},  // "required" needs tools
      {chat, R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": "2"}})",
       "logit_bias.1"},
      {chat,
       R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}})",
       "response_format.type"},
      {chat, R"({"messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "json_schema", "json_schema": 3}})",
       "response_format.json_schema"},
      {text, R"({"prompt": "x", "guided_choice": []})", "guided_choice"},
      {text, R"({"prompt": "x", "structured_outputs": {"regex": 5}})", "structured_outputs.regex"},
      {text, R"({"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a"})",
       "guided_regex"},
      {chat, R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [
                 {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]})",
       "messages[0].tool_calls[0].function.arguments"},
  };
  for (const Case& c : cases) {
    const OpenAiError error = ParseError(c.endpoint, c.body);
    EXPECT_EQ(error.http_status, 400) << c.body;
    EXPECT_EQ(error.type, "invalid_request_error");
    EXPECT_EQ(error.param, c.param) << c.body << ": " << error.message;
  }
  EXPECT_THAT(ParseError(text, "{").message, HasSubstr("the body: invalid JSON"));
  EXPECT_THAT(ParseError(text, "[]").message, HasSubstr("JSON object"));
  EXPECT_THAT(ParseError(text, std::string(1000, '[')).message, HasSubstr("nests deeper"));
}

// The outside test's body: 100,000 keys (1.5 MB) cost 24 s of CPU when every
// key was looked up linearly; now it is refused at kMaxOpenAiJsonKeys.
// response_format, vLLM's structured_outputs and guided_* fields: each
// becomes the request's one grammar, named by its field for errors.
TEST(OpenAiConvertTest, StructuredOutputFields) {
  auto parse = [](OpenAiEndpoint endpoint, const std::string& body) {
    auto r = ParseOpenAiRequest(endpoint, body);
    EXPECT_TRUE(r.ok()) << body << ": " << r.status();
    return r.ok() ? r->generation.structured : std::nullopt;
  };
  const std::string messages = R"("messages": [{"role": "user", "content": "x"}])";
  auto s =
      parse(OpenAiEndpoint::kChat, "{" + messages + R"(, "response_format": {"type": "json_schema",
      "json_schema": {"name": "p", "strict": true, "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}}})");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->json_schema,
            R"({"type":"object","properties":{"b":{},"a":{}}})");  // the client's order
  EXPECT_EQ(s->field, "response_format.json_schema.schema");
  s = parse(OpenAiEndpoint::kChat,
            "{" + messages + R"(, "response_format": {"type": "json_object"}})");
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->json_object);
  EXPECT_FALSE(
      parse(OpenAiEndpoint::kChat, "{" + messages + R"(, "response_format": {"type": "text"}})")
          .has_value());
  s = parse(OpenAiEndpoint::kCompletions,
            R"({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->choice, (std::vector<std::string>{"a", "b"}));
  s = parse(OpenAiEndpoint::kCompletions, R"({"prompt": "x", "guided_regex": "[0-9]+"})");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->regex, "[0-9]+");
  EXPECT_EQ(s->field, "guided_regex");
  s = parse(OpenAiEndpoint::kCompletions,
            R"({"prompt": "x", "guided_json": "{\"type\": \"integer\"}"})");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->json_schema, R"({"type": "integer"})");
  s = parse(OpenAiEndpoint::kCompletions, R"({"prompt": "x", "guided_grammar": "root ::= \"a\""})");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->grammar, R"(root ::= "a")");
}

TEST(OpenAiConvertTest, ManyKeysAreRefused) {
  std::string body = R"({"prompt": "hi", "x": {)";
  for (int i = 0; i < 100000; ++i) absl::StrAppend(&body, i ? "," : "", "\"k", i, "\":0");
  body += "}}";
  const OpenAiError error = ParseError(OpenAiEndpoint::kCompletions, body);
  EXPECT_EQ(error.http_status, 400);
  EXPECT_THAT(error.message, HasSubstr(absl::StrCat("more than ", kMaxOpenAiJsonKeys)));
  // Just under the limit parses, keys in the client's order.
  std::string tools = R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"p": {)";
  // Five keys outside "p": messages, role, content, tools, p.
  for (int i = 0; i < kMaxOpenAiJsonKeys - 5; ++i) {
    absl::StrAppend(&tools, i ? "," : "", "\"k", kMaxOpenAiJsonKeys - i, "\":0");
  }
  tools += "}}]}";
  absl::StatusOr<OpenAiRequest> parsed = ParseOpenAiRequest(OpenAiEndpoint::kChat, tools);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const nlohmann::json parsed_tools = nlohmann::json::parse(parsed->generation.chat->tools_json);
  EXPECT_EQ(parsed_tools[0]["p"].size(), static_cast<size_t>(kMaxOpenAiJsonKeys - 5));
  EXPECT_EQ(parsed->generation.chat->tools_json.substr(0, 16), R"([{"p":{"k16384":)");
}

// A client gone while its body is parsed: the check's status ends the parse.
TEST(OpenAiConvertTest, CheckStopsTheParse) {
  std::string body = R"({"prompt": [)";
  for (int i = 0; i < 100000; ++i) absl::StrAppend(&body, i ? "," : "", i % 100);
  body += "]}";
  int calls = 0;
  absl::StatusOr<OpenAiRequest> parsed =
      ParseOpenAiRequest(OpenAiEndpoint::kCompletions, body, [&calls] {
        ++calls;
        return absl::CancelledError("the client closed its connection");
      });
  EXPECT_EQ(parsed.status(), absl::CancelledError("the client closed its connection"));
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(
      ParseOpenAiRequest(OpenAiEndpoint::kCompletions, body, [] { return absl::OkStatus(); }).ok());
}

TEST(OpenAiConvertTest, StatusesMapToOpenAiErrors) {
  EXPECT_EQ(ErrorForStatus(absl::NotFoundError("m")).http_status, 404);
  EXPECT_EQ(ErrorForStatus(absl::NotFoundError("m")).code, "model_not_found");
  EXPECT_EQ(ErrorForStatus(absl::UnauthenticatedError("x")).http_status, 401);
  EXPECT_EQ(ErrorForStatus(absl::ResourceExhaustedError("x")).http_status, 429);
  EXPECT_EQ(ErrorForStatus(absl::UnavailableError("x")).http_status, 503);
  EXPECT_EQ(ErrorForStatus(absl::InternalError("x")).http_status, 500);
  const json body = json::parse(ErrorBody(ErrorForStatus(absl::InvalidArgumentError("x: bad"))));
  EXPECT_EQ(body["error"]["message"], "x: bad");
  EXPECT_EQ(body["error"]["param"], "x");
  EXPECT_TRUE(body["error"]["code"].is_null());
  // A prompt past the context: OpenAI's code.
  EXPECT_EQ(
      ErrorForStatus(absl::InvalidArgumentError(
                         "the prompt has 9000 tokens, over the limit of 8191 (--max_input_tokens)"))
          .code,
      "context_length_exceeded");
  EXPECT_EQ(ErrorForStatus(
                absl::InvalidArgumentError(
                    "prompt (10 tokens) + max_new_tokens (9000) is over the limit of 8192 tokens "
                    "(--max_total_tokens)"))
                .code,
            "context_length_exceeded");
  EXPECT_STREQ(OpenAiFinishReason(engine::Finish::kEos), "stop");
  EXPECT_STREQ(OpenAiFinishReason(engine::Finish::kStop), "stop");
  EXPECT_STREQ(OpenAiFinishReason(engine::Finish::kLength), "length");
  EXPECT_STREQ(OpenAiFinishReason(engine::Finish::kCancelled), "length");
}

engine::TokenChunk Chunk(std::vector<int64_t> ids, std::string text,
                         std::vector<float> logprobs = {},
                         std::vector<std::vector<engine::TokenLogprob>> top = {}) {
  engine::TokenChunk chunk;
  chunk.token_ids = std::move(ids);
  chunk.text = std::move(text);
  chunk.logprobs = std::move(logprobs);
  chunk.top_logprobs = std::move(top);
  return chunk;
}

std::string Name(int64_t id) { return "t" + std::to_string(id); }

const char* kToolBody = R"({"messages": [{"role": "user", "content": "Weather?"}],
  "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])";

// tool_choice: "auto" parses the calls out of the text (unary and streamed,
// OpenAI's shapes); "required" and a named function become a grammar in the
// parser's syntax; a forced call without a parser, or an unknown function,
// is a 400 naming tool_choice.
TEST(OpenAiConvertTest, ToolCallsAndToolChoice) {
  const std::string text =
      "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
      "</tool_call>";
  OpenAiRequest request = ParseOk(OpenAiEndpoint::kChat, std::string(kToolBody) + "}");
  ASSERT_THAT(ApplyToolChoice(request, grammar::ToolCallFormat::kHermes), accel::test::IsOk());
  EXPECT_FALSE(request.generation.structured.has_value());  // auto: nothing forced
  engine::Completion done;
  done.finish = engine::Finish::kEos;
  {
    OpenAiResponseWriter writer(request, "m", Name, 42, "chatcmpl-1");
    writer.Add(Chunk({1}, text));
    const json body = json::parse(writer.Final(done));
    const json& message = body["choices"][0]["message"];
    EXPECT_EQ(message["content"], "Checking.");
    ASSERT_EQ(message["tool_calls"].size(), 1u);
    EXPECT_EQ(message["tool_calls"][0]["type"], "function");
    EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "get_weather");
    EXPECT_EQ(json::parse(message["tool_calls"][0]["function"]["arguments"].get<std::string>()),
              json::parse(R"({"city": "Oslo"})"));
    EXPECT_EQ(body["choices"][0]["finish_reason"], "tool_calls");
  }
  {
    // Streamed in pieces: content deltas, then the call as OpenAI streams it
    // (index, id, type, name and arguments "" first; then its arguments in
    // pieces, each entry with the index only).
    OpenAiResponseWriter writer(request, "m", Name, 42, "chatcmpl-1");
    std::string events;
    for (size_t i = 0; i < text.size(); i += 5)
      events += writer.StreamChunk(Chunk({1}, text.substr(i, 5)));
    events += writer.StreamEnd(done);
    std::string content;
    int calls = 0;
    int argument_pieces = 0;
    std::string arguments;
    std::string finish;
    for (absl::string_view line : absl::StrSplit(events, '\n')) {
      if (!absl::ConsumePrefix(&line, "data: ") || line == "[DONE]") continue;
      const json e = json::parse(line);
      const json& choice = e["choices"][0];
      if (choice["delta"].contains("content"))
        content += choice["delta"]["content"].get<std::string>();
      if (choice["delta"].contains("tool_calls")) {
        for (const json& call : choice["delta"]["tool_calls"]) {
          EXPECT_EQ(call["index"], 0);
          if (call.contains("id")) {
            EXPECT_EQ(call["type"], "function");
            EXPECT_EQ(call["function"]["name"], "get_weather");
            ++calls;
          } else {
            EXPECT_FALSE(call["function"].contains("name"));
            ++argument_pieces;
          }
          arguments += call["function"]["arguments"].get<std::string>();
        }
      }
      if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
    }
    EXPECT_EQ(content, "Checking.");
    EXPECT_EQ(calls, 1);
    EXPECT_GT(argument_pieces, 1);
    EXPECT_EQ(json::parse(arguments), json::parse(R"({"city": "Oslo"})"));
    EXPECT_EQ(finish, "tool_calls");
  }
  OpenAiRequest required =
      ParseOk(OpenAiEndpoint::kChat, std::string(kToolBody) + R"(, "tool_choice": "required"})");
  ASSERT_THAT(ApplyToolChoice(required, grammar::ToolCallFormat::kHermes), accel::test::IsOk());
  ASSERT_TRUE(required.generation.structured.has_value());
  EXPECT_THAT(required.generation.structured->grammar, HasSubstr("<tool_call>"));
  EXPECT_EQ(required.generation.structured->field, "tool_choice");
  OpenAiRequest named =
      ParseOk(OpenAiEndpoint::kChat,
              std::string(kToolBody) +
                  R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})");
  ASSERT_THAT(ApplyToolChoice(named, grammar::ToolCallFormat::kLlama3Json), accel::test::IsOk());
  ASSERT_TRUE(named.generation.structured.has_value());
  EXPECT_THAT(named.generation.structured->grammar, HasSubstr("get_weather"));
  EXPECT_THAT(ApplyToolChoice(required, grammar::ToolCallFormat::kNone),
              accel::test::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tool_choice")));
  EXPECT_EQ(
      ParseError(OpenAiEndpoint::kChat,
                 std::string(kToolBody) +
                     R"(, "tool_choice": {"type": "function", "function": {"name": "nope"}}})")
          .param,
      "tool_choice.function.name");
  EXPECT_EQ(ParseError(OpenAiEndpoint::kChat, std::string(kToolBody) + R"(, "tool_choice": "any"})")
                .param,
            "tool_choice");
  // "none": the text stays content.
  OpenAiRequest none =
      ParseOk(OpenAiEndpoint::kChat, std::string(kToolBody) + R"(, "tool_choice": "none"})");
  ASSERT_THAT(ApplyToolChoice(none, grammar::ToolCallFormat::kHermes), accel::test::IsOk());
  OpenAiResponseWriter writer(none, "m", Name, 42, "chatcmpl-1");
  writer.Add(Chunk({1}, text));
  EXPECT_EQ(json::parse(writer.Final(done))["choices"][0]["message"]["content"], text);
}

TEST(OpenAiConvertTest, ChatAnswerAndStream) {
  OpenAiRequest request = ParseOk(
      OpenAiEndpoint::kChat,
      R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 1,
          "stream": true, "stream_options": {"include_usage": true}})");
  OpenAiResponseWriter writer(request, "m", Name, 42, "chatcmpl-1");
  const engine::TokenChunk chunk =
      Chunk({7, 8}, "ab", {-0.5f, -0.25f}, {{{7, -0.5f}}, {{8, -0.25f}}});
  writer.Add(chunk);
  engine::Completion completion;
  completion.finish = engine::Finish::kEos;
  completion.prompt_tokens = 3;
  completion.generated_tokens = 2;
  const json body = json::parse(writer.Final(completion));
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["id"], "chatcmpl-1");
  EXPECT_EQ(body["created"], 42);
  EXPECT_EQ(body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(body["choices"][0]["message"]["content"], "ab");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  const json& content = body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], "t7");
  EXPECT_EQ(content[0]["bytes"], json::array({'t', '7'}));
  EXPECT_EQ(content[1]["top_logprobs"][0]["token"], "t8");
  EXPECT_EQ(body["usage"]["total_tokens"], 5);

  const std::string start = writer.StreamStart();
  ASSERT_TRUE(absl::StartsWith(start, "data: "));
  const json first = json::parse(start.substr(6));
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(first["usage"].is_null());
  const json middle = json::parse(writer.StreamChunk(chunk).substr(6));
  EXPECT_EQ(middle["choices"][0]["delta"]["content"], "ab");
  EXPECT_EQ(middle["choices"][0]["logprobs"]["content"].size(), 2u);
  EXPECT_EQ(writer.StreamChunk(Chunk({}, "")), "");
  const std::string end = writer.StreamEnd(completion);
  EXPECT_TRUE(absl::EndsWith(end, "data: [DONE]\n\n"));
  EXPECT_THAT(end, HasSubstr("\"finish_reason\":\"stop\""));
  EXPECT_THAT(end, HasSubstr("\"choices\":[]"));
  EXPECT_THAT(end, HasSubstr("\"total_tokens\":5"));
}

// n choices: the fields reach the request; each chunk goes to its choice
// (index), a choice's finish comes with its last chunk, usage is the sum
// the engine reports.
TEST(OpenAiConvertTest, NChoicesAnswerAndStream) {
  OpenAiRequest request = ParseOk(OpenAiEndpoint::kCompletions, R"({"prompt": "x", "n": 2,
      "best_of": 2, "min_tokens": 3, "stop_token_ids": [4, 5], "include_stop_str_in_output": true,
      "stream": true})");
  EXPECT_EQ(request.generation.n, 2);
  EXPECT_EQ(request.generation.min_tokens, 3);
  EXPECT_EQ(request.generation.stop_token_ids, (std::vector<int64_t>{4, 5}));
  EXPECT_TRUE(request.generation.include_stop_str_in_output);
  OpenAiResponseWriter writer(request, "m", Name, 1, "cmpl-1");
  engine::TokenChunk second = Chunk({2}, "B");
  second.index = 1;
  engine::TokenChunk first = Chunk({1}, "A");
  engine::TokenChunk first_end;
  first_end.finish = engine::Finish::kEos;
  engine::TokenChunk second_end;
  second_end.index = 1;
  second_end.finish = engine::Finish::kLength;
  for (const engine::TokenChunk& c : {second, first, first_end, second_end}) writer.Add(c);
  engine::Completion completion;
  completion.prompt_tokens = 1;
  completion.generated_tokens = 2;
  const json body = json::parse(writer.Final(completion));
  ASSERT_EQ(body["choices"].size(), 2u);
  EXPECT_EQ(body["choices"][0]["index"], 0);
  EXPECT_EQ(body["choices"][0]["text"], "A");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(body["choices"][1]["index"], 1);
  EXPECT_EQ(body["choices"][1]["text"], "B");
  EXPECT_EQ(body["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["completion_tokens"], 2);

  OpenAiResponseWriter stream(request, "m", Name, 1, "cmpl-1");
  const json b = json::parse(stream.StreamChunk(second).substr(6));
  EXPECT_EQ(b["choices"][0]["index"], 1);
  EXPECT_EQ(b["choices"][0]["text"], "B");
  const json end = json::parse(stream.StreamChunk(second_end).substr(6));
  EXPECT_EQ(end["choices"][0]["index"], 1);
  EXPECT_EQ(end["choices"][0]["finish_reason"], "length");
  // The request's end has no choice left to finish: [DONE] only.
  EXPECT_EQ(stream.StreamEnd(completion), "data: [DONE]\n\n");
}

// echo: the prompt's text and tokens (the first null) before the
// completion's; with max_tokens 0 the generated token is left out.
TEST(OpenAiConvertTest, EchoPutsThePromptAndItsLogprobsFirst) {
  OpenAiRequest request = ParseOk(OpenAiEndpoint::kCompletions,
                                  R"({"prompt": [[1, 22]], "max_tokens": 0, "echo": true,
                                      "logprobs": 1})");
  EXPECT_TRUE(request.echo_only);
  EXPECT_TRUE(request.generation.prompt_logprobs);
  EXPECT_EQ(request.generation.max_new_tokens, 1);
  OpenAiResponseWriter writer(request, "m", Name, 1);
  engine::TokenChunk chunk = Chunk({3}, "t3", {-0.5f}, {{{3, -0.5f}}});
  chunk.prompt_logprobs = {{1, std::nullopt, {}}, {22, -2.0f, {{4, -1.0f}}}};
  writer.Add(chunk);
  engine::Completion completion;
  completion.prompt_tokens = 2;
  completion.generated_tokens = 1;
  const json body = json::parse(writer.Final(completion));
  const json& choice = body["choices"][0];
  EXPECT_EQ(choice["text"], "t1t22");
  EXPECT_EQ(choice["logprobs"]["tokens"], json::array({"t1", "t22"}));
  EXPECT_EQ(choice["logprobs"]["token_logprobs"], json::array({nullptr, -2.0}));
  EXPECT_TRUE(choice["logprobs"]["top_logprobs"][0].is_null());
  EXPECT_EQ(choice["logprobs"]["top_logprobs"][1]["t4"], -1.0);
  EXPECT_EQ(choice["logprobs"]["text_offset"], json::array({0, 2}));
  EXPECT_EQ(choice["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["completion_tokens"], 0);

  // With max_tokens: the generated token's entries follow the prompt's.
  OpenAiRequest more = ParseOk(OpenAiEndpoint::kCompletions,
                               R"({"prompt": "hi", "max_tokens": 1, "echo": true, "logprobs": 0})");
  OpenAiResponseWriter with_token(more, "m", Name, 1);
  with_token.Add(chunk);
  const json both = json::parse(with_token.Final(completion));
  EXPECT_EQ(both["choices"][0]["text"], "hit3");  // the prompt as sent, then the text
  EXPECT_EQ(both["choices"][0]["logprobs"]["tokens"], json::array({"t1", "t22", "t3"}));
  EXPECT_EQ(both["choices"][0]["logprobs"]["text_offset"], json::array({0, 2, 5}));
  EXPECT_EQ(both["usage"]["completion_tokens"], 1);
}

// echo with stream: the prompt (and its tokens' logprobs) goes out with the
// choice's first chunk, before the generated text, as vLLM streams it; with
// max_tokens 0 the stream has the prompt alone, finish "length", and no
// completion tokens in its usage.
TEST(OpenAiConvertTest, StreamedEchoSendsThePromptFirst) {
  OpenAiRequest request = ParseOk(OpenAiEndpoint::kCompletions,
                                  R"({"prompt": "hi", "max_tokens": 2, "echo": true,
                                      "logprobs": 0, "stream": true})");
  OpenAiResponseWriter writer(request, "m", Name, 1);
  engine::TokenChunk first = Chunk({3}, "t3", {-0.5f});
  first.prompt_logprobs = {{1, std::nullopt, {}}, {22, -2.0f, {}}};
  const json a = json::parse(writer.StreamChunk(first).substr(6));
  EXPECT_EQ(a["choices"][0]["text"], "hit3");
  EXPECT_EQ(a["choices"][0]["logprobs"]["tokens"], json::array({"t1", "t22", "t3"}));
  EXPECT_EQ(a["choices"][0]["logprobs"]["token_logprobs"], json::array({nullptr, -2.0, -0.5}));
  EXPECT_EQ(a["choices"][0]["logprobs"]["text_offset"], json::array({0, 2, 5}));
  const json b = json::parse(writer.StreamChunk(Chunk({4}, "t4", {-0.25f})).substr(6));
  EXPECT_EQ(b["choices"][0]["text"], "t4");  // the prompt once
  EXPECT_EQ(b["choices"][0]["logprobs"]["tokens"], json::array({"t4"}));
  EXPECT_EQ(b["choices"][0]["logprobs"]["text_offset"], json::array({7}));

  OpenAiRequest only = ParseOk(OpenAiEndpoint::kCompletions,
                               R"({"prompt": [[1, 22]], "max_tokens": 0, "echo": true,
                                   "stream": true, "stream_options": {"include_usage": true}})");
  OpenAiResponseWriter prompt_only(only, "m", Name, 1);
  const json c = json::parse(prompt_only.StreamChunk(Chunk({3}, "t3")).substr(6));
  EXPECT_EQ(c["choices"][0]["text"], "t1t22");
  engine::Completion completion;
  completion.prompt_tokens = 2;
  completion.generated_tokens = 1;
  const std::string end = prompt_only.StreamEnd(completion);
  EXPECT_NE(end.find(R"("finish_reason":"length")"), std::string::npos) << end;
  EXPECT_NE(end.find(R"("completion_tokens":0)"), std::string::npos) << end;
  EXPECT_EQ(end.find("t3"), std::string::npos) << end;  // the generated token is not shown
}

// A list of prompts: one request each, with the other fields; the answer has
// prompts x n choices, each echoing its own prompt.
TEST(OpenAiConvertTest, AListOfPromptsIsOneRequestEach) {
  OpenAiRequest request = ParseOk(OpenAiEndpoint::kCompletions,
                                  R"({"prompt": ["a", "b"], "n": 2, "echo": true, "seed": 3})");
  ASSERT_EQ(request.prompts.size(), 2u);
  EXPECT_EQ(request.prompts[0].prompt, "a");
  EXPECT_EQ(request.prompts[1].prompt, "b");
  EXPECT_EQ(request.prompts[1].n, 2);
  EXPECT_EQ(request.prompts[1].sampling.seed, 3u);
  OpenAiResponseWriter writer(request, "m", Name, 1);
  for (int64_t index = 0; index < 4; ++index) {
    engine::TokenChunk chunk = Chunk({index}, absl::StrCat("-", index));
    chunk.index = index;
    writer.Add(chunk);
  }
  const json body = json::parse(writer.Final(engine::Completion()));
  ASSERT_EQ(body["choices"].size(), 4u);
  EXPECT_EQ(body["choices"][0]["text"], "a-0");
  EXPECT_EQ(body["choices"][1]["text"], "a-1");
  EXPECT_EQ(body["choices"][2]["text"], "b-2");
  EXPECT_EQ(body["choices"][3]["text"], "b-3");
  const OpenAiRequest ids = ParseOk(OpenAiEndpoint::kCompletions, R"({"prompt": [[1, 2], [3]]})");
  ASSERT_EQ(ids.prompts.size(), 2u);
  EXPECT_EQ(ids.prompts[1].prompt_ids, (std::vector<int64_t>{3}));
  EXPECT_TRUE(ParseOk(OpenAiEndpoint::kCompletions, R"({"prompt": ["one"]})").prompts.empty());
}

TEST(OpenAiConvertTest, CompletionLogprobsAndModels) {
  OpenAiRequest request =
      ParseOk(OpenAiEndpoint::kCompletions, R"({"prompt": "x", "logprobs": 1})");
  OpenAiResponseWriter writer(request, "m", Name, 1);
  EXPECT_TRUE(absl::StartsWith(writer.id(), "cmpl-"));
  writer.Add(Chunk({1, 22}, "t1t22", {-1.0f, -2.0f}, {{{1, -1.0f}}, {{3, -0.5f}}}));
  const json body = json::parse(writer.Final(engine::Completion()));
  EXPECT_EQ(body["object"], "text_completion");
  const json& logprobs = body["choices"][0]["logprobs"];
  EXPECT_EQ(logprobs["tokens"], json::array({"t1", "t22"}));
  EXPECT_EQ(logprobs["text_offset"], json::array({0, 2}));
  EXPECT_EQ(logprobs["top_logprobs"][1]["t3"], -0.5);
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  const json list = json::parse(ModelList("m", 5));
  EXPECT_EQ(list["object"], "list");
  EXPECT_EQ(list["data"][0],
            json({{"id", "m"}, {"object", "model"}, {"created", 5}, {"owned_by", "accel"}}));
}

}  // namespace
}  // namespace accel::server::internal
