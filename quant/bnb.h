// quant/bnb.h: bitsandbytes-compatible weight formats, byte for byte: 4-bit
// NF4 / FP4 blockwise quantization (two codes a byte, high nibble first; an
// absmax per block; optionally the absmaxes quantized again to 8 bits in
// groups of 256, "double quant"), LLM.int8 row-wise int8 weights (SCB), the
// quant state that transformers' checkpoints carry as a JSON blob, and the
// `quantization_config` of config.json. Pure tensor math and formats: no
// file I/O (dispatch and the tools read and write the files).
//
//   ACCEL_ASSIGN_OR_RETURN(Quantized4bit q, Quantize4bit(w, QuantType4bit::kNf4, 64, true));
//   ACCEL_ASSIGN_OR_RETURN(at::Tensor back, Dequantize4bit(q));   // w's dtype and shape
//
// Rules (see ../shared/reference/bitsandbytes.md): per block s = x * (1/absmax)
// in float32; NF4 codes by strict comparison with the float32 midpoints of the
// table (a tie goes to the lower code); FP4 by bnb's CUDA decision tree; an
// all-zero block has absmax 0 and codes that decode to 0; dequantization is
// one float32 multiply, then a round-to-nearest-even cast.
#ifndef ACCEL_QUANT_BNB_H_
#define ACCEL_QUANT_BNB_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::quant {

enum class QuantType4bit { kNf4, kFp4 };

// "nf4" / "fp4"; InvalidArgument otherwise, naming the text.
absl::StatusOr<QuantType4bit> ParseQuantType4bit(absl::string_view name);
const char* QuantType4bitName(QuantType4bit type);

// The 16 values of a 4-bit code, index = code (FP4 in bit-pattern order,
// not sorted), exact float32.
const std::array<float, 16>& CodeTable(QuantType4bit type);
// bnb's signed 8-bit dynamic map (create_dynamic_map(signed=True)): 256
// ascending float32 values from -0.99296874 to 1.0; index 127 is 0.
const std::array<float, 256>& DynamicMap();

// The 4-bit blocksizes bnb accepts: 32, 64, ..., 4096.
bool IsValidBlocksize4bit(int64_t blocksize);
inline constexpr int64_t kDefaultBlocksize4bit = 64;
inline constexpr int64_t kNestedBlocksize = 256;

// What the JSON blob `<linear>.weight.quant_state.bitsandbytes__<type>` holds.
struct QuantState4bit {
  QuantType4bit quant_type = QuantType4bit::kNf4;
  int64_t blocksize = kDefaultBlocksize4bit;
  at::ScalarType dtype = at::kFloat;  // of the weight before quantization
  std::vector<int64_t> shape;         // of the weight before quantization
  bool double_quant = false;          // nested_* present
  int64_t nested_blocksize = kNestedBlocksize;
  float nested_offset = 0.0f;
};

// bnb's key order: quant_type, blocksize, dtype, shape[, nested_blocksize,
// nested_dtype, nested_offset].
std::string QuantState4bitToJson(const QuantState4bit& state);
// InvalidArgument naming `label` and the field for a missing or bad field
// (unknown quant type, blocksize, dtype, a negative dimension, a nested
// blocksize other than 256 or a nested dtype other than float32).
absl::StatusOr<QuantState4bit> QuantState4bitFromJson(absl::string_view json,
                                                      absl::string_view label);

// A 4-bit weight in transformers' checkpoint layout (tensor names after
// "<linear>.weight"). All on the cpu.
struct Quantized4bit {
  at::Tensor packed;            // "weight": uint8 [(n+1)/2, 1]
  at::Tensor absmax;            // ".absmax": float32 [nblocks]; uint8 with double quant
  at::Tensor quant_map;         // ".quant_map": float32 [16], CodeTable(type)
  at::Tensor nested_absmax;     // ".nested_absmax": float32 [ceil(nblocks/256)] (double quant)
  at::Tensor nested_quant_map;  // ".nested_quant_map": float32 [256] (double quant)
  QuantState4bit state;
};

inline int64_t NumBlocks(int64_t numel, int64_t blocksize) {
  return (numel + blocksize - 1) / blocksize;
}

// The shapes and dtypes of a Quantized4bit's tensors for a weight of `numel`
// elements, without computing it (meta tensors are made from these).
struct Layout4bit {
  std::vector<int64_t> packed_shape;  // [(n+1)/2, 1], uint8
  int64_t absmax_len = 0;             // uint8 with double quant, else float32
  int64_t nested_absmax_len = 0;      // 0 without double quant
};
Layout4bit LayoutOf4bit(int64_t numel, int64_t blocksize, bool double_quant);

// Quantizes `weight` (float32, bfloat16 or float16, any shape, cpu),
// flattened row-major. InvalidArgument for another dtype, an empty tensor, a
// non-finite value or a blocksize IsValidBlocksize4bit() refuses.
absl::StatusOr<Quantized4bit> Quantize4bit(const at::Tensor& weight, QuantType4bit type,
                                           int64_t blocksize, bool double_quant);

// Whether q's tensors fit q.state (lengths, dtypes, the nested state's
// settings), without reading their data: what the kernels need to run on q.
// InvalidArgument naming the tensor or field that does not fit.
absl::Status CheckQuantized4bitLayout(const Quantized4bit& q);

// The float32 absmax of every block [nblocks]: `absmax` itself, or, with
// double quant, nested_quant_map[absmax] * nested_absmax[b / 256] +
// nested_offset (float32, in that order). InvalidArgument when the tensors
// do not fit the state (lengths, dtypes).
absl::StatusOr<at::Tensor> BlockAbsmax(const Quantized4bit& q);

// The weight back in state.dtype and state.shape. InvalidArgument when the
// tensors do not fit the state.
absl::StatusOr<at::Tensor> Dequantize4bit(const Quantized4bit& q);

// An LLM.int8 weight (transformers' layout: "<linear>.weight" int8 [out, in],
// "<linear>.SCB" float32 [out], "<linear>.weight_format" uint8 [] = 0).
struct QuantizedInt8 {
  at::Tensor weight;  // int8 [out, in]: round-half-even(W * (127 / SCB[r]))
  at::Tensor scb;     // float32 [out]: max |W[r, :]| of the float16 weight
};

// bnb's Int8Params: `weight` [out, in] (float32/bfloat16/float16, cpu) is
// first cast to float16, as bnb does. A row of zeros gets SCB 0 and codes 0.
// InvalidArgument for another rank or dtype, or a non-finite value.
absl::StatusOr<QuantizedInt8> QuantizeInt8(const at::Tensor& weight);
// CB * SCB / 127 in float32, cast to `dtype`.
absl::StatusOr<at::Tensor> DequantizeInt8(const QuantizedInt8& q, at::ScalarType dtype);

// Exact bytes of the stored tensors (the per-tensor constants included: the
// 16-value map, the 256-value nested map; not the JSON blob).
int64_t StoredBytes4bit(int64_t numel, int64_t blocksize, bool double_quant);
int64_t StoredBytesInt8(int64_t out_features, int64_t in_features);

// transformers' BitsAndBytesConfig, as config.json's "quantization_config"
// holds it, plus what a caller asks of load-time quantization.
struct BnbQuantizationConfig {
  bool load_in_8bit = false;
  bool load_in_4bit = false;
  double llm_int8_threshold = 6.0;
  QuantType4bit bnb_4bit_quant_type = QuantType4bit::kFp4;  // transformers' default
  bool bnb_4bit_use_double_quant = false;
  at::ScalarType bnb_4bit_compute_dtype = at::kFloat;
  int64_t blocksize = kDefaultBlocksize4bit;  // not in config.json (per tensor there)
  // Linear modules left unquantized: a name matches when it equals an entry
  // or has it as a dotted part ("lm_head" matches "lm_head", "model.lm_head").
  std::optional<std::vector<std::string>> llm_int8_skip_modules;  // unset: {"lm_head"}
  std::vector<std::string> keep_in_fp32_modules;
  // transformers leaves the modules a device map puts on the cpu or the disk
  // unquantized when this is true (and refuses such a map when false). accel
  // runs quantized modules on the cpu, so false changes nothing; true is
  // honoured where it changes nothing (a map without cpu or disk entries,
  // or one device for everything) and refused by name where it would
  // (models::LoadModel): a stored quantized module is never dequantized.
  bool llm_int8_enable_fp32_cpu_offload = false;
  // Always false: true (bnb's training mode, float16 weights quantized at
  // every forward) is refused by name when parsed.
  bool llm_int8_has_fp16_weight = false;

  bool enabled() const { return load_in_8bit || load_in_4bit; }
  // The skip list in effect.
  std::vector<std::string> SkipModules() const;
  // Whether the Linear module `name` is quantized under this config.
  bool Quantizes(absl::string_view name) const;
};

// Parses a "quantization_config" object (JSON text). InvalidArgument naming
// `label` and the key for a quant_method other than "bitsandbytes", both or
// neither of load_in_8bit / load_in_4bit, an unknown quant type or compute
// dtype, a quant storage other than uint8, llm_int8_has_fp16_weight true, or
// a wrong JSON type. Missing keys take transformers' defaults.
absl::StatusOr<BnbQuantizationConfig> BnbConfigFromJson(absl::string_view json,
                                                        absl::string_view label);
// transformers' BitsAndBytesConfig.to_dict() (the blocksize is not in it).
std::string BnbConfigToJson(const BnbQuantizationConfig& config);

}  // namespace accel::quant

#endif  // ACCEL_QUANT_BNB_H_
