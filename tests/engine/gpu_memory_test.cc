// --gpu_memory_utilization's arithmetic with made-up device figures (a fake
// probe stands for the CUDA device): the blocks it gives, the refusals
// naming the flag and the figures, and the profile read around a forward.
#include "engine/gpu_memory.h"

#include <algorithm>
#include <cstdint>
#include <memory>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::engine {
namespace {

using ::accel::test::IsOk;
using ::accel::test::IsOkAndHolds;
using ::accel::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

TEST(GpuMemoryTest, BlocksAreWhatUtilizationLeavesAfterWeightsAndPeak) {
  // An 80 GiB card, 16 GiB in use after loading, a 2 GiB activation peak:
  // 0.9 x 80 - 16 - 2 = 54 GiB, in 2 MiB blocks.
  const DeviceMemoryProfile profile{80 * kGiB, 16 * kGiB, 2 * kGiB};
  EXPECT_EQ(KvBytesFromDeviceMemory(0.9, profile),
            static_cast<int64_t>(0.9 * 80 * kGiB) - 18 * kGiB);
  const int64_t expected = (static_cast<int64_t>(0.9 * 80 * kGiB) - 18 * kGiB) / (2 * kMiB);
  EXPECT_THAT(KvBlocksFromDeviceMemory(0.9, profile, 2 * kMiB), IsOkAndHolds(expected));
  EXPECT_EQ(expected, 27648);
  // All of the card: 80 - 18 GiB.
  EXPECT_THAT(KvBlocksFromDeviceMemory(1.0, profile, 2 * kMiB), IsOkAndHolds(62 * 512));
  // A block that does not divide the room: the whole blocks only.
  EXPECT_THAT(KvBlocksFromDeviceMemory(1.0, DeviceMemoryProfile{10 * kMiB, 0, 0}, 3 * kMiB),
              IsOkAndHolds(3));
}

TEST(GpuMemoryTest, UtilizationOutsideZeroToOneIsRefusedNamingTheFlag) {
  const DeviceMemoryProfile profile{80 * kGiB, 16 * kGiB, 2 * kGiB};
  for (double bad : {0.0, -0.5, 1.01, 90.0}) {
    EXPECT_THAT(CheckGpuMemoryUtilization(bad),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("--gpu_memory_utilization="), HasSubstr("(0, 1]"))))
        << bad;
    EXPECT_THAT(
        KvBlocksFromDeviceMemory(bad, profile, kMiB),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--gpu_memory_utilization")));
  }
  EXPECT_THAT(CheckGpuMemoryUtilization(1.0), IsOk());
  EXPECT_THAT(CheckGpuMemoryUtilization(0.01), IsOk());
}

TEST(GpuMemoryTest, NoRoomForOneBlockIsRefusedWithTheFigures) {
  // 0.5 x 24 GiB = 12 GiB, less 11 GiB of weights and a 1.5 GiB peak: negative.
  const DeviceMemoryProfile full{24 * kGiB, 11 * kGiB, 3 * kGiB / 2};
  EXPECT_THAT(KvBlocksFromDeviceMemory(0.5, full, 2 * kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--gpu_memory_utilization=0.5"), HasSubstr("24.0 GiB"),
                             HasSubstr("11.0 GiB in use after loading"),
                             HasSubstr("1.50 GiB activation peak"), HasSubstr("not one block"),
                             HasSubstr("block of 2.00 MiB"), HasSubstr("--kv_cache_memory"))));
  // Room, but less than one block.
  const DeviceMemoryProfile almost{10 * kMiB, 8 * kMiB, kMiB};
  EXPECT_THAT(KvBlocksFromDeviceMemory(1.0, almost, 2 * kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not one block")));
  EXPECT_THAT(KvBlocksFromDeviceMemory(1.0, almost, kMiB), IsOkAndHolds(1));
}

// A device whose allocator a "forward" moves: allocated bytes go up by
// `forward_peak` and back down.
class FakeProbe : public DeviceMemoryProbe {
 public:
  absl::StatusOr<int64_t> TotalBytes() override { return total; }
  absl::StatusOr<int64_t> UsedBytes() override { return used; }
  int64_t AllocatedBytes() override { return allocated; }
  int64_t PeakAllocatedBytes() override { return peak; }
  void ResetPeak() override {
    peak = allocated;
    ++resets;
  }
  void Allocate(int64_t bytes) {
    allocated += bytes;
    peak = std::max(peak, allocated);
  }

  int64_t total = 40 * kGiB, used = 10 * kGiB, allocated = 9 * kGiB, peak = 20 * kGiB;
  int resets = 0;
};

TEST(GpuMemoryTest, ProfileReadsThePeakTheForwardAdds) {
  FakeProbe probe;
  int forwards = 0;
  ACCEL_ASSERT_OK_AND_ASSIGN(DeviceMemoryProfile profile, ProfileDeviceMemory(probe, [&] {
                               ++forwards;
                               probe.Allocate(3 * kGiB);
                               probe.Allocate(-3 * kGiB);
                               probe.Allocate(kGiB);  // a peak of 3 GiB, 1 GiB kept
                               probe.Allocate(-kGiB);
                               return absl::OkStatus();
                             }));
  EXPECT_EQ(forwards, 1);
  EXPECT_EQ(probe.resets, 1);  // the load's earlier 20 GiB peak does not count
  EXPECT_EQ(profile.total_bytes, 40 * kGiB);
  EXPECT_EQ(profile.used_after_load_bytes, 10 * kGiB);
  EXPECT_EQ(profile.activation_peak_bytes, 3 * kGiB);
  EXPECT_THAT(profile.ToString(), HasSubstr("3.00 GiB activation peak"));
  // 0.9 x 40 - 10 - 3 = 23 GiB.
  EXPECT_THAT(KvBlocksFromDeviceMemory(0.9, profile, kGiB), IsOkAndHolds(23));
}

TEST(GpuMemoryTest, ProfileReturnsTheForwardsError) {
  FakeProbe probe;
  EXPECT_THAT(ProfileDeviceMemory(probe, [] { return absl::InternalError("out of memory"); }),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("out of memory")));
}

TEST(GpuMemoryTest, NoProbeWithoutACudaLibtorchOrDevice) {
  // On this machine's libtorch (no CUDA): Unimplemented; on a CUDA build,
  // no machine has a device at index 99.
  const absl::Status status = CudaMemoryProbe(99).status();
  EXPECT_TRUE(status.code() == absl::StatusCode::kUnimplemented ||
              status.code() == absl::StatusCode::kInvalidArgument)
      << status;
  EXPECT_THAT(status.message(), HasSubstr("cuda:99"));
}

}  // namespace
}  // namespace accel::engine
