// UTF-8 and Unicode helpers for the tokenizer, each matching what HuggingFace
// tokenizers (Rust) does: strict UTF-8 (no surrogates, no overlongs), Rust's
// String::from_utf8_lossy, char::is_whitespace, char::is_numeric,
// char::to_lowercase, the regex crate's \w, and NFC/NFD/NFKC/NFKD (utf8proc).
#ifndef ACCEL_TOKENIZER_INTERNAL_UNICODE_H_
#define ACCEL_TOKENIZER_INTERNAL_UNICODE_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace accel::tokenizer::internal {

// True when `text` is well-formed UTF-8 as Rust's str requires.
bool IsValidUtf8(absl::string_view text);

// Byte length of the UTF-8 sequence that starts with `lead` (1 for anything
// that is not a valid lead byte). Only meaningful on valid UTF-8.
inline size_t Utf8Length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xF0) return 4;
  if (lead >= 0xE0) return 3;
  if (lead >= 0xC0) return 2;
  return 1;
}

// Decodes the code point at `text[pos]` of valid UTF-8 and advances `pos`.
char32_t NextChar(absl::string_view text, size_t* pos);

// Decodes the last code point of non-empty valid UTF-8.
char32_t LastChar(absl::string_view text);

void AppendUtf8(char32_t c, std::string* out);

// Rust's String::from_utf8_lossy: each maximal invalid subpart becomes one U+FFFD.
std::string LossyUtf8(absl::string_view bytes);

// Unicode White_Space (Rust's char::is_whitespace and the regex crate's \s;
// also Oniguruma's \s).
bool IsWhitespace(char32_t c);

// The regex crate's \w: Alphabetic, marks, decimal digits, connector
// punctuation, join controls.
bool IsWordChar(char32_t c);

// Rust's char::is_numeric: general categories Nd, Nl, No.
bool IsNumeric(char32_t c);

// Rust's char::to_lowercase, appended to `out`.
void AppendLowercase(char32_t c, std::string* out);

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };

// Unicode normalization of valid UTF-8.
std::string NormalizeUnicode(absl::string_view text, NormalForm form);

}  // namespace accel::tokenizer::internal

#endif  // ACCEL_TOKENIZER_INTERNAL_UNICODE_H_
