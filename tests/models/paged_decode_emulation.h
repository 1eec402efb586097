// The paged decode kernels' grid run on the host (models/cuda/internal/
// paged_decode.h through tests/testing/cta_emulator.h), as
// models/cuda/paged_attention.cu launches it: kv_heads x seqs x max_splits
// decode CTAs, then, with splits, one reduce per (sequence, head). The
// parameters' pointers are host memory. Returns "" or what went wrong: a
// barrier not every thread reached, a write past a CTA's shared memory, or
// parameters the kernels refuse.
#ifndef ACCEL_TESTS_MODELS_PAGED_DECODE_EMULATION_H_
#define ACCEL_TESTS_MODELS_PAGED_DECODE_EMULATION_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "models/cuda/internal/paged_decode.h"
#include "models/cuda/paged_decode_params.h"
#include "tests/testing/cta_emulator.h"

namespace accel::models::testing {

template <typename Tag>
std::string EmulatePagedDecodeAs(const cuda::PagedDecodeParams& p, cuda::KvDType dtype) {
  if (const char* refused = cuda::CheckPagedDecodeParams(p, dtype)) return refused;
  const cuda::DecodeLayout l =
      cuda::MakeDecodeLayout(p.heads, p.kv_heads, p.head_dim, p.value_dim, p.partition,
                             cuda::KvDTypeSize(dtype), cuda::kDecodeThreads);
  accel::testing::CtaEmulator cta(cuda::kDecodeThreads);
  // The CTA's shared memory, then a guard that must stay untouched (on the
  // device a write past the allocation faults).
  constexpr size_t kGuard = 4096;
  constexpr uint32_t kGuardBits = 0x7fc0dead;
  std::vector<float> shared(static_cast<size_t>(l.total_floats) + kGuard);
  for (int32_t z = 0; z < p.max_splits; ++z) {
    for (int32_t y = 0; y < p.seqs; ++y) {
      for (int32_t x = 0; x < p.kv_heads; ++x) {
        const std::string where = "CTA (" + std::to_string(x) + ", " + std::to_string(y) + ", " +
                                  std::to_string(z) + "): ";
        // Shared memory starts as garbage on the device: NaN here.
        std::fill(shared.begin(), shared.end(), std::numeric_limits<float>::quiet_NaN());
        for (size_t i = shared.size() - kGuard; i < shared.size(); ++i) {
          std::memcpy(&shared[i], &kGuardBits, 4);
        }
        const std::string error = cta.Run([&](accel::testing::CtaEmulator::Exec& exec) {
          cuda::internal::DecodeSplit<Tag>(p, x, y, z, shared.data(), exec);
        });
        if (!error.empty()) return where + error;
        for (size_t i = shared.size() - kGuard; i < shared.size(); ++i) {
          uint32_t bits;
          std::memcpy(&bits, &shared[i], 4);
          if (bits != kGuardBits) {
            return where + "wrote shared float " + std::to_string(i) + " past the " +
                   std::to_string(l.total_floats) + " it has";
          }
        }
      }
    }
  }
  if (p.max_splits > 1) {
    for (int32_t y = 0; y < p.seqs; ++y) {
      for (int32_t x = 0; x < p.heads; ++x) {
        for (int32_t t = 0; t < 128; ++t) cuda::internal::ReduceSplits<Tag>(p, y, x, t, 128);
      }
    }
  }
  return "";
}

inline std::string EmulatePagedDecode(const cuda::PagedDecodeParams& p, cuda::KvDType dtype) {
  switch (dtype) {
    case cuda::KvDType::kFloat32:
      return EmulatePagedDecodeAs<cuda::internal::Float32>(p, dtype);
    case cuda::KvDType::kBFloat16:
      return EmulatePagedDecodeAs<cuda::internal::BFloat16>(p, dtype);
    case cuda::KvDType::kFloat16:
      return EmulatePagedDecodeAs<cuda::internal::Float16>(p, dtype);
  }
  return "unknown dtype";
}

}  // namespace accel::models::testing

#endif  // ACCEL_TESTS_MODELS_PAGED_DECODE_EMULATION_H_
