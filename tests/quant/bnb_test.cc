// quant/bnb.h against bitsandbytes' rules as ../shared/reference/bitsandbytes.md
// states them: the tables by their bits (and the dynamic map by its sha256),
// the worked example, every threshold and its neighbours, a plain-loop
// reference quantizer compared byte for byte, bnb's published error
// statistics, the dequantize formulas, the JSON formats and the byte counts.
#include "quant/bnb.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "core/dtype.h"
#include "tests/testing/status_matchers.h"

namespace accel::quant {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

at::Tensor FloatTensor(const std::vector<float>& v) {
  return at::from_blob(const_cast<float*>(v.data()), {static_cast<int64_t>(v.size())}, at::kFloat)
      .clone();
}
std::vector<float> ToVector(const at::Tensor& t) {
  at::Tensor f = t.to(at::kFloat).contiguous().reshape({-1});
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}
std::vector<uint8_t> Bytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous().reshape({-1});
  return std::vector<uint8_t>(c.data_ptr<uint8_t>(), c.data_ptr<uint8_t>() + c.numel());
}

// ---------------------------------------------------------------------------
// A small SHA-256 (FIPS 180-4), for the dynamic map's published digest.
std::string Sha256Hex(const uint8_t* data, size_t len) {
  static const uint32_t k[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
      0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
      0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
      0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
      0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
      0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
      0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
      0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
      0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
      0xc67178f2};
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::vector<uint8_t> msg(data, data + len);
  msg.push_back(0x80);
  while (msg.size() % 64 != 56) msg.push_back(0);
  const uint64_t bits = static_cast<uint64_t>(len) * 8;
  for (int i = 7; i >= 0; --i) msg.push_back(static_cast<uint8_t>(bits >> (8 * i)));
  auto rotr = [](uint32_t x, int n) { return (x >> n) | (x << (32 - n)); };
  for (size_t off = 0; off < msg.size(); off += 64) {
    uint32_t w[64];
    for (size_t i = 0; i < 16; ++i) {
      w[i] = (uint32_t{msg[off + 4 * i]} << 24) | (uint32_t{msg[off + 4 * i + 1]} << 16) |
             (uint32_t{msg[off + 4 * i + 2]} << 8) | uint32_t{msg[off + 4 * i + 3]};
    }
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 =
          hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
  }
  std::string hex;
  char buf[9];
  for (uint32_t v : h) {
    std::snprintf(buf, sizeof(buf), "%08x", v);
    hex += buf;
  }
  return hex;
}

TEST(Sha256Test, KnownDigests) {
  EXPECT_EQ(Sha256Hex(nullptr, 0),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const std::string abc = "abc";
  EXPECT_EQ(Sha256Hex(reinterpret_cast<const uint8_t*>(abc.data()), abc.size()),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(Sha256Hex(reinterpret_cast<const uint8_t*>(two.data()), two.size()),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

// ---------------------------------------------------------------------------
// Tables.

// Reference §1.1.
constexpr uint32_t kNf4Hex[16] = {
    0xbf800000, 0xbf3239b1, 0xbf066b30, 0xbeca32a0, 0xbe91a24d, 0xbe3d353f, 0xbdba7871, 0x00000000,
    0x3da2faff, 0x3e24cae3, 0x3e7c04dd, 0x3ead033a, 0x3ee1a4b8, 0x3f1007ab, 0x3f3913b3, 0x3f800000};
constexpr uint32_t kFp4Hex[16] = {
    0x00000000, 0x3baaaaab, 0x3f2aaaab, 0x3f800000, 0x3eaaaaab, 0x3f000000, 0x3e2aaaab, 0x3e800000,
    0x80000000, 0xbbaaaaab, 0xbf2aaaab, 0xbf800000, 0xbeaaaaab, 0xbf000000, 0xbe2aaaab, 0xbe800000};
// Reference §1.2: the 15 NF4 thresholds (bnb's CUDA literals).
constexpr uint32_t kNf4ThresholdHex[15] = {
    0xbf591cd8, 0xbf1c5270, 0xbeeb8480, 0xbeadea76, 0xbe703cec, 0xbe0d38bc, 0xbd3a7871, 0x3d22faff,
    0x3df64862, 0x3e5067e0, 0x3e9582d4, 0x3ec753f9, 0x3f006d04, 0x3f248daf, 0x3f5c89da};
// bnb's CUDA dQuantizeFP4 literals, ascending, and the code above each.
constexpr float kFp4Literal[7] = {0.00260417f, 0.0859375f, 0.20833333f, 0.29166667f,
                                  0.4166667f,  0.583333f,  0.8333333f};
constexpr uint8_t kFp4CodeAbove[8] = {0, 1, 6, 7, 4, 5, 2, 3};

TEST(CodeTableTest, Nf4AndFp4AreBnbsFloat32Values) {
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(Bits(CodeTable(QuantType4bit::kNf4)[i]), kNf4Hex[i]) << "nf4 code " << i;
    EXPECT_EQ(Bits(CodeTable(QuantType4bit::kFp4)[i]), kFp4Hex[i]) << "fp4 code " << i;
  }
}

TEST(CodeTableTest, Nf4ThresholdsAreTheFloat32Midpoints) {
  const auto& nf4 = CodeTable(QuantType4bit::kNf4);
  for (int i = 0; i < 15; ++i) {
    EXPECT_EQ(Bits((nf4[i] + nf4[i + 1]) / 2.0f), kNf4ThresholdHex[i]) << i;
  }
}

TEST(DynamicMapTest, Sha256OfLittleEndianFloat32) {
  const std::array<float, 256>& map = DynamicMap();
  std::vector<uint8_t> bytes;
  for (float f : map) {
    const uint32_t u = Bits(f);
    for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<uint8_t>(u >> (8 * i)));
  }
  EXPECT_EQ(Sha256Hex(bytes.data(), bytes.size()),
            "6d0ca9fed140bc2c31b9be3292029e22a209f6955020e65b13ceb5d7592f4e25");
}

TEST(DynamicMapTest, SpotChecksOfThePrintedTable) {
  const std::array<float, 256>& m = DynamicMap();
  // Rows 0, 64, 112 and 240 of reference §2.3, and its stated properties.
  const std::vector<std::pair<int, std::vector<uint32_t>>> rows = {
      {0,
       {0xbf7e3333, 0xbf7a9999, 0xbf770000, 0xbf736666, 0xbf6fcccc, 0xbf6c3333, 0xbf68999a,
        0xbf650000}},
      {64,
       {0xbdc9eb85, 0xbdc428f5, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c28,
        0xbda1999a}},
      {112,
       {0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705,
        0xb923d70b, 0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94,
        0xb513a3b7, 0x00000000}},
      {128, {0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206}},
      {240,
       {0x3f4bcccc, 0x3f4f6666, 0x3f530000, 0x3f569999, 0x3f5a3333, 0x3f5dcccc, 0x3f616666,
        0x3f650000, 0x3f68999a, 0x3f6c3333, 0x3f6fcccc, 0x3f736666, 0x3f770000, 0x3f7a9999,
        0x3f7e3333, 0x3f800000}},
  };
  for (const auto& [start, hex] : rows) {
    for (size_t i = 0; i < hex.size(); ++i) {
      EXPECT_EQ(Bits(m[start + i]), hex[i]) << "index " << start + i;
    }
  }
  EXPECT_EQ(m[127], 0.0f);
  EXPECT_EQ(m[255], 1.0f);
  EXPECT_EQ(m[0], -0.99296874f);
  for (int i = 0; i + 1 < 256; ++i) EXPECT_LT(m[i], m[i + 1]) << i;
}

TEST(BlocksizeTest, PowersOfTwoFrom32To4096) {
  for (int64_t bs : {32, 64, 128, 256, 512, 1024, 2048, 4096})
    EXPECT_TRUE(IsValidBlocksize4bit(bs));
  for (int64_t bs : {0, -64, 16, 48, 100, 8192}) EXPECT_FALSE(IsValidBlocksize4bit(bs)) << bs;
}

TEST(QuantTypeTest, ParsesAndNames) {
  EXPECT_EQ(*ParseQuantType4bit("nf4"), QuantType4bit::kNf4);
  EXPECT_EQ(*ParseQuantType4bit("fp4"), QuantType4bit::kFp4);
  EXPECT_STREQ(QuantType4bitName(QuantType4bit::kNf4), "nf4");
  EXPECT_STREQ(QuantType4bitName(QuantType4bit::kFp4), "fp4");
  EXPECT_THAT(ParseQuantType4bit("NF4"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NF4")));
  EXPECT_THAT(ParseQuantType4bit("int4"), StatusIs(absl::StatusCode::kInvalidArgument));
}

// ---------------------------------------------------------------------------
// A straightforward reference quantizer: plain loops over the rules of the
// reference, with its thresholds transcribed from the document.

uint8_t RefNf4(float s) {
  uint8_t code = 0;
  for (uint32_t t : kNf4ThresholdHex) code += s > FromBits(t) ? 1 : 0;
  return code;
}

// bnb's dQuantizeFP4 tree as written in csrc/kernels.cu (reference §1.2).
uint8_t RefFp4(float x) {
  const uint8_t sign = x < 0 ? 8 : 0;
  x = std::fabs(x);
  if (x > 0.29166667f) {
    if (x > 0.583333f) return x > 0.8333333f ? 3 + sign : 2 + sign;
    return x > 0.4166667f ? 5 + sign : 4 + sign;
  }
  if (x > 0.0859375f) return x > 0.20833333f ? 7 + sign : 6 + sign;
  return x > 0.00260417f ? 1 + sign : 0 + sign;
}

uint8_t RefDynamic(float s) {
  const auto& m = DynamicMap();
  uint8_t code = 0;
  for (int j = 0; j + 1 < 256; ++j) code += s > (m[j] + m[j + 1]) / 2.0f ? 1 : 0;
  return code;
}

struct RefResult {
  std::vector<uint8_t> packed;
  std::vector<float> absmax;         // float32 (no double quant)
  std::vector<uint8_t> absmax_u8;    // with double quant
  std::vector<float> nested_absmax;  // with double quant
  float offset = 0;
};

RefResult RefQuantize(const std::vector<float>& x, QuantType4bit type, int64_t bs, bool dq) {
  const int64_t n = static_cast<int64_t>(x.size());
  const int64_t nblocks = (n + bs - 1) / bs;
  std::vector<uint8_t> codes(n + 1);
  RefResult r;
  for (int64_t b = 0; b < nblocks; ++b) {
    float amax = 0;
    for (int64_t j = b * bs; j < std::min(n, (b + 1) * bs); ++j) {
      amax = std::max(amax, std::fabs(x[j]));
    }
    r.absmax.push_back(amax);
    for (int64_t j = b * bs; j < std::min(n, (b + 1) * bs); ++j) {
      // An all-zero block: s = 0 (bnb's default backend; see bnb.cc).
      const float s = amax == 0 ? 0.0f : std::min(1.0f, std::max(-1.0f, x[j] * (1.0f / amax)));
      codes[j] = type == QuantType4bit::kNf4 ? RefNf4(s) : RefFp4(s);
    }
  }
  // The padding nibble: the code of 0.0 (NF4 7, FP4 0).
  if (n % 2 == 1) codes[n] = type == QuantType4bit::kNf4 ? 7 : 0;
  for (int64_t i = 0; i < n; i += 2) {
    r.packed.push_back(static_cast<uint8_t>(codes[i] << 4 | codes[i + 1]));
  }
  if (dq) {
    r.offset = at::mean(FloatTensor(r.absmax)).item<float>();
    for (int64_t g = 0; g * 256 < nblocks; ++g) {
      float nmax = 0;
      for (int64_t b = g * 256; b < std::min(nblocks, (g + 1) * 256); ++b) {
        nmax = std::max(nmax, std::fabs(r.absmax[b] - r.offset));
      }
      r.nested_absmax.push_back(nmax);
      for (int64_t b = g * 256; b < std::min(nblocks, (g + 1) * 256); ++b) {
        const float v = r.absmax[b] - r.offset;
        const float s = nmax == 0 ? 0.0f : std::min(1.0f, std::max(-1.0f, v * (1.0f / nmax)));
        r.absmax_u8.push_back(RefDynamic(s));
      }
    }
  }
  return r;
}

// Gaussian values with a block-varying scale, some exact zeros and zero runs.
std::vector<float> RandomWeights(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> pick(0, 99);
  std::vector<float> x(n);
  float scale = 1;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 37 == 0) scale = std::exp2(static_cast<float>(pick(rng) % 20 - 10));
    const int p = pick(rng);
    x[i] = p < 3 ? 0.0f : normal(rng) * scale;
  }
  if (n > 200) std::fill(x.begin() + 100, x.begin() + 200, 0.0f);
  return x;
}

void ExpectMatchesReference(const std::vector<float>& x, QuantType4bit type, int64_t bs, bool dq) {
  SCOPED_TRACE(::testing::Message() << "n=" << x.size() << " type=" << QuantType4bitName(type)
                                    << " blocksize=" << bs << " dq=" << dq);
  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit q, Quantize4bit(FloatTensor(x), type, bs, dq));
  const RefResult r = RefQuantize(x, type, bs, dq);
  EXPECT_EQ(Bytes(q.packed), r.packed);
  if (!dq) {
    EXPECT_EQ(ToVector(q.absmax), r.absmax);
    return;
  }
  EXPECT_EQ(Bits(q.state.nested_offset), Bits(r.offset));
  EXPECT_EQ(Bytes(q.absmax), r.absmax_u8);
  EXPECT_EQ(ToVector(q.nested_absmax), r.nested_absmax);
}

TEST(Quantize4bitTest, MatchesThePlainLoopReferenceByteForByte) {
  uint32_t seed = 1;
  for (QuantType4bit type : {QuantType4bit::kNf4, QuantType4bit::kFp4}) {
    for (bool dq : {false, true}) {
      for (int64_t bs : {32, 64, 128, 256, 4096}) {
        for (int64_t n : {1, 2, 33, 64, 1001, 4096 + 17, 70000}) {
          ExpectMatchesReference(RandomWeights(n, seed++), type, bs, dq);
        }
      }
    }
  }
  // More than 256 blocks: several nested groups, the last partial.
  ExpectMatchesReference(RandomWeights(64 * 700 + 5, 99), QuantType4bit::kNf4, 64, true);
  ExpectMatchesReference(RandomWeights(int64_t{32} * 1000, 98), QuantType4bit::kFp4, 32, true);
}

TEST(Quantize4bitTest, WorkedExampleOfTheReference) {
  const std::vector<float> x = {0.8f, -2.0f, 0.05f, 1.0f};
  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit nf4,
                             Quantize4bit(FloatTensor(x), QuantType4bit::kNf4, 64, false));
  EXPECT_THAT(Bytes(nf4.packed), ElementsAre(0xC0, 0x7C));
  EXPECT_THAT(ToVector(nf4.absmax), ElementsAre(2.0f));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor back, Dequantize4bit(nf4));
  EXPECT_THAT(ToVector(back),
              ElementsAre(0.44070982933044434f * 2.0f, -2.0f, 0.0f, 0.44070982933044434f * 2.0f));
  EXPECT_NEAR(ToVector(back)[0], 0.8814197, 1e-7);

  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit fp4,
                             Quantize4bit(FloatTensor(x), QuantType4bit::kFp4, 64, false));
  EXPECT_THAT(Bytes(fp4.packed), ElementsAre(4 << 4 | 11, 1 << 4 | 5));
  ACCEL_ASSERT_OK_AND_ASSIGN(back, Dequantize4bit(fp4));
  const std::vector<float> v = ToVector(back);
  EXPECT_NEAR(v[0], 0.6666667, 1e-7);
  EXPECT_EQ(v[1], -2.0f);
  EXPECT_NEAR(v[2], 0.0104167, 1e-7);
  EXPECT_EQ(v[3], 1.0f);
}

// The code of s in a block whose absmax is 1.0 (so s = x exactly).
uint8_t CodeOf(float s, QuantType4bit type) {
  auto q = Quantize4bit(FloatTensor({1.0f, s}), type, 64, false);
  EXPECT_THAT(q, IsOk());
  return q.ok() ? Bytes(q->packed)[0] & 0xF : 255;
}

TEST(Quantize4bitTest, EveryNf4ThresholdGoesToTheLowerCode) {
  for (int i = 0; i < 15; ++i) {
    const float t = FromBits(kNf4ThresholdHex[i]);
    EXPECT_EQ(CodeOf(t, QuantType4bit::kNf4), i) << "at threshold " << i;
    EXPECT_EQ(CodeOf(std::nextafter(t, -2.0f), QuantType4bit::kNf4), i) << "below " << i;
    EXPECT_EQ(CodeOf(std::nextafter(t, 2.0f), QuantType4bit::kNf4), i + 1) << "above " << i;
  }
  // The reference's example: s exactly on the 7/8 threshold.
  EXPECT_EQ(CodeOf(0.03979014977812767f, QuantType4bit::kNf4), 7);
  EXPECT_EQ(CodeOf(-1.0f, QuantType4bit::kNf4), 0);
  EXPECT_EQ(CodeOf(0.0f, QuantType4bit::kNf4), 7);
  EXPECT_EQ(CodeOf(-0.0f, QuantType4bit::kNf4), 7);
}

TEST(Quantize4bitTest, Fp4LiteralsOfBnbsCudaTree) {
  for (int i = 0; i < 7; ++i) {
    const float t = kFp4Literal[i];
    const uint8_t below = kFp4CodeAbove[i], above = kFp4CodeAbove[i + 1];
    EXPECT_EQ(CodeOf(t, QuantType4bit::kFp4), below) << i;
    EXPECT_EQ(CodeOf(std::nextafter(t, -2.0f), QuantType4bit::kFp4), below) << i;
    EXPECT_EQ(CodeOf(std::nextafter(t, 2.0f), QuantType4bit::kFp4), above) << i;
    EXPECT_EQ(CodeOf(-t, QuantType4bit::kFp4), below | 8) << i;
    EXPECT_EQ(CodeOf(-std::nextafter(t, 2.0f), QuantType4bit::kFp4), above | 8) << i;
  }
  // 0.583333f is 6 ulp below the true midpoint 3f155556: values between go to 2.
  EXPECT_EQ(Bits(0.583333f), 0x3f155550u);
  EXPECT_EQ(CodeOf(FromBits(0x3f155553), QuantType4bit::kFp4), 2);
  EXPECT_EQ(CodeOf(0.0f, QuantType4bit::kFp4), 0);
  EXPECT_EQ(CodeOf(-0.0f, QuantType4bit::kFp4), 0);  // -0.0 < 0 is false: no sign bit
  EXPECT_EQ(CodeOf(-1e-30f, QuantType4bit::kFp4), 8);
  EXPECT_EQ(CodeOf(1.0f, QuantType4bit::kFp4), 3);
  EXPECT_EQ(CodeOf(-1.0f, QuantType4bit::kFp4), 11);
}

TEST(Quantize4bitTest, PartialLastBlockHasItsOwnAbsmax) {
  std::vector<float> x(64 + 10, 0.5f);
  x[3] = -4.0f;   // block 0
  x[70] = 0.25f;  // block 1: ten values, absmax 0.5
  x[73] = -0.5f;
  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit q,
                             Quantize4bit(FloatTensor(x), QuantType4bit::kNf4, 64, false));
  EXPECT_THAT(ToVector(q.absmax), ElementsAre(4.0f, 0.5f));
  EXPECT_EQ(q.packed.sizes(), (std::vector<int64_t>{37, 1}));
  const std::vector<uint8_t> b = Bytes(q.packed);
  // Block 0: 0.5 / 4 = 0.125 -> code 9; -4 -> code 0.
  EXPECT_EQ(b[0], 0x99);
  EXPECT_EQ(b[1], 0x90);
  EXPECT_EQ(b[31], 0x99);
  // Block 1 (scaled by 1 / 0.5): 1 -> 15, 0.5 -> 12, -1 -> 0.
  EXPECT_EQ(b[32], 0xFF);
  EXPECT_EQ(b[35], 0xCF);
  EXPECT_EQ(b[36], 0xF0);
}

TEST(Quantize4bitTest, OddNumelPadsTheLastLowNibbleWithTheCodeOfZero) {
  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit nf4, Quantize4bit(FloatTensor({1.0f, -1.0f, 1.0f}),
                                                             QuantType4bit::kNf4, 64, false));
  EXPECT_THAT(Bytes(nf4.packed), ElementsAre(0xF0, 0xF7));
  EXPECT_EQ(nf4.packed.sizes(), (std::vector<int64_t>{2, 1}));
  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit fp4, Quantize4bit(FloatTensor({1.0f, -1.0f, -1.0f}),
                                                             QuantType4bit::kFp4, 64, false));
  EXPECT_THAT(Bytes(fp4.packed), ElementsAre(0x3B, 0xB0));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor back, Dequantize4bit(fp4));
  EXPECT_THAT(ToVector(back), ElementsAre(1.0f, -1.0f, -1.0f));
}

TEST(Quantize4bitTest, AllZeroBlockGetsAbsmaxZeroAndDecodesToZero) {
  for (QuantType4bit type : {QuantType4bit::kNf4, QuantType4bit::kFp4}) {
    SCOPED_TRACE(QuantType4bitName(type));
    // Blocks: zeros (one of them -0.0), values, zeros with an odd count.
    std::vector<float> x(64 + 64 + 33, 0.0f);
    x[10] = -0.0f;
    for (int i = 64; i < 128; ++i) x[i] = static_cast<float>(i - 90) / 8;
    const uint8_t zero_byte = type == QuantType4bit::kNf4 ? 0x77 : 0x00;
    for (bool dq : {false, true}) {
      ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit q, Quantize4bit(FloatTensor(x), type, 64, dq));
      if (!dq) {
        EXPECT_THAT(ToVector(q.absmax), ElementsAre(0.0f, 37.0f / 8, 0.0f));
      }
      // Every code is the code of 0.0, the padding nibble included.
      const std::vector<uint8_t> b = Bytes(q.packed);
      for (int i = 0; i < 32; ++i) EXPECT_EQ(b[i], zero_byte) << i;
      for (int i = 64; i < 81; ++i) EXPECT_EQ(b[i], zero_byte) << i;
      // Zero back, also when double quant makes the zero blocks' absmax a
      // nonzero approximation (bnb CUDA's NF4 code 0 is -1.0 and would
      // decode to -absmax there). Without double quant it is +0.0; with it,
      // -0.0 where the approximate absmax came out negative.
      ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor absmax, BlockAbsmax(q));
      if (dq) {
        EXPECT_NE(ToVector(absmax)[0], 0.0f);
      }
      ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor back, Dequantize4bit(q));
      const std::vector<float> v = ToVector(back);
      for (int i : {0, 10, 63, 128, 160}) {
        EXPECT_EQ(v[i], 0.0f) << i << " dq " << dq;
        if (!dq) {
          EXPECT_EQ(Bits(v[i]), 0u) << i;
        }
      }
    }
  }
}

TEST(Quantize4bitTest, TinyDenormalBlockStaysFinite) {
  // 1/absmax would overflow; bnb's default backend clamps absmax at 1e-38.
  const float tiny = 1e-40f;
  ACCEL_ASSERT_OK_AND_ASSIGN(
      Quantized4bit q,
      Quantize4bit(FloatTensor({tiny, -tiny, 0.0f, tiny / 2}), QuantType4bit::kNf4, 64, false));
  EXPECT_EQ(ToVector(q.absmax)[0], tiny);
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor back, Dequantize4bit(q));
  for (float v : ToVector(back)) EXPECT_TRUE(std::isfinite(v));
}

TEST(Quantize4bitTest, HalfInputsAreConvertedToFloat32Exactly) {
  at::manual_seed(7);
  at::Tensor w = at::randn({33, 70}, at::kFloat);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    at::Tensor h = w.to(dtype);
    for (QuantType4bit type : {QuantType4bit::kNf4, QuantType4bit::kFp4}) {
      ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit q, Quantize4bit(h, type, 64, true));
      EXPECT_EQ(q.state.dtype, dtype);
      EXPECT_EQ(q.state.shape, (std::vector<int64_t>{33, 70}));
      const RefResult r = RefQuantize(ToVector(h), type, 64, true);
      EXPECT_EQ(Bytes(q.packed), r.packed);
      EXPECT_EQ(Bytes(q.absmax), r.absmax_u8);
      EXPECT_EQ(ToVector(q.nested_absmax), r.nested_absmax);
      ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor back, Dequantize4bit(q));
      EXPECT_EQ(back.scalar_type(), dtype);
      EXPECT_EQ(back.sizes(), h.sizes());
    }
  }
}

TEST(Quantize4bitTest, NonContiguousInputIsFlattenedRowMajor) {
  at::manual_seed(8);
  at::Tensor w = at::randn({64, 96}, at::kFloat).t();  // [96, 64], transposed strides
  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit q, Quantize4bit(w, QuantType4bit::kNf4, 64, false));
  const RefResult r = RefQuantize(ToVector(w), QuantType4bit::kNf4, 64, false);
  EXPECT_EQ(Bytes(q.packed), r.packed);
  EXPECT_EQ(q.state.shape, (std::vector<int64_t>{96, 64}));
}

TEST(Quantize4bitTest, ThreadCountDoesNotChangeTheResult) {
  at::manual_seed(9);
  at::Tensor w = at::randn({1000, 1003}).to(at::kBFloat16);
  const int threads = at::get_num_threads();
  std::vector<std::vector<uint8_t>> packed, absmax;
  for (int t : {1, 4}) {
    at::set_num_threads(t);
    ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit q, Quantize4bit(w, QuantType4bit::kNf4, 64, true));
    packed.push_back(Bytes(q.packed));
    absmax.push_back(Bytes(q.absmax));
  }
  at::set_num_threads(threads);
  EXPECT_EQ(packed[0], packed[1]);
  EXPECT_EQ(absmax[0], absmax[1]);
}

// bnb's tests/test_functional.py:test_4bit_quant: randn(1024, 1024), blocksize
// 64, mean |error| 0.072798 (NF4) and 0.096543 (FP4).
TEST(Quantize4bitTest, PublishedErrorStatistics) {
  at::manual_seed(0);
  at::Tensor w = at::randn({1024, 1024}, at::kFloat);
  for (auto [type, expected] :
       {std::pair{QuantType4bit::kNf4, 0.072798}, std::pair{QuantType4bit::kFp4, 0.096543}}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit q, Quantize4bit(w, type, 64, false));
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor back, Dequantize4bit(q));
    const double err = (back - w).abs().mean().item<double>();
    EXPECT_NEAR(err, expected, 1e-3) << QuantType4bitName(type);
  }
}

// ---------------------------------------------------------------------------
// Dequantize.

Quantized4bit RandomQuantized(int64_t n, int64_t bs, bool dq, QuantType4bit type,
                              at::ScalarType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> uni(0.0f, 3.0f);
  Quantized4bit q;
  const Layout4bit layout = LayoutOf4bit(n, bs, dq);
  q.packed = at::empty(layout.packed_shape, at::kByte);
  uint8_t* p = q.packed.data_ptr<uint8_t>();
  for (int64_t i = 0; i < q.packed.numel(); ++i) p[i] = static_cast<uint8_t>(byte(rng));
  q.quant_map = at::from_blob(const_cast<float*>(CodeTable(type).data()), {16}, at::kFloat).clone();
  q.state.quant_type = type;
  q.state.blocksize = bs;
  q.state.dtype = dtype;
  q.state.shape = {n};
  if (!dq) {
    q.absmax = at::empty({layout.absmax_len}, at::kFloat);
    for (int64_t i = 0; i < layout.absmax_len; ++i) q.absmax.data_ptr<float>()[i] = uni(rng);
    return q;
  }
  q.state.double_quant = true;
  q.state.nested_offset = 0.3125f + uni(rng);
  q.absmax = at::empty({layout.absmax_len}, at::kByte);
  for (int64_t i = 0; i < layout.absmax_len; ++i) {
    q.absmax.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(byte(rng));
  }
  q.nested_absmax = at::empty({layout.nested_absmax_len}, at::kFloat);
  for (int64_t i = 0; i < layout.nested_absmax_len; ++i) {
    q.nested_absmax.data_ptr<float>()[i] = uni(rng);
  }
  q.nested_quant_map =
      at::from_blob(const_cast<float*>(DynamicMap().data()), {256}, at::kFloat).clone();
  return q;
}

TEST(Dequantize4bitTest, OneFloat32MultiplyThenTheCast) {
  uint32_t seed = 11;
  for (QuantType4bit type : {QuantType4bit::kNf4, QuantType4bit::kFp4}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (bool dq : {false, true}) {
        const int64_t n = 64 * 300 + 3, bs = 64;
        Quantized4bit q = RandomQuantized(n, bs, dq, type, dtype, seed++);
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor absmax, BlockAbsmax(q));
        ASSERT_EQ(absmax.numel(), 301);
        std::vector<float> am(301);
        for (int64_t b = 0; b < 301; ++b) {
          if (!dq) {
            am[b] = q.absmax.data_ptr<float>()[b];
          } else {
            const float scaled = DynamicMap()[q.absmax.data_ptr<uint8_t>()[b]] *
                                 q.nested_absmax.data_ptr<float>()[b / 256];
            am[b] = scaled + q.state.nested_offset;
          }
          EXPECT_EQ(Bits(absmax.data_ptr<float>()[b]), Bits(am[b])) << b;
        }
        ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor w, Dequantize4bit(q));
        ASSERT_EQ(w.scalar_type(), dtype);
        ASSERT_EQ(w.numel(), n);
        const uint8_t* p = q.packed.data_ptr<uint8_t>();
        const std::vector<float> got = ToVector(w);
        for (int64_t j = 0; j < n; ++j) {
          const int code = j % 2 == 0 ? p[j / 2] >> 4 : p[j / 2] & 0xF;
          const float exact = CodeTable(type)[code] * am[j / bs];
          float want = exact;
          if (dtype == at::kBFloat16) want = static_cast<float>(c10::BFloat16(exact));
          if (dtype == at::kHalf) want = static_cast<float>(c10::Half(exact));
          ASSERT_EQ(Bits(got[j]), Bits(want)) << "element " << j;
        }
      }
    }
  }
}

TEST(Dequantize4bitTest, DoubleQuantAbsmaxRoundTripIsBounded) {
  at::manual_seed(3);
  at::Tensor w = at::randn({512, 1000}, at::kFloat) * at::rand({512, 1}, at::kFloat) * 4;
  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit plain, Quantize4bit(w, QuantType4bit::kNf4, 64, false));
  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit dq, Quantize4bit(w, QuantType4bit::kNf4, 64, true));
  EXPECT_EQ(Bytes(plain.packed), Bytes(dq.packed));  // the codes do not depend on it
  EXPECT_EQ(Bits(dq.state.nested_offset), Bits(at::mean(plain.absmax).item<float>()));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor approx, BlockAbsmax(dq));
  const std::vector<float> exact = ToVector(plain.absmax), got = ToVector(approx);
  const std::vector<float> nested = ToVector(dq.nested_absmax);
  // Nearest map entry: within half the widest gap of the map (0.0140625 / 2,
  // near +-1; -1 itself is 0.00703126 from the smallest entry) of s.
  const auto& m = DynamicMap();
  float gap = 1.0f + m[0];
  for (int i = 0; i + 1 < 256; ++i) gap = std::max(gap, (m[i + 1] - m[i]) / 2);
  ASSERT_LT(gap, 0.00704f);
  for (size_t b = 0; b < exact.size(); ++b) {
    const float bound = gap * nested[b / 256] * 1.0001f + 4e-7f * exact[b];
    EXPECT_LE(std::fabs(got[b] - exact[b]), bound) << b;
  }
}

TEST(Dequantize4bitTest, SingleBlockDoubleQuantKeepsTheAbsmaxExactly) {
  // One block: the offset is the absmax itself, the nested absmax 0, code 127.
  ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit q, Quantize4bit(FloatTensor({0.3f, -0.7f, 0.1f}),
                                                           QuantType4bit::kNf4, 64, true));
  EXPECT_EQ(q.state.nested_offset, 0.7f);
  EXPECT_THAT(ToVector(q.nested_absmax), ElementsAre(0.0f));
  EXPECT_THAT(Bytes(q.absmax), ElementsAre(127));
  ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor absmax, BlockAbsmax(q));
  EXPECT_THAT(ToVector(absmax), ElementsAre(0.7f));
}

TEST(Dequantize4bitTest, TensorsThatDoNotFitTheStateAreRefused) {
  Quantized4bit good = RandomQuantized(1000, 64, true, QuantType4bit::kNf4, at::kBFloat16, 5);
  ASSERT_THAT(Dequantize4bit(good), IsOk());
  auto expect_bad = [](const Quantized4bit& q, const char* what) {
    EXPECT_THAT(Dequantize4bit(q), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
    EXPECT_THAT(BlockAbsmax(q), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
  };
  Quantized4bit q = good;
  q.packed = at::zeros({499, 1}, at::kByte);
  expect_bad(q, "weight");
  q = good;
  q.packed = at::zeros({500, 1}, at::kChar);
  expect_bad(q, "weight");
  q = good;
  q.absmax = at::zeros({16}, at::kFloat);  // float32 with double quant
  expect_bad(q, "absmax");
  q = good;
  q.absmax = at::zeros({17}, at::kByte);
  expect_bad(q, "absmax");
  q = good;
  q.nested_absmax = at::Tensor();
  expect_bad(q, "nested_absmax");
  q = good;
  q.nested_quant_map = at::zeros({255}, at::kFloat);
  expect_bad(q, "nested_quant_map");
  q = good;
  q.quant_map = at::zeros({16}, at::kDouble);
  expect_bad(q, "quant_map");
  q = good;
  q.state.nested_blocksize = 128;
  expect_bad(q, "nested_blocksize");
  q = good;
  q.state.blocksize = 48;
  expect_bad(q, "blocksize");
  q = good;
  q.state.dtype = at::kInt;
  expect_bad(q, "dtype");
  q = good;
  q.state.shape = {10, -100};
  expect_bad(q, "shape");
  q = good;
  q.state.shape = {1001};
  expect_bad(q, "weight");
  q = good;
  q.state.double_quant = false;
  expect_bad(q, "absmax");
}

TEST(Quantize4bitTest, BadInputsAreRefused) {
  EXPECT_THAT(Quantize4bit(at::ones({4}, at::kInt), QuantType4bit::kNf4, 64, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int32")));
  EXPECT_THAT(Quantize4bit(at::ones({4}, at::kDouble), QuantType4bit::kNf4, 64, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("float64")));
  EXPECT_THAT(Quantize4bit(at::ones({0, 4}), QuantType4bit::kNf4, 64, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(Quantize4bit(at::Tensor(), QuantType4bit::kNf4, 64, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight")));
  for (int64_t bs : {16, 100, 8192}) {
    EXPECT_THAT(Quantize4bit(at::ones({4}), QuantType4bit::kNf4, bs, false),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocksize")));
  }
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(100, 1.0f);
    x[77] = bad;
    EXPECT_THAT(Quantize4bit(FloatTensor(x), QuantType4bit::kFp4, 64, false),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("non-finite"), HasSubstr("77"))));
  }
  EXPECT_THAT(
      Quantize4bit(at::ones({4}).to(at::kHalf).fill_(INFINITY), QuantType4bit::kNf4, 64, true),
      StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(Quantize4bitTest, LayoutAndStoredBytesMatchTheTensors) {
  for (bool dq : {false, true}) {
    for (int64_t n : {1, 63, 64 * 256, 64 * 257 + 1, 100001}) {
      for (int64_t bs : {32, 64, 4096}) {
        ACCEL_ASSERT_OK_AND_ASSIGN(Quantized4bit q,
                                   Quantize4bit(at::randn({n}), QuantType4bit::kNf4, bs, dq));
        const Layout4bit l = LayoutOf4bit(n, bs, dq);
        EXPECT_EQ(q.packed.sizes().vec(), l.packed_shape);
        EXPECT_EQ(q.absmax.numel(), l.absmax_len);
        EXPECT_EQ(q.absmax.scalar_type(), dq ? at::kByte : at::kFloat);
        auto bytes =
            static_cast<int64_t>(q.packed.nbytes() + q.absmax.nbytes() + q.quant_map.nbytes());
        if (dq) {
          EXPECT_EQ(q.nested_absmax.numel(), l.nested_absmax_len);
          bytes += static_cast<int64_t>(q.nested_absmax.nbytes() + q.nested_quant_map.nbytes());
        } else {
          EXPECT_EQ(l.nested_absmax_len, 0);
          EXPECT_FALSE(q.nested_absmax.defined());
        }
        EXPECT_EQ(StoredBytes4bit(n, bs, dq), bytes) << n << " " << bs << " " << dq;
      }
    }
  }
}

// Reference §6.2 (bytes per parameter) plus the per-tensor constants.
TEST(StoredBytesTest, NumbersOfTheReference) {
  const int64_t n = int64_t{4096} * 4096;
  // 0.5625 = 9/16 B/param; 0.515869 = (1/2 + 1/64 + 4/(64*256)) = 8452/16384.
  EXPECT_EQ(StoredBytes4bit(n, 64, false) - 64, n * 9 / 16);
  EXPECT_EQ(StoredBytes4bit(n, 64, true) - 64 - 1024, n * 8452 / 16384);
  // 0.53125 = 17/32; 0.507935 = 1/2 + 1/128 + 4/(128*256) = 16644/32768.
  EXPECT_EQ(StoredBytes4bit(n, 128, false) - 64, n * 17 / 32);
  EXPECT_EQ(StoredBytes4bit(n, 128, true) - 64 - 1024, n * 16644 / 32768);
  EXPECT_EQ(StoredBytes4bit(n, 32, false) - 64, n * 5 / 8);  // 0.625
  EXPECT_EQ(StoredBytes4bit(n, 64, true), 8655936);
  // LLM.int8: 1 + 4/K per parameter, plus the 1-byte weight_format.
  EXPECT_EQ(StoredBytesInt8(4096, 4096), n + int64_t{4096} * 4 + 1);
  EXPECT_EQ(StoredBytesInt8(11008, 4096), int64_t{11008} * 4096 + int64_t{11008} * 4 + 1);
}

// ---------------------------------------------------------------------------
// Quant state JSON.

TEST(QuantStateJsonTest, BnbsKeyOrderAndFormatting) {
  QuantState4bit st;
  st.quant_type = QuantType4bit::kNf4;
  st.blocksize = 64;
  st.dtype = at::kBFloat16;
  st.shape = {4096, 4096};
  EXPECT_EQ(
      QuantState4bitToJson(st),
      R"({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [4096, 4096]})");
  st.quant_type = QuantType4bit::kFp4;
  st.dtype = at::kHalf;
  st.shape = {};
  st.double_quant = true;
  st.nested_offset = 0.1f;
  EXPECT_EQ(QuantState4bitToJson(st),
            R"({"quant_type": "fp4", "blocksize": 64, "dtype": "float16", "shape": [], )"
            R"("nested_blocksize": 256, "nested_dtype": "float32", )"
            R"("nested_offset": 0.10000000149011612})");
}

std::string OffsetText(float offset) {
  QuantState4bit st;
  st.shape = {1};
  st.double_quant = true;
  st.nested_offset = offset;
  const std::string json = QuantState4bitToJson(st);
  const std::string key = "\"nested_offset\": ";
  const size_t at = json.find(key) + key.size();
  return json.substr(at, json.size() - 1 - at);
}

TEST(QuantStateJsonTest, OffsetIsPythonsReprOfTheFloat) {
  EXPECT_EQ(OffsetText(0.5f), "0.5");
  EXPECT_EQ(OffsetText(3.0f), "3.0");
  EXPECT_EQ(OffsetText(0.0f), "0.0");
  EXPECT_EQ(OffsetText(1e-5f), "9.999999747378752e-06");
  EXPECT_EQ(OffsetText(1e-4f), "9.999999747378752e-05");
  EXPECT_EQ(OffsetText(std::ldexp(1.0f, -20)), "9.5367431640625e-07");
  EXPECT_EQ(OffsetText(123456.789f), "123456.7890625");
  EXPECT_EQ(OffsetText(1e16f), "1.0000000272564224e+16");
  EXPECT_EQ(OffsetText(1e15f), "999999986991104.0");
  EXPECT_EQ(OffsetText(-2.5f), "-2.5");
}

TEST(QuantStateJsonTest, RoundTripsEveryField) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> bits(0, 0x7f7fffff);  // finite, non-negative
  for (int i = 0; i < 2000; ++i) {
    QuantState4bit st;
    st.quant_type = i % 2 ? QuantType4bit::kNf4 : QuantType4bit::kFp4;
    st.blocksize = int64_t{32} << (i % 8);
    st.dtype = i % 3 == 0 ? at::kFloat : (i % 3 == 1 ? at::kBFloat16 : at::kHalf);
    st.shape = {i, 7, 0};
    st.double_quant = i % 4 != 0;
    st.nested_offset = st.double_quant ? FromBits(bits(rng)) : 0.0f;
    const std::string json = QuantState4bitToJson(st);
    ACCEL_ASSERT_OK_AND_ASSIGN(QuantState4bit back, QuantState4bitFromJson(json, "t"));
    EXPECT_EQ(back.quant_type, st.quant_type);
    EXPECT_EQ(back.blocksize, st.blocksize);
    EXPECT_EQ(back.dtype, st.dtype);
    EXPECT_EQ(back.shape, st.shape);
    EXPECT_EQ(back.double_quant, st.double_quant);
    EXPECT_EQ(back.nested_blocksize, 256);
    ASSERT_EQ(Bits(back.nested_offset), Bits(st.nested_offset)) << json;
    // Python's json.loads reads it back as the same double.
    ASSERT_EQ(nlohmann::json::parse(json).value("nested_offset", 0.0),
              static_cast<double>(st.nested_offset));
  }
}

TEST(QuantStateJsonTest, ParsesBnbsOwnBlob) {
  ACCEL_ASSERT_OK_AND_ASSIGN(
      QuantState4bit st,
      QuantState4bitFromJson(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16",
          "shape": [11008, 4096], "nested_blocksize": 256, "nested_dtype": "float32",
          "nested_offset": 0.03148297220468521})",
                             "layers.0.mlp.up_proj"));
  EXPECT_EQ(st.quant_type, QuantType4bit::kNf4);
  EXPECT_EQ(st.dtype, at::kBFloat16);
  EXPECT_EQ(st.shape, (std::vector<int64_t>{11008, 4096}));
  EXPECT_TRUE(st.double_quant);
  EXPECT_EQ(st.nested_offset, static_cast<float>(0.03148297220468521));
  ACCEL_ASSERT_OK_AND_ASSIGN(
      st,
      QuantState4bitFromJson(
          R"({"quant_type": "fp4", "blocksize": 4096, "dtype": "float32", "shape": [3]})", "x"));
  EXPECT_FALSE(st.double_quant);
  EXPECT_EQ(st.blocksize, 4096);
  // str(dtype) without the strip, as some writers have it.
  ACCEL_ASSERT_OK_AND_ASSIGN(st, QuantState4bitFromJson(R"({"quant_type": "nf4", "blocksize": 64,
          "dtype": "torch.float16", "shape": [3], "nested_blocksize": 256,
          "nested_dtype": "torch.float32", "nested_offset": 1})",
                                                        "x"));
  EXPECT_EQ(st.dtype, at::kHalf);
  EXPECT_EQ(st.nested_offset, 1.0f);
}

TEST(QuantStateJsonTest, ErrorsNameTheLabelAndTheKey) {
  const std::string base_nested = R"("nested_blocksize": 256, "nested_dtype": "float32", )";
  struct Case {
    std::string json;
    std::string key;
  };
  const std::vector<Case> cases = {
      {R"({"blocksize": 64, "dtype": "float32", "shape": [2]})", "quant_type"},
      {R"({"quant_type": "int4", "blocksize": 64, "dtype": "float32", "shape": [2]})",
       "quant_type"},
      {R"({"quant_type": 4, "blocksize": 64, "dtype": "float32", "shape": [2]})", "quant_type"},
      {R"({"quant_type": "nf4", "dtype": "float32", "shape": [2]})", "blocksize"},
      {R"({"quant_type": "nf4", "blocksize": 16, "dtype": "float32", "shape": [2]})", "blocksize"},
      {R"({"quant_type": "nf4", "blocksize": 100, "dtype": "float32", "shape": [2]})", "blocksize"},
      {R"({"quant_type": "nf4", "blocksize": "64", "dtype": "float32", "shape": [2]})",
       "blocksize"},
      {R"({"quant_type": "nf4", "blocksize": 64.5, "dtype": "float32", "shape": [2]})",
       "blocksize"},
      {R"({"quant_type": "nf4", "blocksize": 64, "shape": [2]})", "dtype"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "int8", "shape": [2]})", "dtype"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32"})", "shape"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2, -1]})", "shape"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": 2})", "shape"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": ["2"]})", "shape"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2],
           "nested_blocksize": 128, "nested_dtype": "float32", "nested_offset": 0.5})",
       "nested_blocksize"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2],
           "nested_blocksize": 256, "nested_dtype": "float16", "nested_offset": 0.5})",
       "nested_dtype"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2],
           "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": "0.5"})",
       "nested_offset"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2],
           "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 1e300})",
       "nested_offset"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2],
           "nested_blocksize": 256, "nested_dtype": "float32"})",
       "nested_offset"},
      {R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2],
           "nested_offset": 0.5})",
       "nested_blocksize"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(QuantState4bitFromJson(c.json, "q_proj.weight"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("q_proj.weight"), HasSubstr("'" + c.key + "'"))))
        << c.json;
  }
  EXPECT_THAT(QuantState4bitFromJson("{", "lbl"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lbl")));
  EXPECT_THAT(QuantState4bitFromJson("[1]", "lbl"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lbl")));
  EXPECT_THAT(QuantState4bitFromJson(std::string(100000, '[') + std::string(100000, ']'), "lbl"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lbl")));
}

// ---------------------------------------------------------------------------
// LLM.int8.

TEST(Int8Test, RoundsHalfToEven) {
  // SCB 127: the scale 127 / 127 is exactly 1, so each value is its own code.
  const std::vector<float> row = {127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 3.5f, -127.0f, 0.25f};
  at::Tensor w = FloatTensor(row).reshape({1, -1});
  ACCEL_ASSERT_OK_AND_ASSIGN(QuantizedInt8 q, QuantizeInt8(w));
  EXPECT_THAT(ToVector(q.scb), ElementsAre(127.0f));
  EXPECT_EQ(q.weight.scalar_type(), at::kChar);
  at::Tensor cb = q.weight.to(at::kInt).reshape({-1});
  std::vector<int> codes(cb.data_ptr<int>(), cb.data_ptr<int>() + cb.numel());
  EXPECT_THAT(codes, ElementsAre(127, 0, 2, 2, 0, -2, 4, -127, 0));
}

TEST(Int8Test, MatchesThePlainLoopReference) {
  at::manual_seed(4);
  at::Tensor w = at::randn({37, 300}, at::kFloat) * at::rand({37, 1}, at::kFloat) * 3;
  w[5].zero_();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor input = w.to(dtype);
    ACCEL_ASSERT_OK_AND_ASSIGN(QuantizedInt8 q, QuantizeInt8(input));
    ASSERT_EQ(q.weight.sizes(), (std::vector<int64_t>{37, 300}));
    at::Tensor h = input.to(at::kHalf).to(at::kFloat).contiguous();  // bnb's fp16 cast
    for (int64_t r = 0; r < 37; ++r) {
      float amax = 0;
      for (int64_t k = 0; k < 300; ++k) amax = std::max(amax, std::fabs(h[r][k].item<float>()));
      ASSERT_EQ(q.scb[r].item<float>(), amax) << r;
      for (int64_t k = 0; k < 300; ++k) {
        const float want = amax == 0 ? 0.0f : std::rint(h[r][k].item<float>() * (127.0f / amax));
        ASSERT_EQ(q.weight[r][k].item<int>(), static_cast<int>(want)) << r << "," << k;
      }
    }
    EXPECT_EQ(q.scb[5].item<float>(), 0.0f);
    EXPECT_EQ(q.weight[5].abs().sum().item<int64_t>(), 0);
  }
}

TEST(Int8Test, Bfloat16GoesThroughFloat16) {
  // 2^-22 (1 + 2^-7) is a bfloat16; float16 (subnormal there, spacing 2^-24)
  // rounds it to 2^-22, and SCB is taken after that cast.
  const float v = std::ldexp(1.0f + std::ldexp(1.0f, -7), -22);
  at::Tensor w = FloatTensor({v, -v / 2}).reshape({1, 2}).to(at::kBFloat16);
  ASSERT_EQ(w[0][0].item<float>(), v);
  ACCEL_ASSERT_OK_AND_ASSIGN(QuantizedInt8 q, QuantizeInt8(w));
  EXPECT_EQ(q.scb[0].item<float>(), std::ldexp(1.0f, -22));
  // A bfloat16 beyond float16's range is refused rather than turned into inf.
  at::Tensor big = FloatTensor({70000.0f, 1.0f}).reshape({1, 2}).to(at::kBFloat16);
  EXPECT_THAT(QuantizeInt8(big),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("float16")));
}

TEST(Int8Test, DequantizeIsBnbsFloat32Expression) {
  at::manual_seed(6);
  at::Tensor w = at::randn({20, 50}, at::kFloat);
  ACCEL_ASSERT_OK_AND_ASSIGN(QuantizedInt8 q, QuantizeInt8(w));
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(at::Tensor back, DequantizeInt8(q, dtype));
    ASSERT_EQ(back.scalar_type(), dtype);
    // bnb: A * stats.view(-1, 1) * 7.874015718698502e-3, in torch's float32.
    at::Tensor want =
        (q.weight.to(at::kFloat) * q.scb.view({-1, 1}) * 7.874015718698502e-3).to(dtype);
    EXPECT_TRUE(at::equal(back, want)) << DTypeName(dtype);
    // And close to the original weight: half a code of each row's scale.
    at::Tensor err = (back.to(at::kFloat) - w).abs();
    EXPECT_TRUE((err <= q.scb.view({-1, 1}) / 127 * 0.51 + 1e-2).all().item<bool>());
  }
}

TEST(Int8Test, BadInputsAreRefused) {
  EXPECT_THAT(QuantizeInt8(at::ones({4})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 dimensions")));
  EXPECT_THAT(QuantizeInt8(at::ones({2, 2, 2})), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(QuantizeInt8(at::ones({2, 2}, at::kInt)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int32")));
  at::Tensor nan = at::ones({2, 2});
  nan[1][0] = NAN;
  EXPECT_THAT(QuantizeInt8(nan), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[1, 0]")));
  ACCEL_ASSERT_OK_AND_ASSIGN(QuantizedInt8 q, QuantizeInt8(at::ones({3, 4})));
  EXPECT_THAT(DequantizeInt8(q, at::kInt), StatusIs(absl::StatusCode::kInvalidArgument));
  QuantizedInt8 bad = q;
  bad.scb = at::ones({4});
  EXPECT_THAT(DequantizeInt8(bad, at::kFloat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("SCB")));
  bad = q;
  bad.weight = q.weight.to(at::kByte);
  EXPECT_THAT(DequantizeInt8(bad, at::kFloat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int8")));
}

// ---------------------------------------------------------------------------
// quantization_config.

TEST(BnbConfigTest, DefaultsForMissingKeys) {
  ACCEL_ASSERT_OK_AND_ASSIGN(BnbQuantizationConfig c,
                             BnbConfigFromJson(R"({"load_in_4bit": true})", "config.json"));
  EXPECT_TRUE(c.load_in_4bit);
  EXPECT_FALSE(c.load_in_8bit);
  EXPECT_TRUE(c.enabled());
  EXPECT_EQ(c.bnb_4bit_quant_type, QuantType4bit::kFp4);
  EXPECT_FALSE(c.bnb_4bit_use_double_quant);
  EXPECT_EQ(c.bnb_4bit_compute_dtype, at::kFloat);
  EXPECT_EQ(c.llm_int8_threshold, 6.0);
  EXPECT_FALSE(c.llm_int8_skip_modules.has_value());
  EXPECT_THAT(c.SkipModules(), ElementsAre("lm_head"));
  EXPECT_EQ(c.blocksize, 64);
}

TEST(BnbConfigTest, ParsesTransformersToDict) {
  ACCEL_ASSERT_OK_AND_ASSIGN(BnbQuantizationConfig c, BnbConfigFromJson(R"({
      "quant_method": "bitsandbytes",
      "_load_in_4bit": true, "_load_in_8bit": false, "load_in_4bit": true, "load_in_8bit": false,
      "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true,
      "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
      "llm_int8_threshold": 5.5, "llm_int8_has_fp16_weight": false,
      "llm_int8_skip_modules": ["lm_head", "mlp.gate"], "llm_int8_enable_fp32_cpu_offload": false,
      "some_future_key": {"x": 1}})",
                                                                        "config.json"));
  EXPECT_EQ(c.bnb_4bit_quant_type, QuantType4bit::kNf4);
  EXPECT_TRUE(c.bnb_4bit_use_double_quant);
  EXPECT_EQ(c.bnb_4bit_compute_dtype, at::kBFloat16);
  EXPECT_EQ(c.llm_int8_threshold, 5.5);
  ASSERT_TRUE(c.llm_int8_skip_modules.has_value());
  EXPECT_THAT(*c.llm_int8_skip_modules, ElementsAre("lm_head", "mlp.gate"));

  ACCEL_ASSERT_OK_AND_ASSIGN(
      c, BnbConfigFromJson(R"({"load_in_8bit": true, "llm_int8_skip_modules": null,
                               "bnb_4bit_compute_dtype": null})",
                           "c"));
  EXPECT_TRUE(c.load_in_8bit);
  EXPECT_FALSE(c.llm_int8_skip_modules.has_value());
  EXPECT_EQ(c.bnb_4bit_compute_dtype, at::kFloat);
  // Only the private keys (a config written by an old save): a fallback.
  ACCEL_ASSERT_OK_AND_ASSIGN(c, BnbConfigFromJson(R"({"_load_in_8bit": true})", "c"));
  EXPECT_TRUE(c.load_in_8bit);
}

TEST(BnbConfigTest, ComputeDtypeTakesTorchAliases) {
  for (auto [text, dtype] :
       {std::pair{"float32", at::kFloat}, std::pair{"float", at::kFloat},
        std::pair{"torch.float32", at::kFloat}, std::pair{"bfloat16", at::kBFloat16},
        std::pair{"torch.bfloat16", at::kBFloat16}, std::pair{"float16", at::kHalf},
        std::pair{"half", at::kHalf}}) {
    ACCEL_ASSERT_OK_AND_ASSIGN(
        BnbQuantizationConfig c,
        BnbConfigFromJson(
            absl::StrCat(R"({"load_in_4bit": true, "bnb_4bit_compute_dtype": ")", text, R"("})"),
            "c"));
    EXPECT_EQ(c.bnb_4bit_compute_dtype, dtype) << text;
  }
}

TEST(BnbConfigTest, ErrorsNameTheLabelAndTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"quant_method": "gptq", "load_in_4bit": true})", "quant_method"},
      {R"({"load_in_4bit": true, "load_in_8bit": true})", "load_in_4bit"},
      {R"({})", "load_in_8bit"},
      {R"({"load_in_4bit": false, "load_in_8bit": false})", "load_in_4bit"},
      {R"({"load_in_4bit": "yes"})", "load_in_4bit"},
      {R"({"load_in_4bit": true, "bnb_4bit_quant_type": "int4"})", "bnb_4bit_quant_type"},
      {R"({"load_in_4bit": true, "bnb_4bit_use_double_quant": 1})", "bnb_4bit_use_double_quant"},
      {R"({"load_in_4bit": true, "bnb_4bit_compute_dtype": "int8"})", "bnb_4bit_compute_dtype"},
      {R"({"load_in_4bit": true, "bnb_4bit_compute_dtype": "foo"})", "bnb_4bit_compute_dtype"},
      {R"({"load_in_4bit": true, "bnb_4bit_compute_dtype": 16})", "bnb_4bit_compute_dtype"},
      {R"({"load_in_4bit": true, "bnb_4bit_quant_storage": "bfloat16"})", "bnb_4bit_quant_storage"},
      {R"({"load_in_8bit": true, "llm_int8_threshold": "6"})", "llm_int8_threshold"},
      {R"({"load_in_8bit": true, "llm_int8_skip_modules": "lm_head"})", "llm_int8_skip_modules"},
      {R"({"load_in_8bit": true, "llm_int8_skip_modules": ["lm_head", 3]})",
       "llm_int8_skip_modules"},
      {R"({"load_in_8bit": true, "llm_int8_enable_fp32_cpu_offload": "yes"})",
       "llm_int8_enable_fp32_cpu_offload"},
      {R"({"load_in_8bit": true, "llm_int8_has_fp16_weight": 0})", "llm_int8_has_fp16_weight"},
      // bnb's int8 training mode: refused by name, never ignored.
      {R"({"load_in_8bit": true, "llm_int8_has_fp16_weight": true})", "llm_int8_has_fp16_weight"},
  };
  for (const auto& [json, key] : cases) {
    EXPECT_THAT(BnbConfigFromJson(json, "m/config.json"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("m/config.json"), HasSubstr("'" + key + "'"))))
        << json;
  }
  EXPECT_THAT(BnbConfigFromJson("not json", "m/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("m/config.json")));
  EXPECT_THAT(BnbConfigFromJson("[]", "m/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("m/config.json")));
}

TEST(BnbConfigTest, ToJsonIsTransformersToDictSorted) {
  BnbQuantizationConfig c;
  c.load_in_4bit = true;
  c.bnb_4bit_quant_type = QuantType4bit::kNf4;
  c.bnb_4bit_use_double_quant = true;
  c.bnb_4bit_compute_dtype = at::kBFloat16;
  EXPECT_EQ(BnbConfigToJson(c),
            R"({"_load_in_4bit":true,"_load_in_8bit":false,"bnb_4bit_compute_dtype":"bfloat16",)"
            R"("bnb_4bit_quant_storage":"uint8","bnb_4bit_quant_type":"nf4",)"
            R"("bnb_4bit_use_double_quant":true,"llm_int8_enable_fp32_cpu_offload":false,)"
            R"("llm_int8_has_fp16_weight":false,"llm_int8_skip_modules":null,)"
            R"("llm_int8_threshold":6.0,"load_in_4bit":true,"load_in_8bit":false,)"
            R"("quant_method":"bitsandbytes"})");
  c = BnbQuantizationConfig();
  c.load_in_8bit = true;
  c.llm_int8_threshold = 0.0;
  c.llm_int8_skip_modules = std::vector<std::string>{"lm_head", "classifier"};
  ACCEL_ASSERT_OK_AND_ASSIGN(BnbQuantizationConfig back,
                             BnbConfigFromJson(BnbConfigToJson(c), "round trip"));
  EXPECT_TRUE(back.load_in_8bit);
  EXPECT_FALSE(back.load_in_4bit);
  EXPECT_EQ(back.llm_int8_threshold, 0.0);
  EXPECT_EQ(back.llm_int8_skip_modules, c.llm_int8_skip_modules);
  EXPECT_EQ(back.bnb_4bit_quant_type, QuantType4bit::kFp4);
  EXPECT_FALSE(back.llm_int8_enable_fp32_cpu_offload);
  // The cpu-offload flag is read and written back, not dropped.
  c.llm_int8_enable_fp32_cpu_offload = true;
  EXPECT_THAT(BnbConfigToJson(c), HasSubstr(R"("llm_int8_enable_fp32_cpu_offload":true)"));
  ACCEL_ASSERT_OK_AND_ASSIGN(back, BnbConfigFromJson(BnbConfigToJson(c), "round trip"));
  EXPECT_TRUE(back.llm_int8_enable_fp32_cpu_offload);
}

TEST(BnbConfigTest, QuantizesAllButTheSkippedModules) {
  BnbQuantizationConfig c;
  EXPECT_FALSE(c.Quantizes("model.layers.0.mlp.up_proj"));  // not enabled
  c.load_in_4bit = true;
  EXPECT_TRUE(c.Quantizes("model.layers.0.mlp.up_proj"));
  EXPECT_FALSE(c.Quantizes("lm_head"));
  EXPECT_FALSE(c.Quantizes("model.lm_head"));
  EXPECT_TRUE(c.Quantizes("lm_head_extra"));
  EXPECT_TRUE(c.Quantizes("model.my_lm_head"));
  c.llm_int8_skip_modules = std::vector<std::string>{"mlp", "layers.1.self_attn"};
  c.keep_in_fp32_modules = {"wo"};
  EXPECT_THAT(c.SkipModules(), ElementsAre("mlp", "layers.1.self_attn", "wo"));
  EXPECT_TRUE(c.Quantizes("lm_head"));  // an explicit list replaces the default
  EXPECT_FALSE(c.Quantizes("model.layers.0.mlp.down_proj"));
  EXPECT_TRUE(c.Quantizes("model.layers.0.mlp_norm"));
  EXPECT_FALSE(c.Quantizes("model.layers.1.self_attn.q_proj"));
  EXPECT_TRUE(c.Quantizes("model.layers.11.self_attn.q_proj"));
  EXPECT_FALSE(c.Quantizes("encoder.block.0.layer.1.DenseReluDense.wo"));
}

}  // namespace
}  // namespace accel::quant
