#include "loader/internal/safetensors_format.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/json.h"
#include "core/status.h"

namespace accel::loader::internal {
namespace {

using Json = nlohmann::json;

struct DTypeEntry {
  absl::string_view name;
  int size = 0;
};

// Every dtype of the safetensors specification whose elements are whole bytes.
constexpr DTypeEntry kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
    {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8},
};

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// A JSON number that is a non-negative integer within int64.
std::optional<int64_t> AsNonNegative(const Json& value) {
  if (value.is_number_unsigned()) {
    uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) {
    int64_t v = value.get<int64_t>();
    if (v < 0) return std::nullopt;
    return v;
  }
  return std::nullopt;
}

absl::StatusOr<TensorInfo> ParseEntry(const std::string& name, const Json& entry,
                                      absl::string_view label) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": tensor '", name, "': ", why));
  };
  if (!entry.is_object()) return bad("entry is not a JSON object");
  TensorInfo info;
  info.name = name;

  auto dtype = entry.find("dtype");
  if (dtype == entry.end()) return bad("missing \"dtype\"");
  if (!dtype->is_string()) return bad("\"dtype\" is not a string");
  info.dtype = dtype->get<std::string>();
  std::optional<int> element_size = DTypeElementSize(info.dtype);
  if (!element_size) {
    std::vector<absl::string_view> known;
    for (const auto& d : kDTypes) known.push_back(d.name);
    return bad(
        absl::StrCat("unknown dtype '", info.dtype, "' (known: ", absl::StrJoin(known, " "), ")"));
  }

  auto shape = entry.find("shape");
  if (shape == entry.end()) return bad("missing \"shape\"");
  if (!shape->is_array()) return bad("\"shape\" is not an array");
  uint64_t numel = 1;
  bool overflow = false;
  for (const Json& dim : *shape) {
    std::optional<int64_t> d = AsNonNegative(dim);
    if (!d) return bad(absl::StrCat("shape entry ", dim.dump(), " is not a non-negative integer"));
    info.shape.push_back(*d);
    // Every partial product must fit int64, not just uint64: TensorInfo::numel()
    // and torch multiply the dims in int64, and a later 0 would hide the overflow.
    overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(*d), &numel) ||
                numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  }
  uint64_t nbytes = 0;
  overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(*element_size), &nbytes);
  if (overflow || nbytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return bad(absl::StrCat("shape ", ShapeString(info.shape), " overflows the size of a tensor"));
  }

  auto offsets = entry.find("data_offsets");
  if (offsets == entry.end()) return bad("missing \"data_offsets\"");
  if (!offsets->is_array() || offsets->size() != 2) {
    return bad("\"data_offsets\" is not an array [begin, end]");
  }
  std::optional<int64_t> begin = AsNonNegative((*offsets)[0]);
  std::optional<int64_t> end = AsNonNegative((*offsets)[1]);
  if (!begin || !end) return bad("\"data_offsets\" are not non-negative integers");
  if (*end < *begin) {
    return bad(absl::StrCat("data_offsets [", *begin, ", ", *end, "] end before they begin"));
  }
  info.data_begin = static_cast<uint64_t>(*begin);
  info.data_end = static_cast<uint64_t>(*end);
  if (info.data_end - info.data_begin != nbytes) {
    return bad(absl::StrCat("data_offsets [", *begin, ", ", *end, "] hold ",
                            info.data_end - info.data_begin, " bytes, but dtype ", info.dtype,
                            " and shape ", ShapeString(info.shape), " need ", nbytes));
  }
  return info;
}

// A valid header nests three levels.
constexpr int kMaxDepth = 16;

}  // namespace

std::optional<int> DTypeElementSize(absl::string_view dtype) {
  for (const auto& d : kDTypes) {
    if (d.name == dtype) return d.size;
  }
  return std::nullopt;
}

absl::StatusOr<ParsedHeader> ParseSafetensors(absl::string_view file, absl::string_view label) {
  if (file.size() < 8) {
    return absl::DataLossError(absl::StrCat(label, ": file is ", file.size(),
                                            " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(file[i]);
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": header length ", header_len,
                                                   " exceeds the limit of ", kMaxHeaderBytes,
                                                   " bytes (not a safetensors file?)"));
  }
  if (header_len > file.size() - 8) {
    return absl::DataLossError(absl::StrCat(label, ": header length ", header_len,
                                            " runs past the end of the file (", file.size(),
                                            " bytes); the file is truncated or not safetensors"));
  }
  absl::string_view text = file.substr(8, header_len);
  if (text.empty() || text.front() != '{') {
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": header does not start with '{' (not a safetensors file?)"));
  }

  // nlohmann stops at a NUL byte and would accept what follows it; the
  // reference implementation rejects such a header.
  if (text.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": header contains a NUL byte"));
  }
  // nlohmann keeps the last of duplicate keys silently; the reference
  // reader's maps would not see the same header, so a key twice in one object
  // (a tensor named twice, a field of a tensor given twice) is refused.
  JsonLimits limits;
  limits.max_depth = kMaxDepth;
  limits.refuse_duplicate_keys = true;
  ACCEL_ASSIGN_OR_RETURN(Json header, ParseJson(text, absl::StrCat(label, ": header"), limits));
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": header is not a JSON object"));
  }

  ParsedHeader parsed;
  parsed.data_offset = 8 + header_len;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(label, ": \"__metadata__\" is not a JSON object of strings"));
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(label, ": \"__metadata__\" entry '", key,
                                                         "' is not a string (it is ", value.dump(),
                                                         ")"));
        }
        parsed.metadata.emplace(key, value.get<std::string>());
      }
      continue;
    }
    auto info = ParseEntry(name, entry, label);
    if (!info.ok()) return info.status();
    parsed.tensors.push_back(*std::move(info));
  }

  // The data section must be exactly covered: sorted by offset, each tensor
  // starts where the previous one ended, from 0 to the end of the file.
  std::sort(parsed.tensors.begin(), parsed.tensors.end(), [](const auto& a, const auto& b) {
    return std::tie(a.data_begin, a.data_end, a.name) < std::tie(b.data_begin, b.data_end, b.name);
  });
  const uint64_t data_size = file.size() - parsed.data_offset;
  uint64_t cursor = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : parsed.tensors) {
    if (t.data_begin != cursor) {
      std::string where = previous ? absl::StrCat("tensor '", previous->name, "' ends at ", cursor)
                                   : std::string("the data section starts at 0");
      if (t.data_begin < cursor) {
        return absl::InvalidArgumentError(absl::StrCat(label, ": tensor '", t.name, "' starts at ",
                                                       t.data_begin, " and overlaps: ", where));
      }
      return absl::InvalidArgumentError(absl::StrCat(label, ": tensor '", t.name, "' starts at ",
                                                     t.data_begin, ", leaving a gap: ", where));
    }
    if (t.data_end > data_size) {
      return absl::DataLossError(absl::StrCat(
          label, ": tensor '", t.name, "' data_offsets [", t.data_begin, ", ", t.data_end,
          "] run past the end of the data section (", data_size, " bytes); the file is truncated"));
    }
    cursor = t.data_end;
    previous = &t;
  }
  if (cursor != data_size) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": the tensors cover ", cursor,
                                                   " bytes but the data section holds ", data_size,
                                                   " (trailing bytes no tensor owns)"));
  }
  return parsed;
}

std::string SerializeHeader(const std::vector<TensorInfo>& tensors,
                            const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const TensorInfo& t : tensors) {
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.data_begin, t.data_end}}};
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json;
}

}  // namespace accel::loader::internal
