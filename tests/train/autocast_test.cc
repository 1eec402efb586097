// The autocast scope: CPU bfloat16 regions, nesting, restore on exit.
#include "train/autocast.h"

#include <ATen/Functions.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

namespace accel::train {
namespace {

TEST(AutocastScope, CpuBfloat16RegionNestsAndRestores) {
  const at::Tensor a = at::ones({2, 3}), b = at::ones({3, 2});
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
  {
    AutocastScope bf16(c10::DeviceType::CPU, true, at::kBFloat16);
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);
    // The other matrix products 1.13's CPU autocast lowers.
    EXPECT_EQ(at::matmul(a, b).scalar_type(), at::kBFloat16);
    EXPECT_EQ(at::linear(a, b.t()).scalar_type(), at::kBFloat16);
    // Pointwise ops are not on the list: they keep float32.
    EXPECT_EQ(at::add(a, a).scalar_type(), at::kFloat);
    {
      AutocastScope off(c10::DeviceType::CPU, false, at::kBFloat16);
      EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
    }
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
  // The nesting count is back to zero: one more exit would go negative.
  EXPECT_EQ(at::autocast::increment_nesting(), 1);
  EXPECT_EQ(at::autocast::decrement_nesting(), 0);
}

TEST(AutocastScope, CacheSettingIsScopedToo) {
  const bool before = at::autocast::is_autocast_cache_enabled();
  {
    AutocastScope no_cache(c10::DeviceType::CPU, true, at::kBFloat16, /*cache_enabled=*/false);
    EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
  }
  EXPECT_EQ(at::autocast::is_autocast_cache_enabled(), before);
}

TEST(AutocastScope, CpuFloat16IsDisabledAsPythonDoes) {
  const at::Tensor a = at::ones({2, 3}), b = at::ones({3, 2});
  {
    AutocastScope half(c10::DeviceType::CPU, true, at::kHalf);
    EXPECT_FALSE(at::autocast::is_cpu_enabled());
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
    EXPECT_EQ(at::autocast::get_autocast_cpu_dtype(), at::kBFloat16);  // untouched
  }
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
}

}  // namespace
}  // namespace accel::train
