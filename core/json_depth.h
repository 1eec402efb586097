// core/json_depth.h: a guard to run before handing untrusted text to a JSON
// parser. nlohmann's parser and destructor recurse once per nesting level,
// so "[[[[..." a few hundred thousand deep overflows the stack. Torch-free.
#ifndef ACCEL_CORE_JSON_DEPTH_H_
#define ACCEL_CORE_JSON_DEPTH_H_

#include "absl/strings/string_view.h"

namespace accel {

// True when `text` nests arrays/objects deeper than `max_depth` (brackets
// inside strings do not count).
bool JsonNestsDeeperThan(absl::string_view text, int max_depth);

}  // namespace accel

#endif  // ACCEL_CORE_JSON_DEPTH_H_
