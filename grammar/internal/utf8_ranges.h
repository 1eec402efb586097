// Code point ranges as UTF-8 byte sequences: a character class becomes the
// alternatives of a rule whose elements each match one byte.
#ifndef ACCEL_GRAMMAR_INTERNAL_UTF8_RANGES_H_
#define ACCEL_GRAMMAR_INTERNAL_UTF8_RANGES_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace accel::grammar::internal {

inline constexpr uint32_t kMaxCodepoint = 0x10FFFF;

using CodepointRange = std::pair<uint32_t, uint32_t>;  // inclusive
using ByteRange = std::pair<uint8_t, uint8_t>;         // inclusive

// Sorted, merged, surrogates (U+D800..U+DFFF) removed.
std::vector<CodepointRange> NormalizeRanges(std::vector<CodepointRange> ranges);
// Every scalar value outside `ranges` (which must be normalized).
std::vector<CodepointRange> ComplementRanges(const std::vector<CodepointRange>& ranges);
// Byte-range sequences whose union encodes exactly the scalar values of
// `ranges` (normalized) in UTF-8; each sequence is 1 to 4 ranges long.
std::vector<std::vector<ByteRange>> Utf8Sequences(const std::vector<CodepointRange>& ranges);
// Appends the UTF-8 encoding of `cp` (a scalar value).
void AppendUtf8(uint32_t cp, std::string* out);

}  // namespace accel::grammar::internal

#endif  // ACCEL_GRAMMAR_INTERNAL_UTF8_RANGES_H_
