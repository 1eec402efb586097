#include "jinja/internal/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

#include "jinja/internal/lexer.h"

namespace accel::jinja::internal {
namespace {

// Cycles through namespaces make JSON infinite; JavaScript runs out of stack.
constexpr int kMaxJsonDepth = 256;

// JavaScript's Number(string) for ==: whitespace-trimmed decimal, "" -> 0, else NaN.
double JsStringToNumber(absl::string_view s) {
  s = JsTrimEnd(JsTrimStart(s));
  if (s.empty()) return 0;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (s == "Infinity" || s == "+Infinity") return kInf;
  if (s == "-Infinity") return -kInf;
  const std::string text(s);
  for (char c : text) {
    if (!(absl::ascii_isdigit(c) || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-'))
      return std::numeric_limits<double>::quiet_NaN();
  }
  char* end = nullptr;
  const double d = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() ? d : std::numeric_limits<double>::quiet_NaN();
}

// A stand-in for String.prototype.localeCompare (ICU root collation) on the
// keys JSON meets: case-insensitive first, lower case before upper case.
bool LocaleLess(const std::string& a, const std::string& b) {
  const std::string la = AsciiLower(a);
  const std::string lb = AsciiLower(b);
  if (la != lb) return la < lb;
  return b < a;  // 'a' (0x61) > 'A' (0x41): lower case sorts first
}

absl::Status JsonValue(const Value& v, const JsonOptions& o, int depth, size_t limit,
                       std::string* out) {
  if (depth > kMaxJsonDepth) return absl::InvalidArgumentError("value nested too deeply for JSON");
  if (out->size() > limit) return absl::ResourceExhaustedError("JSON text too long");
  if (v.is_undefined()) {
    out->append(o.undefined_as_null ? "null" : "undefined");
  } else if (v.is_none()) {
    out->append("null");
  } else if (v.is_bool()) {
    out->append(v.b() ? "true" : "false");
  } else if (v.is_int()) {
    absl::StrAppend(out, v.i());
  } else if (v.is_float()) {
    out->append(std::isfinite(v.f()) ? JsNumber(v.f()) : "null");
  } else if (v.is_string()) {
    std::string s;
    AppendJsonString(v.s(), &s);
    if (o.ensure_ascii) {
      std::string ascii;
      for (const std::string& cp : CodePoints(s)) {
        const auto c0 = static_cast<unsigned char>(cp[0]);
        if (c0 < 0x7F) {
          ascii += cp;
          continue;
        }
        uint32_t code = c0;
        if (cp.size() == 2) code = ((c0 & 0x1F) << 6) | (cp[1] & 0x3F);
        if (cp.size() == 3) code = ((c0 & 0x0F) << 12) | ((cp[1] & 0x3F) << 6) | (cp[2] & 0x3F);
        if (cp.size() == 4) {
          code =
              ((c0 & 0x07) << 18) | ((cp[1] & 0x3F) << 12) | ((cp[2] & 0x3F) << 6) | (cp[3] & 0x3F);
        }
        char buf[16];
        if (code >= 0x10000) {
          code -= 0x10000;
          std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (code >> 10),
                        0xDC00 + (code & 0x3FF));
        } else {
          std::snprintf(buf, sizeof(buf), "\\u%04x", code);
        }
        ascii += buf;
      }
      s = std::move(ascii);
    }
    out->append(s);
  } else if (v.is_tuple()) {
    return absl::InvalidArgumentError("cannot convert a tuple to JSON");
  } else if (v.is_array() || v.is_object() || v.is_namespace()) {
    const int64_t indent = o.indent.value_or(0);
    if (indent < 0) return absl::InvalidArgumentError("invalid indent for tojson");
    if (indent > 1024) return absl::InvalidArgumentError("indent too large for tojson");
    std::string item_sep = indent != 0 ? "," : ", ";
    std::string key_sep = ": ";
    if (o.separators) std::tie(item_sep, key_sep) = *o.separators;
    const std::string unit(static_cast<size_t>(indent), ' ');
    std::string base = "\n";
    for (int k = 0; k < depth && indent != 0; ++k) base += unit;
    const std::string child = base + unit;
    if (v.is_array()) {
      const std::vector<Value>& items = v.array().items;
      out->push_back('[');
      if (indent != 0 && !items.empty()) out->append(child);
      for (size_t k = 0; k < items.size(); ++k) {
        if (k > 0) {
          out->append(item_sep);
          if (indent != 0) out->append(child);
        }
        if (absl::Status s = JsonValue(items[k], o, depth + 1, limit, out); !s.ok()) return s;
      }
      if (indent != 0 && !items.empty()) out->append(base);
      out->push_back(']');
    } else {
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.object().entries) entries.push_back(&e);
      if (o.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(), [](const auto* x, const auto* y) {
          return LocaleLess(x->first, y->first);
        });
      }
      out->push_back('{');
      for (size_t k = 0; k < entries.size(); ++k) {
        if (k > 0) out->append(item_sep);
        if (indent != 0) out->append(child);
        std::string key;
        AppendJsonString(entries[k]->first, &key);
        if (o.ensure_ascii) {
          JsonOptions just_ascii;
          just_ascii.ensure_ascii = true;
          key.clear();
          if (absl::Status s =
                  JsonValue(Value::String(entries[k]->first), just_ascii, 0, limit, &key);
              !s.ok()) {
            return s;
          }
        }
        out->append(key);
        out->append(key_sep);
        if (absl::Status s = JsonValue(entries[k]->second, o, depth + 1, limit, out); !s.ok())
          return s;
      }
      if (indent != 0 && !entries.empty()) out->append(base);
      out->push_back('}');
    }
  } else {
    return absl::InvalidArgumentError("cannot convert a function to JSON");
  }
  return absl::OkStatus();
}

}  // namespace

bool Value::is_object() const {
  return std::holds_alternative<std::shared_ptr<Object>>(v) && object().type != Object::kNamespace;
}
bool Value::is_namespace() const {
  return std::holds_alternative<std::shared_ptr<Object>>(v) && object().type == Object::kNamespace;
}
bool Value::is_tuple() const { return is_array() && array().tuple; }

const void* Value::identity() const {
  if (is_array()) return &array();
  if (std::holds_alternative<std::shared_ptr<Object>>(v)) return &object();
  if (is_function()) return &function();
  return nullptr;
}

int DepthOf(const Value& v) {
  if (v.is_array()) return v.array().depth;
  if (std::holds_alternative<std::shared_ptr<Object>>(v.v)) return v.object().depth;
  return 0;
}

const Value* Object::Find(absl::string_view key) const {
  for (const auto& [k, value] : entries) {
    if (k == key) return &value;
  }
  return nullptr;
}

void Object::Set(const std::string& key, Value value) {
  depth = std::max(depth, DepthOf(value) + 1);
  for (auto& [k, v] : entries) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(key, std::move(value));
}

Value MakeArray(std::vector<Value> items, bool tuple) {
  auto array = std::make_shared<Array>();
  for (const Value& item : items) array->depth = std::max(array->depth, DepthOf(item) + 1);
  array->items = std::move(items);
  array->tuple = tuple;
  return Value(std::move(array));
}

Value MakeObject(std::vector<std::pair<std::string, Value>> entries, int type) {
  auto object = std::make_shared<Object>();
  for (const auto& entry : entries)
    object->depth = std::max(object->depth, DepthOf(entry.second) + 1);
  object->entries = std::move(entries);
  object->type = static_cast<Object::Type>(type);
  return Value(std::move(object));
}

Value MakeFunction(std::shared_ptr<Function> fn) { return Value(std::move(fn)); }

const char* TypeName(const Value& v) {
  if (v.is_undefined()) return "undefined";
  if (v.is_none()) return "none";
  if (v.is_bool()) return "boolean";
  if (v.is_int()) return "integer";
  if (v.is_float()) return "float";
  if (v.is_string()) return "string";
  if (v.is_tuple()) return "tuple";
  if (v.is_array()) return "list";
  if (v.is_namespace()) return "namespace";
  if (v.is_object()) return "dict";
  return "function";
}

bool Truthy(const Value& v) {
  if (v.is_undefined() || v.is_none()) return false;
  if (v.is_bool()) return v.b();
  if (v.is_int()) return v.i() != 0;
  if (v.is_float()) return v.f() != 0 && !std::isnan(v.f());
  if (v.is_string()) return !v.s().empty();
  if (v.is_array()) return !v.array().items.empty();
  if (v.is_object()) return !v.object().entries.empty();
  return true;  // a namespace is a JS Map object: always truthy
}

std::string JsNumber(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  if (d == 0) return "0";
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  const std::string sci(buf, result.ptr);
  const size_t e_pos = sci.find('e');
  std::string mantissa = sci.substr(0, e_pos);
  const int exponent = std::atoi(sci.c_str() + e_pos + 1);
  std::string sign;
  if (mantissa[0] == '-') {
    sign = "-";
    mantissa.erase(0, 1);
  }
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits.push_back(c);
  }
  const int k = static_cast<int>(digits.size());
  const int n = exponent + 1;
  std::string out;
  if (k <= n && n <= 21) {
    out = digits + std::string(static_cast<size_t>(n - k), '0');
  } else if (0 < n && n <= 21) {
    out = digits.substr(0, static_cast<size_t>(n)) + "." + digits.substr(static_cast<size_t>(n));
  } else if (-6 < n && n <= 0) {
    out = "0." + std::string(static_cast<size_t>(-n), '0') + digits;
  } else {
    out = digits.substr(0, 1);
    if (k > 1) out += "." + digits.substr(1);
    out += (n - 1 >= 0 ? "e+" : "e-") + std::to_string(std::abs(n - 1));
  }
  return sign + out;
}

absl::StatusOr<std::string> PrintString(const Value& v) {
  if (v.is_undefined()) return std::string("undefined");
  if (v.is_none()) return std::string("null");
  if (v.is_bool()) return std::string(v.b() ? "true" : "false");
  if (v.is_int()) return absl::StrCat(v.i());
  if (v.is_float()) {
    const double d = v.f();
    if (d == 0 && std::signbit(d)) return std::string("-0.0");
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 1e21) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%.1f", d);
      return std::string(buf);
    }
    return JsNumber(d);
  }
  if (v.is_string()) return v.s();
  if (v.is_function()) return absl::InvalidArgumentError("cannot print a function");
  JsonOptions options;
  options.undefined_as_null = false;
  return ToJson(v, options, size_t{1} << 26);
}

absl::StatusOr<std::string> RawString(const Value& v) {
  if (v.is_float()) return JsNumber(v.f());
  if (v.is_object() || v.is_namespace()) return std::string("[object Map]");
  if (v.is_array()) {
    std::string out;
    bool first = true;
    for (const Value& item : v.array().items) {
      if (!first) out.push_back(',');
      first = false;
      absl::StatusOr<std::string> s = PrintString(item);
      if (!s.ok()) return s.status();
      out += *s;
    }
    return out;
  }
  return PrintString(v);
}

absl::StatusOr<std::string> ToJson(const Value& v, const JsonOptions& options, size_t limit) {
  std::string out;
  if (absl::Status s = JsonValue(v, options, 0, limit, &out); !s.ok()) return s;
  if (out.size() > limit) return absl::ResourceExhaustedError("JSON text too long");
  return out;
}

void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (char c : s) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\b':
        out->append("\\b");
        break;
      case '\f':
        out->append("\\f");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          out->append(buf);
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

bool StrictEquals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.number() == b.number();
  if (a.v.index() != b.v.index()) return false;
  if (a.is_undefined() || a.is_none()) return true;
  if (a.is_bool()) return a.b() == b.b();
  if (a.is_string()) return a.s() == b.s();
  return a.identity() == b.identity();
}

bool LooseEquals(const Value& a, const Value& b) {
  const bool a_nullish = a.is_undefined() || a.is_none();
  const bool b_nullish = b.is_undefined() || b.is_none();
  if (a_nullish || b_nullish) return a_nullish && b_nullish;
  if (a.identity() != nullptr || b.identity() != nullptr) return a.identity() == b.identity();
  if (a.is_string() && b.is_string()) return a.s() == b.s();
  const double x = a.is_string() ? JsStringToNumber(a.s()) : a.number();
  const double y = b.is_string() ? JsStringToNumber(b.s()) : b.number();
  return x == y;
}

absl::StatusOr<int> Compare(const Value& a, const Value& b, bool case_sensitive) {
  auto error = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot compare ", TypeName(a), " with ", TypeName(b)));
  };
  if (a.is_none() && b.is_none()) return 0;
  if (a.is_none() || b.is_none()) return error();
  if (a.is_undefined() && b.is_undefined()) return 0;
  if (a.is_undefined() || b.is_undefined()) return error();
  const auto numeric = [](const Value& v) { return v.is_number() || v.is_bool(); };
  if (numeric(a) && numeric(b)) {
    const double x = a.number();
    const double y = b.number();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    const std::string x = case_sensitive ? a.s() : AsciiLower(a.s());
    const std::string y = case_sensitive ? b.s() : AsciiLower(b.s());
    return x < y ? -1 : x > y ? 1 : 0;
  }
  return error();
}

size_t Utf16Length(absl::string_view s) {
  size_t n = 0;
  for (char c : s) {
    const auto b = static_cast<unsigned char>(c);
    if ((b & 0xC0) != 0x80) n += b >= 0xF0 ? 2 : 1;
  }
  return n;
}

std::vector<std::string> CodePoints(absl::string_view s) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    size_t len = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
    len = std::min(len, s.size() - i);
    out.emplace_back(s.substr(i, len));
    i += len;
  }
  return out;
}

std::string AsciiUpper(absl::string_view s) { return absl::AsciiStrToUpper(s); }
std::string AsciiLower(absl::string_view s) { return absl::AsciiStrToLower(s); }

absl::string_view JsTrimStart(absl::string_view s) {
  size_t i = 0;
  while (int n = JsSpaceAt(s, i)) i += static_cast<size_t>(n);
  return s.substr(i);
}

absl::string_view JsTrimEnd(absl::string_view s) {
  size_t end = s.size();
  while (int n = JsSpaceBefore(s, end)) end -= static_cast<size_t>(n);
  return s.substr(0, end);
}

}  // namespace accel::jinja::internal
