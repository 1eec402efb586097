#include "quant/bnb.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// Compiled with -fopenmp and without the shared PCH (accel_torch_parallel in
// quant/CMakeLists.txt): at::parallel_for is serial otherwise.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mean.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/dtype.h"
#include "core/json.h"
#include "core/status.h"

namespace accel::quant {
namespace {

using Json = nlohmann::json;

// ---------------------------------------------------------------------------
// Code tables.

// bnb's get_4bit_type("nf4") literals; each rounds to the float32 of the
// reference table (checked by hex in the test).
constexpr std::array<float, 16> kNf4 = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

std::array<float, 16> MakeFp4() {
  // get_4bit_type("fp4"): the E2M1 values divided by 12 in float32.
  constexpr float kRaw[16] = {0.0f,  0.0625f,  8.0f,  12.0f,  4.0f,  6.0f,  2.0f,  3.0f,
                              -0.0f, -0.0625f, -8.0f, -12.0f, -4.0f, -6.0f, -2.0f, -3.0f};
  std::array<float, 16> table{};
  for (int i = 0; i < 16; ++i) table[i] = kRaw[i] / 12.0f;
  return table;
}

// torch.linspace(start, end, steps, dtype=float32) as torch 1.13's cpu
// kernel computes it with AVX2 (the build the reference's table and digest
// come from; checked against at::linspace for 2..299 steps): step = (end -
// start) / (steps - 1) in float32; an element below steps / 2 is start +
// step * i, one above is end - step * (steps - 1 - i), each one fused
// multiply-add (the kernel is compiled with FMA). Pairs of 8-lane vectors
// cover the front: a vector's first lane is computed as above from its own
// index, lane j is that + (j * step) rounded twice; the rest is scalar.
std::vector<float> TorchLinspace(float start, float end, int64_t steps) {
  std::vector<float> out(steps);
  const float step = (end - start) / static_cast<float>(steps - 1);
  const int64_t halfway = steps / 2;
  auto at = [&](int64_t i) {
    return i < halfway ? std::fma(step, static_cast<float>(i), start)
                       : std::fma(-step, static_cast<float>(steps - 1 - i), end);
  };
  constexpr int64_t kLanes = 8;
  int64_t i = 0;
  for (; i + 2 * kLanes <= steps; i += 2 * kLanes) {
    for (int64_t v = i; v < i + 2 * kLanes; v += kLanes) {
      const float base = at(v);
      for (int64_t j = 0; j < kLanes; ++j) {
        const float lane = static_cast<float>(j) * step;
        out[v + j] = base + lane;
      }
    }
  }
  for (; i < steps; ++i) out[i] = at(i);
  return out;
}

// create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8).
std::array<float, 256> MakeDynamicMap() {
  // 10 ** (i - 6) as Python computes it (a double), which torch's scalar
  // multiply rounds to float32 before multiplying in float32.
  constexpr double kScale[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const std::vector<float> b = TorchLinspace(0.1f, 1.0f, (int64_t{1} << i) + 1);
    const float scale = static_cast<float>(kScale[i]);
    for (size_t k = 0; k + 1 < b.size(); ++k) {
      const float mean = (b[k] + b[k + 1]) / 2.0f;
      data.push_back(scale * mean);
      data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  std::array<float, 256> map{};
  std::copy(data.begin(), data.end(), map.begin());
  return map;
}

// ---------------------------------------------------------------------------
// Code search. Every rule is "code = number of thresholds t with s > t"
// (strict: a tie goes to the lower code).

// Codes are computed 16 values at a time: loops of a fixed trip count are
// what GCC vectorizes at -O2 (its very-cheap cost model takes no epilogue).
constexpr int kChunk = 16;

// The 15 NF4 thresholds (float32 midpoints of the table, bit-identical to
// the literals of bnb's CUDA dQuantizeNF4).
struct Nf4Search {
  float t[15] = {};
  Nf4Search() {
    for (int i = 0; i < 15; ++i) t[i] = (kNf4[i] + kNf4[i + 1]) / 2.0f;
  }
  // The midpoints outer and the chunk inner, so the compiler compares a
  // whole register of values with each midpoint (the other order compared
  // one value at a time: a third of accel-make-model --quantize's time).
  void Chunk(const float* s, int32_t* code) const {
    for (int k = 0; k < kChunk; ++k) code[k] = 0;
    for (int i = 0; i < 15; ++i) {
      const float m = t[i];
      for (int k = 0; k < kChunk; ++k) code[k] += s[k] > m ? 1 : 0;
    }
  }
};

// bnb's CUDA dQuantizeFP4: a strict-> tree on |s| with these literals (not
// exact midpoints), the sign bit when s < 0 (so -0.0 gets none). Past each
// literal the code steps to the next of 0, 1, 6, 7, 4, 5, 2, 3.
struct Fp4Search {
  static constexpr float kT[7] = {0.00260417f, 0.0859375f, 0.20833333f, 0.29166667f,
                                  0.4166667f,  0.583333f,  0.8333333f};
  void Chunk(const float* s, int32_t* code) const {
    for (int k = 0; k < kChunk; ++k) {
      const float a = std::fabs(s[k]);
      int32_t c = s[k] < 0.0f ? 8 : 0;
      c += a > kT[0] ? 1 : 0;   // 0 -> 1
      c += a > kT[1] ? 5 : 0;   // 1 -> 6
      c += a > kT[2] ? 1 : 0;   // 6 -> 7
      c += a > kT[3] ? -3 : 0;  // 7 -> 4
      c += a > kT[4] ? 1 : 0;   // 4 -> 5
      c += a > kT[5] ? -3 : 0;  // 5 -> 2
      c += a > kT[6] ? 1 : 0;   // 2 -> 3
      code[k] = c;
    }
  }
};

// Nearest entry of the dynamic map, ties to the lower index: bucketize over
// the 255 float32 midpoints (bnb's default quantize_blockwise).
struct DynamicSearch {
  float m[256] = {};
  DynamicSearch() {
    const std::array<float, 256>& map = DynamicMap();
    for (int i = 0; i < 255; ++i) m[i] = (map[i] + map[i + 1]) / 2.0f;
    m[255] = std::numeric_limits<float>::infinity();
  }
  uint8_t operator()(float s) const {
    int c = 0;
    for (int step = 128; step >= 1; step /= 2) c += s > m[c + step - 1] ? step : 0;
    return static_cast<uint8_t>(c);
  }
};

// The reciprocal bnb scales a block by. bnb's default backend clamps absmax
// at 1e-38 so that a block whose absmax is a tiny denormal still gets a
// finite scale (1/absmax would overflow to inf and 0 * inf is NaN).
inline float Reciprocal(float absmax) { return 1.0f / std::max(absmax, 1e-38f); }

inline float Clamp1(float s) { return std::min(1.0f, std::max(-1.0f, s)); }

// Elements per parallel_for task: enough work to beat the scheduling cost.
constexpr int64_t kGrainElements = 1 << 15;

int64_t GrainFor(int64_t elements_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_item));
}

// ---------------------------------------------------------------------------
// Validation helpers.

bool IsFloatingWeightType(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

absl::Status CheckCpuTensor(const at::Tensor& t, absl::string_view name) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(name, ": undefined tensor"));
  if (!t.device().is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": must be on the cpu, is on ", t.device().str()));
  }
  return absl::OkStatus();
}

absl::Status CheckTensor(const at::Tensor& t, absl::string_view name, at::ScalarType dtype,
                         int64_t numel) {
  ACCEL_RETURN_IF_ERROR(CheckCpuTensor(t, name));
  if (t.scalar_type() != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected ", DTypeName(dtype), ", got ", DTypeName(t.scalar_type())));
  }
  if (t.numel() != numel) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected ", numel, " elements, got ", t.numel()));
  }
  return absl::OkStatus();
}

// The number of elements of `shape`, or an error for a negative dimension or
// a product past 2^62.
absl::StatusOr<int64_t> NumelOf(const std::vector<int64_t>& shape, absl::string_view what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": negative dimension in [", absl::StrJoin(shape, ", "), "]"));
    }
    if (d != 0 && n > (int64_t{1} << 62) / d) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": [", absl::StrJoin(shape, ", "), "] has too many elements"));
    }
    n *= d;
  }
  return n;
}

// Checks that q's tensors fit q.state; returns the weight's numel.
absl::StatusOr<int64_t> CheckQuantized4bit(const Quantized4bit& q) {
  const QuantState4bit& st = q.state;
  if (!IsValidBlocksize4bit(st.blocksize)) {
    return absl::InvalidArgumentError(
        absl::StrCat("quant state: blocksize ", st.blocksize, " is not one of 32, 64, ..., 4096"));
  }
  if (!IsFloatingWeightType(st.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("quant state: dtype ", DTypeName(st.dtype),
                                                   " is not float32, bfloat16 or float16"));
  }
  ACCEL_ASSIGN_OR_RETURN(const int64_t n, NumelOf(st.shape, "quant state: shape"));
  if (n == 0) return absl::InvalidArgumentError("quant state: shape has no elements");
  const int64_t nblocks = NumBlocks(n, st.blocksize);
  ACCEL_RETURN_IF_ERROR(CheckTensor(q.packed, "weight (packed 4-bit)", at::kByte, (n + 1) / 2));
  if (q.quant_map.defined()) {
    ACCEL_RETURN_IF_ERROR(CheckTensor(q.quant_map, "quant_map", at::kFloat, 16));
  }
  if (!st.double_quant) {
    ACCEL_RETURN_IF_ERROR(CheckTensor(q.absmax, "absmax", at::kFloat, nblocks));
    return n;
  }
  if (st.nested_blocksize != kNestedBlocksize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quant state: nested_blocksize ", st.nested_blocksize, " (bnb supports only 256)"));
  }
  if (!std::isfinite(st.nested_offset)) {
    return absl::InvalidArgumentError("quant state: nested_offset is not finite");
  }
  ACCEL_RETURN_IF_ERROR(CheckTensor(q.absmax, "absmax (double quant)", at::kByte, nblocks));
  ACCEL_RETURN_IF_ERROR(CheckTensor(q.nested_absmax, "nested_absmax", at::kFloat,
                                    NumBlocks(nblocks, kNestedBlocksize)));
  ACCEL_RETURN_IF_ERROR(CheckTensor(q.nested_quant_map, "nested_quant_map", at::kFloat, 256));
  return n;
}

// ---------------------------------------------------------------------------
// Quantize.

// The bits of |v|: for finite floats they order as the values do, and an
// integer max vectorizes where a float max (NaN, -0.0) does not.
inline uint32_t AbsBits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u & 0x7fffffffu;
}
inline float FromAbsBits(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
constexpr uint32_t kInfBits = 0x7f800000u;  // above: NaN; equal: inf

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23

// max |x[0..len)| as bits (non-finite values show as >= kInfBits).
template <typename T>
uint32_t MaxAbsBits(const T* x, int64_t len) {
  uint32_t lanes[kChunk] = {};
  int64_t j = 0;
  for (; j + kChunk <= len; j += kChunk) {
    for (int k = 0; k < kChunk; ++k) {
      lanes[k] = std::max(lanes[k], AbsBits(static_cast<float>(x[j + k])));
    }
  }
  uint32_t m = 0;
  for (; j < len; ++j) m = std::max(m, AbsBits(static_cast<float>(x[j])));
  for (int k = 0; k < kChunk; ++k) m = std::max(m, lanes[k]);
  return m;
}

// Quantizes blocks [b0, b1); false if one holds a non-finite value.
template <typename T, typename Search>
bool QuantizeBlocks(const T* x, int64_t n, int64_t blocksize, int64_t b0, int64_t b1,
                    const Search& search, uint8_t zero_code, float* absmax, uint8_t* packed) {
  alignas(64) float s[4096];  // the largest blocksize, a multiple of kChunk
  alignas(64) int32_t codes[4096];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = b * blocksize;
    const int64_t len = std::min(blocksize, n - begin);
    const T* xb = x + begin;
    const uint32_t amax_bits = MaxAbsBits(xb, len);
    if (amax_bits >= kInfBits) return false;
    const float amax = FromAbsBits(amax_bits);
    absmax[b] = amax;
    // An all-zero block scales by 0, so every code is the code of 0.0
    // (NF4 7, FP4 0): bnb's default backend (bytes 0x77 for NF4). bnb's
    // CUDA kernel computes 0 * (1/0) = NaN there and writes code 0, which
    // for NF4 is -1.0: it decodes to -0.0 with a float32 absmax of 0, but
    // to -absmax' once double quant has made that absmax a nonzero
    // approximation; code 7 decodes to 0 either way.
    const float r = amax == 0.0f ? 0.0f : Reciprocal(amax);
    const int64_t padded = (len + kChunk - 1) / kChunk * kChunk;
    for (int64_t j = 0; j < len; ++j) s[j] = Clamp1(static_cast<float>(xb[j]) * r);
    for (int64_t j = len; j < padded; ++j) s[j] = 0.0f;
    for (int64_t j = 0; j < padded; j += kChunk) search.Chunk(s + j, codes + j);
    // Blocks start at an even index (blocksize is even): whole bytes.
    uint8_t* out = packed + begin / 2;
    int64_t j = 0;
    for (; j + 1 < len; j += 2) out[j / 2] = static_cast<uint8_t>((codes[j] << 4) | codes[j + 1]);
    // An odd numel: the last low nibble is padding, the code of 0.0.
    if (j < len) out[j / 2] = static_cast<uint8_t>((codes[j] << 4) | zero_code);
  }
  return true;
}

template <typename T>
int64_t FirstNonFinite(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(static_cast<float>(x[i]))) return i;
  }
  return -1;
}

// Double quant of the float32 absmax `a` [nblocks]: offset = torch's mean,
// then (a - offset) 8-bit blockwise in groups of 256 with the dynamic map.
absl::Status DoubleQuantize(const at::Tensor& a, Quantized4bit& q) {
  const int64_t nblocks = a.numel();
  const int64_t ngroups = NumBlocks(nblocks, kNestedBlocksize);
  float offset = 0.0f;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    offset = at::mean(a).item<float>();
    q.absmax = at::empty({nblocks}, at::kByte);
    q.nested_absmax = at::empty({ngroups}, at::kFloat);
    q.nested_quant_map = at::empty({256}, at::kFloat);
  }));
  if (!std::isfinite(offset)) {
    return absl::InvalidArgumentError(
        "weight: the mean of the block absmaxes overflows float32 (values too large for double "
        "quant)");
  }
  std::memcpy(q.nested_quant_map.data_ptr<float>(), DynamicMap().data(), 256 * sizeof(float));
  static const DynamicSearch search;
  const float* ap = a.data_ptr<float>();
  uint8_t* codes = q.absmax.data_ptr<uint8_t>();
  float* nested = q.nested_absmax.data_ptr<float>();
  at::parallel_for(0, ngroups, GrainFor(kNestedBlocksize * 8), [&](int64_t g0, int64_t g1) {
    float v[kNestedBlocksize];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t begin = g * kNestedBlocksize;
      const int64_t len = std::min(kNestedBlocksize, nblocks - begin);
      float nmax = 0.0f;
      for (int64_t j = 0; j < len; ++j) {
        v[j] = ap[begin + j] - offset;
        nmax = std::max(nmax, std::fabs(v[j]));
      }
      nested[g] = nmax;
      // A group equal to the offset throughout (one block, or equal absmaxes)
      // has nested absmax 0: code 127 (0.0); any code decodes to the offset.
      const float r = nmax == 0.0f ? 0.0f : Reciprocal(nmax);
      for (int64_t j = 0; j < len; ++j) codes[begin + j] = search(Clamp1(v[j] * r));
    }
  });
  q.state.double_quant = true;
  q.state.nested_blocksize = kNestedBlocksize;
  q.state.nested_offset = offset;
  return absl::OkStatus();
}

template <typename T>
void DequantizeBlocks(const uint8_t* packed, const float* absmax, const float* table, int64_t n,
                      int64_t blocksize, T* out) {
  const int64_t nblocks = NumBlocks(n, blocksize);
  at::parallel_for(0, nblocks, GrainFor(blocksize), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * blocksize;
      const int64_t end = std::min(n, begin + blocksize);
      // The 16 values this block can take: cast(code * absmax), the same
      // float32 multiply and rounding per element, done once per code.
      T value[16];
      for (int c = 0; c < 16; ++c) value[c] = static_cast<T>(table[c] * absmax[b]);
      // Blocks start at an even index: whole bytes, but for an odd end.
      int64_t j = begin;
      for (; j + 1 < end; j += 2) {
        const uint8_t byte = packed[j / 2];
        out[j] = value[byte >> 4];
        out[j + 1] = value[byte & 0xF];
      }
      if (j < end) out[j] = value[packed[j / 2] >> 4];
    }
  });
}

// ---------------------------------------------------------------------------
// JSON.

// Python's repr(float) of `v`: the shortest digits that round-trip, fixed
// notation for decimal exponents -4 < decpt <= 16, else d.ddde[+-]XX.
std::string PythonFloatRepr(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  std::string s(buf, res.ptr);
  std::string sign;
  if (s[0] == '-') {
    sign = "-";
    s.erase(0, 1);
  }
  const size_t e = s.find('e');
  const int exp10 = std::atoi(s.c_str() + e + 1);
  std::string digits;
  for (size_t i = 0; i < e; ++i) {
    if (s[i] != '.') digits += s[i];
  }
  const int decpt = exp10 + 1;  // value = 0.digits * 10^decpt
  const int nd = static_cast<int>(digits.size());
  std::string out;
  if (decpt <= -4 || decpt > 16) {
    out = digits.substr(0, 1);
    if (nd > 1) out += "." + digits.substr(1);
    const int ae = std::abs(exp10);
    out += absl::StrCat("e", exp10 < 0 ? "-" : "+", ae < 10 ? "0" : "", ae);
  } else if (decpt <= 0) {
    out = "0." + std::string(-decpt, '0') + digits;
  } else if (decpt >= nd) {
    out = digits + std::string(decpt - nd, '0') + ".0";
  } else {
    out = digits.substr(0, decpt) + "." + digits.substr(decpt);
  }
  return sign + out;
}

absl::StatusOr<Json> ParseJsonObject(absl::string_view text, absl::string_view label) {
  JsonLimits limits;
  limits.max_depth = 8;
  ACCEL_ASSIGN_OR_RETURN(Json json, ParseJson(text, label, limits));
  if (!json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": not a JSON object"));
  }
  return json;
}

absl::Status FieldError(absl::string_view label, absl::string_view key, absl::string_view expected,
                        const Json& got) {
  // The value as JSON, cut short: a bad shape may be a long list.
  constexpr size_t kMaxShown = 80;
  std::string shown = got.dump();
  if (shown.size() > kMaxShown) shown = shown.substr(0, kMaxShown) + "...";
  return absl::InvalidArgumentError(
      absl::StrCat(label, ": key '", key, "': expected ", expected, ", got ", shown));
}

std::optional<int64_t> AsInt(const Json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return static_cast<int64_t>(u);
    }
    return std::nullopt;
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

// The weight dtypes a quant state may name, in torch's spelling. bnb writes
// str(dtype).strip("torch."); a "torch." prefix (str(dtype) itself) is taken
// too.
std::optional<at::ScalarType> WeightDTypeFromName(absl::string_view name) {
  if (absl::StartsWith(name, "torch.")) name.remove_prefix(6);
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  return std::nullopt;
}

// Whether `entry` occurs in `name` as whole dotted components.
bool MatchesDotted(absl::string_view name, absl::string_view entry) {
  if (entry.empty()) return false;
  for (size_t pos = name.find(entry); pos != absl::string_view::npos;
       pos = name.find(entry, pos + 1)) {
    const size_t end = pos + entry.size();
    if ((pos == 0 || name[pos - 1] == '.') && (end == name.size() || name[end] == '.')) {
      return true;
    }
  }
  return false;
}

}  // namespace

// ---------------------------------------------------------------------------
// Public API.

absl::StatusOr<QuantType4bit> ParseQuantType4bit(absl::string_view name) {
  if (name == "nf4") return QuantType4bit::kNf4;
  if (name == "fp4") return QuantType4bit::kFp4;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown 4-bit quant type '", name, "' (expected 'nf4' or 'fp4')"));
}

const char* QuantType4bitName(QuantType4bit type) {
  return type == QuantType4bit::kNf4 ? "nf4" : "fp4";
}

const std::array<float, 16>& CodeTable(QuantType4bit type) {
  static const std::array<float, 16> fp4 = MakeFp4();
  return type == QuantType4bit::kNf4 ? kNf4 : fp4;
}

const std::array<float, 256>& DynamicMap() {
  static const std::array<float, 256> map = MakeDynamicMap();
  return map;
}

bool IsValidBlocksize4bit(int64_t blocksize) {
  return blocksize >= 32 && blocksize <= 4096 && (blocksize & (blocksize - 1)) == 0;
}

Layout4bit LayoutOf4bit(int64_t numel, int64_t blocksize, bool double_quant) {
  Layout4bit layout;
  layout.packed_shape = {(numel + 1) / 2, 1};
  layout.absmax_len = NumBlocks(numel, blocksize);
  layout.nested_absmax_len = double_quant ? NumBlocks(layout.absmax_len, kNestedBlocksize) : 0;
  return layout;
}

absl::StatusOr<Quantized4bit> Quantize4bit(const at::Tensor& weight, QuantType4bit type,
                                           int64_t blocksize, bool double_quant) {
  ACCEL_RETURN_IF_ERROR(CheckCpuTensor(weight, "weight"));
  if (!IsFloatingWeightType(weight.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight: dtype ", DTypeName(weight.scalar_type()), " is not float32, bfloat16 or float16"));
  }
  if (weight.numel() == 0) return absl::InvalidArgumentError("weight: empty tensor");
  if (!IsValidBlocksize4bit(blocksize)) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocksize ", blocksize, " is not one of 32, 64, ..., 4096"));
  }
  const int64_t n = weight.numel();
  const int64_t nblocks = NumBlocks(n, blocksize);
  Quantized4bit q;
  at::Tensor flat;
  at::Tensor absmax;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    flat = weight.contiguous();
    q.packed = at::empty({(n + 1) / 2, 1}, at::kByte);
    absmax = at::empty({nblocks}, at::kFloat);
    q.quant_map = at::empty({16}, at::kFloat);
  }));
  std::memcpy(q.quant_map.data_ptr<float>(), CodeTable(type).data(), 16 * sizeof(float));
  q.state.quant_type = type;
  q.state.blocksize = blocksize;
  q.state.dtype = weight.scalar_type();
  q.state.shape = weight.sizes().vec();

  static const Nf4Search nf4;
  static const Fp4Search fp4;
  int64_t bad = -1;
  auto run = [&](const auto* x) {
    std::atomic<bool> finite{true};
    float* am = absmax.data_ptr<float>();
    uint8_t* packed = q.packed.data_ptr<uint8_t>();
    at::parallel_for(0, nblocks, GrainFor(blocksize), [&](int64_t b0, int64_t b1) {
      const bool ok = type == QuantType4bit::kNf4
                          ? QuantizeBlocks(x, n, blocksize, b0, b1, nf4, 7, am, packed)
                          : QuantizeBlocks(x, n, blocksize, b0, b1, fp4, 0, am, packed);
      if (!ok) finite = false;
    });
    if (!finite) bad = FirstNonFinite(x, n);
  };
  switch (weight.scalar_type()) {
    case at::kFloat:
      run(flat.data_ptr<float>());
      break;
    case at::kBFloat16:
      run(flat.data_ptr<c10::BFloat16>());
      break;
    default:
      run(flat.data_ptr<c10::Half>());
      break;
  }
  if (bad >= 0) {
    return absl::InvalidArgumentError(absl::StrCat("weight: non-finite value at flat index ", bad));
  }
  if (!double_quant) {
    q.absmax = absmax;
    return q;
  }
  ACCEL_RETURN_IF_ERROR(DoubleQuantize(absmax, q));
  return q;
}

namespace {

// BlockAbsmax for a q that CheckQuantized4bit() accepted with numel `n`.
absl::StatusOr<at::Tensor> CheckedBlockAbsmax(const Quantized4bit& q, int64_t n) {
  at::Tensor out;
  if (!q.state.double_quant) {
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { out = q.absmax.reshape({-1}).contiguous(); }));
    return out;
  }
  const int64_t nblocks = NumBlocks(n, q.state.blocksize);
  at::Tensor codes, nested, map;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    codes = q.absmax.contiguous();
    nested = q.nested_absmax.contiguous();
    map = q.nested_quant_map.contiguous();
    out = at::empty({nblocks}, at::kFloat);
  }));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* np = nested.data_ptr<float>();
  const float* mp = map.data_ptr<float>();
  const float offset = q.state.nested_offset;
  float* op = out.data_ptr<float>();
  // bnb: dequantize_blockwise (one float32 multiply), then absmax += offset.
  for (int64_t b = 0; b < nblocks; ++b) {
    const float scaled = mp[cp[b]] * np[b / kNestedBlocksize];
    op[b] = scaled + offset;
  }
  return out;
}

}  // namespace

absl::Status CheckQuantized4bitLayout(const Quantized4bit& q) {
  return CheckQuantized4bit(q).status();
}

absl::StatusOr<at::Tensor> BlockAbsmax(const Quantized4bit& q) {
  ACCEL_ASSIGN_OR_RETURN(const int64_t n, CheckQuantized4bit(q));
  return CheckedBlockAbsmax(q, n);
}

absl::StatusOr<at::Tensor> Dequantize4bit(const Quantized4bit& q) {
  ACCEL_ASSIGN_OR_RETURN(const int64_t n, CheckQuantized4bit(q));
  ACCEL_ASSIGN_OR_RETURN(at::Tensor absmax, CheckedBlockAbsmax(q, n));
  at::Tensor packed, out;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    packed = q.packed.contiguous();
    out = at::empty({n}, q.state.dtype);
  }));
  // The built-in table, as bnb's dequantize_4bit op does (it takes the quant
  // type, not the stored quant_map).
  const float* table = CodeTable(q.state.quant_type).data();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* ap = absmax.data_ptr<float>();
  const int64_t bs = q.state.blocksize;
  switch (q.state.dtype) {
    case at::kFloat:
      DequantizeBlocks(pp, ap, table, n, bs, out.data_ptr<float>());
      break;
    case at::kBFloat16:
      DequantizeBlocks(pp, ap, table, n, bs, out.data_ptr<c10::BFloat16>());
      break;
    default:
      DequantizeBlocks(pp, ap, table, n, bs, out.data_ptr<c10::Half>());
      break;
  }
  ACCEL_RETURN_IF_ERROR(CallTorch([&] { out = out.reshape(q.state.shape); }));
  return out;
}

std::string QuantState4bitToJson(const QuantState4bit& state) {
  // json.dumps' default separators, as bnb's pack_dict_to_tensor writes them.
  std::string out = absl::StrCat("{\"quant_type\": \"", QuantType4bitName(state.quant_type),
                                 "\", \"blocksize\": ", state.blocksize, ", \"dtype\": \"",
                                 DTypeName(state.dtype), "\", \"shape\": [",
                                 absl::StrJoin(state.shape, ", "), "]");
  if (state.double_quant) {
    absl::StrAppend(&out, ", \"nested_blocksize\": ", state.nested_blocksize,
                    ", \"nested_dtype\": \"float32\", \"nested_offset\": ",
                    PythonFloatRepr(static_cast<double>(state.nested_offset)));
  }
  out += "}";
  return out;
}

absl::StatusOr<QuantState4bit> QuantState4bitFromJson(absl::string_view json,
                                                      absl::string_view label) {
  ACCEL_ASSIGN_OR_RETURN(Json obj, ParseJsonObject(json, label));
  auto get = [&](const char* key) -> const Json* {
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
  };
  auto missing = [&](const char* key) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": key '", key, "' is missing"));
  };
  QuantState4bit st;

  const Json* v = get("quant_type");
  if (v == nullptr) return missing("quant_type");
  if (!v->is_string() || !ParseQuantType4bit(v->get<std::string>()).ok()) {
    return FieldError(label, "quant_type", "\"nf4\" or \"fp4\"", *v);
  }
  st.quant_type = *ParseQuantType4bit(v->get<std::string>());

  v = get("blocksize");
  if (v == nullptr) return missing("blocksize");
  if (!AsInt(*v) || !IsValidBlocksize4bit(*AsInt(*v))) {
    return FieldError(label, "blocksize", "one of 32, 64, ..., 4096", *v);
  }
  st.blocksize = *AsInt(*v);

  v = get("dtype");
  if (v == nullptr) return missing("dtype");
  std::optional<at::ScalarType> dtype;
  if (v->is_string()) dtype = WeightDTypeFromName(v->get<std::string>());
  if (!dtype) return FieldError(label, "dtype", "\"float32\", \"bfloat16\" or \"float16\"", *v);
  st.dtype = *dtype;

  v = get("shape");
  if (v == nullptr) return missing("shape");
  if (!v->is_array()) return FieldError(label, "shape", "a list of non-negative integers", *v);
  for (const Json& d : *v) {
    const std::optional<int64_t> i = AsInt(d);
    if (!i || *i < 0) return FieldError(label, "shape", "a list of non-negative integers", *v);
    st.shape.push_back(*i);
  }
  if (!NumelOf(st.shape, "").ok()) {
    return FieldError(label, "shape", "a shape of at most 2^62 elements", *v);
  }

  // bnb writes the three nested keys together; any one of them means
  // double quant, and then all three must be there.
  const char* const kNested[] = {"nested_blocksize", "nested_dtype", "nested_offset"};
  for (const char* key : kNested) st.double_quant = st.double_quant || get(key) != nullptr;
  if (!st.double_quant) return st;
  for (const char* key : kNested) {
    if (get(key) == nullptr) return missing(key);
  }
  v = get("nested_blocksize");
  if (AsInt(*v) != kNestedBlocksize) return FieldError(label, "nested_blocksize", "256", *v);
  st.nested_blocksize = kNestedBlocksize;
  v = get("nested_dtype");
  if (!v->is_string() || WeightDTypeFromName(v->get<std::string>()) != at::kFloat) {
    return FieldError(label, "nested_dtype", "\"float32\"", *v);
  }
  v = get("nested_offset");
  if (!v->is_number() || !std::isfinite(static_cast<float>(v->get<double>()))) {
    return FieldError(label, "nested_offset", "a finite float32 number", *v);
  }
  st.nested_offset = static_cast<float>(v->get<double>());
  return st;
}

absl::StatusOr<QuantizedInt8> QuantizeInt8(const at::Tensor& weight) {
  ACCEL_RETURN_IF_ERROR(CheckCpuTensor(weight, "weight"));
  if (!IsFloatingWeightType(weight.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight: dtype ", DTypeName(weight.scalar_type()), " is not float32, bfloat16 or float16"));
  }
  if (weight.dim() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight: expected 2 dimensions [out, in], got ", weight.dim()));
  }
  const int64_t rows = weight.size(0), cols = weight.size(1);
  at::Tensor half;
  QuantizedInt8 q;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    // bnb's Int8Params casts to float16 first (bf16 too): one RNE rounding
    // from float32 (bf16 -> float32 is exact).
    half = weight.to(at::kHalf).contiguous();
    q.weight = at::empty({rows, cols}, at::kChar);
    q.scb = at::empty({rows}, at::kFloat);
  }));
  const c10::Half* h = half.data_ptr<c10::Half>();
  const int64_t bad = FirstNonFinite(h, rows * cols);
  if (bad >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight: value at [", bad / cols, ", ", bad % cols,
        "] is not finite in float16 (bnb casts the weight to float16 before quantizing)"));
  }
  int8_t* cb = q.weight.data_ptr<int8_t>();
  float* scb = q.scb.data_ptr<float>();
  at::parallel_for(0, rows, GrainFor(cols), [&](int64_t r0, int64_t r1) {
    std::vector<float> v(cols);
    for (int64_t r = r0; r < r1; ++r) {
      const c10::Half* row = h + r * cols;
      int8_t* out = cb + r * cols;
      for (int64_t k = 0; k < cols; ++k) v[k] = static_cast<float>(row[k]);
      const float amax = FromAbsBits(MaxAbsBits(v.data(), cols));
      scb[r] = amax;
      // An all-zero row: bnb would scale by 127/0 = inf; we emit zeros (the
      // reference's advice) by scaling with 0.
      const float scale = amax == 0.0f ? 0.0f : 127.0f / amax;
      for (int64_t k = 0; k < cols; ++k) {
        // Round half to even, as torch.round and CUDA's __float2int_rn do:
        // adding and removing 1.5 * 2^23 rounds |x| < 2^22 to an integer in
        // the default rounding mode (std::nearbyint is a libm call here).
        const float x = std::min(127.0f, std::max(-127.0f, v[k] * scale));
        out[k] = static_cast<int8_t>((x + kRoundMagic) - kRoundMagic);
      }
    }
  });
  return q;
}

absl::StatusOr<at::Tensor> DequantizeInt8(const QuantizedInt8& q, at::ScalarType dtype) {
  if (!IsFloatingWeightType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype: ", DTypeName(dtype), " is not float32, bfloat16 or float16"));
  }
  ACCEL_RETURN_IF_ERROR(CheckCpuTensor(q.weight, "weight (int8)"));
  if (q.weight.scalar_type() != at::kChar || q.weight.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("weight (int8): expected int8 [out, in], got ",
                                                   DTypeName(q.weight.scalar_type()), " with ",
                                                   q.weight.dim(), " dimensions"));
  }
  const int64_t rows = q.weight.size(0), cols = q.weight.size(1);
  ACCEL_RETURN_IF_ERROR(CheckTensor(q.scb, "SCB", at::kFloat, rows));
  at::Tensor cb, scb, out;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    cb = q.weight.contiguous();
    scb = q.scb.contiguous();
    out = at::empty({rows, cols}, dtype);
  }));
  const int8_t* cp = cb.data_ptr<int8_t>();
  const float* sp = scb.data_ptr<float>();
  // bnb's int8_vectorwise_dequant: A * stats * 7.874015718698502e-3, float32
  // left to right (the constant is 1/127 rounded to float32).
  constexpr float kInv127 = 7.874015718698502e-3f;
  auto run = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    at::parallel_for(0, rows, GrainFor(cols), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t k = 0; k < cols; ++k) {
          op[r * cols + k] = static_cast<T>(static_cast<float>(cp[r * cols + k]) * sp[r] * kInv127);
        }
      }
    });
  };
  switch (dtype) {
    case at::kFloat:
      run(out.data_ptr<float>());
      break;
    case at::kBFloat16:
      run(out.data_ptr<c10::BFloat16>());
      break;
    default:
      run(out.data_ptr<c10::Half>());
      break;
  }
  return out;
}

int64_t StoredBytes4bit(int64_t numel, int64_t blocksize, bool double_quant) {
  const int64_t nblocks = NumBlocks(numel, blocksize);
  int64_t bytes = (numel + 1) / 2 + int64_t{16} * 4;  // packed codes + quant_map
  if (double_quant) {
    bytes += nblocks + NumBlocks(nblocks, kNestedBlocksize) * 4 + int64_t{256} * 4;
  } else {
    bytes += nblocks * 4;
  }
  return bytes;
}

int64_t StoredBytesInt8(int64_t out_features, int64_t in_features) {
  // weight int8 [out, in] + SCB float32 [out] + weight_format uint8 [].
  return out_features * in_features + out_features * 4 + 1;
}

std::vector<std::string> BnbQuantizationConfig::SkipModules() const {
  std::vector<std::string> skip =
      llm_int8_skip_modules ? *llm_int8_skip_modules : std::vector<std::string>{"lm_head"};
  // transformers adds the model's keep-in-fp32 modules to the modules it
  // does not convert.
  skip.insert(skip.end(), keep_in_fp32_modules.begin(), keep_in_fp32_modules.end());
  return skip;
}

bool BnbQuantizationConfig::Quantizes(absl::string_view name) const {
  if (!enabled()) return false;
  for (const std::string& entry : SkipModules()) {
    if (MatchesDotted(name, entry)) return false;
  }
  return true;
}

absl::StatusOr<BnbQuantizationConfig> BnbConfigFromJson(absl::string_view json,
                                                        absl::string_view label) {
  ACCEL_ASSIGN_OR_RETURN(Json obj, ParseJsonObject(json, label));
  BnbQuantizationConfig c;
  // A null value means "the default", as transformers' keyword arguments do.
  auto get = [&](const char* key) -> const Json* {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  };
  auto get_bool = [&](const char* key, bool* out) -> absl::Status {
    const Json* v = get(key);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_boolean()) return FieldError(label, key, "true or false", *v);
    *out = v->get<bool>();
    return absl::OkStatus();
  };

  if (const Json* v = get("quant_method")) {
    if (!v->is_string() || v->get<std::string>() != "bitsandbytes") {
      return FieldError(label, "quant_method", "\"bitsandbytes\"", *v);
    }
  }
  // to_dict() writes "_load_in_4bit" next to "load_in_4bit" (the private
  // attribute behind the property); the public key wins, the private one is
  // a fallback for configs that carry only it.
  ACCEL_RETURN_IF_ERROR(get_bool("_load_in_8bit", &c.load_in_8bit));
  ACCEL_RETURN_IF_ERROR(get_bool("_load_in_4bit", &c.load_in_4bit));
  ACCEL_RETURN_IF_ERROR(get_bool("load_in_8bit", &c.load_in_8bit));
  ACCEL_RETURN_IF_ERROR(get_bool("load_in_4bit", &c.load_in_4bit));
  if (c.load_in_8bit == c.load_in_4bit) {
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": keys 'load_in_8bit' and 'load_in_4bit': exactly one must be true, got ",
        c.load_in_8bit ? "both" : "neither"));
  }
  if (const Json* v = get("llm_int8_threshold")) {
    if (!v->is_number()) return FieldError(label, "llm_int8_threshold", "a number", *v);
    c.llm_int8_threshold = v->get<double>();
  }
  if (const Json* v = get("bnb_4bit_quant_type")) {
    if (!v->is_string() || !ParseQuantType4bit(v->get<std::string>()).ok()) {
      return FieldError(label, "bnb_4bit_quant_type", "\"nf4\" or \"fp4\"", *v);
    }
    c.bnb_4bit_quant_type = *ParseQuantType4bit(v->get<std::string>());
  }
  ACCEL_RETURN_IF_ERROR(get_bool("bnb_4bit_use_double_quant", &c.bnb_4bit_use_double_quant));
  if (const Json* v = get("bnb_4bit_compute_dtype")) {
    absl::StatusOr<c10::ScalarType> dtype = absl::InvalidArgumentError("");
    if (v->is_string()) dtype = ParseDType(v->get<std::string>());
    if (!dtype.ok() || !IsFloatingWeightType(*dtype)) {
      return FieldError(label, "bnb_4bit_compute_dtype", "\"float32\", \"bfloat16\" or \"float16\"",
                        *v);
    }
    c.bnb_4bit_compute_dtype = *dtype;
  }
  if (const Json* v = get("bnb_4bit_quant_storage")) {
    absl::StatusOr<c10::ScalarType> dtype = absl::InvalidArgumentError("");
    if (v->is_string()) dtype = ParseDType(v->get<std::string>());
    if (!dtype.ok() || *dtype != at::kByte) {
      return FieldError(label, "bnb_4bit_quant_storage", "\"uint8\" (the only storage supported)",
                        *v);
    }
  }
  ACCEL_RETURN_IF_ERROR(
      get_bool("llm_int8_enable_fp32_cpu_offload", &c.llm_int8_enable_fp32_cpu_offload));
  ACCEL_RETURN_IF_ERROR(get_bool("llm_int8_has_fp16_weight", &c.llm_int8_has_fp16_weight));
  if (c.llm_int8_has_fp16_weight) {
    return absl::InvalidArgumentError(absl::StrCat(
        label,
        ": key 'llm_int8_has_fp16_weight' is true: bitsandbytes' int8 training mode (float16 "
        "weights kept and quantized at every forward), which accel does not serve; the int8 "
        "weights it serves are quantized once (set it to false)"));
  }
  if (const Json* v = get("llm_int8_skip_modules")) {
    std::vector<std::string> modules;
    if (!v->is_array()) return FieldError(label, "llm_int8_skip_modules", "a list of strings", *v);
    for (const Json& m : *v) {
      if (!m.is_string())
        return FieldError(label, "llm_int8_skip_modules", "a list of strings", *v);
      modules.push_back(m.get<std::string>());
    }
    c.llm_int8_skip_modules = std::move(modules);
  }
  return c;
}

std::string BnbConfigToJson(const BnbQuantizationConfig& config) {
  // nlohmann::json keeps keys sorted, as config.json has them
  // (to_json_string(sort_keys=True)).
  Json out = Json::object();
  out["quant_method"] = "bitsandbytes";
  out["_load_in_4bit"] = config.load_in_4bit;
  out["_load_in_8bit"] = config.load_in_8bit;
  out["load_in_4bit"] = config.load_in_4bit;
  out["load_in_8bit"] = config.load_in_8bit;
  out["bnb_4bit_quant_type"] = QuantType4bitName(config.bnb_4bit_quant_type);
  out["bnb_4bit_use_double_quant"] = config.bnb_4bit_use_double_quant;
  out["bnb_4bit_compute_dtype"] = std::string(DTypeName(config.bnb_4bit_compute_dtype));
  out["bnb_4bit_quant_storage"] = "uint8";
  out["llm_int8_threshold"] = config.llm_int8_threshold;
  out["llm_int8_has_fp16_weight"] = config.llm_int8_has_fp16_weight;
  if (config.llm_int8_skip_modules) {
    out["llm_int8_skip_modules"] = *config.llm_int8_skip_modules;
  } else {
    out["llm_int8_skip_modules"] = nullptr;
  }
  out["llm_int8_enable_fp32_cpu_offload"] = config.llm_int8_enable_fp32_cpu_offload;
  return out.dump();
}

}  // namespace accel::quant
