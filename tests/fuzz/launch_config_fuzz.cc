// libFuzzer target for accel-launch's config file reader (train/launch_config.cc:
// yaml-cpp, the YAML-to-JSON conversion and the field checks; scripts/fuzz.sh
// runs it). Any input must give InvalidArgument, never a crash or another
// code, or a config whose JSON form reads back to the same JSON.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "train/launch_config.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<accel::train::ClusterConfig> config =
      accel::train::ParseClusterConfig(text, "fuzz.yaml");
  if (!config.ok()) {
    Check(config.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  const std::string json = accel::train::ClusterConfigToJson(*config);
  absl::StatusOr<accel::train::ClusterConfig> again =
      accel::train::ParseClusterConfig(json, "fuzz-roundtrip.yaml");
  Check(again.ok());
  Check(accel::train::ClusterConfigToJson(*again) == json);
  return 0;
}
