// The parameters the GEMV kernel tests run over: every level and weight
// format (a level this CPU lacks is skipped by the test), with readable names.
#ifndef ACCEL_TESTS_MODELS_GEMV_PARAMS_H_
#define ACCEL_TESTS_MODELS_GEMV_PARAMS_H_

#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include "models/internal/gemv.h"

namespace accel::models::internal {

using GemvParam = std::tuple<GemvIsa, GemvWeight>;

inline auto AllGemvLevelsAndWeights() {
  return ::testing::Combine(
      ::testing::Values(GemvIsa::kScalar, GemvIsa::kAvx2, GemvIsa::kAvx512),
      ::testing::Values(GemvWeight::kFloat32, GemvWeight::kBFloat16, GemvWeight::kFloat16));
}

inline std::string GemvParamName(const ::testing::TestParamInfo<GemvParam>& info) {
  const char* types[] = {"float32", "bfloat16", "float16"};
  return std::string(GemvIsaName(std::get<0>(info.param))) + "_" +
         types[static_cast<int>(std::get<1>(info.param))];
}

}  // namespace accel::models::internal

#endif  // ACCEL_TESTS_MODELS_GEMV_PARAMS_H_
