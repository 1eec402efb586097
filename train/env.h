// train/env.h: the names Accelerate gives to the distributed and precision
// modes; who this process is in a distributed run (ProcessEnvironment) is
// dist/env.h's, named here too for the training library's callers.
#ifndef ACCEL_TRAIN_ENV_H_
#define ACCEL_TRAIN_ENV_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "dist/env.h"

namespace accel::train {

// Accelerate's DistributedType, the members a C++ program can be.
// kFsdp: fully sharded data parallel (train/fsdp.h), on cpus or GPUs.
enum class DistributedType { kNo, kMultiCpu, kMultiGpu, kFsdp };
// Accelerate's PrecisionType. "fp8" is refused by ParsePrecision.
enum class PrecisionType { kNo, kFp16, kBf16 };

absl::string_view DistributedTypeName(DistributedType type);  // "NO", "MULTI_CPU", "MULTI_GPU"
absl::StatusOr<DistributedType> ParseDistributedType(absl::string_view name);
absl::string_view PrecisionName(PrecisionType precision);  // "no", "fp16", "bf16"
// "no", "fp16", "bf16"; anything else (fp8 included) is InvalidArgument naming the value.
absl::StatusOr<PrecisionType> ParsePrecision(absl::string_view name);

// The process environment moved down to dist/ (serving uses it too).
using dist::DetectProcessEnvironment;
using dist::EnvLookup;
using dist::ProcessEnv;
using dist::ProcessEnvironment;

}  // namespace accel::train

#endif  // ACCEL_TRAIN_ENV_H_
