#include "tokenizer/internal/json.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

#include "tokenizer/internal/unicode.h"

namespace accel::tokenizer::internal {
namespace {

absl::string_view TypeName(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::object:
      return "an object";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "an integer";
    case Json::value_t::number_float:
      return "a number";
    default:
      return "something else";
  }
}

}  // namespace

absl::Status JsonReader::Invalid(absl::string_view path, absl::string_view message) const {
  return absl::InvalidArgumentError(absl::StrCat(source_, ": ", path, ": ", message));
}

absl::Status JsonReader::Unsupported(absl::string_view path, absl::string_view what) const {
  return absl::UnimplementedError(
      absl::StrCat(source_, ": ", path, ": ", what, " is not supported"));
}

std::string JsonReader::Child(absl::string_view path, absl::string_view key) {
  return path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
}

std::string JsonReader::Index(absl::string_view path, size_t i) {
  return absl::StrCat(path, "[", i, "]");
}

const Json* JsonReader::Find(const Json& obj, absl::string_view key) {
  auto it = obj.find(std::string(key));
  return it == obj.end() ? nullptr : &*it;
}

absl::Status JsonReader::ExpectObject(const Json& value, absl::string_view path) const {
  if (!value.is_object()) {
    return Invalid(path.empty() ? "(top level)" : path,
                   absl::StrCat("must be an object, not ", TypeName(value)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> JsonReader::String(const Json& obj, absl::string_view path,
                                               absl::string_view key) const {
  const Json* v = Find(obj, key);
  if (v == nullptr) return Invalid(Child(path, key), "is missing");
  if (!v->is_string()) {
    return Invalid(Child(path, key), absl::StrCat("must be a string, not ", TypeName(*v)));
  }
  return v->get<std::string>();
}

absl::StatusOr<std::optional<std::string>> JsonReader::OptionalString(const Json& obj,
                                                                      absl::string_view path,
                                                                      absl::string_view key) const {
  const Json* v = Find(obj, key);
  if (v == nullptr || v->is_null()) return std::optional<std::string>();
  if (!v->is_string()) {
    return Invalid(Child(path, key), absl::StrCat("must be a string or null, not ", TypeName(*v)));
  }
  return std::optional<std::string>(v->get<std::string>());
}

absl::StatusOr<bool> JsonReader::Bool(const Json& obj, absl::string_view path,
                                      absl::string_view key, bool fallback) const {
  const Json* v = Find(obj, key);
  if (v == nullptr || v->is_null()) return fallback;
  if (!v->is_boolean()) {
    return Invalid(Child(path, key), absl::StrCat("must be a boolean, not ", TypeName(*v)));
  }
  return v->get<bool>();
}

absl::StatusOr<int64_t> JsonReader::IntValue(const Json& value, absl::string_view path, int64_t min,
                                             int64_t max) const {
  if (value.is_number_unsigned()) {
    const auto u = value.get<uint64_t>();
    if (u <= static_cast<uint64_t>(max) && static_cast<int64_t>(u) >= min) {
      return static_cast<int64_t>(u);
    }
  } else if (value.is_number_integer()) {
    const auto i = value.get<int64_t>();
    if (i >= min && i <= max) return i;
  } else {
    return Invalid(path, absl::StrCat("must be an integer, not ", TypeName(value)));
  }
  return Invalid(path,
                 absl::StrCat("must be an integer in [", min, ", ", max, "], got ", value.dump()));
}

absl::StatusOr<int64_t> JsonReader::Int(const Json& obj, absl::string_view path,
                                        absl::string_view key, int64_t min, int64_t max) const {
  const Json* v = Find(obj, key);
  if (v == nullptr) return Invalid(Child(path, key), "is missing");
  return IntValue(*v, Child(path, key), min, max);
}

absl::StatusOr<const Json*> JsonReader::Array(const Json& obj, absl::string_view path,
                                              absl::string_view key) const {
  const Json* v = Find(obj, key);
  if (v == nullptr) return Invalid(Child(path, key), "is missing");
  if (!v->is_array()) {
    return Invalid(Child(path, key), absl::StrCat("must be an array, not ", TypeName(*v)));
  }
  return v;
}

absl::StatusOr<std::string> JsonReader::Char(const Json& obj, absl::string_view path,
                                             absl::string_view key) const {
  auto s = String(obj, path, key);
  if (!s.ok()) return s.status();
  size_t pos = 0;
  if (!s->empty()) NextChar(*s, &pos);
  if (s->empty() || pos != s->size()) {
    return Invalid(Child(path, key),
                   absl::StrCat("must be one character, got \"", absl::CEscape(*s), "\""));
  }
  return s;
}

absl::StatusOr<std::string> JsonReader::Type(const Json& obj, absl::string_view path) const {
  return String(obj, path, "type");
}

}  // namespace accel::tokenizer::internal
