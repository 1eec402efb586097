#include "server/internal/openai_responses.h"

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

namespace accel::server::internal {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using json = nlohmann::ordered_json;

ResponsesRequest Parse(const json& body) {
  absl::StatusOr<ResponsesRequest> parsed = ParseResponsesRequest(body.dump());
  EXPECT_TRUE(parsed.ok()) << parsed.status() << " for " << body.dump();
  return parsed.ok() ? *std::move(parsed) : ResponsesRequest();
}

std::string ErrorOf(const json& body) {
  absl::StatusOr<ResponsesRequest> parsed = ParseResponsesRequest(body.dump());
  EXPECT_FALSE(parsed.ok()) << body.dump();
  if (parsed.ok()) return "";
  EXPECT_TRUE(absl::IsInvalidArgument(parsed.status())) << parsed.status();
  return std::string(parsed.status().message());
}

// The SSE events of a stream: (event name, data).
std::vector<std::pair<std::string, json>> Events(const std::string& text) {
  std::vector<std::pair<std::string, json>> events;
  for (absl::string_view block : absl::StrSplit(text, "\n\n", absl::SkipEmpty())) {
    std::vector<std::string> lines = absl::StrSplit(block, '\n');
    EXPECT_EQ(lines.size(), 2u) << block;
    if (lines.size() != 2) continue;
    EXPECT_THAT(lines[0], StartsWith("event: "));
    EXPECT_THAT(lines[1], StartsWith("data: "));
    const json data = json::parse(lines[1].substr(6));
    EXPECT_EQ(data["type"], lines[0].substr(7));
    events.emplace_back(lines[0].substr(7), data);
  }
  return events;
}

engine::TokenChunk Chunk(const std::string& text) {
  engine::TokenChunk chunk;
  chunk.token_ids = {1};
  chunk.text = text;
  return chunk;
}

engine::Completion Done(engine::Finish finish, int64_t prompt, int64_t generated) {
  engine::Completion completion;
  completion.finish = finish;
  completion.prompt_tokens = prompt;
  completion.generated_tokens = generated;
  return completion;
}

TEST(OpenAiResponsesTest, StringInputAndInstructionsAreChatMessages) {
  const ResponsesRequest r = Parse({{"model", "m"},
                                    {"input", "hello"},
                                    {"instructions", "be brief"},
                                    {"max_output_tokens", 7},
                                    {"temperature", 0},
                                    {"top_p", 0.5}});
  ASSERT_TRUE(r.chat.generation.chat.has_value());
  EXPECT_EQ(json::parse(r.chat.generation.chat->messages_json),
            json::parse(R"([{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hello"}])"));
  EXPECT_EQ(r.chat.generation.model, "m");
  EXPECT_EQ(r.chat.generation.max_new_tokens, 7);
  EXPECT_EQ(r.chat.generation.sampling.temperature, 0);
  EXPECT_FLOAT_EQ(r.chat.generation.sampling.top_p, 0.5);
  EXPECT_FALSE(r.chat.stream);
}

TEST(OpenAiResponsesTest, ItemsWithFunctionCallsAndOutputs) {
  const json input = json::parse(R"([
    {"role": "developer", "content": "use tools"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                    {"type": "input_text", "text": "Oslo?"}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
    {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "call_2", "output": "noon"}
  ])");
  const ResponsesRequest r = Parse({{"input", input}});
  const json messages = json::parse(r.chat.generation.chat->messages_json);
  ASSERT_EQ(messages.size(), 5u) << messages.dump();
  EXPECT_EQ(messages[0], json::parse(R"({"role": "system", "content": "use tools"})"));
  EXPECT_EQ(messages[1]["content"], "Weather in Oslo?");
  EXPECT_EQ(messages[2]["role"], "assistant");
  EXPECT_TRUE(messages[2]["content"].is_null());
  ASSERT_EQ(messages[2]["tool_calls"].size(), 2u);  // one assistant turn, both calls
  EXPECT_EQ(messages[2]["tool_calls"][0]["id"], "call_1");
  EXPECT_EQ(messages[2]["tool_calls"][0]["function"]["name"], "get_weather");
  // The chat rules: the template reads the arguments as an object.
  EXPECT_EQ(messages[2]["tool_calls"][0]["function"]["arguments"], (json{{"city", "Oslo"}}));
  EXPECT_EQ(messages[3],
            json::parse(R"({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})"));
  EXPECT_EQ(messages[4]["tool_call_id"], "call_2");
}

TEST(OpenAiResponsesTest, TextFormatAndToolsBecomeTheChatFields) {
  const json schema = {
      {"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}, {"required", {"a"}}};
  ResponsesRequest r = Parse(
      {{"input", "x"},
       {"text",
        {{"format",
          {{"type", "json_schema"}, {"name", "thing"}, {"schema", schema}, {"strict", true}}}}}});
  ASSERT_TRUE(r.chat.generation.structured.has_value());
  EXPECT_EQ(json::parse(r.chat.generation.structured->json_schema), schema);
  EXPECT_EQ(json::parse(r.text_json)["format"]["name"], "thing");  // echoed

  r = Parse({{"input", "x"}, {"text", {{"format", {{"type", "json_object"}}}}}});
  ASSERT_TRUE(r.chat.generation.structured.has_value());
  EXPECT_TRUE(r.chat.generation.structured->json_object);
  r = Parse({{"input", "x"}, {"text", {{"format", {{"type", "text"}}}}}});
  EXPECT_FALSE(r.chat.generation.structured.has_value());

  r = Parse({{"input", "x"},
             {"tools", json::parse(R"([{"type": "function", "name": "f", "description": "d",
                                        "parameters": {"type": "object"}}])")},
             {"tool_choice", {{"type", "function"}, {"name", "f"}}}});
  EXPECT_EQ(json::parse(r.chat.tools_json),
            json::parse(R"([{"type": "function", "function": {"name": "f", "description": "d",
                                                              "parameters": {"type": "object"}}}])"));
  EXPECT_EQ(r.chat.tool_choice, "function");
  EXPECT_EQ(r.chat.tool_choice_function, "f");
}

TEST(OpenAiResponsesTest, ErrorsNameTheResponsesField) {
  EXPECT_THAT(ErrorOf({{"input", "x"}, {"previous_response_id", "resp_1"}}),
              StartsWith("previous_response_id: "));
  EXPECT_THAT(ErrorOf({{"input", "x"}, {"store", true}}), StartsWith("store: "));
  Parse({{"input", "x"}, {"store", false}});  // false is what this server does
  EXPECT_THAT(ErrorOf({{"input", "x"}, {"max_output_tokens", 0}}),
              StartsWith("max_output_tokens: "));
  EXPECT_THAT(ErrorOf({{"input", "x"}, {"max_output_tokens", "many"}}),
              StartsWith("max_output_tokens: "));
  EXPECT_THAT(ErrorOf({{"input", "x"}, {"temperature", 3}}), StartsWith("temperature: "));
  EXPECT_THAT(ErrorOf(json::object()), StartsWith("input: "));
  EXPECT_THAT(ErrorOf({{"input", json::array()}}), StartsWith("input: "));
  EXPECT_THAT(ErrorOf({{"input", 3}}), StartsWith("input: "));
  EXPECT_THAT(ErrorOf({{"input", json::parse(R"([{"role": "user", "content":
                                  [{"type": "input_image", "image_url": "x"}]}])")}}),
              StartsWith("input[0].content[0].type: "));
  EXPECT_THAT(ErrorOf({{"input", json::parse(R"([{"type": "reasoning"}])")}}),
              StartsWith("input[0].type: "));
  EXPECT_THAT(ErrorOf({{"input", json::parse(R"([{"type": "function_call", "name": "f"}])")}}),
              StartsWith("input[0].call_id: "));
  EXPECT_THAT(ErrorOf({{"input", "x"}, {"tools", json::parse(R"([{"type": "web_search"}])")}}),
              StartsWith("tools[0].type: "));
  EXPECT_THAT(ErrorOf({{"input", "x"}, {"text", {{"format", {{"type", "yaml"}}}}}}),
              StartsWith("text.format.type: "));
  EXPECT_THAT(ErrorOf({{"input", "x"}, {"text", {{"format", {{"type", "json_schema"}}}}}}),
              StartsWith("text.format.schema: "));
  EXPECT_THAT(ErrorOf({{"input", "x"},
                       {"tools", json::parse(R"([{"type": "function", "name": "f"}])")},
                       {"tool_choice", {{"type", "function"}, {"name", "g"}}}}),
              StartsWith("tool_choice.name: "));
  // A schema compiles when the request is submitted; its errors name text.format.
  const ResponsesRequest schema =
      Parse({{"input", "x"},
             {"text", {{"format", {{"type", "json_schema"}, {"schema", {{"type", "frob"}}}}}}}});
  ASSERT_TRUE(schema.chat.generation.structured.has_value());
  EXPECT_EQ(schema.chat.generation.structured->field, "text.format.schema");
}

TEST(OpenAiResponsesTest, UnaryResponseObject) {
  const ResponsesRequest r = Parse({{"input", "hi"}, {"instructions", "be brief"}});
  ResponsesWriter writer(r, "serve-small", 1700000000);
  writer.Add(Chunk("Hello"));
  writer.Add(Chunk(" world"));
  const json body = json::parse(writer.Final(Done(engine::Finish::kEos, 5, 2)));
  EXPECT_THAT(body["id"].get<std::string>(), StartsWith("resp_"));
  EXPECT_EQ(body["object"], "response");
  EXPECT_EQ(body["created_at"], 1700000000);
  EXPECT_EQ(body["status"], "completed");
  EXPECT_EQ(body["model"], "serve-small");
  EXPECT_EQ(body["instructions"], "be brief");
  EXPECT_EQ(body["store"], false);
  ASSERT_EQ(body["output"].size(), 1u);
  const json& message = body["output"][0];
  EXPECT_EQ(message["type"], "message");
  EXPECT_EQ(message["role"], "assistant");
  EXPECT_EQ(message["status"], "completed");
  EXPECT_THAT(message["id"].get<std::string>(), StartsWith("msg_"));
  ASSERT_EQ(message["content"].size(), 1u);
  EXPECT_EQ(message["content"][0]["type"], "output_text");
  EXPECT_EQ(message["content"][0]["text"], "Hello world");
  EXPECT_EQ(body["usage"]["input_tokens"], 5);
  EXPECT_EQ(body["usage"]["output_tokens"], 2);
  EXPECT_EQ(body["usage"]["total_tokens"], 7);

  ResponsesWriter cut(r, "serve-small", 1);
  cut.Add(Chunk("Hel"));
  const json incomplete = json::parse(cut.Final(Done(engine::Finish::kLength, 5, 1)));
  EXPECT_EQ(incomplete["status"], "incomplete");
  EXPECT_EQ(incomplete["incomplete_details"]["reason"], "max_output_tokens");
}

TEST(OpenAiResponsesTest, StreamEventsInOpenAisOrder) {
  ResponsesRequest r = Parse({{"input", "hi"}, {"stream", true}});
  EXPECT_TRUE(r.chat.stream);
  ResponsesWriter writer(r, "serve-small", 1);
  std::string text = writer.StreamStart();
  text += writer.StreamChunk(Chunk("Hel"));
  text += writer.StreamChunk(Chunk(""));  // nothing
  text += writer.StreamChunk(Chunk("lo"));
  text += writer.StreamEnd(Done(engine::Finish::kEos, 3, 2));
  const auto events = Events(text);
  std::vector<std::string> names;
  for (size_t i = 0; i < events.size(); ++i) {
    names.push_back(events[i].first);
    EXPECT_EQ(events[i].second["sequence_number"], static_cast<int>(i));
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"response.created", "response.in_progress",
                                      "response.output_item.added", "response.content_part.added",
                                      "response.output_text.delta", "response.output_text.delta",
                                      "response.output_text.done", "response.content_part.done",
                                      "response.output_item.done", "response.completed"}));
  EXPECT_EQ(events[0].second["response"]["status"], "in_progress");
  EXPECT_EQ(events[0].second["response"]["id"], writer.id());
  EXPECT_EQ(events[4].second["delta"], "Hel");
  EXPECT_EQ(events[5].second["delta"], "lo");
  EXPECT_EQ(events[4].second["item_id"], events[2].second["item"]["id"]);
  EXPECT_EQ(events[6].second["text"], "Hello");
  const json& done = events.back().second["response"];
  EXPECT_EQ(done["status"], "completed");
  EXPECT_EQ(done["output"][0]["content"][0]["text"], "Hello");
  EXPECT_EQ(done["usage"]["total_tokens"], 5);

  ResponsesWriter failing(r, "serve-small", 1);
  OpenAiError error;
  error.code = "timeout";
  error.message = "too slow";
  const auto error_events = Events(failing.StreamError(error));
  ASSERT_EQ(error_events.size(), 1u);
  EXPECT_EQ(error_events[0].first, "error");
  EXPECT_EQ(error_events[0].second["message"], "too slow");
}

TEST(OpenAiResponsesTest, FunctionCallsStreamTheirArgumentsAndEndAsItems) {
  ResponsesRequest r = Parse({{"input", "weather?"},
                              {"stream", true},
                              {"tools", json::parse(R"([{"type": "function", "name": "get_weather",
                                        "parameters": {"type": "object"}}])")}});
  ASSERT_TRUE(ApplyToolChoice(r.chat, grammar::ToolCallFormat::kHermes).ok());
  const std::string model_text =
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
  ResponsesWriter writer(r, "m", 1);
  std::string text = writer.StreamStart();
  for (size_t i = 0; i < model_text.size(); i += 4) {
    text += writer.StreamChunk(Chunk(model_text.substr(i, 4)));
  }
  text += writer.StreamEnd(Done(engine::Finish::kEos, 3, 20));
  std::string arguments;
  int deltas = 0;
  json added, done;
  for (const auto& [name, data] : Events(text)) {
    EXPECT_NE(name, "response.output_text.delta") << data.dump();  // no text, only the call
    if (name == "response.output_item.added") added = data["item"];
    if (name == "response.function_call_arguments.delta") {
      ++deltas;
      arguments += data["delta"].get<std::string>();
    }
    if (name == "response.function_call_arguments.done") {
      EXPECT_EQ(data["arguments"], arguments);
    }
    if (name == "response.completed") done = data["response"];
  }
  EXPECT_EQ(added["type"], "function_call");
  EXPECT_EQ(added["name"], "get_weather");
  EXPECT_EQ(added["arguments"], "");
  EXPECT_THAT(added["call_id"].get<std::string>(), StartsWith("call_"));
  EXPECT_GT(deltas, 1);  // in pieces, as written
  EXPECT_EQ(json::parse(arguments), (json{{"city", "Oslo"}}));
  ASSERT_EQ(done["output"].size(), 1u);
  EXPECT_EQ(done["output"][0]["type"], "function_call");
  EXPECT_EQ(done["output"][0]["status"], "completed");
  EXPECT_EQ(done["output"][0]["call_id"], added["call_id"]);

  // Unary: the same call as an output item.
  ResponsesWriter unary(r, "m", 1);
  unary.Add(Chunk("Let me look.\n" + model_text));
  const json body = json::parse(unary.Final(Done(engine::Finish::kEos, 3, 20)));
  ASSERT_EQ(body["output"].size(), 2u);
  EXPECT_EQ(body["output"][0]["content"][0]["text"], "Let me look.");
  EXPECT_EQ(body["output"][1]["type"], "function_call");
  EXPECT_EQ(body["output"][1]["name"], "get_weather");
  EXPECT_EQ(json::parse(body["output"][1]["arguments"].get<std::string>()),
            (json{{"city", "Oslo"}}));
}

}  // namespace
}  // namespace accel::server::internal
