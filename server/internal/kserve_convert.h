// server/internal/kserve_convert.h: KServe v2 / Open Inference Protocol
// messages <-> the engine's terms, with no server attached, so every wire rule
// is unit-tested on its own (tests/server/kserve_convert_test.cc).
//
//   ACCEL_ASSIGN_OR_RETURN(KServeRequest parsed, ParseInferRequest(request));
//   for (size_t i = 0; i < parsed.num_prompts(); ++i) engine->Submit(PromptParams(parsed, i), ...);
//   ...
//   BuildInferResponse(parsed, results, /*final=*/true, &response);
//
// Conventions (serving-anchors.md §1.4-1.5): prompts come as `text_input`
// BYTES (N elements = N prompts) or `input_ids` INT64/INT32 ([L]: one prompt;
// [B, L]: B prompts); sampling comes from request `parameters`, a
// `sampling_parameters` BYTES input holding JSON (Triton's vLLM backend), or
// scalar input tensors (TensorRT-LLM's ensemble), under one set of names.
// Contents may be typed or raw; the answer uses the form the request used.
// Thread-compatible: plain functions over values.
#ifndef ACCEL_SERVER_INTERNAL_KSERVE_CONVERT_H_
#define ACCEL_SERVER_INTERNAL_KSERVE_CONVERT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "engine/request.h"
#include "inference/grpc_service.pb.h"

namespace accel::server::internal {

// Tensor and parameter names of the protocol as we serve it.
inline constexpr char kTextInput[] = "text_input";
inline constexpr char kInputIds[] = "input_ids";
inline constexpr char kSamplingParameters[] = "sampling_parameters";
inline constexpr char kTextOutput[] = "text_output";
inline constexpr char kOutputIds[] = "output_ids";
inline constexpr char kOutputLogProbs[] = "output_log_probs";
inline constexpr char kFinishReason[] = "finish_reason";
inline constexpr char kNumInputTokens[] = "num_input_tokens";
inline constexpr char kNumOutputTokens[] = "num_output_tokens";
inline constexpr char kFinalResponse[] = "triton_final_response";

// output_ids rows shorter than the longest are padded with this (and
// output_log_probs with 0); num_output_tokens gives each row's real length.
inline constexpr int64_t kOutputIdsPad = -1;

// One ModelInfer request, checked and decoded.
struct KServeRequest {
  // From text_input (one per element), or empty when ids were sent.
  std::vector<std::string> prompts;
  // From input_ids: one row per prompt.
  std::vector<std::vector<int64_t>> input_ids;
  int ids_rank = 0;  // input_ids' rank (1 or 2); 0 for text
  // Sampling, stops and limits for every prompt; prompt and ids unset.
  engine::GenerationRequest params;
  bool stream = false;               // the `stream` input or parameter
  bool exclude_input = true;         // false: text_output starts with the prompt
  bool raw = false;                  // the request used raw_input_contents
  std::vector<std::string> outputs;  // the outputs to answer, in order

  size_t num_prompts() const { return ids_rank > 0 ? input_ids.size() : prompts.size(); }
};

// Decodes and checks everything that does not need the model (the engine
// checks the rest in Submit). InvalidArgument naming the tensor or parameter:
// unknown inputs, parameters or requested outputs; wrong datatypes; element
// counts that do not match the shape; raw contents mixed with typed ones;
// truncated raw BYTES; bad sampling_parameters JSON; neither or both of
// text_input and input_ids. Reserved Triton parameters (triton_*,
// sequence_*, priority, timeout, headers, binary_data_output) are ignored.
absl::StatusOr<KServeRequest> ParseInferRequest(const inference::ModelInferRequest& request);

// What prompt `i` is submitted as: `request.params` plus its prompt or ids.
engine::GenerationRequest PromptParams(const KServeRequest& request, size_t i);
// How errors name prompt `i`: "text_input", "text_input[2]", "input_ids[1]".
std::string PromptName(const KServeRequest& request, size_t i);

// What one prompt produced (in a stream chunk: what is new since the last).
struct GenerationResult {
  std::string text;
  std::vector<int64_t> token_ids;
  std::vector<float> logprobs;
  std::string finish_reason;  // "length", "eos", "stop"; empty while running
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
};

// Where prompt `i`'s result starts: empty, or the prompt itself when the
// client set exclude_input_in_output=false (Triton's vLLM backend option).
GenerationResult InitialResult(const KServeRequest& request, size_t i);

// Fills response->outputs (and raw_output_contents when request.raw) with
// the requested outputs of `results` (one per prompt). `final` false is a
// stream chunk: only text_output, output_ids and output_log_probs, when asked
// for. Leaves model_name, model_version, id and parameters to the caller.
void BuildInferResponse(const KServeRequest& request, const std::vector<GenerationResult>& results,
                        bool final, inference::ModelInferResponse* response);

// Tensor decoding, exposed for tests. `raw` is the tensor's
// raw_input_contents entry, or null for typed contents. Each checks the
// datatype and that the element count equals the shape's product.
absl::StatusOr<int64_t> ElementCount(const inference::ModelInferRequest::InferInputTensor& tensor);
absl::StatusOr<std::vector<std::string>> DecodeBytes(
    const inference::ModelInferRequest::InferInputTensor& tensor, const std::string* raw);
// Any INT or UINT datatype (UINT64 above INT64_MAX is InvalidArgument).
absl::StatusOr<std::vector<int64_t>> DecodeInts(
    const inference::ModelInferRequest::InferInputTensor& tensor, const std::string* raw);

// Raw BYTES encoding: per element a 4-byte little-endian length, then the bytes.
std::string EncodeRawBytes(const std::vector<std::string>& elements);

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_KSERVE_CONVERT_H_
