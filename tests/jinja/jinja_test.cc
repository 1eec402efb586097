// Hand-checked renderings per construct, errors and the bounds on hostile
// templates. tests/jinja/jinja_reference_test.cc compares with @huggingface/jinja.
#include "jinja/jinja.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace accel::jinja {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::ordered_json;

absl::StatusOr<std::string> Try(const std::string& source, const Json& context = Json::object()) {
  absl::StatusOr<Template> t = Template::Parse(source);
  if (!t.ok()) return t.status();
  return t->Render(context);
}

std::string Render(const std::string& source, const Json& context = Json::object()) {
  absl::StatusOr<std::string> out = Try(source, context);
  if (!out.ok()) return "ERROR: " + std::string(out.status().message());
  return *out;
}

std::string Error(const std::string& source, const Json& context = Json::object()) {
  absl::StatusOr<std::string> out = Try(source, context);
  if (out.ok()) return "rendered: " + *out;
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  return std::string(out.status().message());
}

TEST(JinjaTest, TextAndTrailingNewline) {
  EXPECT_EQ(Render("hello\n"), "hello");
  EXPECT_EQ(Render("a\n\n"), "a\n");
  absl::StatusOr<Template> keep = Template::Parse("a\n", {.keep_trailing_newline = true});
  ASSERT_TRUE(keep.ok());
  EXPECT_EQ(*keep->Render(Json::object()), "a\n");
}

TEST(JinjaTest, PrintsValuesAsTheReference) {
  EXPECT_EQ(Render("{{ 1 }} {{ 1.0 }} {{ 2.5 }} {{ true }} {{ none }} {{ x }}|"),
            "1 1.0 2.5 true  |");
  EXPECT_EQ(Render("{{ [1, 'a', none] }} {{ {'k': 1.0} }}"), "[1, \"a\", null] {\"k\": 1}");
  EXPECT_EQ(Render("{{ 1.0 ~ '' }} {{ 0.1 + 0.2 }} {{ 7 / 2 }} {{ 7 // 2 }} {{ -7 % 3 }}"),
            "1 0.30000000000000004 3.5 3 -1");
}

TEST(JinjaTest, IfElifElse) {
  const std::string t = "{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %}";
  EXPECT_EQ(Render(t, {{"x", 1}}), "one");
  EXPECT_EQ(Render(t, {{"x", 2}}), "two");
  EXPECT_EQ(Render(t, {{"x", 3}}), "many");
}

TEST(JinjaTest, ForLoopVariables) {
  EXPECT_EQ(
      Render("{% for x in xs %}{{ loop.index }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }} "
             "{% endfor %}",
             {{"xs", {"a", "b"}}}),
      "11truefalse 20falsetrue ");
  EXPECT_EQ(
      Render("{% for x in xs if x > 1 %}{{ x }}{% else %}none{% endfor %}", {{"xs", {1, 2, 3}}}),
      "23");
  EXPECT_EQ(Render("{% for x in [] %}{{ x }}{% else %}none{% endfor %}"), "none");
  EXPECT_EQ(Render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
                   {{"d", {{"a", 1}, {"b", 2}}}}),
            "a=1;b=2;");
}

TEST(JinjaTest, NamespaceAndBlockSet) {
  EXPECT_EQ(Render("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}"
                   "{% endfor %}{{ ns.n }}"),
            "6");
  EXPECT_EQ(Render("{% set x %}a{{ 1 }}b{% endset %}[{{ x }}]"), "[a1b]");
}

TEST(JinjaTest, MacrosAndCall) {
  EXPECT_EQ(Render("{% macro m(a, b='B') %}{{ a }}{{ b }}{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}"),
            "1B23");
  EXPECT_EQ(Render("{% macro w() %}<{{ caller() }}>{% endmacro %}{% call w() %}in{% endcall %}"),
            "<in>");
}

TEST(JinjaTest, FiltersAndMethods) {
  EXPECT_EQ(Render("{{ ' a ' | trim }}|{{ 'ab' | upper }}|{{ [3, 1, 2] | sort | join(',') }}|{{ x "
                   "| default('d') }}"),
            "a|AB|1,2,3|d");
  EXPECT_EQ(Render("{{ {'a': [1, 2]} | tojson(indent=2) }}"),
            "{\n  \"a\": [\n    1,\n    2\n  ]\n}");
  EXPECT_EQ(
      Render("{{ 'a,b,c'.split(',', 1) }}|{{ 'hello'[::-1] }}|{{ 'x'.startswith(('y', 'x')) }}"),
      "[\"a\", \"b,c\"]|olleh|true");
  EXPECT_EQ(Render("{{ users | selectattr('ok') | map(attribute='n') | join }}",
                   {{"users", {{{"n", "a"}, {"ok", true}}, {{"n", "b"}, {"ok", false}}}}}),
            "a");
}

TEST(JinjaTest, WhitespaceControlAndGeneration) {
  EXPECT_EQ(Render("a  {{- 'b' -}}  c {#- x -#} d"), "abcd");
  EXPECT_EQ(Render("x\n  {% if true %}\n  y\n  {% endif %}\nz"), "x\n  y\nz");
  EXPECT_EQ(Render("{% generation %}g{% endgeneration %}"), "g");
}

TEST(JinjaTest, ParseErrorsNameTheLine) {
  EXPECT_THAT(Error("a\nb\n{{ x | foo }}"), HasSubstr("line 3: unknown filter 'foo'"));
  EXPECT_THAT(Error("{{ x is frob }}"), HasSubstr("unknown test 'frob'"));
  EXPECT_THAT(Error("\n{% if x %}open"), HasSubstr("line 2: unclosed 'if' block"));
  EXPECT_THAT(Error("{% frob %}"), HasSubstr("unknown tag 'frob'"));
  EXPECT_THAT(Error("{{ 'abc }}"), HasSubstr("line 1"));
  // A Jinja2 filter the reference lacks fails only when used.
  EXPECT_EQ(Render("{% if false %}{{ x | reject('none') }}{% endif %}ok"), "ok");
  EXPECT_THAT(Error("{{ [1] | reject('none') }}"), HasSubstr("not supported"));
}

TEST(JinjaTest, RaiseExceptionAndRuntimeErrors) {
  EXPECT_THAT(Error("x\n{{ raise_exception('roles must alternate') }}"),
              HasSubstr("line 2: roles must alternate"));
  EXPECT_THAT(Error("{{ x + 1 }}"), HasSubstr("undefined"));
  EXPECT_THAT(Error("{{ 1 / 0 }}"), HasSubstr("division by zero"));
  EXPECT_THAT(Error("{{ 1 }}", Json::array()), HasSubstr("JSON object"));
}

TEST(JinjaTest, HostileTemplatesAreBounded) {
  EXPECT_THAT(Error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
              HasSubstr("recursion"));
  EXPECT_THAT(Error("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"),
              HasSubstr("nested too deeply"));
  std::string chain = "{{ 1";
  for (int i = 0; i < 5000; ++i) chain += " + 1";
  EXPECT_THAT(Error(chain + " }}"), HasSubstr("nested too deeply"));
  EXPECT_THAT(Error("{% for i in range(10**12) %}{% endfor %}"), HasSubstr("range()"));
  EXPECT_THAT(
      Error("{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}"),
      HasSubstr("steps"));
  EXPECT_THAT(Error("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}"
                    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}"),
              HasSubstr("longer than"));
  EXPECT_THAT(
      Error("{% set ns = namespace(a=[1]) %}{% for i in range(40) %}{% set ns.a = ns.a + ns.a %}"
            "{% endfor %}"),
      HasSubstr("list longer"));
  EXPECT_THAT(Error("{% set ns = namespace(a=1) %}{% for i in range(1000) %}{% set ns.a = [ns.a] %}"
                    "{% endfor %}"),
              HasSubstr("nested too deeply"));
  // A namespace holding itself: printing it is an error, and nothing leaks (ASan).
  EXPECT_THAT(Error("{% set ns = namespace() %}{% set ns.self = ns %}{{ ns }}"),
              HasSubstr("deeply"));
  std::string out = "{% for i in range(1000000) %}" + std::string(100, 'x') + "{% endfor %}";
  EXPECT_THAT(Error(out), HasSubstr("output longer"));
}

TEST(JinjaTest, TemplateIsCopyableAndReusable) {
  absl::StatusOr<Template> t = Template::Parse("{{ x }}");
  ASSERT_TRUE(t.ok());
  const Template copy = *t;
  EXPECT_EQ(*copy.Render({{"x", 1}}), "1");
  EXPECT_EQ(*t->Render({{"x", "a"}}), "a");
}

}  // namespace
}  // namespace accel::jinja
