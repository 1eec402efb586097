// core/json.h: the one way accel parses JSON text it did not write itself
// (request bodies, tool definitions, config.json, checkpoint indexes and
// headers, tokenizer files), in time linear in the text and with bounds.
// Torch-free.
//
//   JsonLimits limits;
//   limits.max_keys = 20000;
//   limits.check = [&] { return DeadlineOrCancel(context); };  // optional
//   ACCEL_ASSIGN_OR_RETURN(nlohmann::json body, ParseJson(text, "the body", limits));
//
// Why a helper: nlohmann::ordered_json looks every new key up linearly, so
// an object of n keys costs O(n^2) (100,000 keys: 24 s of CPU); nlohmann's
// parser keeps the last of duplicate keys silently; and a client that has
// gone should not keep a thread parsing for it. Here the document is built
// through nlohmann's SAX interface by a builder of ours that
//   - indexes each large ordered object by a hash of its keys, so
//     ParseOrderedJson is linear too (the key order is kept for the fields
//     that need it: chat messages and tool schemas printed by templates);
//   - stops at max_depth levels of nesting and at max_keys object members in
//     the whole text (InvalidArgument naming `what` and the limit);
//   - refuses duplicate keys when asked (safetensors headers); otherwise the
//     last value wins, as in nlohmann and Python's json module;
//   - calls limits.check every few thousand tokens and stops with its status
//     when it is not OK (a cancelled call, a deadline passed).
// The parse is iterative (nlohmann's parser and destructor keep their own
// stacks), so depth costs no native stack; max_depth bounds what callers
// that recurse over the result (templates, converters) will meet.
//
// Errors name `what` first ("config.json: invalid JSON at line 3, column
// 5: ..."). Invalid JSON never echoes the text's bytes back.
#ifndef ACCEL_CORE_JSON_H_
#define ACCEL_CORE_JSON_H_

#include <cstdint>
#include <functional>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel {

struct JsonLimits {
  // Arrays and objects inside each other; the top level is 1.
  int max_depth = 64;
  // Object members in the whole text (every object's keys, counted
  // together).
  int64_t max_keys = int64_t{1} << 22;
  // InvalidArgument on a key seen twice in one object; else the last wins.
  bool refuse_duplicate_keys = false;
  // Asked every kJsonCheckInterval tokens; a non-OK status stops the parse
  // and is returned unchanged.
  std::function<absl::Status()> check;
  // Set: one key budget over several texts (the fields of one request). The
  // count starts from *key_total and the keys read are added to it, so
  // max_keys bounds them all together.
  int64_t* key_total = nullptr;
};

// How many tokens (values and keys) pass between two calls of
// JsonLimits::check.
inline constexpr int64_t kJsonCheckInterval = 4096;

// The value `text` holds (any JSON value at the top level). Keys of an
// object come back sorted (nlohmann::json's std::map).
absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text, absl::string_view what,
                                         const JsonLimits& limits = {});
// The same with every object's keys in the text's order; duplicate keys keep
// the first one's position and the last one's value (nlohmann's rule).
absl::StatusOr<nlohmann::ordered_json> ParseOrderedJson(absl::string_view text,
                                                        absl::string_view what,
                                                        const JsonLimits& limits = {});

}  // namespace accel

#endif  // ACCEL_CORE_JSON_H_
