#include "grammar/internal/utf8_ranges.h"

#include <algorithm>

namespace accel::grammar::internal {
namespace {

constexpr uint32_t kSurrogateLo = 0xD800;
constexpr uint32_t kSurrogateHi = 0xDFFF;

int EncodedLength(uint32_t cp) {
  if (cp < 0x80) return 1;
  if (cp < 0x800) return 2;
  if (cp < 0x10000) return 3;
  return 4;
}

void Encode(uint32_t cp, uint8_t* out) {
  const int n = EncodedLength(cp);
  if (n == 1) {
    out[0] = static_cast<uint8_t>(cp);
    return;
  }
  static constexpr uint8_t kLead[5] = {0, 0, 0xC0, 0xE0, 0xF0};
  for (int i = n - 1; i > 0; --i) {
    out[i] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    cp >>= 6;
  }
  out[0] = static_cast<uint8_t>(kLead[n] | cp);
}

// Splits [lo, hi] until each piece is one product of byte ranges: first at
// the encoded-length boundaries, then where a continuation byte's range
// would not be full (the classic construction RE2 and Go's regexp use).
void Split(uint32_t lo, uint32_t hi, std::vector<std::vector<ByteRange>>* out) {
  if (lo > hi) return;
  for (uint32_t boundary : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= boundary && boundary < hi) {
      Split(lo, boundary, out);
      Split(boundary + 1, hi, out);
      return;
    }
  }
  const int n = EncodedLength(lo);
  for (int i = 1; i < n; ++i) {
    const uint32_t mask = (uint32_t{1} << (6 * i)) - 1;
    if ((lo & ~mask) != (hi & ~mask)) {
      if ((lo & mask) != 0) {
        Split(lo, lo | mask, out);
        Split((lo | mask) + 1, hi, out);
        return;
      }
      if ((hi & mask) != mask) {
        Split(lo, (hi & ~mask) - 1, out);
        Split(hi & ~mask, hi, out);
        return;
      }
    }
  }
  uint8_t a[4];
  uint8_t b[4];
  Encode(lo, a);
  Encode(hi, b);
  std::vector<ByteRange> sequence;
  for (int i = 0; i < n; ++i) sequence.emplace_back(a[i], b[i]);
  out->push_back(std::move(sequence));
}

}  // namespace

std::vector<CodepointRange> NormalizeRanges(std::vector<CodepointRange> ranges) {
  std::vector<CodepointRange> pieces;
  for (auto [lo, hi] : ranges) {
    if (lo > hi || lo > kMaxCodepoint) continue;
    hi = std::min(hi, kMaxCodepoint);
    if (lo < kSurrogateLo && hi >= kSurrogateLo) {
      pieces.emplace_back(lo, kSurrogateLo - 1);
      lo = kSurrogateLo;
    }
    if (lo >= kSurrogateLo && lo <= kSurrogateHi) {
      if (hi <= kSurrogateHi) continue;
      lo = kSurrogateHi + 1;
    }
    pieces.emplace_back(lo, hi);
  }
  std::sort(pieces.begin(), pieces.end());
  std::vector<CodepointRange> merged;
  for (const auto& r : pieces) {
    if (!merged.empty() && r.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

std::vector<CodepointRange> ComplementRanges(const std::vector<CodepointRange>& ranges) {
  std::vector<CodepointRange> out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : ranges) {
    if (lo > next) out.emplace_back(next, lo - 1);
    next = hi + 1;
  }
  if (next <= kMaxCodepoint) out.emplace_back(next, kMaxCodepoint);
  return NormalizeRanges(std::move(out));
}

std::vector<std::vector<ByteRange>> Utf8Sequences(const std::vector<CodepointRange>& ranges) {
  std::vector<std::vector<ByteRange>> out;
  for (const auto& [lo, hi] : ranges) Split(lo, hi, &out);
  return out;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  uint8_t bytes[4];
  Encode(cp, bytes);
  out->append(reinterpret_cast<const char*>(bytes), EncodedLength(cp));
}

}  // namespace accel::grammar::internal
