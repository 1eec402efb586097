#include "tokenizer/internal/unicode.h"

#include <cstdlib>
#include <memory>

#include <utf8proc.h>

namespace accel::tokenizer::internal {
namespace {

// Whether `b` may follow `lead` as the second byte of a UTF-8 sequence
// (Unicode table 3-7: this is what excludes overlongs and surrogates).
bool ValidSecondByte(unsigned char lead, unsigned char b) {
  switch (lead) {
    case 0xE0:
      return b >= 0xA0 && b <= 0xBF;
    case 0xED:
      return b >= 0x80 && b <= 0x9F;
    case 0xF0:
      return b >= 0x90 && b <= 0xBF;
    case 0xF4:
      return b >= 0x80 && b <= 0x8F;
    default:
      return b >= 0x80 && b <= 0xBF;
  }
}

// Sequence length for a valid lead byte, 0 for a byte that cannot start one.
size_t LeadWidth(unsigned char b) {
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b >= 0xE0 && b <= 0xEF) return 3;
  if (b >= 0xF0 && b <= 0xF4) return 4;
  return 0;
}

// Length of the valid sequence at `pos`, or 0 with `*bad` set to the number
// of bytes that form the maximal invalid subpart there.
size_t ValidSequenceAt(absl::string_view s, size_t pos, size_t* bad) {
  const auto lead = static_cast<unsigned char>(s[pos]);
  const size_t width = LeadWidth(lead);
  if (width == 0) {
    *bad = 1;
    return 0;
  }
  if (width == 1) return 1;
  for (size_t k = 1; k < width; ++k) {
    if (pos + k >= s.size()) {
      *bad = k;
      return 0;
    }
    const auto b = static_cast<unsigned char>(s[pos + k]);
    const bool ok = k == 1 ? ValidSecondByte(lead, b) : (b >= 0x80 && b <= 0xBF);
    if (!ok) {
      *bad = k;
      return 0;
    }
  }
  return width;
}

}  // namespace

bool IsValidUtf8(absl::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<unsigned char>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    size_t bad = 0;
    const size_t n = ValidSequenceAt(text, pos, &bad);
    if (n == 0) return false;
    pos += n;
  }
  return true;
}

char32_t NextChar(absl::string_view text, size_t* pos) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data()) + *pos;
  const size_t n = Utf8Length(p[0]);
  *pos += n;
  switch (n) {
    case 1:
      return p[0];
    case 2:
      return (static_cast<char32_t>(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
    case 3:
      return (static_cast<char32_t>(p[0] & 0x0F) << 12) |
             (static_cast<char32_t>(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    default:
      return (static_cast<char32_t>(p[0] & 0x07) << 18) |
             (static_cast<char32_t>(p[1] & 0x3F) << 12) |
             (static_cast<char32_t>(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
  }
}

char32_t LastChar(absl::string_view text) {
  size_t start = text.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  return NextChar(text, &start);
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string LossyUtf8(absl::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (static_cast<unsigned char>(bytes[pos]) < 0x80) {
      out.push_back(bytes[pos++]);
      continue;
    }
    size_t bad = 0;
    const size_t n = ValidSequenceAt(bytes, pos, &bad);
    if (n > 0) {
      out.append(bytes.data() + pos, n);
      pos += n;
    } else {
      out.append("\xEF\xBF\xBD");
      pos += bad;
    }
  }
  return out;
}

bool IsWhitespace(char32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D);
  switch (c) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool IsWordChar(char32_t c) {
  if (c < 0x80) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  }
  if (c == 0x200C || c == 0x200D) return true;  // Join_Control
  // Other_Alphabetic symbols (circled and squared letters): Alphabetic but So.
  if ((c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) ||
      (c >= 0x1F150 && c <= 0x1F169) || (c >= 0x1F170 && c <= 0x1F189)) {
    return true;
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

bool IsNumeric(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

void AppendLowercase(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c));
    return;
  }
  // The one unconditional multi-character lowercase mapping (SpecialCasing.txt),
  // which Rust's char::to_lowercase applies and a simple case mapping does not.
  if (c == 0x130) {
    out->append("i\xCC\x87");
    return;
  }
  AppendUtf8(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))), out);
}

std::string NormalizeUnicode(absl::string_view text, NormalForm form) {
  if (text.empty()) return std::string();
  // Plain ASCII is invariant under every normal form.
  bool ascii = true;
  for (char ch : text) {
    if (static_cast<unsigned char>(ch) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return std::string(text);
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &mapped,
                                          static_cast<utf8proc_option_t>(options));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(mapped, &std::free);
  // The input is valid UTF-8, so utf8proc fails only when out of memory; keep
  // the text as it is then rather than inventing an error the reference has not.
  if (n < 0) return std::string(text);
  return std::string(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
}

}  // namespace accel::tokenizer::internal
