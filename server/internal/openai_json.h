// Small JSON helpers shared by the OpenAI wire adapters (chat / completions
// in openai_convert.cc, the Responses API in openai_responses.cc): the JSON
// text of a value, a field's error, a field read as OpenAI reads it, and the
// random ids of answers.
#ifndef ACCEL_SERVER_INTERNAL_OPENAI_JSON_H_
#define ACCEL_SERVER_INTERNAL_OPENAI_JSON_H_

#include <cstdint>
#include <mutex>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

#include "core/json.h"

namespace accel::server::internal {

// JSON text of a value; invalid UTF-8 (never expected: the texts are final
// decoded text) becomes U+FFFD rather than an exception.
inline std::string Dump(const nlohmann::ordered_json& value) {
  return value.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

inline absl::Status FieldError(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// The field, or null when absent or null (OpenAI treats an explicit null as
// unset).
inline const nlohmann::ordered_json* Field(const nlohmann::ordered_json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

// `prefix` and `hex_digits` (at most 32) random hex digits: ids clients
// cannot guess or collide on.
inline std::string RandomId(absl::string_view prefix, int hex_digits) {
  static std::mutex mu;
  static std::mt19937_64 engine{std::random_device{}()};
  uint64_t a, b;
  {
    std::lock_guard<std::mutex> lock(mu);
    a = engine();
    b = engine();
  }
  return absl::StrCat(prefix, absl::StrFormat("%016x%016x", a, b).substr(0, hex_digits));
}

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_OPENAI_JSON_H_
