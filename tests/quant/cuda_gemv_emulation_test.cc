// The tensor-core 4-bit GEMV's code (quant/cuda/internal/gemv_mma.h) run on
// the host: every CTA emulated thread by thread (tests/testing/cta_emulator.h),
// the byte permutes and the mma.m16n8k16 fragments as PTX defines them,
// against a plain double reference of the bnb formula (weights dequantized
// into the activation type, products summed; within the float32 summation
// bound) and bit for bit where every sum is exact. What this verifies
// without a GPU: the nibble lookup through prmt, the permuted k order of
// the A and B fragments, the x staging in shared memory (and the tiled
// form's B fragments read from x itself, up to 32 rows), the split of K over
// warps and its reduce, rows past N, up to 8 activation rows. What only a
// device verifies (cuda_kernels_test.cc): the instructions themselves and
// the tensor cores' float32 accumulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "core/float16_bits.h"
#include "quant/cuda/internal/gemv_mma.h"
#include "tests/testing/cta_emulator.h"

namespace accel::quant::cuda::internal {
namespace {

using accel::testing::CtaEmulator;

// --- prmt and the lookup ---------------------------------------------------------

TEST(GemvMmaTest, PrmtSelectsAndReplicatesSigns) {
  const uint32_t a = 0x83828180u, b = 0x07060504u;
  EXPECT_EQ(Prmt(a, b, 0x3210u), a);
  EXPECT_EQ(Prmt(a, b, 0x7654u), b);
  EXPECT_EQ(Prmt(a, b, 0x4051u), 0x04800581u);
  EXPECT_EQ(Prmt(a, b, 0x8888u), 0xffffffffu);  // byte 0 (0x80) has its sign set
  EXPECT_EQ(Prmt(a, b, 0x000cu), 0x80808000u);  // byte 4 (0x04): sign clear
}

template <typename Tag>
void ExpectLookupMatchesTheTable() {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  float code[16];
  for (float& c : code) c = value(rng);
  const float scale = 1.7f;
  uint32_t lo[4], hi[4];
  BuildPlanes<Tag>(code, scale, lo, hi);
  uint16_t want[16];
  for (int i = 0; i < 16; ++i) want[i] = Narrow(Tag{}, code[i] * scale);
  for (uint32_t half = 0; half <= 0xffffu; ++half) {
    uint32_t first, second;
    LookupPairs(half, lo, hi, first, second);
    // Byte 0: its high nibble is the even element (low half of `first`).
    const uint32_t byte0 = half & 0xffu, byte1 = half >> 8;
    const uint32_t expect_first = want[byte0 >> 4] | static_cast<uint32_t>(want[byte0 & 15]) << 16;
    const uint32_t expect_second = want[byte1 >> 4] | static_cast<uint32_t>(want[byte1 & 15]) << 16;
    ASSERT_EQ(first, expect_first) << std::hex << half;
    ASSERT_EQ(second, expect_second) << std::hex << half;
    // The same two bytes as the high half of a word (the other half random):
    // a word's selectors, shifted, serve its high half.
    const uint32_t word = half << 16 | static_cast<uint32_t>(rng() & 0xffffu);
    LookupSelected(NibbleIndex(word) >> 16, NibblePick(word) >> 16, lo, hi, first, second);
    ASSERT_EQ(first, expect_first) << std::hex << word;
    ASSERT_EQ(second, expect_second) << std::hex << word;
    const uint32_t low_word = static_cast<uint32_t>(rng() & 0xffff0000u) | half;
    LookupSelected(NibbleIndex(low_word), NibblePick(low_word), lo, hi, first, second);
    ASSERT_EQ(first, expect_first) << std::hex << low_word;
    ASSERT_EQ(second, expect_second) << std::hex << low_word;
  }
}

TEST(GemvMmaTest, LookupGivesEveryNibblesRoundedValue) {
  ExpectLookupMatchesTheTable<MmaBFloat16>();
  ExpectLookupMatchesTheTable<MmaFloat16>();
}

// --- The CTA, emulated -------------------------------------------------------------

// The kernel's Exec on the host: mma.m16n8k16 with the fragment layout of
// the PTX ISA (A row-major 16x16: register r of lane (g, t) holds row g +
// 8 (r % 2), columns 2t + 8 (r / 2) and the next; B 16x8: register r holds
// rows 2t + 8r and the next, column g; C: rows g and g + 8, columns 2t and
// 2t + 1), each product exact in float32, summed in k order.
class HostExec {
 public:
  explicit HostExec(CtaEmulator::Exec& exec) : exec_(exec) {}
  int tid() const { return exec_.tid(); }
  void Sync() { exec_.Sync(); }
  void WarpSync() { exec_.WarpSync(); }
  // cp.async as the device may run it: a copy lands no earlier than the
  // wait that covers its group (so a read of the stage before that wait
  // sees what was there before: NaN patterns, below), reading its source
  // then.
  void CopyAsync8(uint8_t* shared_dst, const void* global_src) {
    open_.push_back({shared_dst, global_src});
  }
  void CommitCopies() {
    groups_.push_back(std::move(open_));
    open_.clear();
  }
  void WaitCopiesButLast() {
    while (groups_.size() > 1) {
      for (const Copy& copy : groups_.front()) std::memcpy(copy.dst, copy.src, 8);
      groups_.pop_front();
    }
  }
  int64_t copies_in_flight() const {
    int64_t n = static_cast<int64_t>(open_.size());
    for (const auto& group : groups_) n += static_cast<int64_t>(group.size());
    return n;
  }
  template <typename Tag>
  void Mma(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1,
           float (&c)[4]) {
    struct Fragments {
      uint32_t a[4], b[2];
    };
    const Fragments mine = {{a0, a1, a2, a3}, {b0, b1}};
    Fragments all[32];
    exec_.WarpGather(&mine, sizeof(mine), all);
    auto half = [](uint32_t word, int k) {
      return static_cast<uint16_t>(k % 2 == 0 ? word & 0xffffu : word >> 16);
    };
    auto a = [&](int row, int k) {
      const Fragments& f = all[(row % 8) * 4 + (k % 8) / 2];
      return Widen(Tag{}, half(f.a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k));
    };
    auto b = [&](int k, int n) {
      const Fragments& f = all[n * 4 + (k % 8) / 2];
      return Widen(Tag{}, half(f.b[k >= 8 ? 1 : 0], k));
    };
    const int lane = tid() % 32, g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
      for (int k = 0; k < 16; ++k) c[i] += a(row, k) * b(k, col);
    }
  }

 private:
  struct Copy {
    uint8_t* dst;
    const void* src;
  };
  CtaEmulator::Exec& exec_;
  std::vector<Copy> open_;
  std::deque<std::vector<Copy>> groups_;
};

struct Case {
  const char* name;
  bool bf16;
  int64_t n_rows, k, blocksize;
  int32_t m;
  bool bias;
};

struct Inputs {
  std::vector<uint8_t> packed;
  std::vector<float> absmax, code;
  std::vector<uint16_t> x, bias;  // [m, k], [n_rows]
};

// The forms of the kernel (kWide: with WideSplits' splits for 16 CTAs;
// kWideSplit3: K in three splits, their sums added by the reduce).
// kScaled: the scaled form with a grid of 3 CTAs (each taking several tiles
// where N has more than 3 tiles of 16 rows).
enum class Form { kRounds, kPipelined, kTiled, kWide, kWideSplit3, kScaled };

template <typename Tag>
std::vector<uint16_t> RunEmulated(const Case& c, const Inputs& in, Form form, std::string* error) {
  std::vector<uint16_t> y(static_cast<size_t>(c.m * c.n_rows), 0xffffu);  // NaN
  GemvMmaParams p;
  p.x = in.x.data();
  p.packed = in.packed.data();
  p.absmax = in.absmax.data();
  p.code = in.code.data();
  p.bias = c.bias ? in.bias.data() : nullptr;
  p.y = y.data();
  p.n_rows = c.n_rows;
  p.k = c.k;
  p.blocksize = c.blocksize;
  p.m = c.m;
  if (form == Form::kScaled) {
    if (!ScaledTakes(c.m, c.k, c.blocksize, p.x, p.packed)) {
      *error = "ScaledTakes refused";
      return y;
    }
    const int64_t ctas = ScaledCtas(c.n_rows, 3);
    std::vector<uint64_t> shared(static_cast<size_t>(ScaledSharedBytes() / 8 + 1));
    CtaEmulator cta(kMmaThreads);
    for (int64_t first = 0; first < ctas; ++first) {
      std::fill(shared.begin(), shared.end(), ~uint64_t{0});
      uint8_t* sh = reinterpret_cast<uint8_t*>(shared.data());
      *error = cta.Run([&](CtaEmulator::Exec& exec) {
        HostExec host(exec);
        Gemv4bitScaledCta<Tag>(p, first, ctas, sh, host);
      });
      if (!error->empty()) return y;
    }
    return y;
  }
  if (form == Form::kWide || form == Form::kWideSplit3) {
    if (!MmaTiledTakes(c.m, c.k, c.blocksize, p.x, p.packed)) {
      *error = "MmaTiledTakes refused";
      return y;
    }
    const int tiles = static_cast<int>((c.m + 7) / 8);
    p.splits = form == Form::kWideSplit3
                   ? static_cast<int32_t>(std::min<int64_t>(3, c.k / kMmaChunk))
                   : WideSplits(c.n_rows, c.k, 16);
    std::vector<float> workspace(static_cast<size_t>(p.splits * c.m * c.n_rows),
                                 std::numeric_limits<float>::quiet_NaN());
    p.workspace = workspace.data();
    std::vector<uint64_t> shared(static_cast<size_t>(WideSharedBytes(tiles) / 8 + 1));
    CtaEmulator cta(kMmaThreads);
    for (int64_t block = 0; block * kWideRows < c.n_rows; ++block) {
      for (int32_t split = 0; split < p.splits; ++split) {
        std::fill(shared.begin(), shared.end(), ~uint64_t{0});
        uint8_t* sh = reinterpret_cast<uint8_t*>(shared.data());
        *error = cta.Run([&](CtaEmulator::Exec& exec) {
          HostExec host(exec);
          switch (tiles) {
            case 1:
              Gemm4bitMmaWideCta<Tag, 1>(p, block, split, sh, host);
              break;
            case 2:
              Gemm4bitMmaWideCta<Tag, 2>(p, block, split, sh, host);
              break;
            case 3:
              Gemm4bitMmaWideCta<Tag, 3>(p, block, split, sh, host);
              break;
            default:
              Gemm4bitMmaWideCta<Tag, 4>(p, block, split, sh, host);
          }
        });
        if (!error->empty()) return y;
      }
    }
    if (p.splits > 1) {
      for (int64_t i = 0; i < c.m * c.n_rows; ++i) ReduceWideSplits<Tag>(p, i);
    }
    return y;
  }
  if (form == Form::kTiled) {
    if (!MmaTiledTakes(c.m, c.k, c.blocksize, p.x, p.packed)) {
      *error = "MmaTiledTakes refused";
      return y;
    }
    const int tiles = static_cast<int>((c.m + 7) / 8);
    std::vector<uint64_t> shared(static_cast<size_t>(MmaTiledSharedBytes(tiles) / 8 + 1));
    CtaEmulator cta(kMmaThreads);
    for (int64_t block = 0; block * kMmaRows < c.n_rows; ++block) {
      std::fill(shared.begin(), shared.end(), ~uint64_t{0});
      uint8_t* s = reinterpret_cast<uint8_t*>(shared.data());
      *error = cta.Run([&](CtaEmulator::Exec& exec) {
        HostExec host(exec);
        switch (tiles) {
          case 1:
            Gemm4bitMmaTiledCta<Tag, 1>(p, block, s, host);
            break;
          case 2:
            Gemm4bitMmaTiledCta<Tag, 2>(p, block, s, host);
            break;
          case 3:
            Gemm4bitMmaTiledCta<Tag, 3>(p, block, s, host);
            break;
          default:
            Gemm4bitMmaTiledCta<Tag, 4>(p, block, s, host);
        }
      });
      if (!error->empty()) return y;
    }
    return y;
  }
  if (!MmaTakes(c.m, c.k, c.blocksize, p.x, p.packed)) {
    *error = "MmaTakes refused";
    return y;
  }
  const int max_m = c.m <= 1 ? 1 : c.m <= 2 ? 2 : c.m <= 4 ? 4 : 8;
  const bool pipelined = form == Form::kPipelined;
  if (pipelined && max_m > kMmaPipelinedMaxM) {
    *error = "the pipelined kernel takes up to 4 rows";
    return y;
  }
  std::vector<uint64_t> shared(static_cast<size_t>(
      (pipelined ? MmaPipelinedSharedBytes(max_m) : MmaSharedBytes(max_m)) / 8 + 1));
  CtaEmulator cta(kMmaThreads);
  for (int64_t block = 0; block * kMmaRows < c.n_rows; ++block) {
    // Shared memory starts as garbage on the device: NaN patterns here.
    std::fill(shared.begin(), shared.end(), ~uint64_t{0});
    uint8_t* s = reinterpret_cast<uint8_t*>(shared.data());
    *error = cta.Run([&](CtaEmulator::Exec& exec) {
      HostExec host(exec);
      if (pipelined) {
        switch (max_m) {
          case 1:
            Gemv4bitMmaPipelinedCta<Tag, 1>(p, block, s, host);
            break;
          case 2:
            Gemv4bitMmaPipelinedCta<Tag, 2>(p, block, s, host);
            break;
          default:
            Gemv4bitMmaPipelinedCta<Tag, 4>(p, block, s, host);
        }
        // Every copy the kernel issued was waited for before its use; the
        // last group (empty: the round after the last) may stay open.
        if (host.copies_in_flight() != 0) ADD_FAILURE() << "copies never waited for";
        return;
      }
      switch (max_m) {
        case 1:
          Gemv4bitMmaCta<Tag, 1>(p, block, s, host);
          break;
        case 2:
          Gemv4bitMmaCta<Tag, 2>(p, block, s, host);
          break;
        case 4:
          Gemv4bitMmaCta<Tag, 4>(p, block, s, host);
          break;
        default:
          Gemv4bitMmaCta<Tag, 8>(p, block, s, host);
      }
    });
    if (!error->empty()) return y;
  }
  return y;
}

// NF4 (../shared/reference/bitsandbytes.md §1.1).
std::vector<float> Nf4() {
  constexpr uint32_t kBits[16] = {0xbf800000, 0xbf3239b1, 0xbf066b30, 0xbeca32a0,
                                  0xbe91a24d, 0xbe3d353f, 0xbdba7871, 0x00000000,
                                  0x3da2faff, 0x3e24cae3, 0x3e7c04dd, 0x3ead033a,
                                  0x3ee1a4b8, 0x3f1007ab, 0x3f3913b3, 0x3f800000};
  std::vector<float> code(16);
  for (int i = 0; i < 16; ++i) code[static_cast<size_t>(i)] = float16_bits::BitsToFloat(kBits[i]);
  return code;
}

template <typename Tag>
void CheckCase(const Case& c, bool exact_sums, Form form = Form::kRounds) {
  SCOPED_TRACE(std::string(c.name) + (form == Form::kPipelined    ? ", pipelined"
                                      : form == Form::kTiled      ? ", tiled"
                                      : form == Form::kWide       ? ", wide"
                                      : form == Form::kWideSplit3 ? ", wide, 3 splits"
                                      : form == Form::kScaled     ? ", scaled"
                                                                  : ""));
  std::mt19937_64 rng(7);
  Inputs in;
  const int64_t n = c.n_rows * c.k;
  in.packed.resize(static_cast<size_t>(n / 2));
  for (uint8_t& b : in.packed) b = static_cast<uint8_t>(rng());
  in.absmax.resize(static_cast<size_t>((n + c.blocksize - 1) / c.blocksize));
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f), scale(0.5f, 2.0f);
  std::uniform_int_distribution<int> small(-8, 8), exponent(-1, 2);
  if (exact_sums) {
    // Codes (i - 8) / 8, scales 2^-1..2^2, integer x and bias: every sum is
    // exact in float32, so y is the exact sum rounded once.
    in.code.resize(16);
    for (int i = 0; i < 16; ++i) in.code[static_cast<size_t>(i)] = static_cast<float>(i - 8) / 8;
    for (float& a : in.absmax) a = std::ldexp(1.0f, exponent(rng));
  } else {
    in.code = Nf4();
    for (float& a : in.absmax) a = scale(rng);
  }
  in.x.resize(static_cast<size_t>(c.m * c.k));
  for (uint16_t& v : in.x) {
    v = Narrow(Tag{}, exact_sums ? static_cast<float>(small(rng)) : unit(rng));
  }
  in.bias.resize(static_cast<size_t>(c.n_rows));
  for (uint16_t& v : in.bias)
    v = Narrow(Tag{}, exact_sums ? static_cast<float>(small(rng)) : unit(rng));

  std::string error;
  const std::vector<uint16_t> y = RunEmulated<Tag>(c, in, form, &error);
  ASSERT_EQ(error, "");
  const double u = std::ldexp(1.0, -24);
  // The scaled form adds a rounding a block (its sum times the absmax).
  const int64_t terms = c.k + 1 + (form == Form::kScaled ? c.k / 64 + 1 : 0);
  const double gamma = static_cast<double>(terms) * u / (1 - static_cast<double>(terms) * u);
  const double u_out =
      std::is_same_v<Tag, MmaBFloat16> ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  int64_t failures = 0;
  for (int32_t m = 0; m < c.m; ++m) {
    for (int64_t row = 0; row < c.n_rows; ++row) {
      double exact = c.bias ? Widen(Tag{}, in.bias[static_cast<size_t>(row)]) : 0.0;
      double magnitude = std::fabs(exact);
      for (int64_t i = 0; i < c.k; ++i) {
        const int64_t j = row * c.k + i;
        const uint8_t byte = in.packed[static_cast<size_t>(j / 2)];
        const int nibble = j % 2 == 0 ? byte >> 4 : byte & 0xF;
        const float code = in.code[static_cast<size_t>(nibble)];
        const float absmax = in.absmax[static_cast<size_t>(j / c.blocksize)];
        // Dequantize4bit's weight, or the scaled form's: the code rounded,
        // times the absmax (exactly, in double).
        const double w = form == Form::kScaled
                             ? Widen(Tag{}, Narrow(Tag{}, code)) * static_cast<double>(absmax)
                             : Widen(Tag{}, Narrow(Tag{}, code * absmax));
        const double p = Widen(Tag{}, in.x[static_cast<size_t>(m * c.k + i)]) * w;
        exact += p;
        magnitude += std::fabs(p);
      }
      const uint16_t got = y[static_cast<size_t>(m * c.n_rows + row)];
      bool ok;
      if (exact_sums) {
        ok = got == Narrow(Tag{}, static_cast<float>(exact));
      } else {
        const double bound =
            gamma * magnitude + u_out * (std::fabs(exact) + gamma * magnitude) + 1e-9;
        ok = std::fabs(Widen(Tag{}, got) - exact) <= bound;
      }
      if (!ok && ++failures <= 5) {
        ADD_FAILURE() << "x row " << m << ", row " << row << ": got " << Widen(Tag{}, got)
                      << ", exact " << exact;
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

const Case kCases[] = {
    {"Bf16Batch1", true, 64, 4096, 64, 1, true},
    {"Fp16ThreeRowsRaggedN", false, 37, 512, 128, 3, false},  // N % 16 != 0, m not a power of 2
    {"Bf16EightRowsOneChunk", true, 16, 256, 256, 8, true},   // seven idle warps
    {"Fp16TwoRowsTwoRounds", false, 50, 2304, 64, 2, true},   // 9 chunks over 8 warps
    {"Bf16DownProjK", true, 24, 11008, 64, 1, false},         // 43 chunks
    {"Fp16FiveRowsBigBlocks", false, 20, 1024, 1024, 5, true},
};

TEST(GemvMmaTest, EmulatedKernelIsWithinTheFloat32SummationBound) {
  for (const Case& c : kCases) {
    if (c.bf16) {
      CheckCase<MmaBFloat16>(c, false);
    } else {
      CheckCase<MmaFloat16>(c, false);
    }
  }
}

TEST(GemvMmaTest, EmulatedKernelIsBitExactWhenEverySumIsExact) {
  for (const Case& c : kCases) {
    CheckCase<MmaBFloat16>(c, true);
    CheckCase<MmaFloat16>(c, true);
  }
}

// The pipelined form on every case of up to 4 rows, and on cases of its own:
// warps without a chunk (K of one and of three chunks), one round each, an
// odd number of rounds (the x stages' parity), N past the last CTA's rows.
const Case kPipelinedCases[] = {
    {"Bf16OneChunk", true, 16, 256, 64, 1, false},  // seven warps without a chunk
    {"Fp16ThreeChunksFourRows", false, 40, 768, 256, 4, true},
    {"Bf16ThreeRoundsRagged", true, 33, 5376, 64, 3, true},  // 21 chunks: 3 rounds, 5 warps
    {"Fp16TwoRowsSevenRounds", false, 16, 14336, 64, 2, false},
};

std::vector<Case> PipelinedCases() {
  std::vector<Case> cases;
  for (const Case& c : kCases) {
    if (c.m <= kMmaPipelinedMaxM) cases.push_back(c);
  }
  cases.insert(cases.end(), std::begin(kPipelinedCases), std::end(kPipelinedCases));
  return cases;
}

TEST(GemvMmaTest, EmulatedPipelinedKernelIsWithinTheFloat32SummationBound) {
  for (const Case& c : PipelinedCases()) {
    if (c.bf16) {
      CheckCase<MmaBFloat16>(c, false, Form::kPipelined);
    } else {
      CheckCase<MmaFloat16>(c, false, Form::kPipelined);
    }
  }
}

TEST(GemvMmaTest, EmulatedPipelinedKernelIsBitExactWhenEverySumIsExact) {
  for (const Case& c : PipelinedCases()) {
    CheckCase<MmaBFloat16>(c, true, Form::kPipelined);
    CheckCase<MmaFloat16>(c, true, Form::kPipelined);
  }
}

// The tiled form on every case above and on cases of up to 32 rows: a tile
// partly used (9, 17, 30 rows), whole tiles (16, 24, 32), one chunk and
// many, N past the last CTA's rows.
const Case kTiledCases[] = {
    {"Bf16NineRows", true, 37, 512, 64, 9, true},
    {"Fp16SixteenRowsOneChunk", false, 16, 256, 256, 16, false},  // seven idle warps
    {"Bf16SeventeenRowsTwoRounds", true, 50, 2304, 64, 17, false},
    {"Fp16TwentyFourRowsBigBlocks", false, 20, 1024, 1024, 24, true},
    {"Bf16ThirtyRowsDownProjK", true, 24, 11008, 64, 30, false},  // 43 chunks
    {"Fp16ThirtyTwoRows", false, 33, 768, 128, 32, true},
};

std::vector<Case> TiledCases() {
  std::vector<Case> cases(std::begin(kCases), std::end(kCases));
  cases.insert(cases.end(), std::begin(kTiledCases), std::end(kTiledCases));
  return cases;
}

TEST(GemvMmaTest, EmulatedTiledKernelIsWithinTheFloat32SummationBound) {
  for (const Case& c : TiledCases()) {
    if (c.bf16) {
      CheckCase<MmaBFloat16>(c, false, Form::kTiled);
    } else {
      CheckCase<MmaFloat16>(c, false, Form::kTiled);
    }
  }
}

TEST(GemvMmaTest, EmulatedTiledKernelIsBitExactWhenEverySumIsExact) {
  for (const Case& c : TiledCases()) {
    CheckCase<MmaBFloat16>(c, true, Form::kTiled);
    CheckCase<MmaFloat16>(c, true, Form::kTiled);
  }
}

// The wide form on the tiled form's cases (rows of W past one CTA's 128 in
// some: 130 and 300), in one split where WideSplits gives one and in three
// (K of at least three chunks).
const Case kWideCases[] = {
    {"Bf16ThreeCtasOfRows", true, 300, 1024, 64, 20, true},
    {"Fp16TwoCtasNineRows", false, 130, 2304, 128, 9, false},
};

std::vector<Case> WideCases() {
  std::vector<Case> cases = TiledCases();
  cases.insert(cases.end(), std::begin(kWideCases), std::end(kWideCases));
  return cases;
}

TEST(GemvMmaTest, EmulatedWideKernelIsWithinTheFloat32SummationBound) {
  for (const Case& c : WideCases()) {
    for (Form form : {Form::kWide, Form::kWideSplit3}) {
      if (form == Form::kWideSplit3 && c.k < 3 * kMmaChunk) continue;
      if (c.bf16) {
        CheckCase<MmaBFloat16>(c, false, form);
      } else {
        CheckCase<MmaFloat16>(c, false, form);
      }
    }
  }
}

TEST(GemvMmaTest, EmulatedWideKernelIsBitExactWhenEverySumIsExact) {
  for (const Case& c : WideCases()) {
    for (Form form : {Form::kWide, Form::kWideSplit3}) {
      if (form == Form::kWideSplit3 && c.k < 3 * kMmaChunk) continue;
      CheckCase<MmaBFloat16>(c, true, form);
      CheckCase<MmaFloat16>(c, true, form);
    }
  }
}

TEST(GemvMmaTest, WideSplitsFillTheDeviceWithinTheChunks) {
  EXPECT_EQ(WideSplits(14336, 4096, 264), 3);  // 112 CTAs of rows: 3 splits
  EXPECT_EQ(WideSplits(28672, 4096, 264), 2);  // 224
  EXPECT_EQ(WideSplits(4096, 14336, 264), 9);  // 32 CTAs of rows
  EXPECT_EQ(WideSplits(1024, 4096, 264), 16);  // 8 CTAs: capped at K's 16 chunks
  EXPECT_EQ(WideSplits(65536, 4096, 264), 1);  // 512 CTAs of rows already
  EXPECT_EQ(WideSplits(16, 256, 264), 1);      // one chunk
}

// The scaled form on the first form's cases and on its own: many tiles over
// 3 CTAs (each taking several, the next tile's first weights loaded during
// the last round of a tile), blocks of 128 (two segments a block), 256,
// 1024 and 4096 (blocks across rows), K of one chunk (seven idle warps), 8
// rows, N past the last tile.
const Case kScaledCases[] = {
    {"Bf16ManyTilesBlocks128", true, 200, 1024, 128, 1, true},
    {"Fp16OneChunkEightRows", false, 40, 256, 64, 8, false},
    {"Bf16BlocksAcrossRows", true, 53, 1024, 4096, 2, true},
    {"Fp16DownProjKBlocks256", false, 21, 14336, 256, 4, true},
    {"Bf16SixRowsTwoRounds", true, 64, 2304, 64, 6, false},
};

std::vector<Case> ScaledCases() {
  std::vector<Case> cases(std::begin(kCases), std::end(kCases));
  cases.insert(cases.end(), std::begin(kScaledCases), std::end(kScaledCases));
  return cases;
}

TEST(GemvMmaTest, EmulatedScaledKernelIsWithinTheFloat32SummationBound) {
  for (const Case& c : ScaledCases()) {
    if (c.bf16) {
      CheckCase<MmaBFloat16>(c, false, Form::kScaled);
    } else {
      CheckCase<MmaFloat16>(c, false, Form::kScaled);
    }
  }
}

// Codes (i - 8) / 8 are exact in both types and the absmax powers of two:
// the scaled form's weights are then Dequantize4bit's, and every sum exact.
TEST(GemvMmaTest, EmulatedScaledKernelIsBitExactWhenEverySumIsExact) {
  for (const Case& c : ScaledCases()) {
    CheckCase<MmaBFloat16>(c, true, Form::kScaled);
    CheckCase<MmaFloat16>(c, true, Form::kScaled);
  }
}

// Against Dequantize4bit's weights (the first form's numerics): within a
// rounding of the activation type a weight on each side (2 u |x w| summed)
// besides the float32 bound; and the two forms do differ on NF4 (the
// scaled form is not the first form under another name).
template <typename Tag>
void ExpectScaledWithinAWeightRoundingOfTheFirstForm(const Case& c) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(11);
  Inputs in;
  const int64_t n = c.n_rows * c.k;
  in.packed.resize(static_cast<size_t>(n / 2));
  for (uint8_t& b : in.packed) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f), scale(0.5f, 2.0f);
  in.absmax.resize(static_cast<size_t>((n + c.blocksize - 1) / c.blocksize));
  for (float& a : in.absmax) a = scale(rng);
  in.code = Nf4();
  in.x.resize(static_cast<size_t>(c.m * c.k));
  for (uint16_t& v : in.x) v = Narrow(Tag{}, unit(rng));
  in.bias.resize(static_cast<size_t>(c.n_rows));
  for (uint16_t& v : in.bias) v = Narrow(Tag{}, unit(rng));
  std::string error;
  const std::vector<uint16_t> first = RunEmulated<Tag>(c, in, Form::kRounds, &error);
  ASSERT_EQ(error, "");
  const std::vector<uint16_t> scaled = RunEmulated<Tag>(c, in, Form::kScaled, &error);
  ASSERT_EQ(error, "");
  const double u_type =
      std::is_same_v<Tag, MmaBFloat16> ? std::ldexp(1.0, -9) : std::ldexp(1.0, -11);
  const double u_out = 2 * u_type;
  const double u = std::ldexp(1.0, -24);
  const double gamma = static_cast<double>(2 * c.k) * u;
  int64_t differ = 0, failures = 0;
  for (int32_t m = 0; m < c.m; ++m) {
    for (int64_t row = 0; row < c.n_rows; ++row) {
      double magnitude = 0.0;
      double exact = c.bias ? Widen(Tag{}, in.bias[static_cast<size_t>(row)]) : 0.0;
      for (int64_t i = 0; i < c.k; ++i) {
        const int64_t j = row * c.k + i;
        const uint8_t byte = in.packed[static_cast<size_t>(j / 2)];
        const int nibble = j % 2 == 0 ? byte >> 4 : byte & 0xF;
        const double w = in.code[static_cast<size_t>(nibble)] *
                         static_cast<double>(in.absmax[static_cast<size_t>(j / c.blocksize)]);
        const double p = Widen(Tag{}, in.x[static_cast<size_t>(m * c.k + i)]) * w;
        magnitude += std::fabs(p);
        exact += p;
      }
      const size_t at = static_cast<size_t>(m * c.n_rows + row);
      const double a = Widen(Tag{}, first[at]), b = Widen(Tag{}, scaled[at]);
      // Each form's weights within u_type of the exact code * absmax: the
      // forms within 2 u_type of each other, the float32 sums and the two
      // outputs' roundings besides.
      const double bound = 2 * u_type * magnitude * (1 + 4 * u_type) + 2 * gamma * magnitude +
                           u_out * (std::fabs(exact) + magnitude * 2 * u_type) + 1e-9;
      if (first[at] != scaled[at]) ++differ;
      if (!(std::fabs(a - b) <= bound) && ++failures <= 5) {
        ADD_FAILURE() << "x row " << m << ", row " << row << ": first form " << a << ", scaled "
                      << b << ", bound " << bound;
      }
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GT(differ, 0);
}

TEST(GemvMmaTest, EmulatedScaledKernelIsWithinAWeightRoundingOfTheFirstForm) {
  ExpectScaledWithinAWeightRoundingOfTheFirstForm<MmaBFloat16>(
      {"Bf16Batch1", true, 64, 4096, 64, 1, true});
  ExpectScaledWithinAWeightRoundingOfTheFirstForm<MmaFloat16>(
      {"Fp16FourRows", false, 40, 2048, 128, 4, true});
}

// The byte table: every byte value's pair in every lane's copy (each of the
// 256 threads writes 32 copies of its entry; a copy not written keeps the
// fill pattern), looked up from each position of a word.
TEST(GemvMmaTest, ScaledTableHoldsEveryBytesPairInEveryLanesBank) {
  const std::vector<float> code = Nf4();
  std::vector<uint32_t> table(size_t{256} * kScaledTableCopies, 0xdeadbeefu);
  for (int tid = 0; tid < kMmaThreads; ++tid) {
    BuildScaledTable<MmaBFloat16>(code.data(), tid, table.data());
  }
  for (int lane = 0; lane < 32; ++lane) {
    const TableLane lookup(table.data() + lane);
    for (uint32_t byte = 0; byte < 256; ++byte) {
      const uint32_t want = Narrow(MmaBFloat16{}, code[byte >> 4]) |
                            static_cast<uint32_t>(Narrow(MmaBFloat16{}, code[byte & 15])) << 16;
      // The byte in each position of a word (the others random).
      for (int position = 0; position < 4; ++position) {
        const uint32_t word = byte << (8 * position) | (0x5a5a5a5au & ~(0xffu << (8 * position)));
        ASSERT_EQ(lookup(word, position), want) << "lane " << lane << " byte " << byte;
      }
    }
  }
}

TEST(GemvMmaTest, ScaledFormTakesPowerOfTwoBlocksAndFillsTheDevice) {
  alignas(16) static uint8_t buffer[64];
  EXPECT_TRUE(ScaledTakes(1, 4096, 64, buffer, buffer));
  EXPECT_TRUE(ScaledTakes(8, 256, 4096, buffer, buffer));
  EXPECT_FALSE(ScaledTakes(1, 4096, 192, buffer, buffer));  // a multiple of 64, not a power of 2
  EXPECT_FALSE(ScaledTakes(9, 4096, 64, buffer, buffer));   // more than 8 rows
  EXPECT_FALSE(ScaledTakes(1, 4096, 64, buffer + 2, buffer));
  EXPECT_LE(ScaledSharedBytes(), 48 * 1024);  // no opt-in attribute
  EXPECT_EQ(kScaledTableOffset % 16, 0);      // 16-byte stores of the table
  EXPECT_EQ(ScaledCtas(4096, 264), 256);      // a CTA a tile
  EXPECT_EQ(ScaledCtas(28672, 264), 264);     // 1792 tiles over what the device holds
  EXPECT_EQ(ScaledCtas(37, 264), 3);
  EXPECT_EQ(ScaledCtas(4096, 0), 256);  // occupancy unknown: a CTA a tile
}

TEST(GemvMmaTest, TakesOnlyWhatItCan) {
  alignas(16) static uint8_t buffer[64];
  EXPECT_TRUE(MmaTakes(1, 4096, 64, buffer, buffer));
  EXPECT_TRUE(MmaTakes(8, 256, 4096, buffer, buffer));
  EXPECT_FALSE(MmaTakes(9, 4096, 64, buffer, buffer));       // more than 8 rows
  EXPECT_FALSE(MmaTakes(1, 4096 + 64, 64, buffer, buffer));  // K % 256
  EXPECT_FALSE(MmaTakes(1, 4096, 32, buffer, buffer));       // blocks of 32
  EXPECT_FALSE(MmaTakes(1, 4096, 64, buffer + 2, buffer));   // misaligned x
  EXPECT_FALSE(MmaTakes(1, 4096, 64, buffer, buffer + 8));   // misaligned weights
  EXPECT_LE(MmaSharedBytes(kMmaMaxM), 48 * 1024);
  EXPECT_TRUE(MmaTiledTakes(32, 4096, 64, buffer, buffer));
  EXPECT_TRUE(MmaTiledTakes(9, 256, 4096, buffer, buffer));
  EXPECT_FALSE(MmaTiledTakes(33, 4096, 64, buffer, buffer));       // more than 32 rows
  EXPECT_FALSE(MmaTiledTakes(0, 4096, 64, buffer, buffer));        // no rows
  EXPECT_FALSE(MmaTiledTakes(16, 4096 + 64, 64, buffer, buffer));  // K % 256
  EXPECT_FALSE(MmaTiledTakes(16, 4096, 64, buffer + 2, buffer));   // misaligned x
  EXPECT_LE(MmaTiledSharedBytes(kMmaTiledMaxTiles), 48 * 1024);
  EXPECT_LE(WideSharedBytes(kWideMaxTiles), 48 * 1024);
  // Without an opt-in attribute a kernel gets 48 KiB of shared memory.
  EXPECT_LE(MmaPipelinedSharedBytes(kMmaPipelinedMaxM), 48 * 1024);
}

// --- A mixture of experts' routed rows (Gemv4bitExperts) --------------------------

// Each slot's row from the experts kernel's CTAs equals the one-row kernel's
// (RunEmulated, m = 1) for its expert and x row, bit for bit, in both forms;
// a slot with an index outside the experts is zeros. Three experts of
// different weights, scales and code tables (NF4, and a shuffled NF4), three
// tiles of rows (the last partial), two x rows shared by two slots each.
template <typename Tag>
void ExpectExpertSlotsEqualTheirExpertsRows(Form form) {
  SCOPED_TRACE(form == Form::kScaled ? "scaled" : "first form");
  const Case c = {"Experts", std::is_same_v<Tag, MmaBFloat16>, 40, 512, 64, 1, false};
  std::mt19937_64 rng(23);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f), scale(0.5f, 2.0f);
  const int64_t n = c.n_rows * c.k;
  std::vector<Inputs> experts(3);
  for (size_t e = 0; e < experts.size(); ++e) {
    Inputs& in = experts[e];
    in.packed.resize(static_cast<size_t>(n / 2));
    for (uint8_t& b : in.packed) b = static_cast<uint8_t>(rng());
    in.absmax.resize(static_cast<size_t>(n / c.blocksize));
    for (float& a : in.absmax) a = scale(rng);
    in.code = Nf4();
    if (e == 1) std::shuffle(in.code.begin(), in.code.end(), rng);
  }
  // x [2, k], in 16-byte aligned storage (the kernel's loads).
  std::vector<uint64_t> x_storage(static_cast<size_t>(2 * c.k * 2 / 8));
  uint16_t* x = reinterpret_cast<uint16_t*>(x_storage.data());
  for (int64_t i = 0; i < 2 * c.k; ++i) x[i] = Narrow(Tag{}, unit(rng));
  const std::vector<int64_t> ids = {2, 0, 1, 2, 3, -1};  // the last two outside [0, 3)
  const int64_t slots = static_cast<int64_t>(ids.size());
  std::vector<const uint8_t*> packed;
  std::vector<const float*> absmax, code;
  for (const Inputs& in : experts) {
    packed.push_back(in.packed.data());
    absmax.push_back(in.absmax.data());
    code.push_back(in.code.data());
  }
  ExpertRows rows;
  rows.expert_ids = ids.data();
  rows.packed = packed.data();
  rows.absmax = absmax.data();
  rows.code = code.data();
  rows.experts = 3;
  rows.slots_per_x = 2;
  std::vector<uint16_t> y(static_cast<size_t>(slots * c.n_rows), 0xffffu);  // NaN
  GemvMmaParams base;
  base.x = x;
  base.y = y.data();
  base.n_rows = c.n_rows;
  base.k = c.k;
  base.blocksize = c.blocksize;
  const int64_t tiles = (c.n_rows + kMmaRows - 1) / kMmaRows;
  const int64_t ctas = form == Form::kScaled ? 2 : tiles;  // the scaled form: 2 CTAs, 3 tiles
  const int64_t bytes = form == Form::kScaled ? ScaledSharedBytes() : MmaSharedBytes(1);
  std::vector<uint64_t> shared(static_cast<size_t>(bytes / 8 + 1));
  CtaEmulator cta(kMmaThreads);
  for (int64_t slot = 0; slot < slots; ++slot) {
    for (int64_t first = 0; first < ctas; ++first) {
      std::fill(shared.begin(), shared.end(), ~uint64_t{0});
      uint8_t* sh = reinterpret_cast<uint8_t*>(shared.data());
      const std::string error = cta.Run([&](CtaEmulator::Exec& exec) {
        HostExec host(exec);
        if (form == Form::kScaled) {
          Gemv4bitExpertsScaledCta<Tag>(base, rows, slot, first, ctas, sh, host);
        } else {
          Gemv4bitExpertsMmaCta<Tag>(base, rows, slot, first, sh, host);
        }
      });
      ASSERT_EQ(error, "");
    }
  }
  for (int64_t slot = 0; slot < slots; ++slot) {
    SCOPED_TRACE(::testing::Message() << "slot " << slot);
    const int64_t e = ids[static_cast<size_t>(slot)];
    std::vector<uint16_t> want(static_cast<size_t>(c.n_rows), 0);
    if (e >= 0 && e < 3) {
      Inputs one = experts[static_cast<size_t>(e)];
      const uint16_t* row = x + (slot / 2) * c.k;
      one.x.assign(row, row + c.k);
      std::string error;
      want = RunEmulated<Tag>(c, one, form, &error);
      ASSERT_EQ(error, "");
    }
    const std::vector<uint16_t> got(y.begin() + slot * c.n_rows, y.begin() + (slot + 1) * c.n_rows);
    EXPECT_EQ(got, want);
  }
}

TEST(GemvMmaTest, EmulatedExpertsKernelGivesEachSlotItsExpertsRowBitForBit) {
  ExpectExpertSlotsEqualTheirExpertsRows<MmaBFloat16>(Form::kScaled);
  ExpectExpertSlotsEqualTheirExpertsRows<MmaBFloat16>(Form::kRounds);
  ExpectExpertSlotsEqualTheirExpertsRows<MmaFloat16>(Form::kScaled);
  ExpectExpertSlotsEqualTheirExpertsRows<MmaFloat16>(Form::kRounds);
}

}  // namespace
}  // namespace accel::quant::cuda::internal
