#include "core/quote.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace accel {

std::string Quote(absl::string_view text) {
  if (text.size() <= kMaxQuotedBytes) return absl::StrCat("\"", absl::CEscape(text), "\"");
  return absl::StrCat("\"", absl::CEscape(text.substr(0, kMaxQuotedBytes)), "\"... (", text.size(),
                      " bytes)");
}

}  // namespace accel
