// accel-quantize --model DIR --out DIR --method nf4|fp4|int8 [--double_quant]
// [--blocksize N]: writes a bitsandbytes-quantized copy of a model in the
// layout transformers saves (and loads with from_pretrained), which
// accel-serve and accel-generate load as it is.
#include <chrono>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"

#include "core/bytes.h"
#include "core/status.h"
#include "core/tool_main.h"
#include "models/load_model.h"
#include "models/quantize.h"
#include "quant/bnb.h"

ABSL_FLAG(std::string, model, "", "The HuggingFace model folder to quantize.");
ABSL_FLAG(std::string, out, "", "Where the quantized model is written (created).");
ABSL_FLAG(std::string, method, "", "nf4 | fp4 (4-bit) | int8 (LLM.int8)");
ABSL_FLAG(bool, double_quant, false, "4-bit: quantize the absmaxes too (8 bits, groups of 256).");
ABSL_FLAG(int64_t, blocksize, 64, "4-bit: elements per absmax (32, 64, ..., 4096).");
ABSL_FLAG(double, int8_threshold, 6.0,
          "int8: the llm_int8_threshold written to config.json (outlier decomposition).");
ABSL_FLAG(std::string, dtype, "auto",
          "The dtype quantized from and kept for the other layers: auto (config.json's "
          "torch_dtype) | float32 | bfloat16 | float16.");
ABSL_FLAG(std::string, max_shard_size, "5GB", "Shard the weights past this size.");

namespace {

int Fail(const absl::Status& status) {
  std::cerr << "accel-quantize: " << status.message() << "\n";
  return 1;
}

int Run(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "accel-quantize --model DIR --out DIR --method nf4|fp4|int8 [--double_quant] "
      "[--blocksize N]\nWrites a bitsandbytes-quantized copy of a model (transformers' layout).");
  absl::ParseCommandLine(argc, argv);
  const std::string model = absl::GetFlag(FLAGS_model);
  const std::string out = absl::GetFlag(FLAGS_out);
  const std::string method = absl::GetFlag(FLAGS_method);
  if (model.empty()) return Fail(absl::InvalidArgumentError("--model is required"));
  if (out.empty()) return Fail(absl::InvalidArgumentError("--out is required"));
  if (method != "nf4" && method != "fp4" && method != "int8") {
    return Fail(absl::InvalidArgumentError(
        absl::StrFormat("--method '%s': expected nf4, fp4 or int8", method)));
  }
  auto shard = accel::ParseByteSize(absl::GetFlag(FLAGS_max_shard_size));
  if (!shard.ok()) return Fail(accel::Annotate(shard.status(), "--max_shard_size"));

  accel::models::ModelLoadOptions options;
  options.device_map = "cpu";
  options.dtype = absl::GetFlag(FLAGS_dtype);
  options.quantize = method;
  options.double_quant = absl::GetFlag(FLAGS_double_quant);
  options.quant_blocksize = absl::GetFlag(FLAGS_blocksize);
  options.int8_threshold = absl::GetFlag(FLAGS_int8_threshold);
  const auto start = std::chrono::steady_clock::now();
  auto loaded = accel::models::LoadModel(model, options);
  if (!loaded.ok()) return Fail(loaded.status());
  if (loaded->prequantized) {
    return Fail(absl::InvalidArgumentError(absl::StrFormat(
        "--model %s is quantized already (config.json's quantization_config)", model)));
  }
  absl::Status saved = accel::models::SaveQuantizedModel(*loaded, out, *shard);
  if (!saved.ok()) return Fail(saved);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << absl::StrFormat("accel-quantize: %d layers quantized (%s) into %s in %.1f s\n",
                               loaded->quantization.size(),
                               loaded->quantization.begin()->second.ToString(), out, seconds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return accel::ToolMain("accel-quantize", argc, argv, Run); }
