// jinja/internal/value.h: the interpreter's values, with @huggingface/jinja's
// printing, JSON, truthiness and equality (JavaScript semantics where it uses them).
#ifndef ACCEL_JINJA_INTERNAL_VALUE_H_
#define ACCEL_JINJA_INTERNAL_VALUE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "jinja/internal/ast.h"

namespace accel::jinja::internal {

struct Array;
struct Object;
struct Function;
struct Env;

struct UndefinedTag {};
struct NoneTag {};

// Containers are shared: a namespace set in a loop is the one seen after it.
// Only namespaces (and closures through environments) are mutable, so only
// they can form cycles; the evaluator clears them when a render ends.
struct Value {
  using Str = std::shared_ptr<const std::string>;
  std::variant<UndefinedTag, NoneTag, bool, int64_t, double, Str, std::shared_ptr<Array>,
               std::shared_ptr<Object>, std::shared_ptr<Function>>
      v;

  Value() = default;
  static Value None() { return Value(NoneTag{}); }
  static Value Bool(bool b) { return Value(b); }
  static Value Int(int64_t i) { return Value(i); }
  static Value Float(double f) { return Value(f); }
  static Value String(std::string s) {
    return Value(std::make_shared<const std::string>(std::move(s)));
  }

  bool is_undefined() const { return std::holds_alternative<UndefinedTag>(v); }
  bool is_none() const { return std::holds_alternative<NoneTag>(v); }
  bool is_bool() const { return std::holds_alternative<bool>(v); }
  bool is_int() const { return std::holds_alternative<int64_t>(v); }
  bool is_float() const { return std::holds_alternative<double>(v); }
  bool is_number() const { return is_int() || is_float(); }
  bool is_string() const { return std::holds_alternative<Str>(v); }
  bool is_array() const { return std::holds_alternative<std::shared_ptr<Array>>(v); }
  bool is_function() const { return std::holds_alternative<std::shared_ptr<Function>>(v); }
  // A dict or keyword arguments (not a namespace).
  bool is_object() const;
  bool is_namespace() const;
  bool is_tuple() const;

  bool b() const { return std::get<bool>(v); }
  int64_t i() const { return std::get<int64_t>(v); }
  double f() const { return std::get<double>(v); }
  double number() const {
    return is_int() ? static_cast<double>(i()) : is_float() ? f() : b() ? 1 : 0;
  }
  const std::string& s() const { return *std::get<Str>(v); }
  Array& array() const { return *std::get<std::shared_ptr<Array>>(v); }
  Object& object() const { return *std::get<std::shared_ptr<Object>>(v); }
  Function& function() const { return *std::get<std::shared_ptr<Function>>(v); }
  const void* identity() const;  // the container's address, for JavaScript's === on objects

 private:
  template <typename T>
  explicit Value(T x) : v(std::move(x)) {}
  friend Value MakeArray(std::vector<Value> items, bool tuple);
  friend Value MakeObject(std::vector<std::pair<std::string, Value>> entries, int type);
  friend Value MakeFunction(std::shared_ptr<Function> fn);
};

// Nesting of containers, bounded so that destroying one cannot overflow the stack.
inline constexpr int kMaxValueDepth = 128;
int DepthOf(const Value& v);

struct Array {
  std::vector<Value> items;
  bool tuple = false;
  int depth = 1;
};

struct Object {
  enum Type { kDict = 0, kKwargs = 1, kNamespace = 2 };
  Type type = kDict;
  std::vector<std::pair<std::string, Value>> entries;  // in insertion order, as a JS Map
  int depth = 1;

  const Value* Find(absl::string_view key) const;
  void Set(const std::string& key, Value value);
};

struct Function {
  enum Type { kGlobal, kMethod, kMacro, kCaller };
  Type type = kGlobal;
  std::string name;            // global or method name; macro name
  Value receiver;              // kMethod: the string or dict
  const Node* node = nullptr;  // kMacro: the macro; kCaller: the call block
  std::shared_ptr<Env> env;    // kCaller: where the call block is
};

// The caller checks the depth (DepthOf) where values can nest without bound.
Value MakeArray(std::vector<Value> items, bool tuple = false);
Value MakeObject(std::vector<std::pair<std::string, Value>> entries, int type = Object::kDict);
Value MakeFunction(std::shared_ptr<Function> fn);

const char* TypeName(const Value& v);
bool Truthy(const Value& v);

// JavaScript's Number.prototype.toString.
std::string JsNumber(double d);
// How {{ value }} prints: FloatValue 1 as "1.0", arrays and dicts as JSON.
absl::StatusOr<std::string> PrintString(const Value& v);
// JavaScript's String(value.value): what `~`, `+` and |join use (1.0 -> "1").
absl::StatusOr<std::string> RawString(const Value& v);

struct JsonOptions {
  std::optional<int64_t> indent;
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::optional<std::pair<std::string, std::string>> separators;
  bool undefined_as_null = true;
};
// @huggingface/jinja's toJSON (|tojson and printing containers). `limit`
// bounds the result's size.
absl::StatusOr<std::string> ToJson(const Value& v, const JsonOptions& options, size_t limit);
// JSON.stringify of a string.
void AppendJsonString(absl::string_view s, std::string* out);

// JavaScript's == on the values (1 == "1", undefined == null) and ===.
bool LooseEquals(const Value& a, const Value& b);
bool StrictEquals(const Value& a, const Value& b);
// compareRuntimeValues: -1, 0, 1 or an error for types that do not compare.
absl::StatusOr<int> Compare(const Value& a, const Value& b, bool case_sensitive);

// Strings as JavaScript sees them (UTF-16 lengths, code point iteration).
size_t Utf16Length(absl::string_view s);
std::vector<std::string> CodePoints(absl::string_view s);
std::string AsciiUpper(absl::string_view s);
std::string AsciiLower(absl::string_view s);
absl::string_view JsTrimStart(absl::string_view s);
absl::string_view JsTrimEnd(absl::string_view s);

}  // namespace accel::jinja::internal

#endif  // ACCEL_JINJA_INTERNAL_VALUE_H_
