// libFuzzer target for the config.json and generation_config.json parsers
// (scripts/fuzz.sh runs it). The first byte picks the parser; the rest is
// the JSON text. Any input must give InvalidArgument or a config that
// survives ToJson() -> parse -> ToJson() unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "loader/config.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

template <typename Config, typename Parse>
void Fuzz(absl::string_view text, Parse parse) {
  absl::StatusOr<Config> config = parse(text, "fuzz");
  if (!config.ok()) {
    Check(config.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  std::string json = config->ToJson();
  absl::StatusOr<Config> again = parse(json, "fuzz-roundtrip");
  Check(again.ok());
  Check(again->ToJson() == json);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  absl::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    Fuzz<accel::loader::GenerationConfig>(text, accel::loader::ParseGenerationConfig);
  } else {
    Fuzz<accel::loader::ModelConfig>(text, [](absl::string_view json, absl::string_view label) {
      absl::StatusOr<accel::loader::ModelConfig> config =
          accel::loader::ParseModelConfig(json, label);
      // Validate() must not crash on anything the parser accepts.
      if (config.ok()) (void)config->Validate().ok();
      return config;
    });
  }
  return 0;
}
