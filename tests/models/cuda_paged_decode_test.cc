// The paged decode attention kernels' code (models/cuda/internal/
// paged_decode.h, models/cuda/paged_decode_params.h) run on the host: each
// CTA emulated thread by thread (tests/testing/cta_emulator.h: fibers that
// meet at every barrier and exchange, as the device's threads do), over the
// same grid the kernels launch, against a plain double-precision reference
// (tests/models/paged_decode_reference.h). What this verifies without a
// GPU: the block-table indexing, the lanes' split of a key, the split
// boundaries over windows and block edges, the per-split softmax, the value
// sums and the reduce over splits, and that every barrier and shuffle is
// reached by every thread. What only a device verifies
// (cuda_attention_kernels_test.cc): the CUDA intrinsics, vector loads and
// the launch itself.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "models/cuda/internal/paged_decode.h"
#include "models/cuda/paged_decode_params.h"
#include "tests/models/paged_decode_emulation.h"
#include "tests/models/paged_decode_reference.h"
#include "tests/testing/cta_emulator.h"

namespace accel::models::cuda {
namespace {

using accel::testing::CtaEmulator;
using models::testing::CompareDecode;
using models::testing::DecodeCase;
using models::testing::DecodeProblem;
using models::testing::EmulatePagedDecode;
using models::testing::KvDTypeName;
using models::testing::MakeDecodeProblem;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// --- Conversions -------------------------------------------------------------

TEST(PagedDecodeConversionsTest, KnownBitPatterns) {
  using internal::BFloat16;
  using internal::Float16;
  EXPECT_EQ(internal::ToFloat(BFloat16{}, 0x3f80), 1.0f);
  EXPECT_EQ(internal::ToFloat(BFloat16{}, 0xc040), -3.0f);
  EXPECT_EQ(internal::ToFloat(Float16{}, 0x3c00), 1.0f);
  EXPECT_EQ(internal::ToFloat(Float16{}, 0xc000), -2.0f);
  EXPECT_EQ(internal::ToFloat(Float16{}, 0x7bff), 65504.0f);
  EXPECT_EQ(internal::ToFloat(Float16{}, 0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(internal::ToFloat(Float16{}, 0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(internal::ToFloat(Float16{}, 0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(internal::ToFloat(Float16{}, 0x7e00)));
  EXPECT_EQ(Bits(internal::ToFloat(Float16{}, 0x8000)), 0x80000000u);  // -0
  // Round to nearest, ties to even.
  EXPECT_EQ(internal::FromFloat(BFloat16{}, 1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie, even
  EXPECT_EQ(internal::FromFloat(BFloat16{}, 1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(internal::FromFloat(Float16{}, 1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie, even
  EXPECT_EQ(internal::FromFloat(Float16{}, 1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(internal::FromFloat(Float16{}, 65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(internal::FromFloat(Float16{}, 65519.0f), 0x7bff);
  EXPECT_EQ(internal::FromFloat(Float16{}, std::ldexp(1.0f, -25)), 0x0000);  // tie to 0
  EXPECT_EQ(internal::FromFloat(Float16{}, std::ldexp(3.0f, -25)), 0x0002);  // tie to even
}

TEST(PagedDecodeConversionsTest, EverySixteenBitPatternRoundTrips) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const auto b = static_cast<uint16_t>(bits);
    const float bf = internal::ToFloat(internal::BFloat16{}, b);
    const float hf = internal::ToFloat(internal::Float16{}, b);
    if (!std::isnan(bf)) {
      ASSERT_EQ(internal::FromFloat(internal::BFloat16{}, bf), b) << std::hex << bits;
    }
    if (!std::isnan(hf)) {
      ASSERT_EQ(internal::FromFloat(internal::Float16{}, hf), b) << bits;
    }
  }
}

// --- The plan -----------------------------------------------------------------

TEST(PagedDecodePlanTest, SplitsTileTheAttendedPositions) {
  for (int32_t partition : {1, 16, 32, 64, 512}) {
    for (int32_t window : {0, 1, 7, 64, 1000}) {
      for (int32_t total = 1; total <= 300; ++total) {
        SCOPED_TRACE("partition " + std::to_string(partition) + " window " +
                     std::to_string(window) + " total " + std::to_string(total));
        const int32_t first = window > 0 && total > window ? total - window : 0;
        ASSERT_EQ(FirstAttended(total, window), first);
        const int32_t count = PagedDecodeSplits(total, window, partition);
        ASSERT_GE(count, 1);
        int32_t next = first;
        for (int32_t s = 0; s < count; ++s) {
          const PositionRange r = SplitPositions(total, window, partition, s);
          ASSERT_EQ(r.begin, next);
          ASSERT_LT(r.begin, r.end);
          ASSERT_LE(r.end - r.begin, partition);
          // Cuts fall on multiples of the partition (inside the window).
          if (s + 1 < count) {
            ASSERT_EQ(r.end % partition, 0);
          }
          next = r.end;
        }
        ASSERT_EQ(next, total);
        const PositionRange past = SplitPositions(total, window, partition, count);
        ASSERT_GE(past.begin, past.end);
      }
    }
  }
}

// A static step launches PagedDecodeMaxSplits(max_total) splits a row: never
// fewer than any row up to max_total long has (the device run of 2026-11-29
// found a windowed row with one more split than the longest), and no more
// than some row has.
TEST(PagedDecodePlanTest, MaxSplitsIsTheMostAnyShorterSequenceHas) {
  for (int32_t partition : {1, 16, 32, 64, 512}) {
    for (int32_t window : {0, 1, 7, 64, 100, 1000}) {
      for (int32_t max_total = 1; max_total <= 1700; max_total += max_total < 200 ? 1 : 37) {
        int32_t most = 0;
        for (int32_t total = 1; total <= max_total; ++total) {
          most = std::max(most, PagedDecodeSplits(total, window, partition));
        }
        ASSERT_EQ(PagedDecodeMaxSplits(max_total, window, partition), most)
            << "partition " << partition << " window " << window << " max_total " << max_total;
      }
    }
  }
  // The failing case: rows of 3, 40 and 400 under a window of 100, planned for 1600.
  EXPECT_EQ(PagedDecodeSplits(1600, 100, 64), 2);
  EXPECT_EQ(PagedDecodeSplits(400, 100, 64), 3);
  EXPECT_EQ(PagedDecodeMaxSplits(1600, 100, 64), 3);
}

TEST(PagedDecodePlanTest, KvRowOffsetFollowsTheBlockTable) {
  // Block store [blocks, kv_heads = 3, block_size = 4, width = 8].
  const int32_t table[] = {5, 0, 2};
  EXPECT_EQ(KvRowOffset(table, 0, 4, 3, 0, 8), ((5 * 3 + 0) * 4 + 0) * 8);
  EXPECT_EQ(KvRowOffset(table, 3, 4, 3, 2, 8), ((5 * 3 + 2) * 4 + 3) * 8);
  EXPECT_EQ(KvRowOffset(table, 4, 4, 3, 1, 8), ((0 * 3 + 1) * 4 + 0) * 8);
  EXPECT_EQ(KvRowOffset(table, 10, 4, 3, 1, 8), ((2 * 3 + 1) * 4 + 2) * 8);
}

TEST(PagedDecodePlanTest, LayoutCoversHeadDimsAndValueDims) {
  for (int32_t elem : {2, 4}) {
    for (int32_t dim = 8; dim <= kMaxHeadDim; dim += 8) {
      const DecodeLayout l = MakeDecodeLayout(8, 2, dim, dim, 64, elem, kDecodeThreads);
      SCOPED_TRACE("elem " + std::to_string(elem) + " dim " + std::to_string(dim));
      EXPECT_EQ(l.chunks * l.vec, dim);
      EXPECT_LE(l.chunks, l.lanes * kMaxChunksPerLane);  // every chunk has a lane
      EXPECT_TRUE(l.lanes >= 1 && l.lanes <= 32 && (l.lanes & (l.lanes - 1)) == 0);
      EXPECT_EQ(l.keys_per_pass * l.lanes, kDecodeThreads);
      // Values as keys: every chunk has a lane, lanes a power of two.
      EXPECT_EQ(l.value_chunks * l.vec, dim);
      EXPECT_LE(l.value_chunks, l.value_lanes * kMaxChunksPerLane);
      EXPECT_TRUE(l.value_lanes >= 1 && l.value_lanes <= 32 &&
                  (l.value_lanes & (l.value_lanes - 1)) == 0);
      EXPECT_EQ(l.value_slots * l.value_lanes, kDecodeThreads);
      // The warps' sums fit where q was.
      EXPECT_GE(l.q_region_floats, l.q_floats);
      EXPECT_GE(l.q_region_floats, (kDecodeThreads / 32) * kValueHeadTile * dim);
    }
  }
}

TEST(PagedDecodePlanTest, PartitionFitsSharedMemoryAndFillsTheDevice) {
  // One long sequence, 8 kv heads on 132 SMs: halved until 2 CTAs per SM.
  EXPECT_EQ(ChoosePagedPartition(1, 32, 8, 128, 128, 4096, 0, KvDType::kBFloat16, 132), 64);
  // A batch large enough already: 512.
  EXPECT_EQ(ChoosePagedPartition(64, 32, 8, 128, 128, 4096, 0, KvDType::kBFloat16, 132), 512);
  // Without a device's SM count, only the shared memory counts.
  EXPECT_EQ(ChoosePagedPartition(1, 32, 8, 128, 128, 4096, 0, KvDType::kBFloat16, 0), 512);
  // A window bounds the work: 4096 positions, 256 attended, in 4 splits of 64.
  const int32_t windowed =
      ChoosePagedPartition(1, 32, 8, 128, 128, 4096, 256, KvDType::kBFloat16, 132);
  EXPECT_EQ(windowed, 64);
  EXPECT_EQ(PagedDecodeSplits(4096, 256, windowed), 4);
  // A large group with 256-wide heads: the scores must fit 48 KiB.
  const int32_t p = ChoosePagedPartition(64, 32, 1, 256, 256, 4096, 0, KvDType::kFloat32, 0);
  PagedDecodeParams params;
  params.heads = 32;
  params.kv_heads = 1;
  params.head_dim = params.value_dim = 256;
  params.partition = p;
  EXPECT_LE(PagedDecodeSharedBytes(params, KvDType::kFloat32), kDecodeSharedLimit);
  params.partition = 2 * p;
  EXPECT_GT(PagedDecodeSharedBytes(params, KvDType::kFloat32), kDecodeSharedLimit);
}

TEST(PagedDecodePlanTest, ParametersTheKernelsCannotTakeAreNamed) {
  std::vector<float> data(64);
  alignas(16) static float blocks[1024];
  const int32_t one = 1;
  PagedDecodeParams ok;
  ok.q = data.data();
  ok.key_blocks = ok.value_blocks = blocks;
  ok.block_tables = ok.totals = &one;
  ok.out = data.data();
  ok.num_blocks = 1;
  ok.seqs = 1;
  ok.heads = 4;
  ok.kv_heads = 2;
  ok.block_size = 16;
  ok.head_dim = ok.value_dim = 64;
  ok.table_stride = 1;
  ok.partition = 512;
  ASSERT_EQ(CheckPagedDecodeParams(ok, KvDType::kFloat32), nullptr);
  auto refused = [&](auto change) {
    PagedDecodeParams p = ok;
    change(p);
    const char* why = CheckPagedDecodeParams(p, KvDType::kFloat32);
    return why == nullptr ? std::string() : std::string(why);
  };
  EXPECT_EQ(refused([](PagedDecodeParams& p) { p.q = nullptr; }), "a null pointer");
  EXPECT_NE(refused([](PagedDecodeParams& p) { p.max_splits = 2; }).find("workspace"),
            std::string::npos);
  EXPECT_NE(refused([](PagedDecodeParams& p) { p.heads = 5; }).find("multiple of kv_heads"),
            std::string::npos);
  EXPECT_NE(refused([](PagedDecodeParams& p) { p.head_dim = 60; }).find("multiples of 8"),
            std::string::npos);
  EXPECT_NE(refused([](PagedDecodeParams& p) { p.value_dim = 264; }).find("multiples of 8"),
            std::string::npos);
  EXPECT_NE(refused([](PagedDecodeParams& p) {
              p.key_blocks = reinterpret_cast<const char*>(blocks) + 4;
            }).find("16-byte aligned"),
            std::string::npos);
  EXPECT_NE(refused([](PagedDecodeParams& p) { p.partition = 0; }).find("partition"),
            std::string::npos);
  EXPECT_NE(refused([](PagedDecodeParams& p) { p.softcap = -1; }).find("soft-cap"),
            std::string::npos);
  EXPECT_NE(refused([](PagedDecodeParams& p) {
              p.heads = p.kv_heads = 1;
              p.head_dim = p.value_dim = 256;
              p.partition = 100000;
            }).find("shared memory"),
            std::string::npos);
}

// --- The emulator itself --------------------------------------------------------

TEST(CtaEmulatorTest, ThreadsMeetAtBarriersAndExchangeWithinWarps) {
  CtaEmulator cta(64);
  std::vector<float> shared(64, 0.0f);
  std::vector<float> got(64, 0.0f);
  const std::string error = cta.Run([&](CtaEmulator::Exec& exec) {
    const int32_t t = exec.tid();
    shared[static_cast<size_t>(t)] = static_cast<float>(t);
    exec.Sync();
    // Everything written before the barrier is seen after it.
    float sum = 0;
    for (float v : shared) sum += v;
    // A butterfly over each group of 8 lanes.
    float x = static_cast<float>(t);
    for (int32_t mask = 4; mask >= 1; mask /= 2) x += exec.XorLanes(x, mask);
    got[static_cast<size_t>(t)] = x + sum;
  });
  ASSERT_EQ(error, "");
  for (int32_t t = 0; t < 64; ++t) {
    const int32_t base = t / 8 * 8;
    const float lanes = static_cast<float>(8 * base + 28);  // base + ... + base + 7
    EXPECT_EQ(got[static_cast<size_t>(t)], lanes + 2016.0f) << t;
  }
  EXPECT_EQ(cta.barriers(), 1);  // the exchanges are warp-level
}

TEST(CtaEmulatorTest, ABarrierSomeThreadsSkipIsReported) {
  CtaEmulator cta(32);
  const std::string skipped = cta.Run([](CtaEmulator::Exec& exec) {
    if (exec.tid() != 3) exec.Sync();
  });
  EXPECT_NE(skipped.find("finished while 31 wait"), std::string::npos) << skipped;
  const std::string mismatched = cta.Run([](CtaEmulator::Exec& exec) {
    if (exec.tid() == 0) {
      exec.Sync();
    } else {
      exec.XorLanes(1.0f, 1);
    }
  });
  EXPECT_NE(mismatched.find("XorLanes(mask 1)"), std::string::npos) << mismatched;
  // A shuffle only part of a warp reaches.
  const std::string partial = cta.Run([](CtaEmulator::Exec& exec) {
    if (exec.tid() < 16) exec.XorLanes(1.0f, 1);
  });
  EXPECT_NE(partial.find("16 lanes wait"), std::string::npos) << partial;
}

TEST(CtaEmulatorTest, WarpsMeetOnTheirOwn) {
  // Warp 1 runs twice as many warp-level steps as warp 0: fine on the
  // device, and here, as long as each warp agrees with itself.
  CtaEmulator cta(64);
  std::vector<int32_t> gathered(64);
  const std::string error = cta.Run([&](CtaEmulator::Exec& exec) {
    const int32_t t = exec.tid();
    int32_t sum = 0;
    for (int round = 0; round < (t < 32 ? 1 : 2); ++round) {
      int32_t all[32];
      exec.WarpGather(&t, sizeof(t), all);
      for (int32_t v : all) sum += v;
      exec.WarpSync();
    }
    exec.Sync();
    gathered[static_cast<size_t>(t)] = sum;
  });
  ASSERT_EQ(error, "");
  EXPECT_EQ(gathered[0], 496);        // 0 + ... + 31
  EXPECT_EQ(gathered[40], 2 * 1520);  // 32 + ... + 63, twice
}

// --- The kernels, emulated ------------------------------------------------------

class PagedDecodeEmulationTest : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(PagedDecodeEmulationTest, MatchesTheReference) {
  const DecodeCase& c = GetParam();
  const DecodeProblem pr = MakeDecodeProblem(c, 11);
  // Output starts as NaN: an element no thread writes shows.
  std::vector<uint8_t> out(pr.out_elements() * static_cast<size_t>(pr.elem()), 0xff);
  std::vector<float> workspace(static_cast<size_t>(
      PagedDecodeWorkspaceFloats(pr.seqs, c.heads, c.value_dim, pr.max_splits)));
  const PagedDecodeParams p =
      pr.Params(pr.q.data(), pr.keys.data(), pr.values.data(), pr.tables.data(), pr.totals.data(),
                out.data(), workspace.empty() ? nullptr : workspace.data());
  ASSERT_EQ(EmulatePagedDecode(p, c.dtype), "");
  std::string what;
  EXPECT_EQ(CompareDecode(pr, out, &what), 0)
      << KvDTypeName(c.dtype) << ", partition " << pr.partition << ", " << pr.max_splits
      << " splits\n"
      << what;
}

std::vector<DecodeCase> EmulatedCases() {
  std::vector<DecodeCase> cases;
  auto add = [&](DecodeCase c) { cases.push_back(std::move(c)); };
  DecodeCase c;
  // GQA (4 query heads a kv head), lengths around the 16-token blocks, one split.
  c = {};
  c.name = "Bf16Gqa";
  c.totals = {1, 7, 16, 17, 33, 70};
  add(c);
  // Long contexts over 64-position splits, three of 128-wide heads.
  c = {};
  c.name = "Fp16GqaSplits";
  c.dtype = KvDType::kFloat16;
  c.head_dim = c.value_dim = 128;
  c.totals = {1, 100, 300};
  c.partition = 64;
  add(c);
  // One kv head (MQA), a window, blocks of 5: block edges never meet split edges.
  c = {};
  c.name = "F32MqaWindowOddBlocks";
  c.dtype = KvDType::kFloat32;
  c.heads = 4;
  c.kv_heads = 1;
  c.block_size = 5;
  c.window = 37;
  c.totals = {3, 37, 38, 200};
  c.partition = 32;
  add(c);
  // A window inside a long context: only the last two splits exist.
  c = {};
  c.name = "Bf16WindowInLongContext";
  c.window = 100;
  c.totals = {700, 64, 101};
  c.partition = 64;
  add(c);
  // Soft-capped scores (Gemma 2), no grouping, 96-wide heads (12 of 16 lanes).
  c = {};
  c.name = "Bf16SoftcapHead96";
  c.heads = c.kv_heads = 4;
  c.head_dim = c.value_dim = 96;
  c.softcap = 2.0f;
  c.totals = {20, 129};
  c.partition = 64;
  add(c);
  // 256-wide heads (Gemma): two chunks a lane in float32, two value columns a thread.
  c = {};
  c.name = "F32Head256Splits";
  c.dtype = KvDType::kFloat32;
  c.heads = 4;
  c.head_dim = c.value_dim = 256;
  c.totals = {600, 5};
  c.partition = 128;
  add(c);
  c.name = "Fp16Head256";
  c.dtype = KvDType::kFloat16;
  c.totals = {70};
  c.partition = 32;
  add(c);
  // Values narrower than keys: 32-wide rows, 8 lanes, 16 rows at a time.
  c = {};
  c.name = "F32NarrowValues";
  c.dtype = KvDType::kFloat32;
  c.heads = 2;
  c.kv_heads = 1;
  c.value_dim = 32;
  c.totals = {50, 90};
  c.partition = 32;
  add(c);
  // 40-wide values: 10 chunks over 16 lanes, 6 lanes with no value work.
  c.name = "F32Values40";
  c.value_dim = 40;
  c.head_dim = 40;
  add(c);
  // Llama-3-8B's shape (group 4, 128-wide heads) over one full split and a
  // part: the unrolled key and value rounds end inside a block.
  c = {};
  c.name = "Bf16Llama3Shape";
  c.heads = 8;
  c.kv_heads = 2;
  c.head_dim = c.value_dim = 128;
  c.totals = {1000, 517, 33};
  c.partition = 512;
  add(c);
  // 40-wide bfloat16 values: 5 chunks over 8 lanes.
  c = {};
  c.name = "Bf16Values40";
  c.head_dim = c.value_dim = 40;
  c.totals = {90, 3};
  c.partition = 32;
  add(c);
  // A group of 12: more heads than warps and than a thread's head tile.
  c = {};
  c.name = "Bf16Group12";
  c.heads = 12;
  c.kv_heads = 1;
  c.totals = {45, 2};
  add(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, PagedDecodeEmulationTest, ::testing::ValuesIn(EmulatedCases()),
                         [](const ::testing::TestParamInfo<DecodeCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace accel::models::cuda
