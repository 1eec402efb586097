// libFuzzer target for the JSON that quantized checkpoints carry (scripts/fuzz.sh
// runs it): the 4-bit quant state blob ("<layer>.weight.quant_state.bitsandbytes__nf4",
// untrusted bytes inside a safetensors file) and config.json's quantization_config.
// The first byte picks the parser; the rest is the JSON text. Any input must give
// InvalidArgument, or a value whose ToJson() parses back to the same JSON.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "quant/bnb.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

template <typename Value, typename Parse, typename ToJson>
void Fuzz(absl::string_view text, Parse parse, ToJson to_json) {
  absl::StatusOr<Value> value = parse(text, "fuzz");
  if (!value.ok()) {
    Check(value.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  const std::string json = to_json(*value);
  absl::StatusOr<Value> again = parse(json, "fuzz-roundtrip");
  Check(again.ok());
  Check(to_json(*again) == json);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  absl::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    Fuzz<accel::quant::BnbQuantizationConfig>(text, accel::quant::BnbConfigFromJson,
                                              accel::quant::BnbConfigToJson);
  } else {
    Fuzz<accel::quant::QuantState4bit>(text, accel::quant::QuantState4bitFromJson,
                                       accel::quant::QuantState4bitToJson);
  }
  return 0;
}
