// What the fused decoder-step kernels' tests share (tests/models/
// fused_ops_test.cc, decode_gemv_test.cc): the three storage dtypes as
// libtorch and the kernels name them, and the RMSNorm kernel's grid run on
// the host (models/cuda/internal/fused_ops.h's RmsNormRow, a CTA a row,
// through tests/testing/cta_emulator.h).
#ifndef ACCEL_TESTS_MODELS_FUSED_OPS_EMULATION_H_
#define ACCEL_TESTS_MODELS_FUSED_OPS_EMULATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "models/cuda/fused_ops.h"
#include "models/cuda/internal/fused_ops.h"
#include "tests/testing/cta_emulator.h"

namespace accel::models::testing {

struct KernelDType {
  const char* name;
  at::ScalarType type;
  cuda::KvDType kernel;
};
inline const KernelDType kKernelDTypes[] = {{"float32", at::kFloat, cuda::KvDType::kFloat32},
                                            {"bfloat16", at::kBFloat16, cuda::KvDType::kBFloat16},
                                            {"float16", at::kHalf, cuda::KvDType::kFloat16}};

// Every row of `p` by the RMSNorm kernel's code; "" or where the threads
// did not meet.
inline std::string EmulateRmsNorm(const cuda::RmsNormParams& p, cuda::KvDType dtype) {
  accel::testing::CtaEmulator cta(cuda::kRmsNormThreads);
  std::vector<float> shared(cuda::kRmsNormThreads / 32);
  for (int64_t row = 0; row < p.rows; ++row) {
    const std::string error = cta.Run([&](accel::testing::CtaEmulator::Exec& exec) {
      cuda::internal::WithStorage(dtype, 0, [&](auto tag) {
        cuda::internal::RmsNormRow<decltype(tag)>(p, row, cuda::kRmsNormThreads, shared.data(),
                                                  exec);
        return 0;
      });
    });
    if (!error.empty()) return "row " + std::to_string(row) + ": " + error;
  }
  return "";
}

}  // namespace accel::models::testing

#endif  // ACCEL_TESTS_MODELS_FUSED_OPS_EMULATION_H_
