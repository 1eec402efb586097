// JSON Schema to grammar: random masked walks over a vocabulary of
// multi-byte tokens (JSON punctuation fused with quotes, words, split UTF-8)
// must each give text that nlohmann parses and that a plain validator
// written here (independent of the converter) accepts; every refused keyword
// is named.
#include "grammar/json_schema.h"

#include <cmath>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <re2/re2.h>

#include "absl/strings/str_cat.h"

#include "grammar/matcher.h"
#include "tests/testing/status_matchers.h"

namespace accel::grammar {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// Code points of a UTF-8 string.
int64_t Utf8Length(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// A plain validator for the keywords the converter supports.
bool Validate(const Json& value, const Json& schema, const Json& root, std::string* why) {
  auto fail = [&](const std::string& reason) {
    *why = reason + " at " + value.dump();
    return false;
  };
  if (schema.is_boolean()) return schema.get<bool>() || fail("false schema");
  if (schema.contains("$ref")) {
    const std::string ref = schema["$ref"];
    const Json* node = &root;
    if (ref != "#") node = &root[Json::json_pointer(ref.substr(1))];
    return Validate(value, *node, root, why);
  }
  if (schema.contains("anyOf") || schema.contains("oneOf")) {
    const Json& list = schema.contains("anyOf") ? schema["anyOf"] : schema["oneOf"];
    for (const auto& s : list) {
      std::string ignored;
      if (Validate(value, s, root, &ignored)) return true;
    }
    return fail("no branch");
  }
  if (schema.contains("const") && value != schema["const"]) return fail("const");
  if (schema.contains("enum")) {
    bool found = false;
    for (const auto& v : schema["enum"]) found = found || v == value;
    if (!found) return fail("enum");
  }
  if (schema.contains("type")) {
    std::vector<std::string> types;
    if (schema["type"].is_string()) {
      types.push_back(schema["type"]);
    } else {
      for (const auto& t : schema["type"]) types.push_back(t);
    }
    bool ok = false;
    for (const auto& t : types) {
      ok = ok || (t == "object" && value.is_object()) || (t == "array" && value.is_array()) ||
           (t == "string" && value.is_string()) || (t == "number" && value.is_number()) ||
           (t == "integer" && value.is_number_integer()) ||
           (t == "boolean" && value.is_boolean()) || (t == "null" && value.is_null());
    }
    if (!ok) return fail("type");
  }
  if (value.is_object()) {
    const Json props = schema.value("properties", Json::object());
    for (const auto& r : schema.value("required", Json::array())) {
      if (!value.contains(r.get<std::string>())) return fail("required " + r.get<std::string>());
    }
    for (const auto& [k, v] : value.items()) {
      if (props.contains(k)) {
        if (!Validate(v, props[k], root, why)) return false;
      } else if (schema.contains("additionalProperties")) {
        const Json& a = schema["additionalProperties"];
        if (a.is_boolean() && !a.get<bool>()) return fail("additional " + k);
        if (!a.is_boolean() && !Validate(v, a, root, why)) return false;
      } else if (schema.contains("properties")) {
        return fail("additional (strict) " + k);
      }
    }
  }
  if (value.is_array()) {
    const Json prefix = schema.value("prefixItems", Json::array());
    if (schema.contains("minItems") && value.size() < schema["minItems"].get<size_t>()) {
      return fail("minItems");
    }
    if (schema.contains("maxItems") && value.size() > schema["maxItems"].get<size_t>()) {
      return fail("maxItems");
    }
    for (size_t i = 0; i < value.size(); ++i) {
      if (i < prefix.size()) {
        if (!Validate(value[i], prefix[i], root, why)) return false;
      } else if (schema.contains("items")) {
        if (!Validate(value[i], schema["items"], root, why)) return false;
      } else if (!prefix.empty()) {
        return fail("past prefixItems");
      }
    }
  }
  if (value.is_string()) {
    const std::string s = value;
    if (schema.contains("minLength") && Utf8Length(s) < schema["minLength"].get<int64_t>()) {
      return fail("minLength");
    }
    if (schema.contains("maxLength") && Utf8Length(s) > schema["maxLength"].get<int64_t>()) {
      return fail("maxLength");
    }
    if (schema.contains("pattern") && !RE2::PartialMatch(s, schema["pattern"].get<std::string>())) {
      return fail("pattern");
    }
    if (schema.contains("format")) {
      const std::string f = schema["format"];
      const std::string date = "\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])";
      const std::string time =
          "([01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(\\.\\d+)?(Z|[+-]([01]\\d|2[0-3]):[0-5]\\d)";
      std::string re;
      if (f == "date") re = date;
      if (f == "time") re = time;
      if (f == "date-time") re = date + "T" + time;
      if (f == "uuid")
        re = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}";
      if (f == "email") re = "[^@\\s]+@[^@\\s]+\\.[a-zA-Z]{2,}";
      if (f == "ipv4")
        re = "((25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)\\.){3}(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)";
      if (!RE2::FullMatch(s, re)) return fail("format " + f);
    }
  }
  if (value.is_number()) {
    const double d = value.get<double>();
    if (schema.contains("minimum") && d < schema["minimum"].get<double>()) return fail("minimum");
    if (schema.contains("maximum") && d > schema["maximum"].get<double>()) return fail("maximum");
    if (schema.contains("exclusiveMinimum") && d <= schema["exclusiveMinimum"].get<double>()) {
      return fail("exclusiveMinimum");
    }
    if (schema.contains("exclusiveMaximum") && d >= schema["exclusiveMaximum"].get<double>()) {
      return fail("exclusiveMaximum");
    }
  }
  return true;
}

// Tokens as a byte-level BPE vocabulary has them: every byte, JSON
// punctuation fused with quotes and spaces, words, digits, and a character
// whose bytes are split over two tokens.
std::shared_ptr<const TokenVocabulary> TestVocabulary(int64_t* stop) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  for (const char* t :
       {"{\"",   "\":",  "\": ", "\",",   "\", \"", "\"}", "},",  "\"]",  "[\"", "[{",   "}]",
        " {",    ", ",   "true", "false", "null",   "nu",  "ll",  "name", "age", "tags", "id",
        "é",     "\xC3", "\xA9", "日本",  "12",     "345", "0.",  ".5",   "e1",  "-1",   "ab",
        "cd",    "ef",   "@",    ".com",  "2024",   "-0",  "T1",  ":00",  "Z\"", "\\\"", "\\n",
        "\\u00", "  ",   "\n",   "\"",    "a\"",    "\"a", " \"", "xyz",  "q"}) {
    tokens.emplace_back(t);
  }
  std::vector<bool> special(tokens.size() + 1, false);
  *stop = static_cast<int64_t>(tokens.size());
  tokens.emplace_back("<eos>");
  special[*stop] = true;
  return TokenVocabulary::Create(tokens, special);
}

// Random masked walks; each finished output must parse and validate.
void CheckWalks(const std::string& schema_text, int walks, uint32_t seed) {
  SCOPED_TRACE(schema_text);
  auto grammar = CompileJsonSchema(schema_text);
  ASSERT_THAT(grammar, IsOk());
  int64_t stop = 0;
  static const auto vocab = TestVocabulary(&stop);
  stop = vocab->size() - 1;
  auto compiled = CompiledGrammar::Create(*grammar, vocab);
  const Json schema = Json::parse(schema_text);
  std::mt19937 rng(seed);
  int finished = 0;
  for (int w = 0; w < walks; ++w) {
    GrammarMatcher matcher(compiled, {stop});
    std::vector<uint64_t> mask(matcher.mask_words());
    std::string text;
    bool done = false;
    for (int step = 0; step < 1500 && !done; ++step) {
      ASSERT_GT(matcher.FillNextTokenBitmask(mask.data()), 0);
      std::vector<int64_t> allowed;
      for (int64_t t = 0; t < vocab->size(); ++t) {
        if (mask[t >> 6] >> (t & 63) & 1) allowed.push_back(t);
      }
      const bool can_end = mask[stop >> 6] >> (stop & 63) & 1;
      int64_t pick = allowed[rng() % allowed.size()];
      // Prefer tokens that close things as the walk grows, so most finish.
      if (step > 40) {
        for (int64_t t : allowed) {
          const std::string& b = t == stop ? std::string() : vocab->token_bytes(t);
          if (b.find_first_of("\"}]") != std::string::npos && rng() % 2 == 0) pick = t;
        }
      }
      if (can_end && (rng() % 3 == 0 || step > 40)) pick = stop;
      ASSERT_TRUE(matcher.AcceptToken(pick)) << "the mask allowed " << pick;
      if (pick == stop) {
        done = true;
      } else {
        text += vocab->token_bytes(pick);
      }
    }
    if (!done) continue;
    ++finished;
    Json value;
    ASSERT_NO_THROW(value = Json::parse(text)) << text;
    std::string why;
    EXPECT_TRUE(Validate(value, schema, schema, &why)) << text << ": " << why;
  }
  EXPECT_GE(finished, walks / 4) << "too few walks finished";
}

TEST(JsonSchemaTest, ObjectsWithRequiredAndOptionalProperties) {
  CheckWalks(
      R"({"type": "object", "title": "Person", "$schema": "https://json-schema.org/draft/2020-12/schema",
    "properties": {"name": {"type": "string", "maxLength": 6, "description": "who"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "ok": {"type": "boolean"}, "nick": {"type": ["string", "null"], "maxLength": 3}},
    "required": ["name", "ok"], "additionalProperties": false})",
      60, 1);
}

TEST(JsonSchemaTest, ArraysEnumsConstAndNesting) {
  CheckWalks(R"({"type": "object", "properties": {
      "tags": {"type": "array", "items": {"enum": ["ab", "cd", 12, null]}, "minItems": 1, "maxItems": 3},
      "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"const": "x\"y"}], "items": false},
      "kind": {"const": 3}},
    "required": ["tags", "pair", "kind"]})",
             60, 2);
}

TEST(JsonSchemaTest, AnyOfRefsAndRecursion) {
  CheckWalks(R"({"$defs": {"node": {"type": "object", "properties": {
        "id": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 40},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["id"]}},
      "anyOf": [{"$ref": "#/$defs/node"}, {"type": "number", "minimum": 2, "maximum": 7}, {"type": "null"}]})",
             60, 3);
}

TEST(JsonSchemaTest, StringFormatsPatternsAndLengths) {
  CheckWalks(R"({"type": "object", "properties": {
      "d": {"type": "string", "format": "date"}, "t": {"type": "string", "format": "date-time"},
      "u": {"type": "string", "format": "uuid"}, "e": {"type": "string", "format": "email"},
      "ip": {"type": "string", "format": "ipv4"},
      "p": {"type": "string", "pattern": "^[a-c]{2}-\\d+$"}, "q": {"type": "string", "pattern": "b"},
      "l": {"type": "string", "minLength": 2, "maxLength": 4}},
    "required": ["d", "t", "u", "e", "ip", "p", "q", "l"]})",
             40, 4);
}

TEST(JsonSchemaTest, AnyJsonAndOpenObjects) {
  CheckWalks(R"({})", 60, 5);
  CheckWalks(R"({"type": "object", "additionalProperties": {"type": "integer"}})", 60, 6);
  CheckWalks(R"({"type": "object", "properties": {"a": {"type": "string"}, "ab": {"type": "null"}},
      "additionalProperties": {"type": "integer"}})",
             60, 7);
  CheckWalks(R"({"type": "integer", "minimum": -1234, "maximum": 987})", 200, 8);
  CheckWalks(R"({"type": "number", "minimum": -2.5, "exclusiveMaximum": 7.125})", 200, 9);
}

TEST(JsonSchemaTest, IntegerRangesAreExact) {
  for (const auto& [lo, hi] : std::vector<std::pair<int, int>>{
           {-1234, 987}, {0, 0}, {7, 7}, {-50, -3}, {9, 10}, {99, 1000}}) {
    auto g = CompileJsonSchema(Json{{"type", "integer"}, {"minimum", lo}, {"maximum", hi}}.dump());
    ASSERT_THAT(g, IsOk());
    for (int v = lo - 30; v <= hi + 30; ++v) {
      EXPECT_EQ((*g)->Matches(std::to_string(v)), v >= lo && v <= hi)
          << v << " in [" << lo << ", " << hi << "]";
    }
    EXPECT_FALSE((*g)->Matches("-0"));
    EXPECT_FALSE((*g)->Matches("007"));
  }
  auto number = CompileJsonSchema(R"({"type": "number", "minimum": 1, "maximum": 3})");
  ASSERT_THAT(number, IsOk());
  for (const char* yes : {"1", "1.5", "2.999", "3", "3.0", "3.000"})
    EXPECT_TRUE((*number)->Matches(yes)) << yes;
  for (const char* no : {"0.5", "3.01", "4", "-1", "1e3"})
    EXPECT_FALSE((*number)->Matches(no)) << no;
}

// Number schemas with every pair of `bounds` (none, or a value; each
// inclusive or exclusive) against the bound checked on the parsed value
// (strtod) of `texts`: every text matches exactly when it is in range ("-0"
// and "-0.0" never: a grammar writes zero unsigned), an empty range is a
// 400. Returns the texts checked.
int CheckNumberRanges(const std::vector<std::string>& texts,
                      const std::vector<std::optional<double>>& bounds) {
  int checked = 0;
  for (const std::optional<double> lo : bounds) {
    for (const std::optional<double> hi : bounds) {
      if (!lo && !hi) continue;
      for (const bool lo_exclusive : {false, true}) {
        for (const bool hi_exclusive : {false, true}) {
          Json schema = {{"type", "number"}};
          if (lo) schema[lo_exclusive ? "exclusiveMinimum" : "minimum"] = *lo;
          if (hi) schema[hi_exclusive ? "exclusiveMaximum" : "maximum"] = *hi;
          auto g = CompileJsonSchema(schema.dump());
          const bool empty =
              lo && hi && (*lo > *hi || (*lo == *hi && (lo_exclusive || hi_exclusive)));
          if (empty) {
            EXPECT_THAT(g,
                        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("leaves no number")))
                << schema.dump();
            continue;
          }
          EXPECT_THAT(g, IsOk()) << schema.dump();
          if (!g.ok()) continue;
          for (const std::string& text : texts) {
            const double v = std::strtod(text.c_str(), nullptr);
            bool in = true;
            if (lo) in = in && (lo_exclusive ? v > *lo : v >= *lo);
            if (hi) in = in && (hi_exclusive ? v < *hi : v <= *hi);
            if (text.rfind("-0", 0) == 0 && v == 0) in = false;
            EXPECT_EQ((*g)->Matches(text), in) << text << " against " << schema.dump();
            ++checked;
          }
        }
      }
    }
  }
  return checked;
}

// Integers of either sign as bounds, around them numbers with and without
// fractions.
TEST(JsonSchemaTest, NumberRangesWithSignedAndExclusiveBoundsAreExact) {
  std::vector<std::string> texts;
  for (int i = -12; i <= 12; ++i) {
    for (const char* fraction : {"", ".0", ".00", ".5", ".05", ".999"}) {
      if (i < 0) {
        texts.push_back(absl::StrCat("-", -i, fraction));
      } else {
        texts.push_back(absl::StrCat(i, fraction));
        if (i == 0) texts.push_back(absl::StrCat("-0", fraction));
      }
    }
  }
  EXPECT_GT(CheckNumberRanges(texts, {std::nullopt, -7, -2, -1, 0, 3, 5}), 5000);
}

// Fractional bounds: the grammar compares the fraction's digits, so 2.125
// is above 2.12 and 2.1249 below 2.125, whatever the number of digits
// written.
TEST(JsonSchemaTest, NumberRangesWithFractionalBoundsAreExact) {
  std::vector<std::string> texts;
  for (int i = -4; i <= 4; ++i) {
    for (const char* fraction : {"", ".0", ".00", ".05", ".1", ".12", ".125", ".1249", ".1251",
                                 ".13", ".5", ".50", ".05001", ".04999", ".9", ".999", ".25"}) {
      if (i < 0) {
        texts.push_back(absl::StrCat("-", -i, fraction));
      } else {
        texts.push_back(absl::StrCat(i, fraction));
        texts.push_back(absl::StrCat("-", i, fraction));
      }
    }
  }
  const int checked =
      CheckNumberRanges(texts, {std::nullopt, -3.25, -1.5, -0.05, 0, 0.125, 0.5, 2.125, 2.13, 3});
  EXPECT_GT(checked, 50000);
  // Many fraction digits, around a bound of 16.
  auto g = CompileJsonSchema(R"({"type": "number", "minimum": 0.1234567890123456, "maximum": 1})");
  ASSERT_THAT(g, IsOk());
  EXPECT_TRUE((*g)->Matches("0.1234567890123456"));
  EXPECT_TRUE((*g)->Matches("0.12345678901234561"));
  EXPECT_FALSE((*g)->Matches("0.1234567890123455"));
  EXPECT_FALSE((*g)->Matches("0.123456789012345599"));
}

// Additional properties beside declared ones: any key but a declared name
// (which the walks above cannot see: a repeated key parses).
TEST(JsonSchemaTest, AdditionalPropertiesNeverRepeatADeclaredKey) {
  auto g = CompileJsonSchema(R"({"type": "object",
      "properties": {"a": {"type": "string"}, "ab": {"type": "null"}, "b/c": {"type": "boolean"}},
      "required": ["a"], "additionalProperties": {"type": "integer"}})");
  ASSERT_THAT(g, IsOk());
  for (const char* yes :
       {R"({"a": "x"})", R"({"a": "x", "abc": 1})", R"({"a": "x", "": 1})", R"({"a": "x", "b": 1})",
        R"({"a": "x", "ab": null, "aa": 2, "b/": 3})", R"({"a": "x", "a\"": 1})",
        R"({"a": "x", "A": 1, "x": 2})", R"({"a": "x", "\u00e9": 1})"}) {
    EXPECT_EQ((*g)->Matches(yes), std::string(yes).find("\\u") == std::string::npos) << yes;
  }
  for (const char* no : {R"({"a": "x", "a": 1})", R"({"a": "x", "ab": null, "ab": 1})",
                         R"({"a": "x", "b/c": true, "b/c": 1})", R"({"a": "x", "b\/c": 1})",
                         R"({"a": "x", "\u0061": 1})", R"({"a": "x", "abc": "s"})"}) {
    EXPECT_FALSE((*g)->Matches(no)) << no;
  }
}

TEST(JsonSchemaTest, UnsupportedKeywordsAreNamed) {
  EXPECT_THAT(CompileJsonSchema(R"({"type": "array", "uniqueItems": true})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("keyword 'uniqueItems' at / is not supported")));
  EXPECT_THAT(
      CompileJsonSchema(
          R"({"type": "object", "properties": {"a": {"type": "string", "contentEncoding": "x"}}})"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("keyword 'contentEncoding' at /properties/a")));
  EXPECT_THAT(CompileJsonSchema(R"({"type": "string", "format": "hostname"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("keyword 'format'")));
  // No array has at least 5 items and at most 3 (found by grammar_fuzz: the
  // grammar's {4,2} repetition did not parse).
  EXPECT_THAT(CompileJsonSchema(R"({"type": "array", "minItems": 5, "maxItems": 3})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("keyword 'maxItems' at / is below minItems")));
  EXPECT_THAT(CompileJsonSchema(R"({"type": "number", "minimum": -1e-20})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("keyword 'minimum'")));
  EXPECT_THAT(
      CompileJsonSchema(R"({"type": "number", "exclusiveMaximum": 0.12345678901234567})"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("keyword 'exclusiveMaximum'")));
  EXPECT_THAT(CompileJsonSchema(R"({"allOf": [{"type": "string"}, {"maxLength": 3}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("keyword 'allOf'")));
  EXPECT_THAT(CompileJsonSchema(R"({"$ref": "https://example.com/x.json"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("keyword '$ref'")));
  EXPECT_THAT(CompileJsonSchema(R"({"type": "object", "properties": {}, "required": ["x"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("keyword 'required'")));
  EXPECT_THAT(CompileJsonSchema(R"({"type": "string", "pattern": "(a)\\1"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("keyword 'pattern'")));
  EXPECT_THAT(CompileJsonSchema(R"({"type": "strin"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown type \"strin\"")));
  EXPECT_THAT(CompileJsonSchema(R"({"type": )"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("json_schema")));
}

TEST(JsonSchemaTest, CompiledSchemasAreCached) {
  const std::string schema = R"({"type": "object", "properties": {"cached": {"type": "string"}}})";
  auto a = CompileJsonSchema(schema);
  auto b = CompileJsonSchema(R"({"properties": {"cached": {"type": "string"}}, "type": "object"})");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  auto c = CompileJsonSchema(schema);
  EXPECT_EQ(a->get(), c->get());
}

TEST(JsonSchemaTest, JsonObjectGrammar) {
  auto g = JsonObjectGrammar();
  EXPECT_TRUE(g->Matches(R"({"a": [1, 2.5e3, "x\u00e9\n"], "b": {"c": null}})"));
  EXPECT_TRUE(g->Matches("{}"));
  EXPECT_FALSE(g->Matches("[1]"));
  EXPECT_FALSE(g->Matches(R"({"a": 01})"));
  EXPECT_FALSE(g->Matches(R"({"a": "x)"));
  EXPECT_TRUE(JsonValueGrammar()->Matches("[1, true]"));
}

}  // namespace
}  // namespace accel::grammar
