// Reading tokenizer.json fields with errors that name the file and the JSON
// path of the field ("tokenizer.json: model.merges[3]: ...").
#ifndef ACCEL_TOKENIZER_INTERNAL_JSON_H_
#define ACCEL_TOKENIZER_INTERNAL_JSON_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::tokenizer::internal {

using Json = nlohmann::json;

class JsonReader {
 public:
  explicit JsonReader(absl::string_view source) : source_(source) {}

  const std::string& source() const { return source_; }

  // InvalidArgument "<source>: <path>: <message>".
  absl::Status Invalid(absl::string_view path, absl::string_view message) const;
  // Unimplemented "<source>: <path>: <what> is not supported".
  absl::Status Unsupported(absl::string_view path, absl::string_view what) const;

  static std::string Child(absl::string_view path, absl::string_view key);
  static std::string Index(absl::string_view path, size_t i);

  // obj[key], or nullptr when absent. `obj` must be an object.
  static const Json* Find(const Json& obj, absl::string_view key);

  // A required object (checks `value` itself).
  absl::Status ExpectObject(const Json& value, absl::string_view path) const;
  // A required string member.
  absl::StatusOr<std::string> String(const Json& obj, absl::string_view path,
                                     absl::string_view key) const;
  // A string member that may be absent or null.
  absl::StatusOr<std::optional<std::string>> OptionalString(const Json& obj, absl::string_view path,
                                                            absl::string_view key) const;
  // A boolean member; absent or null gives `fallback`.
  absl::StatusOr<bool> Bool(const Json& obj, absl::string_view path, absl::string_view key,
                            bool fallback) const;
  // A required integer member in [min, max].
  absl::StatusOr<int64_t> Int(const Json& obj, absl::string_view path, absl::string_view key,
                              int64_t min, int64_t max) const;
  // An integer value in [min, max] (checks `value` itself).
  absl::StatusOr<int64_t> IntValue(const Json& value, absl::string_view path, int64_t min,
                                   int64_t max) const;
  // A required array member.
  absl::StatusOr<const Json*> Array(const Json& obj, absl::string_view path,
                                    absl::string_view key) const;
  // A member that is a single Unicode character (Metaspace's replacement).
  absl::StatusOr<std::string> Char(const Json& obj, absl::string_view path,
                                   absl::string_view key) const;
  // The "type" member of a component.
  absl::StatusOr<std::string> Type(const Json& obj, absl::string_view path) const;

  // The components listed in obj[key] (a "Sequence"), each read by
  // `parse(reader, item, item_path)`, which returns a null pointer for a
  // JSON null: refused here, since a sequence of nothing is not a component.
  template <typename T, typename Parse>
  absl::StatusOr<std::vector<std::unique_ptr<T>>> Components(const Json& obj,
                                                             absl::string_view path,
                                                             absl::string_view key,
                                                             absl::string_view what,
                                                             Parse parse) const {
    absl::StatusOr<const Json*> list = Array(obj, path, key);
    if (!list.ok()) return list.status();
    std::vector<std::unique_ptr<T>> parts;
    for (size_t i = 0; i < (*list)->size(); ++i) {
      const std::string item_path = Index(Child(path, key), i);
      absl::StatusOr<std::unique_ptr<T>> part = parse(*this, (**list)[i], item_path);
      if (!part.ok()) return part.status();
      if (*part == nullptr) {
        return Invalid(item_path, std::string("must be a ") + std::string(what) + ", not null");
      }
      parts.push_back(*std::move(part));
    }
    return parts;
  }

 private:
  std::string source_;
};

}  // namespace accel::tokenizer::internal

#endif  // ACCEL_TOKENIZER_INTERNAL_JSON_H_
