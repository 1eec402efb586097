#include "server/internal/kserve_convert.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace accel::server::internal {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using InputTensor = ModelInferRequest::InferInputTensor;

// --- An encoder and decoder of our own, written from the wire rules
// (serving-anchors.md §1.4), so the code under test is not checked
// against itself.

std::string Le(uint64_t v, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return out;
}

std::string RawStrings(const std::vector<std::string>& strings) {
  std::string out;
  for (const std::string& s : strings) out += Le(s.size(), 4) + s;
  return out;
}

uint64_t ReadLe(const std::string& bytes, size_t pos, int size) {
  uint64_t v = 0;
  for (int i = 0; i < size; ++i) {
    v |= static_cast<uint64_t>(static_cast<unsigned char>(bytes.at(pos + i))) << (8 * i);
  }
  return v;
}

std::vector<std::string> ParseRawStrings(const std::string& bytes) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < bytes.size()) {
    const uint64_t n = ReadLe(bytes, pos, 4);
    out.push_back(bytes.substr(pos + 4, n));
    pos += 4 + n;
  }
  EXPECT_EQ(pos, bytes.size());
  return out;
}

// One output of a response, decoded from whichever form it uses.
struct Decoded {
  std::string datatype;
  std::vector<int64_t> shape;
  std::vector<std::string> strings;
  std::vector<int64_t> ints;
  std::vector<float> floats;
};

Decoded DecodeOutput(const ModelInferResponse& response, const std::string& name) {
  Decoded d;
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& out = response.outputs(i);
    if (out.name() != name) continue;
    d.datatype = out.datatype();
    d.shape.assign(out.shape().begin(), out.shape().end());
    if (response.raw_output_contents_size() > 0) {
      EXPECT_EQ(response.raw_output_contents_size(), response.outputs_size());
      const std::string& raw = response.raw_output_contents(i);
      if (d.datatype == "BYTES") {
        d.strings = ParseRawStrings(raw);
      } else if (d.datatype == "INT64") {
        for (size_t p = 0; p < raw.size(); p += 8) {
          d.ints.push_back(static_cast<int64_t>(ReadLe(raw, p, 8)));
        }
      } else if (d.datatype == "UINT32") {
        for (size_t p = 0; p < raw.size(); p += 4) d.ints.push_back(ReadLe(raw, p, 4));
      } else if (d.datatype == "FP32") {
        for (size_t p = 0; p < raw.size(); p += 4) {
          const auto bits = static_cast<uint32_t>(ReadLe(raw, p, 4));
          float f;
          std::memcpy(&f, &bits, 4);
          d.floats.push_back(f);
        }
      }
    } else {
      const auto& c = out.contents();
      d.strings.assign(c.bytes_contents().begin(), c.bytes_contents().end());
      d.ints.assign(c.int64_contents().begin(), c.int64_contents().end());
      for (uint32_t v : c.uint_contents()) d.ints.push_back(v);
      d.floats.assign(c.fp32_contents().begin(), c.fp32_contents().end());
    }
    return d;
  }
  ADD_FAILURE() << "no output " << name;
  return d;
}

std::vector<std::string> OutputNames(const ModelInferResponse& response) {
  std::vector<std::string> names;
  for (const auto& out : response.outputs()) names.push_back(out.name());
  return names;
}

// --- Request builders.

InputTensor* AddInput(ModelInferRequest& request, const std::string& name,
                      const std::string& datatype, std::vector<int64_t> shape) {
  InputTensor* t = request.add_inputs();
  t->set_name(name);
  t->set_datatype(datatype);
  for (int64_t d : shape) t->add_shape(d);
  return t;
}

ModelInferRequest TextRequest(const std::vector<std::string>& prompts) {
  ModelInferRequest request;
  InputTensor* t = AddInput(request, "text_input", "BYTES", {static_cast<int64_t>(prompts.size())});
  for (const std::string& p : prompts) t->mutable_contents()->add_bytes_contents(p);
  return request;
}

ModelInferRequest RawTextRequest(const std::vector<std::string>& prompts) {
  ModelInferRequest request;
  AddInput(request, "text_input", "BYTES", {static_cast<int64_t>(prompts.size())});
  request.add_raw_input_contents(RawStrings(prompts));
  return request;
}

void SetParam(ModelInferRequest& request, const std::string& key, inference::InferParameter p) {
  (*request.mutable_parameters())[key] = std::move(p);
}
inference::InferParameter Int(int64_t v) {
  inference::InferParameter p;
  p.set_int64_param(v);
  return p;
}
inference::InferParameter Uint(uint64_t v) {
  inference::InferParameter p;
  p.set_uint64_param(v);
  return p;
}
inference::InferParameter Double(double v) {
  inference::InferParameter p;
  p.set_double_param(v);
  return p;
}
inference::InferParameter Bool(bool v) {
  inference::InferParameter p;
  p.set_bool_param(v);
  return p;
}
inference::InferParameter String(const std::string& v) {
  inference::InferParameter p;
  p.set_string_param(v);
  return p;
}

void AddSamplingJson(ModelInferRequest& request, const std::string& json) {
  AddInput(request, "sampling_parameters", "BYTES", {1})
      ->mutable_contents()
      ->add_bytes_contents(json);
}

// --- Decoding inputs.

TEST(KServeConvertTest, TypedTextInputIsOnePromptPerElement) {
  auto parsed = ParseInferRequest(TextRequest({"Hello", "Bonjour"}));
  ASSERT_THAT(parsed, IsOk());
  EXPECT_THAT(parsed->prompts, ElementsAre("Hello", "Bonjour"));
  EXPECT_EQ(parsed->num_prompts(), 2u);
  EXPECT_FALSE(parsed->raw);
  EXPECT_EQ(PromptParams(*parsed, 1).prompt, "Bonjour");
  EXPECT_EQ(PromptName(*parsed, 1), "text_input[1]");
}

TEST(KServeConvertTest, TextInputShapeOneByOneIsOnePrompt) {
  ModelInferRequest request;
  AddInput(request, "text_input", "BYTES", {1, 1})->mutable_contents()->add_bytes_contents("Hi");
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_THAT(parsed->prompts, ElementsAre("Hi"));
  EXPECT_EQ(PromptName(*parsed, 0), "text_input");
}

TEST(KServeConvertTest, RawTextInputDecodes) {
  auto parsed = ParseInferRequest(RawTextRequest({"one", "", "three \xe2\x82\xac"}));
  ASSERT_THAT(parsed, IsOk());
  EXPECT_THAT(parsed->prompts, ElementsAre("one", "", "three \xe2\x82\xac"));
  EXPECT_TRUE(parsed->raw);
}

TEST(KServeConvertTest, RawBytesWithCutShortLengthIsInvalid) {
  ModelInferRequest request;
  AddInput(request, "text_input", "BYTES", {2});
  request.add_raw_input_contents(RawStrings({"ab"}) + std::string("\x02\x00", 2));
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("text_input"), HasSubstr("cut short"))));
}

TEST(KServeConvertTest, RawBytesWithTruncatedElementIsInvalid) {
  ModelInferRequest request;
  AddInput(request, "text_input", "BYTES", {1});
  request.add_raw_input_contents(Le(10, 4) + "abc");
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("text_input"), HasSubstr("says 10 bytes but only 3"))));
}

TEST(KServeConvertTest, RawBytesElementCountMustMatchShape) {
  ModelInferRequest fewer;
  AddInput(fewer, "text_input", "BYTES", {3});
  fewer.add_raw_input_contents(RawStrings({"a", "b"}));
  EXPECT_THAT(ParseInferRequest(fewer),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds 2 elements")));
  ModelInferRequest more;
  AddInput(more, "text_input", "BYTES", {1});
  more.add_raw_input_contents(RawStrings({"a", "b"}));
  EXPECT_THAT(ParseInferRequest(more),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than the 1")));
}

TEST(KServeConvertTest, TypedElementCountMustMatchShape) {
  ModelInferRequest request;
  InputTensor* t = AddInput(request, "text_input", "BYTES", {3});
  t->mutable_contents()->add_bytes_contents("a");
  t->mutable_contents()->add_bytes_contents("b");
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("text_input"), HasSubstr("bytes_contents has 2 elements"),
                             HasSubstr("needs 3"))));
}

TEST(KServeConvertTest, NegativeDimensionIsInvalid) {
  ModelInferRequest request;
  AddInput(request, "text_input", "BYTES", {-1})->mutable_contents()->add_bytes_contents("a");
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative dimension")));
}

TEST(KServeConvertTest, TextInputWithNoElementsIsInvalid) {
  ModelInferRequest request;
  AddInput(request, "text_input", "BYTES", {0});
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no elements")));
}

TEST(KServeConvertTest, WrongDatatypeNamesTheInput) {
  ModelInferRequest request;
  AddInput(request, "text_input", "INT64", {1})->mutable_contents()->add_int64_contents(1);
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("text_input"), HasSubstr("BYTES"))));
}

TEST(KServeConvertTest, Int64IdsOfRankOneAreOnePrompt) {
  ModelInferRequest request;
  InputTensor* t = AddInput(request, "input_ids", "INT64", {3});
  for (int64_t id : {1, 5, 9}) t->mutable_contents()->add_int64_contents(id);
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(parsed->ids_rank, 1);
  ASSERT_EQ(parsed->num_prompts(), 1u);
  EXPECT_THAT(PromptParams(*parsed, 0).prompt_ids, ElementsAre(1, 5, 9));
  EXPECT_FALSE(PromptParams(*parsed, 0).prompt.has_value());
  // Ids in, ids out by default.
  EXPECT_THAT(parsed->outputs, ::testing::Contains("output_ids"));
}

TEST(KServeConvertTest, Int32IdsTypedAndRaw) {
  ModelInferRequest typed;
  InputTensor* t = AddInput(typed, "input_ids", "INT32", {1, 2});
  t->mutable_contents()->add_int_contents(7);
  t->mutable_contents()->add_int_contents(8);
  auto parsed = ParseInferRequest(typed);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(parsed->ids_rank, 2);
  EXPECT_THAT(parsed->input_ids, ElementsAre(ElementsAre(7, 8)));

  ModelInferRequest raw;
  AddInput(raw, "input_ids", "INT32", {2, 2});
  raw.add_raw_input_contents(Le(3, 4) + Le(4, 4) + Le(5, 4) + Le(0xffffffff, 4));
  parsed = ParseInferRequest(raw);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_THAT(parsed->input_ids, ElementsAre(ElementsAre(3, 4), ElementsAre(5, -1)));
  EXPECT_EQ(PromptName(*parsed, 1), "input_ids[1]");
}

TEST(KServeConvertTest, RawInt64IdsByteCountMustMatchShape) {
  ModelInferRequest request;
  AddInput(request, "input_ids", "INT64", {2});
  request.add_raw_input_contents(Le(1, 8) + Le(2, 4));
  EXPECT_THAT(
      ParseInferRequest(request),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("input_ids"), HasSubstr("12 bytes"), HasSubstr("needs 16"))));
}

TEST(KServeConvertTest, IdsOfRankThreeAreInvalid) {
  ModelInferRequest request;
  AddInput(request, "input_ids", "INT64", {1, 1, 1})->mutable_contents()->add_int64_contents(1);
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[batch, length]")));
}

TEST(KServeConvertTest, RawAndTypedMixedIsInvalid) {
  ModelInferRequest request = RawTextRequest({"a"});
  AddInput(request, "max_tokens", "INT32", {1})->mutable_contents()->add_int_contents(4);
  request.add_raw_input_contents(Le(4, 4));
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("max_tokens"), HasSubstr("raw_input_contents"))));
}

TEST(KServeConvertTest, RawEntriesMustMatchInputs) {
  ModelInferRequest request = RawTextRequest({"a"});
  AddInput(request, "max_tokens", "INT32", {1});
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("one entry per input")));
}

TEST(KServeConvertTest, NeitherOrBothPromptInputsAreInvalid) {
  ModelInferRequest neither;
  AddSamplingJson(neither, "{}");
  EXPECT_THAT(ParseInferRequest(neither),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("neither")));
  ModelInferRequest both = TextRequest({"a"});
  AddInput(both, "input_ids", "INT64", {1})->mutable_contents()->add_int64_contents(1);
  EXPECT_THAT(ParseInferRequest(both),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("both")));
}

TEST(KServeConvertTest, UnknownOrRepeatedInputIsInvalid) {
  ModelInferRequest unknown = TextRequest({"a"});
  AddInput(unknown, "prompt", "BYTES", {1})->mutable_contents()->add_bytes_contents("x");
  EXPECT_THAT(ParseInferRequest(unknown),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"prompt\""), HasSubstr("not known"))));
  ModelInferRequest twice = TextRequest({"a"});
  AddInput(twice, "text_input", "BYTES", {1})->mutable_contents()->add_bytes_contents("b");
  EXPECT_THAT(ParseInferRequest(twice),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than once")));
}

// --- Sampling knobs.

TEST(KServeConvertTest, ParametersOfEachType) {
  ModelInferRequest request = TextRequest({"a"});
  SetParam(request, "max_tokens", Int(12));
  SetParam(request, "temperature", Double(0.5));
  SetParam(request, "top_k", Uint(40));
  SetParam(request, "top_p", String("0.9"));  // Triton's vLLM examples send strings
  SetParam(request, "min_p", Int(0));
  SetParam(request, "repetition_penalty", Double(1.1));
  SetParam(request, "seed", Uint(18446744073709551615u));
  SetParam(request, "stop", String("\n\n"));
  SetParam(request, "stop_token_ids", String("[2, 3]"));
  SetParam(request, "ignore_eos", Bool(true));
  SetParam(request, "return_logprobs", String("true"));
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  const engine::GenerationRequest& p = parsed->params;
  EXPECT_EQ(p.max_new_tokens, 12);
  EXPECT_DOUBLE_EQ(p.sampling.temperature, 0.5);
  EXPECT_EQ(p.sampling.top_k, 40);
  EXPECT_DOUBLE_EQ(p.sampling.top_p, 0.9);
  EXPECT_DOUBLE_EQ(p.sampling.min_p, 0.0);
  EXPECT_DOUBLE_EQ(p.sampling.repetition_penalty, 1.1);
  EXPECT_EQ(p.sampling.seed, 18446744073709551615u);
  EXPECT_THAT(p.stop_strings, ElementsAre("\n\n"));
  EXPECT_THAT(p.stop_token_ids, ElementsAre(2, 3));
  EXPECT_TRUE(p.ignore_eos);
  EXPECT_TRUE(p.logprobs);
  // Logprobs asked for: their output is in the default set.
  EXPECT_THAT(parsed->outputs, ::testing::Contains("output_log_probs"));
}

TEST(KServeConvertTest, StopAsJsonListOrLiteral) {
  ModelInferRequest list = TextRequest({"a"});
  SetParam(list, "stop", String("[\"</s>\", \"###\"]"));
  auto parsed = ParseInferRequest(list);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_THAT(parsed->params.stop_strings, ElementsAre("</s>", "###"));
  // Llama-2's "[INST]" is not JSON: one literal stop string.
  ModelInferRequest literal = TextRequest({"a"});
  SetParam(literal, "stop", String("[INST]"));
  parsed = ParseInferRequest(literal);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_THAT(parsed->params.stop_strings, ElementsAre("[INST]"));
}

TEST(KServeConvertTest, WrongParameterTypeNamesTheKey) {
  ModelInferRequest request = TextRequest({"a"});
  SetParam(request, "temperature", Bool(true));
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"temperature\""), HasSubstr("number"))));
  ModelInferRequest fraction = TextRequest({"a"});
  SetParam(fraction, "max_tokens", Double(1.5));
  EXPECT_THAT(ParseInferRequest(fraction),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"max_tokens\""), HasSubstr("integer"))));
  ModelInferRequest word = TextRequest({"a"});
  SetParam(word, "ignore_eos", String("yes please"));
  EXPECT_THAT(ParseInferRequest(word),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"ignore_eos\"")));
  ModelInferRequest negative = TextRequest({"a"});
  SetParam(negative, "seed", Int(-3));
  EXPECT_THAT(ParseInferRequest(negative),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"seed\"")));
  ModelInferRequest empty = TextRequest({"a"});
  SetParam(empty, "top_k", inference::InferParameter());
  EXPECT_THAT(ParseInferRequest(empty),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no value")));
}

TEST(KServeConvertTest, UnknownParameterIsInvalid) {
  ModelInferRequest request = TextRequest({"a"});
  SetParam(request, "temprature", Double(0.5));
  EXPECT_THAT(ParseInferRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"temprature\""), HasSubstr("temperature"))));
}

TEST(KServeConvertTest, TritonReservedParametersAreIgnored) {
  ModelInferRequest request = TextRequest({"a"});
  SetParam(request, "sequence_id", Int(3));
  SetParam(request, "sequence_start", Bool(true));
  SetParam(request, "sequence_end", Bool(false));
  SetParam(request, "priority", Int(1));
  SetParam(request, "timeout", Int(100));
  SetParam(request, "headers", String("x"));
  SetParam(request, "binary_data_output", Bool(true));
  SetParam(request, "triton_enable_empty_final_response", Bool(true));
  EXPECT_THAT(ParseInferRequest(request), IsOk());
}

TEST(KServeConvertTest, SamplingParametersJson) {
  ModelInferRequest request = TextRequest({"a"});
  AddSamplingJson(request,
                  R"({"max_tokens": 20, "temperature": "0.7", "top_p": 0.95, "top_k": 5.0,)"
                  R"( "stop": ["a", "b"], "stop_token_ids": [7], "seed": 9, "min_p": null,)"
                  R"( "ignore_eos": false, "exclude_input_in_output": true})");
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  const engine::GenerationRequest& p = parsed->params;
  EXPECT_EQ(p.max_new_tokens, 20);
  EXPECT_DOUBLE_EQ(p.sampling.temperature, 0.7);
  EXPECT_DOUBLE_EQ(p.sampling.top_p, 0.95);
  EXPECT_EQ(p.sampling.top_k, 5);
  EXPECT_THAT(p.stop_strings, ElementsAre("a", "b"));
  EXPECT_THAT(p.stop_token_ids, ElementsAre(7));
  EXPECT_EQ(p.sampling.seed, 9u);
  EXPECT_DOUBLE_EQ(p.sampling.min_p, 0.0);
}

TEST(KServeConvertTest, BadSamplingParametersJsonNamesTheInput) {
  for (const std::string json :
       {"{\"temperature\": ", "[1, 2]", "\"x\"", "[[[[[[[[[[1]]]]]]]]]]"}) {
    ModelInferRequest request = TextRequest({"a"});
    AddSamplingJson(request, json);
    EXPECT_THAT(ParseInferRequest(request),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sampling_parameters")))
        << json;
  }
  ModelInferRequest unknown = TextRequest({"a"});
  AddSamplingJson(unknown, R"({"best_of": 2})");
  EXPECT_THAT(ParseInferRequest(unknown),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("sampling_parameters"), HasSubstr("\"best_of\""))));
  ModelInferRequest wrong = TextRequest({"a"});
  AddSamplingJson(wrong, R"({"temperature": {"a": 1}})");
  EXPECT_THAT(ParseInferRequest(wrong),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"temperature\"")));
}

TEST(KServeConvertTest, SameKnobTwiceIsInvalid) {
  ModelInferRequest aliases = TextRequest({"a"});
  SetParam(aliases, "max_tokens", Int(3));
  SetParam(aliases, "max_new_tokens", Int(4));
  EXPECT_THAT(ParseInferRequest(aliases),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already set")));
  ModelInferRequest sources = TextRequest({"a"});
  SetParam(sources, "temperature", Double(0.1));
  AddSamplingJson(sources, R"({"temperature": 0.2})");
  EXPECT_THAT(ParseInferRequest(sources),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("sampling_parameters"), HasSubstr("already set"))));
}

TEST(KServeConvertTest, ScalarInputTensors) {
  ModelInferRequest request = TextRequest({"a"});
  AddInput(request, "max_tokens", "INT32", {1, 1})->mutable_contents()->add_int_contents(8);
  AddInput(request, "temperature", "FP32", {1})->mutable_contents()->add_fp32_contents(0.25f);
  AddInput(request, "random_seed", "UINT64", {1})
      ->mutable_contents()
      ->add_uint64_contents(18446744073709551610u);
  InputTensor* stop = AddInput(request, "stop_words", "BYTES", {3});
  for (const char* s : {"x", "", "yz"}) stop->mutable_contents()->add_bytes_contents(s);
  AddInput(request, "bad_words", "BYTES", {1})->mutable_contents()->add_bytes_contents("");
  AddInput(request, "beam_width", "INT32", {1})->mutable_contents()->add_int_contents(1);
  AddInput(request, "stream", "BOOL", {1})->mutable_contents()->add_bool_contents(true);
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(parsed->params.max_new_tokens, 8);
  EXPECT_DOUBLE_EQ(parsed->params.sampling.temperature, 0.25);
  EXPECT_EQ(parsed->params.sampling.seed, 18446744073709551610u);
  EXPECT_THAT(parsed->params.stop_strings, ElementsAre("x", "yz"));  // "" means none
  EXPECT_TRUE(parsed->stream);
}

TEST(KServeConvertTest, RawScalarInputTensors) {
  ModelInferRequest request = RawTextRequest({"a"});
  AddInput(request, "top_k", "INT64", {1});
  request.add_raw_input_contents(Le(3, 8));
  AddInput(request, "top_p", "FP64", {1});
  double half = 0.5;
  uint64_t bits;
  std::memcpy(&bits, &half, 8);
  request.add_raw_input_contents(Le(bits, 8));
  AddInput(request, "ignore_eos", "BOOL", {1});
  request.add_raw_input_contents(std::string(1, '\1'));
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(parsed->params.sampling.top_k, 3);
  EXPECT_DOUBLE_EQ(parsed->params.sampling.top_p, 0.5);
  EXPECT_TRUE(parsed->params.ignore_eos);
}

TEST(KServeConvertTest, ScalarInputWithManyElementsOrUnsupportedValueIsInvalid) {
  ModelInferRequest many = TextRequest({"a"});
  InputTensor* t = AddInput(many, "temperature", "FP32", {2});
  t->mutable_contents()->add_fp32_contents(0.1f);
  t->mutable_contents()->add_fp32_contents(0.2f);
  EXPECT_THAT(ParseInferRequest(many),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("temperature"), HasSubstr("one element"))));
  ModelInferRequest beams = TextRequest({"a"});
  AddInput(beams, "beam_width", "INT32", {1})->mutable_contents()->add_int_contents(4);
  EXPECT_THAT(ParseInferRequest(beams),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("beam")));
}

TEST(KServeConvertTest, ExcludeInputFalseStartsTheTextWithThePrompt) {
  ModelInferRequest request = TextRequest({"Once upon"});
  SetParam(request, "exclude_input_in_output", Bool(false));
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(InitialResult(*parsed, 0).text, "Once upon");
  ModelInferRequest ids;
  AddInput(ids, "input_ids", "INT64", {1})->mutable_contents()->add_int64_contents(1);
  SetParam(ids, "exclude_input_in_output", Bool(false));
  EXPECT_THAT(ParseInferRequest(ids), StatusIs(absl::StatusCode::kInvalidArgument));
}

// --- Outputs.

TEST(KServeConvertTest, RequestedOutputsAreHonouredAndChecked) {
  ModelInferRequest request = TextRequest({"a"});
  request.add_outputs()->set_name("num_output_tokens");
  request.add_outputs()->set_name("text_output");
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_THAT(parsed->outputs, ElementsAre("text_output", "num_output_tokens"));

  ModelInferRequest unknown = TextRequest({"a"});
  unknown.add_outputs()->set_name("logits");
  EXPECT_THAT(ParseInferRequest(unknown),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"logits\"")));

  ModelInferRequest logprobs = TextRequest({"a"});
  logprobs.add_outputs()->set_name("output_log_probs");
  parsed = ParseInferRequest(logprobs);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_TRUE(parsed->params.logprobs);
}

TEST(KServeConvertTest, DefaultOutputsForText) {
  auto parsed = ParseInferRequest(TextRequest({"a"}));
  ASSERT_THAT(parsed, IsOk());
  EXPECT_THAT(parsed->outputs,
              ElementsAre("text_output", "finish_reason", "num_input_tokens", "num_output_tokens"));
}

std::vector<GenerationResult> TwoResults() {
  GenerationResult a;
  a.text = "hello";
  a.token_ids = {4, 5, 6};
  a.logprobs = {-0.5f, -1.0f, -0.25f};
  a.finish_reason = "length";
  a.prompt_tokens = 2;
  a.generated_tokens = 3;
  GenerationResult b;
  b.text = "";
  b.token_ids = {7};
  b.logprobs = {-2.0f};
  b.finish_reason = "eos";
  b.prompt_tokens = 4;
  b.generated_tokens = 1;
  return {a, b};
}

void CheckTwoResults(const ModelInferResponse& response) {
  EXPECT_THAT(OutputNames(response),
              ElementsAre("text_output", "output_ids", "output_log_probs", "finish_reason",
                          "num_input_tokens", "num_output_tokens"));
  Decoded text = DecodeOutput(response, "text_output");
  EXPECT_EQ(text.datatype, "BYTES");
  EXPECT_THAT(text.shape, ElementsAre(2));
  EXPECT_THAT(text.strings, ElementsAre("hello", ""));
  Decoded ids = DecodeOutput(response, "output_ids");
  EXPECT_EQ(ids.datatype, "INT64");
  EXPECT_THAT(ids.shape, ElementsAre(2, 3));
  EXPECT_THAT(ids.ints, ElementsAre(4, 5, 6, 7, kOutputIdsPad, kOutputIdsPad));
  Decoded logprobs = DecodeOutput(response, "output_log_probs");
  EXPECT_EQ(logprobs.datatype, "FP32");
  EXPECT_THAT(logprobs.floats, ElementsAre(-0.5f, -1.0f, -0.25f, -2.0f, 0.0f, 0.0f));
  Decoded finish = DecodeOutput(response, "finish_reason");
  EXPECT_THAT(finish.strings, ElementsAre("length", "eos"));
  Decoded in = DecodeOutput(response, "num_input_tokens");
  EXPECT_EQ(in.datatype, "UINT32");
  EXPECT_THAT(in.shape, ElementsAre(2));
  EXPECT_THAT(in.ints, ElementsAre(2, 4));
  Decoded out = DecodeOutput(response, "num_output_tokens");
  EXPECT_THAT(out.ints, ElementsAre(3, 1));
}

TEST(KServeConvertTest, TypedResponse) {
  ModelInferRequest request = TextRequest({"p", "q"});
  SetParam(request, "return_logprobs", Bool(true));
  request.add_outputs()->set_name("text_output");
  request.add_outputs()->set_name("output_ids");
  request.add_outputs()->set_name("output_log_probs");
  request.add_outputs()->set_name("finish_reason");
  request.add_outputs()->set_name("num_input_tokens");
  request.add_outputs()->set_name("num_output_tokens");
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  ModelInferResponse response;
  BuildInferResponse(*parsed, TwoResults(), /*final=*/true, &response);
  EXPECT_EQ(response.raw_output_contents_size(), 0);
  CheckTwoResults(response);
}

TEST(KServeConvertTest, RawResponse) {
  ModelInferRequest request = RawTextRequest({"p", "q"});
  SetParam(request, "return_logprobs", Bool(true));
  request.add_outputs()->set_name("output_ids");  // order of `outputs` is ours, not theirs
  for (const char* name : {"text_output", "output_log_probs", "finish_reason", "num_input_tokens",
                           "num_output_tokens"}) {
    request.add_outputs()->set_name(name);
  }
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  ModelInferResponse response;
  BuildInferResponse(*parsed, TwoResults(), /*final=*/true, &response);
  ASSERT_EQ(response.raw_output_contents_size(), 6);
  for (const auto& out : response.outputs()) EXPECT_FALSE(out.has_contents()) << out.name();
  CheckTwoResults(response);
}

TEST(KServeConvertTest, IdsResponseFollowsTheInputRank) {
  ModelInferRequest request;
  AddInput(request, "input_ids", "INT64", {2})->mutable_contents()->add_int64_contents(1);
  request.mutable_inputs(0)->mutable_contents()->add_int64_contents(2);
  auto parsed = ParseInferRequest(request);
  ASSERT_THAT(parsed, IsOk());
  GenerationResult r;
  r.token_ids = {9, 8};
  r.text = "ab";
  r.finish_reason = "length";
  ModelInferResponse response;
  BuildInferResponse(*parsed, {r}, /*final=*/true, &response);
  Decoded ids = DecodeOutput(response, "output_ids");
  EXPECT_THAT(ids.shape, ElementsAre(2));
  EXPECT_THAT(ids.ints, ElementsAre(9, 8));
  EXPECT_THAT(DecodeOutput(response, "text_output").shape, ElementsAre(1));
}

TEST(KServeConvertTest, StreamChunkHasOnlyTheNews) {
  auto parsed = ParseInferRequest(TextRequest({"p"}));
  ASSERT_THAT(parsed, IsOk());
  GenerationResult r;
  r.text = " world";
  r.token_ids = {3};
  ModelInferResponse response;
  BuildInferResponse(*parsed, {r}, /*final=*/false, &response);
  EXPECT_THAT(OutputNames(response), ElementsAre("text_output"));
  EXPECT_THAT(DecodeOutput(response, "text_output").strings, ElementsAre(" world"));
}

TEST(KServeConvertTest, EncodeRawBytesMatchesTheWireRule) {
  EXPECT_EQ(EncodeRawBytes({"ab", ""}), std::string("\x02\x00\x00\x00"
                                                    "ab"
                                                    "\x00\x00\x00\x00",
                                                    10));
}

}  // namespace
}  // namespace accel::server::internal
