// Filters, tests, global functions and string/dict methods, as
// @huggingface/jinja's runtime dispatches them (by the operand's type).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "core/status.h"
#include "jinja/internal/evaluator.h"
#include "jinja/internal/lexer.h"
#include "jinja/internal/parser.h"

namespace accel::jinja::internal {
namespace {

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

const Value* Keyword(const std::vector<std::pair<std::string, Value>>& keyword,
                     absl::string_view name) {
  for (const auto& [key, value] : keyword) {
    if (key == name) return &value;
  }
  return nullptr;
}

// args.at(k) ?? kwargs.get(name) ?? fallback
Value Arg(const std::vector<Value>& positional, size_t k,
          const std::vector<std::pair<std::string, Value>>& keyword, absl::string_view name,
          Value fallback) {
  if (k < positional.size()) return positional[k];
  if (const Value* v = Keyword(keyword, name)) return *v;
  return fallback;
}

// /\b\w/g -> upper case: ASCII word characters after a non-word character.
std::string TitleCase(absl::string_view s) {
  std::string out(s);
  const auto word = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  };
  for (size_t k = 0; k < out.size(); ++k) {
    if (word(out[k]) && (k == 0 || !word(out[k - 1])) && out[k] >= 'a' && out[k] <= 'z') {
      out[k] = static_cast<char>(out[k] - 'a' + 'A');
    }
  }
  return out;
}

// parseInt(s, 10): leading whitespace, a sign, digits; nullopt for NaN.
std::optional<double> ParseInt(absl::string_view s) {
  s = JsTrimStart(s);
  size_t k = 0;
  bool negative = false;
  if (k < s.size() && (s[k] == '+' || s[k] == '-')) negative = s[k++] == '-';
  double value = 0;
  const size_t digits = k;
  while (k < s.size() && s[k] >= '0' && s[k] <= '9') value = value * 10 + (s[k++] - '0');
  if (k == digits) return std::nullopt;
  return negative ? -value : value;
}

// parseFloat(s): the longest decimal prefix after whitespace; nullopt for NaN.
std::optional<double> ParseFloat(absl::string_view s) {
  s = JsTrimStart(s);
  size_t k = 0;
  if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
  if (s.substr(k, 8) == "Infinity")
    return s[0] == '-' ? -std::numeric_limits<double>::infinity()
                       : std::numeric_limits<double>::infinity();
  const size_t mantissa = k;
  while (k < s.size() && s[k] >= '0' && s[k] <= '9') ++k;
  size_t int_digits = k - mantissa;
  size_t frac_digits = 0;
  if (k < s.size() && s[k] == '.') {
    size_t j = k + 1;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
    frac_digits = j - k - 1;
    if (int_digits + frac_digits > 0) k = j;
  }
  if (int_digits + frac_digits == 0) return std::nullopt;
  if (k < s.size() && (s[k] == 'e' || s[k] == 'E')) {
    size_t j = k + 1;
    if (j < s.size() && (s[j] == '+' || s[j] == '-')) ++j;
    const size_t exp_digits = j;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
    if (j > exp_digits) k = j;
  }
  return std::strtod(std::string(s.substr(0, k)).c_str(), nullptr);
}

absl::StatusOr<Value> IntValue(double d) {
  if (!(std::fabs(d) < 9.2e18)) return Invalid("integer out of range");
  return Value::Int(static_cast<int64_t>(d));
}

// String(x.value) for |join: null and undefined are empty.
absl::StatusOr<std::string> JoinPart(const Value& v) {
  if (v.is_none() || v.is_undefined()) return std::string();
  return RawString(v);
}

// JavaScript's String.prototype.replace with a global pattern and a budget.
std::string Replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count) {
  if (count == 0) return s;
  int64_t remaining = count < 0 ? -1 : count;
  std::string out;
  if (from.empty()) {
    const std::vector<std::string> chars = CodePoints(s);
    for (const std::string& c : chars) {
      if (remaining != 0) {
        out += to;
        if (remaining > 0) --remaining;
      }
      out += c;
    }
    if (remaining != 0) out += to;
    return out;
  }
  size_t pos = 0;
  while (true) {
    const size_t found = remaining == 0 ? std::string::npos : s.find(from, pos);
    if (found == std::string::npos) break;
    out.append(s, pos, found - pos);
    out += to;
    pos = found + from.size();
    if (remaining > 0) --remaining;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// @huggingface/jinja's getAttributeValue: "a.b.0" through dicts, namespaces and lists.
Value AttributePath(const Value& item, absl::string_view path) {
  Value value = item;
  for (absl::string_view part : absl::StrSplit(path, '.')) {
    if (value.is_object() || value.is_namespace()) {
      const Value* v = value.object().Find(part);
      value = v == nullptr ? Value() : *v;
    } else if (value.is_array()) {
      const std::optional<double> index = ParseInt(part);
      const auto size = static_cast<double>(value.array().items.size());
      if (!index || *index < 0 || *index >= size) return Value();
      value = value.array().items[static_cast<size_t>(*index)];
    } else {
      return Value();
    }
  }
  return value;
}

}  // namespace

bool Evaluator::IsStringMethod(absl::string_view name) {
  static const auto* const kNames = new absl::flat_hash_set<std::string>{
      "upper",  "lower",      "strip",    "title", "capitalize", "rstrip",
      "lstrip", "startswith", "endswith", "split", "replace"};
  return kNames->contains(name);
}

bool Evaluator::IsDictMethod(absl::string_view name) {
  return name == "get" || name == "items" || name == "keys" || name == "values" ||
         name == "dictsort";
}

absl::StatusOr<bool> Evaluator::ApplyTest(const std::string& test, const Value& v,
                                          const Value* arg) {
  if (!IsKnownTest(test)) {
    return Invalid(absl::StrCat("test '", test, "' is not supported (as in @huggingface/jinja)"));
  }
  if (test == "boolean") return v.is_bool();
  if (test == "callable") return v.is_function();
  if (test == "odd" || test == "even") {
    if (!v.is_int())
      return Invalid(absl::StrCat("cannot test a ", TypeName(v), " for '", test, "'"));
    return (v.i() % 2 != 0) == (test == "odd");
  }
  if (test == "false") return v.is_bool() && !v.b();
  if (test == "true") return v.is_bool() && v.b();
  if (test == "none") return v.is_none();
  if (test == "string") return v.is_string();
  if (test == "number") return v.is_number();
  if (test == "integer") return v.is_int();
  if (test == "iterable") return (v.is_array() && !v.is_tuple()) || v.is_string();
  if (test == "mapping") return v.is_object();
  if (test == "sequence") return v.is_array() || v.is_object() || v.is_string();
  if (test == "lower") return v.is_string() && v.s() == AsciiLower(v.s());
  if (test == "upper") return v.is_string() && v.s() == AsciiUpper(v.s());
  if (test == "defined") return !v.is_undefined();
  if (test == "undefined") return v.is_undefined();
  if (test == "equalto" || test == "eq") {
    if (arg == nullptr)
      return Invalid(absl::StrCat("the '", test, "' test needs a value to compare with"));
    return StrictEquals(v, *arg);
  }
  return Invalid(absl::StrCat("unknown test '", test, "'"));
}

absl::StatusOr<Value> Evaluator::CallGlobal(const std::string& name, Args args) {
  if (name == "raise_exception") {
    std::vector<std::string> parts;
    for (const Value& v : args.positional) {
      ACCEL_ASSIGN_OR_RETURN(std::string s, RawString(v));
      parts.push_back(std::move(s));
    }
    return Invalid(absl::StrJoin(parts, ","));
  }
  if (name == "range") {
    for (const Value& v : args.positional) {
      if (!v.is_number() && !v.is_bool())
        return Invalid(absl::StrCat("range() needs numbers, got a ", TypeName(v)));
    }
    if (args.positional.empty() || args.positional.size() > 3)
      return Invalid("range() takes 1 to 3 arguments");
    double start = 0;
    double stop = args.positional[0].number();
    double step = 1;
    if (args.positional.size() >= 2) {
      start = stop;
      stop = args.positional[1].number();
    }
    if (args.positional.size() == 3) step = args.positional[2].number();
    if (step == 0) return Invalid("range() step must not be zero");
    const double count = std::ceil((stop - start) / step);
    if (count > static_cast<double>(limits_.max_items)) {
      return Invalid(absl::StrCat("range() of more than ", limits_.max_items, " numbers"));
    }
    std::vector<Value> items;
    for (double k = start; step > 0 ? k < stop : k > stop; k += step) {
      items.push_back(k == std::floor(k) ? Value::Int(static_cast<int64_t>(k)) : Value::Float(k));
      if (items.size() > limits_.max_items) return Invalid("range() too long");
    }
    return NewArray(std::move(items));
  }
  if (name == "strftime_now") {
    if (args.positional.empty() || !args.positional[0].is_string()) {
      return Invalid("strftime_now() needs a format string");
    }
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[512];
    const size_t n = std::strftime(buf, sizeof(buf), args.positional[0].s().c_str(), &local);
    return NewString(std::string(buf, n));
  }
  if (name == "namespace") {
    if (args.positional.size() > 1) {
      return Invalid(
          absl::StrCat("namespace expected at most 1 argument, got ", args.positional.size()));
    }
    Value ns = MakeObject({}, Object::kNamespace);
    namespaces_.push_back(std::get<std::shared_ptr<Object>>(ns.v));
    if (args.positional.size() == 1) {
      const Value& source = args.positional[0];
      if (source.is_object()) {
        for (const auto& [key, v] : source.object().entries) ns.object().Set(key, v);
      } else if (source.is_array()) {
        for (const Value& pair : source.array().items) {
          std::vector<Value> kv;
          if (pair.is_array()) {
            kv = pair.array().items;
          } else if (pair.is_string()) {
            for (const std::string& c : CodePoints(pair.s())) kv.push_back(Value::String(c));
          }
          if (kv.size() != 2)
            return Invalid("namespace expected a dict or a list of [key, value] pairs");
          if (!kv[0].is_string()) return Invalid("namespace keys must be strings");
          ns.object().Set(kv[0].s(), kv[1]);
        }
      } else {
        return Invalid(absl::StrCat("a ", TypeName(source), " is not iterable"));
      }
    }
    for (const auto& [key, v] : args.keyword) ns.object().Set(key, v);
    if (DepthOf(ns) > kMaxValueDepth) return Invalid("namespaces nested too deeply");
    return ns;
  }
  return Invalid(absl::StrCat("unknown function '", name, "'"));
}

absl::StatusOr<Value> Evaluator::CallStringMethod(const std::string& s, const std::string& name,
                                                  Args args) {
  if (name == "upper") return NewString(AsciiUpper(s));
  if (name == "lower") return NewString(AsciiLower(s));
  // @huggingface/jinja ignores the characters argument: all whitespace goes.
  if (name == "strip") return NewString(std::string(JsTrimEnd(JsTrimStart(s))));
  if (name == "lstrip") return NewString(std::string(JsTrimStart(s)));
  if (name == "rstrip") return NewString(std::string(JsTrimEnd(s)));
  if (name == "title") return NewString(TitleCase(s));
  if (name == "capitalize") {
    std::string out = s;
    if (!out.empty() && out[0] >= 'a' && out[0] <= 'z')
      out[0] = static_cast<char>(out[0] - 'a' + 'A');
    return NewString(std::move(out));
  }
  if (name == "startswith" || name == "endswith") {
    if (args.positional.empty())
      return Invalid(absl::StrCat(name, "() requires at least one argument"));
    const bool starts = name == "startswith";
    auto test = [&](const std::string& p) {
      return starts ? absl::StartsWith(s, p) : absl::EndsWith(s, p);
    };
    const Value& pattern = args.positional[0];
    if (pattern.is_string()) return Value::Bool(test(pattern.s()));
    if (pattern.is_array()) {
      for (const Value& item : pattern.array().items) {
        if (!item.is_string())
          return Invalid(absl::StrCat(name, "() tuple elements must be strings"));
        if (test(item.s())) return Value::Bool(true);
      }
      return Value::Bool(false);
    }
    return Invalid(absl::StrCat(name, "() argument must be a string or tuple of strings"));
  }
  if (name == "split") {
    if (!args.keyword.empty()) return Invalid("split() takes its arguments by position");
    const Value sep = args.positional.empty() ? Value::None() : args.positional[0];
    if (!sep.is_string() && !sep.is_none())
      return Invalid("split() separator must be a string or none");
    const Value maxsplit = args.positional.size() > 1 ? args.positional[1] : Value::Int(-1);
    if (!maxsplit.is_int()) return Invalid("split() maxsplit must be an integer");
    const int64_t max = maxsplit.i();
    std::vector<std::string> parts;
    if (sep.is_none()) {
      const absl::string_view text = JsTrimStart(s);
      size_t k = 0;
      while (k < text.size()) {
        size_t start = k;
        while (start < text.size() && JsSpaceAt(text, start) > 0)
          start += static_cast<size_t>(JsSpaceAt(text, start));
        if (start >= text.size()) break;
        if (max != -1 && static_cast<int64_t>(parts.size()) >= max) {
          parts.emplace_back(text.substr(start));
          break;
        }
        size_t end = start;
        while (end < text.size() && JsSpaceAt(text, end) == 0) ++end;
        parts.emplace_back(text.substr(start, end - start));
        k = end;
      }
    } else {
      if (sep.s().empty()) return Invalid("empty separator");
      parts = absl::StrSplit(s, sep.s());
      if (max != -1 && static_cast<int64_t>(parts.size()) > max) {
        const auto keep = static_cast<size_t>(std::max<int64_t>(max, 0));
        std::vector<std::string> tail(parts.begin() + static_cast<std::ptrdiff_t>(keep),
                                      parts.end());
        parts.resize(keep);
        parts.push_back(absl::StrJoin(tail, sep.s()));
      }
    }
    std::vector<Value> items;
    items.reserve(parts.size());
    for (std::string& part : parts) items.push_back(Value::String(std::move(part)));
    ACCEL_RETURN_IF_ERROR(Charge(s.size()));
    return NewArray(std::move(items));
  }
  if (name == "replace") {
    if (args.positional.size() < 2) return Invalid("replace() requires at least two arguments");
    const Value& from = args.positional[0];
    const Value& to = args.positional[1];
    if (!from.is_string() || !to.is_string()) return Invalid("replace() arguments must be strings");
    Value count = Value::None();
    if (args.positional.size() > 2) {
      count = args.positional[2];
    } else if (const Value* c = Keyword(args.keyword, "count")) {
      count = *c;
    }
    if (!count.is_int() && !count.is_none())
      return Invalid("replace() count must be an integer or none");
    const size_t pieces = from.s().empty() ? Utf16Length(s) + 1 : s.size() / from.s().size() + 1;
    if (!to.s().empty() && pieces > limits_.max_output / to.s().size()) {
      return Invalid(absl::StrCat("string longer than ", limits_.max_output, " bytes"));
    }
    return NewString(Replace(s, from.s(), to.s(), count.is_int() ? count.i() : -1));
  }
  return Invalid(absl::StrCat("unknown string method '", name, "'"));
}

absl::StatusOr<Value> Evaluator::CallDictMethod(const Value& dict, const std::string& name,
                                                Args args) {
  const Object& object = dict.object();
  if (name == "get") {
    if (args.positional.empty() || !args.positional[0].is_string())
      return Invalid("dict keys must be strings");
    if (const Value* v = object.Find(args.positional[0].s())) return *v;
    return args.positional.size() > 1 ? args.positional[1] : Value::None();
  }
  if (name == "items" || name == "dictsort") {
    std::vector<Value> items;
    for (const auto& [key, v] : object.entries) {
      ACCEL_ASSIGN_OR_RETURN(Value pair, NewArray({Value::String(key), v}));
      items.push_back(std::move(pair));
    }
    if (name == "dictsort") {
      const Value case_sensitive =
          Arg(args.positional, 0, args.keyword, "case_sensitive", Value::Bool(false));
      const Value by = Arg(args.positional, 1, args.keyword, "by", Value::String("key"));
      const Value reverse = Arg(args.positional, 2, args.keyword, "reverse", Value::Bool(false));
      if (!case_sensitive.is_bool()) return Invalid("case_sensitive must be a boolean");
      if (!by.is_string() || (by.s() != "key" && by.s() != "value"))
        return Invalid("by must be 'key' or 'value'");
      if (!reverse.is_bool()) return Invalid("reverse must be a boolean");
      const size_t index = by.s() == "key" ? 0 : 1;
      absl::Status error;
      std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
        absl::StatusOr<int> c =
            Compare(a.array().items[index], b.array().items[index], case_sensitive.b());
        if (!c.ok()) {
          error.Update(c.status());
          return false;
        }
        return reverse.b() ? *c > 0 : *c < 0;
      });
      ACCEL_RETURN_IF_ERROR(error);
    }
    return NewArray(std::move(items));
  }
  if (name == "keys" || name == "values") {
    std::vector<Value> items;
    for (const auto& [key, v] : object.entries)
      items.push_back(name == "keys" ? Value::String(key) : v);
    return NewArray(std::move(items));
  }
  return Invalid(absl::StrCat("unknown dict method '", name, "'"));
}

absl::StatusOr<Value> Evaluator::ToJsonFilter(const Value& operand, const Args& args) {
  JsonOptions options;
  if (const Value* indent = Keyword(args.keyword, "indent");
      indent != nullptr && !indent->is_none()) {
    if (!indent->is_int()) return Invalid("tojson indent must be an integer");
    options.indent = indent->i();
  }
  if (const Value* v = Keyword(args.keyword, "ensure_ascii")) {
    if (!v->is_bool()) return Invalid("tojson ensure_ascii must be a boolean");
    options.ensure_ascii = v->b();
  }
  if (const Value* v = Keyword(args.keyword, "sort_keys")) {
    if (!v->is_bool()) return Invalid("tojson sort_keys must be a boolean");
    options.sort_keys = v->b();
  }
  if (const Value* v = Keyword(args.keyword, "separators"); v != nullptr && !v->is_none()) {
    if (!v->is_array() || v->array().items.size() != 2 || !v->array().items[0].is_string() ||
        !v->array().items[1].is_string()) {
      return Invalid("tojson separators must be a tuple of two strings");
    }
    options.separators = std::make_pair(v->array().items[0].s(), v->array().items[1].s());
  }
  ACCEL_ASSIGN_OR_RETURN(std::string json, ToJson(operand, options, limits_.max_output));
  return NewString(std::move(json));
}

absl::StatusOr<Value> Evaluator::Sort(const Value& operand, const Args& args) {
  const Value reverse = Arg(args.positional, 0, args.keyword, "reverse", Value::Bool(false));
  const Value case_sensitive =
      Arg(args.positional, 1, args.keyword, "case_sensitive", Value::Bool(false));
  const Value attribute = Arg(args.positional, 2, args.keyword, "attribute", Value::None());
  if (!reverse.is_bool()) return Invalid("reverse must be a boolean");
  if (!case_sensitive.is_bool()) return Invalid("case_sensitive must be a boolean");
  if (!attribute.is_string() && !attribute.is_int() && !attribute.is_none()) {
    return Invalid("attribute must be a string, an integer or none");
  }
  const std::string path = attribute.is_string() ? attribute.s()
                           : attribute.is_int()  ? absl::StrCat(attribute.i())
                                                 : "";
  auto key = [&](const Value& item) {
    return attribute.is_none() ? item : AttributePath(item, path);
  };
  std::vector<Value> items = operand.array().items;
  absl::Status error;
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    absl::StatusOr<int> c = Compare(key(a), key(b), case_sensitive.b());
    if (!c.ok()) {
      error.Update(c.status());
      return false;
    }
    return reverse.b() ? *c > 0 : *c < 0;
  });
  ACCEL_RETURN_IF_ERROR(error);
  return NewArray(std::move(items));
}

absl::StatusOr<Value> Evaluator::SelectAttr(const Value& operand, const Node& filter, bool select,
                                            const EnvPtr& env) {
  const std::string& name = filter.a->str;
  for (const Value& item : operand.array().items) {
    if (!item.is_object() && !item.is_namespace()) {
      return Invalid(absl::StrCat("'", name, "' can only be applied to a list of dicts"));
    }
  }
  std::vector<Value> args;
  for (const NodePtr& arg : filter.list) {
    if (arg->kind != NodeKind::kString)
      return Invalid(absl::StrCat("the arguments of '", name, "' must be strings"));
    ACCEL_ASSIGN_OR_RETURN(Value v, Eval(*arg, env));
    args.push_back(std::move(v));
  }
  if (args.empty()) return Invalid(absl::StrCat("'", name, "' needs an attribute name"));
  std::vector<Value> kept;
  for (const Value& item : operand.array().items) {
    const Value* attr = item.object().Find(args[0].s());
    bool result = false;
    if (attr != nullptr) {
      if (args.size() > 1) {
        if (!IsKnownTest(args[1].s()))
          return Invalid(absl::StrCat("unknown test '", args[1].s(), "'"));
        ACCEL_ASSIGN_OR_RETURN(result,
                               ApplyTest(args[1].s(), *attr, args.size() > 2 ? &args[2] : nullptr));
      } else {
        result = Truthy(*attr);
      }
    }
    if (result == select) kept.push_back(item);
  }
  return NewArray(std::move(kept));
}

absl::StatusOr<Value> Evaluator::ApplyFilter(const Value& operand, const Node& filter,
                                             const EnvPtr& env) {
  const std::string& name = filter.kind == NodeKind::kCall ? filter.a->str : filter.str;
  if (!IsKnownFilter(name)) {
    return Invalid(absl::StrCat("filter '", name, "' is not supported (as in @huggingface/jinja)"));
  }
  if (filter.kind == NodeKind::kCall) return ApplyFilterCall(operand, filter, env);
  if (name == "safe") return operand;
  if (name == "tojson") return ToJsonFilter(operand, Args{});
  const auto unknown = [&]() {
    return Invalid(absl::StrCat("filter '", name, "' does not apply to a ", TypeName(operand)));
  };
  if (operand.is_array()) {
    const std::vector<Value>& items = operand.array().items;
    if (name == "list") return operand;
    if (name == "first") return items.empty() ? Value() : items.front();
    if (name == "last") return items.empty() ? Value() : items.back();
    if (name == "length") return Value::Int(static_cast<int64_t>(items.size()));
    if (name == "reverse") return NewArray(std::vector<Value>(items.rbegin(), items.rend()));
    if (name == "sort") return Sort(operand, Args{});
    if (name == "join") {
      std::string out;
      for (const Value& item : items) {
        ACCEL_ASSIGN_OR_RETURN(std::string part, JoinPart(item));
        out += part;
        if (out.size() > limits_.max_output) return Invalid("string too long");
      }
      return NewString(std::move(out));
    }
    if (name == "string") {
      JsonOptions options;
      options.undefined_as_null = false;
      ACCEL_ASSIGN_OR_RETURN(std::string json, ToJson(operand, options, limits_.max_output));
      return NewString(std::move(json));
    }
    if (name == "unique") {
      std::vector<Value> out;
      for (const Value& item : items) {
        bool seen = false;
        for (const Value& kept : out) seen = seen || StrictEquals(kept, item);
        if (!seen) out.push_back(item);
      }
      return NewArray(std::move(out));
    }
    return unknown();
  }
  if (operand.is_string()) {
    const std::string& s = operand.s();
    if (name == "length") return Value::Int(static_cast<int64_t>(Utf16Length(s)));
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
      return CallStringMethod(s, name, Args{});
    }
    if (name == "trim") return NewString(std::string(JsTrimEnd(JsTrimStart(s))));
    if (name == "indent") {
      std::vector<std::string> lines = absl::StrSplit(s, '\n');
      for (size_t k = 1; k < lines.size(); ++k) {
        if (!lines[k].empty()) lines[k] = "    " + lines[k];
      }
      return NewString(absl::StrJoin(lines, "\n"));
    }
    if (name == "join" || name == "string") return operand;
    if (name == "int") {
      const std::optional<double> v = ParseInt(s);
      return v ? IntValue(*v) : Value::Int(0);
    }
    if (name == "float") return Value::Float(ParseFloat(s).value_or(0));
    return unknown();
  }
  if (operand.is_number()) {
    if (name == "abs") {
      if (operand.is_float()) return Value::Float(std::fabs(operand.f()));
      if (operand.i() == std::numeric_limits<int64_t>::min()) return Invalid("integer overflow");
      return Value::Int(operand.i() < 0 ? -operand.i() : operand.i());
    }
    if (name == "int") return operand.is_int() ? operand : IntValue(std::floor(operand.f()));
    if (name == "float") return Value::Float(operand.number());
    if (name == "string") {
      ACCEL_ASSIGN_OR_RETURN(std::string s, PrintString(operand));
      return NewString(std::move(s));
    }
    return unknown();
  }
  if (operand.is_object()) {
    if (name == "items") return CallDictMethod(operand, "items", Args{});
    if (name == "length") return Value::Int(static_cast<int64_t>(operand.object().entries.size()));
    if (IsDictMethod(name)) return CallDictMethod(operand, name, Args{});
    return unknown();
  }
  if (operand.is_bool()) {
    if (name == "bool") return operand;
    if (name == "int") return Value::Int(operand.b() ? 1 : 0);
    if (name == "float") return Value::Float(operand.b() ? 1 : 0);
    if (name == "string") return Value::String(operand.b() ? "true" : "false");
    return unknown();
  }
  return unknown();
}

absl::StatusOr<Value> Evaluator::ApplyFilterCall(const Value& operand, const Node& filter,
                                                 const EnvPtr& env) {
  const std::string& name = filter.a->str;
  const auto unknown = [&]() {
    return Invalid(absl::StrCat("filter '", name, "' does not apply to a ", TypeName(operand)));
  };
  if (operand.is_array() && (name == "selectattr" || name == "rejectattr")) {
    return SelectAttr(operand, filter, name == "selectattr", env);
  }
  ACCEL_ASSIGN_OR_RETURN(Args args, EvalArgs(filter.list, env));
  if (name == "tojson") return ToJsonFilter(operand, args);
  if (name == "join") {
    std::vector<std::string> parts;
    if (operand.is_string()) {
      parts = CodePoints(operand.s());
    } else if (operand.is_array()) {
      for (const Value& item : operand.array().items) {
        ACCEL_ASSIGN_OR_RETURN(std::string part, JoinPart(item));
        parts.push_back(std::move(part));
      }
    } else {
      return unknown();
    }
    const Value sep = Arg(args.positional, 0, args.keyword, "separator", Value::String(""));
    if (!sep.is_string()) return Invalid("join separator must be a string");
    size_t total = 0;
    for (const std::string& p : parts) total += p.size() + sep.s().size();
    if (total > limits_.max_output) return Invalid("string too long");
    return NewString(absl::StrJoin(parts, sep.s()));
  }
  if (name == "int" || name == "float") {
    const bool is_int = name == "int";
    const Value fallback =
        Arg(args.positional, 0, args.keyword, "default", is_int ? Value::Int(0) : Value::Float(0));
    if (operand.is_string()) {
      const std::optional<double> v = is_int ? ParseInt(operand.s()) : ParseFloat(operand.s());
      if (!v) return fallback;
      return is_int ? IntValue(*v) : Value::Float(*v);
    }
    if (operand.is_number()) return operand;
    if (operand.is_bool())
      return is_int ? Value::Int(operand.b() ? 1 : 0) : Value::Float(operand.b() ? 1 : 0);
    return unknown();
  }
  if (name == "default") {
    const Value fallback = args.positional.empty() ? Value::String("") : args.positional[0];
    const Value boolean = Arg(args.positional, 1, args.keyword, "boolean", Value::Bool(false));
    if (!boolean.is_bool()) return Invalid("the 'default' filter's flag must be a boolean");
    if (operand.is_undefined() || (boolean.b() && !Truthy(operand))) return fallback;
    return operand;
  }
  if (operand.is_array()) {
    if (name == "sort") return Sort(operand, args);
    if (name == "map") {
      const Value* attribute = Keyword(args.keyword, "attribute");
      if (attribute == nullptr) return Invalid("'map' without attribute= is not supported");
      if (!attribute->is_string()) return Invalid("map attribute must be a string");
      const Value* fallback = Keyword(args.keyword, "default");
      std::vector<Value> out;
      for (const Value& item : operand.array().items) {
        if (!item.is_object() && !item.is_namespace()) return Invalid("items in map must be dicts");
        Value v = AttributePath(item, attribute->s());
        if (v.is_undefined() && fallback != nullptr) v = *fallback;
        out.push_back(std::move(v));
      }
      return NewArray(std::move(out));
    }
    return unknown();
  }
  if (operand.is_string()) {
    if (name == "indent") {
      const Value width = Arg(args.positional, 0, args.keyword, "width", Value::Int(4));
      if (!width.is_int()) return Invalid("indent width must be an integer");
      if (width.i() < 0 || width.i() > 1024) return Invalid("indent width out of range");
      const Value first = Arg(args.positional, 1, args.keyword, "first", Value::Bool(false));
      const Value blank = Arg(args.positional, 2, args.keyword, "blank", Value::Bool(false));
      const std::string pad(static_cast<size_t>(width.i()), ' ');
      std::vector<std::string> lines = absl::StrSplit(operand.s(), '\n');
      if (lines.size() * pad.size() > limits_.max_output) return Invalid("string too long");
      for (size_t k = 0; k < lines.size(); ++k) {
        if ((!Truthy(first) && k == 0) || (!Truthy(blank) && lines[k].empty())) continue;
        lines[k] = pad + lines[k];
      }
      return NewString(absl::StrJoin(lines, "\n"));
    }
    if (name == "replace") return CallStringMethod(operand.s(), "replace", std::move(args));
    return unknown();
  }
  if (operand.is_object() && IsDictMethod(name))
    return CallDictMethod(operand, name, std::move(args));
  return unknown();
}

}  // namespace accel::jinja::internal
