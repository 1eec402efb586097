// core/quote.h: the one way an error message echoes a string a
// client sent (a model name, a tensor name, a parameter key or value, a
// stop string), in the server and the engine alike. Clients put such strings in logs and in gRPC
// trailing metadata, whose size is limited (8 KiB by default in most clients), so an echo is cut
// and every byte that is not printable ASCII is escaped: a 100,000-byte name with NUL bytes comes
// back as a short, readable quote.
#ifndef ACCEL_CORE_QUOTE_H_
#define ACCEL_CORE_QUOTE_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace accel {

// The most bytes of an untrusted string an error message quotes.
inline constexpr size_t kMaxQuotedBytes = 64;

// `text` in double quotes, C-escaped (absl::CEscape: quotes, backslashes,
// control and non-ASCII bytes as \" \\ \n \000 ...; octal rather than
// CHexEscape's \x, after which every hex-digit letter that follows would be
// escaped too, "\x00\x61\x61"); past kMaxQuotedBytes
// the quote ends with "..." and says the whole length:
//   Quote("abc")         -> "abc"
//   Quote(100000 x "a")  -> "aaaa...a"... (100000 bytes)
std::string Quote(absl::string_view text);

}  // namespace accel

#endif  // ACCEL_CORE_QUOTE_H_
