// Tool-call parsers on the models' own renderings of tool-call turns (each
// family's chat template, rendered by our jinja), whole and streamed in
// random pieces; the call grammars against the parsers.
#include "grammar/tool_calls.h"

#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"

#include "grammar/grammar.h"
#include "tests/testing/status_matchers.h"
#include "tokenizer/chat_template.h"

namespace accel::grammar {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;
using Json = nlohmann::json;

std::string ReadTemplate(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

const char* kTools = R"([{"type": "function", "function": {"name": "get_weather",
  "description": "Weather in a city", "parameters": {"type": "object",
  "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
  "required": ["city"]}}},
  {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
  "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}])";

// The assistant turn a template renders for `calls` (with `content` before
// them), cut out of the whole conversation between `open` and `close`.
std::string RenderedTurn(const std::string& template_path, const std::string& content,
                         const Json& calls, const std::string& open, const std::string& close) {
  auto chat = tokenizer::ChatTemplate::FromSource(
      ReadTemplate(template_path), {{"bos_token", "<s>"}, {"eos_token", "</s>"}}, template_path);
  EXPECT_THAT(chat, IsOk());
  Json messages = Json::array();
  messages.push_back({{"role", "user"}, {"content", "Weather in Paris?"}});
  Json assistant = {{"role", "assistant"}, {"content", content}, {"tool_calls", calls}};
  messages.push_back(assistant);
  messages.push_back({{"role", "tool"}, {"tool_call_id", "abcdefghi"}, {"content", "sunny"}});
  messages.push_back({{"role", "assistant"}, {"content", "It is sunny."}});
  messages.push_back({{"role", "user"}, {"content", "Thanks"}});
  auto text = chat->Render(messages.dump(), kTools, /*add_generation_prompt=*/false);
  EXPECT_THAT(text, IsOk());
  if (!text.ok()) return "";
  const size_t start = text->find(open);
  EXPECT_NE(start, std::string::npos) << *text;
  const size_t end = text->find(close, start + open.size());
  EXPECT_NE(end, std::string::npos) << *text;
  return text->substr(start + open.size(), end - start - open.size());
}

Json Call(const std::string& name, const Json& arguments) {
  return {{"id", "abcdefghi"},
          {"type", "function"},
          {"function", {{"name", name}, {"arguments", arguments}}}};
}

// The parse of `text`, whole and streamed in random pieces, must agree.
ParsedToolCalls ParseBothWays(ToolCallFormat format, const std::string& text) {
  ParsedToolCalls whole = ParseToolCalls(format, text);
  std::mt19937 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    ToolCallStreamParser stream(format);
    std::string content;
    std::vector<ToolCall> calls;
    auto take = [&](std::vector<ToolCallStreamParser::Event> events) {
      for (auto& e : events) {
        content += e.content;
        if (e.call) {
          EXPECT_EQ(e.index, static_cast<int>(calls.size()));
          calls.push_back(*e.call);
        }
        if (!e.arguments.empty()) {
          ASSERT_LT(e.index, static_cast<int>(calls.size()));
          calls[e.index].arguments += e.arguments;
        }
      }
    };
    for (size_t i = 0; i < text.size();) {
      const size_t n = 1 + rng() % 7;
      take(stream.Add(text.substr(i, n)));
      i += n;
    }
    take(stream.Finish());
    EXPECT_EQ(absl::StripTrailingAsciiWhitespace(content), whole.content) << text;
    EXPECT_EQ(calls.size(), whole.calls.size()) << text;
    for (size_t i = 0; i < calls.size() && i < whole.calls.size(); ++i) {
      EXPECT_EQ(calls[i].name, whole.calls[i].name);
      EXPECT_EQ(Json::parse(calls[i].arguments), Json::parse(whole.calls[i].arguments));
    }
  }
  return whole;
}

TEST(ToolCallsTest, HermesOnQwen3Rendering) {
  const std::string text =
      RenderedTurn(ACCEL_TOOL_TEMPLATES "/qwen3.jinja", "Let me check.",
                   Json::array({Call("get_weather", {{"city", "Paris"}, {"days", 2}}),
                                Call("get_time", {{"zone", "CET"}})}),
                   "<|im_start|>assistant\n", "<|im_end|>");
  ASSERT_THAT(text, HasSubstr("<tool_call>"));
  EXPECT_EQ(DetectToolCallFormat(ReadTemplate(ACCEL_TOOL_TEMPLATES "/qwen3.jinja")),
            ToolCallFormat::kHermes);
  ParsedToolCalls parsed = ParseBothWays(ToolCallFormat::kHermes, text);
  EXPECT_EQ(parsed.content, "Let me check.");
  ASSERT_EQ(parsed.calls.size(), 2u);
  EXPECT_EQ(parsed.calls[0].name, "get_weather");
  EXPECT_EQ(Json::parse(parsed.calls[0].arguments), (Json{{"city", "Paris"}, {"days", 2}}));
  EXPECT_EQ(parsed.calls[1].name, "get_time");
  EXPECT_THAT(parsed.calls[0].id, ::testing::StartsWith("call_"));
  EXPECT_EQ(parsed.calls[0].id.size(), 29u);
  EXPECT_NE(parsed.calls[0].id, parsed.calls[1].id);
}

TEST(ToolCallsTest, Llama3JsonOnLlama31Rendering) {
  const std::string path = ACCEL_JINJA_TEMPLATES "/llama3.1-tools.jinja";
  const std::string text =
      RenderedTurn(path, "", Json::array({Call("get_weather", {{"city", "Paris"}})}),
                   "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>");
  EXPECT_EQ(DetectToolCallFormat(ReadTemplate(path)), ToolCallFormat::kLlama3Json);
  for (const std::string& variant : {text, "<|python_tag|>" + text, text + "; " + text}) {
    ParsedToolCalls parsed = ParseBothWays(ToolCallFormat::kLlama3Json, variant);
    EXPECT_EQ(parsed.content, "");
    ASSERT_GE(parsed.calls.size(), 1u) << variant;
    EXPECT_EQ(parsed.calls[0].name, "get_weather");
    EXPECT_EQ(Json::parse(parsed.calls[0].arguments), (Json{{"city", "Paris"}}));
  }
  EXPECT_EQ(ParseToolCalls(ToolCallFormat::kLlama3Json, text + "; " + text).calls.size(), 2u);
  // Prose that merely contains braces is content.
  ParsedToolCalls prose = ParseBothWays(ToolCallFormat::kLlama3Json, "Use {x} here.");
  EXPECT_EQ(prose.content, "Use {x} here.");
  EXPECT_TRUE(prose.calls.empty());
}

TEST(ToolCallsTest, MistralOnMistralRendering) {
  const std::string path = ACCEL_TOOL_TEMPLATES "/mistral-7b-instruct-v0.3.jinja";
  const std::string text = RenderedTurn(
      path, "",
      Json::array({Call("get_weather", {{"city", "Paris"}}), Call("get_time", {{"zone", "UTC"}})}),
      "[/INST]", "</s>");
  ASSERT_THAT(text, HasSubstr("[TOOL_CALLS]"));
  EXPECT_EQ(DetectToolCallFormat(ReadTemplate(path)), ToolCallFormat::kMistral);
  // As decoded with special tokens and without ([TOOL_CALLS] is one).
  std::string without = text;
  without.erase(without.find("[TOOL_CALLS]"), 12);
  for (const std::string& variant : {text, without}) {
    ParsedToolCalls parsed = ParseBothWays(ToolCallFormat::kMistral, variant);
    EXPECT_EQ(parsed.content, "");
    ASSERT_EQ(parsed.calls.size(), 2u) << variant;
    EXPECT_EQ(parsed.calls[1].name, "get_time");
    EXPECT_EQ(Json::parse(parsed.calls[1].arguments), (Json{{"zone", "UTC"}}));
    EXPECT_EQ(parsed.calls[0].id.size(), 9u);
  }
  // Mistral's newer form: name[ARGS]{...}
  ParsedToolCalls v11 =
      ParseBothWays(ToolCallFormat::kMistral, "Sure.[TOOL_CALLS]get_time[ARGS]{\"zone\": \"UTC\"}");
  EXPECT_EQ(v11.content, "Sure.");
  ASSERT_EQ(v11.calls.size(), 1u);
  EXPECT_EQ(v11.calls[0].name, "get_time");
}

// A call's arguments stream as they are written: the call (id, name,
// arguments "") once its name is complete, then pieces of the arguments'
// text, none held until the call ends.
TEST(ToolCallsTest, StreamedArgumentsComeInPieces) {
  const std::string head = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ";
  const std::string arguments = "{\"city\": \"Pa}ris\\\"\", \"days\": [2, {\"x\": 1}]}";
  const std::string text = head + arguments + "}\n</tool_call>";
  ToolCallStreamParser stream(ToolCallFormat::kHermes);
  std::string content;
  std::string streamed_arguments;
  int calls = 0;
  int argument_events = 0;
  size_t call_seen_at = std::string::npos;
  for (size_t i = 0; i < text.size(); ++i) {
    for (auto& e : stream.Add(text.substr(i, 1))) {
      content += e.content;
      if (e.call) {
        ++calls;
        call_seen_at = i;
        EXPECT_EQ(e.call->name, "get_weather");
        EXPECT_EQ(e.call->arguments, "");
        EXPECT_THAT(e.call->id, ::testing::StartsWith("call_"));
      }
      if (!e.arguments.empty()) {
        ++argument_events;
        EXPECT_EQ(e.index, 0);
        streamed_arguments += e.arguments;
      }
    }
  }
  // Nothing waits for the end of the call: the arguments are all out.
  EXPECT_EQ(streamed_arguments, arguments);
  for (auto& e : stream.Finish()) {
    content += e.content;
    EXPECT_FALSE(e.call.has_value());
    EXPECT_TRUE(e.arguments.empty());
  }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(stream.num_calls(), 1);
  // The call is announced before its arguments begin; one piece per character fed.
  EXPECT_LT(call_seen_at, head.size() + 1);
  EXPECT_EQ(argument_events, static_cast<int>(arguments.size()));
  EXPECT_EQ(content, "Sure.");
  EXPECT_EQ(Json::parse(streamed_arguments),
            Json::parse(ParseToolCalls(ToolCallFormat::kHermes, text).calls[0].arguments));

  // A call in another shape (arguments before the name) still comes whole.
  ToolCallStreamParser other(ToolCallFormat::kHermes);
  std::vector<ToolCallStreamParser::Event> events =
      other.Add("<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>");
  for (auto& e : other.Finish()) events.push_back(std::move(e));
  int whole = 0;
  for (auto& e : events) {
    if (e.call) {
      ++whole;
      EXPECT_EQ(e.call->name, "f");
      EXPECT_EQ(Json::parse(e.call->arguments), (Json{{"a", 1}}));
    }
    EXPECT_TRUE(e.arguments.empty());
    EXPECT_EQ(e.content, "");
  }
  EXPECT_EQ(whole, 1);
}

TEST(ToolCallsTest, BrokenCallsStayContent) {
  // Whole text: bad arguments are content. (A stream has announced that
  // call by the time its arguments go wrong, as vLLM's does.)
  const std::string bad_arguments =
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>";
  EXPECT_TRUE(ParseToolCalls(ToolCallFormat::kHermes, bad_arguments).calls.empty());
  EXPECT_EQ(ParseToolCalls(ToolCallFormat::kHermes, bad_arguments).content, bad_arguments);
  for (const char* text :
       {"<tool_call>{\"arguments\": {}}</tool_call>", "<tool_call>\n{\"name\": \"f\"",
        "<tool_call>\n{\"name\": 3, \"arguments\": {}}</tool_call>"}) {
    ParsedToolCalls parsed = ParseBothWays(ToolCallFormat::kHermes, text);
    EXPECT_TRUE(parsed.calls.empty()) << text;
    EXPECT_EQ(parsed.content, text);
  }
  // Text before a call, and a marker split over stream pieces.
  ParsedToolCalls parsed =
      ParseBothWays(ToolCallFormat::kHermes,
                    "I'll look <tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_call>");
  EXPECT_EQ(parsed.content, "I'll look");
  ASSERT_EQ(parsed.calls.size(), 1u);
  EXPECT_EQ(parsed.calls[0].arguments, "{}");
  EXPECT_EQ(ParseBothWays(ToolCallFormat::kHermes, "a < b <tool").content, "a < b <tool");
}

TEST(ToolCallsTest, FormatNames) {
  EXPECT_EQ(*ToolCallFormatFromName("hermes"), ToolCallFormat::kHermes);
  EXPECT_EQ(*ToolCallFormatFromName("llama3_json"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(*ToolCallFormatFromName("mistral"), ToolCallFormat::kMistral);
  EXPECT_THAT(ToolCallFormatFromName("qwen"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown parser \"qwen\"")));
  EXPECT_EQ(DetectToolCallFormat("{{ messages }}"), ToolCallFormat::kNone);
}

// The grammar of a forced call accepts what the parser reads as that call,
// and refuses other functions and arguments off the schema.
TEST(ToolCallsTest, CallGrammarsMatchTheParsers) {
  struct Case {
    ToolCallFormat format;
    std::string good;
    std::string bad;
  };
  const std::vector<Case> cases = {
      {ToolCallFormat::kHermes,
       "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": "
       "3}}\n</tool_call>",
       "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": "
       "9}}\n</tool_call>"},
      {ToolCallFormat::kLlama3Json, "{\"name\": \"get_time\", \"parameters\": {\"zone\": \"UTC\"}}",
       "{\"name\": \"get_time\", \"parameters\": {\"zone\": \"PST\"}}"},
      {ToolCallFormat::kMistral,
       "[{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}, {\"name\": \"get_weather\", "
       "\"arguments\": {\"city\": \"x\"}}]",
       "[{\"name\": \"get_date\", \"arguments\": {}}]"},
  };
  for (const Case& c : cases) {
    auto gbnf = ToolCallGbnf(c.format, kTools, std::nullopt);
    ASSERT_THAT(gbnf, IsOk());
    auto g = ParseGbnf(*gbnf);
    ASSERT_THAT(g, IsOk()) << *gbnf;
    EXPECT_TRUE((*g)->Matches(c.good)) << c.good;
    EXPECT_FALSE((*g)->Matches(c.bad)) << c.bad;
    EXPECT_FALSE(ParseToolCalls(c.format, c.good).calls.empty()) << c.good;
  }
  auto named = ToolCallGbnf(ToolCallFormat::kLlama3Json, kTools, "get_weather");
  ASSERT_THAT(named, IsOk());
  auto g = ParseGbnf(*named);
  ASSERT_THAT(g, IsOk());
  EXPECT_TRUE((*g)->Matches("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"a\"}}"));
  EXPECT_FALSE((*g)->Matches("{\"name\": \"get_time\", \"parameters\": {\"zone\": \"UTC\"}}"));
  EXPECT_THAT(
      ToolCallGbnf(ToolCallFormat::kHermes, kTools, "nope"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no function named \"nope\"")));
  EXPECT_THAT(ToolCallGbnf(ToolCallFormat::kHermes, R"([{"type": "function"}])", std::nullopt),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tools[0]")));
}

}  // namespace
}  // namespace accel::grammar
