#include "grammar/json_schema.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "core/json.h"

namespace accel::grammar {
namespace {

using Json = nlohmann::ordered_json;

// The shared pieces every schema's grammar may use.
constexpr absl::string_view kPrimitives = R"(
ws ::= | " " | "\n" [ \t]{0,20}
json-char ::= [^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})
json-string ::= "\"" json-char* "\""
json-integer ::= "-"? ([0-9] | [1-9] [0-9]{1,15})
json-number ::= json-integer ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?
json-boolean ::= "true" | "false"
json-null ::= "null"
json-value ::= json-object | json-array | json-string | json-number | json-boolean | json-null
json-object ::= "{" ws ( json-member (ws "," ws json-member)* ws )? "}"
json-member ::= json-string ws ":" ws json-value
json-array ::= "[" ws ( json-value (ws "," ws json-value)* ws )? "]"
)";

const std::set<std::string>& Annotations() {
  static const auto* kSet = new std::set<std::string>{
      "$schema",  "$id",        "title",    "description", "default", "examples",
      "$comment", "deprecated", "readOnly", "writeOnly",   "$defs",   "definitions"};
  return *kSet;
}

const std::set<std::string>& Supported() {
  static const auto* kSet = new std::set<std::string>{"type",
                                                      "properties",
                                                      "required",
                                                      "additionalProperties",
                                                      "enum",
                                                      "const",
                                                      "items",
                                                      "prefixItems",
                                                      "minItems",
                                                      "maxItems",
                                                      "anyOf",
                                                      "oneOf",
                                                      "allOf",
                                                      "$ref",
                                                      "minLength",
                                                      "maxLength",
                                                      "pattern",
                                                      "format",
                                                      "minimum",
                                                      "maximum",
                                                      "exclusiveMinimum",
                                                      "exclusiveMaximum"};
  return *kSet;
}

std::string Pointer(const std::string& path) { return path.empty() ? "/" : path; }

// The decimal numbers in [lo, hi] (both >= 0, equal digit counts), digit by
// digit.
std::string SameLengthRange(const std::string& lo, const std::string& hi) {
  if (lo.empty()) return "";
  if (lo[0] == hi[0]) {
    std::string rest = SameLengthRange(lo.substr(1), hi.substr(1));
    return absl::StrCat("\"", std::string(1, lo[0]), "\"", rest.empty() ? "" : " ", rest);
  }
  const size_t n = lo.size() - 1;
  std::vector<std::string> branches;
  const std::string nines(n, '9');
  const std::string zeros(n, '0');
  char first_full = lo[0];
  if (lo.substr(1) != zeros) {
    branches.push_back(absl::StrCat("\"", std::string(1, lo[0]), "\" (",
                                    SameLengthRange(lo.substr(1), nines), ")"));
    ++first_full;
  }
  char last_full = hi[0];
  if (hi.substr(1) != nines) --last_full;
  if (first_full <= last_full) {
    std::string b =
        absl::StrCat("[", std::string(1, first_full), "-", std::string(1, last_full), "]");
    if (n > 0) absl::StrAppend(&b, " [0-9]{", n, "}");
    branches.push_back(b);
  }
  if (hi.substr(1) != nines) {
    branches.push_back(absl::StrCat("\"", std::string(1, hi[0]), "\" (",
                                    SameLengthRange(zeros, hi.substr(1)), ")"));
  }
  if (n == 0 && branches.empty()) return absl::StrCat("\"", std::string(1, lo[0]), "\"");
  return absl::StrCat("(", absl::StrJoin(branches, " | "), ")");
}

constexpr int kMaxIntegerDigits = 16;
constexpr int kMaxFractionDigits = 16;

// A non-negative decimal as its integer part and its fraction's digits
// (without trailing zeros: empty for an integer).
struct Decimal {
  uint64_t integer = 0;
  std::string fraction;
  bool operator==(const Decimal& o) const { return integer == o.integer && fraction == o.fraction; }
  bool operator<(const Decimal& o) const {
    if (integer != o.integer) return integer < o.integer;
    return fraction < o.fraction;  // digit strings without trailing zeros compare as fractions
  }
};

// `v` (>= 0, at most 1e15) as the shortest decimal that reads back as it;
// nullopt when that has more than kMaxFractionDigits fraction digits.
std::optional<Decimal> ToDecimal(double v) {
  char text[64];
  const std::to_chars_result r =
      std::to_chars(text, text + sizeof(text), v, std::chars_format::fixed);
  const std::string fixed(text, r.ptr);
  Decimal d;
  const size_t dot = fixed.find('.');
  d.integer = std::stoull(fixed.substr(0, dot));
  if (dot != std::string::npos) {
    d.fraction = fixed.substr(dot + 1);
    while (!d.fraction.empty() && d.fraction.back() == '0') d.fraction.pop_back();
  }
  if (d.fraction.size() > static_cast<size_t>(kMaxFractionDigits)) return std::nullopt;
  return d;
}

// The decimal numbers (no leading zeros) in [lo, hi], lo >= 0; no hi: up to
// kMaxIntegerDigits digits.
std::string UnsignedRange(uint64_t lo, std::optional<uint64_t> hi) {
  const std::string lo_text = std::to_string(lo);
  std::vector<std::string> branches;
  const size_t max_digits = hi ? std::to_string(*hi).size() : kMaxIntegerDigits;
  for (size_t digits = lo_text.size(); digits <= max_digits; ++digits) {
    const std::string from =
        digits == lo_text.size() ? lo_text : "1" + std::string(digits - 1, '0');
    std::string to(digits, '9');
    if (hi && digits == max_digits) to = std::to_string(*hi);
    if (from.size() == to.size() && from > to) continue;
    if (digits == 1 && from == "0" && to == "9") {
      branches.push_back("[0-9]");
      continue;
    }
    branches.push_back(SameLengthRange(from, to));
  }
  if (branches.empty()) return "";
  return absl::StrCat("(", absl::StrJoin(branches, " | "), ")");
}

class SchemaConverter {
 public:
  explicit SchemaConverter(const Json& root) : root_(root) {}

  absl::StatusOr<std::string> Convert() {
    auto expression = Visit(root_, "root-value", "");
    if (!expression.ok()) return expression.status();
    std::string out = absl::StrCat("root ::= ", *expression, "\n", kPrimitives);
    for (const auto& [name, body] : rules_) absl::StrAppend(&out, name, " ::= ", body, "\n");
    return out;
  }

 private:
  absl::Status Unsupported(const std::string& keyword, const std::string& path,
                           const std::string& why = "is not supported") {
    return absl::InvalidArgumentError(
        absl::StrCat("json_schema: keyword '", keyword, "' at ", Pointer(path), " ", why));
  }

  std::string RuleName(const std::string& hint) {
    std::string name;
    for (char c : hint) {
      name.push_back(std::isalnum(static_cast<unsigned char>(c)) ? c : '-');
    }
    if (name.empty()) name = "r";
    std::string unique = absl::StrCat("s-", name);
    for (int i = 1; rules_.count(unique) || reserved_.count(unique); ++i) {
      unique = absl::StrCat("s-", name, "-", i);
    }
    reserved_.insert(unique);
    return unique;
  }

  std::string AddRule(const std::string& hint, const std::string& body) {
    auto it = by_body_.find(body);
    if (it != by_body_.end()) return it->second;
    const std::string name = RuleName(hint);
    rules_[name] = body;
    by_body_[body] = name;
    return name;
  }

  absl::StatusOr<std::string> Visit(const Json& schema, const std::string& hint,
                                    const std::string& path) {
    if (++depth_ > 128) return absl::InvalidArgumentError("json_schema: nested too deeply");
    auto result = VisitInner(schema, hint, path);
    --depth_;
    return result;
  }

  absl::StatusOr<std::string> VisitInner(const Json& schema, const std::string& hint,
                                         const std::string& path) {
    if (schema.is_boolean()) {
      if (schema.get<bool>()) return std::string("json-value");
      return absl::InvalidArgumentError(absl::StrCat("json_schema: the schema at ", Pointer(path),
                                                     " is false (matches nothing)"));
    }
    if (!schema.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("json_schema: the schema at ", Pointer(path), " is not an object"));
    }
    for (const auto& [key, value] : schema.items()) {
      if (!Annotations().count(key) && !Supported().count(key)) return Unsupported(key, path);
    }
    if (schema.contains("$ref")) return Ref(schema, path);
    for (const char* combiner : {"anyOf", "oneOf", "allOf"}) {
      if (!schema.contains(combiner)) continue;
      for (const auto& [key, value] : schema.items()) {
        if (key != combiner && !Annotations().count(key)) {
          return Unsupported(key, path, absl::StrCat("beside ", combiner, " is not supported"));
        }
      }
      const Json& list = schema[combiner];
      const std::string here = absl::StrCat(path, "/", combiner);
      if (!list.is_array() || list.empty()) {
        return Unsupported(combiner, path, "must be a non-empty array");
      }
      if (std::string(combiner) == "allOf" && list.size() != 1) {
        return Unsupported(combiner, path, "with more than one schema is not supported");
      }
      std::vector<std::string> branches;
      for (size_t i = 0; i < list.size(); ++i) {
        auto branch = Visit(list[i], hint, absl::StrCat(here, "/", i));
        if (!branch.ok()) return branch.status();
        branches.push_back(*branch);
      }
      return absl::StrCat("(", absl::StrJoin(branches, " | "), ")");
    }
    if (schema.contains("const")) return GbnfLiteral(schema["const"].dump());
    if (schema.contains("enum")) {
      const Json& values = schema["enum"];
      if (!values.is_array() || values.empty()) {
        return Unsupported("enum", path, "must be a non-empty array");
      }
      std::vector<std::string> branches;
      for (const auto& v : values) branches.push_back(GbnfLiteral(v.dump()));
      return absl::StrCat("(", absl::StrJoin(branches, " | "), ")");
    }
    std::vector<std::string> types;
    if (schema.contains("type")) {
      const Json& type = schema["type"];
      if (type.is_string()) {
        types.push_back(type.get<std::string>());
      } else if (type.is_array() && !type.empty()) {
        for (const auto& t : type) {
          if (!t.is_string()) return Unsupported("type", path, "must name types");
          types.push_back(t.get<std::string>());
        }
      } else {
        return Unsupported("type", path, "must be a string or a list of strings");
      }
    } else if (schema.contains("properties") || schema.contains("additionalProperties")) {
      types.push_back("object");
    } else if (schema.contains("items") || schema.contains("prefixItems")) {
      types.push_back("array");
    } else if (schema.contains("pattern") || schema.contains("format") ||
               schema.contains("minLength") || schema.contains("maxLength")) {
      types.push_back("string");
    } else if (schema.contains("minimum") || schema.contains("maximum")) {
      types.push_back("number");
    } else {
      return std::string("json-value");
    }
    std::vector<std::string> branches;
    for (const std::string& type : types) {
      absl::StatusOr<std::string> branch;
      if (type == "object") {
        branch = Object(schema, hint, path);
      } else if (type == "array") {
        branch = Array(schema, hint, path);
      } else if (type == "string") {
        branch = String(schema, hint, path);
      } else if (type == "integer" || type == "number") {
        branch = Number(schema, type == "integer", path);
      } else if (type == "boolean") {
        branch = std::string("json-boolean");
      } else if (type == "null") {
        branch = std::string("json-null");
      } else {
        return Unsupported("type", path, absl::StrCat("has an unknown type \"", type, "\""));
      }
      if (!branch.ok()) return branch.status();
      branches.push_back(*branch);
    }
    if (branches.size() == 1) return branches.front();
    return absl::StrCat("(", absl::StrJoin(branches, " | "), ")");
  }

  absl::StatusOr<std::string> Ref(const Json& schema, const std::string& path) {
    const Json& ref = schema["$ref"];
    if (!ref.is_string()) return Unsupported("$ref", path, "must be a string");
    const std::string target = ref.get<std::string>();
    auto it = refs_.find(target);
    if (it != refs_.end()) return it->second;
    if (target.empty() || target[0] != '#') {
      return Unsupported(
          "$ref", path,
          absl::StrCat("to \"", target, "\": only local references (#...) are supported"));
    }
    const Json* node = &root_;
    std::string hint = "ref";
    if (target.size() > 1) {
      if (target[1] != '/') {
        return Unsupported("$ref", path, absl::StrCat("to \"", target, "\" is not a JSON pointer"));
      }
      for (absl::string_view piece : absl::StrSplit(target.substr(2), '/')) {
        std::string key(piece);
        for (size_t p; (p = key.find("~1")) != std::string::npos;) key.replace(p, 2, "/");
        for (size_t p; (p = key.find("~0")) != std::string::npos;) key.replace(p, 2, "~");
        if (!node->is_object() || !node->contains(key)) {
          return Unsupported("$ref", path, absl::StrCat("to \"", target, "\" points nowhere"));
        }
        node = &(*node)[key];
        hint = key;
      }
    }
    const std::string name = RuleName(hint);
    refs_[target] = name;
    auto body = Visit(*node, hint, target.substr(1));
    if (!body.ok()) return body.status();
    rules_[name] = *body;
    return name;
  }

  absl::StatusOr<std::string> Object(const Json& schema, const std::string& hint,
                                     const std::string& path) {
    std::set<std::string> required;
    if (schema.contains("required")) {
      const Json& r = schema["required"];
      if (!r.is_array()) return Unsupported("required", path, "must be an array");
      for (const auto& name : r) {
        if (!name.is_string()) return Unsupported("required", path, "must list strings");
        required.insert(name.get<std::string>());
      }
    }
    std::vector<std::pair<std::string, std::string>> members;  // (member expression, name)
    std::vector<bool> is_required;
    if (schema.contains("properties")) {
      const Json& properties = schema["properties"];
      if (!properties.is_object()) return Unsupported("properties", path, "must be an object");
      for (const auto& [name, sub] : properties.items()) {
        auto value = Visit(sub, name, absl::StrCat(path, "/properties/", name));
        if (!value.ok()) return value.status();
        const std::string member =
            AddRule(absl::StrCat(hint, "-", name, "-kv"),
                    absl::StrCat(GbnfLiteral(Json(name).dump()), " ws \":\" ws ", *value));
        members.emplace_back(member, name);
        is_required.push_back(required.count(name) > 0);
      }
    }
    for (const std::string& name : required) {
      bool found = false;
      for (const auto& m : members) found = found || m.second == name;
      if (!found) {
        return Unsupported("required", path,
                           absl::StrCat("names \"", name, "\", which is not in properties"));
      }
    }
    std::optional<std::string> extra;  // the member rule of additional properties
    if (schema.contains("additionalProperties")) {
      const Json& additional = schema["additionalProperties"];
      if (!(additional.is_boolean() && !additional.get<bool>())) {
        std::string value = "json-value";
        if (!additional.is_boolean()) {
          auto v = Visit(additional, absl::StrCat(hint, "-additional"),
                         absl::StrCat(path, "/additionalProperties"));
          if (!v.ok()) return v.status();
          value = *v;
        }
        std::vector<std::string> declared;
        for (const auto& m : members) declared.push_back(m.second);
        extra = AddRule(absl::StrCat(hint, "-additional-kv"),
                        absl::StrCat(UndeclaredKey(declared), " ws \":\" ws ", value));
      }
    } else if (!schema.contains("properties")) {
      extra = std::string("json-member");
    }
    // after[i]: the members from i on when one was already written (each
    // preceded by a comma); first[i]: the same when none was.
    const size_t n = members.size();
    std::string after_tail = extra ? absl::StrCat("(ws \",\" ws ", *extra, ")*") : "";
    std::string first_tail = extra ? absl::StrCat("(", *extra, " ", after_tail, ")?") : "";
    std::vector<std::string> after(n + 1), first(n + 1);
    after[n] = after_tail;
    first[n] = first_tail;
    for (size_t k = n; k-- > 0;) {
      const std::string& m = members[k].first;
      const std::string rest_after =
          after[k + 1].empty() ? "" : AddRule(absl::StrCat(hint, "-after"), after[k + 1]);
      const std::string with =
          absl::StrCat("ws \",\" ws ", m, rest_after.empty() ? "" : " ", rest_after);
      after[k] = is_required[k] ? with
                                : absl::StrCat("(ws \",\" ws ", m, ")?",
                                               rest_after.empty() ? "" : " ", rest_after);
      const std::string starts = absl::StrCat(m, rest_after.empty() ? "" : " ", rest_after);
      if (is_required[k]) {
        first[k] = starts;
      } else {
        const std::string rest_first =
            first[k + 1].empty() ? "" : AddRule(absl::StrCat(hint, "-first"), first[k + 1]);
        first[k] = absl::StrCat("(", starts, rest_first.empty() ? " | " : " | ", rest_first, ")");
      }
    }
    const std::string body =
        first[0].empty() ? "\"{\" ws \"}\"" : absl::StrCat("\"{\" ws ", first[0], " ws \"}\"");
    return AddRule(hint, body);
  }

  // The key of an additional property: a JSON string that is none of the
  // declared names. The names' trie becomes one rule per node: end here
  // (unless a name does), go on with a byte that leaves every name (then
  // any characters), or follow a child. The key may use JSON's one-letter
  // escapes but not the solidus or \u ones, so its text is its value's one
  // spelling and a declared name cannot come back escaped. Names with
  // other bytes than printable ASCII (no quote or backslash) keep a plain
  // json-string key, which may repeat them (a documented gap).
  std::string UndeclaredKey(const std::vector<std::string>& names) {
    if (names.empty()) return "json-string";
    for (const std::string& name : names) {
      for (unsigned char c : name) {
        if (c < 0x20 || c > 0x7E || c == '"' || c == '\\') return "json-string";
      }
    }
    if (!rules_.count("s-key-char")) {
      rules_["s-key-char"] = R"([^"\\\x00-\x1F] | "\\" ["\\bfnrt])";
      reserved_.insert("s-key-char");
    }
    const std::set<std::string> set(names.begin(), names.end());
    std::function<std::string(const std::string&)> node = [&](const std::string& prefix) {
      std::set<unsigned char> children;
      for (const std::string& name : set) {
        if (name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0) {
          children.insert(static_cast<unsigned char>(name[prefix.size()]));
        }
      }
      std::vector<std::string> alternatives;
      if (!set.count(prefix)) alternatives.emplace_back();  // the key ends here
      std::string other = R"([^"\\\x00-\x1F)";
      for (unsigned char c : children) absl::StrAppend(&other, absl::StrFormat("\\x%02X", c));
      alternatives.push_back(absl::StrCat("(", other, R"(] | "\\" ["\\bfnrt]) s-key-char*)"));
      for (unsigned char c : children) {
        alternatives.push_back(
            absl::StrCat(absl::StrFormat("[\\x%02X] ", c), node(prefix + static_cast<char>(c))));
      }
      return AddRule("key", absl::StrJoin(alternatives, " | "));
    };
    return absl::StrCat("\"\\\"\" ", node(""), " \"\\\"\"");
  }

  // A count keyword (minItems, maxLength...): absent, or an integer a
  // grammar's repetition can hold.
  absl::StatusOr<std::optional<int64_t>> RepetitionBound(const Json& schema, const char* key,
                                                         const std::string& path) {
    if (!schema.contains(key)) return std::optional<int64_t>();
    const Json& v = schema[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxRepetition) {
      return Unsupported(key, path,
                         absl::StrCat("must be an integer in [0, ", kMaxRepetition, "]"));
    }
    return std::optional<int64_t>(v.get<int64_t>());
  }

  absl::StatusOr<std::string> Array(const Json& schema, const std::string& hint,
                                    const std::string& path) {
    auto min_items = RepetitionBound(schema, "minItems", path);
    if (!min_items.ok()) return min_items.status();
    auto max_items = RepetitionBound(schema, "maxItems", path);
    if (!max_items.ok()) return max_items.status();
    if (*min_items && *max_items && **max_items < **min_items) {
      return Unsupported("maxItems", path, "is below minItems");
    }
    std::vector<std::string> prefix;
    if (schema.contains("prefixItems")) {
      const Json& list = schema["prefixItems"];
      if (!list.is_array()) return Unsupported("prefixItems", path, "must be an array");
      for (size_t i = 0; i < list.size(); ++i) {
        auto item =
            Visit(list[i], absl::StrCat(hint, "-", i), absl::StrCat(path, "/prefixItems/", i));
        if (!item.ok()) return item.status();
        prefix.push_back(*item);
      }
    }
    std::optional<std::string> item;
    if (schema.contains("items")) {
      const Json& items = schema["items"];
      if (!(items.is_boolean() && !items.get<bool>())) {
        auto v = Visit(items, absl::StrCat(hint, "-item"), absl::StrCat(path, "/items"));
        if (!v.ok()) return v.status();
        item = *v;
      }
    } else if (prefix.empty()) {
      item = "json-value";
    }
    const int64_t k = static_cast<int64_t>(prefix.size());
    const int64_t lo = std::max<int64_t>(0, min_items->value_or(0) - k);
    std::optional<int64_t> hi;
    if (*max_items) hi = std::max<int64_t>(0, **max_items - k);
    if (*max_items && **max_items < k) {
      return Unsupported("maxItems", path, "is below the number of prefixItems");
    }
    if (!item && lo > 0)
      return Unsupported("minItems", path, "needs more items than prefixItems allows");
    std::string body = "\"[\" ws";
    for (int64_t i = 0; i < k; ++i) {
      absl::StrAppend(&body, i ? " ws \",\" ws " : " ", prefix[i]);
    }
    if (item && !(hi && *hi == 0)) {
      const std::string next = absl::StrCat("ws \",\" ws ", *item);
      auto bounds = [](int64_t a, std::optional<int64_t> b) {
        return b ? absl::StrCat("{", a, ",", *b, "}") : absl::StrCat("{", a, ",}");
      };
      if (k > 0) {
        absl::StrAppend(&body, " (", next, ")", bounds(lo, hi));
      } else if (lo > 0) {
        absl::StrAppend(&body, " ", *item, " (", next, ")",
                        bounds(lo - 1, hi ? std::optional<int64_t>(*hi - 1) : std::nullopt));
      } else {
        absl::StrAppend(&body, " (", *item, " (", next, ")",
                        bounds(0, hi ? std::optional<int64_t>(*hi - 1) : std::nullopt), ")?");
      }
    }
    absl::StrAppend(&body, " ws \"]\"");
    return AddRule(hint, body);
  }

  absl::StatusOr<std::string> String(const Json& schema, const std::string& hint,
                                     const std::string& path) {
    const bool has_length = schema.contains("minLength") || schema.contains("maxLength");
    if (schema.contains("pattern")) {
      if (has_length) {
        return Unsupported(schema.contains("minLength") ? "minLength" : "maxLength", path,
                           "beside pattern is not supported");
      }
      if (schema.contains("format"))
        return Unsupported("format", path, "beside pattern is not supported");
      const Json& p = schema["pattern"];
      if (!p.is_string()) return Unsupported("pattern", path, "must be a string");
      std::string pattern = p.get<std::string>();
      // JSON Schema patterns search: the ends the pattern leaves unanchored
      // may hold anything.
      const bool starts = !pattern.empty() && pattern.front() == '^';
      const bool ends = pattern.size() > (starts ? 1u : 0u) && pattern.back() == '$' &&
                        (pattern.size() < 2 || pattern[pattern.size() - 2] != '\\');
      const std::string core =
          pattern.substr(starts ? 1 : 0, pattern.size() - (starts ? 1 : 0) - (ends ? 1 : 0));
      const std::string anchored =
          absl::StrCat(starts ? "" : ".*", "(?:", core, ")", ends ? "" : ".*");
      auto body = RegexToGbnf(anchored, /*json_string=*/true);
      if (!body.ok()) {
        return Unsupported("pattern", path,
                           absl::StrCat("cannot be used: ", body.status().message()));
      }
      return AddRule(absl::StrCat(hint, "-pattern"), absl::StrCat("\"\\\"\" ", *body, " \"\\\"\""));
    }
    if (schema.contains("format")) {
      if (has_length)
        return Unsupported("format", path, "beside minLength / maxLength is not supported");
      const Json& f = schema["format"];
      if (!f.is_string()) return Unsupported("format", path, "must be a string");
      const std::string format = f.get<std::string>();
      static const std::map<std::string, std::string> kFormats = {
          {"date",
           R"([0-9]{4} "-" ("0" [1-9] | "1" [0-2]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]))"},
          {"time",
           R"(([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{1,9})? ("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9]))"},
          {"uuid",
           R"([0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12})"},
          {"email",
           R"([a-zA-Z0-9_+-] [a-zA-Z0-9._+-]{0,63} "@" [a-zA-Z0-9-]{1,63} ("." [a-zA-Z0-9-]{1,63}){0,4} "." [a-zA-Z]{2,24})"},
          {"ipv4", R"(s-octet "." s-octet "." s-octet "." s-octet)"},
      };
      std::string body;
      if (format == "date-time") {
        body = absl::StrCat(kFormats.at("date"), " \"T\" ", kFormats.at("time"));
      } else if (auto it = kFormats.find(format); it != kFormats.end()) {
        body = it->second;
        if (format == "ipv4") {
          rules_["s-octet"] =
              "\"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9] [0-9] | [0-9]";
          reserved_.insert("s-octet");
        }
      } else {
        return Unsupported(
            "format", path,
            absl::StrCat("\"", format,
                         "\" is not supported (date, time, date-time, uuid, email, ipv4 are)"));
      }
      return AddRule(absl::StrCat(hint, "-", format), absl::StrCat("\"\\\"\" ", body, " \"\\\"\""));
    }
    if (has_length) {
      auto lo = RepetitionBound(schema, "minLength", path);
      if (!lo.ok()) return lo.status();
      auto hi = RepetitionBound(schema, "maxLength", path);
      if (!hi.ok()) return hi.status();
      if (*hi && **hi < lo->value_or(0))
        return Unsupported("maxLength", path, "is below minLength");
      const std::string bounds = *hi ? absl::StrCat("{", lo->value_or(0), ",", **hi, "}")
                                     : absl::StrCat("{", lo->value_or(0), ",}");
      return AddRule(absl::StrCat(hint, "-string"),
                     absl::StrCat("\"\\\"\" json-char", bounds, " \"\\\"\""));
    }
    return std::string("json-string");
  }

  absl::StatusOr<std::string> Number(const Json& schema, bool integer, const std::string& path) {
    std::optional<double> lo;
    std::optional<double> hi;
    bool lo_exclusive = false;
    bool hi_exclusive = false;
    for (const char* key : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) {
      if (!schema.contains(key)) continue;
      const Json& v = schema[key];
      if (!v.is_number()) return Unsupported(key, path, "must be a number");
      const double d = v.get<double>();
      if (!std::isfinite(d) || std::fabs(d) > 1e15)
        return Unsupported(key, path, "is out of range");
      const std::string k = key;
      if (k == "minimum" || k == "exclusiveMinimum") {
        if (!lo || d >= *lo) {
          lo = d;
          lo_exclusive = k == "exclusiveMinimum";
        }
      } else if (!hi || d <= *hi) {
        hi = d;
        hi_exclusive = k == "exclusiveMaximum";
      }
    }
    if (!lo && !hi) return std::string(integer ? "json-integer" : "json-number");
    if (integer) {
      std::optional<int64_t> a;
      std::optional<int64_t> b;
      if (lo) a = static_cast<int64_t>(lo_exclusive ? std::floor(*lo) + 1 : std::ceil(*lo));
      if (hi) b = static_cast<int64_t>(hi_exclusive ? std::ceil(*hi) - 1 : std::floor(*hi));
      if (a && b && *a > *b)
        return Unsupported("maximum", path, "leaves no integer above the minimum");
      return AddRule("integer-range", IntegerRange(a, b));
    }
    // number: v >= 0 by its own bounds (clipped at 0), and v < 0 as "-" and
    // its magnitude m = -v, bounded by -hi below (m > 0 when hi >= 0:
    // "-0" is left out) and by -lo above.
    std::optional<Decimal> a;
    std::optional<Decimal> b;
    if (lo) a = ToDecimal(std::fabs(*lo));
    if (hi) b = ToDecimal(std::fabs(*hi));
    if ((lo && !a) || (hi && !b)) {
      const bool at_lo = lo && !a;
      return Unsupported(at_lo ? (lo_exclusive ? "exclusiveMinimum" : "minimum")
                               : (hi_exclusive ? "exclusiveMaximum" : "maximum"),
                         path,
                         absl::StrCat("has more than ", kMaxFractionDigits, " fraction digits"));
    }
    std::vector<std::string> branches;
    if (!hi || *hi > 0 || (*hi == 0 && !hi_exclusive)) {
      const bool clipped = !lo || *lo < 0;
      std::string part =
          NonNegativeNumber(clipped ? Decimal() : *a, !clipped && lo_exclusive, b, hi_exclusive);
      if (!part.empty()) branches.push_back(part);
    }
    if (!lo || *lo < 0) {
      const bool below_zero = hi && *hi < 0;
      std::string part = NonNegativeNumber(below_zero ? *b : Decimal(),
                                           below_zero ? hi_exclusive : true, a, lo_exclusive);
      if (!part.empty()) branches.push_back(absl::StrCat("\"-\" (", part, ")"));
    }
    if (branches.empty()) {
      return Unsupported(hi_exclusive ? "exclusiveMaximum" : "maximum", path,
                         "leaves no number above the minimum");
    }
    return AddRule("number-range", absl::StrJoin(branches, " | "));
  }

  // A bound of a fraction's digits: the fractions 0.S with S >= digits (a
  // lower bound) or S <= digits (an upper one), strictly when `strict`.
  struct FractionBound {
    std::string digits;  // no trailing zeros; empty: 0
    bool strict = false;
  };

  // The digit strings S (1 to about 16 digits) of fractions 0.S within the
  // bounds (none: no bound), as grammar branches, and whether no fraction at
  // all (0) is within them. Digit by digit: a first digit strictly between
  // the bounds' first digits takes any tail; one equal to a bound's first
  // digit takes the tail that keeps within that bound's rest.
  struct Fractions {
    std::vector<std::string> branches;
    bool zero_ok = false;
  };
  static Fractions FractionsWithin(std::optional<FractionBound> lower,
                                   std::optional<FractionBound> upper) {
    // A lower bound of 0, inclusive, bounds nothing.
    if (lower && lower->digits.empty() && !lower->strict) lower.reset();
    const std::string tail = "[0-9]{0,15}";
    if (!lower && !upper) return {{"[0-9]{1,16}"}, true};
    if (upper && upper->digits.empty()) {
      // S <= 0: zeros only, when nothing above 0 is required.
      if (upper->strict || lower) return {};
      return {{"\"0\"{1,16}"}, true};
    }
    if (lower && lower->digits.empty() && !upper) {
      return {{"\"0\"{0,15} [1-9] [0-9]{0,15}"}, false};  // S > 0
    }
    Fractions out;
    out.zero_ok = !lower;  // the upper bound, not empty here, is above 0
    const char first = lower && !lower->digits.empty() ? lower->digits[0] : '0';
    const char last = upper ? upper->digits[0] : '9';
    auto rest = [](const std::optional<FractionBound>& b) -> std::optional<FractionBound> {
      if (!b) return std::nullopt;
      return FractionBound{b->digits.empty() ? "" : b->digits.substr(1), b->strict};
    };
    // Digits strictly inside: any tail.
    const char inside_from = lower ? static_cast<char>(first + 1) : first;
    const char inside_to = upper ? static_cast<char>(last - 1) : last;
    if (inside_from <= inside_to) {
      out.branches.push_back(absl::StrCat(
          inside_from == inside_to
              ? absl::StrCat("\"", std::string(1, inside_from), "\"")
              : absl::StrCat("[", std::string(1, inside_from), "-", std::string(1, inside_to), "]"),
          " ", tail));
    }
    // The bounds' own first digits: the tail that keeps within the bound's
    // rest (both bounds' when they share the digit).
    auto bounded = [&](char digit, bool at_lower, bool at_upper) {
      const Fractions after = FractionsWithin(at_lower ? rest(lower) : std::nullopt,
                                              at_upper ? rest(upper) : std::nullopt);
      const std::string head = absl::StrCat("\"", std::string(1, digit), "\"");
      if (!after.branches.empty()) {
        out.branches.push_back(absl::StrCat(head, " (", absl::StrJoin(after.branches, " | "), ")",
                                            after.zero_ok ? "?" : ""));
      } else if (after.zero_ok) {
        out.branches.push_back(head);
      }
    };
    if (lower && upper && first == last) {
      bounded(first, true, true);
    } else {
      if (lower) bounded(first, true, false);
      if (upper) bounded(last, false, true);
    }
    return out;
  }

  // The decimals (no exponent) v >= 0 with v >= lo (v > lo when
  // `lo_exclusive`) and v <= hi (v < hi): by the integer part (strictly
  // between the bounds' integer parts: any fraction; equal to one: the
  // fractions within that bound). Empty when none is.
  static std::string NonNegativeNumber(const Decimal& lo, bool lo_exclusive,
                                       const std::optional<Decimal>& hi, bool hi_exclusive) {
    if (hi && (*hi < lo || (*hi == lo && (lo_exclusive || hi_exclusive)))) return "";
    auto with_fraction = [](const std::string& integer, const Fractions& f) -> std::string {
      if (f.branches.empty()) return f.zero_ok ? integer : "";
      return absl::StrCat(integer, " (\".\" (", absl::StrJoin(f.branches, " | "), "))",
                          f.zero_ok ? "?" : "");
    };
    const std::optional<FractionBound> lower = FractionBound{lo.fraction, lo_exclusive};
    std::optional<FractionBound> upper;
    if (hi) upper = FractionBound{hi->fraction, hi_exclusive};
    std::vector<std::string> branches;
    const std::string lo_text = absl::StrCat("\"", lo.integer, "\"");
    if (hi && hi->integer == lo.integer) {
      branches.push_back(with_fraction(lo_text, FractionsWithin(lower, upper)));
    } else {
      branches.push_back(with_fraction(lo_text, FractionsWithin(lower, std::nullopt)));
      std::optional<uint64_t> last;
      if (hi) last = hi->integer - 1;
      if (!last || lo.integer + 1 <= *last) {
        branches.push_back(with_fraction(UnsignedRange(lo.integer + 1, last),
                                         FractionsWithin(std::nullopt, std::nullopt)));
      }
      if (hi) {
        branches.push_back(with_fraction(absl::StrCat("\"", hi->integer, "\""),
                                         FractionsWithin(std::nullopt, upper)));
      }
    }
    branches.erase(std::remove(branches.begin(), branches.end(), ""), branches.end());
    return absl::StrJoin(branches, " | ");
  }

  static std::string IntegerRange(std::optional<int64_t> lo, std::optional<int64_t> hi) {
    std::vector<std::string> branches;
    // Negative part: -x with x in [max(1, -hi), -lo].
    if (!lo || *lo < 0) {
      const uint64_t x_lo = hi && *hi < 0 ? static_cast<uint64_t>(-*hi) : 1;
      std::optional<uint64_t> x_hi;
      if (lo) x_hi = static_cast<uint64_t>(-*lo);
      branches.push_back(absl::StrCat("\"-\" ", UnsignedRange(x_lo, x_hi)));
    }
    if (!hi || *hi >= 0) {
      const uint64_t from = lo && *lo > 0 ? static_cast<uint64_t>(*lo) : 0;
      std::optional<uint64_t> to;
      if (hi) to = static_cast<uint64_t>(*hi);
      branches.push_back(UnsignedRange(from, to));
    }
    return absl::StrJoin(branches, " | ");
  }

  const Json& root_;
  std::map<std::string, std::string> rules_;
  std::map<std::string, std::string> by_body_;
  std::set<std::string> reserved_;
  std::map<std::string, std::string> refs_;
  int depth_ = 0;
};

class SchemaCache {
 public:
  std::shared_ptr<const Grammar> Find(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second.second);
    return it->second.first;
  }
  void Insert(const std::string& key, std::shared_ptr<const Grammar> grammar) {
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.count(key)) return;
    order_.push_front(key);
    entries_.emplace(key, std::make_pair(std::move(grammar), order_.begin()));
    while (entries_.size() > kCapacity) {
      entries_.erase(order_.back());
      order_.pop_back();
    }
  }

 private:
  static constexpr size_t kCapacity = 512;
  std::mutex mu_;
  std::list<std::string> order_;
  std::map<std::string, std::pair<std::shared_ptr<const Grammar>, std::list<std::string>::iterator>>
      entries_;
};

SchemaCache& Cache() {
  static auto* cache = new SchemaCache;
  return *cache;
}

std::shared_ptr<const Grammar> FixedGrammar(absl::string_view root) {
  auto grammar = ParseGbnf(absl::StrCat("root ::= ", root, "\n", kPrimitives), "json");
  return *std::move(grammar);  // fixed text, parsed by the tests
}

}  // namespace

absl::StatusOr<std::string> JsonSchemaToGbnf(absl::string_view schema_json) {
  JsonLimits limits;
  limits.max_depth = 128;
  limits.max_keys = 100000;
  auto schema = ParseOrderedJson(schema_json, "json_schema", limits);
  if (!schema.ok()) return schema.status();
  return SchemaConverter(*schema).Convert();
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(absl::string_view schema_json) {
  JsonLimits limits;
  limits.max_depth = 128;
  limits.max_keys = 100000;
  auto schema = ParseOrderedJson(schema_json, "json_schema", limits);
  if (!schema.ok()) return schema.status();
  const std::string key = schema->dump();
  if (auto cached = Cache().Find(key)) return cached;
  auto gbnf = SchemaConverter(*schema).Convert();
  if (!gbnf.ok()) return gbnf.status();
  auto grammar = ParseGbnf(*gbnf, "json_schema");
  if (!grammar.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("json_schema: the schema's grammar is refused: ", grammar.status().message()));
  }
  Cache().Insert(key, *grammar);
  return *grammar;
}

std::shared_ptr<const Grammar> JsonObjectGrammar() {
  static const auto* grammar = new std::shared_ptr<const Grammar>(FixedGrammar("json-object"));
  return *grammar;
}

std::shared_ptr<const Grammar> JsonValueGrammar() {
  static const auto* grammar = new std::shared_ptr<const Grammar>(FixedGrammar("json-value"));
  return *grammar;
}

}  // namespace accel::grammar
